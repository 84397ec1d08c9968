"""``streamkl verify``: kernels against the references, as a numerical gate.

Without ``--impl`` it runs streamkl's own kernels: ``streamkl_gpu.attention_kl`` (forward, and
backward in both the fused and separate modes) on a battery of cases — shapes that don't divide
the tiles, N = 1, GQA on either side, D1 != D2, causal with N_Q < N_K and N_Q > N_K (empty rows),
split-K, large logits — then packed sequences (``attention_kl_varlen``: zero-length, length-1
and key-less sequences), the NaN-planting cases, and ``streamkl_gpu.indexer_kl`` (the indexer
battery of ``streamkl_ref.testing``, and its Megatron mean). Every output and gradient is compared
with ``streamkl_ref`` in float64 (and with mpmath for the small cases). On a GPU it runs fp32,
fp16 and bf16; on CPU, under the Triton interpreter, fp32 and fp16 (the interpreter's bf16 dot
is wrong, and the kernels compute bf16 in fp32 there).

The battery is a list of units, one per case of the report (:func:`own_units`); each draws its
inputs from its own generator (seed and case name), so its rows do not depend on the process it
runs in or on what ran before it. ``--jobs N`` checks them in N spawned worker processes (on a
GPU, by default), one dtype of one case at a time: a first GPU run is mostly Triton compiling
kernel variants, CPU work that runs well side by side, and each dtype compiles kernels of its
own; the rows come back in battery order, the same rows as in one process.

With ``--impl MODULE:FUNCTION`` it runs the conformance suite of ``streamkl_ref.testing``
(``check_attention_kl``, or ``check_indexer_kl`` with ``--indexer``) against that callable: the
same battery (plus NaN-planting cases), the same reference, table, JSON and exit status.

The tolerance rule (one home: ``streamkl_ref.testing.tolerance``), FlashAttention's: an output
passes when its error against the float64 reference is at most ``C`` times the error that the
same math, done densely in PyTorch at the inputs' precision, makes against that reference, plus a
floor. Errors are relative Frobenius norms.

Exit status: 0 when every row passes, 1 otherwise (2 for a usage or set-up problem).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import importlib
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from streamkl_ref._testing import reference_cache, same_precision
from streamkl_ref.testing import (
    CASE_SETS,
    FLOOR,
    INDEXER_SUPPORT_KEYS,
    SUPPORT_KEYS,
    ZERO_GRAD_TOL,
    Report,
    Row,
    attention_cases,
    case_generator,
    check_attention_kl,
    check_indexer_kl,
    indexer_cases,
    kl_error_and_tolerance,
    kl_row_floor,
    relative_error,
    tolerance,
)

from streamkl_gpu.verify_workers import (  # the runner (re-exported: tests and tools use verify.run_units)
    EarlyWorkers,
    RunSettings,
    _cpu_seconds,
    _interpreter_checks,
    _warm_worker,
    _worker_ready,
    hand_out_order,
    run_units,
)

MP_MAX_SCORES = 1500  # mpmath check only for B*H*N_Q*N_K up to this
CPU_ONE_DTYPE_NK = 128  # on CPU, cases with more keys (several tiles) run in the first dtype only
# cases with this many keys also check settings 1 and 2 (one trained side) with the default
# backward mode: a training step's path, on Hopper the Gluon backward where it applies
# (attention/gluon/bwd_dispatch.auto_takes)
SETTINGS_MIN_KEYS = 2048
MAX_DEFAULT_JOBS = 8  # worker processes of a GPU run without --jobs, at most
FLOAT32_COST = 2  # a float32 case's compile cost against a 16-bit one's (Unit.cost)

DESCRIPTION = """\
Check attention-KL kernels against the float64 references, as a numerical gate.

Without --impl: streamkl's own kernels: streamkl_gpu.attention_kl (forward; backward in the
fused and separate modes; split-K; NaN planting) and streamkl_gpu.indexer_kl, case by case in
--jobs worker processes (default on a GPU: min(8, CPU cores), since a first run is mostly Triton
compiling, CPU work; on CPU: 1), with the rows of a run in one process.
With --impl MODULE:FUNCTION: your callable, through the conformance suite of
streamkl_ref.testing (the same battery plus NaN-planting cases). It is called as
FUNCTION(q1, k1, q2, k2, causal=..., scale1=..., scale2=...) with torch tensors, or, with
--indexer, as FUNCTION(q, k, q_idx, k_idx, weights, causal=..., scale=..., relu=...).

