"""The indexer loss's forward that also accumulates the ``-p`` part of the gradient.

With a scalar reduction (``"sum"`` / ``"mean"``) the upstream gradient ``g`` is one number for
every row, so ``G = g (softmax(I) - p)`` splits into a student part ``g softmax(I)`` (needs only
the indexer: the backward's ``TEACHER=False`` kernels) and a target part ``-g p`` whose
contractions do not depend on ``g`` beyond a factor:

    dweights_p[j, t] = sum_s p relu(a_j),      dq_p[j, t] = sum_s p w_j 1[a_j > 0] k_idx[s],
    dk_p[s]          = sum_{j, t} p w_j 1[a_j > 0] q_idx[j, t]         (no indicator: relu=False)

This kernel is the forward (the online KL state of ``_indexer_fwd``) plus those three sums, so
the teacher is read once per training step: the backward then subtracts ``g * (dq_p, dk_p,
dweights_p)`` from the student part (``_indexer._loss_backward``). Extra memory: fp32 buffers of
the gradients' sizes.

Layout: one program per (block of BLOCK_T tokens, batch element); the teacher as in the forward
(chunks of HB heads x BLOCK_T tokens, ``_teacher_target``); the indexer as in the backward's dq
kernel: all GI_PAD heads of the one indexer key head (H_KI = 1: the host checks) x BLOCK_T tokens
as the rows of one tile, q_idx rows and weights loaded once. dq_p and dweights_p stay in
registers; each key tile's dk_p share is one fp32 atomic add of [BLOCK_N, D_I] into a zeroed
buffer: on Hopper (DK_TMA) one bulk TMA reduction; elsewhere per-element atomics, whose
[BLOCK_N, D_I] pointer tensor cost ~350 B of spills in an offline DSA compile.

NaN isolation as in the backward: in the masked stage the contraction operands (k_idx rows for
dq_p, q_idx rows for dk_p) are set to 0 where non-finite, so what a row cannot see never reaches
it as 0 * NaN.
"""
import triton
import triton.language as tl

from streamkl_gpu._core.jit import LOG2E, _dot, _key_stages, _to_bits
from streamkl_gpu.indexer.triton.bwd import _coef_a, _finite_or_zero, _query_rows
from streamkl_gpu.indexer.triton.fwd import (_finish, _indexer_logits, _indexer_logits_keys, _lse_columns, _online_update,
                           _teacher_target, _teacher_target_keys, _token_visible, _token_visible_keys,
                           _weight_columns)

__all__ = ["LOG2E"]


