"""flash_cuda in transformers (flash_cuda/integrations/transformers.py), with small randomly
initialised models built from configs (no downloads): a Llama-style GQA model and Mistral (GQA
with a sliding window). Plain, left-padded, right-padded and packed batches match
attn_implementation="eager"; training gives eager's loss and gradients; greedy generation gives
eager's tokens; compiled models match too. On the CPU the reference runs (float32); on a GPU the
kernels (bfloat16).
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flash_cuda.integrations import transformers as fc_hf  # noqa: E402
from conftest import skip_unless_built  # noqa: E402

NAME = fc_hf.register()
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA device")])]


def _config(arch):
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  head_dim=16)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.MistralConfig(sliding_window=6, **common)


def _dtype(device, dtype=None):
    return dtype or (torch.bfloat16 if device == "cuda" else torch.float32)


def _models(arch, device, seed=0, dtype=None):
    """(ours, eager): the same weights under both implementations."""
    torch.manual_seed(seed)
    config = _config(arch)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                          attn_implementation="eager")
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                         attn_implementation=NAME)
    ours.load_state_dict(eager.state_dict())
    for m in (eager, ours):
        m.to(device=device, dtype=_dtype(device, dtype)).eval()
    assert ours.config._attn_implementation == NAME
    return ours, eager


def _tol(device):
    return dict(atol=3e-2, rtol=3e-2) if device == "cuda" else dict(atol=2e-5, rtol=2e-5)


def _ids(device, batch=2, length=12, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=gen).to(device)


@pytest.mark.fast
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_batches_match_eager(arch, device, padding):
    ours, eager = _models(arch, device)
    ids = _ids(device)
    mask = torch.ones_like(ids)
    if padding == "left":
        mask[0, :5] = 0
    elif padding == "right":
        mask[1, 7:] = 0
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask).logits
        want = eager(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()  # padded positions' outputs are undefined in eager
    torch.testing.assert_close(got[keep].float(), want[keep].float(), **_tol(device))


def _packed(device, lengths=(5, 9, 4)):
    """One row of packed sequences, with position_ids restarting at each, and the sequences."""
    seqs = [_ids(device, 1, n, seed=10 + i) for i, n in enumerate(lengths)]
    ids = torch.cat(seqs, dim=1)
    position_ids = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    return ids, position_ids, seqs


@pytest.mark.fast
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("with_cu_seqlens", [False, True], ids=["position_ids", "cu_seqlens"])
def test_packed_sequences_match_separate_runs(arch, device, with_cu_seqlens):
    """DataCollatorWithFlattening's two outputs: position_ids only, or with cu_seq_lens."""
    ours, eager = _models(arch, device)
    ids, position_ids, seqs = _packed(device)
    kwargs = {}
    if with_cu_seqlens:
        lengths = torch.tensor([s.shape[1] for s in seqs])
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(device, torch.int32)
        kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=int(lengths.max()),
                      max_length_k=int(lengths.max()))
    with torch.no_grad():
        got = ours(input_ids=ids, position_ids=position_ids, use_cache=False, **kwargs).logits
        want = torch.cat([eager(input_ids=s, use_cache=False).logits for s in seqs], dim=1)
    torch.testing.assert_close(got.float(), want.float(), **_tol(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_training_matches_eager(arch, device):
    """Loss and every parameter's gradient, on a right-padded batch."""
    ours, eager = _models(arch, device)
    ids = _ids(device, length=16)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    results = []
    for model in (ours, eager):
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (loss, grads), (loss_e, grads_e) = results
    torch.testing.assert_close(loss.float(), loss_e.float(), **_tol(device))
    scale = max(g.abs().max() for g in grads_e.values())
    for name, g in grads.items():
        err = (g - grads_e[name]).abs().max()
        limit = (5e-2 if device == "cuda" else 1e-4) * scale
        assert err <= limit, f"{name}: {err:.3e} > {limit:.3e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generation_matches_eager(arch, device, cache):
    # float16 on the GPU: a randomly initialised model's logits lie close together, and
    # bfloat16's rounding alone can swap near-tied tokens between two correct attentions.
    if device == "cuda":
        skip_unless_built(torch.float16, 1, directions=("fwd",))
    ours, eager = _models(arch, device, seed=3, dtype=torch.float16 if device == "cuda" else None)
    ids = _ids(device, length=7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding, as generation uses
    kwargs = dict(max_new_tokens=10, do_sample=False, attention_mask=mask, pad_token_id=0)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    got = ours.generate(ids, **kwargs)
    want = eager.generate(ids, **kwargs)
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", ["padded", "packed"])
def test_compiled_model_matches_eager(device, batch):
    """torch.compile of the model (transformers' default fullgraph=False: the data-dependent
    steps of unpadding and packing break the graph there, as in transformers' own flash path),
    forward and backward."""
    ours, eager = _models("llama", device)
    if batch == "packed":
        ids, position_ids, seqs = _packed(device)
        inputs = dict(input_ids=ids, position_ids=position_ids, use_cache=False)
    else:
        ids = _ids(device)
        mask = torch.ones_like(ids)
        mask[0, :4] = 0
        inputs = dict(input_ids=ids, attention_mask=mask)
    torch._dynamo.reset()
    compiled = torch.compile(ours, backend="inductor" if device == "cuda" else "aot_eager")
    got = compiled(**inputs).logits
    got.float().sum().backward()
    want = ours(**inputs).logits
    keep = inputs.get("attention_mask", torch.ones_like(ids)).bool()
    torch.testing.assert_close(got[keep].float(), want[keep].float(), **_tol(device))


def test_attention_sinks_raise():
    """GPT-OSS passes its sinks as s_aux: refused by name, never dropped."""
    config = transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
        num_experts_per_tok=1, max_position_embeddings=128, sliding_window=8)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=NAME)
    assert model.config._attn_implementation == NAME
    with pytest.raises(NotImplementedError, match="^s_aux=<tensor> is not supported"):
        model(input_ids=_ids("cpu"))


def test_flash_names_are_refused():
    with pytest.raises(ValueError, match="contain.*'flash'"):
        fc_hf.register("flash_cuda")


def test_custom_4d_masks_are_refused():
    ours, _ = _models("llama", "cpu")
    q = torch.randn(1, 4, 3, 16)
    k = torch.randn(1, 2, 3, 16)
    with pytest.raises(NotImplementedError, match="2-D padding masks"):
        fc_hf.attention_forward(ours.model.layers[0].self_attn, q, k, k,
                                torch.ones(1, 1, 3, 3, dtype=torch.bool))


def _masked_reference(q, k, v, mask, causal, window=None):
    """(b, h, s, d) attention with a 2-D key mask, bottom-right causal, GQA by head groups."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    q_len, k_len = q.shape[2], k.shape[2]
    keep = mask[:, None, None, :].bool().expand(-1, 1, q_len, -1)
    rows = torch.arange(q_len)[:, None] + (k_len - q_len)
    cols = torch.arange(k_len)[None, :]
    if causal:
        keep = keep & (cols <= rows)
    if window is not None:
        keep = keep & (cols > rows - window)
    p = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2)


@pytest.mark.parametrize("case", ["cross_attention_padded_encoder", "decode_left_padded",
                                  "chunk_after_cache_left_padded", "sliding_window_padded"])
def test_attention_function_against_a_masked_reference(case):
    """The attention function alone, on the shapes transformers gives it: key masks shorter
    or longer than the queries, causal or not."""
    torch.manual_seed(5)
    module = torch.nn.Module()
    if case == "cross_attention_padded_encoder":  # 3 decoder queries, 6 encoder keys
        q_len, k_len, causal, window = 3, 6, False, None
        mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    elif case == "decode_left_padded":
        q_len, k_len, causal, window = 1, 9, True, None
        mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9])
    elif case == "chunk_after_cache_left_padded":
        q_len, k_len, causal, window = 4, 10, True, None
        mask = torch.tensor([[0, 0] + [1] * 8, [1] * 10])
    else:
        q_len, k_len, causal, window = 8, 8, True, 3
        mask = torch.tensor([[0, 0, 0] + [1] * 5, [1] * 6 + [0, 0]])
    q = torch.randn(2, 4, q_len, 16)
    k, v = torch.randn(2, 2, k_len, 16), torch.randn(2, 2, k_len, 16)
    out, _ = fc_hf.attention_forward(module, q, k, v, mask, is_causal=causal,
                                     sliding_window=window)
    expected = _masked_reference(q, k, v, mask, causal, window)
    if q_len == k_len:  # padded query rows are undefined: compare the real ones
        keep = mask.bool()
        out, expected = out[keep], expected[keep]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
