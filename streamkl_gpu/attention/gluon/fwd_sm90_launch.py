"""Host side of the Hopper Gluon forward (``fwd_sm90``): launch configurations and the candidate
lists the tuner times, TMA descriptors, the per-call constexprs, and the launch through a cache of
compiled kernels (later launches call the compiled launcher directly; ``_core/launcher.py``'s key).

Diagnostic variants (``streamkl_gpu.devtools.diagnostics``) are reached only through the forcing
hook (``streamkl_gpu._core.forcing``), which also records every launch (the compiled kernel and its
``SCHED`` constexpr) for the benchmarks that read its SASS.
"""
import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from streamkl_gpu._core import forcing as _forcing
from streamkl_gpu._core import launcher as _fast_launch
from streamkl_gpu.attention.gluon import fwd_sm90 as _kernel
from streamkl_gpu.devtools import diagnostics as _diagnostics

def _ring_stages(d1: int, d2: int, block_n: int) -> int:
    """Key-ring depth that fits beside Q: per CTA Q takes 256 (D1+D2) bytes, a ring stage
    2 block_n (D1+D2) bytes; 227 KB of shared memory per CTA on sm_90; at most 4 stages."""
    budget = 227 * 1024 - 2048 - 256 * (d1 + d2)
    return max(2, min(4, budget // (2 * block_n * (d1 + d2))))


def kernel_config(d1: int, d2: int):
    """Default launch configuration for head dims (d1, d2): 128-key tiles, the deepest key ring
    that fits, 168 registers per thread (the sketch's setting), the ``DEFAULT_KNOBS``."""
    return config_of(candidates(d1, d2)[0])


def candidates(d1: int, d2: int):
    """Launch configurations the tuner times, as (BLOCK_N, NUM_STAGES, maxnreg, PINGPONG) tuples,
    default first. H200, 2026-12-01 (bench/results/): the
    default ran 8K bf16 D=128 at 1.51x SDPA non-causal, 1.40x causal; the others are the
    plausible knobs (more registers for ptxas' scheduling; 64-key tiles: half the live score
    registers, twice the tiles; the sketch's turnstile, which orders the two warpgroups' turns on
    the tensor cores) that run 2 measures next."""
    s128, s64 = _ring_stages(d1, d2, 128), _ring_stages(d1, d2, 64)
    # H200, 2026-12-01 (bench/results/): the 224-register
    # configs cannot launch (a CTA of 384 threads x 224 registers exceeds the SM's 65536:
    # "OutOfResources: threads, Required: 384, Hardware limit: 256"), so none is a candidate.
    knobs = DEFAULT_KNOBS
    if (d1, d2) == (128, 128):
        # the measured winner alone (the second schedule search): in the first, 64-key tiles
        # lost at every D = 128 point by 10-18 % and the turnstile was within +-5 % of the default
        # (won 8K causal by 3 %, lost 8K full by 5 %), while the tuned API path ran 8K full 6 %
        # slower than the default forced: timing noise picks, so do not time
        return [make_cand(d1, d2, 128, 168, **knobs)]
    return [make_cand(d1, d2, 128, 168, **knobs), make_cand(d1, d2, 64, 168, **knobs),
            make_cand(d1, d2, 128, 168, PINGPONG=1, **knobs)]


# Schedule knobs every tuner candidate carries (a knob joins only on a GPU measurement).
# H200, 2026-12-01 (bench/results/): MERGE + FOLD + MASK1 faster than the second search's default at every 8K/16K
# point (time ratio 0.936 8K full, 0.942 16K causal, 0.947 8K causal, 0.965 16K full), FOLD alone
# 0.952 / 0.942 / 0.973 / 0.970, FOLD + MASK1 0.959 / 0.945 / 0.971 / 1.011, MERGE alone 1.010
# (mean); the three together ran 8K 1.42x / 1.40x SDPA (full / causal), 16K 1.35x / 1.29x, 32K
# 1.33x / 1.24x, 64K 1.25x / 1.28x, against the default's 1.52x / 1.48x at 8K. Same accuracy on
# the four check cases (rel. error vs float64 2.4e-7 on kl, 4.4e-8 on lse2, as before; one-key
# rows exactly 0; NaN isolated).
DEFAULT_KNOBS: dict = dict(MERGE=1, FOLD=1, MASK1=1)


def make_cand(d1: int, d2: int, block_n: int, maxnreg: int, **knobs):
    """A candidate tuple (``CAND_FIELDS``): BLOCK_N, the deepest ring that fits, maxnreg, the knobs
    (trailing defaults left out, at least up to PINGPONG: shorter names on disk)."""
    f = dict(zip(CAND_FIELDS, range(len(CAND_FIELDS))))
    out = [block_n, _ring_stages(d1, d2, block_n), maxnreg] + [0] * (len(CAND_FIELDS) - 3)
    for name, value in knobs.items():
        out[f[name]] = value
    while len(out) > 4 and out[-1] == 0:
        out.pop()
    return tuple(out)


def experiments(d1: int, d2: int):
    """Schedules the GPU script measures beside the tuner's candidates (not chosen by the tuner
    until a run shows they pay), same tuple form as :func:`candidates` (fields ``CAND_FIELDS``).
    The second schedule search: the first search's losers (64-key tiles with PINGPONG/FENCE, POLY, RESCALE, all
    5-25 % slower than the default at 8K, bench/results/) are no longer
    measured; the side-2-first order (ORDER) and the two-tile lookahead (LOOK) are. SASS on CPU
    (sm_90, triton 3.9, bf16 D = 128): ORDER no spills, 0 MUFU.EX2 between the waits (ptxas sinks
    them, as in the default); ORDER+FENCE=2 64 of 64 there, no spills non-causal, 11 STL causal
    (masked loop); LOOK at 64-key tiles no spills causal or not, 34 EX2 between the first two
    waits, 4 DEPBAR per two-tile iteration; LOOK at 128-key tiles spills (~20 STL per loop, also
    at maxnreg 240)."""
    def cand(block_n, maxnreg, **knobs):
        return make_cand(d1, d2, block_n, maxnreg, **knobs)

    # The third schedule search: FOLD, MASK1 and MERGE became the default (DEFAULT_KNOBS); POLY 3
    # (a quarter of side 2's exponentials by the polynomial: 1.05-1.48x the old default, spills)
    # and POLY 2 with FOLD (0.96-1.02x) are no longer measured; FENCE=2 with FOLD (0.94-0.98x,
    # spills outside the loops) and the turnstile with FOLD (0.98-1.00x) are, on top of the new
    # default; the knob-free schedule (the second search's default) is the control, FOLD + MASK1 without
    # MERGE says what MERGE adds.
    d = DEFAULT_KNOBS
    return [cand(128, 168)] * bool(DEFAULT_KNOBS) + [
        cand(128, 168, FOLD=1, MASK1=1),
        cand(128, 168, FENCE=2, **d),
        cand(128, 168, PINGPONG=1, **d),
        # FA3's ping-pong with the late turn, as the per-warpgroup releases (RELTURN needs MERGE)
        cand(128, 168, PINGPONG=1, TURN=1, RELTURN=1, **d),
        # DEFER: l1, l2, acc as per-thread partial row sums, the quad's shuffles once at the end:
        # 776 instead of 797 instructions per whole-tile loop, 8 SHFL instead of 20 (triton 3.6)
        cand(128, 168, DEFER=1, **d),
    ]


# The second schedule search's experiments (none beat the default on the H200), timed by a script
# since removed (``git show b7066de:bench/gluon_gpu.py``, ``--configs``):
# bench/results/2026-12-01_h200_e1a7af2/gluon.csv.
SEARCHED_EXPERIMENTS = (
    (128, 2, 168, 1), (128, 2, 168, 0, 0, 0, 0, 2), (128, 2, 168, 0, 0, 0, 0, 2, 1),
    (64, 4, 168, 0, 0, 0, 0, 2, 1, 1), (128, 2, 168, 1, 0, 0, 0, 2, 0, 0, 1),
    (128, 2, 168, 1, 0, 0, 0, 2, 1, 0, 1), (128, 2, 168, 0, 0, 0, 0, 0, 0, 0, 0, 1),
    (128, 2, 168, 0, 0, 0, 0, 2, 0, 0, 0, 1), (128, 2, 168, 1, 0, 0, 0, 2, 0, 0, 1, 1),
    (128, 2, 168, 1, 0, 0, 0, 2, 0, 0, 1, 1, 1), (64, 4, 168, 0, 0, 0, 0, 2, 1, 1, 0, 1))


def configs_to_measure(d1: int, d2: int):
    """The tuner's candidates, then the experiments: what the removed GPU script checked and timed
    (``git show b7066de:bench/gluon_gpu.py``) and tests/test_gluon_compile.py compiles."""
    cands = candidates(d1, d2)
    return cands + [c for c in experiments(d1, d2) if c not in cands]


# The fields of a candidate tuple, in order; trailing ones may be left out (their defaults).
CAND_FIELDS = ("BLOCK_N", "NUM_STAGES", "maxnreg") + tuple(_kernel.SCHED_BITS)
CAND_DEFAULTS = {k: 0 for k in _kernel.SCHED_BITS}
_FLAG_NAMES = dict(PINGPONG="pingpong", SPLIT="split", POLY="poly", RESCALE="rescale", FENCE="fence",
                   ORDER="s2first", LOOK="look", TURN="lateturn", MERGE="merged",
                   RELTURN="relturn", FOLD="ffma", MASK1="mask1", DEFER="defer")


def sched_of(cfg) -> int:
    """The ``SCHED`` constexpr of a launch configuration: its knobs packed by ``SCHED_BITS``."""
    out = 0
    for name, (off, width) in _kernel.SCHED_BITS.items():
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
    if cfg.get("MASK1") and cfg.get("ORDER"):
        raise ValueError("MASK1 (the masked tiles' mask applied once) is written for the side-1-first fold, not ORDER")
    return out


def config_of(cand) -> dict:
    """The launch configuration (``launch_args``' ``config``) of a candidate tuple."""
    if len(cand) > len(CAND_FIELDS) or len(cand) < 3:
        raise ValueError(f"a Gluon candidate has 3..{len(CAND_FIELDS)} fields {CAND_FIELDS}, got {cand!r}")
    cfg = {**CAND_DEFAULTS, **dict(zip(CAND_FIELDS, cand))}
    return dict(cfg, CONSUMER_REGS=240)


def describe(cand) -> str:
    """A short name of a candidate for tables: ``n128 s2 r168`` plus its switched-on flags."""
    cfg = config_of(cand)
    flags = [_FLAG_NAMES[k] + ("" if cfg[k] == 1 else str(cfg[k])) for k in _FLAG_NAMES if cfg[k]]
    return " ".join([f"n{cfg['BLOCK_N']} s{cfg['NUM_STAGES']} r{cfg['maxnreg']}"] + flags)


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


_STATICS: dict = {}  # (D1, D2, config, causal, VARIANT) -> (block_n, constexprs, options): the per-call host work
_MAX_STATICS = 1024


def _statics(D1, D2, config, causal, variant):
    key = (D1, D2, tuple(sorted((config or {}).items())), bool(causal), variant)
    hit = _STATICS.get(key)
    if hit is None:
        cfg = {**kernel_config(D1, D2), **(config or {})}
        constexprs = dict(D1=D1, D2=D2, BLOCK_N=cfg["BLOCK_N"], NUM_STAGES=cfg["NUM_STAGES"], CAUSAL=bool(causal),
                          CONSUMER_REGS=cfg["CONSUMER_REGS"], VARIANT=variant, SCHED=sched_of(cfg))
        options = dict(num_warps=4)
        if cfg.get("maxnreg"):
            options["maxnreg"] = cfg["maxnreg"]
        if len(_STATICS) >= _MAX_STATICS:
            _STATICS.clear()
        hit = _STATICS[key] = (cfg["BLOCK_N"], constexprs, options)
    return hit


def launch_args(q1, k1, q2, k2, causal, scale1, scale2, kl, lse1_bits, lse2_bits, config=None):
    """(grid, positional args, constexprs, options) of one forward launch; also used by the CI
    compile test, which passes the same descriptors to ``GluonASTSource``. ``config``: entries
    that replace :func:`kernel_config`'s (the GPU script's config sweep). A diagnostic variant
    forced by ``forcing(attention_fwd_variant=...)`` computes wrong results, for timing only."""
    B, H, N_Q, D1 = q1.shape
    N_K, D2 = k1.shape[2], q2.shape[3]
    variant = _diagnostics.attention_fwd_variant(_forcing.forced("attention_fwd_variant"))
    block_n, constexprs, options = _statics(D1, D2, config, causal, variant)
    descs = (make_descriptor(q1, _kernel.WG_M.value), make_descriptor(k1, block_n),
             make_descriptor(q2, _kernel.WG_M.value), make_descriptor(k2, block_n))
    args = descs + (kl, lse1_bits, lse2_bits, H, N_Q, N_K, H // k1.shape[1], H // k2.shape[1],
                    scale1 * _kernel.LOG2E, scale2 * _kernel.LOG2E, 1)
    grid = (triton.cdiv(N_Q, _kernel.BLOCK_M.value), B * H)
    return grid, args, dict(constexprs), dict(options)


def waits_per_tile(sched: int) -> int:
    """The wgmma waits in the source of one key-tile loop body: two per (sub-)tile product pair."""
    if (sched >> _kernel.SCHED_BITS["LOOK"][0]) & 1:  # two key tiles per iteration of the whole-tile loop
        return 4
    if (sched >> _kernel.SCHED_BITS["POLY"][0]) & 3 == 3:  # the loop holds both tile bodies (a branch on i % 2)
        return 4
    return 2 * (1 + ((sched >> _kernel.SCHED_BITS["SPLIT"][0]) & 1))


def gluon_forward(q1, k1, q2, k2, causal, scale1, scale2, out=None, config=None):
    """Launch the Gluon forward: (kl nats, lse1_bits, lse2_bits), float32 [B, H, N_Q].

    The caller (``use_gluon``) has checked the shapes, dtypes, strides and device. ``out``: an
    optional triple of output buffers (the API passes NaN-poisoned ones in tests); ``config``:
    see :func:`launch_args`. The launch is recorded for an open ``forcing`` block."""
    B, H, N_Q, _ = q1.shape
    if out is None:
        out = tuple(torch.empty((B, H, N_Q), dtype=torch.float32, device=q1.device) for _ in range(3))
    kl, lse1_bits, lse2_bits = out
    grid, args, constexprs, options = launch_args(q1, k1, q2, k2, causal, scale1, scale2, kl, lse1_bits, lse2_bits,
                                                  config)
    kernel = _launch(grid, args, constexprs, options)
    _forcing.record("attention_fwd_sm90", kernel, **constexprs)
    return kl, lse1_bits, lse2_bits


# Compiled kernels kept per specialisation (on by default: outputs bitwise equal to the JIT
# launch's, bound then direct; host time per API call 140 -> 112 us at B=1 H=32 N=2K on the H200
# with triton 3.6, the kernel's time unchanged). STREAMKL_FAST_LAUNCH=0 turns it off.
_COMPILED: dict = {}  # specialisation key -> (CompiledKernel, the constexpr tail in parameter order)
FAST_STATS = {"direct": 0, "bound": 0}


def _launch(grid, args, constexprs, options):
    """``_gluon_kl_fwd_kernel[grid](*args, **constexprs, **options)``; unless ``STREAMKL_FAST_LAUNCH=0``
    the first launch of each specialisation keeps the compiled kernel and later ones call its
    launcher directly (``_fast_launch``'s method and key: what Triton specialises each argument
    on, descriptors by type, block shape, dtype and base alignment), saving the JIT binder's
    tens of microseconds per call (the 2K points of the no-regression grid are host-bound).
    In a compile-ahead thread (``_core.launcher``) it only compiles."""
    if _fast_launch.compiling_ahead():
        return _fast_launch.kernel_call(_kernel._gluon_kl_fwd_kernel, grid)(*args, **constexprs, **options)
    if not _fast_launch.enabled():
        return _kernel._gluon_kl_fwd_kernel[grid](*args, **constexprs, **options)
    key = (tuple(constexprs.items()), tuple(sorted(options.items())), tuple(_fast_launch._spec(a) for a in args))
    hit = _COMPILED.get(key)
    if hit is None:
        kernel = _kernel._gluon_kl_fwd_kernel[grid](*args, **constexprs, **options)
        if hasattr(kernel, "result"):  # an asynchronous compile (triton >= 3.5)
            kernel = kernel.result()
        if len(_COMPILED) >= 1024:
            _COMPILED.clear()
        _COMPILED[key] = (kernel, _fast_launch._tail(_kernel._gluon_kl_fwd_kernel, len(args), constexprs, {})[0])
        FAST_STATS["bound"] += 1
        return kernel
    kernel, tail = hit
    stream = _fast_launch._raw_stream(torch.cuda.current_device())
    kernel.run(grid[0], grid[1], 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *args, *tail)
    FAST_STATS["direct"] += 1
    return kernel
