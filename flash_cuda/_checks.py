"""Argument rules of flash_cuda, one small named predicate per rule, in two groups.

* The op rules (`check_fwd_op`, `check_bwd_op`): what torch.ops.flash_cuda.fwd / .bwd need of
  their tensors and numbers. The CPU and fake (meta) kernels in _ops.py call them; the CUDA
  kernels check the same rules in C++ (csrc/ops/attention_cuda.cpp) with the same messages, so a
  bad input gets one answer whichever way and on whichever device it arrives.
* The API conversions (`as_int`, `as_window`, `as_scale`, `as_flag`, ...): what the
  FlashAttention-3 functions accept for each Python argument (integer-likes, pairs, float-likes,
  bool-likes), converted once into what the ops take.

Each check raises with a message that names the argument, states the rule and says what would
be accepted: TypeError for a Python object of the wrong kind, ValueError for a tensor or value
that breaks a rule, NotImplementedError for a FlashAttention feature flash_cuda does not have.
Passing inputs cost a few comparisons; messages are built only on failure.
"""

import numbers
from typing import Dict, Optional

import torch
from torch._subclasses.fake_tensor import is_fake

MIN_HEAD_DIM = 8
MAX_HEAD_DIM = 256
# The kernels move rows in 16-byte chunks: 8 elements of a 2-byte dtype.
HEAD_DIM_MULTIPLE = 8
CUDA_DTYPES = (torch.float16, torch.bfloat16)
CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEVICE_TYPES = ("cpu", "cuda", "meta")
# The kernels multiply by softmax_scale * log2(e) in float32: outside this range it flushes to
# zero or overflows.  The C++ op layer checks the same bounds.
SCALE_MIN, SCALE_MAX = 1e-30, 1e30


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _values_readable(t: torch.Tensor) -> bool:
    """Whether a tensor's values can be read without a device sync or a graph break.

    Values are read only from real CPU tensors in eager mode: on CUDA that would block on the
    stream, and under tracing (torch.compile, FakeTensorMode) the values do not exist yet.
    """
    return t.device.type == "cpu" and not torch.compiler.is_compiling() and not is_fake(t)


# ---- op rules ---------------------------------------------------------------------------------

def check_is_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}.")


def _check_all_equal(tensors: Dict[str, torch.Tensor], rule: str, describe) -> None:
    """Raises when describe(t) differs between the tensors, naming each with its value."""
    first = describe(next(iter(tensors.values())))
    if any(describe(t) != first for t in tensors.values()):
        found = ", ".join(f"{name} {describe(t)}" for name, t in tensors.items())
        raise ValueError(f"{', '.join(tensors)} must {rule}; got {found}.")


def check_supported_dtype(name: str, t: torch.Tensor) -> None:
    allowed = CUDA_DTYPES if t.device.type == "cuda" else CPU_DTYPES
    if t.dtype not in allowed:
        raise ValueError(
            f"{name} has dtype {_dtype_name(t.dtype)}, which flash_cuda does not support on "
            f"{t.device.type}; use float16 or bfloat16 (float32 is also accepted on the CPU).")


def check_rank(name: str, t: torch.Tensor, varlen: bool) -> None:
    if t.dim() != (3 if varlen else 4):
        layout = ("3-D (total_tokens, heads, head_dim) for varlen attention (cu_seqlens given)"
                  if varlen else
                  "4-D (batch, seqlen, heads, head_dim) for dense attention (no cu_seqlens)")
        raise ValueError(f"{name} must be {layout}; got shape {_shape(t)}.")


def check_head_dim(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(f"q, k and v must share the head dim (last dimension); got "
                         f"{q.shape[-1]}, {k.shape[-1]} and {v.shape[-1]}.")
    if d % HEAD_DIM_MULTIPLE != 0 or not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"the head dim of q, k and v (their last dimension) must be a multiple "
                         f"of {HEAD_DIM_MULTIPLE} between {MIN_HEAD_DIM} and {MAX_HEAD_DIM}; "
                         f"got {d}. Pad it with zeros up to the next multiple of "
                         f"{HEAD_DIM_MULTIPLE} if needed.")


