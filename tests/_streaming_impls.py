"""Streaming (online-softmax) attention-KL implementations for the conformance tests: docs/math.md's
five-number recurrence as a plain float32 PyTorch loop over key tiles of ``block`` keys, the way a
kernel runs it, and variants that each get one rescale of the recurrence wrong.

``streaming_kl(..., block=64, finish="lse")`` is correct; ``finish`` picks the grouping of the last
step: ``"lse"`` is the boxed ``acc/l1 + LSE2 - LSE1`` (``LSE_t = m_t + ln l_t``), ``"split"`` is
``acc/l1 + (m2 - m1) + ln(l2/l1)``. ``bug`` plants one mistake (:data:`BUGS`). Differentiable
through autograd; NaN in an invisible key reaches the gradients (``nan_isolation="forward"``).
``streamkl verify --impl tests._streaming_impls:NAME`` runs the named ones below.
"""
from __future__ import annotations

import functools
import math

import torch

BUGS = {
    "acc_not_rescaled": "acc' = acc + sum(...): the old tiles keep their old reference",
    "acc_side2_factor": "acc' = a2 * acc + ...: side 2's factor on side 1's accumulator",
    "l1_not_rescaled": "l1' = l1 + sum(...)",
    "l1_side2_factor": "l1' = a2 * l1 + ...",
    "l2_not_rescaled": "l2' = l2 + sum(...)",
    "l2_side1_factor": "l2' = a1 * l2 + ...",
    "m1_not_updated": "m1 never written back: every tile's factor exp(m1 - m1') is 0, so only the last tile counts",
    "m2_not_updated": "m2 never written back",
}
BLOCKS = (16, 64, 128)
FINISHES = ("lse", "split")