An output passes when its relative error against float64 is at most C times the error of the
same math done densely in PyTorch at the inputs' precision, plus a floor per dtype.
Exit status: 0 when every row passes, 1 when any fails, 2 for a usage or set-up problem."""

EPILOG = """\
examples:
  streamkl verify --quick
  streamkl verify --jobs 16 --json report.json
  streamkl verify --only tiles_300,indexer:gqa --jobs 1
  streamkl verify --impl mypkg.kl:attention_kl --layout bnhd --returns sum --json report.json
  streamkl verify --impl mypkg.kl:attention_kl --cases all --seed 3
  streamkl verify --impl mypkg.kl:kl_sdpa --causal-align top-left --no-grad"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``streamkl verify``."""
    p = argparse.ArgumentParser(prog="streamkl verify", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto (default): the GPU if there is one, else CPU (Triton kernels run "
                        "under the Triton interpreter there)")
    p.add_argument("--quick", action="store_true", help="the quick subset of the cases (a fast smoke gate)")
    p.add_argument("--cases", choices=CASE_SETS, default="default",
                   help="default: the battery for the device (the small cases on CPU, a few hundred keys at "
                        "most; plus the large ones on a GPU); large: the large cases only (head dims up to "
                        "128 or 576, hundreds of rows, 4096 keys); all: both, on any device")
    p.add_argument("--json", metavar="PATH",
                   help="also write the report as JSON to PATH (rows, and the shapes and options of each case)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--autotune", action="store_true",
                   help="own kernels on a GPU: time every launch candidate; default: the shape "
                        "rule's config of each shape class, untimed (one compile per kernel variant)")
    p.add_argument("--jobs", type=int, metavar="N",
                   help="check the cases in N worker processes (default: on a GPU min(8, CPU cores), as a "
                        "first run is mostly Triton compiling, CPU work that runs well side by side; on CPU 1); "
                        "1: all in this process")
    p.add_argument("--no-reference-cache", action="store_true",
                   help="compute every float64 reference (by default a GPU run keeps them under "
                        "$STREAMKL_CACHE_DIR/reference, keyed by the reference code and the exact inputs)")
    p.add_argument("--only", metavar="NAMES",
                   help="only these cases of the battery (comma list, names as in the report, e.g. "
                        "n=1,varlen_mixed,indexer:gqa); each gets the inputs it gets in the full run")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-case progress lines on stderr")
    g = p.add_argument_group("checking your own implementation")
    g.add_argument("--impl", metavar="MODULE:FUNCTION",
                   help="the callable to check instead of streamkl's kernels (imported from the "
                        "current directory or sys.path)")
    g.add_argument("--indexer", action="store_true",
                   help="FUNCTION is an indexer loss (q, k, q_idx, k_idx, weights, *, causal, scale, relu)")
    g.add_argument("--no-grad", action="store_true", help="check the forward only (no gradients)")
    g.add_argument("--layout", choices=["bhnd", "bnhd"], default="bhnd",
                   help="tensor layout FUNCTION takes: bhnd = [B, H, N, D] (default), "
                        "bnhd = [B, N, H, D] (flash-attn); rows are returned in the same order")
    g.add_argument("--causal-align", choices=["bottom-right", "top-left"], default="bottom-right",
                   help="what causal=True means to FUNCTION: bottom-right (default, FlashAttention) "
                        "or top-left (SDPA's is_causal; causal cases with N_Q > N_K are then skipped)")
    g.add_argument("--returns", choices=["rows", "sum", "mean"], default="rows",
                   help="what FUNCTION returns: KL per query row (default), or its sum or mean")
    g.add_argument("--dtypes", metavar="LIST",
                   help="comma list of input dtypes, e.g. float32,bfloat16 (default: float32 on "
                        "CPU, float32,bfloat16 on a GPU)")
    g.add_argument("--supports", metavar="JSON",
                   help='claims of FUNCTION as a JSON object, e.g. \'{"gqa": false, "nan_isolation": "forward"}\'; '
                        "cases outside them are reported skipped. Keys: "
                        + "; ".join(f"{k} ({v})" for k, v in SUPPORT_KEYS.items())
                        + ". With --indexer: " + ", ".join(k for k in INDEXER_SUPPORT_KEYS if k not in SUPPORT_KEYS)
                        + " too, and grad_inputs of q_idx, k_idx, weights")
    return p

# packed sequences (attention_kl_varlen): (name, [(n_q, n_k), ...], H, HK1, HK2, D1, D2, causal, split_k)
VARLEN_CPU_CASES = [
    ("varlen_mixed", [(5, 9), (0, 4), (17, 17), (1, 1), (6, 0), (20, 7)], 4, 2, 1, 16, 24, True, None),
    ("varlen_noncausal_splitk", [(3, 40), (9, 9), (0, 0), (12, 33)], 2, 1, 2, 16, 16, False, 3),
]
VARLEN_WHY = ("packed sequences (cu_seqlens): zero-length, length-1 and key-less sequences, each sequence "
              "masked from its neighbours")
VARLEN_GPU_CASES = VARLEN_CPU_CASES + [
    # >= 2048 keys in one sequence: the forward reads keys through TMA descriptors (Hopper)
    ("varlen_big", [(300, 300), (0, 64), (1, 1), (513, 700), (129, 0), (2100, 2300)], 8, 2, 4, 128, 64, True, None),
]


# On a GPU each new kernel specialisation compiles once (seconds; tens of seconds for an fp32
# kernel at D = 128, whose IEEE dots unroll into huge code), so the GPU battery runs every case in
# at least one dtype and the extra dtypes only where the kernels are small: cases with a head dim
# above GPU_SMALL_HEAD_DIM run in bfloat16 alone, and float16 (the same kernels as bfloat16 with
# another element type) on the quick attention cases and the first packed-sequence case only.
# docs/verify.md, "On the GPU", lists the case-dtype pairs this leaves out.
GPU_SMALL_HEAD_DIM = 32


def gpu_case_dtypes(head_dims, dtypes, fp16=False):
    """The dtypes of ``dtypes`` (names or torch dtypes) a GPU run checks a case with these head
    dims in; ``fp16``: float16 too, where the heads are small."""
    def name(d):
        return str(d).replace("torch.", "")
    if max(head_dims) > GPU_SMALL_HEAD_DIM:
        return [d for d in dtypes if name(d) == "bfloat16"] or list(dtypes[:1])
    return [d for d in dtypes if fp16 or name(d) != "float16"] or list(dtypes[:1])


# ---- streamkl's own kernels: the battery as units, one per case of the report, each checked in
# its dtypes by a module-level function (a worker process imports it by name)

@dataclass(frozen=True)
class Unit:
    """One case of the own-kernel battery and the dtypes it runs in. ``check(case, dtype, seed,
    device, report)`` checks one dtype, adding its rows and its entry of ``report.cases``. It draws
    its inputs from the case's own generator (``case_generator(seed, name)``), so a unit's rows
    are the same in whichever process it runs and whatever ran before it."""

    name: str  # the case, as the report names it
    check: Callable
    case: Any  # a Case, an IndexerCase or an entry of VARLEN_*_CASES
    dtypes: tuple  # dtype names
    head_dims: tuple

    def cost(self, dtype: str) -> int:
        """A static estimate of the first run's compile time of this case in ``dtype``, to start
        the expensive work first: kernels grow with the head dim, and a float32 kernel (IEEE dots,
        which unroll into far more code) costs about twice a 16-bit one (measured on an H200:
        float32 1.2-2.6x bfloat16 per case, bench/results/2026-12-04_h200_c67a99f/verify_cold.json
        and verify_quick_cold.json)."""
        return max(self.head_dims) * (FLOAT32_COST if dtype == "float32" else 1)


def own_dtypes(device: str, quick: bool = False) -> list:
    """The dtypes streamkl's own kernels are checked in: float32, float16 and, on a GPU, bfloat16
    (the interpreter's bf16 dot is wrong); ``--quick`` on a GPU: float32 and bfloat16."""
    if device != "cuda":
        return ["float32", "float16"]
    return ["float32", "bfloat16"] if quick else ["float32", "float16", "bfloat16"]


def own_units(device: str, quick: bool = False, which: str = "default") -> list:
    """The own-kernel battery, one :class:`Unit` per case, in report order: the attention cases,
    the packed sequences, the NaN-planting cases, the indexer cases and the indexer's mean."""
    on_gpu = device == "cuda"
    dtypes = own_dtypes(device, quick)
    rest = dtypes[:1] if quick else dtypes  # NaN planting and the indexer; the smoke gate: the first dtype

    def pick(dims, names, fp16=False):
        return tuple(gpu_case_dtypes(dims, names, fp16) if on_gpu else names)

    units = []
    for c in attention_cases(device, quick=quick, planted=False, which=which):
        case_dtypes = pick((c.D1, c.D2), dtypes, c.quick)
        if not on_gpu and c.NK > CPU_ONE_DTYPE_NK:
            case_dtypes = case_dtypes[:1]  # interpreted, a multi-tile case costs seconds per dtype
        units.append(Unit(c.name, _check_attention_case, c, case_dtypes, (c.D1, c.D2)))
    varlen = VARLEN_GPU_CASES if on_gpu else VARLEN_CPU_CASES
    for i, v in enumerate(varlen[:1] if quick else varlen):
        units.append(Unit(v[0], _check_varlen_case, v, pick((v[5], v[6]), dtypes, fp16=i == 0), (v[5], v[6])))
    planted = [c for c in attention_cases(device, which=which) if c.plant]
    for c in planted[:1] if quick else planted:
        units.append(Unit(c.name, _check_planted_case, c, pick((c.D1, c.D2), rest), (c.D1, c.D2)))
    for c in indexer_cases(device, quick=quick, which=which):
        units.append(Unit("indexer:" + c.name, _check_indexer_case, c, pick((c.D, c.DI), rest), (c.D, c.DI)))
    if not quick:
        for c in indexer_cases(device, which=which):
            if c.name in ("causal_nq>nk", "gqa"):
                units.append(Unit("indexer(mean):" + c.name, _check_indexer_mean_case, c, tuple(rest[:1]),
                                  (c.D, c.DI)))
    return units


def default_jobs(device: str) -> int:
    """Worker processes of a run without ``--jobs``: on a GPU, min(8, the CPU cores this process
    may use): the run is mostly Triton compiling, CPU work that runs well side by side; elsewhere
    1 (the interpreter is CPU-bound itself)."""
    if device != "cuda":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_DEFAULT_JOBS, cores))


