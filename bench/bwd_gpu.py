"""The backward kernel variants on the GPU (issue 14, the Triton half): checks, then timings.

    python bench/bwd_gpu.py OUT [--quick] [--no-compile] [--workers N]

1. prewarm: every call below once, at small shapes with the same Triton specialisations, in
   parallel worker processes (fills Triton's on-disk cache, so the serial part compiles nothing).
2. check: each variant (STREAMKL_BWD_VARIANT) vs float64 (``dense_kl`` in float64, small shapes)
   and vs the old kernels ("ptr"), bf16/fp16, settings 1/2/both, causal or not, GQA, D1 != D2.
   Pass: relative error vs float64 <= 1.5x the old kernels' + 1e-3 (both printed).
3. time: backward = fwd+bwd - fwd (``do_bench`` medians) of the old kernels (fused, separate;
   their configs tuned as today), each new variant, SDPA fwd and fwd+bwd (default dispatch), and
   torch.compile of the eager materialised loss (setting 1, 8K, non-causal); at every timed shape
   the variant's gradients are also compared with the old fused kernel's (max rel. Frobenius).
Writes OUT/bwd_gpu.csv (measure, provider, shape, value, unit, note), OUT/bwd_gpu.log; the table
of backward times and ratios to SDPA's backward is printed last. A failing variant is reported
and skipped; the run goes on. --quick: N = 8K, 16K; settings 1 and 2 (about 100 s on one H200).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
os.environ.setdefault("STREAMKL_TUNING_CACHE", "0")  # tune in this run (no stale on-disk choices)

K = 1024
# (name, bwd_mode, STREAMKL_BWD_VARIANT or None for the default candidate set, tuned): tuned = the
# tuner times every tile config of that variant (_tuning.bwd_variant_candidates); untuned = its
# first config (quick mode keeps compiles down: each tile config is one more compile per shape class)
OLD = [("old-fused", "fused", "ptr", True), ("old-separate", "separate", "ptr", True)]
# --quick: timed first (the table's columns), in this order; then, budget permitting, EXTRA_QUICK at 8K
NEW_QUICK = [("tma+trans+fold+rows+reduce/fused", "fused", "tma+trans+fold+rows+reduce", True),
             ("tma+trans+fold+rows/separate", "separate", "tma+trans+fold+rows", False)]
EXTRA_QUICK = [("auto", "auto", None, True),
               ("tma+trans+fold+reduce/fused", "fused", "tma+trans+fold+reduce", False)]
NEW_FULL = [v[:3] + (True,) for v in NEW_QUICK + EXTRA_QUICK[1:]] + [
    ("tma+trans+reduce/fused", "fused", "tma+trans+reduce", True),
    ("tma+trans+fold/separate", "separate", "tma+trans+fold", True),
    ("tma+trans/fused", "fused", "tma+trans", True),
    ("tma/separate", "separate", "tma", True),
    ("trans+fold/fused", "fused", "trans+fold", True),
    ("auto", "auto", None, True)]
# gradients of a variant vs the old fused kernels at a timed shape (bf16 outputs: a few roundings
# of 2^-8 give ~4e-3 relative Frobenius): above this the variant is reported as a MISMATCH
MISMATCH = 2e-2
SET_TRAIN = {"s1": ("q2", "k2"), "s2": ("q1", "k1"), "both": ("q1", "k1", "q2", "k2")}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--workers", type=int, default=0, help="prewarm processes (0: CPU count - 2, at most 15)")
    ap.add_argument("--budget-s", type=float, default=None, help="stop timing past this many seconds")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU smoke run of this script under TRITON_INTERPRET=1 (tiny shapes, no GPU)")
    ap.add_argument("--grid", action="store_true",
                    help="also time the no-regression grid (both settings, GQA, D1 != D2, small N_Q at N_K = 32K); "
                         "on by default without --quick")
    ap.add_argument("--grid-only", action="store_true", help="checks, then only the no-regression grid")
    ap.add_argument("--sweep", action="store_true",
                    help="only the tile sweep, timing probes and baselines at 8K non-causal s1/s2 (bench/bwd_sweep.py)")
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


class Run:
    def __init__(self, a):
        import torch

        import streamkl_gpu
        from streamkl_bench.providers import ProvidersMixin, dense_kl

        self.a, self.torch, self.dense_kl = a, torch, dense_kl
        self.ak = streamkl_gpu.attention_kl
        self.dev = torch.device("cpu" if a.tiny else "cuda")
        self.H, self.D = (2, 32) if a.tiny else (32, 128)
        os.makedirs(a.out, exist_ok=True)
        self.rows = []
        self.logf = open(os.path.join(a.out, "bwd_gpu.log") if not a._worker else os.devnull, "a")
        self.t0 = time.perf_counter()
        # (--grid-only --quick: 95 s, under the 110 s the final run gives it, so that it writes its outputs)
        quick_budget = 95.0 + (60.0 if a.grid and not a.grid_only else 0.0)
        if a.sweep:  # the final run's slot is 100 s: its outputs must be written before the timeout
            quick_budget = 88.0
        self.budget = a.budget_s if a.budget_s is not None else (quick_budget if a.quick else 420.0)

        class _P(ProvidersMixin):  # the bench's SDPA / torch.compile closures (self.torch, self.ak, self.get)
            pass
        self.prov = _P()
        self.prov.torch, self.prov.ak, self.prov.get = torch, self.ak, (lambda *x, **k: None)
        self.ns = [64] if a.tiny else [8 * K, 16 * K]
        self.settings = ["s1", "s2"] if a.quick else ["s1", "s2", "both"]
        self.variants = OLD + (NEW_QUICK if a.quick else NEW_FULL)
        self.extras = EXTRA_QUICK if a.quick else []  # timed after everything else, at 8K only
        self.grid = a.grid or a.grid_only or (not a.quick and not a.tiny)
        self.mismatches = 0  # timed shapes where a variant's gradients differ from the old kernels'
        self.compile_warm = False  # the prewarm workers compiled the torch.compile baseline

    # -- helpers ---------------------------------------------------------------------------------
    def log(self, msg):
        line = f"[{time.perf_counter() - self.t0:6.1f}s] {msg}"
        print(line, flush=True)
        self.logf.write(line + "\n")
        self.logf.flush()

    def row(self, measure, provider, shape, value, unit, note=""):
        self.rows.append(dict(measure=measure, provider=provider, shape=shape, value=value, unit=unit, note=note))

    def left(self):
        return self.budget - (time.perf_counter() - self.t0)

    def inputs(self, H, NQ, NK, D1, D2, dtype, HK1=None, HK2=None, seed=0):
        torch = self.torch
        gen = torch.Generator(device=self.dev)
        gen.manual_seed(1234 + seed)
        d = {}
        for name, shp in (("q1", (1, H, NQ, D1)), ("k1", (1, HK1 or H, NK, D1)),
                          ("q2", (1, H, NQ, D2)), ("k2", (1, HK2 or H, NK, D2))):
            d[name] = torch.randn(shp, generator=gen, device=self.dev, dtype=dtype)
        d["g"] = torch.randn((1, H, NQ), generator=gen, device=self.dev, dtype=torch.float32)
        return d

    def ours_fb(self, d, causal, setting, mode, variant, tuned=False):
        """Gradients of the trained side through attention_kl with ``variant`` forced."""
        torch = self.torch
        set_variant(variant)
        os.environ["STREAMKL_AUTOTUNE"] = "1" if tuned else "0"
        x = {n: d[n].detach().requires_grad_(n in SET_TRAIN[setting]) for n in ("q1", "k1", "q2", "k2")}
        kl = self.ak(x["q1"], x["k1"], x["q2"], x["k2"], causal=causal, bwd_mode=mode)
        return torch.autograd.grad(kl, [x[n] for n in SET_TRAIN[setting]], d["g"])

    def sync(self):
        if not self.a.tiny:
            self.torch.cuda.synchronize()

    def bench(self, fn, n):
        if self.a.tiny:  # CPU smoke run: one timed call
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        from triton.testing import do_bench
        rep = 60 if self.a.quick else 150
        if n >= 16 * K:
            rep *= 2
        return do_bench(fn, warmup=10, rep=rep, return_mode="median")

    # -- checks ------------------------------------------------------------------------------------
    def check_cases(self):
        torch = self.torch
        bf, fp = torch.bfloat16, torch.float16
        # name, H, HK1, HK2, NQ, NK, D1, D2, dtype, causal, setting
        # --quick: two cases with the timed kernels' specialisations (H = 16, N % 16 == 0, bf16,
        # D = 128), so they compile nothing new; the full list adds fp16, GQA, D1 != D2, ragged N
        cases = [("s1-causal-bf16", 16, 16, 16, 384, 384, 128, 128, bf, True, "s1"),
                 ("s2-nq<nk-bf16", 16, 16, 16, 256, 384, 128, 128, bf, False, "s2")]
        if not self.a.quick:
            cases += [("s2-gqa-nq<nk-bf16", 4, 2, 2, 256, 384, 128, 128, bf, False, "s2"),
                      ("both-gqa-d128/64-nq>nk-fp16", 4, 4, 1, 384, 256, 128, 64, fp, True, "both"),("s1-ragged-d64/128-fp16", 2, 2, 2, 250, 250, 64, 128, fp, False, "s1"),
                      ("s2-causal-gqa-bf16", 4, 1, 4, 300, 300, 128, 128, bf, True, "s2"),
                      ("both-full-bf16", 2, 2, 2, 256, 256, 128, 128, bf, False, "both")]
        if self.a.tiny:  # the same cases at interpreter sizes (bf16 dots run in fp32 there)
            cases = [(c[0], 2, max(1, c[2] * 2 // c[1]), max(1, c[3] * 2 // c[1]), c[4] // 10, c[5] // 10,
                      c[6] // 8, c[7] // 8, c[8], c[9], c[10]) for c in cases]
        return cases

    def check_variants(self):
        return [v for v in self.variants + self.extras if v[2] is not None]

    def run_checks(self):
        torch = self.torch
        fails = 0
        for (name, H, HK1, HK2, NQ, NK, D1, D2, dt, causal, setting) in self.check_cases():
            d = self.inputs(H, NQ, NK, D1, D2, dt, HK1, HK2, seed=NQ + NK)
            req = SET_TRAIN[setting]
            x64 = {n: d[n].detach().double().requires_grad_(n in req) for n in ("q1", "k1", "q2", "k2")}
            kl64 = self.dense_kl(x64["q1"], x64["k1"], x64["q2"], x64["k2"], causal=causal, cdt=torch.float64)
            ref = torch.autograd.grad(kl64, [x64[n] for n in req], d["g"].double())
            old_err = None
            results = {}
            for vname, mode, variant, _ in self.check_variants():
                if self.left() < -10:  # past the budget (the checks come after the timings)
                    self.log(f"check {name} {vname}: skipped (budget)")
                    self.row("check_err_vs_f64", vname, name, float("nan"), "rel", "skipped(budget)")
                    continue
                try:
                    gr = self.ours_fb(d, causal, setting, mode, variant)
                    self.sync()
                    err = max(rel(a, b) for a, b in zip(gr, ref))
                    results[vname] = gr
                    if vname == "old-fused":
                        old_err = err
                    vs_old = (max(rel(a, b) for a, b in zip(gr, results["old-fused"]))
                              if "old-fused" in results else float("nan"))
                    tol = 1.5 * old_err + 1e-3 if old_err is not None else 3e-2
                    ok = math.isfinite(err) and err <= tol
                    fails += not ok
                    self.row("check_err_vs_f64", vname, name, err, "rel", f"tol={tol:.2e} vs_old={vs_old:.2e}"
                             + ("" if ok else " FAIL"))
                    self.log(f"check {name:28s} {vname:30s} err {err:.2e} (tol {tol:.2e}) vs old {vs_old:.2e}"
                             f" {'ok' if ok else 'FAIL'}")
                except Exception as exc:
                    fails += 1
                    self.row("check_err_vs_f64", vname, name, float("nan"), "rel", f"ERROR {type(exc).__name__}")
                    self.log(f"check {name} {vname}: ERROR {type(exc).__name__}: {str(exc)[:300]}")
                    self.logf.write(traceback.format_exc())
        set_variant(None)
        self.log(f"checks: {fails} failed")
        return fails

    # -- timing ----------------------------------------------------------------------------------
    def timed_shapes(self):
        return [(n, c, s) for n in self.ns for c in (False, True) for s in self.settings]

    def run_timing(self):
        torch = self.torch
        H, D = self.H, self.D
        bwd = {}  # (shape, provider) -> ms
        d_keep = {}
        for n in self.ns:
            for causal in (False, True):
                shape = f"N={fmt_n(n)}{' causal' if causal else ''}"
                d = self.inputs(H, n, n, D, D, torch.bfloat16, seed=n)
                # SDPA (default dispatch; q = q1, k = k1, v = k2 as in bench_gpu.py)
                try:
                    self.prov.prep_sdpa_bwd([d])
                    f_fwd = self.prov.f_sdpa(causal)
                    f_fb = self.prov.f_sdpa(causal, backward=True)
                    t_f = self.bench(lambda: f_fwd(d), n)
                    t_fb = self.bench(lambda: f_fb(d), n)
                    self.row("fwd", "sdpa", shape, t_f, "ms")
                    self.row("fwd+bwd", "sdpa", shape, t_fb, "ms")
                    self.row("bwd", "sdpa", shape, t_fb - t_f, "ms", "fwd+bwd - fwd")
                    bwd[(shape, "sdpa")] = t_fb - t_f
                    self.log(f"{shape:14s} sdpa fwd {t_f:.3f} fwd+bwd {t_fb:.3f} bwd {t_fb - t_f:.3f} ms")
                except Exception as exc:
                    self.log(f"{shape} sdpa: ERROR {type(exc).__name__}: {str(exc)[:300]}")
                # the forward alone, tuned and untuned (each fwd+bwd subtracts the one it ran with)
                fwd_ms = {}
                for tuned in sorted({v[3] for v in self.variants}, reverse=True):
                    os.environ["STREAMKL_AUTOTUNE"] = "1" if tuned else "0"
                    fwd_ms[tuned] = self.bench(
                        lambda: self.ak(d["q1"], d["k1"], d["q2"], d["k2"], causal=causal), n)
                    self.row("fwd", "ours" if tuned else "ours(untuned)", shape, fwd_ms[tuned], "ms")
                for setting in self.settings:
                    self.time_variants(d, f"{shape} {setting}", causal, setting, fwd_ms, bwd.get((shape, "sdpa")),
                                       self.variants, bwd)
                d_keep[(n, causal)] = (d, fwd_ms)
                if n != self.ns[0]:
                    d_keep.pop((n, causal))
                del d
                if not self.a.tiny:
                    torch.cuda.empty_cache()
            if n == 8 * K and not self.a.no_compile:  # the torch.compile target is at 8K
                if self.a.quick and not self.compile_warm:  # compiling it here would take the budget
                    self.log("torch.compile: skipped (its prewarm compile did not finish)")
                elif self.left() > 10:
                    self.time_compile(bwd)
                else:
                    self.log("torch.compile: skipped (budget)")
        # optional: the extra variants at the first N (after every main measurement)
        for (n, causal), (d, fwd_ms) in list(d_keep.items()):
            shape = f"N={fmt_n(n)}{' causal' if causal else ''}"
            for tuned in {v[3] for v in self.extras} - set(fwd_ms):
                os.environ["STREAMKL_AUTOTUNE"] = "1" if tuned else "0"
                fwd_ms[tuned] = self.bench(lambda: self.ak(d["q1"], d["k1"], d["q2"], d["k2"], causal=causal), n)
            for setting in self.settings:
                if self.extras and self.left() > 5:
                    self.time_variants(d, f"{shape} {setting}", causal, setting, fwd_ms, bwd.get((shape, "sdpa")),
                                       OLD[:1] + self.extras, bwd, skip_first=True)
        d_keep.clear()
        return bwd

    def time_variants(self, d, sshape, causal, setting, fwd_ms, sd, variants, bwd, skip_first=False):
        """fwd+bwd of each variant on inputs ``d``; backward = that minus the forward (``fwd_ms``,
        per tuning flag); gradients compared with the first variant's (the old fused kernels;
        ``skip_first``: that one only as the gradient reference, not timed again)."""
        base = None
        for i, (vname, mode, variant, tuned) in enumerate(variants):
            if skip_first and i == 0:
                try:
                    base = self.ours_fb(d, causal, setting, mode, variant, tuned)
                except Exception as exc:
                    self.log(f"{sshape} {vname} (reference): ERROR {type(exc).__name__}: {str(exc)[:200]}")
                continue
            if self.left() < 0:
                self.log(f"{sshape} {vname}: skipped (budget)")
                self.row("bwd", vname, sshape, float("nan"), "ms", "skipped(budget)")
                continue
            try:
                gr = self.ours_fb(d, causal, setting, mode, variant, tuned)  # compiles / tunes
                self.sync()
                if base is None:
                    base = gr
                diff = max(rel(a, b) for a, b in zip(gr, base))
                if not diff <= MISMATCH:  # NaN included
                    self.mismatches += 1
                    self.log(f"{sshape} {vname}: MISMATCH gradients vs {variants[0][0]}: rel {diff:.2e} > {MISMATCH}")
                del gr
                t = self.bench(lambda: self.ours_fb(d, causal, setting, mode, variant, tuned), d["q1"].shape[2])
                b_ms = t - fwd_ms[tuned]
                bwd[(sshape, vname)] = b_ms
                plan = plan_of(variant, mode, tuned)
                note = f"vs_{variants[0][0]}_grad={diff:.2e} plan={plan}"
                self.row("fwd+bwd", vname, sshape, t, "ms", note)
                self.row("bwd", vname, sshape, b_ms, "ms", note)
                if sd:
                    self.row("bwd_ratio_sdpa", vname, sshape, b_ms / sd, "x")
                self.log(f"{sshape:17s} {vname:30s} fwd+bwd {t:8.3f} bwd {b_ms:8.3f} ms"
                         f"{'' if not sd else f' = {b_ms / sd:.2f}x sdpa'}  grad vs {variants[0][0]} {diff:.1e}"
                         f"  {plan}")
            except Exception as exc:
                self.row("bwd", vname, sshape, float("nan"), "ms", f"ERROR {type(exc).__name__}")
                self.log(f"{sshape} {vname}: ERROR {type(exc).__name__}: {str(exc)[:400]}")
                self.logf.write(traceback.format_exc())
        set_variant(None)

    # the no-regression grid of issue 14 (full mode): both settings, GQA, D1 != D2, small N_Q
    # with N_K = 32K; (label, H, HK1, HK2, NQ, NK, D1, D2, causal, setting)
    GRID = [("both N=8K", 32, 32, 32, 8 * K, 8 * K, 128, 128, False, "both"),
            ("both N=8K causal", 32, 32, 32, 8 * K, 8 * K, 128, 128, True, "both"),
            ("gqa8 N=8K s1", 32, 8, 8, 8 * K, 8 * K, 128, 128, False, "s1"),
            ("gqa8 N=8K causal s2", 32, 8, 8, 8 * K, 8 * K, 128, 128, True, "s2"),
            ("d128/64 N=8K s1", 32, 32, 32, 8 * K, 8 * K, 128, 64, False, "s1"),
            ("d64/128 N=8K s2", 32, 32, 32, 8 * K, 8 * K, 64, 128, False, "s2"),
            ("nq16 nk32K s1", 32, 32, 32, 16, 32 * K, 128, 128, False, "s1"),
            ("nq512 nk32K s2", 32, 32, 32, 512, 32 * K, 128, 128, False, "s2"),
            ("nq512 nk32K both", 32, 32, 32, 512, 32 * K, 128, 128, False, "both")]
    GRID_VARIANTS = [("old-fused", "fused", "ptr", True), ("old-separate", "separate", "ptr", True),
                     ("auto", "auto", None, True),
                     ("tma+trans+fold+rows+reduce/fused", "fused", "tma+trans+fold+rows+reduce", True),
                     ("tma+trans+fold+rows/separate", "separate", "tma+trans+fold+rows", True)]

    def grid_cases(self):
        if not self.a.tiny:
            return self.GRID
        return [(c[0], 2, max(1, c[2] // 16), max(1, c[3] // 16), max(16, c[4] // 128), max(16, c[5] // 128),
                 c[6] // 4, c[7] // 4) + c[8:] for c in self.GRID]  # CPU smoke sizes

    def run_grid(self, bwd):
        torch = self.torch
        for (label, H, HK1, HK2, NQ, NK, D1, D2, causal, setting) in self.grid_cases():
            if self.left() < 0:
                self.log(f"grid {label}: skipped (budget)")
                continue
            try:
                d = self.inputs(H, NQ, NK, D1, D2, torch.bfloat16, HK1, HK2, seed=NQ + NK)
                os.environ["STREAMKL_AUTOTUNE"] = "1"
                fwd_ms = {True: self.bench(lambda: self.ak(d["q1"], d["k1"], d["q2"], d["k2"], causal=causal), NK)}
                self.row("fwd", "ours", label, fwd_ms[True], "ms")
                self.time_variants(d, label, causal, setting, fwd_ms, None, self.GRID_VARIANTS, bwd)
                old = min((bwd[(label, v)] for v in ("old-fused", "old-separate") if (label, v) in bwd), default=None)
                for v in self.GRID_VARIANTS[2:]:
                    if old and (label, v[0]) in bwd:
                        self.row("bwd_vs_old_best", v[0], label, bwd[(label, v[0])] / old, "x",
                                 "regression" if bwd[(label, v[0])] > 1.03 * old else "")
                del d
                if not self.a.tiny:
                    torch.cuda.empty_cache()
            except Exception as exc:
                self.log(f"grid {label}: ERROR {type(exc).__name__}: {str(exc)[:300]}")

    def time_compile(self, bwd):
        torch = self.torch
        n, shape = 8 * K, "N=8K s1"
        try:
            d = self.inputs(32, n, n, 128, 128, torch.bfloat16, seed=n)
            comp = self.prov.compiled_kl()
            d2 = {k: (v.detach().requires_grad_(k in SET_TRAIN["s1"]) if k != "g" else v) for k, v in d.items()}
            f_fb = self.prov.f_eager_fb(False, "s1", comp)
            f_fwd = self.prov.f_eager_fwd(False, comp)
            f_fb(d2)
            f_fwd(d)
            self.sync()
            t_fb = self.bench(lambda: f_fb(d2), n)
            t_f = self.bench(lambda: f_fwd(d), n)
            self.row("fwd", "torch.compile", shape, t_f, "ms")
            self.row("fwd+bwd", "torch.compile", shape, t_fb, "ms")
            self.row("bwd", "torch.compile", shape, t_fb - t_f, "ms", "fwd+bwd - fwd")
            bwd[(shape, "torch.compile")] = t_fb - t_f
            bwd[(shape, "torch.compile fwd+bwd")] = t_fb
            self.log(f"{shape} torch.compile fwd {t_f:.3f} fwd+bwd {t_fb:.3f} ms")
        except Exception as exc:
            self.log(f"torch.compile: ERROR {type(exc).__name__}: {str(exc)[:300]}")

    # -- output ------------------------------------------------------------------------------------
    def write(self):
        with open(os.path.join(self.a.out, "bwd_gpu.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["measure", "provider", "shape", "value", "unit", "note"])
            w.writeheader()
            for r in self.rows:
                w.writerow(r)

    def table(self, bwd, fails):
        names = [v[0] for v in self.variants + self.extras]
        lines = ["", f"backward = fwd+bwd - fwd, ms (x SDPA's backward); B=1 H=32 D=128 bf16; checks failed: {fails};"
                 f" gradient mismatches at the timed shapes: {self.mismatches}"]
        lines.append(f"{'shape':18s} {'sdpa':>7s} " + " ".join(f"{nm[:22]:>22s}" for nm in names))
        for n, causal, setting in ([] if self.a.grid_only else self.timed_shapes()):
            shape = f"N={fmt_n(n)}{' causal' if causal else ''}"
            sshape = f"{shape} {setting}"
            sd = bwd.get((shape, "sdpa"))
            cells = []
            for nm in names:
                t = bwd.get((sshape, nm))
                cells.append(f"{'-':>22s}" if t is None else
                             f"{t:9.2f} ({t / sd:5.2f}x)".rjust(22) if sd else f"{t:22.2f}")
            new = [bwd[(sshape, nm)] for nm in names[len(OLD):] if (sshape, nm) in bwd]
            verdict = ""
            if new and sd:
                verdict = f"  best new {min(new) / sd:.2f}x sdpa ({'meets' if min(new) <= 1.4 * sd else 'misses'} 1.4x)"
            lines.append(f"{sshape:18s} {sd if sd else float('nan'):7.2f} " + " ".join(cells) + verdict)
        grid_rows = [r for r in self.rows if r["measure"] == "bwd_vs_old_best"]
        if grid_rows:
            lines.append("no-regression grid: backward / best old backward (> 1.03 = regression)")
            for r in grid_rows:
                lines.append(f"  {r['shape']:20s} {r['provider']:34s} {r['value']:.3f} {r['note']}")
        tc = bwd.get(("N=8K s1", "torch.compile fwd+bwd"))
        if tc:
            best = min((bwd[k] for k in bwd if k[0] == "N=8K s1" and k[1] in names), default=None)
            fwd = next((r["value"] for r in self.rows if r["measure"] == "fwd" and r["provider"] == "ours"
                        and r["shape"] == "N=8K"), None)
            if best is not None and fwd is not None:
                lines.append(f"torch.compile fwd+bwd s1 8K: {tc:.2f} ms; ours (best bwd + fwd) {best + fwd:.2f} ms "
                             f"= {tc / (best + fwd):.2f}x faster")
        text = "\n".join(lines)
        with open(os.path.join(self.a.out, "bwd_gpu_table.txt"), "w") as f:
            f.write(text + "\n")
        print(text, flush=True)


def set_variant(v):
    if v is None:
        os.environ.pop("STREAMKL_BWD_VARIANT", None)
    else:
        os.environ["STREAMKL_BWD_VARIANT"] = v


def plan_of(variant, mode, tuned):
    """The (mode, dK config, dQ config) the last plan under ``variant`` chose (what was timed)."""
    from streamkl_gpu.attention import launch as _launch
    got = [p for sig, p in _launch._PLANS.items() if sig[0] == "bwd" and sig[2][-1] == variant
           and sig[2][3] == mode and sig[3][0] == ("1" if tuned else "0")]
    return "/".join(map(str, got[-1])).replace(" ", "") if got else "?"


def fmt_n(n):
    return f"{n // K}K" if n >= K else str(n)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / max(b.norm().item(), 1e-30)).item()


# -- prewarm --------------------------------------------------------------------------------------
def prewarm_jobs(r):
    """Every kernel specialisation the serial part uses, at small shapes (N = 2048: the same Triton
    integer specialisations as 8K/16K, all % 16; H = 32)."""
    # in priority order (prewarm() keeps it per worker): the main variants, the extras, the checks
    # (--quick: its checks share the timed kernels' specialisations, nothing to prewarm)
    jobs = []
    for j, v in enumerate(r.variants + r.extras):
        for c in (False, True):
            for s in r.settings:
                jobs.append({"t": "fb", "causal": c, "setting": s, "v": j, "tier": 0 if j < len(r.variants) else 1})
    if not r.a.quick:
        jobs += [{"t": "check", "i": i, "v": j, "tier": 2} for i in range(len(r.check_cases()))
                 for j in range(len(r.check_variants()))]
    if r.a.grid_only:
        jobs = [j for j in jobs if j["t"] == "check"]
    if r.grid:
        for i in range(len(r.grid_cases())):
            for j in range(len(r.GRID_VARIANTS)):
                jobs.append({"t": "grid", "i": i, "v": j, "tier": 3})
    if not r.a.no_compile and not r.a.grid_only:
        jobs.insert(0, {"t": "compile", "tier": 0})
    return jobs


def job_cost(r, j):
    """Estimated compiles of a prewarm job (tile configs the tuner tries, both kernels if separate)."""
    if j["t"] == "compile":
        return 8.0
    if j["t"] == "check":
        return 2.0 if r.check_variants()[j["v"]][1] == "separate" else 1.0
    _, mode, variant, tuned = (r.GRID_VARIANTS if j["t"] == "grid" else r.variants + r.extras)[j["v"]]
    if variant is None:  # the default candidate set: old and new
        return 8.0
    per_kernel = (2 if variant == "ptr" else 3) if tuned else 1
    return 1.0 + per_kernel * (2 if mode != "fused" else 1)


def worker(r, jobfile):
    with open(jobfile) as f:
        jobs = json.load(f)
    for j in jobs:
        t = time.perf_counter()
        try:
            if j["t"] == "check":
                (name, H, HK1, HK2, NQ, NK, D1, D2, dt, causal, setting) = r.check_cases()[j["i"]]
                vname, mode, variant, _ = r.check_variants()[j["v"]]
                d = r.inputs(H, NQ, NK, D1, D2, dt, HK1, HK2)
                r.ours_fb(d, causal, setting, mode, variant)
            elif j["t"] == "fb":
                vname, mode, variant, tuned = (r.variants + r.extras)[j["v"]]
                n = 64 if r.a.tiny else 2048
                d = r.inputs(r.H, n, n, r.D, r.D, r.torch.bfloat16)
                os.environ["STREAMKL_AUTOTUNE"] = "1"  # the tuned forward's candidates too
                r.ak(d["q1"], d["k1"], d["q2"], d["k2"], causal=j["causal"])
                r.ours_fb(d, j["causal"], j["setting"], mode, variant, tuned)
            elif j["t"] == "grid":  # the same specialisations at N <= 2048
                (label, H, HK1, HK2, NQ, NK, D1, D2, causal, setting) = r.grid_cases()[j["i"]]
                vname, mode, variant, tuned = r.GRID_VARIANTS[j["v"]]
                d = r.inputs(H, min(NQ, 2048), min(NK, 2048), D1, D2, r.torch.bfloat16, HK1, HK2)
                os.environ["STREAMKL_AUTOTUNE"] = "1"
                r.ak(d["q1"], d["k1"], d["q2"], d["k2"], causal=causal)
                r.ours_fb(d, causal, setting, mode, variant, tuned)
            elif j["t"] == "compile":
                d = r.inputs(32, 8 * K, 8 * K, 128, 128, r.torch.bfloat16)
                comp = r.prov.compiled_kl()
                d2 = {k: (v.detach().requires_grad_(k in SET_TRAIN["s1"]) if k != "g" else v) for k, v in d.items()}
                r.prov.f_eager_fb(False, "s1", comp)(d2)
                r.prov.f_eager_fwd(False, comp)(d)
            r.sync()
            print(f"JOB ok {json.dumps(j)} {time.perf_counter() - t:.1f}s", flush=True)
        except Exception as exc:
            print(f"JOB fail {json.dumps(j)} {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        if not r.a.tiny:
            r.torch.cuda.empty_cache()
    return 0


def prewarm(r, limit_s):
    jobs = prewarm_jobs(r)
    n = r.a.workers or max(1, min(15, (os.cpu_count() or 4) - 2))
    n = min(n, len(jobs))
    plans = [[] for _ in range(n)]
    loads = [0.0] * n
    # by priority tier, longest first within a tier, each to the least loaded worker: every
    # worker's queue is in tier order, so the main measurements' kernels compile first
    for est, j in sorted(((job_cost(r, j), j) for j in jobs), key=lambda x: (x[1]["tier"], -x[0])):
        w = loads.index(min(loads))
        plans[w].append(j)
        loads[w] += est
    procs = []
    tmp = os.path.join(r.a.out, "prewarm")
    os.makedirs(tmp, exist_ok=True)
    for i, p in enumerate(plans):
        jf = os.path.join(tmp, f"jobs_{i}.json")
        with open(jf, "w") as f:
            json.dump(p, f)
        lf = open(os.path.join(tmp, f"worker_{i}.out"), "w")
        args = [sys.executable, os.path.abspath(__file__), r.a.out, "--_worker", jf]
        if r.a.quick:
            args.append("--quick")
        if r.a.no_compile:
            args.append("--no-compile")
        if r.a.tiny:
            args.append("--tiny")
        if r.a.grid:
            args.append("--grid")
        if r.a.grid_only:
            args.append("--grid-only")
        procs.append((subprocess.Popen(args, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True), lf))
    r.log(f"prewarm: {len(jobs)} jobs on {n} workers (limit {limit_s:.0f} s)")
    end = time.perf_counter() + limit_s
    for p, lf in procs:
        try:
            p.wait(timeout=max(0.1, end - time.perf_counter()))
        except subprocess.TimeoutExpired:
            p.kill()  # a worker this script started, by its own handle
            p.wait()
        lf.close()
    ok = fail = 0
    for i in range(len(plans)):
        with open(os.path.join(tmp, f"worker_{i}.out")) as f:
            for line in f:
                if line.startswith("JOB ok"):
                    ok += 1
                    if '"t": "compile"' in line:
                        r.compile_warm = True
                elif line.startswith("JOB fail"):
                    fail += 1
                    r.log(f"prewarm {line.strip()[:300]}")
    r.log(f"prewarm: {ok} ok, {fail} failed, {len(jobs) - ok - fail} not finished")


def main(argv=None):
    a = parse(argv)
    if a.tiny:
        os.environ["TRITON_INTERPRET"] = "1"
        a.no_compile = True
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    r = Run(a)
    if a.sweep:
        import bwd_sweep
        if a._worker:
            with open(a._worker) as f:
                return bwd_sweep.worker(r, json.load(f))
        r.log(f"sweep; device {'cpu' if a.tiny else r.torch.cuda.get_device_name()}")
        try:
            bwd_sweep.run(r)
        finally:
            r.write()
        return 0
    if a._worker:
        return worker(r, a._worker)
    import torch
    import triton
    r.log(f"device {'cpu' if a.tiny else torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    # the prewarm gets up to 40 % of the budget (the workers are stopped then: they would share
    # the GPU with the timings)
    prewarm(r, 30.0 if a.tiny else min(100.0, 0.4 * r.budget) if a.quick else 150.0)
    bwd = {}
    try:  # timings first (the budget may run out), then the checks, then the grid
        if not a.grid_only:
            bwd = r.run_timing()
    except Exception as exc:
        r.log(f"timing: ERROR {type(exc).__name__}: {exc}")
        r.logf.write(traceback.format_exc())
    fails = None
    try:
        fails = r.run_checks()
        if r.grid:
            r.run_grid(bwd)
    except KeyboardInterrupt:  # the runner's SIGINT at its time limit: write what there is
        r.log("interrupted: writing what there is")
    except Exception as exc:
        r.log(f"grid: ERROR {type(exc).__name__}: {exc}")
        r.logf.write(traceback.format_exc())
    finally:
        r.write()
    r.table(bwd, fails)
    return 0


if __name__ == "__main__":
    sys.exit(main())
