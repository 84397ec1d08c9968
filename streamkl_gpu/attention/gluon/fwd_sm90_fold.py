"""The per-tile fold of the Hopper Gluon forward (``fwd_sm90``): what a consumer warpgroup does with
a key tile's two score products once the tensor cores return them.

The shifted scores and their exponentials (``_shifted``, ``_exp2`` and the FMA-pipe polynomial
``_exp2_poly`` with its NumPy twin), the row maxima and sums (``_new_max``, ``_row_sum``), the
log-ratio accumulator, and the three forms of a whole fold: ``_fold_sub`` (the maxima on every
tile, the variant ``eager_max``), ``_fold_sub_lazy`` (the lazy maxima, what runs unforced; its
warpgroup ``_vote``) and ``_fold_sub_s2first`` (side 2 first, the ORDER / LOOK schedules, from
``_half2`` and ``_half1``). The formulas are ``_fwd._fwd_key_range``'s; the schedule knobs
(``SCHED_BITS``, packed by ``fwd_sm90_launch.GluonFwdConfig``) select among the forms. The kernel,
its producer warp and the consumers' key-tile loops are in ``fwd_sm90``.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.language.extra import libdevice

from streamkl_gpu.attention.triton import fwd as _fwd


# VARIANT constexpr: 4 and 5 the lazy maxima (``_fold_sub_lazy``; 5 with ``_vote``'s VOTE 1), what runs
# unforced with and without a causal mask ("lazy_max", "lazy_vote"); 0 the fold with the row maxima
# on every tile (``_fold_sub``, forced as "eager_max"); 1-3 diagnostic variants of that fold that
# leave out one part of the work (wrong results on purpose, for timing only). Named in
# devtools/diagnostics.py (ATTENTION_FWD_DEFAULTS), forced through _core/forcing.py.


@gluon.jit
def _exp2(x, VARIANT: gl.constexpr):
    if VARIANT == 1:  # no exponentials: what the tensor cores and the FP32 work alone cost
        out = x
    else:
        out = gl.exp2(x)
    return out


# Schedule knobs, packed into one constexpr ``SCHED`` (bit offset, width); the fields of
# ``fwd_sm90_launch.GluonFwdConfig``, packed by its ``sched_of``.
SCHED_BITS = dict(PINGPONG=(0, 1), SPLIT=(1, 1), POLY=(2, 2), RESCALE=(4, 1), FENCE=(5, 2), ORDER=(7, 1),
                  LOOK=(8, 1), TURN=(9, 1), MERGE=(10, 1), RELTURN=(11, 1), FOLD=(12, 1), MASK1=(13, 1),
                  DEFER=(14, 1), UNITE=(15, 1), TRIO=(16, 1))
RESCALE_BITS = gl.constexpr(8.0)  # conditional rescaling: a new reference max only when the max grows by more


@gluon.constexpr_function
def _knob(sched, name):
    off, width = SCHED_BITS[str(name)]
    return (int(sched) >> off) & ((1 << width) - 1)


@gluon.constexpr_function
def _with_knob(sched, name, value):
    """``sched`` with knob ``name`` set to ``value``."""
    off, width = SCHED_BITS[str(name)]
    return (int(sched) & ~(((1 << width) - 1) << off)) | (int(value) << off)


# 2^f on [-0.5, 0.5], degree 5, fitted for the relative error (max 2.3e-7 evaluated in fp32)
EXP2_POLY = (1.0000001192092896, 0.6931469440460205, 0.24022120237350464, 0.05550713464617729,
             0.009675540961325169, 0.0013276456156745553)
_P0, _P1, _P2, _P3, _P4, _P5 = (gl.constexpr(c) for c in EXP2_POLY)


@gluon.jit
def _exp2_poly(x):
    """2^x on the FMA pipe (FA4's trick: the MUFU is the scarcer unit), for x <= 0: x = j + f,
    j = rint(x) by the 1.5 * 2^23 rounding trick, f in [-0.5, 0.5]; 2^f by a degree-5 polynomial
    (max relative error 2.3e-7 in fp32, as MUFU.EX2's ~2^-22), times 2^j built from j's bits.
    x <= -127 (masked entries are -inf) gives exactly 0; NaN stays NaN (the clamp is a where, not
    a max, and the power of two is multiplied, not added to NaN's bits)."""
    x = gl.where(x < -127.0, -127.0, x)
    t = x + 12582912.0
    j = t - 12582912.0
    f = x - j
    p = _P5 * f + _P4
    p = p * f + _P3
    p = p * f + _P2
    p = p * f + _P1
    p = p * f + _P0
    two_j = ((t.to(gl.int32, bitcast=True) - 0x4B400000 + 127) << 23).to(gl.float32, bitcast=True)
    return p * two_j


def exp2_poly_reference(x):
    """NumPy float32 twin of ``_exp2_poly`` (same steps and constants), for the CPU tests."""
    import numpy as np

    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        x = np.where(x < np.float32(-127.0), np.float32(-127.0), x)
        t = (x + np.float32(12582912.0)).astype(np.float32)
        j = (t - np.float32(12582912.0)).astype(np.float32)
        f = (x - j).astype(np.float32)
        p = np.float32(EXP2_POLY[5])
        for c in EXP2_POLY[4::-1]:
            p = (p * f + np.float32(c)).astype(np.float32)
        bits = ((t.view(np.int32).astype(np.int64) - 0x4B400000 + 127) << 23) & 0xFFFFFFFF
        two_j = bits.astype(np.uint32).view(np.float32)
        return (p * two_j).astype(np.float32)


@gluon.jit
def _sum_exp2(x, VARIANT: gl.constexpr, POLY: gl.constexpr):
    """Row sums of 2^x (side 2's exponentials feed only l2). POLY 1: all by the polynomial;
    2: every other column by the polynomial, the rest on the MUFU (3: see ``_consumer``)."""
    if POLY == 1:
        out = gl.sum(_exp2_poly(x), axis=1)
    elif POLY == 2:
        xa, xb = gl.split(gl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
        out = gl.convert_layout(gl.sum(_exp2(xa, VARIANT), axis=1) + gl.sum(_exp2_poly(xb), axis=1),
                                gl.SliceLayout(1, x.type.layout))
    else:
        out = gl.sum(_exp2(x, VARIANT), axis=1)
    return out


@gluon.jit
def _new_max(m, s, visible, MASKED: gl.constexpr, RESCALE: gl.constexpr):
    """The row reference after a tile: the running max, or with RESCALE the old reference kept
    while the max grows by at most RESCALE_BITS (FA4's conditional rescaling: exact in exact
    arithmetic, since the reference cancels in lse and KL; the exponentials are then <= 2^8)."""
    if MASKED:
        m_new = gl.maximum(m, gl.max(gl.where(visible, s, float("-inf")), axis=1))
    else:
        m_new = gl.maximum(m, gl.max(s, axis=1))
    if RESCALE:
        m_new = gl.where(m_new > m + RESCALE_BITS, m_new, m)
    return m_new


@gluon.jit
def _shifted(m, s_raw, qk_scale, visible, MASKED: gl.constexpr, RESCALE: gl.constexpr, FOLD: gl.constexpr = 0):
    """One side's scores of a tile taken to bits (rounded once, before the max) and shifted by the
    new row reference: (the new max, the shift, x = s - shift). Masked tiles shift by the safe max
    (an all-invisible row keeps a finite reference).

    FOLD (whole tiles only): the max taken on the raw scores and scaled once per row (rounding is
    monotone and qk_scale > 0, so rn(max(s) * c) is bitwise the max of rn(s * c): the same m), and
    x = fma(s, c, -shift), one FFMA per score instead of FMUL + FADD (-128 instructions per
    128-key tile and thread). x is then rounded once instead of twice (closer to float64, within
    half an ulp of s * c of the two-rounding form's); masked tiles keep ``mul.rn`` + subtract, so that one-key rows
    stay exactly 0 (x = 0 at the max: the FFMA fold left KL ~1e-7 there, docs/design/attention_forward.md v4)."""
    if FOLD and not MASKED:
        m_tile = libdevice.mul_rn(gl.max(s_raw, axis=1), qk_scale)
        m_new = gl.maximum(m, m_tile)
        if RESCALE:
            m_new = gl.where(m_new > m + RESCALE_BITS, m_new, m)
        x = gl.fma(s_raw, qk_scale, -m_new[:, None])
        out = (m_new, m_new, x)
    else:
        s = libdevice.mul_rn(s_raw, qk_scale)
        m_new = _new_max(m, s, visible, MASKED, RESCALE)
        if MASKED:
            shift = _fwd._safe(m_new)
        else:
            shift = m_new
        out = (m_new, shift, s - shift[:, None])
    return out


@gluon.jit
def _shifted_premasked(m, s_masked, qk_scale, RESCALE: gl.constexpr):
    """``_shifted`` of a masked tile whose raw scores are already -inf where invisible (MASK1):
    the max, the exponentials and the sums need no mask of their own (rn(-inf c) - shift = -inf,
    2^-inf = 0); the shift is the safe max (an all-invisible row keeps a finite reference)."""
    s = libdevice.mul_rn(s_masked, qk_scale)
    m_new = _new_max(m, s, 0, False, RESCALE)
    shift = _fwd._safe(m_new)
    return m_new, shift, s - shift[:, None]


@gluon.jit
def _row_sum(x, DEFER: gl.constexpr):
    """Row sums of a tile [WG_M, N]; DEFER: only over each thread's own columns, [WG_M, 4] (the
    wgmma layout spreads a row's columns over the 4 threads of a quad, 2 x N/8 each: the
    reshape to [WG_M, N/8, 4, 2] is a pure relabeling), so the quad's shuffles wait for the end."""
    if DEFER:
        out = gl.sum(gl.sum(gl.reshape(x, [x.shape[0], x.shape[1] // 8, 4, 2]), axis=1), axis=2)
    else:
        out = gl.sum(x, axis=1)
    return out


@gluon.jit
def _per_row(v, like, DEFER: gl.constexpr):
    """A per-row value [WG_M] in the shape of the sums (DEFER: broadcast to ``like``'s [WG_M, 4])."""
    if DEFER:
        out = gl.convert_layout(v, gl.SliceLayout(1, like.type.layout))[:, None]
    else:
        out = v
    return out


@gluon.jit
def _side1_exps(x1, m1, l1, shift1, visible, MASKED: gl.constexpr, VARIANT: gl.constexpr,
                DEFER: gl.constexpr = False):
    """Side 1's exponentials of a tile: (p1, the new l1, alpha1 = the old l1's rescale factor)."""
    if MASKED:
        p1 = _exp2(gl.where(visible, x1, float("-inf")), VARIANT)
    else:
        p1 = _exp2(x1, VARIANT)
    alpha1 = gl.exp2(m1 - shift1)
    l1_new = l1 * _per_row(alpha1, l1, DEFER) + _row_sum(p1, DEFER)
    return p1, l1_new, alpha1


@gluon.jit
def _fold_sub(st, t1, t2, k1, k2, k1_free, k2_free, turn_next, visible, qk_scale1, qk_scale2, zero, ONE,
              W1: gl.constexpr, W2: gl.constexpr, RELEASE: gl.constexpr,
              MASKED: gl.constexpr, VARIANT: gl.constexpr, SCHED: gl.constexpr):
    """Fold one (sub-)tile's scores into the row states (the formulas of _fwd._fwd_key_range,
    same order): wait for S1 (W1 products still in flight after it), fold side 1, then wait for
    S2 (W2 in flight) and fold side 2. RELEASE: this is the slot's last sub-tile; free K1 and K2
    (and with PINGPONG + TURN hand the tensor cores to the other warpgroup: ``turn_next``)."""
    m1, l1, m2, l2, acc = st
    RESCALE: gl.constexpr = _knob(SCHED, "RESCALE")
    s1, k1 = warpgroup_mma_wait(num_outstanding=W1, deps=(t1, k1))
    if RELEASE and not _knob(SCHED, "MERGE"):  # MERGE: one release after the last wait (k2_free)
        mbarrier.arrive(k1_free, count=1)
    s2_raw = s1  # VARIANT 2 (no second product): side 2 folds S1 again
    # MASK1 (masked tiles): the mask applied once to each side's raw scores, and once to the
    # acc term, instead of at the max, the exponentials and the term of each side (5 -> 3 selects
    # per score pair, fewer live predicates)
    PRE: gl.constexpr = MASKED and _knob(SCHED, "MASK1")
    MASK_LATER: gl.constexpr = MASKED and not PRE
    # DEFER: l1, l2, acc kept as per-thread partial row sums [WG_M, 4], reduced once at the end
    DEFER: gl.constexpr = _knob(SCHED, "DEFER")
    # ---- side 1, while S2 is still on the tensor cores
    if PRE:
        m1_new, shift1, x1 = _shifted_premasked(m1, gl.where(visible, s1, float("-inf")), qk_scale1, RESCALE)
    else:
        m1_new, shift1, x1 = _shifted(m1, s1, qk_scale1, visible, MASKED, RESCALE, _knob(SCHED, "FOLD"))
    FENCE: gl.constexpr = _knob(SCHED, "FENCE")
    if FENCE == 1 or (FENCE == 2 and not MASKED):  # 2: whole tiles only (the masked loop spills)
        # the exponentials inside a loop of one trip (ONE is a runtime 1): ptxas schedules
        # within blocks, so it cannot hoist the S2 wait (after the loop) above them
        p1 = zero
        l1_new = l1
        alpha1 = l1
        for _ in range(ONE):
            p1, l1_new, alpha1 = _side1_exps(x1, m1, l1, shift1, visible, MASK_LATER, VARIANT, DEFER)
    else:
        p1, l1_new, alpha1 = _side1_exps(x1, m1, l1, shift1, visible, MASK_LATER, VARIANT, DEFER)

    # ---- side 2
    if VARIANT != 2:
        s2_raw, k2 = warpgroup_mma_wait(num_outstanding=W2, deps=(t2, k2))
    if RELEASE and _knob(SCHED, "PINGPONG") and _knob(SCHED, "TURN") and not _knob(SCHED, "RELTURN"):
        mbarrier.arrive(turn_next, count=1)  # this tile's products are done: the other's turn
    if RELEASE:
        mbarrier.arrive(k2_free, count=1)
    if PRE:
        m2_new, shift2, x2 = _shifted_premasked(m2, gl.where(visible, s2_raw, float("-inf")), qk_scale2, RESCALE)
    else:
        m2_new, shift2, x2 = _shifted(m2, s2_raw, qk_scale2, visible, MASKED, RESCALE, _knob(SCHED, "FOLD"))
    log_ratio = x1 - x2  # the shifted log-ratio (see _fwd._finalize)
    if DEFER:
        if MASK_LATER:
            sum2 = _row_sum(_exp2(gl.where(visible, x2, float("-inf")), VARIANT), True)
        else:
            sum2 = _row_sum(_exp2(x2, VARIANT), True)
        if MASKED:
            term = gl.where(visible, p1 * log_ratio, 0.0) if MASK_LATER else \
                p1 * gl.maximum(log_ratio, -3.4028234663852886e38)
        else:
            term = p1 * log_ratio
    elif PRE:
        sum2 = _sum_exp2(x2, VARIANT, _knob(SCHED, "POLY"))
        # invisible entries: x1 - x2 = -inf - -inf = NaN and p1 = 0; max(NaN, -FLT_MAX) is
        # -FLT_MAX (max.f32 returns the non-NaN operand), times p1 = 0: exactly 0 without the
        # mask (no predicate live this late). A NaN in a visible key: in K1, p1 and the term are
        # NaN; in K2 only, the term is -FLT_MAX p1 (not NaN), but l2 is NaN, so kl and lse2 are.
        term = p1 * gl.maximum(log_ratio, -3.4028234663852886e38)
    elif MASKED:
        sum2 = _sum_exp2(gl.where(visible, x2, float("-inf")), VARIANT, _knob(SCHED, "POLY"))
        # masked entries add exactly 0: p1 * log_ratio would be 0 * NaN for a NaN key
        term = gl.where(visible, p1 * log_ratio, 0.0)
    else:
        sum2 = _sum_exp2(x2, VARIANT, _knob(SCHED, "POLY"))
        term = p1 * log_ratio
    alpha2 = gl.exp2(m2 - shift2)
    if VARIANT != 3:
        # re-reference the old acc to the new maxima: each old term moves by -(dm1 - dm2)
        moved = (shift1 - _fwd._safe(m1)) - (shift2 - _fwd._safe(m2))
        acc = (acc - l1 * _per_row(moved, acc, DEFER)) * _per_row(alpha1, acc, DEFER) + _row_sum(term, DEFER)
    l2 = l2 * _per_row(alpha2, l2, DEFER) + sum2
    return m1_new, l1_new, m2_new, l2, acc


@gluon.jit
def _vote(bad, VOTE: gl.constexpr):
    """Any row of the warpgroup bad (0 or 1, uniform). VOTE 0: one reduction over the rows;
    1: each warp's 16 rows by shuffles, the 4 warps' votes through a shared buffer of 4 ints read
    back whole by every thread (one barrier, warp-uniform addresses)."""
    if VOTE == 1:
        W: gl.constexpr = bad.shape[0] // 16  # warps: 16 rows each (4; 8 with UNITE)
        per_warp = gl.max(gl.reshape(bad, [W, 16]), axis=1)
        buf = gl.allocate_shared_memory(gl.int32, [W], gl.SwizzledSharedLayout(1, 1, 1, order=[0]), per_warp)
        out = gl.max(buf.load(gl.BlockedLayout([W], [32], [W], [0])), axis=0)
    else:
        out = gl.max(bad, axis=0)
    return out


LAZY_LIMIT = gl.constexpr(256.0)  # VARIANT 4: a tile's row sum of 2^x at the old reference at most 2^RESCALE_BITS


@gluon.jit
def _fold_sub_lazy(st, t1, t2, q1, q2, k1, k2, k1_free, k2_free, turn_next, qk_scale1, qk_scale2, zero, ONE,
                   SCHED: gl.constexpr, VOTE: gl.constexpr = 0, k1_smem=0, k2_smem=0, slot=0):
    """VARIANT 4 (``lazy_max``), whole tiles after the first: _fold_sub without the row maxima
    while they barely move. Both sides are taken at the old references, x = fma(s, c, -m) (no
    FMNMX, no max shuffles); where every row's sums stay <= LAZY_LIMIT (every x <= 8: the
    exponentials' range under RESCALE; exact, the reference cancels in lse and KL) the tile is
    folded with the references kept (alpha = 1, nothing moves). Otherwise (a max grew by more
    than 8 bits; -inf references, +inf or NaN sums) the warpgroup issues S1 and S2 again (the key
    slot is released only after the vote) and folds them by _fold_sub: bitwise the default's
    fold. One warpgroup-wide vote per tile (a reduction through shared memory)."""
    m1, l1, m2, l2, acc = st
    s1, k1 = warpgroup_mma_wait(num_outstanding=1, deps=(t1, k1))
    x1 = gl.fma(s1, qk_scale1, -m1[:, None])
    p1 = gl.exp2(x1)
    sum1 = gl.sum(p1, axis=1)
    s2, k2 = warpgroup_mma_wait(num_outstanding=0, deps=(t2, k2))
    x2 = gl.fma(s2, qk_scale2, -m2[:, None])
    sum2 = gl.sum(gl.exp2(x2), axis=1)
    bad = gl.where((sum1 <= LAZY_LIMIT) & (sum2 <= LAZY_LIMIT), 0, 1)  # NaN and +inf sums are bad
    l1_f = l1 + sum1  # the fast fold above the vote (VARIANT 4's SASS unchanged; 5 spills less)
    l2_f = l2 + sum2
    acc_f = acc + gl.sum(p1 * (x1 - x2), axis=1)
    if _vote(bad, VOTE) == 0:
        l1 = l1_f
        l2 = l2_f
        acc = acc_f
        if _knob(SCHED, "PINGPONG") and _knob(SCHED, "TURN") and not _knob(SCHED, "RELTURN"):
            mbarrier.arrive(turn_next, count=1)
        if not _knob(SCHED, "MERGE"):
            mbarrier.arrive(k1_free, count=1)
        mbarrier.arrive(k2_free, count=1)
    else:
        if VOTE:  # the slot's descriptors rebuilt here, from an opaque copy of the slot (not live across the fold)
            so = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [slot], gl.int32, False, 1)
            k1 = k1_smem.index(so).reshape(k1.shape)
            k2 = k2_smem.index(so).reshape(k2.shape)
        t1 = warpgroup_mma(q1, k1.permute((1, 0)), zero, use_acc=False, is_async=True)
        t2 = warpgroup_mma(q2, k2.permute((1, 0)), zero, use_acc=False, is_async=True)
        m1, l1, m2, l2, acc = _fold_sub((m1, l1, m2, l2, acc), t1, t2, k1, k2, k1_free, k2_free, turn_next, 0,
                                        qk_scale1, qk_scale2, zero, ONE, 1, 0, True, False, 0, SCHED)
    return m1, l1, m2, l2, acc


# ---- side 2 first (ORDER) and the two-tile lookahead (LOOK): the same formulas as _fold_sub,
# with the products issued S2 then S1. Side 2 is folded while S1 runs; it leaves only x2 live (its
# exponentials feed l2 alone), where side 1 first leaves p1 and x1 live across the S2 wait (192
# registers with the S2 accumulator, the pressure under which ptxas sinks the exponentials).

@gluon.jit
def _half2(m2, l2, s2_raw, visible, qk_scale2, ONE, MASKED: gl.constexpr, VARIANT: gl.constexpr,
           SCHED: gl.constexpr):
    """Side 2 of a tile, folded first: (the new m2, the new l2, x2, moved2 = shift2 - safe(old m2))."""
    RESCALE: gl.constexpr = _knob(SCHED, "RESCALE")
    POLY: gl.constexpr = _knob(SCHED, "POLY")
    FENCE: gl.constexpr = _knob(SCHED, "FENCE")
    m2_new, shift2, x2 = _shifted(m2, s2_raw, qk_scale2, visible, MASKED, RESCALE, _knob(SCHED, "FOLD"))
    if MASKED:
        e2 = gl.where(visible, x2, float("-inf"))
    else:
        e2 = x2
    if FENCE == 1 or (FENCE == 2 and not MASKED):  # the one-trip loop of _fold_sub: ptxas cannot
        sum2 = l2  # sink these exponentials below the S1 wait (after the loop)
        for _ in range(ONE):
            sum2 = _sum_exp2(e2, VARIANT, POLY)
    else:
        sum2 = _sum_exp2(e2, VARIANT, POLY)
    alpha2 = gl.exp2(m2 - shift2)
    l2_new = l2 * alpha2 + sum2
    return m2_new, l2_new, x2, shift2 - _fwd._safe(m2)


@gluon.jit
def _half1(m1, l1, acc, s1_raw, x2, moved2, visible, qk_scale1, ONE, MASKED: gl.constexpr, VARIANT: gl.constexpr,
           SCHED: gl.constexpr):
    """Side 1 of a tile after side 2 (``_half2``'s x2, moved2): (the new m1, l1, acc). FENCE: its
    exponentials in a one-trip loop (LOOK: so that they stay above the next product's wait)."""
    RESCALE: gl.constexpr = _knob(SCHED, "RESCALE")
    FENCE: gl.constexpr = _knob(SCHED, "FENCE")
    m1_new, shift1, x1 = _shifted(m1, s1_raw, qk_scale1, visible, MASKED, RESCALE, _knob(SCHED, "FOLD"))
    if FENCE == 1 or (FENCE == 2 and not MASKED):
        p1 = x1
        l1_new = l1
        alpha1 = l1
        for _ in range(ONE):
            p1, l1_new, alpha1 = _side1_exps(x1, m1, l1, shift1, visible, MASKED, VARIANT)
    else:
        p1, l1_new, alpha1 = _side1_exps(x1, m1, l1, shift1, visible, MASKED, VARIANT)
    log_ratio = x1 - x2  # the shifted log-ratio (see _fwd._finalize)
    if MASKED:
        term = gl.where(visible, p1 * log_ratio, 0.0)  # masked entries add exactly 0 (NaN keys)
    else:
        term = p1 * log_ratio
    if VARIANT != 3:
        moved = (shift1 - _fwd._safe(m1)) - moved2  # as _fold_sub: (dm1) - (dm2)
        acc = (acc - l1 * moved) * alpha1 + gl.sum(term, axis=1)
    return m1_new, l1_new, acc


@gluon.jit
def _fold_sub_s2first(st, t1, t2, k1, k2, k1_free, k2_free, turn_next, visible, qk_scale1, qk_scale2, ONE,
                      RELEASE: gl.constexpr, MASKED: gl.constexpr, VARIANT: gl.constexpr, SCHED: gl.constexpr):
    """ORDER: S2 was issued before S1; wait for S2 (S1 in flight), fold side 2, wait for S1, fold
    side 1. VARIANT 2 (no second product): t1 is t2, side 2 folds S1."""
    m1, l1, m2, l2, acc = st
    if VARIANT == 2:
        s2_raw, k1 = warpgroup_mma_wait(num_outstanding=0, deps=(t1, k1))
    else:
        s2_raw, k2 = warpgroup_mma_wait(num_outstanding=1, deps=(t2, k2))
    if RELEASE and not _knob(SCHED, "MERGE"):  # MERGE: one release after the last wait (k1_free)
        mbarrier.arrive(k2_free, count=1)
    m2, l2, x2, moved2 = _half2(m2, l2, s2_raw, visible, qk_scale2, ONE, MASKED, VARIANT, SCHED)
    s1_raw = s2_raw
    if VARIANT != 2:
        s1_raw, k1 = warpgroup_mma_wait(num_outstanding=0, deps=(t1, k1))
    if RELEASE and _knob(SCHED, "PINGPONG") and _knob(SCHED, "TURN") and not _knob(SCHED, "RELTURN"):
        mbarrier.arrive(turn_next, count=1)  # this tile's products are done: the other's turn
    if RELEASE:
        mbarrier.arrive(k1_free, count=1)
    m1, l1, acc = _half1(m1, l1, acc, s1_raw, x2, moved2, visible, qk_scale1, ONE, MASKED, VARIANT, SCHED)
    return m1, l1, m2, l2, acc