def check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: bool) -> None:
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {_shape(k)} and {_shape(v)}.")
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"the number of heads of q ({heads_q}) must be a multiple of the number "
                         f"of heads of k and v ({heads_kv}) (MHA, GQA or MQA).")
    if not varlen and q.shape[0] != k.shape[0]:
        raise ValueError(f"q, k and v must have the same batch size (dimension 0); got "
                         f"{q.shape[0]} for q and {k.shape[0]} for k and v.")


def check_qkv(q, k, v, varlen: bool) -> None:
    """The rules q, k and v share in both layouts."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_is_tensor(name, t)
    if not q.device == k.device == v.device:
        _check_all_equal({"q": q, "k": k, "v": v}, "be on the same device",
                         lambda t: f"on {t.device}")
    if q.device.type not in DEVICE_TYPES:
        raise ValueError(f"q is on {q.device}; flash_cuda runs on CUDA devices and on the "
                         f"CPU (the reference implementation).")
    if not q.dtype == k.dtype == v.dtype:
        _check_all_equal({"q": q, "k": k, "v": v}, "share one dtype",
                         lambda t: _dtype_name(t.dtype))
    check_supported_dtype("q", q)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_rank(name, t, varlen)
    check_head_dim(q, k, v)
    check_heads(q, k, v, varlen)


def check_index_tensor(name: str, t: torch.Tensor, length, q: torch.Tensor) -> None:
    """cu_seqlens / seqused: int32, 1-D of `length` entries, on q's device, contiguous."""
    check_is_tensor(name, t)
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must have dtype int32; got {_dtype_name(t.dtype)}. "
                         f"{name}.to(torch.int32) would do.")
    if t.dim() != 1 or t.shape[0] != length:
        raise ValueError(f"{name} must be 1-D with {length} entries; got shape {_shape(t)}.")
    if t.device != q.device:
        raise ValueError(f"{name} must be on q's device ({q.device}); got {t.device}.")
    if t.stride(0) != 1 and length > 1:
        raise ValueError(f"{name} must be contiguous (the kernels index it as a plain array); "
                         f"got stride {t.stride(0)}. {name}.contiguous() would do.")


def check_cu_seqlens_values(name: str, cu: torch.Tensor, total: int) -> None:
    """cu[0] == 0, nondecreasing, cu[-1] <= total; checked only where values are readable."""
    if not _values_readable(cu):
        return
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0; got {name}[0] = {values[0]}.")
    for b in range(len(values) - 1):
        if values[b + 1] < values[b]:
            raise ValueError(f"{name} must be nondecreasing (it holds cumulative sequence "
                             f"lengths); got {name}[{b}] = {values[b]} > {name}[{b + 1}] = "
                             f"{values[b + 1]}.")
    if values[-1] > total:
        raise ValueError(f"{name}[-1] = {values[-1]} exceeds the {total} rows of the packed "
                         f"tensor it indexes.")


def check_max_seqlen(name: str, value) -> None:
    """max_seqlen_* >= 0; a SymInt gets a runtime assertion instead of a guard, so that an
    unbacked one (from .item() under torch.compile) traces."""
    if isinstance(value, torch.SymInt):
        torch._check(value >= 0, lambda: f"{name} must be >= 0; got {value}.")
    elif value < 0:
        raise ValueError(f"{name} must be >= 0; got {value}.")


def check_max_seqlen_covers(name: str, value, cu: torch.Tensor, cu_name: str) -> None:
    """The CUDA kernels size their grid by max_seqlen, so a smaller one would skip rows."""
    if isinstance(value, torch.SymInt) or not _values_readable(cu):
        return
    values = cu.tolist()
    longest = max((b - a for a, b in zip(values, values[1:])), default=0)
    if value < longest:
        raise ValueError(f"{name} = {value} is smaller than the longest sequence in {cu_name} "
                         f"({longest}); pass the maximum of {cu_name}.diff().")


