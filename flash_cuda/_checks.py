"""Argument validation for the user API, one small named predicate per rule.

Each check raises with a message that names the argument, states the rule and says what would
be accepted: TypeError for a Python object of the wrong kind, ValueError for a tensor or value
that breaks a rule, NotImplementedError for a FlashAttention feature flash_cuda does not have.
"""

import math
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
DENSE_LAYOUT = "(batch, seqlen, heads, head_dim)"
VARLEN_LAYOUT = "(total_tokens, heads, head_dim)"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _values_readable(t: torch.Tensor) -> bool:
    """Whether a tensor's values can be read without a device sync or a graph break.

    Values are read only from real CPU tensors in eager mode: on CUDA that would block on the
    stream, and under tracing (torch.compile, FakeTensorMode) the values do not exist yet.
    """
    return t.device.type == "cpu" and not torch.compiler.is_compiling() and not is_fake(t)


def check_is_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}.")


def _check_all_equal(tensors: Dict[str, torch.Tensor], rule: str, describe) -> None:
    """Raises when describe(t) differs between the tensors, naming each with its value."""
    if len({describe(t) for t in tensors.values()}) > 1:
        found = ", ".join(f"{name} {describe(t)}" for name, t in tensors.items())
        raise ValueError(f"{', '.join(tensors)} must {rule}; got {found}.")


def check_same_device(tensors: Dict[str, torch.Tensor]) -> None:
    _check_all_equal(tensors, "be on the same device", lambda t: f"on {t.device}")


def check_supported_device(name: str, t: torch.Tensor) -> None:
    if t.device.type not in DEVICE_TYPES:
        raise ValueError(f"{name} is on {t.device}; flash_cuda runs on CUDA devices and on the "
                         f"CPU (the reference implementation).")


def check_same_dtype(tensors: Dict[str, torch.Tensor]) -> None:
    _check_all_equal(tensors, "share one dtype", lambda t: _dtype_name(t.dtype))


def check_supported_dtype(name: str, t: torch.Tensor) -> None:
    allowed = CUDA_DTYPES if t.device.type == "cuda" else CPU_DTYPES
    if t.dtype not in allowed:
        raise ValueError(
            f"{name} has dtype {_dtype_name(t.dtype)}, which flash_cuda does not support on "
            f"{t.device.type}; use float16 or bfloat16 (float32 is also accepted on the CPU).")


def check_rank(name: str, t: torch.Tensor, varlen: bool) -> None:
    rank, layout = (3, VARLEN_LAYOUT) if varlen else (4, DENSE_LAYOUT)
    if t.dim() != rank:
        kind = "flash_attn_varlen_func" if varlen else "flash_attn_func"
        raise ValueError(f"{name} must be {rank}-D {layout} for {kind}; got shape "
                         f"{tuple(t.shape)}.")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last (head_dim) dimension, i.e. stride(-1) == 1; "
            f"got strides {tuple(t.stride())}. Other dimensions may have any stride; "
            f"{name}.contiguous() would satisfy this.")


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


def check_kv_same_shape(k: torch.Tensor, v: torch.Tensor) -> None:
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}.")


def check_heads_grouped(q: torch.Tensor, k: torch.Tensor) -> None:
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"the number of heads of q ({heads_q}) must be a multiple of the number "
                         f"of heads of k and v ({heads_kv}) (MHA, GQA or MQA).")


def check_same_batch(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q, k and v must have the same batch size (dimension 0); got "
                         f"{q.shape[0]} for q and {k.shape[0]} for k and v.")


def check_index_tensor(name: str, t: torch.Tensor, length, q: torch.Tensor) -> None:
    """cu_seqlens / seqused: int32, 1-D of `length` entries, on q's device."""
    check_is_tensor(name, t)
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must have dtype int32; got {_dtype_name(t.dtype)}. "
                         f"{name}.to(torch.int32) would do.")
    if t.dim() != 1 or t.shape[0] != length:
        raise ValueError(f"{name} must be 1-D with {length} entries; got shape {tuple(t.shape)}.")
    if t.device != q.device:
        raise ValueError(f"{name} must be on q's device ({q.device}); got {t.device}.")
    if not t.is_contiguous():
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
    # A SymInt (traced value) passes through untouched: int() on it would specialise the graph.
    if isinstance(value, torch.SymInt):
        return
    if not _is_int(value):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}.")
    if value < 0:
        raise ValueError(f"{name} must be >= 0; got {value}.")


def check_max_seqlen_covers(name: str, value, cu: torch.Tensor, cu_name: str) -> None:
    """The CUDA kernels size their grid by max_seqlen, so a smaller one would skip rows."""
    if not _is_int(value) or not _values_readable(cu):
        return
    values = cu.tolist()
    longest = max((b - a for a, b in zip(values, values[1:])), default=0)
    if value < longest:
        raise ValueError(f"{name} = {value} is smaller than the longest sequence in {cu_name} "
                         f"({longest}); pass the maximum of {cu_name}.diff().")


