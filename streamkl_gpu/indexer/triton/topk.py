"""Triton kernels of the sparse stage's indexer loss (``indexer_kl_topk``, docs/indexer.md).

One program per (query token, batch element): the token's selected keys ``topk_indices[b, t, :]``
are gathered BLOCK_K slots at a time by pointer loads (Hopper's TMA has no row gather), a slot is
*used* iff its index lies in ``[0, N_K)`` (``-1`` = unused; any other out-of-range value reads as
unused, so a bad index never reads out of bounds) and, with ``causal``, the key is visible
(``s <= t + N_K - N_Q``, bottom-right). The GEMM's M dimension is teacher heads: a *chunk* is HB
heads of one key head (MQA at DSA: all 128 heads in one chunk, each gathered key row read once for
them all); the indexer's rows are all its H_I heads at once (HI_PAD rows; per indexer key head the
rows of the other key heads are masked out of the product).

Forward (``_topk_fwd_kernel``), two passes over the slots:
1. per teacher head the LSE over the token's set (bits), the online max/sum of a softmax;
2. per slot tile the renormalised target ``p_s = (1/H) sum_h exp2(s_h - lse_h)`` (exact per entry,
   sums to 1 over the set), the student's logits ``I_s`` and the five-scalar online state of
   ``_indexer_fwd._online_update``; ``p`` is stored per slot (``P_SET [B, N_Q, K]`` fp32, 0 at
   unused slots; slots past the row's last used one are not written and never read), so the
   backward never reads the teacher.

Both kernels walk the slots up to the row's last used one (``_used_extent``: one cheap scan of
the row's indices first).

Backward (``_topk_bwd_kernel``), one pass over the slots from ``P_SET`` and ``LSE_I``:
``G = g (exp(I - LSE_I) - p)``, ``A_j = G w_j 1[a_j > 0]``; dweights and dq_idx in registers,
``dk_idx[key] += A^T q_idx`` by fp32 atomic adds at the gathered rows (a scatter-add over rows;
not deterministic in the order of the adds).

NaN isolation: unused slots load 0 rows and are selected away (``tl.where``) before any product,
so a NaN key reaches exactly the rows that selected it.
"""
import triton
import triton.language as tl

from streamkl_gpu._core.jit import LOG2E, _dot, _safe, _to_bits
from streamkl_gpu.indexer.triton.bwd import _coef_a
from streamkl_gpu.indexer.triton.fwd import _dot_rows, _finish, _online_update


@triton.jit
def _slots(TOPK, topk_row, s0, K_SEL, t, N_Q, N_K, stride_ts, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr):
    """(slots, key index with unused slots at 0, used) of the slot tile starting at ``s0``."""
    slots = s0 + tl.arange(0, BLOCK_K)
    idx = tl.load(TOPK + topk_row + slots.to(tl.int64) * stride_ts, mask=slots < K_SEL, other=-1)
    used = (idx >= 0) & (idx < N_K)
    if CAUSAL:  # bottom-right: key s visible to token t iff s <= t + (N_K - N_Q)
        used = used & (idx <= t + (N_K - N_Q))
    return slots, tl.where(used, idx, 0).to(tl.int64), used


@triton.jit
def _used_extent(TOPK, topk_row, K_SEL, t, N_Q, N_K, stride_ts, CAUSAL: tl.constexpr, SCAN: tl.constexpr = 256):
    """1 + the last used slot of the row (0: none): the slot loops stop there. ``torch.topk``'s
    sorted output puts a short row's masked (``-1``) slots last (Megatron marks them so), so early
    causal rows with fewer visible keys than ``K`` skip their trailing tiles."""
    last = tl.full([SCAN], -1, tl.int32)
    for s0 in range(0, K_SEL, SCAN):
        slots, _, used = _slots(TOPK, topk_row, s0, K_SEL, t, N_Q, N_K, stride_ts, SCAN, CAUSAL)
        last = tl.maximum(last, tl.where(used, slots, -1))
    return tl.max(last, 0) + 1


