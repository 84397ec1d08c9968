"""The chunk design's gradient kernel on keys-major tiles: ``_indexer_bwd_dq_kernel``'s P_SAVED /
DK_SHARE / student-only case (``bwd.py``) with the score tile transposed, as the keys-major forward
(``fwd.py``, "Keys-major score tiles") transposes its own.

Per token block (all indexer heads of one key head: columns ``c = j * BLOCK_T + t``) and key tile:

    a^T   = k q^T                                   [BLOCK_N keys, COLS]  (one product)
    I^T   = sum_j w_j relu(a_j)^T                   [BLOCK_N, BLOCK_T]: in-thread adds and lane
                                                    shuffles along a row, no cross-warp reduction
    G^T   = g (exp(I - LSE_I) - p)^T                0 where not visible (p: the chunk's stored target)
    C^T   = G^T 1[a > 0]                            per column, broadcast from G^T
    dq^   += C k             (C^T's transpose)      [COLS, D_I]  (second product)
    dk    += C^T (w q)                              [BLOCK_N, D_I] (third product; added into dk)

and after the key loop ``dq = w dq^`` and ``dweights = q . dq^`` (row-wise): since
``relu(a) = 1[a > 0] a`` and ``a = q . k``, ``sum_s G relu(a_j) = q_j . sum_s G 1[a_j > 0] k_s``,
so the weights never enter the loop's element-wise work and the per-tile row sums of dweights
(a reduction down the keys, across warps in this layout) are gone. ``relu=False`` drops the
indicator. The weights are folded into the dk operand ``w q`` once per program.

NaN isolation as ``bwd.py``: masked entries are selected to 0 before they multiply; in the masked
stage (the causal band, a ragged last tile) a non-finite key row is zeroed in the dq^ operand and
a non-finite ``w q`` row in the dk operand, so a key (token) that a token (key) cannot see adds 0,
never 0 * NaN; tokens that do see it get the NaN through G.

The row-major kernel is the reference for this one (tests/test_indexer_chunk_grad_keys.py runs
both under the interpreter against float64).
"""
import triton
import triton.language as tl

from streamkl_gpu._core.jit import LOG2E, _dot, _key_stages
from streamkl_gpu.indexer.triton.bwd import _finite_or_zero, _query_rows, _token_block
from streamkl_gpu.indexer.triton.fwd import _token_visible_keys


@triton.jit
def _visible_target(P, b, p_rows, toks, t_off, keys, lse_i, N_Q, N_K, diag_offset, MASKED: tl.constexpr,
                    CAUSAL: tl.constexpr):
    """Which (key, token) entries of the tile are visible, and the stored target there (the storing
    forward wrote those entries; nothing else is read)."""
    visible = _token_visible_keys(toks, keys, N_Q, N_K, diag_offset, MASKED, CAUSAL) & (lse_i != float("-inf"))[None, :]
    p_at = (b.to(tl.int64) * p_rows + (toks - t_off).to(tl.int64))[None, :] * N_K + keys[:, None]
    return visible, tl.load(P + p_at, mask=visible, other=0.0)


@triton.jit
def _student_logits(a, col_ok, w_cols, BLOCK_N: tl.constexpr, GI_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                    RELU: tl.constexpr):
    """I^T [BLOCK_N, BLOCK_T] of one key tile from its scores a^T (the module's I^T line)."""
    if RELU:
        act = tl.maximum(a, 0.0, propagate_nan=tl.PropagateNan.ALL)  # relu(NaN) stays NaN
    else:
        act = a
    contrib = tl.where(col_ok[None, :], act * w_cols[None, :], 0.0)
    return tl.sum(tl.reshape(contrib, [BLOCK_N, GI_PAD, BLOCK_T]), axis=1)


