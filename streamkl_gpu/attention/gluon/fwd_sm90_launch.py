"""Host side of the Hopper Gluon forward (``fwd_sm90``): launch configurations
(:class:`GluonFwdConfig`) and the candidate lists the tuner times, TMA descriptors, the per-call
constexprs, and the launch through a cache of compiled kernels (later launches call the compiled
launcher directly; ``_core/launcher.py``'s key).

Diagnostic variants (``streamkl_gpu.devtools.diagnostics``) are reached only through the forcing
hook (``streamkl_gpu._core.forcing``), which also records every launch (the compiled kernel and its
``SCHED`` constexpr) for the benchmarks that read its SASS.
"""
import dataclasses
from dataclasses import dataclass, fields

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from streamkl_gpu._core import forcing as _forcing
from streamkl_gpu._core import launcher as _fast_launch
from streamkl_gpu.attention.gluon import fwd_sm90 as _kernel
from streamkl_gpu.attention.gluon import fwd_sm90_fold as _fold
from streamkl_gpu.devtools import diagnostics as _diagnostics


# The two-warpgroup default's registers: ptxas' cap per thread (the sketch's setting) and the
# consumer warpgroups' setmaxnreg (a TRIO launch takes 128 and 160: three consumers beside the producer)
DEFAULT_MAXNREG = 168
DEFAULT_CONSUMER_REGS = 240


@dataclass(frozen=True)
class GluonFwdConfig:
    """One launch of the Hopper Gluon forward (``fwd_sm90``): key tiles of ``block_n`` keys
    through a ring of ``num_stages`` TMA slots, ptxas capped at ``maxnreg`` registers per thread
    (the consumer warpgroups raise theirs to ``consumer_regs`` with setmaxnreg), and the schedule
    knobs, each 0 (off) or its level, packed into the kernel's ``SCHED`` constexpr by
    :func:`sched_of` (``fwd_sm90_fold.SCHED_BITS``; the fields below are its names in lower case).
    Equal fields are one launch (the tuner and its disk cache key on them)."""
    block_n: int
    num_stages: int
    maxnreg: int = DEFAULT_MAXNREG
    pingpong: int = 0  # the turnstile: the two consumer warpgroups take turns on the tensor cores
    split: int = 0  # each key tile as two half-tile products
    poly: int = 0  # 1-3: a share of side 2's exponentials by a polynomial on the FMA pipe
    rescale: int = 0  # a new reference max only when the max grows by more than RESCALE_BITS
    fence: int = 0  # 1, 2: fences that keep side 1's exponentials before the S2 wait (2: whole tiles only)
    order: int = 0  # side 2 folded first
    look: int = 0  # two key tiles per iteration of the whole-tile loop (needs order)
    turn: int = 0  # the turnstile handed over after the tile's last wait (needs pingpong)
    merge: int = 0  # one ready and one empty barrier per ring slot for K1 and K2
    relturn: int = 0  # the per-warpgroup releases as the turn (needs pingpong, turn, merge)
    fold: int = 0  # whole tiles: the scale folded into the exponent's FFMA
    mask1: int = 0  # masked tiles: the mask applied once
    defer: int = 0  # l1, l2, acc as per-thread partial sums, reduced across the quad at the end
    unite: int = 0  # both consumer warpgroups in one 8-warp partition: half the compile, 1.24-1.29x the time
    trio: int = 0  # three consumer warpgroups, 192 query rows per CTA (512 threads: maxnreg 128, consumers 160)
    consumer_regs: int = DEFAULT_CONSUMER_REGS

    def knobs(self) -> dict:
        """The schedule knobs by the kernel's names (``SCHED_BITS``: ``{"PINGPONG": 0, ...}``)."""
        return {name: getattr(self, name.lower()) for name in _fold.SCHED_BITS}

    @property
    def sched(self) -> int:
        """The ``SCHED`` constexpr of this launch (a ``ValueError`` for knobs the kernel does not take)."""
        return sched_of(self.knobs())


# every knob of the kernel is a field
KNOB_FIELDS = tuple(name.lower() for name in _fold.SCHED_BITS)
if not set(KNOB_FIELDS) <= {f.name for f in fields(GluonFwdConfig)}:
    raise ImportError(f"fwd_sm90_fold.SCHED_BITS has knobs GluonFwdConfig lacks: {sorted(KNOB_FIELDS)}")


