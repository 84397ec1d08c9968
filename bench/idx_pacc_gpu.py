#!/usr/bin/env python3
"""The accumulating ("pacc") design of the indexer loss, DSA-like 8K causal fwd+bwd (issue 10).

    python bench/idx_pacc_gpu.py OUT --quick        # fits a 90 s slot on one H200, compiles included
    TRITON_INTERPRET=1 python bench/idx_pacc_gpu.py /tmp/x --tiny   # CPU smoke of the script

Reduction "mean", ``lse`` given (the training case), bf16, causal, B = 1, DSA-like config
(H=128, D=576, H_K=1, sigma=192^-0.5; H_I=64, D_I=128, H_KI=1). What it does, in order:
  1. warm-up: every variant's kernels compiled by parallel child processes (Triton's disk cache
     is shared); each child also checks its variant on a small causal problem (N=192) against
     float64 (streamkl_ref.indexer_kl / indexer_kl_grad: loss, dq_idx, dk_idx, dweights;
     FlashAttention's rule: error <= 3 x the materialised bf16 form's error + 1e-2) and prints
     the result; a child past its time is killed and its variant skipped.
  2. times at N=8192, the baseline first: the current default (the first candidate of each
     kernel kind, STREAMKL_AUTOTUNE=0: accumulating forward (128,128,64,64,8,3), student backward
     (128,128,64,64,8,2)) fwd+bwd, then the accumulating forward's variants alone (its parts:
     "teacher", "logits", "nodk" are timing-only variants with incomplete gradients), then the
     student backward's variants alone, then fwd+bwd of the fastest checked forward with the
     fastest checked backward (per design), last the GQA-like config's fwd+bwd (H=32, D=128,
     H_K=8; H_I=16, D_I=64) of each design's default.
  3. the short table last: ms, ratio to the forward matmul floor (bf16 rate of an 8192^3 matmul
     measured in this run), check status.
A watchdog prints the table of what ran and exits before --deadline (default 84 s under --quick).
Outputs in OUT: idx_pacc.csv (long format: measure, provider, shape, value, unit, note),
idx_pacc.log. The torch.compile baseline is the lead's (306.6 ms in run s5r3; target 8x = 38.3 ms).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("STREAMKL_TUNING_CACHE", "0")  # forced configs only: no stale disk choices
os.environ["STREAMKL_AUTOTUNE"] = "0"  # the first candidate of each kind: the default an untuned run takes
os.environ.setdefault("STREAMKL_INDEXER_PACC", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import streamkl_ref  # noqa: E402
import streamkl_gpu  # noqa: E402
from streamkl_gpu import _indexer  # noqa: E402

COLUMNS = ["measure", "provider", "shape", "value", "unit", "note"]
DSA = dict(H=128, HK=1, D=576, HI=64, HKI=1, DI=128, scale=192 ** -0.5)
GQA = dict(H=32, HK=8, D=128, HI=16, HKI=1, DI=64, scale=None)
TINY = dict(H=8, HK=1, D=32, HI=4, HKI=1, DI=16, scale=None)
LOG2E = 1.4426950408889634
_ORIG = _indexer._candidates

BASE_FWD = (128, 128, 64, 64, 8, 3)
BASE_BWD = (128, 128, 64, 64, 8, 2)
STORE_FWD = (128, 128, 128, 64, 4, 3)  # the plain forward's measured best tile (17.17 ms, s5r4)
# The forward's variants, most informative first: (label, design, config, checked). Designs:
# "pacc" accumulates the target's share (_indexer_pacc's accumulating kernel, kind "pacc"),
# "pstore" stores p (kind "pstore", the forward's tile). A pacc config's 9th field names a kernel
# variant: "teacher" / "logits" / "nodk" time the accumulating forward's parts (gradients
# incomplete: not checked).
FWD_VARIANTS = [
    ("base", "pacc", BASE_FWD, True),
    ("store", "pstore", STORE_FWD, True),  # the store design: a measured experiment (quadratic memory)
    ("part:teacher", "pacc", BASE_FWD + (None, 1, "teacher"), False),
    ("part:logits", "pacc", BASE_FWD + (None, 1, "logits"), False),
    ("part:nodk", "pacc", BASE_FWD + (None, 1, "nodk"), False),
    ("w4", "pacc", (128, 128, 64, 64, 4, 3), True),
    ("kt+tm+h2 w4", "pacc", (128, 128, 64, 64, 4, 3, None, 1, "kt+tm+h2"), True),  # offline: 384 B of spills
    ("kt w8", "pacc", BASE_FWD + (None, 1, "kt"), True),  # keys as the indexer's rows: offline 144 B of spills
    ("tm w4", "pacc", (128, 128, 64, 64, 4, 3, None, 1, "tm"), True),  # token-major q: offline 504 B (568)
    ("kt+tm w8", "pacc", BASE_FWD + (None, 1, "kt+tm"), True),  # offline: 152 B
]
# also: ("bn32 w8", "pacc", (128, 128, 32, 64, 8, 3), True): offline 48 B of spills;
# ("t2 hb64 w8", "pacc", (128, 128, 64, 64, 8, 3, 64), True): two tokens x 64 heads, 472 B
# also: ("store p fp16", "pstore", STORE_FWD + (None, 1, "p16"), True): p stored in float16
# The student backward's variants (dq and dk kernels forced to the same config), after the
# forward of their design's first variant: (label, design, config). A 9th field "dqk": the
# one-kernel backward (STREAMKL_INDEXER_BWD=dqk); "again": the logits formed again by a second
# product (BWD_LOGITS_FROM_A off: the session-5 backward)
BWD_VARIANTS = [
    ("base", "pacc", BASE_BWD),
    ("w4 s2", "pacc", (64, 64, 64, 64, 4, 2)),
    ("dqk", "pacc", BASE_BWD + (None, 1, "dqk")),
    ("logits again", "pacc", BASE_BWD + (None, 1, "again")),
    ("dqk w4", "pacc", (64, 64, 64, 64, 4, 2, None, 1, "dqk")),
    ("store", "pstore", BASE_BWD),
]
DESIGN_ENV = {"pacc": "0", "pstore": "1"}  # STREAMKL_INDEXER_PSTORE


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tiny", action="store_true", help="CPU smoke (TRITON_INTERPRET=1)")
    p.add_argument("--n", type=int, default=None, help="tokens (default 8192; --tiny 32)")
    p.add_argument("--deadline", type=float, default=None, help="seconds (default 84 --quick, 400)")
    p.add_argument("--warm-s", type=float, default=None, help="warm-up seconds at most (default 50 --quick)")
    p.add_argument("--parallel", type=int, default=None)
    p.add_argument("--no-warm", action="store_true")
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.deadline is None:
        a.deadline = 84.0 if a.quick else 400.0
    if a.warm_s is None:
        a.warm_s = 50.0 if a.quick else 150.0
    if a.n is None:
        a.n = 32 if a.tiny else 8192
    return a


class Force:
    """Force launch configs per kernel kind ("pacc", "pstore", "bwd"; others: the first candidate)
    and the design (STREAMKL_INDEXER_PSTORE)."""

    def __init__(self, design="pacc", **want):
        self.design, self.want = design, want

    def __enter__(self):
        def cands(kind, ieee, dims=None, n_sm=132, **kw):
            full = _ORIG(kind, ieee, dims, n_sm, **kw)
            want = self.want.get(kind)
            return [want] if want is not None and not (ieee or _runtime_interp()) else full[:1]
        _indexer._candidates = cands
        bwd = self.want.get("bwd")
        pst = self.want.get("pstore")  # "p16" (a bench-only 9th field): p stored in float16
        _indexer.PSTORE_DTYPE = torch.float16 if pst is not None and len(pst) > 8 and pst[8] == "p16" else torch.float32
        # "again" (a bench-only 9th field): the backward forms the logits again (as session 5)
        _indexer.BWD_LOGITS_FROM_A = not (bwd is not None and len(bwd) > 8 and bwd[8] == "again")
        self.old_env = {v: os.environ.get(v) for v in ("STREAMKL_INDEXER_PSTORE", "STREAMKL_INDEXER_BWD")}
        os.environ["STREAMKL_INDEXER_PSTORE"] = DESIGN_ENV[self.design]
        # "dqk" (a bench-only 9th field): the one-kernel backward
        os.environ["STREAMKL_INDEXER_BWD"] = "dqk" if bwd is not None and len(bwd) > 8 and bwd[8] == "dqk" else "separate"
        return self

    def __exit__(self, *exc):
        _indexer._candidates = _ORIG
        _indexer.BWD_LOGITS_FROM_A = True
        _indexer.PSTORE_DTYPE = torch.float32
        for var, val in self.old_env.items():
            if val is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = val


def forced(design, fwd_cfg=None, bwd_cfg=None):
    kind = "pstore" if design == "pstore" else "pacc"
    return Force(design, **{kind: fwd_cfg, "bwd": bwd_cfg})


def _runtime_interp():
    from streamkl_gpu import _runtime
    return _runtime.interpreting()


def inputs(cfg, N, device, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, std=1.0):
        return (std * torch.randn(shape, generator=gen, device=device)).to(dtype)
    return [rnd(1, cfg["H"], N, cfg["D"]), rnd(1, cfg["HK"], N, cfg["D"]), rnd(1, cfg["HI"], N, cfg["DI"]),
            rnd(1, cfg["HKI"], N, cfg["DI"]), rnd(1, cfg["HI"], N, std=(cfg["HI"] * cfg["DI"]) ** -0.5)]


def scale_of(cfg):
    return cfg["scale"] if cfg["scale"] is not None else cfg["D"] ** -0.5


def teacher_lse(q, k, scale):
    """Natural-log causal teacher LSEs [B, H, N] by PyTorch in head chunks (not our kernels)."""
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


def rel_err(x, ref):
    x = torch.as_tensor(x).detach().double().cpu()
    ref = torch.as_tensor(np.asarray(ref), dtype=torch.float64)
    if not torch.isfinite(x).all():
        return math.inf
    denom = max(ref.norm().item(), 1e-12 * math.sqrt(max(ref.numel(), 1)))
    return ((x - ref).norm() / denom).item()


def fwd_part(design, xs, lse, kw):
    """The forward alone: pacc (total, lse_idx, dq_p, dk_p, dw_p) / pstore (total, lse_idx, p)."""
    f = _indexer._forward_pstore if design == "pstore" else _indexer._forward_pacc
    return f(*xs, lse, kw["causal"], kw["scale"], True)


def bwd_part(design, xs, kw, saved):
    """The backward alone, from its forward's outputs ``saved`` (g = 1 / N for every row)."""
    g = torch.ones((), device=xs[0].device) / xs[0].shape[2]
    rows = g.expand(xs[0].shape[0], xs[0].shape[2]).contiguous()
    if design == "pstore":
        _, lse_idx, p = saved
        return _indexer._backward(rows, *xs, None, lse_idx, kw["causal"], kw["scale"], True, p_saved=p)
    _, lse_idx, dq_p, dk_p, dw_p = saved
    return _indexer._backward(rows, *xs, lse_idx, lse_idx, kw["causal"], kw["scale"], True,
                              target_part=(g, dq_p, dk_p, dw_p))