@triton.jit
def _coefficient_tile(a, logits, visible, p, g, lse_bits, BLOCK_N: tl.constexpr, GI_PAD: tl.constexpr,
                      BLOCK_T: tl.constexpr, RELU: tl.constexpr):
    """C^T [BLOCK_N, COLS] of one key tile (the module's G^T and C^T lines)."""
    COLS: tl.constexpr = GI_PAD * BLOCK_T
    soft = tl.exp2(logits * LOG2E - lse_bits[None, :])
    grad = tl.where(visible, g[None, :] * (soft - p), 0.0)
    grad_c = tl.reshape(tl.broadcast_to(grad[:, None, :], [BLOCK_N, GI_PAD, BLOCK_T]), [BLOCK_N, COLS])
    vis_c = tl.reshape(tl.broadcast_to(visible[:, None, :], [BLOCK_N, GI_PAD, BLOCK_T]), [BLOCK_N, COLS])
    if RELU:  # the indicator multiplies (not selects): a NaN G stays NaN
        coef = grad_c * (a > 0).to(tl.float32)
    else:
        coef = grad_c
    return tl.where(vis_c, coef, 0.0)


@triton.jit
def _chunk_grad_key_range(
    dq_hat, q_rows, w_cols, q_w, col_ok, KI, KI_DESC, ki_base, P, LSE_I, G_UP, DK, DK_DESC,
    b, kvi, t0, lo, hi, rot, t_off, p_rows, H_KI, N_Q, N_K, stride_kin, stride_kid,
    DI: tl.constexpr, DI_PAD: tl.constexpr, GI_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, RELU: tl.constexpr,
    IEEE_I: tl.constexpr, USE_TMA: tl.constexpr, DK_SHARE: tl.constexpr, BRANCH_LAYOUT: tl.constexpr,
):
    COLS: tl.constexpr = GI_PAD * BLOCK_T
    diag_offset = N_K - N_Q
    offs_d = tl.arange(0, DI_PAD)
    toks = t0 + tl.arange(0, BLOCK_T)
    tok_ok = toks < N_Q
    row = b.to(tl.int64) * N_Q + toks
    lse_i = tl.load(LSE_I + row, mask=tok_ok, other=float("-inf"))
    g = tl.load(G_UP + row, mask=tok_ok, other=0.0)
    lse_bits = lse_i * LOG2E
    w_for_dk = q_w
    if MASKED:  # a non-finite (w q) column must not reach the keys it cannot see through C^T (w q)
        w_for_dk = _finite_or_zero(q_w)
    q_t = tl.trans(q_rows)  # formed before the loop, so its shared-memory copy is written once, not per tile
    n_tiles = tl.cdiv(hi - lo, BLOCK_N)
    n_div = tl.maximum(n_tiles, 1)  # never 0: the GPU forms a zero-trip loop's first addresses (bwd.py)
    for i in range(0, n_tiles):
        # the first tile rotates with the token block, so programs running at once add their dk
        # shares into different rows (bwd.py's _dq_key_range)
        s0 = lo + ((i + rot) % n_div) * BLOCK_N
        keys = s0 + tl.arange(0, BLOCK_N)
        if USE_TMA:  # the plan's box [1, 1, BLOCK_N, DI_PAD]
            k_tile = KI_DESC.load([b, kvi, s0, 0]).reshape(BLOCK_N, DI_PAD)
        else:
            k_tile = tl.load(ki_base + keys.to(tl.int64)[:, None] * stride_kin + offs_d[None, :] * stride_kid,
                             mask=(keys < N_K)[:, None] & (offs_d < DI)[None, :], other=0.0)
        if BRANCH_LAYOUT:
            # The variant "keys_branch" (not the default: timed on an H100 at 0.98-1.03x the default's
            # step on the DSA-like and MQA paths and 1.00x at GQA-like, bench/results/2026-12-06_h100_28c24a4/
            # and 2026-12-06_h100_6dc1dc9/: nothing gained). The first product
            # and C^T under an always-taken branch (i < n_tiles) hide "a's product feeds the next
            # products" from Triton's MMA layout choice, whose chained-dot rule gives that product
            # warpsPerCTA [num_warps, 1]: at 64 keys and 8 warps both warpgroups then form the same
            # [BLOCK_N, COLS] tile and all its element-wise work; unchained it is [4, 2]. With the
            # product outside the branch (its result used only inside) triton 3.6's software
            # pipeliner fails (make_ttgir). Offline sm_90, DSA-like tile: 20 HGMMA per key tile
            # instead of 28, loop 788 / 878 instructions instead of 989 / 1254 (triton 3.6).
            visible, p = _visible_target(P, b, p_rows, toks, t_off, keys, lse_i, N_Q, N_K, diag_offset, MASKED, CAUSAL)
            coef = tl.zeros([BLOCK_N, COLS], k_tile.dtype)
            if n_tiles > 0:
                a = _dot(k_tile, q_t, IEEE_I)  # [BLOCK_N, COLS], from the raw key tile
                logits = _student_logits(a, col_ok, w_cols, BLOCK_N, GI_PAD, BLOCK_T, RELU)
                coef = _coefficient_tile(a, logits, visible, p, g, lse_bits, BLOCK_N, GI_PAD, BLOCK_T, RELU).to(k_tile.dtype)
            if MASKED:  # a non-finite key that a token cannot see must not reach it through C k
                k_tile = _finite_or_zero(k_tile)
        else:
            a = _dot(k_tile, q_t, IEEE_I)  # [BLOCK_N, COLS], from the raw key tile
            if MASKED:  # a non-finite key that a token cannot see must not reach it through C k
                k_tile = _finite_or_zero(k_tile)
            logits = _student_logits(a, col_ok, w_cols, BLOCK_N, GI_PAD, BLOCK_T, RELU)
            visible, p = _visible_target(P, b, p_rows, toks, t_off, keys, lse_i, N_Q, N_K, diag_offset, MASKED, CAUSAL)
            coef = _coefficient_tile(a, logits, visible, p, g, lse_bits, BLOCK_N, GI_PAD, BLOCK_T, RELU)
        dq_hat += _dot(tl.trans(coef.to(k_tile.dtype)), k_tile, IEEE_I)
        if DK_SHARE == 2:  # one bulk TMA reduction (Hopper)
            dk_part = _dot(coef.to(w_for_dk.dtype), w_for_dk, IEEE_I)  # [BLOCK_N, DI_PAD]
            DK_DESC.atomic_add([b, kvi, s0, 0], dk_part.reshape(1, 1, BLOCK_N, DI_PAD))
        elif DK_SHARE == 1:  # relaxed: a sum read only after the kernel (the default acq_rel puts a
            # MEMBAR.ALL.GPU before every atomic in the SASS: 8 fenced L2 round trips per tile at DSA-like)
            dk_part = _dot(coef.to(w_for_dk.dtype), w_for_dk, IEEE_I)  # [BLOCK_N, DI_PAD]
            out = (b.to(tl.int64) * H_KI + kvi) * N_K + keys
            tl.atomic_add(DK + out[:, None] * DI + offs_d[None, :], dk_part,
                          mask=(keys < N_K)[:, None] & (offs_d < DI)[None, :], sem="relaxed")
        # DK_SHARE 0: no dk share (the diagnostic "no_dk", devtools/diagnostics.py: dq and dweights alone)
    return dq_hat


