"""flash_cuda as PyTorch SDPA's flash-attention implementation.

torch (2.10+) keeps a registry of flash-attention implementations (torch.nn.attention:
register_flash_attention_impl / activate_flash_attention_impl / restore_flash_attention_impl).
Importing flash_cuda registers "flash_cuda" there (nothing else happens, and this module is not
imported, until it is activated);
activating it overrides the CUDA kernels of the four aten ops that SDPA's flash backend and
torch.nn.attention.varlen.varlen_attn call:

  aten::_scaled_dot_product_flash_attention / _backward   (F.scaled_dot_product_attention)
  aten::_flash_attention_forward / _backward              (varlen_attn, nested tensors)

with wrappers over torch.ops.flash_cuda.fwd / .bwd. Autograd stays torch's own (the aten ops'
derivative formulas call the overridden backward), and torch's meta kernels describe the
outputs, which the wrappers match, strides included, so torch.compile traces them.

    import torch, flash_cuda
    from torch.nn.attention import activate_flash_attention_impl, sdpa_kernel, SDPBackend
    activate_flash_attention_impl("flash_cuda")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

What SDPA's flash backend accepts is still decided by torch (CUDA, float16 / bfloat16, head dim
<= 256, no attn_mask); dropout, return_debug_mask and alibi_slopes raise NotImplementedError
naming themselves, as does seqused_k outside torch.inference_mode() (torch's backward op has no
seqused_k). AOTInductor calls these aten ops through its C shim, which bypasses the override. A
build without CUDA kernels cannot be activated.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch.library import Library

NAME = "flash_cuda"
_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_flash_attention_forward", "_flash_attention_backward")


def _not_supported(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"flash_cuda's SDPA backend does not support {what}; leave it at its default, or "
        f"restore torch's flash attention with "
        f"torch.nn.attention.restore_flash_attention_impl().")


def _check_forward(dropout_p, return_debug_mask, alibi_slopes=None):
    if dropout_p != 0.0:
        raise _not_supported(f"dropout_p={dropout_p}")
    if return_debug_mask:
        raise _not_supported("return_debug_mask=True")
    if alibi_slopes is not None:
        raise _not_supported("alibi_slopes")


def _window(left: Optional[int], right: Optional[int]):
    return (-1 if left is None else left), (-1 if right is None else right)


def _scale(scale: Optional[float], query: torch.Tensor) -> float:
    return query.shape[-1] ** -0.5 if scale is None else scale


def _like(result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`result` with the strides of torch.empty_like(like), which torch's meta kernels promise.
    The ops already allocate that way when `like`'s last dim is contiguous (as SDPA's flash
    backend requires), so the copy is for direct calls only."""
    if like.stride(-1) == 1:
        return result
    return torch.empty_like(like).copy_(result)


def _rng_state():
    """Placeholders for the philox seed (2,) and offset () of a dropout that does not run; on
    the CPU so that no kernel is launched for them."""
    return (torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64))


def _debug_mask(query: torch.Tensor) -> torch.Tensor:
    return query.new_empty(0)


# ---- SDPA: (batch, heads, seqlen, head_dim) --------------------------------------------------

def _sdpa_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                  scale=None):
    _check_forward(dropout_p, return_debug_mask)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (b, s, h, d) views
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    out, lse = torch.ops.flash_cuda.fwd(q, k, v, None, None, None, None, seqlen_q, seqlen_k,
                                        _scale(scale, query), is_causal, -1, -1, False)
    seed, offset = _rng_state()
    return (_like(out.transpose(1, 2), query), lse, None, None, seqlen_q, seqlen_k, seed, offset,
            _debug_mask(query))