def fwd_bwd(train, lse, kw):
    loss = streamkl_gpu.indexer_kl(*train, lse=lse, reduction="mean", **kw)
    return torch.autograd.grad(loss, train[2:])


# ----------------------------------------------------------------------------------------------
# warm-up children: compile and check one variant on the small problem
# ----------------------------------------------------------------------------------------------

def check_variant(cfg, device, design, fwd_cfg, bwd_cfg, tiny, N=192):
    """{tensor: (err, tol)} of fwd+bwd with these forced configs vs float64 at N (tiny: 24)."""
    N = 24 if tiny else N
    xs = inputs(cfg, N, device, seed=2, dtype=torch.float16 if tiny else torch.bfloat16)
    kw = dict(causal=True, scale=scale_of(cfg))
    x64 = [x.double().cpu().numpy() for x in xs]
    kl_ref, _, lse_ref = streamkl_ref.indexer_kl(*x64, return_lse=True, **kw)
    ref = dict(loss=float(kl_ref.mean()), **streamkl_ref.indexer_kl_grad(*x64, np.full(kl_ref.shape, 1.0 / N), **kw))
    flags = (False, False, True, True, True)
    sp_in = [x.detach().clone().requires_grad_(r) for x, r in zip(xs, flags)]
    sp_loss = _indexer.indexer_kl_naive(*sp_in, compute_dtype=xs[0].dtype, **kw).mean()
    sp = dict(loss=sp_loss.detach(), **dict(zip(("dq_idx", "dk_idx", "dweights"), torch.autograd.grad(sp_loss, sp_in[2:]))))
    lse = torch.from_numpy(lse_ref).float().to(device)
    ins = [x.detach().clone().requires_grad_(r) for x, r in zip(xs, flags)]
    with forced(design, fwd_cfg, bwd_cfg):
        loss = streamkl_gpu.indexer_kl(*ins, lse=lse, reduction="mean", **kw)
        grads = torch.autograd.grad(loss, ins[2:])
    ours = dict(loss=loss.detach(), **dict(zip(("dq_idx", "dk_idx", "dweights"), grads)))
    out = {}
    for name in ("loss", "dq_idx", "dk_idx", "dweights"):
        base = rel_err(sp[name], ref[name])
        out[name] = (rel_err(ours[name], ref[name]), 3.0 * (base if math.isfinite(base) else 0.0) + 1e-2)
    return out


