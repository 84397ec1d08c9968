#!/usr/bin/env python3
"""The accumulating ("pacc") design of the indexer loss, DSA-like 8K causal fwd+bwd (issue 10).

    python bench/idx_pacc_gpu.py OUT --quick        # fits a 150 s slot on one H200, compiles included
    python bench/idx_pacc_gpu.py OUT --final        # <= 70 s: the default and two candidates (FINAL)
    TRITON_INTERPRET=1 python bench/idx_pacc_gpu.py /tmp/x --tiny   # CPU smoke of the script

Reduction "mean", ``lse`` given (the training case), bf16, causal, B = 1, DSA-like config
(H=128, D=576, H_K=1, sigma=192^-0.5; H_I=64, D_I=128, H_KI=1). What it does, in order:
  1. warm-up: every variant's kernels compiled by parallel child processes, one compile job per
     forward variant and per backward variant (Triton's disk cache is shared; one CPU thread
     each); a job past --warm-s is killed and its variant skipped (run s6r2: checked jobs that
     compiled a forward and two backward kernels each took over 50 s among 16).
  2. times at N=8192, the baseline first: the current default (the first candidate of each
     kernel kind, STREAMKL_AUTOTUNE=0: accumulating forward (128,128,64,64,8,3), student backward
     (128,128,64,64,8,2)) fwd+bwd and the store design's, then the forwards alone ("part:nodk":
     timing only, no dk_p share), then the student backwards alone, then fwd+bwd of each
     design's fastest forward with its fastest backward.
  3. checks what it timed: fwd+bwd of each variant vs float64 on a small causal problem (N=192;
     streamkl_ref.indexer_kl / indexer_kl_grad: loss, dq_idx, dk_idx, dweights; FlashAttention's
     rule: error <= 3 x the materialised bf16 form's error + 1e-2), the kernels warm; then kernel
     times (torch.profiler) of the default's fwd+bwd if time is left.
  4. the short table last: ms, ratio to the forward matmul floor (bf16 rate of an 8192^3 matmul
     measured in this run), check status.
A watchdog prints the table of what ran and exits before --deadline (default 140 s under --quick: the
lead gave this script a 150 s slot from run s6r3; at most 8 compiles at once, warm-up at most 90 s).
Outputs in OUT: idx_pacc.csv (long format: measure, provider, shape, value, unit, note),
idx_pacc.log. The torch.compile baseline is the lead's (306.6 ms in run s5r3; target 8x = 38.3 ms).
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
os.environ.setdefault("STREAMKL_TUNING_CACHE", "0")  # forced configs only: no stale disk choices
os.environ["STREAMKL_AUTOTUNE"] = "0"  # the first candidate of each kind: the default an untuned run takes
os.environ.setdefault("STREAMKL_INDEXER_PACC", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import streamkl_ref  # noqa: E402
import streamkl_gpu  # noqa: E402
from streamkl_gpu.indexer.training import accumulate as idx_accumulate  # noqa: E402
from streamkl_gpu.indexer import api as idx_api  # noqa: E402
from streamkl_gpu.indexer.training import choice as idx_choice  # noqa: E402
from streamkl_gpu.indexer.training import chunk as idx_chunk  # noqa: E402
from streamkl_gpu.indexer import configs as idx_configs  # noqa: E402
from streamkl_gpu.indexer import host as idx_host  # noqa: E402
from streamkl_gpu.indexer.training import store as idx_store  # noqa: E402

COLUMNS = ["measure", "provider", "shape", "value", "unit", "note"]
DSA = dict(H=128, HK=1, D=576, HI=64, HKI=1, DI=128, scale=192 ** -0.5)
TINY = dict(H=8, HK=1, D=32, HI=4, HKI=1, DI=16, scale=None)
LOG2E = 1.4426950408889634
_ORIG = idx_configs._candidates

BASE_FWD = (128, 128, 64, 64, 8, 3)
BASE_BWD = (128, 128, 64, 64, 8, 2)
# the plain forward's first DSA candidate since s6-idxdsa's merge: the keys-major 128-key tile on 4
# warps (13.69 ms in run s6r2); the row-major one before it (17.17 ms, s5r4)
STORE_FWD = (128, 128, 128, 64, 4, 3, None, 1, "keys")
STORE_FWD_ROWS = (128, 128, 128, 64, 4, 3)
# The forward's variants, most informative first: (label, design, config, checked). Designs:
# "pacc" accumulates the target's share (_indexer_pacc's accumulating kernel, kind "pacc"),
# "pstore" stores p (kind "pstore", the forward's tile), "chunk" stores p chunk by chunk and forms
# the whole gradient in the forward. A pacc config's 9th field names a kernel variant.
FWD_VARIANTS = [
    ("base", "pacc", BASE_FWD, True),
    # the chunk design: p stored chunk by chunk (linear memory), the whole gradient in the forward
    # (its "fwd" time is its fwd+bwd but the backward's scaling by g); dk by fp32 atomics
    ("chunk keys", "chunk", STORE_FWD, True),
    # the chunk design with its gradient kernel on 4 warps (9th field + "w4bwd", a bench-only
    # flag: Force then forces the backward config CHUNK_W4_BWD; the storing forward ignores it)
    ("chunk keys w4bwd", "chunk", STORE_FWD[:8] + ("keys_w4bwd",), True),
    # the storing forward alone (whole p; no dk shares): tells a crash of the chunk design apart
    ("store keys", "pstore", STORE_FWD, False),
]
CHUNK_W4_BWD = (64, 64, 64, 64, 4, 2)  # offline (dq + dk atomics): 384 B of spills, 8 warps 408 B
# Measured: run s6r2 (H200, triton 3.6): part:teacher 25.73 ms, part:logits 30.39; run s6r3: the
# default fwd+bwd 51.41 ms (forward 38.53, backward 12.99), kt+tm on 8 warps 40.94 (slower); the
# dqk backward and the chunk design with TMA bulk dk reductions crashed (illegal instruction /
# illegal memory access; now fp32 atomics). Not timed now (~6 compile jobs per run):
# ("kt+tm w8", "pacc", BASE_FWD + (None, 1, "kt+tm")), ("tm w4", "pacc", (128, 128, 64, 64, 4, 3, None, 1, "tm"))
# offline 504 B, ("kt+tm bn128 w8", "pacc", (128, 128, 128, 64, 8, 3, None, 1, "kt+tm")) offline 408 B,
# ("kt+tm+h2 w4", "pacc", (128, 128, 64, 64, 4, 3, None, 1, "kt+tm+h2")) 384 B, ("kt w8", "pacc",
# BASE_FWD + (None, 1, "kt")) 144 B, ("part:nodk", ...), ("w4", "pacc", (128, 128, 64, 64, 4, 3)) 568 B,
# ("bn32 w8", "pacc", (128, 128, 32, 64, 8, 3)) 48 B, ("t2 hb64 w8", "pacc", (128, 128, 64, 64, 8, 3, 64))
# 472 B, ("store p fp16", "pstore", STORE_FWD + (None, 1, "p16")), ("chunk rows", "chunk", STORE_FWD_ROWS)
# (the row-major storing forward).
# The student backward's variants (dq and dk kernels forced to the same config), after the
# forward of their design's first variant: (label, design, config). A 9th field "dqk": the
# one-kernel backward (STREAMKL_INDEXER_BWD=dqk, dk by fp32 atomics); "again": the logits formed
# again by a second product (BWD_LOGITS_FROM_A off: the session-5 backward)
BWD_VARIANTS = [
    ("base", "pacc", BASE_BWD),
    ("dqk", "pacc", BASE_BWD + (None, 1, "dqk")),
]
# also: ("w4 s2", "pacc", (64, 64, 64, 64, 4, 2)), ("dqk w4", "pacc", (64, 64, 64, 64, 4, 2, None, 1, "dqk")),
# ("logits again", "pacc", BASE_BWD + (None, 1, "again")), ("store", "pstore", BASE_BWD).
# --final: the default (first candidates) and the two candidates that failed on the H200 in run
# s6r3 with TMA bulk dk reductions and use fp32 atomics since: the chunk design (keys-major storing
# forward) and the dqk backward
FINAL = {"fwd": ("base", "chunk keys"), "bwd": ("base", "dqk")}
if "--final" in sys.argv:
    FWD_VARIANTS = [v for v in FWD_VARIANTS if v[0] in FINAL["fwd"]]
    BWD_VARIANTS = [v for v in BWD_VARIANTS if v[0] in FINAL["bwd"]]

DESIGN_ENV = {"pacc": "0", "pstore": "1", "chunk": "chunk"}  # STREAMKL_INDEXER_PSTORE


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tiny", action="store_true", help="CPU smoke (TRITON_INTERPRET=1)")
    p.add_argument("--n", type=int, default=None, help="tokens (default 8192; --tiny 32)")
    p.add_argument("--deadline", type=float, default=None, help="seconds (default 140 --quick, 400)")
    p.add_argument("--warm-s", type=float, default=None, help="warm-up seconds at most (default 90 --quick)")
    p.add_argument("--parallel", type=int, default=None)
    p.add_argument("--no-warm", action="store_true")
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    p.add_argument("--final", action="store_true",
                   help="the final run (<= 70 s): the default and the two candidates fixed after s6r3 (FINAL)")
    a = p.parse_args(argv)
    if a.final:
        a.quick = True
        a.deadline = a.deadline or 64.0
        a.warm_s = a.warm_s or 40.0
    if a.deadline is None:
        a.deadline = 140.0 if a.quick else 400.0  # the lead's slot for this script: 150 s (run s6r3)
    if a.warm_s is None:
        a.warm_s = 90.0 if a.quick else 150.0
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
        pst = self.want.get("pstore")
        if self.design == "chunk" and pst is not None and len(pst) > 8 and "w4bwd" in str(pst[8]).split("_"):
            self.want = dict(self.want, bwd=CHUNK_W4_BWD)
        idx_configs._candidates = cands
        bwd = self.want.get("bwd")
        pst = self.want.get("pstore")  # "p16" (a bench-only 9th field): p stored in float16
        idx_choice.PSTORE_DTYPE = torch.float16 if pst is not None and len(pst) > 8 and pst[8] == "p16" else torch.float32
        # "again" (a bench-only 9th field): the backward forms the logits again (as session 5)
        idx_host.BWD_LOGITS_FROM_A = not (bwd is not None and len(bwd) > 8 and bwd[8] == "again")
        self.old_env = {v: os.environ.get(v) for v in ("STREAMKL_INDEXER_PSTORE", "STREAMKL_INDEXER_BWD")}
        os.environ["STREAMKL_INDEXER_PSTORE"] = DESIGN_ENV[self.design]
        # "dqk" (a bench-only 9th field): the one-kernel backward
        os.environ["STREAMKL_INDEXER_BWD"] = "dqk" if bwd is not None and len(bwd) > 8 and bwd[8] == "dqk" else "separate"
        return self

    def __exit__(self, *exc):
        idx_configs._candidates = _ORIG
        idx_host.BWD_LOGITS_FROM_A = True
        idx_choice.PSTORE_DTYPE = torch.float32
        for var, val in self.old_env.items():
            if val is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = val


def forced(design, fwd_cfg=None, bwd_cfg=None):
    kind = "pstore" if design in ("pstore", "chunk") else "pacc"
    return Force(design, **{kind: fwd_cfg, "bwd": bwd_cfg})


def _runtime_interp():
    from streamkl_gpu._core import runtime as _runtime
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
    f = {"pstore": idx_store._forward_pstore, "chunk": idx_chunk._forward_full}.get(design, idx_accumulate._forward_pacc)
    return f(*xs, lse, kw["causal"], kw["scale"], True)


def bwd_part(design, xs, kw, saved):
    """The backward alone, from its forward's outputs ``saved`` (g = 1 / N for every row)."""
    g = torch.ones((), device=xs[0].device) / xs[0].shape[2]
    rows = g.expand(xs[0].shape[0], xs[0].shape[2]).contiguous()
    if design == "pstore":
        _, lse_idx, p = saved
        return idx_host._backward(rows, *xs, None, lse_idx, kw["causal"], kw["scale"], True, p_saved=p)
    _, lse_idx, dq_p, dk_p, dw_p = saved
    return idx_host._backward(rows, *xs, lse_idx, lse_idx, kw["causal"], kw["scale"], True,
                              target_part=(g, dq_p, dk_p, dw_p))


