"""Session 6 (issue 14): the separate backward kernels' new candidates against the current auto plan.

    python bench/bwd_s6.py OUT [--budget-s 78] [--workers N] [--tiny]

The auto path for one trained side at D = 128 is the separate pair: dK kernel 64x128x8x3
``tma+trans+fold+rows`` + dQ kernel 128x64x8x3 ``tma+fold`` (run s5r4: 8K s1 6.30 ms, s2 5.89 ms
backward; SDPA's 5.20). This times, at B=1 H=32 N=8K D=128 bf16, each kernel alone (direct
launches, bench/bwd_sweep.py's ``Direct``) for the reference config and each candidate (tile
shapes with two or three CTAs per SM, register caps, no rows pre-pass, heavy-first causal order),
then the best pair against the reference pair, non-causal first, causal after; every timed launch's
output is compared with the reference kernel's at the same shape (MISMATCH above 2e-2), and the
best pair against float64 at a small shape, last.

1. prewarm: every launch compiled once at N = 2048 (the 8K specialisations) in worker processes.
2. time (most important first), 3. check; a watchdog writes OUT/bwd_s6.csv, OUT/bwd_s6.log and the
table (OUT/bwd_s6_table.txt, printed last) before the budget ends, whatever is running then.
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

T_START = time.perf_counter()  # the budget counts from here (before torch's import)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
os.environ.setdefault("STREAMKL_TUNING_CACHE", "0")

K = 1024
SETTINGS = ("s1", "s2")
SET_TRAIN = {"s1": ("q2", "k2"), "s2": ("q1", "k1")}
MISMATCH = 2e-2
# (tag, N_Q, N_K, causal), in timing order: the 8K points, then the fused-vs-separate
# question at small N_Q (auto_bwd_mode: fused below 4 dQ programs per SM; run s5r4 measured the
# separate pair faster at N_Q = 512, N_K = 32K)
SHAPES = [("8K", 8 * K, 8 * K, False), ("8K causal", 8 * K, 8 * K, True), ("8K both", 8 * K, 8 * K, False),
          ("nq512 nk32K", 512, 32 * K, False), ("nq16 nk32K", 16, 32 * K, False)]
SHAPES_TINY = [("8K", 64, 64, False), ("8K causal", 64, 64, True), ("nq512 nk32K", 16, 64, False),
               ("8K both", 64, 64, False)]


def shape_settings(tag):
    """The settings timed at a shape: both sides trained at "8K both" (Direct then compares dQ1, dK1)."""
    return ("both",) if tag.endswith("both") else SETTINGS
SMALL_Q = ("nq512 nk32K", "nq16 nk32K")
# (H, N) of the float64 checks: the 8K kernels' integer specialisations (N % 16 == 0)
CHECK_SHAPE, CHECK_SHAPE_TINY = (16, 384), (2, 64)


class Cand:
    """One launch of the dK (``kind="dk"``) or dQ kernel: (BLOCK_M, BLOCK_N, warps, stages), extra
    kernel options (constexprs, ``maxnreg``), and for dK whether the rows pre-pass runs."""

    def __init__(self, name, kind, cfg, opts=None, rows=True, at=("8K",), probe=0):
        self.name, self.kind, self.cfg, self.opts, self.rows = name, kind, tuple(cfg), dict(opts or {}), rows
        self.at = at  # the SHAPES (by tag) it is timed at
        self.probe = probe  # _bwd.PROBE_* flags: timing only (wrong gradients, not compared or checked)

    def runs(self, tag):
        return tag in self.at

    def launch(self, direct):
        if self.kind == "dk":
            return direct.dk(self.cfg, False, self.probe, opts=self.opts, rows=self.rows)[1]
        if self.kind == "fused":  # (dQ in fp32, dK): the fused kernel, dQ by TMA reduce-adds
            return direct.dk(self.cfg, True, opts=self.opts, rows=self.rows)
        return direct.dq(self.cfg, opts=self.opts)


REF_DK = Cand("dk 64x128x8x3 rows (auto)", "dk", (64, 128, 8, 3), at=("8K", "8K causal") + SMALL_Q)
REF_DQ = Cand("dq 128x64x8x3 (auto)", "dq", (128, 64, 8, 3), at=("8K", "8K causal") + SMALL_Q)
# the fused kernel (the auto mode at small N_Q), non-causal only
REF_FUSED = Cand("fused 64x128x8x2 rows", "fused", (64, 128, 8, 2), at=SMALL_Q)  # run s6r1's auto at nq512
REFS = {"dk": REF_DK, "dq": REF_DQ, "fused": REF_FUSED}
# the dK launches of the default plans since run s6r2's adoption of "pack" (timed in pairs)
DEFAULT_DK = ("dk 64x128x8x3 pack", "dk 32x64x4x3 both pack")


def is_ref(c):
    """A reference launch (what the auto plan or the fused candidate runs today): the others are
    compared with the one of their kind at the same shape."""
    return c in REFS.values() or c.name.endswith("auto)")
# in timing order (the slot may end early): the references first, then the expected best. Offline
# sm_90 compile (bench/bwd_s6_offline.py, triton 3.6), whole-tile loop instructions s1 / s2: dK
# rows 459 / 556 (6 TMA loads a tile, 10 SYNCS), pack 398 / 374 (3 loads, 4 SYNCS), no spills;
# dQ 313 / 319. CTAs per SM by registers and shared memory: the auto pair 1 + 1; dq 64x32x4x2 3,
# 64x64x4x2 / 64x32x4x3 / the r128 caps (32-40 bytes of spills) 2; dk 32x64x4x* pack 2 (172-187
# registers, no spills; loop 270-280), 3 with the r168 cap
CANDIDATES = [  # the final run (s6r4): the references, the default since s6r2 (pack), the probes
    REF_DQ, REF_DK,
    Cand("dk 64x128x8x3 pack", "dk", (64, 128, 8, 3), rows="pack", at=("8K", "8K causal") + SMALL_Q),
    # what limits the dK kernel (the new default), removing one part at a time (_bwd.PROBE_*; NO_DK
    # leaves the separate kernel nothing to do: the compiler drops the whole loop)
    Cand("dk 64x128x8x3 pack probe noexp", "dk", (64, 128, 8, 3), rows="pack", probe=1),
    Cand("dk 64x128x8x3 pack probe onescore", "dk", (64, 128, 8, 3), rows="pack", probe=2),
    Cand("dq 128x64x8x3 heavy", "dq", (128, 64, 8, 3), {"HEAVY_FIRST": True}, at=("8K causal",)),
    REF_FUSED,
    # both settings (the auto pair of run s6r1: dK 32x64x4x3 rows + dQ 64x32x4x3; 6 row loads a tile)
    Cand("dk 32x64x4x3 rows (both auto)", "dk", (32, 64, 4, 3), at=("8K both",)),
    Cand("dq 64x32x4x3 (both auto)", "dq", (64, 32, 4, 3), at=("8K both",)),
    Cand("dk 32x64x4x3 both pack", "dk", (32, 64, 4, 3), rows="pack", at=("8K both",)),
]
# Run s6r3 (H200, 8K, the kernels alone, ms s1 / s2; bench/results/2026-12-01_h200_d2682d7/bwd_kernels*):
# dK rows 3.374 / 3.424, pack 3.369 / 3.390, pack 8x4 3.412 / 3.240, 64x64x4x2 pack 3.426 / 3.263, pack
# + poly (half of P2's exp2 on the FMA pipe, setting 1) 3.627 / 3.283; dQ 2.644 / 2.530, poly 2.890 /
# 2.399 (in setting 2 poly is the same kernel: a 5 % spread between identical kernels in one run).
# Probes of dK pack: no exp2 3.034 / 3.124, one score product 3.067 / 2.463.
# Run s6r2 (H200, the kernels alone at 8K, ms s1 / s2; bench/results/2026-12-01_h200_d3b757b/bwd_kernels*):
# dK rows (auto) 3.374 / 3.483, pack 3.365 / 3.306, pack 8x4 3.403 / 3.274, 64x64x4x2 pack 3.390 / 3.295,
# 32x64x4x2 r168 pack 3.648 / 3.643, 32x64x4x3 pack 3.678 / 3.586, 32x128x8x2 r128 pack 3.497 / 4.488,
# 64x128x8x2 pack 3.942 / 3.932, norows 4.027 / 3.931, 4-CTA 32x64x4x1 r128 pack 5.35 / 5.50;
# dQ 128x64x8x3 (auto) 2.660 / 2.335, 128x64x8x4 2.777 / 2.545, 128x32x8x3 r128 2.839 / 2.708,
# 64x64x4x2 3.005 / 2.825, 64x32x4x3 3.022 / 3.113, 128x32x8x2 r128 3.073 / 2.926, 64x32x4x2 3.178 / 3.093,
# 64x32x4x1 r128 3.926 / 3.905: more CTAs per SM did not pay; causal heavy-first dQ 0.99x / 1.00x.
TINY_CFG = {"dk": (16, 32, 1, 1), "dq": (32, 16, 1, 1), "fused": (16, 32, 1, 1)}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="everything written before this many seconds (the slot is 80 s)")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run under TRITON_INTERPRET=1")
    ap.add_argument("--only", default="", help="comma-separated candidate names (default: all)")
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


class S6:
    def __init__(self, a):
        import torch
        self.a, self.torch = a, torch
        self.dev = torch.device("cpu" if a.tiny else "cuda")
        self.H, self.D = (2, 32) if a.tiny else (32, 128)
        self.n = 64 if a.tiny else 8 * K
        os.makedirs(a.out, exist_ok=True)
        self.rows, self.lines = [], []
        self.logf = open(os.path.join(a.out, "bwd_s6.log") if not a._worker else os.devnull, "a")
        self.t0 = T_START
        self.timed = {}  # (shape, setting, name) -> ms
        self.diffs = {}  # (shape, setting, name) -> rel. difference vs the reference kernel's output
        self.lock = threading.Lock()
        self.done = False
        self.cands = [c for c in CANDIDATES if not a.only or c.name in a.only.split(",")]
        if a.tiny:
            import bwd_sweep
            bwd_sweep.TINY = True  # the fused dQ by per-element atomics (no TMA reduce-add in the interpreter)
            for c in self.cands:
                c.cfg = TINY_CFG[c.kind]
                c.opts.pop("maxnreg", None)

    def log(self, msg):
        line = f"[{time.perf_counter() - self.t0:6.1f}s] {msg}"
        print(line, flush=True)
        self.logf.write(line + "\n")
        self.logf.flush()

    def row(self, measure, provider, shape, value, unit, note=""):
        with self.lock:
            self.rows.append(dict(measure=measure, provider=provider, shape=shape, value=value, unit=unit, note=note))

    def left(self):
        return self.a.budget_s - (time.perf_counter() - self.t0)

    def sync(self):
        if not self.a.tiny:
            self.torch.cuda.synchronize()

    def bench(self, fn):
        if self.a.tiny:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        from triton.testing import do_bench
        return do_bench(fn, warmup=5, rep=40, return_mode="median")

    def inputs(self, H, N, D, seed=0, nk=None):
        torch = self.torch
        gen = torch.Generator(device=self.dev)
        gen.manual_seed(99 + seed)
        dt = torch.float16 if self.a.tiny else torch.bfloat16  # bf16 dots are garbage in the interpreter
        d = {k: torch.randn((1, H, N if k[0] == "q" else (nk or N), D), generator=gen, device=self.dev, dtype=dt)
             for k in ("q1", "k1", "q2", "k2")}
        d["g"] = torch.randn((1, H, N), generator=gen, device=self.dev, dtype=torch.float32)
        return d

    def forward(self, d, causal):
        from streamkl_gpu.attention import launch as _launch
        os.environ["STREAMKL_AUTOTUNE"] = "0"
        return _launch.forward(d["q1"], d["k1"], d["q2"], d["k2"], causal, None, None, None)

    # -- output ------------------------------------------------------------------------------------
    def write(self):
        with self.lock:
            rows = list(self.rows)
        with open(os.path.join(self.a.out, "bwd_s6.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["measure", "provider", "shape", "value", "unit", "note"])
            w.writeheader()
            for r in rows:
                w.writerow(r)

    def table(self):
        timed = dict(self.timed)
        sd = {k[0]: v for k, v in timed.items() if k[2] == "sdpa bwd"}
        lines = ["", f"bwd_s6: kernel-alone ms at B=1 H={self.H} D={self.D} bf16 (direct launches); x = vs the auto "
                 "config of that kernel; pairs: dK + dQ (+ rows pre-pass)"]
        for shape in sorted({k[0] for k in timed}):
            for s in shape_settings(shape):
                ks = [(k, v) for k, v in timed.items() if k[0] == shape and k[1] == s]
                if not ks:
                    continue
                lines.append(f"{shape} {s}" + (f" (SDPA bwd {sd[shape]:.3f} ms)" if shape in sd else ""))
                ref = {c.kind: timed[(shape, s, c.name)] for c in CANDIDATES if is_ref(c) and (shape, s, c.name) in timed}
                for (_, _, name), t in sorted(ks, key=lambda kv: (kv[0][2].split()[0], kv[1])):
                    kind = name.split()[0]
                    base = ref.get(kind)
                    diff = self.diffs.get((shape, s, name))
                    lines.append(f"  {name:40s} {t:8.3f} ms" + (f"  {t / base:.3f}x" if base and kind in ref else "")
                                 + (f"  vs ref {diff:.1e}" if diff is not None else "")
                                 + ("  MISMATCH" if diff is not None and not diff <= MISMATCH else "")
                                 + (f"  = {t / sd[shape]:.3f}x sdpa" if kind in ("pair", "auto") and shape in sd else ""))
        lines += self.lines
        text = "\n".join(lines)
        with open(os.path.join(self.a.out, "bwd_s6_table.txt"), "w") as f:
            f.write(text + "\n")
        return text

    def finish(self, why):
        with self.lock:
            if self.done:
                return
            self.done = True
        self.log(f"finish: {why}")
        try:
            self.write()
            print(self.table(), flush=True)
        except Exception as exc:  # the watchdog must not die writing
            print(f"write failed: {type(exc).__name__}: {exc}", flush=True)

    # -- timing ------------------------------------------------------------------------------------
    def time_shape(self, tag, nq, nk, causal, ok):
        torch = self.torch
        from bwd_sweep import Direct
        shape = tag
        d = self.inputs(self.H, nq, self.D, seed=1 + causal, nk=nk)
        if not self.a.tiny and nq == nk:
            try:  # SDPA's backward = fwd+bwd - fwd (q = q1, k = k1, v = k2, as bench_gpu.py)
                q, k, v = (d[n].detach().requires_grad_() for n in ("q1", "k1", "k2"))
                sdpa = torch.nn.functional.scaled_dot_product_attention
                go = torch.randn_like(q)
                t_f = self.bench(lambda: sdpa(q, k, v, is_causal=causal))
                t_fb = self.bench(lambda: torch.autograd.grad(sdpa(q, k, v, is_causal=causal), (q, k, v), go))
                self.timed[(shape, "s1", "sdpa bwd")] = t_fb - t_f
                self.row("bwd", "sdpa", shape, t_fb - t_f, "ms", "fwd+bwd - fwd")
                self.log(f"{shape} sdpa fwd {t_f:.3f} fwd+bwd {t_fb:.3f} bwd {t_fb - t_f:.3f} ms")
                del q, k, v, go
            except Exception as exc:
                self.log(f"{shape} sdpa: ERROR {type(exc).__name__}: {str(exc)[:200]}")
        fwd = self.forward(d, causal)
        for s in shape_settings(tag):
            direct = Direct(torch, d, fwd, s, causal=causal)
            refs = {}
            kernels = {}
            for c in self.cands:
                if not c.runs(tag):
                    continue
                if self.left() < 12:
                    self.log(f"{shape} {s} {c.name}: skipped (budget)")
                    continue
                if ok is not None and (c.name, s, causal) not in ok:
                    self.log(f"{shape} {s} {c.name}: skipped (not prewarmed)")
                    continue
                try:
                    out = c.launch(direct)
                    self.sync()
                    ref = refs.get(c.kind)
                    diff = rel(out, ref) if ref is not None and not c.probe else None
                    if is_ref(c):
                        refs[c.kind] = out
                    else:
                        del out
                    t = self.bench(lambda: c.launch(direct))
                    self.timed[(shape, s, c.name)] = t
                    if diff is not None:
                        self.diffs[(shape, s, c.name)] = diff
                    kernels[c.name] = c
                    bad = diff is not None and not diff <= MISMATCH
                    self.row("bwd_kernel", c.name, f"{shape} {s}", t, "ms",
                             (f"vs_ref={diff:.2e}" if diff is not None else "") + (" MISMATCH" if bad else ""))
                    self.log(f"{shape} {s} {c.name:36s} {t:8.3f} ms" + (f"  vs ref {diff:.1e}" if diff is not None else "")
                             + ("  MISMATCH" if bad else ""))
                except Exception as exc:
                    self.row("bwd_kernel", c.name, f"{shape} {s}", float("nan"), "ms", f"ERROR {type(exc).__name__}")
                    self.log(f"{shape} {s} {c.name}: ERROR {type(exc).__name__}: {str(exc)[:300]}")
                    self.logf.write(traceback.format_exc())
            self.pair(shape, s, direct, kernels)
            del refs
        del d, fwd
        if not self.a.tiny:
            torch.cuda.empty_cache()

    def pair(self, shape, s, direct, kernels):
        """dK + dQ together: the reference pair, the new default (``DEFAULT_DK`` + the reference dQ)
        and the best of each kind (no mismatch), each one after the other and with the dQ kernel on
        a second stream beside the dK kernel (``_launch``'s STREAMKL_BWD_STREAMS path)."""
        def best(kind):
            got = [(self.timed[(shape, s, n)], c) for n, c in kernels.items() if c.kind == kind and not c.probe
                   and self.diffs.get((shape, s, n), 0.0) <= MISMATCH]
            return min(got, key=lambda x: x[0])[1] if got else None
        bdk, bdq = best("dk"), best("dq")
        rdk = next((c for c in kernels.values() if c.kind == "dk" and is_ref(c)), None)
        rdq = next((c for c in kernels.values() if c.kind == "dq" and is_ref(c)), None)
        ddk = next((c for c in kernels.values() if c.kind == "dk" and c.name in DEFAULT_DK), None)
        pairs = []
        for p in ((rdk, rdq), (ddk, rdq), (bdk, bdq)):
            if p[0] and p[1] and p not in pairs:
                pairs.append(p)
        for dk, dq in pairs:
            for streams in (False, True):
                if (dk.name not in kernels or dq.name not in kernels or self.left() < 6
                        or (streams and (self.a.tiny or shape not in ("8K", "8K causal")))):
                    continue
                name = f"pair {dk.name.split(' ', 1)[1]} + {dq.name.split(' ', 1)[1]}" + (" streams" if streams else "")
                try:
                    if streams:
                        t = self.bench(lambda: beside(self.torch, lambda: dk.launch(direct), lambda: dq.launch(direct)))
                    else:
                        t = self.bench(lambda: (dk.launch(direct), dq.launch(direct)))
                    self.timed[(shape, s, name)] = t
                    self.row("bwd_pair", name, f"{shape} {s}", t, "ms", "dK + dQ kernels (+ rows pre-pass)"
                             + ("; dQ on a second stream" if streams else ""))
                    self.log(f"{shape} {s} {name:60s} {t:8.3f} ms")
                except Exception as exc:
                    self.log(f"{shape} {s} {name}: ERROR {type(exc).__name__}: {str(exc)[:300]}")

    # -- checks (last) -------------------------------------------------------------------------------
    def api_grads(self, d, setting, streams):
        """attention_kl's gradients of the trained side, separate kernels, the default dK variant
        (pack) at its first tile config, STREAMKL_BWD_STREAMS=streams."""
        torch = self.torch
        import streamkl_gpu
        os.environ.update(STREAMKL_AUTOTUNE="0", STREAMKL_BWD_STREAMS="1" if streams else "0",
                          STREAMKL_BWD_VARIANT="tma+trans+fold+rows+pack")
        try:
            x = {n: d[n].detach().requires_grad_(n in SET_TRAIN[setting]) for n in ("q1", "k1", "q2", "k2")}
            kl = streamkl_gpu.attention_kl(x["q1"], x["k1"], x["q2"], x["k2"], bwd_mode="separate")
            return torch.autograd.grad(kl, [x[n] for n in SET_TRAIN[setting]], d["g"])
        finally:
            for k in ("STREAMKL_BWD_STREAMS", "STREAMKL_BWD_VARIANT"):
                os.environ.pop(k, None)

    def auto_fb(self, d, setting, streams=False):
        """attention_kl forward + backward of one setting, auto mode, tuned (the default path)."""
        torch = self.torch
        import streamkl_gpu
        os.environ.update(STREAMKL_AUTOTUNE="1", STREAMKL_BWD_STREAMS="1" if streams else "0")
        x = {n: d[n].detach().requires_grad_(n in SET_TRAIN[setting]) for n in ("q1", "k1", "q2", "k2")}
        kl = streamkl_gpu.attention_kl(x["q1"], x["k1"], x["q2"], x["k2"])
        return torch.autograd.grad(kl, [x[n] for n in SET_TRAIN[setting]], d["g"])

    def time_auto(self, ok):
        """The API's default path at 8K non-causal (backward = fwd+bwd - fwd, as bench/bwd_musts_gpu.py),
        the dQ kernel on one stream and on a second one."""
        import streamkl_gpu
        from streamkl_gpu.attention import launch as _launch
        d = self.inputs(self.H, self.n, self.D, seed=21)
        os.environ["STREAMKL_AUTOTUNE"] = "1"
        try:
            t_f = self.bench(lambda: streamkl_gpu.attention_kl(d["q1"], d["k1"], d["q2"], d["k2"]))
        except Exception as exc:
            self.log(f"auto fwd: ERROR {type(exc).__name__}: {str(exc)[:200]}")
            return
        for s in SETTINGS:
            for streams in (False,):  # (the second stream: s6r3 auto 6.346 vs 6.275 s1, 5.863 vs 6.039 s2)
                if self.left() < 14 or (ok is not None and ("apiauto", s, False) not in ok):
                    self.log(f"auto {s} streams={streams}: skipped")
                    continue
                try:
                    self.auto_fb(d, s, streams)  # tunes (first call)
                    self.sync()
                    t = self.bench(lambda: self.auto_fb(d, s, streams))
                    plans = [p for sig, p in _launch._PLANS.items() if sig[0] == "bwd"]
                    plan = "/".join(map(str, plans[-1])).replace(" ", "") if plans else "?"
                    name = "auto" + (" streams" if streams else "")
                    self.timed[("8K", s, name)] = t - t_f
                    self.row("bwd", name, f"8K {s}", t - t_f, "ms", f"fwd+bwd {t:.3f} - fwd {t_f:.3f}; plan={plan}")
                    self.log(f"8K {s} {name:14s} fwd+bwd {t:.3f} - fwd {t_f:.3f} = bwd {t - t_f:.3f} ms  {plan}")
                except Exception as exc:
                    self.log(f"auto {s} streams={streams}: ERROR {type(exc).__name__}: {str(exc)[:300]}")
        os.environ.pop("STREAMKL_BWD_STREAMS", None)
        del d

    def profile_auto(self, setting="s1"):
        """torch.profiler of warm API calls at 8K non-causal (the default path): the GPU kernels of
        the last fwd+bwd, their durations and the idle gaps between them (what runs outside the two
        backward kernels); OUT/bwd_s6_profile.txt."""
        torch = self.torch
        from torch.profiler import ProfilerActivity, profile
        d = self.inputs(self.H, self.n, self.D, seed=21)
        os.environ["STREAMKL_BWD_STREAMS"] = "0"
        for _ in range(2):
            self.auto_fb(d, setting)
        self.sync()
        from torch.profiler import record_function
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                with record_function("bwd_s6_call"):
                    self.auto_fb(d, setting)
            self.sync()
        evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
        # the host side of the last call: its start, and when each kernel launch was issued
        cpu = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU),
                     key=lambda e: e.time_range.start)
        calls = [e for e in cpu if e.name == "bwd_s6_call"]
        host = []
        if calls:
            c0 = calls[-1].time_range.start
            launches = [e for e in cpu if "LaunchKernel" in e.name and e.time_range.start >= c0
                        and e.time_range.end <= calls[-1].time_range.end]
            host = [f"  host: call {calls[-1].time_range.end - c0:.1f} us; launches at "
                    + ", ".join(f"{e.time_range.start - c0:.0f}" for e in launches) + " us after its start"]
        # the last call: from the last forward kernel (its name has "fwd") on
        starts = [i for i, e in enumerate(evs) if "fwd" in e.name and (i == 0 or "fwd" not in evs[i - 1].name)]
        last = evs[starts[-1]:] if starts else evs
        lines = [f"profile: attention_kl fwd+bwd, 8K {setting}, warm (the last of 3 calls); us"]
        prev = None
        busy = 0.0
        for e in last:
            t0, t1 = e.time_range.start, e.time_range.end
            gap = (t0 - prev) if prev is not None else 0.0
            busy += t1 - t0
            lines.append(f"  gap {gap:8.1f}  {t1 - t0:9.1f}  {e.name[:90]}")
            self.row("profile_us", e.name[:60], f"8K {setting}", t1 - t0, "us", f"gap_before={gap:.1f}")
            prev = t1
        if last:
            span = last[-1].time_range.end - last[0].time_range.start
            lines.append(f"  span {span:.1f} us, kernels {busy:.1f} us, idle {span - busy:.1f} us")
            if calls:
                lines.append(f"  the last call's first kernel started {last[0].time_range.start - calls[-1].time_range.start:.1f}"
                             " us after the call began on the host")
        lines += host
        text = "\n".join(lines)
        with open(os.path.join(self.a.out, "bwd_s6_profile.txt"), "w") as f:
            f.write(text + "\n")
        self.log(text)
        os.environ.pop("STREAMKL_BWD_STREAMS", None)
        del d

    def check_streams(self, ok):
        """The API's second-stream path (STREAMKL_BWD_STREAMS=1) gives the gradients of the one-stream
        path bitwise (the same kernels; only the launch streams differ)."""
        H, n = CHECK_SHAPE_TINY if self.a.tiny else CHECK_SHAPE
        for s in SETTINGS:
            if self.left() < 3 or (ok is not None and ("api", s, False) not in ok):
                self.log(f"check streams {s}: skipped ({'budget' if self.left() < 3 else 'not prewarmed'})")
                continue
            d = self.inputs(H, n, self.D, seed=11)
            try:
                a, b = self.api_grads(d, s, False), self.api_grads(d, s, True)
                self.sync()
                same = all(self.torch.equal(x, y) for x, y in zip(a, b))
                self.row("check_streams", "api separate pack", f"{s} H={H} N={n}", float(same), "bool",
                         "bitwise equal" if same else "FAIL: streams change the gradients")
                self.log(f"check streams {s}: {'bitwise equal ok' if same else 'FAIL'}")
                if not same:
                    self.lines.append(f"CHECK FAIL streams {s}")
            except Exception as exc:
                self.log(f"check streams {s}: ERROR {type(exc).__name__}: {str(exc)[:200]}")

    def checks(self, ok):
        """Each candidate vs float64 at a small shape (H = 16, N = 384: the 8K kernels' integer
        specialisations), relative to the reference kernel's own error: err <= 1.5 x ref + 1e-3."""
        torch = self.torch
        from bwd_sweep import Direct
        from streamkl_bench.providers import dense_kl
        H, n = CHECK_SHAPE_TINY if self.a.tiny else CHECK_SHAPE
        for causal in (False, True):
            d = self.inputs(H, n, self.D, seed=7 + causal)
            fwd = self.forward(d, causal)
            for s in SETTINGS:
                if self.left() < 4:
                    self.log("checks: skipped (budget)")
                    return
                names = SET_TRAIN[s]
                x64 = {k: d[k].detach().double().requires_grad_(k in names) for k in ("q1", "k1", "q2", "k2")}
                kl64 = dense_kl(x64["q1"], x64["k1"], x64["q2"], x64["k2"], causal=causal, cdt=torch.float64)
                dq64, dk64 = torch.autograd.grad(kl64, [x64[k] for k in names], d["g"].double())
                direct = Direct(torch, d, fwd, s, causal=causal)
                base = {}
                for c in self.cands:
                    if not c.runs("8K causal" if causal else "8K") or c.probe or self.left() < 4:
                        continue
                    try:
                        out = c.launch(direct)
                        self.sync()
                        err = rel(out, {"dk": dk64, "dq": dq64, "fused": (dq64, dk64)}[c.kind])
                        if is_ref(c):
                            base[c.kind] = err
                        b = base.get(c.kind)
                        good = math.isfinite(err) and (b is None or err <= 1.5 * b + 1e-3)
                        label = f"{s}{' causal' if causal else ''}"
                        self.row("check_err_vs_f64", c.name, f"{label} H={H} N={n}", err, "rel",
                                 (f"ref={b:.2e}" if b is not None else "") + ("" if good else " FAIL"))
                        self.log(f"check {label:9s} {c.name:36s} err {err:.2e}" + (f" (ref {b:.2e})" if b else "")
                                 + (" ok" if good else " FAIL"))
                        if not good:
                            self.lines.append(f"CHECK FAIL {label} {c.name}: err {err:.2e} vs ref {b}")
                    except Exception as exc:
                        self.log(f"check {s} {c.name}: ERROR {type(exc).__name__}: {str(exc)[:200]}")


