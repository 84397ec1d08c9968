"""The attention kernels' launch configurations: the forward and backward candidate lists the tuner
times (pruned by shape), the backward kernel variants, and the automatic rules ``auto_split_k``
(forward key splits) and ``auto_bwd_mode`` (fused or separate backward), read off the H200
measurements in ``bench/results/``.

By default nothing is timed: the first candidate of each shape class runs, and ``SHAPE_RULES``
(measured winners, each citing the committed CSV row that justifies it) put the winner first,
so a new shape compiles only the kernels it runs. ``STREAMKL_AUTOTUNE=1`` opts into measured
tuning (``streamkl_gpu/_core/tuning.py``), on a bounded slice of long problems."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from streamkl_gpu._core import runtime as _runtime
from streamkl_gpu._core import tuning as _tuning
from streamkl_gpu._core.runtime import cdiv, interpreting


@dataclass(frozen=True)
class FwdConfig:
    """One launch of the forward Triton kernel (``attention/triton/fwd.py``): a query tile of
    ``block_m`` rows against key tiles of ``block_n``, keys read through TMA descriptors when
    ``use_tma``, the keys split over ``splits`` programs per query tile (1: the one-pass kernel;
    more: the split-K kernel whose partial states a combine pass merges)."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = False
    splits: int = 1


