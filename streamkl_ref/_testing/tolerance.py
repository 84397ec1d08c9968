"""The tolerance rule (one home: ``streamkl verify``, tests/_gpu_helpers.py and users' checks use
it): an output passes when its error against the float64 reference is at most ``C_TOL`` times the
error of the same math done densely at the inputs' precision, plus a floor per dtype; KL rows also
get an absolute allowance near 0 (docs/conformance.md derives it)."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np


C_TOL = 3.0
FLOOR = {"float32": 2e-6, "float16": 1e-3, "bfloat16": 8e-3, "float64": 1e-12}
# where the exact gradient is 0: a few fp32 roundings of O(1) terms
ZERO_GRAD_TOL = 1e-5
TOLERANCE_RULE = f"error <= {C_TOL} * error(same-precision dense PyTorch vs float64) + floor[dtype] {FLOOR}"


def _dtype_name(dtype) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in FLOOR:
        raise ValueError(f"dtype must be one of {sorted(FLOOR)}, got {dtype!r}")
    return name


def tolerance(same_precision_error: float, dtype, *, ratio: float = C_TOL, floor: Optional[float] = None) -> float:
    """The project's tolerance: ``ratio * same_precision_error + floor[dtype]``.

    ``same_precision_error``: the relative error against the float64 reference of the same math
    done densely at the inputs' precision (:func:`attention_kl_torch` with
    ``compute_dtype=dtype``); ``dtype``: a torch dtype or its name (``"float32"``, ``"float16"``,
    ``"bfloat16"``, ``"float64"``). The floor covers what the dense computation happens to get
    exactly right (rounding errors of a good kernel are not bounded by those of another order).
    """
    base = float(same_precision_error)
    if not base >= 0.0:  # NaN or negative
        raise ValueError(f"same_precision_error must be a non-negative number, got {same_precision_error!r}")
    return ratio * base + (FLOOR[_dtype_name(dtype)] if floor is None else float(floor))


# The KL near 0. A kernel forms each row's KL as a difference of terms the size of the logits
# (acc/l1 ~ E_P1[S1 - S2], LSE1, LSE2), kept in float32 (the row statistics of every kernel, for
# half inputs too): its rounding is absolute, about u * (|LSE1| + |LSE2| + |acc/l1|), however
# small the KL. Where the KL is 0 (one key) or tiny, no relative rule holds; each row gets this
# absolute allowance (docs/conformance.md, "The tolerance rule", derives it).
ROW_STAT_EPS = {"float32": 2.0 ** -24, "float16": 2.0 ** -24, "bfloat16": 2.0 ** -24, "float64": 2.0 ** -53}
KL_ROUNDING_ULPS = 8.0


def kl_row_floor(lse1, lse2, kl, dtype) -> np.ndarray:
    """Per-row absolute allowance of a KL row: ``KL_ROUNDING_ULPS * u * (1 + |LSE1| + |LSE2| +
    |KL + LSE1 - LSE2|)``, ``u`` the unit roundoff of float32 row statistics (float64's for
    float64); the last term is ``|acc/l1|``, the ``1`` the relative rounding of the sums ``l_t``
    (``ln(l (1 + d)) = ln l + d``). Rows that see no key (``LSE = -inf``) get 0: their KL is
    exactly 0."""
    lse1, lse2, kl = (np.asarray(_to_numpy(x), dtype=np.float64) for x in (lse1, lse2, kl))
    with np.errstate(invalid="ignore"):
        mag = 1.0 + np.abs(lse1) + np.abs(lse2) + np.abs(kl + lse1 - lse2)
    return np.where(np.isfinite(lse1) & np.isfinite(lse2), KL_ROUNDING_ULPS * ROW_STAT_EPS[_dtype_name(dtype)] * mag,
                    0.0)


def kl_error_and_tolerance(got, ref, same, row_floor, dtype) -> tuple:
    """``(error, tolerance)`` of KL rows: both on the scale ``S = max(‖ref‖, ‖row_floor‖)``, so
    the row passes iff ``‖got − ref‖ <= C_TOL ‖same − ref‖ + floor[dtype]·S + ‖row_floor‖``
    (``same``: the same-precision dense result). With ``‖ref‖`` well above the allowance this is
    :func:`tolerance` on relative errors plus ``‖row_floor‖/‖ref‖``; where the reference is 0 it
    is the absolute allowance alone."""
    a, r, s = (np.asarray(_to_numpy(x), dtype=np.float64) for x in (got, ref, same))
    if a.shape != r.shape:
        raise ValueError(f"shapes differ: {a.shape} vs reference {r.shape}")
    f = float(np.linalg.norm(np.asarray(row_floor, dtype=np.float64)))
    scale = max(float(np.linalg.norm(r)), f, 1e-300)
    err = math.inf if not np.isfinite(a).all() else float(np.linalg.norm(a - r)) / scale
    same_err = float(np.linalg.norm(s - r)) / scale if np.isfinite(s).all() else math.inf
    return err, tolerance(same_err, dtype) + f / scale


def relative_error(x, ref) -> float:
    """Relative Frobenius error ``‖x − ref‖ / ‖ref‖`` in float64; ``inf`` if ``x`` is not finite.

    A (numerically) all-zero reference is compared on a ``1e-12 · sqrt(n)`` scale, so 0/0 and
    tiny/tiny do not read as failures.
    """
    a = _to_numpy(x)
    r = np.asarray(_to_numpy(ref), dtype=np.float64)
    if a.shape != r.shape:
        raise ValueError(f"shapes differ: {a.shape} vs reference {r.shape}")
    if not np.isfinite(a).all():
        return math.inf
    denom = max(float(np.linalg.norm(r)), 1e-12 * math.sqrt(max(r.size, 1)))
    return float(np.linalg.norm(a - r)) / denom


def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        return x.detach().to("cpu").double().numpy()
    return np.asarray(x, dtype=np.float64)
