"""Backward Triton kernels: recompute P1, P2 tile by tile from the saved LSEs (docs/math.md).

Per tile, with scores in bits (``s_t = sigma_t * log2(e) * q_t.k_t``, the forward's fold):

    x_t = s_t - lse_t,  P_t = exp2(x_t)                 (lse_t saved by the forward, in bits)
    setting 1 (train side 2):  dS2 = g * (P2 - P1)
    setting 2 (train side 1):  dS1 = g * P1 * ((S1 - S2) - (LSE1 - LSE2) - KL)
                                   = g * ln2 * P1 * (x1 - x2 - KL * log2(e))   (KL saved in nats)
    dQ_t = sigma_t * dS_t K_t,   dK_t = sigma_t * dS_t^T Q_t

The log-ratio comes from the two logits and the saved LSEs, never from log(P). sigma_t and g
are folded into dS before the two matmuls. Rows with no visible key get lse = EMPTY_LSE (1e30) here,
so P1 = P2 = 0 exactly and their gradient is 0; masked entries get s = -inf and P = 0, and their
log-ratio is taken before masking, so no -inf - -inf is formed.

Invisible values never reach a row (docs/math.md), in the *masked* stage only (whole tiles are seen
by every row of the tile: no guard there): masked entries of dS are selected to 0, never
multiplied (an invisible key's score, or a row's NaN log-ratio, may be NaN); and the operands of
the dS matmuls are made finite (``_finite``), since a 0 in dS times a NaN/inf key row (dQ = dS K)
or query row (dK = dS^T Q) is NaN in the matmul. That loses nothing a row sees: a NaN key or query
that a row does see already makes its dS entries NaN (its scores and saved LSE are NaN).
Padded query rows (past N_Q) load as 0 with g = 0 and lse = -inf, so they add exactly 0.

Two kernels:
- ``_kl_bwd_dk_kernel``: one program per (key tile, batch, query head); loops over the query
  tiles that see the key tile and accumulates dK1/dK2 in registers. With FUSED_DQ it also adds
  each tile's dQ contribution into an fp32 buffer with atomics: every (query tile, key tile)
  pair is visited once (4 matmuls per tile for one setting, 6 for both).
- ``_kl_bwd_dq_kernel``: one program per (query tile, batch, query head); loops over key tiles
  and accumulates dQ in registers (the "separate" path, together with the dk kernel without
  FUSED_DQ: no atomics on dQ, bitwise repeatable).
GQA: with more than one query head per key head, dK is either added with fp32 atomics into a
[B, H_K, N_K, D] buffer (DK_ATOMIC) or stored per query head and summed by the caller in a fixed
order (deterministic).
"""
import triton
import triton.language as tl

from streamkl_gpu._core.jit import LN2, LOG2E, _dot, _key_stages
from streamkl_gpu.attention.triton.fwd import _batch_offsets, _row_layout, _sequence


# For rows with no visible key (and padding rows) the LSE is replaced by this finite "+infinity":
# exp2(s - EMPTY_LSE) = 0 exactly for every fp32 score, while (s1 - lse1) - (s2 - lse2) stays finite.
EMPTY_LSE = tl.constexpr(1e30)

@triton.jit
def _row_consts(LSE1, LSE2, KL, G, rows, row_ok):
    """Per-row constants of the backward, read from the forward's saved values (bits)."""
    lse1 = tl.load(LSE1 + rows, mask=row_ok, other=float("-inf"))
    lse2 = tl.load(LSE2 + rows, mask=row_ok, other=float("-inf"))
    kl = tl.load(KL + rows, mask=row_ok, other=0.0)
    g = tl.load(G + rows, mask=row_ok, other=0.0)
    empty = lse1 == float("-inf")  # no visible key (or a padding row)
    lse1_bits = tl.where(empty, EMPTY_LSE, lse1)  # the forward saves the LSEs in bits
    lse2_bits = tl.where(empty, EMPTY_LSE, lse2)
    kl_bits = tl.where(empty, 0.0, kl * LOG2E)
    g = tl.where(empty, 0.0, g)
    return lse1_bits, lse2_bits, kl_bits, g


@triton.jit
def _fold_factors(lse1_bits, lse2_bits, kl_bits, g, qk_scale1, qk_scale2, scale1, scale2):
    """Per-row factors of the folded dS formulas (``_tile_ds`` with FOLD), from ``_row_consts``:
    c2 = g * sigma2;  c1 = g * sigma1 * ln2,  a_t = c1 * qk_scale_t,  rc = c1 * (lse1 - lse2 + KL)
    (the row terms summed first: a row constant). Empty rows: g = 0, so all four are 0."""
    c2 = g * scale2
    c1 = g * (scale1 * LN2)
    return c2, c1 * qk_scale1, c1 * qk_scale2, c1 * (lse1_bits - lse2_bits + kl_bits)


@triton.jit
def _gexp_factors(lse1_bits, lse2_bits, kl_bits, g):
    """Per-row constants of the both-sides dK kernel with |g| folded into the exponentials (GEXP):
    e_t = lse_t - log2|g|, so exp2(s_t * qk_scale_t - e_t) = |g| * P_t; rc = lse1 - lse2 + KL (bits);
    sgn = the sign of g. sigma_t (times ln2 for side 1) is applied once to dK after the query loop.
    g = 0 (empty rows too) gets e_t = EMPTY_LSE, so |g| * P_t = 0 exactly; a NaN g stays NaN in e_t."""
    e_shift = tl.log2(tl.abs(g))
    zero = g == 0.0
    e1 = tl.where(zero, EMPTY_LSE, lse1_bits - e_shift)
    e2 = tl.where(zero, EMPTY_LSE, lse2_bits - e_shift)
    sgn = tl.where(g < 0.0, -1.0, 1.0)
    return e1, e2, lse1_bits - lse2_bits + kl_bits, sgn