@dataclass(frozen=True)
class BwdConfig:
    """One launch of a backward Triton kernel (``attention/triton/bwd.py``), the dK kernel (key
    tiles of ``block_n`` stationary, query tiles of ``block_m`` streamed) or the dQ kernel (the
    other way round); ``variant``: the kernel variant's parts joined with "+" (``BWD_VARIANTS``;
    "ptr": pointer loads, the first kernels)."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    variant: str = "ptr"


@dataclass(frozen=True)
class ShapeRule:
    """The measured winner of one shape class, run first (untimed by default): ``kernel`` ("fwd",
    "bwd_dk", "bwd_dq") and ``shape_class`` name the class, ``config`` its winner; ``csv`` and
    ``row_prefix`` the committed CSV and the first characters of the row that justify it (a test
    checks that the file holds that row and that the row names the config); ``shows``: what the row
    shows; ``replaces``: the candidate the winner supersedes (the same tile in a variant the row
    measured it against), left out of the list the tuner times, or None."""
    kernel: str
    shape_class: tuple
    config: Union[FwdConfig, BwdConfig]
    csv: str
    row_prefix: str
    shows: str
    replaces: Union[FwdConfig, BwdConfig, None] = None


# Below this many keys the forward is launch-bound and the TMA path measured slower (H200, 1K
# tokens: 0.21 ms vs 0.11 with pointer loads; 2K: 0.21 vs 0.24, TMA ahead from there on;
# bench/results/2026-11-29_h200_97028b2/bench.csv vs 2026-11-29_h200_f87f3b3/bench.csv). Presumably the
# per-launch cost of encoding two host descriptors; not profiled.
TMA_MIN_KEYS = 2048

# Below this many keys the backward runs without TMA descriptors (its pointer variants): there it
# is launch-bound, and each call paid Triton's per-launch encoding of up to nine host descriptors
# for its two kernels, plus the rows pre-pass's launch (H200, B=1 H=1 N_Q=1 N_K=64 D=64, setting 1:
# 33 of the 284 ms of 300 profiled fwd+bwd calls in Triton's descriptor wrapper,
# bench/results/2026-12-04_h200_02748e6/host_profile.txt). Every point of the benchmark
# grids has at least this many keys, so none of their measured configs moves.
BWD_TMA_MIN_KEYS = 1024

# fp32 inputs promise fp32 accuracy: their dots run in IEEE fp32 on the FMA units (no tensor
# cores); large tiles then unroll into huge code that takes minutes to compile, so small tiles.
_IEEE_TILE = dict(block_m=32, block_n=32, num_warps=4, num_stages=2)

# Tuning times every candidate; past this much work per call (score entries times head-dim
# sum: 32 heads x 16K x 16K x (128 + 128), about 12 ms of forward on an H200) the candidates are
# timed on a bounded slice of the problem instead (``tuning_slice``), so that a first call at
# 512K tokens pays seconds, not a minute, beyond compiling.
TUNING_WORK_LIMIT = 32 * 16384 * 16384 * 256


# The shape rule: what runs untimed (the default) is the first candidate of a shape class, and
# these entries move the measured winner of a class to the front. Each cites the committed CSV
# and the first characters of the row that justify it (tests/test_tuning.py checks that the file
# holds that row and that the row names the config). Classes without an entry keep their list's
# order.
_BWD_MUSTS = "bench/results/2026-12-01_h200_3ab8703/bwd_musts.csv"
_FWD_TMA = "bench/results/2026-11-29_h200_97028b2/fwd_tma_configs.csv"
_BWD_BOTH = "bench/results/2026-12-06_h100_726d126/bwd_both_rule.csv"
_BWD_HEAVY = "bench/results/2026-12-07_h100_9317ca2/bwd_both_heavy.csv"
_BWD_ONE_HEAVY = "bench/results/2026-12-07_h100_b37bfd7/bwd_one_side_heavy.csv"
_BWD_BOTH_GEXP = "bench/results/2026-12-07_h100_b840538/bwd_both_gexp.csv"
_PACKED_FWD = "bench/results/2026-12-07_h100_6995b54/varlen_fwd_tiles_summary.csv"
SHAPE_RULES = (
    ShapeRule("fwd", ("d128", "tma", "full"),
              FwdConfig(block_m=128, block_n=32, num_warps=8, num_stages=3, use_tma=True), _FWD_TMA,
              "fwd,streamkl cfg=128/32/8/3/True,fwd,0,16384,16384,", "16K non-causal 12.07 ms, the best config there"),
    ShapeRule("fwd", ("d128", "tma", "causal"),
              FwdConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, use_tma=True), _FWD_TMA,
              "fwd,streamkl cfg=128/64/8/3/True,fwd,1,16384,16384,", "16K causal 5.87 ms, the best config there"),
    # packed sequences (attention_kl_varlen, the Triton forward): every TMA tile forced in turn, 5 interleaved
    # rounds, at 24K tokens (documents of 2K-8K), 80K (1K-16K) and 256K (64K-128K, H = 8)
    ShapeRule("fwd", ("d128", "tma", "packed causal"),
              FwdConfig(block_m=64, block_n=64, num_warps=4, num_stages=2, use_tma=True), _PACKED_FWD,
              "varlen_fwd_80k_c,cfg=64/64/4/2/True,", "80K causal 12.35 ms against 13.24 for the dense rule's "
              "128/32 and 13.61 for 128/64; the best tile at 24K and 256K too"),
    ShapeRule("fwd", ("d128", "tma", "packed full"),
              FwdConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, use_tma=True), _PACKED_FWD,
              "varlen_fwd_80k_nc,cfg=128/64/8/3/True,", "80K non-causal 24.04 ms against 25.88 for 128/32; the best "
              "tile at 256K (0.90x), and at 24K within 0.3 % of the timed pick"),
    ShapeRule("bwd_dk", ("d<=128", "tma", "separate", "one side"),
              BwdConfig(block_m=64, block_n=128, num_warps=8, num_stages=3, variant="tma+trans+fold+rows"), _BWD_MUSTS,
              "bwd,auto,N=8K s1,", "the tuned plan at 8K/16K, causal or not, s1 and s2, GQA, D1 != D2"),
    ShapeRule("bwd_dq", ("d<=128", "tma", "separate", "one side"),
              BwdConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, variant="tma+fold+heavy"), _BWD_ONE_HEAVY,
              "bwd,after,s1 N=256K H=4 D=128 causal,", "the tuned tile with its heaviest query tiles first (causal; "
              "without a causal mask the same kernel as \"tma+fold\"): the no-regression rounds at 8K and 16K "
              "(settings 1 and 2, D = 96) and the long rows beside it",
              replaces=BwdConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, variant="tma+fold")),
    ShapeRule("bwd_dk", ("d<=128", "tma", "separate", "both sides"),
              BwdConfig(block_m=32, block_n=64, num_warps=4, num_stages=3, variant="tma+trans+fold+rows+pack+gexp"),
              _BWD_BOTH_GEXP, "step,after,both N=16K H=32 causal,", "the tuned tile with |g| folded into its "
              "exponentials (four packed row constants instead of six): the step under the no-regression rule "
              "0.942-0.946x at 8K and 16K (compare_summary.csv beside it), the dK kernel 0.87-0.92x from 16K to "
              "1M tokens (bwd_kernel_split.csv); the packed six were the tuned tile's 0.887x at 8K "
              "(bench/results/2026-12-01_h200_d3b757b/bwd_kernels.csv, and " + _BWD_BOTH + ")",
              replaces=BwdConfig(block_m=32, block_n=64, num_warps=4, num_stages=3, variant="tma+trans+fold+rows+pack")),
    ShapeRule("bwd_dq", ("d<=128", "tma", "separate", "both sides"),
              BwdConfig(block_m=64, block_n=32, num_warps=4, num_stages=3, variant="tma+fold+heavy"), _BWD_HEAVY,
              "bwd,after,both N=256K H=4 causal,", "the tuned tile with its heaviest query tiles first (causal; "
              "without a causal mask the same kernel as \"tma+fold\"): the no-regression rounds at 8K and 16K "
              "and the long rows beside it",
              replaces=BwdConfig(block_m=64, block_n=32, num_warps=4, num_stages=3, variant="tma+fold")),
    ShapeRule("bwd_dk", ("d<=128", "tma", "fused", "one side", "long queries"),
              BwdConfig(block_m=64, block_n=128, num_warps=8, num_stages=2, variant="tma+trans+fold+rows+reduce"),
              _BWD_MUSTS, "bwd,auto,nq512 nk32K s2,", "the tuned plan at N_Q 512 x N_K 32K"),
    ShapeRule("bwd_dk", ("d<=128", "tma", "fused", "one side", "short queries"),
              BwdConfig(block_m=32, block_n=128, num_warps=8, num_stages=3, variant="ptr"), _BWD_MUSTS,
              "bwd,auto,nq16 nk32K s1,", "the tuned plan at N_Q 16 x N_K 32K"),
)
_RULES = {(rule.kernel, rule.shape_class): rule for rule in SHAPE_RULES}
# fused dK: N_Q below this is "short queries" (measured at 16 and 512 only; the boundary between
# them is a guess: one or two query tiles per key tile, where a TMA reduce-add per tile buys little)
RULE_SHORT_QUERIES = 256


def rule_first(candidates, kernel, cls):
    """``candidates`` with the shape rule's config for ``(kernel, cls)`` first (added when the
    list lacks it) and without the config the rule replaces; unchanged where no rule entry covers
    the class."""
    rule = _RULES.get((kernel, cls))
    if rule is None:
        return list(candidates)
    return [rule.config] + [c for c in candidates if c not in (rule.config, rule.replaces)]


def tuning_slice(dims, causal):
    """``(n_q, n_k)`` of a bounded slice of the problem to time candidates on, or None (time the
    problem itself). The slice keeps every batch and head, the first ``n_q`` query rows and the
    keys they see: with bottom-right causal alignment, rows ``[0, n_q)`` see keys
    ``< n_q + (N_K - N_Q)``, so the sliced problem is causal in the same way, tile for tile."""
    def work(nq, nk):
        pairs = nq * nk / 2 if causal and nq == nk else nq * nk
        return dims.B * dims.H * pairs * (dims.D1 + dims.D2)

    if work(dims.NQ, dims.NK) <= TUNING_WORK_LIMIT:
        return None
    nq = dims.NQ
    while nq > 1024:
        nq //= 2
        nk = min(dims.NK, nq + max(0, dims.NK - dims.NQ)) if causal else min(dims.NK, max(nq, 16384))
        if work(nq, nk) <= TUNING_WORK_LIMIT:
            return nq, nk
    return nq, (min(dims.NK, nq + max(0, dims.NK - dims.NQ)) if causal else min(dims.NK, 16384))


def _fwd(tiles, use_tma):
    """Forward configs of ``(block_m, block_n, num_warps, num_stages)`` tiles."""
    return [FwdConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st, use_tma=use_tma) for bm, bn, w, st in tiles]


def fwd_candidates(dims, d_pad, split, ieee=False, tma=False, causal=False, packed=False):
    """:class:`FwdConfig` candidates (``splits`` 1: the caller sets the key splits), pruned by shape.
    ``packed``: the packed-sequence forward (``attention_kl_varlen``), whose shape rule is its own.

    ``tma``: the key tensors can be read through TMA descriptors (Hopper, aligned strides). At
    D = 128 the best TMA config beat the best pointer config in every measured case (H200, 8K/16K,
    causal or not: bench/results/2026-11-29_h200_97028b2/fwd_tma_configs.csv), so pointer configs are not
    tried there; at other head dims both kinds are candidates (not measured at scale).
    """
    if interpreting():
        block_m, block_n = _runtime.INTERPRETER_BLOCK
        return [FwdConfig(block_m=block_m, block_n=block_n, num_warps=1, num_stages=1, use_tma=tma)]
    if ieee:
        return [FwdConfig(block_m=16, block_n=32, num_warps=4, num_stages=2) if split else FwdConfig(**_IEEE_TILE)]
    if split:
        bm = 16 if dims.NQ <= 16 else (32 if dims.NQ <= 32 else 64)
        cands = [(bm, 128, 4, 3), (bm, 64, 4, 3)] if d_pad <= 128 else [(bm, 64, 4, 2), (bm, 32, 4, 2)]
        return _fwd(cands, False)
    tma_only = False  # tiles (block_m, block_n, num_warps, num_stages)
    if d_pad <= 64:
        cands = [(128, 64, 4, 3), (128, 128, 8, 3)]
        tma_cands = [(128, 64, 4, 3), (128, 128, 8, 2)]
    elif d_pad <= 128:
        cands = [(128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (128, 128, 8, 2)]
        # measured best: 128/32/8/3 (8K, 16K non-causal), 128/64/8/3 (16K causal), 64/64/4/2 (8K causal)
        tma_cands = [(128, 32, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2)]
        tma_only = True
    else:
        cands = [(64, 64, 4, 2), (64, 32, 4, 2)]
        tma_cands = [(64, 64, 4, 2), (64, 32, 4, 3)]
    if not tma:
        return _fwd(cands, False)
    cands = _fwd(tma_cands, True) + ([] if tma_only else _fwd(cands, False))
    cls = ("packed " if packed else "") + ("causal" if causal else "full")
    return rule_first(cands, "fwd", ("d128", "tma", cls)) if tma_only else cands


def _bwd(tiles, variant):
    """Backward configs of ``(block_m, block_n, num_warps, num_stages)`` tiles."""
    return [BwdConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st, variant=variant) for bm, bn, w, st in tiles]


def bwd_candidates(d_pad, both, kind, ieee=False):
    """:class:`BwdConfig` candidates of the first kernels (variant "ptr") of the dK (``kind="dk"``)
    or dQ kernel."""
    if interpreting():
        block_m, block_n = _runtime.INTERPRETER_BLOCK
        return [BwdConfig(block_m=block_m, block_n=block_n, num_warps=1, num_stages=1)]
    if ieee:
        return [BwdConfig(**_IEEE_TILE)]
    if kind == "dq":
        if d_pad <= 128 and not both:
            return _bwd([(128, 64, 8, 2), (64, 64, 4, 2)], "ptr")
        return _bwd([(64, 64, 8, 2), (64, 32, 4, 2)], "ptr")
    # dk (block_m = query tile, block_n = key tile held in registers)
    if d_pad <= 128 and not both:
        return _bwd([(64, 128, 8, 2), (32, 128, 8, 3)], "ptr")
    return _bwd([(64, 64, 8, 2), (32, 64, 4, 2)], "ptr")


# Backward kernel variants (streamkl_gpu/attention/triton/bwd.py constexprs), named by their parts joined with "+":
#   "ptr"     pointer loads, query-major tiles (the kernels as measured up to 2026-12-01)
#   "tma"     every operand tile through TMA tensor descriptors (Hopper; USE_TMA)
#   "trans"   dK kernel on key-major tiles, dS^T in registers for dK += dS^T Q (TRANS)
#   "fold"    fewer fp32 ops per score; the dQ kernel applies the row factors once (FOLD)
#   "reduce"  fused dQ by one TMA reduce-add per tile instead of per-element atomics (DQ_REDUCE)
#   "rows"    the dK kernel's per-row constants precomputed by a pre-pass, read by TMA (ROWS; needs
#             "tma" and "fold")
#   "pack"    with "rows": the six constants side by side per row, one TMA load per query tile (ROWS_PACKED)
#   "poly"    setting 1: half of P2's exponentials on the FMA pipe (POLY; FA4's exp2 emulation)
#   "gexp"    with "pack", both sides, separate dK kernel: |g| folded into the exponentials' row
#             offsets, four packed row constants instead of six, sigma applied to dK once (GEXP)
#   "heavy"   causal dQ kernel: the query tiles with the most keys launched first (HEAVY_FIRST)
#   "rN"      launch option: at most N registers per thread (ptxas .maxnreg; _launch._launch_opts)
# STREAMKL_BWD_VARIANT=<name> restricts the candidates to that variant (tests, the GPU bench);
# unset, the tuner times all of them and keeps the fastest.
BWD_VARIANTS = ("ptr", "tma", "tma+trans", "tma+fold", "tma+trans+fold", "tma+trans+reduce",
                "tma+trans+fold+reduce", "tma+trans+fold+rows", "tma+trans+fold+rows+reduce",
                "trans", "fold", "trans+fold", "tma+trans+fold+rows+heavy",
                "tma+trans+fold+rows+pack", "tma+trans+fold+rows+pack+reduce", "tma+trans+fold+rows+pack+heavy",
                "tma+trans+fold+rows+pack+poly", "tma+trans+fold+rows+pack+gexp")


def bwd_variant(forced=None):
    """The variant STREAMKL_BWD_VARIANT forces, or None."""
    name = forced if forced is not None else _runtime.env("STREAMKL_BWD_VARIANT")
    if not name:
        return None
    if name not in BWD_VARIANTS:
        raise ValueError(f"STREAMKL_BWD_VARIANT must be one of {BWD_VARIANTS}, got {name!r}")
    return name


def bwd_variant_candidates(d_pad, both, kind, ieee=False, tma=False, fused=False, few=False, n_q=None):
    """:class:`BwdConfig` candidates of the dK (``kind="dk"``) or dQ kernel, every variant.

    The old configs (``bwd_candidates``, variant "ptr") stay candidates; with TMA-capable inputs
    (``tma``) the descriptor variants join them. Chosen before a GPU measured them (a script
    since removed, ``git show b7066de:bench/bwd_gpu.py``, then timed them against each other:
    bench/results/2026-12-01_h200_2a98499/bwd_variants.csv): FlashAttention-2/3's choice at
    D = 128 for the key-stationary loop is 128 keys x 64 queries, 8 warps; the dQ loop 128 queries
    x 64 keys. ``few`` (problems
    past TUNING_WORK_LIMIT, timed on a bounded slice): one new candidate, so that a first call at
    long N pays one more timing, not three. The shape rule's config
    (``SHAPE_RULES``; ``n_q``: the query rows, for the fused dK's classes) comes first.
    """
    forced = bwd_variant()
    if forced is not None:
        forced = _kernel_variant(forced, kind, fused)
        if "tma" in forced.split("+") and not tma:
            if not interpreting():
                raise ValueError(f"STREAMKL_BWD_VARIANT={forced!r} needs TMA-capable inputs (Hopper, aligned)")
            # CPU tensors not aligned: the same variant without descriptors (and so without the reduce)
            forced = _kernel_variant(forced.replace("tma", "").replace("reduce", "").replace("rows", "").replace("pack", "")
                                     .replace("gexp", ""),
                                     kind, fused)
    if interpreting():
        block_m, block_n = _runtime.INTERPRETER_BLOCK
        return [BwdConfig(block_m=block_m, block_n=block_n, num_warps=1, num_stages=1, variant=forced or "ptr")]
    old = bwd_candidates(d_pad, both, kind, ieee)
    if ieee:
        return old
    # tiles (block_m, block_n, num_warps, num_stages) of the new variants
    if d_pad <= 128 and not both:
        tiles = {"dk": [(64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 2)],
                 # dQ: 3 stages first (bench/results/2026-12-01_h200_121408f/bwd_sweep.csv, 8K,
                 # setting 2, the dQ kernel alone: 128x64x8x3 2.54 ms, 128x64x8x2 2.91): the one new
                 # candidate of long problems ("few")
                 "dq": [(128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3)]}[kind]
    else:
        # dK: 64 keys make one warpgroup's rows (key-major tiles): 4 warps; 8 warps would split the
        # 64 rows over two warpgroups
        tiles = {"dk": [(32, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 2), (64, 64, 8, 2)],
                 "dq": [(64, 64, 8, 2), (64, 32, 4, 3)]}[kind]
    if forced is not None:  # every tile shape of that variant (the old configs for "ptr")
        return old if forced == "ptr" else _bwd(tiles, forced)
    # the tuner's default set: the old configs and the expected best new ones (SASS from the
    # offline sm_90 compile of a script since removed, ``git show b7066de:bench/bwd_sass.py``,
    # triton 3.6, D = 128, setting 1 fused: old 1718 / 2400
    # instructions per key-tile loop (whole / masked) with 259 spill stores, rows+reduce 529 / 766
    # and none; tile 32 x 128 / 4 warps spills, 64 x 64 / 4 warps is twice the instructions per score)
    # The separate dK kernel reads its row constants packed (one TMA load per query tile): an H200 run
    # (H200, 8K, the kernel alone) 64x128x8x3 pack vs rows s1 3.365 / 3.374 ms, s2
    # 3.306 / 3.483, causal s1 1.893 / 1.878, s2 1.779 / 1.839; N_Q 512 x N_K 32K 1.083 / 1.123 (s1),
    # 1.063 / 1.113 (s2); both settings 32x64x4x3 4.624 / 5.213. The fused kernel keeps "rows": its
    # pack form was 0.97-1.03x (N_Q 16 and 512, N_K 32K), no gain. Not in the default set (a selectable
    # variant, STREAMKL_BWD_VARIANT=tma+trans+fold+rows+pack): at one setting it is within the runs'
    # ~5 % noise (an H200 run: 3.369 / 3.374 s1, 3.390 / 3.424 s2), a check too short to move the
    # default plan off the one an H200 run measured against SDPA and the old kernels. With both
    # settings it is the rule's (SHAPE_RULES: 0.887x there).
    if kind == "dk":
        names = (["tma+trans+fold+rows+reduce", "tma+trans+fold+reduce"] if fused else
                 ["tma+trans+fold+rows", "tma+trans+fold"])
        if not tma:
            names = ["trans+fold"]
    else:
        names = ["tma+fold"] if tma else ["fold"]
    cls = None  # the shape rule's class: TMA tiles up to D = 128 only
    if tma and d_pad <= 128:
        cls = ("d<=128", "tma", "fused" if fused else "separate", "both sides" if both else "one side")
        if fused:
            cls += ("short queries" if n_q is not None and n_q < RULE_SHORT_QUERIES else "long queries",)
    if few:  # the old configs and one new one: the rule's (added by rule_first) or the first tile
        cands = old + ([] if ("bwd_" + kind, cls) in _RULES else _bwd(tiles[:1], names[0]))
    else:
        cands = old + [c for n in names for c in _bwd(tiles[:1], n)] + _bwd(tiles[1:2], names[0])
    return cands if cls is None else rule_first(cands, "bwd_" + kind, cls)


def varlen_bwd_candidates(d_pad, both, kind, ieee=False, fused=False, causal=False):
    """Candidates of the packed backward's dK (``kind="dk"``) or dQ kernel (``attention/varlen.py``,
    the first one untimed by default; ``STREAMKL_AUTOTUNE=1`` times them below TUNING_WORK_LIMIT).

    Packed sequences take no TMA descriptors, so the dense kernels' pointer-load forms: the
    key-major dK tile with folded row factors (``"trans+fold"``) and the folded dQ kernel
    (``"fold"``; causal: ``"fold+heavy"``, each sequence's last query tiles launched first, the
    order of the varlen forward) come first, then the old configs, where D <= 128: the dense
    rules' tiles of one trained side or of both (which take the same parts with TMA; the
    both-sides packed step 0.710x the old configs' on an H100,
    bench/results/2026-12-07_h100_31f6919/compare_summary.csv). Not the dense list's other
    key-major tile for both sides, 32 x 128 with 8 warps: it asks 238,080 bytes of shared memory
    in the fused kernel, over Hopper's 232,448 (triton 3.6, sm_90). Wider heads: the old configs
    alone. A forced variant (``STREAMKL_BWD_VARIANT``), fp32 inputs and the interpreter keep
    :func:`bwd_variant_candidates`'s list.
    """
    if bwd_variant() is not None or interpreting() or ieee:
        return bwd_variant_candidates(d_pad, both, kind, ieee, tma=False, fused=fused, few=True)
    old = bwd_candidates(d_pad, both, kind)
    if d_pad > 128:
        return old
    order = "fold+heavy" if causal else "fold"
    if both:  # the dense both-sides rules' tiles ("gexp" needs the packed rows, so TMA)
        new = (BwdConfig(block_m=32, block_n=64, num_warps=4, num_stages=3, variant="trans+fold") if kind == "dk" else
               BwdConfig(block_m=64, block_n=32, num_warps=4, num_stages=3, variant=order))
    elif kind == "dk":  # (the dense rule's tile in its two-stage form)
        new = BwdConfig(block_m=64, block_n=128, num_warps=8, num_stages=2, variant="trans+fold")
    else:
        new = BwdConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, variant=order)
    return [new] + old


def _kernel_variant(name, kind, fused):
    """The part of a variant that applies to one kernel: the dQ kernel has no key-major, rows or
    reduce form, "reduce" applies only to the fused dK kernel's dQ and "gexp" only to the separate one."""
    keep = ("tma", "fold", "heavy", "poly") if kind == "dq" else (
        ("tma", "trans", "fold", "rows", "pack", "poly") + (("reduce",) if fused else ("gexp",)))
    return "+".join(p for p in name.split("+") if p in keep) or "ptr"


