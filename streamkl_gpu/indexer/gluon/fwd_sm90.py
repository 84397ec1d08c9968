"""Hopper (sm_90) forward of the indexer loss in Gluon, for an MQA teacher (the DSA-like
config: H = 128, D = 576, H_K = 1; H_I = 64, D_I = 128, H_KI = 1).

Same outputs and conventions as ``_indexer_fwd._indexer_fwd_kernel`` with two key splits (the
Triton path is the reference this kernel is checked against on the GPU, beside float64): the
five-scalar state ``m, l, mass, acc, plogp`` of ``streamkl_ref.indexer_kl_online`` per token,
teacher scores in bits (``mul.rn``, then the head's LSE subtracted), the target ``p`` summed over
heads on chip, the student's logits in nats, bottom-right causal. The host merges the two
consumer warpgroups' states (``_indexer._merge_splits``).

Why: the Triton forward re-reads a token's 128 x 576 teacher query rows (147 KB) from L2 for
every key tile, as the A operand of each score tile: ~64 FLOP per byte of L2 traffic at 128 x 128
tiles, and the measured forward (25 ms at 8K, 3.5x the matmul floor) runs at ~3 TB/s of it.
Here one CTA owns one token and keeps its teacher query rows (all heads, all of D) and indexer
query rows resident in shared memory for the whole key loop; only key tiles stream (TMA, in
64-wide D chunks through one ring), ~116 FLOP per byte at DSA.

Schedule: one CTA per (token, batch element), causal tokens longest first.
- a producer warp loads q (cdiv(D, 64) boxes of all heads x 64 dims) and q_idx once, then for
  every key tile its cdiv(D, 64) teacher key chunks and cdiv(D_I, 64) indexer key chunks
  ([BLOCK_N, 64] each), in tile order, into the ring of the warpgroup that takes the tile (the
  NUM_STAGES slots split between the two, the first taking the odd one);
- two consumer warpgroups take the key tiles in turn (tile i: warpgroup i % 2). The score tiles
  are transposed, keys as rows: ``s [BLOCK_N keys, NT heads] = K_chunk q_chunk^T`` chained over
  the D chunks (A: the streamed key chunk; B: the resident query chunk; N = all teacher heads,
  64 or 128, so one m64 x N x k16 wgmma per 16 dims), ``a [BLOCK_N, 64]`` likewise for the
  indexer. A ring slot is released once the products reading it have retired. Each warpgroup has
  its own ring: with one ring shared in turn, warpgroup 1's first chunks (11 per DSA tile, 7
  slots) sit a whole phase past slots whose first load may not have landed, where a parity wait on
  a fresh barrier passes at once (a stale read, then a release the producer counts for another
  chunk). In its own ring a warpgroup waits for a chunk only after releasing the chunk the slot
  held before, so the slot's last completed phase is that one's. Then the fold:
  ``p[s] = (1/H) sum_h exp2(s_h - lse_h)`` and ``I[s] = sum_j w_j relu(a_j)`` are row sums
  (within a thread and 4 lanes, no cross-warp reduction), and the online update. The ring order
  makes the warpgroups take turns on the tensor cores: one's exponentials run while the other's
  products do.

Masks (keys >= N_K, the causal band) are selections on the per-key vectors after the head sums:
a masked key adds exactly 0 to every sum, whatever its scores (NaN included). Heads past H and
indexer heads past H_I are TMA zero fill; their LSE is +inf (teacher) and weight 0 (indexer).

This module imports Gluon unconditionally; ``_indexer`` guards the import.
"""
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra import libdevice

from streamkl_gpu._core import forcing as _forcing
from streamkl_gpu._core.gluon_compat import tma_load
from streamkl_gpu._core.launcher import kernel_call


HEADS = gl.constexpr(64)  # heads per wgmma (its M), teacher and indexer
DCH = gl.constexpr(64)  # D chunk of a box (128 bytes of bf16: the 128-byte swizzle)
LOG2E = 1.4426950408889634
_LOG2E = gl.constexpr(LOG2E)
SMEM_BYTES = 227 * 1024  # dynamic shared memory per CTA on sm_90
SMEM_RESERVE = 4096  # barriers and the compiler's reduction scratch


@gluon.constexpr_function
def _acc_layout(n):
    # wgmma accumulator of one warpgroup: [64 keys, n heads] fp32
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, int(n), 16])


