"""Forward Triton kernels of the indexer loss (docs/math.md, "The indexer loss").

Layout: one program per (block of BLOCK_T query tokens, batch element). The GEMM's M dimension
is (head, token) pairs: a *chunk* is HB teacher heads that share one key head times the BLOCK_T
tokens, row ``r = i * BLOCK_T + t`` (head ``i`` of the chunk, token ``t``). For MQA (H_K = 1) and
HB = H one chunk covers every head: the key tile is read once for all H query heads of the
block. For GQA the chunks of a key tile loop over the key heads (and, for wide groups, over
sub-blocks of a group). The head sum of ``p`` is a reshape ``[HB, BLOCK_T, BLOCK_N]`` and a
sum over the first axis. The indexer is chunked the same way (IB heads of one key head).

Head dims are tiled along D in BLOCK_D-wide chunks (a K loop inside each score tile, masks at
D), so a 576-wide absorbed-MLA head is 9 chunks of 64, never padded to 1024.

Units: teacher scores are taken to bits right after the dot (``s = sigma * log2(e) * q.k``,
``_to_bits``: one rounding, before any max or LSE is subtracted); the teacher LSEs the kernels
read are in bits (the host converts a caller's natural-log ``lse`` once). The student's logits
``I`` stay in nats (they are the caller's numbers, no scale); its exponentials are
``exp2((I - m) * log2(e))``.

Per query token the forward keeps five scalars (streamkl_ref.indexer_kl_online's state):
``m`` (running max of I), ``l = sum exp(I - m)``, ``mass = sum p``, ``acc = sum p (I - m)``
re-referenced to the running max (``acc -= mass * (m_new - m_old)``), ``plogp = sum p log p``
(p is exact per entry once the teacher LSEs are known: no rescaling). Finalisation uses
``sum p = 1``: ``KL = plogp - acc + log l`` (the student's max never enters, so large logits
cost no accuracy).

Masks are selections (``tl.where``) applied before any product, so an invisible entry never
contributes ``0 * NaN``. Rows with no visible key: KL 0, LSE_I = -inf.
"""
import triton
import triton.language as tl

from streamkl_gpu._core.jit import LN2, LOG2E, _dot, _key_stages, _safe, _to_bits

__all__ = ["LN2", "LOG2E"]


def variant_meta(variant: str, interpreting: bool = False) -> dict:
    """Launch keywords of ``_indexer_fwd_kernel`` for a forward config's variant (``IndexerConfig.variant``),
    ``_``-separated options: first ``keys`` (keys-major score tiles, KEYS_MAJOR) or ``tiles`` /
    ``l1`` (the (head, token)-major tiles); then ``flat`` (FLATTEN: the key loop and its D-chunk
    loop as one pipelined loop), ``lpt`` (LPT: token blocks in reverse order, the longest causal
    rows first), ``rNNN`` (at most NNN registers per thread, ptxas' maxnreg; not under the
    interpreter). E.g. ``keys_flat_lpt``."""
    opts = variant.split("_")
    meta = dict(KEYS_MAJOR=opts[0] == "keys", FLATTEN="flat" in opts, LPT="lpt" in opts)
    regs = [int(o[1:]) for o in opts[1:] if o[:1] == "r" and o[1:].isdigit()]
    if regs and not interpreting:
        meta["maxnreg"] = regs[-1]
    return meta


@triton.jit
def _dot_rows(A, a_off, a_ok, B_, b_off, b_ok, stride_ad, stride_bd,
              A_DESC, B_DESC, batch, a_head, a_tok, b_head, b_tok,
              D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
              A_HEADS: tl.constexpr, IEEE: tl.constexpr, USE_TMA: tl.constexpr,
              A_L1: tl.constexpr = False, B_L1: tl.constexpr = False):
    """``S[r, c] = sum_d A[a_off[r] + d] * B[b_off[c] + d]`` in fp32, D tiled in BLOCK_D chunks.
    Rows/columns outside ``a_ok``/``b_ok`` and dims past D load as 0.

    USE_TMA (Hopper): the same tiles through tensor descriptors of the [B, H, N, D] tensors: A's
    rows ``r = i * (ROWS // A_HEADS) + t`` are the box [1, A_HEADS, ROWS // A_HEADS, BLOCK_D] at
    (batch, a_head, a_tok); B's the box [1, 1, COLS, BLOCK_D] at (batch, b_head, b_tok). Out of
    range rows and dims arrive as zeros; rows past the caller's heads carry other heads' values,
    which the caller masks by row (no pointer tensors: measured offline, the pointer form spills).

    A_L1 (pointer loads only): A through L1, B not. At DSA a token's q rows are 128 x 576 bf16 =
    147 KB, re-read for every key tile: from L1 instead of L2 if they stay resident there."""
    acc = tl.zeros([ROWS, COLS], tl.float32)
    offs_d = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        if USE_TMA:
            a = A_DESC.load([batch, a_head, a_tok, d0]).reshape(ROWS, BLOCK_D)
            b = B_DESC.load([batch, b_head, b_tok, d0]).reshape(COLS, BLOCK_D)
        else:
            d = d0 + offs_d
            d_ok = d < D
            if A_L1:  # A's rows through L1 (cp.async.ca: re-read every key tile), B's around it (.cg)
                a = tl.load(A + a_off[:, None] + d[None, :] * stride_ad, mask=a_ok[:, None] & d_ok[None, :],
                            other=0.0, cache_modifier=".ca")
                b = tl.load(B_ + b_off[:, None] + d[None, :] * stride_bd, mask=b_ok[:, None] & d_ok[None, :],
                            other=0.0, cache_modifier=".cg")
            elif B_L1:  # the other way round (the dk kernel: one key tile, re-read for every token block)
                a = tl.load(A + a_off[:, None] + d[None, :] * stride_ad, mask=a_ok[:, None] & d_ok[None, :],
                            other=0.0, cache_modifier=".cg")
                b = tl.load(B_ + b_off[:, None] + d[None, :] * stride_bd, mask=b_ok[:, None] & d_ok[None, :],
                            other=0.0, cache_modifier=".ca")
            else:
                a = tl.load(A + a_off[:, None] + d[None, :] * stride_ad, mask=a_ok[:, None] & d_ok[None, :], other=0.0)
                b = tl.load(B_ + b_off[:, None] + d[None, :] * stride_bd, mask=b_ok[:, None] & d_ok[None, :], other=0.0)
        acc += _dot(a, tl.trans(b), IEEE)
    return acc


