#!/usr/bin/env python3
"""The sparse stage's indexer loss (``indexer_kl_topk``) on one GPU: checks vs float64, then timings.

    python bench/indexer_topk_gpu.py OUT_DIR --quick   # <= ~60-100 s on one H200
    python bench/indexer_topk_gpu.py OUT_DIR           # also N = 16K and the GQA-like baselines
    TRITON_INTERPRET=1 python bench/indexer_topk_gpu.py /tmp/x --tiny   # CPU smoke of the script

Configs (issue 10's anchors): dsa = teacher H=128, D=576, H_K=1, scale 192^-0.5; indexer H_I=64,
D_I=128, H_KI=1; gqa = teacher H=32, D=128, H_K=8; indexer H_I=16, D_I=64. Top-k: K = 2048 (DSA),
each row's set K random distinct visible keys (causal; rows with fewer than K visible keys list
them all and pad with -1), in random slot order (as torch.topk returns them). bf16, B = 1.

Checks: (1) small shapes vs the float64 reference (streamkl_ref.indexer_kl_topk and _grad) for
fp32/fp16/bf16 under the project's tolerance rule (ratio 3 x the same-precision PyTorch gather
form's error + floor); (2) DSA-like at N = 8K, K = 2048: 32 sampled rows (incl. the first and the
last) of ours vs the PyTorch gather form in float64 on those rows (the whole problem in float64
does not fit), KL and the gradients' rows dq_idx, dweights; dk_idx vs the fp32 gather form.
Timings (triton.testing.do_bench, median ms; a call over 50 ms: one warm call; peak extra GiB; the
first call of ours / ours_lse tunes the forward over its candidates: tune_fwd_ms rows), in
this order: ours and ours_lse fwd and fwd+bwd (mean loss), launch-config variants of the forward,
the PyTorch gather form (torch.compile, then eager) where it fits; each variant's KL is checked
against the default's. --quick (the final run's limit: 50 s, then SIGINT) runs the DSA 8K point
only, in the order that decides a default: ours and ours_lse, the variants (until 24 s), the
torch.compile forward (if 12 s of the 44 s budget are left), eager; then the checks as far as the
budget goes (skipped ones are printed as SKIPPED; the r5c run passed them all with the default
config). SIGINT prints the summary of what finished. floor_ms = the forward's matmul FLOPs over the used slots (teacher + indexer) at the bf16
rate of an 8192^3 matmul measured in the same run (our forward does the teacher twice: >= 2x).

Outputs: OUT_DIR/topk_bench.csv (long: measure, provider, shape, value, unit, note), topk.log.
Every section survives a failing variant (printed as FAILED with its error). Exit 1 if a check failed.
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

import streamkl_ref  # noqa: E402
from streamkl_ref import testing  # noqa: E402
from streamkl_gpu.indexer import topk as _indexer_topk  # noqa: E402
from streamkl_gpu.indexer.topk import indexer_kl_topk, indexer_kl_topk_naive  # noqa: E402

def _scale(cfg):
    return cfg["scale"] if cfg["scale"] is not None else cfg["D"] ** -0.5


CONFIGS = {
    "dsa": dict(H=128, HK=1, D=576, HI=64, HKI=1, DI=128, scale=192 ** -0.5),
    "gqa": dict(H=32, HK=8, D=128, HI=16, HKI=1, DI=64, scale=None),
    "tiny": dict(H=8, HK=1, D=24, HI=2, HKI=1, DI=16, scale=None),  # --tiny: the code paths on CPU
}
COLUMNS = ["measure", "provider", "shape", "value", "unit", "note"]
T0 = time.time()


class Out:
    def __init__(self, out_dir):
        os.makedirs(out_dir, exist_ok=True)
        self.csv = open(os.path.join(out_dir, "topk_bench.csv"), "w", newline="")
        self.w = csv.DictWriter(self.csv, COLUMNS)
        self.w.writeheader()
        self.log_f = open(os.path.join(out_dir, "topk.log"), "w")
        self.table = []
        self.failed = []

    def log(self, msg):
        line = f"[{time.time() - T0:6.1f}s] {msg}"
        print(line, flush=True)
        self.log_f.write(line + "\n")
        self.log_f.flush()

    def row(self, measure, provider, shape, value, unit, note=""):
        self.w.writerow(dict(measure=measure, provider=provider, shape=shape, value=value, unit=unit, note=note))
        self.csv.flush()
        self.table.append((measure, provider, shape, value, unit, note))


def make_problem(cfg, N, K, dtype, device, seed=0, causal=True, B=1):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=gen)).to(device=device, dtype=dtype)

    q = rnd(B, cfg["H"], N, cfg["D"])
    k = rnd(B, cfg["HK"], N, cfg["D"])
    q_idx = rnd(B, cfg["HI"], N, cfg["DI"], s=cfg["DI"] ** -0.25)
    k_idx = rnd(B, cfg["HKI"], N, cfg["DI"], s=cfg["DI"] ** -0.25)
    w = rnd(B, cfg["HI"], N, s=cfg["HI"] ** -0.5)
    topk = random_sets(B, N, N, K, causal, device, seed)
    return q, k, q_idx, k_idx, w, topk


def random_sets(B, NQ, NK, K, causal, device, seed):
    """``[B, NQ, K]`` int32: per row min(K, visible) random distinct visible keys, -1 padding,
    in random slot order (row by row in chunks: an [rows, NK] score matrix at a time)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty((B, NQ, K), dtype=torch.int32, device=device)
    K_eff = min(K, NK)
    chunk = max(1, (1 << 26) // NK)
    for b in range(B):
        for t0 in range(0, NQ, chunk):
            rows = torch.arange(t0, min(NQ, t0 + chunk), device=device)
            r = torch.rand((len(rows), NK), generator=gen, device=device)
            if causal:
                r = r.masked_fill(torch.arange(NK, device=device)[None, :] > rows[:, None] + (NK - NQ), -1.0)
            val, idx = r.topk(K_eff, dim=-1)  # random order of the chosen keys
            idx = torch.where(val < 0, -1, idx).to(torch.int32)
            if K_eff < K:
                idx = torch.cat([idx, torch.full((len(rows), K - K_eff), -1, dtype=torch.int32, device=device)], -1)
            out[b, t0:t0 + len(rows)] = idx
    return out


def set_lse(q, k, topk, scale, causal, chunk=512):
    """The teacher's per-head LSEs over each row's set, float32 [B, H, N_Q] (natural log), by the
    gather form in row chunks: what a sparse attention over the same indices returns."""
    B, H, N, D = q.shape
    HK, NK = k.shape[1], k.shape[2]
    out = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    bidx = torch.arange(B, device=q.device)[:, None, None]
    for t0 in range(0, N, chunk):
        rows = torch.arange(t0, min(N, t0 + chunk), device=q.device)
        idx = topk[:, rows].long()
        used = (idx >= 0) & (idx < NK)
        if causal:
            used &= idx <= rows[None, :, None] + (NK - N)
        kg = k[bidx, :, torch.where(used, idx, 0)]  # [B, R, K, HK, D]
        qg = q[:, :, rows].reshape(B, HK, H // HK, len(rows), D)
        s = torch.einsum("bzgtd,btszd->bzgts", qg, kg).reshape(B, H, len(rows), -1).float() * scale
        out[:, :, rows] = torch.logsumexp(s.masked_fill(~used[:, None], float("-inf")), dim=-1)
    return out


def rel(x, ref):
    return testing.relative_error(x, ref)


def bench(fn, quick):
    import triton

    if not torch.cuda.is_available():  # --tiny on CPU: one timed call (checks the code path only)
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3, 0.0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    one = start.elapsed_time(end)
    if one > 50.0:  # a slow call (the eager gather form's backward: seconds): that one warm call
        return one, peak
    ms = triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100)
    return ms, peak


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------

def check_small(out, device, tiny, quick=False):
    """Small shapes vs float64 (reference on CPU), each dtype, fwd + grads, causal and not."""
    # (shape, dtypes): pruned to keep --quick's compiles few (each dtype/shape is a compile)
    shapes = [dict(H=8, HK=1, D=72, HI=4, HKI=1, DI=32, N=40, K=13, relu=True, causal=True,
                   dtypes=[torch.float32, torch.bfloat16]),
              dict(H=4, HK=2, D=40, HI=6, HKI=2, DI=24, N=33, K=20, relu=False, causal=False,
                   dtypes=[torch.float16])]
    if tiny:  # the CPU smoke (tests/test_indexer_topk_bench.py): one shape
        shapes = shapes[:1]
    elif not quick:  # (--quick: the DSA shape is checked at 8K by check_dsa_rows)
        shapes.append(dict(H=128, HK=1, D=576, HI=64, HKI=1, DI=128, N=160, K=100, relu=True, causal=True,
                           dtypes=[torch.bfloat16]))
    for sh in shapes:
        cfg = {k_: sh[k_] for k_ in ("H", "HK", "D", "HI", "HKI", "DI")}
        cfg["scale"] = None
        for dtype in ([torch.float32] if tiny else sh["dtypes"]):
            name = f"small H{sh['H']}/{sh['HK']} D{sh['D']} HI{sh['HI']}/{sh['HKI']} N{sh['N']} K{sh['K']} " \
                   f"{'causal' if sh['causal'] else 'full'} relu={sh['relu']} {str(dtype)[6:]}"
            try:
                q, k, qi, ki, w, topk = make_problem(cfg, sh["N"], sh["K"], dtype, device, seed=3, causal=sh["causal"])
                topk[:, 1, :] = -1  # an empty row
                kw = dict(causal=sh["causal"], relu=sh["relu"])
                x64 = [x.double().cpu().numpy() for x in (q, k, qi, ki, w)]
                sets = topk.cpu().numpy()
                g = torch.randn(topk.shape[:2], generator=torch.Generator().manual_seed(1)).to(device)
                ref = streamkl_ref.indexer_kl_topk(*x64, sets, **kw)
                rg = streamkl_ref.indexer_kl_topk_grad(*x64, sets, g.double().cpu().numpy(), **kw)
                leaves = [t.detach().clone().requires_grad_(True) for t in (qi, ki, w)]
                ours = indexer_kl_topk(q, k, *leaves, topk, **kw)
                og = torch.autograd.grad((ours * g).sum(), leaves)
                leaves2 = [t.detach().float().requires_grad_(True) for t in (qi, ki, w)]
                same = indexer_kl_topk_naive(q.float(), k.float(), *leaves2, topk, **kw)
                sg = torch.autograd.grad((same * g).sum(), leaves2)
                ok_all = True
                for tname, a, s, r in [("kl", ours, same, ref)] + [
                        (n, a_, s_, rg[n]) for n, a_, s_ in zip(("dq_idx", "dk_idx", "dweights"), og, sg)]:
                    err, base = rel(a, r), rel(s, r)
                    tol = testing.tolerance(base, dtype)
                    ok = err <= tol
                    ok_all &= ok
                    out.row("check_err", "ours", name, f"{err:.3e}", "rel", f"{tname} tol {tol:.2e} {'ok' if ok else 'FAIL'}")
                if bool(ours[:, 1].ne(0).any()):
                    ok_all = False
                    out.log(f"FAIL {name}: the empty row's KL is not 0")
                out.log(f"{'ok  ' if ok_all else 'FAIL'} {name}")
                if not ok_all:
                    out.failed.append(name)
            except Exception as e:  # noqa: BLE001
                out.failed.append(name)
                out.log(f"FAILED {name}: {e!r}\n{traceback.format_exc()}")


def check_dsa_rows(out, device, N, K, rows=32, cfg_name="dsa", dtype=torch.bfloat16, chunk=512):
    """DSA-like at N, K: sampled rows vs the float64 gather form on those rows."""
    name = f"{cfg_name} N{N} K{K} {str(dtype)[6:]} rows"
    try:
        cfg = CONFIGS[cfg_name]
        q, k, qi, ki, w, topk = make_problem(cfg, N, K, dtype, device, seed=5)
        leaves = [t.detach().clone().requires_grad_(True) for t in (qi, ki, w)]
        ours = indexer_kl_topk(q, k, *leaves, topk, causal=True, scale=cfg["scale"])
        g = torch.ones_like(ours)
        dq, dk, dw = torch.autograd.grad((ours * g).sum(), leaves)
        sel = torch.unique(torch.cat([torch.tensor([0, N - 1]), torch.randint(0, N, (rows - 2,))])).to(device)
        # the rows alone: causal folded into the sets (non-causal on a row subset)
        sub = topk[:, sel]
        visible = sub.long() <= sel[None, :, None]
        sub = torch.where(visible, sub, -1)
        ref = indexer_kl_topk_naive(q[:, :, sel].double(), k.double(), qi[:, :, sel].double(), ki.double(),
                                    w[:, :, sel].double(), sub, causal=False, scale=cfg["scale"],
                                    compute_dtype=torch.float64)
        same = indexer_kl_topk_naive(q[:, :, sel], k, qi[:, :, sel], ki, w[:, :, sel], sub, causal=False,
                                     scale=cfg["scale"], compute_dtype=torch.float32)
        err, base = rel(ours[:, sel], ref), rel(same, ref)
        tol = testing.tolerance(base, dtype)
        out.row("check_err", "ours", name, f"{err:.3e}", "rel", f"kl tol {tol:.2e} {'ok' if err <= tol else 'FAIL'}")
        # gradient rows of q_idx / weights vs float64 autograd of the row subset
        l64 = [qi[:, :, sel].double().requires_grad_(True), ki.double().requires_grad_(True),
               w[:, :, sel].double().requires_grad_(True)]
        kl64 = indexer_kl_topk_naive(q[:, :, sel].double(), k.double(), *l64, sub, causal=False,
                                     scale=cfg["scale"], compute_dtype=torch.float64)
        gq64, _, gw64 = torch.autograd.grad(kl64.sum(), l64)
        ok = err <= tol
        for tname, a, r in (("dq_idx", dq[:, :, sel], gq64), ("dweights", dw[:, :, sel], gw64)):
            e = rel(a, r)
            good = e <= 3e-2
            ok &= good
            out.row("check_err", "ours", name, f"{e:.3e}", "rel", f"{tname} rows, bound 3e-2 {'ok' if good else 'FAIL'}")
        del l64, kl64
        torch.cuda.empty_cache()
        # dk_idx: every row adds to it: vs the fp32 gather form's autograd (same inputs) in chunks of rows
        dk_ref = torch.zeros_like(dk, dtype=torch.float32)
        for t0 in range(0, N, chunk):
            rs = slice(t0, min(N, t0 + chunk))
            subr = topk[:, rs]
            ar = torch.arange(t0, min(N, t0 + chunk), device=device)
            subr = torch.where(subr.long() <= ar[None, :, None], subr, -1)
            kk = ki.float().requires_grad_(True)
            part = indexer_kl_topk_naive(q[:, :, rs], k, qi[:, :, rs].float(), kk, w[:, :, rs].float(), subr,
                                         causal=False, scale=cfg["scale"], compute_dtype=None)
            dk_ref += torch.autograd.grad(part.sum(), kk)[0]
        e = rel(dk, dk_ref)
        good = e <= 3e-2
        ok &= good
        out.row("check_err", "ours", name, f"{e:.3e}", "rel", f"dk_idx vs fp32 gather, bound 3e-2 {'ok' if good else 'FAIL'}")
        out.log(f"{'ok  ' if ok else 'FAIL'} {name}: kl err {err:.2e} (tol {tol:.2e}); dk err {e:.2e}")
        if not ok:
            out.failed.append(name)
    except Exception as e:  # noqa: BLE001
        out.failed.append(name)
        out.log(f"FAILED {name}: {e!r}\n{traceback.format_exc()}")
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# Timings
# ----------------------------------------------------------------------------------------------

def matmul_rate(device):
    import triton

    if device == "cpu":
        return 1e12

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=5, rep=30)
    return 2 * 8192 ** 3 / (ms * 1e-3)


