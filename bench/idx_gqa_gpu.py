#!/usr/bin/env python3
"""The GQA-like indexer forward (issue 10: <= 3.0x the matmul floor): the current default config
of the general kernel against the GQA kernel (``streamkl_gpu.indexer.triton.fwd_gqa``, config variants
"gqa" / "gqa-flat"), each forced, 8K causal bf16 with ``lse`` given (then 16K), checked after.

    python bench/idx_gqa_gpu.py OUT_DIR --quick     # fits a 70 s slot on one H200, compiles included
    python bench/idx_gqa_gpu.py OUT_DIR             # also 16K and longer timings
    python bench/idx_gqa_gpu.py OUT_DIR --quick --final   # the API's default path (autotune off) vs the
                                                    # former default config, 8K..64K, <= 60 s
    TRITON_INTERPRET=1 python bench/idx_gqa_gpu.py /tmp/x --tiny   # CPU smoke of the script

Order (the slot is fixed; a watchdog ends the run in time and prints what ran):
  1. every config's kernel compiled by parallel child processes (the small check problem, the same
     specialisation as 8K: ints divisible by 16, key splits > 1);
  2. the bf16 rate of an 8192^3 matmul (the floor's rate);
  3. time the 8K forward (GQA-like: H=32, D=128, H_K=8; H_I=16, D_I=64, H_KI=1), the default first,
     round robin over the configs (3 passes under --quick; a config's time: the median of its
     passes), the KL against the default config's (relative error); then 16K the same way;
  4. checks of every config timed: KL vs float64 (streamkl_ref.indexer_kl) at N=320 causal, with
     and without lse (FlashAttention's rule: <= 3 x the materialised bf16 form's error + 1e-2);
  5. the table, with torch.compile's recorded 8K number (run r5c) for the speed-up.
A config that fails (compile, resources, wrong numbers) is printed and the run goes on.

Outputs in OUT_DIR: idx_gqa.csv (long format: measure, provider, shape, value, unit, note),
idx_gqa.log. Short table last.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import subprocess
import sys
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
os.environ.setdefault("STREAMKL_TUNING_CACHE", "0")  # forced configs only

import numpy as np  # noqa: E402
import torch  # noqa: E402

import streamkl_ref  # noqa: E402
import streamkl_gpu  # noqa: E402
from streamkl_gpu.indexer import host as idx_host  # noqa: E402
from streamkl_gpu.indexer import plan as idx_plan  # noqa: E402
from streamkl_gpu.indexer.api import indexer_kl_naive  # noqa: E402

from indexer_gpu import CONFIGS, _floor_flops, _rel_err  # noqa: E402
from indexer_perf_gpu import Force, RECORDED_COMPILE  # noqa: E402

COLUMNS = ["measure", "provider", "shape", "value", "unit", "note"]
DEFAULT = (64, 64, 64, 64, 4, 3, 1, 5)  # the general kernel's measured best (r5c 2.341 ms, s5r4 2.654)
# The GQA kernel's configs, most promising first. L2 traffic per 8K causal forward (q re-read per
# key tile: BLOCK_N FLOP per q byte; K per group: 4 x BLOCK_T): default 64x64 ~10.8 GB (4.6 TB/s
# at its 2.34 ms, r5c: likely L2-bound), "gqa" 64x64 ~6.5 GB, 64x128 ~3.8 GB, 64x32 ~12 GB.
# Offline sm_90 (triton 3.9, bench/idx_gqa_aot.py): registers, shared memory -> CTAs per SM.
# "gqa": K once per key head, "gqa-flat": K per head, "gqa-pp": flat, products one head ahead,
# "-band": the masked tiles in a second launch (-40 registers in the main one), "-rNNN": ptxas
# register cap, "-tm": the token-major grid (default: key splits of a token block
# adjacent, causal-heaviest blocks first: fewer token blocks' q rows in L2 at once; the ncu of the
# old 128x128 config, s5r2, showed a 61 % L2 hit rate and 0.6 TB/s of DRAM reads for ~100 MB of inputs).
GQA_CONFIGS = [
    (64, 64, 64, 64, 4, 3, 1, 5, "gqa-band"),       # s6r2: 1.785 ms = 4.00x (157 regs, 66 KB: 3 CTAs/SM)
    (64, 64, 64, 64, 4, 3, 1, 10, "gqa-band"),      # more splits (s6r2, "gqa" 64x64: 10 splits 2.219, 5 splits 2.728)
    (64, 64, 64, 64, 4, 3, 1, 3, "gqa-band"),       # _fwd_split's 16K count
    (64, 64, 64, 64, 4, 3, 1, 16, "gqa-band"),      # 5 splits at 8K: ~320 programs with work for 396
    (64, 64, 64, 64, 4, 3, 1, 24, "gqa-band"),      # CTA slots (3 per SM): one uneven wave; more: finer
    (64, 64, 64, 64, 4, 3, 1, 5, "gqa-band-ss"),    # the band's launch on a side stream (beside the main one)
    (64, 64, 64, 64, 4, 3, 1, 16, "gqa-band-ss"),
    (64, 64, 64, 64, 4, 2, 1, 5, "gqa-flat-band"),  # s6r2: "gqa-flat" 2.011 < "gqa" 2.728 (no band); 158 regs, 66 KB
    (64, 64, 64, 64, 4, 3, 1, 5, "gqa-flat-band"),  # 157 regs, 98 KB: 2 CTAs/SM
    (64, 64, 64, 64, 4, 2, 1, 5, "gqa-band-r128"),  # 128 regs + 24 B spills, 49 KB: 4 CTAs/SM
    (64, 64, 64, 64, 4, 2, 1, 10, "gqa-band-r128"),
    (64, 64, 64, 64, 4, 2, 1, 10, "gqa-flat-band"),
    (128, 128, 128, 64, 8, 2, 1, 9, "gqa-band"),    # s6r2: 1.934 ms
    # session 7 (indices 13-17): the s7r1 default (capped at 128 registers, 48 splits) and variants of it
    (64, 64, 64, 64, 4, 2, 1, 48, "gqa-band-r128"),
    (64, 64, 64, 64, 4, 2, 1, 96, "gqa-band-r128"),
    (64, 64, 64, 64, 4, 2, 1, 48, "gqa-band-ss-r128"),  # the band on a side stream
    (64, 64, 64, 64, 4, 2, 1, 48, "gqa-tm-band-r128"),  # the token-major grid
    (64, 64, 64, 64, 4, 2, 1, 48, "gqa-band-r120"),
]
CHECK_N = 320  # strides divisible by 16: the check problem compiles the 8K kernels


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tiny", action="store_true", help="CPU smoke (TRITON_INTERPRET=1)")
    p.add_argument("--deadline", type=float, default=None, help="seconds; default 58 (--quick), 400")
    p.add_argument("--ns", default=None, help="N list (default 8192,16384)")
    p.add_argument("--configs", default=None, help="indices into GQA_CONFIGS to run, e.g. 0,1,2 (default all)")
    p.add_argument("--final", action="store_true",
                   help="the API's default path (autotune off, no forced config) against the former default "
                        "config, at 8K, 16K, 32K, 64K (unless --ns), checks after")
    p.add_argument("--parallel", type=int, default=None)
    p.add_argument("--warm-job", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.tiny:  # the GQA kernel reads through TMA descriptors only: the interpreter's, in the smoke
        streamkl_gpu._core.runtime.INTERPRETER_TMA = True
    if a.deadline is None:
        a.deadline = 52.0 if a.final else 58.0 if a.quick else 400.0  # --quick: a 70 s slot less imports; --final: <= 60 s
    return a


def tiny_cfg():
    return dict(H=8, HK=2, D=32, HI=4, HKI=1, DI=16, scale=None)


def tiny_variant(c):
    """The CPU smoke's configs: tiles the interpreter runs quickly, the same variants."""
    return (16, 16, 16, 32, 1, 1, 1, min(c[7], 3)) + tuple(c[8:])


