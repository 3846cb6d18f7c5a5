"""Registers the non-CUDA implementations of torch.ops.flash_cuda.fwd / .bwd.

The schemas and CUDA kernels come from the compiled extension flash_cuda._C; this module adds
the CPU implementation (the plain-PyTorch reference: correct, not fast) and the fake
implementation that lets FakeTensorMode and torch.compile trace the ops without data.
"""

import torch

try:
    from flash_cuda import _C
except ImportError as exc:  # the extension is the only source of the op schemas
    raise ImportError(
        "flash_cuda._C, the compiled extension that defines torch.ops.flash_cuda, could not be "
        "imported. Build it in the source tree with `python setup.py build_ext --inplace` (or "
        "`pip install -e .`); see setup.py for the FLASH_CUDA_* build knobs. "
        f"Original error: {exc}"
    ) from exc

from flash_cuda import reference

__all__ = ["fwd", "bwd", "build_info"]

fwd = torch.ops.flash_cuda.fwd.default
bwd = torch.ops.flash_cuda.bwd.default
# Read once here: the API consults it on every call, also while torch.compile traces, where a
# call into the extension would break the graph.
CUDA_DETERMINISTIC_BACKWARD = bool(_C.build_info()["features"]["deterministic_backward"])


def _lse_shape(q, cu_seqlens_q):
    """Dense: (batch, heads_q, seqlen_q); varlen: (heads_q, total_q)."""
    if cu_seqlens_q is None:
        return (q.shape[0], q.shape[2], q.shape[1])
    return (q.shape[1], q.shape[0])


@torch.library.register_kernel("flash_cuda::fwd", "cpu")
def _fwd_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
             max_seqlen_k, softmax_scale, causal, window_left, window_right):
    # The reference walks each sequence's real length, so max_seqlen (a CUDA grid size) is
    # not needed here.
    return reference.attention_forward_reference(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, softmax_scale=softmax_scale,
        causal=causal, window_left=window_left, window_right=window_right, upcast=True)


@torch.library.register_kernel("flash_cuda::bwd", "cpu")
def _bwd_cpu(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
             max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
             deterministic):
    # The reference sums in a fixed order, so every call is deterministic whatever the flag.
    return reference.attention_backward_reference(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        softmax_scale=softmax_scale, causal=causal, window_left=window_left,
        window_right=window_right, upcast=True)


@torch.library.register_fake("flash_cuda::fwd")
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
              max_seqlen_k, softmax_scale, causal, window_left, window_right):
    out = q.new_empty(q.shape)
    lse = q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("flash_cuda::bwd")
def _bwd_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
              max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
              deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def build_info():
    """What this build holds, as a plain dict.

    Keys: archs (compute capabilities compiled for), head_dims ({"fwd": [...], "bwd": [...]},
    the compiled kernel sizes; a head dim without its own kernel runs on the next compiled
    size up), dtypes
    (sorted manifest names, e.g. ["bf16", "fp16"]), kernels (one name per compiled kernel),
    features (flags such as varlen, causal, local, gqa, deterministic_backward) and devices
    (where the ops run: "cpu" always, through the plain-PyTorch reference, and "cuda" when the
    build holds kernels).
    """
    info = dict(_C.build_info())
    info["archs"] = list(info["archs"])
    info["head_dims"] = {direction: list(dims) for direction, dims in info["head_dims"].items()}
    info["dtypes"] = sorted(info["dtypes"])
    info["kernels"] = list(info["kernels"])
    info["features"] = dict(info["features"])
    info["devices"] = ["cpu", "cuda"] if info["kernels"] else ["cpu"]
    return info
