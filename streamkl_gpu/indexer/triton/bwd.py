"""Backward Triton kernels of the indexer loss: recompute tile by tile (docs/math.md, "The indexer loss").

Per (token block, key tile), from the teacher LSEs (bits) and the student's LSE_I (nats) that the
forward saved:

    p = (1/H) sum_h exp2(s_h - lse_h)                (the teacher target, _teacher_target)
    G = g * (exp(I - LSE_I) - p)                      (dKL/dI, 0 where masked)
    A[j] = G * w_j * 1[a_j > 0]                       (no indicator when relu=False)
    dweights[j, t] = sum_s G relu(a_j),  dq_idx[j, t] = sum_s A[j] k_idx,  dk_idx[s] = sum_{j, t} A[j]^T q_idx

Two kernels:
- ``_indexer_bwd_dq_kernel``: one program per (token block, b, indexer key head): loops over the
  key tiles the block sees, dq_idx and dweights of the group's heads in registers (no atomics).
- ``_indexer_bwd_dk_kernel``: one program per (key tile, b, indexer key head, token split): loops
  over the token blocks of its split that see the tile, dk_idx in registers; with more than one
  split the partial dk_idx are fp32 atomic adds (one [BLOCK_N, D_I] add per program).
Each recomputes the teacher target (the dominant cost): the plain ("separate") design reads
the teacher twice per backward. ``FUSED_DQ`` ("fused"): the dk kernel alone, adding each tile's
dq_idx / dweights share with fp32 atomics (the teacher read once per backward, at the price of
about N_Q * N_K / BLOCK_N * H_I * D_I atomic adds). ``DK_SHARE`` ("dqk"): the dq kernel alone,
adding each tile's dk_idx share (one TMA bulk reduction per tile on Hopper).

Where the target comes from: the teacher (``TEACHER``), nowhere (the accumulating design: the
student's part only, the forward summed the target's), or the forward's stored p (``P_SAVED``,
the "store" design: ``LSE_T`` then points at p [B, N_Q, N_K]). ``LOGITS_FROM_A`` (one indexer
key head): the student's logits are summed from the kernel's own products a, not formed again.

NaN isolation: every masked entry is selected to 0 (``tl.where``) before it is multiplied, and in
the masked stage (the diagonal band) the operand rows of the contraction (k_idx rows in dq,
q_idx rows in dk) are set to 0 where non-finite: a key (query row) that a row (key) cannot
see then contributes 0, never 0 * NaN; rows that do see it get the NaN through A.

``L1`` (the "l1" config variant, pointer loads): the teacher tile operand each kernel re-reads
is cached in L1: the token block's q rows in the dq kernel (re-read for every key tile), the key
tile in the dk kernel (re-read for every token block).
"""
import triton
import triton.language as tl

from streamkl_gpu._core.jit import LOG2E, _dot, _key_stages
from streamkl_gpu.indexer.triton.fwd import _indexer_logits, _teacher_target, _token_visible


@triton.jit
def _finite_or_zero(x):
    return tl.where((x == x) & (tl.abs(x) < float("inf")), x, 0.0)


@triton.jit
def _query_rows(QI, QI_DESC, b, j0, t0, j, tok, row_ok, stride_qib, stride_qih, stride_qin, stride_qid,
                DI: tl.constexpr, DI_PAD: tl.constexpr, ROWS: tl.constexpr, USE_TMA: tl.constexpr):
    """q_idx rows ``r = (j - j0) * BLOCK_T + t`` as [ROWS, DI_PAD], 0 outside ``row_ok`` and past D_I."""
    if USE_TMA:  # box [1, GI_PAD, BLOCK_T, DI_PAD] (the plan's IB = GI_PAD, BLOCK_DI = DI_PAD)
        rows = QI_DESC.load([b, j0, t0, 0]).reshape(ROWS, DI_PAD)
        rows = tl.where(row_ok[:, None], rows, 0.0)  # the box's rows past the group are other heads
    else:
        offs_d = tl.arange(0, DI_PAD)
        off = b.to(tl.int64) * stride_qib + j.to(tl.int64) * stride_qih + tok.to(tl.int64) * stride_qin
        rows = tl.load(QI + off[:, None] + offs_d[None, :] * stride_qid,
                       mask=row_ok[:, None] & (offs_d < DI)[None, :], other=0.0)
    return rows