def first_fwd(design):
    return next(c for _, d, c, _ in FWD_VARIANTS if d == design)


def gqa_forced(design, tiny):
    """(fwd config, bwd config) of a design's default at the GQA-like config, 8K (the forward's
    first candidate carries key splits that depend on N: the 8K one is forced at the check size)."""
    if tiny:
        return None, None
    from streamkl_ref._checks import check_indexer_inputs
    xs = [torch.empty(s, device="meta") for s in ((1, 32, 8192, 128), (1, 8, 8192, 128), (1, 16, 8192, 64),
                                                   (1, 1, 8192, 64), (1, 16, 8192))]
    dims = check_indexer_inputs(*xs)
    kind = "pstore" if design == "pstore" else "pacc"
    return _ORIG(kind, False, dims, 132)[0], _ORIG("bwd", False, dims, 132, teacher=False)[0]


def run_job(job, tiny):
    kind, idx = job.split(":")
    cfg = TINY if tiny else DSA
    device = "cpu" if tiny else "cuda"
    if kind == "gqa":  # the GQA-like config's fwd+bwd check (N=320) of a design's default
        res = check_variant(TINY if tiny else GQA, device, idx, *gqa_forced(idx, tiny), tiny, N=320)
        print("RESULT " + json.dumps(res), flush=True)
        return
    if kind == "fwd":
        label, design, fwd_cfg, checked = FWD_VARIANTS[int(idx)]
        bwd_cfg = BASE_BWD
    else:
        label, design, bwd_cfg = BWD_VARIANTS[int(idx)]
        fwd_cfg, checked = first_fwd(design), True
    if checked:
        res = check_variant(cfg, device, design, fwd_cfg, bwd_cfg, tiny)
    else:  # compile only (timing-only variant): the forward on the small problem
        xs = inputs(cfg, 24 if tiny else 192, device, seed=2)
        kw = dict(causal=True, scale=scale_of(cfg))
        lse = teacher_lse(xs[0], xs[1], kw["scale"])
        with forced(design, fwd_cfg):
            fwd_part(design, xs, lse, kw)
        res = {}
    if device == "cuda":
        torch.cuda.synchronize()
    print("RESULT " + json.dumps(res), flush=True)