def _ring_stages(d1: int, d2: int, block_n: int, cta_rows: int = 128) -> int:
    """Key-ring depth that fits beside Q: per CTA Q takes 2 cta_rows (D1+D2) bytes, a ring stage
    2 block_n (D1+D2) bytes; 227 KB of shared memory per CTA on sm_90; at most 4 stages."""
    budget = 227 * 1024 - 2048 - 2 * cta_rows * (d1 + d2)
    return max(2, min(4, budget // (2 * block_n * (d1 + d2))))


def kernel_config(d1: int, d2: int) -> GluonFwdConfig:
    """Default launch configuration for head dims (d1, d2): 128-key tiles, the deepest key ring
    that fits, 168 registers per thread (the sketch's setting), the ``DEFAULT_KNOBS``."""
    return candidates(d1, d2)[0]


def candidates(d1: int, d2: int, trio: bool = False):
    """Launch configurations the tuner times, default first; ``trio``: the shape is in
    :func:`trio_class`, where the shape rule puts :func:`trio_config` first. H200, 2026-12-01 (bench/results/): the
    default ran 8K bf16 D=128 at 1.51x SDPA non-causal, 1.40x causal; the others are the
    plausible knobs (more registers for ptxas' scheduling; 64-key tiles: half the live score
    registers, twice the tiles; the sketch's turnstile, which orders the two warpgroups' turns on
    the tensor cores) that run 2 measures next."""
    # H200, 2026-12-01 (bench/results/): the 224-register
    # configs cannot launch (a CTA of 384 threads x 224 registers exceeds the SM's 65536:
    # "OutOfResources: threads, Required: 384, Hardware limit: 256"), so none is a candidate.
    knobs = DEFAULT_KNOBS
    if (d1, d2) == (128, 128):
        # the measured winner alone (the second schedule search): in the first, 64-key tiles
        # lost at every D = 128 point by 10-18 % and the turnstile was within +-5 % of the default
        # (won 8K causal by 3 %, lost 8K full by 5 %), while the tuned API path ran 8K full 6 %
        # slower than the default forced: timing noise picks, so do not time
        if trio:
            return [trio_config(d1, d2), make_config(d1, d2, 128, DEFAULT_MAXNREG, **knobs)]
        return [make_config(d1, d2, 128, DEFAULT_MAXNREG, **knobs)]
    return [make_config(d1, d2, 128, DEFAULT_MAXNREG, **knobs), make_config(d1, d2, 64, DEFAULT_MAXNREG, **knobs),
            make_config(d1, d2, 128, DEFAULT_MAXNREG, pingpong=1, **knobs)]


# The shape rule of the Gluon forward (what runs untimed, STREAMKL_AUTOTUNE off, is the first
# candidate): TRIO, a third consumer warpgroup, where it was faster than the two-warpgroup default
# at every measured point of the class, with bitwise the same outputs (an H200, bf16, D = 128,
# B = 1, H = 32, 5 rotated rounds against cuDNN's forward; rows ``fwd N=<n> full,trio_n128`` of the
# CSV and of trio_timing_long.csv beside it):
# 0.958 and 0.915 at 8K (two runs), 0.939 at 16K, 0.944 at 32K, 0.925 at 64K without a causal mask.
# Not at 4K (1.001) nor with a causal mask at 4K-16K (1.29, 1.06, 1.005: the 192-row CTAs cross
# the diagonal in more masked tiles); 0.977 / 0.963 causal at 32K / 64K, left out (not bitwise the
# default's there, and its quick twin would not be either). Other head dims, fp16 and GQA were not
# measured and keep the default.
TRIO_RULE_CSV = "bench/results/2026-12-06_h200_ad34345/trio_timing.csv"
TRIO_RULE_POINTS = (8192, 16384, 32768, 65536)  # the cited rows' N (tests/test_gluon_compile.py reads them)
TRIO_MIN_KEYS = 8192


def trio_class(d1: int, d2: int, causal: bool, n_q: int, n_k: int, dtype1, dtype2, gqa: bool) -> bool:
    """Is a forward shape in the shape rule's TRIO class: no causal mask, D1 = D2 = 128, bf16, no
    GQA, at least ``TRIO_MIN_KEYS`` query rows and keys."""
    return (not causal and d1 == 128 and d2 == 128 and dtype1 is torch.bfloat16 and dtype2 is torch.bfloat16
            and not gqa and n_q >= TRIO_MIN_KEYS and n_k >= TRIO_MIN_KEYS)


def trio_config(d1: int, d2: int) -> GluonFwdConfig:
    """The default's schedule with three consumer warpgroups: 192 query rows per CTA, 512 threads
    (``maxnreg`` 128 at launch), the consumers raised to 160 registers."""
    return make_config(d1, d2, 128, 128, trio=1, consumer_regs=160, **DEFAULT_KNOBS)


# Schedule knobs every tuner candidate carries (a knob joins only on a GPU measurement).
# H200, 2026-12-01 (bench/results/): MERGE + FOLD + MASK1 faster than the second search's default at every 8K/16K
# point (time ratio 0.936 8K full, 0.942 16K causal, 0.947 8K causal, 0.965 16K full), FOLD alone
# 0.952 / 0.942 / 0.973 / 0.970, FOLD + MASK1 0.959 / 0.945 / 0.971 / 1.011, MERGE alone 1.010
# (mean); the three together ran 8K 1.42x / 1.40x SDPA (full / causal), 16K 1.35x / 1.29x, 32K
# 1.33x / 1.24x, 64K 1.25x / 1.28x, against the default's 1.52x / 1.48x at 8K. Same accuracy on
# the four check cases (rel. error vs float64 2.4e-7 on kl, 4.4e-8 on lse2, as before; one-key
# rows exactly 0; NaN isolated).
DEFAULT_KNOBS: dict = dict(merge=1, fold=1, mask1=1)


def make_config(d1: int, d2: int, block_n: int, maxnreg: int, **knobs) -> GluonFwdConfig:
    """A launch configuration of ``block_n``-key tiles with the deepest ring that fits beside Q for
    head dims (d1, d2), ``maxnreg`` registers, and the given knobs (:class:`GluonFwdConfig` fields)
    on; the others off."""
    cta_rows = cta_query_rows(knobs.get("trio", 0))
    return GluonFwdConfig(block_n=block_n, num_stages=_ring_stages(d1, d2, block_n, cta_rows), maxnreg=maxnreg, **knobs)


def cta_query_rows(trio: int) -> int:
    """Query rows per CTA: 64 per consumer warpgroup, two of them (TRIO: three)."""
    return _kernel.BLOCK_M.value + trio * _kernel.WG_M.value


def experiments(d1: int, d2: int):
    """Schedules the GPU script measures beside the tuner's candidates (not chosen by the tuner
    until a run shows they pay), as :class:`GluonFwdConfig`.
    The second schedule search: the first search's losers (64-key tiles with PINGPONG/FENCE, POLY, RESCALE, all
    5-25 % slower than the default at 8K, bench/results/) are no longer
    measured; the side-2-first order (ORDER) and the two-tile lookahead (LOOK) are. SASS on CPU
    (sm_90, triton 3.9, bf16 D = 128): ORDER no spills, 0 MUFU.EX2 between the waits (ptxas sinks
    them, as in the default); ORDER+FENCE=2 64 of 64 there, no spills non-causal, 11 STL causal
    (masked loop); LOOK at 64-key tiles no spills causal or not, 34 EX2 between the first two
    waits, 4 DEPBAR per two-tile iteration; LOOK at 128-key tiles spills (~20 STL per loop, also
    at maxnreg 240)."""
    def cand(block_n, maxnreg, **knobs):
        return make_config(d1, d2, block_n, maxnreg, **knobs)

    # The third schedule search: FOLD, MASK1 and MERGE became the default (DEFAULT_KNOBS); POLY 3
    # (a quarter of side 2's exponentials by the polynomial: 1.05-1.48x the old default, spills)
    # and POLY 2 with FOLD (0.96-1.02x) are no longer measured; FENCE=2 with FOLD (0.94-0.98x,
    # spills outside the loops) and the turnstile with FOLD (0.98-1.00x) are, on top of the new
    # default; the knob-free schedule (the second search's default) is the control, FOLD + MASK1 without
    # MERGE says what MERGE adds.
    d = DEFAULT_KNOBS
    return [cand(128, DEFAULT_MAXNREG)] * bool(DEFAULT_KNOBS) + [
        cand(128, DEFAULT_MAXNREG, fold=1, mask1=1),
        cand(128, DEFAULT_MAXNREG, fence=2, **d),
        cand(128, DEFAULT_MAXNREG, pingpong=1, **d),
        # FA3's ping-pong with the late turn, as the per-warpgroup releases (RELTURN needs MERGE)
        cand(128, DEFAULT_MAXNREG, pingpong=1, turn=1, relturn=1, **d),
        # DEFER: l1, l2, acc as per-thread partial row sums, the quad's shuffles once at the end:
        # 776 instead of 797 instructions per whole-tile loop, 8 SHFL instead of 20 (triton 3.6)
        cand(128, DEFAULT_MAXNREG, defer=1, **d),
        # TRIO: a third consumer warpgroup (more warps to issue from; the fold is issue-bound per
        # warp), 160 registers per consumer thread instead of 240; 64-key tiles keep the scores in 64
        trio_config(d1, d2),
        # TRIO at 64-key tiles: no spills, but 1.02-1.10x the default's time (TRIO_RULE_CSV)
        cand(64, 128, trio=1, consumer_regs=160, **d),
    ]


# The second schedule search's experiments (none beat the default on the H200), timed by a script
# since removed (``git show b7066de:bench/gluon_gpu.py``, ``--configs``):
# bench/results/2026-12-01_h200_e1a7af2/gluon.csv.
SEARCHED_EXPERIMENTS = tuple(GluonFwdConfig(**c) for c in (
    dict(block_n=128, num_stages=2, pingpong=1),
    dict(block_n=128, num_stages=2, fence=2),
    dict(block_n=128, num_stages=2, fence=2, order=1),
    dict(block_n=64, num_stages=4, fence=2, order=1, look=1),
    dict(block_n=128, num_stages=2, pingpong=1, fence=2, turn=1),
    dict(block_n=128, num_stages=2, pingpong=1, fence=2, order=1, turn=1),
    dict(block_n=128, num_stages=2, merge=1),
    dict(block_n=128, num_stages=2, fence=2, merge=1),
    dict(block_n=128, num_stages=2, pingpong=1, fence=2, turn=1, merge=1),
    dict(block_n=128, num_stages=2, pingpong=1, fence=2, turn=1, merge=1, relturn=1),
    dict(block_n=64, num_stages=4, fence=2, order=1, look=1, merge=1)))


def configs_to_measure(d1: int, d2: int):
    """The tuner's candidates, then the experiments: what the removed GPU script checked and timed
    (``git show b7066de:bench/gluon_gpu.py``) and tests/test_gluon_compile.py compiles."""
    cands = candidates(d1, d2)
    return cands + [c for c in experiments(d1, d2) if c not in cands]


_FLAG_NAMES = dict(pingpong="pingpong", split="split", poly="poly", rescale="rescale", fence="fence",
                   order="s2first", look="look", turn="lateturn", merge="merged",
                   relturn="relturn", fold="ffma", mask1="mask1", defer="defer", trio="trio")


def sched_of(knobs) -> int:
    """The ``SCHED`` constexpr of schedule knobs ``{"PINGPONG": 1, ...}`` (the kernel's names; a
    knob left out is 0), packed by ``SCHED_BITS``; :attr:`GluonFwdConfig.sched` of a launch."""
    cfg = knobs
    out = 0
    for name, (off, width) in _fold.SCHED_BITS.items():
        v = int(cfg.get(name, 0))
        if not 0 <= v < (1 << width):
            raise ValueError(f"{name}={v} does not fit in {width} bit(s)")
        out |= v << off
    if cfg.get("LOOK") and cfg.get("PINGPONG"):
        raise ValueError("LOOK (two tiles per iteration) does not take the PINGPONG turnstile")
    if cfg.get("RELTURN") and not (cfg.get("PINGPONG") and cfg.get("TURN") and cfg.get("MERGE")):
        raise ValueError("RELTURN (the release as the turn) needs PINGPONG=1, TURN=1 and MERGE=1")
    if cfg.get("TURN") and not cfg.get("PINGPONG"):
        raise ValueError("TURN (hand the turn over after the last wait) needs PINGPONG=1")
    if cfg.get("LOOK") and not cfg.get("ORDER"):
        raise ValueError("LOOK folds side 2 first: it needs ORDER=1")
    if cfg.get("ORDER") and cfg.get("SPLIT"):
        raise ValueError("ORDER (side 2 first) does not take SPLIT")
    if cfg.get("DEFER") and (cfg.get("ORDER") or cfg.get("POLY") or cfg.get("SPLIT")):
        raise ValueError("DEFER (partial row sums) is written for the side-1-first fold without POLY or SPLIT")
    if cfg.get("UNITE") and (cfg.get("PINGPONG") or cfg.get("LOOK")):
        raise ValueError("UNITE (one consumer partition) does not take the turnstile (PINGPONG) or LOOK")
    if cfg.get("TRIO") and (cfg.get("PINGPONG") or cfg.get("LOOK") or cfg.get("UNITE")):
        raise ValueError("TRIO (three consumer warpgroups) does not take PINGPONG, LOOK or UNITE")
    if cfg.get("MASK1") and cfg.get("ORDER"):
        raise ValueError("MASK1 (the masked tiles' mask applied once) is written for the side-1-first fold, not ORDER")
    return out


def describe(cfg: GluonFwdConfig) -> str:
    """A short name of a launch configuration for tables: ``n128 s2 r168`` plus its switched-on knobs."""
    flags = [_FLAG_NAMES[k] + ("" if getattr(cfg, k) == 1 else str(getattr(cfg, k)))
             for k in _FLAG_NAMES if getattr(cfg, k)]
    return " ".join([f"n{cfg.block_n} s{cfg.num_stages} r{cfg.maxnreg}"] + flags)


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _gl_dtype(dtype):
    return getattr(gl, _GL_DTYPES[dtype])


_LAYOUTS: dict = {}  # (rows, D, dtype) -> the shared-memory layout of a TMA block (host cost: ~10 us each)


def make_descriptor(t, rows: int):
    """4-D TMA descriptor over ``t`` ([B, H, N, D], any TMA-legal strides), block [1, 1, rows, D]."""
    block = [1, 1, rows, t.shape[-1]]
    key = (rows, t.shape[-1], t.dtype)
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for(block, _gl_dtype(t.dtype))
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


# (D1, D2, config, causal, VARIANT) -> (block_n, q_rows, cta_rows, constexprs, options): the per-call host work
_STATICS: dict = {}
_MAX_STATICS = 1024


def _statics(D1, D2, config, causal, variant):
    if config is not None and not isinstance(config, GluonFwdConfig):
        raise TypeError(f"config must be a GluonFwdConfig or None, got {type(config).__name__}")
    key = (D1, D2, config, bool(causal), variant)
    hit = _STATICS.get(key)
    if hit is None:
        cfg = config if config is not None else kernel_config(D1, D2)
        constexprs = dict(D1=D1, D2=D2, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages, CAUSAL=bool(causal),
                          CONSUMER_REGS=cfg.consumer_regs, VARIANT=variant, SCHED=cfg.sched)
        options = dict(num_warps=8 if cfg.unite else 4)
        if cfg.maxnreg:
            options["maxnreg"] = cfg.maxnreg
        if len(_STATICS) >= _MAX_STATICS:
            _STATICS.clear()
        q_rows = _kernel.BLOCK_M.value if cfg.unite else _kernel.WG_M.value  # a TMA block of Q
        hit = _STATICS[key] = (cfg.block_n, q_rows, cta_query_rows(cfg.trio), constexprs, options)
    return hit


def launch_args(q1, k1, q2, k2, causal, scale1, scale2, kl, lse1_bits, lse2_bits, config=None):
    """(grid, positional args, constexprs, options) of one forward launch; also used by the CI
    compile test, which passes the same descriptors to ``GluonASTSource``. ``config``: a
    :class:`GluonFwdConfig` (None: :func:`kernel_config`'s, the default). A diagnostic variant
    forced by ``forcing(attention_fwd_variant=...)`` computes wrong results, for timing only."""
    B, H, N_Q, D1 = q1.shape
    N_K, D2 = k1.shape[2], q2.shape[3]
    variant = _diagnostics.attention_fwd_variant(_forcing.forced("attention_fwd_variant"), causal)
    block_n, q_rows, cta_rows, constexprs, options = _statics(D1, D2, config, causal, variant)
    descs = (make_descriptor(q1, q_rows), make_descriptor(k1, block_n),
             make_descriptor(q2, q_rows), make_descriptor(k2, block_n))
    args = descs + (kl, lse1_bits, lse2_bits, H, N_Q, N_K, H // k1.shape[1], H // k2.shape[1],
                    scale1 * _kernel.LOG2E, scale2 * _kernel.LOG2E, 1)
    grid = (triton.cdiv(N_Q, cta_rows), B * H)
    return grid, args, dict(constexprs), dict(options)


def waits_per_tile(sched: int) -> int:
    """The wgmma waits in the source of one key-tile loop body: two per (sub-)tile product pair."""
    if (sched >> _fold.SCHED_BITS["LOOK"][0]) & 1:  # two key tiles per iteration of the whole-tile loop
        return 4
    if (sched >> _fold.SCHED_BITS["POLY"][0]) & 3 == 3:  # the loop holds both tile bodies (a branch on i % 2)
        return 4
    return 2 * (1 + ((sched >> _fold.SCHED_BITS["SPLIT"][0]) & 1))


def gluon_forward(q1, k1, q2, k2, causal, scale1, scale2, out=None, config=None, quick_first=False):
    """Launch the Gluon forward: (kl nats, lse1_bits, lse2_bits), float32 [B, H, N_Q].

    The caller (``use_gluon``) has checked the shapes, dtypes, strides and device. ``out``: an
    optional triple of output buffers (the API passes NaN-poisoned ones in tests); ``config``:
    see :func:`launch_args`. ``quick_first`` (the API's untuned path): at a specialisation not
    compiled yet in this process, compile it on a background thread and launch its
    :func:`quick_twin` (bitwise the same outputs, about half the compile) until it is kept: a first
    call waits for the twin's compile only. The launch is recorded for an open ``forcing`` block
    (the twin's while it runs)."""
    B, H, N_Q, D1 = q1.shape
    if out is None:
        out = tuple(torch.empty((B, H, N_Q), dtype=torch.float32, device=q1.device) for _ in range(3))
    kl, lse1_bits, lse2_bits = out
    grid, args, constexprs, options = launch_args(q1, k1, q2, k2, causal, scale1, scale2, kl, lse1_bits, lse2_bits,
                                                  config)
    twin = None
    if quick_first:  # built only at a specialisation's first meetings (_launch)
        def twin():
            cfg = quick_twin(config or kernel_config(D1, q2.shape[3]), causal)
            return cfg and launch_args(q1, k1, q2, k2, causal, scale1, scale2, kl, lse1_bits, lse2_bits, cfg)
    kernel, constexprs = _launch(grid, args, constexprs, options, twin)
    _forcing.record("attention_fwd_sm90", kernel, **constexprs)
    return kl, lse1_bits, lse2_bits


# Compiled kernels kept per specialisation (on by default: outputs bitwise equal to the JIT
# launch's, bound then direct; host time per API call 140 -> 112 us at B=1 H=32 N=2K on the H200
# with triton 3.6, the kernel's time unchanged). STREAMKL_FAST_LAUNCH=0 turns it off.
_COMPILED: dict = {}  # specialisation key -> (CompiledKernel, the constexpr tail in parameter order, its direct_entry)
FAST_STATS = {"direct": 0, "bound": 0}


def quick_twin(cfg: GluonFwdConfig, causal: bool = False):
    """The launch that computes what ``cfg`` does with both consumer warpgroups in one partition
    (UNITE): one copy of the fold's code, so about half of ``cfg``'s compile
    (None where there is none: the turnstile and the two-tile loop order two warpgroups). For
    TRIO the two-warpgroup schedule's twin: bitwise the same without a causal mask (each row's
    fold is the same); none with one (192-row CTAs mask other tiles)."""
    if cfg.unite or cfg.pingpong or cfg.look or (cfg.trio and causal):
        return None
    if cfg.trio:
        cfg = dataclasses.replace(cfg, trio=0, maxnreg=DEFAULT_MAXNREG, consumer_regs=DEFAULT_CONSUMER_REGS)
    return dataclasses.replace(cfg, unite=1)


_COMPILING: dict = {}  # specialisation key -> the thread that compiled (or compiles) the default launch


def _key(args, constexprs, options):
    return (tuple(constexprs.items()), tuple(sorted(options.items())), tuple(_fast_launch._spec(a) for a in args))


def _first_compile_pending(key, grid, args, constexprs, options) -> bool:
    """Is the launch at specialisation ``key`` (not kept in ``_COMPILED``) compiling on a background
    thread? At its first meeting, start that compile (``_core.launcher``'s compile-ahead rules: not
    under the interpreter, not with ``STREAMKL_COMPILE_AHEAD=0``; :func:`_launch` never asks from a
    compile-ahead thread); True until it has finished."""
    if not _fast_launch.ahead_allowed():
        return False
    thread = _COMPILING.get(key)
    if thread is None:
        device = torch.cuda.current_device()

        def work():
            with torch.cuda.device(device):
                kernel = _kernel._gluon_kl_fwd_kernel.warmup(*args, grid=grid, **constexprs, **options)
                kernel._init_handles()  # the module load (and triton 3.6's launcher build) here too
            _keep(key, kernel, constexprs, len(args))

        if len(_COMPILING) >= 1024:
            _COMPILING.clear()
        _COMPILING[key] = _fast_launch.compile_in_background(work, "streamkl-compile-default")
        return True
    # finished: kept (the next _launch runs it directly), or failed (the next _launch compiles it
    # on the calling thread and raises there)
    return thread.is_alive()


def _keep(key, kernel, constexprs, n_args):
    if len(_COMPILED) >= 1024:
        _COMPILED.clear()
    _COMPILED[key] = (kernel, _fast_launch._tail(_kernel._gluon_kl_fwd_kernel, n_args, constexprs, {})[0],
                      *_fast_launch.direct_entry(kernel))


def _launch(grid, args, constexprs, options, twin=None):
    """``_gluon_kl_fwd_kernel[grid](*args, **constexprs, **options)``; unless ``STREAMKL_FAST_LAUNCH=0``
    the first launch of each specialisation keeps the compiled kernel and later ones call its
    launcher directly (``_fast_launch``'s method and key: what Triton specialises each argument
    on, descriptors by type, block shape, dtype and base alignment), saving the JIT binder's
    tens of microseconds per call (the 2K points of the no-regression grid are host-bound).
    In a compile-ahead thread (``_core.launcher``) it only compiles. ``twin``: None, or a function
    of no arguments that gives the (grid, args, constexprs, options) of a launch with the same
    outputs that compiles faster, or None (:func:`quick_twin`): while this launch compiles on a
    background thread, the twin is launched instead. Returns the kernel and the constexprs launched."""
    if _fast_launch.compiling_ahead() or not _fast_launch.enabled():
        return _fast_launch.kernel_call(_kernel._gluon_kl_fwd_kernel, grid)(*args, **constexprs, **options), constexprs
    key = _key(args, constexprs, options)
    hit = _COMPILED.get(key)
    if hit is None:
        quick = twin() if twin is not None else None
        if quick is not None and _first_compile_pending(key, grid, args, constexprs, options):
            return _launch(*quick)
        _fast_launch.compiler_ready()
        kernel = _kernel._gluon_kl_fwd_kernel[grid](*args, **constexprs, **options)
        if hasattr(kernel, "result"):  # an asynchronous compile (triton >= 3.5)
            kernel = kernel.result()
        _keep(key, kernel, constexprs, len(args))
        FAST_STATS["bound"] += 1
        return kernel, constexprs
    kernel, tail, run, head = hit
    stream = _fast_launch._raw_stream(torch.cuda.current_device())
    run(grid[0], grid[1], 1, stream, *head, *args, *tail)
    FAST_STATS["direct"] += 1
    return kernel, constexprs