@triton.jit
def _teacher_target_tm(
    Q_DESC, K_DESC, LSE_T, b, t0, s0, H, GROUP, N_Q, N_K, diag_offset, qk_scale, inv_heads, n_chunks,
    chunks_per_group, D: tl.constexpr, BLOCK_D: tl.constexpr, HB: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, NO_CONTRACT: tl.constexpr,
):
    """``_indexer_fwd._teacher_target`` for one token (BLOCK_T = 1) through a token-major q
    descriptor: ``Q_DESC`` is over q viewed as [B, N, H, D], box [1, 1, HB, BLOCK_D], so a
    chunk's rows arrive as a [HB, BLOCK_D] tile that the product reads from shared memory (the
    head-major box [1, HB, 1, BLOCK_D] is reshaped through registers). Same values."""
    rows = tl.arange(0, HB)
    keys = s0 + tl.arange(0, BLOCK_N)
    key_ok = keys < N_K
    b64 = b.to(tl.int64)
    p = tl.zeros([1, BLOCK_N], tl.float32)
    tok_ok = (t0 + rows * 0) < N_Q  # [HB] (a tensor: the interpreter's masks must be)
    for c in range(0, n_chunks):
        kv = c // chunks_per_group
        h0 = kv * GROUP + (c % chunks_per_group) * HB
        h_in_group = (c % chunks_per_group) * HB + rows
        h = kv * GROUP + h_in_group
        row_ok = (h_in_group < GROUP) & tok_ok
        s = tl.zeros([HB, BLOCK_N], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            a = Q_DESC.load([b, t0, h0, d0]).reshape(HB, BLOCK_D)
            kt = K_DESC.load([b, kv, s0, d0]).reshape(BLOCK_N, BLOCK_D)
            s += _dot(a, tl.trans(kt), IEEE)
        lse = tl.load(LSE_T + (b64 * H + h) * N_Q + t0, mask=row_ok, other=float("-inf"))
        # log2 P_h = s - lse (bits). "!= -inf" keeps a NaN LSE a NaN (a NaN row stays NaN)
        x = _to_bits(s, qk_scale, NO_CONTRACT) - lse[:, None]
        visible = (row_ok & (lse != float("-inf")))[:, None]
        if MASKED:
            visible = visible & key_ok[None, :]
            if CAUSAL:  # bottom-right causal: key s visible to token t iff s <= t + (N_K - N_Q)
                visible = visible & (keys[None, :] <= t0 + diag_offset)
        e = tl.exp2(tl.where(visible, x, float("-inf")))
        p += tl.sum(e, axis=0)[None, :]
    return p * inv_heads


@triton.jit
def _target_shares(dq_p, dw_p, p, visible, a, k_tile, q_rows, q_for_dk, w_rows, row_ok, DK_P, DK_DESC,
                   b, s0, N_K, DI: tl.constexpr, DI_PAD: tl.constexpr, GI_PAD: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, RELU: tl.constexpr,
                   IEEE_I: tl.constexpr, DK_TMA: tl.constexpr, PARTS: tl.constexpr):
    """One key tile's target shares with g = 1: dq_p, dweights_p added (registers), dk_p's
    [BLOCK_N, D_I] share reduced into memory (PARTS = 2, timing only: not)."""
    ROWS: tl.constexpr = GI_PAD * BLOCK_T
    keys = s0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, DI_PAD)
    # the target part of G with g = 1, broadcast to the indexer rows (0 where not visible)
    p_vis = tl.where(visible, p, 0.0)
    p_rows = tl.reshape(tl.broadcast_to(p_vis[None, :, :], [GI_PAD, BLOCK_T, BLOCK_N]), [ROWS, BLOCK_N])
    vis_rows = tl.reshape(tl.broadcast_to(visible[None, :, :], [GI_PAD, BLOCK_T, BLOCK_N]), [ROWS, BLOCK_N])
    vis_rows = vis_rows & row_ok[:, None]
    coef, dw_terms = _coef_a(p_rows, vis_rows, a, w_rows, RELU)
    dw_p += tl.sum(dw_terms, 1)
    k_for_dq = k_tile
    if MASKED:  # a non-finite key that a row cannot see must not reach it through A @ k
        k_for_dq = _finite_or_zero(k_tile)
    dq_p += _dot(coef.to(k_tile.dtype), k_for_dq, IEEE_I)
    if PARTS >= 3:  # (not in the timing-only "nodk" variant)
        dk_part = _dot(tl.trans(coef.to(q_rows.dtype)), q_for_dk, IEEE_I)  # [BLOCK_N, DI_PAD]
        if DK_TMA:  # one bulk reduction (cp.reduce.async.bulk): no [BLOCK_N, D_I] pointer tensor
            DK_DESC.atomic_add([b, 0, s0, 0], dk_part.reshape(1, 1, BLOCK_N, DI_PAD))
        else:
            out = b.to(tl.int64) * N_K + keys
            tl.atomic_add(DK_P + out[:, None] * DI + offs_d[None, :], dk_part,
                          mask=(keys < N_K)[:, None] & (offs_d < DI)[None, :], sem="relaxed")
    return dq_p, dw_p


