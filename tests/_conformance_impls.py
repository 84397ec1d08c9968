"""Attention-KL implementations for the conformance tests: one correct dense formula, written as a
user would (``[B, H, N, D]``, bottom-right causal), and deliberately wrong variants of it, each with
one bug that real kernels have had. ``streamkl verify --impl tests._conformance_impls:NAME`` runs
any of them through the command line.
"""
from __future__ import annotations

import math

import torch


def _expand(k, h, mapping="div"):
    hk = k.shape[1]
    if hk == h:
        return k
    idx = torch.arange(h, device=k.device)
    idx = idx // (h // hk) if mapping == "div" else idx % hk  # "mod": the bug
    return k[:, idx]


def _scores(q, k, scale, h, mapping="div", default="sqrt"):
    d = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d) if default == "sqrt" else 1.0 / d
    return scale * (q.float() @ _expand(k, h, mapping).float().transpose(-1, -2))


def _visible(nq, nk, causal, align="bottom-right", device=None):
    if not causal:
        return torch.ones(nq, nk, dtype=torch.bool, device=device)
    i = torch.arange(nq, device=device)[:, None]
    j = torch.arange(nk, device=device)[None, :]
    return j <= i + (nk - nq) if align == "bottom-right" else j <= i


def kl_formula(q1, k1, q2, k2, *, causal=False, scale1=None, scale2=None, align="bottom-right",
               mapping="div", default="sqrt", reverse=False, lse_bf16=False, leak=False):
    """KL(P1 || P2) per row, ``[B, H, N_Q]``, float32; the keyword arguments plant the bugs."""
    h, nq, nk = q1.shape[1], q1.shape[2], k1.shape[2]
    s1 = _scores(q1, k1, scale1, h, mapping, default)
    s2 = _scores(q2, k2, scale2, h, mapping, default)
    vis = _visible(nq, nk, causal, align, q1.device)
    empty = ~vis.any(-1)
    vis = vis | empty[:, None]  # rows with no key: computed unmasked, KL set to 0 below
    m1, m2 = s1.masked_fill(~vis, -math.inf), s2.masked_fill(~vis, -math.inf)
    if reverse:  # the bug: KL(P2 || P1)
        m1, m2, s1, s2 = m2, m1, s2, s1
    logp1, logp2 = torch.log_softmax(m1, -1), torch.log_softmax(m2, -1)
    if lse_bf16:  # the bug: the log-sum-exp kept in bfloat16
        logp1 = m1 - torch.logsumexp(m1, -1, keepdim=True).bfloat16().float()
        logp2 = m2 - torch.logsumexp(m2, -1, keepdim=True).bfloat16().float()
    p1 = logp1.exp()
    if leak:  # the bug: the log-ratio from the unmasked scores, so 0 * NaN reaches the row
        lse1, lse2 = torch.logsumexp(m1, -1, keepdim=True), torch.logsumexp(m2, -1, keepdim=True)
        kl = (p1 * ((s1 - s2) - (lse1 - lse2))).sum(-1)
    else:
        kl = (p1 * torch.where(vis, logp1 - logp2, torch.zeros((), device=q1.device))).sum(-1)
    return kl.masked_fill(empty, 0.0)


def correct(q1, k1, q2, k2, *, causal, scale1, scale2):
    return kl_formula(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2)


def top_left(q1, k1, q2, k2, *, causal, scale1, scale2):
    return kl_formula(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2, align="top-left")


def gqa_mod(q1, k1, q2, k2, *, causal, scale1, scale2):
    return kl_formula(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2, mapping="mod")


def scale_one_over_d(q1, k1, q2, k2, *, causal, scale1, scale2):
    return kl_formula(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2, default="d")


def reverse_kl(q1, k1, q2, k2, *, causal, scale1, scale2):
    return kl_formula(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2, reverse=True)


def lse_in_bf16(q1, k1, q2, k2, *, causal, scale1, scale2):
    return kl_formula(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2, lse_bf16=True)


def zero_times_nan(q1, k1, q2, k2, *, causal, scale1, scale2):
    return kl_formula(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2, leak=True)


def detached_teacher(q1, k1, q2, k2, *, causal, scale1, scale2):
    """Gradients of the wrong setting: P1 detached as a weight (setting 1's teacher), so side 1
    gets the gradient of ``Σ P1·log P1`` with ``P1`` fixed, which is 0, instead of the true one."""
    h, nq, nk = q1.shape[1], q1.shape[2], k1.shape[2]
    s1 = _scores(q1, k1, scale1, h)
    s2 = _scores(q2, k2, scale2, h)
    vis = _visible(nq, nk, causal, device=q1.device)
    empty = ~vis.any(-1)
    vis = vis | empty[:, None]
    logp1 = torch.log_softmax(s1.masked_fill(~vis, -math.inf), -1)
    logp2 = torch.log_softmax(s2.masked_fill(~vis, -math.inf), -1)
    p1 = logp1.exp().detach()
    kl = (p1 * torch.where(vis, logp1 - logp2, torch.zeros((), device=q1.device))).sum(-1)
    return kl.masked_fill(empty, 0.0)


