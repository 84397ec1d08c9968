"""The chunk design's storing forward for teachers with several key heads (GQA, MHA): the GQA
forward kernel's lean head loop (``fwd_gqa.py``) that also stores the target p it forms.

The chunk design (``indexer/training/chunk.py``'s ``_forward_full``) forms the training step's whole gradient in the
forward, one chunk of tokens at a time: a storing forward writes the chunk's target
``p [B, chunk, N_K]`` (fp32, 0 where masked) and its final KL / LSE_I, then the teacher-free
gradient kernel (``bwd.py``'s ``_indexer_bwd_dq_kernel``, P_SAVED, DK_SHARE) reads it back. For
an MQA teacher the storing forward is the general kernel's tile (all heads of one key head in
one tile); for several key heads that tile holds one head per chunk and re-reads K for each,
which is what ``fwd_gqa.py`` avoids. This kernel is that one's loop (one box per head, the
scale / LSE / head mean folded into one FFMA before exp2: ``_head_exp``, ``_lse_shift``; the same
five-scalar student state: ``_online_update``, ``_finish``) plus one store of p per tile.

Plans: the GQA kernel's (``fwd_gqa.applies``: TMA descriptors, head dims <= 128, one
teacher head per tile); its variant string chooses the loop (``"gqa"``: one K tile per key head,
its group's heads inside; ``"gqa-flat"`` and ``"gqa-pp"``: one flat loop over the heads), the
grid order (``-tm``), the masked band in a second launch (``-band``; ``-ss``'s side stream is
not used here: the band runs after the main launch), a register cap (``-rNNN``, GPU only), the
key splits merged by ``fwd_gqa.merge_states_wide`` straight into the chunk's rows (``-wm``) and one
chunk within the chunk design's p budget (``-one``: ``training/chunk.py``'s ``PCHUNK_MAX_BYTES``).
Key splits as the plan says; their states are merged per chunk before the gradient kernel reads
LSE_I.

The stored p must equal what the general storing forward writes wherever the gradient kernel
reads it (the visible entries): tests/test_indexer_training_paths.py compares both.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from streamkl_gpu._core import checks as _checks
from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu._core.jit import _dot, _key_stages
from streamkl_gpu._core.launcher import kernel_call
from streamkl_gpu.indexer.plan import _fresh, _key_splits, _merge_splits
from streamkl_gpu.indexer.triton import fwd_gqa as _indexer_fwd_gqa
from streamkl_gpu.indexer.triton.fwd import _finish, _online_update
from streamkl_gpu.indexer.triton.fwd_gqa import _head_exp, _lse_shift, parse_variant

__all__ = ["applies", "launch_chunk"]

# p's tiles stored through a TMA descriptor of the chunk's p (box [1, BLOCK_T, BLOCK_N]; rows and
# keys past its bounds clipped) where its strides allow (N_K a multiple of 4): a pointer store of
# a 64 x 64 fp32 tile costs a 64-bit address per element (~64 registers on 4 warps, under the
# 128-register cap of the first candidate). False: pointer stores everywhere.
P_TMA_STORE = True


def applies(pl, dims, use_tma: bool) -> bool:
    """Does this kernel run the chunk design's storing forward for plan ``pl``? Where the GQA
    forward kernel would (its variant, TMA, head dims <= 128, HB = IB = 1)."""
    return _indexer_fwd_gqa.applies(pl, dims, use_tma)


def launch_chunk(dims, pl, q, k, q_idx, k_idx, weights, lse_bits, kl, lse_idx, p, c0, rows, causal, relu,
                 ieee_t, ieee_i):
    """The tokens ``c0 .. c0 + rows`` of every batch element: their KL and LSE_I into ``kl`` /
    ``lse_idx`` [B, N_Q] (key splits merged here), their target into ``p [B, p_rows, N_K]`` (row
    ``t - c0``). ``lse_bits``: the teacher LSEs in bits; the tensors are compute views."""
    var = parse_variant(pl["variant"])
    d_pad, di_pad = _checks.head_pad(dims.D), _checks.head_pad(dims.DI)
    bt, bn = pl["BLOCK_T"], pl["BLOCK_N"]
    TD = _runtime.TensorDescriptor

    def desc(t, box_rows, width):
        return TD(t, list(t.shape), list(t.stride()), [1, 1, box_rows, width])

    splits, per_split = _key_splits(dims, pl)
    slots = splits + 1 if var.band else splits  # -band: the band's state is one more "split"
    p_rows = p.shape[1]
    p_tma = P_TMA_STORE and _runtime.tma_ok(p)
    p_desc = TD(p, list(p.shape), list(p.stride()), [1, bt, bn]) if p_tma else None
    # the splits' states of this chunk's rows only (row t - c0), merged below
    part = _fresh((5, slots, dims.B, p_rows), torch.float32, q.device) if slots > 1 else kl
    n_t = _runtime.cdiv(rows, bt)
    extra = {} if (var.cap is None or _runtime.interpreting()) else {"maxnreg": var.cap}
    args = (desc(q, bt, d_pad), desc(k, bn, d_pad), desc(q_idx, bt, di_pad), desc(k_idx, bn, di_pad),
            weights, lse_bits, kl, lse_idx, part, p, p_desc, *weights.stride(),
            dims.H, dims.HK, dims.HI, dims.HKI, dims.NQ, dims.NK, dims.scale * 1.4426950408889634, math.log2(dims.H))
    meta = dict(GROUP=dims.H // dims.HK, GROUP_I=dims.HI // dims.HKI, D_PAD=d_pad, DI_PAD=di_pad, BLOCK_T=bt,
                BLOCK_N=bn, CAUSAL=causal, RELU=relu, IEEE_T=ieee_t, IEEE_I=ieee_i, SPLIT=slots > 1, P_TMA=p_tma,
                HEAD_LOOP=1 if var.loop == 1 else 0, num_warps=pl["warps"], num_stages=pl["stages"])
    grid = (splits, n_t, dims.B) if var.split_major else (n_t, splits, dims.B)
    kernel_call(_indexer_fwd_gqa_store_kernel, grid)(*args, per_split, c0, p_rows, 0, slots, **meta,
                                        SPLIT_MAJOR=var.split_major, STAGES=1 if var.band else 0, **extra)
    if var.band:  # one program per token block: its masked band only, into slot ``splits``
        kernel_call(_indexer_fwd_gqa_store_kernel, (1, n_t, dims.B))(*args, dims.NK, c0, p_rows, splits, slots, **meta,
                                                        SPLIT_MAJOR=True, STAGES=2)
    if slots > 1:  # this chunk's rows, before the gradient kernel reads LSE_I
        if var.wide_merge:  # (in place: no chunk-sized copies)
            _indexer_fwd_gqa.merge_states_wide(part, kl, lse_idx, c0, rows)
        elif _indexer_fwd_gqa.MERGE_KERNEL:
            kl_c = _fresh((dims.B, p_rows), torch.float32, q.device)
            lse_c = _fresh((dims.B, p_rows), torch.float32, q.device)
            _indexer_fwd_gqa.merge_states(part, kl_c, lse_c)
        else:
            kl_c, lse_c = _merge_splits(part)
        if not var.wide_merge:
            kl[:, c0:c0 + rows] = kl_c[:, :rows]
            lse_idx[:, c0:c0 + rows] = lse_c[:, :rows]


@triton.jit
def _target_and_logits(
    Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, stride_wb, stride_wh, stride_wn,
    b, t0, s0, H, HK, HI, HKI, N_Q, qk_scale, log2_heads,
    GROUP: tl.constexpr, GROUP_I: tl.constexpr, D_PAD: tl.constexpr, DI_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, RELU: tl.constexpr, IEEE_T: tl.constexpr,
    IEEE_I: tl.constexpr, HEAD_LOOP: tl.constexpr,
):
    """``(p, I)`` [BLOCK_T, BLOCK_N] of one key tile, unmasked: ``fwd_gqa._gqa_key_range``'s
    target (HEAD_LOOP 1: its "gqa" loop, 0: its "gqa-flat" loop) and student logits."""
    toks = t0 + tl.arange(0, BLOCK_T)
    tok_ok = toks < N_Q
    b64 = b.to(tl.int64)
    p = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    shift = _lse_shift(LSE_T, b64 * H * N_Q, toks, tok_ok, log2_heads)
    if HEAD_LOOP == 1:  # one K tile load per key head, then its group's heads
        for kv in range(0, HK):
            kt = K_DESC.load([b, kv, s0, 0]).reshape(BLOCK_N, D_PAD)
            for g in range(0, H // HK):
                h = kv * GROUP + g
                shift_next = _lse_shift(LSE_T, (b64 * H + tl.minimum(h + 1, H - 1)) * N_Q, toks, tok_ok, log2_heads)
                qt = Q_DESC.load([b, h, t0, 0]).reshape(BLOCK_T, D_PAD)
                p += _head_exp(_dot(qt, tl.trans(kt), IEEE_T), shift, qk_scale)
                shift = shift_next
    else:  # one flat loop over the teacher heads, the K tile per head (from L2 after the group's first)
        for h in range(0, H):
            shift_next = _lse_shift(LSE_T, (b64 * H + tl.minimum(h + 1, H - 1)) * N_Q, toks, tok_ok, log2_heads)
            kt = K_DESC.load([b, h // GROUP, s0, 0]).reshape(BLOCK_N, D_PAD)
            qt = Q_DESC.load([b, h, t0, 0]).reshape(BLOCK_T, D_PAD)
            p += _head_exp(_dot(qt, tl.trans(kt), IEEE_T), shift, qk_scale)
            shift = shift_next
    logits = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    w_row = W + b64 * stride_wb + toks.to(tl.int64) * stride_wn
    w = tl.load(w_row, mask=tok_ok, other=0.0).to(tl.float32)
    for kvi in range(0, HKI):
        kit = KI_DESC.load([b, kvi, s0, 0]).reshape(BLOCK_N, DI_PAD)
        for jj in range(0, HI // HKI):
            j = kvi * GROUP_I + jj
            w_next = tl.load(w_row + tl.minimum(j + 1, HI - 1) * stride_wh, mask=tok_ok, other=0.0).to(tl.float32)
            qit = QI_DESC.load([b, j, t0, 0]).reshape(BLOCK_T, DI_PAD)
            a = _dot(qit, tl.trans(kit), IEEE_I)
            if RELU:
                a = tl.maximum(a, 0.0, propagate_nan=tl.PropagateNan.ALL)  # relu(NaN) stays NaN
            logits += w[:, None] * a
            w = w_next
    return p, logits


@triton.jit
def _store_key_range(
    m, l, mass, acc, plogp,
    Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, P, P_DESC, stride_wb, stride_wh, stride_wn,
    b, t0, lo, hi, H, HK, HI, HKI, N_Q, N_K, qk_scale, log2_heads, t_off, p_rows,
    GROUP: tl.constexpr, GROUP_I: tl.constexpr, D_PAD: tl.constexpr, DI_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    RELU: tl.constexpr, IEEE_T: tl.constexpr, IEEE_I: tl.constexpr, HEAD_LOOP: tl.constexpr,
    P_TMA: tl.constexpr,
):
    toks = t0 + tl.arange(0, BLOCK_T)
    tok_ok = toks < N_Q
    diag_offset = N_K - N_Q
    p_row = (b.to(tl.int64) * p_rows + (toks - t_off).to(tl.int64)) * N_K
    for s0 in range(lo, hi, BLOCK_N):
        keys = s0 + tl.arange(0, BLOCK_N)
        p, logits = _target_and_logits(Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, stride_wb, stride_wh, stride_wn,
                                       b, t0, s0, H, HK, HI, HKI, N_Q, qk_scale, log2_heads, GROUP, GROUP_I,
                                       D_PAD, DI_PAD, BLOCK_T, BLOCK_N, RELU, IEEE_T, IEEE_I, HEAD_LOOP)
        if MASKED:
            visible = tok_ok[:, None] & (keys < N_K)[None, :]
            if CAUSAL:
                visible = visible & (keys[None, :] <= toks[:, None] + diag_offset)
            p_out = tl.where(visible, p, 0.0)  # stored 0 where masked (an invisible entry's score may be anything)
        else:  # whole tiles: every key visible to every row of the block
            visible = tok_ok[:, None]
            p_out = p  # (rows past N_Q: 0, their shift is +inf)
        if P_TMA:  # the box at (b, t0 - t_off, s0); keys past N_K and rows past p_rows clipped
            P_DESC.store([b, t0 - t_off, s0], p_out.reshape(1, BLOCK_T, BLOCK_N))
        else:
            tl.store(P + p_row[:, None] + keys[None, :], p_out, mask=tok_ok[:, None] & (keys < N_K)[None, :])
        m, l, mass, acc, plogp = _online_update(m, l, mass, acc, plogp, p, logits, visible)
    return m, l, mass, acc, plogp


@triton.jit
def _indexer_fwd_gqa_store_kernel(
    Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, KL, LSE_I, PART, P, P_DESC,
    stride_wb, stride_wh, stride_wn,
    H, HK, HI, HKI, N_Q, N_K, qk_scale, log2_heads, keys_per_split, t_off, p_rows, slot0, n_slots,
    GROUP: tl.constexpr, GROUP_I: tl.constexpr, D_PAD: tl.constexpr, DI_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, RELU: tl.constexpr,
    IEEE_T: tl.constexpr, IEEE_I: tl.constexpr, SPLIT: tl.constexpr, HEAD_LOOP: tl.constexpr,
    SPLIT_MAJOR: tl.constexpr, STAGES: tl.constexpr, P_TMA: tl.constexpr = False,
):
    """The tokens ``t_off ..`` (grid: their token blocks) as ``fwd_gqa._indexer_fwd_gqa_kernel``,
    storing p into ``P [B, p_rows, N_K]``. SPLIT: the five-scalar states into ``PART [5, n_slots,
    B, p_rows]`` (row ``t - t_off``), slot ``slot0 + split``; else KL / LSE_I [B, N_Q] directly.
    STAGES: 0 whole tiles then the masked band, 1 whole tiles only, 2 the band only."""
    if SPLIT_MAJOR:
        split = tl.program_id(0)
        pid_t = tl.num_programs(1) - 1 - tl.program_id(1)  # causal: the longest key ranges first
    else:
        pid_t = tl.program_id(0)
        split = tl.program_id(1)
    b = tl.program_id(2)
    t0 = t_off + pid_t * BLOCK_T
    toks = t0 + tl.arange(0, BLOCK_T)
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_T], tl.float32)
    mass = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T], tl.float32)
    plogp = tl.zeros([BLOCK_T], tl.float32)
    key_lo = split * keys_per_split  # a multiple of BLOCK_N (the host rounds keys_per_split)
    full_hi, key_hi = _key_stages(t0, key_lo, tl.minimum(key_lo + keys_per_split, N_K), N_Q, N_K,
                                  BLOCK_T, BLOCK_N, CAUSAL)
    key_hi = tl.maximum(key_hi, key_lo)  # a split past the causal frontier walks nothing
    if STAGES != 2:
        m, l, mass, acc, plogp = _store_key_range(
            m, l, mass, acc, plogp, Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, P, P_DESC, stride_wb, stride_wh, stride_wn,
            b, t0, key_lo, full_hi, H, HK, HI, HKI, N_Q, N_K, qk_scale, log2_heads, t_off, p_rows,
            GROUP, GROUP_I, D_PAD, DI_PAD, BLOCK_T, BLOCK_N, False, CAUSAL, RELU, IEEE_T, IEEE_I, HEAD_LOOP, P_TMA)
    if STAGES != 1:
        m, l, mass, acc, plogp = _store_key_range(
            m, l, mass, acc, plogp, Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, P, P_DESC, stride_wb, stride_wh, stride_wn,
            b, t0, full_hi, key_hi, H, HK, HI, HKI, N_Q, N_K, qk_scale, log2_heads, t_off, p_rows,
            GROUP, GROUP_I, D_PAD, DI_PAD, BLOCK_T, BLOCK_N, True, CAUSAL, RELU, IEEE_T, IEEE_I, HEAD_LOOP, P_TMA)
    ok = toks < N_Q
    if SPLIT:
        row = b.to(tl.int64) * p_rows + (toks - t_off)
        plane = tl.num_programs(2).to(tl.int64) * n_slots * p_rows
        at = PART + (slot0 + split).to(tl.int64) * tl.num_programs(2) * p_rows + row
        tl.store(at, m, mask=ok)
        tl.store(at + plane, l, mask=ok)
        tl.store(at + 2 * plane, mass, mask=ok)
        tl.store(at + 3 * plane, acc, mask=ok)
        tl.store(at + 4 * plane, plogp, mask=ok)
    else:
        kl, lse_i = _finish(m, l, acc, plogp)
        out = b.to(tl.int64) * N_Q + toks
        tl.store(KL + out, kl, mask=ok)
        tl.store(LSE_I + out, lse_i, mask=ok)