# Column order of the packed row constants (_kl_bwd_rows_kernel PACKED): each setting's values in
# one 16-byte group (a TMA box starts 16-byte aligned): setting 1 in columns 0..3, setting 2 in 4..7
PACKED_PLANES = ("c2", "lse2", "lse1", None, "lse1", "a1", "a2", "rc")
# ... and with GEXP (both sides): one 16-byte group per row
PACKED_GEXP_PLANES = ("e1", "e2", "rc", "sgn")


@triton.jit
def _columns4(x):
    """The four columns of a [M, 4] tile as [M] vectors (two splits of the last dim)."""
    lo, hi = x.reshape(x.shape[0], 2, 2).split()  # columns (0, 2) and (1, 3)
    c0, c2 = lo.split()
    c1, c3 = hi.split()
    return c0, c1, c2, c3


@triton.jit
def _exp2_fma(x):
    """2^x on the FMA pipe instead of MUFU (FA4's exp2 emulation): x = j + f with j = round(x) (the
    1.5 * 2^23 add leaves it in the low mantissa bits), 2^f by its degree-5 Taylor polynomial on
    [-0.5, 0.5] (relative error <= 2.4e-6, 3.1e-6 with its fp32 rounding), 2^j from the exponent
    bits. x is clamped at -125 (2^-125 for -inf: masked entries are selected to 0 after, empty rows
    have g = 0); NaN stays NaN (the product with a NaN polynomial)."""
    x = tl.maximum(x, -125.0, propagate_nan=tl.PropagateNan.ALL)
    t = x + 12582912.0
    j = t - 12582912.0
    f = x - j
    p = f * 1.3333558e-3 + 9.6181291e-3
    p = p * f + 5.5504109e-2
    p = p * f + 2.4022651e-1
    p = p * f + 6.9314718e-1
    p = p * f + 1.0
    scale = ((t.to(tl.int32, bitcast=True) << 23) + 0x3F800000).to(tl.float32, bitcast=True)
    return p * scale


@triton.jit
def _exp2_split(x):
    """exp2 of a tile: the odd columns on the FMA pipe (_exp2_fma), the even ones on MUFU (adjacent
    columns sit in one thread's registers in the MMA layout: the split and join move no data)."""
    even, odd = x.reshape(x.shape[0], x.shape[1] // 2, 2).split()
    return tl.join(tl.exp2(even), _exp2_fma(odd)).reshape(x.shape[0], x.shape[1])


@triton.jit
def _finite(x):
    """x with NaN and +-inf replaced by 0: a matmul operand of the masked stage (see the docstring)."""
    return tl.where(tl.abs(x) < float("inf"), x, 0.0)


@triton.jit
def _along_rows(v, TRANS: tl.constexpr):
    """A per-query-row vector broadcast over a tile: rows are dim 0, or dim 1 if TRANS (key-major)."""
    if TRANS:
        out = v[None, :]
    else:
        out = v[:, None]
    return out


@triton.jit
def _tile_ds(q1, q2, k1, k2, lse1_bits, lse2_bits, kl_bits, g, offs_m, cols, N_K, diag_offset,
             qk_scale1, qk_scale2, scale1, scale2,
             MASKED: tl.constexpr, CAUSAL: tl.constexpr, TRAIN1: tl.constexpr, TRAIN2: tl.constexpr,
             IEEE1: tl.constexpr, IEEE2: tl.constexpr,
             TRANS: tl.constexpr = False, FOLD: tl.constexpr = False, ROW_SCALE: tl.constexpr = True,
             c2=None, a1=None, a2=None, rc=None, POLY: tl.constexpr = 0, GEXP: tl.constexpr = False):
    """dS1 (if TRAIN1) and dS2 (if TRAIN2) of one [BLOCK_M, BLOCK_N] tile, sigma and g folded in.

    TRANS: the tile is computed key-major, dS^T [BLOCK_N, BLOCK_M] (S^T = K Q^T), so that dK += dS^T Q
    takes dS^T straight from registers (the wgmma A operand), as FlashAttention's dK/dV loop.
    FOLD: the same formulas in fewer fp32 ops per score, with the per-row factors ``c2, a1, a2, rc``
    of ``_fold_factors`` (formed by the caller once per query tile, or once per row by a pre-pass):
        setting 2:  ds1 = P1 * (s1*a1 - (s2*a2 + rc))   (2 FFMA + 1 FMUL instead of 2 FFMA + 2 FADD + 2 FMUL)
        setting 1:  ds2 = (P2 - P1) * c2
    ROW_SCALE=False (FOLD only): the per-row factor (g * sigma_t, times ln2 for side 1) is left out,
    for a caller that applies it once to its dQ rows after the key loop (the dQ kernel); then
    ds1 = P1 * (s1*qk_scale1 - (s2*qk_scale2 + (lse1 - lse2 + KL))), ds2 = P2 - P1.
    POLY (setting 1 only, two exponentials per score): half of P2's on the FMA pipe (_exp2_split).
    GEXP (both sides, FOLD with ROW_SCALE; ``_gexp_factors``): lse1_bits / lse2_bits hold e1 / e2,
    ``c2`` the sign of g, ``rc`` lse1 - lse2 + KL; with u_t = exp2(x_t) = |g| * P_t, v1 = sgn * u1:
        ds1 = v1 * (s1*qk_scale1 - (s2*qk_scale2 + rc)),  ds2 = sgn * u2 - v1   (1 FFMA + 2 FMUL)
    both without sigma_t (and ln2), which the caller applies to dK once: four row constants where
    the other fold has six, in the same number of fp32 ops per score.
    """
    if TRANS:
        s1 = _dot(k1, tl.trans(q1), IEEE1)
        s2 = _dot(k2, tl.trans(q2), IEEE2)
    else:
        s1 = _dot(q1, tl.trans(k1), IEEE1)
        s2 = _dot(q2, tl.trans(k2), IEEE2)
    # log2 P_t = s_t * sigma_t * log2(e) - lse_t (bits; one FFMA, the forward's fold)
    x1 = s1 * qk_scale1 - _along_rows(lse1_bits, TRANS)
    if FOLD:
        if TRAIN1:
            # (x1 - x2 - KL) * c1 with the row terms summed first: lse1 - lse2 + KL is a row constant
            if GEXP:
                log_ratio = s1 * qk_scale1 - (s2 * qk_scale2 + _along_rows(rc, TRANS))
            elif ROW_SCALE:
                log_ratio = s1 * _along_rows(a1, TRANS) - (s2 * _along_rows(a2, TRANS) + _along_rows(rc, TRANS))
            else:
                row1 = lse1_bits - lse2_bits + kl_bits
                log_ratio = s1 * qk_scale1 - (s2 * qk_scale2 + _along_rows(row1, TRANS))
        if TRAIN2:
            x2 = s2 * qk_scale2 - _along_rows(lse2_bits, TRANS)
    else:
        x2 = s2 * qk_scale2 - _along_rows(lse2_bits, TRANS)
        if TRAIN1:
            # (S1 - S2) - (LSE1 - LSE2) - KL = log P1 - log P2 - KL, formed from logits and saved LSEs
            # (never log of a probability), before masking: finite
            log_ratio = x1 - x2 - _along_rows(kl_bits, TRANS)
    if MASKED:
        if TRANS:
            visible = cols[:, None] < N_K
            if CAUSAL:
                visible = visible & (cols[:, None] <= offs_m[None, :] + diag_offset)
        else:
            visible = cols[None, :] < N_K
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + diag_offset)
        x1 = tl.where(visible, x1, float("-inf"))
        if TRAIN2:
            x2 = tl.where(visible, x2, float("-inf"))
    p1 = tl.exp2(x1)
    ds1 = p1
    ds2 = p1
    if GEXP:  # both sides; p_t = |g| * P_t, c2 the sign of g
        sgn = _along_rows(c2, TRANS)
        v1 = p1 * sgn
        ds2 = tl.exp2(x2) * sgn - v1
        ds1 = v1 * log_ratio
    elif TRAIN2:
        if POLY and not TRAIN1:
            p2 = _exp2_split(x2)
        else:
            p2 = tl.exp2(x2)
        if FOLD and not ROW_SCALE:
            ds2 = p2 - p1
        elif FOLD:
            ds2 = (p2 - p1) * _along_rows(c2, TRANS)
        else:
            ds2 = (p2 - p1) * _along_rows(g * scale2, TRANS)
    if TRAIN1 and not GEXP:
        if FOLD:
            ds1 = p1 * log_ratio
        else:
            ds1 = p1 * log_ratio * _along_rows(g * (scale1 * LN2), TRANS)
    if MASKED:  # select, never multiply: 0 * NaN = NaN (an invisible key's score, a NaN row's g)
        ds1 = tl.where(visible, ds1, 0.0)
        ds2 = tl.where(visible, ds2, 0.0)
    return ds1, ds2


