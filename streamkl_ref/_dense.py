"""Materialised attention KL: the whole ``[N_Q, N_K]`` score matrix at once, in float64.

This is the plain, numerically careful reference that the streaming code is checked against.

- Row log-sum-exp with the row maximum ``m`` subtracted, and log-probabilities as
  ``(S_t − m_t) − log l_t`` (:func:`masked_log_softmax`): probabilities are never logged.
- ``KL[i] = Σ_j P1[i,j] · (logP1[i,j] − logP2[i,j])`` over visible entries only; masked entries
  contribute exactly 0 (they are selected away, never multiplied), and a row with no visible key
  has ``KL = 0`` and ``LSE = −inf`` (decided from the mask, never from the values, so a NaN stays
  a NaN).
- Natural logarithms (nats) throughout.
- NaN in an input yields NaN in every row whose visible scores it reaches (a NaN in ``q_t[b,h,i]``
  poisons row ``i``; a NaN in ``k_t[b,g,j]`` poisons the rows that see key ``j`` in the heads that
  read key head ``g``); rows it does not reach are unaffected, bit for bit. The same isolation
  holds for ±inf (an infinite key a row cannot see never reaches it); what ±inf in an entry a
  row *does* see gives is outside the contract.

Every helper here works in whatever float dtype it is handed (tests use float32 to measure the
rounding a float32 computation makes); the public :func:`attention_kl` always uses float64.
"""
from __future__ import annotations

import numpy as np

from ._checks import Dims, check_flag, check_inputs
from ._scores import as_float_array, expand_key_heads, scaled_scores, visible

__all__ = [
    "attention_kl",
    "dense_scores",
    "dense_kl_lse",
    "masked_log_softmax",
    "masked_logsumexp",
    "masked_probs",
    "kl_from_log_probs",
]


def dense_scores(q1, k1, q2, k2, dims: Dims, causal: bool, dtype=np.float64):
    """``(S1, S2, mask)``: scores ``[B, H, N_Q, N_K]`` in ``dtype`` and the visibility mask
    ``[N_Q, N_K]`` (``True`` = visible; masked scores are left as computed, not set to ``-inf``)."""
    q1 = as_float_array(q1, "q1", dtype)
    k1 = as_float_array(k1, "k1", dtype)
    q2 = as_float_array(q2, "q2", dtype)
    k2 = as_float_array(k2, "k2", dtype)
    s1 = scaled_scores(q1, expand_key_heads(k1, dims.group1), dims.scale1)
    s2 = scaled_scores(q2, expand_key_heads(k2, dims.group2), dims.scale2)
    mask = visible(np.arange(dims.NQ), np.arange(dims.NK), dims.NQ, dims.NK, causal)
    return s1, s2, mask


def masked_log_softmax(s: np.ndarray, mask: np.ndarray):
    """``(log_p, lse)`` per row over the visible entries.

    With ``m`` the row maximum and ``l = Σ exp(s − m)``: ``log_p = (s − m) − log l`` (0, a
    placeholder never used, at masked entries) and ``lse = m + log l`` (``−inf`` for rows with no
    visible entry). Forming ``log_p`` from ``s − m`` rather than ``s − lse`` keeps it accurate to
    rounding relative to ``|log_p|`` instead of ``|lse|``, which matters when logits are large.
    """
    neg_inf = s.dtype.type(-np.inf)
    row_has_key = mask.any(axis=-1)
    row_max = np.max(np.where(mask, s, neg_inf), axis=-1, initial=neg_inf)
    ref = np.where(row_has_key, row_max, 0)[..., None]  # any finite value for empty rows
    shifted = np.where(mask, s, ref) - ref  # masked entries -> 0, never -inf - -inf
    total = np.sum(np.where(mask, np.exp(shifted), 0), axis=-1)
    log_total = np.log(np.where(row_has_key, total, 1))
    lse = np.where(row_has_key, ref[..., 0] + log_total, neg_inf)
    log_p = np.where(mask, shifted - log_total[..., None], 0)
    return log_p, lse


def masked_logsumexp(s: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``log Σ_{visible j} exp(s[..., j])`` per row, max-subtracted; ``−inf`` for empty rows."""
    return masked_log_softmax(s, mask)[1]


def masked_probs(log_p: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``exp(log_p)`` at visible entries, exactly 0 at masked ones."""
    return np.where(mask, np.exp(np.where(mask, log_p, 0)), 0)


def kl_from_log_probs(log_p1: np.ndarray, log_p2: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``Σ_j P1 · (logP1 − logP2)`` over visible entries (0 for rows with none)."""
    p1 = masked_probs(log_p1, mask)
    return np.sum(np.where(mask, p1 * (log_p1 - log_p2), 0), axis=-1)


def dense_kl_lse(q1, k1, q2, k2, dims: Dims, causal: bool, dtype=np.float64):
    """``(KL, LSE1, LSE2)``, each ``[B, H, N_Q]``, every step in ``dtype``."""
    s1, s2, mask = dense_scores(q1, k1, q2, k2, dims, causal, dtype)
    log_p1, lse1 = masked_log_softmax(s1, mask)
    log_p2, lse2 = masked_log_softmax(s2, mask)
    return kl_from_log_probs(log_p1, log_p2, mask), lse1, lse2


def attention_kl(q1, k1, q2, k2, *, causal=False, scale1=None, scale2=None, return_lse=False):
    """Per-row ``KL(P1 || P2)`` of two attention distributions, materialised, in float64.

    Args:
        q1: ``[B, H, N_Q, D1]`` side-1 queries. k1: ``[B, H_K1, N_K, D1]`` side-1 keys.
        q2: ``[B, H, N_Q, D2]`` side-2 queries. k2: ``[B, H_K2, N_K, D2]`` side-2 keys.
        causal: bottom-right aligned causal mask (key ``j`` visible to query ``i`` iff
            ``j <= i + N_K - N_Q``).
        scale1, scale2: score scales; ``None`` means ``1/sqrt(D_t)``.
        return_lse: also return the natural-log row log-sum-exps.

    Returns:
        ``kl`` ``[B, H, N_Q]`` float64 (nats), or ``(kl, lse1, lse2)`` with ``return_lse``.
        Rows with no visible key: ``kl = 0``, ``lse = -inf``. Inputs of any real dtype are
        upcast to float64 first. A NaN input gives NaN in exactly the rows it reaches.

    Raises:
        ValueError: naming the offending argument, for inconsistent shapes or a bad scale.
    """
    causal = check_flag(causal, "causal")
    q1, k1, q2, k2 = (as_float_array(x, n) for x, n in ((q1, "q1"), (k1, "k1"), (q2, "q2"), (k2, "k2")))
    dims = check_inputs(q1, k1, q2, k2, scale1=scale1, scale2=scale2)
    kl, lse1, lse2 = dense_kl_lse(q1, k1, q2, k2, dims, causal)
    return (kl, lse1, lse2) if return_lse else kl