@triton.jit
def _indexer_rows_logits(QI, KI, W, b, t, idx, used, j, j_ok, GROUP_I, H_KI,
                         stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
                         stride_wb, stride_wh, stride_wn,
                         DI: tl.constexpr, BLOCK_DI: tl.constexpr, HI_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
                         RELU: tl.constexpr, IEEE: tl.constexpr):
    """``(a [HI_PAD, BLOCK_K], I [BLOCK_K])``: per indexer head the score ``q_idx_j . k_idx`` of
    the gathered keys (0 in padding rows), and the logits ``sum_j w_j relu(a_j)``."""
    b64 = b.to(tl.int64)
    q_off = b64 * stride_qib + j.to(tl.int64) * stride_qih + t.to(tl.int64) * stride_qin
    a = tl.zeros([HI_PAD, BLOCK_K], tl.float32)
    for kvi in range(0, H_KI):
        rows_ok = j_ok & (j // GROUP_I == kvi)
        k_off = b64 * stride_kib + kvi * stride_kih + idx.to(tl.int64) * stride_kin
        a += _dot_rows(QI, q_off, rows_ok, KI, k_off, used, stride_qid, stride_kid,
                       None, None, b, 0, 0, 0, 0, DI, BLOCK_DI, HI_PAD, BLOCK_K, HI_PAD, IEEE, False)
    w = tl.load(W + b64 * stride_wb + j.to(tl.int64) * stride_wh + t.to(tl.int64) * stride_wn,
                mask=j_ok, other=0.0).to(tl.float32)
    if RELU:
        act = tl.maximum(a, 0.0, propagate_nan=tl.PropagateNan.ALL)  # relu(NaN) stays NaN
    else:
        act = a
    logits = tl.sum(tl.where(j_ok[:, None], w[:, None] * act, 0.0), 0)
    return a, w, logits


@triton.jit
def _target_tile(Q, K, LSE_T, b, t, idx, used, hh, H, GROUP, N_Q, qk_scale, inv_heads, n_chunks, chunks_per_group,
                 stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, HB: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE_T: tl.constexpr, NO_CONTRACT: tl.constexpr, A_L1: tl.constexpr):
    """The target ``p [BLOCK_K] = (1/H) sum_h exp2(s_h - lse_h)`` of one slot tile (0 at unused slots)."""
    b64 = b.to(tl.int64)
    p = tl.zeros([BLOCK_K], tl.float32)
    for c in range(0, n_chunks):
        kv = c // chunks_per_group
        h_in_group = (c % chunks_per_group) * HB + hh
        h = kv * GROUP + h_in_group
        row_ok = h_in_group < GROUP
        q_off = b64 * stride_qb + h.to(tl.int64) * stride_qh + t.to(tl.int64) * stride_qn
        k_off = b64 * stride_kb + kv * stride_kh + idx.to(tl.int64) * stride_kn
        s = _dot_rows(Q, q_off, row_ok, K, k_off, used, stride_qd, stride_kd,
                      None, None, b, 0, 0, 0, 0, D, BLOCK_D, HB, BLOCK_K, HB, IEEE_T, False, A_L1)
        lse = tl.load(LSE_T + (b64 * H + h) * N_Q + t, mask=row_ok, other=float("-inf"))
        # "!= -inf" keeps a NaN LSE a NaN (a NaN row stays NaN)
        vis = row_ok[:, None] & used[None, :] & (lse != float("-inf"))[:, None]
        x = _to_bits(s, qk_scale, NO_CONTRACT) - lse[:, None]
        p += tl.sum(tl.exp2(tl.where(vis, x, float("-inf"))), 0)
    return p * inv_heads


@triton.jit
def _topk_student_kernel(
    QI, KI, W, TOPK, LOGITS, LSE_I,
    stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
    stride_wb, stride_wh, stride_wn, stride_tb, stride_tn, stride_ts,
    H_I, H_KI, GROUP_I, N_Q, N_K, K_SEL,
    DI: tl.constexpr, BLOCK_DI: tl.constexpr, HI_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr, RELU: tl.constexpr, IEEE_I: tl.constexpr,
):
    """The separate-student design (STUDENT_SEPARATE): the student's logits per slot LOGITS
    [B, N_Q, K] (fp32) and LSE_I [B, N_Q] over the set (nats), before the teacher kernel.
    Grid (N_Q, B)."""
    t = tl.program_id(0)
    b = tl.program_id(1)
    b64 = b.to(tl.int64)
    topk_row = b64 * stride_tb + t.to(tl.int64) * stride_tn
    extent = _used_extent(TOPK, topk_row, K_SEL, t, N_Q, N_K, stride_ts, CAUSAL)
    j = tl.arange(0, HI_PAD)
    j_ok = j < H_I
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.zeros([1], tl.float32)
    row = b64 * N_Q + t
    for s0 in range(0, extent, BLOCK_K):
        slots, idx, used = _slots(TOPK, topk_row, s0, K_SEL, t, N_Q, N_K, stride_ts, BLOCK_K, CAUSAL)
        _, _, logits = _indexer_rows_logits(
            QI, KI, W, b, t, idx, used, j, j_ok, GROUP_I, H_KI,
            stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
            stride_wb, stride_wh, stride_wn, DI, BLOCK_DI, HI_PAD, BLOCK_K, RELU, IEEE_I)
        x = tl.where(used, logits, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 0))
        shift = _safe(m_new)
        l = l * tl.exp2((m - shift) * LOG2E) + tl.sum(tl.exp2((x - shift) * LOG2E), 0)
        m = m_new
        tl.store(LOGITS + row * K_SEL + slots, logits, mask=slots < K_SEL)
    # empty set: l = 0, LSE -inf; a NaN logit makes l NaN (the max ignores NaN)
    lse_i = tl.where(l == 0.0, float("-inf"), _safe(m) + tl.log(tl.where(l == 0.0, 1.0, l)))
    tl.store(LSE_I + row + tl.arange(0, 1), lse_i)