@triton.jit
def _pacc_key_range(
    m, l, mass, acc, plogp, dq_p, dw_p, q_rows, w_rows, row_ok,
    Q, K, KI, Q_DESC, K_DESC, KI_DESC, LSE_T, DK_P, DK_DESC,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_kib, stride_kin, stride_kid,
    b, t0, lo, hi, rot, H, GROUP, N_Q, N_K, qk_scale, inv_heads, n_chunks, chunks_per_group,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DI: tl.constexpr, DI_PAD: tl.constexpr,
    HB: tl.constexpr, GI_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, RELU: tl.constexpr,
    IEEE_T: tl.constexpr, IEEE_I: tl.constexpr, NO_CONTRACT: tl.constexpr, USE_TMA: tl.constexpr,
    DK_TMA: tl.constexpr, A_L1: tl.constexpr, PARTS: tl.constexpr, Q_TM: tl.constexpr = False,
):
    ROWS: tl.constexpr = GI_PAD * BLOCK_T
    diag_offset = N_K - N_Q
    toks = t0 + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, DI_PAD)
    b64 = b.to(tl.int64)
    ki_base = KI + b64 * stride_kib
    q_for_dk = q_rows
    if MASKED:  # a non-finite query row must not reach the keys it cannot see through A^T @ q
        q_for_dk = _finite_or_zero(q_rows)
    n_tiles = tl.cdiv(hi - lo, BLOCK_N)
    for i in range(0, n_tiles):
        # the unmasked stage starts at a tile that depends on the token block (then wraps), so
        # the programs running at once add their dk shares into different rows of dk_p, not all
        # into the same [BLOCK_N, D_I] rows at the same time (the online state is order-free)
        if MASKED:
            s0 = lo + i * BLOCK_N
        else:
            s0 = lo + ((i + rot) % n_tiles) * BLOCK_N
        keys = s0 + tl.arange(0, BLOCK_N)
        if Q_TM:  # one token, a token-major q descriptor (_teacher_target_tm)
            p = _teacher_target_tm(Q_DESC, K_DESC, LSE_T, b, t0, s0, H, GROUP, N_Q, N_K, diag_offset, qk_scale,
                                   inv_heads, n_chunks, chunks_per_group, D, BLOCK_D, HB, BLOCK_N,
                                   MASKED, CAUSAL, IEEE_T, NO_CONTRACT)
        else:
            p = _teacher_target(Q, K, Q_DESC, K_DESC, LSE_T, stride_qb, stride_qh, stride_qn, stride_qd,
                                stride_kb, stride_kh, stride_kn, stride_kd,
                                b, t0, s0, H, GROUP, N_Q, N_K, diag_offset, qk_scale, inv_heads,
                                n_chunks, chunks_per_group, D, BLOCK_D, HB, BLOCK_T, BLOCK_N,
                                MASKED, CAUSAL, IEEE_T, NO_CONTRACT, USE_TMA, A_L1)
        if USE_TMA:  # box [1, 1, BLOCK_N, DI_PAD]
            k_tile = KI_DESC.load([b, 0, s0, 0]).reshape(BLOCK_N, DI_PAD)
        else:
            k_tile = tl.load(ki_base + keys.to(tl.int64)[:, None] * stride_kin + offs_d[None, :] * stride_kid,
                             mask=(keys < N_K)[:, None] & (offs_d < DI)[None, :], other=0.0)
        visible = _token_visible(toks, keys, N_Q, N_K, diag_offset, MASKED, CAUSAL)
        if PARTS >= 1:
            a = _dot(q_rows, tl.trans(k_tile), IEEE_I)  # [ROWS, BLOCK_N]: row r = j * BLOCK_T + t
            if RELU:
                act = tl.maximum(a, 0.0, propagate_nan=tl.PropagateNan.ALL)  # relu(NaN) stays NaN
            else:
                act = a
            contrib = tl.where(row_ok[:, None], w_rows[:, None] * act, 0.0)
            logits = tl.sum(tl.reshape(contrib, [GI_PAD, BLOCK_T, BLOCK_N]), axis=0)
        else:  # timing only ("teacher" variant): the teacher's part alone, no indexer products
            a = tl.zeros([ROWS, BLOCK_N], tl.float32)
            logits = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
        m, l, mass, acc, plogp = _online_update(m, l, mass, acc, plogp, p, logits, visible)
        if PARTS >= 2:  # (not in the timing-only "logits" / "teacher" variants)
            dq_p, dw_p = _target_shares(
                dq_p, dw_p, p, visible, a, k_tile, q_rows, q_for_dk, w_rows, row_ok, DK_P, DK_DESC,
                b, s0, N_K, DI, DI_PAD, GI_PAD, BLOCK_T, BLOCK_N, MASKED, RELU, IEEE_I, DK_TMA, PARTS)
    return m, l, mass, acc, plogp, dq_p, dw_p


