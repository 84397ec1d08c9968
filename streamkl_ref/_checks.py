"""Input validation shared by streamkl_ref and streamkl_gpu (one home for the shape rules).

Works on anything with ``.ndim`` and ``.shape`` (NumPy arrays, torch tensors), so importing it
never needs torch. Every error is a ``ValueError`` that names the offending argument.
Conventions: docs/math.md (shapes ``[B, H, N, D]``, GQA per side).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

__all__ = [
    "Dims",
    "IndexerDims",
    "check_inputs",
    "check_indexer_inputs",
    "check_shape",
    "check_block",
    "check_flag",
    "check_rows",
    "resolve_scale",
]


@dataclass(frozen=True)
class Dims:
    """The sizes of one attention-KL problem, after validation."""

    B: int  # batch
    H: int  # query heads (shared by both sides)
    NQ: int  # query rows
    NK: int  # key rows
    D1: int  # head dim of side 1 (q1, k1)
    D2: int  # head dim of side 2 (q2, k2)
    HK1: int  # key heads of side 1 (GQA: query head h reads key head h // (H // HK1))
    HK2: int  # key heads of side 2
    scale1: float  # sigma_1 (resolved: None -> 1/sqrt(D1))
    scale2: float  # sigma_2

    @property
    def group1(self) -> int:
        return self.H // self.HK1

    @property
    def group2(self) -> int:
        return self.H // self.HK2


def resolve_scale(scale, head_dim: int, name: str) -> float:
    """``None`` -> ``1/sqrt(head_dim)``; otherwise a finite, positive real number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, Real):
        raise ValueError(f"{name} must be a positive finite real number or None, got {scale!r}")
    value = float(scale)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be positive and finite, got {scale!r}")
    return value


def _shape4(x, name: str) -> tuple[int, int, int, int]:
    ndim = getattr(x, "ndim", None)
    if ndim is None:
        raise ValueError(f"{name} must be an array or tensor, got {type(x).__name__}")
    if ndim != 4:
        raise ValueError(f"{name} must have 4 dimensions [B, H, N, D], got {ndim} (shape {tuple(x.shape)})")
    return tuple(int(s) for s in x.shape)


def check_inputs(q1, k1, q2, k2, *, scale1=None, scale2=None) -> Dims:
    """Validate the four inputs against each other and return the problem's sizes."""
    B, H, NQ, D1 = _shape4(q1, "q1")
    Bk1, HK1, NK, Dk1 = _shape4(k1, "k1")
    Bq2, H2, NQ2, D2 = _shape4(q2, "q2")
    Bk2, HK2, NK2, Dk2 = _shape4(k2, "k2")
    for name, b in (("k1", Bk1), ("q2", Bq2), ("k2", Bk2)):
        if b != B:
            raise ValueError(f"{name} has batch size {b}, but q1 has {B}: both sides share B")
    if H2 != H:
        raise ValueError(f"q2 has {H2} query heads, but q1 has {H}: both sides share H")
    if NQ2 != NQ:
        raise ValueError(f"q2 has {NQ2} query rows, but q1 has {NQ}: both sides share N_Q")
    if NK2 != NK:
        raise ValueError(f"k2 has {NK2} key rows, but k1 has {NK}: both sides share N_K")
    if Dk1 != D1:
        raise ValueError(f"k1 has head dim {Dk1}, but q1 has {D1}: q and k of a side share D")
    if Dk2 != D2:
        raise ValueError(f"k2 has head dim {Dk2}, but q2 has {D2}: q and k of a side share D")
    if H < 1:
        raise ValueError(f"q1 has {H} query heads; a problem needs at least one head (H >= 1)")
    for name, hk in (("k1", HK1), ("k2", HK2)):
        if hk < 1:
            raise ValueError(f"{name} has {hk} key heads; each side needs at least one (H_K >= 1)")
        if H % hk != 0:
            raise ValueError(
                f"{name} has {hk} key heads, which does not divide the {H} query heads (GQA needs H % H_K == 0)"
            )
    for name, d in (("q1", D1), ("q2", D2)):
        if d < 1:
            raise ValueError(f"{name} has head dim {d}; it must be at least 1")
    return Dims(
        B=B, H=H, NQ=NQ, NK=NK, D1=D1, D2=D2, HK1=HK1, HK2=HK2,
        scale1=resolve_scale(scale1, D1, "scale1"),
        scale2=resolve_scale(scale2, D2, "scale2"),
    )


def check_flag(value, name: str) -> bool:
    """A flag (``causal``, ``relu``): a ``bool`` or ``numpy.bool_``; a string, None, a number or a
    tensor is an error, never silently truthy (the message streamkl_gpu uses)."""
    import numpy as np

    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name} must be a bool, got {value!r} of type {type(value).__name__}")


