"""Section ``nan``: the NaN/inf isolation contract (docs/api.md, "NaN and infinity") on the GPU,
through the public API only. (What the guards cost: the ``nan_cost`` section.)

    python bench/bench_gpu.py --sections nan                       # about 30-60 s, mostly compiling
    python bench/bench_gpu.py --sections nan --device cpu --tiny   # CPU smoke under the interpreter

For a few shapes (ragged with GQA in bf16, fp16 and fp32; two tile-sized ones, 128 and 2K keys, the
latter through the TMA path on Hopper; N_Q > N_K with empty rows; a decode shape that the forward
splits over keys; the others in bf16), causal:
every input is a strided view into a larger NaN-filled buffer (NaN just past N_K, past D and past
the heads), and two poison sets are planted: "keys" (NaN and +-inf in keys past the causal
frontier of most rows) and "rows" (NaN/inf in query rows, one an empty row when N_Q > N_K, and NaN
in an upstream-gradient row). Against the clean run (same layout, finite padding):

- forward (Triton one pass, Triton split-K, Gluon): KL, LSE1, LSE2 of unreached rows bitwise equal;
- backward, deterministic=True: dq1, dq2 of unreached rows and dk1, dk2 of unreached keys bitwise;
- backward with atomics (bwd_mode="fused", and "separate" whose GQA dk adds atomically): the same
  entries within 2 ulp of the dtype relative plus 1e-4 of the tensor's largest entry;
- everywhere: every entry a NaN reaches is NaN (never a silent 0), unreached entries are finite.

A row is *reached* if it holds a poisoned query (or upstream gradient) or sees a poisoned key and
at least one key; a key's dk is reached if a reached row sees it. Writes OUT_DIR/nan_check.csv (one
line per compared tensor), a pass/fail table last; exit 0 only if all passed. STREAMKL_AUTOTUNE=0
(one launch config per shape); STREAMKL_FWD_BACKEND picks the forward kernel per path.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from unittest import mock
from dataclasses import dataclass

COLUMNS = ["case", "dtype", "poison", "path", "tensor", "compared", "reached", "max_abs_diff", "tol",
           "bitwise", "nan_ok", "finite_ok", "pass", "tma_expected", "detail"]


@dataclass(frozen=True)
class Case:
    name: str
    B: int
    H: int
    HK1: int
    HK2: int
    NQ: int
    NK: int
    D1: int
    D2: int
    dtypes: tuple
    layout: str = "bhnd"  # "bnhd": [B, N, H, D] buffers seen through transpose(1, 2)
    pad: tuple = (0, 1, 16, 8)  # NaN storage past B, heads, N, D (8 keeps 16-byte rows for TMA)


def gpu_cases():
    """Few dtype/shape combinations: each one compiles its own kernels (most of the run time)."""
    return [
        Case("ragged-200-gqa", 1, 4, 1, 2, 200, 200, 64, 64, ("bf16", "fp16", "fp32"), layout="bnhd"),
        Case("tile-128", 1, 2, 2, 2, 128, 128, 128, 128, ("bf16",), pad=(1, 0, 16, 8)),
        Case("nq>nk", 1, 2, 1, 2, 300, 100, 64, 64, ("bf16",), layout="bnhd"),
        Case("tma-2k", 1, 2, 1, 2, 2048, 2048, 128, 128, ("bf16",), pad=(0, 1, 64, 8)),
        Case("decode-16x4k", 1, 4, 1, 1, 16, 4096, 64, 64, ("bf16",)),
    ]


def tiny_cases():
    return [
        Case("ragged-20", 1, 2, 1, 2, 20, 20, 8, 12, ("fp32",), layout="bnhd", pad=(0, 1, 5, 3)),
        Case("nq>nk", 1, 2, 1, 1, 30, 10, 8, 8, ("fp16",), pad=(0, 1, 3, 2)),
    ]


def poisons(case: Case, kind: str):
    """``(key_poison, query_poison, grad_poison)`` as in tests/_nan_cases.py, for every batch."""
    nan, inf = math.nan, math.inf
    NQ, NK = case.NQ, case.NK
    if kind == "keys":  # past the causal frontier of most rows (key j is seen by rows i >= j + NQ - NK)
        m = min(NQ, NK)
        return ([(1, 0, NK - 1 - m // 5, 1, nan), (2, case.HK2 - 1, NK - 1 - m // 9, 2, inf),
                 (1, 0, NK - 1, 0, -inf)], [], [])
    first = (NQ - NK) // 2 if NQ > NK else NQ // 3  # an empty row when N_Q > N_K
    return ([], [(1, 0, first, 3, nan), (2, case.H - 1, NQ - 1 - NQ // 4, 0, inf), (1, case.H - 1, NQ - 2, 1, nan)],
            [(min(1, case.H - 1), NQ // 2, nan)])


def main(out_dir, tiny: bool = False) -> bool:
    t_start = time.time()
    if tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ["STREAMKL_AUTOTUNE"] = "0"
    import torch

    import streamkl_gpu

    device = torch.device("cpu" if tiny else "cuda")
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    int_view = {2: torch.int16, 4: torch.int32}
    cc_major = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 0
    rows = []

    def visible(case):
        i = torch.arange(case.NQ)[:, None]
        j = torch.arange(case.NK)[None, :]
        return j <= i + (case.NK - case.NQ)  # bottom-right causal

    def taint(case, kind):
        key_p, query_p, grad_p = poisons(case, kind)
        vis = visible(case)
        sees_any = vis.any(dim=1)
        H, NK, NQ = case.H, case.NK, case.NQ

        def marks(nan_only):
            kmark = torch.zeros(H, NK, dtype=torch.bool)
            qmark = torch.zeros(H, NQ, dtype=torch.bool)
            gmark = torch.zeros(H, NQ, dtype=torch.bool)
            for side, kh, j, _, v in key_p:
                if nan_only and not math.isnan(v):
                    continue
                group = H // (case.HK1 if side == 1 else case.HK2)
                kmark[kh * group:(kh + 1) * group, j] = True
            for _, h, i, _, v in query_p:
                if not (nan_only and not math.isnan(v)):
                    qmark[h, i] = True
            for h, i, v in grad_p:
                if not (nan_only and not math.isnan(v)):
                    gmark[h, i] = True
            sees_bad = (kmark[:, None, :] & vis[None]).any(dim=-1)
            fwd = sees_any & (qmark | sees_bad)
            return fwd, fwd | (sees_any & gmark)

        def keys(rows_bwd, hk):
            return (rows_bwd[:, :, None] & vis[None]).any(dim=1).view(hk, H // hk, NK).any(dim=1)

        fwd, bwd = marks(False)
        fwd_nan, bwd_nan = marks(True)
        return dict(fwd=(fwd, fwd_nan), bwd=(bwd, bwd_nan),
                    dk1=(keys(bwd, case.HK1), keys(bwd_nan, case.HK1)),
                    dk2=(keys(bwd, case.HK2), keys(bwd_nan, case.HK2)))

    def make_inputs(case, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        shapes = [(case.B, case.H, case.NQ, case.D1), (case.B, case.HK1, case.NK, case.D1),
                  (case.B, case.H, case.NQ, case.D2), (case.B, case.HK2, case.NK, case.D2)]
        xs = [torch.randn(s, generator=g).to(dtype) for s in shapes]
        return xs, torch.randn(case.B, case.H, case.NQ, generator=g)

    def place(case, x, fill):
        """``x`` inside a buffer ``case.pad`` larger on every axis, filled with ``fill``: a strided view."""
        B, H, N, D = x.shape
        pb, ph, pn, pd = case.pad
        if case.layout == "bhnd":
            buf = torch.full((B + pb, H + ph, N + pn, D + pd), fill, dtype=x.dtype, device=device)
            view = buf[:B, :H, :N, :D]
        else:
            buf = torch.full((B + pb, N + pn, H + ph, D + pd), fill, dtype=x.dtype, device=device)
            view = buf[:B, :N, :H, :D].transpose(1, 2)
        view.copy_(x.to(device))
        return view

    def poisoned(case, xs, g, kind):
        xs = [x.clone() for x in xs]
        g = g.clone()
        key_p, query_p, grad_p = poisons(case, kind)
        for side, kh, j, d, v in key_p:
            xs[1 if side == 1 else 3][:, kh, j, d] = v
        for side, h, i, d, v in query_p:
            xs[0 if side == 1 else 2][:, h, i, d] = v
        for h, i, v in grad_p:
            g[:, h, i] = v
        return xs, g

    def tma_expected(case, views):
        if device.type != "cuda" or cc_major < 9 or case.NK < 2048:
            return False
        return all(v.stride(-1) == 1 and v.data_ptr() % 16 == 0
                   and all((s * v.element_size()) % 16 == 0 for s in v.stride()[:-1]) for v in (views[1], views[3]))

    def forward(views, split_k):
        kl, lse1, lse2 = streamkl_gpu.attention_kl_with_lse(*views, causal=True, split_k=split_k)
        return {"kl": kl, "lse1": lse1, "lse2": lse2}

    def backward(views, g, bwd_mode, deterministic):
        ins = [v.detach().requires_grad_(True) for v in views]
        kl = streamkl_gpu.attention_kl(*ins, causal=True, bwd_mode=bwd_mode, deterministic=deterministic)
        kl.backward(g.to(device))
        return {n: x.grad for n, x in zip(("dq1", "dk1", "dq2", "dk2"), ins)}

    def compare(meta, name, out, clean, reached, reached_nan, exact):
        """One CSV row: unreached entries equal (bitwise or within tolerance), NaN where a NaN reaches."""
        out, clean = out.detach().cpu(), clean.detach().cpu()
        extra = out.dim() - reached.dim() - 1
        shape_mask = lambda m: m.view((1,) + tuple(m.shape) + (1,) * extra).expand(out.shape)  # noqa: E731
        keep, nan_mask = ~shape_mask(reached), shape_mask(reached_nan)
        o, c = out[keep], clean[keep]
        finite_ok = bool(torch.isfinite(c).all() or torch.isneginf(c[~torch.isfinite(c)]).all())
        nan_ok = bool(torch.isnan(out[nan_mask]).all())
        same_special = torch.equal(torch.isneginf(o), torch.isneginf(c)) and not torch.isnan(o).any()
        of, cf = o.double().masked_fill(torch.isneginf(o), 0), c.double().masked_fill(torch.isneginf(c), 0)
        diff = (of - cf).abs()
        max_diff = diff.max().item() if diff.numel() else 0.0
        bitwise = bool(torch.equal((o + 0).view(int_view[o.element_size()]), (c + 0).view(int_view[c.element_size()])))
        if exact:
            tol, ok = 0.0, bitwise
        else:
            eps = torch.finfo(out.dtype).eps
            scale = cf.abs().max().item() if cf.numel() else 0.0
            tol = 1e-4 * scale
            ok = same_special and bool((diff <= 2 * eps * cf.abs() + tol).all())
        passed = ok and nan_ok and finite_ok
        rows.append({**meta, "tensor": name, "compared": int(keep.sum()), "reached": int((~keep).sum()),
                     "max_abs_diff": f"{max_diff:.3e}", "tol": "bitwise" if exact else f"2ulp+{tol:.2e}",
                     "bitwise": int(bitwise), "nan_ok": int(nan_ok), "finite_ok": int(finite_ok),
                     "pass": int(passed), "detail": ""})
        return passed

    # (name, kind, argument, forward backend): the forward on the Triton kernel in one pass (keys
    # through TMA from 2K keys on Hopper) and split over keys as it picks, on the Gluon kernel
    # (forced: "n/a" where it does not take the problem), and the backward paths (forward "auto")
    paths = [("fwd triton", "fwd", 1, "triton"), ("fwd triton split=auto", "fwd", None, "triton"),
             ("fwd gluon", "fwd", 1, "gluon"), ("bwd deterministic", "bwd", ("auto", True), "auto"),
             ("bwd fused", "bwd", ("fused", False), "auto"), ("bwd separate", "bwd", ("separate", False), "auto")]

    def run_path(kind, arg, backend, views, g):
        with mock.patch.dict(os.environ, {"STREAMKL_FWD_BACKEND": backend}):
            return forward(views, arg) if kind == "fwd" else backward(views, g, *arg)

    summary = {}
    cases = tiny_cases() if tiny else gpu_cases()
    for case in cases:
        for dname in case.dtypes:
            dtype = dtypes[dname]
            xs, g = make_inputs(case, dtype, seed=case.NQ * 7 + case.NK)
            clean_views = [place(case, x, 0.0) for x in xs]
            tma = tma_expected(case, clean_views)
            clean_out = {}
            for path, kind, arg, backend in paths:
                try:
                    clean_out[path] = run_path(kind, arg, backend, clean_views, g)
                except ValueError as exc:  # a forced backend that does not take this problem
                    if backend != "gluon":
                        raise
                    clean_out[path] = f"n/a: {exc}"
            for poison in ("keys", "rows"):
                bad_xs, bad_g = poisoned(case, xs, g, poison)
                views = [place(case, x, math.nan) for x in bad_xs]
                reach = taint(case, poison)
                for path, kind, arg, backend in paths:
                    meta = dict(case=case.name, dtype=dname, poison=poison, path=path,
                                tma_expected=int(tma and path == "fwd triton"))
                    key = (case.name, dname, path)
                    if isinstance(clean_out[path], str):
                        rows.append({**meta, "tensor": "-", "pass": "", "detail": clean_out[path][:300]})
                        summary.setdefault(key, None)
                        continue
                    try:
                        out = run_path(kind, arg, backend, views, bad_g)
                        exact = kind == "fwd" or arg[1]
                        ok = True
                        for name, x in out.items():
                            r, r_nan = reach["fwd" if kind == "fwd" else
                                             ("bwd" if name.startswith("dq") else name)]
                            if name.startswith("lse"):  # a NaN on the other side leaves an LSE finite
                                r_nan = torch.zeros_like(r_nan)
                            ok &= compare(meta, name, x, clean_out[path][name], r, r_nan, exact)
                    except Exception as exc:  # report, keep checking the rest
                        rows.append({**meta, "tensor": "-", "pass": 0, "detail": f"{type(exc).__name__}: {exc}"[:300]})
                        ok = False
                    summary[key] = summary.get(key, True) is not False and ok
            print(f"{case.name:14s} {dname}: done at {time.time() - t_start:.1f} s"
                  + (" (Triton TMA path expected)" if tma else ""), flush=True)

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "nan_check.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in COLUMNS})
    for r in rows:
        if r["pass"] == 0:
            print("FAIL", {k: r.get(k, "") for k in COLUMNS if r.get(k, "") != ""}, flush=True)
    path_names = [p[0] for p in paths]
    print(f"\nNaN isolation check ({'CPU interpreter' if tiny else torch.cuda.get_device_name(device)}), "
          f"{time.time() - t_start:.1f} s; each cell: both poison sets, every output "
          f"(n/a: the forced Gluon forward does not take the problem; reason in the CSV)", flush=True)
    width = max(len(p) for p in path_names)
    print(f"{'case':15s} {'dtype':5s} " + " ".join(f"{p:>{width}s}" for p in path_names))
    cell = {True: "pass", False: "FAIL", None: "n/a"}
    for case in cases:
        for dname in case.dtypes:
            cells = [cell[summary[(case.name, dname, p)]] for p in path_names]
            print(f"{case.name:15s} {dname:5s} " + " ".join(f"{c:>{width}s}" for c in cells))
    all_ok = all(v is not False for v in summary.values())
    print("ALL PASS" if all_ok else "SOME FAILED (see the FAIL lines above and nan_check.csv)", flush=True)
    return all_ok


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory for nan_check.csv")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    args = parser.parse_args()
    sys.exit(0 if main(args.out_dir, tiny=args.tiny) else 1)