def bwd_streams(dims, n_sm: int) -> bool:
    """Run the separate backward's dQ kernel on a second stream beside the dK kernel (each one's
    last, partly filled wave of CTAs then overlaps the other's). ``STREAMKL_BWD_STREAMS=1`` / ``0``
    forces it; unset: off. Measured (an H200 run, 8K): the API's backward s1 6.346 ms vs
    6.275 on one stream, s2 5.863 vs 6.039; within that run's ~5 % spread between identical kernels."""
    forced = _runtime.env("STREAMKL_BWD_STREAMS")
    if forced in ("0", "1"):
        return forced == "1"
    return False


# A backward whose keys fit in one key tile of the fused dK kernel runs that kernel alone (it
# stores dQ whole, DQ_STORE: launch.py's _TritonBackward): one launch where the separate path
# makes two, and no zeroed fp32 dQ buffer or conversion where the fused path adds dQ by atomics.
# Every query tile is then walked by one program per (batch, head), so the "auto" mode takes it
# only for short query blocks, where a call's time is the host's and its launches' (the tiny
# shape of the host-cost measurement: N_Q = 1, N_K = 64). Timed on an H100 only together with the
# direct C launch (the tiny step over SDPA's 1.46x / 1.27x before both, 1.18x / 1.08x after:
# bench/results/2026-12-07_h100_beb2e2c/host_ab.csv), not alone.
ONE_TILE_MAX_QUERIES = 256


