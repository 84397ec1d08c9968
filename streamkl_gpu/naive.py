"""Plain PyTorch attention KL: materialises both score matrices (the baseline everyone uses).

Beside the kernels as flash-linear-attention keeps a ``naive.py``: the readable statement of what
the kernels compute, the torch-side reference for tests (at the inputs' own precision it measures
the rounding error the same math makes there, which sets the kernels' tolerances), and the eager /
torch.compile / chunked baselines of the benchmark. The formula has one home,
:func:`streamkl_ref.testing.attention_kl_torch` (the conformance suite's baseline); this module
keeps the names the kernels' tests and the benchmark use.
"""
from __future__ import annotations

import torch

from streamkl_ref.testing import attention_kl_torch, attention_kl_torch_chunked, causal_mask

__all__ = ["attention_kl_naive", "attention_kl_chunked", "causal_mask"]


def attention_kl_naive(q1, k1, q2, k2, *, causal=False, scale1=None, scale2=None,
                       compute_dtype=torch.float32):
    """KL(P1 || P2) per query row, ``[B, H, N_Q]`` in ``compute_dtype``, fully materialised
    (:func:`streamkl_ref.testing.attention_kl_torch`)."""
    return attention_kl_torch(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2,
                              compute_dtype=compute_dtype)


def attention_kl_chunked(q1, k1, q2, k2, *, causal=False, scale1=None, scale2=None,
                         compute_dtype=torch.float32, chunk=1024):
    """The same, over query chunks of ``chunk`` rows (what users do today to avoid OOM)."""
    return attention_kl_torch_chunked(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2,
                                      compute_dtype=compute_dtype, chunk=chunk)