def _expand(k, h):
    return k if k.shape[1] == h else k.repeat_interleave(h // k.shape[1], dim=1)


def streaming_kl(q1, k1, q2, k2, *, causal, scale1, scale2, block=64, finish="lse", bug=None):
    """``[B, H, N_Q]`` KL(P1 || P2) in float32, streamed over key tiles of ``block`` keys."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"bug must be one of {sorted(BUGS)}, got {bug!r}")
    h, nq, nk = q1.shape[1], q1.shape[2], k1.shape[2]
    sc1 = 1.0 / math.sqrt(q1.shape[-1]) if scale1 is None else scale1
    sc2 = 1.0 / math.sqrt(q2.shape[-1]) if scale2 is None else scale2
    q1f, q2f = q1.float(), q2.float()
    k1e, k2e = _expand(k1, h).float(), _expand(k2, h).float()
    shape = q1.shape[:3]
    neg_inf = torch.full(shape, -math.inf, device=q1.device)
    m1, m2 = neg_inf, neg_inf
    l1 = l2 = acc = torch.zeros(shape, device=q1.device)
    zero = torch.zeros((), device=q1.device)
    rows = torch.arange(nq, device=q1.device)[:, None]
    for start in range(0, nk, block):
        stop = min(start + block, nk)
        cols = torch.arange(start, stop, device=q1.device)[None, :]
        vis = (cols <= rows + (nk - nq)) if causal else torch.ones(nq, stop - start, dtype=torch.bool,
                                                                   device=q1.device)
        s1 = sc1 * (q1f @ k1e[:, :, start:stop].transpose(-1, -2))
        s2 = sc2 * (q2f @ k2e[:, :, start:stop].transpose(-1, -2))
        m1n = torch.maximum(m1, s1.masked_fill(~vis, -math.inf).amax(-1))
        m2n = torch.maximum(m2, s2.masked_fill(~vis, -math.inf).amax(-1))
        # finite stand-ins where nothing has been seen yet: masked entries and the factors are
        # selected away before any arithmetic (no exp(-inf - -inf), no 0 * inf in autograd)
        r1 = torch.where(torch.isfinite(m1n), m1n, zero)
        r2 = torch.where(torch.isfinite(m2n), m2n, zero)
        a1 = torch.where(torch.isfinite(m1), torch.exp(torch.where(torch.isfinite(m1), m1, r1) - r1), zero)
        a2 = torch.where(torch.isfinite(m2), torch.exp(torch.where(torch.isfinite(m2), m2, r2) - r2), zero)
        p1 = torch.where(vis, torch.exp(torch.where(vis, s1, r1[..., None]) - r1[..., None]), zero)
        p2 = torch.where(vis, torch.exp(torch.where(vis, s2, r2[..., None]) - r2[..., None]), zero)
        t_acc = (p1 * torch.where(vis, s1 - s2, zero)).sum(-1)
        f_acc = {"acc_not_rescaled": 1.0, "acc_side2_factor": a2}.get(bug, a1)
        f_l1 = {"l1_not_rescaled": 1.0, "l1_side2_factor": a2}.get(bug, a1)
        f_l2 = {"l2_not_rescaled": 1.0, "l2_side1_factor": a1}.get(bug, a2)
        acc = f_acc * acc + t_acc
        l1 = f_l1 * l1 + p1.sum(-1)
        l2 = f_l2 * l2 + p2.sum(-1)
        last1, last2 = m1n, m2n
        if bug != "m1_not_updated":
            m1 = m1n
        if bug != "m2_not_updated":
            m2 = m2n
    if nk == 0:
        return torch.zeros(shape, device=q1.device)
    if bug == "m1_not_updated":  # the final step reads the last tile's maximum
        m1 = last1
    if bug == "m2_not_updated":
        m2 = last2
    seen = l1 > 0
    one = torch.ones((), device=q1.device)
    l1s, l2s = torch.where(seen, l1, one), torch.where(seen, l2, one)
    m1s, m2s = torch.where(seen, m1, zero), torch.where(seen, m2, zero)
    if finish == "lse":
        kl = acc / l1s + (m2s + torch.log(l2s)) - (m1s + torch.log(l1s))
    elif finish == "split":
        kl = acc / l1s + (m2s - m1s) + torch.log(l2s / l1s)
    else:
        raise ValueError(f"finish must be 'lse' or 'split', got {finish!r}")
    return torch.where(seen, kl, zero)  # a row that sees no key: KL 0


def variant(block=64, finish="lse", bug=None):
    """``streaming_kl`` with its options bound, named for the reports."""
    fn = functools.partial(streaming_kl, block=block, finish=finish, bug=bug)
    fn.__qualname__ = fn.__name__ = f"streaming_kl[block={block}, finish={finish}, bug={bug}]"
    return fn


# for the command line (`streamkl verify --impl tests._streaming_impls:NAME`)
def correct_block128(q1, k1, q2, k2, *, causal, scale1, scale2):
    return streaming_kl(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2, block=128)


def acc_not_rescaled_block128(q1, k1, q2, k2, *, causal, scale1, scale2):
    return streaming_kl(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2, block=128,
                        bug="acc_not_rescaled")


# ---- the indexer loss, streamed: KL(p || softmax(I)) with p the head mean of the teacher's softmaxes
INDEXER_BUGS = {
    "teacher_l_not_rescaled": "the teacher's per-head sums l_h' = l_h + sum(...)",
    "teacher_m_not_updated": "the teacher's running max never written back",
    "student_l_not_rescaled": "the indexer's sum l_I' = l_I + sum(...)",
    "student_m_not_updated": "the indexer's running max never written back",
}


def _online(m, l, x, vis, zero, rescale=True, keep_max=True):
    """One tile of the online log-sum-exp: the new (m, l) and the tile's max (for a bug's final step)."""
    m_new = torch.maximum(m, x.masked_fill(~vis, -math.inf).amax(-1))
    r = torch.where(torch.isfinite(m_new), m_new, zero)
    a = torch.where(torch.isfinite(m), torch.exp(torch.where(torch.isfinite(m), m, r) - r), zero)
    p = torch.where(vis, torch.exp(torch.where(vis, x, r[..., None]) - r[..., None]), zero)
    l = (a if rescale else 1.0) * l + p.sum(-1)
    return (m_new if keep_max else m), l, m_new


def streaming_indexer_kl(q, k, q_idx, k_idx, weights, *, causal, scale, relu, block=64, bug=None):
    """``[B, N_Q]`` indexer KL in float32 over key tiles of ``block`` keys: a first pass for the
    teacher's per-head LSEs (online), a second for ``sum p ln p``, ``sum p I`` and the indexer's
    online LSE; ``KL = sum p ln p - sum p I + LSE_I``."""
    if bug is not None and bug not in INDEXER_BUGS:
        raise ValueError(f"bug must be one of {sorted(INDEXER_BUGS)}, got {bug!r}")
    h, nq, nk = q.shape[1], q.shape[2], k.shape[2]
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qf, ke = q.float(), _expand(k, h).float()
    qif, kie, wf = q_idx.float(), _expand(k_idx, q_idx.shape[1]).float(), weights.float()
    dev = q.device
    zero = torch.zeros((), device=dev)
    rows = torch.arange(nq, device=dev)[:, None]

    def tile(start):
        stop = min(start + block, nk)
        cols = torch.arange(start, stop, device=dev)[None, :]
        vis = (cols <= rows + (nk - nq)) if causal else torch.ones(nq, stop - start, dtype=torch.bool, device=dev)
        s = sc * (qf @ ke[:, :, start:stop].transpose(-1, -2))  # [B, H, N_Q, T]
        a = qif @ kie[:, :, start:stop].transpose(-1, -2)  # [B, H_I, N_Q, T]
        logits = (wf[..., None] * (torch.relu(a) if relu else a)).sum(1)  # [B, N_Q, T]
        return vis, s, logits

    m_t = torch.full(q.shape[:3], -math.inf, device=dev)
    l_t = torch.zeros(q.shape[:3], device=dev)
    for start in range(0, nk, block):
        vis, s, _ = tile(start)
        m_t, l_t, last_t = _online(m_t, l_t, s, vis, zero, rescale=bug != "teacher_l_not_rescaled",
                                   keep_max=bug != "teacher_m_not_updated")
    if bug == "teacher_m_not_updated":
        m_t = last_t
    seen_t = l_t > 0
    lse_t = torch.where(seen_t, torch.where(seen_t, m_t, zero) + torch.log(torch.where(seen_t, l_t, 1.0)), zero)
    shape = (q.shape[0], nq)
    m_i = torch.full(shape, -math.inf, device=dev)
    l_i, p_log_p, p_i = torch.zeros(shape, device=dev), torch.zeros(shape, device=dev), torch.zeros(shape, device=dev)
    for start in range(0, nk, block):
        vis, s, logits = tile(start)
        e = torch.where(vis, torch.exp(torch.where(vis, s, zero) - lse_t[..., None]), zero)
        p = e.mean(1)  # the teacher's mixture over heads, [B, N_Q, T]
        pos = p > 0
        p_log_p = p_log_p + torch.where(pos, p * torch.log(torch.where(pos, p, 1.0)), zero).sum(-1)
        p_i = p_i + torch.where(vis, p * logits, zero).sum(-1)
        m_i, l_i, last_i = _online(m_i, l_i, logits, vis, zero, rescale=bug != "student_l_not_rescaled",
                                   keep_max=bug != "student_m_not_updated")
    if bug == "student_m_not_updated":
        m_i = last_i
    seen = l_i > 0
    lse_i = torch.where(seen, m_i, zero) + torch.log(torch.where(seen, l_i, 1.0))
    return torch.where(seen, p_log_p - p_i + lse_i, zero)


def indexer_variant(block=64, bug=None):
    fn = functools.partial(streaming_indexer_kl, block=block, bug=bug)
    fn.__qualname__ = fn.__name__ = f"streaming_indexer_kl[block={block}, bug={bug}]"
    return fn
