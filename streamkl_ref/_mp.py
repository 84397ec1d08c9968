"""Attention KL in arbitrary precision (mpmath): the ground truth for small shapes.

Every input element is converted to an ``mpf`` exactly (a float64 is a dyadic rational), the
scale is the float64 value the other implementations use (``None`` -> the float64 nearest
``1/sqrt(D_t)``), taken as exact, so that comparisons measure only the arithmetic of the
implementation under test. All arithmetic is done at ``dps`` decimal digits: dot products with
``fdot``, ``LSE = log Σ exp(S)`` (mpmath has no overflow, so no max is subtracted), and
``KL = Σ_j P1·((S1 − LSE1) − (S2 − LSE2))``. Masking, GQA and empty rows follow docs/math.md exactly as
in :mod:`streamkl_ref._dense` (empty row: ``KL = 0``, ``LSE = −inf``).

Inputs may also be object arrays of ``mpf`` (or anything ``mpf`` accepts): the gradient tests
perturb inputs by far less than a float64 ulp and difference the results.
"""
from __future__ import annotations

import mpmath
import numpy as np

from ._checks import check_flag, check_inputs
from ._scores import visible

__all__ = ["attention_kl_mp"]


def _as_mp_input(x, name: str) -> np.ndarray:
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a real array, could not convert it: {exc}") from exc
    if arr.dtype.kind not in "fiuO":
        raise ValueError(f"{name} must hold real numbers (or mpf objects), got dtype {arr.dtype}")
    return arr


def _to_mpf(value):
    if isinstance(value, mpmath.mpf):
        return value
    if isinstance(value, (np.floating, np.integer)):
        value = value.item()
    return mpmath.mpf(value)


def attention_kl_mp(
    q1,
    k1,
    q2,
    k2,
    *,
    causal=False,
    scale1=None,
    scale2=None,
    return_lse=False,
    dps=50,
    return_mpf=False,
):
    """Per-row ``KL(P1 || P2)`` in mpmath at ``dps`` significant decimal digits.

    Same arguments and conventions as :func:`streamkl_ref.attention_kl` (bottom-right causal,
    GQA, empty rows give ``KL = 0`` and ``LSE = −inf``, NaN inputs give NaN rows), plus:

    Args:
        dps: working precision in decimal digits (>= 15).
        return_mpf: return object arrays of ``mpf`` (full precision) instead of float64 arrays.

    Returns:
        ``kl`` ``[B, H, N_Q]``, or ``(kl, lse1, lse2)`` with ``return_lse``; float64 (rounded
        from the mpf results), or object arrays of ``mpf`` with ``return_mpf``.

    Cost is ``O(B·H·N_Q·N_K·(D1 + D2))`` mpmath operations: meant for tiny shapes.
    """
    causal = check_flag(causal, "causal")
    arrays = [_as_mp_input(x, n) for x, n in ((q1, "q1"), (k1, "k1"), (q2, "q2"), (k2, "k2"))]
    dims = check_inputs(*arrays, scale1=scale1, scale2=scale2)
    if isinstance(dps, bool) or not isinstance(dps, int) or dps < 15:
        raise ValueError(f"dps must be an integer >= 15, got {dps!r}")
    q1, k1, q2, k2 = arrays
    mask = visible(np.arange(dims.NQ), np.arange(dims.NK), dims.NQ, dims.NK, causal)
    shape = (dims.B, dims.H, dims.NQ)
    kl_out = np.empty(shape, dtype=object)
    lse1_out = np.empty(shape, dtype=object)
    lse2_out = np.empty(shape, dtype=object)
    with mpmath.workdps(dps):
        sigma1, sigma2 = mpmath.mpf(dims.scale1), mpmath.mpf(dims.scale2)

        def rows_of(x):  # [B, Hx, N, D] -> nested lists of mpf vectors
            return [[[[_to_mpf(v) for v in x[b, h, n]] for n in range(x.shape[2])]
                     for h in range(x.shape[1])] for b in range(x.shape[0])]

        Q1, K1, Q2, K2 = rows_of(q1), rows_of(k1), rows_of(q2), rows_of(k2)
        neg_inf = mpmath.mpf("-inf")
        for b in range(dims.B):
            for h in range(dims.H):
                kh1, kh2 = h // dims.group1, h // dims.group2
                for i in range(dims.NQ):
                    keys = [j for j in range(dims.NK) if mask[i, j]]
                    if not keys:
                        kl_out[b, h, i], lse1_out[b, h, i], lse2_out[b, h, i] = mpmath.mpf(0), neg_inf, neg_inf
                        continue
                    s1 = [sigma1 * mpmath.fdot(Q1[b][h][i], K1[b][kh1][j]) for j in keys]
                    s2 = [sigma2 * mpmath.fdot(Q2[b][h][i], K2[b][kh2][j]) for j in keys]
                    lse1 = mpmath.log(mpmath.fsum(mpmath.exp(s) for s in s1))
                    lse2 = mpmath.log(mpmath.fsum(mpmath.exp(s) for s in s2))
                    log_p1 = [s - lse1 for s in s1]
                    log_p2 = [s - lse2 for s in s2]
                    kl_out[b, h, i] = mpmath.fsum(mpmath.exp(a) * (a - c) for a, c in zip(log_p1, log_p2))
                    lse1_out[b, h, i], lse2_out[b, h, i] = lse1, lse2
    outs = (kl_out, lse1_out, lse2_out)
    if not return_mpf:
        outs = tuple(np.array([float(v) for v in o.ravel()], dtype=np.float64).reshape(shape) for o in outs)
    return outs if return_lse else outs[0]
