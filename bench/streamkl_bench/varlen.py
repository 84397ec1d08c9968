"""Section ``varlen``: packed variable-length sequences (``attention_kl_varlen``): checks, then the benchmark.

    python bench/bench_gpu.py --sections varlen [--section-args varlen="--parts packed,a"]
    PYTHONPATH=bench:. python -m streamkl_bench.varlen OUT --device cpu --parts packed   # CPU smoke

Checks (bf16; zero-length, length-1, N_Q != N_K sequences and one of 2300 keys (TMA); GQA, D1 != D2,
causal and not; fused, separate and deterministic backward; split-K): the forward and setting 1's
gradients against ``streamkl_ref``'s float64 ``attention_kl_varlen(_grad)``, error <= 3x the same
math in bf16 PyTorch, sequence by sequence, + 5e-3. Benchmark (H = 32, D = 128, bf16, causal): 80K
tokens in 1x16K + 2x8K + 4x4K + 8x2K + 16x1K documents, shuffled; forward and forward+backward,
packed vs (a) one ``attention_kl`` call per sequence (summed; the forward also with
STREAMKL_FWD_BACKEND=triton, the kernel varlen runs) vs (b) every sequence right-padded to 16K in
one call; peak extra memory. Musts: packed <= 1.1x (a), (b) >= 2x packed. Writes OUT/varlen.csv
(long format: section, case, provider, metric, value, unit, note); a short table last.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import random
import sys
import time

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402

import streamkl_gpu  # noqa: E402
import streamkl_ref  # noqa: E402
from streamkl_gpu.naive import attention_kl_naive  # noqa: E402

from .timing import extra_memory_gib, sync, time_ms  # noqa: E402

FIELDS = ["section", "case", "provider", "metric", "value", "unit", "note"]
DEV = "cuda"  # --device cpu: the interpreter smoke run
BF16_FLOOR = 5e-3
RATIO = 3.0


class Out:
    def __init__(self, out_dir):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "varlen.csv")
        self.f = open(self.path, "w", newline="")
        self.w = csv.DictWriter(self.f, fieldnames=FIELDS)
        self.w.writeheader()
        self.table = []

    def row(self, section, case, provider, metric, value, unit="", note=""):
        self.w.writerow(dict(section=section, case=case, provider=provider, metric=metric,
                             value=value, unit=unit, note=note))
        self.f.flush()


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def rel_err(x, ref):
    x = torch.as_tensor(x).detach().double().cpu()
    ref = torch.as_tensor(ref, dtype=torch.float64)
    if not torch.isfinite(x).all():
        return math.inf
    denom = max(ref.norm().item(), 1e-12 * math.sqrt(max(ref.numel(), 1)))
    return ((x - ref).norm() / denom).item()


def cu_tensor(lens):
    return torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32, device=DEV)


# Checks

def same_precision_bf16(xs, cu_q, cu_k, g, causal):
    """bf16 PyTorch, sequence by sequence: KL [total_q, H] and the setting-1 grads (dq2, dk2)."""
    kl = torch.zeros(xs[0].shape[:2], dtype=torch.float64)
    dq2 = torch.zeros(xs[2].shape, dtype=torch.float64)
    dk2 = torch.zeros(xs[3].shape, dtype=torch.float64)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        rows, keys = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if rows.start == rows.stop or keys.start == keys.stop:
            continue
        ins = [x[sl].transpose(0, 1)[None].detach().clone().requires_grad_(j >= 2)
               for j, (x, sl) in enumerate(zip(xs, (rows, keys, rows, keys)))]
        out = attention_kl_naive(*ins, causal=causal, compute_dtype=torch.bfloat16)
        out.backward(g[rows].T[None].to(out.dtype))
        kl[rows] = out[0].T.double().cpu()
        dq2[rows] = ins[2].grad[0].transpose(0, 1).double().cpu()
        dk2[keys] = ins[3].grad[0].transpose(0, 1).double().cpu()
    return kl, dq2, dk2


def checks(out):
    # the last sequence has >= 2048 keys: the forward reads keys through TMA descriptors there
    lens = [(100, 100), (0, 50), (257, 300), (1, 1), (64, 0), (513, 513), (300, 129), (7, 700), (2100, 2300)]
    H, HK1, HK2, D1, D2 = 8, 4, 2, 128, 64
    if DEV == "cpu":
        lens = [(5, 5), (0, 3), (9, 12), (1, 1), (4, 0), (17, 17), (6, 3), (2, 20)]
        H, HK1, HK2, D1, D2 = 2, 2, 1, 32, 16
    lens_q, lens_k = [a for a, _ in lens], [b for _, b in lens]
    gen = torch.Generator(device=DEV).manual_seed(0)
    tq, tk = sum(lens_q), sum(lens_k)
    xs = [torch.randn(s, device=DEV, generator=gen, dtype=torch.float32).to(torch.bfloat16)
          for s in ((tq, H, D1), (tk, HK1, D1), (tq, H, D2), (tk, HK2, D2))]
    cu_q, cu_k = cu_tensor(lens_q), cu_tensor(lens_k)
    mq, mk = max(lens_q), max(lens_k)
    g = torch.randn(tq, H, device=DEV, generator=gen)
    x64 = [x.double().cpu().numpy() for x in xs]
    results = []
    for causal in (False, True):
        ref_kl = streamkl_ref.attention_kl_varlen(*x64, cu_q.cpu().numpy(), cu_k.cpu().numpy(), mq, mk,
                                                  causal=causal)
        ref_g = streamkl_ref.attention_kl_varlen_grad(*x64, cu_q.cpu().numpy(), cu_k.cpu().numpy(), mq, mk,
                                                      g.double().cpu().numpy(), causal=causal)
        same_kl, same_dq2, same_dk2 = same_precision_bf16(xs, cu_q, cu_k, g, causal)
        for label, kw in (("fused", dict(bwd_mode="fused")), ("separate", dict(bwd_mode="separate")),
                          ("deterministic", dict(deterministic=True)), ("split_k=4", dict(split_k=4))):
            q2 = xs[2].detach().clone().requires_grad_()
            k2 = xs[3].detach().clone().requires_grad_()
            kl = streamkl_gpu.attention_kl_varlen(xs[0], xs[1], q2, k2, cu_q, cu_k, mq, mk, causal=causal, **kw)
            kl.backward(g)
            sync(DEV == "cuda")
            case = f"causal={causal} {label}"
            for name, ours, ref, same in (("kl", kl, ref_kl, same_kl), ("dq2", q2.grad, ref_g["dq2"], same_dq2),
                                          ("dk2", k2.grad, ref_g["dk2"], same_dk2)):
                err = rel_err(ours.float().cpu(), ref)
                base = rel_err(same, ref)
                tol = RATIO * base + BF16_FLOOR
                ok = err <= tol
                results.append(ok)
                out.row("check", case, "attention_kl_varlen", f"{name}_rel_err", f"{err:.3e}", "",
                        f"tol {tol:.3e} (bf16 eager {base:.3e}) {'PASS' if ok else 'FAIL'}")
                log(f"check {case} {name}: err {err:.2e} tol {tol:.2e} {'ok' if ok else 'FAIL'}")
            # zero-key sequence: KL 0 and zero gradients, exactly
            rows = slice(int(cu_q[4]), int(cu_q[5]))
            exact = bool((kl[rows] == 0).all() and (q2.grad[rows] == 0).all())
            results.append(exact)
            out.row("check", case, "attention_kl_varlen", "no_keys_exact_zero", int(exact))
    return all(results), len(results)


# Benchmark

def bench_lens(seed=0):
    lens = [16384] + [8192] * 2 + [4096] * 4 + [2048] * 8 + [1024] * 16
    random.Random(seed).shuffle(lens)
    return lens


def timed(fn, grad_to_none=None, long_call=False):
    """Median ms of ``fn``; ``long_call`` (the padded case, ~1 s a call): 3 event-timed calls."""
    if long_call and DEV == "cuda":
        fn()
        for x in grad_to_none or ():
            x.grad = None
    return time_ms(fn, cuda=DEV == "cuda", warmup=10, rep=60, grad_to_none=grad_to_none,
                   long_call_ms=0.0 if long_call else None)


def peak_extra(fn):
    """Peak bytes allocated during ``fn`` beyond what was allocated before it (0 on CPU)."""
    gib = extra_memory_gib(fn, cuda=DEV == "cuda")
    return 0 if math.isnan(gib) else gib * 2 ** 30


def benchmark(out, quick=False, parts=("packed", "a", "b")):
    H, D = 32, 128
    lens = bench_lens()
    if quick:
        lens = [n // 4 for n in lens]
    if DEV == "cpu":
        H, D = 2, 16
        lens = [n // 1024 for n in lens]
    total = sum(lens)
    n_max = max(lens)
    log(f"benchmark: {len(lens)} sequences, {total} tokens, max {n_max}, H={H}, D={D}, bf16, causal")
    gen = torch.Generator(device=DEV).manual_seed(1)
    q1, k1, q2, k2 = (torch.randn(total, H, D, device=DEV, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    q2.requires_grad_()
    k2.requires_grad_()
    cu = cu_tensor(lens)
    g = torch.randn(total, H, device=DEV, generator=gen)
    shape = f"{len(lens)} seqs {total} tokens H={H} D={D} bf16 causal"

    class Results(dict):  # every time goes to the CSV as soon as it is measured
        def __setitem__(self, key, ms):
            super().__setitem__(key, ms)
            out.row("bench", shape, key[0], f"{key[1]}_ms", f"{ms:.4f}", "ms",
                    "median (do_bench; padded: 3 event-timed calls)")

    res = Results()
    mem_fwd = mem_fb = float("nan")

    def packed_fwd():
        return streamkl_gpu.attention_kl_varlen(q1, k1, q2, k2, cu, cu, n_max, n_max, causal=True,
                                                check_seqlens=False)

    def packed_fb():
        packed_fwd().backward(g)

    if "packed" in parts:
        mem_fwd, mem_fb = bench_packed(out, res, packed_fwd, packed_fb, q2, k2)
    starts = np.concatenate([[0], np.cumsum(lens)])
    if "a" in parts:
        bench_per_sequence(out, res, lens, starts, q1, k1, q2, k2, g)
    if "b" in parts:
        bench_padded(out, res, lens, starts, n_max, H, D, q1, k1, q2, k2, g, packed_fwd)
    musts = []
    for mode in ("fwd", "fwd_bwd"):
        if ("packed", mode) in res and ("per_sequence", mode) in res:
            ra = res["packed", mode] / res["per_sequence", mode]
            out.row("bench", shape, "packed/per_sequence", f"{mode}_ratio", f"{ra:.3f}", "x", "must <= 1.1")
            musts.append((f"{mode}: packed / (a) per-sequence <= 1.1", ra, ra <= 1.1))
        if ("padded", mode) in res and ("packed", mode) in res:
            rb = res["padded", mode] / res["packed", mode]
            out.row("bench", shape, "padded/packed", f"{mode}_speedup", f"{rb:.3f}", "x", "must >= 2")
            musts.append((f"{mode}: (b) padded / packed >= 2", rb, rb >= 2.0))
    return res, musts, (mem_fwd, mem_fb)


def bench_packed(out, res, packed_fwd, packed_fb, q2, k2):
    with torch.no_grad():
        packed_fwd()  # compile + tune
    packed_fb()
    with torch.no_grad():
        res["packed", "fwd"] = timed(packed_fwd)
        mem_fwd = peak_extra(packed_fwd)
    res["packed", "fwd_bwd"] = timed(packed_fb, grad_to_none=[q2, k2])
    q2.grad = k2.grad = None
    mem_fb = peak_extra(packed_fb)
    q2.grad = k2.grad = None
    log(f"packed: fwd {res['packed', 'fwd']:.3f} ms, fwd+bwd {res['packed', 'fwd_bwd']:.3f} ms")
    for mode, v in (("fwd", mem_fwd), ("fwd_bwd", mem_fb)):
        out.row("bench", "packed", "attention_kl_varlen", f"{mode}_peak_extra", v, "bytes",
                "beyond inputs; fwd_bwd includes the q2/k2 gradients")
    return mem_fwd, mem_fb


def bench_per_sequence(out, res, lens, starts, q1, k1, q2, k2, g):
    """(a) one attention_kl call per sequence, on [1, H, n, D] views of the packed tensors."""
    fwd_sum = fb_sum = fwd_triton_sum = 0.0
    mem_a = 0
    for i, n in enumerate(lens):
        sl = slice(int(starts[i]), int(starts[i + 1]))
        v1, w1 = q1[sl].transpose(0, 1)[None], k1[sl].transpose(0, 1)[None]
        v2 = q2.detach()[sl].transpose(0, 1)[None].clone().requires_grad_()  # a leaf per sequence
        w2 = k2.detach()[sl].transpose(0, 1)[None].clone().requires_grad_()
        gi = g[sl].T[None].contiguous()

        def f_fwd():
            return streamkl_gpu.attention_kl(v1, w1, v2, w2, causal=True)

        def f_fb():
            f_fwd().backward(gi)

        with torch.no_grad():
            f_fwd()
            fwd_sum += timed(f_fwd)
            # the same calls on the Triton forward (the kernel varlen runs; attention_kl may pick Gluon)
            saved = os.environ.get("STREAMKL_FWD_BACKEND")
            os.environ["STREAMKL_FWD_BACKEND"] = "triton"  # the documented variable, read per call
            try:
                f_fwd()
                fwd_triton_sum += timed(f_fwd)
            finally:
                os.environ.pop("STREAMKL_FWD_BACKEND") if saved is None else os.environ.update(
                    STREAMKL_FWD_BACKEND=saved)
        f_fb()
        fb_sum += timed(f_fb, grad_to_none=[v2, w2])
        v2.grad = w2.grad = None
        mem_a = max(mem_a, peak_extra(f_fb))
        del v2, w2
    res["per_sequence", "fwd"] = fwd_sum
    res["per_sequence", "fwd_bwd"] = fb_sum
    out.row("bench", "per_sequence", "attention_kl (STREAMKL_FWD_BACKEND=triton)", "fwd_ms",
            f"{fwd_triton_sum:.4f}", "ms", "summed do_bench medians; varlen runs the Triton forward")
    log(f"(a') per sequence, Triton forward forced, summed: fwd {fwd_triton_sum:.3f} ms")
    out.row("bench", "per_sequence", "attention_kl", "fwd_bwd_peak_extra", mem_a, "bytes",
            "largest single call (16K); its clones of q2/k2 not counted")
    log(f"(a) per sequence, summed: fwd {fwd_sum:.3f} ms, fwd+bwd {fb_sum:.3f} ms")


def bench_padded(out, res, lens, starts, n_max, H, D, q1, k1, q2, k2, g, packed_fwd):
    """(b) every sequence right-padded to n_max, one [B, H, n_max, D] causal call."""
    B = len(lens)
    pads = []
    for x in (q1, k1, q2.detach(), k2.detach()):
        p = torch.zeros(B, H, n_max, D, device=DEV, dtype=torch.bfloat16)
        for i, n in enumerate(lens):
            p[i, :, :n] = x[int(starts[i]):int(starts[i + 1])].transpose(0, 1)
        pads.append(p)
    pq1, pk1, pq2, pk2 = pads
    pq2.requires_grad_()
    pk2.requires_grad_()
    pg = torch.zeros(B, H, n_max, device=DEV)
    for i, n in enumerate(lens):
        pg[i, :, :n] = g[int(starts[i]):int(starts[i + 1])].T

    def p_fwd():
        return streamkl_gpu.attention_kl(pq1, pk1, pq2, pk2, causal=True)

    def p_fb():
        p_fwd().backward(pg)

    with torch.no_grad():
        p_fwd()
        res["padded", "fwd"] = timed(p_fwd, long_call=True)
    log(f"(b) padded to {n_max}: fwd {res['padded', 'fwd']:.3f} ms")
    p_fb()
    res["padded", "fwd_bwd"] = timed(p_fb, grad_to_none=[pq2, pk2], long_call=True)
    pq2.grad = pk2.grad = None
    mem_b = peak_extra(p_fb)
    out.row("bench", "padded", "attention_kl", "fwd_bwd_peak_extra", mem_b, "bytes",
            "beyond the padded inputs (which are themselves 31x16K)")
    # the padded run computes the same numbers on the real rows (right padding, causal);
    # other tiles / TMA, so not bitwise: the relative difference is recorded
    with torch.no_grad():
        kl_p = p_fwd()
        kl_v = packed_fwd()
    diff = max(rel_err(kl_p[i, :, :n].T.cpu(), kl_v[int(starts[i]):int(starts[i + 1])].double().cpu())
               for i, n in enumerate(lens))
    out.row("bench", "padded", "attention_kl", "real_rows_rel_diff_vs_packed", f"{diff:.3e}")
    log(f"(b) padded to {n_max}: fwd {res['padded', 'fwd']:.3f} ms, fwd+bwd {res['padded', 'fwd_bwd']:.3f} ms; "
        f"real rows vs packed: rel diff {diff:.1e}")
    del pads, pq1, pk1, pq2, pk2


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--parts", default="checks,packed,a,b",
                    help="comma list of: checks, packed, a (per-sequence calls), b (padded to 16K); "
                         "default all, in that order (every row is written as soon as it is measured)")
    ap.add_argument("--quick", action="store_true", help="sequences 4x shorter (a smoke run)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: smoke run under the Triton interpreter at toy sizes")
    a = ap.parse_args(argv)
    global DEV
    DEV = a.device
    out = Out(a.out_dir)
    t0 = time.time()
    import triton

    gpu = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)"
    out.row("env", "gpu", gpu, "torch", torch.__version__)
    out.row("env", "gpu", gpu, "triton", triton.__version__)
    parts = [x.strip() for x in a.parts.split(",") if x.strip()]
    bad = set(parts) - {"checks", "packed", "a", "b"}
    if bad:
        ap.error(f"unknown --parts {sorted(bad)}")
    ok, n_checks = True, 0
    if "checks" in parts:
        ok, n_checks = checks(out)
        log(f"checks: {'all pass' if ok else 'FAILURES'} ({n_checks})")
    res, musts, mem = benchmark(out, quick=a.quick, parts=parts)
    out.row("env", "run", "", "wall_s", f"{time.time() - t0:.1f}", "s")
    out.f.close()

    print("\n== attention_kl_varlen (H=32, D=128, bf16, causal; 1x16K+2x8K+4x4K+8x2K+16x1K packed) ==")
    print(f"{'provider':<28}{'fwd ms':>10}{'fwd+bwd ms':>12}")
    for prov, label in (("packed", "packed (varlen)"), ("per_sequence", "(a) per sequence, summed"),
                        ("padded", "(b) padded to 16K")):
        if (prov, "fwd") in res:
            print(f"{label:<28}{res[prov, 'fwd']:>10.3f}{res.get((prov, 'fwd_bwd'), float('nan')):>12.3f}")
    print(f"packed peak extra memory: fwd {mem[0] / 2**20:.1f} MiB, fwd+bwd {mem[1] / 2**20:.1f} MiB")
    for text, value, passed in musts:
        print(f"MUST {text}: {value:.3f} {'PASS' if passed else 'FAIL'}")
    print(f"checks: {n_checks} {'PASS' if ok else 'FAIL'}; CSV: {out.path}")
    return 0 if ok and all(p for *_, p in musts) else 1  # (parts not run: not judged)


if __name__ == "__main__":
    sys.exit(main())