@triton.jit
def _dk_dq_side(dk, ds, q, k, dq_ptrs, dq_mask, dq_desc, tma_b, h, start_m,
                MASKED: tl.constexpr, FUSED_DQ: tl.constexpr, IEEE: tl.constexpr,
                TRANS: tl.constexpr = False, DQ_REDUCE: tl.constexpr = False, DQ_STORE: tl.constexpr = False):
    """One side's share of a tile: dK += dS^T Q in registers; with FUSED_DQ, dQ += dS K by atomics
    (per element, or with DQ_REDUCE one TMA bulk reduce-add of the whole [BLOCK_M, D] tile; rows
    past N_Q and dims past D fall outside the descriptor and are dropped), or with DQ_STORE (the
    launch's one key tile holds every key: this product is the row's whole dQ) a plain store in
    the buffer's dtype. TRANS: ``ds`` holds dS^T."""
    ds = ds.to(q.dtype)  # the tensor-core operand precision, as FlashAttention's backward
    if MASKED:  # a NaN query row must not reach the dK of keys it cannot see
        q = _finite(q)
    if TRANS:
        dk += _dot(ds, q, IEEE)
    else:
        dk += _dot(tl.trans(ds), q, IEEE)
    if FUSED_DQ:
        if MASKED:  # nor a NaN key the dQ of rows that cannot see it
            k = _finite(k)
        if TRANS:
            dq = _dot(tl.trans(ds), k, IEEE)
        else:
            dq = _dot(ds, k, IEEE)
        if DQ_STORE:
            tl.store(dq_ptrs, dq.to(dq_ptrs.dtype.element_ty), mask=dq_mask)
        elif DQ_REDUCE:
            dq_desc.atomic_add([tma_b, h, start_m, 0], dq.reshape(1, 1, dq.shape[0], dq.shape[1]))
        else:
            tl.atomic_add(dq_ptrs, dq, mask=dq_mask, sem="relaxed")
    return dk


