#!/usr/bin/env python3
"""streamkl benchmark + correctness run: ONE call on one GPU (default run budgeted at ~8 min).

    PYTHONUNBUFFERED=1 python bench/bench_gpu.py                      # everything, H200 budget
    python bench/bench_gpu.py --quick                                 # fewer N, fewer reps
    python bench/bench_gpu.py --sections env,check --out /tmp/x       # a subset
    TRITON_INTERPRET=1 python bench/bench_gpu.py --device cpu --tiny --sections check,fwd   # CPU smoke

Sections (see bench/README.md): env, check, fwd, bwd, decode, smallq, long.
Outputs under --out: bench.csv (long format, one row per measurement), check.csv (one row per
compared tensor), summary.txt (ratios vs the anchors' targets), env.json, bench.log.
Exit status: 0 ok; 1 a correctness check failed; 3 a section raised (rows written so far are kept).

Baselines mirror /work/shared/anchors/h200-2026-11-29.md:
  eager   = materialised fp32 log_softmax of both score matrices (matmul in the input dtype,
            cast to fp32, scale, mask), then the row sum of P1 * (logP1 - logP2);
  compile = torch.compile of that same function (static shapes, fresh dynamo cache per point);
  chunked = eager over 1024-row query chunks;
  sdpa    = F.scaled_dot_product_attention at the same shape, PyTorch's default backend dispatch
            (cuDNN on the H200 with torch 2.11; the anchors' SDPA numbers match it);
  sdpa_flash = the same call forced to the FlashAttention backend (sdpa_kernel([FLASH_ATTENTION])).
The summary's "ours/SDPA" lines compare against the faster of sdpa and sdpa_flash in this run.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as _dt
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COLUMNS = ["kernel", "provider", "mode", "causal", "n_q", "n_k", "b", "h", "d1", "d2", "dtype",
           "p20_ms", "p50_ms", "p80_ms", "peak_extra_gib", "status", "gpu", "torch", "triton",
           "date", "streamkl_version", "extra"]
CHECK_COLUMNS = ["case", "dtype", "setting", "err", "tol", "pass", "tensor", "eager_err", "detail"]
ALL_SECTIONS = ["env", "check", "fwd", "bwd", "decode", "smallq", "long"]

# Anchors (h200-2026-11-29.md): used for the summary's "measured vs anchor" lines and as a
# labelled fallback when a baseline was skipped in this run.
ANCHOR = {
    "copy_tb_s": 4.14, "matmul_tflops": 756.0,
    ("fwd", "eager", False, 8192): 64.15, ("fwd", "compile", False, 8192): 8.04,
    ("fwd", "sdpa", False, 8192): 1.70, ("fwd", "eager", True, 8192): 78.33,
    ("fwd", "compile", True, 8192): 13.06, ("fwd", "sdpa", True, 8192): 0.97,
    ("s1", "eager", False, 8192): 91.72, ("s1", "compile", False, 8192): 14.47,
    ("s2", "eager", False, 8192): 105.37, ("s2", "compile", False, 8192): 16.28,
    ("s1", "eager", True, 8192): 113.62, ("s1", "compile", True, 8192): 22.20,
    ("s2", "eager", True, 8192): 127.34, ("s2", "compile", True, 8192): 22.79,
    ("sdpa_fb", False, 8192): 6.55, ("sdpa_fb", True, 8192): 3.75,
}
SETTINGS = {"s1": ("q2", "k2"), "s2": ("q1", "k1"), "both": ("q1", "k1", "q2", "k2")}
# FlashAttention-style tolerance: err(ours) <= C * err(eager, same dtype) + floor.
C_FWD, C_BWD = 2.0, 3.0


# ----------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(ALL_SECTIONS),
                   help="comma list of: " + ",".join(ALL_SECTIONS) + " (default: all)")
    p.add_argument("--quick", action="store_true", help="fewer N points and shorter do_bench reps")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test / GPU sanity)")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out", help="output dir (default $OUT or ./bench_out)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-time budget for the whole run; perf points that would overrun are recorded "
                        "as 'skipped(budget)'. Default 460 (quick: 300, tiny: 600). Checks are never skipped.")
    p.add_argument("--compile-fwd-n", default=None, help="N list for torch.compile forward (priority order)")
    p.add_argument("--compile-bwd-n", default=None, help="N list for torch.compile fwd+bwd (priority order)")
    p.add_argument("--mem-limit-gb", type=float, default=100.0, help="skip eager/compile points estimated above this")
    p.add_argument("--check-autotune", action="store_true",
                   help="let streamkl_gpu tune launch configs during the check section (default: "
                        "STREAMKL_AUTOTUNE=0 there, i.e. the first candidate config; saves compiles)")
    p.add_argument("--full-check", action="store_true",
                   help="the full dtype x setting x mode product and more feature cases (~2x the compiles)")
    p.add_argument("--prewarm", choices=["auto", "on", "off"], default="auto",
                   help="compile in parallel worker processes first (Triton kernels of every section, "
                        "torch.compile graphs) so the serial run hits the on-disk caches. auto = on for "
                        "--device cuda without --tiny")
    p.add_argument("--prewarm-workers", type=int, default=None, help="default min(12, cpu_count - 2)")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-v", "--verbose", action="store_true", help="one stdout line per measurement (always in bench.log)")
    a = p.parse_args(argv)
    a.sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    bad = [s for s in a.sections if s not in ALL_SECTIONS]
    if bad:
        p.error(f"unknown sections {bad}; choose from {ALL_SECTIONS}")
    return a


def make_config(a):
    K = 1024
    if a.tiny:
        c = dict(
            H=2, D=32, fwd_n=[64, 96], bwd_n=[64], compile_fwd_n=[96], compile_bwd_n=[64],
            compile_bwd_settings=["s1", "s2"], chunk=32,
            decode=[(1, 512), (4, 512)], smallq_nq=[4, 16], smallq_nk=256,
            long_h=2, long_n=[128, 256], long_bwd_n=[256], warmup_ms=5, rep_ms=20,
            budgets=dict(prewarm=60, env=30, check=240, fwd=90, bwd=90, decode=30, smallq=30, long=30), total=600,
        )
    elif a.quick:
        c = dict(
            H=32, D=128, fwd_n=[2 * K, 8 * K, 32 * K], bwd_n=[2 * K, 8 * K], compile_fwd_n=[8 * K],
            compile_bwd_n=[8 * K], compile_bwd_settings=["s1", "s2"], chunk=1024,
            decode=[(1, 128 * K), (16, 128 * K), (1, 32 * K)], smallq_nq=[16, 512], smallq_nk=32 * K,
            long_h=8, long_n=[16 * K, 128 * K, 512 * K], long_bwd_n=[16 * K, 512 * K], warmup_ms=10, rep_ms=40,
            budgets=dict(prewarm=90, env=10, check=40, fwd=50, bwd=60, decode=10, smallq=10, long=25), total=300,
        )
    else:
        c = dict(
            H=32, D=128, fwd_n=[1 * K, 2 * K, 4 * K, 8 * K, 16 * K, 32 * K, 64 * K],
            bwd_n=[1 * K, 2 * K, 4 * K, 8 * K, 16 * K, 32 * K], compile_fwd_n=[8 * K, 4 * K],
            compile_bwd_n=[8 * K, 4 * K], compile_bwd_settings=["s1", "s2", "both"], chunk=1024,
            decode=[(1, 128 * K), (16, 128 * K), (1, 32 * K)], smallq_nq=[16, 64, 256, 512], smallq_nk=32 * K,
            long_h=8, long_n=[4 * K, 16 * K, 64 * K, 128 * K, 256 * K, 512 * K], long_bwd_n=[4 * K, 64 * K, 512 * K],
            warmup_ms=25, rep_ms=100,
            budgets=dict(prewarm=110, env=10, check=45, fwd=100, bwd=135, decode=10, smallq=20, long=30), total=460,
        )
    if a.compile_fwd_n:
        c["compile_fwd_n"] = [int(x) for x in a.compile_fwd_n.split(",") if x]
    if a.compile_bwd_n:
        c["compile_bwd_n"] = [int(x) for x in a.compile_bwd_n.split(",") if x]
    if a.budget_s is not None:
        c["total"] = a.budget_s
    return c


# ----------------------------------------------------------------------------------------------
# the math the baselines and the float64 reference share
# ----------------------------------------------------------------------------------------------
def dense_kl(q1, k1, q2, k2, causal=False, scale1=None, scale2=None, cdt=None, diag=None):
    """Eager attention KL: materialised log_softmax of both score matrices in `cdt` (default fp32).

    Scores: matmul in the input dtype, cast to cdt, times the scale. causal is bottom-right:
    key j visible to query i iff j <= i + diag, diag = N_K - N_Q unless given (query chunks).
    Masked entries: -inf before log_softmax, then log-probs set to 0 so 0*log(0/0) = 0 and no NaN
    reaches the values or the gradients; rows with no visible key give KL = 0 and gradient 0.
    """
    import torch
    cdt = cdt or torch.float32
    H, NQ, NK = q1.shape[1], q1.shape[2], k1.shape[2]
    sc1 = scale1 if scale1 is not None else 1.0 / math.sqrt(q1.shape[-1])
    sc2 = scale2 if scale2 is not None else 1.0 / math.sqrt(q2.shape[-1])
    if k1.shape[1] != H:
        k1 = k1.repeat_interleave(H // k1.shape[1], dim=1)
    if k2.shape[1] != H:
        k2 = k2.repeat_interleave(H // k2.shape[1], dim=1)
    if not causal:
        lp1 = torch.log_softmax(torch.matmul(q1, k1.transpose(-1, -2)).to(cdt) * sc1, dim=-1)
        lp2 = torch.log_softmax(torch.matmul(q2, k2.transpose(-1, -2)).to(cdt) * sc2, dim=-1)
        return (lp1.exp() * (lp1 - lp2)).sum(-1)
    if diag is None:
        diag = NK - NQ
    dev = q1.device
    hidden = torch.arange(NK, device=dev)[None, :] > (torch.arange(NQ, device=dev)[:, None] + diag)
    empty_rows = diag < 0  # row 0 sees keys j <= diag: none when diag < 0

    def logp(q, k, sc):
        s = torch.matmul(q, k.transpose(-1, -2)).to(cdt) * sc
        s = s.masked_fill_(hidden, -math.inf)
        if empty_rows:
            s = s.masked_fill_(hidden.all(-1, keepdim=True), 0.0)
        return torch.log_softmax(s, dim=-1).masked_fill(hidden, 0.0)

    lp1 = logp(q1, k1, sc1)
    lp2 = logp(q2, k2, sc2)
    return (lp1.exp() * (lp1 - lp2)).sum(-1)


def chunked_kl(q1, k1, q2, k2, causal=False, chunk=1024):
    """Eager over query chunks (what users do today to avoid the N^2 OOM)."""
    import torch
    NQ, NK = q1.shape[2], k1.shape[2]
    outs = []
    for i0 in range(0, NQ, chunk):
        i1 = min(NQ, i0 + chunk)
        outs.append(dense_kl(q1[:, :, i0:i1], k1, q2[:, :, i0:i1], k2, causal=causal, diag=i0 + NK - NQ))
    return torch.cat(outs, dim=2)


# ----------------------------------------------------------------------------------------------
# the runner
# ----------------------------------------------------------------------------------------------
class Budget:
    def __init__(self, t0, total, budgets, sections):
        self.t0, self.total = t0, total
        self.plan = {}
        cum = 0.0
        for s in sections:
            cum += budgets.get(s, 30)
            self.plan[s] = cum
        self.deadline = t0 + total

    def start(self, section):
        now = time.perf_counter()
        names = list(self.plan)
        i = names.index(section)
        prev = self.plan[names[i - 1]] if i else 0.0
        own = self.plan[section] - prev
        later = self.plan[names[-1]] - self.plan[section]  # the budgets of the sections still to come
        # Unused time of earlier sections carries forward. If earlier sections overran, this one still
        # gets half its own budget, and half of every later section's budget stays reserved for it;
        # nothing starts past the global end (+15 s grace).
        end = self.t0 + self.total + 15 - 0.5 * later
        self.deadline = min(max(self.t0 + self.plan[section], now + 0.5 * own), end)
        return own

    def remaining(self):
        return self.deadline - time.perf_counter()

    def allows(self, cost_s):
        return cost_s <= self.remaining()


class Runner:
    def __init__(self, args, cfg):
        self.a, self.cfg = args, cfg
        self.t0 = time.perf_counter()
        os.makedirs(args.out, exist_ok=True)
        self.log_f = open(os.path.join(args.out, "bench.log"), "w")
        import torch
        import triton
        self.torch, self.triton = torch, triton
        self.dev = torch.device(args.device)
        self.cuda = args.device == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise SystemExit("--device cuda but torch.cuda.is_available() is False (use --device cpu --tiny)")
        self.rows = []
        self.checks = []
        self.section_errors = []
        self.hist = {}  # (kernel, provider, mode, causal) -> (work, seconds per call)
        self.compile_est = {"fwd": 25.0, "bwd": 45.0}
        self.copy_bw = None  # bytes/s, read + written
        self.env = self._env()
        self.bench_f = open(os.path.join(args.out, "bench.csv"), "w", newline="")
        self.bench_w = csv.DictWriter(self.bench_f, fieldnames=COLUMNS)
        self.bench_w.writeheader()
        self.check_f = None
        self.budget = Budget(self.t0, cfg["total"], cfg["budgets"], args.sections)
        self.ak = None
        self.ak_error = None
        try:
            import streamkl_gpu
            self.ak = streamkl_gpu.attention_kl
            self.env["streamkl_gpu_file"] = getattr(streamkl_gpu, "__file__", None) or str(getattr(streamkl_gpu, "__path__", ""))
        except Exception as e:  # the module may not exist yet; baselines still run
            self.ak_error = f"{type(e).__name__}: {e}"
            self.log(f"WARNING: streamkl_gpu.attention_kl unavailable ({self.ak_error}); 'ours' rows will be errors")
        self.env["streamkl_version"] = self._version()

    # ---------------------------------------------------------------- logging / rows
    def log(self, msg, stdout=True):
        line = f"[{time.perf_counter() - self.t0:7.1f}s] {msg}"
        self.log_f.write(line + "\n")
        self.log_f.flush()
        if stdout:
            print(line, flush=True)

    def _env(self):
        torch, triton = self.torch, self.triton
        gpu = torch.cuda.get_device_name(0) if self.cuda else f"cpu:{platform.processor() or platform.machine()}"
        return {
            "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "python": sys.version.split()[0], "cuda": getattr(torch.version, "cuda", None),
            "triton_interpret": os.environ.get("TRITON_INTERPRET", ""), "host": platform.node(),
            "argv": sys.argv,
        }

    def _version(self):
        v = None
        try:
            import streamkl_gpu
            v = getattr(streamkl_gpu, "__version__", None)
        except Exception:
            pass
        if v is None:
            try:
                from importlib.metadata import version
                v = version("streamkl")
            except Exception:
                try:
                    with open(os.path.join(ROOT, "pyproject.toml")) as f:
                        for line in f:
                            if line.startswith("version"):
                                v = line.split("=")[1].strip().strip('"')
                                break
                except Exception:
                    v = "unknown"
        try:
            sha = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, timeout=5).stdout.strip()
            dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            if sha:
                v = f"{v}+g{sha}" + (".dirty" if dirty else "")
        except Exception:
            pass
        return str(v)

    def row(self, kernel, provider, mode, causal, nq, nk, b, h, d1, d2, dtype, times=None, peak=None,
            status="ok", extra="", echo=None):
        r = {k: "" for k in COLUMNS}
        r.update(kernel=kernel, provider=provider, mode=mode, causal=int(bool(causal)), n_q=nq, n_k=nk, b=b, h=h,
                 d1=d1, d2=d2, dtype=dtype, status=status, extra=extra,
                 gpu=self.env["gpu"], torch=self.env["torch"], triton=self.env["triton"], date=self.env["date"],
                 streamkl_version=self.env["streamkl_version"])
        if times is not None:
            r["p20_ms"], r["p50_ms"], r["p80_ms"] = (f"{t:.6g}" for t in times)
        if peak is not None and not (isinstance(peak, float) and math.isnan(peak)):
            r["peak_extra_gib"] = f"{peak:.4g}"
        self.rows.append(r)
        self.bench_w.writerow(r)
        self.bench_f.flush()
        p50 = r["p50_ms"] or "-"
        self.log(f"  {kernel:<10} {provider:<14} {mode:<12} c={int(bool(causal))} nq={nq} nk={nk} "
                 f"p50={p50} ms peak={r['peak_extra_gib'] or '-'} GiB {status} {extra}",
                 stdout=self.a.verbose if echo is None else echo)
        return r

    def get(self, kernel, provider, mode, causal, nq, nk=None):
        nk = nq if nk is None else nk
        for r in self.rows:
            if (r["kernel"] == kernel and r["provider"] == provider and r["mode"] == mode
                    and r["causal"] == int(bool(causal)) and r["n_q"] == nq and r["n_k"] == nk
                    and r["status"] == "ok" and r["p50_ms"]):
                return float(r["p50_ms"])
        return None

    # ---------------------------------------------------------------- device helpers
    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def free(self):
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def inputs(self, B, H, NQ, NK, D1, D2, dtype, HK1=None, HK2=None, req=(), seed=0, n_sets=1,
               g=True):
        """n_sets independent random input sets (rotated through by the timed closures)."""
        torch = self.torch
        dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
        HK1, HK2 = HK1 or H, HK2 or H
        sets = []
        for s in range(n_sets):
            gen = torch.Generator(device=self.dev)
            gen.manual_seed(self.a.seed * 1000003 + seed * 101 + s)
            d = {}
            for name, shp in (("q1", (B, H, NQ, D1)), ("k1", (B, HK1, NK, D1)),
                              ("q2", (B, H, NQ, D2)), ("k2", (B, HK2, NK, D2))):
                d[name] = torch.randn(shp, generator=gen, device=self.dev, dtype=dt).requires_grad_(name in req)
            if g:
                d["g"] = torch.randn((B, H, NQ), generator=gen, device=self.dev, dtype=torch.float32)
            sets.append(d)
        return sets

    @staticmethod
    def n_sets_for(nbytes_per_set, cap=1 << 31):
        return max(1, min(4, cap // max(1, nbytes_per_set)))

    def rotate(self, sets, f):
        state = {"i": 0}

        def fn():
            d = sets[state["i"] % len(sets)]
            state["i"] += 1
            return f(d)
        return fn

    def predict(self, key, work):
        h = self.hist.get(key)
        if h is None:
            return None
        return h[1] * work / h[0]

    def measure(self, fn, key=None, work=1.0, ctx=None, compile_kind=None, slow_reps=None):
        """Warm-up (compiles/autotunes), one call for peak memory, then do_bench (or a few
        event-timed calls when one call is slow). Returns (times_ms, peak_gib, status, extra)."""
        torch = self.torch
        ctx = ctx or contextlib.nullcontext
        pred = self.predict(key, work) if key else None
        cost = 0.0
        if compile_kind:
            cost += self.compile_est[compile_kind]
        if pred is not None:
            cost += pred * 2 + (max(0.25, 9 * pred) if pred < 0.3 else pred * (3 if pred < 1.5 else 1))
        if not self.budget.allows(cost):
            return None, None, "skipped(budget)", f"est_s={cost:.1f}"
        slow = pred is not None and pred > 0.3 and not compile_kind
        extra = []
        try:
            with ctx():
                if not slow:  # warm-up: JIT compile, autotune, torch.compile, cuBLAS heuristics
                    tw = time.perf_counter()
                    out = fn()
                    self.sync()
                    del out
                    first = time.perf_counter() - tw
                    extra.append(f"first_call_s={first:.3g}")
                    if compile_kind:
                        self.compile_est[compile_kind] = max(self.compile_est[compile_kind] * 0.5, first * 1.2)
                # one call for peak memory (and a time sample)
                self.sync()
                if self.cuda:
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    out = fn()
                    e1.record()
                    torch.cuda.synchronize()
                    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
                    t_one = e0.elapsed_time(e1)
                else:
                    tc = time.perf_counter()
                    out = fn()
                    t_one = (time.perf_counter() - tc) * 1e3
                    peak = float("nan")
                del out
                if key:
                    self.hist[key] = (work, t_one / 1e3)
                if not self.cuda:
                    samples = [t_one]
                    for _ in range(2):
                        tc = time.perf_counter()
                        fn()
                        samples.append((time.perf_counter() - tc) * 1e3)
                    times = quantiles(samples)
                    extra.append(f"reps={len(samples)};timer=perf_counter")
                elif t_one > 300.0:  # slow: a few event-timed calls, no do_bench
                    reps = slow_reps or (3 if t_one < 1500.0 else 1)
                    samples = [t_one]
                    for _ in range(reps - 1):
                        if not self.budget.allows(t_one / 1e3 * 1.2):
                            break
                        e0.record()
                        fn()
                        e1.record()
                        torch.cuda.synchronize()
                        samples.append(e0.elapsed_time(e1))
                    times = quantiles(samples)
                    extra.append(f"reps={len(samples)};timer=cuda_events" + (";no_warmup" if slow else ""))
                else:
                    from triton.testing import do_bench
                    times = do_bench(fn, warmup=self.cfg["warmup_ms"], rep=self.cfg["rep_ms"],
                                     quantiles=[0.2, 0.5, 0.8])
                    extra.append("timer=do_bench")
            return list(times), peak, "ok", ";".join(extra)
        except torch.cuda.OutOfMemoryError as e:
            self.free()
            return None, None, "OOM", str(e).split("\n")[0][:120].replace(",", ";")
        except RuntimeError as e:
            if "out of memory" in str(e).lower():
                self.free()
                return None, None, "OOM", ""
            self.free()
            self.log(f"ERROR in measurement: {type(e).__name__}: {str(e)[:300]}")
            self.log(traceback.format_exc(), stdout=False)
            return None, None, "error", f"{type(e).__name__}: {str(e)[:100]}".replace(",", ";").replace("\n", " ")
        except Exception as e:
            self.free()
            self.log(f"ERROR in measurement: {type(e).__name__}: {str(e)[:300]}")
            self.log(traceback.format_exc(), stdout=False)
            return None, None, "error", f"{type(e).__name__}: {str(e)[:100]}".replace(",", ";").replace("\n", " ")

    def point(self, meta, fn, key_provider=None, work=1.0, ctx=None, compile_kind=None, pre_status=None,
              extra="", slow_reps=None):
        """Measure fn and write one row. meta = (kernel, provider, mode, causal, nq, nk, b, h, d1, d2, dtype)."""
        kernel, provider, mode, causal = meta[:4]
        if pre_status is not None:
            return self.row(*meta, status=pre_status, extra=extra)
        if fn is None:
            return self.row(*meta, status="error", extra=(self.ak_error or "unavailable").replace(",", ";")[:100])
        key = (kernel, key_provider or provider, mode, causal)
        times, peak, status, ex = self.measure(fn, key=key, work=work, ctx=ctx, compile_kind=compile_kind,
                                               slow_reps=slow_reps)
        ex = ";".join(x for x in (extra, ex) if x)
        return self.row(*meta, times=times, peak=peak, status=status, extra=ex)

    # ---------------------------------------------------------------- providers (closures)
    def f_ours_fwd(self, causal, split_k=None):
        if self.ak is None:
            return None
        ak = self.ak
        return lambda d: ak(d["q1"], d["k1"], d["q2"], d["k2"], causal=causal, split_k=split_k)

    def f_ours_fb(self, causal, setting, bwd_mode):
        if self.ak is None:
            return None
        ak, names, torch = self.ak, SETTINGS[setting], self.torch

        def f(d):
            kl = ak(d["q1"], d["k1"], d["q2"], d["k2"], causal=causal, bwd_mode=bwd_mode)
            return torch.autograd.grad(kl, [d[n] for n in names], d["g"])
        return f

    def f_eager_fwd(self, causal, compiled=None):
        fn = compiled or dense_kl
        return lambda d: fn(d["q1"], d["k1"], d["q2"], d["k2"], causal)

    def f_eager_fb(self, causal, setting, compiled=None):
        fn, names, torch = compiled or dense_kl, SETTINGS[setting], self.torch

        def f(d):
            kl = fn(d["q1"], d["k1"], d["q2"], d["k2"], causal)
            return torch.autograd.grad(kl, [d[n] for n in names], d["g"])
        return f

    # SDPA providers: "sdpa" = PyTorch's default backend dispatch (no context; cuDNN on the H200),
    # "sdpa_flash" = forced to the FlashAttention backend (on CPU: torch's CPU flash kernel).
    SDPA_PROVIDERS = (("sdpa", "default"), ("sdpa_flash", "flash"))

    def sdpa_ctx(self, backend):
        if backend == "default":
            return None
        from torch.nn.attention import SDPBackend, sdpa_kernel
        be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
        return lambda: sdpa_kernel([be])

    def sdpa_best(self, kernel, mode, causal, nq, nk=None):
        """The faster of the SDPA providers measured in this run: (ms, which, note) or (None, None, "")."""
        got = [(self.get(kernel, p, mode, causal, nq, nk), b) for p, b in self.SDPA_PROVIDERS]
        meas = [(t, b) for t, b in got if t]
        if not meas:
            return None, None, ""
        t, b = min(meas)
        missing = [b2 for t2, b2 in got if not t2]
        return t, b, (f"; {','.join(missing)} not measured" if missing else "")

    def prep_sdpa_bwd(self, sets):
        """Leaves (sharing storage with q1, k1, k2) and dO for SDPA fwd+bwd, made before timing."""
        for d in sets:
            d["_sdpa"] = [d[n].detach().requires_grad_(True) for n in ("q1", "k1", "k2")]
            d["_do"] = self.torch.randn_like(d["q1"])
        return sets

    def f_sdpa(self, causal, backward=False):
        """SDPA at the same shape: q = q1, k = k1, v = k2 (contents do not matter for speed)."""
        F = self.torch.nn.functional
        torch = self.torch

        if not backward:
            return lambda d: F.scaled_dot_product_attention(d["q1"], d["k1"], d["k2"], is_causal=causal)

        def f(d):
            q, k, v = d["_sdpa"]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return torch.autograd.grad(o, (q, k, v), d["_do"])
        return f

    def compiled_kl(self):
        torch = self.torch
        import torch._dynamo as dyn
        dyn.reset()
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(dyn.config, name):
                try:
                    setattr(dyn.config, name, 256)
                except Exception:
                    pass
        return torch.compile(dense_kl, dynamic=False)

    # ------------------------------------------------------------------------------------------
    # sections
    # ------------------------------------------------------------------------------------------
    def sec_env(self):
        torch = self.torch
        bw, t_copy, nbytes = self.measure_copy()
        self.row("env", "copy", "d2d", 0, 0, 0, 0, 0, 0, 0, "uint8", times=t_copy, status="ok",
                 extra=f"bytes={nbytes};tb_s={bw / 1e12:.4g};counts=read+written", echo=False)
        n = 8192 if self.cuda and not self.a.tiny else 512
        dt = torch.bfloat16 if self.cuda else torch.float32
        a = torch.randn(n, n, device=self.dev, dtype=dt)
        b = torch.randn(n, n, device=self.dev, dtype=dt)
        times = self.bench_simple(lambda: a @ b)
        tflops = 2 * n ** 3 / (times[1] * 1e-3) / 1e12
        self.row("env", "matmul", "mm", 0, n, n, 1, 1, n, n, "bf16" if self.cuda else "fp32", times=times,
                 extra=f"tflops={tflops:.4g}", echo=False)
        del a, b
        self.free()
        self.env.update(copy_tb_s=round(bw / 1e12, 4), matmul_tflops=round(tflops, 2), matmul_n=n)
        with open(os.path.join(self.a.out, "env.json"), "w") as f:
            json.dump(self.env, f, indent=1)
        self.log(f"env: {self.env['gpu']} torch {self.env['torch']} triton {self.env['triton']} "
                 f"streamkl {self.env['streamkl_version']}; copy {bw / 1e12:.3f} TB/s (anchor 4.14); "
                 f"{'bf16 ' if self.cuda else ''}matmul {n}^3 {tflops:.1f} TFLOP/s (anchor 756)")

    def bench_simple(self, fn):
        if self.cuda:
            from triton.testing import do_bench
            return list(do_bench(fn, warmup=self.cfg["warmup_ms"], rep=self.cfg["rep_ms"], quantiles=[0.2, 0.5, 0.8]))
        fn()
        s = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            s.append((time.perf_counter() - t) * 1e3)
        return quantiles(s)

    def measure_copy(self):
        if self.copy_bw is None:
            torch = self.torch
            nbytes = (1 << 30) if (self.cuda and not self.a.tiny) else (32 << 20)
            x = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=self.dev)
            y = torch.empty_like(x)
            times = self.bench_simple(lambda: y.copy_(x))
            self.copy_bw = 2 * nbytes / (times[1] * 1e-3)
            self._copy = (times, nbytes)
            del x, y
            self.free()
        return self.copy_bw, self._copy[0], self._copy[1]

    # ---------------------------------------------------------------- forward
    def sec_fwd(self):
        cfg, H, D = self.cfg, self.cfg["H"], self.cfg["D"]
        elem = 2
        for causal in (False, True):
            for n in prio(cfg["fwd_n"]):
                tp = time.perf_counter()
                per_set = 4 * H * n * D * elem
                sets = self.inputs(1, H, n, n, D, D, "bf16", seed=n + causal, n_sets=self.n_sets_for(per_set), g=False)
                meta = lambda prov: ("fwd", prov, "fwd", causal, n, n, 1, H, D, D, "bf16")
                work = H * n * n
                f = self.f_ours_fwd(causal)
                self.point(meta("ours"), f and self.rotate(sets, f), work=work)
                for prov, be in self.SDPA_PROVIDERS:
                    self.point(meta(prov), self.rotate(sets, self.f_sdpa(causal)), work=work, ctx=self.sdpa_ctx(be),
                               extra=f"sdpa_backend={be}")
                est_eager = 6.5 * H * n * n * 4 / 1e9
                if est_eager > self.a.mem_limit_gb:
                    self.point(meta("eager"), None, pre_status="OOM/skipped", extra=f"est_gb={est_eager:.0f}")
                else:
                    self.point(meta("eager"), self.rotate(sets, self.f_eager_fwd(causal)), work=work)
                ch = cfg["chunk"]
                self.point(meta("chunked"), self.rotate(sets[:1], lambda d: chunked_kl(d["q1"], d["k1"], d["q2"], d["k2"], causal, ch)),
                           work=work, extra=f"chunk={ch}")
                del sets
                self.free()
                self.group_line("fwd", causal, n, n, "fwd", ["ours", "sdpa", "sdpa_flash", "eager", "chunked"], tp)
        self.compile_points("fwd")

    def compile_points(self, which):
        """torch.compile points in priority order (the summary's N first), each with a fresh cache."""
        cfg, H, D = self.cfg, self.cfg["H"], self.cfg["D"]
        if not self.cuda:
            for n in (cfg["compile_fwd_n"] if which == "fwd" else cfg["compile_bwd_n"]):
                for causal in (False, True):
                    modes = ["fwd"] if which == "fwd" else [f"fwd_bwd_{s}" for s in cfg["compile_bwd_settings"]]
                    for m in modes:
                        self.row("fwd" if which == "fwd" else "fwd_bwd", "compile", m, causal, n, n, 1, H, D, D,
                                 "bf16", status="skipped(cpu)")
            return
        ns = cfg["compile_fwd_n"] if which == "fwd" else cfg["compile_bwd_n"]
        settings = [None] if which == "fwd" else cfg["compile_bwd_settings"]
        for n in ns:
            for setting in settings:
                for causal in (False, True):
                    tp = time.perf_counter()
                    kernel = "fwd" if which == "fwd" else "fwd_bwd"
                    mode = "fwd" if setting is None else f"fwd_bwd_{setting}"
                    meta = (kernel, "compile", mode, causal, n, n, 1, H, D, D, "bf16")
                    est = (2.5 if setting is None else 4.5) * H * n * n * 4 / 1e9
                    if est > self.a.mem_limit_gb:
                        self.point(meta, None, pre_status="OOM/skipped", extra=f"est_gb={est:.0f}")
                        continue
                    sets = self.inputs(1, H, n, n, D, D, "bf16", seed=7 * n + causal, req=SETTINGS.get(setting, ()),
                                       n_sets=1)
                    try:
                        comp = self.compiled_kl()
                    except Exception as e:
                        self.point(meta, None, pre_status="error", extra=f"{type(e).__name__}")
                        continue
                    f = self.f_eager_fwd(causal, comp) if setting is None else self.f_eager_fb(causal, setting, comp)
                    r = self.point(meta, self.rotate(sets, f), work=H * n * n,
                                   compile_kind="fwd" if setting is None else "bwd")
                    del sets, comp, f
                    self.free()
                    self.log(f"{kernel} compile {mode} c={int(causal)} N={n}: {r['status']} p50={r['p50_ms'] or '-'} ms "
                             f"({time.perf_counter() - tp:.1f}s; {r['extra']})")

    def group_line(self, kernel, causal, nq, nk, mode, provs, tp):
        parts = []
        for p in provs:
            v = self.get(kernel, p, mode, causal, nq, nk)
            if v is None:
                st = next((r["status"] for r in reversed(self.rows) if r["kernel"] == kernel and r["provider"] == p
                           and r["mode"] == mode and r["n_q"] == nq and r["n_k"] == nk
                           and r["causal"] == int(bool(causal))), "-")
                parts.append(f"{p}={st}")
            else:
                parts.append(f"{p}={v:.4g}")
        self.log(f"{kernel} {mode} c={int(causal)} nq={nq} nk={nk}: " + " ".join(parts) +
                 f" ms ({time.perf_counter() - tp:.1f}s)")

    # ---------------------------------------------------------------- forward + backward
    def sec_bwd(self):
        cfg, H, D = self.cfg, self.cfg["H"], self.cfg["D"]
        for causal in (False, True):
            for n in prio(cfg["bwd_n"]):
                for setting in ("s1", "s2", "both"):
                    tp = time.perf_counter()
                    mode = f"fwd_bwd_{setting}"
                    per_set = 4 * H * n * D * 2 * 2
                    sets = self.inputs(1, H, n, n, D, D, "bf16", seed=3 * n + causal, req=SETTINGS[setting],
                                       n_sets=self.n_sets_for(per_set))
                    meta = lambda prov: ("fwd_bwd", prov, mode, causal, n, n, 1, H, D, D, "bf16")
                    work = H * n * n
                    # "auto" only where the summary reads it (N >= 8K; all N with --tiny): saves ~40 points
                    for bm in ("fused", "separate", "auto"):
                        if bm == "auto" and n < 8 * 1024 and not self.a.tiny:
                            continue
                        f = self.f_ours_fb(causal, setting, bm)
                        self.point(meta(f"ours_{bm}"), f and self.rotate(sets, f), work=work)
                    if setting == "s1":  # SDPA fwd+bwd does not depend on the setting: once per (N, causal)
                        sdpa_sets = self.prep_sdpa_bwd(sets)
                        for prov, be in self.SDPA_PROVIDERS:
                            self.point(("fwd_bwd", prov, "fwd_bwd_sdpa", causal, n, n, 1, H, D, D, "bf16"),
                                       self.rotate(sdpa_sets, self.f_sdpa(causal, backward=True)), work=work,
                                       ctx=self.sdpa_ctx(be), extra=f"sdpa_backend={be}")
                    est = 8.5 * H * n * n * 4 / 1e9
                    if est > self.a.mem_limit_gb:
                        self.point(meta("eager"), None, pre_status="OOM/skipped", extra=f"est_gb={est:.0f}")
                    else:
                        self.point(meta("eager"), self.rotate(sets, self.f_eager_fb(causal, setting)), work=work)
                    del sets
                    self.free()
                    self.group_line("fwd_bwd", causal, n, n, mode, ["ours_fused", "ours_separate", "ours_auto", "eager"], tp)
        self.compile_points("bwd")

    # ---------------------------------------------------------------- decode-like small N_Q, forward
    def sec_decode(self):
        cfg, H, D = self.cfg, self.cfg["H"], self.cfg["D"]
        bw, _, _ = self.measure_copy()
        for nq, nk in cfg["decode"]:
            tp = time.perf_counter()
            per_set = 2 * H * nk * D * 2
            sets = self.inputs(1, H, nq, nk, D, D, "bf16", seed=nq * 7 + nk, n_sets=self.n_sets_for(per_set), g=False)
            meta = lambda prov: ("decode", prov, "fwd", False, nq, nk, 1, H, D, D, "bf16")
            work = H * nq * nk
            f = self.f_ours_fwd(False)
            self.point(meta("ours"), f and self.rotate(sets, f), work=work, extra="split_k=auto")
            f = self.f_ours_fwd(False, split_k=1)
            self.point(meta("ours_split1"), f and self.rotate(sets, f), work=work, extra="split_k=1")
            for prov, be in self.SDPA_PROVIDERS:
                self.point(meta(prov), self.rotate(sets, self.f_sdpa(False)), work=work, ctx=self.sdpa_ctx(be),
                           extra=f"sdpa_backend={be}")
            self.point(meta("eager"), self.rotate(sets, self.f_eager_fwd(False)), work=work)
            kbytes = 2 * H * nk * D * 2  # K1 and K2, bf16, read once
            floor = kbytes / bw * 1e3
            self.row(*meta("floor"), times=[floor] * 3, extra=f"bytes={kbytes};copy_tb_s={bw / 1e12:.4g}")
            del sets
            self.free()
            self.group_line("decode", False, nq, nk, "fwd", ["ours", "ours_split1", "sdpa", "sdpa_flash", "eager", "floor"], tp)

    # ---------------------------------------------------------------- fused vs separate backward at small N_Q
    def sec_smallq(self):
        cfg, H, D = self.cfg, self.cfg["H"], self.cfg["D"]
        nk = cfg["smallq_nk"]
        for nq in cfg["smallq_nq"]:
            for setting in ("s1", "s2", "both"):
                tp = time.perf_counter()
                mode = f"fwd_bwd_{setting}"
                per_set = 2 * H * (nk + nq) * D * 2 * 2
                sets = self.inputs(1, H, nq, nk, D, D, "bf16", seed=11 * nq, req=SETTINGS[setting],
                                   n_sets=self.n_sets_for(per_set))
                for bm in ("fused", "separate", "auto"):
                    f = self.f_ours_fb(False, setting, bm)
                    self.point(("smallq_bwd", f"ours_{bm}", mode, False, nq, nk, 1, H, D, D, "bf16"),
                               f and self.rotate(sets, f), work=H * nq * nk)
                del sets
                self.free()
                self.group_line("smallq_bwd", False, nq, nk, mode, ["ours_fused", "ours_separate", "ours_auto"], tp)

    # ---------------------------------------------------------------- long context + memory vs N
    def sec_long(self):
        # streamkl_gpu tunes per shape bucket by timing every candidate config; at 512K one forward
        # is ~1 s, so tuning would cost minutes: the first candidate config is used here.
        old = os.environ.get("STREAMKL_AUTOTUNE")
        os.environ["STREAMKL_AUTOTUNE"] = "0"
        try:
            self._sec_long()
        finally:
            if old is None:
                os.environ.pop("STREAMKL_AUTOTUNE", None)
            else:
                os.environ["STREAMKL_AUTOTUNE"] = old

    def _sec_long(self):
        cfg, D, H = self.cfg, self.cfg["D"], self.cfg["long_h"]
        causal = True
        for n in cfg["long_n"]:
            tp = time.perf_counter()
            for setting in (None, "s1"):
                if setting == "s1" and n not in cfg["long_bwd_n"]:
                    continue
                mode = "fwd" if setting is None else "fwd_bwd_s1"
                meta = ("long", "ours" if setting is None else "ours_auto", mode, causal, n, n, 1, H, D, D, "bf16")
                if self.ak is None:
                    self.point(meta, None)
                    continue
                try:
                    sets = self.inputs(1, H, n, n, D, D, "bf16", seed=n, req=SETTINGS.get(setting, ()), n_sets=1,
                                       g=setting is not None)
                except self.torch.cuda.OutOfMemoryError:
                    self.free()
                    self.row(*meta, status="OOM", extra="inputs")
                    continue
                f = self.f_ours_fwd(causal) if setting is None else self.f_ours_fb(causal, setting, "auto")
                inb = 4 * H * n * D * 2
                self.point(meta, self.rotate(sets, f), work=H * n * n, slow_reps=2,
                           extra=f"input_gib={inb / 2 ** 30:.3g};autotune=off")
                del sets
                self.free()
            self.group_line("long", causal, n, n, "fwd", ["ours"], tp)

    # ------------------------------------------------------------------------------------------
    # correctness
    # ------------------------------------------------------------------------------------------
    def check_cases(self):
        """The correctness matrix. Every dimension the brief lists is covered; the full product is
        not (each new constexpr combination is a Triton compile, ~1-3 s on the GPU host):
        core (N=197, D=64) = bf16 x causal x {fwd, s1, s2, both} fused + separate ('both'; s1, s2
        too when causal); fp16 and fp32 x causal x {fwd, both fused} (+ fp32 causal separate);
        features (bf16 unless noted) = fwd and 'both' fused (+ separate where the path differs) on
        GQA/MQA, D1 != D2 (128/64, 80/96), N_Q != N_K both ways, scales, N_Q = 1 and 5 (split-K),
        the deterministic GQA backward, D=128 N=2048 all settings. --full-check: the full product."""
        t = self.a.tiny
        full = self.a.full_check
        cases = []
        n_core, d_core = (37, 16) if t else (197, 64)
        for dt in ("fp32", "fp16", "bf16"):
            for causal in (False, True):
                if full:
                    settings, sep = ["fwd", "s1", "s2", "both"], ["s1", "s2", "both"]
                elif dt == "bf16":
                    settings, sep = ["fwd", "s1", "s2", "both"], (["s1", "s2", "both"] if causal else ["both"])
                else:
                    settings, sep = ["fwd", "both"], (["both"] if (dt == "fp32" and causal) else [])
                cases.append(dict(name=f"core_n{n_core}_d{d_core}", B=1 if t else 2, H=2 if t else 4, NQ=n_core,
                                  NK=n_core, D1=d_core, D2=d_core, causal=causal, dtype=dt,
                                  settings=settings, separate=sep))
        if t:
            sh = [dict(name="gqa_h4_hk2_hk1", H=4, HK1=2, HK2=1, NQ=40, NK=40, D1=16, D2=16, causal=True),
                  dict(name="d32_16", NQ=33, NK=33, D1=32, D2=16, causal=True),
                  dict(name="d24_40", NQ=30, NK=30, D1=24, D2=40, causal=False),
                  dict(name="nq9_lt_nk50", NQ=9, NK=50, D1=16, D2=16, causal=True),
                  dict(name="nq50_gt_nk9", NQ=50, NK=9, D1=16, D2=16, causal=True),
                  dict(name="nq50_gt_nk9", NQ=50, NK=9, D1=16, D2=16, causal=False),
                  dict(name="scales_tau", NQ=21, NK=21, D1=16, D2=16, causal=True, scale1=0.37, scale2=0.09),
                  dict(name="nq1_nk150", NQ=1, NK=150, D1=16, D2=16, causal=False),
                  dict(name="gqa_deterministic", H=4, HK1=2, HK2=1, NQ=24, NK=24, D1=16, D2=16, causal=True,
                       settings=["both"], separate=[], kw=dict(deterministic=True))]
        else:
            # D=64 cases keep N % 16 != 0 like the core, so they reuse its compiled kernels
            sh = [dict(name="gqa_h8_hk2_hk4", H=8, HK1=2, HK2=4, NQ=197, NK=197, D1=64, D2=64, causal=True),
                  dict(name="mqa_h8_hk1_hk8", H=8, HK1=1, HK2=8, NQ=101, NK=101, D1=64, D2=64, causal=False,
                       separate=[]),
                  dict(name="d128_64", NQ=200, NK=200, D1=128, D2=64, causal=True, separate=[]),
                  dict(name="d80_96", NQ=150, NK=150, D1=80, D2=96, causal=True),
                  dict(name="nq70_lt_nk333", NQ=70, NK=333, D1=64, D2=64, causal=True),
                  dict(name="nq333_gt_nk70", NQ=333, NK=70, D1=64, D2=64, causal=True),
                  dict(name="nq333_gt_nk70", NQ=333, NK=70, D1=64, D2=64, causal=False, separate=[]),
                  dict(name="scales_tau", NQ=129, NK=129, D1=64, D2=64, causal=True, scale1=0.37, scale2=0.09),
                  dict(name="nq1_nk1500", NQ=1, NK=1500, D1=64, D2=64, causal=False, separate=[]),
                  dict(name="nq5_nk777", NQ=5, NK=777, D1=64, D2=64, causal=True),
                  # D=128, N % 16 == 0: kernels the perf sections compile anyway
                  dict(name="big_n2048", B=1, H=4, NQ=2048, NK=2048, D1=128, D2=128, causal=True,
                       settings=["fwd", "s1", "s2", "both"], separate=[]),
                  dict(name="gqa_deterministic", H=8, HK1=2, HK2=4, NQ=197, NK=197, D1=64, D2=64, causal=True,
                       settings=["both"], separate=[], kw=dict(deterministic=True)),
                  dict(name="d80_96", NQ=150, NK=150, D1=80, D2=96, causal=True, dtype="fp32", settings=["fwd"],
                       separate=[])]
            if full:
                sh += [dict(name="d128_64", NQ=200, NK=200, D1=128, D2=64, causal=False, dtype="fp16"),
                       dict(name="d80_96", NQ=150, NK=150, D1=80, D2=96, causal=False, dtype="fp32"),
                       dict(name="gqa_h8_hk2_hk4", H=8, HK1=2, HK2=4, NQ=256, NK=256, D1=64, D2=64, causal=False,
                            settings=["fwd", "s1", "s2", "both"], separate=["s1", "s2", "both"])]
                for c in sh:
                    c["separate"] = [x for x in c.get("settings", ["fwd", "both"]) if x != "fwd"]
        for c in sh:
            c.setdefault("B", 1 if t else 2)
            c.setdefault("H", 2 if t else 4)
            c.setdefault("dtype", "bf16")
            c.setdefault("settings", ["fwd", "both"])
            c.setdefault("separate", ["both"])
            cases.append(c)
        return cases

    def crow(self, case, dtype, setting, err, tol, ok, tensor, eager_err="", detail=""):
        r = dict(case=case, dtype=dtype, setting=setting, err=f"{err:.4g}" if isinstance(err, float) else err,
                 tol=f"{tol:.4g}" if isinstance(tol, float) else tol, **{"pass": bool(ok)}, tensor=tensor,
                 eager_err=f"{eager_err:.4g}" if isinstance(eager_err, float) else eager_err,
                 detail=str(detail).replace("\n", " ")[:200])
        self.checks.append(r)
        if self.check_f is None:
            self.check_f = open(os.path.join(self.a.out, "check.csv"), "w", newline="")
            self.check_w = csv.DictWriter(self.check_f, fieldnames=CHECK_COLUMNS)
            self.check_w.writeheader()
        self.check_w.writerow(r)
        self.check_f.flush()
        self.log(f"  check {'PASS' if ok else 'FAIL'} {case} {dtype} {setting} {tensor} err={r['err']} tol={r['tol']} {r['detail']}",
                 stdout=not ok or self.a.verbose)

    @contextlib.contextmanager
    def tf32(self, on):
        torch = self.torch
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = on
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old

    def maxerr(self, a, b):
        torch = self.torch
        if a.shape != b.shape:
            return float("nan")
        d = (a.double() - b.double()).abs()
        if d.numel() == 0:
            return 0.0
        v = d.max().item()
        if torch.isnan(a).any().item():
            return float("nan")
        return v

    def run_case(self, c):
        torch = self.torch
        dtype = c["dtype"]
        causal = c["causal"]
        case = f"{c['name']}{'/causal' if causal else ''}"
        kw = dict(causal=causal, scale1=c.get("scale1"), scale2=c.get("scale2"))
        base = self.inputs(c["B"], c["H"], c["NQ"], c["NK"], c["D1"], c["D2"], dtype, HK1=c.get("HK1"),
                           HK2=c.get("HK2"), seed=hash_str(case + dtype))[0]
        names = ("q1", "k1", "q2", "k2")

        def leaf(d, req, cast=None):
            return {n: (d[n].detach().to(cast) if cast else d[n].detach()).requires_grad_(n in req) for n in names}

        def eager_run(req, tf32):
            x = leaf(base, req)
            with self.tf32(tf32):
                kl = dense_kl(*(x[n] for n in names), **kw)
                gr = torch.autograd.grad(kl, [x[n] for n in req], base["g"]) if req else []
            return kl.detach(), [t.detach() for t in gr]

        for setting in c["settings"]:
            req = () if setting == "fwd" else SETTINGS[setting]
            # float64 reference (same rounded inputs, materialised log_softmax in float64)
            x64 = leaf(base, req, torch.float64)
            kl64 = dense_kl(*(x64[n] for n in names), cdt=torch.float64, **kw)
            g64 = torch.autograd.grad(kl64, [x64[n] for n in req], base["g"].double()) if req else []
            kl64 = kl64.detach()
            # the same eager math at this dtype; fp32 inputs: TF32 matmul allowed (the looser of the two)
            e_kl, e_gr = eager_run(req, tf32=(dtype == "fp32"))
            strict = eager_run(req, tf32=False) if (dtype == "fp32" and self.cuda) else None
            okw = dict(c.get("kw", {}))
            if setting == "fwd":
                modes = [None]
            elif okw.get("deterministic"):
                modes = ["deterministic"]
            else:
                modes = ["fused"] + (["separate"] if setting in c["separate"] else [])
            for bm in modes:
                label = case if bm is None else f"{case}/{bm}"
                try:
                    x = leaf(base, req)
                    if bm in ("fused", "separate"):
                        okw["bwd_mode"] = bm
                    kl = self.ak(*(x[n] for n in names), **kw, **okw)
                    gr = torch.autograd.grad(kl, [x[n] for n in req], base["g"]) if req else []
                except Exception as e:
                    self.crow(label, dtype, setting, "", "", False, "all", detail=f"{type(e).__name__}: {e}")
                    self.log(traceback.format_exc(), stdout=False)
                    continue
                if setting == "fwd":
                    ok_api = kl.dtype == torch.float32 and tuple(kl.shape) == (c["B"], c["H"], c["NQ"])
                    self.crow(label, dtype, "api", 0.0 if ok_api else 1.0, 0.0, ok_api, "kl dtype/shape",
                              detail=f"{kl.dtype} {tuple(kl.shape)}")
                outs = [("kl", kl.detach(), kl64, e_kl, strict[0] if strict else None, C_FWD)]
                if bm == "separate":
                    outs = []  # the forward does not depend on the mode: compared once (fused run)
                outs += [(f"d{n}", gr[i], g64[i], e_gr[i], strict[1][i] if strict else None, C_BWD)
                         for i, n in enumerate(req)]
                for tname, ours, ref, eag, eag_strict, cmul in outs:
                    err = self.maxerr(ours, ref)
                    eerr = self.maxerr(eag, ref)
                    amax = ref.abs().max().item() if ref.numel() else 0.0
                    floor = (2e-5 * max(1.0, amax)) if tname == "kl" else (2e-5 * amax + 1e-7)
                    tol = cmul * eerr + floor
                    detail = ""
                    if eag_strict is not None:
                        serr = self.maxerr(eag_strict, ref)
                        detail = f"eager_fp32_strict_err={serr:.3g}"
                        if err > cmul * serr + floor:
                            detail += " (ours at TF32-level precision)"
                    if ours.dtype != ref.dtype and tname != "kl" and ours.dtype != base["q1"].dtype:
                        detail += f" grad dtype {ours.dtype}"
                    self.crow(label, dtype, setting, err, tol, err <= tol, tname, eerr, detail)

    def check_splitk(self):
        torch = self.torch
        t = self.a.tiny
        shapes = ([dict(B=1, H=2, NQ=1, NK=200, D1=16, D2=16, causal=False, dtype="fp32", splits=[None, 2, 3]),
                   dict(B=1, H=2, NQ=4, NK=150, D1=16, D2=16, causal=True, dtype="bf16", splits=[3])] if t else
                  [dict(B=1, H=4, NQ=1, NK=32768, D1=128, D2=128, causal=False, dtype="bf16", splits=[None, 2, 5, 16]),
                   dict(B=2, H=4, HK1=2, NQ=16, NK=4099, D1=128, D2=64, causal=True, dtype="bf16", splits=[None, 3, 8]),
                   dict(B=1, H=4, NQ=3, NK=2000, D1=64, D2=64, causal=False, dtype="fp32", splits=[None, 4])])
        for s in shapes:
            case = f"splitk_nq{s['NQ']}_nk{s['NK']}{'/causal' if s['causal'] else ''}"
            d = self.inputs(s["B"], s["H"], s["NQ"], s["NK"], s["D1"], s["D2"], s["dtype"], HK1=s.get("HK1"),
                            seed=hash_str(case), g=False)[0]
            args = (d["q1"], d["k1"], d["q2"], d["k2"])
            ref = dense_kl(*(a.double() for a in args), s["causal"], cdt=torch.float64)
            with self.tf32(s["dtype"] == "fp32"):
                eerr = self.maxerr(dense_kl(*args, s["causal"]), ref)
            tol = C_FWD * eerr + 2e-5 * max(1.0, ref.abs().max().item())
            try:
                one = self.ak(*args, causal=s["causal"], split_k=1)
                self.crow(case, s["dtype"], "fwd", self.maxerr(one, ref), tol, self.maxerr(one, ref) <= tol,
                          "kl(split_k=1 vs fp64)", eerr)
                for k in s["splits"]:
                    sk = self.ak(*args, causal=s["causal"], split_k=k)
                    e1 = self.maxerr(sk, one)
                    self.crow(f"{case}/split_k={k}", s["dtype"], "fwd", e1, tol, e1 <= tol, "kl(split vs one-pass)", eerr)
                    e2 = self.maxerr(sk, ref)
                    self.crow(f"{case}/split_k={k}", s["dtype"], "fwd", e2, tol, e2 <= tol, "kl(split vs fp64)", eerr)
            except Exception as e:
                self.crow(case, s["dtype"], "fwd", "", "", False, "split", detail=f"{type(e).__name__}: {e}")
                self.log(traceback.format_exc(), stdout=False)

    def check_determinism(self):
        torch = self.torch
        t = self.a.tiny
        fwd_shapes = ([dict(B=1, H=2, NQ=40, NK=40, causal=True), dict(B=1, H=2, NQ=1, NK=300, causal=False)] if t else
                      [dict(B=2, H=4, NQ=1000, NK=1000, causal=True), dict(B=1, H=4, NQ=1, NK=32768, causal=False)])
        D = 16 if t else 64
        for s in fwd_shapes:
            case = f"determinism_fwd_nq{s['NQ']}_nk{s['NK']}{'/causal' if s['causal'] else ''}"
            d = self.inputs(s["B"], s["H"], s["NQ"], s["NK"], D, D, "bf16", seed=hash_str(case), g=False)[0]
            try:
                a = self.ak(d["q1"], d["k1"], d["q2"], d["k2"], causal=s["causal"])
                b = self.ak(d["q1"], d["k1"], d["q2"], d["k2"], causal=s["causal"])
                same = bool(torch.equal(a, b))
                self.crow(case, "bf16", "fwd", self.maxerr(a, b), 0.0, same, "kl bitwise")
            except Exception as e:
                self.crow(case, "bf16", "fwd", "", "", False, "kl bitwise", detail=f"{type(e).__name__}: {e}")
        s = (dict(B=1, H=4, HK1=2, HK2=1, N=40) if t else dict(B=2, H=8, HK1=2, HK2=4, N=1000))
        for bm in ("fused", "separate"):
            case = f"determinism_bwd_n{s['N']}_gqa/causal/{bm}"
            d = self.inputs(s["B"], s["H"], s["N"], s["N"], D, D, "bf16", HK1=s["HK1"], HK2=s["HK2"],
                            req=SETTINGS["both"], seed=hash_str(case))[0]
            try:
                runs = []
                for _ in range(2):
                    kl = self.ak(d["q1"], d["k1"], d["q2"], d["k2"], causal=True, bwd_mode=bm, deterministic=True)
                    runs.append(torch.autograd.grad(kl, [d[n] for n in SETTINGS["both"]], d["g"]))
                for i, n in enumerate(SETTINGS["both"]):
                    same = bool(torch.equal(runs[0][i], runs[1][i]))
                    self.crow(case, "bf16", "both", self.maxerr(runs[0][i], runs[1][i]), 0.0, same,
                              f"d{n} bitwise (deterministic=True)")
            except Exception as e:
                self.crow(case, "bf16", "both", "", "", False, "bitwise", detail=f"{type(e).__name__}: {e}")
                self.log(traceback.format_exc(), stdout=False)

    def check_vs_streamkl_ref(self):
        """Our float64 torch reference against the project's NumPy reference, tiny shapes."""
        torch = self.torch
        try:
            import streamkl_ref
            ref_fn = streamkl_ref.attention_kl
        except Exception as e:
            self.log(f"  (streamkl_ref.attention_kl unavailable: {type(e).__name__}; dense-reference cross-check skipped)")
            return
        for causal, (nq, nk) in ((False, (7, 13)), (True, (13, 7)), (True, (6, 19))):
            case = f"dense_ref_vs_streamkl_ref_nq{nq}_nk{nk}{'/causal' if causal else ''}"
            d = self.inputs(1, 4, nq, nk, 8, 12, "fp32", HK1=2, HK2=1, seed=hash_str(case), g=False)[0]
            x = [d[n].detach().cpu().double() for n in ("q1", "k1", "q2", "k2")]
            mine = dense_kl(*x, causal, scale1=0.7, scale2=0.3, cdt=torch.float64)
            try:
                theirs = torch.as_tensor(ref_fn(*(t.numpy() for t in x), causal=causal, scale1=0.7, scale2=0.3),
                                         dtype=torch.float64)
                err = self.maxerr(mine, theirs.reshape(mine.shape))
                self.crow(case, "fp64", "fwd", err, 1e-9, err <= 1e-9, "kl(bench dense ref vs streamkl_ref)")
            except Exception as e:
                self.crow(case, "fp64", "fwd", "", "", False, "kl", detail=f"{type(e).__name__}: {e}")

    def sec_check(self):
        # streamkl_gpu tunes launch configs per shape bucket on first use (each candidate a compile);
        # correctness needs one config per shape, so take the first candidate unless asked not to.
        old = os.environ.get("STREAMKL_AUTOTUNE")
        if not self.a.check_autotune:
            os.environ["STREAMKL_AUTOTUNE"] = "0"
        try:
            self._sec_check()
        finally:
            if old is None:
                os.environ.pop("STREAMKL_AUTOTUNE", None)
            else:
                os.environ["STREAMKL_AUTOTUNE"] = old

    def _sec_check(self):
        if self.ak is None:
            self.crow("import", "-", "-", "", "", False, "streamkl_gpu.attention_kl", detail=self.ak_error)
            return
        cases = self.check_cases()
        for i, c in enumerate(cases):
            tc = time.perf_counter()
            n0 = len(self.checks)
            try:
                self.run_case(c)
            except Exception as e:
                self.crow(c["name"], c["dtype"], "-", "", "", False, "case", detail=f"{type(e).__name__}: {e}")
                self.log(traceback.format_exc(), stdout=False)
            self.free()
            new = self.checks[n0:]
            nf = sum(not r["pass"] for r in new)
            self.log(f"check {i + 1}/{len(cases)} {c['name']}{'/causal' if c['causal'] else ''} {c['dtype']}: "
                     f"{len(new) - nf}/{len(new)} pass ({time.perf_counter() - tc:.1f}s)", stdout=self.a.verbose or nf > 0)
        for f in (self.check_splitk, self.check_determinism, self.check_vs_streamkl_ref):
            tc = time.perf_counter()
            n0 = len(self.checks)
            f()
            new = self.checks[n0:]
            nf = sum(not r["pass"] for r in new)
            self.log(f"check {f.__name__}: {len(new) - nf}/{len(new)} pass ({time.perf_counter() - tc:.1f}s)",
                     stdout=self.a.verbose or nf > 0)
        nf = sum(not r["pass"] for r in self.checks)
        self.log(f"check: {len(self.checks) - nf}/{len(self.checks)} rows pass")

    # ------------------------------------------------------------------------------------------
    # summary
    # ------------------------------------------------------------------------------------------
    def summary(self):
        L = []
        cfg = self.cfg
        K = 1024
        big = 8 * K if not self.a.tiny else cfg["fwd_n"][-1]
        L.append(f"== streamkl summary: {self.env['gpu']} | torch {self.env['torch']} | triton {self.env['triton']} | "
                 f"{self.env['streamkl_version']} | {self.env['date']} ==")
        if self.a.tiny:
            L.append("(tiny shapes: ratios below are NOT comparable with the anchors' targets)")

        def mark(ok):
            return "----" if ok is None else ("PASS" if ok else "MISS")

        def line(text, ok):
            L.append(f"{text:<86} {mark(ok)}")

        if self.checks:
            nf = sum(not r["pass"] for r in self.checks)
            line(f"correctness: {len(self.checks) - nf}/{len(self.checks)} check rows pass (check.csv)", nf == 0)
        # machine-to-machine variation: the anchors were measured on another H200 (756 TFLOP/s bf16)
        if "copy_tb_s" in self.env:
            cp = self.env["copy_tb_s"]
            L.append(f"env: copy {cp:.3g} TB/s = {cp / ANCHOR['copy_tb_s']:.2f}x the anchors' {ANCHOR['copy_tb_s']} "
                     f"(bytes read + written)" + ("" if self.cuda else " (CPU: not comparable)"))
        if "matmul_tflops" in self.env:
            mm, mn = self.env["matmul_tflops"], self.env.get("matmul_n")
            if self.cuda:
                L.append(f"env: bf16 matmul {mn}^3 {mm:.1f} TFLOP/s = {mm / ANCHOR['matmul_tflops']:.2f}x the anchors' "
                         f"{ANCHOR['matmul_tflops']:.0f} (machines differ: compare ratios within one run)")
            else:
                L.append(f"env: fp32 matmul {mn}^3 {mm:.3g} TFLOP/s on CPU (not comparable with the anchors' bf16 "
                         f"{ANCHOR['matmul_tflops']:.0f} TFLOP/s on the H200)")
        else:
            L.append(f"env: bf16 matmul not measured in this run (no env section); the anchors' machine: "
                     f"{ANCHOR['matmul_tflops']:.0f} TFLOP/s")

        def base(kernel, prov, mode, causal, n, akey):
            v = self.get(kernel, prov, mode, causal, n)
            if v is not None:
                return v, ""
            a = ANCHOR.get(akey) if not self.a.tiny else None
            return (a, " [anchor value]") if a is not None else (None, "")

        # measured baselines vs anchors (do our baselines mirror the anchors' definitions?)
        if not self.a.tiny:
            parts = []
            for (k, p, m, akey) in (("fwd", "eager", "fwd", "fwd"), ("fwd", "compile", "fwd", "fwd"), ("fwd", "sdpa", "fwd", "fwd")):
                for c in (False, True):
                    v = self.get(k, p, m, c, 8 * K)
                    a = ANCHOR.get((akey, p, c, 8 * K))
                    if v is not None and a:
                        parts.append(f"{p}{'/c' if c else ''} {v:.3g}/{a:.3g}")
            if parts:
                L.append("baselines fwd 8K measured/anchor ms: " + ", ".join(parts) + " (sdpa = default dispatch)")
        # the two SDPA providers side by side (the anchors' SDPA matches the default dispatch)
        parts = []
        for c in (False, True):
            sd, sf = self.get("fwd", "sdpa", "fwd", c, big), self.get("fwd", "sdpa_flash", "fwd", c, big)
            if sd or sf:
                parts.append(f"{'c' if c else 'nc'} {sd or float('nan'):.3g}/{sf or float('nan'):.3g}"
                             + (f" (flash x{sf / sd:.2f})" if sd and sf else ""))
        if parts:
            L.append(f"SDPA fwd N={fmt_n(big)} default dispatch/flash backend ms: " + ", ".join(parts))
        sdpa_key = "(d = SDPA default dispatch, f = SDPA flash backend: the faster of the two in this run, per N)"
        # forward vs compile / eager
        for c, tgt in ((False, 2.4), (True, 4.2)):
            o = self.get("fwd", "ours", "fwd", c, big)
            cb, note = base("fwd", "compile", "fwd", c, big, ("fwd", "compile", c, big))
            if o and cb:
                line(f"fwd N={big} {'causal    ' if c else 'non-causal'} ours vs compile: x{cb / o:.2f} (target >= {tgt}){note}",
                     cb / o >= tgt)
            eb, note = base("fwd", "eager", "fwd", c, big, ("fwd", "eager", c, big))
            if o and eb:
                line(f"fwd N={big} {'causal    ' if c else 'non-causal'} ours vs eager: x{eb / o:.1f} (paper {'26-43' if c else '13-18'}x){note}", None)
        # ours vs SDPA forward at N >= 8K
        # against the FASTER of sdpa (default dispatch) and sdpa_flash, per N; which one is in the line
        fwd_sdpa_lines = False
        for c in (False, True):
            ratios, notes = [], set()
            for n in cfg["fwd_n"]:
                if n < (8 * K if not self.a.tiny else 0):
                    continue
                o = self.get("fwd", "ours", "fwd", c, n)
                s, which, note = self.sdpa_best("fwd", "fwd", c, n)
                if o and s:
                    ratios.append((n, o / s, which[0]))
                    if note:
                        notes.add(note.lstrip("; "))
            if ratios:
                fwd_sdpa_lines = True
                worst = max(r for _, r, _ in ratios)
                txt = " ".join(f"{fmt_n(n)}:{r:.2f}{w}" for n, r, w in ratios)
                nt = f" [{'; '.join(sorted(notes))}]" if notes else ""
                line(f"fwd ours/SDPA {'causal    ' if c else 'non-causal'} {txt} (must <= 1.6){nt}", worst <= 1.6)
                line(f"      ... same, goal <= 1.1 (worst {worst:.2f})", worst <= 1.1)
        if fwd_sdpa_lines:
            L.append("      " + sdpa_key)
        # decode / split-K
        for nq, nk in cfg["decode"]:
            o = self.get("decode", "ours", "fwd", False, nq, nk)
            f = self.get("decode", "floor", "fwd", False, nq, nk)
            o1 = self.get("decode", "ours_split1", "fwd", False, nq, nk)
            s, which, _ = self.sdpa_best("decode", "fwd", False, nq, nk)
            if o and f:
                tgt = nq == 1 and nk == cfg["decode"][0][1]
                extra = (f"; split-K x{o1 / o:.1f} vs split_k=1" if o1 else "") + (f"; SDPA {s:.3g} ({which})" if s else "")
                line(f"decode NQ={nq} NK={fmt_n(nk)} ours {o:.3g} ms = {o / f:.2f}x floor"
                     + (" (target <= 1.4)" if tgt else "") + extra, (o / f <= 1.4) if tgt else None)
        # fwd+bwd vs eager / compile / SDPA
        bigb = 8 * K if not self.a.tiny else cfg["bwd_n"][-1]
        targets = {("s1", False): 2.6, ("s1", True): 5.3, ("s2", False): 3.8, ("s2", True): 9.1}
        for st in ("s1", "s2", "both"):
            for c in (False, True):
                mode = f"fwd_bwd_{st}"
                o = self.get("fwd_bwd", "ours_auto", mode, c, bigb)
                if not o:
                    continue
                cs = "causal    " if c else "non-causal"
                e, note = base("fwd_bwd", "eager", mode, c, bigb, (st, "eager", c, bigb))
                if e:
                    tgt = targets.get((st, c))
                    line(f"fwd+bwd {st:<4} N={bigb} {cs} ours(auto) vs eager: x{e / o:.2f}" +
                         (f" (target >= {tgt})" if tgt else "") + note, (e / o >= tgt) if tgt else None)
                cb, note = base("fwd_bwd", "compile", mode, c, bigb, (st, "compile", c, bigb))
                if cb:
                    line(f"fwd+bwd {st:<4} N={bigb} {cs} ours(auto) vs compile: x{cb / o:.2f} (>= 1.0 'competitive'){note}",
                         cb / o >= 1.0)
        fb_sdpa_lines = False
        for c in (False, True):
            parts = []
            for n in cfg["bwd_n"]:
                if n < bigb:
                    continue
                s, which, _ = self.sdpa_best("fwd_bwd", "fwd_bwd_sdpa", c, n)
                r = [f"{st}:{self.get('fwd_bwd', 'ours_auto', f'fwd_bwd_{st}', c, n) / s:.2f}"
                     for st in ("s1", "s2", "both") if s and self.get("fwd_bwd", "ours_auto", f"fwd_bwd_{st}", c, n)]
                if r:
                    parts.append(f"{fmt_n(n)}({which[0]}) " + ",".join(r))
            if parts:
                line(f"fwd+bwd ours/SDPA-fwd+bwd {'c ' if c else 'nc'}: " + " | ".join(parts), None)
                fb_sdpa_lines = True
        if fb_sdpa_lines:
            L.append("      " + sdpa_key)
        # fused vs separate
        nk = cfg["smallq_nk"]
        for st in ("s1", "s2", "both"):
            parts, auto_ok = [], True
            for nq in cfg["smallq_nq"]:
                fu = self.get("smallq_bwd", "ours_fused", f"fwd_bwd_{st}", False, nq, nk)
                se = self.get("smallq_bwd", "ours_separate", f"fwd_bwd_{st}", False, nq, nk)
                au = self.get("smallq_bwd", "ours_auto", f"fwd_bwd_{st}", False, nq, nk)
                if fu and se:
                    parts.append(f"{nq}:{se / fu:.2f}")
                    if au:
                        auto_ok = auto_ok and au <= 1.1 * min(fu, se)
            if parts:
                line(f"separate/fused {st:<4} NK={fmt_n(nk)} by NQ: " + " ".join(parts) + " (paper: up to 2.0)", None)
                line(f"      ... auto within 10% of the faster mode at every NQ ({st})", auto_ok)
        # long
        for r in self.rows:
            if r["kernel"] == "long" and r["n_q"] == max(cfg["long_n"]):
                ok = r["status"] == "ok"
                line(f"long N={fmt_n(r['n_q'])} H={r['h']} causal {r['mode']}: {r['status']} p50={r['p50_ms'] or '-'} ms "
                     f"peak_extra={r['peak_extra_gib'] or '-'} GiB (fits)", ok)
        mem = [(r["n_q"], float(r["peak_extra_gib"])) for r in self.rows if r["kernel"] == "long" and r["mode"] == "fwd"
               and r["status"] == "ok" and r["peak_extra_gib"]]
        if mem:
            L.append("ours fwd peak extra GiB vs N: " + " ".join(f"{fmt_n(n)}:{g:.3g}" for n, g in mem)
                     + "  (O(N_Q) outputs only: KL + saved LSEs)")
        if self.section_errors:
            L.append("SECTION ERRORS: " + "; ".join(self.section_errors))
        L = L[:60]
        txt = "\n".join(L)
        with open(os.path.join(self.a.out, "summary.txt"), "w") as f:
            f.write(txt + "\n")
        print(txt, flush=True)
        self.log_f.write(txt + "\n")


# ----------------------------------------------------------------------------------------------
# prewarm: the same calls in parallel worker processes, to fill the on-disk compile caches
# (Triton: ~/.triton/cache; Inductor: /tmp/torchinductor_*) before the serial, timed run.
# ----------------------------------------------------------------------------------------------
def prewarm_jobs(r):
    cfg, secs, H, D = r.cfg, r.a.sections, r.cfg["H"], r.cfg["D"]
    jobs = []  # (estimated seconds, job)
    if "check" in secs and r.ak is not None:
        for i, _ in enumerate(r.check_cases()):
            jobs.append((8, {"t": "case", "i": i}))
        jobs += [(8, {"t": "splitk"}), (6, {"t": "determinism"})]
    if r.ak is not None:
        if "fwd" in secs or "bwd" in secs:
            n = 1024 if not r.a.tiny else cfg["fwd_n"][0]
            for c in (False, True):  # H=16, N=1K: same int specialisations as H=32, N=1K..64K (all % 16 == 0)
                jobs.append((6, {"t": "fwd", "H": max(16, H // 2) if not r.a.tiny else H, "NQ": n, "NK": n,
                                 "causal": c, "split_k": 1}))
        if "bwd" in secs or "smallq" in secs:
            n = 1024 if not r.a.tiny else cfg["bwd_n"][0]
            for st in ("s1", "s2", "both"):
                for m in ("fused", "separate"):
                    for c in ((False, True) if "bwd" in secs else (False,)):
                        jobs.append((20 if m == "separate" else 12,
                                     {"t": "fb", "H": max(16, H // 2) if not r.a.tiny else H, "N": n,
                                      "setting": st, "mode": m, "causal": c}))
        if "decode" in secs:
            for nq, nk in cfg["decode"]:
                for sk in (None, 1):
                    jobs.append((4, {"t": "fwd", "H": H, "NQ": nq, "NK": nk, "causal": False, "split_k": sk}))
        if "smallq" in secs:
            for nq in cfg["smallq_nq"]:
                jobs.append((4, {"t": "fwd", "H": H, "NQ": nq, "NK": cfg["smallq_nk"], "causal": False, "split_k": None}))
        if "long" in secs:
            n = cfg["long_n"][0]
            jobs.append((5, {"t": "fwd", "H": cfg["long_h"], "NQ": n, "NK": n, "causal": True, "split_k": None,
                             "autotune": "0"}))
            jobs.append((8, {"t": "fb", "H": cfg["long_h"], "N": n, "setting": "s1", "mode": "auto", "causal": True,
                             "autotune": "0"}))
    compile_jobs = []  # in priority order: the summary's N = 8K first
    if r.cuda:
        if "bwd" in secs and cfg["compile_bwd_n"]:
            n = cfg["compile_bwd_n"][0]
            for st in cfg["compile_bwd_settings"]:
                for c in (False, True):
                    compile_jobs.append((45, {"t": "compile", "n": n, "setting": st, "causal": c}))
        if "fwd" in secs:
            for n in cfg["compile_fwd_n"]:
                for c in (False, True):
                    compile_jobs.insert(0 if n == 8192 else len(compile_jobs),
                                        (25, {"t": "compile", "n": n, "setting": None, "causal": c}))
    return jobs, compile_jobs


def assign(jobs, compile_jobs, n_workers, n_compile_workers):
    """Longest-first greedy; torch.compile jobs (GPU memory: up to ~20 GB each at 8K) on at most
    n_compile_workers workers."""
    loads = [0.0] * n_workers
    plan = [[] for _ in range(n_workers)]
    for est, j in compile_jobs:  # kept in priority order
        w = min(range(max(1, n_compile_workers)), key=lambda i: loads[i])
        plan[w].append(j)
        loads[w] += est
    for est, j in sorted(jobs, key=lambda x: -x[0]):
        w = min(range(n_workers), key=lambda i: loads[i])
        plan[w].append(j)
        loads[w] += est
    return [p for p in plan if p], max(loads) if loads else 0.0


def run_prewarm(r):
    import tempfile
    jobs, compile_jobs = prewarm_jobs(r)
    if not jobs and not compile_jobs:
        r.log("prewarm: nothing to do")
        return
    nw = r.a.prewarm_workers or max(1, min(12, (os.cpu_count() or 4) - 2))
    plan, est = assign(jobs, compile_jobs, nw, min(4, nw))
    tmp = tempfile.mkdtemp(prefix="streamkl_prewarm_")  # the workers' own CSVs (discarded)
    logs = os.path.join(r.a.out, "prewarm_logs")  # their logs come back with the results
    os.makedirs(logs, exist_ok=True)
    procs = []
    for i, p in enumerate(plan):
        jf = os.path.join(tmp, f"jobs{i}.json")
        with open(jf, "w") as f:
            json.dump(p, f)
        cmd = [sys.executable, os.path.abspath(__file__), "--_worker", jf, "--device", r.a.device,
               "--out", os.path.join(tmp, f"w{i}"), "--seed", str(r.a.seed)]
        if r.a.tiny:
            cmd.append("--tiny")
        if r.a.quick:
            cmd.append("--quick")
        if r.a.full_check:
            cmd.append("--full-check")
        logf = open(os.path.join(logs, f"w{i}.log"), "w")
        procs.append((subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT), logf, i))
    r.log(f"prewarm: {len(jobs) + len(compile_jobs)} jobs on {len(procs)} worker processes "
          f"(longest worker ~{est:.0f}s of work by the static estimates; logs in {logs})")
    deadline = time.perf_counter() + max(10.0, r.budget.remaining())
    while time.perf_counter() < deadline and any(p.poll() is None for p, _, _ in procs):
        time.sleep(0.5)
    killed = 0
    for p, logf, i in procs:
        if p.poll() is None:  # past the budget: stop this worker (only processes started here)
            p.kill()
            p.wait()
            killed += 1
        logf.close()
    done = fails = 0
    for _, _, i in procs:
        try:
            with open(os.path.join(logs, f"w{i}.log")) as f:
                for line in f:
                    if line.startswith("JOB ok"):
                        done += 1
                    elif line.startswith("JOB fail"):
                        fails += 1
                        r.log(f"  prewarm worker {i}: {line.strip()[:200]}", stdout=False)
        except OSError:
            pass
    r.log(f"prewarm: {done} jobs done, {fails} failed, {killed} workers stopped at the budget")
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)


def worker_main(r, jobfile):
    torch = r.torch
    with open(jobfile) as f:
        jobs = json.load(f)
    cases = r.check_cases() if any(j["t"] == "case" for j in jobs) else []
    for j in jobs:
        t = time.perf_counter()
        old = os.environ.get("STREAMKL_AUTOTUNE")
        try:
            if j["t"] in ("case", "splitk", "determinism"):
                os.environ["STREAMKL_AUTOTUNE"] = "0"
                if j["t"] == "case":
                    r.run_case(cases[j["i"]])
                elif j["t"] == "splitk":
                    r.check_splitk()
                else:
                    r.check_determinism()
            elif j["t"] == "fwd":
                if "autotune" in j:
                    os.environ["STREAMKL_AUTOTUNE"] = j["autotune"]
                d = r.inputs(1, j["H"], j["NQ"], j["NK"], r.cfg["D"], r.cfg["D"], "bf16", g=False)[0]
                r.f_ours_fwd(j["causal"], j["split_k"])(d)
            elif j["t"] == "fb":
                if "autotune" in j:
                    os.environ["STREAMKL_AUTOTUNE"] = j["autotune"]
                d = r.inputs(1, j["H"], j["N"], j["N"], r.cfg["D"], r.cfg["D"], "bf16", req=SETTINGS[j["setting"]])[0]
                r.f_ours_fb(j["causal"], j["setting"], j["mode"])(d)
            elif j["t"] == "compile":
                n, st, c = j["n"], j["setting"], j["causal"]
                d = r.inputs(1, r.cfg["H"], n, n, r.cfg["D"], r.cfg["D"], "bf16", req=SETTINGS.get(st, ()))[0]
                comp = r.compiled_kl()
                (r.f_eager_fwd(c, comp) if st is None else r.f_eager_fb(c, st, comp))(d)
            r.sync()
            print(f"JOB ok {json.dumps(j)} {time.perf_counter() - t:.1f}s", flush=True)
        except Exception as e:
            print(f"JOB fail {json.dumps(j)} {type(e).__name__}: {str(e)[:200]}", flush=True)
        finally:
            if old is None:
                os.environ.pop("STREAMKL_AUTOTUNE", None)
            else:
                os.environ["STREAMKL_AUTOTUNE"] = old
            r.free()
    return 0


def quantiles(samples):
    s = sorted(samples)
    if len(s) == 1:
        return [s[0]] * 3

    def q(p):
        x = p * (len(s) - 1)
        lo = int(math.floor(x))
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (x - lo)
    return [q(0.2), q(0.5), q(0.8)]


def prio(ns, key=8192):
    """The summary's N first (compiles and autotuning land there), then larger, then smaller."""
    return sorted(n for n in ns if n >= key) + sorted((n for n in ns if n < key), reverse=True)


def fmt_n(n):
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def hash_str(s):
    h = 0
    for ch in s:
        h = (h * 131 + ord(ch)) % 1000003
    return h


SECTION_DOC = {
    "prewarm": "compile everything in parallel worker processes (fills the on-disk caches)",
    "env": "copy bandwidth + 8192^3 bf16 matmul",
    "check": "correctness vs float64 (fp32/fp16/bf16, settings, modes, GQA, D1!=D2, NQ!=NK, split-K, determinism)",
    "fwd": "forward N=1K..64K: ours, SDPA (default dispatch, flash backend), eager, chunked, compile",
    "bwd": "fwd+bwd N=1K..32K, s1/s2/both: ours fused/separate/auto, SDPA (default, flash), eager, compile",
    "decode": "N_Q in {1,16}, N_K 32K/128K forward + bandwidth floor",
    "smallq": "fused vs separate backward, N_Q 16..512, N_K 32K",
    "long": "512K tokens (H=8, causal) fwd and s1 fwd+bwd; peak extra memory vs N",
}


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before torch/triton/streamkl_gpu are imported
    if ROOT not in sys.path:
        sys.path.append(ROOT)  # appended: a PYTHONPATH entry (or an installed package) still wins
    cfg = make_config(args)
    if args._worker:
        args.sections = []
        r = Runner(args, cfg)
        return worker_main(r, args._worker)
    prewarm = args.prewarm == "on" or (args.prewarm == "auto" and args.device == "cuda" and not args.tiny)
    if prewarm and any(s in args.sections for s in ("check", "fwd", "bwd", "decode", "smallq", "long")):
        args.sections = ["prewarm"] + args.sections
    r = Runner(args, cfg)
    torch = r.torch
    torch.manual_seed(args.seed)
    est = {s: cfg["budgets"][s] for s in args.sections}
    r.log(f"streamkl bench: sections {','.join(args.sections)}; device {args.device}; "
          f"{'tiny' if args.tiny else 'quick' if args.quick else 'full'}; out {os.path.abspath(args.out)}; "
          f"budget {cfg['total']:.0f}s; section budgets (s) " + " ".join(f"{k}={v}" for k, v in est.items()))
    for s in args.sections:
        ts = time.perf_counter()
        own = r.budget.start(s)
        r.log(f"== {s}: {SECTION_DOC[s]} (budget ~{own:.0f}s, deadline in {r.budget.remaining():.0f}s)")
        try:
            if s == "prewarm":
                run_prewarm(r)
            else:
                getattr(r, f"sec_{s}")()
        except Exception as e:
            r.section_errors.append(f"{s}: {type(e).__name__}: {str(e)[:120]}")
            r.log(f"SECTION {s} FAILED: {type(e).__name__}: {e}")
            r.log(traceback.format_exc(), stdout=False)
            r.free()
        r.log(f"== {s} done in {time.perf_counter() - ts:.1f}s (elapsed {time.perf_counter() - r.t0:.1f}s)")
    r.summary()
    r.bench_f.close()
    if r.check_f:
        r.check_f.close()
    nfail = sum(not c["pass"] for c in r.checks)
    rc = 1 if nfail else (3 if r.section_errors else 0)
    r.log(f"done in {time.perf_counter() - r.t0:.1f}s; {nfail} failed checks; exit {rc}")
    r.log_f.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