@triton.jit
def _topk_fwd_kernel(
    Q, K, QI, KI, W, TOPK, LSE_T, KL, LSE_I, P_SET, LOGITS,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
    stride_wb, stride_wh, stride_wn, stride_tb, stride_tn, stride_ts,
    H, GROUP, H_I, H_KI, GROUP_I, N_Q, N_K, K_SEL, qk_scale, inv_heads, n_chunks, chunks_per_group,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DI: tl.constexpr, BLOCK_DI: tl.constexpr,
    HB: tl.constexpr, HI_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr, RELU: tl.constexpr, IEEE_T: tl.constexpr, IEEE_I: tl.constexpr,
    NO_CONTRACT: tl.constexpr, HAS_LSE: tl.constexpr = False, A_L1: tl.constexpr = False,
    STUDENT_SEPARATE: tl.constexpr = False,
):
    """KL [B, N_Q] and LSE_I [B, N_Q] (nats), the teacher's set LSEs LSE_T [B, H, N_Q] (bits) and
    the target per slot P_SET [B, N_Q, K] (fp32). Grid (N_Q, B). A_L1: the token's teacher q
    rows through L1 (``.ca``; re-read for every slot tile: 147 KB at DSA), the gathered keys not.
    HAS_LSE: LSE_T holds the caller's set LSEs (bits): pass 1 is skipped. STUDENT_SEPARATE:
    ``_topk_student_kernel`` ran first (LOGITS per slot, LSE_I): pass 2 only reads them and sums
    ``KL = sum p log p - sum p (I - LSE_I)`` (no online state, no student products here)."""
    t = tl.program_id(0)
    b = tl.program_id(1)
    b64 = b.to(tl.int64)
    topk_row = b64 * stride_tb + t.to(tl.int64) * stride_tn
    extent = _used_extent(TOPK, topk_row, K_SEL, t, N_Q, N_K, stride_ts, CAUSAL)
    hh = tl.arange(0, HB)
    # pass 1: each teacher head's LSE over the set, in bits (unless the caller gave them)
    if not HAS_LSE:
        for c in range(0, n_chunks):
            kv = c // chunks_per_group
            h_in_group = (c % chunks_per_group) * HB + hh
            h = kv * GROUP + h_in_group
            row_ok = h_in_group < GROUP
            q_off = b64 * stride_qb + h.to(tl.int64) * stride_qh + t.to(tl.int64) * stride_qn
            m = tl.full([HB], float("-inf"), tl.float32)
            l = tl.zeros([HB], tl.float32)
            for s0 in range(0, extent, BLOCK_K):
                slots, idx, used = _slots(TOPK, topk_row, s0, K_SEL, t, N_Q, N_K, stride_ts, BLOCK_K, CAUSAL)
                k_off = b64 * stride_kb + kv * stride_kh + idx.to(tl.int64) * stride_kn
                s = _dot_rows(Q, q_off, row_ok, K, k_off, used, stride_qd, stride_kd,
                              None, None, b, 0, 0, 0, 0, D, BLOCK_D, HB, BLOCK_K, HB, IEEE_T, False, A_L1)
                x = tl.where(used[None, :], _to_bits(s, qk_scale, NO_CONTRACT), float("-inf"))
                m_new = tl.maximum(m, tl.max(x, 1))
                shift = _safe(m_new)
                l = l * tl.exp2(m - shift) + tl.sum(tl.exp2(x - shift[:, None]), 1)
                m = m_new
            # empty set: l = 0, LSE -inf; a NaN score makes l NaN (the max ignores NaN), LSE NaN
            lse = tl.where(l == 0.0, float("-inf"), _safe(m) + tl.log2(tl.where(l == 0.0, 1.0, l)))
            tl.store(LSE_T + (b64 * H + h) * N_Q + t, lse, mask=row_ok)
    tl.debug_barrier()  # pass 2 reads the LSEs other threads of this program stored
    p_row = (b64 * N_Q + t) * K_SEL
    zero = tl.arange(0, 1)
    if STUDENT_SEPARATE:  # pass 2: target; the student's logits and LSE_I from _topk_student_kernel
        lse_i = tl.load(LSE_I + b64 * N_Q + t + zero)
        plogp = tl.zeros([1], tl.float32)
        acc = tl.zeros([1], tl.float32)
        for s0 in range(0, extent, BLOCK_K):
            slots, idx, used = _slots(TOPK, topk_row, s0, K_SEL, t, N_Q, N_K, stride_ts, BLOCK_K, CAUSAL)
            p = _target_tile(Q, K, LSE_T, b, t, idx, used, hh, H, GROUP, N_Q, qk_scale, inv_heads, n_chunks,
                             chunks_per_group, stride_qb, stride_qh, stride_qn, stride_qd,
                             stride_kb, stride_kh, stride_kn, stride_kd,
                             D, BLOCK_D, HB, BLOCK_K, IEEE_T, NO_CONTRACT, A_L1)
            logits = tl.load(LOGITS + p_row + slots, mask=used, other=0.0)
            # p log p with 0 log 0 = 0; a NaN p stays NaN (NaN > 0 is False, then NaN * 0 = NaN)
            log_p = tl.log(tl.where(used & (p > 0), p, 1.0))
            plogp += tl.sum(tl.where(used, p * log_p, 0.0), 0)
            acc += tl.sum(tl.where(used, p * (logits - lse_i), 0.0), 0)
            tl.store(P_SET + p_row + slots, tl.where(used, p, 0.0), mask=slots < K_SEL)
        kl = tl.where(lse_i == float("-inf"), 0.0, plogp - acc)  # sum p = 1 over a non-empty set
        tl.store(KL + b64 * N_Q + t + zero, kl)
    else:
        # pass 2: target, student logits, online KL state
        j = tl.arange(0, HI_PAD)
        j_ok = j < H_I
        m_i = tl.full([1], float("-inf"), tl.float32)
        l_i = tl.zeros([1], tl.float32)
        mass = tl.zeros([1], tl.float32)
        acc = tl.zeros([1], tl.float32)
        plogp = tl.zeros([1], tl.float32)
        for s0 in range(0, extent, BLOCK_K):
            slots, idx, used = _slots(TOPK, topk_row, s0, K_SEL, t, N_Q, N_K, stride_ts, BLOCK_K, CAUSAL)
            p = _target_tile(Q, K, LSE_T, b, t, idx, used, hh, H, GROUP, N_Q, qk_scale, inv_heads, n_chunks,
                             chunks_per_group, stride_qb, stride_qh, stride_qn, stride_qd,
                             stride_kb, stride_kh, stride_kn, stride_kd,
                             D, BLOCK_D, HB, BLOCK_K, IEEE_T, NO_CONTRACT, A_L1)
            a, w, logits = _indexer_rows_logits(
                QI, KI, W, b, t, idx, used, j, j_ok, GROUP_I, H_KI,
                stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
                stride_wb, stride_wh, stride_wn, DI, BLOCK_DI, HI_PAD, BLOCK_K, RELU, IEEE_I)
            m_i, l_i, mass, acc, plogp = _online_update(m_i, l_i, mass, acc, plogp, p[None, :], logits[None, :],
                                                        used[None, :])
            tl.store(P_SET + p_row + slots, tl.where(used, p, 0.0), mask=slots < K_SEL)
        kl, lse_i = _finish(m_i, l_i, acc, plogp)
        tl.store(KL + b64 * N_Q + t + zero, kl)
        tl.store(LSE_I + b64 * N_Q + t + zero, lse_i)


