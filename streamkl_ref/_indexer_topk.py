"""The sparse stage's indexer loss: the KL over each row's selected keys (top-k), both the
head-averaged teacher and the student renormalised over the set (DeepSeek-V3.2's sparse training
stage; Megatron-LM's ``compute_dsa_indexer_loss(..., sparse_loss=True)``).

Per row ``t`` with ``S_t`` = the keys listed in ``topk_indices[b, t]`` (``-1`` = unused slot) that
the row sees (bottom-right causal):

    P_h^S = softmax over S_t of σ q_h k_{h//g}ᵀ    (each teacher head's LSE over the set)
    p_S   = (1/H) Σ_h P_h^S                         (the head mean; sums to 1 over S_t)
    q_S   = softmax over S_t of I                   (I as in :func:`indexer_kl`)
    KL_t  = Σ_{s∈S_t} p_S (log p_S − log q_S)       (0 log 0 = 0; an empty set gives 0)

This is Megatron's order (mask the scores with the set, softmax per head, sum over heads,
L1-normalise) without its ``clamp(min=tiny)`` before the logarithms. It is not the full-row mixture
restricted to the set: a key's teacher mass off the set never enters. When every visible key is
listed it is :func:`indexer_kl`. Inputs are checked: each key at most once per row (Megatron's
``scatter_`` would count a repeated key once; here it is a ``ValueError``), values in ``[-1, N_K)``.
NaN isolation: a NaN reaches exactly the rows whose set (or whose own query) holds it.

:func:`indexer_kl_topk` materialises in float64 (scores over all keys, the set as a mask);
:func:`indexer_kl_topk_mp` is the mpmath definition, per row over the listed keys (tiny shapes);
:func:`indexer_kl_topk_grad` is the closed-form gradient (statement 9's forms with
``G = g·(q_S − p_S)`` on the set, 0 elsewhere; ``dk_idx`` a scatter-add over the rows).
"""
from __future__ import annotations

import mpmath
import numpy as np

from ._checks import IndexerDims, check_flag, check_indexer_inputs
from ._dense import kl_from_log_probs, masked_log_softmax
from ._indexer import (
    _NAMES,
    _check_relu,
    _dense_parts,
    _grad_from_parts,
    _row_array,
    check_indexer_call,
    teacher_log_target,
)
from ._mp import _as_mp_input, _to_mpf
from ._scores import expand_key_heads, scaled_scores, visible

__all__ = ["indexer_kl_topk", "indexer_kl_topk_mp", "indexer_kl_topk_grad", "topk_mask"]


def topk_mask(topk_indices, dims: IndexerDims, causal: bool) -> np.ndarray:
    """Boolean ``[B, N_Q, N_K]``: key ``s`` is in row ``t``'s set (listed in ``topk_indices[b, t]``
    and visible). ``topk_indices`` ``[B, N_Q, K]`` integers, ``-1`` = unused slot; any other value
    must lie in ``[0, N_K)`` and appear at most once per row (``ValueError`` otherwise). Listed
    keys that the causal mask hides are left out."""
    arr = np.asarray(topk_indices)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"topk_indices must hold integers (int32, -1 = unused), got dtype {arr.dtype}")
    if arr.ndim != 3 or arr.shape[:2] != (dims.B, dims.NQ):
        raise ValueError(f"topk_indices must have shape [B, N_Q, K] = [{dims.B}, {dims.NQ}, K], got {list(arr.shape)}")
    arr = arr.astype(np.int64)
    if arr.size and ((arr < -1) | (arr >= dims.NK)).any():
        raise ValueError(f"topk_indices must be -1 (unused) or a key index in [0, {dims.NK}), "
                         f"got values from {arr.min()} to {arr.max()}")
    used = arr >= 0
    srt = np.sort(np.where(used, arr, -1 - np.arange(arr.shape[-1])), axis=-1)  # unused slots distinct
    if (srt[..., 1:] == srt[..., :-1]).any():
        raise ValueError("topk_indices lists a key twice in one row; each key may appear at most once")
    selected = np.zeros((dims.B, dims.NQ, dims.NK + 1), dtype=bool)  # column N_K catches the -1s
    b, t, _ = np.indices(arr.shape)
    selected[b, t, np.where(used, arr, dims.NK)] = True
    return selected[..., : dims.NK] & visible(np.arange(dims.NQ), np.arange(dims.NK), dims.NQ, dims.NK, causal)


def _topk_parts(q, k, q_idx, k_idx, weights, topk_indices, causal, scale, relu):
    arrays, dims, relu = check_indexer_call(q, k, q_idx, k_idx, weights, scale=scale, relu=relu)
    parts = _dense_parts(arrays, dims, causal, relu)
    selected = topk_mask(topk_indices, dims, causal)
    # the teacher: each head's softmax over the set (its LSE over the set), then the head mean
    s = scaled_scores(arrays[0], expand_key_heads(arrays[1], dims.group), dims.scale)
    log_p_heads, lse_teacher_set = masked_log_softmax(s, selected[:, None])
    log_p_set = teacher_log_target(log_p_heads, selected)
    log_q_set, lse_set = masked_log_softmax(parts["logits"], selected)
    return arrays, dims, relu, parts, selected, log_p_set, log_q_set, lse_set, lse_teacher_set