def _parse(argv):
    p = build_parser()
    args = p.parse_args(argv)
    if args.seed < 0:
        p.error(f"--seed must be a non-negative int, got {args.seed}")
    if args.jobs is not None and args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.impl is not None and (args.jobs is not None or args.only is not None):
        p.error("--jobs and --only run streamkl's own kernels: they do not go with --impl")
    if args.impl is None:
        for opt, dflt in (("indexer", False), ("no_grad", False), ("layout", "bhnd"),
                          ("causal_align", "bottom-right"), ("returns", "rows"), ("dtypes", None),
                          ("supports", None)):
            if getattr(args, opt) != dflt:
                p.error(f"--{opt.replace('_', '-')} needs --impl MODULE:FUNCTION")
    elif ":" not in args.impl:
        p.error(f"--impl must be MODULE:FUNCTION, got {args.impl!r}")
    return args


def main(argv=None) -> int:
    try:
        args = _parse(argv)
    except SystemExit as exc:  # --help (0), usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    # a correctness gate needs no launch tuning: one config per shape class (set before any launch)
    saved = os.environ.get("STREAMKL_AUTOTUNE")
    os.environ["STREAMKL_AUTOTUNE"] = "1" if args.autotune else "0"
    try:
        return _run(args)
    finally:
        if saved is None:
            os.environ.pop("STREAMKL_AUTOTUNE", None)
        else:
            os.environ["STREAMKL_AUTOTUNE"] = saved


