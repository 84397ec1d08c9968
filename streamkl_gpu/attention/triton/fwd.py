"""Forward Triton kernels: the one-pass streaming KL and its split-K variant.

Conventions (docs/math.md): per (batch b, query head h) the kernel streams the key
tiles of side 1 (``k1``, key head ``h // group1``) and side 2 (``k2``, key head ``h // group2``)
past one block of query rows and keeps five running scalars per row:

    m1, l1   running max and rescaled sum of exp(S1)       (the teacher's softmax normaliser)
    m2, l2   the same for S2                               (the student's)
    acc      sum of exp(S1 - m1) * ((S1 - m1) - (S2 - m2)), rescaled with l1 (docs/math.md's acc
             re-referenced to the two maxima: acc_MATH - l1 * (m1 - m2); see _finalize)

Base 2: the scores are multiplied by ``sigma_t * log2(e)`` in fp32 right after each ``tl.dot``
(``qk_scale1``/``qk_scale2``), so every exponential is an ``exp2`` and every state value is in
bits; ``_finalize`` converts back with ``ln 2``. We scale the fp32 scores instead of pre-scaling
a bf16/fp16 Q because folding the scale into a low-precision Q adds one more rounding of every
query element (relative 2^-9 for bf16) that the reference does not make; and we scale before
the max, not inside the exponent's FFMA, so that the max's own exponent is exactly 0. The exact
identity and each kernel's placement of the factor: proofs/04_base2.md.

Masks: out-of-range keys and keys past the bottom-right causal frontier get exponent -inf on
both sides in the *masked* stage only. The log-ratio is taken before masking, so ``-inf - -inf``
is never formed, and the masked entries' terms ``p1 * log_ratio`` are *selected* to 0, never
multiplied: a key a row cannot see may hold NaN or inf, and ``0 * NaN = NaN`` would reach the
row (docs/math.md, "Invisible keys never reach a row"). Whole tiles need no guard: every row of the
block sees every key there. A row whose running max is still -inf uses 0 as its shift
(``_safe``), so ``exp2(-inf - -inf)`` is never evaluated either: an all-masked tile leaves the
state unchanged.

Offsets: batch/head base offsets are int64 and the key pointers are advanced tile by tile in
64-bit pointer arithmetic, so 512K tokens x 32 heads x 128 dims (> 2^31 elements) is fine.
"""
import triton
import triton.language as tl

from streamkl_gpu._core.jit import LN2, LOG2E, _dot, _key_stages, _safe, _to_bits  # noqa: F401 (shared helpers)


@triton.jit
def _sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, N_Q, N_K, VARLEN: tl.constexpr):
    """``(first query row, query rows, first key, keys)`` of batch entry ``b``.

    Padded batches: ``(0, N_Q, 0, N_K)``. VARLEN (packed sequences, docs/math.md "Packed sequences"):
    ``b`` is a sequence, ``N_Q``/``N_K`` are the packed totals, and the bounds come from
    ``cu_seqlens``, clamped into ``[0, total]`` with end >= start, so a cu_seqlens the host did
    not check (``check_seqlens=False``) never makes a kernel read or write out of bounds.
    """
    q_lo = 0
    k_lo = 0
    n_q = N_Q
    n_k = N_K
    if VARLEN:
        q_lo = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_Q + b), 0), N_Q)
        n_q = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_Q + b + 1), q_lo), N_Q) - q_lo
        k_lo = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_K + b), 0), N_K)
        n_k = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_K + b + 1), k_lo), N_K) - k_lo
    return q_lo, n_q, k_lo, n_k


@triton.jit
def _batch_offsets(b, q_lo, k_lo, stride_qb, stride_qn, stride_kb, stride_kn, VARLEN: tl.constexpr):
    """int64 element offsets of batch entry ``b``'s queries and keys (VARLEN: of the sequence's
    first row and key in the packed tensors)."""
    if VARLEN:
        off_q = q_lo.to(tl.int64) * stride_qn
        off_k = k_lo.to(tl.int64) * stride_kn
    else:
        off_q = b.to(tl.int64) * stride_qb
        off_k = b.to(tl.int64) * stride_kb
    return off_q, off_k