def indexer_kl_topk(q, k, q_idx, k_idx, weights, topk_indices, *, causal=False, scale=None, relu=True,
                    return_lse=False):
    """The sparse stage's indexer loss per row (module docstring), materialised, in float64.

    Args:
        q, k, q_idx, k_idx, weights, causal, scale, relu: as :func:`indexer_kl`.
        topk_indices: ``[B, N_Q, K]`` integers, ``-1`` = unused slot; each key at most once per
            row, values in ``[-1, N_K)`` (``ValueError`` otherwise); keys the causal mask hides
            are left out.
        return_lse: also return the student's LSE over each row's set ``[B, N_Q]`` and the
            teacher's per-head LSEs over the set ``[B, H, N_Q]`` (natural log; ``-inf`` for an
            empty set).

    Returns:
        ``kl`` ``[B, N_Q]`` float64 (nats), or ``(kl, lse_idx_set, lse_teacher_set)``.
    """
    causal = check_flag(causal, "causal")
    *_, selected, log_p_set, log_q_set, lse_set, lse_teacher_set = _topk_parts(
        q, k, q_idx, k_idx, weights, topk_indices, causal, scale, relu)
    kl = kl_from_log_probs(log_p_set, log_q_set, selected)
    return (kl, lse_set, lse_teacher_set) if return_lse else kl


def indexer_kl_topk_grad(q, k, q_idx, k_idx, weights, topk_indices, grad_kl, *, causal=False, scale=None,
                         relu=True):
    """Closed-form gradient of ``Σ grad_kl · KL_topk`` (:func:`indexer_kl_topk`): the closed forms
    of :func:`indexer_kl_grad` with ``G = g·(q_S − p_S)`` on each row's set, 0 elsewhere
    (``{"dq_idx", "dk_idx", "dweights"}``; ``dk_idx`` sums the rows that selected each key)."""
    causal = check_flag(causal, "causal")
    arrays, dims, relu, parts, selected, log_p_set, log_q_set, *_ = _topk_parts(
        q, k, q_idx, k_idx, weights, topk_indices, causal, scale, relu)
    g = _row_array(grad_kl, "grad_kl", (dims.B, dims.NQ), "[B, N_Q]", np.float64)
    return _grad_from_parts(parts, selected, log_p_set, log_q_set, arrays, dims, g, relu)


def indexer_kl_topk_mp(q, k, q_idx, k_idx, weights, topk_indices, *, causal=False, scale=None, relu=True,
                       dps=50):
    """The definition in mpmath at ``dps`` digits, row by row over the listed keys (a gather, not
    a mask; tiny shapes only). Same arguments and checks as :func:`indexer_kl_topk`; float64
    ``[B, N_Q]``. The scale is the float64 value the other implementations use, taken as exact."""
    causal = check_flag(causal, "causal")
    arrays = [_as_mp_input(x, n) for x, n in zip((q, k, q_idx, k_idx, weights), _NAMES)]
    dims = check_indexer_inputs(*arrays, scale=scale)
    relu = _check_relu(relu)
    if isinstance(dps, bool) or not isinstance(dps, int) or dps < 15:
        raise ValueError(f"dps must be an integer >= 15, got {dps!r}")
    selected = topk_mask(topk_indices, dims, causal)
    idx = np.asarray(topk_indices)
    q, k, q_idx, k_idx, w = arrays
    out = np.zeros((dims.B, dims.NQ))
    with mpmath.workdps(dps):
        sigma = mpmath.mpf(dims.scale)

        def dot(x, y):
            return mpmath.fdot([_to_mpf(v) for v in x], [_to_mpf(v) for v in y])

        for b in range(dims.B):
            for t in range(dims.NQ):
                chosen = [int(s) for s in idx[b, t] if s >= 0 and selected[b, t, s]]
                if not chosen:
                    continue
                target = {s: mpmath.mpf(0) for s in chosen}
                for h in range(dims.H):
                    sc = {s: sigma * dot(q[b, h, t], k[b, h // dims.group, s]) for s in chosen}
                    lse = mpmath.log(mpmath.fsum(mpmath.exp(v) for v in sc.values()))
                    for s in chosen:
                        target[s] += mpmath.exp(sc[s] - lse) / dims.H
                logits = {}
                for s in chosen:
                    total = mpmath.mpf(0)
                    for j in range(dims.HI):
                        a = dot(q_idx[b, j, t], k_idx[b, j // dims.group_idx, s])
                        total += _to_mpf(w[b, j, t]) * (max(a, 0) if relu else a)
                    logits[s] = total
                lse_i = mpmath.log(mpmath.fsum(mpmath.exp(v) for v in logits.values()))
                out[b, t] = float(mpmath.fsum(
                    target[s] * (mpmath.log(target[s]) - (logits[s] - lse_i)) for s in chosen if target[s] > 0))
    return out