class Run:
    def __init__(self, args):
        self.args = args
        os.makedirs(args.out_dir, exist_ok=True)
        self.device = "cpu" if args.tiny else "cuda"
        self.logf = open(os.path.join(args.out_dir, "idx_gqa.log"), "a")
        self.rows, self.t0, self.failed, self.rate = [], time.time(), 0, None
        self.results = {}  # (N, label) -> ms or a status string
        self.checks = {}  # label -> "ok" / "FAIL ..." text
        self.floors = {}
        self.cfg = tiny_cfg() if args.tiny else CONFIGS["gqa"]
        self.scale = self.cfg["D"] ** -0.5

    def log(self, msg):
        line = f"[{time.time() - self.t0:6.1f}s] {msg}"
        print(line, flush=True)
        self.logf.write(line + "\n")
        self.logf.flush()

    def record(self, measure, provider, shape, value, unit, note=""):
        self.rows.append(dict(measure=measure, provider=provider, shape=shape, value=value, unit=unit, note=note))
        with open(os.path.join(self.args.out_dir, "idx_gqa.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(self.rows)

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def left(self):
        return self.args.deadline - (time.time() - self.t0)

    def inputs(self, N, seed=0, dtype=torch.bfloat16):
        cfg = self.cfg
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def rnd(*shape, std=1.0):
            return (std * torch.randn(shape, generator=gen, device=self.device)).to(dtype)
        return [rnd(1, cfg["H"], N, cfg["D"]), rnd(1, cfg["HK"], N, cfg["D"]), rnd(1, cfg["HI"], N, cfg["DI"]),
                rnd(1, cfg["HKI"], N, cfg["DI"]), rnd(1, cfg["HI"], N, std=(cfg["HI"] * cfg["DI"]) ** -0.5)]

    def teacher_lse(self, q, k):
        """Natural-log causal teacher LSEs [B, H, N] by PyTorch (head chunks; not our kernels)."""
        B, H, N, D = q.shape
        g = H // k.shape[1]
        out = torch.empty(B, H, N, dtype=torch.float32, device=q.device)
        mask = torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
        step = max(1, (1 << 31) // (N * N * 4))
        for h0 in range(0, H, step):
            hs = range(h0, min(H, h0 + step))
            kk = torch.stack([k[:, h // g] for h in hs], 1).float()
            s = torch.matmul(q[:, h0:h0 + len(hs)].float(), kk.transpose(-1, -2)) * self.scale
            out[:, h0:h0 + len(hs)] = s.masked_fill(~mask, float("-inf")).logsumexp(-1)
            del s, kk
        return out

    def time_ms(self, fn, reps):
        fn()
        self.sync()
        if self.device != "cuda":
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
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
        ms = self.time_ms(lambda: a @ b, reps=10)
        self.rate = 2 * n ** 3 / (ms * 1e-3)
        self.log(f"bf16 matmul 8192^3: {ms:.3f} ms = {self.rate / 1e12:.0f} TFLOP/s")
        self.record("matmul_rate", "torch", "8192^3", f"{self.rate / 1e12:.1f}", "TFLOP/s")


def label(c):
    if c is None:
        return "api-default (autotune off)"
    return f"fwd{list(c)}"


def configs(args):
    """(label, forced config) of the run: the default first, then the GQA kernel's configs."""
    if args.final:  # the API's default path (None: nothing forced; since s7r1 the 128-register band
        # kernel at the rule's 48 splits), the general kernel's former default, the uncapped band
        # kernel (the default before s7r1), the capped one at 64 splits, the flat loop capped
        return [DEFAULT, None, (64, 64, 64, 64, 4, 3, 1, 48, "gqa-band"), (64, 64, 64, 64, 4, 2, 1, 64, "gqa-band-r128"),
                (64, 64, 64, 64, 4, 2, 1, 48, "gqa-flat-band-r128")]
    gq = GQA_CONFIGS if args.configs is None else [GQA_CONFIGS[int(i)] for i in args.configs.split(",") if i]
    out = [DEFAULT] + gq
    if args.tiny:
        out = [tiny_variant(c) for c in out]
    return list(dict.fromkeys(out))


def forward(xs, lse, c, causal=True, scale=None):
    if c is None:  # the API's own choice (STREAMKL_AUTOTUNE=0 under --final: the first candidate)
        return streamkl_gpu.indexer_kl(*xs, lse=lse, causal=causal, scale=scale)
    with Force(fwd=c):
        return streamkl_gpu.indexer_kl(*xs, lse=lse, causal=causal, scale=scale)


# ----------------------------------------------------------------------------------------------
# Warm-up: each config compiled by a child process (the check problem once)
# ----------------------------------------------------------------------------------------------

def run_warm_job(args, i):
    run = Run(argparse.Namespace(**dict(vars(args), out_dir=os.environ.get("TMPDIR", "/tmp"))))
    c = configs(args)[i]
    n = 24 if args.tiny else CHECK_N
    xs = run.inputs(n, seed=1, dtype=torch.float16 if args.tiny else torch.bfloat16)
    forward(xs, run.teacher_lse(xs[0], xs[1]), c, scale=run.scale)
    forward(xs, None, c, scale=run.scale)  # the no-lse check: the LSE pass (its first candidate) too
    run.sync()


def _kernel(c):
    if c is None:
        return None
    """A config less its key splits: configs that differ only there (splits > 1) share a kernel."""
    return tuple(c[:7]) + tuple(c[8:])


def warm_jobs(cands):
    """One warm-up job (an index into ``cands``) per kernel."""
    jobs, seen = [], set()
    for i, c in enumerate(cands):
        if _kernel(c) not in seen:
            seen.add(_kernel(c))
            jobs.append(i)
    return jobs


def warm_up(run, jobs, parallel, limit):
    """Run the warm-up jobs (indices into ``configs``) ``parallel`` at a time; the failed ones."""
    t0 = time.time()
    pending, running, failed = list(jobs), [], []
    while pending or running:
        while pending and len(running) < parallel:
            i = pending.pop(0)
            cmd = [sys.executable, os.path.abspath(__file__), run.args.out_dir, "--warm-job", str(i)]
            cmd += [f for f, on in (("--tiny", run.args.tiny), ("--quick", run.args.quick), ("--final", run.args.final))
                    if on]
            if run.args.configs is not None:
                cmd += ["--configs", run.args.configs]
            running.append((i, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        still = []
        for i, proc in running:
            if proc.poll() is None:
                if time.time() - t0 > limit:
                    proc.kill()
                    failed.append(i)
                    run.log(f"warm-up {i}: killed (over {limit:.0f} s)")
                else:
                    still.append((i, proc))
                continue
            out = proc.stdout.read()
            if proc.returncode != 0:
                failed.append(i)
                run.log(f"warm-up {i} {configs(run.args)[i]}: exit {proc.returncode}\n{out[-1200:]}")
        running = still
        time.sleep(0.1)
    run.log(f"warm-up: {len(jobs)} jobs, {parallel} at a time, {time.time() - t0:.0f} s, {len(failed)} failed")
    return set(failed)


# ----------------------------------------------------------------------------------------------
# Phases
# ----------------------------------------------------------------------------------------------

def time_point(run, N, cands, bad, reps, passes):
    """Time every config at N (causal, lse given), round robin: pass 1 loads each config's kernels
    (Triton's disk cache) and times it, passes 2.. time them all again (the GPU's clocks drift
    within a run: s6r2 timed the same kernel at 2.65 and 2.22 ms); a config's time is the median
    of its passes' medians. The first GQA config is timed once more with the key splits merged
    by PyTorch (idx_plan._merge_splits) instead of merge_states. The default's KL is kept for the
    comparison below."""
    from streamkl_gpu.indexer.triton import fwd_gqa as _indexer_fwd_gqa
    xs = run.inputs(N)
    if N > 16384:  # PyTorch's dense LSE would need N^2 floats per head: our LSE pass (checked at 320 after)
        lse = idx_host._forward(*xs, None, True, run.scale, True)[2] / idx_plan.LOG2E
        run.sync()
    else:
        lse = run.teacher_lse(xs[0], xs[1])
    floor = _floor_flops(run.cfg, N, True) / run.rate * 1e3
    run.floors[N] = floor
    shape = f"gqa N={N} causal"
    run.record("floor", "matmul", shape, f"{floor:.4f}", "ms", "fwd matmul FLOPs at the measured bf16 rate")
    kls = {}
    variants = [(label(c), c, True) for i, c in enumerate(cands) if i not in bad]
    for i in bad:
        run.results[(N, label(cands[i]))] = "warm-fail"
    gq = [c for _, c, _ in variants if c is not None and isinstance(c[-1], str) and c[-1].startswith("gqa")]
    if gq:
        variants.append((label(gq[0]) + " host-merge", gq[0], False))
    times = {name: [] for name, _, _ in variants}
    for p in range(passes):
        for name, c, merge in variants:
            key = (N, name)
            if run.results.get(key) == "error":
                continue
            if run.left() < (4 if p == 0 else 2):
                run.results.setdefault(key, "time")
                continue
            try:
                _indexer_fwd_gqa.MERGE_KERNEL = merge
                times[name].append(run.time_ms(lambda: forward(xs, lse, c, scale=run.scale), reps))
                if p == 0 and merge:
                    kls[c] = forward(xs, lse, c, scale=run.scale)
                    run.sync()
                ms = float(np.median(times[name]))
                run.results[key] = ms
                run.log(f"{shape} {name} (pass {p + 1}): {times[name][-1]:.3f} ms, median so far {ms:.3f} = "
                        f"{ms / floor:.2f}x floor")
            except Exception as exc:  # noqa: BLE001 - printed, the run goes on
                run.results[key] = "error"
                run.failed += 1
                run.log(f"{shape} {name} raised {type(exc).__name__}: {str(exc)[:300]}")
                run.logf.write(traceback.format_exc())
            finally:
                _indexer_fwd_gqa.MERGE_KERNEL = True
    for name, _, _ in variants:
        if times[name]:
            ms = float(np.median(times[name]))
            run.record("fwd_ms", f"ours_lse {name}", shape, f"{ms:.4f}", "ms",
                       f"ratio {ms / floor:.2f}; passes " + " ".join(f"{t:.4f}" for t in times[name]))
    # against the default config's KL at this N (same inputs, the existing Triton path)
    base = kls.get(cands[0])
    for c, kl in kls.items():
        if c == cands[0] or base is None:
            continue
        err = _rel_err(kl, base.double().cpu().numpy())
        ok = err <= 1e-3
        run.failed += not ok
        run.record("vs_default_rel_err", label(c), shape, f"{err:.3e}", "rel", "ok" if ok else "FAIL (> 1e-3)")
        run.log(f"{shape} {label(c)} vs default: rel err {err:.2e} {'ok' if ok else 'FAIL'}")
        run.checks.setdefault(label(c), []).append(f"vs-default@{N} {err:.1e}{'' if ok else ' FAIL'}")
    del xs, lse, kls
    if run.device == "cuda":
        torch.cuda.empty_cache()


def check_all(run, cands, bad):
    """KL vs float64 on the small causal problem with lse given, each config forced."""
    n = 24 if run.args.tiny else CHECK_N
    dtype = torch.float16 if run.args.tiny else torch.bfloat16
    xs = run.inputs(n, seed=1, dtype=dtype)
    kw = dict(causal=True, scale=run.scale)
    x64 = [x.double().cpu().numpy() for x in xs]
    kl_ref, _, lse_ref = streamkl_ref.indexer_kl(*x64, return_lse=True, **kw)
    base = _rel_err(indexer_kl_naive(*xs, compute_dtype=xs[0].dtype, **kw), kl_ref)
    tol = 3.0 * (base if math.isfinite(base) else 0.0) + 1e-2
    lse = torch.from_numpy(lse_ref).float().to(run.device)
    for i, c in enumerate(cands):
        if i in bad or run.left() < 2:
            continue
        try:
            err = _rel_err(forward(xs, lse, c, **kw), kl_ref)
            err_nolse = _rel_err(forward(xs, None, c, **kw), kl_ref)  # the LSE pass first, then the forward
            ok = err <= tol and err_nolse <= tol
        except Exception as exc:  # noqa: BLE001
            err = err_nolse = float("nan")
            ok = False
            run.log(f"check {label(c)} raised {type(exc).__name__}: {str(exc)[:300]}")
            run.logf.write(traceback.format_exc())
        run.failed += not ok
        run.log(f"check N={n} {label(c)}: err {err:.2e} (no lse {err_nolse:.2e}) tol {tol:.2e} {'ok' if ok else 'FAIL'}")
        run.record("check_kl_rel_err", label(c), f"gqa N={n} causal", f"{err:.3e}", "rel",
                   f"no-lse {err_nolse:.3e} tol {tol:.3e} {'ok' if ok else 'FAIL'}")
        run.checks.setdefault(label(c), []).append(f"f64 {err:.1e}{'' if ok else ' FAIL'}")


def table(run, cands):
    print("\n== GQA-like indexer forward, causal bf16, lse given (forced configs; api-default: nothing forced, "
          "autotune off) ==", flush=True)
    comp = RECORDED_COMPILE.get(("gqa", 8192, "fwd"))
    print(f"{'N':>6s} {'config':52s} {'ms':>8s} {'x floor':>8s} {'vs default':>10s} {'x compile':>9s}  checks")
    for N in sorted(run.floors):
        floor = run.floors[N]
        base = run.results.get((N, label(cands[0])))
        extra = sorted({k[1] for k in run.results if k[0] == N and k[1].endswith("host-merge")})
        for c in cands + extra:
            name = c if isinstance(c, str) else label(c)
            ms = run.results.get((N, name), "-")
            chk = "; ".join(run.checks.get(name, []))
            if isinstance(ms, float):
                vs = f"{base / ms:.2f}x" if isinstance(base, float) else "-"
                cp = f"{comp / ms:.1f}x" if (comp and N == 8192) else "-"
                print(f"{N:6d} {name:52s} {ms:8.3f} {ms / floor:8.2f} {vs:>10s} {cp:>9s}  {chk}")
            else:
                print(f"{N:6d} {name:52s} {ms:>8s}")
    rate = f"{run.rate / 1e12:.0f}" if run.rate else "?"
    print(f"floor: fwd matmul FLOPs (causal half) at {rate} TFLOP/s; torch.compile 8K fwd {comp} ms (run r5c, "
          f"recorded); {run.failed} failure(s); {time.time() - run.t0:.0f} s", flush=True)


def main(argv=None):
    args = parse_args(argv)
    if args.warm_job is not None:
        run_warm_job(args, int(args.warm_job))
        return 0
    run = Run(args)
    cands = configs(args)

    def watchdog():  # the slot is fixed: print what ran and leave before the caller kills us
        run.log(f"past the {args.deadline:.0f} s deadline: table of what ran, then exit")
        table(run, cands)
        os._exit(3)
    timer = threading.Timer(args.deadline, watchdog)
    timer.daemon = True
    timer.start()
    import triton
    run.log(f"idx_gqa: {torch.cuda.get_device_name() if run.device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
            f"triton {triton.__version__}, quick={args.quick}; configs {cands}")
    os.environ["STREAMKL_AUTOTUNE"] = "0" if args.final else "1"
    bad = set()
    if run.device == "cuda":
        try:
            jobs = warm_jobs(cands)
            failed = warm_up(run, jobs, args.parallel or max(1, min(16, os.cpu_count() or 1)),
                             limit=0.55 * args.deadline)
            bad = {i for i, c in enumerate(cands) if any(_kernel(c) == _kernel(cands[j]) for j in failed)}
        except Exception as exc:  # noqa: BLE001 - then this process compiles
            run.log(f"warm-up raised {type(exc).__name__}: {exc}")
    run.matmul_rate()
    ns = ([int(n) for n in args.ns.split(",")] if args.ns else [32] if args.tiny
          else [8192, 16384, 32768, 65536] if args.final else [8192, 16384])
    reps = 5 if args.quick else 20
    passes = 3 if args.quick else 5
    # timings first (8K, then 16K: the kernels are loaded by then, so 16K costs its compute only),
    # the float64 checks of what was timed after
    for n_i, N in enumerate(ns):
        if n_i and run.left() < 8:
            run.log(f"N={N}: skipped ({run.left():.0f} s left)")
            continue
        try:
            time_point(run, N, cands, bad, reps if n_i == 0 else (3 if args.quick else 10), passes)
        except Exception as exc:  # noqa: BLE001
            run.log(f"N={N} raised {type(exc).__name__}: {exc}")
            run.logf.write(traceback.format_exc())
    try:
        check_all(run, cands, bad)
    except Exception as exc:  # noqa: BLE001
        run.log(f"checks raised {type(exc).__name__}: {exc}")
        run.logf.write(traceback.format_exc())
    timer.cancel()
    table(run, cands)
    return 1 if run.failed else 0


if __name__ == "__main__":
    sys.exit(main())