@triton.jit
def _token_block(QI, QI_DESC, W, T_OFF, H_KI, GROUP_I, N_Q, stride_qib, stride_qih, stride_qin, stride_qid,
                 stride_wb, stride_wh, stride_wn, DI: tl.constexpr, DI_PAD: tl.constexpr, GI_PAD: tl.constexpr,
                 BLOCK_T: tl.constexpr, USE_TMA: tl.constexpr, LPT: tl.constexpr = False):
    """The program's token block (grid: token blocks from T_OFF, B * H_KI) and every indexer head of
    its key head ``kvi``, as ``r = j * BLOCK_T + t`` rows (``GI_PAD * BLOCK_T``): ``(b, kvi, t0,
    tok, j, ok, q_rows [rows, DI_PAD], w [rows] fp32)``, q rows and weights 0 where not ``ok``.
    LPT: token blocks in reverse order (causal: the longest rows start first, the short ones fill
    the last wave)."""
    ROWS: tl.constexpr = GI_PAD * BLOCK_T
    pid_t = tl.program_id(0)
    if LPT:
        pid_t = tl.num_programs(0) - 1 - pid_t
    pid_bk = tl.program_id(1)
    b = pid_bk // H_KI
    kvi = pid_bk % H_KI
    t0 = T_OFF + pid_t * BLOCK_T
    rows = tl.arange(0, ROWS)
    tok = t0 + rows % BLOCK_T
    j_in_group = rows // BLOCK_T
    j = kvi * GROUP_I + j_in_group
    ok = (j_in_group < GROUP_I) & (tok < N_Q)
    q_rows = _query_rows(QI, QI_DESC, b, kvi * GROUP_I, t0, j, tok, ok, stride_qib, stride_qih, stride_qin,
                         stride_qid, DI, DI_PAD, ROWS, USE_TMA)
    w = tl.load(W + b.to(tl.int64) * stride_wb + j.to(tl.int64) * stride_wh + tok.to(tl.int64) * stride_wn,
                mask=ok, other=0.0).to(tl.float32)
    return b, kvi, t0, tok, j, ok, q_rows, w