@triton.jit
def _dk_query_range(
    dk1, dk2, k1, k2, start_n, cols, lo, hi,
    Q1, Q2, DQ1, DQ2, LSE1, LSE2, KL, G, row_base, row_step,
    stride_q1n, stride_q1d, stride_q2n, stride_q2d, stride_dq1n, stride_dq2n,
    N_Q, N_K, D1: tl.constexpr, D2: tl.constexpr, diag_offset, qk_scale1, qk_scale2, scale1, scale2,
    BLOCK_M: tl.constexpr, D1_PAD: tl.constexpr, D2_PAD: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, TRAIN1: tl.constexpr, TRAIN2: tl.constexpr,
    FUSED_DQ: tl.constexpr, IEEE1: tl.constexpr, IEEE2: tl.constexpr,
    q1_desc, q2_desc, dq1_desc, dq2_desc, tma_b, h,
    USE_TMA: tl.constexpr, TRANS: tl.constexpr, FOLD: tl.constexpr, DQ_REDUCE: tl.constexpr,
    rows_desc, pid_bh, ROWS: tl.constexpr, ROWS_PACKED: tl.constexpr = False,
    POLY: tl.constexpr = 0, DQ_STORE: tl.constexpr = False, GEXP: tl.constexpr = False,
):
    offs_d1 = tl.arange(0, D1_PAD)
    offs_d2 = tl.arange(0, D2_PAD)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < N_Q
        rows64 = offs_m.to(tl.int64)
        if USE_TMA:  # rows past N_Q and dims past D arrive as zeros, as the masked loads give
            q1 = q1_desc.load([tma_b, h, start_m, 0]).reshape(BLOCK_M, D1_PAD)
            q2 = q2_desc.load([tma_b, h, start_m, 0]).reshape(BLOCK_M, D2_PAD)
        else:
            q1 = tl.load(Q1 + rows64[:, None] * stride_q1n + offs_d1[None, :] * stride_q1d,
                         mask=row_ok[:, None] & (offs_d1[None, :] < D1), other=0.0)
            q2 = tl.load(Q2 + rows64[:, None] * stride_q2n + offs_d2[None, :] * stride_q2d,
                         mask=row_ok[:, None] & (offs_d2[None, :] < D2), other=0.0)
        c2 = None
        a1 = None
        a2 = None
        rc = None
        if ROWS and ROWS_PACKED:  # the pre-pass's packed row constants: one TMA load per tile
            kl_bits = tl.zeros([BLOCK_M], tl.float32)  # (unused with ROWS: folded into rc)
            g = kl_bits
            if GEXP:  # both sides, four columns: e1, e2, rc, sign of g (_gexp_factors)
                lse1_bits, lse2_bits, rc, c2 = _columns4(rows_desc.load([pid_bh, start_m, 0]).reshape(BLOCK_M, 4))
            elif TRAIN1 and TRAIN2:  # all eight columns: even c2, lse1, lse1, a2; odd lse2, -, a1, rc
                even, odd = rows_desc.load([pid_bh, start_m, 0]).reshape(BLOCK_M, 4, 2).split()
                c2, lse1_bits, _, a2 = _columns4(even)
                lse2_bits, _, a1, rc = _columns4(odd)
            elif TRAIN2:  # columns 0..3: c2, lse2, lse1, -
                c2, lse2_bits, lse1_bits, _ = _columns4(rows_desc.load([pid_bh, start_m, 0]).reshape(BLOCK_M, 4))
            else:  # columns 4..7: lse1, a1, a2, rc
                lse1_bits, a1, a2, rc = _columns4(rows_desc.load([pid_bh, start_m, 4]).reshape(BLOCK_M, 4))
                lse2_bits = lse1_bits
        elif ROWS:  # the pre-pass's per-row planes (_kl_bwd_rows_kernel), one TMA load each
            lse1_bits = rows_desc.load([0, pid_bh, start_m]).reshape(BLOCK_M)
            lse2_bits = lse1_bits
            kl_bits = lse1_bits
            g = lse1_bits
            if TRAIN2:
                lse2_bits = rows_desc.load([1, pid_bh, start_m]).reshape(BLOCK_M)
                c2 = rows_desc.load([2, pid_bh, start_m]).reshape(BLOCK_M)
            if TRAIN1:
                a1 = rows_desc.load([3, pid_bh, start_m]).reshape(BLOCK_M)
                a2 = rows_desc.load([4, pid_bh, start_m]).reshape(BLOCK_M)
                rc = rows_desc.load([5, pid_bh, start_m]).reshape(BLOCK_M)
        else:
            lse1_bits, lse2_bits, kl_bits, g = _row_consts(LSE1, LSE2, KL, G, row_base + offs_m * row_step, row_ok)
            if FOLD:
                c2, a1, a2, rc = _fold_factors(lse1_bits, lse2_bits, kl_bits, g, qk_scale1, qk_scale2,
                                               scale1, scale2)
        ds1, ds2 = _tile_ds(q1, q2, k1, k2, lse1_bits, lse2_bits, kl_bits, g, offs_m, cols, N_K,
                            diag_offset, qk_scale1, qk_scale2, scale1, scale2,
                            MASKED, CAUSAL, TRAIN1, TRAIN2, IEEE1, IEEE2, TRANS, FOLD, True, c2, a1, a2, rc, POLY,
                            GEXP)
        if TRAIN1:
            dk1 = _dk_dq_side(dk1, ds1, q1, k1, DQ1 + rows64[:, None] * stride_dq1n + offs_d1[None, :],
                              row_ok[:, None] & (offs_d1[None, :] < D1), dq1_desc, tma_b, h, start_m,
                              MASKED, FUSED_DQ, IEEE1, TRANS, DQ_REDUCE, DQ_STORE)
        if TRAIN2:
            dk2 = _dk_dq_side(dk2, ds2, q2, k2, DQ2 + rows64[:, None] * stride_dq2n + offs_d2[None, :],
                              row_ok[:, None] & (offs_d2[None, :] < D2), dq2_desc, tma_b, h, start_m,
                              MASKED, FUSED_DQ, IEEE2, TRANS, DQ_REDUCE, DQ_STORE)
    return dk1, dk2