@triton.jit
def _teacher_target(
    Q, K, Q_DESC, K_DESC, LSE_T, stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    b, t0, s0, H, GROUP, N_Q, N_K, diag_offset, qk_scale, inv_heads, n_chunks, chunks_per_group,
    D: tl.constexpr, BLOCK_D: tl.constexpr, HB: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, NO_CONTRACT: tl.constexpr,
    USE_TMA: tl.constexpr, A_L1: tl.constexpr = False, B_L1: tl.constexpr = False,
):
    """The head-averaged target ``p [BLOCK_T, BLOCK_N]`` of tokens t0.. and keys s0..: exactly 0
    where masked (and in padding rows), ``(1/H) sum_h exp2(s_h - lse_h)`` elsewhere."""
    ROWS: tl.constexpr = HB * BLOCK_T
    rows = tl.arange(0, ROWS)
    head_in_chunk = rows // BLOCK_T
    tok = t0 + rows % BLOCK_T
    keys = s0 + tl.arange(0, BLOCK_N)
    key_ok = keys < N_K
    b64 = b.to(tl.int64)
    k_off_base = b64 * stride_kb + keys.to(tl.int64) * stride_kn
    q_off_base = b64 * stride_qb + tok.to(tl.int64) * stride_qn
    p = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for c in range(0, n_chunks):
        kv = c // chunks_per_group
        h0 = kv * GROUP + (c % chunks_per_group) * HB
        h_in_group = (c % chunks_per_group) * HB + head_in_chunk
        h = kv * GROUP + h_in_group
        row_ok = (h_in_group < GROUP) & (tok < N_Q)
        s = _dot_rows(Q, q_off_base + h.to(tl.int64) * stride_qh, row_ok,
                      K, k_off_base + kv.to(tl.int64) * stride_kh, key_ok, stride_qd, stride_kd,
                      Q_DESC, K_DESC, b, h0, t0, kv, s0,
                      D, BLOCK_D, ROWS, BLOCK_N, HB, IEEE, USE_TMA, A_L1, B_L1)
        lse = tl.load(LSE_T + (b64 * H + h) * N_Q + tok, mask=row_ok, other=float("-inf"))
        # log2 P_h = s - lse (bits). "!= -inf" keeps a NaN LSE a NaN (a NaN row stays NaN)
        x = _to_bits(s, qk_scale, NO_CONTRACT) - lse[:, None]
        visible = (row_ok & (lse != float("-inf")))[:, None]
        if MASKED:
            visible = visible & key_ok[None, :]
            if CAUSAL:  # bottom-right causal: key s visible to token t iff s <= t + (N_K - N_Q)
                visible = visible & (keys[None, :] <= tok[:, None] + diag_offset)
        e = tl.exp2(tl.where(visible, x, float("-inf")))
        p += tl.sum(tl.reshape(e, [HB, BLOCK_T, BLOCK_N]), axis=0)
    return p * inv_heads