@triton.jit
def _row_grad_coef(
    Q, K, QI, KI, Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, LSE_I, G_UP,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
    stride_wb, stride_wh, stride_wn,
    b, t0, s0, H, GROUP, GROUP_I, N_Q, N_K, qk_scale, inv_heads,
    n_chunks, chunks_per_group, n_ichunks, ichunks_per_group, a_rows, w_rows, row_ok, t_off, p_rows,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DI: tl.constexpr, BLOCK_DI: tl.constexpr,
    HB: tl.constexpr, IB: tl.constexpr, GI_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, RELU: tl.constexpr,
    IEEE_T: tl.constexpr, IEEE_I: tl.constexpr, NO_CONTRACT: tl.constexpr, USE_TMA: tl.constexpr, TEACHER: tl.constexpr,
    L1_Q: tl.constexpr, L1_K: tl.constexpr, P_SAVED: tl.constexpr = False, LOGITS_FROM_A: tl.constexpr = False,
):
    """``(G, visible)`` of one [BLOCK_T, BLOCK_N] tile, broadcast to the indexer rows
    ``r = j * BLOCK_T + t`` ([GI_PAD * BLOCK_T, BLOCK_N]); G is 0 where not visible.

    LOGITS_FROM_A (one indexer key head: the caller's rows are every indexer head): the logits
    are summed from the caller's products ``a_rows`` (raw operands, [ROWS, BLOCK_N]), its
    ``w_rows`` and ``row_ok``, not formed again by ``_indexer_logits`` (one product per tile fewer)."""
    diag_offset = N_K - N_Q
    toks = t0 + tl.arange(0, BLOCK_T)
    keys = s0 + tl.arange(0, BLOCK_N)
    if TEACHER:
        p = _teacher_target(Q, K, Q_DESC, K_DESC, LSE_T, stride_qb, stride_qh, stride_qn, stride_qd,
                            stride_kb, stride_kh, stride_kn, stride_kd,
                            b, t0, s0, H, GROUP, N_Q, N_K, diag_offset, qk_scale, inv_heads,
                            n_chunks, chunks_per_group, D, BLOCK_D, HB, BLOCK_T, BLOCK_N,
                            MASKED, CAUSAL, IEEE_T, NO_CONTRACT, USE_TMA, L1_Q, L1_K)
    elif P_SAVED:  # the target the forward stored ("store" design, _indexer_pacc): LSE_T is p [B, N_Q, N_K]
        # read only where visible: the forward wrote the tiles its own blocks visited, no others
        p_ok = _token_visible(toks, keys, N_Q, N_K, diag_offset, True, CAUSAL)
        p_at = (b.to(tl.int64) * p_rows + (toks - t_off).to(tl.int64))[:, None] * N_K + keys[None, :]
        p = tl.load(LSE_T + p_at, mask=p_ok, other=0.0).to(tl.float32)
    else:  # the student's part only: the forward accumulated the -p part (_indexer_pacc)
        p = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    if LOGITS_FROM_A:
        if RELU:
            act = tl.maximum(a_rows, 0.0, propagate_nan=tl.PropagateNan.ALL)  # relu(NaN) stays NaN
        else:
            act = a_rows
        contrib = tl.where(row_ok[:, None], w_rows[:, None] * act, 0.0)
        logits = tl.sum(tl.reshape(contrib, [GI_PAD, BLOCK_T, BLOCK_N]), axis=0)
    else:
        logits = _indexer_logits(QI, KI, QI_DESC, KI_DESC, W, stride_qib, stride_qih, stride_qin, stride_qid,
                                 stride_kib, stride_kih, stride_kin, stride_kid, stride_wb, stride_wh, stride_wn,
                                 b, t0, s0, GROUP_I, N_Q, N_K, n_ichunks, ichunks_per_group,
                                 DI, BLOCK_DI, IB, BLOCK_T, BLOCK_N, RELU, IEEE_I, USE_TMA)
    tok_ok = toks < N_Q
    row = b.to(tl.int64) * N_Q + toks
    lse_i = tl.load(LSE_I + row, mask=tok_ok, other=float("-inf"))
    g = tl.load(G_UP + row, mask=tok_ok, other=0.0)
    # an empty row (LSE_I = -inf) sees no key: visible is False everywhere, so G = 0 there
    visible = _token_visible(toks, keys, N_Q, N_K, diag_offset, MASKED, CAUSAL) & (lse_i != float("-inf"))[:, None]
    soft = tl.exp2((logits - lse_i[:, None]) * LOG2E)
    grad = tl.where(visible, g[:, None] * (soft - p), 0.0)
    ROWS: tl.constexpr = GI_PAD * BLOCK_T
    grad_rows = tl.reshape(tl.broadcast_to(grad[None, :, :], [GI_PAD, BLOCK_T, BLOCK_N]), [ROWS, BLOCK_N])
    vis_rows = tl.reshape(tl.broadcast_to(visible[None, :, :], [GI_PAD, BLOCK_T, BLOCK_N]), [ROWS, BLOCK_N])
    return grad_rows, vis_rows


@triton.jit
def _coef_a(grad_rows, vis_rows, a, w, RELU: tl.constexpr):
    """``(A, dweights terms)``: A = G * w * 1[a > 0], G * relu(a); both 0 where not visible.
    The indicator multiplies (not selects), so a NaN G stays NaN in A."""
    if RELU:
        act = tl.maximum(a, 0.0, propagate_nan=tl.PropagateNan.ALL)
        coef = grad_rows * w[:, None] * (a > 0).to(tl.float32)
    else:
        act = a
        coef = grad_rows * w[:, None]
    return tl.where(vis_rows, coef, 0.0), tl.where(vis_rows, grad_rows * act, 0.0)


