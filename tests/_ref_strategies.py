"""Shared Hypothesis strategies and tolerances for the streamkl_ref tests.

A *problem* is one attention-KL input: ``q1 [B,H,NQ,D1]``, ``k1 [B,HK1,NK,D1]``,
``q2 [B,H,NQ,D2]``, ``k2 [B,HK2,NK,D2]`` plus ``causal, scale1, scale2``. Shapes stay tiny so that
the mpmath ground truth is cheap; entries are bounded floats.

Tolerances (see :func:`kl_tolerance`): every float64 implementation is compared with the
reference as ``|x − ref| <= rel·|ref| + ulps·eps·(1 + logit_scale)``: a relative part, plus the
absolute rounding that forming and cancelling logits of size ``logit_scale`` costs (the KL is a
difference of quantities of that size: ``Σ P1·(S1 − S2)`` against ``LSE1 − LSE2``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from streamkl_ref._checks import check_inputs
from streamkl_ref._dense import dense_scores

EPS64 = float(np.finfo(np.float64).eps)
EPS32 = float(np.finfo(np.float32).eps)


@dataclass
class Problem:
    q1: np.ndarray
    k1: np.ndarray
    q2: np.ndarray
    k2: np.ndarray
    causal: bool = False
    scale1: Optional[float] = None
    scale2: Optional[float] = None
    extra: dict = field(default_factory=dict)

    @property
    def inputs(self):
        return self.q1, self.k1, self.q2, self.k2

    @property
    def kw(self):
        return {"causal": self.causal, "scale1": self.scale1, "scale2": self.scale2}

    @property
    def dims(self):
        return check_inputs(*self.inputs, scale1=self.scale1, scale2=self.scale2)

    def __repr__(self):  # short, for Hypothesis failure reports
        d = self.dims
        return (f"Problem(B={d.B}, H={d.H}, HK1={d.HK1}, HK2={d.HK2}, NQ={d.NQ}, NK={d.NK}, "
                f"D1={d.D1}, D2={d.D2}, causal={self.causal}, scale1={self.scale1}, scale2={self.scale2}, "
                f"q1={self.q1.tolist()}, k1={self.k1.tolist()}, q2={self.q2.tolist()}, k2={self.k2.tolist()})")


def make_problem(seed=0, B=1, H=2, HK1=1, HK2=2, NQ=3, NK=4, D1=3, D2=2, causal=False,
                 scale1=None, scale2=None, amplitude=1.0) -> Problem:
    """A deterministic problem (for ``@example`` and fixed-shape tests)."""
    rng = np.random.default_rng(seed)
    return Problem(
        q1=amplitude * rng.standard_normal((B, H, NQ, D1)),
        k1=amplitude * rng.standard_normal((B, HK1, NK, D1)),
        q2=amplitude * rng.standard_normal((B, H, NQ, D2)),
        k2=amplitude * rng.standard_normal((B, HK2, NK, D2)),
        causal=causal, scale1=scale1, scale2=scale2,
    )


@st.composite
def problems(draw, max_n=7, max_d=5, max_b=2, amplitude=2.0, scales=True):
    """Random small problems: GQA per side, D1 != D2 allowed, N_Q != N_K, causal or not."""
    B = draw(st.integers(1, max_b))
    H = draw(st.sampled_from([1, 2, 4]))
    HK1 = draw(st.sampled_from([d for d in (1, 2, 4) if H % d == 0]))
    HK2 = draw(st.sampled_from([d for d in (1, 2, 4) if H % d == 0]))
    NQ = draw(st.integers(1, max_n))
    NK = draw(st.integers(1, max_n))
    D1 = draw(st.integers(1, max_d))
    D2 = draw(st.integers(1, max_d))
    causal = draw(st.booleans())
    elements = st.floats(-amplitude, amplitude, allow_nan=False, allow_infinity=False, allow_subnormal=False)

    def arr(shape):
        return draw(hnp.arrays(np.float64, shape, elements=elements))

    scale_st = st.one_of(st.none(), st.floats(0.05, 2.0)) if scales else st.none()
    return Problem(
        q1=arr((B, H, NQ, D1)), k1=arr((B, HK1, NK, D1)),
        q2=arr((B, H, NQ, D2)), k2=arr((B, HK2, NK, D2)),
        causal=causal, scale1=draw(scale_st), scale2=draw(scale_st),
    )


def logit_scale(problem: Problem) -> np.ndarray:
    """Per row ``[B, H, NQ]``: ``max |S_t|`` over the visible entries of both sides (0 if none)."""
    s1, s2, mask = dense_scores(*problem.inputs, problem.dims, problem.causal)
    big = np.maximum(np.abs(s1), np.abs(s2))
    return np.max(np.where(mask, big, 0.0), axis=-1, initial=0.0)


def kl_tolerance(ref, scale, *, rel=1e-12, ulps=64, eps=EPS64):
    """``rel·|ref| + ulps·eps·(1 + scale)`` (see the module docstring)."""
    return rel * np.abs(ref) + ulps * eps * (1.0 + scale)


def assert_close_rows(actual, ref, scale, *, rel=1e-12, ulps=64, eps=EPS64, what="kl"):
    """Row-wise comparison with :func:`kl_tolerance`; ``-inf`` must match ``-inf`` exactly."""
    actual = np.asarray(actual, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert actual.shape == ref.shape
    inf_a, inf_r = np.isneginf(actual), np.isneginf(ref)
    assert np.array_equal(inf_a, inf_r), f"{what}: -inf pattern differs"
    assert not np.isnan(actual).any() and not np.isnan(ref).any(), f"{what}: NaN"
    a, r = np.where(inf_r, 0.0, actual), np.where(inf_r, 0.0, ref)
    tol = kl_tolerance(r, scale, rel=rel, ulps=ulps, eps=eps)
    err = np.abs(a - r)
    worst = np.unravel_index(np.argmax(err - tol), err.shape) if err.size else None
    assert np.all(err <= tol), f"{what}: |err| {err[worst]:.3e} > tol {tol[worst]:.3e} at {worst}"


# ---- state-level tiles (merge / update tests) ----
ROWS = 3
logits = st.floats(-60, 60, allow_nan=False, allow_subnormal=False)


@st.composite
def tiles(draw, max_keys=10):
    """Scores ``[ROWS, N]`` of both sides and a mask (rows may be fully masked)."""
    n = draw(st.integers(1, max_keys))
    s1 = draw(hnp.arrays(np.float64, (ROWS, n), elements=logits))
    s2 = draw(hnp.arrays(np.float64, (ROWS, n), elements=logits))
    mask = draw(hnp.arrays(bool, (ROWS, n)))
    return s1, s2, mask
