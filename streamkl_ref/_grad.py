"""Gradients of ``L = Σ_{b,h,i} g[b,h,i] · KL[b,h,i]`` with respect to ``q1, k1, q2, k2``.

With ``g`` the upstream gradient (any sign, may be 0):

- setting 1 (P1 fixed; train side 2): ``dS2 = g ⊙ (P2 − P1)``;
- setting 2 (P2 fixed; train side 1): ``dS1 = g ⊙ P1 ⊙ ((S1 − S2) − (LSE1 − LSE2) − KL)``;

these are the exact partial derivatives of ``L`` with respect to ``S2`` and ``S1``. Then, per
side ``t`` (:func:`scores_backward`, the one home of this step)::

    dQ_t = σ_t · dS_t · K_t        dK_t = σ_t · dS_tᵀ · Q_t

and with GQA the ``dK`` of a key head is the sum over the query heads that read it. The
log-ratio is always formed from logits and log-sum-exps, never as ``log(P1) − log(P2)``.
Masked entries and rows with no visible key get exactly zero gradient (selected away, never
multiplied by ``−inf``). A NaN in an input or in ``g`` reaches the gradients of the rows and
keys it touches and no others: a NaN or ±inf in a key reaches only the rows that see that key,
and one in a query row (or its ``g``) only that row and the ``dK`` of the keys it sees
(:func:`scores_backward`).

:func:`attention_kl_grad` materialises everything; :func:`attention_kl_grad_tiled` is the
tiled backward a kernel runs, recomputing ``P_t = exp(S_t − LSE_t)`` tile by tile from the
saved ``LSE1, LSE2`` (and ``KL``), storing nothing of size ``N_Q × N_K``.
"""
from __future__ import annotations

import numpy as np

from ._checks import check_block, check_flag, check_inputs, check_rows
from ._dense import dense_scores, kl_from_log_probs, masked_log_softmax, masked_probs
from ._scores import (
    as_float_array,
    check_float_dtype,
    expand_key_heads,
    finite_or_zero,
    reduce_key_heads,
    scaled_scores,
    tile_past_frontier,
    visible,
)

__all__ = ["attention_kl_grad", "attention_kl_grad_tiled", "scores_backward"]


def scores_backward(ds: np.ndarray, q: np.ndarray, k_expanded: np.ndarray, scale):
    """From ``dS [..., R, C]`` to ``(dQ [..., R, D], dK [..., C, D])`` for ``S = scale · Q Kᵀ``
    (per query head; reduce ``dK`` over a GQA group with ``reduce_key_heads``).

    ``ds`` must be exactly 0 at masked entries; the non-finite entries of ``q`` and ``k`` are
    zeroed in the products (:func:`~streamkl_ref._scores.finite_or_zero`), so a NaN key reaches
    only the rows that see it and a NaN query row only the keys it sees."""
    sigma = ds.dtype.type(scale)
    return (sigma * (ds @ finite_or_zero(k_expanded)),
            sigma * (np.swapaxes(ds, -1, -2) @ finite_or_zero(q)))


def _as_inputs(q1, k1, q2, k2, dtype=np.float64):
    return tuple(as_float_array(x, n, dtype) for x, n in ((q1, "q1"), (k1, "k1"), (q2, "q2"), (k2, "k2")))


def _as_row_array(x, name, dims, dtype):
    arr = as_float_array(x, name, dtype)
    check_rows(arr, name, dims)
    return arr