def _pick_device(args):
    import torch  # after argument parsing: --help needs no torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("streamkl verify: --device cuda, but torch sees no CUDA GPU", file=sys.stderr)
        return None
    if device == "cpu":
        # must happen before the kernel modules are imported (they are imported lazily)
        api = sys.modules.get("streamkl_gpu.api")
        if api is not None and not api.interpreting():
            print("streamkl verify: the kernels were already loaded for the GPU; run in a fresh "
                  "process with TRITON_INTERPRET=1", file=sys.stderr)
            return None
        os.environ["TRITON_INTERPRET"] = "1"
    return device


def _run(args) -> int:
    early = start_workers_early(args)  # before this process imports torch (_pick_device)
    try:
        device = _pick_device(args)
        if device is None:
            return 2
        # (another device: a GPU seen in /dev that torch does not see; the pool is shut down below)
        return _run_on(args, device, early if early is not None and early.device == device else None)
    finally:
        if early is not None:
            early.pool.shutdown(wait=False, cancel_futures=True)


def _run_on(args, device, early) -> int:
    if device != "cpu":
        return _run_impl(args, device) if args.impl is not None else _run_own(args, device, early)
    from streamkl_gpu.devtools import bounds as _interpreter_bounds

    with _interpreter_checks():
        try:
            return _run_impl(args, device) if args.impl is not None else _run_own(args, device, early)
        except (_interpreter_bounds.OutOfBoundsAccess, _interpreter_bounds.DataRace) as exc:
            print(f"streamkl verify: FAIL, {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1


def _finish(report: Report, args, device_name: str, extra: dict) -> int:
    import numpy as np
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # a user's pure-PyTorch implementation needs no Triton
        triton_version = None
    print(report.table())
    print(f"\n{report.summary()}  ({len(report.cases)} cases on {device_name}, {report.elapsed_s:.1f} s; "
          f"torch {torch.__version__}, triton {triton_version})")
    if args.json:
        out = report.to_dict()
        out.update({
            "device": device_name, "torch": torch.__version__, "triton": triton_version,
            "numpy": np.__version__, "python": platform.python_version(),
            "date": datetime.date.today().isoformat(), **extra,
        })
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2, allow_nan=False)
    return 0 if report.passed else 1


