"""Plain PyTorch attention KL: materialises both score matrices (the baseline everyone uses).

Beside the kernels as flash-linear-attention keeps a ``naive.py``: it is the readable statement
of what the kernels compute, the torch-side reference for tests (run it in float64 for the
"truth", or at the inputs' own precision to measure the rounding error the same math makes
there, which sets the kernels' tolerances), and the eager / torch.compile / chunked baselines of
the benchmark. It is differentiable through autograd. Conventions: docs/math.md.
"""
from __future__ import annotations

import torch

from streamkl_ref._checks import check_inputs

__all__ = ["attention_kl_naive", "attention_kl_chunked", "causal_mask"]


def causal_mask(n_q: int, n_k: int, device=None) -> torch.Tensor:
    """Bottom-right causal mask, ``True`` where key j is visible to query i: ``j <= i + (N_K - N_Q)``."""
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    return j <= i + (n_k - n_q)


def _expand_kv(k: torch.Tensor, h: int) -> torch.Tensor:
    # GQA: query head h reads key head h // (H // H_K)
    return k.repeat_interleave(h // k.shape[1], dim=1) if k.shape[1] != h else k


def attention_kl_naive(q1, k1, q2, k2, *, causal=False, scale1=None, scale2=None,
                       compute_dtype=torch.float32, row_offset=0, n_k_visible=None):
    """KL(P1 || P2) per query row, ``[B, H, N_Q]`` in ``compute_dtype``, fully materialised.

    Scores are formed in ``compute_dtype`` from the inputs cast to it. Masked entries are -inf on
    both sides and contribute exactly 0; rows with no visible key give 0.
    ``row_offset`` lets a caller evaluate a chunk of query rows of a larger problem (the causal
    frontier of row i is then computed for row ``row_offset + i`` of ``n_q_total`` rows).
    """
    dims = check_inputs(q1, k1, q2, k2, scale1=scale1, scale2=scale2)
    return _naive_rows(q1, k1, q2, k2, dims, causal, compute_dtype, row_offset, dims.NQ)


def _naive_rows(q1, k1, q2, k2, dims, causal, compute_dtype, row_offset, n_q_total):
    H = dims.H
    s1 = dims.scale1 * (q1.to(compute_dtype) @ _expand_kv(k1, H).to(compute_dtype).transpose(-1, -2))
    s2 = dims.scale2 * (q2.to(compute_dtype) @ _expand_kv(k2, H).to(compute_dtype).transpose(-1, -2))
    empty = None
    if causal:
        n_q = q1.shape[2]
        i = torch.arange(row_offset, row_offset + n_q, device=q1.device)[:, None]
        j = torch.arange(dims.NK, device=q1.device)[None, :]
        visible = j <= i + (dims.NK - n_q_total)
        # rows with no visible key: keep them unmasked for the arithmetic (no all -inf row, so no
        # NaN, also not in autograd) and set their KL to the convention's 0 below
        empty = ~visible.any(-1)
        visible = visible | empty[:, None]
        s1 = s1.masked_fill(~visible, float("-inf"))
        s2 = s2.masked_fill(~visible, float("-inf"))
    logp1 = torch.log_softmax(s1, dim=-1)
    logp2 = torch.log_softmax(s2, dim=-1)
    p1 = logp1.exp()
    # 0 * log(0/.) = 0: the log-ratio of masked entries (p1 == 0) is replaced by 0 before the
    # product, so neither the value nor its autograd ever touches -inf - -inf
    log_ratio = torch.where(p1 > 0, logp1 - logp2, torch.zeros((), dtype=p1.dtype, device=p1.device))
    kl = (p1 * log_ratio).sum(-1)
    if empty is not None:
        kl = kl.masked_fill(empty, 0.0)
    return kl


def attention_kl_chunked(q1, k1, q2, k2, *, causal=False, scale1=None, scale2=None,
                         compute_dtype=torch.float32, chunk=1024):
    """The same, over query chunks of ``chunk`` rows (what users do today to avoid OOM)."""
    dims = check_inputs(q1, k1, q2, k2, scale1=scale1, scale2=scale2)
    out = []
    for start in range(0, dims.NQ, chunk):
        sl = slice(start, start + chunk)
        out.append(_naive_rows(q1[:, :, sl], k1, q2[:, :, sl], k2, dims, causal, compute_dtype,
                               start, dims.NQ))
    return torch.cat(out, dim=-1)