def fwd_bwd(train, lse, kw):
    loss = streamkl_gpu.indexer_kl(*train, lse=lse, reduction="mean", **kw)
    return torch.autograd.grad(loss, train[2:])


# ----------------------------------------------------------------------------------------------
# warm-up children: compile and check one variant on the small problem
# ----------------------------------------------------------------------------------------------

def first_fwd(design):
    return next(c for _, d, c, _ in FWD_VARIANTS if d == design)


def dummy_saved(design, cfg, N, device):
    """A forward's outputs of the right shapes (zeros) for compiling a backward alone."""
    z = lambda *shape: torch.zeros(shape, dtype=torch.float32, device=device)  # noqa: E731
    if design == "pstore":
        return z(), z(1, N), z(1, N, N)
    return z(), z(1, N), z(1, cfg["HI"], N, cfg["DI"]), z(1, 1, N, cfg["DI"]), z(1, cfg["HI"], N)


def run_job(job, tiny):
    """A warm-up child: compile one variant's kernels (a forward, or a backward) on the small
    problem (N=192: the 8K kernels' specialisations), one CPU thread."""
    torch.set_num_threads(1)
    kind, idx = job.split(":")
    cfg = TINY if tiny else DSA
    device = "cpu" if tiny else "cuda"
    N = 24 if tiny else 192
    xs = inputs(cfg, N, device, seed=2)
    kw = dict(causal=True, scale=scale_of(cfg))
    if kind == "fwd":
        _, design, fwd_cfg, _ = FWD_VARIANTS[int(idx)]
        lse = torch.zeros(1, cfg["H"], N, device=device)
        with forced(design, fwd_cfg):
            fwd_part(design, xs, lse, kw)
    else:
        _, design, bwd_cfg = BWD_VARIANTS[int(idx)]
        with forced(design, bwd_cfg=bwd_cfg):
            bwd_part(design, xs, kw, dummy_saved(design, cfg, N, device))
    if device == "cuda":
        torch.cuda.synchronize()
    print("RESULT {}", flush=True)