def _sdpa_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                   max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    if dropout_p != 0.0:
        raise _not_supported(f"dropout_p={dropout_p}")
    q, k, v, o, do = (t.transpose(1, 2) for t in (query, key, value, out, grad_out))
    dq, dk, dv = torch.ops.flash_cuda.bwd(do, q, k, v, o, logsumexp, None, None, None, None,
                                          query.shape[2], key.shape[2], _scale(scale, query),
                                          is_causal, -1, -1, False)
    return tuple(_like(g.transpose(1, 2), t) for g, t in ((dq, query), (dk, key), (dv, value)))


# ---- the flash ops: dense (batch, seqlen, heads, head_dim) or varlen (total, heads, head_dim) --

def _flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                   return_debug_mask, *, scale=None, window_size_left=None,
                   window_size_right=None, seqused_k=None, alibi_slopes=None):
    _check_forward(dropout_p, return_debug_mask, alibi_slopes)
    # torch's _flash_attention_backward has no seqused_k, so a backward after this forward would
    # ignore it. Whether one follows cannot be told here (a compiled training step runs its
    # forward with gradients off), so seqused_k is taken only where none can: inference mode.
    if seqused_k is not None and not torch.is_inference_mode_enabled():
        raise _not_supported("seqused_k outside torch.inference_mode() (torch's "
                             "_flash_attention_backward has no seqused_k, so a backward would "
                             "ignore it)")
    left, right = _window(window_size_left, window_size_right)
    if cum_seq_q is None:
        max_q, max_k = query.shape[1], key.shape[1]
    out, lse = torch.ops.flash_cuda.fwd(query, key, value, cum_seq_q, cum_seq_k, None, seqused_k,
                                        max_q, max_k, _scale(scale, query), is_causal, left,
                                        right, False)
    seed, offset = _rng_state()
    return _like(out, query), lse, seed, offset, _debug_mask(query)


def _flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                    max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
                    window_size_left=None, window_size_right=None):
    if dropout_p != 0.0:
        raise _not_supported(f"dropout_p={dropout_p}")
    left, right = _window(window_size_left, window_size_right)
    if cum_seq_q is None:
        max_q, max_k = query.shape[1], key.shape[1]
    dq, dk, dv = torch.ops.flash_cuda.bwd(grad_out, query, key, value, out, logsumexp, cum_seq_q,
                                          cum_seq_k, None, None, max_q, max_k,
                                          _scale(scale, query), is_causal, left, right, False)
    return _like(dq, query), _like(dk, key), _like(dv, value)


_KERNELS = dict(zip(_OPS, (_sdpa_forward, _sdpa_backward, _flash_forward, _flash_backward)))


@dataclass
class Handle:
    """What activation returns to torch's registry; remove() gives the ops back to torch."""

    library: Optional[Library]

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


def register(dispatch_keys=("CUDA",)) -> Handle:
    """Overrides the four aten flash ops for `dispatch_keys` with flash_cuda's kernels. torch's
    activate_flash_attention_impl("flash_cuda") calls this with the default; tests pass "CPU"
    (where these aten ops have no kernel) to run the wrappers on the reference. A build without
    CUDA kernels refuses the CUDA key: it would replace torch's working kernels with none."""
    from flash_cuda import _ops

    if "CUDA" in dispatch_keys and not _ops.HAS_CUDA_KERNELS:
        raise RuntimeError("flash_cuda was built without CUDA kernels, so it cannot serve "
                           "SDPA's flash backend on CUDA; reinstall it with a CUDA toolkit "
                           "(see the README's Install section).")
    library = Library("aten", "IMPL")  # noqa: TOR901
    for key in dispatch_keys:
        for op, kernel in _KERNELS.items():
            library.impl(op, kernel, key)
    return Handle(library)


def activate() -> None:
    """Shorthand for torch.nn.attention.activate_flash_attention_impl("flash_cuda")."""
    torch.nn.attention.activate_flash_attention_impl(NAME)


def restore() -> None:
    """Shorthand for torch.nn.attention.restore_flash_attention_impl(), if flash_cuda is the
    active implementation."""
    if torch.nn.attention.current_flash_attention_impl() == NAME:
        torch.nn.attention.restore_flash_attention_impl()