@triton.jit
def _row_layout(pid_bh, h, H, q_lo, N_Q, VARLEN: tl.constexpr):
    """``(base, step)``: query row ``i`` of this (batch, head) lives at ``base + i * step`` in the
    per-row buffers (KL, LSE*, G, PART planes): ``[B * H, N_Q]``, or VARLEN ``[total_q, H]``."""
    if VARLEN:
        base = q_lo.to(tl.int64) * H + h
        step = H
    else:
        base = pid_bh.to(tl.int64) * N_Q
        step = 1
    return base, step


@triton.jit
def _finalize(m1, l1, m2, l2, acc):
    """(m1, l1, m2, l2, acc) in bits -> (kl in nats, lse1, lse2 in bits). Empty rows -> (0, -inf, -inf).

    The kernels keep acc *shifted*: acc = sum_j p1_j * ((s1_j - m1) - (s2_j - m2)), which is
    docs/math.md's acc minus l1 * (m1 - m2). Then KL = acc/l1 + LSE2 - LSE1 becomes
    KL_bits = acc/l1 + log2(l2/l1): the maxima cancel exactly and large logits cost no accuracy.
    The LSEs stay in bits (log2 of the sums of 2^s): the backward recomputes P = exp2(s - lse)
    from them, and a round trip through nats would add two roundings of a possibly large number.
    """
    empty = l1 == 0.0
    l1_safe = tl.where(empty, 1.0, l1)
    l2_safe = tl.where(empty, 1.0, l2)
    kl_bits = acc / l1_safe + tl.log2(l2_safe / l1_safe)
    kl = tl.where(empty, 0.0, kl_bits * LN2)
    lse1 = tl.where(empty, float("-inf"), m1 + tl.log2(l1_safe))
    lse2 = tl.where(empty, float("-inf"), m2 + tl.log2(l2_safe))
    return kl, lse1, lse2


