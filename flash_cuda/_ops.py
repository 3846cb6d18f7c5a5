"""The Python half of torch.ops.flash_cuda.fwd / .bwd: CPU, fake and autograd implementations.

The schemas come from the compiled extension flash_cuda._C (csrc/ops/registration.cpp) and, in
a build with CUDA kernels, the CUDA implementations too. This module adds:

* the CPU implementation, the plain-PyTorch reference (correct, not fast);
* the fake implementation, which lets FakeTensorMode, torch.compile and torch.export trace the
  ops without data;
* the autograd formula of fwd (its backward calls bwd), so that direct op calls, exported graphs
  and the Python API alike are differentiable;
* in a build without CUDA kernels, a CUDA implementation that says so.

The CPU and fake implementations check the op rules (flash_cuda/_checks.py), the CUDA one checks
them in C++ with the same messages.
"""

from typing import NamedTuple, Optional

import torch

try:
    from flash_cuda import _C
except ImportError as exc:  # the extension is the only source of the op schemas
    raise ImportError(
        "flash_cuda._C, the compiled extension that defines torch.ops.flash_cuda, could not be "
        "imported. Install the package with `pip install --no-build-isolation -e .` (or build "
        "it in the source tree with `python setup.py build_ext --inplace`); see setup.py for "
        f"the FLASH_CUDA_* build knobs. Original error: {exc}"
    ) from exc

from flash_cuda import _checks, reference, reference_kvcache

__all__ = ["fwd", "bwd", "fwd_kvcache", "combine", "build_info"]

fwd = torch.ops.flash_cuda.fwd.default
bwd = torch.ops.flash_cuda.bwd.default
fwd_kvcache = torch.ops.flash_cuda.fwd_kvcache.default
combine = torch.ops.flash_cuda.combine.default
_BUILD_INFO = _C.build_info()
# Read once here: the API consults it on every call, also while torch.compile traces, where a
# call into the extension would break the graph.
CUDA_DETERMINISTIC_BACKWARD = bool(_BUILD_INFO["features"]["deterministic_backward"])
HAS_CUDA_KERNELS = bool(_BUILD_INFO["kernels"])


@torch.library.register_kernel("flash_cuda::fwd", "cpu")
def _fwd_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
             max_seqlen_k, softmax_scale, causal, window_left, window_right, deterministic=False):
    _checks.check_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                         max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right)
    # The reference walks each sequence's real length, so max_seqlen (a CUDA grid size) is
    # not needed here.
    return reference.attention_forward_reference(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, softmax_scale=softmax_scale,
        causal=causal, window_left=window_left, window_right=window_right, upcast=True)


@torch.library.register_kernel("flash_cuda::bwd", "cpu")
def _bwd_cpu(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
             max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
             deterministic):
    _checks.check_bwd_op(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                         seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                         window_right)
    # The reference sums in a fixed order, so every call is deterministic whatever the flag.
    return reference.attention_backward_reference(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        softmax_scale=softmax_scale, causal=causal, window_left=window_left,
        window_right=window_right, upcast=True)


@torch.library.register_fake("flash_cuda::fwd")
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
              max_seqlen_k, softmax_scale, causal, window_left, window_right,
              deterministic=False):
    _checks.check_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                         max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right)
    out = reference.output_like(q)
    lse = q.new_empty(_checks.lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("flash_cuda::bwd")
def _bwd_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
              max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
              deterministic):
    _checks.check_bwd_op(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                         seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                         window_right)
    return reference.output_like(q), reference.output_like(k), reference.output_like(v)


# ---- the KV-cache op (forward only) ----------------------------------------------------------

class _KvcacheArgs(NamedTuple):
    """fwd_kvcache's arguments, in its schema's order (csrc/ops/registration.cpp)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    rotary_cos: Optional[torch.Tensor]
    rotary_sin: Optional[torch.Tensor]
    cache_seqlens: Optional[torch.Tensor]
    cache_batch_idx: Optional[torch.Tensor]
    cache_leftpad: Optional[torch.Tensor]
    page_table: Optional[torch.Tensor]
    cu_seqlens_q: Optional[torch.Tensor]
    cu_seqlens_k_new: Optional[torch.Tensor]
    max_seqlen_q: Optional[int]
    rotary_seqlens: Optional[torch.Tensor]
    softmax_scale: float
    causal: bool
    window_left: int
    window_right: int
    rotary_interleaved: bool
    num_splits: int
    out: torch.Tensor


def _checked_kvcache_args(args) -> _KvcacheArgs:
    """The op's positional arguments, named, once its rules hold."""
    a = _KvcacheArgs(*args)
    _checks.check_kvcache_op(a.q, a.k_cache, a.v_cache, a.k, a.v, a.rotary_cos, a.rotary_sin,
                             a.cache_seqlens, a.cache_batch_idx, a.cache_leftpad, a.page_table,
                             a.cu_seqlens_q, a.cu_seqlens_k_new, a.max_seqlen_q,
                             a.rotary_seqlens, a.softmax_scale, a.window_left, a.window_right,
                             a.out)
    return a


