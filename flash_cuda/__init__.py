"""flash_cuda: exact attention with CUDA kernels and a FlashAttention-3 compatible API.

Importing the package loads the compiled extension (the torch.ops.flash_cuda schemas and CUDA
kernels), registers the CPU reference, fake and autograd implementations of those ops, and adds
"flash_cuda" to torch's registry of SDPA flash-attention implementations (activated only on
request: flash_cuda/sdpa.py). Integrations with other libraries: flash_cuda.integrations.
"""

import torch.nn.attention as _attention

from flash_cuda._ops import build_info
from flash_cuda.interface import (
    flash_attn_combine,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    get_scheduler_metadata,
)

__version__ = "0.1.0"


def _activate_sdpa():
    """torch's activate_flash_attention_impl("flash_cuda") lands here (flash_cuda.sdpa)."""
    from flash_cuda import sdpa
    return sdpa.register()


# "flash_cuda" in torch's registry of SDPA flash-attention implementations (torch >= 2.10);
# registering activates nothing.
if hasattr(_attention, "register_flash_attention_impl"):
    _attention.register_flash_attention_impl("flash_cuda", register_fn=_activate_sdpa)


def __getattr__(name):
    # flash_cuda.sdpa and flash_cuda.integrations load on first use.
    if name in ("sdpa", "integrations"):
        import importlib
        return importlib.import_module(f"flash_cuda.{name}")
    raise AttributeError(f"module 'flash_cuda' has no attribute {name!r}")


__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_with_kvcache",
    "flash_attn_combine",
    "get_scheduler_metadata",
    "build_info",
    "__version__",
]