def check_window(window_left, window_right) -> None:
    if window_left < -1 or window_right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 means unbounded on that side); "
                         f"got ({window_left}, {window_right}).")


def check_scale_value(softmax_scale) -> None:
    if isinstance(softmax_scale, torch.SymFloat):
        return  # checked by the kernels at run time
    if not SCALE_MIN <= softmax_scale <= SCALE_MAX:  # also False for NaN
        raise ValueError(f"softmax_scale must be a finite number > 0, within [{SCALE_MIN:g}, "
                         f"{SCALE_MAX:g}] (the kernels take the running max of unscaled "
                         f"scores and scale in float32); got {softmax_scale:g}.")


INT32_MAX = 2**31 - 1


def _check_at_most(value, limit: int, message: str) -> None:
    """value <= limit; for a SymInt a runtime assertion rather than a guard on its value."""
    if isinstance(value, torch.SymInt):
        torch._check_value(value <= limit, lambda: message)
    elif value > limit:
        raise ValueError(message)


def check_cuda_grid_limits(q, k, batch, max_seqlen_q, max_seqlen_k, varlen) -> None:
    """What the CUDA kernels' grid and 32-bit row counts can hold (fake CUDA tensors; the CUDA
    kernel checks the same in C++)."""
    heads = q.shape[-2]
    _check_at_most(heads, 65535, f"the number of heads of q must be at most 65535 on CUDA; got "
                                 f"{heads}.")
    _check_at_most(batch, 65535 // 2, f"the batch size must be at most 32767 on CUDA; got "
                                      f"{batch}.")
    seqlens = ((max_seqlen_q, max_seqlen_k) if varlen else (q.shape[1], k.shape[1]))
    for name, value in zip(("max_seqlen_q", "max_seqlen_k"), seqlens):
        _check_at_most(value, INT32_MAX, f"{name} must be between 0 and 2^31 - 1 on CUDA; got "
                                         f"{value}.")
    for t in (q, k):
        _check_at_most(t.shape[0], INT32_MAX, f"the number of rows of q / k must be between 0 "
                                              f"and 2^31 - 1 on CUDA; got {t.shape[0]}.")


def check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k) -> bool:
    """Both (varlen) or neither (dense); returns whether varlen."""
    varlen = cu_seqlens_q is not None
    if (cu_seqlens_k is not None) != varlen:
        raise ValueError("cu_seqlens_q and cu_seqlens_k go together: pass both (varlen "
                         "attention) or neither (dense attention).")
    return varlen


def check_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                 max_seqlen_k, softmax_scale, window_left, window_right) -> None:
    """Every rule of torch.ops.flash_cuda.fwd (and of the problem half of .bwd)."""
    varlen = check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k)
    check_qkv(q, k, v, varlen)
    if varlen:
        check_is_tensor("cu_seqlens_q", cu_seqlens_q)
        if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1:
            raise ValueError(f"cu_seqlens_q must be 1-D with batch + 1 >= 1 entries; got shape "
                             f"{_shape(cu_seqlens_q)}.")
        batch = cu_seqlens_q.shape[0] - 1
        check_index_tensor("cu_seqlens_q", cu_seqlens_q, batch + 1, q)
        check_index_tensor("cu_seqlens_k", cu_seqlens_k, batch + 1, q)
    else:
        batch = q.shape[0]
    for name, used in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if used is not None:
            check_index_tensor(name, used, batch, q)
    check_max_seqlen("max_seqlen_q", max_seqlen_q)
    check_max_seqlen("max_seqlen_k", max_seqlen_k)
    check_window(window_left, window_right)
    check_scale_value(softmax_scale)
    if q.device.type == "cuda":
        check_cuda_grid_limits(q, k, batch, max_seqlen_q, max_seqlen_k, varlen)
    if varlen:
        check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0])
        check_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0])
        check_max_seqlen_covers("max_seqlen_q", max_seqlen_q, cu_seqlens_q, "cu_seqlens_q")
        check_max_seqlen_covers("max_seqlen_k", max_seqlen_k, cu_seqlens_k, "cu_seqlens_k")


