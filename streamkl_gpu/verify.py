"""``streamkl verify``: the kernels against the references, as a numerical gate.

Runs ``streamkl_gpu.attention_kl`` (forward, and backward in both the fused and separate modes)
on a battery of cases — shapes that don't divide the tiles, N = 1, GQA on either side,
D1 != D2, causal with N_Q < N_K and N_Q > N_K (empty rows), split-K, large logits, and packed
sequences (``attention_kl_varlen``: zero-length, length-1 and key-less sequences) — and
compares every output and gradient with ``streamkl_ref`` in float64 (and with mpmath for the
small cases). On a GPU it runs fp32, fp16 and bf16; on CPU, under the Triton interpreter,
fp32 and fp16 (the interpreter's bf16 dot is wrong, and the kernels compute bf16 in fp32 there).

Tolerances follow FlashAttention's tests: an output passes when its error against the float64
reference is at most ``C`` times the error that the same math, done densely in PyTorch at the
inputs' precision (``streamkl_gpu.naive``), makes against that reference, plus a floor — so the
bound follows real rounding rather than a magic number. Errors are relative Frobenius norms.

Exit status: 0 when every row passes, 1 otherwise (2 for a usage or set-up problem).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

# FlashAttention-style tolerance: err <= C * err(same-precision eager) + FLOOR[dtype]
C_TOL = 3.0
FLOOR = {"float32": 2e-6, "float16": 1e-3, "bfloat16": 8e-3}
# where the exact gradient is 0: a few fp32 roundings of O(1) terms
ZERO_GRAD_TOL = 1e-5

# (name, B, H, HK1, HK2, N_Q, N_K, D1, D2, causal, scale1, scale2, split_k)
CPU_CASES = [
    ("ragged", 1, 2, 2, 2, 21, 37, 16, 16, False, None, None, None),
    ("gqa1_d1>d2", 1, 4, 2, 4, 19, 23, 32, 16, False, None, None, None),
    ("gqa2_d1<d2", 1, 4, 4, 1, 17, 29, 16, 24, False, None, None, None),
    ("causal_nq<nk", 1, 2, 1, 2, 13, 40, 16, 16, True, None, None, None),
    ("causal_nq>nk", 1, 2, 2, 1, 40, 13, 16, 16, True, None, None, None),
    ("n=1", 2, 2, 2, 2, 1, 1, 16, 16, False, None, None, None),
    ("decode_splitk", 1, 2, 1, 1, 3, 70, 16, 16, False, None, None, 3),
    ("large_logits", 1, 2, 2, 2, 18, 33, 16, 16, False, 4.0, 3.0, None),
]
GPU_CASES = CPU_CASES + [
    ("big_d128_d64", 2, 4, 2, 1, 300, 500, 128, 64, False, None, None, None),
    ("big_causal", 2, 4, 4, 2, 500, 300, 128, 64, True, None, None, None),
    ("d80_d96_causal", 1, 4, 2, 4, 257, 389, 80, 96, True, None, None, None),
    ("decode_splitk_1x4096", 1, 8, 2, 8, 1, 4096, 128, 128, False, None, None, None),
]
MP_MAX_SCORES = 1500  # mpmath check only for B*H*N_Q*N_K up to this

# packed sequences (attention_kl_varlen): (name, [(n_q, n_k), ...], H, HK1, HK2, D1, D2, causal, split_k)
VARLEN_CPU_CASES = [
    ("varlen_mixed", [(5, 9), (0, 4), (17, 17), (1, 1), (6, 0), (20, 7)], 4, 2, 1, 16, 24, True, None),
    ("varlen_noncausal_splitk", [(3, 40), (9, 9), (0, 0), (12, 33)], 2, 1, 2, 16, 16, False, 3),
]
VARLEN_GPU_CASES = VARLEN_CPU_CASES + [
    # >= 2048 keys in one sequence: the forward reads keys through TMA descriptors (Hopper)
    ("varlen_big", [(300, 300), (0, 64), (1, 1), (513, 700), (129, 0), (2100, 2300)], 8, 2, 4, 128, 64, True, None),
]


def _parse(argv):
    p = argparse.ArgumentParser(prog="streamkl verify", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: the GPU if there is one, else the Triton interpreter on CPU")
    p.add_argument("--quick", action="store_true", help="fewer cases (fast smoke gate)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON to PATH")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--autotune", action="store_true",
                   help="time every launch candidate (GPU); default: the first candidate of each "
                        "shape class, which keeps the gate to one compile per kernel variant")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-case progress lines on stderr")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
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


def _run(args) -> int:
    import torch  # noqa: E402 (after argument parsing: --help needs no torch)

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("streamkl verify: --device cuda, but torch sees no CUDA GPU", file=sys.stderr)
        return 2
    if device == "cpu":
        # must happen before the kernel modules are imported (they are imported lazily)
        if "streamkl_gpu.api" in sys.modules and not sys.modules["streamkl_gpu.api"].interpreting():
            print("streamkl verify: the kernels were already loaded for the GPU; run in a fresh "
                  "process with TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"

    import numpy as np
    import triton

    import streamkl_ref
    from streamkl_gpu import api
    from streamkl_gpu.naive import attention_kl_naive

    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])
    cases = GPU_CASES if device == "cuda" else CPU_CASES
    if args.quick:
        cases = cases[:4]
        dtypes = dtypes[:2] if device == "cpu" else [torch.float32, torch.bfloat16]
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    t_start = time.time()

    def rel(a, ref):
        a = a.detach().double().cpu()
        ref = torch.as_tensor(ref, dtype=torch.float64)
        if not torch.isfinite(a).all():
            return float("inf")
        # relative Frobenius error; the 1e-12 * sqrt(n) floor only matters for a reference that
        # is (numerically) all zero, where it keeps 0/0 and tiny/tiny from reading as failures
        denom = max(ref.norm().item(), 1e-12 * math.sqrt(max(ref.numel(), 1)))
        return ((a - ref).norm() / denom).item()

    def record(case, dtype, quantity, err, tol, ok=None, note=""):
        ok = (err <= tol) if ok is None else ok
        rows.append({"case": case, "dtype": str(dtype).replace("torch.", ""), "quantity": quantity,
                     "error": err, "tolerance": tol, "pass": bool(ok), "note": note})

    for (name, B, H, HK1, HK2, NQ, NK, D1, D2, causal, sc1, sc2, split) in cases:
        base = [torch.randn(B, H, NQ, D1, generator=gen), torch.randn(B, HK1, NK, D1, generator=gen),
                torch.randn(B, H, NQ, D2, generator=gen), torch.randn(B, HK2, NK, D2, generator=gen)]
        g = torch.randn(B, H, NQ, generator=gen)
        for dtype in dtypes:
            dname = str(dtype).replace("torch.", "")
            if not args.quiet:  # the first GPU run compiles each kernel variant: show progress
                print(f"[{time.time() - t_start:6.1f}s] {name} {dname}", file=sys.stderr, flush=True)
            xs = [x.to(dtype) for x in base]  # the exact inputs the kernel sees
            x64 = [x.double().numpy() for x in xs]
            kw = dict(causal=causal, scale1=sc1, scale2=sc2)
            ref_kl = streamkl_ref.attention_kl(*x64, **kw)
            ref_grad = streamkl_ref.attention_kl_grad(*x64, g.double().numpy(), **kw)
            # the same math at the inputs' precision: sets the tolerance scale
            same = [x.clone().requires_grad_(True) for x in xs]
            same_kl = attention_kl_naive(*same, compute_dtype=dtype if dtype != torch.float16 else torch.float16, **kw)
            same_kl.backward(g.to(same_kl.dtype))
            floor = FLOOR[dname]
            kl_tol = C_TOL * rel(same_kl, ref_kl) + floor
            dev_xs = [x.to(device) for x in xs]
            kl = api.attention_kl(*dev_xs, split_k=split, **kw)
            record(name, dtype, "kl", rel(kl, ref_kl), kl_tol)
            if split is not None:
                kl1 = api.attention_kl(*dev_xs, split_k=1, **kw)
                err = rel(kl, kl1.double().cpu().numpy())
                record(name, dtype, "kl split-K vs one pass", err, 8 * floor)
            if causal and NQ > NK:
                empty = slice(0, NQ - NK)
                ok = bool((kl[..., empty] == 0).all())
                record(name, dtype, "kl of empty rows == 0", 0.0 if ok else 1.0, 0.0, ok)
            if B * H * NQ * NK <= MP_MAX_SCORES and dtype == torch.float32:
                mp_kl = streamkl_ref.attention_kl_mp(*x64, dps=50, **kw)
                record(name, dtype, "kl vs mpmath", rel(kl, mp_kl), kl_tol)
            for mode in ("fused", "separate"):
                ins = [x.clone().requires_grad_(True) for x in dev_xs]
                out = api.attention_kl(*ins, bwd_mode=mode, **kw)
                out.backward(g.to(device))
                for tname, t, s in zip(("dq1", "dk1", "dq2", "dk2"), ins, same):
                    if not np.any(ref_grad[tname]):
                        # exactly zero gradient (e.g. one key per row): relative error is undefined;
                        # the kernel's fp32 arithmetic must leave only rounding noise of O(1) terms
                        err = t.grad.detach().double().abs().max().item()
                        record(name, dtype, f"{tname} ({mode}) max|.|", err, ZERO_GRAD_TOL,
                               note="reference gradient is exactly 0")
                        continue
                    tol = C_TOL * rel(s.grad, ref_grad[tname]) + floor
                    record(name, dtype, f"{tname} ({mode})", rel(t.grad, ref_grad[tname]), tol)
    from streamkl_gpu import attention_kl_varlen

    varlen_cases = VARLEN_GPU_CASES if device == "cuda" else VARLEN_CPU_CASES
    if args.quick:
        varlen_cases = varlen_cases[:1]
    for (name, lens, H, HK1, HK2, D1, D2, causal, split) in varlen_cases:
        tq, tk = sum(a for a, _ in lens), sum(b for _, b in lens)
        base = [torch.randn(tq, H, D1, generator=gen), torch.randn(tk, HK1, D1, generator=gen),
                torch.randn(tq, H, D2, generator=gen), torch.randn(tk, HK2, D2, generator=gen)]
        g = torch.randn(tq, H, generator=gen)
        cu_q = torch.tensor([0] + list(np.cumsum([a for a, _ in lens])), dtype=torch.int32)
        cu_k = torch.tensor([0] + list(np.cumsum([b for _, b in lens])), dtype=torch.int32)
        mq, mk = max(a for a, _ in lens), max(b for _, b in lens)
        for dtype in dtypes:
            dname = str(dtype).replace("torch.", "")
            if not args.quiet:
                print(f"[{time.time() - t_start:6.1f}s] {name} {dname}", file=sys.stderr, flush=True)
            xs = [x.to(dtype) for x in base]
            x64 = [x.double().numpy() for x in xs]
            packing = (cu_q.numpy(), cu_k.numpy(), mq, mk)
            ref_kl = streamkl_ref.attention_kl_varlen(*x64, *packing, causal=causal)
            ref_grad = streamkl_ref.attention_kl_varlen_grad(*x64, *packing, g.double().numpy(), causal=causal)
            # the same math at the inputs' precision, sequence by sequence (tolerance scale)
            same = [x.clone().requires_grad_(True) for x in xs]
            same_kl = torch.zeros(tq, H, dtype=torch.float64)
            for i in range(len(lens)):
                rows_i, keys_i = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
                if rows_i.start == rows_i.stop or keys_i.start == keys_i.stop:
                    continue
                seq = [x[sl].transpose(0, 1)[None] for x, sl in zip(same, (rows_i, keys_i, rows_i, keys_i))]
                out = attention_kl_naive(*seq, causal=causal, compute_dtype=dtype)
                out.backward(g[rows_i].T[None].to(out.dtype))
                same_kl[rows_i] = out[0].T.detach().double()
            floor = FLOOR[dname]
            kl_tol = C_TOL * rel(same_kl, ref_kl) + floor
            dev_xs = [x.to(device) for x in xs]
            dev_cu = (cu_q.to(device), cu_k.to(device), mq, mk)
            kl = attention_kl_varlen(*dev_xs, *dev_cu, causal=causal, split_k=split)
            record(name, dtype, "kl", rel(kl, ref_kl), kl_tol)
            no_keys = [i for i, (a, b) in enumerate(lens) if a and not b]
            if no_keys:
                ok = all(bool((kl[int(cu_q[i]):int(cu_q[i + 1])] == 0).all()) for i in no_keys)
                record(name, dtype, "kl no-key seqs == 0", 0.0 if ok else 1.0, 0.0, ok)
            for mode in ("fused", "separate"):
                ins = [x.clone().requires_grad_(True) for x in dev_xs]
                out = attention_kl_varlen(*ins, *dev_cu, causal=causal, bwd_mode=mode)
                out.backward(g.to(device))
                for tname, t, s in zip(("dq1", "dk1", "dq2", "dk2"), ins, same):
                    tol = C_TOL * rel(s.grad, ref_grad[tname]) + floor
                    record(name, dtype, f"{tname} ({mode})", rel(t.grad, ref_grad[tname]), tol)
    elapsed = time.time() - t_start

    failed = [r for r in rows if not r["pass"]]
    width = max(len(r["case"]) for r in rows)
    print(f"{'case':<{width}}  {'dtype':<8}  {'quantity':<24}  {'error':>9}  {'tolerance':>9}  pass")
    for r in rows:
        print(f"{r['case']:<{width}}  {r['dtype']:<8}  {r['quantity']:<24}  {r['error']:9.2e}  "
              f"{r['tolerance']:9.2e}  {'ok' if r['pass'] else 'FAIL'}")
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    print(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed  "
          f"({len(cases) + len(varlen_cases)} cases on {gpu}, {elapsed:.1f} s; torch {torch.__version__}, triton {triton.__version__})")
    if args.json:
        report = {
            "passed": not failed, "rows": rows, "device": gpu, "elapsed_s": elapsed,
            "torch": torch.__version__, "triton": triton.__version__, "numpy": np.__version__,
            "python": platform.python_version(), "date": datetime.date.today().isoformat(),
            "tolerance_rule": f"error <= {C_TOL} * error(same-precision eager) + floor {FLOOR}",
        }
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
