"""Loss modules over the streaming KL functions, as PyTorch and Liger-Kernel ship theirs.

``AttentionKLLoss(causal=..., reduction=...)(q1, k1, q2, k2)`` is
:func:`streamkl_gpu.attention_kl` with its options fixed in the constructor and a reduction;
``IndexerKLLoss(...)(q, k, q_idx, k_idx, weights, topk_indices=None, lse=None)`` is
:func:`streamkl_gpu.indexer_kl` (dense) or :func:`streamkl_gpu.indexer_kl_topk` (with
``topk_indices``). Each returns exactly what the function returns for the same arguments (the
modules hold no state and no parameters), and traces under ``torch.compile(fullgraph=True)``.

Reductions: ``"none"`` (the per-row KL), ``"sum"``, ``"mean"``: the mean over the rows that see at
least one key (rows with no visible key, possible with ``causal`` and ``N_Q > N_K``, have KL 0 by
convention and are not counted; the indexer functions' own ``"mean"``). Default ``"mean"``, as
``torch.nn`` losses.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["AttentionKLLoss", "IndexerKLLoss", "REDUCTIONS"]

REDUCTIONS = ("none", "sum", "mean")


def _check_reduction(reduction):
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return reduction


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def _check_scale(name, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"{name} must be None or a number, got {value!r}")
    return None if value is None else float(value)


def _visible_rows(n_q: int, n_k: int, causal: bool) -> int:
    """Query rows with at least one visible key (bottom-right causal: row i sees key j iff
    j <= i + N_K - N_Q, so the first N_Q - N_K rows see none)."""
    if n_k == 0:
        return 0
    return min(n_q, n_k) if causal else n_q


class AttentionKLLoss(torch.nn.Module):
    """Row-wise ``KL(P1 || P2)`` between two attentions (:func:`streamkl_gpu.attention_kl`), reduced.

    Args:
        causal, scale1, scale2, split_k, bwd_mode, deterministic: the function's options
            (bottom-right causal; ``None`` scales mean ``1/sqrt(D)``).
        reduction: ``"none"`` (float32 ``[B, H, N_Q]``), ``"sum"``, or ``"mean"`` over the
            ``B * H`` x (rows with at least one visible key).

    ``forward(q1, k1, q2, k2)``: side 1 (the teacher in distillation) ``q1 [B, H, N_Q, D1]``,
    ``k1 [B, H_K1, N_K, D1]``; side 2 (the student) ``q2 [B, H, N_Q, D2]``, ``k2 [B, H_K2, N_K, D2]``.
    Gradients go to the inputs that require them.
    """

    def __init__(self, *, causal: bool = False, scale1: Optional[float] = None, scale2: Optional[float] = None,
                 split_k: Optional[int] = None, bwd_mode: str = "auto", deterministic: bool = False,
                 reduction: str = "mean"):
        super().__init__()
        self.causal = _check_bool("causal", causal)
        self.scale1 = _check_scale("scale1", scale1)
        self.scale2 = _check_scale("scale2", scale2)
        if split_k is not None and (isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1):
            raise ValueError(f"split_k must be None or a positive int, got {split_k!r}")
        self.split_k = split_k
        if bwd_mode not in ("auto", "fused", "separate"):
            raise ValueError(f"bwd_mode must be 'auto', 'fused' or 'separate', got {bwd_mode!r}")
        self.bwd_mode = bwd_mode
        self.deterministic = _check_bool("deterministic", deterministic)
        self.reduction = _check_reduction(reduction)

    def forward(self, q1: torch.Tensor, k1: torch.Tensor, q2: torch.Tensor, k2: torch.Tensor) -> torch.Tensor:
        from . import attention_kl

        kl = attention_kl(q1, k1, q2, k2, causal=self.causal, scale1=self.scale1, scale2=self.scale2,
                          split_k=self.split_k, bwd_mode=self.bwd_mode, deterministic=self.deterministic)
        if self.reduction == "none":
            return kl
        total = kl.sum()
        if self.reduction == "sum":
            return total
        rows = kl.shape[0] * kl.shape[1] * _visible_rows(q1.shape[2], k1.shape[2], self.causal)
        return total / max(rows, 1)

    def extra_repr(self) -> str:
        parts = [f"causal={self.causal}", f"scale1={self.scale1}", f"scale2={self.scale2}"]
        if self.split_k is not None:
            parts.append(f"split_k={self.split_k}")
        if self.bwd_mode != "auto":
            parts.append(f"bwd_mode={self.bwd_mode!r}")
        if self.deterministic:
            parts.append("deterministic=True")
        parts.append(f"reduction={self.reduction!r}")
        return ", ".join(parts)


class IndexerKLLoss(torch.nn.Module):
    """The sparse-attention indexer loss ``KL(p || softmax(I))`` per row, reduced.

    Dense (:func:`streamkl_gpu.indexer_kl`) or, when ``forward`` gets ``topk_indices``, over each
    row's selected keys (:func:`streamkl_gpu.indexer_kl_topk`, Megatron-LM's ``sparse_loss``).

    Args:
        causal, scale, relu: the functions' options (bottom-right causal; ``scale=None`` means
            ``1/sqrt(D)`` of the teacher; ``relu=False`` drops the indexer's ReLU).
        reduction: ``"none"`` (float32 ``[B, N_Q]``), ``"sum"``, or ``"mean"`` over the rows with
            at least one visible key (Megatron's reduction); passed to the function.

    ``forward(q, k, q_idx, k_idx, weights, topk_indices=None, lse=None, row_weights=None)``: teacher
    ``q [B, H, N_Q, D]``, ``k [B, H_K, N_K, D]`` (a constant: no gradient), indexer
    ``q_idx [B, H_I, N_Q, D_I]``, ``k_idx [B, H_KI, N_K, D_I]``, ``weights [B, H_I, N_Q]``;
    ``topk_indices [B, N_Q, K]`` int32/int64 with ``-1`` for an unused slot; ``lse`` the teacher's
    optional LSEs (float32 ``[B, H, N_Q]``, natural log; over each row's set with ``topk_indices``);
    ``row_weights`` optional per-row weights ``[B, N_Q]`` known at forward time (per-token loss
    weights, masked rows: the loss of ``row_weights * KL``; the dense training step keeps its
    forward-formed gradient with them).
    """

    def __init__(self, *, causal: bool = False, scale: Optional[float] = None, relu: bool = True,
                 reduction: str = "mean"):
        super().__init__()
        self.causal = _check_bool("causal", causal)
        self.scale = _check_scale("scale", scale)
        self.relu = _check_bool("relu", relu)
        self.reduction = _check_reduction(reduction)

    def forward(self, q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
                weights: torch.Tensor, topk_indices: Optional[torch.Tensor] = None,
                lse: Optional[torch.Tensor] = None, row_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        from . import indexer_kl, indexer_kl_topk

        options = dict(causal=self.causal, scale=self.scale, relu=self.relu, lse=lse, reduction=self.reduction,
                       row_weights=row_weights)
        if topk_indices is None:
            return indexer_kl(q, k, q_idx, k_idx, weights, **options)
        return indexer_kl_topk(q, k, q_idx, k_idx, weights, topk_indices, **options)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, scale={self.scale}, relu={self.relu}, reduction={self.reduction!r}"
