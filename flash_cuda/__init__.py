"""flash_cuda: exact attention with CUDA kernels and a FlashAttention-3 compatible API.

Importing the package loads the compiled extension (the torch.ops.flash_cuda schemas and CUDA
kernels) and registers the CPU reference and fake implementations of those ops.
"""

from flash_cuda._ops import build_info
from flash_cuda.interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
)

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "build_info",
    "__version__",
]