@triton.jit
def _pacc_key_range_kt(
    m, l, mass, acc, plogp, dq_p, dw_p, q_rows, w_rows, row_ok,
    Q, K, KI, Q_DESC, K_DESC, KI_DESC, LSE_T, DK_P, DK_DESC,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_kib, stride_kin, stride_kid,
    b, t0, lo, hi, rot, H, GROUP, N_Q, N_K, qk_scale, inv_heads, n_chunks, chunks_per_group,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DI: tl.constexpr, DI_PAD: tl.constexpr,
    HB: tl.constexpr, GI_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, RELU: tl.constexpr,
    IEEE_T: tl.constexpr, IEEE_I: tl.constexpr, NO_CONTRACT: tl.constexpr, USE_TMA: tl.constexpr,
    DK_TMA: tl.constexpr, A_L1: tl.constexpr, Q_TM: tl.constexpr = False, DK_HALVES: tl.constexpr = False,
):
    """``_pacc_key_range`` with the indexer's products transposed ("kt" variant): keys as the
    rows, ``aT = k_idx q_rows^T [BLOCK_N, ROWS]`` (column r = j * BLOCK_T + t). The q_idx rows
    are the B operand (they stay in shared memory, not registers), the sum over heads runs
    along the accumulator's columns, the target broadcasts along them, and the dk share is
    ``coefT @ q_rows`` straight from the accumulator (dq's operand is the transposed one)."""
    ROWS: tl.constexpr = GI_PAD * BLOCK_T
    diag_offset = N_K - N_Q
    toks = t0 + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, DI_PAD)
    b64 = b.to(tl.int64)
    ki_base = KI + b64 * stride_kib
    q_for_dk = q_rows
    if MASKED:  # a non-finite query row must not reach the keys it cannot see through A^T @ q
        q_for_dk = _finite_or_zero(q_rows)
    if DK_HALVES:  # q_for_dk's two D halves (DK_TMA only: the host checks)
        q_dk_lo, q_dk_hi = tl.split(tl.permute(tl.reshape(q_for_dk, [ROWS, 2, DI_PAD // 2]), [0, 2, 1]))
    n_tiles = tl.cdiv(hi - lo, BLOCK_N)
    for i in range(0, n_tiles):
        if MASKED:
            s0 = lo + i * BLOCK_N
        else:  # rotated start: concurrent programs reduce into different dk_p rows (see _pacc_key_range)
            s0 = lo + ((i + rot) % n_tiles) * BLOCK_N
        keys = s0 + tl.arange(0, BLOCK_N)
        if Q_TM:  # one token, a token-major q descriptor (_teacher_target_tm)
            p = _teacher_target_tm(Q_DESC, K_DESC, LSE_T, b, t0, s0, H, GROUP, N_Q, N_K, diag_offset, qk_scale,
                                   inv_heads, n_chunks, chunks_per_group, D, BLOCK_D, HB, BLOCK_N,
                                   MASKED, CAUSAL, IEEE_T, NO_CONTRACT)
        else:
            p = _teacher_target(Q, K, Q_DESC, K_DESC, LSE_T, stride_qb, stride_qh, stride_qn, stride_qd,
                                stride_kb, stride_kh, stride_kn, stride_kd,
                                b, t0, s0, H, GROUP, N_Q, N_K, diag_offset, qk_scale, inv_heads,
                                n_chunks, chunks_per_group, D, BLOCK_D, HB, BLOCK_T, BLOCK_N,
                                MASKED, CAUSAL, IEEE_T, NO_CONTRACT, USE_TMA, A_L1)
        if USE_TMA:  # box [1, 1, BLOCK_N, DI_PAD]
            k_tile = KI_DESC.load([b, 0, s0, 0]).reshape(BLOCK_N, DI_PAD)
        else:
            k_tile = tl.load(ki_base + keys.to(tl.int64)[:, None] * stride_kin + offs_d[None, :] * stride_kid,
                             mask=(keys < N_K)[:, None] & (offs_d < DI)[None, :], other=0.0)
        visible = _token_visible(toks, keys, N_Q, N_K, diag_offset, MASKED, CAUSAL)
        a_t = _dot(k_tile, tl.trans(q_rows), IEEE_I)  # [BLOCK_N, ROWS]
        if RELU:
            act_t = tl.maximum(a_t, 0.0, propagate_nan=tl.PropagateNan.ALL)  # relu(NaN) stays NaN
        else:
            act_t = a_t
        contrib_t = tl.where(row_ok[None, :], w_rows[None, :] * act_t, 0.0)
        logits = tl.trans(tl.sum(tl.reshape(contrib_t, [BLOCK_N, GI_PAD, BLOCK_T]), axis=1))  # [BLOCK_T, BLOCK_N]
        m, l, mass, acc, plogp = _online_update(m, l, mass, acc, plogp, p, logits, visible)
        # the target part of G with g = 1, broadcast along the columns (0 where not visible)
        p_t = tl.trans(tl.where(visible, p, 0.0))  # [BLOCK_N, BLOCK_T]
        p_cols = tl.reshape(tl.broadcast_to(p_t[:, None, :], [BLOCK_N, GI_PAD, BLOCK_T]), [BLOCK_N, ROWS])
        vis_t = tl.trans(visible)
        vis_cols = tl.reshape(tl.broadcast_to(vis_t[:, None, :], [BLOCK_N, GI_PAD, BLOCK_T]), [BLOCK_N, ROWS])
        vis_cols = vis_cols & row_ok[None, :]
        if RELU:
            coef_t = p_cols * w_rows[None, :] * (a_t > 0).to(tl.float32)
        else:
            coef_t = p_cols * w_rows[None, :]
        coef_t = tl.where(vis_cols, coef_t, 0.0)
        dw_p += tl.sum(tl.where(vis_cols, p_cols * act_t, 0.0), 0)
        k_for_dq = k_tile
        if MASKED:  # a non-finite key that a row cannot see must not reach it through A @ k
            k_for_dq = _finite_or_zero(k_tile)
        dq_p += _dot(tl.trans(coef_t.to(k_tile.dtype)), k_for_dq, IEEE_I)  # [ROWS, DI_PAD]
        if DK_HALVES:  # the share in two D halves, one reduction each: half the live accumulator
            HALF: tl.constexpr = DI_PAD // 2
            dk_lo = _dot(coef_t.to(q_rows.dtype), q_dk_lo, IEEE_I)  # [BLOCK_N, DI_PAD / 2]
            DK_DESC.atomic_add([b, 0, s0, 0], dk_lo.reshape(1, 1, BLOCK_N, HALF))
            dk_hi = _dot(coef_t.to(q_rows.dtype), q_dk_hi, IEEE_I)
            DK_DESC.atomic_add([b, 0, s0, HALF], dk_hi.reshape(1, 1, BLOCK_N, HALF))
        elif DK_TMA:  # one bulk reduction (cp.reduce.async.bulk)
            dk_part = _dot(coef_t.to(q_rows.dtype), q_for_dk, IEEE_I)  # [BLOCK_N, DI_PAD]
            DK_DESC.atomic_add([b, 0, s0, 0], dk_part.reshape(1, 1, BLOCK_N, DI_PAD))
        else:
            dk_part = _dot(coef_t.to(q_rows.dtype), q_for_dk, IEEE_I)  # [BLOCK_N, DI_PAD]
            out = b64 * N_K + keys
            tl.atomic_add(DK_P + out[:, None] * DI + offs_d[None, :], dk_part,
                          mask=(keys < N_K)[:, None] & (offs_d < DI)[None, :], sem="relaxed")
    return m, l, mass, acc, plogp, dq_p, dw_p


@triton.jit
def _indexer_fwd_pacc_kernel(
    Q, K, QI, KI, W, LSE_T, KL, LSE_I, DQ_P, DW_P, DK_P,
    Q_DESC, K_DESC, QI_DESC, KI_DESC,  # TMA descriptors of q, k, q_idx, k_idx (used when USE_TMA)
    DK_DESC,  # dk_p's descriptor, box [1, 1, BLOCK_N, DI_PAD] (used when DK_TMA)
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
    stride_wb, stride_wh, stride_wn,
    H, GROUP, H_I, N_Q, N_K, qk_scale, inv_heads, n_chunks, chunks_per_group,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DI: tl.constexpr, DI_PAD: tl.constexpr,
    HB: tl.constexpr, GI_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, RELU: tl.constexpr, IEEE_T: tl.constexpr, IEEE_I: tl.constexpr,
    NO_CONTRACT: tl.constexpr, USE_TMA: tl.constexpr, DK_TMA: tl.constexpr, A_L1: tl.constexpr = False,
    PARTS: tl.constexpr = 3, KEY_ROWS: tl.constexpr = False, Q_TM: tl.constexpr = False,
    DK_HALVES: tl.constexpr = False,
):
    """KL and LSE_I [B, N_Q] as ``_indexer_fwd_kernel``; dq_p [B, H_I, N_Q, D_I] and dweights_p
    [B, H_I, N_Q] stored, dk_p [B, 1, N_K, D_I] added (fp32, contiguous; dk_p zeroed)."""
    ROWS: tl.constexpr = GI_PAD * BLOCK_T
    pid_t = tl.program_id(0)
    b = tl.program_id(1)
    t0 = pid_t * BLOCK_T
    toks = t0 + tl.arange(0, BLOCK_T)
    rows = tl.arange(0, ROWS)
    tok = t0 + rows % BLOCK_T
    j = rows // BLOCK_T
    row_ok = (j < H_I) & (tok < N_Q)
    b64 = b.to(tl.int64)
    q_rows = _query_rows(QI, QI_DESC, b, 0, t0, j, tok, row_ok, stride_qib, stride_qih, stride_qin,
                         stride_qid, DI, DI_PAD, ROWS, USE_TMA)
    w_rows = tl.load(W + b64 * stride_wb + j.to(tl.int64) * stride_wh + tok.to(tl.int64) * stride_wn,
                     mask=row_ok, other=0.0).to(tl.float32)
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_T], tl.float32)
    mass = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T], tl.float32)
    plogp = tl.zeros([BLOCK_T], tl.float32)
    dq_p = tl.zeros([ROWS, DI_PAD], tl.float32)
    dw_p = tl.zeros([ROWS], tl.float32)
    full_hi, key_hi = _key_stages(t0, 0, N_K, N_Q, N_K, BLOCK_T, BLOCK_N, CAUSAL)
    if KEY_ROWS:  # the "kt" variant: the indexer's products transposed (_pacc_key_range_kt)
        m, l, mass, acc, plogp, dq_p, dw_p = _pacc_key_range_kt(
            m, l, mass, acc, plogp, dq_p, dw_p, q_rows, w_rows, row_ok, Q, K, KI, Q_DESC, K_DESC, KI_DESC, LSE_T, DK_P, DK_DESC,
            stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
            stride_kib, stride_kin, stride_kid, b, t0, 0, full_hi, pid_t, H, GROUP, N_Q, N_K, qk_scale, inv_heads,
            n_chunks, chunks_per_group, D, BLOCK_D, DI, DI_PAD, HB, GI_PAD, BLOCK_T, BLOCK_N,
            False, CAUSAL, RELU, IEEE_T, IEEE_I, NO_CONTRACT, USE_TMA, DK_TMA, A_L1, Q_TM, DK_HALVES)
        m, l, mass, acc, plogp, dq_p, dw_p = _pacc_key_range_kt(
            m, l, mass, acc, plogp, dq_p, dw_p, q_rows, w_rows, row_ok, Q, K, KI, Q_DESC, K_DESC, KI_DESC, LSE_T, DK_P, DK_DESC,
            stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
            stride_kib, stride_kin, stride_kid, b, t0, full_hi, key_hi, 0, H, GROUP, N_Q, N_K, qk_scale, inv_heads,
            n_chunks, chunks_per_group, D, BLOCK_D, DI, DI_PAD, HB, GI_PAD, BLOCK_T, BLOCK_N,
            True, CAUSAL, RELU, IEEE_T, IEEE_I, NO_CONTRACT, USE_TMA, DK_TMA, A_L1, Q_TM, DK_HALVES)
    else:
        m, l, mass, acc, plogp, dq_p, dw_p = _pacc_key_range(
            m, l, mass, acc, plogp, dq_p, dw_p, q_rows, w_rows, row_ok, Q, K, KI, Q_DESC, K_DESC, KI_DESC, LSE_T, DK_P, DK_DESC,
            stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
            stride_kib, stride_kin, stride_kid, b, t0, 0, full_hi, pid_t, H, GROUP, N_Q, N_K, qk_scale, inv_heads,
            n_chunks, chunks_per_group, D, BLOCK_D, DI, DI_PAD, HB, GI_PAD, BLOCK_T, BLOCK_N,
            False, CAUSAL, RELU, IEEE_T, IEEE_I, NO_CONTRACT, USE_TMA, DK_TMA, A_L1, PARTS, Q_TM)
        m, l, mass, acc, plogp, dq_p, dw_p = _pacc_key_range(
            m, l, mass, acc, plogp, dq_p, dw_p, q_rows, w_rows, row_ok, Q, K, KI, Q_DESC, K_DESC, KI_DESC, LSE_T, DK_P, DK_DESC,
            stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
            stride_kib, stride_kin, stride_kid, b, t0, full_hi, key_hi, 0, H, GROUP, N_Q, N_K, qk_scale, inv_heads,
            n_chunks, chunks_per_group, D, BLOCK_D, DI, DI_PAD, HB, GI_PAD, BLOCK_T, BLOCK_N,
            True, CAUSAL, RELU, IEEE_T, IEEE_I, NO_CONTRACT, USE_TMA, DK_TMA, A_L1, PARTS, Q_TM)
    kl, lse_i = _finish(m, l, acc, plogp)
    ok = toks < N_Q
    out = b64 * N_Q + toks
    tl.store(KL + out, kl, mask=ok)
    tl.store(LSE_I + out, lse_i, mask=ok)
    offs_d = tl.arange(0, DI_PAD)
    out_row = (b64 * H_I + j) * N_Q + tok
    tl.store(DQ_P + out_row[:, None] * DI + offs_d[None, :], dq_p, mask=row_ok[:, None] & (offs_d < DI)[None, :])
    tl.store(DW_P + out_row, dw_p, mask=row_ok)