@triton.jit
def _chunk_grad_keys_kernel(
    QI, KI, W, P, LSE_I, G_UP, DQ, DW, DK, QI_DESC, KI_DESC, DK_DESC, T_OFF, P_ROWS,
    stride_qib, stride_qih, stride_qin, stride_qid, stride_kib, stride_kih, stride_kin, stride_kid,
    stride_wb, stride_wh, stride_wn, H_I, H_KI, GROUP_I, N_Q, N_K,
    DI: tl.constexpr, DI_PAD: tl.constexpr, GI_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, RELU: tl.constexpr, IEEE_I: tl.constexpr, USE_TMA: tl.constexpr, DK_SHARE: tl.constexpr,
    BRANCH_LAYOUT: tl.constexpr = False, LPT: tl.constexpr = False,
):
    """dq_idx [B, H_I, N_Q, D_I] and dweights [B, H_I, N_Q] (fp32) of indexer key head ``kvi``'s
    heads for one token block of the chunk starting at T_OFF (P: its target [B, P_ROWS, N_K]), and
    their dk_idx share added into the zeroed fp32 DK (DK_SHARE 2: one TMA bulk reduction per
    tile; 1: fp32 atomics; 0: none, a diagnostic). Grid (token blocks of the chunk, B * H_KI); LPT
    (causal): the token blocks in reverse order, the longest rows first (``bwd._token_block``)."""
    COLS: tl.constexpr = GI_PAD * BLOCK_T
    pid_t = tl.program_id(0)
    b, kvi, t0, tok_c, j, col_ok, q_rows, w_cols = _token_block(
        QI, QI_DESC, W, T_OFF, H_KI, GROUP_I, N_Q, stride_qib, stride_qih, stride_qin, stride_qid,
        stride_wb, stride_wh, stride_wn, DI, DI_PAD, GI_PAD, BLOCK_T, USE_TMA, LPT)  # columns c = j * BLOCK_T + t
    b64 = b.to(tl.int64)
    q_w = (q_rows.to(tl.float32) * w_cols[:, None]).to(q_rows.dtype)  # the dk operand, weights folded in
    ki_base = KI + b64 * stride_kib + kvi.to(tl.int64) * stride_kih
    dq_hat = tl.zeros([COLS, DI_PAD], tl.float32)
    full_hi, key_hi = _key_stages(t0, 0, N_K, N_Q, N_K, BLOCK_T, BLOCK_N, CAUSAL)
    dq_hat = _chunk_grad_key_range(
        dq_hat, q_rows, w_cols, q_w, col_ok, KI, KI_DESC, ki_base, P, LSE_I, G_UP, DK, DK_DESC,
        b, kvi, t0, 0, full_hi, pid_t, T_OFF, P_ROWS, H_KI, N_Q, N_K, stride_kin, stride_kid,
        DI, DI_PAD, GI_PAD, BLOCK_T, BLOCK_N, False, CAUSAL, RELU, IEEE_I, USE_TMA, DK_SHARE, BRANCH_LAYOUT)
    dq_hat = _chunk_grad_key_range(
        dq_hat, q_rows, w_cols, q_w, col_ok, KI, KI_DESC, ki_base, P, LSE_I, G_UP, DK, DK_DESC,
        b, kvi, t0, full_hi, key_hi, pid_t, T_OFF, P_ROWS, H_KI, N_Q, N_K, stride_kin, stride_kid,
        DI, DI_PAD, GI_PAD, BLOCK_T, BLOCK_N, True, CAUSAL, RELU, IEEE_I, USE_TMA, DK_SHARE, BRANCH_LAYOUT)
    offs_d = tl.arange(0, DI_PAD)
    out_row = (b64 * H_I + j) * N_Q + tok_c
    tl.store(DQ + out_row[:, None] * DI + offs_d[None, :], dq_hat * w_cols[:, None],
             mask=col_ok[:, None] & (offs_d < DI)[None, :])
    # q rows loaded again (not kept in registers through the key loop, where only their shared-
    # memory copies are read)
    q_again = _query_rows(QI, QI_DESC, b, kvi * GROUP_I, t0, j, tok_c, col_ok, stride_qib, stride_qih, stride_qin,
                          stride_qid, DI, DI_PAD, COLS, USE_TMA)
    tl.store(DW + out_row, tl.sum(dq_hat * q_again.to(tl.float32), 1), mask=col_ok)
