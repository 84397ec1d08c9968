"""``attention_kl``: the public PyTorch entry point to the streaming KL kernels (docs/api.md).

A thin public module: the custom ops, the autograd formula and the functions live in
``streamkl_gpu/attention/ops.py``; this module re-exports the public names.
"""
from streamkl_gpu.attention.ops import (MAX_HEAD_DIM, SUPPORTED_DTYPES, attention_kl, attention_kl_with_lse,
                                        auto_bwd_mode, auto_split_k, interpreting)

__all__ = ["attention_kl", "attention_kl_with_lse", "auto_split_k", "auto_bwd_mode", "interpreting",
           "SUPPORTED_DTYPES", "MAX_HEAD_DIM"]