# ----------------------------------------------------------------------------------------------
# The "store" design: the plain forward's tile (the forward's launch configs) that also writes
# the target p [B, N_Q, N_K] it forms; the backward's teacher-free kernels read it back
# (_indexer_bwd, P_SAVED), so the teacher is read once per training step and no gradient-sized
# accumulators are carried in the forward's registers. Extra memory: B * N_Q * N_K floats
# (_indexer.pstore_enabled caps it).
# ----------------------------------------------------------------------------------------------

@triton.jit
def _pstore_key_range(
    m, l, mass, acc, plogp,
    Q, K, QI, KI, Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, P,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
    stride_wb, stride_wh, stride_wn,
    b, t0, lo, hi, H, GROUP, GROUP_I, N_Q, N_K, qk_scale, inv_heads,
    n_chunks, chunks_per_group, n_ichunks, ichunks_per_group, t_off, p_rows,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DI: tl.constexpr, BLOCK_DI: tl.constexpr,
    HB: tl.constexpr, IB: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, RELU: tl.constexpr,
    IEEE_T: tl.constexpr, IEEE_I: tl.constexpr, NO_CONTRACT: tl.constexpr, USE_TMA: tl.constexpr,
    A_L1: tl.constexpr, KEYS_MAJOR: tl.constexpr = False,
):
    """_indexer_fwd._fwd_key_range's loop, plus one store of each tile's p (0 where masked):
    token t's row of P is ``b * p_rows + t - t_off`` (a chunk of p_rows tokens from t_off).
    KEYS_MAJOR: the keys-major score tiles of _indexer_fwd, p^T stored transposed."""
    diag_offset = N_K - N_Q
    toks = t0 + tl.arange(0, BLOCK_T)
    p_row = (b.to(tl.int64) * p_rows + (toks - t_off).to(tl.int64)) * N_K
    tok_ok = toks < N_Q
    if KEYS_MAJOR:  # the per-column LSEs and weights of the first head chunk, once per program
        lse_first = _lse_columns(LSE_T, b, t0, H, GROUP, N_Q, 0, chunks_per_group, HB, BLOCK_T)
        w_first = _weight_columns(W, stride_wb, stride_wh, stride_wn, b, t0, GROUP_I, N_Q, 0, ichunks_per_group,
                                  IB, BLOCK_T)
    for s0 in range(lo, hi, BLOCK_N):
        keys = s0 + tl.arange(0, BLOCK_N)
        if KEYS_MAJOR:  # [BLOCK_N, BLOCK_T] tiles, the state's sums along axis 0
            p_t = _teacher_target_keys(Q, K, Q_DESC, K_DESC, LSE_T, stride_qb, stride_qh, stride_qn, stride_qd,
                                       stride_kb, stride_kh, stride_kn, stride_kd,
                                       b, t0, s0, H, GROUP, N_Q, N_K, diag_offset, qk_scale, inv_heads,
                                       n_chunks, chunks_per_group, D, BLOCK_D, HB, BLOCK_T, BLOCK_N,
                                       MASKED, CAUSAL, IEEE_T, NO_CONTRACT, USE_TMA, lse_first)
            logits_t = _indexer_logits_keys(QI, KI, QI_DESC, KI_DESC, W, stride_qib, stride_qih, stride_qin, stride_qid,
                                            stride_kib, stride_kih, stride_kin, stride_kid, stride_wb, stride_wh,
                                            stride_wn, b, t0, s0, GROUP_I, N_Q, N_K, n_ichunks, ichunks_per_group,
                                            DI, BLOCK_DI, IB, BLOCK_T, BLOCK_N, RELU, IEEE_I, USE_TMA, w_first)
            visible_t = _token_visible_keys(toks, keys, N_Q, N_K, diag_offset, MASKED, CAUSAL)
            m, l, mass, acc, plogp = _online_update(m, l, mass, acc, plogp, p_t, logits_t, visible_t, 0, True)
            tl.store(P + p_row[None, :] + keys[:, None], p_t.to(P.dtype.element_ty),
                     mask=tok_ok[None, :] & (keys < N_K)[:, None])
        else:
            p = _teacher_target(Q, K, Q_DESC, K_DESC, LSE_T, stride_qb, stride_qh, stride_qn, stride_qd,
                                stride_kb, stride_kh, stride_kn, stride_kd,
                                b, t0, s0, H, GROUP, N_Q, N_K, diag_offset, qk_scale, inv_heads,
                                n_chunks, chunks_per_group, D, BLOCK_D, HB, BLOCK_T, BLOCK_N,
                                MASKED, CAUSAL, IEEE_T, NO_CONTRACT, USE_TMA, A_L1)
            logits = _indexer_logits(QI, KI, QI_DESC, KI_DESC, W, stride_qib, stride_qih, stride_qin, stride_qid,
                                     stride_kib, stride_kih, stride_kin, stride_kid, stride_wb, stride_wh, stride_wn,
                                     b, t0, s0, GROUP_I, N_Q, N_K, n_ichunks, ichunks_per_group,
                                     DI, BLOCK_DI, IB, BLOCK_T, BLOCK_N, RELU, IEEE_I, USE_TMA, A_L1)
            visible = _token_visible(toks, keys, N_Q, N_K, diag_offset, MASKED, CAUSAL)
            m, l, mass, acc, plogp = _online_update(m, l, mass, acc, plogp, p, logits, visible)
            tl.store(P + p_row[:, None] + keys[None, :], p.to(P.dtype.element_ty),
                     mask=tok_ok[:, None] & (keys < N_K)[None, :])
    return m, l, mass, acc, plogp