@triton.jit
def _indexer_logits(
    QI, KI, QI_DESC, KI_DESC, W, stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
    stride_wb, stride_wh, stride_wn,
    b, t0, s0, GROUP_I, N_Q, N_K, n_chunks, chunks_per_group,
    DI: tl.constexpr, BLOCK_DI: tl.constexpr, IB: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    RELU: tl.constexpr, IEEE: tl.constexpr, USE_TMA: tl.constexpr, A_L1: tl.constexpr = False,
):
    """The student's logits ``I [BLOCK_T, BLOCK_N] = sum_j w_j relu(q_idx_j . k_idx)`` (unmasked:
    the caller selects the visible entries)."""
    ROWS: tl.constexpr = IB * BLOCK_T
    rows = tl.arange(0, ROWS)
    head_in_chunk = rows // BLOCK_T
    tok = t0 + rows % BLOCK_T
    keys = s0 + tl.arange(0, BLOCK_N)
    key_ok = keys < N_K
    b64 = b.to(tl.int64)
    k_off_base = b64 * stride_kib + keys.to(tl.int64) * stride_kin
    q_off_base = b64 * stride_qib + tok.to(tl.int64) * stride_qin
    logits = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for c in range(0, n_chunks):
        kv = c // chunks_per_group
        j0 = kv * GROUP_I + (c % chunks_per_group) * IB
        j_in_group = (c % chunks_per_group) * IB + head_in_chunk
        j = kv * GROUP_I + j_in_group
        row_ok = (j_in_group < GROUP_I) & (tok < N_Q)
        a = _dot_rows(QI, q_off_base + j.to(tl.int64) * stride_qih, row_ok,
                      KI, k_off_base + kv.to(tl.int64) * stride_kih, key_ok, stride_qid, stride_kid,
                      QI_DESC, KI_DESC, b, j0, t0, kv, s0,
                      DI, BLOCK_DI, ROWS, BLOCK_N, IB, IEEE, USE_TMA, A_L1)
        w = tl.load(W + b64 * stride_wb + j.to(tl.int64) * stride_wh + tok.to(tl.int64) * stride_wn,
                    mask=row_ok, other=0.0).to(tl.float32)
        if RELU:
            a = tl.maximum(a, 0.0, propagate_nan=tl.PropagateNan.ALL)  # relu(NaN) stays NaN
        contrib = tl.where(row_ok[:, None], w[:, None] * a, 0.0)
        logits += tl.sum(tl.reshape(contrib, [IB, BLOCK_T, BLOCK_N]), axis=0)
    return logits


# ----------------------------------------------------------------------------------------------
# Keys-major score tiles (the "keys" variant, ``IndexerConfig.variant``): S^T [BLOCK_N keys, HB * BLOCK_T
# (head, token) columns] = k q^T. The sum over heads is then a sum along a row of the MMA
# accumulator: in-thread adds and two lane shuffles (each thread holds a few keys' rows), where
# the (head, token)-major tile sums down its columns: lane shuffles over 8 lanes and a cross-warp
# reduction through shared memory, once per tile. The online state's five sums then run along the
# keys (axis 0) on BLOCK_N x BLOCK_T values only. Same formulas as _teacher_target /
# _indexer_logits (those are the reference for these; tests/test_indexer_keys_major.py).
# ----------------------------------------------------------------------------------------------