def check_block(value, name: str) -> int:
    """A tile size: a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_rows(x, name: str, dims: Dims) -> tuple[int, int, int]:
    """A per-query-row array (``grad_kl``, ``lse1``, ``lse2``, ``kl``): shape ``[B, H, N_Q]``."""
    ndim = getattr(x, "ndim", None)
    if ndim is None:
        raise ValueError(f"{name} must be an array or tensor, got {type(x).__name__}")
    shape = tuple(int(s) for s in x.shape)
    want = (dims.B, dims.H, dims.NQ)
    if shape != want:
        raise ValueError(f"{name} must have shape [B, H, N_Q] = {list(want)}, got {list(shape)}")
    return shape


@dataclass(frozen=True)
class IndexerDims:
    """The sizes of one indexer-loss problem (teacher ``q, k``; student ``q_idx, k_idx, weights``)."""

    B: int  # batch
    H: int  # teacher query heads (the target averages their attention)
    HK: int  # teacher key heads (GQA: head h reads key head h // (H // HK))
    NQ: int  # query rows
    NK: int  # key rows
    D: int  # teacher head dim
    HI: int  # indexer query heads
    HKI: int  # indexer key heads (usually 1)
    DI: int  # indexer head dim
    scale: float  # teacher sigma (resolved: None -> 1/sqrt(D))

    @property
    def group(self) -> int:
        return self.H // self.HK

    @property
    def group_idx(self) -> int:
        return self.HI // self.HKI


def check_shape(x, name: str, want: tuple, label: str) -> tuple:
    """``x`` must have exactly the shape ``want``; ``label`` spells it (e.g. ``"[B, N_Q]"``)."""
    ndim = getattr(x, "ndim", None)
    if ndim is None:
        raise ValueError(f"{name} must be an array or tensor, got {type(x).__name__}")
    shape = tuple(int(s) for s in x.shape)
    if shape != tuple(want):
        raise ValueError(f"{name} must have shape {label} = {list(want)}, got {list(shape)}")
    return shape


def check_indexer_inputs(q, k, q_idx, k_idx, weights, *, scale=None) -> IndexerDims:
    """Validate the five inputs of the indexer loss against each other; return the sizes.

    ``q [B, H, N_Q, D]``, ``k [B, H_K, N_K, D]`` (``H % H_K == 0``), ``q_idx [B, H_I, N_Q, D_I]``,
    ``k_idx [B, H_KI, N_K, D_I]`` (``H_I % H_KI == 0``), ``weights [B, H_I, N_Q]``.
    """
    B, H, NQ, D = _shape4(q, "q")
    Bk, HK, NK, Dk = _shape4(k, "k")
    Bqi, HI, NQi, DI = _shape4(q_idx, "q_idx")
    Bki, HKI, NKi, DIk = _shape4(k_idx, "k_idx")
    for name, b in (("k", Bk), ("q_idx", Bqi), ("k_idx", Bki)):
        if b != B:
            raise ValueError(f"{name} has batch size {b}, but q has {B}: teacher and indexer share B")
    if NQi != NQ:
        raise ValueError(f"q_idx has {NQi} query rows, but q has {NQ}: teacher and indexer share N_Q")
    if NKi != NK:
        raise ValueError(f"k_idx has {NKi} key rows, but k has {NK}: teacher and indexer share N_K")
    if Dk != D:
        raise ValueError(f"k has head dim {Dk}, but q has {D}: the teacher's q and k share D")
    if DIk != DI:
        raise ValueError(f"k_idx has head dim {DIk}, but q_idx has {DI}: the indexer's q_idx and k_idx share D_I")
    for name, d in (("q", D), ("q_idx", DI)):
        if d < 1:
            raise ValueError(f"{name} has head dim {d}; it must be at least 1")
    for name, heads, label in (("q", H, "H"), ("k", HK, "H_K"), ("q_idx", HI, "H_I"), ("k_idx", HKI, "H_KI")):
        if heads < 1:
            raise ValueError(f"{name} has {heads} heads; it needs at least one ({label} >= 1)")
    if HK < 1 or H % HK != 0:
        raise ValueError(f"k has {HK} key heads, which does not divide the {H} query heads of q (H % H_K == 0)")
    if HKI < 1 or HI % HKI != 0:
        raise ValueError(
            f"k_idx has {HKI} key heads, which does not divide the {HI} query heads of q_idx (H_I % H_KI == 0)"
        )
    wdim = getattr(weights, "ndim", None)
    if wdim is None:
        raise ValueError(f"weights must be an array or tensor, got {type(weights).__name__}")
    check_shape(weights, "weights", (B, HI, NQ), "[B, H_I, N_Q]")
    return IndexerDims(
        B=B, H=H, HK=HK, NQ=NQ, NK=NK, D=D, HI=HI, HKI=HKI, DI=DI,
        scale=resolve_scale(scale, D, "scale"),
    )