def ragged_off_by_one(q1, k1, q2, k2, *, causal, scale1, scale2, block=16):
    """A tiled online-softmax implementation over key tiles of ``block`` keys, zero-padded, whose
    tail mask is ``j <= N_K`` instead of ``j < N_K``: one padded key (score 0) joins every row
    whenever N_K is not a multiple of the tile."""
    h, nq, nk = q1.shape[1], q1.shape[2], k1.shape[2]
    n_tiles = -(-nk // block)
    pad = n_tiles * block - nk

    def padded(k):
        return torch.cat([k, torch.zeros(*k.shape[:2], pad, k.shape[3], dtype=k.dtype, device=k.device)], 2)

    s1 = _scores(q1, padded(k1), scale1, h)
    s2 = _scores(q2, padded(k2), scale2, h)
    i = torch.arange(nq, device=q1.device)[:, None]
    j = torch.arange(n_tiles * block, device=q1.device)[None, :]
    vis = j <= nk  # the bug: should be j < nk
    if causal:
        vis = vis & (j <= i + (nk - nq))
    empty = ~vis.any(-1)
    vis = vis | empty[:, None]
    logp1 = torch.log_softmax(s1.masked_fill(~vis, -math.inf), -1)
    logp2 = torch.log_softmax(s2.masked_fill(~vis, -math.inf), -1)
    kl = (logp1.exp() * torch.where(vis, logp1 - logp2, torch.zeros((), device=q1.device))).sum(-1)
    return kl.masked_fill(empty, 0.0)


# ---- correct ones, through the adapters
def correct_bnhd(q1, k1, q2, k2, *, causal, scale1, scale2):
    """flash-attn layout ``[B, N, H, D]`` in, rows ``[B, N_Q, H]`` out."""
    t = [x.transpose(1, 2) for x in (q1, k1, q2, k2)]
    return correct(*t, causal=causal, scale1=scale1, scale2=scale2).transpose(1, 2)


def correct_sum(q1, k1, q2, k2, *, causal, scale1, scale2):
    return correct(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2).sum()


def correct_mean(q1, k1, q2, k2, *, causal, scale1, scale2):
    return correct(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2).mean()


def correct_top_left(q1, k1, q2, k2, *, causal, scale1, scale2):
    """A correct implementation of the top-left convention (SDPA's ``is_causal``)."""
    return top_left(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2)


def correct_isolating(q1, k1, q2, k2, *, causal, scale1, scale2):
    """Correct, and NaN-isolating in the gradients too: each score is formed from a query and a key
    zeroed where the pair is invisible, so autograd never multiplies a masked zero by a NaN."""
    h, nq, nk = q1.shape[1], q1.shape[2], k1.shape[2]
    vis = _visible(nq, nk, causal, device=q1.device)
    empty = ~vis.any(-1)
    vis = vis | empty[:, None]
    zero = torch.zeros((), device=q1.device)

    def scores(q, k, scale):
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        qm = torch.where(vis[..., None], q.float()[:, :, :, None, :], zero)  # [B, H, NQ, NK, D]
        km = torch.where(vis[..., None], _expand(k, h).float()[:, :, None, :, :], zero)
        return scale * (qm * km).sum(-1)

    logp1 = torch.log_softmax(scores(q1, k1, scale1).masked_fill(~vis, -math.inf), -1)
    logp2 = torch.log_softmax(scores(q2, k2, scale2).masked_fill(~vis, -math.inf), -1)
    kl = (logp1.exp() * torch.where(vis, logp1 - logp2, zero)).sum(-1)
    return kl.masked_fill(empty, 0.0)


# ---- the indexer loss: a user's dense formula and wrong variants of it
def indexer_formula(q, k, q_idx, k_idx, weights, *, causal=False, scale=None, relu=True, align="bottom-right",
                    mapping="div", target="mixture", leak=False):
    """``[B, N_Q]`` KL(p || softmax(I)), float32; the keyword arguments plant the bugs:
    ``target="mean_log"`` averages the heads' log-probabilities (a geometric mean, not the
    mixture), ``"mean_kl"`` averages per-head KLs; ``leak`` forms log softmax(I) from unmasked
    logits, so the masked p = 0 multiplies a NaN."""
    h, nq, nk = q.shape[1], q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    vis = _visible(nq, nk, causal, align, q.device)
    empty = ~vis.any(-1)
    vis = vis | empty[:, None]
    s = scale * (q.float() @ _expand(k, h, mapping).float().transpose(-1, -2))
    logp_h = torch.log_softmax(s.masked_fill(~vis, -math.inf), -1)  # [B, H, NQ, NK]
    a = q_idx.float() @ _expand(k_idx, q_idx.shape[1], mapping).float().transpose(-1, -2)
    logits = (weights.float()[..., None] * (torch.relu(a) if relu else a)).sum(1)  # [B, NQ, NK]
    log_q = torch.log_softmax(logits.masked_fill(~vis, -math.inf), -1)
    if leak:
        log_q = logits - torch.logsumexp(logits.masked_fill(~vis, -math.inf), -1, keepdim=True)
    zero = torch.zeros((), device=q.device)
    if target == "mean_kl":
        p_h = logp_h.exp()
        kl = (p_h * torch.where(vis, logp_h - log_q[:, None], zero)).sum(-1).mean(1)
        return kl.masked_fill(empty, 0.0)
    if target == "mean_log":
        log_p = torch.where(vis, logp_h, zero).mean(1)
        p = torch.where(vis, log_p.exp(), zero)
    else:
        p = logp_h.exp().mean(1)
        log_p = torch.log(torch.where(p > 0, p, torch.ones((), device=q.device)))
    if leak:
        kl = (p * (log_p - log_q)).sum(-1)
    else:
        kl = torch.where(p > 0, p * (log_p - torch.where(vis, log_q, zero)), zero).sum(-1)
    return kl.masked_fill(empty, 0.0)


def idx_correct(q, k, q_idx, k_idx, weights, *, causal, scale, relu):
    return indexer_formula(q, k, q_idx, k_idx, weights, causal=causal, scale=scale, relu=relu)


def idx_top_left(q, k, q_idx, k_idx, weights, *, causal, scale, relu):
    return indexer_formula(q, k, q_idx, k_idx, weights, causal=causal, scale=scale, relu=relu, align="top-left")


def idx_gqa_mod(q, k, q_idx, k_idx, weights, *, causal, scale, relu):
    return indexer_formula(q, k, q_idx, k_idx, weights, causal=causal, scale=scale, relu=relu, mapping="mod")


def idx_mean_log_probs(q, k, q_idx, k_idx, weights, *, causal, scale, relu):
    return indexer_formula(q, k, q_idx, k_idx, weights, causal=causal, scale=scale, relu=relu, target="mean_log")


def idx_mean_of_head_kls(q, k, q_idx, k_idx, weights, *, causal, scale, relu):
    return indexer_formula(q, k, q_idx, k_idx, weights, causal=causal, scale=scale, relu=relu, target="mean_kl")


def idx_zero_times_nan(q, k, q_idx, k_idx, weights, *, causal, scale, relu):
    return indexer_formula(q, k, q_idx, k_idx, weights, causal=causal, scale=scale, relu=relu, leak=True)


def idx_always_relu(q, k, q_idx, k_idx, weights, *, causal, scale, relu):
    """Ignores ``relu=False``."""
    return indexer_formula(q, k, q_idx, k_idx, weights, causal=causal, scale=scale, relu=True)


def idx_megatron_sum(q, k, q_idx, k_idx, weights, *, causal, scale, relu):
    """Megatron-style ``[S, B, H, D]`` tensors arrive as bnhd here via the adapter; returns the sum."""
    t = [x.transpose(1, 2) for x in (q, k, q_idx, k_idx, weights)]
    return idx_correct(*t, causal=causal, scale=scale, relu=relu).sum()


# A user's Triton kernel with a memory bug: the correct formula for the numbers, plus a staging
# copy of q1 by a Triton kernel whose load is shifted by one element (an off-by-one offset): its
# last lane reads past the tensor. On a GPU that may fault or read a neighbour; under `streamkl
# verify` on CPU the bounds-checked interpreter fails every case. Its in-bounds twin passes.
# The racy twin: every program sums its block into element 0 by a plain load-add-store (instead of
# an atomic add): right under the interpreter, whose programs run in order; a lost update on a GPU.
_copy_kernel = None


def _staging_copy(x, shift, racy_sum=False):
    global _copy_kernel
    import triton
    import triton.language as tl

    if _copy_kernel is None:
        @triton.jit
        def _copy(X, Y, S, N, SHIFT: tl.constexpr, RACY_SUM: tl.constexpr, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(X + offs + SHIFT, mask=offs < N, other=0.0)
            tl.store(Y + offs, x, mask=offs < N)
            if RACY_SUM:
                tl.store(S, tl.load(S) + tl.sum(x, 0))

        _copy_kernel = _copy
    flat = x.detach().contiguous().reshape(-1)
    out, total = torch.empty_like(flat), torch.zeros(1, dtype=flat.dtype, device=flat.device)
    _copy_kernel[(triton.cdiv(flat.numel(), 64),)](flat, out, total, flat.numel(), SHIFT=shift, RACY_SUM=racy_sum,
                                                   BLOCK=64)
    if racy_sum:
        assert torch.allclose(total, flat.sum().reshape(1), rtol=1e-4, atol=1e-4)  # right here, in order
    return out.view_as(x)


def triton_sums_q1_racily(q1, k1, q2, k2, *, causal, scale1, scale2):
    _staging_copy(q1, shift=0, racy_sum=True)
    return kl_formula(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2)


def triton_reads_past_q1(q1, k1, q2, k2, *, causal, scale1, scale2):
    _staging_copy(q1, shift=1)
    return kl_formula(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2)


def triton_reads_q1_in_bounds(q1, k1, q2, k2, *, causal, scale1, scale2):
    staged = _staging_copy(q1, shift=0)
    assert torch.equal(staged, q1.detach())
    return kl_formula(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2)
