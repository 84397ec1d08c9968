"""Hopper (sm_90) forward in Gluon: the one-pass streaming KL with overlapped score products.

Same outputs and conventions as ``_fwd._kl_fwd_kernel`` (the portable Triton path and the
reference this kernel is checked against on the GPU): per row the five scalars
``m1, l1, m2, l2, acc`` in bits, ``acc`` re-referenced to both maxima, bottom-right causal with
tile skipping (``_fwd._key_stages``), ``_fwd._finalize`` at the end. Scores are taken to bits
rounded once: in masked tiles ``mul.rn`` before the max (as the Triton path: one-key rows exactly
0); in whole tiles, with the default's ``FOLD`` knob, the max on the raw scores scaled once per row
(bitwise the same max) and the shifted score as one FFMA, x = fma(s_raw, c, -m) (``_shifted``;
proofs/04_base2.md, "Where a kernel applies the factor"). The per-tile formulas are ``_fwd._fwd_key_range``'s, split in two
halves so that the side-1 half runs while the side-2 product is still on the tensor cores.

Schedule: one CTA owns 128 query rows of one (b, h).
- a TMA producer warp loads Q1, Q2 (once) and the key tiles K1, K2 into an ``NUM_STAGES`` ring;
- two consumer warpgroups (``TRIO``: three, 192 rows per CTA; 64 query rows each, Q read by the
  wgmma from shared memory) issue, per
  key tile, ``S1 = Q1 K1^T`` and ``S2 = Q2 K2^T`` as async wgmma, wait for S1 only, fold S1 (max,
  exponentials, l1) while S2 runs, then wait for S2 and fold it (l2, log-ratio, acc). Both waits
  are inside the iteration: issuing across the loop back-edge made ptxas serialise every HGMMA
  (the sketch's trap; tests/test_gluon_compile.py checks the SASS for it).

Descriptors are 4-D over ``[B, H, N, D]`` with any TMA-legal strides: rows past ``N_Q`` and keys
past ``N_K`` arrive as zeros (TMA zero fill). The ragged key tile and the causal band are folded in
the masked stage; NaN isolation: a masked entry adds exactly 0 to every sum (``where``, never
``0 * x``), and query rows past ``N_Q`` are never stored.

This module holds the kernel; the per-tile fold is ``fwd_sm90_fold``, the host side (configs,
descriptors, launch) ``fwd_sm90_launch``.
It imports Gluon unconditionally; ``dispatch`` guards the import.
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from streamkl_gpu._core.gluon_compat import tma_load
from streamkl_gpu.attention.triton import fwd as _fwd
from streamkl_gpu.attention.gluon.fwd_sm90_fold import (_fold_sub, _fold_sub_lazy, _fold_sub_s2first, _half1, _half2,
                                                       _knob, _row_sum, _with_knob)


WG_M = gl.constexpr(64)  # query rows per consumer warpgroup (the wgmma M)
BLOCK_M = gl.constexpr(128)  # query rows per CTA: two consumer warpgroups (TRIO: three, 192 rows)
LOG2E = 1.4426950408889634


@gluon.constexpr_function
def _acc_layout(block_n, warps=4):
    # wgmma accumulator of one warpgroup: [64, block_n] fp32 (UNITE: two warpgroups, [128, block_n])
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[int(warps), 1], instr_shape=[16, int(block_n), 16])


@gluon.jit
def _load_partition(q1_desc, k1_desc, q2_desc, k2_desc, q1_smem, q2_smem, k1_smem, k2_smem,
                    q_bar, k1_ready, k2_ready, k1_empty, k2_empty,
                    b, h, kv_head1, kv_head2, start_m, n_tiles,
                    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, SCHED: gl.constexpr):
    """Producer warp: Q1, Q2 of both warpgroups once, then key tile i into ring slot i % NUM_STAGES.
    MERGE: K1 and K2 of a slot share one ready and one empty barrier (k1_ready, k1_empty)."""
    if _knob(SCHED, "UNITE"):  # one [128, D] block per side
        mbarrier.expect(q_bar, q1_desc.block_type.nbytes + q2_desc.block_type.nbytes)
        tma_load(q1_desc, [b, h, start_m, 0], q_bar, q1_smem.index(0))
        tma_load(q2_desc, [b, h, start_m, 0], q_bar, q2_smem.index(0))
    else:  # one [64, D] block per consumer warpgroup and side
        NUM_WG: gl.constexpr = 2 + _knob(SCHED, "TRIO")
        mbarrier.expect(q_bar, NUM_WG * (q1_desc.block_type.nbytes + q2_desc.block_type.nbytes))
        for w in gl.static_range(NUM_WG):
            tma_load(q1_desc, [b, h, start_m + w * WG_M, 0], q_bar, q1_smem.index(w))
            tma_load(q2_desc, [b, h, start_m + w * WG_M, 0], q_bar, q2_smem.index(w))
    for i in range(n_tiles):
        s = i % NUM_STAGES
        ph = (i // NUM_STAGES) & 1
        if _knob(SCHED, "MERGE"):
            mbarrier.wait(k1_empty.index(s), ph ^ 1)  # a fresh barrier passes the phase-1 wait
            if _knob(SCHED, "RELTURN"):  # per-warpgroup empty barriers
                mbarrier.wait(k2_empty.index(s), ph ^ 1)
            mbarrier.expect(k1_ready.index(s), k1_desc.block_type.nbytes + k2_desc.block_type.nbytes)
            tma_load(k1_desc, [b, kv_head1, i * BLOCK_N, 0], k1_ready.index(s), k1_smem.index(s))
            tma_load(k2_desc, [b, kv_head2, i * BLOCK_N, 0], k1_ready.index(s), k2_smem.index(s))
        else:
            mbarrier.wait(k1_empty.index(s), ph ^ 1)  # a fresh barrier passes the phase-1 wait
            mbarrier.expect(k1_ready.index(s), k1_desc.block_type.nbytes)
            tma_load(k1_desc, [b, kv_head1, i * BLOCK_N, 0], k1_ready.index(s), k1_smem.index(s))
            mbarrier.wait(k2_empty.index(s), ph ^ 1)
            mbarrier.expect(k2_ready.index(s), k2_desc.block_type.nbytes)
            tma_load(k2_desc, [b, kv_head2, i * BLOCK_N, 0], k2_ready.index(s), k2_smem.index(s))


@gluon.jit
def _fold_pair(st, q1, q2, k1_smem, k2_smem, k1_ready, k2_ready, k1_empty, k2_empty, i, zero,
               qk_scale1, qk_scale2, ONE, D1: gl.constexpr, D2: gl.constexpr, BLOCK_N: gl.constexpr,
               NUM_STAGES: gl.constexpr, VARIANT: gl.constexpr, SCHED: gl.constexpr):
    """LOOK: whole key tiles i and i + 1 in one iteration, side 2 first, the next product issued
    before each fold so that the tensor cores have this warpgroup's work during three of the four
    folds (one of two without LOOK): S2a S1a | fold 2a | S2b | fold 1a | S1b | fold 2b | fold 1b. At most
    two groups in flight, every one waited inside the iteration (no token over the back edge, the
    sketch's trap). Not for VARIANT 2 (the caller folds single tiles then)."""
    m1, l1, m2, l2, acc = st
    sa = i % NUM_STAGES
    sb = (i + 1) % NUM_STAGES
    k1a = k1_smem.index(sa).reshape([BLOCK_N, D1])
    k2a = k2_smem.index(sa).reshape([BLOCK_N, D2])
    k1b = k1_smem.index(sb).reshape([BLOCK_N, D1])
    k2b = k2_smem.index(sb).reshape([BLOCK_N, D2])
    MERGE: gl.constexpr = _knob(SCHED, "MERGE")
    mbarrier.wait(k1_ready.index(sa), (i // NUM_STAGES) & 1)
    if not MERGE:
        mbarrier.wait(k2_ready.index(sa), (i // NUM_STAGES) & 1)
    t2a = warpgroup_mma(q2, k2a.permute((1, 0)), zero, use_acc=False, is_async=True)
    t1a = warpgroup_mma(q1, k1a.permute((1, 0)), zero, use_acc=False, is_async=True)
    s2a, k2a = warpgroup_mma_wait(num_outstanding=1, deps=(t2a, k2a))
    if not MERGE:
        mbarrier.arrive(k2_empty.index(sa), count=1)
    m2, l2, x2a, moved2a = _half2(m2, l2, s2a, 0, qk_scale2, ONE, False, VARIANT, SCHED)
    mbarrier.wait(k1_ready.index(sb), ((i + 1) // NUM_STAGES) & 1)
    if not MERGE:
        mbarrier.wait(k2_ready.index(sb), ((i + 1) // NUM_STAGES) & 1)
    t2b = warpgroup_mma(q2, k2b.permute((1, 0)), zero, use_acc=False, is_async=True)
    s1a, k1a = warpgroup_mma_wait(num_outstanding=1, deps=(t1a, k1a))
    mbarrier.arrive(k1_empty.index(sa), count=1)
    m1, l1, acc = _half1(m1, l1, acc, s1a, x2a, moved2a, 0, qk_scale1, ONE, False, VARIANT, SCHED)
    t1b = warpgroup_mma(q1, k1b.permute((1, 0)), zero, use_acc=False, is_async=True)
    s2b, k2b = warpgroup_mma_wait(num_outstanding=1, deps=(t2b, k2b))
    if not MERGE:
        mbarrier.arrive(k2_empty.index(sb), count=1)
    m2, l2, x2b, moved2b = _half2(m2, l2, s2b, 0, qk_scale2, ONE, False, VARIANT, SCHED)
    s1b, k1b = warpgroup_mma_wait(num_outstanding=0, deps=(t1b, k1b))
    mbarrier.arrive(k1_empty.index(sb), count=1)
    m1, l1, acc = _half1(m1, l1, acc, s1b, x2b, moved2b, 0, qk_scale1, ONE, False, VARIANT, SCHED)
    return m1, l1, m2, l2, acc


@gluon.jit
def _visible(i, h, rows, N_K, diag_offset, BLOCK_N: gl.constexpr, SUB_N: gl.constexpr, CAUSAL: gl.constexpr,
             ONE_TEST: gl.constexpr = False):
    """Which entries of sub-tile h of key tile i a row sees: keys < N_K, and the causal band.
    ONE_TEST (MASK1, causal): the two bounds folded into one per-row last visible key, one
    compare per entry (the same set: j < N_K and j <= i + diag  <=>  j <= min(N_K - 1, i + diag))."""
    col_layout: gl.constexpr = gl.SliceLayout(0, _acc_layout(SUB_N, rows.shape[0] // 16))  # 16 rows per warp
    cols = i * BLOCK_N + h * SUB_N + gl.arange(0, SUB_N, layout=col_layout)
    if ONE_TEST and CAUSAL:
        visible = cols[None, :] <= gl.minimum(rows + diag_offset, N_K - 1)[:, None]
    else:
        visible = cols[None, :] < N_K
        if CAUSAL:  # bottom-right causal: key j visible to query i iff j <= i + (N_K - N_Q)
            visible = visible & (cols[None, :] <= rows[:, None] + diag_offset)
    return visible


@gluon.jit
def _fold_tile(st, q1, q2, k1_smem, k2_smem, k1_ready, k2_ready, k1_empty, k2_empty, turn_bars, i, zero,
               rows, N_K, diag_offset, qk_scale1, qk_scale2, ONE,
               D1: gl.constexpr, D2: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
               MASKED: gl.constexpr, CAUSAL: gl.constexpr, VARIANT: gl.constexpr, WG: gl.constexpr,
               SCHED: gl.constexpr):
    """Fold key tile i into the row states. The products of the tile are issued together (SPLIT:
    as two halves of BLOCK_N / 2 keys, S1a S2a S1b S2b, each half folded as it lands while the
    rest run), then folded in issue order. VARIANT != 0: a deliberately wrong kernel for timing
    what bounds the real one (named in devtools/diagnostics.py)."""
    SPLIT: gl.constexpr = _knob(SCHED, "SPLIT")
    PINGPONG: gl.constexpr = _knob(SCHED, "PINGPONG")
    SUB_N: gl.constexpr = BLOCK_N // (1 + SPLIT)
    P: gl.constexpr = 1 if VARIANT == 2 else 2  # products per sub-tile
    s = i % NUM_STAGES
    ph = (i // NUM_STAGES) & 1
    k1 = k1_smem.index(s).reshape([BLOCK_N, D1])
    k2 = k2_smem.index(s).reshape([BLOCK_N, D2])
    mbarrier.wait(k1_ready.index(s), ph)
    RELTURN: gl.constexpr = _knob(SCHED, "RELTURN")
    k1_free = k1_empty.index(s)
    k2_free = k2_empty.index(s)
    if RELTURN:  # per-warpgroup empty barriers (k1_empty: warpgroup 0's, k2_empty: 1's), one release
        if WG == 1:
            k1_free = k2_empty.index(s)
        k2_free = k1_free
    elif _knob(SCHED, "MERGE"):  # one barrier pair per slot: each mbarrier op costs a BAR.SYNC (membar, 3.6)
        k2_free = k1_empty.index(s)
    if not _knob(SCHED, "MERGE"):
        mbarrier.wait(k2_ready.index(s), ph)
    if RELTURN:  # the turn is the other warpgroup's release: 1 waits for 0's of tile i, 0 for 1's of i - 1
        if WG == 1:
            mbarrier.wait(k1_empty.index(s), ph)
        else:
            j = i + NUM_STAGES - 1
            mbarrier.wait(k2_empty.index(j % NUM_STAGES), ((j // NUM_STAGES) + 1) & 1, pred=i > 0)
    elif PINGPONG:  # FA3's turnstile: the two warpgroups take turns on the tensor cores
        mbarrier.wait(turn_bars.index(WG), i & 1)
    ORDER: gl.constexpr = _knob(SCHED, "ORDER") and not SPLIT
    if ORDER:  # side 2 first: S2 issued (and waited) before S1
        if VARIANT != 2:
            t2 = warpgroup_mma(q2, k2.permute((1, 0)), zero, use_acc=False, is_async=True)
            t1 = warpgroup_mma(q1, k1.permute((1, 0)), zero, use_acc=False, is_async=True)
        else:
            t1 = warpgroup_mma(q1, k1.permute((1, 0)), zero, use_acc=False, is_async=True)
            t2 = t1
    elif SPLIT:
        k1a = k1.slice(0, SUB_N)
        k2a = k2.slice(0, SUB_N)
        k1b = k1.slice(SUB_N, SUB_N)
        k2b = k2.slice(SUB_N, SUB_N)
        t1a = warpgroup_mma(q1, k1a.permute((1, 0)), zero, use_acc=False, is_async=True)
        t2a = t1a
        if VARIANT != 2:
            t2a = warpgroup_mma(q2, k2a.permute((1, 0)), zero, use_acc=False, is_async=True)
        t1b = warpgroup_mma(q1, k1b.permute((1, 0)), zero, use_acc=False, is_async=True)
        t2b = t1b
        if VARIANT != 2:
            t2b = warpgroup_mma(q2, k2b.permute((1, 0)), zero, use_acc=False, is_async=True)
    else:
        t1 = warpgroup_mma(q1, k1.permute((1, 0)), zero, use_acc=False, is_async=True)
        t2 = t1
        if VARIANT != 2:
            t2 = warpgroup_mma(q2, k2.permute((1, 0)), zero, use_acc=False, is_async=True)
    turn_next = turn_bars.index(1 - WG)
    if PINGPONG and not _knob(SCHED, "TURN"):  # TURN: handed over after the tile's last wait instead
        mbarrier.arrive(turn_bars.index(1 - WG), count=1)
    visible_a = 0
    visible_b = 0
    if MASKED:
        ONE_TEST: gl.constexpr = _knob(SCHED, "MASK1")
        visible_a = _visible(i, 0, rows, N_K, diag_offset, BLOCK_N, SUB_N, CAUSAL, ONE_TEST)
        if SPLIT:
            visible_b = _visible(i, 1, rows, N_K, diag_offset, BLOCK_N, SUB_N, CAUSAL, ONE_TEST)
    if ORDER:
        st = _fold_sub_s2first(st, t1, t2, k1, k2, k1_free, k2_free, turn_next, visible_a,
                               qk_scale1, qk_scale2, ONE, True, MASKED, VARIANT, SCHED)
    elif SPLIT:
        st = _fold_sub(st, t1a, t2a, k1a, k2a, k1_free, k2_free, turn_next, visible_a, qk_scale1,
                       qk_scale2, zero, ONE, 2 * P - 1, 2 * P - 2, False, MASKED, VARIANT, SCHED)
        st = _fold_sub(st, t1b, t2b, k1b, k2b, k1_free, k2_free, turn_next, visible_b, qk_scale1,
                       qk_scale2, zero, ONE, P - 1, 0, True, MASKED, VARIANT, SCHED)
    elif VARIANT >= 4 and not MASKED:
        st = _fold_sub_lazy(st, t1, t2, q1, q2, k1, k2, k1_free, k2_free, turn_next, qk_scale1, qk_scale2, zero,
                            ONE, SCHED, VARIANT - 4, k1_smem, k2_smem, s)
    else:
        st = _fold_sub(st, t1, t2, k1, k2, k1_free, k2_free, turn_next, visible_a, qk_scale1,
                       qk_scale2, zero, ONE, P - 1, 0, True, MASKED, VARIANT, SCHED)
    return st


@gluon.jit
def _consumer(WG: gl.constexpr, q1_smem, q2_smem, k1_smem, k2_smem, q_bar, k1_ready, k2_ready, k1_empty,
              k2_empty, turn_bars, KL, LSE1, LSE2, pid_bh, start_m, n_full, n_tiles, N_Q, N_K, qk_scale1,
              qk_scale2, ONE, D1: gl.constexpr, D2: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, VARIANT: gl.constexpr, SCHED: gl.constexpr):
    """Consumer warpgroup WG: query rows start_m + 64 WG .. +63, all key tiles of the CTA."""
    SUB_N: gl.constexpr = BLOCK_N // (1 + _knob(SCHED, "SPLIT"))  # keys per wgmma
    UNITE: gl.constexpr = _knob(SCHED, "UNITE")  # one partition of both warpgroups: all 128 rows
    M: gl.constexpr = WG_M * (1 + UNITE)
    acc_layout: gl.constexpr = _acc_layout(SUB_N, 4 * (1 + UNITE))
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    mbarrier.wait(q_bar, 0)
    q1 = q1_smem.index(WG).reshape([M, D1])
    q2 = q2_smem.index(WG).reshape([M, D2])
    zero = gl.zeros([M, SUB_N], gl.float32, acc_layout)
    rows = start_m + WG * WG_M + gl.arange(0, M, layout=row_layout)
    diag_offset = N_K - N_Q
    m1 = gl.full([M], float("-inf"), gl.float32, row_layout)
    m2 = gl.full([M], float("-inf"), gl.float32, row_layout)
    DEFER: gl.constexpr = _knob(SCHED, "DEFER")
    l1 = _row_sum(zero, DEFER)  # zeros: [WG_M] rows, or DEFER's [WG_M, 4] per-thread parts
    l2 = _row_sum(zero, DEFER)
    acc = _row_sum(zero, DEFER)
    st = (m1, l1, m2, l2, acc)
    # whole tiles every row of the CTA sees, then the causal band and the ragged last tile
    if _knob(SCHED, "POLY") == 3:
        # POLY 3: a quarter of side 2's exponentials on the FMA pipe: even whole tiles with POLY 2
        # (every other column of side 2 by the polynomial), odd ones (and the masked tiles) all on
        # the MUFU; a branch in the loop (two tiles per iteration spill: 14 STL, triton 3.6). Then the
        # share where the MUFU and the issue slots balance with FOLD (estimate: MUFU 16 (132 - k)
        # cycles, instruction issue at 2 (801 + 11 k) per scheduler and tile, k ~ 13 of side 2's 64)
        SCHED_P2: gl.constexpr = _with_knob(SCHED, "POLY", 2)
        SCHED_P0: gl.constexpr = _with_knob(SCHED, "POLY", 0)
        for i in range(n_full):
            if i % 2 == 0:
                st = _fold_tile(st, q1, q2, k1_smem, k2_smem, k1_ready, k2_ready, k1_empty, k2_empty, turn_bars, i,
                                zero, rows, N_K, diag_offset, qk_scale1, qk_scale2, ONE, D1, D2, BLOCK_N, NUM_STAGES,
                                False, CAUSAL, VARIANT, WG, SCHED_P2)
            else:
                st = _fold_tile(st, q1, q2, k1_smem, k2_smem, k1_ready, k2_ready, k1_empty, k2_empty, turn_bars, i,
                                zero, rows, N_K, diag_offset, qk_scale1, qk_scale2, ONE, D1, D2, BLOCK_N, NUM_STAGES,
                                False, CAUSAL, VARIANT, WG, SCHED_P0)
    elif _knob(SCHED, "LOOK") and VARIANT != 2:  # whole tiles two at a time, the odd one alone
        for j in range(n_full // 2):
            st = _fold_pair(st, q1, q2, k1_smem, k2_smem, k1_ready, k2_ready, k1_empty, k2_empty, 2 * j, zero,
                            qk_scale1, qk_scale2, ONE, D1, D2, BLOCK_N, NUM_STAGES, VARIANT, SCHED)
        if n_full % 2 == 1:
            st = _fold_tile(st, q1, q2, k1_smem, k2_smem, k1_ready, k2_ready, k1_empty, k2_empty, turn_bars,
                            n_full - 1, zero, rows, N_K, diag_offset, qk_scale1, qk_scale2, ONE, D1, D2, BLOCK_N,
                            NUM_STAGES, False, CAUSAL, VARIANT, WG, SCHED)
    else:
        lo = 0
        if VARIANT >= 4 and n_full > 0:  # lazy_max: the first whole tile sets finite references
            st = _fold_tile(st, q1, q2, k1_smem, k2_smem, k1_ready, k2_ready, k1_empty, k2_empty, turn_bars, 0,
                            zero, rows, N_K, diag_offset, qk_scale1, qk_scale2, ONE, D1, D2, BLOCK_N, NUM_STAGES,
                            False, CAUSAL, 0, WG, SCHED)
            lo = 1
        for i in range(lo, n_full):
            st = _fold_tile(st, q1, q2, k1_smem, k2_smem, k1_ready, k2_ready, k1_empty, k2_empty, turn_bars, i,
                            zero, rows, N_K, diag_offset, qk_scale1, qk_scale2, ONE, D1, D2, BLOCK_N, NUM_STAGES,
                            False, CAUSAL, VARIANT, WG, SCHED)
    SCHED_MASKED: gl.constexpr = _with_knob(SCHED, "POLY", 0) if _knob(SCHED, "POLY") == 3 else SCHED
    for i in range(n_full, n_tiles):
        st = _fold_tile(st, q1, q2, k1_smem, k2_smem, k1_ready, k2_ready, k1_empty, k2_empty, turn_bars, i,
                        zero, rows, N_K, diag_offset, qk_scale1, qk_scale2, ONE, D1, D2, BLOCK_N, NUM_STAGES,
                        True, CAUSAL, VARIANT, WG, SCHED_MASKED)
    m1, l1, m2, l2, acc = st
    if DEFER:  # the quads' partial sums, reduced once
        l1 = gl.convert_layout(gl.sum(l1, axis=1), row_layout)
        l2 = gl.convert_layout(gl.sum(l2, axis=1), row_layout)
        acc = gl.convert_layout(gl.sum(acc, axis=1), row_layout)
    kl, lse1, lse2 = _fwd._finalize(m1, l1, m2, l2, acc)
    row_ok = rows < N_Q  # padded query rows (TMA zero fill) are never written
    out = pid_bh.to(gl.int64) * N_Q + rows
    gl.store(KL + out, kl, mask=row_ok)
    gl.store(LSE1 + out, lse1, mask=row_ok)
    gl.store(LSE2 + out, lse2, mask=row_ok)


@gluon.jit
def _consumer0(q1_smem, q2_smem, k1_smem, k2_smem, q_bar, k1_ready, k2_ready, k1_empty, k2_empty, turn_bars,
               KL, LSE1, LSE2, pid_bh, start_m, n_full, n_tiles, N_Q, N_K, qk_scale1, qk_scale2, ONE,
               D1: gl.constexpr, D2: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
               CAUSAL: gl.constexpr, VARIANT: gl.constexpr, SCHED: gl.constexpr):
    _consumer(0, q1_smem, q2_smem, k1_smem, k2_smem, q_bar, k1_ready, k2_ready, k1_empty, k2_empty, turn_bars,
              KL, LSE1, LSE2, pid_bh, start_m, n_full, n_tiles, N_Q, N_K, qk_scale1, qk_scale2, ONE, D1, D2,
              BLOCK_N, NUM_STAGES, CAUSAL, VARIANT, SCHED)


@gluon.jit
def _consumer1(q1_smem, q2_smem, k1_smem, k2_smem, q_bar, k1_ready, k2_ready, k1_empty, k2_empty, turn_bars,
               KL, LSE1, LSE2, pid_bh, start_m, n_full, n_tiles, N_Q, N_K, qk_scale1, qk_scale2, ONE,
               D1: gl.constexpr, D2: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
               CAUSAL: gl.constexpr, VARIANT: gl.constexpr, SCHED: gl.constexpr):
    _consumer(1, q1_smem, q2_smem, k1_smem, k2_smem, q_bar, k1_ready, k2_ready, k1_empty, k2_empty, turn_bars,
              KL, LSE1, LSE2, pid_bh, start_m, n_full, n_tiles, N_Q, N_K, qk_scale1, qk_scale2, ONE, D1, D2,
              BLOCK_N, NUM_STAGES, CAUSAL, VARIANT, SCHED)


@gluon.jit
def _consumer2(q1_smem, q2_smem, k1_smem, k2_smem, q_bar, k1_ready, k2_ready, k1_empty, k2_empty, turn_bars,
               KL, LSE1, LSE2, pid_bh, start_m, n_full, n_tiles, N_Q, N_K, qk_scale1, qk_scale2, ONE,
               D1: gl.constexpr, D2: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
               CAUSAL: gl.constexpr, VARIANT: gl.constexpr, SCHED: gl.constexpr):
    _consumer(2, q1_smem, q2_smem, k1_smem, k2_smem, q_bar, k1_ready, k2_ready, k1_empty, k2_empty, turn_bars,
              KL, LSE1, LSE2, pid_bh, start_m, n_full, n_tiles, N_Q, N_K, qk_scale1, qk_scale2, ONE, D1, D2,
              BLOCK_N, NUM_STAGES, CAUSAL, VARIANT, SCHED)


@gluon.jit(do_not_specialize=["ONE"])
def _gluon_kl_fwd_kernel(q1_desc, k1_desc, q2_desc, k2_desc, KL, LSE1, LSE2,
                         H, N_Q, N_K, GROUP1, GROUP2, qk_scale1, qk_scale2, ONE,
                         D1: gl.constexpr, D2: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                         CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr, VARIANT: gl.constexpr,
                         SCHED: gl.constexpr):
    """One CTA: 128 query rows of one (b, h). ``ONE``: the runtime integer 1 (never specialised:
    the FENCE schedule's one-trip loop must stay a loop); ``SCHED``: the schedule knobs
    (``fwd_sm90_fold.SCHED_BITS``)."""
    pid_m = gl.program_id(0)
    if CAUSAL:  # the longest query blocks (most key tiles) first: fewer idle SMs in the last wave
        pid_m = gl.num_programs(0) - 1 - pid_m
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    kv_head1 = h // GROUP1  # GQA per side
    kv_head2 = h // GROUP2
    TRIO: gl.constexpr = _knob(SCHED, "TRIO")  # a third consumer warpgroup: 192 query rows per CTA
    CTA_M: gl.constexpr = BLOCK_M + TRIO * WG_M
    start_m = pid_m * CTA_M
    full_hi, key_hi = _fwd._key_stages(start_m, 0, N_K, N_Q, N_K, CTA_M, BLOCK_N, CAUSAL)
    n_full = full_hi // BLOCK_N
    n_tiles = gl.cdiv(key_hi, BLOCK_N)

    Q_BLOCKS: gl.constexpr = 2 - _knob(SCHED, "UNITE") + TRIO  # UNITE: one [128, D] Q block per side
    q1_smem = gl.allocate_shared_memory(q1_desc.dtype, [Q_BLOCKS, 1, 1, CTA_M // Q_BLOCKS, D1], q1_desc.layout)
    q2_smem = gl.allocate_shared_memory(q2_desc.dtype, [Q_BLOCKS, 1, 1, CTA_M // Q_BLOCKS, D2], q2_desc.layout)
    k1_smem = gl.allocate_shared_memory(k1_desc.dtype, [NUM_STAGES, 1, 1, BLOCK_N, D1], k1_desc.layout)
    k2_smem = gl.allocate_shared_memory(k2_desc.dtype, [NUM_STAGES, 1, 1, BLOCK_N, D2], k2_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k1_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k2_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k1_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k2_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k1_ready.index(i), count=1)
        mbarrier.init(k2_ready.index(i), count=1)
        # every consumer warpgroup releases a slot; RELTURN: k1_empty warpgroup 0's, k2_empty 1's
        mbarrier.init(k1_empty.index(i), count=1 if _knob(SCHED, "RELTURN") or _knob(SCHED, "UNITE") else 2 + TRIO)
        mbarrier.init(k2_empty.index(i), count=1 if _knob(SCHED, "RELTURN") or _knob(SCHED, "UNITE") else 2 + TRIO)
    turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn_bars.index(0), count=1)
    mbarrier.init(turn_bars.index(1), count=1)
    if _knob(SCHED, "PINGPONG") and not _knob(SCHED, "RELTURN"):
        mbarrier.arrive(turn_bars.index(0), count=1)  # warpgroup 0 goes first

    # argument tuples inline: a tuple bound to a local turns its constexprs into tensors (sketch)
    if _knob(SCHED, "UNITE"):  # one consumer partition of 8 warps (the kernel's num_warps): one code copy
        gl.warp_specialize([
            (_consumer0, (q1_smem, q2_smem, k1_smem, k2_smem, q_bar, k1_ready, k2_ready, k1_empty, k2_empty,
                          turn_bars, KL, LSE1, LSE2, pid_bh, start_m, n_full, n_tiles, N_Q, N_K, qk_scale1,
                          qk_scale2, ONE, D1, D2, BLOCK_N, NUM_STAGES, CAUSAL, VARIANT, SCHED)),
            (_load_partition, (q1_desc, k1_desc, q2_desc, k2_desc, q1_smem, q2_smem, k1_smem, k2_smem,
                               q_bar, k1_ready, k2_ready, k1_empty, k2_empty,
                               b, h, kv_head1, kv_head2, start_m, n_tiles, BLOCK_N, NUM_STAGES, SCHED)),
        ], [1], [24])
    elif TRIO:
        gl.warp_specialize([
            (_consumer0, (q1_smem, q2_smem, k1_smem, k2_smem, q_bar, k1_ready, k2_ready, k1_empty, k2_empty,
                          turn_bars, KL, LSE1, LSE2, pid_bh, start_m, n_full, n_tiles, N_Q, N_K, qk_scale1, qk_scale2,
                          ONE, D1, D2, BLOCK_N, NUM_STAGES, CAUSAL, VARIANT, SCHED)),
            (_consumer1, (q1_smem, q2_smem, k1_smem, k2_smem, q_bar, k1_ready, k2_ready, k1_empty, k2_empty,
                          turn_bars, KL, LSE1, LSE2, pid_bh, start_m, n_full, n_tiles, N_Q, N_K, qk_scale1, qk_scale2,
                          ONE, D1, D2, BLOCK_N, NUM_STAGES, CAUSAL, VARIANT, SCHED)),
            (_consumer2, (q1_smem, q2_smem, k1_smem, k2_smem, q_bar, k1_ready, k2_ready, k1_empty, k2_empty,
                          turn_bars, KL, LSE1, LSE2, pid_bh, start_m, n_full, n_tiles, N_Q, N_K, qk_scale1, qk_scale2,
                          ONE, D1, D2, BLOCK_N, NUM_STAGES, CAUSAL, VARIANT, SCHED)),
            (_load_partition, (q1_desc, k1_desc, q2_desc, k2_desc, q1_smem, q2_smem, k1_smem, k2_smem,
                               q_bar, k1_ready, k2_ready, k1_empty, k2_empty,
                               b, h, kv_head1, kv_head2, start_m, n_tiles, BLOCK_N, NUM_STAGES, SCHED)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([
            (_consumer0, (q1_smem, q2_smem, k1_smem, k2_smem, q_bar, k1_ready, k2_ready, k1_empty, k2_empty,
                          turn_bars, KL, LSE1, LSE2, pid_bh, start_m, n_full, n_tiles, N_Q, N_K, qk_scale1, qk_scale2,
                          ONE, D1, D2, BLOCK_N, NUM_STAGES, CAUSAL, VARIANT, SCHED)),
            (_consumer1, (q1_smem, q2_smem, k1_smem, k2_smem, q_bar, k1_ready, k2_ready, k1_empty, k2_empty,
                          turn_bars, KL, LSE1, LSE2, pid_bh, start_m, n_full, n_tiles, N_Q, N_K, qk_scale1, qk_scale2,
                          ONE, D1, D2, BLOCK_N, NUM_STAGES, CAUSAL, VARIANT, SCHED)),
            (_load_partition, (q1_desc, k1_desc, q2_desc, k2_desc, q1_smem, q2_smem, k1_smem, k2_smem,
                               q_bar, k1_ready, k2_ready, k1_empty, k2_empty,
                               b, h, kv_head1, kv_head2, start_m, n_tiles, BLOCK_N, NUM_STAGES, SCHED)),
        ], [4, 1], [CONSUMER_REGS, 24])
