"""fa4: FlashAttention-4 in pure Python on NVIDIA's CuTe DSL.

``out, lse = fa4.flash_attn_func(q, k, v, causal=True)`` -- the same call as flash-attn-4's
``flash_attn.cute``. Kernels are JIT-compiled on first use and cached in memory and on disk.
Importing fa4 does not import the CuTe DSL; the first kernel call does.
"""

__version__ = "0.1.0"

from fa4.combine import flash_attn_combine  # noqa: E402
from fa4.config import KernelOptions  # noqa: E402
from fa4.interface import explain, flash_attn_func, flash_attn_varlen_func  # noqa: E402
from fa4.jit import cache_info  # noqa: E402
from fa4.kvcache import flash_attn_with_kvcache  # noqa: E402

__all__ = ["__version__", "KernelOptions", "cache_info", "explain", "flash_attn_combine", "flash_attn_func",
           "flash_attn_varlen_func", "flash_attn_with_kvcache"]