@gluon.jit
def _load_partition(q_desc, k_desc, qi_desc, ki_desc, q_smem, qi_smem, ring, q_bar, ready, empty,
                    b, t, n_tiles, rot, DC: gl.constexpr, DIC: gl.constexpr,
                    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Producer warp: the token's q and q_idx rows once, then the key chunks of every tile."""
    mbarrier.expect(q_bar, DC * q_desc.block_type.nbytes + DIC * qi_desc.block_type.nbytes)
    for c in gl.static_range(DC):
        tma_load(q_desc, [b, 0, t, c * DCH], q_bar, q_smem.index(c))
    for c in gl.static_range(DIC):
        tma_load(qi_desc, [b, 0, t, c * DCH], q_bar, qi_smem.index(c))
    NCH: gl.constexpr = DC + DIC
    SH0: gl.constexpr = (NUM_STAGES + 1) // 2  # warpgroup 0's ring: slots 0 .. SH0 - 1
    SH1: gl.constexpr = NUM_STAGES // 2  # warpgroup 1's: SH0 ..
    for i in range(n_tiles):
        key0 = ((i + rot) % n_tiles) * BLOCK_N  # the i-th tile walked (rotated by rot)
        sh = gl.where(i % 2 == 0, SH0, SH1)
        for c in gl.static_range(NCH):
            g = (i // 2) * NCH + c  # the chunk's place in warpgroup i % 2's ring
            s = (i % 2) * SH0 + g % sh
            ph = (g // sh) & 1
            mbarrier.wait(empty.index(s), ph ^ 1)  # a fresh barrier passes the phase-1 wait
            mbarrier.expect(ready.index(s), k_desc.block_type.nbytes)
            if c < DC:
                tma_load(k_desc, [b, 0, key0, c * DCH], ready.index(s), ring.index(s))
            else:
                tma_load(ki_desc, [b, 0, key0, (c - DC) * DCH], ready.index(s), ring.index(s))


@gluon.jit
def _chunk(g, base: gl.constexpr, ring, ready, SH: gl.constexpr, BLOCK_N: gl.constexpr):
    """Slot of chunk ``g`` of the ring at ``base`` (``SH`` slots) once it has landed: the wgmma's A
    operand [BLOCK_N keys, 64]."""
    s = base + g % SH
    mbarrier.wait(ready.index(s), (g // SH) & 1)
    return ring.index(s).reshape([BLOCK_N, DCH])


@gluon.jit
def _scores(q_smem, qi_smem, ring, ready, empty, g0, base: gl.constexpr, zero_t, zero_i,
            NT: gl.constexpr, DC: gl.constexpr, DIC: gl.constexpr, BLOCK_N: gl.constexpr,
            SH: gl.constexpr, KEEP_KI: gl.constexpr):
    """The score tiles of one key tile, keys as rows: teacher ``s [BLOCK_N, NT]`` (all heads in
    one wgmma N) and indexer ``a [BLOCK_N, 64]``, fp32, chained over the D chunks (A: the
    streamed key chunk; B: the resident query chunk, transposed). A ring slot is released once
    the products reading it have retired (every wait inside the tile); KEEP_KI: the indexer key
    chunks stay (the accumulating fold reads them again, then releases them)."""
    s = zero_t
    for c in gl.static_range(DC):
        kc = _chunk(g0 + c, base, ring, ready, SH, BLOCK_N)
        s = warpgroup_mma(kc, q_smem.index(c).reshape([NT, DCH]).permute((1, 0)), s, use_acc=c > 0, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        if c > 0:  # chunk c - 1's product has retired: its slot is free
            mbarrier.arrive(empty.index(base + (g0 + c - 1) % SH), count=1)
    a = zero_i
    for c in gl.static_range(DIC):
        kc = _chunk(g0 + DC + c, base, ring, ready, SH, BLOCK_N)
        a = warpgroup_mma(kc, qi_smem.index(c).reshape([HEADS, DCH]).permute((1, 0)), a, use_acc=c > 0,
                          is_async=True)
        s, a = warpgroup_mma_wait(num_outstanding=1, deps=(s, a))
        if (c == 0 and DC > 0) or (c > 0 and not KEEP_KI):  # the previous chunk's slot
            mbarrier.arrive(empty.index(base + (g0 + DC + c - 1) % SH), count=1)
    s, a = warpgroup_mma_wait(num_outstanding=0, deps=(s, a))
    if not KEEP_KI:
        mbarrier.arrive(empty.index(base + (g0 + DC + DIC - 1) % SH), count=1)
    return s, a


@gluon.jit
def _safe(m):
    # shift to use for a running max: 0 while the row has seen no visible key (m == -inf)
    return gl.where(m == float("-inf"), 0.0, m)


@gluon.constexpr_function
def _coef_layout(dtype):
    # the coefficient tile [BLOCK_N keys, 64 heads], an A operand (and, permuted, an A of dq)
    return gl.NVMMASharedLayout.get_default_for([64, 64], dtype)


@gluon.constexpr_function
def _rows_layout():
    # [BLOCK_N, 64] bf16 tiles read from / written to shared memory: 16-byte vectors per thread
    return gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])


@gluon.jit
def _pacc_fold(p, visible, a, w, dq0, dq1, dw, cs, qi_smem, ring, empty, DK_P, b64, g0, base: gl.constexpr, tile,
               key_lim, N_K, zero_i, DC: gl.constexpr, DIC: gl.constexpr, DI: gl.constexpr, BLOCK_N: gl.constexpr,
               SH: gl.constexpr, RELU: gl.constexpr):
    """The target's share of the gradient for one key tile (g = 1; ``_indexer_pacc``'s sums):
    ``coef[s, j] = p[s] w_j 1[a > 0]`` (0 where not visible), ``dweights_p[j] += sum_s p relu(a)``,
    ``dq_p[j] += coef^T k_idx``, ``dk_p[s] += coef q_idx`` (fp32 atomics). ``a`` is relu'd already
    (RELU). Then the tile's indexer key chunks are released.

    NaN isolation: in the tile with invisible keys, their k_idx rows are zeroed in the ring slot
    (this warpgroup's alone) before ``coef^T k_idx``, and the dk rows of invisible keys are
    selected away before the add, so a non-finite key or query row never reaches what cannot see it."""
    i_layout: gl.constexpr = a.type.layout
    irow: gl.constexpr = gl.SliceLayout(1, i_layout)
    p_i = gl.convert_layout(p, irow)  # 0 where not visible
    vis_i = gl.convert_layout(visible, irow)
    if RELU:
        coef = p_i[:, None] * w[None, :] * (a > 0.0).to(gl.float32)  # multiplied: a NaN p stays NaN
    else:
        coef = p_i[:, None] * w[None, :]
    coef = gl.where(vis_i[:, None], coef, 0.0)
    dw += gl.sum(gl.where(vis_i[:, None], p_i[:, None] * a, 0.0), axis=0)
    cs.store(coef.to(cs.dtype))
    if (tile + 1) * BLOCK_N > key_lim:  # the tile with invisible keys: zero their k_idx rows
        rl: gl.constexpr = _rows_layout()
        key_ok = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, rl)) < key_lim
        for c in gl.static_range(DIC):
            slot = ring.index(base + (g0 + DC + c) % SH).reshape([BLOCK_N, DCH])
            x = slot.load(rl)
            slot.store(gl.where(key_ok[:, None], x, 0.0).to(x.dtype))
    fence_async_shared()
    # dq_p += coef^T k_idx (both chunks in flight), then dk_p's shares chunk by chunk (one
    # [BLOCK_N, 64] fp32 tile of registers at a time)
    k0 = ring.index(base + (g0 + DC) % SH).reshape([BLOCK_N, DCH])
    dq0 = warpgroup_mma(cs.permute((1, 0)), k0, dq0, is_async=True)
    if DIC == 2:
        k1 = ring.index(base + (g0 + DC + 1) % SH).reshape([BLOCK_N, DCH])
        dq1 = warpgroup_mma(cs.permute((1, 0)), k1, dq1, is_async=True)
    keys = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=irow)
    cols = gl.arange(0, DCH, layout=gl.SliceLayout(0, i_layout))
    ok = (keys < key_lim)[:, None]
    at = DK_P + b64 * N_K * DI + (keys[:, None] * DI + cols[None, :])
    for c in gl.static_range(DIC):
        dk = warpgroup_mma(cs, qi_smem.index(c).reshape([HEADS, DCH]), zero_i, use_acc=False, is_async=True)
        if DIC == 2:
            dq0, dq1, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dq0, dq1, dk))
        else:
            dq0, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dq0, dk))
        if c == 0:  # every product reading the tile's k_idx chunks has retired
            for cc in gl.static_range(DIC):
                mbarrier.arrive(empty.index(base + (g0 + DC + cc) % SH), count=1)
        gl.atomic_add(at + c * DCH, gl.where(ok, dk, 0.0), mask=ok & (c * DCH + cols < DI)[None, :], sem="relaxed")
    return dq0, dq1, dw


