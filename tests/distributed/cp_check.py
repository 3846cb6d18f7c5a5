"""One context-parallel attention check, run by each rank of a process group (spawned by
test_context_parallel.py; not collected by pytest).

Every rank builds the same inputs, runs torch's context parallel
(`torch.distributed.tensor.experimental.context_parallel`: ring attention over the ranks, causal
inputs sharded head-tail for balance) with flash_cuda activated as SDPA's flash-attention
implementation, forward and backward, and gathers the output and the gradients back to the whole
sequence.  Rank 0 compares them with a float32 reference on the whole sequence and writes
{"errors": {...}, "bounds": {...}, "ran": {...}} as JSON: our error may be at most 2x that of
torch's math attention computed in the low precision itself (its reductions too), plus fp32
rounding noise; "ran" says whether flash_cuda's forward and backward ops ran in the ring (so
that torch's own flash kernels cannot pass for them).

With a world size of 1 the check runs wherever one GPU is (test_context_parallel.py says why
gloo ranks sharing one GPU are not used).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _inputs(case, device):
    g = torch.Generator(device="cpu").manual_seed(case["seed"])
    b, hq, hk, s, d = case["batch"], case["heads_q"], case["heads_kv"], case["seqlen"], case["hdim"]
    dtype = getattr(torch, case["dtype"])

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    return randn(b, hq, s, d), randn(b, hk, s, d), randn(b, hk, s, d), randn(b, hq, s, d)


def _attention(q, k, v, dout, causal):
    """out, dq, dk, dv of SDPA under the active backend choice."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                         enable_gqa=q.shape[1] != k.shape[1])
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def run(rank, world, init_file, backend, case, result_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import (_cp_options,
                                                                  context_parallel_unshard,
                                                                  set_rotate_method)
    from torch.nn.attention import (SDPBackend, activate_flash_attention_impl,
                                    restore_flash_attention_impl, sdpa_kernel)

    import flash_cuda  # noqa: F401  (registers "flash_cuda" as a flash-attention implementation)

    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        mesh = init_device_mesh("cuda", (world,))
        set_rotate_method(case.get("rotate", "allgather"))  # torch's default; or "alltoall"
        causal = case["causal"]
        # torch balances causal shards head-tail and refuses the balance without a causal mask.
        _cp_options.enable_load_balance = causal
        q, k, v, dout = _inputs(case, device)

        activate_flash_attention_impl("flash_cuda")
        try:
            cq, ck, cv, cdo = (t.clone() for t in (q, k, v, dout))
            cpu = [torch.profiler.ProfilerActivity.CPU]
            with context_parallel(mesh, buffers=[cq, ck, cv, cdo], buffer_seq_dims=[2, 2, 2, 2]), \
                    torch.profiler.profile(activities=cpu) as prof:
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    for t in (cq, ck, cv):
                        t.requires_grad_()
                    out = F.scaled_dot_product_attention(cq, ck, cv, is_causal=causal,
                                                         enable_gqa=cq.shape[1] != ck.shape[1])
                    out.backward(cdo)
                    grads = [t.grad for t in (cq, ck, cv)]
                    for t in (cq, ck, cv):
                        t.requires_grad_(False)
            got = context_parallel_unshard(mesh, [out.detach(), *grads], [2, 2, 2, 2])
            ops = {e.key for e in prof.key_averages()}
            ran = {op: f"flash_cuda::{op}" in ops for op in ("fwd", "bwd")}
        finally:
            restore_flash_attention_impl()

        if rank == 0:
            with sdpa_kernel(SDPBackend.MATH):
                want = _attention(*(t.float() for t in (q, k, v, dout)), causal)
                # Low precision throughout, reductions included (by default the math backend
                # reduces 16-bit inputs in float32 and rounds only its outputs).
                allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
                torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
                try:
                    lowp = _attention(q, k, v, dout, causal)
                finally:
                    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)
            names = ("out", "dq", "dk", "dv")
            errors = {n: (a.float() - w).abs().max().item() for n, a, w in zip(names, got, want)}
            lowp_err = {n: (a.float() - w).abs().max().item() for n, a, w in zip(names, lowp, want)}
            bounds = {n: 2 * lowp_err[n] + 1e-3 * max(1.0, w.abs().max().item())
                      for n, w in zip(names, want)}
            nan = {n: bool(torch.isnan(a).any()) for n, a in zip(names, got)}
            with open(result_path, "w") as f:
                json.dump({"errors": errors, "bounds": bounds, "lowp": lowp_err, "nan": nan,
                           "ran": ran}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":  # python cp_check.py WORLD BACKEND CASE_JSON RESULT_PATH
    import tempfile

    import torch.multiprocessing as mp
    world, backend = int(sys.argv[1]), sys.argv[2]
    case, result = json.loads(sys.argv[3]), sys.argv[4]
    init = tempfile.mktemp(prefix="cp_init_")
    mp.spawn(run, args=(world, init, backend, case, result), nprocs=world)
    if os.path.exists(init):
        os.remove(init)
