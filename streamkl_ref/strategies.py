"""Public Hypothesis strategies for attention-KL implementations (needs the ``test`` extra).

``import streamkl_ref`` never imports this module (nor Hypothesis); ``import
streamkl_ref.strategies`` needs ``hypothesis`` (``pip install 'streamkl[test]'``).

A *problem* is one attention-KL input: ``q1 [B,H,NQ,D1]``, ``k1 [B,HK1,NK,D1]``,
``q2 [B,H,NQ,D2]``, ``k2 [B,HK2,NK,D2]`` plus ``causal, scale1, scale2`` (:class:`Problem`, NumPy
float64). Shapes stay tiny so that the mpmath ground truth is cheap; entries are bounded floats.

Strategies:

- :func:`shapes` — sizes with GQA per side (``H % H_K == 0``), ``D1 != D2`` and ``N_Q != N_K``
  (each can be turned off for an implementation that lacks it);
- :func:`scales` — ``None`` (``1/sqrt(D)``), ordinary scales, and with ``extreme=True`` scales that
  push logits to the hundreds (what breaks an LSE kept in low precision);
- :func:`problems` — a full problem from those (``causal`` drawn too);
- :func:`planted_problems` — a causal problem and a copy with NaN or ±inf planted where some
  rows cannot see it (keys past a row's causal frontier, or a query row, whose ``dK`` of keys it
  cannot see must stay clean): the isolation contract of docs/api.md;
- :func:`tiles` — score tiles with masks, for state-level (merge / update) tests.

Settings: :data:`PROFILES` holds the named profiles the project uses (``ci``: derandomised, 12
examples, no deadline; ``dev``: 30 examples; ``thorough``: 500); :func:`register_profiles` registers
them under ``streamkl-<name>`` for ``settings.load_profile``. Attention-KL examples are cheap but
not free (NumPy and mpmath per example), so the deadline is off and ``too_slow`` suppressed.

Tolerances for float64 implementations (:func:`kl_tolerance`): ``|x − ref| <= rel·|ref| +
ulps·eps·(1 + logit_scale)``: a relative part, plus the absolute rounding that forming and
cancelling logits of size ``logit_scale`` costs (the KL is a difference of quantities of that
size: ``Σ P1·(S1 − S2)`` against ``LSE1 − LSE2``). For torch implementations in lower precision
use :func:`streamkl_ref.testing.tolerance` instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ._checks import check_inputs
from ._dense import dense_scores

__all__ = [
    "EPS64", "EPS32", "Shape", "Problem", "Planted", "make_problem", "shapes", "scales", "problems",
    "planted_problems", "tiles", "ROWS", "logits", "logit_scale", "kl_tolerance", "assert_close_rows",
    "PROFILES", "register_profiles",
]

EPS64 = float(np.finfo(np.float64).eps)
EPS32 = float(np.finfo(np.float32).eps)

_COMMON = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILES = {
    "ci": settings(derandomize=True, max_examples=12, **_COMMON),
    "dev": settings(max_examples=30, **_COMMON),
    "thorough": settings(max_examples=500, **_COMMON),
}


def register_profiles(prefix: str = "streamkl-") -> list:
    """Register :data:`PROFILES` with Hypothesis as ``<prefix><name>``; returns the names."""
    names = []
    for name, prof in PROFILES.items():
        settings.register_profile(prefix + name, prof)
        names.append(prefix + name)
    return names


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


@dataclass(frozen=True)
class Shape:
    B: int
    H: int
    HK1: int
    HK2: int
    NQ: int
    NK: int
    D1: int
    D2: int


@st.composite
def shapes(draw, max_n=7, max_d=5, max_b=2, gqa=True, d1_ne_d2=True, nq_ne_nk=True, min_n=1):
    """Problem sizes: GQA per side (``H in {1, 2, 4}``, ``H_K`` dividing it), ``D1 != D2``,
    ``N_Q != N_K`` allowed; pass ``False`` to keep a feature out."""
    B = draw(st.integers(1, max_b))
    H = draw(st.sampled_from([1, 2, 4]))
    divisors = [d for d in (1, 2, 4) if H % d == 0] if gqa else [H]
    HK1, HK2 = draw(st.sampled_from(divisors)), draw(st.sampled_from(divisors))
    NQ = draw(st.integers(min_n, max_n))
    NK = draw(st.integers(min_n, max_n)) if nq_ne_nk else NQ
    D1 = draw(st.integers(1, max_d))
    D2 = draw(st.integers(1, max_d)) if d1_ne_d2 else D1
    return Shape(B, H, HK1, HK2, NQ, NK, D1, D2)


def scales(extreme=False):
    """``None`` (``1/sqrt(D)``) or a positive scale; ``extreme=True`` adds scales of 8..40 that,
    with entries of size ~2, give logits in the hundreds."""
    base = st.one_of(st.none(), st.floats(0.05, 2.0))
    return st.one_of(base, st.floats(8.0, 40.0)) if extreme else base


@st.composite
def problems(draw, max_n=7, max_d=5, max_b=2, amplitude=2.0, scales=True, extreme=False,
             gqa=True, d1_ne_d2=True, nq_ne_nk=True, causal=None):
    """Random small problems: GQA per side, D1 != D2 allowed, N_Q != N_K, causal or not.

    ``scales=False``: both scales ``None``; ``extreme=True``: also very large scales (see
    :func:`scales`); ``causal``: force it (``None``: drawn).
    """
    shape = draw(shapes(max_n=max_n, max_d=max_d, max_b=max_b, gqa=gqa, d1_ne_d2=d1_ne_d2, nq_ne_nk=nq_ne_nk))
    is_causal = draw(st.booleans()) if causal is None else bool(causal)
    elements = st.floats(-amplitude, amplitude, allow_nan=False, allow_infinity=False, allow_subnormal=False)

    def arr(shp):
        return draw(hnp.arrays(np.float64, shp, elements=elements))

    scale_st = _scales_fn(extreme) if scales else st.none()
    s = shape
    return Problem(
        q1=arr((s.B, s.H, s.NQ, s.D1)), k1=arr((s.B, s.HK1, s.NK, s.D1)),
        q2=arr((s.B, s.H, s.NQ, s.D2)), k2=arr((s.B, s.HK2, s.NK, s.D2)),
        causal=is_causal, scale1=draw(scale_st), scale2=draw(scale_st),
    )


_scales_fn = scales  # `problems` has an argument of that name


@dataclass
class Planted:
    """A clean problem, the same with planted values, and what the planted values cannot reach.

    ``rows_ok [N_Q]``: query rows whose KL, LSEs and ``dq1``/``dq2`` must equal the clean run's;
    ``keys_ok [N_K]``: keys whose ``dk1``/``dk2`` must (those no planted query row sees).
    """

    clean: Problem
    planted: Problem
    where: str  # "keys" or "queries"
    index: int
    value: float
    rows_ok: np.ndarray
    keys_ok: np.ndarray


@st.composite
def planted_problems(draw, max_n=8, max_d=4, max_b=2, where=None):
    """A causal problem with NaN / +inf / -inf planted in a key (of ``k1``, ``k2`` or both) or a
    query row (of ``q1``, ``q2`` or both) that at least one row (key) cannot see."""
    p = draw(problems(max_n=max_n, max_d=max_d, max_b=max_b, causal=True))
    d = p.dims
    off = d.NK - d.NQ
    where = draw(st.sampled_from(["keys", "queries"])) if where is None else where
    value = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    sides = draw(st.sampled_from([(1,), (2,), (1, 2)]))
    planted = Problem(*(x.copy() for x in p.inputs), **p.kw)
    if where == "keys":
        j = draw(st.integers(0, d.NK - 1))
        for side in sides:
            getattr(planted, f"k{side}")[:, :, j] = value
        rows_ok = np.arange(d.NQ) + off < j  # rows whose frontier stops before key j
        keys_ok = np.zeros(d.NK, bool)  # every key is seen by some row that sees key j (or none)
    else:
        i = draw(st.integers(0, d.NQ - 1))
        for side in sides:
            getattr(planted, f"q{side}")[:, :, i] = value
        rows_ok = np.arange(d.NQ) != i
        keys_ok = np.arange(d.NK) > i + off  # keys row i cannot see
        j = i
    return Planted(p, planted, where, int(j), value, rows_ok, keys_ok)


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