def attention_kl_grad(q1, k1, q2, k2, grad_kl, *, causal=False, scale1=None, scale2=None):
    """Closed-form gradient of ``Σ grad_kl · KL`` (both settings), materialised, float64.

    Args:
        q1, k1, q2, k2, causal, scale1, scale2: as :func:`streamkl_ref.attention_kl`.
        grad_kl: ``[B, H, N_Q]`` upstream gradient.

    Returns:
        ``{"dq1", "dk1", "dq2", "dk2"}``: float64 arrays shaped like the inputs
        (``dk_t`` like ``k_t``: summed over the query heads of its GQA group). Rows with no
        visible key contribute exactly 0. A NaN in an input or in ``grad_kl`` gives NaN in the
        gradients of the rows (and the keys those rows see) that it reaches.

    Raises:
        ValueError: naming the argument, for inconsistent shapes (``grad_kl`` included) or a bad
        scale.
    """
    causal = check_flag(causal, "causal")
    q1, k1, q2, k2 = _as_inputs(q1, k1, q2, k2)
    dims = check_inputs(q1, k1, q2, k2, scale1=scale1, scale2=scale2)
    g = _as_row_array(grad_kl, "grad_kl", dims, np.float64)[..., None]
    s1, s2, mask = dense_scores(q1, k1, q2, k2, dims, causal)
    log_p1, _ = masked_log_softmax(s1, mask)
    log_p2, _ = masked_log_softmax(s2, mask)
    p1, p2 = masked_probs(log_p1, mask), masked_probs(log_p2, mask)
    kl = kl_from_log_probs(log_p1, log_p2, mask)[..., None]
    # (S1 − S2) − (LSE1 − LSE2) regrouped as log P1 − log P2, each formed from logits as
    # (S − m) − log l: the same number, with the large terms cancelled first.
    ds1 = np.where(mask, g * p1 * ((log_p1 - log_p2) - kl), 0.0)
    ds2 = np.where(mask, g * (p2 - p1), 0.0)
    dq1, dk1 = scores_backward(ds1, q1, expand_key_heads(k1, dims.group1), dims.scale1)
    dq2, dk2 = scores_backward(ds2, q2, expand_key_heads(k2, dims.group2), dims.scale2)
    return {
        "dq1": dq1,
        "dk1": reduce_key_heads(dk1, dims.group1),
        "dq2": dq2,
        "dk2": reduce_key_heads(dk2, dims.group2),
    }


def _tile_probs(s, lse_rows, mask):
    """``P = exp(S − LSE)`` on the tile's visible entries, 0 elsewhere (LSE of a row with no key
    is ``−inf``; such rows have no visible entry, and a finite stand-in keeps ``exp`` harmless)."""
    dtype = s.dtype.type
    lse = np.where(lse_rows == -np.inf, dtype(0), lse_rows)[..., None]
    return np.where(mask, np.exp(np.where(mask, s, lse) - lse), dtype(0))