def time_point(out, device, cfg_name, N, K, quick, rate, baselines=False, variants=(), budget=1e9,
               compile_baseline=True, variant_budget=None):
    cfg = CONFIGS[cfg_name]
    shape = f"{cfg_name} N={N} K={K} causal bf16"
    try:
        q, k, qi, ki, w, topk = make_problem(cfg, N, K, torch.bfloat16, device, seed=7)
    except Exception as e:  # noqa: BLE001
        out.log(f"FAILED making {shape}: {e!r}")
        return
    used = int((topk >= 0).sum())
    flops = 2.0 * used * (cfg["H"] * cfg["D"] + cfg["HI"] * cfg["DI"])
    floor_ms = flops / rate * 1e3
    out.row("floor", "matmul", shape, f"{floor_ms:.3f}", "ms", f"{used} used slots, bf16 rate {rate / 1e12:.0f} TFLOP/s")
    leaves = [t.detach().clone().requires_grad_(True) for t in (qi, ki, w)]

    def run(provider, fwd, fwd_bwd):
        for pass_name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
            if fn is None:
                continue
            try:
                ms, peak = bench(fn, quick)
                out.row(f"{pass_name}_ms", provider, shape, f"{ms:.3f}", "ms", f"{ms / floor_ms:.2f}x floor")
                out.row(f"{pass_name}_peak", provider, shape, f"{peak:.2f}", "GiB", "")
                out.log(f"{shape} {provider} {pass_name}: {ms:.3f} ms ({ms / floor_ms:.2f}x floor), peak {peak:.2f} GiB")
            except Exception as e:  # noqa: BLE001
                out.row(f"{pass_name}_ms", provider, shape, "nan", "ms", f"FAILED {type(e).__name__}: {str(e)[:120]}")
                out.log(f"FAILED {shape} {provider} {pass_name}: {e!r}")
            torch.cuda.empty_cache()

    run.out = out
    kw = dict(causal=True, scale=cfg["scale"])

    def ours_fwd():
        with torch.no_grad():
            indexer_kl_topk(q, k, qi, ki, w, topk, reduction="mean", **kw)

    def ours_fb():
        loss = indexer_kl_topk(q, k, *leaves, topk, reduction="mean", **kw)
        torch.autograd.grad(loss, leaves)

    run("ours", ours_fwd, ours_fb)
    log_tuning(out, shape, "ours")
    try:
        lse = set_lse(q, k, topk, _scale(cfg), True)
        with torch.no_grad():
            a = indexer_kl_topk(q, k, qi, ki, w, topk, **kw)
            b = indexer_kl_topk(q, k, qi, ki, w, topk, lse=lse, **kw)
        e = rel(b, a)
        out.row("check_err", "ours_lse", shape, f"{e:.3e}", "rel", f"kl with lse vs without, bound 1e-2 {'ok' if e <= 1e-2 else 'FAIL'}")
        if e > 1e-2:
            out.failed.append(f"{shape} lse")

        def lse_fwd():
            with torch.no_grad():
                indexer_kl_topk(q, k, qi, ki, w, topk, lse=lse, reduction="mean", **kw)

        def lse_fb():
            torch.autograd.grad(indexer_kl_topk(q, k, *leaves, topk, lse=lse, reduction="mean", **kw), leaves)

        run("ours_lse", lse_fwd, lse_fb)
        log_tuning(out, shape, "ours_lse")
    except Exception as e:  # noqa: BLE001
        out.log(f"FAILED {shape} ours_lse: {e!r}\n{traceback.format_exc()}")
    with torch.no_grad():
        kl_default = indexer_kl_topk(q, k, qi, ki, w, topk, **kw)
    v_budget = variant_budget if variant_budget is not None else budget - (15 if baselines else 0)
    for v in variants:
        if time.time() - T0 > v_budget:  # leave the compile baseline its time
            out.log(f"SKIPPED variant {v}: past {v_budget:.0f} s")
            continue
        _indexer_topk.CONFIG_OVERRIDE = v
        try:
            with torch.no_grad():
                e = rel(indexer_kl_topk(q, k, qi, ki, w, topk, **kw), kl_default)
            good = e <= 1e-3
            out.row("check_err", f"ours cfg={v}", shape, f"{e:.3e}", "rel",
                    f"kl vs the default config, bound 1e-3 {'ok' if good else 'FAIL'}")
            if not good:
                out.failed.append(f"{shape} cfg={v}")
            run(f"ours cfg={v}", ours_fwd, None)
        except Exception as e:  # noqa: BLE001
            out.failed.append(f"{shape} cfg={v}")
            out.log(f"FAILED {shape} cfg={v}: {e!r}")
        finally:
            _indexer_topk.CONFIG_OVERRIDE = None
    if baselines:
        run_baselines(run, q, k, qi, ki, w, leaves, topk, kw, compile_baseline, budget, quick)


