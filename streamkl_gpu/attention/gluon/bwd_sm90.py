"""Hopper (sm_90) backward in Gluon for one trained side (settings 1 and 2), FA3's schedule.
(``tests/test_gluon_bwd_schedule.py`` replays the schedule in PyTorch: keep the two in step.)

Same math and conventions as ``_bwd`` (the portable Triton kernels, the reference this one is
checked against on the GPU by a script since removed, ``git show b7066de:bench/gluon_bwd_gpu.py``:
bench/results/2026-12-01_h200_2a98499/gluon_bwd.csv): P1, P2 recomputed from the saved LSEs
(bits), for the trained side t

    setting 1 (t = 2):  dS2 = g * sigma2 * (P2 - P1)
    setting 2 (t = 1):  dS1 = g * sigma1 * ln2 * P1 * (x1 - x2 - KL * log2(e)),   x_s = s_s - lse_s
    dQ_t = dS_t K_t,   dK_t = dS_t^T Q_t

Rows with no visible key (lse = -inf) get lse = EMPTY_LSE and g = 0 (``_bwd._row_consts``), so
their dS is exactly 0.

Schedule: one CTA owns 128 keys of one (b, h); two consumer warpgroups own 64 keys each (K1, K2
stationary in shared memory, loaded once by TMA); a producer warp streams 64-row query tiles
(Q1, Q2) through an ``NUM_STAGES`` mbarrier ring. Per query tile each warpgroup
- issues ``S1 = Q1 K1^T`` and ``S2 = Q2 K2^T`` [64 queries, 64 keys] as async wgmma, waits for
  S1, forms its exponential while S2 runs, then waits for S2;
- forms dS_t in registers (row constants loaded beside the products) and writes it to shared
  memory (its 64-key half of a [64, 128] dS tile);
- ``dK_t += dS_t^T Q_t``: the transposed shared-memory view of its own dS half as the A operand,
  accumulated in registers over the query tiles;
- meets the other warpgroup on an mbarrier (``ds_ready``: both halves written) and computes
  ``dQ_t[:, w-th half of D] = dS_t [64 q, 128 keys] K_t[:, w-th half]``, staged in shared memory
  and added by one TMA reduce-add (``_dq_add``) into a [B, H, N_Q rounded up to 64, D] fp32
  buffer the host converts (the variant ``vector_atomics``: fp32 vector atomics from registers).
Three waits per tile, all inside the iteration (tests/test_gluon_bwd_compile.py checks the SASS).
DQ_LAG (``GluonBwdConfig.dq_lag``, off: checked on the GPU; with the vector atomics 1-4 % faster
than without, with the TMA reduce-adds within 3 % either way: docs/design/attention_backward.md):
the meeting moves one tile later, so that a warpgroup no longer waits for the other's dS of the
tile it is on: tile i waits for its dK product, releases its Q slot, then adds the dQ half of tile
i - 1 (``_dq_tile``: by then the other warpgroup wrote that dS a tile ago), and the last tile's dQ
comes after the loop. Four waits per tile; it needs DS_BUFS >= 2 (tile i's dS is written while
tile i - 1's is read); the barrier protocol is replayed under random interleavings in
tests/test_gluon_bwd_schedule.py.
Head dims are held as two chunks of D/2 (TMA boxes [64, D/2]) so that every operand is a whole
shared-memory tile: the dQ split across the warpgroups needs no sub-tile slicing. Both sides
trained: one launch per side (``bwd_dispatch.try_gluon_backward``). Host side: ``bwd_sm90_launch``.

Causal (bottom-right) with tile skipping: a key block sees query rows from ``start_n - (N_K - N_Q)``
on; the band of query tiles that see the block partly is the masked stage, the rest is unmasked
(all masked for the ragged last key block, whose keys past N_K arrive as TMA zeros).
NaN isolation (docs/math.md), as in ``_bwd``: masked entries of dS are selected to 0, and the
operands of the dS products are made finite where a 0 in dS could meet a NaN: with CAUSAL, the
K_t of the dQ product is a finite copy (made once; a row that sees a NaN key has NaN dS anyway)
and the Q_t of the dK product in the causal band is a finite copy per tile. Without CAUSAL the
only masked entries are TMA zero fill (keys past N_K, rows past N_Q).

GQA per side: K_s is read at key head h // GROUP_s; with more than one query head per key head
on the trained side dK is added with fp32 atomics into the key head (``DK_ATOMIC``; the host
converts). This module imports Gluon unconditionally; ``bwd_dispatch`` guards the import.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from streamkl_gpu._core.gluon_compat import NEW_REINTERPRET, cta_barrier, tma_load, tma_reduce_add


WG_N = gl.constexpr(64)  # keys per consumer warpgroup (the wgmma M of S^T and dK)
BLOCK_N = gl.constexpr(128)  # keys per CTA: two consumer warpgroups
BLOCK_M = gl.constexpr(64)  # query rows per streamed tile
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
LOG2E_C = gl.constexpr(LOG2E)
EMPTY_LSE = gl.constexpr(1e30)  # _bwd.EMPTY_LSE: exp2(s - EMPTY_LSE) = 0 for every fp32 score


@gluon.constexpr_function
def _mma_layout(n):
    # wgmma accumulator of one warpgroup: [64, n] fp32
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, int(n), 16])


@gluon.constexpr_function
def _copy_layout(dc):
    # a [64, dc] 16-bit tile in 16-byte pieces over one warpgroup (the finite copies)
    tpc = min(int(dc) // 8, 32)
    return gl.BlockedLayout([1, 8], [32 // tpc, tpc], [4, 1], [1, 0])


@gluon.constexpr_function
def _ds_smem_layout(dtype):
    return gl.NVMMASharedLayout.get_default_for([64, 64], dtype)


@gluon.constexpr_function
def _tile_smem_layout(dc, dtype):
    return gl.NVMMASharedLayout.get_default_for([64, int(dc)], dtype)


@gluon.jit
def _tile(smem, idx, DC: gl.constexpr):
    """Tile ``idx`` of a [n, 1, 1, 64, DC] TMA buffer as a [64, DC] operand."""
    return smem.index(idx).reshape([64, DC])


@gluon.jit
def _finite_copy(src, dst, DC: gl.constexpr):
    """dst = src with NaN and +-inf replaced by 0 ([64, DC] shared tiles, one warpgroup)."""
    layout: gl.constexpr = _copy_layout(DC)
    x = src.load(layout)
    dst.store(gl.where(gl.abs(x) < float("inf"), x, gl.zeros_like(x)))


@gluon.jit
def _load_partition(q1_desc, k1_desc, q2_desc, k2_desc, q1_ring, q2_ring, k1_smem, k2_smem,
                    k_bar, q_ready, q_empty, b, h, kv_head1, kv_head2, start_n, m_lo, n_tiles,
                    DC: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Producer warp: the CTA's K1, K2 once ([key half, D chunk] tiles), then query tile i
    (rows m_lo + 64 i) into ring slot i % NUM_STAGES."""
    mbarrier.expect(k_bar, 4 * k1_desc.block_type.nbytes + 4 * k2_desc.block_type.nbytes)
    for kh in gl.static_range(2):
        for c in gl.static_range(2):
            tma_load(k1_desc, [b, kv_head1, start_n + kh * WG_N, c * DC], k_bar, k1_smem.index(kh * 2 + c))
            tma_load(k2_desc, [b, kv_head2, start_n + kh * WG_N, c * DC], k_bar, k2_smem.index(kh * 2 + c))
    for i in range(n_tiles):
        s = i % NUM_STAGES
        ph = (i // NUM_STAGES) & 1
        start_m = m_lo + i * BLOCK_M
        mbarrier.wait(q_empty.index(s), ph ^ 1)  # a fresh barrier passes the phase-1 wait
        mbarrier.expect(q_ready.index(s), 2 * q1_desc.block_type.nbytes + 2 * q2_desc.block_type.nbytes)
        for c in gl.static_range(2):
            tma_load(q1_desc, [b, h, start_m, c * DC], q_ready.index(s), q1_ring.index(s * 2 + c))
            tma_load(q2_desc, [b, h, start_m, c * DC], q_ready.index(s), q2_ring.index(s * 2 + c))


# Variants (``VARIANT`` constexpr): "kernel" (3) stages each dQ tile in shared memory and adds it
# with one TMA reduce-add (the host passes a descriptor of the dQ buffer); "vector_atomics" (0)
# adds it with fp32 vector atomics from registers (_add_pairs: right, 1.22-1.27x the step's time on
# an H100, bench/results/2026-12-06_h100_c32c559/gluon_bwd_dq.csv); scalar_dq_atomics (2) with
# gl.atomic_add (right, slower still); no_dq_atomics (1) is wrong on purpose (no dQ: what it costs).
VARIANTS = {"kernel": 3, "vector_atomics": 0, "no_dq_atomics": 1, "scalar_dq_atomics": 2}
DQ_TMA_VARIANT = 3  # the variant whose DQ argument is a TMA descriptor (launch_args)


@gluon.jit
def _add_pairs(ptrs, x):
    """``*ptrs += x`` with one ``red.global.add.v2.f32`` per two adjacent columns: in the wgmma
    accumulator layout a thread's registers come in pairs (row r, columns 2t and 2t + 1: the
    first register basis of its linear layout is [0, 1]), so ``pack=2`` hands the asm two
    neighbours (8-byte aligned: even column, fp32 rows of D).
    Half the instructions of ``gl.atomic_add``'s scalar ones, and every 32-byte sector a warp
    touches is whole. The address goes in as an integer (triton 3.6 takes no pointer operand)."""
    gl.inline_asm_elementwise(
        "red.relaxed.gpu.global.add.v2.f32 [$2], {$4, $5};\n\tmov.u32 $0, 0;\n\tmov.u32 $1, 0;",
        "=r,=r,l,l,f,f", [ptrs.to(gl.int64), x], dtype=gl.int32, is_pure=False, pack=2)


@gluon.jit
def _bwd_tile(WG: gl.constexpr, dk0, dk1, i, m_lo, q1_ring, q2_ring, k1_smem, k2_smem, kfin_smem, qfin_smem, ds_smem,
              dq_smem,
              q_ready, q_empty, ds_ready, ds_free, LSE1, LSE2, KL, G, DQ, pid_bh, keys, N_Q, N_K, diag_offset,
              qk_scale1, qk_scale2, coef,
              D: gl.constexpr, DC: gl.constexpr, NUM_STAGES: gl.constexpr, DS_BUFS: gl.constexpr,
              TRAIN: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr, VARIANT: gl.constexpr,
              DQ_LAG: gl.constexpr):
    """One query tile for warpgroup WG (keys ``keys``): dK chunks updated, dQ half added (with
    DQ_LAG: the previous tile's dQ half, see ``_dq_tile``)."""
    s_layout: gl.constexpr = _mma_layout(WG_N)  # [64 queries, 64 keys]
    c_layout: gl.constexpr = _mma_layout(DC)  # [64, DC]: dK chunk, dQ half
    dtype: gl.constexpr = q1_ring.dtype
    s = i % NUM_STAGES
    ph = (i // NUM_STAGES) & 1
    buf = i % DS_BUFS
    ds_ph = (i // DS_BUFS) & 1
    start_m = m_lo + i * BLOCK_M
    if TRAIN == 1:
        q_t = q1_ring
        k_t = k1_smem
    else:
        q_t = q2_ring
        k_t = k2_smem

    # per-row constants, read while the products run (_bwd._row_consts)
    rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    row_ok = rows < N_Q
    at = pid_bh.to(gl.int64) * N_Q + rows
    lse1 = gl.load(LSE1 + at, mask=row_ok, other=float("-inf"))
    lse2 = gl.load(LSE2 + at, mask=row_ok, other=float("-inf"))
    g = gl.load(G + at, mask=row_ok, other=0.0)
    empty = lse1 == float("-inf")  # no visible key (or a padding row)
    lse1 = gl.where(empty, EMPTY_LSE, lse1)
    lse2 = gl.where(empty, EMPTY_LSE, lse2)
    g = gl.where(empty, 0.0, g) * coef
    if TRAIN == 1:
        kl = gl.load(KL + at, mask=row_ok, other=0.0)
        kl_bits = gl.where(empty, 0.0, kl * LOG2E_C)

    mbarrier.wait(q_ready.index(s), ph)
    if MASKED:
        if CAUSAL and VARIANT == 3:  # the copies share their buffer with the dQ staging tile
            tma.store_wait(0)  # the last reduce-add has read it
            cta_barrier()
        if CAUSAL:  # the dK product's Q: a finite copy (a NaN query row vs the keys it cannot see),
            # made before the score products so that its registers are not live beside theirs
            _finite_copy(_tile(q_t, s * 2, DC), qfin_smem.index(WG * 2), DC)
            _finite_copy(_tile(q_t, s * 2 + 1, DC), qfin_smem.index(WG * 2 + 1), DC)
    zero = gl.zeros([BLOCK_M, WG_N], gl.float32, s_layout)
    t1 = warpgroup_mma(_tile(q1_ring, s * 2, DC), _tile(k1_smem, WG * 2, DC).permute((1, 0)), zero,
                       use_acc=False, is_async=True)
    t1 = warpgroup_mma(_tile(q1_ring, s * 2 + 1, DC), _tile(k1_smem, WG * 2 + 1, DC).permute((1, 0)), t1,
                       is_async=True)
    t2 = warpgroup_mma(_tile(q2_ring, s * 2, DC), _tile(k2_smem, WG * 2, DC).permute((1, 0)), zero,
                       use_acc=False, is_async=True)
    t2 = warpgroup_mma(_tile(q2_ring, s * 2 + 1, DC), _tile(k2_smem, WG * 2 + 1, DC).permute((1, 0)), t2,
                       is_async=True)
    if MASKED:
        visible = keys[None, :] < N_K
        if CAUSAL:  # bottom-right causal: key j visible to query i iff j <= i + (N_K - N_Q)
            visible = visible & (keys[None, :] <= rows[:, None] + diag_offset)

    # ---- S1 (side 1's exponent) while S2 is still on the tensor cores
    s1 = warpgroup_mma_wait(num_outstanding=2, deps=(t1,))
    x1 = s1 * qk_scale1 - lse1[:, None]
    if TRAIN == 2:
        if MASKED:
            x1 = gl.where(visible, x1, float("-inf"))
        p1 = gl.exp2(x1)
    s2 = warpgroup_mma_wait(num_outstanding=0, deps=(t2,))
    x2 = s2 * qk_scale2 - lse2[:, None]
    if TRAIN == 2:
        if MASKED:
            x2 = gl.where(visible, x2, float("-inf"))
        ds = (gl.exp2(x2) - p1) * g[:, None]
    else:
        # log P1 - log P2 - KL from the logits and saved LSEs, before masking (finite)
        log_ratio = x1 - x2 - kl_bits[:, None]
        if MASKED:
            x1 = gl.where(visible, x1, float("-inf"))
        ds = gl.exp2(x1) * log_ratio * g[:, None]
    if MASKED:  # select, never multiply: 0 * NaN = NaN
        ds = gl.where(visible, ds, 0.0)

    # ---- dS to shared memory (this warpgroup's 64 keys); the dK product reads it transposed
    mbarrier.wait(ds_free.index(buf), ds_ph ^ 1)  # the other warpgroup is done with this buffer
    ds_own = ds_smem.index(buf * 2 + WG)
    ds_own.store(ds.to(dtype))
    fence_async_shared()
    cta_barrier()  # every thread of this warpgroup has written (the arrive below is one thread's)
    mbarrier.arrive(ds_ready.index(buf), count=1)
    # dK_t += dS^T Q_t
    if MASKED and CAUSAL:
        dk0 = warpgroup_mma(ds_own.permute((1, 0)), qfin_smem.index(WG * 2), dk0, is_async=True)
        dk1 = warpgroup_mma(ds_own.permute((1, 0)), qfin_smem.index(WG * 2 + 1), dk1, is_async=True)
    else:
        dk0 = warpgroup_mma(ds_own.permute((1, 0)), _tile(q_t, s * 2, DC), dk0, is_async=True)
        dk1 = warpgroup_mma(ds_own.permute((1, 0)), _tile(q_t, s * 2 + 1, DC), dk1, is_async=True)
    if DQ_LAG:  # this tile's dQ waits for the next tile (or the epilogue); the previous tile's runs now
        dk0, dk1 = warpgroup_mma_wait(num_outstanding=0, deps=(dk0, dk1))
        mbarrier.arrive(q_empty.index(s), count=1)
        if i > 0:
            _dq_tile(WG, i - 1, m_lo, k1_smem, k2_smem, kfin_smem, ds_smem, dq_smem, ds_ready, ds_free, DQ, pid_bh, N_Q,
                     D, DC, DS_BUFS, TRAIN, CAUSAL, VARIANT)
    else:
        kq0, kq1 = _dq_keys(WG, k1_smem, k2_smem, kfin_smem, DC, TRAIN, CAUSAL)
        mbarrier.wait(ds_ready.index(buf), ds_ph)
        zq = gl.zeros([BLOCK_M, DC], gl.float32, c_layout)
        tq = warpgroup_mma(ds_smem.index(buf * 2), kq0, zq, use_acc=False, is_async=True)
        tq = warpgroup_mma(ds_smem.index(buf * 2 + 1), kq1, tq, is_async=True)
        dk0, dk1, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dk0, dk1, tq))
        mbarrier.arrive(q_empty.index(s), count=1)
        mbarrier.arrive(ds_free.index(buf), count=1)
        _dq_add(WG, dq, start_m, DQ, dq_smem, pid_bh, N_Q, D, DC, VARIANT)
    return dk0, dk1


@gluon.jit
def _dq_keys(WG: gl.constexpr, k1_smem, k2_smem, kfin_smem, DC: gl.constexpr, TRAIN: gl.constexpr,
             CAUSAL: gl.constexpr):
    """The K_t chunks of warpgroup WG's dQ half: [key half 0, chunk WG], [key half 1, chunk WG]."""
    if CAUSAL:
        kq0 = kfin_smem.index(WG)
        kq1 = kfin_smem.index(2 + WG)
    else:
        if TRAIN == 1:
            k_t = k1_smem
        else:
            k_t = k2_smem
        kq0 = _tile(k_t, WG, DC)
        kq1 = _tile(k_t, 2 + WG, DC)
    return kq0, kq1


@gluon.jit
def _dq_add(WG: gl.constexpr, dq, start_m, DQ, dq_smem, pid_bh, N_Q, D: gl.constexpr, DC: gl.constexpr,
            VARIANT: gl.constexpr):
    """dQ[start_m .. +63, WG-th half of D] += dq: (VARIANT 3, the default) the tile staged in this
    warpgroup's ``dq_smem`` buffer and added by one TMA reduce-add through the descriptor ``DQ``
    (FlashAttention-3's way: one bulk operation instead of 16 vector atomics per thread), or fp32
    atomics from registers."""
    c_layout: gl.constexpr = _mma_layout(DC)
    N_Q_PAD = gl.cdiv(N_Q, BLOCK_M) * BLOCK_M  # the buffer's rows per (b, h): whole 64-row tiles
    if VARIANT == 3:
        buf = dq_smem.index(WG)
        tma.store_wait(0)  # this warpgroup's last reduce-add has read the buffer (its issuing thread waits)
        cta_barrier()  # ... before any thread of the warpgroup overwrites it
        buf.store(dq)
        fence_async_shared()
        cta_barrier()  # every thread has written before the one that issues the copy
        tma_reduce_add(DQ, [pid_bh * N_Q_PAD + start_m, WG * DC], buf)
    elif VARIANT != 1:
        q_rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, c_layout))
        cols = WG * DC + gl.arange(0, DC, layout=gl.SliceLayout(0, c_layout))
        # the buffer has whole 64-row tiles (rows past N_Q add zeros): no mask, no branches
        ptrs = DQ + (pid_bh.to(gl.int64) * N_Q_PAD + q_rows)[:, None] * D + cols[None, :]
        if VARIANT == 2:
            gl.atomic_add(ptrs, dq, sem="relaxed")
        else:
            _add_pairs(ptrs, dq)