@triton.jit
def _kl_bwd_dk_kernel(
    Q1, K1, Q2, K2, LSE1, LSE2, KL, G,
    DK1, DK2, DQ1, DQ2,
    stride_q1b, stride_q1h, stride_q1n, stride_q1d,
    stride_k1b, stride_k1h, stride_k1n, stride_k1d,
    stride_q2b, stride_q2h, stride_q2n, stride_q2d,
    stride_k2b, stride_k2h, stride_k2n, stride_k2d,
    stride_dk1b, stride_dk1h, stride_dk1n,
    stride_dk2b, stride_dk2h, stride_dk2n,
    stride_dq1b, stride_dq1h, stride_dq1n,
    stride_dq2b, stride_dq2h, stride_dq2n,
    H, N_Q, N_K, D1: tl.constexpr, D2: tl.constexpr, GROUP1, GROUP2,
    qk_scale1, qk_scale2, scale1, scale2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D1_PAD: tl.constexpr, D2_PAD: tl.constexpr,
    CAUSAL: tl.constexpr, TRAIN1: tl.constexpr, TRAIN2: tl.constexpr, FUSED_DQ: tl.constexpr,
    DK1_ATOMIC: tl.constexpr, DK2_ATOMIC: tl.constexpr, IEEE1: tl.constexpr, IEEE2: tl.constexpr,
    CU_SEQLENS_Q=None, CU_SEQLENS_K=None,  # int32 [batch + 1] (used when VARLEN)
    VARLEN: tl.constexpr = False,
    # TMA descriptors (USE_TMA; never with VARLEN): q*/k* as [B, H(_K), N, D] with blocks
    # [1, 1, BLOCK_M or BLOCK_N, D_PAD]; dq* (DQ_REDUCE) of the fp32 dQ buffers, blocks [1, 1, BLOCK_M, D_PAD]
    Q1_DESC=None, K1_DESC=None, Q2_DESC=None, K2_DESC=None, DQ1_DESC=None, DQ2_DESC=None,
    USE_TMA: tl.constexpr = False,  # every operand tile through TMA descriptors
    TRANS: tl.constexpr = False,  # key-major tiles (dS^T in registers for dK += dS^T Q)
    FOLD: tl.constexpr = False,  # fewer fp32 ops per score (see _tile_ds)
    DQ_REDUCE: tl.constexpr = False,  # fused dQ by TMA bulk reduce-add (needs FUSED_DQ)
    ROWS_DESC=None,  # [6, B*H, N_Q] planes of _kl_bwd_rows_kernel, blocks [1, 1, BLOCK_M] (ROWS)
    ROWS: tl.constexpr = False,  # per-row constants precomputed by the pre-pass (needs FOLD, USE_TMA)
    # ROWS_PACKED (with ROWS): ROWS_DESC over [B*H, N_Q, 8] (PACKED_PLANES), blocks [1, BLOCK_M, 4 or 8]
    ROWS_PACKED: tl.constexpr = False,
    POLY: tl.constexpr = 0,  # setting 1: half of P2's exponentials on the FMA pipe (_exp2_split)
    # with FUSED_DQ: the grid's one key tile holds every key (N_K <= BLOCK_N) and every query row
    # is visited (not causal, or N_Q <= N_K): dQ is stored, not added (no zeroed buffer, no atomics)
    DQ_STORE: tl.constexpr = False,
    # both sides, separate, ROWS_PACKED: |g| folded into the exponentials, four row constants per
    # row (_gexp_factors; ROWS_DESC over [B*H, N_Q, 4]), sigma_t applied to dK after the query loop
    GEXP: tl.constexpr = False,
):
    # VARLEN: as in _kl_fwd_kernel (b is the sequence, N_Q/N_K the totals, [total, H, D] tensors
    # as [1, H, total, D] views); the grid covers the longest sequence's key tiles.
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    kh1 = h // GROUP1
    kh2 = h // GROUP2
    start_n = pid_n * BLOCK_N
    q_lo, N_Q, k_lo, N_K = _sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, N_Q, N_K, VARLEN)
    if VARLEN:
        if start_n >= N_K:  # a key tile past this sequence's end: no work, nothing to write
            return
    cols = start_n + tl.arange(0, BLOCK_N)
    col_ok = cols < N_K
    cols64 = cols.to(tl.int64)
    offs_d1 = tl.arange(0, D1_PAD)
    offs_d2 = tl.arange(0, D2_PAD)
    h64 = h.to(tl.int64)
    off_q1, off_k1 = _batch_offsets(b, q_lo, k_lo, stride_q1b, stride_q1n, stride_k1b, stride_k1n, VARLEN)
    off_q2, off_k2 = _batch_offsets(b, q_lo, k_lo, stride_q2b, stride_q2n, stride_k2b, stride_k2n, VARLEN)
    off_dq1, off_dk1 = _batch_offsets(b, q_lo, k_lo, stride_dq1b, stride_dq1n, stride_dk1b, stride_dk1n, VARLEN)
    off_dq2, off_dk2 = _batch_offsets(b, q_lo, k_lo, stride_dq2b, stride_dq2n, stride_dk2b, stride_dk2n, VARLEN)

    if USE_TMA:  # keys past N_K and dims past D arrive as zeros
        k1 = K1_DESC.load([b, kh1, start_n, 0]).reshape(BLOCK_N, D1_PAD)
        k2 = K2_DESC.load([b, kh2, start_n, 0]).reshape(BLOCK_N, D2_PAD)
    else:
        k1 = tl.load(K1 + off_k1 + kh1.to(tl.int64) * stride_k1h
                     + cols64[:, None] * stride_k1n + offs_d1[None, :] * stride_k1d,
                     mask=col_ok[:, None] & (offs_d1[None, :] < D1), other=0.0)
        k2 = tl.load(K2 + off_k2 + kh2.to(tl.int64) * stride_k2h
                     + cols64[:, None] * stride_k2n + offs_d2[None, :] * stride_k2d,
                     mask=col_ok[:, None] & (offs_d2[None, :] < D2), other=0.0)
    dk1 = tl.zeros([BLOCK_N, D1_PAD], tl.float32)
    dk2 = tl.zeros([BLOCK_N, D2_PAD], tl.float32)

    q1_base = Q1 + off_q1 + h64 * stride_q1h
    q2_base = Q2 + off_q2 + h64 * stride_q2h
    dq1_base = DQ1 + off_dq1 + h64 * stride_dq1h
    dq2_base = DQ2 + off_dq2 + h64 * stride_dq2h
    row_base, row_step = _row_layout(pid_bh, h, H, q_lo, N_Q, VARLEN)

    diag_offset = N_K - N_Q
    m_lo = 0
    m_full = 0
    if CAUSAL:
        # query rows that see any key of this tile: i >= start_n - diag_offset
        m_lo = (tl.maximum(start_n - diag_offset, 0) // BLOCK_M) * BLOCK_M
        # query tiles all of whose rows see every key of this tile start at or after
        # start_n + BLOCK_N - 1 - diag_offset; the band before that is masked
        m_full = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag_offset, 0), BLOCK_M) * BLOCK_M
        m_full = tl.maximum(tl.minimum(m_full, N_Q), m_lo)
    dk1, dk2 = _dk_query_range(
        dk1, dk2, k1, k2, start_n, cols, m_lo, m_full,
        q1_base, q2_base, dq1_base, dq2_base, LSE1, LSE2, KL, G, row_base, row_step,
        stride_q1n, stride_q1d, stride_q2n, stride_q2d, stride_dq1n, stride_dq2n,
        N_Q, N_K, D1, D2, diag_offset, qk_scale1, qk_scale2, scale1, scale2,
        BLOCK_M, D1_PAD, D2_PAD, True, CAUSAL, TRAIN1, TRAIN2, FUSED_DQ, IEEE1, IEEE2,
        Q1_DESC, Q2_DESC, DQ1_DESC, DQ2_DESC, b, h, USE_TMA, TRANS, FOLD, DQ_REDUCE, ROWS_DESC, pid_bh, ROWS,
            ROWS_PACKED, POLY, DQ_STORE, GEXP)
    if start_n + BLOCK_N <= N_K:
        dk1, dk2 = _dk_query_range(
            dk1, dk2, k1, k2, start_n, cols, m_full, N_Q,
            q1_base, q2_base, dq1_base, dq2_base, LSE1, LSE2, KL, G, row_base, row_step,
            stride_q1n, stride_q1d, stride_q2n, stride_q2d, stride_dq1n, stride_dq2n,
            N_Q, N_K, D1, D2, diag_offset, qk_scale1, qk_scale2, scale1, scale2,
            BLOCK_M, D1_PAD, D2_PAD, False, CAUSAL, TRAIN1, TRAIN2, FUSED_DQ, IEEE1, IEEE2,
            Q1_DESC, Q2_DESC, DQ1_DESC, DQ2_DESC, b, h, USE_TMA, TRANS, FOLD, DQ_REDUCE, ROWS_DESC, pid_bh, ROWS,
            ROWS_PACKED, POLY, DQ_STORE, GEXP)
    else:  # the ragged last key tile: keys past N_K must be masked out of every query tile
        dk1, dk2 = _dk_query_range(
            dk1, dk2, k1, k2, start_n, cols, m_full, N_Q,
            q1_base, q2_base, dq1_base, dq2_base, LSE1, LSE2, KL, G, row_base, row_step,
            stride_q1n, stride_q1d, stride_q2n, stride_q2d, stride_dq1n, stride_dq2n,
            N_Q, N_K, D1, D2, diag_offset, qk_scale1, qk_scale2, scale1, scale2,
            BLOCK_M, D1_PAD, D2_PAD, True, CAUSAL, TRAIN1, TRAIN2, FUSED_DQ, IEEE1, IEEE2,
            Q1_DESC, Q2_DESC, DQ1_DESC, DQ2_DESC, b, h, USE_TMA, TRANS, FOLD, DQ_REDUCE, ROWS_DESC, pid_bh, ROWS,
            ROWS_PACKED, POLY, DQ_STORE, GEXP)
    if GEXP:  # the row factors' sigma_t (and ln2 of side 1's log-ratio), once per key row
        dk1 = dk1 * (scale1 * LN2)
        dk2 = dk2 * scale2

    if TRAIN1:
        if DK1_ATOMIC:  # GQA: add into the shared key head's fp32 buffer
            ptr = DK1 + off_dk1 + kh1.to(tl.int64) * stride_dk1h + cols64[:, None] * stride_dk1n + offs_d1[None, :]
            tl.atomic_add(ptr, dk1, mask=col_ok[:, None] & (offs_d1[None, :] < D1), sem="relaxed")
        else:  # one query head per key head, or a per-query-head buffer summed by the caller
            ptr = DK1 + off_dk1 + h64 * stride_dk1h + cols64[:, None] * stride_dk1n + offs_d1[None, :]
            tl.store(ptr, dk1.to(DK1.dtype.element_ty), mask=col_ok[:, None] & (offs_d1[None, :] < D1))
    if TRAIN2:
        if DK2_ATOMIC:
            ptr = DK2 + off_dk2 + kh2.to(tl.int64) * stride_dk2h + cols64[:, None] * stride_dk2n + offs_d2[None, :]
            tl.atomic_add(ptr, dk2, mask=col_ok[:, None] & (offs_d2[None, :] < D2), sem="relaxed")
        else:
            ptr = DK2 + off_dk2 + h64 * stride_dk2h + cols64[:, None] * stride_dk2n + offs_d2[None, :]
            tl.store(ptr, dk2.to(DK2.dtype.element_ty), mask=col_ok[:, None] & (offs_d2[None, :] < D2))