@triton.jit
def _dq_key_range(
    dq, dw, q_rows, w_rows, row_ok, ki_base, kvi, rot, DK, DK_DESC, t_off, p_rows,
    Q, K, QI, KI, Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, LSE_I, G_UP,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
    stride_wb, stride_wh, stride_wn,
    b, t0, lo, hi, H, GROUP, GROUP_I, N_Q, N_K, qk_scale, inv_heads,
    n_chunks, chunks_per_group, n_ichunks, ichunks_per_group,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DI: tl.constexpr, BLOCK_DI: tl.constexpr, DI_PAD: tl.constexpr,
    HB: tl.constexpr, IB: tl.constexpr, GI_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, RELU: tl.constexpr,
    IEEE_T: tl.constexpr, IEEE_I: tl.constexpr, NO_CONTRACT: tl.constexpr, USE_TMA: tl.constexpr, TEACHER: tl.constexpr,
    L1_Q: tl.constexpr, P_SAVED: tl.constexpr = False, LOGITS_FROM_A: tl.constexpr = False,
    DK_SHARE: tl.constexpr = 0, H_KI=1,
):
    offs_d = tl.arange(0, DI_PAD)
    q_for_dk = q_rows
    if DK_SHARE > 0:
        if MASKED:  # a non-finite query row must not reach the keys it cannot see through A^T @ q
            q_for_dk = _finite_or_zero(q_rows)
    n_tiles = tl.cdiv(hi - lo, BLOCK_N)
    # the divisor of the rotation, never 0: a stage with no tiles (the unmasked stage of the first
    # causal token blocks) still has its first iteration's addresses formed on the GPU (the loop's
    # pipelined loads are issued ahead), and x % 0 there is garbage: with the stored p read by
    # pointer (P_SAVED) and a rotation (DK_SHARE), that read faulted on the H200 (
    # compute-sanitizer: an invalid global read at the P_SAVED load, 16 GB past an allocation)
    n_div = tl.maximum(n_tiles, 1)
    for i in range(0, n_tiles):
        # DK_SHARE: the unmasked stage starts at a tile that depends on the token block (then
        # wraps), so the programs running at once add their dk shares into different rows
        s0 = lo + ((i + rot) % n_div) * BLOCK_N
        keys = s0 + tl.arange(0, BLOCK_N)
        if USE_TMA:  # the plan makes this box [1, 1, BLOCK_N, DI_PAD] (BLOCK_DI = DI_PAD)
            k_tile = KI_DESC.load([b, kvi, s0, 0]).reshape(BLOCK_N, DI_PAD)
        else:
            k_tile = tl.load(ki_base + keys.to(tl.int64)[:, None] * stride_kin + offs_d[None, :] * stride_kid,
                             mask=(keys < N_K)[:, None] & (offs_d < DI)[None, :], other=0.0)
        if LOGITS_FROM_A:  # the raw key tile: a key that a row sees and that is NaN makes its logit NaN
            a = _dot(q_rows, tl.trans(k_tile), IEEE_I)
        if MASKED:  # a non-finite key that a row cannot see must not reach it through A @ k
            k_tile = _finite_or_zero(k_tile)
        if not LOGITS_FROM_A:
            a = _dot(q_rows, tl.trans(k_tile), IEEE_I)
        grad_rows, vis_rows = _row_grad_coef(
            Q, K, QI, KI, Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, LSE_I, G_UP,
            stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
            stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
            stride_wb, stride_wh, stride_wn, b, t0, s0, H, GROUP, GROUP_I, N_Q, N_K, qk_scale, inv_heads,
            n_chunks, chunks_per_group, n_ichunks, ichunks_per_group, a, w_rows, row_ok, t_off, p_rows, D, BLOCK_D, DI, BLOCK_DI,
            HB, IB, GI_PAD, BLOCK_T, BLOCK_N, MASKED, CAUSAL, RELU, IEEE_T, IEEE_I, NO_CONTRACT, USE_TMA, TEACHER,
            L1_Q, False, P_SAVED, LOGITS_FROM_A)
        coef, dw_terms = _coef_a(grad_rows, vis_rows, a, w_rows, RELU)
        dw += tl.sum(dw_terms, 1)
        dq += _dot(coef.to(k_tile.dtype), k_tile, IEEE_I)
        if DK_SHARE > 0:  # the "dqk" backward: this tile's dk share, added into a zeroed fp32 dk
            dk_part = _dot(tl.trans(coef.to(q_rows.dtype)), q_for_dk, IEEE_I)  # [BLOCK_N, DI_PAD]
            if DK_SHARE == 2:  # one bulk TMA reduction (Hopper)
                DK_DESC.atomic_add([b, kvi, s0, 0], dk_part.reshape(1, 1, BLOCK_N, DI_PAD))
            else:
                out = (b.to(tl.int64) * H_KI + kvi) * N_K + keys
                tl.atomic_add(DK + out[:, None] * DI + offs_d[None, :], dk_part,
                              mask=(keys < N_K)[:, None] & (offs_d < DI)[None, :], sem="relaxed")
    return dq, dw


