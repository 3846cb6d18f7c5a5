"""flash_cuda as a Hugging Face transformers attention implementation.

    import flash_cuda.integrations.transformers as fc_hf
    name = fc_hf.register()                      # "fa_cuda"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name,
                                                 dtype=torch.bfloat16)

Note [The name]
transformers (5.x) treats every attn_implementation whose name contains "flash" as a
FlashAttention package to load (an installed flash-attn, or a Kernels-Hub repository), so a
function registered under "flash_cuda" makes from_config / from_pretrained fail, and GPT-OSS
even swaps such names for a hub kernel. The name here, "fa_cuda", stays outside that rule and is
registered through the two public interfaces: AttentionInterface (the attention function) and
AttentionMaskInterface (the mask function; without one, padded batches would reach the function
unmasked). transformers' own padding-free and unpadding logic runs only for "flash" names, so
the function below does that work itself:

* a 2-D padding mask (left or right padding, or a static cache longer than what was written):
  unpad the keys (and, where queries and keys are the same tokens, the queries),
  flash_attn_varlen_func, pad back;
* cu_seq_lens_q / _k from DataCollatorWithFlattening(return_flash_attn_kwargs=True): varlen;
* packed sequences marked only by position_ids restarting (DataCollatorWithFlattening's
  default, batch size 1): cu_seqlens from the restarts, varlen;
* anything else: flash_attn_func (causal is bottom-right aligned, as decoding needs).

Attention sinks (GPT-OSS's s_aux), softcap (Gemma 2) and attention dropout raise
NotImplementedError naming the argument. transformers is an optional dependency
(`pip install flash_cuda[transformers]`); importing this module needs it.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from flash_cuda.interface import flash_attn_func, flash_attn_varlen_func

NAME = "fa_cuda"

__all__ = ["NAME", "register", "attention_forward", "attention_mask"]


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    return F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def _unpad(x: torch.Tensor, mask: torch.Tensor):
    """(batch, seqlen, heads, d) and a bool (batch, seqlen) mask -> packed rows, their indices,
    cu_seqlens and the longest length."""
    lengths = mask.sum(-1, dtype=torch.int32)
    index = mask.flatten().nonzero().flatten()
    return x.flatten(0, 1)[index], index, _cu_seqlens(lengths), lengths.max()


def _packed_boundaries(position_ids: Optional[torch.Tensor], batch: int, q_len: int):
    """cu_seqlens and the longest length when position_ids restart inside one row (packed
    sequences, as transformers detects them), else None."""
    if position_ids is None or batch != 1 or q_len == 1 or position_ids.shape[-1] != q_len:
        return None
    pos = position_ids.reshape(-1)
    first = pos.min()
    if not bool((pos != torch.arange(q_len, device=pos.device) + first).any()):
        return None
    starts = (pos == first).nonzero().flatten().to(torch.int32)
    cu = torch.cat([starts, starts.new_tensor([q_len])])
    return cu, cu.diff().max()


def _run_padded(q, k, v, mask, attn_kwargs):
    """Attention of a padded batch through its 2-D mask (True = a token to attend to)."""
    batch, q_len = q.shape[:2]
    mask = mask.bool()
    if k.shape[1] > mask.shape[1]:  # a static cache: only the first mask.shape[1] slots hold keys
        k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]
    k_rows, k_index, cu_k, max_k = _unpad(k, mask)
    v_rows = v.flatten(0, 1)[k_index]
    if q_len == k.shape[1]:  # self-attention over the whole sequence: the mask is q's too
        q_rows, q_index, cu_q, max_q = q.flatten(0, 1)[k_index], k_index, cu_k, max_k
        out_rows = flash_attn_varlen_func(q_rows, k_rows, v_rows, cu_q, cu_k, max_q, max_k,
                                          **attn_kwargs)
        out = out_rows.new_zeros(batch * q_len, *out_rows.shape[1:])
        out[q_index] = out_rows
        return out.view(batch, q_len, *out_rows.shape[1:])
    # Fewer queries than keys: decoding, a chunk after a cache (left padding puts every pad
    # before it) or cross-attention to a padded encoder. The mask says nothing of the queries;
    # each sequence keeps all q_len of them, bottom-right aligned to its own keys.
    cu_q = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=q.device)
    out = flash_attn_varlen_func(q.flatten(0, 1), k_rows, v_rows, cu_q, cu_k, q_len, max_k,
                                 **attn_kwargs)
    return out.view(batch, q_len, *out.shape[1:])


def _run_varlen(q, k, v, cu_q, cu_k, max_q, max_k, attn_kwargs):
    out = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                 cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k,
                                 **attn_kwargs)
    return out.view(*q.shape[:2], *out.shape[1:])


def _kernel_dtype(query: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype to run float32 CUDA activations in: autocast's, as transformers' own flash
    integration does; None keeps the input's (the CPU reference takes float32)."""
    if query.device.type == "cuda" and query.dtype == torch.float32 and \
            torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return None


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, s_aux: Optional[torch.Tensor] = None,
                      position_ids: Optional[torch.Tensor] = None,
                      cu_seq_lens_q: Optional[torch.Tensor] = None,
                      cu_seq_lens_k: Optional[torch.Tensor] = None, max_length_q=None,
                      max_length_k=None, **kwargs):
    """transformers' attention-function contract: query (batch, heads_q, seqlen_q, d), key /
    value (batch, heads_kv, seqlen_k, d) with the cache already appended; returns
    (out (batch, seqlen_q, heads_q, d), None)."""
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(
            f"attention_mask of shape {tuple(attention_mask.shape)}: the {NAME} attention takes "
            f"2-D padding masks (batch, seqlen_k), which its mask function produces; custom 4-D "
            f"masks are not supported.")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    attn_kwargs = dict(softmax_scale=scaling, causal=bool(causal), window_size=window,
                       softcap=0.0 if softcap is None else softcap, dropout_p=dropout,
                       s_aux=s_aux)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, seqlen, heads, d)
    dtype = _kernel_dtype(query)
    if dtype is not None:
        q, k, v = (t.to(dtype) for t in (q, k, v))
    batch, q_len = q.shape[:2]
    if attention_mask is not None:
        out = _run_padded(q, k, v, attention_mask, attn_kwargs)
    elif cu_seq_lens_q is not None and cu_seq_lens_k is not None:
        max_q = cu_seq_lens_q.diff().max() if max_length_q is None else max_length_q
        max_k = cu_seq_lens_k.diff().max() if max_length_k is None else max_length_k
        out = _run_varlen(q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_q, max_k, attn_kwargs)
    else:
        packed = _packed_boundaries(position_ids, batch, q_len)
        if packed is not None:
            cu, longest = packed
            out = _run_varlen(q, k, v, cu, cu, longest, longest, attn_kwargs)
        else:
            out = flash_attn_func(q, k, v, **attn_kwargs)
    return out.to(query.dtype), None


def attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                   kv_offset: int = 0, mask_function=None,
                   attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """The mask function (AttentionMaskInterface): None when nothing is padded, else the 2-D
    bool padding mask (batch, <= kv_length) that attention_forward unpads with, as transformers'
    flash_attention_mask gives. One addition: with no mask but a key buffer longer than the
    tokens written so far (a static cache; transformers 5.24's generate() drops an all-ones mask
    for implementations whose name lacks "flash"), a mask of the written length, so that the
    unwritten slots are not attended to. A static cache gives q_offset as a device tensor:
    reading it costs one host sync per forward (not per layer), and breaks a compiled graph
    there, as transformers' own mask functions do when they read the mask."""
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            return None
        return attention_mask
    config = kwargs.get("config")
    if config is not None and getattr(config, "is_encoder_decoder", False):
        return None
    written = int(q_offset) + q_length
    if written < kv_length:
        return torch.ones(batch_size, written, dtype=torch.bool,
                          device=kwargs.get("device", "cpu"))
    return None


def register(name: str = NAME) -> str:
    """Makes flash_cuda selectable as attn_implementation=name (default "fa_cuda") in
    transformers; returns the name. A name containing "flash" is refused (Note [The name])."""
    if "flash" in name.lower():
        raise ValueError(f"name={name!r}: transformers loads a FlashAttention package for every "
                         f"attn_implementation containing 'flash', so flash_cuda registers "
                         f"under another name (the default is {NAME!r}).")
    from transformers import AttentionInterface, AttentionMaskInterface
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name