_LOGGED = set()


def log_tuning(out, shape, provider):
    """The forward's candidate timings the first call measured (``_tuning.TUNING_LOG``: the
    one-kernel default, the separate-student design, the L1 variant) and the choice."""
    from streamkl_gpu._core import tuning as _tuning

    for key, measured in _tuning.TUNING_LOG.items():
        if key[0] != "topk_fwd" or key in _LOGGED:
            continue
        _LOGGED.add(key)
        best = min(measured, key=lambda m: m[1]) if measured else None
        for cfg, ms in measured:
            note = ("chosen" if best and cfg == best[0] else "") + (" (lse given)" if key[11] else "")
            out.row("tune_fwd_ms", f"{provider} cfg={cfg}", shape, f"{ms:.3f}", "ms", note.strip())
            out.log(f"{shape} {provider} tuning: cfg={cfg} {ms:.3f} ms {note}")


def run_baselines(run, q, k, qi, ki, w, leaves, topk, kw, compile_baseline=True, budget=1e9, quick=False):
    """torch.compile first (the targets' baseline; with --quick its fwd_bwd only while more than
    25 s of the budget are left: a second compile), then eager (a slow call is timed once)."""
    rows = (topk >= 0).any(-1).sum()

    def naive_loss(*xs):
        return indexer_kl_topk_naive(q, k, *xs, topk, compute_dtype=None, **kw).sum() / rows

    providers = []
    if compile_baseline and time.time() - T0 > budget - 12:
        run.out.log(f"SKIPPED torch_gather_compile: within 12 s of the {budget:.0f} s budget")
    elif compile_baseline:
        providers.append(("torch_gather_compile", torch.compile(naive_loss)))
    providers.append(("torch_gather_eager", naive_loss))
    for provider, f in providers:
        def fwd(f=f):
            with torch.no_grad():
                f(qi, ki, w)

        def fb(f=f):
            torch.autograd.grad(f(*leaves), leaves)

        run(provider, fwd, None)
        if quick and time.time() - T0 > budget - 25:
            run.out.log(f"SKIPPED {provider} fwd_bwd: within 25 s of the {budget:.0f} s budget")
            continue
        run(provider, None, fb)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tiny", action="store_true", help="CPU smoke under TRITON_INTERPRET=1")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip the remaining sections past this many seconds (default: --quick 44)")
    args = p.parse_args(argv)
    budget = args.budget_s if args.budget_s is not None else (44.0 if args.quick else 1e9)
    out = Out(args.out_dir)
    try:
        _main(args, out, budget)
    except KeyboardInterrupt:  # the runner's timeout (SIGINT): keep what was measured
        out.failed.append("interrupted")
        out.log("INTERRUPTED (SIGINT): the summary below holds what finished")
    print("\n=== indexer_kl_topk summary ===")
    for measure, provider, shape, value, unit, note in out.table:
        if measure.endswith("_ms") or measure == "floor" or "FAIL" in note:  # incl. tune_fwd_ms
            print(f"{measure:12s} {provider:26s} {shape:30s} {value:>10s} {unit:4s} {note}")
    print(f"checks failed: {out.failed if out.failed else 'none'}   total {time.time() - T0:.1f}s")
    return 1 if out.failed else 0