@torch.library.register_kernel("flash_cuda::fwd_kvcache", "cpu")
def _fwd_kvcache_cpu(*args):
    a = _checked_kvcache_args(args)
    # num_splits changes no result: the reference never splits.
    out, lse = reference_kvcache.kvcache_forward_reference(
        a.q, a.k_cache, a.v_cache, a.k, a.v, a.rotary_cos, a.rotary_sin, a.cache_seqlens,
        a.cache_batch_idx, a.cache_leftpad, a.page_table, a.cu_seqlens_q, a.cu_seqlens_k_new,
        a.rotary_seqlens, softmax_scale=a.softmax_scale, causal=a.causal,
        window_size=(a.window_left, a.window_right), rotary_interleaved=a.rotary_interleaved)
    a.out.copy_(out)
    return lse


@torch.library.register_fake("flash_cuda::fwd_kvcache")
def _fwd_kvcache_fake(*args):
    a = _checked_kvcache_args(args)
    return a.q.new_empty(_checks.lse_shape(a.q, a.cu_seqlens_q is not None), dtype=torch.float32)


def _no_cuda_fwd_kvcache(*args):
    _checked_kvcache_args(args)
    raise NotImplementedError(
        "flash_cuda was built without CUDA kernels (FLASH_CUDA_DISABLE_CUDA=1 or no CUDA "
        "toolkit): flash_attn_with_kvcache runs on CPU tensors only in this build.")


# A build with CUDA kernels registers fwd_kvcache's CUDA kernel in C++ (csrc/ops/kvcache_cuda.cpp),
# which checks the same rules with the same messages.
if not HAS_CUDA_KERNELS:
    torch.library.register_kernel("flash_cuda::fwd_kvcache", "cuda", _no_cuda_fwd_kvcache)


@torch.library.register_kernel("flash_cuda::_kvcache_num_splits", "cpu")
def _kvcache_num_splits_cpu(cache_seqlens, batch, seqlen_q, varlen_q, heads_q, heads_kv,
                            head_dim, capacity, dtype, window_left, num_splits, page_size,
                            leftpad):
    return min(max(1, num_splits), _checks.KVCACHE_MAX_SPLITS)  # the reference never splits


# ---- combine ----------------------------------------------------------------------------------

def _combine(out_partial, lse_partial, out):
    """The merge in PyTorch ops (no host sync, so also on CUDA for what the fused combine
    kernel does not take, see _fusable): each split weighs exp(lse_s - lse), a split with lse
    -inf nothing."""
    _checks.check_combine_op(out_partial, lse_partial, out)
    merged, lse = reference_kvcache.combine_reference(out_partial, lse_partial, out.dtype)
    out.copy_(merged)
    return lse


def _fusable(out_partial, out):
    """Whether flash_cuda's combine kernel takes this layout (else PyTorch operations run)."""
    if not HAS_CUDA_KERNELS or out.dtype not in (torch.float16, torch.bfloat16):
        return False
    if (out_partial.shape[0] > _checks.KVCACHE_MAX_SPLITS or out_partial.shape[-1] % 4 or
            out_partial.shape[-1] > _checks.MAX_HEAD_DIM):
        return False
    if out_partial.numel() == 0 or out.numel() == 0:
        return False
    if out_partial.shape[-3] * out_partial.shape[-2] > 2 ** 31 - 1:  # the kernel's grid x
        return False
    strides_ok = all(s % 4 == 0 for s in out_partial.stride()[:-1]) and \
        all(s % 4 == 0 for s in out.stride()[:-1])
    return (strides_ok and out_partial.data_ptr() % 16 == 0 and out.data_ptr() % 8 == 0 and
            (out_partial.dim() == 4 or out_partial.shape[1] <= 65535))