@triton.jit
def _lse_columns(LSE_T, b, t0, H, GROUP, N_Q, c, chunks_per_group, HB: tl.constexpr, BLOCK_T: tl.constexpr):
    """The teacher LSEs (bits) of head chunk ``c``'s columns, ``[HB * BLOCK_T]``. A padding
    column, or one with no visible key (lse = -inf), gets +inf: its exp2 gives 0 with no
    per-entry select (its scores are finite: zero-filled, or another head of the same token). A
    NaN LSE stays NaN (NaN != -inf), so a NaN row stays NaN."""
    cols = tl.arange(0, HB * BLOCK_T)
    tok = t0 + cols % BLOCK_T
    h_in_group = (c % chunks_per_group) * HB + cols // BLOCK_T
    h = (c // chunks_per_group) * GROUP + h_in_group
    col_ok = (h_in_group < GROUP) & (tok < N_Q)
    lse = tl.load(LSE_T + (b.to(tl.int64) * H + h) * N_Q + tok, mask=col_ok, other=float("-inf"))
    return tl.where(col_ok & (lse != float("-inf")), lse, float("inf"))


@triton.jit
def _weight_columns(W, stride_wb, stride_wh, stride_wn, b, t0, GROUP_I, N_Q, c, chunks_per_group,
                    IB: tl.constexpr, BLOCK_T: tl.constexpr):
    """The weights of indexer head chunk ``c``'s columns, ``[IB * BLOCK_T]`` fp32 (0 in padding)."""
    cols = tl.arange(0, IB * BLOCK_T)
    tok = t0 + cols % BLOCK_T
    j_in_group = (c % chunks_per_group) * IB + cols // BLOCK_T
    j = (c // chunks_per_group) * GROUP_I + j_in_group
    col_ok = (j_in_group < GROUP_I) & (tok < N_Q)
    return tl.load(W + b.to(tl.int64) * stride_wb + j.to(tl.int64) * stride_wh + tok.to(tl.int64) * stride_wn,
                   mask=col_ok, other=0.0).to(tl.float32)


@triton.jit
def _teacher_target_keys(
    Q, K, Q_DESC, K_DESC, LSE_T, stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    b, t0, s0, H, GROUP, N_Q, N_K, diag_offset, qk_scale, inv_heads, n_chunks, chunks_per_group,
    D: tl.constexpr, BLOCK_D: tl.constexpr, HB: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, NO_CONTRACT: tl.constexpr,
    USE_TMA: tl.constexpr, lse_first,
):
    """``p^T [BLOCK_N, BLOCK_T]``: _teacher_target's target, keys-major (column ``c = i * BLOCK_T
    + t``: head ``i`` of the chunk, token ``t``). ``lse_first``: ``_lse_columns`` of chunk 0,
    loaded once per program (used when there is one chunk: MQA)."""
    COLS: tl.constexpr = HB * BLOCK_T
    cols = tl.arange(0, COLS)
    head_in_chunk = cols // BLOCK_T
    tok = t0 + cols % BLOCK_T
    keys = s0 + tl.arange(0, BLOCK_N)
    key_ok = keys < N_K
    b64 = b.to(tl.int64)
    k_off_base = b64 * stride_kb + keys.to(tl.int64) * stride_kn
    q_off_base = b64 * stride_qb + tok.to(tl.int64) * stride_qn
    p = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for c in range(0, n_chunks):
        kv = c // chunks_per_group
        h0 = kv * GROUP + (c % chunks_per_group) * HB
        h_in_group = (c % chunks_per_group) * HB + head_in_chunk
        h = kv * GROUP + h_in_group
        col_ok = (h_in_group < GROUP) & (tok < N_Q)
        s = _dot_rows(K, k_off_base + kv.to(tl.int64) * stride_kh, key_ok,
                      Q, q_off_base + h.to(tl.int64) * stride_qh, col_ok, stride_kd, stride_qd,
                      K_DESC, Q_DESC, b, kv, s0, h0, t0,
                      D, BLOCK_D, BLOCK_N, COLS, 1, IEEE, USE_TMA)
        if n_chunks == 1:  # loop-invariant: no reload (and no layout conversion) per key tile
            lse_col = lse_first
        else:
            lse_col = _lse_columns(LSE_T, b, t0, H, GROUP, N_Q, c, chunks_per_group, HB, BLOCK_T)
        x = _to_bits(s, qk_scale, NO_CONTRACT) - lse_col[None, :]
        if MASKED:
            visible = key_ok[:, None] & (tok >= 0)[None, :]
            if CAUSAL:  # bottom-right causal: key s visible to token t iff s <= t + (N_K - N_Q)
                visible = visible & (keys[:, None] <= tok[None, :] + diag_offset)
            x = tl.where(visible, x, float("-inf"))
        e = tl.exp2(x)
        if BLOCK_T == 1:  # one token: the head sum is the row sum
            p += tl.sum(e, 1)[:, None]
        else:
            p += tl.sum(tl.reshape(e, [BLOCK_N, HB, BLOCK_T]), axis=1)
    return p * inv_heads


@triton.jit
def _indexer_logits_keys(
    QI, KI, QI_DESC, KI_DESC, W, stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
    stride_wb, stride_wh, stride_wn,
    b, t0, s0, GROUP_I, N_Q, N_K, n_chunks, chunks_per_group,
    DI: tl.constexpr, BLOCK_DI: tl.constexpr, IB: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    RELU: tl.constexpr, IEEE: tl.constexpr, USE_TMA: tl.constexpr, w_first,
):
    """``I^T [BLOCK_N, BLOCK_T]``: _indexer_logits' logits, keys-major (unmasked). ``w_first``:
    ``_weight_columns`` of chunk 0, loaded once per program (used when there is one chunk)."""
    COLS: tl.constexpr = IB * BLOCK_T
    cols = tl.arange(0, COLS)
    head_in_chunk = cols // BLOCK_T
    tok = t0 + cols % BLOCK_T
    keys = s0 + tl.arange(0, BLOCK_N)
    key_ok = keys < N_K
    b64 = b.to(tl.int64)
    k_off_base = b64 * stride_kib + keys.to(tl.int64) * stride_kin
    q_off_base = b64 * stride_qib + tok.to(tl.int64) * stride_qin
    logits = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for c in range(0, n_chunks):
        kv = c // chunks_per_group
        j0 = kv * GROUP_I + (c % chunks_per_group) * IB
        j_in_group = (c % chunks_per_group) * IB + head_in_chunk
        j = kv * GROUP_I + j_in_group
        col_ok = (j_in_group < GROUP_I) & (tok < N_Q)
        a = _dot_rows(KI, k_off_base + kv.to(tl.int64) * stride_kih, key_ok,
                      QI, q_off_base + j.to(tl.int64) * stride_qih, col_ok, stride_kid, stride_qid,
                      KI_DESC, QI_DESC, b, kv, s0, j0, t0,
                      DI, BLOCK_DI, BLOCK_N, COLS, 1, IEEE, USE_TMA)
        if n_chunks == 1:
            w = w_first
        else:
            w = _weight_columns(W, stride_wb, stride_wh, stride_wn, b, t0, GROUP_I, N_Q, c, chunks_per_group,
                                IB, BLOCK_T)
        if RELU:
            a = tl.maximum(a, 0.0, propagate_nan=tl.PropagateNan.ALL)  # relu(NaN) stays NaN
        contrib = tl.where(col_ok[None, :], a * w[None, :], 0.0)
        if BLOCK_T == 1:
            logits += tl.sum(contrib, 1)[:, None]
        else:
            logits += tl.sum(tl.reshape(contrib, [BLOCK_N, IB, BLOCK_T]), axis=1)
    return logits


@triton.jit
def _token_visible_keys(toks, keys, N_Q, N_K, diag_offset, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """_token_visible, keys-major: [BLOCK_N, BLOCK_T]."""
    visible = (toks < N_Q)[None, :] & (keys >= 0)[:, None]
    if MASKED:
        visible = visible & (keys < N_K)[:, None]
        if CAUSAL:
            visible = visible & (keys[:, None] <= toks[None, :] + diag_offset)
    return visible


@triton.jit
def _token_visible(toks, keys, N_Q, N_K, diag_offset, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    visible = (toks < N_Q)[:, None] & (keys >= 0)[None, :]
    if MASKED:
        visible = visible & (keys < N_K)[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= toks[:, None] + diag_offset)
    return visible


@triton.jit
def _fwd_key_range(
    m, l, mass, acc, plogp,
    Q, K, QI, KI, Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
    stride_wb, stride_wh, stride_wn,
    b, t0, lo, hi, H, GROUP, GROUP_I, N_Q, N_K, qk_scale, inv_heads,
    n_chunks, chunks_per_group, n_ichunks, ichunks_per_group,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DI: tl.constexpr, BLOCK_DI: tl.constexpr,
    HB: tl.constexpr, IB: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, RELU: tl.constexpr,
    IEEE_T: tl.constexpr, IEEE_I: tl.constexpr, NO_CONTRACT: tl.constexpr, USE_TMA: tl.constexpr,
    A_L1: tl.constexpr, KEYS_MAJOR: tl.constexpr = False, FLATTEN: tl.constexpr = False,
):
    diag_offset = N_K - N_Q
    toks = t0 + tl.arange(0, BLOCK_T)
    if KEYS_MAJOR:  # the per-column LSEs and weights of the first head chunk, once per program
        lse_first = _lse_columns(LSE_T, b, t0, H, GROUP, N_Q, 0, chunks_per_group, HB, BLOCK_T)
        w_first = _weight_columns(W, stride_wb, stride_wh, stride_wn, b, t0, GROUP_I, N_Q, 0, ichunks_per_group,
                                  IB, BLOCK_T)
    # FLATTEN: the key-tile loop and its D-chunk loop as one pipelined loop (triton's loop
    # flattening), so the next key tile's first chunks load while this tile's exponentials and
    # indexer run (one loop nest when the head chunks are one, n_chunks == 1: MQA)
    for s0 in tl.range(lo, hi, BLOCK_N, flatten=FLATTEN):
        keys = s0 + tl.arange(0, BLOCK_N)
        if KEYS_MAJOR:  # [BLOCK_N, BLOCK_T] tiles, the state's sums along axis 0
            p = _teacher_target_keys(Q, K, Q_DESC, K_DESC, LSE_T, stride_qb, stride_qh, stride_qn, stride_qd,
                                     stride_kb, stride_kh, stride_kn, stride_kd,
                                     b, t0, s0, H, GROUP, N_Q, N_K, diag_offset, qk_scale, inv_heads,
                                     n_chunks, chunks_per_group, D, BLOCK_D, HB, BLOCK_T, BLOCK_N,
                                     MASKED, CAUSAL, IEEE_T, NO_CONTRACT, USE_TMA, lse_first)
            logits = _indexer_logits_keys(QI, KI, QI_DESC, KI_DESC, W, stride_qib, stride_qih, stride_qin, stride_qid,
                                          stride_kib, stride_kih, stride_kin, stride_kid, stride_wb, stride_wh,
                                          stride_wn, b, t0, s0, GROUP_I, N_Q, N_K, n_ichunks, ichunks_per_group,
                                          DI, BLOCK_DI, IB, BLOCK_T, BLOCK_N, RELU, IEEE_I, USE_TMA, w_first)
            visible = _token_visible_keys(toks, keys, N_Q, N_K, diag_offset, MASKED, CAUSAL)
            m, l, mass, acc, plogp = _online_update(m, l, mass, acc, plogp, p, logits, visible, 0, True)
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
    return m, l, mass, acc, plogp


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _online_update(m, l, mass, acc, plogp, p, logits, visible, AXIS: tl.constexpr = 1,
                   FUSED_SUMS: tl.constexpr = False):
    """The five-scalar state of each token after one [BLOCK_T, BLOCK_N] tile of target ``p`` and
    student logits (streamkl_ref.indexer_kl_online's recurrence). AXIS = 0: the tiles are
    keys-major, [BLOCK_N, BLOCK_T] (``_teacher_target_keys``). FUSED_SUMS: the four sums as one
    four-operand reduction (keys-major: one shared-memory round trip and barrier, not four)."""
    m_new = tl.maximum(m, tl.max(tl.where(visible, logits, float("-inf")), AXIS))
    shift = _safe(m_new)
    centred = logits - tl.expand_dims(shift, AXIS)  # I - m'
    e = tl.exp2(tl.where(visible, centred, float("-inf")) * LOG2E)
    alpha = tl.exp2((m - shift) * LOG2E)  # 0 while the row was empty, 1 if the max did not move
    # p log p with 0 log 0 = 0; a NaN p stays NaN (NaN > 0 is False, then NaN * 0 = NaN)
    if FUSED_SUMS:
        log_p = tl.log(tl.where(visible & (p > 0), p, 1.0))
        sum_e, sum_plogp, sum_centred, sum_p = tl.reduce(
            (e, tl.where(visible, p * log_p, 0.0), tl.where(visible, p * centred, 0.0), tl.where(visible, p, 0.0)),
            AXIS, _add4)
        l = l * alpha + sum_e
        plogp += sum_plogp
        acc = acc - mass * (shift - _safe(m)) + sum_centred  # as below
        mass += sum_p
    else:
        l = l * alpha + tl.sum(e, AXIS)
        log_p = tl.log(tl.where(visible & (p > 0), p, 1.0))
        plogp += tl.sum(tl.where(visible, p * log_p, 0.0), AXIS)
        # every old term p (I - m) moves by -(m' - m) when the max moves: -mass * moved in all
        acc = acc - mass * (shift - _safe(m)) + tl.sum(tl.where(visible, p * centred, 0.0), AXIS)
        mass += tl.sum(tl.where(visible, p, 0.0), AXIS)
    return m_new, l, mass, acc, plogp


@triton.jit
def _indexer_fwd_kernel(
    Q, K, QI, KI, W, LSE_T, KL, LSE_I, PART,
    Q_DESC, K_DESC, QI_DESC, KI_DESC,  # TMA descriptors of q, k, q_idx, k_idx (used when USE_TMA)
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
    stride_wb, stride_wh, stride_wn,
    H, GROUP, GROUP_I, N_Q, N_K, qk_scale, inv_heads,
    n_chunks, chunks_per_group, n_ichunks, ichunks_per_group, keys_per_split,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DI: tl.constexpr, BLOCK_DI: tl.constexpr,
    HB: tl.constexpr, IB: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, RELU: tl.constexpr, IEEE_T: tl.constexpr, IEEE_I: tl.constexpr,
    NO_CONTRACT: tl.constexpr, USE_TMA: tl.constexpr, SPLIT: tl.constexpr, A_L1: tl.constexpr = False,
    KEYS_MAJOR: tl.constexpr = False, FLATTEN: tl.constexpr = False, LPT: tl.constexpr = False,
):
    """KL [B, N_Q] (nats) and the student's LSE_I [B, N_Q] (nats) from the teacher LSEs (bits).
    KEYS_MAJOR, FLATTEN, LPT: the config variant's options (``variant_meta``).

    Grid (token blocks, key splits, B). SPLIT: program ``(., s, .)`` walks the keys
    ``[s * keys_per_split, (s + 1) * keys_per_split)`` only and stores its five-scalar state in
    ``PART [5, splits, B, N_Q]`` (m, l, mass, acc, plogp); the host merges the splits
    (``_indexer._merge_splits``, the merge rule of streamkl_ref.indexer_kl_online's state)."""
    pid_t = tl.program_id(0)
    if LPT:  # the last token blocks (causal: the most keys) start first, the short ones fill the tail
        pid_t = tl.num_programs(0) - 1 - pid_t
    split = tl.program_id(1)
    b = tl.program_id(2)
    t0 = pid_t * BLOCK_T
    toks = t0 + tl.arange(0, BLOCK_T)
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_T], tl.float32)
    mass = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T], tl.float32)
    plogp = tl.zeros([BLOCK_T], tl.float32)
    key_lo = split * keys_per_split  # a multiple of BLOCK_N (the host rounds keys_per_split)
    # whole tiles every token of the block sees (no masks), then the diagonal band / ragged tile
    full_hi, key_hi = _key_stages(t0, key_lo, tl.minimum(key_lo + keys_per_split, N_K), N_Q, N_K,
                                  BLOCK_T, BLOCK_N, CAUSAL)
    key_hi = tl.maximum(key_hi, key_lo)  # a split past the causal frontier walks nothing
    m, l, mass, acc, plogp = _fwd_key_range(
        m, l, mass, acc, plogp, Q, K, QI, KI, Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T,
        stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
        stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
        stride_wb, stride_wh, stride_wn, b, t0, key_lo, full_hi, H, GROUP, GROUP_I, N_Q, N_K, qk_scale, inv_heads,
        n_chunks, chunks_per_group, n_ichunks, ichunks_per_group, D, BLOCK_D, DI, BLOCK_DI,
        HB, IB, BLOCK_T, BLOCK_N, False, CAUSAL, RELU, IEEE_T, IEEE_I, NO_CONTRACT, USE_TMA, A_L1, KEYS_MAJOR, FLATTEN)
    m, l, mass, acc, plogp = _fwd_key_range(
        m, l, mass, acc, plogp, Q, K, QI, KI, Q_DESC, K_DESC, QI_DESC, KI_DESC, W, LSE_T,
        stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
        stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
        stride_wb, stride_wh, stride_wn, b, t0, full_hi, key_hi, H, GROUP, GROUP_I, N_Q, N_K, qk_scale,
        inv_heads, n_chunks, chunks_per_group, n_ichunks, ichunks_per_group, D, BLOCK_D, DI, BLOCK_DI,
        HB, IB, BLOCK_T, BLOCK_N, True, CAUSAL, RELU, IEEE_T, IEEE_I, NO_CONTRACT, USE_TMA, A_L1, KEYS_MAJOR, FLATTEN)
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