@triton.jit
def _indexer_fwd_pstore_kernel(
    Q, K, QI, KI, W, LSE_T, KL, LSE_I, PART, P,
    Q_DESC, K_DESC, QI_DESC, KI_DESC,  # TMA descriptors of q, k, q_idx, k_idx (used when USE_TMA)
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
    stride_wb, stride_wh, stride_wn,
    H, GROUP, GROUP_I, N_Q, N_K, qk_scale, inv_heads,
    n_chunks, chunks_per_group, n_ichunks, ichunks_per_group, keys_per_split, t_off, p_rows,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DI: tl.constexpr, BLOCK_DI: tl.constexpr,
    HB: tl.constexpr, IB: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, RELU: tl.constexpr, IEEE_T: tl.constexpr, IEEE_I: tl.constexpr,
    NO_CONTRACT: tl.constexpr, USE_TMA: tl.constexpr, SPLIT: tl.constexpr, A_L1: tl.constexpr = False,
    KEYS_MAJOR: tl.constexpr = False, LPT: tl.constexpr = False,
):
    """``_indexer_fwd._indexer_fwd_kernel`` (same grid, key splits and outputs) that also stores
    the target ``p`` of every tile it visits into ``P [B, p_rows, N_K]`` (tiles past a block's
    causal frontier are not written: the backward reads only visible entries). The grid covers
    the tokens ``t_off ..`` (a chunk of p_rows tokens; the whole problem: 0 and N_Q). LPT: token
    blocks in reverse order (causal: the longest rows first), as the forward's."""
    pid_t = tl.program_id(0)
    if LPT:
        pid_t = tl.num_programs(0) - 1 - pid_t
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
    m, l, mass, acc, plogp = _pstore_key_range(
        m, l, mass, acc, plogp, Q, K, QI, KI, Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, P,
        stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
        stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
        stride_wb, stride_wh, stride_wn, b, t0, key_lo, full_hi, H, GROUP, GROUP_I, N_Q, N_K, qk_scale, inv_heads,
        n_chunks, chunks_per_group, n_ichunks, ichunks_per_group, t_off, p_rows, D, BLOCK_D, DI, BLOCK_DI,
        HB, IB, BLOCK_T, BLOCK_N, False, CAUSAL, RELU, IEEE_T, IEEE_I, NO_CONTRACT, USE_TMA, A_L1, KEYS_MAJOR)
    m, l, mass, acc, plogp = _pstore_key_range(
        m, l, mass, acc, plogp, Q, K, QI, KI, Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, P,
        stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
        stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
        stride_wb, stride_wh, stride_wn, b, t0, full_hi, key_hi, H, GROUP, GROUP_I, N_Q, N_K, qk_scale,
        inv_heads, n_chunks, chunks_per_group, n_ichunks, ichunks_per_group, t_off, p_rows, D, BLOCK_D, DI, BLOCK_DI,
        HB, IB, BLOCK_T, BLOCK_N, True, CAUSAL, RELU, IEEE_T, IEEE_I, NO_CONTRACT, USE_TMA, A_L1, KEYS_MAJOR)
    ok = toks < N_Q
    out = b.to(tl.int64) * N_Q + toks
    if SPLIT:
        plane = tl.num_programs(1).to(tl.int64) * tl.num_programs(2) * N_Q
        at = PART + split.to(tl.int64) * tl.num_programs(2) * N_Q + out
        tl.store(at, m, mask=ok)
        tl.store(at + plane, l, mask=ok)
        tl.store(at + 2 * plane, mass, mask=ok)
        tl.store(at + 3 * plane, acc, mask=ok)
        tl.store(at + 4 * plane, plogp, mask=ok)
    else:
        kl, lse_i = _finish(m, l, acc, plogp)
        tl.store(KL + out, kl, mask=ok)
        tl.store(LSE_I + out, lse_i, mask=ok)