@triton.jit
def _fwd_key_range(
    m1, l1, m2, l2, acc,
    q1, q2, k1_ptrs, k2_ptrs, stride_k1n, stride_k2n, k1_desc, k2_desc, tma_b, tma_key0, kv_head1, kv_head2,
    offs_m, offs_n, offs_d1, offs_d2, D1: tl.constexpr, D2: tl.constexpr, N_K, diag_offset,
    lo, hi, qk_scale1, qk_scale2,
    BLOCK_N: tl.constexpr, D1_PAD: tl.constexpr, D2_PAD: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, IEEE1: tl.constexpr, IEEE2: tl.constexpr,
    USE_TMA: tl.constexpr, NO_CONTRACT: tl.constexpr,
):
    """Fold key tiles [lo, hi) into the row states. MASKED=False: every key of every tile is
    visible to every row (no mask work at all); MASKED=True: bounds and causal masks applied.
    Keys come through ``k*_ptrs`` or, with USE_TMA, the tensor descriptors ``k*_desc`` (key
    ``start_n`` of batch entry ``tma_b`` is descriptor row ``tma_key0 + start_n``)."""
    k1_ptrs += lo.to(tl.int64) * stride_k1n
    k2_ptrs += lo.to(tl.int64) * stride_k2n
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if USE_TMA:
            # Hopper bulk tensor copies (TMA): keys past N_K and dims past D arrive as zeros, so
            # no mask and no per-thread address registers (measured: fewer registers per thread)
            k1 = k1_desc.load([tma_b, kv_head1, tma_key0 + start_n, 0]).reshape(BLOCK_N, D1_PAD)
            k2 = k2_desc.load([tma_b, kv_head2, tma_key0 + start_n, 0]).reshape(BLOCK_N, D2_PAD)
        elif MASKED:
            k1 = tl.load(k1_ptrs, mask=(cols[:, None] < N_K) & (offs_d1[None, :] < D1), other=0.0)
            k2 = tl.load(k2_ptrs, mask=(cols[:, None] < N_K) & (offs_d2[None, :] < D2), other=0.0)
        else:  # whole tiles: bounds masks only on padded head dims (D is constexpr: folded away)
            k1 = tl.load(k1_ptrs, mask=offs_d1[None, :] < D1, other=0.0)
            k2 = tl.load(k2_ptrs, mask=offs_d2[None, :] < D2, other=0.0)
        # Scores in bits, s_t = sigma_t * log2(e) * q_t.k_t: the scale multiplies each fp32 dot
        # product once, before the max, so the row maximum is one of these values and its own
        # exponent s - max is exactly 0 (one visible key => P = 1, KL = 0 exactly). A fold into
        # the exponent, FFMA(s_raw, scale, -fl(max_raw * scale)), saves one op per score but
        # leaves the max with the product's rounding residual (measured on the GPU: KL ~ 1e-7
        # for a one-key row). This is also what streamkl_ref's emulation computes.
        s1 = _to_bits(_dot(q1, tl.trans(k1), IEEE1), qk_scale1, NO_CONTRACT)
        s2 = _to_bits(_dot(q2, tl.trans(k2), IEEE2), qk_scale2, NO_CONTRACT)
        if MASKED:
            visible = cols[None, :] < N_K
            if CAUSAL:
                # bottom-right causal: key j visible to query i iff j <= i + (N_K - N_Q)
                visible = visible & (cols[None, :] <= offs_m[:, None] + diag_offset)
            m1_new = tl.maximum(m1, tl.max(tl.where(visible, s1, float("-inf")), 1))
            m2_new = tl.maximum(m2, tl.max(tl.where(visible, s2, float("-inf")), 1))
            shift1 = _safe(m1_new)
            shift2 = _safe(m2_new)
        else:
            m1_new = tl.maximum(m1, tl.max(s1, 1))
            m2_new = tl.maximum(m2, tl.max(s2, 1))
            shift1 = m1_new
            shift2 = m2_new
        x1 = s1 - shift1[:, None]  # log2 of the unnormalised P1 entries, <= 0 where visible
        x2 = s2 - shift2[:, None]
        # the shifted log-ratio (s1 - m1) - (s2 - m2): small where P1 matters, so the large maxima
        # never enter the per-entry sum (see _finalize); from unmasked scores, so never -inf - -inf
        log_ratio = x1 - x2
        if MASKED:
            x1 = tl.where(visible, x1, float("-inf"))  # exp2(-inf) = 0: masked entries add nothing
            x2 = tl.where(visible, x2, float("-inf"))
        p1 = tl.exp2(x1)
        p2 = tl.exp2(x2)
        terms = p1 * log_ratio
        if MASKED:
            # select, never multiply: a key this row cannot see may hold NaN/inf (0 * NaN = NaN)
            terms = tl.where(visible, terms, 0.0)
        alpha1 = tl.exp2(m1 - shift1)  # exp2(-inf) = 0 on the first visible tile: l1 = acc = 0 there
        alpha2 = tl.exp2(m2 - shift2)
        # re-reference the old acc to the new maxima: each old term moves by -(dm1 - dm2)
        moved = (shift1 - _safe(m1)) - (shift2 - _safe(m2))
        acc = (acc - l1 * moved) * alpha1 + tl.sum(terms, 1)
        l1 = l1 * alpha1 + tl.sum(p1, 1)
        l2 = l2 * alpha2 + tl.sum(p2, 1)
        m1 = m1_new
        m2 = m2_new
        k1_ptrs += BLOCK_N * stride_k1n
        k2_ptrs += BLOCK_N * stride_k2n
    return m1, l1, m2, l2, acc