@gluon.jit
def _consumer(WG: gl.constexpr, q_smem, qi_smem, ring, coef_smem, vec_smem, q_bar, ready, empty, LSE_T, W, PART,
              DQ_P, DW_P, DK_P, P, T_OFF, P_ROWS, b, t, n_tiles, rot, H, H_I, N_Q, N_K, stride_wb, stride_wh,
              stride_wn, qk_scale, inv_heads, part_plane,
              NT: gl.constexpr, DC: gl.constexpr, DIC: gl.constexpr, DI: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, RELU: gl.constexpr, PACC: gl.constexpr,
              STUDENT: gl.constexpr, STORE: gl.constexpr):
    """Walked tiles WG, WG + 2, ... of token t (tile ``(i + rot) % n_tiles``): the online state,
    stored as key split WG. PACC: also the target's share of the gradient (g = 1), added into
    DQ_P [B, H_I, N_Q, DI], DW_P [B, H_I, N_Q], DK_P [B, 1, N_K, DI] (zeroed fp32). STUDENT
    (the backward, no teacher: DC = 0, PACC): the same sums with ``softmax(I)`` in place of
    ``p``, from the student's LSE ``LSE_T [B, N_Q]`` (nats); no state stored. STORE (the chunk
    design's storing forward): also the target row of token t, ``p`` of its visible keys, into row
    ``t - T_OFF`` of ``P [B, P_ROWS, N_K]`` (fp32; the gradient kernel reads only visible keys)."""
    t_layout: gl.constexpr = _acc_layout(NT)
    i_layout: gl.constexpr = _acc_layout(HEADS)
    key_layout: gl.constexpr = gl.SliceLayout(1, t_layout)
    NCH: gl.constexpr = DC + DIC
    b64 = b.to(gl.int64)
    # teacher LSEs (bits), one per column: +inf for heads past H and for -inf (a head without
    # visible keys), so exp2(s - lse) = 0 there; a NaN LSE stays NaN
    heads = gl.arange(0, NT, layout=gl.SliceLayout(0, t_layout))
    if STUDENT:
        lse_i = gl.load(LSE_T + b64 * N_Q + t)  # the student's LSE (nats), a row with keys: finite
        lse = gl.zeros([NT], gl.float32, gl.SliceLayout(0, t_layout))
    else:
        lse = gl.load(LSE_T + (b64 * H + heads) * N_Q + t, mask=heads < H, other=float("inf"))
        lse = gl.where(lse == float("-inf"), float("inf"), lse)
    iheads = gl.arange(0, HEADS, layout=gl.SliceLayout(0, i_layout))
    w = gl.load(W + b64 * stride_wb + iheads.to(gl.int64) * stride_wh + t.to(gl.int64) * stride_wn,
                mask=iheads < H_I, other=0.0).to(gl.float32)
    if PACC:  # LSEs and weights parked in shared memory, re-read per tile: the fold needs the registers
        lse_s = vec_smem.slice(2 * WG * 128, NT)
        w_s = vec_smem.slice((2 * WG + 1) * 128, HEADS)
        if not STUDENT:
            lse_s.store(lse)
        w_s.store(w)
    zero_t = gl.zeros([BLOCK_N, NT], gl.float32, t_layout)
    zero_i = gl.zeros([BLOCK_N, HEADS], gl.float32, i_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=key_layout)
    key_lim = N_K
    if CAUSAL:  # bottom-right causal: key s visible to token t iff s <= t + (N_K - N_Q)
        key_lim = gl.minimum(N_K, t + (N_K - N_Q) + 1)
    m = gl.to_tensor(float("-inf"))
    l = gl.to_tensor(0.0)
    mass = gl.to_tensor(0.0)
    acc = gl.to_tensor(0.0)
    plogp = gl.to_tensor(0.0)
    # PACC state: dq_p of the token's indexer heads ([64 heads, 64 dims] per D_I chunk, as the
    # accumulator of coef^T @ k_idx) and dweights_p (per head)
    dq0 = zero_i
    dq1 = zero_i
    dw = gl.zeros([HEADS], gl.float32, gl.SliceLayout(0, i_layout))
    cs = coef_smem.index(WG)
    mbarrier.wait(q_bar, 0)
    SH: gl.constexpr = (NUM_STAGES + 1 - WG) // 2  # this warpgroup's ring: slots base .. base + SH - 1
    base: gl.constexpr = WG * ((NUM_STAGES + 1) // 2)
    for i in range(WG, n_tiles, 2):
        g0 = (i // 2) * NCH  # the tile's first chunk in this warpgroup's ring
        tile = (i + rot) % n_tiles
        s, a = _scores(q_smem, qi_smem, ring, ready, empty, g0, base, zero_t, zero_i, NT, DC, DIC, BLOCK_N,
                       SH, PACC)
        if PACC:
            w = w_s.load(gl.SliceLayout(0, i_layout))
        if not STUDENT:
            if PACC:
                lse = lse_s.load(gl.SliceLayout(0, t_layout))
            # the target: row sums of 2^(s_h - lse_h) over the heads (scores in bits, rounded once)
            p = gl.sum(gl.exp2(libdevice.mul_rn(s, qk_scale) - lse[None, :]), axis=1)
        if RELU:
            a = gl.where(a < 0.0, 0.0, a)  # relu; NaN stays NaN
        logits = gl.convert_layout(gl.sum(a * w[None, :], axis=1), key_layout)
        keys = tile * BLOCK_N + offs_n
        visible = keys < key_lim
        if STUDENT:  # softmax(I) from the forward's LSE_I in place of the target
            p = gl.where(visible, gl.exp2((logits - lse_i) * _LOG2E), 0.0)
        else:
            p = gl.where(visible, p * inv_heads, 0.0)
            if STORE:
                gl.store(P + (b64 * P_ROWS + (t - T_OFF)) * N_K + keys, p, mask=keys < N_K)
            # the online update (_indexer_fwd._online_update on one token)
            m_new = gl.maximum(m, gl.max(gl.where(visible, logits, float("-inf")), axis=0))
            shift = _safe(m_new)
            centred = logits - shift
            e_i = gl.exp2(gl.where(visible, centred, float("-inf")) * _LOG2E)
            alpha = gl.exp2((m - shift) * _LOG2E)
            l = l * alpha + gl.sum(e_i, axis=0)
            log_p = gl.log(gl.where(visible & (p > 0), p, 1.0))
            plogp += gl.sum(gl.where(visible, p * log_p, 0.0), axis=0)
            acc = acc - mass * (shift - _safe(m)) + gl.sum(gl.where(visible, p * centred, 0.0), axis=0)
            mass += gl.sum(p, axis=0)
            m = m_new
        if PACC:
            dq0, dq1, dw = _pacc_fold(p, visible, a, w, dq0, dq1, dw, cs, qi_smem, ring, empty, DK_P, b64, g0, base,
                                      tile, key_lim, N_K, zero_i, DC, DIC, DI, BLOCK_N, SH, RELU)
    if PACC:  # this warpgroup's share of the token's dq_p / dweights_p (the other adds its own)
        rows = gl.arange(0, HEADS, layout=gl.SliceLayout(1, i_layout))
        cols = gl.arange(0, DCH, layout=gl.SliceLayout(0, i_layout))
        dq_at = DQ_P + ((b64 * H_I + rows[:, None]) * N_Q + t) * DI
        ok = (rows < H_I)[:, None]
        gl.atomic_add(dq_at + cols[None, :], dq0, mask=ok & (cols < DI)[None, :], sem="relaxed")
        if DIC == 2:
            gl.atomic_add(dq_at + DCH + cols[None, :], dq1, mask=ok & (DCH + cols < DI)[None, :], sem="relaxed")
        gl.atomic_add(DW_P + (b64 * H_I + iheads) * N_Q + t, dw, mask=iheads < H_I, sem="relaxed")
    if not STUDENT:
        at = PART + (WG * gl.num_programs(1) + b64) * N_Q + t  # PART [5, 2, B, N_Q]
        gl.store(at, m)
        gl.store(at + part_plane, l)
        gl.store(at + 2 * part_plane, mass)
        gl.store(at + 3 * part_plane, acc)
        gl.store(at + 4 * part_plane, plogp)


@gluon.jit
def _consumer0(q_smem, qi_smem, ring, coef_smem, vec_smem, q_bar, ready, empty, LSE_T, W, PART, DQ_P, DW_P, DK_P,
               P, T_OFF, P_ROWS, b, t, n_tiles, rot, H, H_I, N_Q, N_K, stride_wb, stride_wh, stride_wn, qk_scale,
               inv_heads, part_plane, NT: gl.constexpr, DC: gl.constexpr, DIC: gl.constexpr, DI: gl.constexpr,
               BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, RELU: gl.constexpr,
               PACC: gl.constexpr, STUDENT: gl.constexpr, STORE: gl.constexpr):
    _consumer(0, q_smem, qi_smem, ring, coef_smem, vec_smem, q_bar, ready, empty, LSE_T, W, PART, DQ_P, DW_P, DK_P,
              P, T_OFF, P_ROWS, b, t, n_tiles, rot, H, H_I, N_Q, N_K, stride_wb, stride_wh, stride_wn, qk_scale,
              inv_heads, part_plane, NT, DC, DIC, DI, BLOCK_N, NUM_STAGES, CAUSAL, RELU, PACC, STUDENT, STORE)


@gluon.jit
def _consumer1(q_smem, qi_smem, ring, coef_smem, vec_smem, q_bar, ready, empty, LSE_T, W, PART, DQ_P, DW_P, DK_P,
               P, T_OFF, P_ROWS, b, t, n_tiles, rot, H, H_I, N_Q, N_K, stride_wb, stride_wh, stride_wn, qk_scale,
               inv_heads, part_plane, NT: gl.constexpr, DC: gl.constexpr, DIC: gl.constexpr, DI: gl.constexpr,
               BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, RELU: gl.constexpr,
               PACC: gl.constexpr, STUDENT: gl.constexpr, STORE: gl.constexpr):
    _consumer(1, q_smem, qi_smem, ring, coef_smem, vec_smem, q_bar, ready, empty, LSE_T, W, PART, DQ_P, DW_P, DK_P,
              P, T_OFF, P_ROWS, b, t, n_tiles, rot, H, H_I, N_Q, N_K, stride_wb, stride_wh, stride_wn, qk_scale,
              inv_heads, part_plane, NT, DC, DIC, DI, BLOCK_N, NUM_STAGES, CAUSAL, RELU, PACC, STUDENT, STORE)


@gluon.jit
def _gluon_indexer_fwd_kernel(q_desc, k_desc, qi_desc, ki_desc, LSE_T, W, PART, DQ_P, DW_P, DK_P, P, T_OFF, P_ROWS,
                              H, H_I, N_Q, N_K, stride_wb, stride_wh, stride_wn, qk_scale, inv_heads,
                              NT: gl.constexpr, DC: gl.constexpr, DIC: gl.constexpr, DI: gl.constexpr,
                              BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                              RELU: gl.constexpr, PACC: gl.constexpr, STUDENT: gl.constexpr, STORE: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """Grid (tokens, B): one CTA per token, tokens ``T_OFF ..`` (0 .. N_Q - 1 but in the chunk
    design's storing forward). PART [5, 2, B, N_Q] (m, l, mass, acc, plogp per consumer
    warpgroup); LSE_T [B, H, N_Q] teacher LSEs in bits. PACC: DQ_P, DW_P, DK_P get the target's
    share of the gradient (zeroed fp32 buffers; else unused). STORE: P [B, P_ROWS, N_K] gets the
    tokens' target rows (else unused)."""
    t = gl.program_id(0)
    if CAUSAL:  # the longest tokens (most key tiles) first: fewer idle SMs in the last wave
        t = gl.num_programs(0) - 1 - t
    t = T_OFF + t
    b = gl.program_id(1)
    key_hi = N_K
    if CAUSAL:
        key_hi = gl.maximum(gl.minimum(N_K, t + (N_K - N_Q) + 1), 0)
    n_tiles = gl.cdiv(key_hi, BLOCK_N)
    # PACC: the walk starts at a token-dependent tile (then wraps), so that the CTAs running at
    # once add their dk_p shares into different rows (the online state is order-free)
    rot = 0
    if PACC:
        rot = t % gl.maximum(n_tiles, 1)
    part_plane = 2 * gl.num_programs(1) * N_Q

    if DC > 0:
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [DC, 1, NT, 1, DCH], q_desc.layout)
    qi_smem = gl.allocate_shared_memory(qi_desc.dtype, [DIC, 1, HEADS, 1, DCH], qi_desc.layout)
    ring = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, 1, 1, BLOCK_N, DCH], k_desc.layout)
    if DC == 0:  # STUDENT: no teacher rows (unused)
        q_smem = ring
    if PACC:  # one coefficient tile per consumer warpgroup; its LSEs and weights
        coef_smem = gl.allocate_shared_memory(k_desc.dtype, [2, BLOCK_N, HEADS], _coef_layout(k_desc.dtype))
        vec_smem = gl.allocate_shared_memory(gl.float32, [4 * 128], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:  # unused
        coef_smem = ring
        vec_smem = ring
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)  # the one warpgroup that read the slot releases it

    # argument tuples inline: a tuple bound to a local turns its constexprs into tensors (sketch)
    gl.warp_specialize([
        (_consumer0, (q_smem, qi_smem, ring, coef_smem, vec_smem, q_bar, ready, empty, LSE_T, W, PART, DQ_P, DW_P, DK_P,
                      P, T_OFF, P_ROWS, b, t, n_tiles, rot, H, H_I, N_Q, N_K, stride_wb, stride_wh, stride_wn,
                      qk_scale, inv_heads, part_plane, NT, DC, DIC, DI, BLOCK_N, NUM_STAGES, CAUSAL, RELU, PACC,
                      STUDENT, STORE)),
        (_consumer1, (q_smem, qi_smem, ring, coef_smem, vec_smem, q_bar, ready, empty, LSE_T, W, PART, DQ_P, DW_P, DK_P,
                      P, T_OFF, P_ROWS, b, t, n_tiles, rot, H, H_I, N_Q, N_K, stride_wb, stride_wh, stride_wn,
                      qk_scale, inv_heads, part_plane, NT, DC, DIC, DI, BLOCK_N, NUM_STAGES, CAUSAL, RELU, PACC,
                      STUDENT, STORE)),
        (_load_partition, (q_desc, k_desc, qi_desc, ki_desc, q_smem, qi_smem, ring, q_bar, ready, empty,
                           b, t, n_tiles, rot, DC, DIC, BLOCK_N, NUM_STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------

# Registers: the CTA is 3 warpgroups (two consumers; the producer warp's group), launched at
# maxnreg = 168 (168 x 384 threads = 64512 of the SM's 65536); setmaxnreg then gives each
# consumer warpgroup CONSUMER_REGS and the producer's group the rest, a multiple of 8.
CTA_THREADS = 384
CTA_REGS = 168 * CTA_THREADS


def producer_regs(consumer_regs: int) -> int:
    return min(256, (CTA_REGS - 2 * 128 * consumer_regs) // 128 // 8 * 8)


MAX_HEADS = 128  # two 64-head wgmma per D chunk
MAX_INDEXER_HEADS = 64
CHUNK_BYTES = 64 * 64 * 2  # one resident [64 heads, 64 dims] box of bf16/fp16


def resident_bytes(H: int, D: int, DI: int, student: bool = False) -> int:
    """Shared memory of the resident q (not in the student backward) and q_idx rows of one token."""
    return ((0 if student else triton.cdiv(H, 64) * triton.cdiv(D, 64)) + triton.cdiv(DI, 64)) * CHUNK_BYTES


def ring_stages(H: int, D: int, DI: int, block_n: int, most: int = 8, pacc: bool = False, student: bool = False) -> int:
    """Ring slots that fit beside the resident rows (0: none fit, the kernel does not apply), split
    between the consumer warpgroups' rings (the first takes the odd one); ``pacc`` (and
    ``student``, the backward): beside the two coefficient tiles [block_n, 64] too."""
    free = (SMEM_BYTES - SMEM_RESERVE - resident_bytes(H, D, DI, student)
            - (2 * block_n * 64 * 2 if (pacc or student) else 0))
    return max(0, min(most, free // (block_n * 64 * 2)))


def why_not(dims, dtypes, tensors_tma_ok: bool, capability, pacc: bool = False) -> str:
    """Why the Gluon forward (``pacc``: the accumulating one) does not apply to a problem ('' when
    it does): pure, CPU-testable."""
    if tuple(capability) != (9, 0):
        return f"compute capability {tuple(capability)}, not (9, 0)"
    if len(set(dtypes)) != 1 or dtypes[0] not in (torch.bfloat16, torch.float16):
        return f"dtypes {dtypes}: q, k, q_idx, k_idx must all be float16 or all bfloat16"
    if dims.HK != 1 or dims.HKI != 1:
        return f"H_K = {dims.HK}, H_KI = {dims.HKI}: one teacher and one indexer key head only"
    if dims.H > MAX_HEADS or dims.HI > MAX_INDEXER_HEADS:
        return f"H = {dims.H}, H_I = {dims.HI}: at most {MAX_HEADS} and {MAX_INDEXER_HEADS}"
    if not tensors_tma_ok:
        return "a tensor is not TMA-legal (unit stride in D, 16-byte aligned base and strides)"
    if pacc and dims.DI > 128:
        return f"D_I = {dims.DI}: the accumulating forward holds dq_p for D_I <= 128"
    if ring_stages(dims.H, dims.D, dims.DI, 64, pacc=pacc) < 4:
        return f"D = {dims.D}, D_I = {dims.DI}: the resident rows leave no room for two key rings of two slots"
    return ""


@dataclass(frozen=True)
class GluonIndexerConfig:
    """One launch of the Hopper Gluon indexer forward: key tiles of ``block_n`` keys through a ring
    of ``num_stages`` TMA slots, the consumer warpgroups at ``consumer_regs`` registers per thread
    (setmaxnreg; the producer's group gets the rest, ``producer_regs``). Equal fields are one launch."""
    block_n: int
    num_stages: int
    consumer_regs: int = 240


def candidates(dims, pacc: bool = False, student: bool = False):
    """Launch configurations (:class:`GluonIndexerConfig`), default first: 64-key tiles, the
    deepest rings that fit (DSA-like: 7 slots, 4 and 3 for the consumer warpgroups), and 4 slots. 128-key
    tiles hold three [64, 128] fp32 accumulators per thread: 66 local loads/stores per key tile
    in an offline sm_90 compile (triton 3.9); 64-key tiles none but one reload. Not yet timed."""
    stages = ring_stages(dims.H, dims.D, dims.DI, 64, pacc=pacc, student=student)
    if stages < 4:
        return []
    return list(dict.fromkeys([GluonIndexerConfig(block_n=64, num_stages=stages),
                               GluonIndexerConfig(block_n=64, num_stages=min(stages, 4))]))


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def make_descriptor(t, block):
    """4-D TMA descriptor over ``t`` ([B, H, N, D], TMA-legal strides) with box ``block``."""
    layout = gl.NVMMASharedLayout.get_default_for(block, getattr(gl, _GL_DTYPES[t.dtype]))
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def launch_args(q, k, q_idx, k_idx, weights, lse_bits, part, causal, scale, relu, config=None, grads=None,
                student=False, store=None):
    """(grid, positional args, constexprs, options) of one launch (the CI compile test passes the
    same to ``GluonASTSource``). ``lse_bits``: [B, H, N_Q] fp32 contiguous, teacher LSEs in bits;
    ``part``: [5, 2, B, N_Q] fp32; ``grads``: the accumulating forward's zeroed fp32 buffers
    (dq_p [B, H_I, N_Q, D_I], dw_p [B, H_I, N_Q], dk_p [B, 1, N_K, D_I]), or None. ``student``:
    the backward's student part into ``grads`` (no teacher; ``lse_bits`` is then the student's
    LSE [B, N_Q] in nats, ``part`` unused). ``store``: ``(p, t_off, rows)``, the chunk design's
    storing forward (:func:`storing_states`), or None. ``config``: a :class:`GluonIndexerConfig`
    (None: the first of :func:`candidates`)."""
    B, H, N_Q, D = q.shape
    N_K, H_I, DI = k.shape[2], q_idx.shape[1], q_idx.shape[3]
    pacc = grads is not None
    cfg = config if config is not None else candidates(SimpleNamespace(H=H, D=D, DI=DI), pacc, student)[0]
    block_n, stages, regs = cfg.block_n, cfg.num_stages, cfg.consumer_regs
    nt = 64 if H <= 64 else 128  # all teacher heads in one wgmma N
    descs = (make_descriptor(q, [1, nt, 1, 64]), make_descriptor(k, [1, 1, block_n, 64]),
             make_descriptor(q_idx, [1, 64, 1, 64]), make_descriptor(k_idx, [1, 1, block_n, 64]))
    dq_p, dw_p, dk_p = grads if pacc else (part, part, part)
    p, t_off, rows = store if store is not None else (part, 0, N_Q)
    args = descs + (lse_bits, weights, part, dq_p, dw_p, dk_p, p, t_off, p.shape[1] if store is not None else 0,
                    H, H_I, N_Q, N_K, *weights.stride(), float(scale * LOG2E), 1.0 / H)
    constexprs = dict(NT=nt, DC=0 if student else triton.cdiv(D, 64), DIC=triton.cdiv(DI, 64), DI=DI,
                      BLOCK_N=block_n, NUM_STAGES=stages, CAUSAL=bool(causal), RELU=bool(relu), PACC=pacc,
                      STUDENT=bool(student), STORE=store is not None, CONSUMER_REGS=regs,
                      PRODUCER_REGS=producer_regs(regs))
    return (rows, B), args, constexprs, dict(num_warps=4, maxnreg=CTA_REGS // CTA_THREADS)


def student_grads(q, k, q_idx, k_idx, weights, lse_idx, causal, relu, grads, config=None):
    """The backward's student part with g = 1 (``g softmax(I)``'s contractions, no teacher), added
    into ``grads`` = (dq_s, dw_s, dk_s), zeroed fp32 buffers shaped as the accumulating forward's
    (``lse_idx``: the forward's student LSE [B, N_Q], nats, fp32 contiguous)."""
    grid, args, constexprs, options = launch_args(q, k, q_idx, k_idx, weights, lse_idx, lse_idx, causal, 1.0, relu,
                                                  config, grads, student=True)
    kernel = kernel_call(_gluon_indexer_fwd_kernel, grid)(*args, **constexprs, **options)
    _forcing.record("indexer_fwd_sm90", kernel, **constexprs)  # for an open forcing block
    return grads


def forward_states(q, k, q_idx, k_idx, weights, lse_bits, causal, scale, relu, config=None, part=None, grads=None):
    """Launch: the two consumer warpgroups' states ``part [5, 2, B, N_Q]`` (merge with
    ``_indexer._merge_splits``); ``grads``: see :func:`launch_args` (the accumulating forward).
    The caller (``_indexer``) has checked applicability."""
    B, _, N_Q, _ = q.shape
    if part is None:
        part = torch.empty((5, 2, B, N_Q), dtype=torch.float32, device=q.device)
    grid, args, constexprs, options = launch_args(q, k, q_idx, k_idx, weights, lse_bits, part, causal, scale, relu,
                                                  config, grads)
    kernel = kernel_call(_gluon_indexer_fwd_kernel, grid)(*args, **constexprs, **options)
    _forcing.record("indexer_fwd_sm90", kernel, **constexprs)  # for an open forcing block
    return part


def storing_states(q, k, q_idx, k_idx, weights, lse_bits, causal, scale, relu, part, p, t_off, rows, config=None):
    """The chunk design's storing forward on tokens ``t_off .. t_off + rows - 1``: their two
    consumer states into ``part [5, 2, B, N_Q]`` (as :func:`forward_states`; merge the chunk's rows
    with ``fwd_gqa.merge_states_wide``) and their target rows into ``p [B, P_ROWS, N_K]`` (fp32,
    row ``t - t_off``; only visible keys are written)."""
    grid, args, constexprs, options = launch_args(q, k, q_idx, k_idx, weights, lse_bits, part, causal, scale, relu,
                                                  config, store=(p, t_off, rows))
    kernel = kernel_call(_gluon_indexer_fwd_kernel, grid)(*args, **constexprs, **options)
    _forcing.record("indexer_fwd_sm90", kernel, **constexprs)  # for an open forcing block
    return part


def emulate_states(q, k, q_idx, k_idx, weights, lse_bits, causal, scale, relu, block_n=64, grads=None, student=False):
    """The kernel's schedule in float64 PyTorch, for CPU tests (Gluon does not run under the
    interpreter): per token, the key tiles walked in the kernel's order (rotated when ``grads``
    is given), tile i folded into warpgroup i % 2's state; returns ``part [5, 2, B, N_Q]`` and
    adds the accumulating forward's shares into ``grads`` (dq_p, dw_p, dk_p); ``student``: the
    backward's student shares instead (``lse_bits`` is then the student's LSE [B, N_Q], nats).
    Checks the decomposition (interleaved key splits, merge, rotation, the shares), not the
    Gluon code."""
    LN2 = 0.6931471805599453
    B, H, N_Q, D = q.shape
    N_K = k.shape[2]
    qd, kd, qid, kid, wd = (x.detach().double().cpu() for x in (q, k, q_idx, k_idx, weights))
    lse = lse_bits.detach().double().cpu()
    part = torch.zeros(5, 2, B, N_Q, dtype=torch.float64)
    part[0] = float("-inf")
    gq, gw, gk = ([g.detach().double().cpu().clone() for g in grads] if grads is not None else (None, None, None))
    for b in range(B):
        for t in range(N_Q):
            key_lim = min(N_K, t + (N_K - N_Q) + 1) if causal else N_K
            n_tiles = -(-max(key_lim, 0) // block_n)
            rot = t % max(n_tiles, 1) if grads is not None else 0
            lse_t = None if student else torch.where(lse[b, :, t] == float("-inf"), float("inf"), lse[b, :, t])
            for i in range(n_tiles):
                wg, tile = i % 2, (i + rot) % n_tiles
                keys = torch.arange(tile * block_n, min((tile + 1) * block_n, N_K))
                vis = keys < key_lim
                a = kid[b, 0, keys] @ qid[b, :, t].T  # [keys, H_I]
                act = a.clamp_min(0) if relu else a
                logits = act @ wd[b, :, t]
                if student:  # softmax(I) in place of the target
                    p = torch.where(vis, torch.exp(logits - lse[b, t]), 0.0)
                else:
                    s_bits = (kd[b, 0, keys] @ qd[b, :, t].T) * (scale / LN2)  # [keys, H]
                    p = torch.where(vis, torch.exp2(s_bits - lse_t[None, :]).sum(1) / H, 0.0)
                m, l, mass, acc, plogp = part[:, wg, b, t].tolist()
                m_new = max(m, logits[vis].max().item())
                shift = 0.0 if m_new == float("-inf") else m_new
                centred = logits - shift
                l = l * (torch.exp(torch.tensor(m - shift)).item()) + torch.exp(centred[vis]).sum().item()
                pv = p[vis]
                plogp += (pv * torch.log(torch.where(pv > 0, pv, 1.0))).sum().item()
                acc = acc - mass * (shift - (0.0 if m == float("-inf") else m)) + (pv * centred[vis]).sum().item()
                mass += pv.sum().item()
                part[:, wg, b, t] = torch.tensor([m_new, l, mass, acc, plogp], dtype=torch.float64)
                if grads is not None:
                    coef = p[:, None] * wd[b, :, t][None, :] * ((a > 0).double() if relu else 1.0)
                    coef = torch.where(vis[:, None], coef, 0.0)
                    gw[b, :, t] += (torch.where(vis[:, None], p[:, None] * act, 0.0)).sum(0)
                    gq[b, :, t] += coef.T @ kid[b, 0, keys]
                    gk[b, 0, keys] += coef @ qid[b, :, t]
    if grads is not None:
        for dst, src in zip(grads, (gq, gw, gk)):
            dst.copy_(src.to(dst.dtype))
    return part.float().to(q.device)