def lse_shape(q: torch.Tensor, varlen: bool) -> tuple:
    """Dense: (batch, heads_q, seqlen_q); varlen: (heads_q, total_q)."""
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def check_bwd_op(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                 seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                 window_right) -> None:
    """Every rule of torch.ops.flash_cuda.bwd."""
    check_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                 max_seqlen_k, softmax_scale, window_left, window_right)
    for name, t in (("dout", dout), ("out", out)):
        check_is_tensor(name, t)
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must have q's shape {_shape(q)}, dtype "
                             f"{_dtype_name(q.dtype)} and device {q.device}; got {_shape(t)}, "
                             f"{_dtype_name(t.dtype)} on {t.device}.")
    check_is_tensor("softmax_lse", softmax_lse)
    expected = lse_shape(q, cu_seqlens_q is not None)
    if (_shape(softmax_lse) != expected or softmax_lse.dtype != torch.float32
            or softmax_lse.device != q.device):
        raise ValueError(f"softmax_lse must be the forward's: float32 of shape {expected} on "
                         f"{q.device}; got {_dtype_name(softmax_lse.dtype)} of shape "
                         f"{_shape(softmax_lse)} on {softmax_lse.device}.")


# ---- API conversions --------------------------------------------------------------------------

def _is_integer(value) -> bool:
    return isinstance(value, (numbers.Integral, torch.SymInt)) and not isinstance(value, bool)


def as_int(name: str, value):
    """An integer-like as an int (or the SymInt itself): Python and numpy integers, SymInts
    (also unbacked ones from .item() under torch.compile) and 0-d or 1-element integer tensors
    (read with .item(), a device sync on CUDA, as FlashAttention's own conversion does)."""
    if type(value) is int or isinstance(value, torch.SymInt):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and not value.is_complex() and value.dtype != torch.bool:
        return value.item()
    if _is_integer(value):
        return int(value)
    raise TypeError(f"{name} must be an int (a Python or numpy integer, a SymInt, or a "
                    f"one-element integer tensor); got {type(value).__name__}.")


def as_window(window_size):
    """(left, right) ints from any length-2 sequence or tensor of integer-likes."""
    if isinstance(window_size, torch.Tensor):
        if window_size.numel() != 2 or window_size.is_floating_point():
            raise TypeError(f"window_size must be a pair (left, right) of ints; got a tensor of "
                            f"shape {_shape(window_size)} and dtype "
                            f"{_dtype_name(window_size.dtype)}.")
        window_size = window_size.tolist()
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair (left, right) of ints; got "
                        f"{window_size!r}.") from None
    if not (_is_integer(left) and _is_integer(right)):
        raise TypeError(f"window_size entries must be ints; got {window_size!r}.")
    # int() on a SymInt specialises on its value: the schema's window arguments are plain ints.
    return int(left), int(right)


def as_scale(softmax_scale, head_dim):
    """None -> head_dim ** -0.5; float-likes (Python and numpy floats and ints, SymFloat) -> a
    float, or the SymFloat itself under torch.compile. Tensors are refused: reading one on CUDA
    would be a silent device sync."""
    if softmax_scale is None:
        return head_dim ** -0.5
    if type(softmax_scale) is float or isinstance(softmax_scale, torch.SymFloat):
        return softmax_scale
    if isinstance(softmax_scale, (numbers.Real, torch.SymInt)) and \
            not isinstance(softmax_scale, bool):
        return float(softmax_scale)
    raise TypeError(f"softmax_scale must be a float or None (None means 1 / sqrt(head_dim)); "
                    f"got {type(softmax_scale).__name__}.")


def as_flag(name: str, value) -> bool:
    """Python and numpy bools, and one-element bool tensors (read with .item(): a device sync
    for a CUDA tensor)."""
    if value is True or value is False:
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"):  # without numpy
        return bool(value)
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.numel() == 1:
        return bool(value.item())
    raise TypeError(f"{name} must be a bool; got {type(value).__name__}.")