@triton.jit
def _kl_fwd_kernel(
    Q1, K1, Q2, K2,
    K1_DESC, K2_DESC,  # TMA descriptors of k1/k2 as [B, H_K, N_K, D] (used when USE_TMA; VARLEN: [1, H_K, total_k, D])
    KL, LSE1, LSE2,  # outputs [B*H, N_Q] fp32: KL in nats, LSEs in bits (used when SPLIT == False)
    PART,  # partial states [5, SPLITS, B*H, N_Q] fp32 (used when SPLIT == True)
    stride_q1b, stride_q1h, stride_q1n, stride_q1d,
    stride_k1b, stride_k1h, stride_k1n, stride_k1d,
    stride_q2b, stride_q2h, stride_q2n, stride_q2d,
    stride_k2b, stride_k2h, stride_k2n, stride_k2d,
    H, N_Q, N_K, D1: tl.constexpr, D2: tl.constexpr, GROUP1, GROUP2, keys_per_split, num_splits,
    qk_scale1, qk_scale2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D1_PAD: tl.constexpr, D2_PAD: tl.constexpr,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, IEEE1: tl.constexpr, IEEE2: tl.constexpr,
    USE_TMA: tl.constexpr, NO_CONTRACT: tl.constexpr,
    CU_SEQLENS_Q=None, CU_SEQLENS_K=None,  # int32 [batch + 1] (used when VARLEN)
    VARLEN: tl.constexpr = False,
    HEAVY_FIRST: tl.constexpr = False,  # causal: the last query tiles (the most keys) launched first
):
    # VARLEN (packed sequences): q/k are [1, H, total, D] views of the packed [total, H, D]
    # tensors, "batch" b is the sequence, N_Q/N_K are the totals, and KL/LSE*/PART rows are laid
    # out [total_q, H]; the grid covers the longest sequence and other programs exit at once.
    pid_m = tl.program_id(0)
    if HEAVY_FIRST:  # blocks start in launch order: the long ones first, the short ones fill the tail
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    pid_split = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    start_m = pid_m * BLOCK_M
    rows_total = tl.num_programs(1) * N_Q  # rows of KL/LSE*, one state plane of PART
    # TMA descriptor coordinates: [b, head, key, 0]; packed: the [1, H_K, total_k, D] view, so
    # batch 0 and the sequence's first key (a tile may run into the next sequence: its keys are
    # masked like keys past N_K; past total_k the descriptor returns zeros)
    tma_b = b
    tma_key0 = 0
    if VARLEN:
        rows_total = N_Q * H
    q_lo, N_Q, k_lo, N_K = _sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, N_Q, N_K, VARLEN)
    if VARLEN:
        if start_m >= N_Q:  # a query block past this sequence's end: no work, nothing to write
            return
        tma_b = 0
        tma_key0 = k_lo
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d1 = tl.arange(0, D1_PAD)
    offs_d2 = tl.arange(0, D2_PAD)
    row_ok = offs_m < N_Q

    # 64-bit base offsets: b * stride_b can exceed 2^31 at long contexts
    off_q1, off_k1 = _batch_offsets(b, q_lo, k_lo, stride_q1b, stride_q1n, stride_k1b, stride_k1n, VARLEN)
    off_q2, off_k2 = _batch_offsets(b, q_lo, k_lo, stride_q2b, stride_q2n, stride_k2b, stride_k2n, VARLEN)
    q1_base = Q1 + off_q1 + h.to(tl.int64) * stride_q1h
    q2_base = Q2 + off_q2 + h.to(tl.int64) * stride_q2h
    kv_head1 = h // GROUP1
    kv_head2 = h // GROUP2
    k1_base = K1 + off_k1 + kv_head1.to(tl.int64) * stride_k1h
    k2_base = K2 + off_k2 + kv_head2.to(tl.int64) * stride_k2h
    rows64 = offs_m.to(tl.int64)
    q1 = tl.load(q1_base + rows64[:, None] * stride_q1n + offs_d1[None, :] * stride_q1d,
                 mask=row_ok[:, None] & (offs_d1[None, :] < D1), other=0.0)
    q2 = tl.load(q2_base + rows64[:, None] * stride_q2n + offs_d2[None, :] * stride_q2d,
                 mask=row_ok[:, None] & (offs_d2[None, :] < D2), other=0.0)
    k1_ptrs = k1_base + offs_n[:, None] * stride_k1n + offs_d1[None, :] * stride_k1d
    k2_ptrs = k2_base + offs_n[:, None] * stride_k2n + offs_d2[None, :] * stride_k2d

    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l1 = tl.zeros([BLOCK_M], tl.float32)
    l2 = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M], tl.float32)

    # Key range of this program (one split of the keys), then its two stages: whole tiles every
    # row sees (no masking) and the rest (the causal diagonal band and the ragged last tile).
    diag_offset = N_K - N_Q
    key_lo = pid_split * keys_per_split  # a multiple of BLOCK_N
    full_hi, key_hi = _key_stages(start_m, key_lo, tl.minimum(key_lo + keys_per_split, N_K),
                                  N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    m1, l1, m2, l2, acc = _fwd_key_range(
        m1, l1, m2, l2, acc, q1, q2, k1_ptrs, k2_ptrs, stride_k1n, stride_k2n,
        K1_DESC, K2_DESC, tma_b, tma_key0, kv_head1, kv_head2,
        offs_m, offs_n, offs_d1, offs_d2, D1, D2, N_K, diag_offset, key_lo, full_hi,
        qk_scale1, qk_scale2, BLOCK_N, D1_PAD, D2_PAD, False, CAUSAL, IEEE1, IEEE2, USE_TMA, NO_CONTRACT)
    m1, l1, m2, l2, acc = _fwd_key_range(
        m1, l1, m2, l2, acc, q1, q2, k1_ptrs, k2_ptrs, stride_k1n, stride_k2n,
        K1_DESC, K2_DESC, tma_b, tma_key0, kv_head1, kv_head2,
        offs_m, offs_n, offs_d1, offs_d2, D1, D2, N_K, diag_offset, full_hi, key_hi,
        qk_scale1, qk_scale2, BLOCK_N, D1_PAD, D2_PAD, True, CAUSAL, IEEE1, IEEE2, USE_TMA, NO_CONTRACT)

    row_base, row_step = _row_layout(pid_bh, h, H, q_lo, N_Q, VARLEN)
    row_out = row_base + offs_m * row_step
    if SPLIT:
        # partial state of this key range; merged by _kl_combine_kernel (the merge rule of docs/math.md)
        plane = num_splits.to(tl.int64) * rows_total
        part = PART + pid_split.to(tl.int64) * rows_total + row_out
        tl.store(part, m1, mask=row_ok)
        tl.store(part + plane, l1, mask=row_ok)
        tl.store(part + 2 * plane, m2, mask=row_ok)
        tl.store(part + 3 * plane, l2, mask=row_ok)
        tl.store(part + 4 * plane, acc, mask=row_ok)
    else:
        kl, lse1, lse2 = _finalize(m1, l1, m2, l2, acc)
        tl.store(KL + row_out, kl, mask=row_ok)
        tl.store(LSE1 + row_out, lse1, mask=row_ok)
        tl.store(LSE2 + row_out, lse2, mask=row_ok)


@triton.jit
def _merge_scale(m_a, m_b):
    """Rescale factors for merging two running maxima; -inf (empty) sides get factor 0, never NaN."""
    m = tl.maximum(m_a, m_b)
    shift = _safe(m)
    return m, tl.exp2(m_a - shift), tl.exp2(m_b - shift)


@triton.jit
def _kl_combine_kernel(PART, KL, LSE1, LSE2, rows_total, num_splits, BLOCK: tl.constexpr):
    """Merge the split-K partial states in split order (deterministic) and finalize."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < rows_total
    plane = num_splits * rows_total.to(tl.int64)  # distance between the five state planes
    m1 = tl.full([BLOCK], float("-inf"), tl.float32)
    m2 = tl.full([BLOCK], float("-inf"), tl.float32)
    l1 = tl.zeros([BLOCK], tl.float32)
    l2 = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    p = PART + offs
    for _ in range(0, num_splits):  # split order: the merge result is bitwise reproducible
        m1_s = tl.load(p, mask=ok, other=float("-inf"))
        l1_s = tl.load(p + plane, mask=ok, other=0.0)
        m2_s = tl.load(p + 2 * plane, mask=ok, other=float("-inf"))
        l2_s = tl.load(p + 3 * plane, mask=ok, other=0.0)
        acc_s = tl.load(p + 4 * plane, mask=ok, other=0.0)
        m1_new, a1, b1 = _merge_scale(m1, m1_s)
        m2_new, a2, b2 = _merge_scale(m2, m2_s)
        # the shifted acc of each part is re-referenced to the merged maxima before the sum
        moved_a = (_safe(m1_new) - _safe(m1)) - (_safe(m2_new) - _safe(m2))
        moved_b = (_safe(m1_new) - _safe(m1_s)) - (_safe(m2_new) - _safe(m2_s))
        acc = (acc - l1 * moved_a) * a1 + (acc_s - l1_s * moved_b) * b1
        l1 = l1 * a1 + l1_s * b1
        l2 = l2 * a2 + l2_s * b2
        m1 = m1_new
        m2 = m2_new
        p += rows_total
    kl, lse1, lse2 = _finalize(m1, l1, m2, l2, acc)
    tl.store(KL + offs, kl, mask=ok)
    tl.store(LSE1 + offs, lse1, mask=ok)
    tl.store(LSE2 + offs, lse2, mask=ok)