@triton.jit
def _indexer_bwd_dq_kernel(
    Q, K, QI, KI, W, LSE_T, LSE_I, G_UP, DQ, DW,
    Q_DESC, K_DESC, QI_DESC, KI_DESC,  # TMA descriptors (used when USE_TMA)
    DK, DK_DESC,  # DK_SHARE ("dqk" backward): zeroed fp32 dk_idx, and its descriptor (DK_SHARE = 2)
    T_OFF, P_ROWS,  # the tokens t_off.. of this launch (a chunk); P_SAVED: P's rows per batch element
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
    stride_wb, stride_wh, stride_wn,
    H, GROUP, H_I, H_KI, GROUP_I, N_Q, N_K, qk_scale, inv_heads,
    n_chunks, chunks_per_group, n_ichunks, ichunks_per_group,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DI: tl.constexpr, BLOCK_DI: tl.constexpr, DI_PAD: tl.constexpr,
    HB: tl.constexpr, IB: tl.constexpr, GI_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, RELU: tl.constexpr, IEEE_T: tl.constexpr, IEEE_I: tl.constexpr,
    NO_CONTRACT: tl.constexpr, USE_TMA: tl.constexpr, TEACHER: tl.constexpr = True, L1: tl.constexpr = False,
    P_SAVED: tl.constexpr = False, LOGITS_FROM_A: tl.constexpr = False, DK_SHARE: tl.constexpr = 0,
):
    """dq_idx [B, H_I, N_Q, D_I] and dweights [B, H_I, N_Q] (fp32, contiguous) of the heads of
    indexer key head ``kvi`` for one token block. DK_SHARE (the one-kernel "dqk" backward): each
    key tile's dk_idx share of these heads is added into DK too (1: fp32 atomics, 2: one TMA bulk
    reduction per tile)."""
    ROWS: tl.constexpr = GI_PAD * BLOCK_T
    pid_t = tl.program_id(0)
    b, kvi, t0, tok, j, row_ok, q_rows, w_rows = _token_block(
        QI, QI_DESC, W, T_OFF, H_KI, GROUP_I, N_Q, stride_qib, stride_qih, stride_qin, stride_qid,
        stride_wb, stride_wh, stride_wn, DI, DI_PAD, GI_PAD, BLOCK_T, USE_TMA)
    offs_d = tl.arange(0, DI_PAD)
    b64 = b.to(tl.int64)
    ki_base = KI + b64 * stride_kib + kvi.to(tl.int64) * stride_kih
    dq = tl.zeros([ROWS, DI_PAD], tl.float32)
    dw = tl.zeros([ROWS], tl.float32)
    full_hi, key_hi = _key_stages(t0, 0, N_K, N_Q, N_K, BLOCK_T, BLOCK_N, CAUSAL)
    ROT = pid_t if DK_SHARE > 0 else 0  # the unmasked stage's first tile (rotated: see _dq_key_range)
    dq, dw = _dq_key_range(
        dq, dw, q_rows, w_rows, row_ok, ki_base, kvi, ROT, DK, DK_DESC, T_OFF, P_ROWS, Q, K, QI, KI, Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, LSE_I, G_UP,
        stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
        stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
        stride_wb, stride_wh, stride_wn, b, t0, 0, full_hi, H, GROUP, GROUP_I, N_Q, N_K, qk_scale, inv_heads,
        n_chunks, chunks_per_group, n_ichunks, ichunks_per_group, D, BLOCK_D, DI, BLOCK_DI, DI_PAD,
        HB, IB, GI_PAD, BLOCK_T, BLOCK_N, False, CAUSAL, RELU, IEEE_T, IEEE_I, NO_CONTRACT, USE_TMA, TEACHER,
        L1, P_SAVED, LOGITS_FROM_A, DK_SHARE, H_KI)
    dq, dw = _dq_key_range(
        dq, dw, q_rows, w_rows, row_ok, ki_base, kvi, ROT, DK, DK_DESC, T_OFF, P_ROWS, Q, K, QI, KI, Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, LSE_I, G_UP,
        stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
        stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
        stride_wb, stride_wh, stride_wn, b, t0, full_hi, key_hi, H, GROUP, GROUP_I, N_Q, N_K, qk_scale,
        inv_heads, n_chunks, chunks_per_group, n_ichunks, ichunks_per_group, D, BLOCK_D, DI, BLOCK_DI, DI_PAD,
        HB, IB, GI_PAD, BLOCK_T, BLOCK_N, True, CAUSAL, RELU, IEEE_T, IEEE_I, NO_CONTRACT, USE_TMA, TEACHER,
        L1, P_SAVED, LOGITS_FROM_A, DK_SHARE, H_KI)
    out_row = (b64 * H_I + j) * N_Q + tok
    tl.store(DQ + out_row[:, None] * DI + offs_d[None, :], dq, mask=row_ok[:, None] & (offs_d < DI)[None, :])
    tl.store(DW + out_row, dw, mask=row_ok)


