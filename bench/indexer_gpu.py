#!/usr/bin/env python3
"""The indexer loss on one GPU: correctness checks against float64, then timings (issue 10).

    python bench/indexer_gpu.py OUT_DIR            # checks + full timing grid (N = 2K..128K)
    python bench/indexer_gpu.py OUT_DIR --quick    # <= ~3 min: checks subset, 8K both configs, 32K ours
    TRITON_INTERPRET=1 python bench/indexer_gpu.py /tmp/x --tiny   # CPU smoke of the script itself

Configs (../shared/anchors/h200-2026-12-01.md):
  dsa: teacher H=128, D=576, H_K=1 (MQA), scale 192^-0.5; indexer H_I=64, D_I=128, H_KI=1
  gqa: teacher H=32, D=128, H_K=8; indexer H_I=16, D_I=64, H_KI=1
Providers: ``eager`` / ``compile`` = the materialised PyTorch form (streamkl_gpu.indexer.host.
indexer_kl_naive: bf16 inputs, fp32 scores per head, softmax, head mean; indexer scores, ReLU,
weights, log-softmax; KL; mean over rows), only where it fits (N <= 8K); ``ours`` =
streamkl_gpu.indexer_kl (teacher LSE pass included), ``ours_lse`` = the same with ``lse`` given
(the training case: FlashAttention returns it; its fwd_bwd takes the default design, the
accumulating one for an MQA teacher: STREAMKL_INDEXER_PACC=auto); ``ours_lse_fused`` = the plain
design with the fused backward (STREAMKL_INDEXER_PACC=0, STREAMKL_INDEXER_BWD=fused: one kernel,
dq_idx/dweights by atomics; fwd_bwd only). Passes: ``fwd`` and ``fwd_bwd`` (gradients to
q_idx, k_idx, weights of the mean loss). All causal, B = 1, bf16.
Floor = forward matmul FLOPs (teacher + indexer, causal half) at the bf16 rate of an 8192^3
matmul measured in the same run; ``ratio`` = ms / floor (fwd_bwd too: the issue's goal is
fwd+bwd within 2.5x of the forward floor).

Outputs in OUT_DIR: indexer_bench.csv (long format, one row per measurement), indexer_check.csv
(one row per compared tensor), indexer_tuned.json (launch configs the autotuner chose),
indexer_bench.log. The short table is printed last. Exit status 1 if a check failed.
"""
from __future__ import annotations

import argparse
import csv
import gc
import json
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
import streamkl_gpu  # noqa: E402
from streamkl_gpu.indexer import host as idx_host  # noqa: E402
from streamkl_gpu.indexer.api import indexer_kl_naive  # noqa: E402

CONFIGS = {
    "dsa": dict(H=128, HK=1, D=576, HI=64, HKI=1, DI=128, scale=192 ** -0.5),
    "gqa": dict(H=32, HK=8, D=128, HI=16, HKI=1, DI=64, scale=None),
}
BENCH_COLUMNS = ["config", "n", "causal", "provider", "pass", "ms", "peak_gib", "floor_ms", "ratio",
                 "status", "timer", "gpu", "torch", "triton", "extra"]
CHECK_COLUMNS = ["case", "dtype", "tensor", "err", "tol", "same_precision_err", "pass"]
MATERIALISED_MAX_N = 8192


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--quick", action="store_true", help="checks subset; 8K both configs; 32K ours only")
    p.add_argument("--tiny", action="store_true", help="CPU smoke (TRITON_INTERPRET=1): tiny shapes")
    p.add_argument("--ns", default=None, help="comma-separated N list (default 2K..128K; --quick: 8K,32K)")
    p.add_argument("--configs", default="dsa,gqa")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--providers", default=None,
                   help="comma-separated subset of ours_lse,ours_lse_fused,ours,eager,compile (default: all that fit)")
    p.add_argument("--passes", default="fwd,fwd_bwd", help="comma-separated subset of fwd,fwd_bwd")
    p.add_argument("--memory-only", action="store_true",
                   help="peak extra memory only (one call per point, no timing: the 128K re-measure)")
    p.add_argument("--autotune-max-n", type=int, default=None,
                   help="above this N take the first launch candidate (tuning a 128K point costs "
                        "minutes); default 32768, --quick 16384")
    args = p.parse_args(argv)
    if args.autotune_max_n is None:
        args.autotune_max_n = 16384 if args.quick else 32768
    return args