def _main(args, out, budget):
    device = "cpu" if args.tiny else "cuda"
    if not args.tiny:
        out.log(f"gpu {torch.cuda.get_device_name()} torch {torch.__version__}")
        import triton
        out.log(f"triton {triton.__version__}")
    if not args.quick:  # --quick: the timings that decide the default first, then the checks
        check_small(out, device, args.tiny, args.quick)
    if args.tiny:  # the GPU-only sections' code paths, tiny, on CPU
        check_dsa_rows(out, device, 12, 6, rows=4, cfg_name="tiny", dtype=torch.float32, chunk=5)
        time_point(out, device, "tiny", 6, 4, True, matmul_rate(device), baselines=True,
                   variants=[(16, 16, 16, 1, 1, True)], compile_baseline=False)
    else:
        if not args.quick:
            check_dsa_rows(out, device, 8192, 2048, chunk=1024)
        try:
            rate = matmul_rate(device)
        except Exception as e:  # noqa: BLE001
            out.log(f"FAILED matmul rate: {e!r}")
            rate = 700e12
        # launch configs of the forward (BLOCK_K, BLOCK_D, heads per chunk, warps, stages) beside the default
        # r5c (H200, DSA 8K, K=2048): the default (64, 64, 128, 8, 2) fwd 26.1 ms, 16.5 with lse
        # (BLOCK_K, BLOCK_D, heads per chunk, warps, stages, A_L1, SEPARATE student kernel), most promising first
        # (the default, the separate-student design and the L1 variant are the tuner's candidates:
        # their times are the tune_fwd_ms rows)
        variants = [(128, 64, 128, 8, 2), (64, 64, 128, 8, 2, True, True), (128, 64, 128, 8, 2, True),
                    (64, 64, 128, 8, 3)]
        points = [("dsa", 8192, dict(baselines=True, variants=variants))]
        if not args.quick:
            points += [("gqa", 8192, dict(baselines=True)), ("dsa", 4096, dict(baselines=True)),
                       ("dsa", 16384, dict(baselines=False))]
        for cfg_name, n, kw in points:
            if time.time() - T0 > budget:
                out.log(f"SKIPPED {cfg_name} N={n}: past the {budget:.0f} s budget")
                continue
            time_point(out, device, cfg_name, n, 2048, args.quick, rate, budget=budget,
                       variant_budget=24.0 if args.quick else None, **kw)
        if args.quick:  # the checks after the timings, as far as the budget goes (DSA 8K rows first)
            if time.time() - T0 < budget - 8:
                check_dsa_rows(out, device, 8192, 2048, chunk=1024)
            else:
                out.log("SKIPPED the DSA 8K row check: past the budget")
            if time.time() - T0 < budget - 6:
                check_small(out, device, False, True)
            else:
                out.log("SKIPPED the small-shape checks: past the budget")


if __name__ == "__main__":
    sys.exit(main())