@triton.jit
def _finish(m, l, acc, plogp):
    """(KL, LSE_I) of a row from its final state. Empty: no visible key (l = 0; a visible key
    adds exp(0) = 1 at the max). Not m == -inf: the max ignores NaN, so a NaN row can keep
    m = -inf, but its l is NaN and its KL stays NaN."""
    empty = l == 0.0
    log_l = tl.log(tl.where(empty, 1.0, l))
    kl = tl.where(empty, 0.0, plogp - acc + log_l)  # uses sum p = 1: the max m never enters
    lse_i = tl.where(empty, float("-inf"), m + log_l)
    return kl, lse_i


@triton.jit
def _lse_fold(m, l, s, keys, tok, N_K, diag_offset, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """One key tile's scores ``s [ROWS, BLOCK_N]`` (bits) folded into the online max and sum."""
    if MASKED:
        visible = (keys < N_K)[None, :] & (tok >= 0)[:, None]
        if CAUSAL:
            visible = visible & (keys[None, :] <= tok[:, None] + diag_offset)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    shift = _safe(m_new)
    l = l * tl.exp2(m - shift) + tl.sum(tl.exp2(s - shift[:, None]), 1)
    return m_new, l


@triton.jit
def _lse_key_range(m, l, Q, K, Q_DESC, K_DESC, q_off, row_ok, k_off_base, tok, b, h0, t0, kv,
                   lo, hi, N_Q, N_K, stride_qd, stride_kn, stride_kd,
                   qk_scale, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                   HB: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                   NO_CONTRACT: tl.constexpr, USE_TMA: tl.constexpr, A_L1: tl.constexpr):
    diag_offset = N_K - N_Q
    for s0 in range(lo, hi, BLOCK_N):
        keys = s0 + tl.arange(0, BLOCK_N)
        key_ok = keys < N_K
        s = _dot_rows(Q, q_off, row_ok, K, k_off_base + keys.to(tl.int64) * stride_kn, key_ok,
                      stride_qd, stride_kd, Q_DESC, K_DESC, b, h0, t0, kv, s0,
                      D, BLOCK_D, ROWS, BLOCK_N, HB, IEEE, USE_TMA, A_L1)
        m, l = _lse_fold(m, l, _to_bits(s, qk_scale, NO_CONTRACT), keys, tok, N_K, diag_offset, MASKED, CAUSAL)
    return m, l


@triton.jit
def _lse_q_chunks(Q, Q_DESC, q_off, row_ok, stride_qd, b, h0, t0,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, HB: tl.constexpr,
                  USE_TMA: tl.constexpr):
    """The program's q rows, loaded once: a tuple of cdiv(D, BLOCK_D) chunks [ROWS, BLOCK_D] (dims
    past D and rows outside ``row_ok`` zero). The selection on ``row_ok`` makes each chunk a computed
    value, so the compiler keeps it in registers as the products' A operand (wgmma with A in
    registers) rather than staging it through shared memory from a load."""
    offs_d = tl.arange(0, BLOCK_D)
    NCH: tl.constexpr = (D + BLOCK_D - 1) // BLOCK_D
    chunks = ()
    for c in tl.static_range(0, NCH):
        if USE_TMA:
            qc = Q_DESC.load([b, h0, t0, c * BLOCK_D]).reshape(ROWS, BLOCK_D)
        else:
            d = c * BLOCK_D + offs_d
            qc = tl.load(Q + q_off[:, None] + d[None, :] * stride_qd, mask=row_ok[:, None] & (d < D)[None, :],
                         other=0.0)
        chunks = chunks + (tl.where(row_ok[:, None], qc, tl.zeros_like(qc)),)
    return chunks


@triton.jit
def _lse_key_range_resident(m, l, q_chunks, K, K_DESC, k_off_base, tok, b, kv,
                            lo, hi, N_Q, N_K, stride_kn, stride_kd, qk_scale,
                            D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                            MASKED: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                            NO_CONTRACT: tl.constexpr, USE_TMA: tl.constexpr):
    """``_lse_key_range`` with the q rows resident (``_lse_q_chunks``): per key tile only the key
    chunks are read, the D loop unrolled (one product per chunk, the same order of sums)."""
    diag_offset = N_K - N_Q
    offs_d = tl.arange(0, BLOCK_D)
    NCH: tl.constexpr = (D + BLOCK_D - 1) // BLOCK_D
    for s0 in range(lo, hi, BLOCK_N):
        keys = s0 + tl.arange(0, BLOCK_N)
        key_ok = keys < N_K
        k_off = k_off_base + keys.to(tl.int64) * stride_kn
        s = tl.zeros([q_chunks[0].shape[0], BLOCK_N], tl.float32)
        for c in tl.static_range(0, NCH):
            if USE_TMA:
                kc = K_DESC.load([b, kv, s0, c * BLOCK_D]).reshape(BLOCK_N, BLOCK_D)
            else:
                d = c * BLOCK_D + offs_d
                kc = tl.load(K + k_off[:, None] + d[None, :] * stride_kd, mask=key_ok[:, None] & (d < D)[None, :],
                             other=0.0)
            s += _dot(q_chunks[c], tl.trans(kc), IEEE)
        m, l = _lse_fold(m, l, _to_bits(s, qk_scale, NO_CONTRACT), keys, tok, N_K, diag_offset, MASKED, CAUSAL)
    return m, l


@triton.jit
def _teacher_lse_kernel(
    Q, K, Q_DESC, K_DESC, LSE_T, stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    H, GROUP, N_Q, N_K, qk_scale, chunks_per_group,
    D: tl.constexpr, BLOCK_D: tl.constexpr, HB: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, NO_CONTRACT: tl.constexpr, USE_TMA: tl.constexpr,
    A_L1: tl.constexpr = False, Q_RESIDENT: tl.constexpr = False, LPT: tl.constexpr = False,
):
    """The teacher's per-head LSEs in bits, ``[B, H, N_Q]`` (-inf for rows with no visible key):
    the first pass when the caller gives no ``lse``. One program per (token block, head chunk, b).
    Q_RESIDENT (variant ``qreg``): the program's q rows are loaded once, before the key loop, and
    kept in registers (``_lse_q_chunks``), so a key tile reads only its keys. LPT: token blocks in
    reverse order (the longest causal rows first)."""
    ROWS: tl.constexpr = HB * BLOCK_T
    pid_t = tl.program_id(0)
    if LPT:
        pid_t = tl.num_programs(0) - 1 - pid_t
    c = tl.program_id(1)
    b = tl.program_id(2)
    t0 = pid_t * BLOCK_T
    rows = tl.arange(0, ROWS)
    tok = t0 + rows % BLOCK_T
    kv = c // chunks_per_group
    h0 = kv * GROUP + (c % chunks_per_group) * HB
    h_in_group = (c % chunks_per_group) * HB + rows // BLOCK_T
    h = kv * GROUP + h_in_group
    row_ok = (h_in_group < GROUP) & (tok < N_Q)
    b64 = b.to(tl.int64)
    q_off = b64 * stride_qb + h.to(tl.int64) * stride_qh + tok.to(tl.int64) * stride_qn
    k_off_base = b64 * stride_kb + kv.to(tl.int64) * stride_kh
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    full_hi, key_hi = _key_stages(t0, 0, N_K, N_Q, N_K, BLOCK_T, BLOCK_N, CAUSAL)
    if Q_RESIDENT:
        q_chunks = _lse_q_chunks(Q, Q_DESC, q_off, row_ok, stride_qd, b, h0, t0, D, BLOCK_D, ROWS, HB, USE_TMA)
        m, l = _lse_key_range_resident(m, l, q_chunks, K, K_DESC, k_off_base, tok, b, kv, 0, full_hi,
                                       N_Q, N_K, stride_kn, stride_kd, qk_scale, D, BLOCK_D, BLOCK_N, False, CAUSAL,
                                       IEEE, NO_CONTRACT, USE_TMA)
        m, l = _lse_key_range_resident(m, l, q_chunks, K, K_DESC, k_off_base, tok, b, kv, full_hi, key_hi,
                                       N_Q, N_K, stride_kn, stride_kd, qk_scale, D, BLOCK_D, BLOCK_N, True, CAUSAL,
                                       IEEE, NO_CONTRACT, USE_TMA)
    else:
        m, l = _lse_key_range(m, l, Q, K, Q_DESC, K_DESC, q_off, row_ok, k_off_base, tok, b, h0, t0, kv,
                              0, full_hi, N_Q, N_K, stride_qd, stride_kn, stride_kd, qk_scale, D, BLOCK_D,
                              ROWS, BLOCK_N, HB, False, CAUSAL, IEEE, NO_CONTRACT, USE_TMA, A_L1)
        m, l = _lse_key_range(m, l, Q, K, Q_DESC, K_DESC, q_off, row_ok, k_off_base, tok, b, h0, t0, kv,
                              full_hi, key_hi, N_Q, N_K, stride_qd, stride_kn, stride_kd, qk_scale, D, BLOCK_D,
                              ROWS, BLOCK_N, HB, True, CAUSAL, IEEE, NO_CONTRACT, USE_TMA, A_L1)
    lse = tl.where(l == 0.0, float("-inf"), m + tl.log2(l))  # l is NaN (not 0) for a NaN row
    tl.store(LSE_T + (b64 * H + h) * N_Q + tok, lse, mask=row_ok)