class Checker:
    """fwd+bwd of forced variants vs float64 on the small causal problem (N=192), the reference
    and the materialised bf16 form computed once (FlashAttention's rule: error <= 3 x the bf16
    form's error + 1e-2)."""

    def __init__(self, cfg, device, tiny):
        N = 24 if tiny else 192
        self.xs = inputs(cfg, N, device, seed=2, dtype=torch.float16 if tiny else torch.bfloat16)
        self.kw = dict(causal=True, scale=scale_of(cfg))
        x64 = [x.double().cpu().numpy() for x in self.xs]
        kl_ref, _, lse_ref = streamkl_ref.indexer_kl(*x64, return_lse=True, **self.kw)
        self.ref = dict(loss=float(kl_ref.mean()),
                        **streamkl_ref.indexer_kl_grad(*x64, np.full(kl_ref.shape, 1.0 / N), **self.kw))
        sp_in = [x.detach().clone().requires_grad_(r) for x, r in zip(self.xs, TRAIN)]
        sp_loss = idx_api.indexer_kl_naive(*sp_in, compute_dtype=self.xs[0].dtype, **self.kw).mean()
        self.sp = dict(loss=sp_loss.detach(), **dict(zip(GRADS, torch.autograd.grad(sp_loss, sp_in[2:]))))
        self.lse = torch.from_numpy(lse_ref).float().to(device)
        self.N = N

    def __call__(self, design, fwd_cfg, bwd_cfg):
        ins = [x.detach().clone().requires_grad_(r) for x, r in zip(self.xs, TRAIN)]
        with forced(design, fwd_cfg, bwd_cfg):
            loss = streamkl_gpu.indexer_kl(*ins, lse=self.lse, reduction="mean", **self.kw)
            grads = torch.autograd.grad(loss, ins[2:])
        ours = dict(loss=loss.detach(), **dict(zip(GRADS, grads)))
        out = {}
        for name in ("loss",) + GRADS:
            base = rel_err(self.sp[name], self.ref[name])
            out[name] = (rel_err(ours[name], self.ref[name]), 3.0 * (base if math.isfinite(base) else 0.0) + 1e-2)
        return out