_SIDE = []


def beside(torch, first, second):
    """``first()`` on the current stream and ``second()`` on a second one, forked before and
    joined after (as _launch.backward does with STREAMKL_BWD_STREAMS=1)."""
    if not _SIDE:
        _SIDE.append(torch.cuda.Stream())
    main, side = torch.cuda.current_stream(), _SIDE[0]
    side.wait_stream(main)
    first()
    with torch.cuda.stream(side):
        second()
    main.wait_stream(side)


def rel(a, b):
    if isinstance(a, tuple):
        return max(rel(x, y) for x, y in zip(a, b))
    a, b = a.double(), b.double()
    return ((a - b).norm() / max(b.norm().item(), 1e-30)).item()


# -- prewarm ------------------------------------------------------------------------------------------
def worker(r, jobfile):
    from bwd_sweep import Direct
    torch = r.torch
    with open(jobfile) as f:
        jobs = json.load(f)
    n = 64 if r.a.tiny else 2048
    d = r.inputs(r.H, n, r.D)
    fwd = tuple(torch.zeros((1, r.H, n), device=r.dev, dtype=torch.float32) for _ in range(3))
    by_name = {c.name: c for c in r.cands}
    for j in jobs:
        t = time.perf_counter()
        try:
            if j["name"] == "fwd":  # the untuned forward (Triton or Gluon: what time_shape / checks run)
                dd = r.inputs(j["H"], j["n"], r.D, nk=j["nk"])
                r.forward(dd, j["causal"])
                del dd
            elif j["name"] == "apiauto":  # time_auto's kernels: every tuner candidate, at 4K (the
                # separate mode as at 8K; the same specialisations), and the tuned forward's
                dd = r.inputs(r.H, 4 * K, r.D, seed=21)
                r.auto_fb(dd, j["s"])
                del dd
            elif j["name"] == "api":  # the API calls of check_streams (their own specialisations)
                H_c, n_c = CHECK_SHAPE_TINY if r.a.tiny else CHECK_SHAPE
                dd = r.inputs(H_c, n_c, r.D, seed=11)
                r.api_grads(dd, j["s"], False)
                r.api_grads(dd, j["s"], True)
            else:
                by_name[j["name"]].launch(Direct(torch, d, fwd, j["s"], causal=j["causal"]))
            r.sync()
            print(f"S6 ok {json.dumps(j)} {time.perf_counter() - t:.1f}s", flush=True)
        except Exception as exc:
            print(f"S6 fail {json.dumps(j)} {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return 0


def prewarm(r, limit_s):
    """Compile every (candidate, setting, causal) in worker processes; returns the set that compiled."""
    H_c, n_c = CHECK_SHAPE_TINY if r.a.tiny else CHECK_SHAPE
    shapes = SHAPES_TINY if r.a.tiny else SHAPES
    # the longest first: the tuned auto path compiles every candidate (time_auto)
    jobs = [] if r.a.tiny else [dict(name="apiauto", s=s, causal=False) for s in SETTINGS]
    jobs += [dict(name="fwd", s="s1", causal=c, H=r.H, n=nq, nk=nk) for _, nq, nk, c in shapes[:2]]
    jobs += [dict(name="fwd", s="s1", causal=c, H=H_c, n=n_c, nk=n_c) for c in (False, True)]
    jobs += [dict(name="fwd", s="s1", causal=c, H=r.H, n=nq, nk=nk) for _, nq, nk, c in shapes[2:]]
    for causal in (False, True):  # (N_Q, N_K % 16 == 0 everywhere: the same kernels at every shape)
        for c in r.cands:
            for s in ("s1", "s2", "both"):
                if any(c.runs(tag) and s in shape_settings(tag) for tag, _, _, cz in shapes if cz == causal):
                    jobs.append(dict(name=c.name, s=s, causal=causal))
    jobs += [dict(name="api", s=s, causal=False) for s in SETTINGS]  # check_streams' (last)
    nw = r.a.workers or max(1, min(14, (os.cpu_count() or 4) - 2))
    nw = min(nw, len(jobs))
    long = [j for j in jobs if j["name"] == "apiauto"][:max(0, nw - 1)]  # a worker each, nothing else
    rest = [j for j in jobs if j not in long]
    nr = nw - len(long)
    plans = [[j] for j in long] + [rest[i::nr] for i in range(nr)]
    tmp = os.path.join(r.a.out, "prewarm_s6")
    os.makedirs(tmp, exist_ok=True)
    procs = []
    for i, p in enumerate(plans):
        jf = os.path.join(tmp, f"jobs_{i}.json")
        with open(jf, "w") as f:
            json.dump(p, f)
        lf = open(os.path.join(tmp, f"worker_{i}.out"), "w")
        args = [sys.executable, os.path.abspath(__file__), r.a.out, "--_worker", jf] + (["--tiny"] if r.a.tiny else [])
        if r.a.only:
            args += ["--only", r.a.only]
        procs.append((subprocess.Popen(args, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True), lf))
    r.log(f"prewarm: {len(jobs)} jobs on {nw} workers (limit {limit_s:.0f} s)")
    end = time.perf_counter() + limit_s
    for p, lf in procs:
        try:
            p.wait(timeout=max(0.1, end - time.perf_counter()))
        except subprocess.TimeoutExpired:
            p.kill()  # a worker this script started, by its own handle
            p.wait()
        lf.close()
    ok, nfail, nok = set(), 0, 0
    for i in range(len(plans)):
        with open(os.path.join(tmp, f"worker_{i}.out")) as f:
            for line in f:
                if line.startswith("S6 ok "):
                    nok += 1
                    j = json.loads(line[6:line.index("}") + 1])
                    ok.add((j["name"], j["s"], j["causal"]))
                elif line.startswith("S6 fail "):
                    nfail += 1
                    r.log(f"prewarm {line.strip()[:300]}")
    r.log(f"prewarm: {nok} ok, {nfail} failed, {len(jobs) - nok - nfail} not finished")
    return ok


def main(argv=None):
    a = parse(argv)
    if a.budget_s is None:
        a.budget_s = 300.0 if a.tiny else 74.0
    if a.tiny:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    r = S6(a)
    if a._worker:
        return worker(r, a._worker)
    import torch
    import triton
    r.log(f"device {'cpu' if a.tiny else torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}; budget {a.budget_s:.0f} s")
    dog = threading.Timer(max(1.0, a.budget_s - 2.0), lambda: (r.finish("watchdog"), os._exit(0)))
    dog.daemon = True
    dog.start()
    try:
        ok = prewarm(r, 20.0 if a.tiny else min(38.0, 0.5 * a.budget_s))
        if a.tiny:  # the interpreter compiles nothing: run everything whether its worker got to it or not
            ok = None
        for tag, nq, nk, causal in SHAPES_TINY if a.tiny else SHAPES:
            try:
                r.time_shape(tag, nq, nk, causal, ok)
                if tag == "8K" and not a.tiny:
                    r.time_auto(ok)
                    try:
                        r.profile_auto()
                    except Exception as exc:
                        r.log(f"profile: ERROR {type(exc).__name__}: {str(exc)[:300]}")
            except Exception as exc:
                r.log(f"timing {tag}: ERROR {type(exc).__name__}: {exc}")
                r.logf.write(traceback.format_exc())
        try:
            r.checks(ok)
            r.check_streams(ok)
        except Exception as exc:
            r.log(f"checks: ERROR {type(exc).__name__}: {exc}")
            r.logf.write(traceback.format_exc())
    except KeyboardInterrupt:
        r.log("interrupted: writing what there is")
    finally:
        dog.cancel()
        r.finish("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
