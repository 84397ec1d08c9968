#!/usr/bin/env python3
"""Every forward launch candidate of the indexer loss, forced one at a time (issue 10's targets).

    python bench/indexer_perf_gpu.py OUT_DIR --quick      # <= ~100 s on one H200 (compiles included)
    python bench/indexer_perf_gpu.py OUT_DIR              # the same with longer timings, N = 8K and 16K
    TRITON_INTERPRET=1 python bench/indexer_perf_gpu.py /tmp/x --tiny   # CPU smoke of the script

For each anchor config (DSA-like, GQA-like; bench/indexer_gpu.py's CONFIGS) and each candidate of
``streamkl_gpu.indexer.host._candidates("fwd", ...)`` (old and new: the tuner's full list):
  1. check: a small causal problem with ``lse`` given, KL vs float64 (streamkl_ref.indexer_kl),
     FlashAttention's rule: error <= 3 x the materialised bf16 form's error + 1e-2;
  2. time the forward with ``lse`` given at N = 8K causal, that candidate forced.
Then fwd+bwd (``reduction="mean"``, ``lse`` given; each variant first checked vs float64, loss and
the three gradients): the plain design with the fastest forward forced, once per backward
candidate (dq and dk kernels forced to the same config) and once with the fused backward; and
the accumulating design (STREAMKL_INDEXER_PACC=1) once per candidate of its forward
(--quick: the first backward candidate, the first "l1" one, fused, two accumulating). Last the
materialised form under torch.compile at 8K (fwd; fwd+bwd at DSA only under --quick); if it is
skipped (budget, --no-compile) the table's speed-ups use last session's recorded numbers, labelled.
Kernels are compiled first by parallel child processes (--parallel, default min(16, CPUs)).
A candidate that fails (compile error, resources, wrong numbers) is printed and skipped; past
``--budget`` seconds the remaining timings are skipped and marked so.

Outputs in OUT_DIR: indexer_perf.csv (long format: measure, provider, shape, value, unit, note),
indexer_perf.log. Short table last: ms, ratio to the forward matmul floor (bf16 rate of an
8192^3 matmul measured in this run) and speed-up over torch.compile.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
os.environ.setdefault("STREAMKL_TUNING_CACHE", "0")  # forced configs only: no stale disk choices

import numpy as np  # noqa: E402
import torch  # noqa: E402

import streamkl_ref  # noqa: E402
import streamkl_gpu  # noqa: E402
from streamkl_gpu.indexer.training import choice as idx_choice  # noqa: E402
from streamkl_gpu.indexer import configs as idx_configs  # noqa: E402
from streamkl_gpu.indexer import host as idx_host  # noqa: E402
from streamkl_gpu.indexer.api import indexer_kl_naive  # noqa: E402
from streamkl_gpu._core.forcing import forcing  # noqa: E402
from streamkl_ref._checks import check_indexer_inputs  # noqa: E402

from indexer_gpu import CONFIGS, _floor_flops, _rel_err  # noqa: E402

COLUMNS = ["measure", "provider", "shape", "value", "unit", "note"]
_ORIG_CANDIDATES = idx_configs._candidates


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tiny", action="store_true", help="CPU smoke (TRITON_INTERPRET=1)")
    p.add_argument("--configs", default="dsa,gqa")
    p.add_argument("--ns", default=None, help="N list (default 8192; full: 8192,16384)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--no-bwd", action="store_true", help="forward candidates only")
    p.add_argument("--budget", type=float, default=None, help="seconds; default 100 (--quick), 600")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds after which the table of what ran is printed and the run ends (default budget + 8)")
    p.add_argument("--parallel", type=int, default=None, help="warm-up compile processes (default: CPUs)")
    p.add_argument("--no-warm", action="store_true", help="compile in the timing process (one at a time)")
    p.add_argument("--warm-job", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tiny-warm", action="store_true", help=argparse.SUPPRESS)  # CPU smoke of the warm-up
    # CPU smoke of the Gluon phase: _gluon_indexer.emulate_states stands in for the kernel
    p.add_argument("--tiny-gluon-emulate", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.budget is None:
        a.budget = 100.0 if a.quick else 600.0
    if a.deadline is None:
        a.deadline = a.budget + 8.0
    return a


class Force:
    """Force one launch config per kernel kind (others: the tuner's first candidate)."""

    def __init__(self, **by_kind):
        self.by_kind = by_kind

    def __enter__(self):
        def cands(kind, ieee, dims=None, n_sm=132, **kw):
            full = _ORIG_CANDIDATES(kind, ieee, dims, n_sm, **kw)
            want = self.by_kind.get(kind)
            if want is None:
                return full[:1]
            return [want]
        idx_configs._candidates = cands
        gl_want = self.by_kind.get("gluon")
        if gl_want is not None:  # the Gluon forward with this launch config, forced on
            self.gl_old = (idx_host._gluon_indexer.candidates, os.environ.get("STREAMKL_INDEXER_GLUON"))
            idx_host._gluon_indexer.candidates = lambda dims, pacc=False, student=False: [gl_want]
            os.environ["STREAMKL_INDEXER_GLUON"] = "1"
        return self

    def __exit__(self, *exc):
        idx_configs._candidates = _ORIG_CANDIDATES
        if self.by_kind.get("gluon") is not None:
            idx_host._gluon_indexer.candidates, env = self.gl_old
            if env is None:
                os.environ.pop("STREAMKL_INDEXER_GLUON", None)
            else:
                os.environ["STREAMKL_INDEXER_GLUON"] = env


def gluon_candidates(cfg, N=8192, pacc=False):
    """The Gluon forward's (``pacc``: the accumulating forward's) launch configs (BLOCK_N,
    NUM_STAGES, CONSUMER_REGS) at this config ([] where it does not apply by shape, or Gluon is
    missing)."""
    if idx_host._gluon_indexer is None:
        return []
    dims = config_dims(cfg, N)
    if dims.HK != 1 or dims.HKI != 1 or dims.H > 128 or dims.HI > 64 or (pacc and dims.DI > 128):
        return []
    cands = idx_host._gluon_indexer.candidates(dims, pacc)
    return cands[:1] if QUICK else cands  # --quick: the default (deepest ring) only


def gluon_pacc_variants(cfg, N=8192):
    """(label, environment, forced) of the Gluon accumulating forward's fwd+bwd variants."""
    env = {"STREAMKL_INDEXER_PACC": "1", "STREAMKL_INDEXER_GLUON_PACC": "1"}
    return [("pacc " + gluon_label(c), env, dict(gluon=c)) for c in gluon_candidates(cfg, N, pacc=True)]


def gluon_label(c):
    return f"gluon n{c[0]} s{c[1]} r{c[2]}"


def shapes(cfg, N):
    return [(1, cfg["H"], N, cfg["D"]), (1, cfg["HK"], N, cfg["D"]), (1, cfg["HI"], N, cfg["DI"]),
            (1, cfg["HKI"], N, cfg["DI"]), (1, cfg["HI"], N)]


def fwd_candidates(cfg, N, device):
    """The forward candidates the tuner would try at this N (the ones timed; the checks run them
    on a small problem, where the plan caps the key splits at the key tiles)."""
    dims = check_indexer_inputs(*[torch.empty(s, device="meta") for s in shapes(cfg, N)],
                                scale=cfg["scale"])
    n_sm = streamkl_gpu._core.runtime.n_sm(torch.device(device))
    # the tuner's list, then the "l1" variants it no longer tries (measured slower, s4r4)
    out = _ORIG_CANDIDATES("fwd", False, dims, n_sm)
    return out + [c for c in idx_configs.l1_fwd_candidates(dims) if c not in out]


def config_dims(cfg, N=8192):
    return check_indexer_inputs(*[torch.empty(s, device="meta") for s in shapes(cfg, N)], scale=cfg["scale"])


def bwd_candidates(cfg):
    """The plain backward's candidates (the teacher-recomputing kernels) of this config."""
    return _ORIG_CANDIDATES("bwd", False, config_dims(cfg))


QUICK = "--quick" in sys.argv  # the --quick budget: fewer fwd+bwd variants (bwd_variants)


def bwd_variants(cfg):
    """(label, environment, forced configs) of the fwd+bwd variants: the plain design (forward,
    then a backward that recomputes the teacher: "separate" kernels per backward candidate, or
    "fused"), and the accumulating one (STREAMKL_INDEXER_PACC=1: the forward adds the target's
    share of the gradient, the backward runs the indexer alone) per accumulating candidate."""
    bc = bwd_candidates(cfg)
    plain = {"STREAMKL_INDEXER_PACC": "0"}
    sep = [(f"plain separate bwd{list(b)}", dict(plain, STREAMKL_INDEXER_BWD="separate"), dict(bwd=b)) for b in bc]
    fused = [(f"plain fused bwd{list(bc[0])}", dict(plain, STREAMKL_INDEXER_BWD="fused"), dict(bwd=bc[0]))]
    pacc = [(f"pacc fwd{list(c)}", {"STREAMKL_INDEXER_PACC": "1"}, dict(pacc=c))
            for c in _ORIG_CANDIDATES("pacc", False, config_dims(cfg))]
    if QUICK:
        # the 12:49 run (DSA 8K): pacc fwd[128,128,64,64,8,2] 73.2 ms, pacc BLOCK_N = 32 101.3,
        # plain fused 132.9, plain separate 136.7; s4r4: pacc fwd[128,128,64,64,8,3] 52.96,
        # [..,8,2] 61.79, "l1" 60.29, plain separate "l1" 128.4 (DSA), 18.29 (GQA).
        # --quick (session 5): the accumulating default (the reference for the Gluon one) and its
        # 4-warp plan; r5c measured BLOCK_N = 128 (54.13 ms) slower than 64 (53.05). GQA: r5c
        # measured the default (12.97 ms): not timed again
        keep = [v for v in pacc if v[2]["pacc"] in ((128, 128, 64, 64, 8, 3), (128, 128, 64, 64, 4, 3))] or pacc[:1]
        if config_dims(cfg).HK > 1:
            keep = []
        plain_default = not idx_choice.pacc_enabled(config_dims(cfg))
        return keep + (sep[:1] if plain_default else [])
    return sep + fused + pacc


class Env:
    """Set environment variables for a block (restored after)."""

    def __init__(self, env):
        self.env, self.old = env, {}

    def __enter__(self):
        for k, v in self.env.items():
            self.old[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------------------------------------
# Warm-up: every kernel the run will launch is compiled first by parallel child processes
# (Triton's and Inductor's on-disk caches are shared), so the compile time of ~20 candidates is
# paid once in parallel, not one after another.
# ----------------------------------------------------------------------------------------------

def compile_passes(args, cname):
    """torch.compile passes timed: fwd and fwd+bwd everywhere; --quick: none (run r5c's numbers,
    RECORDED_COMPILE, labelled in the table)."""
    return () if args.quick else ("fwd", "fwd_bwd")


# Forward candidates measured in the 12:49 UTC run of this script (H200, triton 3.6, --quick,
# 8K causal, lse given) and far from the best there (25.05 ms, fwd[128,128,128,64,8,3]): --quick
# lists them with that number instead of timing them again (the full run times everything).
MEASURED_SLOW = {
    ("dsa", 8192, (128, 128, 64, 64, 8, 2)): 43.2,
    ("dsa", 8192, (128, 128, 64, 64, 8, 3)): 33.6,
    ("dsa", 8192, (256, 128, 64, 64, 8, 2)): 37.5,
    # measured (bench/results/2026-12-01_h200_3c98559/indexer_perf.log)
    ("dsa", 8192, (128, 128, 128, 64, 8, 2)): 30.26,
    ("dsa", 8192, (128, 128, 64, 64, 8, 2, None, 1, "l1")): 46.12,
    ("dsa", 8192, (128, 128, 128, 64, 8, 2, None, 1, "l1")): 30.92,
    ("dsa", 8192, (128, 128, 32, 64, 8, 2, None, 1, "l1")): 70.99,
    ("gqa", 8192, (128, 128, 64, 64, 8, 2)): 10.21,
    ("gqa", 8192, (128, 128, 64, 64, 8, 2, 1)): 7.96,
    ("gqa", 8192, (256, 128, 64, 64, 8, 2)): 9.86,
    ("gqa", 8192, (128, 128, 64, 64, 8, 2, None, 3)): 8.86,
    ("gqa", 8192, (128, 128, 64, 64, 8, 2, 1, 9)): 3.18,
    ("gqa", 8192, (64, 64, 64, 64, 4, 2, None, 2)): 8.04,
    # run r5c (15:01 UTC, bench/results/2026-12-01_h200_121408f/indexer_perf.log): all but the best
    ("dsa", 8192, (128, 128, 128, 64, 8, 3)): 24.89,
    ("dsa", 8192, (128, 128, 128, 64, 4, 2)): 21.36,
    ("dsa", 8192, (64, 64, 64, 64, 4, 3, 64)): 28.25,
    ("gqa", 8192, (128, 128, 128, 64, 8, 2, 1, 9)): 2.483,
    ("gqa", 8192, (64, 64, 64, 64, 4, 2, 1, 5)): 3.256,
    ("gqa", 8192, (32, 32, 64, 64, 4, 2, 1, 3)): 4.785,
    ("gqa", 8192, (64, 64, 32, 64, 4, 3, 1, 5)): 2.700,
}
# torch.compile of the materialised form in run r5c (--quick uses these, labelled, instead of
# compiling it again: ~50 s of the warm-up)
RECORDED_COMPILE = {("dsa", 8192, "fwd"): 251.124, ("dsa", 8192, "fwd_bwd"): 306.640, ("gqa", 8192, "fwd"): 28.205}


def warm_jobs(args, configs, ns, device):
    """The children's jobs, longest first: torch.compile, then fwd+bwd (three kernels each), then
    the forward candidates."""
    compile_jobs, fb_jobs, fwd_jobs = [], [], []
    for cname in configs:
        for N in ns:
            cfg = tiny_config(CONFIGS[cname]) if args.tiny else CONFIGS[cname]
            for i, c in enumerate(fwd_candidates(cfg, N, device)):
                if not (args.quick and (cname, N, c) in MEASURED_SLOW):
                    fwd_jobs.append(f"{cname}:{N}:fwd:{i}")
            if not args.tiny:
                fwd_jobs += [f"{cname}:{N}:gluon:{i}" for i, _ in enumerate(gluon_candidates(cfg, N))]
                if not args.no_bwd:
                    fwd_jobs += [f"{cname}:{N}:gluonpacc:{i}" for i, _ in enumerate(gluon_pacc_variants(cfg, N))]
            if not args.no_bwd:
                for i, _ in enumerate(bwd_variants(cfg)):
                    fb_jobs.append(f"{cname}:{N}:bwd:{i}")
            if not args.no_compile and N <= 8192 and not args.tiny:
                compile_jobs += [f"{cname}:{N}:compile:{pss}" for pss in compile_passes(args, cname)]
    # the Gluon jobs first: their compiles are the longest (the accumulating one took over 55 s
    # among 16 parallel jobs in run r5c)
    gluon_jobs = [j for j in fwd_jobs if ":gluon" in j]
    return gluon_jobs + compile_jobs + fb_jobs + [j for j in fwd_jobs if ":gluon" not in j]


def tiny_config(cfg):
    return dict(cfg, H=min(cfg["H"], 8), HI=min(cfg["HI"], 4), DI=16, D=min(cfg["D"], 32), HK=min(cfg["HK"], 2))


def check_n(cname, tiny):
    # strides divisible by 16 (the kernels compiled here are the 8K ones); ragged vs 128-wide tiles
    return 24 if tiny else (192 if cname == "dsa" else 320)


def run_warm_job(job, tiny=False):
    """One child's work: the small check problem (or, for torch.compile, the real one) once."""
    cname, N, kind, which = job.split(":")
    N = int(N)
    cfg = tiny_config(CONFIGS[cname]) if tiny else CONFIGS[cname]
    bench = Bench(argparse.Namespace(out_dir=os.environ.get("TMPDIR", "/tmp"), tiny=tiny, quick=QUICK, budget=1e9,
                                     no_bwd=False, no_compile=False))
    scale = cfg["scale"] if cfg["scale"] is not None else cfg["D"] ** -0.5
    kw = dict(causal=True, scale=scale)
    cands = fwd_candidates(cfg, N, bench.device)
    if kind == "compile":
        xs = bench.inputs(cfg, N)
        bench.compiled_ms(xs, kw, which, reps=0)
        return
    xs = bench.inputs(cfg, check_n(cname, tiny))
    lse = bench.teacher_lse(xs[0], xs[1], scale)
    if kind == "fwd":
        with Force(fwd=cands[int(which)]):
            streamkl_gpu.indexer_kl(*xs, lse=lse, **kw)
    elif kind == "gluon":  # every check problem (and its Triton reference), with and without lse
        for _, xs_c, kw_c, _, _, lse_c, _ in bench.gluon_cases(cname, cfg):
            with Force(gluon=gluon_candidates(cfg, N)[int(which)]):  # as Bench.gluon_fwd
                streamkl_gpu.indexer_kl(*xs_c, lse=lse_c, **kw_c)
                streamkl_gpu.indexer_kl(*xs_c, **kw_c)
    elif kind == "gluonpacc":  # the check problem's fwd+bwd (as Bench.gluon_fwd_bwd)
        name, env, forced = gluon_pacc_variants(cfg, N)[int(which)]
        xs = bench.inputs(cfg, check_n(cname, tiny), seed=2)
        lse = bench.teacher_lse(xs[0], xs[1], scale)
        train = [x.detach().clone().requires_grad_(r) for x, r in zip(xs, (False, False, True, True, True))]
        with Env(env), Force(**forced):
            torch.autograd.grad(streamkl_gpu.indexer_kl(*train, lse=lse, reduction="mean", **kw), train[2:])
    else:
        name, env, forced = bwd_variants(cfg)[int(which)]
        with Env(env), Force(fwd=cands[0], **forced):
            if name.startswith("plain"):  # the backward's kernels alone (the forward is a fwd job)
                g = torch.ones(xs[0].shape[0], xs[0].shape[2], device=xs[0].device)
                lse_idx = torch.zeros_like(g)
                idx_host._backward(g, *xs, (lse * 1.4426950408889634).contiguous(), lse_idx, True, scale, True)
            else:
                train = [x.detach().clone().requires_grad_(r) for x, r in zip(xs, (False, False, True, True, True))]
                torch.autograd.grad(streamkl_gpu.indexer_kl(*train, lse=lse, reduction="mean", **kw), train[2:])
    bench.sync()


GLUON_WARM_S = 65.0  # seconds a Gluon warm-up job may take (compiles ~15-60 s, then small checks)


def warm_up(bench, jobs, parallel):
    import subprocess
    t0 = time.time()
    pending, running, failed = list(jobs), [], []
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            cmd = ([sys.executable, os.path.abspath(__file__), "-", "--warm-job", job] + (["--tiny"] if bench.args.tiny else [])
                   + (["--quick"] if bench.args.quick else []))  # the same variant lists as here
            proc = subprocess.Popen(cmd,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            running.append((job, proc, time.time()))
        still = []
        for job, proc, start in running:
            if proc.poll() is None:
                # a stuck compile must not eat the run; a Gluon job (a new kernel: a deadlock in its
                # barriers would hang) gets GLUON_WARM_S of its own
                if (time.time() - start > GLUON_WARM_S) if ":gluon" in job else (time.time() - t0 > bench.args.budget * 0.5):
                    proc.kill()
                    failed.append(job)
                    limit = GLUON_WARM_S if ":gluon" in job else bench.args.budget * 0.5
                    bench.log(f"warm-up {job}: killed (over {limit:.0f} s)")
                else:
                    still.append((job, proc, start))
                continue
            out = proc.stdout.read()
            if proc.returncode != 0:
                failed.append(job)
                bench.log(f"warm-up {job}: exit {proc.returncode}\n{out[-1500:]}")
        running = still
        time.sleep(0.2)
    bench.log(f"warm-up: {len(jobs)} jobs, {parallel} at a time, {time.time() - t0:.0f} s, {len(failed)} failed")
    return failed


class Bench:
    def __init__(self, args):
        self.args = args
        os.makedirs(args.out_dir, exist_ok=True)
        self.device = "cpu" if args.tiny else "cuda"
        self.logf = open(os.path.join(args.out_dir, "indexer_perf.log"), "a")
        self.rows = []
        self.t0 = time.time()
        self.failed = 0
        self.rate = None
        self._problems = {}

    def log(self, msg):
        line = f"[{time.time() - self.t0:6.1f}s] {msg}"
        print(line, flush=True)
        self.logf.write(line + "\n")
        self.logf.flush()

    def over(self):
        return time.time() - self.t0 > self.args.budget

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def record(self, measure, provider, shape, value, unit, note=""):
        self.rows.append(dict(measure=measure, provider=provider, shape=shape, value=value, unit=unit, note=note))
        with open(os.path.join(self.args.out_dir, "indexer_perf.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(self.rows)

    def inputs(self, cfg, N, seed=0, dtype=torch.bfloat16):
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def rnd(*shape, std=1.0):
            return (std * torch.randn(shape, generator=gen, device=self.device)).to(dtype)
        return [rnd(1, cfg["H"], N, cfg["D"]), rnd(1, cfg["HK"], N, cfg["D"]), rnd(1, cfg["HI"], N, cfg["DI"]),
                rnd(1, cfg["HKI"], N, cfg["DI"]), rnd(1, cfg["HI"], N, std=(cfg["HI"] * cfg["DI"]) ** -0.5)]

    def teacher_lse(self, q, k, scale):
        """Natural-log causal teacher LSEs [B, H, N] by PyTorch (head chunks; not our kernels)."""
        B, H, N, D = q.shape
        g = H // k.shape[1]
        out = torch.empty(B, H, N, dtype=torch.float32, device=q.device)
        mask = torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
        step = max(1, (1 << 31) // (N * N * 4))
        for h0 in range(0, H, step):
            hs = range(h0, min(H, h0 + step))
            kk = torch.stack([k[:, h // g] for h in hs], 1).float()
            s = torch.matmul(q[:, h0:h0 + len(hs)].float(), kk.transpose(-1, -2)) * scale
            out[:, h0:h0 + len(hs)] = s.masked_fill(~mask, float("-inf")).logsumexp(-1)
            del s, kk
        return out

    def time_ms(self, fn, reps=None):
        """Median ms of ``reps`` event-timed calls after one warm-up (compiles)."""
        fn()
        self.sync()
        if self.device != "cuda":
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        reps = reps or (5 if self.args.quick else 20)
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        return float(np.median(ts))

    def matmul_rate(self):
        if self.device != "cuda":
            self.rate = 1e12
            return
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        ms = self.time_ms(lambda: a @ b, reps=20)
        self.rate = 2 * n ** 3 / (ms * 1e-3)
        self.log(f"bf16 matmul 8192^3: {ms:.3f} ms = {self.rate / 1e12:.0f} TFLOP/s")
        self.record("matmul_rate", "torch", "8192^3", f"{self.rate / 1e12:.1f}", "TFLOP/s")

    # ------------------------------------------------------------------------------------------
    def check_candidates(self, cname, cfg, cands):
        """KL of every forward candidate vs float64 on a small causal problem with lse given
        (N = 192 / 320: strides divisible by 16, so the kernels compiled here are the 8K ones)."""
        t = self.args.tiny
        small = cfg
        N = check_n(cname, t)
        xs = self.inputs(small, N, seed=1, dtype=torch.float16 if t else torch.bfloat16)
        scale = cfg["scale"] if cfg["scale"] is not None else small["D"] ** -0.5
        kw = dict(causal=True, scale=scale)
        x64 = [x.double().cpu().numpy() for x in xs]
        kl_ref, _, lse_ref = streamkl_ref.indexer_kl(*x64, return_lse=True, **kw)
        sp = indexer_kl_naive(*xs, compute_dtype=xs[0].dtype, **kw)
        base = _rel_err(sp, kl_ref)
        tol = 3.0 * (base if math.isfinite(base) else 0.0) + 1e-2
        lse = torch.from_numpy(lse_ref).float().to(self.device)
        ok_cfgs = []
        for c in cands:
            if self.args.quick and (cname, 8192, c) in MEASURED_SLOW:  # not timed: not compiled either
                continue
            try:
                with Force(fwd=c):
                    kl = streamkl_gpu.indexer_kl(*xs, lse=lse, **kw)
                self.sync()
                err = _rel_err(kl, kl_ref)
                ok = err <= tol
            except Exception as exc:  # noqa: BLE001 - printed, the run goes on
                err, ok = float("nan"), False
                self.log(f"check {cname} {c} raised {type(exc).__name__}: {str(exc)[:300]}")
                self.logf.write(traceback.format_exc())
            self.failed += not ok
            self.log(f"check {cname} N={N} {c}: err {err:.2e} tol {tol:.2e} {'ok' if ok else 'FAIL'}")
            self.record("check_kl_rel_err", f"fwd{list(c)}", f"{cname} N={N} causal lse", f"{err:.3e}", "rel",
                        f"tol {tol:.3e} {'ok' if ok else 'FAIL'}")
            if ok:
                ok_cfgs.append(c)
        return ok_cfgs

    def check_fwd_bwd(self, cname, cfg, variants=None):
        """Loss and gradients of every fwd+bwd variant (plain and accumulating, reduction "mean",
        lse given) vs float64 on the small causal problem; same tolerance rule (the materialised
        form's gradients at the inputs' precision)."""
        t = self.args.tiny
        N = check_n(cname, t)
        xs = self.inputs(cfg, N, seed=2, dtype=torch.float16 if t else torch.bfloat16)
        scale = cfg["scale"] if cfg["scale"] is not None else cfg["D"] ** -0.5
        kw = dict(causal=True, scale=scale)
        x64 = [x.double().cpu().numpy() for x in xs]
        kl_ref, _, lse_ref = streamkl_ref.indexer_kl(*x64, return_lse=True, **kw)
        ref = dict(loss=float(kl_ref.mean()), **streamkl_ref.indexer_kl_grad(*x64, np.full(kl_ref.shape, 1.0 / N), **kw))
        train_flags = (False, False, True, True, True)
        sp_in = [x.detach().clone().requires_grad_(r) for x, r in zip(xs, train_flags)]
        sp_loss = indexer_kl_naive(*sp_in, compute_dtype=xs[0].dtype, **kw).mean()
        sp = dict(loss=sp_loss.detach(), **dict(zip(("dq_idx", "dk_idx", "dweights"), torch.autograd.grad(sp_loss, sp_in[2:]))))
        lse = torch.from_numpy(lse_ref).float().to(self.device)
        ok_names = []
        for name, env, forced in (bwd_variants(cfg) if variants is None else variants):
            try:
                ins = [x.detach().clone().requires_grad_(r) for x, r in zip(xs, train_flags)]
                with Env(env), Force(**forced):
                    loss = streamkl_gpu.indexer_kl(*ins, lse=lse, reduction="mean", **kw)
                    grads = torch.autograd.grad(loss, ins[2:])
                ours = dict(loss=loss.detach(), **dict(zip(("dq_idx", "dk_idx", "dweights"), grads)))
                bad = []
                for tensor in ("loss", "dq_idx", "dk_idx", "dweights"):
                    err = _rel_err(ours[tensor], ref[tensor])
                    base = _rel_err(sp[tensor], ref[tensor])
                    tol = 3.0 * (base if math.isfinite(base) else 0.0) + 1e-2
                    self.record("check_rel_err", f"fwd_bwd {name} {tensor}", f"{cname} N={N} causal lse mean",
                                f"{err:.3e}", "rel", f"tol {tol:.3e} {'ok' if err <= tol else 'FAIL'}")
                    if not err <= tol:
                        bad.append(f"{tensor} {err:.2e} > {tol:.2e}")
                ok = not bad
            except Exception as exc:  # noqa: BLE001 - printed, the run goes on
                ok, bad = False, [f"raised {type(exc).__name__}: {str(exc)[:300]}"]
                self.logf.write(traceback.format_exc())
            self.failed += not ok
            self.log(f"check {cname} fwd+bwd {name}: {'ok' if ok else 'FAIL ' + '; '.join(bad)}")
            if ok:
                ok_names.append(name)
        return ok_names

    def problem(self, cname, cfg, N, results):
        """(xs, lse, kw, floor, shape, res) of one timing point (inputs kept for the later phases)."""
        key = (cname, N)
        if key not in self._problems:
            xs = self.inputs(cfg, N)
            scale = cfg["scale"] if cfg["scale"] is not None else cfg["D"] ** -0.5
            lse = self.teacher_lse(xs[0], xs[1], scale)
            floor = _floor_flops(cfg, N, True) / self.rate * 1e3
            shape = f"{cname} N={N} causal"
            self.record("floor", "matmul", shape, f"{floor:.4f}", "ms", "fwd matmul FLOPs at the measured bf16 rate")
            self._problems[key] = (xs, lse, dict(causal=True, scale=scale), floor, shape)
        xs, lse, kw, floor, shape = self._problems[key]
        res = results.setdefault(key, dict(floor=floor, fwd={}, fwd_bwd={}, compile={}))
        return xs, lse, kw, floor, shape, res

    def time_forced_fwd(self, res, key, label, force, xs, lse, kw, shape, floor) -> bool:
        """Time one forced forward (``Force(**force)``) into ``res["fwd"][key]``: its ms, or
        "budget" / "error" (logged, the run goes on). True when it was timed."""
        timed = False
        if self.over():
            res["fwd"][key] = "budget"
            return timed
        try:
            with Force(**force), forcing() as ran:  # the hook records the Gluon launches
                ms = self.time_ms(lambda: streamkl_gpu.indexer_kl(*xs, lse=lse, **kw))
            self.ran = ran
            res["fwd"][key] = ms
            self.record("fwd_ms", f"ours_lse {label}", shape, f"{ms:.4f}", "ms", f"ratio {ms / floor:.2f}")
            self.log(f"{shape} fwd {label}: {ms:.3f} ms = {ms / floor:.2f}x floor")
            timed = True
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            res["fwd"][key] = "error"
            self.log(f"{shape} fwd {label} raised {type(exc).__name__}: {str(exc)[:300]}")
            self.logf.write(traceback.format_exc())
        self.free()
        return timed

    def bench_fwd(self, cname, cfg, N, cands, ok_cfgs, results):
        """Every forward candidate, forced (--quick: less those measured slow in the 12:49 run)."""
        xs, lse, kw, floor, shape, res = self.problem(cname, cfg, N, results)
        for c in cands:
            if self.args.quick and (cname, N, c) in MEASURED_SLOW:  # neither checked nor timed here
                res["fwd"][c] = f"{MEASURED_SLOW[(cname, N, c)]:.2f}rec"
                continue
            if c not in ok_cfgs:
                res["fwd"][c] = "check-failed"
                continue
            self.time_forced_fwd(res, c, f"fwd{list(c)}", dict(fwd=c), xs, lse, kw, shape, floor)

    def gluon_cases(self, cname, cfg):
        """The Gluon forward's check problems: (label, inputs, kwargs, float64 KL, tolerance,
        lse, the Triton forward's KL). Square causal at the check size (the 8K specialisation),
        N_Q < N_K non-causal, then ragged sizes (new specialisations: not under --quick)."""
        scale = cfg["scale"] if cfg["scale"] is not None else cfg["D"] ** -0.5
        sizes = [(check_n(cname, False), check_n(cname, False), True), (64, 320, False), (70, 133, False),
                 (96, 150, True)]
        if self.args.tiny:  # the CPU smoke (emulated kernel)
            sizes = [(check_n(cname, True), check_n(cname, True), True), (8, 40, False)]
        cases = []
        for seed, (nq, nk, causal) in enumerate(sizes[:2] if self.args.quick else sizes):
            xs = self.inputs(cfg, nk, seed=10 + seed)
            xs = [xs[0][:, :, :nq].contiguous(), xs[1], xs[2][:, :, :nq].contiguous(), xs[3],
                  xs[4][:, :, :nq].contiguous()]
            kw = dict(causal=causal, scale=scale)
            x64 = [x.double().cpu().numpy() for x in xs]
            kl_ref, _, lse_ref = streamkl_ref.indexer_kl(*x64, return_lse=True, **kw)
            base = _rel_err(indexer_kl_naive(*xs, compute_dtype=xs[0].dtype, **kw), kl_ref)
            tol = 3.0 * (base if math.isfinite(base) else 0.0) + 1e-2
            lse = torch.from_numpy(lse_ref).float().to(self.device)
            with Env({"STREAMKL_INDEXER_GLUON": "0"}), Force():  # the Triton forward, first candidate
                kl_triton = streamkl_gpu.indexer_kl(*xs, lse=lse, **kw)
            cases.append((f"NQ={nq} NK={nk} {'causal' if causal else 'full'}", xs, kw, kl_ref, tol, lse, kl_triton))
        return cases

    def gluon_fwd_bwd(self, cname, cfg, N, results, warm_failed=()):
        """The Gluon accumulating forward's fwd+bwd (reduction "mean", lse given): loss and
        gradients vs float64 (check_fwd_bwd's rule), then timed with its fwd / bwd split."""
        variants = [v for i, v in enumerate(gluon_pacc_variants(cfg, N)) if i not in warm_failed]
        for i, v in enumerate(gluon_pacc_variants(cfg, N)):
            if i in warm_failed:
                self.failed += 1
                self.log(f"{v[0]}: its warm-up job failed or hung (log above): not run here")
        if not variants:
            return
        ok = set(self.check_fwd_bwd(cname, cfg, variants) or [])
        self.bench_fwd_bwd(cname, cfg, N, results, [v for v in variants if v[0] in ok])

    def gluon_fwd(self, cname, cfg, N, results, warm_failed=()):
        """The Gluon forward (STREAMKL_INDEXER_GLUON=1), each launch config forced: KL vs float64
        and vs the Triton forward on the small causal problem (and a non-causal one with
        N_Q != N_K), then timed at N causal with lse given."""
        cands = gluon_candidates(cfg, N)
        if (self.args.tiny and not getattr(self.args, "tiny_gluon_emulate", False)) or not cands:
            self.log(f"gluon {cname}: {'skipped (cpu)' if self.args.tiny else 'does not apply (shape) / no Gluon'}")
            return
        xs_, lse_, kw_, floor, shape, res = self.problem(cname, cfg, N, results)
        self.log(f"gluon {cname}: check problems (float64 references, Triton forward)")
        cases = self.gluon_cases(cname, cfg) if len(warm_failed) < len(cands) else []
        for i, c in enumerate(cands):
            name = gluon_label(c)
            if i in warm_failed:
                res["fwd"][name] = "warm-up-failed"
                self.failed += 1
                self.log(f"{name}: its warm-up job failed or hung (log above): not run here")
                continue
            ok = True
            for label, xs, kw, kl_ref, tol, lse, kl_triton in cases:
                self.log(f"gluon {name} {label}: launching")
                try:
                    with Force(gluon=c):  # (the LSE pass of the no-lse call: its first candidate)
                        kl = streamkl_gpu.indexer_kl(*xs, lse=lse, **kw)
                        kl_nolse = streamkl_gpu.indexer_kl(*xs, **kw)  # the LSE pass (Triton), then Gluon
                    self.sync()
                    err, err_nolse = _rel_err(kl, kl_ref), _rel_err(kl_nolse, kl_ref)
                    vs_triton = _rel_err(kl, kl_triton.double().cpu().numpy())
                    good = err <= tol and err_nolse <= tol
                except Exception as exc:  # noqa: BLE001 - printed, the run goes on
                    err = err_nolse = vs_triton = float("nan")
                    good = False
                    self.log(f"check {cname} {name} {label} raised {type(exc).__name__}: {str(exc)[:400]}")
                    self.logf.write(traceback.format_exc())
                ok &= good
                self.failed += not good
                self.log(f"check {cname} {name} {label}: err {err:.2e} (no lse {err_nolse:.2e}), vs Triton "
                         f"{vs_triton:.2e}, tol {tol:.2e} {'ok' if good else 'FAIL'}")
                self.record("check_kl_rel_err", name, f"{cname} {label} lse", f"{err:.3e}", "rel",
                            f"tol {tol:.3e} no-lse {err_nolse:.3e} vs-triton {vs_triton:.3e} {'ok' if good else 'FAIL'}")
            if not ok:
                res["fwd"][name] = "check-failed"
                continue
            if self.time_forced_fwd(res, name, name, dict(gluon=c), xs_, lse_, kw_, shape, floor):
                k = self.ran.launches[-1].kernel if self.ran.launches else None  # the forcing hook's record
                if k is not None and hasattr(k, "n_regs"):
                    self.log(f"  {name}: n_regs {k.n_regs}, n_spills {k.n_spills}, shared {k.metadata.shared}")

    def bench_fwd_bwd(self, cname, cfg, N, results, variants=None):
        """fwd+bwd (mean, lse given) per variant, the plain ones with the fastest forward forced."""
        xs, lse, kw, floor, shape, res = self.problem(cname, cfg, N, results)
        timed = {c: v for c, v in res["fwd"].items() if isinstance(v, float) and isinstance(c, tuple)}
        best = min(timed, key=timed.get) if timed else None
        train = [x.detach().clone().requires_grad_(r) for x, r in zip(xs, (False, False, True, True, True))]
        for name, env, forced in (bwd_variants(cfg) if variants is None else variants):
            if self.over():
                res["fwd_bwd"][name] = "budget"
                continue

            def fb():
                loss = streamkl_gpu.indexer_kl(*train, lse=lse, reduction="mean", **kw)
                torch.autograd.grad(loss, train[2:])
            try:
                with Env(env), Force(fwd=best, **forced):
                    ms = self.time_ms(fb, reps=3 if self.args.quick else 10)
                res["fwd_bwd"][name] = ms
                self.record("fwd_bwd_ms", f"ours_lse fwd{list(best or ())} {name}", shape, f"{ms:.4f}", "ms",
                            f"ratio {ms / floor:.2f}")
                self.log(f"{shape} fwd+bwd {name}: {ms:.3f} ms = {ms / floor:.2f}x floor")
                if name.startswith("pacc"):  # the split: the accumulating forward alone (graph kept)
                    with Env(env), Force(fwd=best, **forced):
                        f_ms = self.time_ms(lambda: streamkl_gpu.indexer_kl(*train, lse=lse, reduction="mean", **kw),
                                            reps=3 if self.args.quick else 10)
                    res.setdefault("split", {})[name] = (f_ms, ms - f_ms)
                    self.record("pacc_fwd_ms", f"ours_lse {name}", shape, f"{f_ms:.4f}", "ms",
                                f"bwd part {ms - f_ms:.4f} ms (fwd+bwd minus fwd)")
                    self.log(f"{shape} {name}: fwd part {f_ms:.3f} ms, bwd part {ms - f_ms:.3f} ms")
            except Exception as exc:  # noqa: BLE001
                res["fwd_bwd"][name] = "error"
                self.log(f"{shape} fwd+bwd {name} raised {type(exc).__name__}: {str(exc)[:300]}")
                self.logf.write(traceback.format_exc())
            self.free()
        del train

    def bench_compile(self, cname, cfg, N, results, warm_failed=()):
        """torch.compile of the materialised form (the targets' baseline; --quick: fwd only, the
        DSA fwd+bwd then from the recorded session-3 number, labelled)."""
        if self.args.no_compile or self.args.tiny or N > 8192:
            return
        xs, lse, kw, floor, shape, res = self.problem(cname, cfg, N, results)
        for pss in compile_passes(self.args, cname):
            if self.over():
                res["compile"][pss] = "budget"
                continue
            if self.args.quick and f"{cname}:{N}:compile:{pss}" in warm_failed:  # compiling here would blow --quick
                res["compile"][pss] = "warm-up-failed"
                self.log(f"{shape} torch.compile {pss}: its warm-up job did not finish: not timed (--quick)")
                continue
            try:
                res["compile"][pss] = ms = self.compiled_ms(xs, kw, pss)
                self.record(f"{pss}_ms", "compile", shape, f"{ms:.4f}", "ms", f"ratio {ms / floor:.2f}")
                self.log(f"{shape} torch.compile {pss}: {ms:.3f} ms")
            except Exception as exc:  # noqa: BLE001
                res["compile"][pss] = "oom" if isinstance(exc, torch.cuda.OutOfMemoryError) else "error"
                self.log(f"{shape} torch.compile {pss} raised {type(exc).__name__}: {str(exc)[:300]}")
            self.free()

    def compiled_ms(self, xs, kw, pss, reps=3):
        def loss_fn(q, k, qi, ki, w):
            return indexer_kl_naive(q, k, qi, ki, w, compute_dtype=torch.float32, **kw).mean()
        comp = torch.compile(loss_fn, fullgraph=True, dynamic=False)
        if pss == "fwd":
            def f():
                with torch.no_grad():
                    comp(*xs)
        else:
            train = [x.detach().clone().requires_grad_(r) for x, r in zip(xs, (False, False, True, True, True))]

            def f():
                torch.autograd.grad(comp(*train), train[2:])
        if reps == 0:  # warm-up only: compile and run once
            f()
            return float("nan")
        return self.time_ms(f, reps=reps)

    def free(self):
        import gc
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def recorded_compile(cname, N, pss):
        """torch.compile of the materialised form as measured last session (H200, same script
        family: bench/indexer_gpu.py), for the speed-up column when this run skipped it."""
        path = os.path.join(ROOT, "bench", "results", "2026-12-01_h200_0175a65", "indexer_timing.csv")
        try:
            with open(path) as f:
                for r in csv.DictReader(f):
                    if (r["config"], int(r["n"]), r["provider"], r["pass"], r["status"]) == (cname, N, "compile", pss, "ok"):
                        return float(r["ms"])
        except (OSError, KeyError, ValueError):
            pass
        return None

    def table(self, results):
        print("\n== indexer_kl forward candidates, forced (causal, bf16, lse given) ==")
        print(f"{'shape':18s} {'pass':8s} {'variant':52s} {'ms':>9s} {'x floor':>8s} {'x faster than compile':>22s}")
        for (cname, N), res in results.items():
            shape = f"{cname} N={N}"
            floor = res["floor"]
            for pss in ("fwd", "fwd_bwd"):
                comp = res["compile"].get(pss)
                if not isinstance(comp, float):
                    rec, where = RECORDED_COMPILE.get((cname, N, pss)), "run r5c, H200"
                    if rec is None:
                        rec, where = self.recorded_compile(cname, N, pss), "session 3, H200"
                    if rec is not None:
                        print(f"{shape:18s} {pss:8s} {'torch.compile: recorded (' + where + ')':52s} {rec:9.3f} "
                              f"{rec / floor:8.2f}")
                        comp = rec
                entries = sorted(res[pss].items(), key=lambda kv: kv[1] if isinstance(kv[1], float) else math.inf)
                for name, ms in entries:
                    label = f"fwd{list(name)}" if isinstance(name, tuple) else name  # (Gluon: a string)
                    if isinstance(ms, float):
                        speed = f"{comp / ms:.1f}x" if isinstance(comp, float) else "-"
                        print(f"{shape:18s} {pss:8s} {label:52s} {ms:9.3f} {ms / floor:8.2f} {speed:>22s}")
                    else:
                        print(f"{shape:18s} {pss:8s} {label:52s} {ms:>9s}")
                got = res["compile"].get(pss)
                if got is not None:
                    txt = f"{got:9.3f} {got / floor:8.2f}" if isinstance(got, float) else f"{got:>9s}"
                    print(f"{shape:18s} {pss:8s} {'torch.compile (materialised, this run)':52s} {txt}")
            for name, (f_ms, b_ms) in res.get("split", {}).items():
                print(f"{shape:18s} {'split':8s} {name[:40] + ' fwd|bwd':52s} {f_ms:9.3f} {b_ms:9.3f}")
        print(f"floor: forward matmul FLOPs (teacher + indexer, causal half) at {self.rate / 1e12:.0f} TFLOP/s; "
              f"{self.failed} check(s) failed; {time.time() - self.t0:.0f} s")


def main(argv=None):
    args = parse_args(argv)
    if args.warm_job:
        run_warm_job(args.warm_job, args.tiny)
        return 0
    bench = Bench(args)
    results = {}
    # run-wide watchdog: past --deadline seconds (a hang, a slow compile) the table of what ran is
    # printed and the run ends, before the caller's own timeout can kill it silently
    import threading

    def watchdog():
        bench.log(f"past the {args.deadline:.0f} s deadline: table of what ran, then exit")
        bench.table(results)
        sys.stdout.flush()
        os._exit(3)
    timer = threading.Timer(args.deadline, watchdog)
    timer.daemon = True
    timer.start()
    import triton
    bench.log(f"indexer perf: {torch.cuda.get_device_name() if bench.device == 'cuda' else 'cpu'}, "
              f"torch {torch.__version__}, triton {triton.__version__}, quick={args.quick}")
    os.environ["STREAMKL_AUTOTUNE"] = "1"
    bench.matmul_rate()
    configs = [c for c in args.configs.split(",") if c]
    ns = [int(n) for n in args.ns.split(",")] if args.ns else ([32] if args.tiny else [8192] if args.quick else [8192, 16384])
    warm_failed = set()
    if (bench.device == "cuda" or args.tiny_warm) and not args.no_warm:
        try:
            warm_failed = set(warm_up(bench, warm_jobs(args, configs, ns, bench.device),
                                      args.parallel or max(1, min(16, os.cpu_count() or 1))))
        except Exception as exc:  # noqa: BLE001 - then the timing process compiles
            bench.log(f"warm-up raised {type(exc).__name__}: {exc}")
    cfgs = {c: (tiny_config(CONFIGS[c]) if args.tiny else CONFIGS[c]) for c in configs}
    if args.tiny and args.tiny_gluon_emulate and idx_host._gluon_indexer is not None:
        g = idx_host._gluon_indexer
        idx_host.gluon_why_not = lambda *a, **k: ""

        def emulated(q, k, qi, ki, w, lse_bits, causal, scale, relu, config=None, part=None, grads=None):
            part.copy_(g.emulate_states(q, k, qi, ki, w, lse_bits, causal, scale, relu, block_n=8, grads=grads))
            return part
        g.forward_states = emulated

        def emulated_student(q, k, qi, ki, w, lse_idx, causal, relu, grads, config=None):
            g.emulate_states(q, k, qi, ki, w, lse_idx, causal, 1.0, relu, block_n=8, grads=grads, student=True)
            return grads
        g.student_grads = emulated_student
        bench.log("gluon: emulated (CPU smoke of the script, not the kernel)")

    def guarded(what, fn, *a):
        try:
            return fn(*a)
        except Exception as exc:  # noqa: BLE001 - printed, the run goes on
            bench.log(f"{what} raised {type(exc).__name__}: {exc}")
            bench.logf.write(traceback.format_exc())
            return None

    # phases across configs (forward of all, then fwd+bwd, then torch.compile), so that a budget
    # overrun costs the least informative measurements, not a whole config
    plan = {}
    for cname in configs:
        for N in ns:
            cands = guarded(f"candidates of {cname}", fwd_candidates, cfgs[cname], N, bench.device) or []
            ok = guarded(f"checks of {cname}", bench.check_candidates, cname, cfgs[cname], cands) or []
            plan[(cname, N)] = (cands, ok)
            guarded(f"{cname} N={N} fwd", bench.bench_fwd, cname, cfgs[cname], N, cands, ok, results)
    # the Gluon kernels right after the Triton forwards (they decide the Gluon defaults and the
    # DSA targets), then the Triton fwd+bwd, torch.compile last (not timed under --quick: run
    # r5c's numbers). Only the Gluon launch configs whose warm-up job passed run here; the
    # run-wide watchdog (--deadline) prints the table of what ran if a new kernel hangs
    for cname in configs:
        for N in ns:
            bad = {i for i in range(8) if f"{cname}:{N}:gluon:{i}" in warm_failed}
            guarded(f"{cname} N={N} gluon fwd", bench.gluon_fwd, cname, cfgs[cname], N, results, bad)
            if not args.no_bwd and (not args.tiny or args.tiny_gluon_emulate):
                guarded(f"{cname} N={N} gluon fwd+bwd", bench.gluon_fwd_bwd, cname, cfgs[cname], N, results,
                        {i for i in range(8) if f"{cname}:{N}:gluonpacc:{i}" in warm_failed})
    if not args.no_bwd:
        for cname in configs:
            guarded(f"fwd+bwd checks of {cname}", bench.check_fwd_bwd, cname, cfgs[cname])
            for N in ns:
                guarded(f"{cname} N={N} fwd+bwd", bench.bench_fwd_bwd, cname, cfgs[cname], N, results)
    for cname in configs:
        for N in ns:
            guarded(f"{cname} N={N} torch.compile", bench.bench_compile, cname, cfgs[cname], N, results, warm_failed)
    timer.cancel()
    bench._problems.clear()
    bench.free()
    bench.table(results)
    return 1 if bench.failed else 0


if __name__ == "__main__":
    sys.exit(main())