# ----------------------------------------------------------------------------------------------
# the timing process
# ----------------------------------------------------------------------------------------------

class Bench:
    def __init__(self, args):
        self.args = args
        os.makedirs(args.out_dir, exist_ok=True)
        self.logf = open(os.path.join(args.out_dir, "idx_pacc.log"), "a")
        self.rows, self.t0 = [], time.time()
        self.device = "cpu" if args.tiny else "cuda"
        self.checks = {}  # job -> "ok" / "FAIL ..." / "timing only" / "not run"
        self.times = {}  # (measure, label) -> ms or a status string
        self.floor = None
        self.job_of = {}  # (measure, label) -> the warm-up job that checked it
        self.floor_of = {}  # (measure, label) -> the floor (ms) of its config

    def log(self, msg):
        line = f"[{time.time() - self.t0:6.1f}s] {msg}"
        print(line, flush=True)
        self.logf.write(line + "\n")
        self.logf.flush()

    def record(self, measure, provider, shape, value, unit, note=""):
        self.rows.append(dict(measure=measure, provider=provider, shape=shape, value=value, unit=unit, note=note))
        with open(os.path.join(self.args.out_dir, "idx_pacc.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(self.rows)

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def left(self):
        return self.args.deadline - (time.time() - self.t0)

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
            return 1e12
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        ms = self.time_ms(lambda: a @ b, reps=10)
        rate = 2 * n ** 3 / (ms * 1e-3)
        self.log(f"bf16 matmul 8192^3: {ms:.3f} ms = {rate / 1e12:.0f} TFLOP/s")
        self.record("matmul_rate", "torch", "8192^3", f"{rate / 1e12:.1f}", "TFLOP/s")
        return rate

    def warm_up(self, jobs):
        par = self.args.parallel or max(1, min(16, os.cpu_count() or 1))
        t0 = time.time()
        pending, running = list(jobs), []
        while pending or running:
            while pending and len(running) < par:
                job = pending.pop(0)
                cmd = [sys.executable, os.path.abspath(__file__), self.args.out_dir, "--job", job] + (
                    ["--tiny"] if self.args.tiny else [])
                running.append((job, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
            still = []
            for job, proc in running:
                if proc.poll() is None:
                    if time.time() - t0 > self.args.warm_s:
                        proc.kill()
                        proc.wait()
                        self.checks[job] = f"killed (warm-up over {self.args.warm_s:.0f} s)"
                        self.log(f"warm-up {job} {self.job_label(job)}: {self.checks[job]}")
                    else:
                        still.append((job, proc))
                    continue
                out = proc.stdout.read()
                res = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode != 0 or not res:
                    self.checks[job] = f"FAIL exit {proc.returncode}"
                    self.log(f"warm-up {job} {self.job_label(job)}: exit {proc.returncode}\n{out[-1500:]}")
                    continue
                errs = json.loads(res[-1][7:])
                bad = [f"{k} {e:.2e} > {t:.2e}" for k, (e, t) in errs.items() if not e <= t]
                for k, (e, t) in errs.items():
                    self.record("check_rel_err", f"{self.job_label(job)} {k}",
                                f"{'gqa N=320' if job.startswith('gqa') else 'dsa N=192'} causal lse mean",
                                f"{e:.3e}", "rel", f"tol {t:.3e} {'ok' if e <= t else 'FAIL'}")
                self.checks[job] = ("FAIL " + "; ".join(bad)) if bad else ("ok" if errs else "timing only")
                self.log(f"warm-up {job} {self.job_label(job)}: {time.time() - t0:.0f} s, check {self.checks[job]}")
            running = still
            time.sleep(0.1)
        self.log(f"warm-up: {len(jobs)} jobs, {par} at a time, {time.time() - t0:.0f} s")

    @staticmethod
    def job_label(job):
        kind, idx = job.split(":")
        if kind == "gqa":
            return f"gqa {idx} default"
        if kind == "fwd":
            label, design, cfg, _ = FWD_VARIANTS[int(idx)]
            return f"fwd {label} {design}{list(cfg)}"
        label, design, cfg = BWD_VARIANTS[int(idx)]
        return f"bwd {label} {design}{list(cfg)}"

    def usable(self, job):
        return self.checks.get(job, "not run") in ("ok", "timing only") or self.args.no_warm

    def timed(self, measure, label, fn, reps, shape, job=None):
        self.job_of[(measure, label)] = job
        if self.left() < 4:
            self.times[(measure, label)] = "deadline"
            return None
        try:
            ms = self.time_ms(fn, reps)
        except Exception as exc:  # noqa: BLE001 - printed, the run goes on
            self.times[(measure, label)] = "error"
            self.log(f"{measure} {label} raised {type(exc).__name__}: {str(exc)[:400]}")
            self.logf.write(traceback.format_exc())
            return None
        self.times[(measure, label)] = ms
        self.floor_of[(measure, label)] = self.floor
        self.record(measure, label, shape, f"{ms:.4f}", "ms", f"ratio {ms / self.floor:.2f} to the floor")
        self.log(f"{shape} {measure} {label}: {ms:.3f} ms = {ms / self.floor:.2f}x floor")
        return ms

    def profile(self, label, fn, shape):
        """Each kernel's device time in one call of ``fn`` (after a warm call), logged and recorded."""
        from torch.profiler import ProfilerActivity, profile
        fn()
        self.sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            self.sync()
        rows = []
        for ev in prof.key_averages():
            us = getattr(ev, "device_time_total", None)
            if us is None:
                us = getattr(ev, "cuda_time_total", 0.0)
            if us and ev.count:
                rows.append((us / 1e3, ev.count, ev.key))
        rows.sort(reverse=True)
        for ms, count, key in rows[:8]:
            self.log(f"profile {label}: {ms:8.3f} ms  x{count}  {key[:90]}")
            self.record("kernel_ms", f"{label} {key[:120]}", shape, f"{ms:.4f}", "ms", f"{count} launches")

    def table(self):
        lines = ["", f"{'measure':10s} {'variant':48s} {'ms':>9s} {'x floor':>8s}  check"]
        for (measure, label), v in self.times.items():
            ms = f"{v:9.3f}" if isinstance(v, float) else f"{v:>9s}"
            floor = self.floor_of.get((measure, label))
            ratio = f"{v / floor:8.2f}" if isinstance(v, float) and floor else f"{'':8s}"
            lines.append(f"{measure:10s} {label:48s} {ms} {ratio}  {self.check_of(measure, label)}")
        text = "\n".join(lines)
        print(text, flush=True)
        self.logf.write(text + "\n")
        self.logf.flush()

    def check_of(self, measure, label):
        job = self.job_of.get((measure, label))
        return self.checks.get(job, "not checked") if job else ""


def main(argv=None):
    args = parse_args(argv)
    if args.job:
        run_job(args.job, args.tiny)
        return 0
    bench = Bench(args)

    def watchdog():
        bench.log(f"past the {args.deadline:.0f} s deadline: table of what ran, then exit")
        bench.table()
        sys.stdout.flush()
        os._exit(3)
    timer = threading.Timer(args.deadline, watchdog)
    timer.daemon = True
    timer.start()
    import triton
    bench.log(f"idx_pacc: {torch.cuda.get_device_name() if bench.device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
              f"triton {triton.__version__}, quick={args.quick}, N={args.n}")
    # the checked jobs: every forward variant (each with the base backward) and the backward
    # variants not already covered by a forward job
    jobs = [f"fwd:{i}" for i in range(len(FWD_VARIANTS))] + [
        f"bwd:{i}" for i, (_, d, c) in enumerate(BWD_VARIANTS) if c != BASE_BWD]
    jobs = jobs[:2] + ["gqa:pacc", "gqa:pstore"] + jobs[2:]  # both designs' defaults first (a slow compile is killed)
    if not args.no_warm:
        try:
            bench.warm_up(jobs)
        except Exception as exc:  # noqa: BLE001 - then the timing process compiles
            bench.log(f"warm-up raised {type(exc).__name__}: {exc}")
            args.no_warm = True
    cfg = TINY if args.tiny else DSA
    N = args.n
    shape = f"dsa N={N} causal lse mean"
    rate = bench.matmul_rate()
    flops = 2 * (cfg["H"] * cfg["D"] + cfg["HI"] * cfg["DI"]) * N * N * 0.5
    bench.floor = flops / rate * 1e3
    bench.log(f"forward matmul floor {bench.floor:.3f} ms")
    bench.record("floor_ms", "bf16 rate", shape, f"{bench.floor:.4f}", "ms")
    kw = dict(causal=True, scale=scale_of(cfg))
    xs = inputs(cfg, N, bench.device)
    lse = teacher_lse(xs[0], xs[1], kw["scale"])
    train = [x.detach().clone().requires_grad_(r) for x, r in zip(xs, (False, False, True, True, True))]
    reps = 3 if args.quick else 10

    def fwd_job(design, fc):
        return next(f"fwd:{i}" for i, (_, d, c, _) in enumerate(FWD_VARIANTS) if (d, c) == (design, fc))

    def bwd_job(design, bc):
        if bc == BASE_BWD:
            return fwd_job(design, first_fwd(design))
        return next(f"bwd:{i}" for i, (_, d, c) in enumerate(BWD_VARIANTS) if (d, c) == (design, bc))

    # 1. fwd+bwd: the current default (the accumulating design, first candidates), then the store design
    for design in ("pacc", "pstore"):
        job = fwd_job(design, first_fwd(design))
        label = f"{'default ' if design == 'pacc' else ''}{design} fwd{list(first_fwd(design))} bwd{list(BASE_BWD)}"
        if bench.usable(job):
            with forced(design, first_fwd(design), BASE_BWD):
                bench.timed("fwd+bwd", label, lambda: fwd_bwd(train, lse, kw), reps, shape, job)
        else:
            bench.times[("fwd+bwd", label)] = "skipped"
            bench.job_of[("fwd+bwd", label)] = job
    fwd_ms, bwd_ms, saved = {}, {}, {}
    # 2. the forwards alone (each design's first variant first)
    for i, (label, design, fc, checked) in enumerate(FWD_VARIANTS):
        name = f"{label} {design}{list(fc)}"
        if not bench.usable(f"fwd:{i}"):
            bench.times[("fwd", name)] = "skipped"
            bench.job_of[("fwd", name)] = f"fwd:{i}"
            continue
        with forced(design, fc):
            ms = bench.timed("fwd", name, lambda: fwd_part(design, xs, lse, kw), reps, shape, f"fwd:{i}")
            if fc == first_fwd(design) and ms is not None:
                saved[design] = fwd_part(design, xs, lse, kw)
        if ms is not None and checked:
            fwd_ms[(design, fc)] = ms
    # 3. the backwards alone, from their design's first forward
    for i, (label, design, bc) in enumerate(BWD_VARIANTS):
        name = f"{label} {design}{list(bc)}"
        job = bwd_job(design, bc)
        if design not in saved or not bench.usable(job):
            bench.times[("bwd", name)] = "skipped"
            bench.job_of[("bwd", name)] = job
            continue
        with forced(design, bwd_cfg=bc):
            ms = bench.timed("bwd", name, lambda: bwd_part(design, xs, kw, saved[design]), reps, shape, job)
        if ms is not None:
            bwd_ms[(design, bc)] = ms
    saved.clear()
    # 4. fwd+bwd of each design's fastest checked forward with its fastest checked backward
    for design in ("pacc", "pstore"):
        fs = {c: v for (d, c), v in fwd_ms.items() if d == design}
        bs = {c: v for (d, c), v in bwd_ms.items() if d == design}
        if not fs or not bs:
            continue
        bf, bb = min(fs, key=fs.get), min(bs, key=bs.get)
        if (bf, bb) != (first_fwd(design), BASE_BWD):
            with forced(design, bf, bb):
                bench.timed("fwd+bwd", f"best {design} fwd{list(bf)} bwd{list(bb)}", lambda: fwd_bwd(train, lse, kw),
                            reps, shape, fwd_job(design, bf))
    # 4b. where the time goes: kernel times (torch.profiler) of each design's default fwd+bwd
    if bench.device == "cuda":
        for design in ("pacc", "pstore"):
            if bench.left() < 15 or not bench.usable(fwd_job(design, first_fwd(design))):
                continue
            try:
                with forced(design, first_fwd(design), BASE_BWD):
                    bench.profile(f"{design} default", lambda: fwd_bwd(train, lse, kw), shape)
            except Exception as exc:  # noqa: BLE001 - printed, the run goes on
                bench.log(f"profile {design} raised {type(exc).__name__}: {str(exc)[:300]}")
    # 5. the GQA-like config's fwd+bwd, each design's default (pstore's "auto" would apply there too)
    del train, xs, lse
    if bench.device == "cuda":
        torch.cuda.empty_cache()
    gcfg = TINY if args.tiny else GQA
    gkw = dict(causal=True, scale=scale_of(gcfg))
    gxs = inputs(gcfg, N, bench.device)
    glse = teacher_lse(gxs[0], gxs[1], gkw["scale"])
    gtrain = [x.detach().clone().requires_grad_(r) for x, r in zip(gxs, (False, False, True, True, True))]
    gflops = 2 * (gcfg["H"] * gcfg["D"] + gcfg["HI"] * gcfg["DI"]) * N * N * 0.5
    bench.floor = gflops / rate * 1e3
    bench.log(f"gqa forward matmul floor {bench.floor:.3f} ms")
    for design in ("pacc", "pstore"):
        fc, bc = gqa_forced(design, args.tiny)
        name = f"gqa {design} default fwd{list(fc or ())} bwd{list(bc or ())}"
        if not bench.usable(f"gqa:{design}"):
            bench.times[("fwd+bwd", name)] = "skipped"
            bench.job_of[("fwd+bwd", name)] = f"gqa:{design}"
            continue
        with forced(design, fc, bc):
            bench.timed("fwd+bwd", name, lambda: fwd_bwd(gtrain, glse, gkw), reps, f"gqa N={N} causal lse mean",
                        f"gqa:{design}")
    timer.cancel()
    bench.table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