def stores_dq_whole(n_q: int, n_k: int, causal: bool, block_n: int) -> bool:
    """Does the fused dK kernel with ``block_n``-key tiles store dQ whole (DQ_STORE)? Every key in
    its grid's one key tile, and every query row visited by that tile's program (not causal, or
    N_Q <= N_K: bottom-right causal rows then all see key 0)."""
    return n_k <= block_n and (not causal or n_q <= n_k)


def one_tile_backward(dims, causal: bool, block_n: int) -> bool:
    """Does the "auto" backward run the fused dK kernel alone, storing dQ: :func:`stores_dq_whole`
    for a short query block (``ONE_TILE_MAX_QUERIES``)?"""
    return dims.NQ <= ONE_TILE_MAX_QUERIES and stores_dq_whole(dims.NQ, dims.NK, causal, block_n)


def auto_split_k(dims, block_m: int, block_n: int, n_sm: int) -> int:
    """Split the keys across programs when the query blocks alone cannot fill the GPU.

    Rule: with ``P = ceil(N_Q / BLOCK_M) * B * H`` query-block programs, split only when
    ``P < n_sm``; then aim at about ``4 * n_sm`` programs in all, keeping at least 4 key tiles
    per split (below that the merge traffic outweighs the parallelism).
    """
    programs = cdiv(dims.NQ, block_m) * dims.B * dims.H
    if programs >= n_sm:
        return 1
    key_tiles = cdiv(dims.NK, block_n)
    return max(1, min(cdiv(4 * n_sm, programs), key_tiles // 4))


SPLIT_OPTIONS = (1, 2, 4, 8, 16, 32, 64)


def wave_split_k(dims, block_m: int, block_n: int, n_sm: int):
    """Decoding's measured rule (query tiles of at most 16 rows, at most a quarter of the SMs busy
    with query blocks): the most key splits, a power of two, that keep every program in one wave
    (``programs * splits <= n_sm``) with at least 4 key tiles per split; None outside that range
    (the splits are then timed). The record (H200, triton 3.6, every tile and split timed,
    bench/results/2026-12-04_h200_19ad57e/tuning_log.csv; B = 1, H = 32, D = 128, bf16): at
    N_Q = 1, 4, 16 and N_K = 32K-512K, 4 splits of 16 x 128 tiles (128 programs on 132 SMs) were
    the fastest of 18 candidates; :func:`auto_split_k`'s 17 splits (four waves) 1.11-1.21x slower.
    At N_Q = 1, N_K = 8K (0.05 ms a call) the candidates' medians were within noise of each other."""
    programs = cdiv(dims.NQ, block_m) * dims.B * dims.H
    if block_m > 16 or 4 * programs > n_sm:
        return None
    splits, key_tiles = 1, cdiv(dims.NK, block_n)
    while programs * splits * 2 <= n_sm and splits * 2 <= key_tiles // 4:
        splits *= 2
    return splits


def split_choices(dims, ieee, d_pad, n_sm):
    """The forward's key splits to choose among when ``split_k=None``.

    Without tuning (``STREAMKL_AUTOTUNE=auto`` or ``0``, the interpreter): the measured rule of
    :func:`wave_split_k` where it applies (decoding); elsewhere with ``0`` and in the interpreter
    the one value of :func:`auto_split_k`, and with ``auto`` the options below, timed (no rule
    derived there: :func:`auto_split_k` measured 1.16x slower than the timed choice at N_Q = 1
    and 16, N_K = 128K).
    With tuning, where the query blocks leave the GPU short of programs (fewer than 8 per SM) and
    there are keys to split: every power of two up to 64 that keeps at least 4 key tiles per
    split and at most 32 programs per SM, all timed on the real problem (decode calls are short).
    ``1`` here means the one-pass kernel with its usual tiles. The measured reason (H200,
    2026-12-01, N_Q = 1, N_K = 128K, B = 1, H = 32): the rule's single value ran at 1.12x the copy
    floor where ``split_k=8`` ran at 0.98x: wave quantisation and occupancy, which a closed-form
    rule does not capture.
    """
    probe = fwd_candidates(dims, d_pad, True, ieee)[0]
    block_m, block_n = probe.block_m, probe.block_n
    rule = auto_split_k(dims, block_m, block_n, n_sm)
    wave = wave_split_k(dims, block_m, block_n, n_sm)
    if not _tuning.autotune_enabled(ruled=wave is not None):  # no derived rule elsewhere: timed by default
        return (rule if wave is None else wave,)
    programs = cdiv(dims.NQ, block_m) * dims.B * dims.H
    key_tiles = cdiv(dims.NK, block_n)
    if programs >= 8 * n_sm or key_tiles < 8:
        return (rule,)
    options = tuple(s for s in SPLIT_OPTIONS if s == 1 or (s <= key_tiles // 4 and programs * s <= 32 * n_sm))
    return options if rule in options else options + (rule,)


# Above D = 128 the fused dK kernel (which also holds the dQ operands) outgrows Hopper's 232,448 bytes
# of shared memory per program (offline, sm_90, triton 3.6, bf16, pointer loads:
# bench/results/2026-12-07_sass-sm90_c623459/wide_head_bwd_census.csv). With one side trained its
# first candidate, 64 x 64 with 8 warps, asks 295,680 bytes and so fails at its first launch (only
# 32 x 64 with 4 warps fits, 188,800, never timed); with both sides every candidate asks
# 254,464-475,648. The separate kernels' first candidates ask 205,824 (dK) and 196,608 (dQ). So a
# fused mode, asked for or picked, runs the separate kernels there.
FUSED_MAX_HEAD_PAD = 128


def fused_fits(d_pad: int) -> bool:
    """Can the fused backward run at padded head dim ``d_pad`` (``FUSED_MAX_HEAD_PAD``)?"""
    return d_pad <= FUSED_MAX_HEAD_PAD


# both sides trained: the separate kernels from this many query rows; with the TMA kernels and at
# least BOTH_MIN_HEADS batch x heads from fewer, and fewer still against this many keys or more
# (auto_bwd_mode's measurements)
BOTH_SEPARATE_MIN_NQ = 512
BOTH_SEPARATE_MIN_NQ_TMA = 256
BOTH_SEPARATE_MIN_NQ_LONG_KEYS, BOTH_LONG_KEYS = 96, 8192
BOTH_MIN_HEADS = 32


def auto_bwd_mode(dims, n_sm: int, both: bool = False, new_kernels: bool = False) -> str:
    """Pick the fused kernel (each tile pair visited once, dQ by fp32 atomics) or the separate ones.

    ``new_kernels``: the TMA variants are candidates (Hopper, aligned, half precision). Then one
    setting runs separate wherever the dQ kernel alone has programs for at least 90 % of the SMs
    (one wave): measured (H200, bench/results/2026-12-01_h200_121408f/bwd_sweep.csv, the tile sweep
    (``--sweep``) of a script since removed, ``git show b7066de:bench/bwd_gpu.py``, 8K non-causal,
    direct launches) setting 2 separate 64x128x8x3 + 128x64x8x3 5.80 ms vs fused 64x128x8x3 6.79 (0.85x);
    setting 1 fused 6.89, of which its dQ share costs 3.54 (the dK kernel alone 3.35; the dQ
    kernel alone 2.54 for setting 2). The fused kernel's dQ (a [64, D] fp32 product and reduce-add
    per tile pair, on the dK kernel's critical path at one CTA of 8 warps per SM) costs more than
    a second pass over the keys. Down to one wave of dQ programs (an H200 run, N_Q 2K x N_K 32K, 512
    programs: separate 0.93x / 0.89x of fused, s1 / s2; an H200 run, N_Q 512 x N_K
    32K, 128 programs on 132 SMs: separate 1.745 / 1.649 ms vs fused 64x128x8x2 1.918 / 1.904);
    below it fused (an H200 run, N_Q 16 x N_K 32K, 32 programs: separate 1.059 / 0.970 ms, fused 0.461 /
    0.469): each dQ program walks every key, so with fewer programs than SMs its time does not
    shrink with N_Q while the fused kernel's does.

    Measured on the H200 (bench/results/2026-11-29_h200_f87f3b3/bench.csv; B=1, H=32, D=128, bf16):
    - one setting (s1 or s2): fused is as fast or faster at N = 4K..32K, causal or not
      (s1, 8K non-causal: 12.84 ms fused vs 13.72 separate), and at N_Q = 16..512 with N_K = 32K;
    - both settings: fused wins at small N_Q (N_K = 32K, N_Q = 16: 1.53 vs 1.79 ms), separate from
      N_Q = 512 on (N_Q = 512: 4.46 vs 5.24; N = 8K: 16.7 vs 20.5), the kernels of that run. With
      the separate kernels' key-major dK, heaviest-first dQ and |g| folded into the exponentials, the TMA kernels
      (``new_kernels``; the only ones measured for this) run separate from N_Q = 256 at every N_K
      measured, and from N_Q = 96 against 8K keys or more: on an H100
      (bench/results/2026-12-08_h100_8d365cc/, ``devtools.bwd_mode_sweep``, 5 rotated rounds, causal
      and not) at N_K = 32K separate 1.42-1.71 ms against fused 1.69-2.70 for N_Q = 96-192 and
      1.92 against 3.16 at 256; at 8K and 16K separate 0.43-0.88 against 0.46-1.38 for N_Q = 96-192;
      at 4K fused as fast or faster up to N_Q = 192 (0.35 against 0.44 at 128), separate from 256
      (0.38 against 0.46); at N_Q = 64 fused at every N_K but for two causal points within 4 %.
      The grids agree at N_Q = 256, N_K = 32K: 1.944 against 3.143 (H100,
      bench/results/2026-12-08_h100_eb23045/bench.csv) and 2.019 against 3.110 (H200,
      bench/results/2026-12-04_h200_e7f5ad9/bench.csv).
      The sweep ran B x H = 32; the rule holds from there up (reasoned: the fused kernel's time grows
      with B x H, while below one wave the dQ kernel's does not, so the separate pair only gains
      with more heads) and leaves fewer heads, where a dQ kernel of a few programs walking every key
      could lose to the fused kernel, on N_Q = 512.
    Not measured, reasoned: with fewer key-tile programs than SMs the fused kernel has too
    little parallelism (each program walks every query tile), so the separate kernels run then.
    """
    key_programs = cdiv(dims.NK, 64) * dims.B * dims.H
    if key_programs < n_sm:
        return "separate"
    if both and dims.NQ >= BOTH_SEPARATE_MIN_NQ:
        return "separate"
    if both and new_kernels and dims.B * dims.H >= BOTH_MIN_HEADS and (dims.NQ >= BOTH_SEPARATE_MIN_NQ_TMA or (
            dims.NQ >= BOTH_SEPARATE_MIN_NQ_LONG_KEYS and dims.NK >= BOTH_LONG_KEYS)):
        return "separate"
    if new_kernels and 10 * cdiv(dims.NQ, 128) * dims.B * dims.H >= 9 * n_sm:
        return "separate"
    return "fused"