@triton.jit
def _dq_key_range(
    dq1, dq2, q1, q2, lse1_bits, lse2_bits, kl_bits, g, offs_m, k1_ptrs, k2_ptrs,
    stride_k1n, stride_k2n, lo, hi, N_K, D1: tl.constexpr, D2: tl.constexpr, diag_offset,
    qk_scale1, qk_scale2, scale1, scale2,
    BLOCK_N: tl.constexpr, D1_PAD: tl.constexpr, D2_PAD: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, TRAIN1: tl.constexpr, TRAIN2: tl.constexpr,
    IEEE1: tl.constexpr, IEEE2: tl.constexpr,
    k1_desc, k2_desc, tma_b, kh1, kh2,
    USE_TMA: tl.constexpr, FOLD: tl.constexpr, POLY: tl.constexpr = 0,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d1 = tl.arange(0, D1_PAD)
    offs_d2 = tl.arange(0, D2_PAD)
    k1_ptrs += lo.to(tl.int64) * stride_k1n
    k2_ptrs += lo.to(tl.int64) * stride_k2n
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if USE_TMA:  # keys past N_K and dims past D arrive as zeros
            k1 = k1_desc.load([tma_b, kh1, start_n, 0]).reshape(BLOCK_N, D1_PAD)
            k2 = k2_desc.load([tma_b, kh2, start_n, 0]).reshape(BLOCK_N, D2_PAD)
        elif MASKED:
            k1 = tl.load(k1_ptrs, mask=(cols[:, None] < N_K) & (offs_d1[None, :] < D1), other=0.0)
            k2 = tl.load(k2_ptrs, mask=(cols[:, None] < N_K) & (offs_d2[None, :] < D2), other=0.0)
        else:  # whole tiles: bounds masks only on padded head dims
            k1 = tl.load(k1_ptrs, mask=offs_d1[None, :] < D1, other=0.0)
            k2 = tl.load(k2_ptrs, mask=offs_d2[None, :] < D2, other=0.0)
        # FOLD: the per-row factors g * sigma (* ln2) wait for the end of the key loop (the caller)
        ds1, ds2 = _tile_ds(q1, q2, k1, k2, lse1_bits, lse2_bits, kl_bits, g, offs_m, cols, N_K,
                            diag_offset, qk_scale1, qk_scale2, scale1, scale2,
                            MASKED, CAUSAL, TRAIN1, TRAIN2, IEEE1, IEEE2, False, FOLD, not FOLD, POLY=POLY)
        if MASKED:  # a NaN/inf key must not reach the dQ of rows that cannot see it
            k1 = _finite(k1)
            k2 = _finite(k2)
        if TRAIN1:
            dq1 += _dot(ds1.to(k1.dtype), k1, IEEE1)
        if TRAIN2:
            dq2 += _dot(ds2.to(k2.dtype), k2, IEEE2)
        k1_ptrs += BLOCK_N * stride_k1n
        k2_ptrs += BLOCK_N * stride_k2n
    return dq1, dq2


@triton.jit
def _kl_bwd_dq_kernel(
    Q1, K1, Q2, K2, LSE1, LSE2, KL, G, DQ1, DQ2,
    stride_q1b, stride_q1h, stride_q1n, stride_q1d,
    stride_k1b, stride_k1h, stride_k1n, stride_k1d,
    stride_q2b, stride_q2h, stride_q2n, stride_q2d,
    stride_k2b, stride_k2h, stride_k2n, stride_k2d,
    stride_dq1b, stride_dq1h, stride_dq1n,
    stride_dq2b, stride_dq2h, stride_dq2n,
    H, N_Q, N_K, D1: tl.constexpr, D2: tl.constexpr, GROUP1, GROUP2,
    qk_scale1, qk_scale2, scale1, scale2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D1_PAD: tl.constexpr, D2_PAD: tl.constexpr,
    CAUSAL: tl.constexpr, TRAIN1: tl.constexpr, TRAIN2: tl.constexpr,
    IEEE1: tl.constexpr, IEEE2: tl.constexpr,
    CU_SEQLENS_Q=None, CU_SEQLENS_K=None,  # int32 [batch + 1] (used when VARLEN)
    VARLEN: tl.constexpr = False,
    # TMA descriptors (USE_TMA; never with VARLEN), as in _kl_bwd_dk_kernel
    Q1_DESC=None, K1_DESC=None, Q2_DESC=None, K2_DESC=None,
    USE_TMA: tl.constexpr = False,  # every operand tile through TMA descriptors
    FOLD: tl.constexpr = False,  # fewer fp32 ops per score; the row factors applied once to dQ
    HEAVY_FIRST: tl.constexpr = False,  # causal: the last query tiles (the most keys) launched first
    POLY: tl.constexpr = 0,  # setting 1: half of P2's exponentials on the FMA pipe (_exp2_split)
):
    # VARLEN: as in _kl_fwd_kernel
    pid_m = tl.program_id(0)
    if HEAVY_FIRST:  # blocks start in launch order: the long ones first, the short ones fill the tail
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    start_m = pid_m * BLOCK_M
    q_lo, N_Q, k_lo, N_K = _sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, N_Q, N_K, VARLEN)
    if VARLEN:
        if start_m >= N_Q:  # a query block past this sequence's end
            return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d1 = tl.arange(0, D1_PAD)
    offs_d2 = tl.arange(0, D2_PAD)
    row_ok = offs_m < N_Q
    rows64 = offs_m.to(tl.int64)
    h64 = h.to(tl.int64)
    kh1 = h // GROUP1
    kh2 = h // GROUP2
    off_q1, off_k1 = _batch_offsets(b, q_lo, k_lo, stride_q1b, stride_q1n, stride_k1b, stride_k1n, VARLEN)
    off_q2, off_k2 = _batch_offsets(b, q_lo, k_lo, stride_q2b, stride_q2n, stride_k2b, stride_k2n, VARLEN)
    off_dq1, off_dq2 = _batch_offsets(b, q_lo, q_lo, stride_dq1b, stride_dq1n, stride_dq2b, stride_dq2n, VARLEN)

    if USE_TMA:  # rows past N_Q and dims past D arrive as zeros
        q1 = Q1_DESC.load([b, h, start_m, 0]).reshape(BLOCK_M, D1_PAD)
        q2 = Q2_DESC.load([b, h, start_m, 0]).reshape(BLOCK_M, D2_PAD)
    else:
        q1 = tl.load(Q1 + off_q1 + h64 * stride_q1h + rows64[:, None] * stride_q1n + offs_d1[None, :] * stride_q1d,
                     mask=row_ok[:, None] & (offs_d1[None, :] < D1), other=0.0)
        q2 = tl.load(Q2 + off_q2 + h64 * stride_q2h + rows64[:, None] * stride_q2n + offs_d2[None, :] * stride_q2d,
                     mask=row_ok[:, None] & (offs_d2[None, :] < D2), other=0.0)
    row_base, row_step = _row_layout(pid_bh, h, H, q_lo, N_Q, VARLEN)
    lse1_bits, lse2_bits, kl_bits, g = _row_consts(LSE1, LSE2, KL, G, row_base + offs_m * row_step, row_ok)
    k1_ptrs = (K1 + off_k1 + kh1.to(tl.int64) * stride_k1h
               + offs_n[:, None] * stride_k1n + offs_d1[None, :] * stride_k1d)
    k2_ptrs = (K2 + off_k2 + kh2.to(tl.int64) * stride_k2h
               + offs_n[:, None] * stride_k2n + offs_d2[None, :] * stride_k2d)
    dq1 = tl.zeros([BLOCK_M, D1_PAD], tl.float32)
    dq2 = tl.zeros([BLOCK_M, D2_PAD], tl.float32)

    # same two stages as the forward: whole tiles unmasked, then the causal band / ragged tail
    diag_offset = N_K - N_Q
    key_lo = pid_m * 0  # a runtime zero, so the range start can be widened to int64
    full_hi, key_hi = _key_stages(start_m, key_lo, N_K, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    dq1, dq2 = _dq_key_range(
        dq1, dq2, q1, q2, lse1_bits, lse2_bits, kl_bits, g, offs_m, k1_ptrs, k2_ptrs,
        stride_k1n, stride_k2n, key_lo, full_hi, N_K, D1, D2, diag_offset,
        qk_scale1, qk_scale2, scale1, scale2,
        BLOCK_N, D1_PAD, D2_PAD, False, CAUSAL, TRAIN1, TRAIN2, IEEE1, IEEE2,
        K1_DESC, K2_DESC, b, kh1, kh2, USE_TMA, FOLD, POLY)
    dq1, dq2 = _dq_key_range(
        dq1, dq2, q1, q2, lse1_bits, lse2_bits, kl_bits, g, offs_m, k1_ptrs, k2_ptrs,
        stride_k1n, stride_k2n, full_hi, key_hi, N_K, D1, D2, diag_offset,
        qk_scale1, qk_scale2, scale1, scale2,
        BLOCK_N, D1_PAD, D2_PAD, True, CAUSAL, TRAIN1, TRAIN2, IEEE1, IEEE2,
        K1_DESC, K2_DESC, b, kh1, kh2, USE_TMA, FOLD, POLY)
    if FOLD:  # the per-row factors left out of dS (g = 0 on empty and padding rows: their sums are 0)
        dq1 = dq1 * (g * (scale1 * LN2))[:, None]
        dq2 = dq2 * (g * scale2)[:, None]

    if TRAIN1:
        tl.store(DQ1 + off_dq1 + h64 * stride_dq1h + rows64[:, None] * stride_dq1n + offs_d1[None, :],
                 dq1.to(DQ1.dtype.element_ty), mask=row_ok[:, None] & (offs_d1[None, :] < D1))
    if TRAIN2:
        tl.store(DQ2 + off_dq2 + h64 * stride_dq2h + rows64[:, None] * stride_dq2n + offs_d2[None, :],
                 dq2.to(DQ2.dtype.element_ty), mask=row_ok[:, None] & (offs_d2[None, :] < D2))


@triton.jit
def _kl_bwd_rows_kernel(LSE1, LSE2, KL, G, ROWS, n_rows, N_Q, row_pitch, plane,
                        qk_scale1, qk_scale2, scale1, scale2, BLOCK: tl.constexpr, PACKED: tl.constexpr = False,
                        GEXP: tl.constexpr = False):
    """Pre-pass of the ROWS variant: the dK kernel's per-row constants, once per row instead of once
    per (row, key tile): planes lse1', lse2', c2, a1, a2, rc (``_row_consts``, ``_fold_factors``) of
    ``ROWS[6, B*H, row_pitch]``. Rows past N_Q are never written: the dK kernel's TMA loads stop
    at N_Q and return zeros there (g = 0: those rows add exactly 0, their Q rows being zeros too).
    PACKED: the same values side by side, ``ROWS[B*H, N_Q, 8]`` in the order ``PACKED_PLANES``
    (column 3 is 0), so that the dK kernel reads a query tile's constants in one TMA load.
    GEXP (with PACKED): ``ROWS[B*H, N_Q, 4]`` in the order ``PACKED_GEXP_PLANES`` (``_gexp_factors``)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_rows
    lse1_bits, lse2_bits, kl_bits, g = _row_consts(LSE1, LSE2, KL, G, offs, ok)
    if GEXP:
        e1, e2, rc, sgn = _gexp_factors(lse1_bits, lse2_bits, kl_bits, g)
        out = ROWS + offs.to(tl.int64) * 4
        tl.store(out, e1, mask=ok)
        tl.store(out + 1, e2, mask=ok)
        tl.store(out + 2, rc, mask=ok)
        tl.store(out + 3, sgn, mask=ok)
        return
    c2, a1, a2, rc = _fold_factors(lse1_bits, lse2_bits, kl_bits, g, qk_scale1, qk_scale2, scale1, scale2)
    if PACKED:
        out = ROWS + offs.to(tl.int64) * 8
        tl.store(out, c2, mask=ok)
        tl.store(out + 1, lse2_bits, mask=ok)
        tl.store(out + 2, lse1_bits, mask=ok)
        tl.store(out + 3, tl.zeros_like(lse1_bits), mask=ok)
        tl.store(out + 4, lse1_bits, mask=ok)
        tl.store(out + 5, a1, mask=ok)
        tl.store(out + 6, a2, mask=ok)
        tl.store(out + 7, rc, mask=ok)
        return
    bh = offs // N_Q
    out = ROWS + bh.to(tl.int64) * row_pitch + offs % N_Q
    tl.store(out, lse1_bits, mask=ok)
    tl.store(out + plane, lse2_bits, mask=ok)
    tl.store(out + 2 * plane, c2, mask=ok)
    tl.store(out + 3 * plane, a1, mask=ok)
    tl.store(out + 4 * plane, a2, mask=ok)
    tl.store(out + 5 * plane, rc, mask=ok)