TRAIN = (False, False, True, True, True)
GRADS = ("dq_idx", "dk_idx", "dweights")


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
        self.compiled = {}  # warm-up job -> "ok" / why not
        self.checks = {}  # (design, fwd config, bwd config) -> "ok" / "FAIL ..."
        self.check_of_row = {}  # (measure, label) -> the check key of that row (None: timing only)
        self.notes = {}  # (measure, label) -> why skipped
        self.times = {}  # (measure, label) -> ms or a status string
        self.floor = None
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
        """Compile every job's kernels in parallel children (one CPU thread each); a job past
        --warm-s is killed and its variant skipped (a compile in the timing process would eat the slot)."""
        par = self.args.parallel or max(1, min(8, os.cpu_count() or 1))  # the lead: at most 8 compiles at once
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        t0 = time.time()
        pending, running = list(jobs), []
        while pending or running:
            while pending and len(running) < par:
                job = pending.pop(0)
                cmd = [sys.executable, os.path.abspath(__file__), self.args.out_dir, "--job", job] + (
                    ["--tiny"] if self.args.tiny else []) + (["--final"] if self.args.final else [])  # the same lists
                running.append((job, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                                      env=env)))
            still = []
            for job, proc in running:
                if proc.poll() is None:
                    if time.time() - t0 > self.args.warm_s:
                        proc.kill()
                        proc.wait()
                        self.compiled[job] = f"compile killed (warm-up over {self.args.warm_s:.0f} s)"
                        self.log(f"warm-up {job} {self.job_label(job)}: {self.compiled[job]}")
                    else:
                        still.append((job, proc))
                    continue
                out = proc.stdout.read()
                ok = proc.returncode == 0 and any(ln.startswith("RESULT ") for ln in out.splitlines())
                self.compiled[job] = "ok" if ok else f"compile FAIL exit {proc.returncode}"
                self.log(f"warm-up {job} {self.job_label(job)}: {time.time() - t0:.0f} s, {self.compiled[job]}"
                         + ("" if ok else "\n" + out[-1500:]))
            running = still
            time.sleep(0.1)
        self.log(f"warm-up: {len(jobs)} jobs, {par} at a time, {time.time() - t0:.0f} s")

    @staticmethod
    def job_label(job):
        kind, idx = job.split(":")
        if kind == "fwd":
            label, design, cfg, _ = FWD_VARIANTS[int(idx)]
            return f"fwd {label} {design}{list(cfg)}"
        label, design, cfg = BWD_VARIANTS[int(idx)]
        return f"bwd {label} {design}{list(cfg)}"

    def usable(self, *jobs):
        return self.args.no_warm or all(self.compiled.get(j) == "ok" for j in jobs)

    def timed(self, measure, label, fn, reps, shape, check=None):
        """Median ms of ``fn``; ``check`` = (design, fwd config, bwd config) checked later."""
        self.check_of_row[(measure, label)] = check
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

    def skipped(self, measure, label, why):
        self.times[(measure, label)] = "skipped"
        self.check_of_row[(measure, label)] = None
        self.notes[(measure, label)] = why

    def run_checks(self, checker):
        """Every timed variant's fwd+bwd vs float64 (the kernels are warm: fast)."""
        for key, chk in self.check_of_row.items():
            if chk is None or chk in self.checks or not isinstance(self.times.get(key), float):
                continue
            if self.left() < 3:
                self.checks[chk] = "not checked (deadline)"
                continue
            design, fc, bc = chk
            try:
                errs = checker(design, fc, bc)
            except Exception as exc:  # noqa: BLE001
                self.checks[chk] = f"FAIL raised {type(exc).__name__}: {str(exc)[:200]}"
                self.logf.write(traceback.format_exc())
            else:
                bad = [f"{k} {e:.2e} > {t:.2e}" for k, (e, t) in errs.items() if not e <= t]
                for k, (e, t) in errs.items():
                    self.record("check_rel_err", f"{design} fwd{list(fc)} bwd{list(bc)} {k}",
                                f"dsa N={checker.N} causal lse mean", f"{e:.3e}", "rel",
                                f"tol {t:.3e} {'ok' if e <= t else 'FAIL'}")
                self.checks[chk] = ("FAIL " + "; ".join(bad)) if bad else "ok"
            self.log(f"check {design} fwd{list(fc)} bwd{list(bc)}: {self.checks[chk]}")

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
        lines = ["", f"{'measure':8s} {'variant':58s} {'ms':>9s} {'x floor':>8s}  check"]
        for (measure, label), v in self.times.items():
            ms = f"{v:9.3f}" if isinstance(v, float) else f"{v:>9s}"
            floor = self.floor_of.get((measure, label))
            ratio = f"{v / floor:8.2f}" if isinstance(v, float) and floor else f"{'':8s}"
            chk = self.check_of_row.get((measure, label))
            note = self.checks.get(chk, "not checked") if chk else self.notes.get((measure, label), "timing only")
            lines.append(f"{measure:8s} {label:58s} {ms} {ratio}  {note}")
        text = "\n".join(lines)
        print(text, flush=True)
        self.logf.write(text + "\n")
        self.logf.flush()


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
    fjob = {(d, c): f"fwd:{i}" for i, (_, d, c, _) in enumerate(FWD_VARIANTS)}
    bjob = {(d, c): f"bwd:{i}" for i, (_, d, c) in enumerate(BWD_VARIANTS)}
    if not args.no_warm:
        try:
            bench.warm_up(list(fjob.values()) + list(bjob.values()))
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
    train = [x.detach().clone().requires_grad_(r) for x, r in zip(xs, TRAIN)]
    reps = 3 if args.quick else 10
    # 1. fwd+bwd: the current default (the accumulating design, first candidates), then the store design
    for design in ("pacc", "chunk"):
        fc = first_fwd(design)
        label = f"{'default ' if design == 'pacc' else ''}{design} fwd{list(fc)} bwd{list(BASE_BWD)}"
        if bench.usable(fjob[(design, fc)], *([bjob[(design, BASE_BWD)]] if (design, BASE_BWD) in bjob else [])):
            with forced(design, fc, BASE_BWD):
                bench.timed("fwd+bwd", label, lambda: fwd_bwd(train, lse, kw), reps, shape, (design, fc, BASE_BWD))
        else:
            bench.skipped("fwd+bwd", label, "not compiled in the warm-up")
    fwd_ms, bwd_ms, saved = {}, {}, {}
    # 2. the forwards alone (each design's first variant first)
    for label, design, fc, checked in FWD_VARIANTS:
        name = f"{label} {design}{list(fc)}"
        if not bench.usable(fjob[(design, fc)]):
            bench.skipped("fwd", name, bench.compiled.get(fjob[(design, fc)], "not compiled"))
            continue
        with forced(design, fc):
            ms = bench.timed("fwd", name, lambda: fwd_part(design, xs, lse, kw), reps, shape,
                             (design, fc, BASE_BWD) if checked else None)
            if fc == first_fwd(design) and ms is not None:
                saved[design] = fwd_part(design, xs, lse, kw)
        if ms is not None and checked:
            fwd_ms[(design, fc)] = ms
    # 3. the backwards alone, from their design's first forward
    for label, design, bc in BWD_VARIANTS:
        name = f"{label} {design}{list(bc)}"
        if design not in saved or not bench.usable(bjob[(design, bc)]):
            bench.skipped("bwd", name, bench.compiled.get(bjob[(design, bc)], "no forward"))
            continue
        with forced(design, bwd_cfg=bc):
            ms = bench.timed("bwd", name, lambda: bwd_part(design, xs, kw, saved[design]), reps, shape,
                             (design, first_fwd(design), bc))
        if ms is not None:
            bwd_ms[(design, bc)] = ms
    saved.clear()
    # 4. fwd+bwd of each design's fastest forward with its fastest backward
    for design in ("pacc",):
        fs = {c: v for (d, c), v in fwd_ms.items() if d == design}
        bs = {c: v for (d, c), v in bwd_ms.items() if d == design}
        if not fs or not bs:
            continue
        bf, bb = min(fs, key=fs.get), min(bs, key=bs.get)
        if (bf, bb) != (first_fwd(design), BASE_BWD):
            with forced(design, bf, bb):
                bench.timed("fwd+bwd", f"best {design} fwd{list(bf)} bwd{list(bb)}", lambda: fwd_bwd(train, lse, kw),
                            reps, shape, (design, bf, bb))
    # 5. checks of what was timed (vs float64 at N=192; kernels warm), then where the time goes
    del train, xs, lse
    try:
        bench.run_checks(Checker(cfg, bench.device, args.tiny))
    except Exception as exc:  # noqa: BLE001
        bench.log(f"checks raised {type(exc).__name__}: {str(exc)[:300]}")
        bench.logf.write(traceback.format_exc())
    if bench.device == "cuda" and bench.left() > 12 and not args.final:
        xs = inputs(cfg, N, bench.device)
        lse = teacher_lse(xs[0], xs[1], kw["scale"])
        train = [x.detach().clone().requires_grad_(r) for x, r in zip(xs, TRAIN)]
        try:
            with forced("pacc", BASE_FWD, BASE_BWD):
                bench.profile("pacc default", lambda: fwd_bwd(train, lse, kw), shape)
        except Exception as exc:  # noqa: BLE001 - printed, the run goes on
            bench.log(f"profile raised {type(exc).__name__}: {str(exc)[:300]}")
    timer.cancel()
    bench.table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