def check_not_supported(name: str, value) -> None:
    """A FlashAttention argument flash_cuda cannot honour yet: only None is accepted."""
    if value is not None:
        shown = "<tensor>" if isinstance(value, torch.Tensor) else repr(value)
        raise NotImplementedError(f"{name}={shown} is not supported by flash_cuda; leave {name} "
                                  f"at its default (None).")


def check_at_default(name: str, value, default) -> None:
    """A numeric FlashAttention argument flash_cuda supports only at its default."""
    if value != default:
        raise NotImplementedError(f"{name}={value!r} is not supported by flash_cuda; leave "
                                  f"{name} at its default ({default!r}).")


def check_hints(num_splits, pack_gqa, sm_margin) -> None:
    """Performance hints: any valid value gives the same result, so only the types matter."""
    if not _is_integer(num_splits) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 lets the library choose); got "
                         f"{num_splits!r}.")
    if pack_gqa is not None and pack_gqa is not True and pack_gqa is not False:
        raise TypeError(f"pack_gqa must be a bool or None; got {type(pack_gqa).__name__}.")
    if not _is_integer(sm_margin) or sm_margin < 0:
        raise ValueError(f"sm_margin must be an int >= 0; got {sm_margin!r}.")


def wants_deterministic(deterministic: bool) -> bool:
    """deterministic=True, or torch.use_deterministic_algorithms(True) without warn_only (with
    warn_only, the backward warns instead: at::Context::alertNotDeterministic)."""
    return deterministic or (torch.are_deterministic_algorithms_enabled()
                             and not torch.is_deterministic_algorithms_warn_only_enabled())


def check_deterministic_backward(deterministic: bool, q, k, v, supported: bool) -> None:
    """Fails at the call, not later in backward, when the CUDA backward cannot be deterministic.

    Only calls that will need a backward are affected: inference is fine, and the CPU
    reference is always deterministic.
    """
    if supported or q.device.type != "cuda" or not wants_deterministic(deterministic):
        return
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError(
            "deterministic=True (or torch.use_deterministic_algorithms(True)) is not supported "
            "by this build's CUDA backward (its dq accumulation uses atomics); pass "
            "deterministic=False, run without gradients, or use "
            "torch.use_deterministic_algorithms(True, warn_only=True).")


def check_packed(name: str, packed, count: int, layout: str) -> None:
    """qkv / kv: a tensor with `count` slices on dimension 2."""
    check_is_tensor(name, packed)
    if packed.dim() != 5 or packed.shape[2] != count:
        raise ValueError(f"{name} must be 5-D {layout}; got shape {_shape(packed)}.")


def check_optional_tensor(name: str, value: Optional[torch.Tensor]) -> None:
    if value is not None and not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None; got {type(value).__name__}.")


# ---- the KV-cache op ----------------------------------------------------------------------------

def _check_like(name: str, t: torch.Tensor, q: torch.Tensor, rank: int, heads: int,
                heads_name: str) -> None:
    """A 16-bit / float32 tensor of q's dtype and device, of `rank`, heads and head dim."""
    check_is_tensor(name, t)
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D; got shape {_shape(t)}.")
    if t.dtype != q.dtype or t.device != q.device:
        raise ValueError(f"{name} must have q's dtype ({_dtype_name(q.dtype)}) and device "
                         f"({q.device}); got {_dtype_name(t.dtype)} on {t.device}.")
    if t.shape[-2] != heads or t.shape[-1] != q.shape[-1]:
        raise ValueError(f"{name} must have {heads} heads ({heads_name}) and q's head dim "
                         f"{q.shape[-1]} in its last two dimensions; got shape {_shape(t)}.")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension; got stride "
                         f"{t.stride(-1)}.")