def check_window_size(window_size) -> None:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints; got {window_size!r}.")
    if not all(_is_int(w) for w in window_size):
        raise TypeError(f"window_size entries must be ints; got {window_size!r}.")
    if any(w < -1 for w in window_size):
        raise ValueError(f"window_size entries must be >= -1 (-1 means unbounded on that side); "
                         f"got {tuple(window_size)}.")


# The kernels multiply by softmax_scale * log2(e) in float32: outside this range it flushes to
# zero or overflows.  The C++ op layer checks the same bounds.
SCALE_MIN, SCALE_MAX = 1e-30, 1e30


def check_softmax_scale(softmax_scale) -> None:
    if softmax_scale is None or isinstance(softmax_scale, torch.SymFloat):
        return
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None (None means "
                        f"1 / sqrt(head_dim)); got {type(softmax_scale).__name__}.")
    if not math.isfinite(softmax_scale) or not SCALE_MIN <= softmax_scale <= SCALE_MAX:
        raise ValueError(f"softmax_scale must be a finite number > 0, within [{SCALE_MIN:g}, "
                         f"{SCALE_MAX:g}] (the kernels take the running max of unscaled "
                         f"scores and scale in float32); got {softmax_scale}.")


def check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {type(value).__name__}.")


def check_unsupported(**features) -> None:
    """Each keyword maps to (value, default); any non-default value is a missing feature."""
    for name, (value, default) in features.items():
        if default is None:
            unsupported = value is not None
        else:
            unsupported = value != default
        if unsupported:
            shown = "<tensor>" if isinstance(value, torch.Tensor) else repr(value)
            raise NotImplementedError(
                f"{name}={shown} is not supported by flash_cuda; leave {name} at its default "
                f"({default!r}).")


def check_hints(num_splits, pack_gqa, sm_margin) -> None:
    """Performance hints: any valid value gives the same result, so only the types matter."""
    if not _is_int(num_splits) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 lets the library choose); got "
                         f"{num_splits!r}.")
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise TypeError(f"pack_gqa must be a bool or None; got {type(pack_gqa).__name__}.")
    if not _is_int(sm_margin) or sm_margin < 0:
        raise ValueError(f"sm_margin must be an int >= 0; got {sm_margin!r}.")


def check_deterministic_backward(deterministic: bool, q, k, v, supported: bool) -> None:
    """Fails at the call, not later in backward, when the CUDA backward cannot be deterministic.

    Only calls that will need a backward are affected: inference with deterministic=True is
    fine, and the CPU reference is always deterministic.
    """
    if not deterministic or supported or q.device.type != "cuda":
        return
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError(
            "deterministic=True is not supported by this build's CUDA backward (its dq "
            "accumulation uses atomics); pass deterministic=False, or run without gradients.")


def check_packed(name: str, packed, count: int, layout: str) -> None:
    """qkv / kv: a tensor with `count` slices on dimension 2."""
    check_is_tensor(name, packed)
    if packed.dim() != 5 or packed.shape[2] != count:
        raise ValueError(f"{name} must be 5-D {layout}; got shape {tuple(packed.shape)}.")


def check_qkv(q, k, v, varlen: bool) -> None:
    """The rules q, k and v share in both layouts."""
    tensors = {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        check_is_tensor(name, t)
    check_same_device(tensors)
    check_supported_device("q", q)
    check_same_dtype(tensors)
    check_supported_dtype("q", q)
    for name, t in tensors.items():
        check_rank(name, t, varlen)
        check_last_dim_contiguous(name, t)
    check_head_dim(q, k, v)
    check_kv_same_shape(k, v)
    check_heads_grouped(q, k)


def check_dense(q, k, v) -> None:
    check_qkv(q, k, v, varlen=False)
    check_same_batch(q, k)


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor]) -> None:
    check_qkv(q, k, v, varlen=True)
    check_is_tensor("cu_seqlens_q", cu_seqlens_q)
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"cu_seqlens_q must be 1-D with batch + 1 >= 1 entries; got shape "
                         f"{tuple(cu_seqlens_q.shape)}.")
    batch = cu_seqlens_q.shape[0] - 1
    check_index_tensor("cu_seqlens_q", cu_seqlens_q, batch + 1, q)
    check_index_tensor("cu_seqlens_k", cu_seqlens_k, batch + 1, q)
    for name, used in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if used is not None:
            check_index_tensor(name, used, batch, q)
    check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    check_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    check_max_seqlen("max_seqlen_q", max_seqlen_q)
    check_max_seqlen("max_seqlen_k", max_seqlen_k)
    check_max_seqlen_covers("max_seqlen_q", max_seqlen_q, cu_seqlens_q, "cu_seqlens_q")
    check_max_seqlen_covers("max_seqlen_k", max_seqlen_k, cu_seqlens_k, "cu_seqlens_k")