@gluon.jit
def _dq_tile(WG: gl.constexpr, j, m_lo, k1_smem, k2_smem, kfin_smem, ds_smem,
             dq_smem, ds_ready, ds_free, DQ, pid_bh, N_Q,
             D: gl.constexpr, DC: gl.constexpr, DS_BUFS: gl.constexpr, TRAIN: gl.constexpr, CAUSAL: gl.constexpr,
             VARIANT: gl.constexpr):
    """DQ_LAG: warpgroup WG's dQ half of query tile j, once both halves of its dS are written
    (``ds_ready``; by now the other warpgroup is normally a tile past it: no wait), then the
    buffer released (``ds_free``). Self-contained: no product is left in flight."""
    c_layout: gl.constexpr = _mma_layout(DC)
    buf = j % DS_BUFS
    kq0, kq1 = _dq_keys(WG, k1_smem, k2_smem, kfin_smem, DC, TRAIN, CAUSAL)
    mbarrier.wait(ds_ready.index(buf), (j // DS_BUFS) & 1)
    zq = gl.zeros([BLOCK_M, DC], gl.float32, c_layout)
    tq = warpgroup_mma(ds_smem.index(buf * 2), kq0, zq, use_acc=False, is_async=True)
    tq = warpgroup_mma(ds_smem.index(buf * 2 + 1), kq1, tq, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(tq,))
    mbarrier.arrive(ds_free.index(buf), count=1)
    _dq_add(WG, dq, m_lo + j * BLOCK_M, DQ, dq_smem, pid_bh, N_Q, D, DC, VARIANT)


@gluon.jit
def _consumer(WG: gl.constexpr, q1_ring, q2_ring, k1_smem, k2_smem, kfin_smem, qfin_smem, ds_smem, dq_smem,
              k_bar, q_ready, q_empty, ds_ready, ds_free, LSE1, LSE2, KL, G, DQ, DK,
              pid_bh, dk_row0, start_n, m_lo, n_masked, n_tiles, N_Q, N_K, qk_scale1, qk_scale2, coef,
              D: gl.constexpr, DC: gl.constexpr, NUM_STAGES: gl.constexpr, DS_BUFS: gl.constexpr,
              TRAIN: gl.constexpr, CAUSAL: gl.constexpr, DK_ATOMIC: gl.constexpr, VARIANT: gl.constexpr,
              DQ_LAG: gl.constexpr):
    """Consumer warpgroup WG: keys start_n + 64 WG .. +63, every query tile of the CTA."""
    s_layout: gl.constexpr = _mma_layout(WG_N)
    c_layout: gl.constexpr = _mma_layout(DC)
    keys = start_n + WG * WG_N + gl.arange(0, WG_N, layout=gl.SliceLayout(0, s_layout))
    diag_offset = N_K - N_Q
    mbarrier.wait(k_bar, 0)
    if TRAIN == 1:
        k_t = k1_smem
    else:
        k_t = k2_smem
    if CAUSAL:  # the dQ product's K_t: a finite copy of the chunks this warpgroup reads
        _finite_copy(_tile(k_t, WG, DC), kfin_smem.index(WG), DC)
        _finite_copy(_tile(k_t, 2 + WG, DC), kfin_smem.index(2 + WG), DC)
        fence_async_shared()
        cta_barrier()
    dk0 = gl.zeros([WG_N, DC], gl.float32, c_layout)
    dk1 = gl.zeros([WG_N, DC], gl.float32, c_layout)
    # the causal band (and every tile of the ragged last key block), then whole tiles
    for i in range(n_masked):
        dk0, dk1 = _bwd_tile(WG, dk0, dk1, i, m_lo, q1_ring, q2_ring, k1_smem, k2_smem, kfin_smem, qfin_smem, ds_smem,
                             dq_smem,
                             q_ready, q_empty, ds_ready, ds_free, LSE1, LSE2, KL, G, DQ, pid_bh, keys, N_Q, N_K,
                             diag_offset, qk_scale1, qk_scale2, coef, D, DC, NUM_STAGES, DS_BUFS, TRAIN, True,
                             CAUSAL, VARIANT, DQ_LAG)
    for i in range(n_masked, n_tiles):
        dk0, dk1 = _bwd_tile(WG, dk0, dk1, i, m_lo, q1_ring, q2_ring, k1_smem, k2_smem, kfin_smem, qfin_smem, ds_smem,
                             dq_smem,
                             q_ready, q_empty, ds_ready, ds_free, LSE1, LSE2, KL, G, DQ, pid_bh, keys, N_Q, N_K,
                             diag_offset, qk_scale1, qk_scale2, coef, D, DC, NUM_STAGES, DS_BUFS, TRAIN, False,
                             CAUSAL, VARIANT, DQ_LAG)
    if DQ_LAG:  # the last tile's dQ half
        if n_tiles > 0:
            _dq_tile(WG, n_tiles - 1, m_lo, k1_smem, k2_smem, kfin_smem, ds_smem,
                     dq_smem, ds_ready, ds_free, DQ, pid_bh, N_Q,
                     D, DC, DS_BUFS, TRAIN, CAUSAL, VARIANT)
    out_keys = start_n + WG * WG_N + gl.arange(0, WG_N, layout=gl.SliceLayout(1, c_layout))
    cols = gl.arange(0, DC, layout=gl.SliceLayout(0, c_layout))
    ptrs = DK + (dk_row0 + out_keys)[:, None] * D + cols[None, :]
    if DK_ATOMIC:  # GQA: the query heads of a key head add into one fp32 buffer (whole key blocks)
        _add_pairs(ptrs, dk0)
        _add_pairs(ptrs + DC, dk1)
    else:
        key_ok = (out_keys < N_K)[:, None]
        gl.store(ptrs, dk0.to(DK.dtype.element_ty), mask=key_ok)
        gl.store(ptrs + DC, dk1.to(DK.dtype.element_ty), mask=key_ok)


@gluon.jit
def _consumer0(q1_ring, q2_ring, k1_smem, k2_smem, kfin_smem, qfin_smem, ds_smem, dq_smem,
               k_bar, q_ready, q_empty, ds_ready, ds_free, LSE1, LSE2, KL, G, DQ, DK,
               pid_bh, dk_row0, start_n, m_lo, n_masked, n_tiles, N_Q, N_K, qk_scale1, qk_scale2, coef,
               D: gl.constexpr, DC: gl.constexpr, NUM_STAGES: gl.constexpr, DS_BUFS: gl.constexpr,
               TRAIN: gl.constexpr, CAUSAL: gl.constexpr, DK_ATOMIC: gl.constexpr, VARIANT: gl.constexpr,
               DQ_LAG: gl.constexpr):
    _consumer(0, q1_ring, q2_ring, k1_smem, k2_smem, kfin_smem, qfin_smem, ds_smem, dq_smem,
              k_bar, q_ready, q_empty, ds_ready, ds_free, LSE1, LSE2, KL, G, DQ, DK,
              pid_bh, dk_row0, start_n, m_lo, n_masked, n_tiles, N_Q, N_K, qk_scale1, qk_scale2, coef,
              D, DC, NUM_STAGES, DS_BUFS, TRAIN, CAUSAL, DK_ATOMIC, VARIANT, DQ_LAG)


@gluon.jit
def _consumer1(q1_ring, q2_ring, k1_smem, k2_smem, kfin_smem, qfin_smem, ds_smem, dq_smem,
               k_bar, q_ready, q_empty, ds_ready, ds_free, LSE1, LSE2, KL, G, DQ, DK,
               pid_bh, dk_row0, start_n, m_lo, n_masked, n_tiles, N_Q, N_K, qk_scale1, qk_scale2, coef,
               D: gl.constexpr, DC: gl.constexpr, NUM_STAGES: gl.constexpr, DS_BUFS: gl.constexpr,
               TRAIN: gl.constexpr, CAUSAL: gl.constexpr, DK_ATOMIC: gl.constexpr, VARIANT: gl.constexpr,
               DQ_LAG: gl.constexpr):
    _consumer(1, q1_ring, q2_ring, k1_smem, k2_smem, kfin_smem, qfin_smem, ds_smem, dq_smem,
              k_bar, q_ready, q_empty, ds_ready, ds_free, LSE1, LSE2, KL, G, DQ, DK,
              pid_bh, dk_row0, start_n, m_lo, n_masked, n_tiles, N_Q, N_K, qk_scale1, qk_scale2, coef,
              D, DC, NUM_STAGES, DS_BUFS, TRAIN, CAUSAL, DK_ATOMIC, VARIANT, DQ_LAG)


# sizes are not specialised on (divisibility by 16, == 1): one compile per dtype, D, side, causal
# and config serves every shape (nothing here gains from it: the row-constant loads are two
# strided values per thread, the dK/dQ rows are aligned by D)
@gluon.jit(do_not_specialize=["H", "N_Q", "N_K", "GROUP1", "GROUP2"])
def _gluon_kl_bwd_kernel(q1_desc, k1_desc, q2_desc, k2_desc, LSE1, LSE2, KL, G, DQ, DK,
                         H, N_Q, N_K, GROUP1, GROUP2, qk_scale1, qk_scale2, coef,
                         D: gl.constexpr, NUM_STAGES: gl.constexpr, DS_BUFS: gl.constexpr, TRAIN: gl.constexpr,
                         CAUSAL: gl.constexpr, DK_ATOMIC: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                         VARIANT: gl.constexpr, DQ_LAG: gl.constexpr = False):
    DC: gl.constexpr = D // 2
    pid_n = gl.program_id(0)  # causal: the first key blocks have the most query tiles, and run first
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    kv_head1 = h // GROUP1  # GQA per side
    kv_head2 = h // GROUP2
    if DK_ATOMIC:  # dK rows of the trained side's key head in an fp32 [B, H_K, N_K rounded up to 128, D] buffer
        if TRAIN == 1:
            dk_row0 = (b * (H // GROUP1) + kv_head1).to(gl.int64) * (gl.cdiv(N_K, BLOCK_N) * BLOCK_N)
        else:
            dk_row0 = (b * (H // GROUP2) + kv_head2).to(gl.int64) * (gl.cdiv(N_K, BLOCK_N) * BLOCK_N)
    else:
        dk_row0 = pid_bh.to(gl.int64) * N_K
    start_n = pid_n * BLOCK_N
    n_q_tiles = gl.cdiv(N_Q, BLOCK_M)
    m_lo = 0
    n_masked = 0
    if CAUSAL:
        diag_offset = N_K - N_Q
        # query rows that see any key of this block: i >= start_n - diag_offset
        first = gl.minimum(gl.maximum(start_n - diag_offset, 0) // BLOCK_M, n_q_tiles)
        m_lo = first * BLOCK_M
        # tiles all of whose rows see every key of the block start at start_n + BLOCK_N - 1 - diag
        full = gl.cdiv(gl.maximum(start_n + BLOCK_N - 1 - diag_offset, 0), BLOCK_M)
        n_masked = gl.minimum(full, n_q_tiles) - first
        n_masked = gl.maximum(n_masked, 0)
    n_tiles = n_q_tiles - m_lo // BLOCK_M
    if start_n + BLOCK_N > N_K:  # the ragged last key block: every tile masked
        n_masked = n_tiles

    q1_ring = gl.allocate_shared_memory(q1_desc.dtype, [2 * NUM_STAGES, 1, 1, BLOCK_M, DC], q1_desc.layout)
    q2_ring = gl.allocate_shared_memory(q2_desc.dtype, [2 * NUM_STAGES, 1, 1, BLOCK_M, DC], q2_desc.layout)
    k1_smem = gl.allocate_shared_memory(k1_desc.dtype, [4, 1, 1, WG_N, DC], k1_desc.layout)
    k2_smem = gl.allocate_shared_memory(k2_desc.dtype, [4, 1, 1, WG_N, DC], k2_desc.layout)
    ds_layout: gl.constexpr = _ds_smem_layout(q1_desc.dtype)
    ds_smem = gl.allocate_shared_memory(q1_desc.dtype, [2 * DS_BUFS, BLOCK_M, WG_N], ds_layout)  # [buf, key half]
    FIN: gl.constexpr = 4 if CAUSAL else 1  # the finite copies exist only for the causal masks
    fin_layout: gl.constexpr = _tile_smem_layout(DC, q1_desc.dtype)
    kfin_smem = gl.allocate_shared_memory(k1_desc.dtype, [FIN, WG_N, DC], fin_layout)  # [key half, chunk]
    qfin_smem = gl.allocate_shared_memory(q1_desc.dtype, [FIN, BLOCK_M, DC], fin_layout)  # [warpgroup, chunk]
    if VARIANT == 3:  # a [64, DC] fp32 staging tile per warpgroup, DQ its TMA descriptor
        if CAUSAL:  # on each warpgroup's own finite copies of Q (no room beside them at D = 128)
            if NEW_REINTERPRET:
                dq_smem = qfin_smem.reinterpret(gl.float32, [2, BLOCK_M, DC], DQ.layout)
            else:
                dq_smem = qfin_smem._reinterpret(gl.float32, [2, BLOCK_M, DC], DQ.layout)
        else:
            dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, DC], DQ.layout)
    else:  # unused
        dq_smem = ds_smem
    k_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [DS_BUFS, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [DS_BUFS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(k_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # both consumer warpgroups release a slot
    for i in gl.static_range(DS_BUFS):
        mbarrier.init(ds_ready.index(i), count=2)
        mbarrier.init(ds_free.index(i), count=2)

    # argument tuples inline: a tuple bound to a local turns its constexprs into tensors (sketch)
    gl.warp_specialize([
        (_consumer0, (q1_ring, q2_ring, k1_smem, k2_smem, kfin_smem, qfin_smem, ds_smem, dq_smem,
                      k_bar, q_ready, q_empty, ds_ready, ds_free, LSE1, LSE2, KL, G, DQ, DK,
                      pid_bh, dk_row0, start_n, m_lo, n_masked, n_tiles, N_Q, N_K, qk_scale1, qk_scale2, coef,
                      D, DC, NUM_STAGES, DS_BUFS, TRAIN, CAUSAL, DK_ATOMIC, VARIANT, DQ_LAG)),
        (_consumer1, (q1_ring, q2_ring, k1_smem, k2_smem, kfin_smem, qfin_smem, ds_smem, dq_smem,
                      k_bar, q_ready, q_empty, ds_ready, ds_free, LSE1, LSE2, KL, G, DQ, DK,
                      pid_bh, dk_row0, start_n, m_lo, n_masked, n_tiles, N_Q, N_K, qk_scale1, qk_scale2, coef,
                      D, DC, NUM_STAGES, DS_BUFS, TRAIN, CAUSAL, DK_ATOMIC, VARIANT, DQ_LAG)),
        (_load_partition, (q1_desc, k1_desc, q2_desc, k2_desc, q1_ring, q2_ring, k1_smem, k2_smem,
                           k_bar, q_ready, q_empty, b, h, kv_head1, kv_head2, start_n, m_lo, n_tiles, DC,
                           NUM_STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])