@triton.jit
def _dk_token_range(
    dk, k_tile, j, j0, j_in_group, s0, DQ, DW,
    Q, K, QI, KI, Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, LSE_I, G_UP,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
    stride_wb, stride_wh, stride_wn,
    b, lo, hi, H, GROUP, H_I, GROUP_I, N_Q, N_K, qk_scale, inv_heads,
    n_chunks, chunks_per_group, n_ichunks, ichunks_per_group,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DI: tl.constexpr, BLOCK_DI: tl.constexpr, DI_PAD: tl.constexpr,
    HB: tl.constexpr, IB: tl.constexpr, GI_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, RELU: tl.constexpr,
    IEEE_T: tl.constexpr, IEEE_I: tl.constexpr, NO_CONTRACT: tl.constexpr, USE_TMA: tl.constexpr,
    FUSED_DQ: tl.constexpr, TEACHER: tl.constexpr, L1_K: tl.constexpr, P_SAVED: tl.constexpr = False,
    LOGITS_FROM_A: tl.constexpr = False,
):
    ROWS: tl.constexpr = GI_PAD * BLOCK_T
    offs_d = tl.arange(0, DI_PAD)
    rows = tl.arange(0, ROWS)
    b64 = b.to(tl.int64)
    k_for_dq = k_tile
    if FUSED_DQ:
        if MASKED:  # a non-finite key that a row cannot see must not reach it through A @ k
            k_for_dq = _finite_or_zero(k_tile)
    for t0 in range(lo, hi, BLOCK_T):
        tok = t0 + rows % BLOCK_T
        row_ok = (j_in_group < GROUP_I) & (tok < N_Q)
        q_rows = _query_rows(QI, QI_DESC, b, j0, t0, j, tok, row_ok, stride_qib, stride_qih, stride_qin,
                             stride_qid, DI, DI_PAD, ROWS, USE_TMA)
        w_rows = tl.load(W + b64 * stride_wb + j.to(tl.int64) * stride_wh + tok.to(tl.int64) * stride_wn,
                         mask=row_ok, other=0.0).to(tl.float32)
        if LOGITS_FROM_A:  # the raw rows: a NaN query row makes its own logits NaN
            a = _dot(q_rows, tl.trans(k_tile), IEEE_I)
        if MASKED:  # a non-finite query row must not reach the keys it cannot see through A^T @ q
            q_rows = _finite_or_zero(q_rows)
        if not LOGITS_FROM_A:
            a = _dot(q_rows, tl.trans(k_tile), IEEE_I)
        grad_rows, vis_rows = _row_grad_coef(
            Q, K, QI, KI, Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, LSE_I, G_UP,
            stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
            stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
            stride_wb, stride_wh, stride_wn, b, t0, s0, H, GROUP, GROUP_I, N_Q, N_K, qk_scale, inv_heads,
            n_chunks, chunks_per_group, n_ichunks, ichunks_per_group, a, w_rows, row_ok, 0, N_Q, D, BLOCK_D, DI, BLOCK_DI,
            HB, IB, GI_PAD, BLOCK_T, BLOCK_N, MASKED, CAUSAL, RELU, IEEE_T, IEEE_I, NO_CONTRACT, USE_TMA, TEACHER,
            False, L1_K, P_SAVED, LOGITS_FROM_A)
        coef, dw_terms = _coef_a(grad_rows, vis_rows, a, w_rows, RELU)
        dk += _dot(tl.trans(coef.to(q_rows.dtype)), q_rows, IEEE_I)
        if FUSED_DQ:  # this tile's share of dq_idx and dweights: fp32 atomic adds (zeroed buffers)
            dq_part = _dot(coef.to(k_for_dq.dtype), k_for_dq, IEEE_I)
            row_out = (b64 * H_I + j) * N_Q + tok
            tl.atomic_add(DQ + row_out[:, None] * DI + offs_d[None, :], dq_part,
                          mask=row_ok[:, None] & (offs_d < DI)[None, :], sem="relaxed")
            tl.atomic_add(DW + row_out, tl.sum(dw_terms, 1), mask=row_ok, sem="relaxed")
    return dk