def check_kvcache_op(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                     cache_batch_idx, cache_leftpad, page_table, cu_seqlens_q, cu_seqlens_k_new,
                     max_seqlen_q, rotary_seqlens, softmax_scale, window_left,
                     window_right, out) -> int:
    """The rules of torch.ops.flash_cuda.fwd_kvcache; returns the batch size.  The CUDA kernel
    checks the same rules, in this order, in C++ (csrc/ops/kvcache_checks.h: check_kvcache_op)
    with the same messages."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_is_tensor(name, t)
    if q.device.type not in DEVICE_TYPES:
        raise ValueError(f"q is on {q.device}; flash_cuda runs on CUDA devices and on the "
                         f"CPU (the reference implementation).")
    check_supported_dtype("q", q)
    varlen_q = cu_seqlens_q is not None
    check_rank("q", q, varlen_q)
    heads_kv = k_cache.shape[-2] if k_cache.dim() == 4 else 0
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_like(name, t, q, 4, heads_kv, "k_cache's")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape; got "
                         f"{_shape(k_cache)} and {_shape(v_cache)}.")
    check_head_dim(q, k_cache, v_cache)
    if heads_kv == 0 or q.shape[-2] % heads_kv != 0:
        raise ValueError(f"the number of heads of q ({q.shape[-2]}) must be a multiple of the "
                         f"number of heads of the cache ({heads_kv}) (MHA, GQA or MQA).")
    if varlen_q:
        check_is_tensor("cu_seqlens_q", cu_seqlens_q)
        if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1:
            raise ValueError(f"cu_seqlens_q must be 1-D with batch + 1 >= 1 entries; got shape "
                             f"{_shape(cu_seqlens_q)}.")
    batch = cu_seqlens_q.shape[0] - 1 if varlen_q else q.shape[0]
    if varlen_q:
        check_index_tensor("cu_seqlens_q", cu_seqlens_q, batch + 1, q)
        if max_seqlen_q is None:
            raise ValueError("max_seqlen_q is required with cu_seqlens_q (it sizes the grid).")
        check_max_seqlen("max_seqlen_q", max_seqlen_q)
    if (k is None) != (v is None):
        raise ValueError("k and v go together: pass both (they are appended to the cache) or "
                         "neither.")
    if cu_seqlens_k_new is not None and k is None:
        raise ValueError("cu_seqlens_k_new describes packed new keys: pass k and v with it.")
    if k is not None:
        varlen_k = cu_seqlens_k_new is not None
        for name, t in (("k", k), ("v", v)):
            _check_like(name, t, q, 3 if varlen_k else 4, heads_kv, "the cache's")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape; got {_shape(k)} and "
                             f"{_shape(v)}.")
        if varlen_k:
            check_index_tensor("cu_seqlens_k_new", cu_seqlens_k_new, batch + 1, q)
        elif k.shape[0] != batch:
            raise ValueError(f"k and v must have q's batch size {batch} in dimension 0; got "
                             f"{k.shape[0]}.")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens (where the new keys go) is required with k and v.")
    for name, t in (("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
                    ("cache_leftpad", cache_leftpad), ("rotary_seqlens", rotary_seqlens)):
        if t is not None:
            check_index_tensor(name, t, batch, q)
    if page_table is not None:
        check_is_tensor("page_table", page_table)
        if page_table.dtype != torch.int32 or page_table.dim() != 2 or \
                page_table.shape[0] != batch or page_table.device != q.device:
            raise ValueError(f"page_table must be int32 of shape (batch={batch}, pages per "
                             f"sequence) on q's device; got {_dtype_name(page_table.dtype)} of "
                             f"shape {_shape(page_table)} on {page_table.device}.")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx selects rows of a dense cache; with a page_table "
                             "the table maps sequences to pages: pass one or the other.")
    if k_cache.shape[0] == 0 and batch > 0:
        raise ValueError(f"k_cache has no {'pages' if page_table is not None else 'rows'} in "
                         f"dimension 0; the batch has {batch} sequences.")
    if page_table is None and cache_batch_idx is None and k_cache.shape[0] < batch:
        raise ValueError(f"k_cache holds {k_cache.shape[0]} cache rows in dimension 0 for a "
                         f"batch of {batch} sequences: pass cache_batch_idx to pick rows, or a "
                         f"cache with at least {batch} rows.")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin go together: pass both or neither.")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos / rotary_sin rotate the new keys (and q): pass k and v "
                             "too.")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            check_is_tensor(name, t)
            if t.dim() != 2 or t.shape != rotary_cos.shape or t.device != q.device:
                raise ValueError(f"{name} must be 2-D (positions, rotary_dim / 2), of "
                                 f"rotary_cos's shape, on q's device; got shape {_shape(t)} on "
                                 f"{t.device}.")
        if rotary_cos.shape[0] == 0:
            raise ValueError("rotary_cos / rotary_sin must hold at least one position (row).")
        rotary_dim = 2 * rotary_cos.shape[1]
        if rotary_dim % 16 != 0 or not 0 < rotary_dim <= q.shape[-1]:
            raise ValueError(f"the rotary dim (2 * rotary_cos.shape[1] = {rotary_dim}) must be "
                             f"a multiple of 16 between 16 and the head dim {q.shape[-1]}.")
    check_is_tensor("out", out)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must have q's shape {_shape(q)}, dtype "
                         f"({_dtype_name(q.dtype)}) and device ({q.device}); got shape "
                         f"{_shape(out)}, {_dtype_name(out.dtype)} on {out.device}.")
    if out.numel() > 0 and out.stride(-1) != 1:
        raise ValueError(f"out must have a contiguous last dimension; got stride "
                         f"{out.stride(-1)}.")
    check_window(window_left, window_right)
    check_scale_value(softmax_scale)
    return batch


# ---- the combine op -------------------------------------------------------------------------------

MAX_SPLITS = 256
KVCACHE_MAX_SPLITS = 256  # the split count the KV-cache kernels take (common/combine.cuh)
COMBINE_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_combine_op(out_partial, lse_partial, out) -> None:
    """The rules of torch.ops.flash_cuda.combine: out_partial (splits, batch, seqlen, heads, d)
    or packed (splits, total_q, heads, d), float32; lse_partial its shape without d, float32;
    out out_partial's shape without the splits, float32, float16 or bfloat16."""
    for name, t in (("out_partial", out_partial), ("lse_partial", lse_partial), ("out", out)):
        check_is_tensor(name, t)
    if out_partial.device.type not in DEVICE_TYPES:
        raise ValueError(f"out_partial is on {out_partial.device}; flash_cuda runs on CUDA "
                         f"devices and on the CPU.")
    if lse_partial.device != out_partial.device or out.device != out_partial.device:
        raise ValueError(f"out_partial, lse_partial and out must be on one device; got "
                         f"{out_partial.device}, {lse_partial.device} and {out.device}.")
    for name, t in (("out_partial", out_partial), ("lse_partial", lse_partial)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 (the split kernels' partial results); "
                             f"got {_dtype_name(t.dtype)}.")
    if out_partial.dim() not in (4, 5):
        raise ValueError(f"out_partial must be 5-D (splits, batch, seqlen, heads, head_dim) or "
                         f"4-D (splits, total_q, heads, head_dim); got shape "
                         f"{_shape(out_partial)}.")
    if not 1 <= out_partial.shape[0] <= MAX_SPLITS:
        raise ValueError(f"out_partial must hold between 1 and {MAX_SPLITS} splits in "
                         f"dimension 0; got {out_partial.shape[0]}.")
    if lse_partial.shape != out_partial.shape[:-1]:
        raise ValueError(f"lse_partial must have out_partial's shape without its last "
                         f"dimension, {_shape(out_partial)[:-1]}; got {_shape(lse_partial)}.")
    if out.shape != out_partial.shape[1:]:
        raise ValueError(f"out must have out_partial's shape without the splits, "
                         f"{_shape(out_partial)[1:]}; got {_shape(out)}.")
    if out.dtype not in COMBINE_OUT_DTYPES:
        raise ValueError(f"out must be float32, float16 or bfloat16; got "
                         f"{_dtype_name(out.dtype)}.")
    for name, t in (("out_partial", out_partial), ("out", out)):
        if t.numel() > 0 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension; got stride "
                             f"{t.stride(-1)}.")