def _combine_cuda(out_partial, lse_partial, out):
    if _fusable(out_partial, out):
        _checks.check_combine_op(out_partial, lse_partial, out)
        return torch.ops.flash_cuda._combine_cuda.default(out_partial, lse_partial, out)
    return _combine(out_partial, lse_partial, out)


torch.library.register_kernel("flash_cuda::combine", "cpu", _combine)
torch.library.register_kernel("flash_cuda::combine", "cuda", _combine_cuda)


@torch.library.register_fake("flash_cuda::combine")
def _combine_fake(out_partial, lse_partial, out):
    _checks.check_combine_op(out_partial, lse_partial, out)
    return lse_partial.new_empty(lse_partial.shape[1:])


# ---- autograd --------------------------------------------------------------------------------

def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
     softmax_scale, causal, window_left, window_right, deterministic) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    # max_seqlen may be a SymInt under torch.compile; it is kept as given.
    ctx.args = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
                deterministic)
    # The kernels give no gradient through lse: it is an output to read, not to train through.
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k, used_q, used_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.flash_cuda.bwd(dout, q, k, v, out, lse, cu_q, cu_k, used_q, used_k,
                                          *ctx.args)
    # No gradient flows to the 11 arguments after q, k and v.
    return (dq, dk, dv) + (None,) * 11


def _bwd_setup_context(ctx, inputs, output):
    pass


def _bwd_backward(ctx, *grads):
    raise NotImplementedError("flash_cuda has no double backward: torch.ops.flash_cuda.bwd is "
                              "not differentiable.")


torch.library.register_autograd("flash_cuda::fwd", _fwd_backward, setup_context=_fwd_setup_context)
torch.library.register_autograd("flash_cuda::bwd", _bwd_backward, setup_context=_bwd_setup_context)


# ---- a build without CUDA kernels --------------------------------------------------------------

def _no_cuda_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                 max_seqlen_k, softmax_scale, causal, window_left, window_right,
                 deterministic=False):
    # A CPU call with one argument on CUDA lands here too: its rules first, then the build's.
    _checks.check_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                         max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right)
    _no_cuda_kernels()


def _no_cuda_bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                 seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                 window_right, deterministic):
    _checks.check_bwd_op(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                         seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                         window_right)
    _no_cuda_kernels()


def _no_cuda_kernels():
    raise NotImplementedError(
        "flash_cuda was built without CUDA kernels (no nvcc at build time, a CPU-only torch, or "
        "FLASH_CUDA_DISABLE_CUDA=1), so it runs only on CPU tensors. Reinstall it with a CUDA "
        "toolkit whose major version matches torch.version.cuda: `pip install "
        "--no-build-isolation -e .` (see the README's Install section).")


def _no_cuda_num_splits(*args):
    _no_cuda_kernels()


if not HAS_CUDA_KERNELS:
    torch.library.register_kernel("flash_cuda::fwd", "cuda", _no_cuda_fwd)
    torch.library.register_kernel("flash_cuda::bwd", "cuda", _no_cuda_bwd)
    torch.library.register_kernel("flash_cuda::_kvcache_num_splits", "cuda", _no_cuda_num_splits)


def build_info():
    """What this build holds, as a plain dict.

    Keys: archs (compute capabilities compiled for), head_dims ({"fwd": [...], "bwd": [...]},
    the compiled kernel sizes; a head dim without its own kernel runs on the next compiled
    size up), dtypes (sorted manifest names, e.g. ["bf16", "fp16"]), kernels (one name per
    compiled kernel), families (kernel families compiled, e.g. ["sm80"]), features (flags such
    as varlen, causal, local, gqa, deterministic_backward) and devices (where the ops run: "cpu"
    always, through the plain-PyTorch reference, and "cuda" when the build holds kernels).
    """
    info = dict(_C.build_info())
    info["archs"] = list(info["archs"])
    info["head_dims"] = {direction: list(dims) for direction, dims in info["head_dims"].items()}
    info["dtypes"] = sorted(info["dtypes"])
    info["kernels"] = list(info["kernels"])
    info["families"] = list(info["families"])
    info["features"] = dict(info["features"])
    info["devices"] = ["cpu", "cuda"] if info["kernels"] else ["cpu"]
    return info
