"""Problems for the indexer-loss tests (reference here; the GPU tests may import these too).

An *indexer problem* is teacher ``q [B,H,NQ,D]``, ``k [B,HK,NK,D]`` and student
``q_idx [B,HI,NQ,DI]``, ``k_idx [B,HKI,NK,DI]``, ``weights [B,HI,NQ]`` plus ``causal, scale,
relu``. Shapes stay tiny so the mpmath ground truth is cheap; entries are bounded floats.

Tolerance scale (:func:`indexer_logit_scale`): per row, the largest visible ``|S_h|`` and
``|I|``. The KL is ``Σ p log p − Σ p·I + LSE_I``: terms of that size cancel, so a float
computation of it errs by a few ulps of ``1 + scale`` (use ``streamkl_ref.strategies.kl_tolerance``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from streamkl_ref._checks import check_indexer_inputs
from streamkl_ref._indexer import indexer_logits
from streamkl_ref._scores import expand_key_heads, scaled_scores, visible

NAMES = ("q", "k", "q_idx", "k_idx", "weights")
GRADS = ("dq_idx", "dk_idx", "dweights")  # gradients of inputs 2, 3, 4


@dataclass
class IndexerProblem:
    q: np.ndarray
    k: np.ndarray
    q_idx: np.ndarray
    k_idx: np.ndarray
    weights: np.ndarray
    causal: bool = False
    scale: Optional[float] = None
    relu: bool = True

    @property
    def inputs(self):
        return self.q, self.k, self.q_idx, self.k_idx, self.weights

    @property
    def kw(self):
        return {"causal": self.causal, "scale": self.scale, "relu": self.relu}

    @property
    def dims(self):
        return check_indexer_inputs(*self.inputs, scale=self.scale)

    @property
    def mask(self):
        d = self.dims
        return visible(np.arange(d.NQ), np.arange(d.NK), d.NQ, d.NK, self.causal)

    def __repr__(self):  # short, for Hypothesis failure reports
        d = self.dims
        arrays = ", ".join(f"{n}={x.tolist()}" for n, x in zip(NAMES, self.inputs))
        return (f"IndexerProblem(B={d.B}, H={d.H}, HK={d.HK}, HI={d.HI}, HKI={d.HKI}, NQ={d.NQ}, "
                f"NK={d.NK}, D={d.D}, DI={d.DI}, causal={self.causal}, scale={self.scale}, "
                f"relu={self.relu}, {arrays})")


def make_indexer_problem(seed=0, B=1, H=2, HK=1, HI=2, HKI=1, NQ=3, NK=4, D=3, DI=2, causal=False,
                         scale=None, relu=True, amplitude=1.0, weight_amplitude=1.0) -> IndexerProblem:
    """A deterministic problem (for ``@example`` and fixed-shape tests)."""
    rng = np.random.default_rng(seed)
    return IndexerProblem(
        q=amplitude * rng.standard_normal((B, H, NQ, D)),
        k=amplitude * rng.standard_normal((B, HK, NK, D)),
        q_idx=amplitude * rng.standard_normal((B, HI, NQ, DI)),
        k_idx=amplitude * rng.standard_normal((B, HKI, NK, DI)),
        weights=weight_amplitude * rng.standard_normal((B, HI, NQ)),
        causal=causal, scale=scale, relu=relu,
    )


@st.composite
def indexer_problems(draw, max_n=6, max_d=4, max_b=2, amplitude=2.0):
    """Random small problems: GQA/MQA on both sides, N_Q != N_K, causal or not, relu on/off."""
    B = draw(st.integers(1, max_b))
    H = draw(st.sampled_from([1, 2, 4]))
    HK = draw(st.sampled_from([d for d in (1, 2, 4) if H % d == 0]))
    HI = draw(st.sampled_from([1, 2, 3]))
    HKI = draw(st.sampled_from([d for d in (1, 3) if HI % d == 0]))
    NQ = draw(st.integers(1, max_n))
    NK = draw(st.integers(1, max_n))
    D = draw(st.integers(1, max_d))
    DI = draw(st.integers(1, max_d))
    elements = st.floats(-amplitude, amplitude, allow_nan=False, allow_infinity=False, allow_subnormal=False)

    def arr(shape):
        return draw(hnp.arrays(np.float64, shape, elements=elements))

    return IndexerProblem(
        q=arr((B, H, NQ, D)), k=arr((B, HK, NK, D)),
        q_idx=arr((B, HI, NQ, DI)), k_idx=arr((B, HKI, NK, DI)), weights=arr((B, HI, NQ)),
        causal=draw(st.booleans()), scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
        relu=draw(st.booleans()),
    )


def indexer_logit_scale(problem: IndexerProblem) -> np.ndarray:
    """Per row ``[B, NQ]``: ``max(|S_h|, |I|)`` over the visible entries and teacher heads (0 if
    none), with ``|I|`` bounded by ``Σ_j |weights_j · a_j|`` (the size of its rounded terms)."""
    d = problem.dims
    q, k, q_idx, k_idx, weights = problem.inputs
    s = np.abs(scaled_scores(q, expand_key_heads(k, d.group), d.scale)).max(axis=1)
    terms, _ = indexer_logits(np.abs(q_idx), np.abs(expand_key_heads(k_idx, d.group_idx)), np.abs(weights), False)
    return np.max(np.where(problem.mask, np.maximum(s, terms), 0.0), axis=-1, initial=0.0)
