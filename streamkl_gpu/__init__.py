"""streamkl_gpu: Triton kernels for streaming attention KL behind one PyTorch function.

``attention_kl(q1, k1, q2, k2, *, causal=False, scale1=None, scale2=None)`` -> float32
``[B, H, N_Q]``. Runs on NVIDIA GPUs, and on CPU tensors under the Triton interpreter
(set ``TRITON_INTERPRET=1`` before importing this package). Conventions: MATH.md.
"""
from .api import (
    MAX_HEAD_DIM,
    SUPPORTED_DTYPES,
    attention_kl,
    attention_kl_with_lse,
    auto_bwd_mode,
    auto_split_k,
    interpreting,
)

__version__ = "0.1.0"
__all__ = [
    "attention_kl",
    "attention_kl_with_lse",
    "auto_split_k",
    "auto_bwd_mode",
    "interpreting",
    "SUPPORTED_DTYPES",
    "MAX_HEAD_DIM",
    "__version__",
]