class Run:
    def __init__(self, args):
        self.args = args
        os.makedirs(args.out_dir, exist_ok=True)
        self.device = "cpu" if args.tiny else "cuda"
        self.logf = open(os.path.join(args.out_dir, "indexer_bench.log"), "a")
        self.rows, self.checks, self.failed = [], [], 0
        self.gpu = torch.cuda.get_device_name() if self.device == "cuda" else "cpu"
        import triton
        self.versions = (torch.__version__, triton.__version__)
        self.rate = None  # bf16 FLOP/s measured in this run

    def log(self, msg):
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.logf.write(line + "\n")
        self.logf.flush()

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def free(self):
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------------------
    def inputs(self, cfg, N, dtype=torch.bfloat16, seed=0, NQ=None, megatron=False):
        """q, k, q_idx, k_idx, weights (``[B, H, N, D]``; ``megatron``: views of ``[S, B, H, D]``)."""
        NQ = N if NQ is None else NQ
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def rnd(*shape, std=1.0):
            if megatron:  # [B, H, S, D] -> allocate [S, B, H, D] and permute back
                perm = (2, 0, 1, 3) if len(shape) == 4 else (2, 0, 1)
                inv = (1, 2, 0, 3) if len(shape) == 4 else (1, 2, 0)
                st = tuple(shape[i] for i in perm)
                return (std * torch.randn(st, generator=gen, device=self.device)).to(dtype).permute(*inv)
            return (std * torch.randn(shape, generator=gen, device=self.device)).to(dtype)

        q = rnd(1, cfg["H"], NQ, cfg["D"])
        k = rnd(1, cfg["HK"], N, cfg["D"])
        q_idx = rnd(1, cfg["HI"], NQ, cfg["DI"])
        k_idx = rnd(1, cfg["HKI"], N, cfg["DI"])
        # DSA folds the softmax scale and 1/sqrt(H_I) into the weights
        weights = rnd(1, cfg["HI"], NQ, std=(cfg["HI"] * cfg["DI"]) ** -0.5)
        return q, k, q_idx, k_idx, weights

    def teacher_lse(self, xs, cfg, causal):
        """Natural-log teacher LSEs [B, H, N_Q] (what FlashAttention would hand over)."""
        _, _, lse_bits = idx_host._forward(*xs, None, causal, _scale(cfg), True)
        return (lse_bits * math.log(2.0)).contiguous()

    # ------------------------------------------------------------------------------------------
    def check(self):
        """Small shapes on the GPU vs streamkl_ref (float64 on CPU), FlashAttention's tolerance
        rule: error <= 3 x the materialised form's error at the inputs' precision + a floor."""
        t = self.args.tiny
        dsa_small = dict(CONFIGS["dsa"], H=8 if t else 128, HI=4 if t else 64, D=576, DI=16 if t else 128)
        gqa_small = dict(CONFIGS["gqa"], H=4 if t else 32, HK=2 if t else 8, HI=4 if t else 16, DI=16 if t else 64,
                         D=32 if t else 128)
        n1, n2 = (9, 13) if t else (256, 300)
        cases = [
            ("dsa_bf16_causal", dsa_small, n1, None, torch.bfloat16, True, False, False),
            ("dsa_bf16_causal_lse", dsa_small, n1, None, torch.bfloat16, True, True, False),
            ("gqa_fp16_causal_ragged", gqa_small, n2, None, torch.float16, True, False, False),
            ("gqa_bf16_noncausal_lse_megatron", gqa_small, n2, None, torch.bfloat16, False, True, True),
            ("gqa_fp16_causal_nq_gt_nk", gqa_small, n2 // 2, n2, torch.float16, True, False, False),
            ("gqa_fp32_causal", gqa_small, n1, None, torch.float32, True, False, False),
            ("gqa_bf16_relu_off", dict(gqa_small, relu=False), n1, None, torch.bfloat16, True, False, False),
        ]
        if self.args.quick:
            cases = cases[:4]
        for name, cfg, N, NQ, dtype, causal, with_lse, megatron in cases:
            try:
                self._check_case(name, cfg, N, NQ, dtype, causal, with_lse, megatron)
            except Exception:
                self.failed += 1
                self.log(f"check {name} raised:\n{traceback.format_exc()}")
                self.checks.append(dict(case=name, dtype=str(dtype), tensor="*", err="", tol="",
                                        same_precision_err="", **{"pass": False}))
            self.free()

    def _check_case(self, name, cfg, N, NQ, dtype, causal, with_lse, megatron):
        relu = cfg.get("relu", True)
        xs = self.inputs(cfg, N, dtype=dtype, seed=1, NQ=NQ, megatron=megatron)
        kw = dict(causal=causal, scale=cfg["scale"], relu=relu)
        x64 = [x.detach().double().cpu().numpy() for x in xs]
        kl_ref, _, lse_ref = streamkl_ref.indexer_kl(*x64, return_lse=True, **kw)
        g = torch.rand(xs[0].shape[0], xs[0].shape[2], device=self.device) + 0.5
        grads_ref = streamkl_ref.indexer_kl_grad(*x64, g.double().cpu().numpy(), **kw)
        lse = torch.from_numpy(lse_ref).float().to(self.device) if with_lse else None
        train = (False, False, True, True, True)
        ins = [x.detach().clone().requires_grad_(r) for x, r in zip(xs, train)]
        kl = streamkl_gpu.indexer_kl(*ins, lse=lse, **kw)
        kl.backward(g)
        ours = dict(kl=kl.detach(), dq_idx=ins[2].grad, dk_idx=ins[3].grad, dweights=ins[4].grad)
        # same precision: the materialised form in the inputs' dtype (bf16/fp16 products and softmax)
        sp_in = [x.detach().clone().requires_grad_(r) for x, r in zip(xs, train)]
        sp_kl = indexer_kl_naive(*sp_in, compute_dtype=dtype, **kw)
        sp_kl.backward(g.to(sp_kl.dtype))
        sp = dict(kl=sp_kl.detach(), dq_idx=sp_in[2].grad, dk_idx=sp_in[3].grad, dweights=sp_in[4].grad)
        ref = dict(kl=kl_ref, **grads_ref)
        floor = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
        for tensor in ("kl", "dq_idx", "dk_idx", "dweights"):
            err = _rel_err(ours[tensor], ref[tensor])
            base = _rel_err(sp[tensor], ref[tensor])
            tol = 3.0 * (base if math.isfinite(base) else 0.0) + floor
            ok = err <= tol
            self.failed += not ok
            self.checks.append(dict(case=name, dtype=str(dtype).replace("torch.", ""), tensor=tensor,
                                    err=f"{err:.3e}", tol=f"{tol:.3e}", same_precision_err=f"{base:.3e}",
                                    **{"pass": ok}))
            self.log(f"check {name:34s} {tensor:9s} err {err:.2e} tol {tol:.2e} {'ok' if ok else 'FAIL'}")

    # ------------------------------------------------------------------------------------------
    def measure_matmul_rate(self):
        if self.device != "cuda":
            self.rate = 1e12
            return
        from triton.testing import do_bench
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        ms = do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
        self.rate = 2 * n ** 3 / (ms * 1e-3)
        self.log(f"bf16 matmul 8192^3: {ms:.3f} ms = {self.rate / 1e12:.0f} TFLOP/s")
        del a, b
        self.free()

    def timed(self, fn):
        """(median ms, timer): one warm-up call (compiles / autotunes), then do_bench, or for slow
        calls (> 100 ms) the median of 3 event-timed calls."""
        fn()
        self.sync()
        if self.device != "cuda":
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3, "perf_counter"
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        one = start.elapsed_time(end)
        if one > 2000.0:  # multi-second calls (128K): the one warm event-timed call
            return one, "events_x1"
        if one > 100.0:
            ts = []
            for _ in range(3):
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                ts.append(start.elapsed_time(end))
            return float(np.median(ts)), "events_x3"
        from triton.testing import do_bench
        rep = 50 if self.args.quick else 100
        return do_bench(fn, warmup=10, rep=rep, return_mode="median"), "do_bench"

    def peak(self, fn):
        if self.device != "cuda":
            return float("nan")
        self.sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        self.sync()
        return (torch.cuda.max_memory_allocated() - base) / 2 ** 30

    def bench_point(self, cname, cfg, N, providers):
        causal = True
        floor_ms = _floor_flops(cfg, N, causal) / self.rate * 1e3
        xs = self.inputs(cfg, N)
        kw = dict(causal=causal, scale=cfg["scale"])
        os.environ["STREAMKL_AUTOTUNE"] = "1" if N <= self.args.autotune_max_n else "0"
        lse = None
        if any(p.startswith("ours_lse") for p in providers):
            lse = self.teacher_lse(xs, cfg, causal)
        train = [x.detach().clone().requires_grad_(r) for x, r in zip(xs, (False, False, True, True, True))]
        compiled = {}
        for provider in providers:
            wanted = self.args.passes.split(",")
            for pss in [x for x in (("fwd_bwd",) if provider == "ours_lse_fused" else ("fwd", "fwd_bwd")) if x in wanted]:
                status, ms, peak, timer, extra = "ok", float("nan"), float("nan"), "", ""
                try:
                    fn = self._fn(provider, pss, xs, train, lse, kw, compiled)
                    peak = self.peak(fn)
                    if self.args.memory_only:
                        timer = "not timed (--memory-only)"
                    else:
                        ms, timer = self.timed(fn)
                except torch.cuda.OutOfMemoryError:
                    status = "oom"
                except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                    status = "error"
                    extra = f"{type(exc).__name__}: {str(exc)[:200]}"
                    self.log(traceback.format_exc())
                for x in train:
                    x.grad = None
                self.free()
                ratio = ms / floor_ms if math.isfinite(ms) else float("nan")
                self.rows.append(dict(config=cname, n=N, causal=causal, provider=provider, **{"pass": pss},
                                      ms=f"{ms:.4f}", peak_gib=f"{peak:.3f}", floor_ms=f"{floor_ms:.4f}",
                                      ratio=f"{ratio:.3f}", status=status, timer=timer, gpu=self.gpu,
                                      torch=self.versions[0], triton=self.versions[1], extra=extra))
                self.log(f"{cname} N={N:6d} {provider:8s} {pss:7s} {ms:10.3f} ms  peak {peak:7.2f} GiB  "
                         f"ratio {ratio:6.2f}  {status} {extra}")
                self.flush()
        del xs, train, lse
        self.free()

    def _fn(self, provider, pss, xs, train, lse, kw, compiled):
        if provider in ("ours", "ours_lse", "ours_lse_fused"):
            lse_arg = None if provider == "ours" else lse
            mode = "fused" if provider == "ours_lse_fused" else "separate"
            if pss == "fwd":
                return lambda: streamkl_gpu.indexer_kl(*xs, lse=lse_arg, **kw)

            def fb():
                os.environ["STREAMKL_INDEXER_BWD"] = mode  # the backward's kernels (idx_host.bwd_mode)
                if mode == "fused":  # the plain design's fused backward, not the accumulating one
                    os.environ["STREAMKL_INDEXER_PACC"] = "0"
                try:
                    loss = streamkl_gpu.indexer_kl(*train, lse=lse_arg, reduction="mean", **kw)
                    torch.autograd.grad(loss, train[2:])
                finally:
                    os.environ["STREAMKL_INDEXER_BWD"] = "separate"
                    os.environ.pop("STREAMKL_INDEXER_PACC", None)
            return fb
        # materialised: the mean over rows (causal, N_Q = N_K: every row sees a key)
        def loss_fn(q, k, qi, ki, w):
            return indexer_kl_naive(q, k, qi, ki, w, compute_dtype=torch.float32, **kw).mean()

        if provider == "compile":
            if pss not in compiled:
                compiled[pss] = torch.compile(loss_fn, fullgraph=True, dynamic=False)
            loss_fn = compiled[pss]
        if pss == "fwd":
            def f():
                with torch.no_grad():
                    return loss_fn(*xs)
            return f

        def fb():
            torch.autograd.grad(loss_fn(*train), train[2:])
        return fb

    # ------------------------------------------------------------------------------------------
    def flush(self):
        with open(os.path.join(self.args.out_dir, "indexer_bench.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=BENCH_COLUMNS)
            w.writeheader()
            w.writerows(self.rows)
        with open(os.path.join(self.args.out_dir, "indexer_check.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CHECK_COLUMNS)
            w.writeheader()
            w.writerows(self.checks)
        from streamkl_gpu._core import tuning as _tuning
        tuned = {repr(k): list(v) for k, v in _tuning._TUNED.items() if str(k[0]).startswith("idx_")}
        with open(os.path.join(self.args.out_dir, "indexer_tuned.json"), "w") as f:
            json.dump(tuned, f, indent=1)

    def table(self):
        print("\n== indexer_kl checks ==")
        n_ok = sum(bool(c["pass"]) for c in self.checks)
        print(f"{n_ok}/{len(self.checks)} compared tensors within tolerance"
              + ("" if n_ok == len(self.checks) else "  FAILED: " + ", ".join(
                  f"{c['case']}:{c['tensor']}" for c in self.checks if not c["pass"])))
        print("\n== indexer_kl timings (causal, bf16; ms, peak extra GiB, ratio to the fwd matmul floor) ==")
        print(f"{'config':6s} {'N':>7s} {'provider':14s} {'fwd ms':>9s} {'GiB':>7s} {'ratio':>6s} "
              f"{'fwd+bwd ms':>11s} {'GiB':>7s} {'ratio':>6s}")
        keys = []
        for r in self.rows:
            key = (r["config"], r["n"], r["provider"])
            if key not in keys:
                keys.append(key)
        for key in keys:
            cells = {r["pass"]: r for r in self.rows if (r["config"], r["n"], r["provider"]) == key}

            def c(p, field):
                r = cells.get(p)
                if r is None:
                    return "-"
                return r[field] if r["status"] == "ok" else r["status"]
            print(f"{key[0]:6s} {key[1]:7d} {key[2]:14s} {c('fwd', 'ms'):>9s} {c('fwd', 'peak_gib'):>7s} "
                  f"{c('fwd', 'ratio'):>6s} {c('fwd_bwd', 'ms'):>11s} {c('fwd_bwd', 'peak_gib'):>7s} "
                  f"{c('fwd_bwd', 'ratio'):>6s}")
        # speed-ups over torch.compile at the largest N where it ran
        for cname in CONFIGS:
            for pss in ("fwd", "fwd_bwd"):
                comp = [r for r in self.rows if r["config"] == cname and r["provider"] == "compile"
                        and r["pass"] == pss and r["status"] == "ok"]
                if not comp:
                    continue
                best = max(comp, key=lambda r: r["n"])
                for prov in ("ours", "ours_lse", "ours_lse_fused"):
                    mine = [r for r in self.rows if r["config"] == cname and r["provider"] == prov
                            and r["pass"] == pss and r["n"] == best["n"] and r["status"] == "ok"]
                    if mine:
                        print(f"{cname} N={best['n']} {pss}: {prov} {float(best['ms']) / float(mine[0]['ms']):.1f}x "
                              f"faster than torch.compile")


def _scale(cfg):
    return cfg["scale"] if cfg["scale"] is not None else cfg["D"] ** -0.5


def _floor_flops(cfg, N, causal):
    per_pair = 2 * (cfg["H"] * cfg["D"] + cfg["HI"] * cfg["DI"])
    return per_pair * N * N * (0.5 if causal else 1.0)


def _rel_err(x, ref):
    x = torch.as_tensor(x).detach().double().cpu()
    ref = torch.as_tensor(np.asarray(ref), dtype=torch.float64)
    if not torch.isfinite(x).all():
        return math.inf
    denom = max(ref.norm().item(), 1e-12 * math.sqrt(max(ref.numel(), 1)))
    return ((x - ref).norm() / denom).item()


def main(argv=None):
    args = parse_args(argv)
    run = Run(args)
    run.log(f"indexer bench: gpu {run.gpu}, torch {run.versions[0]}, triton {run.versions[1]}, "
            f"quick={args.quick} tiny={args.tiny}")
    t0 = time.time()
    if not args.no_check:
        run.check()
        run.flush()
        run.log(f"checks done in {time.time() - t0:.0f} s, {run.failed} failed")
    run.measure_matmul_rate()
    configs = [c for c in args.configs.split(",") if c]
    if args.tiny:
        grid = [(c, n) for c in configs for n in (32,)]
        tiny_cfg = {"dsa": dict(CONFIGS["dsa"], H=8, HI=4, DI=16), "gqa": dict(CONFIGS["gqa"], H=4, HK=2, HI=4, DI=16, D=32)}
    elif args.ns:
        grid = [(c, int(n)) for c in configs for n in args.ns.split(",")]
    elif args.quick:
        grid = [(c, n) for n in (8192, 32768) for c in configs]
    else:
        grid = [(c, n) for c in configs for n in (2048, 4096, 8192, 16384, 32768, 65536, 131072)]
    for cname, N in grid:
        cfg = tiny_cfg[cname] if args.tiny else CONFIGS[cname]
        providers = ["ours_lse", "ours_lse_fused", "ours"]
        if N <= MATERIALISED_MAX_N and not args.tiny or (args.tiny and N <= 64):
            providers = ["eager"] + ([] if args.no_compile or args.tiny else ["compile"]) + providers
            if args.quick and cname != "dsa" and "compile" in providers:
                providers.remove("compile")  # the quick budget: compile only at the DSA-like config
        if args.providers:
            providers = [p for p in providers if p in args.providers.split(",")]
        run.log(f"-- {cname} N={N} providers {providers}")
        run.bench_point(cname, cfg, N, providers)
    run.flush()
    run.log(f"done in {time.time() - t0:.0f} s")
    run.table()
    return 1 if run.failed else 0


if __name__ == "__main__":
    sys.exit(main())