def _append(report: Report, other: Report, prefix: str = "") -> None:
    """Add another report's rows and cases to ``report`` (case names prefixed)."""
    for r in other.rows:
        r.case = prefix + r.case
        report.rows.append(r)
    for name, case in other.cases.items():
        report.cases[prefix + name] = case


def _load_impl(spec: str):
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    module = importlib.import_module(module_name)
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"{spec} is not callable")
    return fn


def _run_impl(args, device: str) -> int:
    import torch

    from streamkl_ref import testing

    try:
        fn = _load_impl(args.impl)
    except Exception as exc:  # noqa: BLE001 (a set-up problem: exit 2 with the reason)
        print(f"streamkl verify: cannot load --impl {args.impl}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if args.dtypes:
        dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    else:
        dtypes = ("float32",) if device == "cpu" else ("float32", "bfloat16")
    try:
        supports = json.loads(args.supports) if args.supports else None
    except json.JSONDecodeError as exc:
        print(f"streamkl verify: --supports is not JSON: {exc}", file=sys.stderr)
        return 2
    check = testing.check_indexer_kl if args.indexer else testing.check_attention_kl
    kwargs = dict(device=device, dtypes=dtypes, grads=not args.no_grad, quick=args.quick,
                  layout=args.layout, causal_align=args.causal_align, returns=args.returns,
                  supports=supports, seed=args.seed, cases=args.cases)
    try:
        with reference_cache.kept_in(reference_directory(args, device)):
            report = check(fn, **kwargs)
    except ValueError as exc:  # a bad option value (dtype name, supports key, ...)
        print(f"streamkl verify: {exc}", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return _finish(report, args, name, {"impl": args.impl, "loss": "indexer" if args.indexer else "attention"})


def _record(report, case, dname, quantity, err, tol, ok=None, note=""):
    ok = (err <= tol) if ok is None else ok
    report.rows.append(Row(case, dname, quantity, float(err), float(tol), "pass" if ok else "fail", note))


def _check_attention_case(case, dname, seed, device, report):
    """``streamkl_gpu.attention_kl`` on one case in one dtype: the KL (also against mpmath when
    small, split-K against one pass, empty rows exactly 0) and the four gradients of both
    backward modes; from ``SETTINGS_MIN_KEYS`` keys also settings 1 and 2 in the default mode."""
    import numpy as np
    import torch

    import streamkl_ref
    from streamkl_gpu import api

    report.cases[case.name] = case.to_dict()
    name, B, H, NQ, NK = case.name, case.B, case.H, case.NQ, case.NK
    gen = case_generator(seed, case)
    base = [torch.randn(*shape, generator=gen) for shape in case.shapes.values()]
    g = torch.randn(B, H, NQ, generator=gen)
    dtype = getattr(torch, dname)

    def record(*row, **kw):
        _record(report, name, dname, *row, **kw)

    xs = [x.to(dtype) for x in base]  # the exact inputs the kernel sees
    x64 = [x.double().numpy() for x in xs]
    kw = dict(causal=case.causal, scale1=case.scale1, scale2=case.scale2)
    ref_kl, ref_lse1, ref_lse2 = reference_cache.call(streamkl_ref.attention_kl, *x64, return_lse=True, **kw)
    row_floor = kl_row_floor(ref_lse1, ref_lse2, ref_kl, dname)
    ref_grad = reference_cache.call(streamkl_ref.attention_kl_grad, *x64, g.double().numpy(), **kw)
    # the same math at the inputs' precision: sets the tolerance scale
    same = same_precision.call(same_precision.attention_kl_same, *x64, g.double().numpy(), dtype=dname, **kw)
    same_kl = same["kl"]
    floor = FLOOR[dname]
    dev_xs = [x.to(device) for x in xs]
    kl = api.attention_kl(*dev_xs, split_k=case.split_k, **kw)
    record("kl", *kl_error_and_tolerance(kl, ref_kl, same_kl, row_floor, dname))
    if case.split_k is not None:
        kl1 = api.attention_kl(*dev_xs, split_k=1, **kw)
        err = relative_error(kl, kl1.double().cpu().numpy())
        record("kl split-K vs one pass", err, 8 * floor)
    if case.causal and NQ > NK:
        empty = slice(0, NQ - NK)
        ok = bool((kl[..., empty] == 0).all())
        record("kl of empty rows == 0", 0.0 if ok else 1.0, 0.0, ok)
    if B * H * NQ * NK <= MP_MAX_SCORES and dtype == torch.float32:
        mp_kl = reference_cache.call(streamkl_ref.attention_kl_mp, *x64, dps=50, **kw)
        record("kl vs mpmath", *kl_error_and_tolerance(kl, mp_kl, same_kl, row_floor, dname))
    for mode in ("fused", "separate"):
        ins = [x.clone().requires_grad_(True) for x in dev_xs]
        out = api.attention_kl(*ins, bwd_mode=mode, **kw)
        out.backward(g.to(device))
        for tname, t in zip(("dq1", "dk1", "dq2", "dk2"), ins):
            if not np.any(ref_grad[tname]):
                # exactly zero gradient (e.g. one key per row): relative error is undefined;
                # the kernel's fp32 arithmetic must leave only rounding noise of O(1) terms
                err = t.grad.detach().double().abs().max().item()
                record(f"{tname} ({mode}) max|.|", err, ZERO_GRAD_TOL, note="reference gradient is exactly 0")
                continue
            tol = tolerance(relative_error(same[tname], ref_grad[tname]), dname)
            record(f"{tname} ({mode})", relative_error(t.grad, ref_grad[tname]), tol)
    if NK < SETTINGS_MIN_KEYS:
        return
    for setting, trained in ((1, ("dq2", "dk2")), (2, ("dq1", "dk1"))):
        ins = [x.clone().requires_grad_(n in trained) for n, x in zip(("dq1", "dk1", "dq2", "dk2"), dev_xs)]
        api.attention_kl(*ins, **kw).backward(g.to(device))
        for tname, t in zip(("dq1", "dk1", "dq2", "dk2"), ins):
            if tname in trained:
                tol = tolerance(relative_error(same[tname], ref_grad[tname]), dname)
                record(f"{tname} (setting {setting})", relative_error(t.grad, ref_grad[tname]), tol)


def _check_varlen_case(case, dname, seed, device, report):
    """``streamkl_gpu.attention_kl_varlen`` on one packing in one dtype: the KL (key-less
    sequences exactly 0) and the four gradients of both backward modes."""
    import numpy as np
    import torch

    import streamkl_ref
    from streamkl_gpu import attention_kl_varlen

    name, lens, H, HK1, HK2, D1, D2, causal, split = case
    report.cases[name] = {"kind": "varlen", "seqlens_qk": [list(x) for x in lens], "H": H, "HK1": HK1,
                          "HK2": HK2, "D1": D1, "D2": D2, "causal": causal, "split_k": split, "why": VARLEN_WHY}
    tq, tk = sum(a for a, _ in lens), sum(b for _, b in lens)
    gen = case_generator(seed, name)
    base = [torch.randn(tq, H, D1, generator=gen), torch.randn(tk, HK1, D1, generator=gen),
            torch.randn(tq, H, D2, generator=gen), torch.randn(tk, HK2, D2, generator=gen)]
    g = torch.randn(tq, H, generator=gen)
    cu_q = torch.tensor([0] + list(np.cumsum([a for a, _ in lens])), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(np.cumsum([b for _, b in lens])), dtype=torch.int32)
    mq, mk = max(a for a, _ in lens), max(b for _, b in lens)
    dtype = getattr(torch, dname)

    def record(*row, **kw):
        _record(report, name, dname, *row, **kw)

    xs = [x.to(dtype) for x in base]
    x64 = [x.double().numpy() for x in xs]
    packing = (cu_q.numpy(), cu_k.numpy(), mq, mk)
    ref_kl, ref_lse1, ref_lse2 = reference_cache.call(streamkl_ref.attention_kl_varlen, *x64, *packing, causal=causal,
                                                      return_lse=True)
    row_floor = kl_row_floor(ref_lse1, ref_lse2, ref_kl, dname)
    ref_grad = reference_cache.call(streamkl_ref.attention_kl_varlen_grad, *x64, *packing, g.double().numpy(),
                                causal=causal)
    # the same math at the inputs' precision, sequence by sequence (tolerance scale)
    same = same_precision.call(same_precision.attention_kl_varlen_same, *x64, *packing[:2], g.double().numpy(),
                               dtype=dname, causal=causal)
    same_kl = same["kl"]
    dev_xs = [x.to(device) for x in xs]
    dev_cu = (cu_q.to(device), cu_k.to(device), mq, mk)
    kl = attention_kl_varlen(*dev_xs, *dev_cu, causal=causal, split_k=split)
    record("kl", *kl_error_and_tolerance(kl, ref_kl, same_kl, row_floor, dname))
    no_keys = [i for i, (a, b) in enumerate(lens) if a and not b]
    if no_keys:
        ok = all(bool((kl[int(cu_q[i]):int(cu_q[i + 1])] == 0).all()) for i in no_keys)
        record("kl no-key seqs == 0", 0.0 if ok else 1.0, 0.0, ok)
    for mode in ("fused", "separate"):
        ins = [x.clone().requires_grad_(True) for x in dev_xs]
        out = attention_kl_varlen(*ins, *dev_cu, causal=causal, bwd_mode=mode)
        out.backward(g.to(device))
        for tname, t in zip(("dq1", "dk1", "dq2", "dk2"), ins):
            tol = tolerance(relative_error(same[tname], ref_grad[tname]), dname)
            record(f"{tname} ({mode})", relative_error(t.grad, ref_grad[tname]), tol)


# the NaN/inf isolation contract (planted cases) and the indexer loss: through the conformance suite
def _check_planted_case(case, dname, seed, device, report):
    from streamkl_gpu import api

    _append(report, check_attention_kl(api.attention_kl, device=device, dtypes=[dname], cases=[case], seed=seed))


def _check_indexer_case(case, dname, seed, device, report):
    from streamkl_gpu import indexer_kl

    _append(report, check_indexer_kl(indexer_kl, device=device, dtypes=[dname], cases=[case], seed=seed),
            prefix="indexer:")


def _indexer_mean(*args, **kwargs):
    """The indexer loss with Megatron's reduction: the mean over the rows that see a key."""
    from streamkl_gpu import indexer_kl

    return indexer_kl(*args, reduction="mean", **kwargs)


def _check_indexer_mean_case(case, dname, seed, device, report):
    _append(report, check_indexer_kl(_indexer_mean, device=device, dtypes=[dname], returns="mean", cases=[case],
                                     seed=seed), prefix="indexer(mean):")


def _gpu_visible() -> bool:
    """A cheap guess, without torch, that torch will see an NVIDIA GPU: the driver's device
    nodes exist and ``CUDA_VISIBLE_DEVICES`` hides none of them all."""
    import glob

    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def start_workers_early(args):
    """Start the run's worker processes now, before this process imports torch, where the run
    will use them: the parent's torch import (seconds) and the workers' own imports then overlap.
    Only where the device is known without torch (``--device cuda``, ``--device cpu`` with
    ``--jobs``, or ``auto`` with a GPU's device nodes present) and more than one worker will run;
    otherwise None (the pool starts later, as it would). ``_run`` shuts the pool down if torch
    then sees another device."""
    if args.impl is not None:
        return None
    device = args.device
    if device == "auto":
        device = "cuda" if _gpu_visible() else None
    if device is None or (device == "cpu" and args.jobs is None):
        return None
    units, unknown = selected_units(args, device)
    jobs = 0 if unknown else run_jobs(args, device, units)
    if jobs <= 1:
        return None
    if device == "cpu":  # before the workers import the kernel modules (as _pick_device does here)
        os.environ["TRITON_INTERPRET"] = "1"
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_warm_worker,
                               initargs=(device,))
    for _ in range(jobs):  # a pool starts its processes as work arrives
        pool.submit(_worker_ready)
    return EarlyWorkers(pool, device, jobs)


def reference_directory(args, device: str):
    """Where the float64 references persist (``streamkl_ref._testing.reference_cache``): on a GPU
    ``$STREAMKL_CACHE_DIR/reference`` (default ``$XDG_CACHE_HOME/streamkl``, else
    ``~/.cache/streamkl``), so a warm gate recomputes none; None on CPU (the interpreter's own
    time dominates there) and with ``--no-reference-cache``."""
    if device == "cpu" or getattr(args, "no_reference_cache", False):
        return None
    from streamkl_gpu._core.tuning import cache_root

    return os.path.join(cache_root(), "reference")


def selected_units(args, device: str):
    """``(units, unknown)``: the battery's units that ``--only`` selects (all without it), and
    the names it gives that the battery lacks, sorted."""
    units = own_units(device, quick=args.quick, which=args.cases)
    if not args.only:
        return units, []
    wanted = {name.strip() for name in args.only.split(",") if name.strip()}
    return [u for u in units if u.name in wanted], sorted(wanted - {u.name for u in units})


def run_jobs(args, device: str, units: list) -> int:
    """Worker processes of the run: ``--jobs`` or :func:`default_jobs`, at most one per unit."""
    return max(1, min(args.jobs or default_jobs(device), len(units)))


def _run_own(args, device: str, early=None) -> int:
    import torch

    units, unknown = selected_units(args, device)
    if unknown:
        print(f"streamkl verify: --only: no case {', '.join(unknown)} in this battery; its cases: "
              + ", ".join(u.name for u in own_units(device, quick=args.quick, which=args.cases)), file=sys.stderr)
        return 2
    jobs = run_jobs(args, device, units)
    report = Report(options={"impl": "streamkl_gpu.attention_kl", "device": device, "quick": args.quick,
                             "cases": args.cases, "seed": args.seed, "dtypes": own_dtypes(device, args.quick),
                             "bwd_modes": ["fused", "separate"], "autotune": args.autotune})
    t_start, cpu_start = time.time(), _cpu_seconds()
    if jobs > 1 and not args.quiet:
        print(f"[{0:6.1f}s] {len(units)} cases in {jobs} worker processes", file=sys.stderr, flush=True)
    run = RunSettings(device, args.seed, args.quiet, t_start, reference_directory(args, device))
    outcomes = run_units(units, run, jobs, pool=None if early is None else early.pool)
    case_seconds, seen = {}, collections.Counter()
    for outcome in outcomes:
        report.rows += outcome.rows
        report.cases.update(outcome.cases)
        case_seconds.update(outcome.seconds)
        seen.update(outcome.bounds)
    if device == "cpu":  # every launch above ran bounds- and race-checked (a violation fails its case)
        _record(report, "interpreter", "-", "accesses outside the launch's tensors, races", 0.0, 0.0,
                ok=seen["launches"] > 0 and seen["race_checked_launches"] > 0,
                note=f"{seen['launches']} launches ({seen['race_checked_launches']} race-checked), "
                     f"{seen['checked_accesses']} element accesses checked"
                     + ("" if seen["launches"] > 0 else "; no launch was checked: the bounds checks were not on"))
    report.elapsed_s = time.time() - t_start
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    return _finish(report, args, device_name, {"elapsed_s": report.elapsed_s, "cpu_s": _cpu_seconds() - cpu_start,
                                               "jobs": jobs, "case_seconds": case_seconds})


if __name__ == "__main__":
    sys.exit(main())