@triton.jit
def _indexer_bwd_dk_kernel(
    Q, K, QI, KI, W, LSE_T, LSE_I, G_UP, DK,
    DQ, DW,  # FUSED_DQ: fp32 zeroed dq_idx [B, H_I, N_Q, D_I] and dweights [B, H_I, N_Q] (atomics)
    Q_DESC, K_DESC, QI_DESC, KI_DESC,  # TMA descriptors (used when USE_TMA)
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
    stride_wb, stride_wh, stride_wn,
    H, GROUP, H_I, H_KI, GROUP_I, N_Q, N_K, qk_scale, inv_heads,
    n_chunks, chunks_per_group, n_ichunks, ichunks_per_group, tokens_per_split,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DI: tl.constexpr, BLOCK_DI: tl.constexpr, DI_PAD: tl.constexpr,
    HB: tl.constexpr, IB: tl.constexpr, GI_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, RELU: tl.constexpr, IEEE_T: tl.constexpr, IEEE_I: tl.constexpr,
    NO_CONTRACT: tl.constexpr, ATOMIC: tl.constexpr, USE_TMA: tl.constexpr, FUSED_DQ: tl.constexpr, TEACHER: tl.constexpr = True,
    L1: tl.constexpr = False, P_SAVED: tl.constexpr = False, LOGITS_FROM_A: tl.constexpr = False,
):
    """dk_idx [B, H_KI, N_K, D_I] (fp32, contiguous) of one key tile: the sum over the token blocks
    that see it (those in this program's token split, program axis 2) and over the indexer heads
    of key head ``kvi``. ATOMIC (more than one split): fp32 atomic adds into a zeroed buffer.
    Fixed-size token splits balance the causal triangle: a split before the tile's first visible
    token exits at once."""
    ROWS: tl.constexpr = GI_PAD * BLOCK_T
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1)
    split_lo = tl.program_id(2) * tokens_per_split  # a multiple of BLOCK_T
    split_hi = tl.minimum(split_lo + tokens_per_split, N_Q)
    b = pid_bk // H_KI
    kvi = pid_bk % H_KI
    s0 = pid_n * BLOCK_N
    keys = s0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, DI_PAD)
    rows = tl.arange(0, ROWS)
    j_in_group = rows // BLOCK_T
    j = kvi * GROUP_I + j_in_group
    b64 = b.to(tl.int64)
    ki_base = KI + b64 * stride_kib + kvi.to(tl.int64) * stride_kih
    if USE_TMA:
        k_tile = KI_DESC.load([b, kvi, s0, 0]).reshape(BLOCK_N, DI_PAD)
    else:
        k_tile = tl.load(ki_base + keys.to(tl.int64)[:, None] * stride_kin + offs_d[None, :] * stride_kid,
                         mask=(keys < N_K)[:, None] & (offs_d < DI)[None, :], other=0.0)
    dk = tl.zeros([BLOCK_N, DI_PAD], tl.float32)
    # token blocks: causal ones before the first token that sees s0 are skipped; from t_full on
    # every token sees every key of the tile (whole tile < N_K), no masks there
    diag_offset = N_K - N_Q
    t_lo = 0
    t_full = 0
    if CAUSAL:
        t_lo = (tl.maximum(s0 - diag_offset, 0) // BLOCK_T) * BLOCK_T
        t_full = tl.maximum(s0 + BLOCK_N - 1 - diag_offset, 0)
        t_full = ((t_full + BLOCK_T - 1) // BLOCK_T) * BLOCK_T
    if s0 + BLOCK_N > N_K:
        t_full = N_Q
    t_lo = tl.minimum(t_lo, N_Q)
    t_full = tl.minimum(tl.maximum(t_full, t_lo), N_Q)
    # this program's share: [split_lo, split_hi) of both ranges (all bounds multiples of BLOCK_T or N_Q)
    mask_lo = tl.maximum(t_lo, split_lo)
    mask_hi = tl.minimum(t_full, split_hi)
    full_lo = tl.maximum(t_full, split_lo)
    dk = _dk_token_range(
        dk, k_tile, j, kvi * GROUP_I, j_in_group, s0, DQ, DW, Q, K, QI, KI, Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, LSE_I, G_UP,
        stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
        stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
        stride_wb, stride_wh, stride_wn, b, mask_lo, mask_hi, H, GROUP, H_I, GROUP_I, N_Q, N_K, qk_scale, inv_heads,
        n_chunks, chunks_per_group, n_ichunks, ichunks_per_group, D, BLOCK_D, DI, BLOCK_DI, DI_PAD,
        HB, IB, GI_PAD, BLOCK_T, BLOCK_N, True, CAUSAL, RELU, IEEE_T, IEEE_I, NO_CONTRACT, USE_TMA, FUSED_DQ, TEACHER,
        L1, P_SAVED, LOGITS_FROM_A)
    dk = _dk_token_range(
        dk, k_tile, j, kvi * GROUP_I, j_in_group, s0, DQ, DW, Q, K, QI, KI, Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T, LSE_I, G_UP,
        stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
        stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
        stride_wb, stride_wh, stride_wn, b, full_lo, split_hi, H, GROUP, H_I, GROUP_I, N_Q, N_K, qk_scale, inv_heads,
        n_chunks, chunks_per_group, n_ichunks, ichunks_per_group, D, BLOCK_D, DI, BLOCK_DI, DI_PAD,
        HB, IB, GI_PAD, BLOCK_T, BLOCK_N, False, CAUSAL, RELU, IEEE_T, IEEE_I, NO_CONTRACT, USE_TMA, FUSED_DQ, TEACHER,
        L1, P_SAVED, LOGITS_FROM_A)
    out_row = (b64 * H_KI + kvi) * N_K + keys
    out_ok = (keys < N_K)[:, None] & (offs_d < DI)[None, :]
    if ATOMIC:
        if mask_lo < split_hi:  # splits before the first visible token add nothing
            tl.atomic_add(DK + out_row[:, None] * DI + offs_d[None, :], dk, mask=out_ok, sem="relaxed")
    else:
        tl.store(DK + out_row[:, None] * DI + offs_d[None, :], dk, mask=out_ok)