def attention_kl_grad_tiled(
    q1,
    k1,
    q2,
    k2,
    grad_kl,
    lse1,
    lse2,
    kl,
    *,
    causal=False,
    scale1=None,
    scale2=None,
    block_q=16,
    block_k=16,
    dtype=np.float64,
    settings=("1", "2"),
):
    """The tiled backward a kernel runs, from the forward's saved ``lse1, lse2, kl`` (nats).

    Two passes, like FlashAttention's Triton backward (no atomics):

    - key-tile pass: for each ``block_k`` key tile, walk the query blocks, recompute the
      ``block_q x block_k`` tiles of ``S1, S2``, ``P_t = exp(S_t − LSE_t)`` and ``dS_t``, and
      accumulate ``dK_t`` for that key tile;
    - query-tile pass: for each query block, walk the key tiles and accumulate ``dQ_t``.

    Tiles past the causal frontier are skipped; partial tiles are masked. Setting 1 needs
    ``lse1, lse2``; setting 2 also ``kl``, through the per-row offset
    ``(LSE1 − LSE2) + KL`` in ``dS1 = g·P1·((S1 − S2) − offset)``.

    Args:
        q1, k1, q2, k2, causal, scale1, scale2: as :func:`streamkl_ref.attention_kl`.
        grad_kl, lse1, lse2, kl: ``[B, H, N_Q]``.
        block_q, block_k: tile sizes (positive integers).
        dtype: ``np.float64`` or ``np.float32``: the arithmetic of every step.
        settings: any non-empty subset of ``("1", "2")``: ``"1"`` gives ``dq2, dk2``,
            ``"2"`` gives ``dq1, dk1``.

    Returns:
        Dict with the requested settings' gradients, arrays of ``dtype``.
    """
    causal = check_flag(causal, "causal")
    arrays = _as_inputs(q1, k1, q2, k2)
    dims = check_inputs(*arrays, scale1=scale1, scale2=scale2)
    block_q = check_block(block_q, "block_q")
    block_k = check_block(block_k, "block_k")
    dtype = check_float_dtype(dtype)
    if isinstance(settings, str):
        settings = (settings,)
    try:
        wanted = set(settings)
    except TypeError as exc:
        raise ValueError(f"settings must be a collection of '1' and/or '2', got {settings!r}") from exc
    if not wanted or not wanted <= {"1", "2"}:
        raise ValueError(f"settings must be a non-empty subset of ('1', '2'), got {settings!r}")
    g = _as_row_array(grad_kl, "grad_kl", dims, dtype)
    lse1 = _as_row_array(lse1, "lse1", dims, dtype)
    lse2 = _as_row_array(lse2, "lse2", dims, dtype)
    kl = _as_row_array(kl, "kl", dims, dtype)
    q1, k1, q2, k2 = (x.astype(dtype) for x in arrays)
    k1e, k2e = expand_key_heads(k1, dims.group1), expand_key_heads(k2, dims.group2)
    NQ, NK = dims.NQ, dims.NK
    zero = dtype(0)
    # per-row offset of setting 2: (LSE1 − LSE2) + KL; rows with no key (LSE = −inf) get 0
    empty = lse1 == -np.inf
    lse1_safe = np.where(empty, zero, lse1)
    lse2_safe = np.where(lse2 == -np.inf, zero, lse2)
    offset = np.where(empty, zero, (lse1_safe - lse2_safe) + kl)

    def tile_ds(r0, r1, c0, c1):
        """``(dS1, dS2)`` of one tile (``None`` for a setting not requested), masked entries 0."""
        rows = slice(r0, r1)
        mask = visible(np.arange(r0, r1), np.arange(c0, c1), NQ, NK, causal)
        s1 = scaled_scores(q1[:, :, rows], k1e[:, :, c0:c1], dims.scale1)
        s2 = scaled_scores(q2[:, :, rows], k2e[:, :, c0:c1], dims.scale2)
        p1 = _tile_probs(s1, lse1[:, :, rows], mask)
        g_rows = g[:, :, rows, None]
        ds1 = ds2 = None
        if "1" in wanted:
            p2 = _tile_probs(s2, lse2[:, :, rows], mask)
            ds2 = np.where(mask, g_rows * (p2 - p1), zero)
        if "2" in wanted:
            log_ratio = np.where(mask, s1, zero) - np.where(mask, s2, zero) - offset[:, :, rows, None]
            ds1 = np.where(mask, g_rows * p1 * log_ratio, zero)
        return ds1, ds2

    def tiles(n, block):
        return [(a, min(a + block, n)) for a in range(0, n, block)]

    dq1, dq2 = np.zeros_like(q1), np.zeros_like(q2)
    dk1e, dk2e = np.zeros_like(k1e), np.zeros_like(k2e)
    # key-tile pass: dK
    for c0, c1 in tiles(NK, block_k):
        dk1_acc = np.zeros_like(k1e[:, :, c0:c1])
        dk2_acc = np.zeros_like(k2e[:, :, c0:c1])
        for r0, r1 in tiles(NQ, block_q):
            if causal and tile_past_frontier(r0, r1, c0, NQ, NK):
                continue
            ds1, ds2 = tile_ds(r0, r1, c0, c1)
            if ds1 is not None:
                dk1_acc += scores_backward(ds1, q1[:, :, r0:r1], k1e[:, :, c0:c1], dims.scale1)[1]
            if ds2 is not None:
                dk2_acc += scores_backward(ds2, q2[:, :, r0:r1], k2e[:, :, c0:c1], dims.scale2)[1]
        dk1e[:, :, c0:c1], dk2e[:, :, c0:c1] = dk1_acc, dk2_acc
    # query-tile pass: dQ
    for r0, r1 in tiles(NQ, block_q):
        for c0, c1 in tiles(NK, block_k):
            if causal and tile_past_frontier(r0, r1, c0, NQ, NK):
                break  # every later key tile is further past the frontier
            ds1, ds2 = tile_ds(r0, r1, c0, c1)
            if ds1 is not None:
                dq1[:, :, r0:r1] += scores_backward(ds1, q1[:, :, r0:r1], k1e[:, :, c0:c1], dims.scale1)[0]
            if ds2 is not None:
                dq2[:, :, r0:r1] += scores_backward(ds2, q2[:, :, r0:r1], k2e[:, :, c0:c1], dims.scale2)[0]
    out = {}
    if "2" in wanted:
        out["dq1"], out["dk1"] = dq1, reduce_key_heads(dk1e, dims.group1)
    if "1" in wanted:
        out["dq2"], out["dk2"] = dq2, reduce_key_heads(dk2e, dims.group2)
    return out