@triton.jit
def _topk_bwd_kernel(
    QI, KI, W, TOPK, P_SET, LSE_I, G_UP, DQ, DK, DW,
    stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
    stride_wb, stride_wh, stride_wn, stride_tb, stride_tn, stride_ts,
    H_I, H_KI, GROUP_I, N_Q, N_K, K_SEL,
    DI: tl.constexpr, DI_PAD: tl.constexpr, HI_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr, RELU: tl.constexpr, IEEE_I: tl.constexpr,
):
    """dq_idx [B, H_I, N_Q, D_I], dweights [B, H_I, N_Q] (fp32, contiguous, written) and dk_idx
    [B, H_KI, N_K, D_I] (fp32, contiguous, zeroed by the host; atomic adds). Grid (N_Q, B)."""
    t = tl.program_id(0)
    b = tl.program_id(1)
    b64 = b.to(tl.int64)
    topk_row = b64 * stride_tb + t.to(tl.int64) * stride_tn
    extent = _used_extent(TOPK, topk_row, K_SEL, t, N_Q, N_K, stride_ts, CAUSAL)
    j = tl.arange(0, HI_PAD)
    j_ok = j < H_I
    offs_d = tl.arange(0, DI_PAD)
    d_ok = offs_d < DI
    q_off = b64 * stride_qib + j.to(tl.int64) * stride_qih + t.to(tl.int64) * stride_qin
    q_rows = tl.load(QI + q_off[:, None] + offs_d[None, :] * stride_qid, mask=j_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.load(W + b64 * stride_wb + j.to(tl.int64) * stride_wh + t.to(tl.int64) * stride_wn,
                mask=j_ok, other=0.0).to(tl.float32)
    row = b64 * N_Q + t
    zero = tl.arange(0, 1)
    lse_i = tl.load(LSE_I + row + zero)
    g = tl.load(G_UP + row + zero)
    dq = tl.zeros([HI_PAD, DI_PAD], tl.float32)
    dw = tl.zeros([HI_PAD], tl.float32)
    p_row = row * K_SEL
    for s0 in range(0, extent, BLOCK_K):
        slots, idx, used = _slots(TOPK, topk_row, s0, K_SEL, t, N_Q, N_K, stride_ts, BLOCK_K, CAUSAL)
        p = tl.load(P_SET + p_row + slots, mask=used, other=0.0)
        # per indexer head the score of the gathered keys, from the q_idx rows held in registers
        a = tl.zeros([HI_PAD, BLOCK_K], tl.float32)
        for kvi in range(0, H_KI):
            rows_ok = j_ok & (j // GROUP_I == kvi)
            k_ptr = KI + b64 * stride_kib + kvi * stride_kih + idx[:, None] * stride_kin
            k_tile = tl.load(k_ptr + offs_d[None, :] * stride_kid, mask=used[:, None] & d_ok[None, :], other=0.0)
            a += tl.where(rows_ok[:, None], _dot(q_rows, tl.trans(k_tile), IEEE_I), 0.0)
        if RELU:
            act = tl.maximum(a, 0.0, propagate_nan=tl.PropagateNan.ALL)  # relu(NaN) stays NaN
        else:
            act = a
        logits = tl.sum(tl.where(j_ok[:, None], w[:, None] * act, 0.0), 0)
        # an empty row (LSE_I = -inf) has no used slot; G = 0 off the set
        vis = used & (lse_i != float("-inf"))
        soft = tl.exp2((logits - lse_i) * LOG2E)
        grad = tl.where(vis, g * (soft - p), 0.0)
        grad_rows = tl.broadcast_to(grad[None, :], [HI_PAD, BLOCK_K])
        vis_rows = tl.broadcast_to(vis[None, :], [HI_PAD, BLOCK_K]) & j_ok[:, None]
        coef, dw_terms = _coef_a(grad_rows, vis_rows, a, w, RELU)
        dw += tl.sum(dw_terms, 1)
        for kvi in range(0, H_KI):
            rows_ok = j_ok & (j // GROUP_I == kvi)
            k_ptr = KI + b64 * stride_kib + kvi * stride_kih + idx[:, None] * stride_kin  # again (L1)
            k_tile = tl.load(k_ptr + offs_d[None, :] * stride_kid, mask=used[:, None] & d_ok[None, :], other=0.0)
            c_kv = tl.where(rows_ok[:, None], coef, 0.0)
            dq += _dot(c_kv.to(k_tile.dtype), k_tile, IEEE_I)
            dk_part = _dot(tl.trans(c_kv).to(q_rows.dtype), q_rows, IEEE_I)  # [BLOCK_K, DI_PAD]
            dk_ptr = DK + ((b64 * H_KI + kvi) * N_K + idx[:, None]) * DI + offs_d[None, :]
            tl.atomic_add(dk_ptr, dk_part, mask=used[:, None] & d_ok[None, :], sem="relaxed")
    out_rows = (b64 * H_I + j) * N_Q + t
    tl.store(DQ + out_rows[:, None] * DI + offs_d[None, :], dq, mask=j_ok[:, None] & d_ok[None, :])
    tl.store(DW + out_rows, dw, mask=j_ok)
