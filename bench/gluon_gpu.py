"""GPU check and timing of the Gluon forward (issue 13), for one H200 run.

    python bench/gluon_gpu.py OUT_DIR [--quick] [--budget SECONDS] [--no-autotune]

Sections (a time budget skips what does not fit, recorded as ``skipped``; the SASS always runs):
1. check: the Gluon path (forced) vs the Triton path (forced) vs float64, every case class:
   bf16/fp16, ragged N, causal N_Q < N_K and N_Q > N_K (empty rows), GQA, D1 != D2 (64/128),
   transposed layouts, small N_Q, large logits, NaN in invisible keys / in one query row.
   Outputs are NaN-poisoned before the launch (_runtime.POISON_FRESH), so an unwritten row fails.
2. targets: B=1, H=32, D=128 bf16 forward at N = 8K..64K, causal and not: gluon, triton (forced),
   auto, and SDPA (default dispatch, same shape, is_causal).
3. variants: the Gluon kernel beside deliberately wrong variants (no exponentials, no second
   product, no acc work) and other launch configs, 8K (bench/NOTES.md's variant-timing method).
4. grid: the no-regression grid, auto vs forced triton (and gluon where it takes the shape):
   N = 1K..64K at D=128 bf16 and fp16, D in {64, 96, 256}, GQA 32:8, D1 != D2 = 128/64, decode
   N_Q in {1, 16}.
5. sass: the SASS of every Gluon kernel the run compiled (triton's bundled cuobjdump), with the
   HGMMA / WARPGROUP.DEPBAR / STL / LDL counts per main loop (files in OUT_DIR/sass/).
A failing case is caught, printed (with the compile error) and recorded; the run goes on.
Writes OUT_DIR/gluon_gpu.csv (long format: one row per case, provider and metric) and
OUT_DIR/gluon_gpu.log; prints short tables last.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import streamkl_gpu  # noqa: E402
from streamkl_gpu import _gluon_dispatch as dispatch  # noqa: E402
from streamkl_gpu import _gluon_sass, _runtime  # noqa: E402
from streamkl_gpu.naive import attention_kl_naive  # noqa: E402

K = 1024
LN2 = math.log(2.0)
T0 = time.time()
ROWS = []
LOG = []
SASS_SEEN = {}  # kernel hash -> (label, compiled kernel)


def log(msg=""):
    line = f"[{time.time() - T0:6.0f}s] {msg}"
    print(line, flush=True)
    LOG.append(line)


def record(section, case, provider, metric, value, status="ok", detail="", **meta):
    ROWS.append(dict(section=section, case=case, provider=provider, metric=metric,
                     value="" if value is None else value, status=status, detail=detail, **meta))


def set_backend(name):
    dispatch.FWD_BACKEND = name


def forward_bits(q1, k1, q2, k2, causal, split_k=None):
    """(kl, lse1_bits, lse2_bits) of the API's forward (``_launch.forward``) with the current
    backend setting."""
    from streamkl_gpu._launch import forward as fwd

    return fwd(q1, k1, q2, k2, causal, 1.0 / math.sqrt(q1.shape[-1]), 1.0 / math.sqrt(q2.shape[-1]), split_k)


def note_gluon_kernel(label):
    from streamkl_gpu import _gluon_fwd

    k = _gluon_fwd.LAST_KERNEL
    if k is not None:
        h = getattr(k, "hash", None) or id(k)
        SASS_SEEN.setdefault(h, (label, k))


# ----------------------------------------------------------------------------------------------
# 1. correctness
# ----------------------------------------------------------------------------------------------

def reference64(q1, k1, q2, k2, causal):
    """float64 (kl nats, lse1 bits, lse2 bits); NaN where an input NaN reaches the row."""
    kl = attention_kl_naive(q1, k1, q2, k2, causal=causal, compute_dtype=torch.float64)
    H = q1.shape[1]
    out = [kl]
    for q, k in ((q1, k1), (q2, k2)):
        k = k.repeat_interleave(H // k.shape[1], dim=1) if k.shape[1] != H else k
        s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if causal:
            nq, nk = q.shape[2], k.shape[2]
            i = torch.arange(nq, device=q.device)[:, None]
            j = torch.arange(nk, device=q.device)[None, :]
            s = s.masked_fill(~(j <= i + (nk - nq)), float("-inf"))
        out.append(torch.logsumexp(s, dim=-1) / LN2)
    return out


def _cmp(ours, ref):
    """(same NaN and inf pattern, relative error on the finite entries, max abs error there)."""
    ours = ours.double()
    same = bool(torch.equal(torch.isnan(ours), torch.isnan(ref))
                and torch.equal(torch.isinf(ours), torch.isinf(ref))
                and torch.equal(ours[torch.isinf(ref)], ref[torch.isinf(ref)]))
    fin = torch.isfinite(ref) & torch.isfinite(ours)
    if not fin.any():
        return same, 0.0, 0.0
    d = (ours[fin] - ref[fin])
    rel = (d.norm() / max(ref[fin].norm().item(), 1e-30)).item()
    return same, rel, d.abs().max().item()


def make_case(B, H, HK1, HK2, NQ, NK, D1, D2, dtype, seed=0, layout="bhnd", scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def t(h, n, d):
        if layout == "bnhd":  # [B, N, H, D] storage viewed as [B, H, N, D]
            return (scale * torch.randn(B, n, h, d, device="cuda", generator=g)).to(dtype).transpose(1, 2)
        return (scale * torch.randn(B, h, n, d, device="cuda", generator=g)).to(dtype)

    return [t(H, NQ, D1), t(HK1, NK, D1), t(H, NQ, D2), t(HK2, NK, D2)]


def check_cases(quick):
    cases = []
    for dt in ("bf16", "fp16"):
        cases += [
            (f"{dt} aligned 1024x1024 full", dict(B=1, H=4, HK1=4, HK2=4, NQ=1024, NK=1024, D1=128, D2=128), False, {}),
            (f"{dt} aligned 1024x1024 causal", dict(B=1, H=4, HK1=4, HK2=4, NQ=1024, NK=1024, D1=128, D2=128), True, {}),
            (f"{dt} ragged 777x1029 causal NQ<NK", dict(B=2, H=2, HK1=2, HK2=2, NQ=777, NK=1029, D1=128, D2=128), True, {}),
            (f"{dt} ragged 1100x613 causal NQ>NK (empty rows)", dict(B=1, H=2, HK1=2, HK2=2, NQ=1100, NK=613, D1=128, D2=128), True, {}),
            (f"{dt} GQA 8:2 / 8:4 640x640 causal", dict(B=1, H=8, HK1=2, HK2=4, NQ=640, NK=640, D1=128, D2=128), True, {}),
            (f"{dt} D1/D2 128/64 ragged 700x900 causal", dict(B=1, H=4, HK1=2, HK2=4, NQ=700, NK=900, D1=128, D2=64), True, {}),
            (f"{dt} D1/D2 64/128 ragged 900x700 full", dict(B=1, H=4, HK1=4, HK2=1, NQ=900, NK=700, D1=64, D2=128), False, {}),
            (f"{dt} D 64/64 ragged 333x1000 causal", dict(B=1, H=3, HK1=3, HK2=3, NQ=333, NK=1000, D1=64, D2=64), True, {}),
        ]
        cases += [
            (f"{dt} transposed [B,N,H,D] 512x768 causal", dict(B=2, H=4, HK1=4, HK2=2, NQ=512, NK=768, D1=128, D2=128), True, dict(layout="bnhd")),
            (f"{dt} N_Q 1 x 300 causal", dict(B=1, H=8, HK1=8, HK2=8, NQ=1, NK=300, D1=64, D2=128), True, {}),
        ]
        if not quick:
            cases += [
                (f"{dt} large logits x8 600x600 full", dict(B=1, H=2, HK1=2, HK2=2, NQ=600, NK=600, D1=128, D2=128), False, dict(scale=8.0)),
                (f"{dt} small N_Q 16 x 5000 full", dict(B=1, H=8, HK1=8, HK2=8, NQ=16, NK=5000, D1=128, D2=128), False, {}),
                (f"{dt} N_K 1..100 tiny 130x100 causal", dict(B=1, H=2, HK1=2, HK2=2, NQ=130, NK=100, D1=128, D2=128), True, {}),
                (f"{dt} 4096x4096 causal", dict(B=1, H=4, HK1=4, HK2=4, NQ=4096, NK=4096, D1=128, D2=128), True, {}),
            ]
        if quick and dt == "fp16":  # fp16 in --quick: the dtype on three of the classes
            cases = [c for c in cases if not c[0].startswith("fp16")] + [
                c for c in cases if c[0].startswith("fp16") and ("aligned 1024x1024 causal" in c[0] or "128/64" in c[0])]
        cases += [(f"{dt} NaN in invisible keys 300x300 causal", dict(B=1, H=2, HK1=2, HK2=2, NQ=300, NK=300, D1=128, D2=128), True, dict(nan="keys")),
                  (f"{dt} NaN in one query row 260x700 full", dict(B=1, H=2, HK1=2, HK2=2, NQ=260, NK=700, D1=128, D2=128), False, dict(nan="query"))]
    return cases


def run_check(quick):
    log("== check: gluon vs triton vs float64 (outputs NaN-poisoned; Triton path untuned: first config)")
    _runtime.POISON_FRESH = True
    tune = os.environ.get("STREAMKL_AUTOTUNE")
    os.environ["STREAMKL_AUTOTUNE"] = "0"  # accuracy does not need tuned configs (saves compiles)
    results = []
    for i, (name, shape, causal, opts) in enumerate(check_cases(quick)):
        dtype = torch.bfloat16 if name.startswith("bf16") else torch.float16
        meta = dict(dtype=name[:4], causal=int(causal), **{k.lower(): v for k, v in shape.items()})
        try:
            xs = make_case(**shape, dtype=dtype, seed=i, layout=opts.get("layout", "bhnd"), scale=opts.get("scale", 1.0))
            if opts.get("nan") == "keys":  # keys 250.. are invisible to rows < 250 (N_Q == N_K)
                for k in (xs[1], xs[3]):
                    k[:, :, 250:] = float("nan")
            if opts.get("nan") == "query":
                xs[0][:, :, 5] = float("nan")
            ref = reference64(*xs, causal)
            outs = {}
            for prov in ("triton", "gluon"):
                set_backend(prov)
                outs[prov] = [t.clone() for t in forward_bits(*xs, causal)]
                torch.cuda.synchronize()
                if prov == "gluon":
                    note_gluon_kernel(name)
            set_backend("auto")
            ok = True
            details = []
            for j, what in enumerate(("kl", "lse1_bits", "lse2_bits")):
                same_g, rel_g, abs_g = _cmp(outs["gluon"][j], ref[j])
                same_t, rel_t, abs_t = _cmp(outs["triton"][j], ref[j])
                vs = (outs["gluon"][j] - outs["triton"][j]).abs()
                vs = vs[torch.isfinite(vs)]
                vs_max = vs.max().item() if vs.numel() else 0.0
                floor = 1e-5
                good = same_g and rel_g <= 3 * rel_t + floor
                ok &= good
                record("check", name, "gluon", f"{what}_rel_err", rel_g, "ok" if good else "FAIL", **meta)
                record("check", name, "triton", f"{what}_rel_err", rel_t, "ok" if same_t else "FAIL(pattern)", **meta)
                record("check", name, "gluon", f"{what}_max_abs_err", abs_g, **meta)
                record("check", name, "gluon-triton", f"{what}_max_abs_diff", vs_max, **meta)
                details.append(f"{what}: gluon {rel_g:.1e}{'' if same_g else ' PATTERN'} triton {rel_t:.1e}"
                               f"{'' if same_t else ' PATTERN'} |g-t| {vs_max:.1e}")
            if causal and shape["NQ"] == shape["NK"] and not opts.get("nan"):
                exact0 = bool((outs["gluon"][0][..., 0] == 0).all())  # one visible key: KL exactly 0
                ok &= exact0
                record("check", name, "gluon", "one_key_row_exactly_0", int(exact0), "ok" if exact0 else "FAIL", **meta)
            results.append((name, ok, "; ".join(details)))
            log(f"{'PASS' if ok else 'FAIL'} {name}: {'; '.join(details)}")
        except Exception as exc:  # record and go on
            set_backend("auto")
            tb = traceback.format_exc()
            results.append((name, False, f"{type(exc).__name__}: {str(exc)[:300]}"))
            record("check", name, "gluon", "error", None, "ERROR", f"{type(exc).__name__}: {str(exc)[:2000]}", **meta)
            log(f"ERROR {name}:\n{tb[-4000:]}")
        finally:
            torch.cuda.empty_cache()
    _runtime.POISON_FRESH = False
    if tune is None:
        os.environ.pop("STREAMKL_AUTOTUNE")
    else:
        os.environ["STREAMKL_AUTOTUNE"] = tune
    return results


# ----------------------------------------------------------------------------------------------
# 2. SASS
# ----------------------------------------------------------------------------------------------

def run_sass(out_dir):
    log("== sass of the Gluon kernels this run compiled")
    os.makedirs(os.path.join(out_dir, "sass"), exist_ok=True)
    summary = []
    for n, (h, (label, k)) in enumerate(SASS_SEEN.items()):
        try:
            sass = _gluon_sass.sass_of(k)
            name = f"gluon_{n:02d}"
            with open(os.path.join(out_dir, "sass", name + ".sass"), "w") as f:
                f.write(f"// first used by: {label}\n// hash: {h}\n" + sass)
            c = _gluon_sass.sass_counts(sass)
            regs = getattr(k, "n_regs", None)
            spills = getattr(k, "n_spills", None)
            loops = [(lp["hgmma"], lp["depbar"], lp["ex2"], lp["ex2_between_waits"]) for lp in c["loops"]]
            ok = c["stl"] == 0 and c["ldl"] == 0 and c["hgmma"] > 0 and loops and all(1 <= d <= 2 for _, d, _, _ in loops)
            if label.startswith("variant"):  # timing variants: reported, not judged
                ok = None
            for m in ("hgmma", "depbar", "stl", "ldl", "ex2"):
                record("sass", label, name, m, c[m])
            record("sass", label, name, "loops(hgmma,depbar,ex2,ex2_between_waits)", json.dumps(loops),
                   "ok" if ok else ("info" if ok is None else "FAIL"), f"regs={regs} spills={spills}")
            summary.append((name, label, ok, c, loops, regs, spills))
            log(f"{'ok  ' if ok else ('info' if ok is None else 'FAIL')} {name} ({label}): HGMMA={c['hgmma']} DEPBAR={c['depbar']} STL={c['stl']} "
                f"LDL={c['ldl']} regs={regs} spills={spills} loops={loops}")
        except Exception as exc:
            log(f"ERROR sass {label}: {type(exc).__name__}: {exc}")
            record("sass", label, "", "error", None, "ERROR", str(exc)[:2000])
    return summary


# ----------------------------------------------------------------------------------------------
# 3./4. timing
# ----------------------------------------------------------------------------------------------

class Budget:
    def __init__(self, seconds):
        self.end = T0 + seconds

    def left(self):
        return self.end - time.time()


def time_ms(fn, warmup, rep):
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def time_point(section, case, meta, xs, causal, providers, warmup, rep, budget, times):
    for prov in providers:
        if budget.left() < 5:
            record(section, case, prov, "ms", None, "skipped", "time budget", **meta)
            continue
        try:
            if prov == "sdpa":
                q1, k1, q2, _ = xs
                fn = lambda: F.scaled_dot_product_attention(q1, k1, q2, is_causal=causal)  # noqa: E731
            else:
                backend = {"gluon": "gluon", "triton": "triton", "auto": "auto"}[prov]

                def fn(backend=backend):
                    set_backend(backend)
                    return streamkl_gpu.attention_kl(*xs, causal=causal)
            with torch.no_grad():
                ms = time_ms(fn, warmup, rep)
            if prov == "gluon":
                note_gluon_kernel(case)
            times[prov] = ms
            record(section, case, prov, "ms", ms, **meta)
        except Exception as exc:
            tb = traceback.format_exc()
            record(section, case, prov, "ms", None, "ERROR", f"{type(exc).__name__}: {str(exc)[:2000]}", **meta)
            log(f"ERROR {section} {case} {prov}:\n{tb[-3000:]}")
        finally:
            set_backend("auto")
    line = " ".join(f"{p}={times[p]:.3f}" for p in providers if p in times)
    log(f"{section} {case}: {line}")


def supported(xs):
    """Does the Gluon kernel take these inputs (ignoring split-K, which forced gluon overrides)?"""
    from streamkl_ref._checks import check_inputs

    dims = check_inputs(*xs)
    return dispatch.gluon_unsupported(dims, [t.dtype for t in xs], [t.stride() for t in xs],
                                      dispatch.device_capability(xs[0].device), False,
                                      [t.data_ptr() for t in xs]) is None


def run_timing(section, points, warmup, rep, budget):
    log(f"== {section}")
    table = []
    for case, shape, causal, with_sdpa in points:
        dtype = torch.bfloat16 if shape.pop("dtype", "bf16") == "bf16" else torch.float16
        meta = dict(dtype="bf16" if dtype == torch.bfloat16 else "fp16", causal=int(causal),
                    **{k.lower(): v for k, v in shape.items()})
        times = {}
        if budget.left() < 10:
            record(section, case, "all", "ms", None, "skipped", "time budget", **meta)
            table.append((case, causal, times))
            continue
        try:
            xs = make_case(**shape, dtype=dtype, seed=7)
            provs = ["auto", "triton"]
            if supported(xs):
                provs.insert(0, "gluon")
            if with_sdpa and shape["HK1"] == shape["H"] and shape["D1"] == shape["D2"]:
                provs.append("sdpa")
            time_point(section, case, meta, xs, causal, provs, warmup, rep, budget, times)
        except Exception as exc:
            record(section, case, "all", "ms", None, "ERROR", f"{type(exc).__name__}: {str(exc)[:2000]}", **meta)
            log(f"ERROR {section} {case}: {traceback.format_exc()[-3000:]}")
        finally:
            xs = None
            torch.cuda.empty_cache()
        table.append((case, causal, times))
    return table


def run_variants(quick, warmup, rep, budget):
    """Time the Gluon kernel beside deliberately wrong variants of it (bench/NOTES.md's method:
    what the time is made of) and a few launch configurations, at B=1, H=32, D=128, bf16, 8K."""
    from streamkl_gpu import _gluon_fwd

    log("== variants and configs of the Gluon kernel (8K, bf16, D=128; wrong results on purpose)")
    table = []
    sc = 1.0 / math.sqrt(128)
    runs = [(v, None) for v in _gluon_fwd.VARIANTS if not (quick and v == "no_acc")]
    if not quick:
        runs += [("kernel", c) for c in (dict(maxnreg=224), dict(BLOCK_N=64, NUM_STAGES=4))]
    for causal in ((False,) if quick else (False, True)):
        sh = shape(8 * K)
        sh.pop("dtype")
        xs = make_case(**sh, dtype=torch.bfloat16, seed=3)
        times = {}
        for variant, config in runs:
            name = variant if config is None else "kernel " + ",".join(f"{k}={v}" for k, v in config.items())
            meta = dict(dtype="bf16", causal=int(causal), **{k.lower(): v for k, v in sh.items()})
            if budget.left() < 10:
                record("variants", name, "gluon", "ms", None, "skipped", "time budget", **meta)
                continue
            try:
                fn = lambda: _gluon_fwd.gluon_forward(*xs, causal, sc, sc, config=config, variant=variant)  # noqa: E731
                ms = time_ms(fn, warmup, rep)
                note_gluon_kernel(f"variant {name} causal={int(causal)}")
                times[name] = ms
                record("variants", name, "gluon", "ms", ms, **meta)
            except Exception as exc:
                record("variants", name, "gluon", "ms", None, "ERROR", f"{type(exc).__name__}: {str(exc)[:2000]}", **meta)
                log(f"ERROR variant {name}: {traceback.format_exc()[-3000:]}")
        log(f"variants causal={int(causal)}: " + " ".join(f"{k}={v:.3f}" for k, v in times.items()))
        table.append((causal, times))
        xs = None
        torch.cuda.empty_cache()
    return table


def shape(N, NQ=None, D1=128, D2=128, H=32, HK=None, dtype="bf16"):
    HK = HK or H
    return dict(B=1, H=H, HK1=HK, HK2=HK, NQ=NQ or N, NK=N, D1=D1, D2=D2, dtype=dtype)


def target_points(quick):
    ns = [8 * K, 16 * K] if quick else [8 * K, 16 * K, 32 * K, 64 * K]
    return [(f"bf16 D128 N={n // K}K {'causal' if c else 'full'}", shape(n), c, True) for n in ns for c in (False, True)]


def grid_points(quick):
    pts = []
    if quick:
        for n in (1 * K, 2 * K, 4 * K):
            pts.append((f"bf16 D128 N={n // K}K full", shape(n), False, False))
        pts.append(("fp16 D128 N=8K causal", shape(8 * K, dtype="fp16"), True, False))
        pts.append(("bf16 D128/64 N=8K full", shape(8 * K, D2=64), False, False))
        pts.append(("bf16 decode NQ=16 NK=32K", shape(32 * K, NQ=16), False, False))
        return pts
    for dt in ("bf16", "fp16"):
        for n in (1 * K, 2 * K, 4 * K, 8 * K, 16 * K, 32 * K, 64 * K):
            if dt == "bf16" and n >= 8 * K:
                continue  # in the targets section (same run)
            for c in (False, True):
                pts.append((f"{dt} D128 N={n // K}K {'causal' if c else 'full'}", shape(n, dtype=dt), c, False))
    for d in (64, 96, 256):
        for c in (False, True):
            pts.append((f"bf16 D{d} N=8K {'causal' if c else 'full'}", shape(8 * K, D1=d, D2=d), c, False))
    for c in (False, True):
        pts.append((f"bf16 GQA 32:8 N=8K {'causal' if c else 'full'}", shape(8 * K, HK=8), c, False))
        pts.append((f"bf16 D128/64 N=8K {'causal' if c else 'full'}", shape(8 * K, D2=64), c, False))
    for nq, nk in ((1, 32 * K), (16, 32 * K), (16, 128 * K)):
        pts.append((f"bf16 decode NQ={nq} NK={nk // K}K", shape(nk, NQ=nq), False, False))
    return pts


# ----------------------------------------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--quick", action="store_true", help="fewer cases and sizes (about 3 minutes)")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 170 quick, 540)")
    p.add_argument("--no-autotune", action="store_true", help="Triton path: first config, no tuning")
    p.add_argument("--no-check", action="store_true", help="skip the correctness section (timing only)")
    a = p.parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    if a.no_autotune:
        os.environ["STREAMKL_AUTOTUNE"] = "0"
    budget = Budget(a.budget if a.budget is not None else (170 if a.quick else 540))
    env = dict(gpu=torch.cuda.get_device_name(), capability=str(torch.cuda.get_device_capability()),
               torch=torch.__version__, triton=triton.__version__, gluon=dispatch.GLUON_AVAILABLE,
               gluon_error=dispatch.GLUON_IMPORT_ERROR,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    log(f"env {env}")
    warmup, rep = (10, 40) if a.quick else (20, 80)

    checks = [] if a.no_check else run_check(a.quick)
    targets, grid = [], []
    if budget.left() > 20:
        targets = run_timing("targets", target_points(a.quick), warmup, rep, budget)
    variants = []
    if budget.left() > 30:
        variants = run_variants(a.quick, warmup, rep, budget)
    if budget.left() > 20:
        grid = run_timing("grid", grid_points(a.quick), warmup, rep, budget)
    sass = run_sass(a.out_dir)

    keys = ["section", "case", "provider", "metric", "value", "status", "detail", "dtype", "causal",
            "b", "h", "hk1", "hk2", "nq", "nk", "d1", "d2"]
    with open(os.path.join(a.out_dir, "gluon_gpu.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, keys + list(env))
        w.writeheader()
        for r in ROWS:
            w.writerow({**{k: "" for k in keys}, **r, **env})

    # ---- short tables (last)
    out = ["", "== summary", f"env: {env}"]
    n_ok = sum(ok for _, ok, _ in checks)
    out.append(f"check: {n_ok}/{len(checks)} pass")
    out += [f"  FAIL {n}: {d}" for n, ok, d in checks if not ok]
    judged = [s for s in sass if s[2] is not None]
    out.append(f"sass: {sum(bool(s[2]) for s in judged)}/{len(judged)} kernels ok (no STL/LDL, HGMMA, 1-2 DEPBAR "
               "per loop; timing variants: info only)")
    out += [f"  {s[0]} {'ok  ' if s[2] else ('info' if s[2] is None else 'FAIL')} {s[1]}: HGMMA={s[3]['hgmma']} DEPBAR={s[3]['depbar']} "
            f"STL={s[3]['stl']} LDL={s[3]['ldl']} regs={s[5]} loops={s[4]}" for s in sass]
    out.append("targets (ms; ratio to SDPA): case | gluon | triton | auto | sdpa | gluon/sdpa | triton/sdpa")
    for case, _, t in targets:
        sd = t.get("sdpa")
        r = lambda k: f"{t[k] / sd:.2f}" if (k in t and sd) else "-"  # noqa: E731
        f_ = lambda k: f"{t[k]:.3f}" if k in t else "-"  # noqa: E731
        out.append(f"  {case:28s} | {f_('gluon')} | {f_('triton')} | {f_('auto')} | {f_('sdpa')} | {r('gluon')} | {r('triton')}")
    out.append("grid (ms): case | gluon | triton | auto | auto/triton (must be <= 1.03) | gluon/triton")
    worst = 0.0
    for case, _, t in targets + grid:
        at = t["auto"] / t["triton"] if ("auto" in t and "triton" in t) else None
        gt = t["gluon"] / t["triton"] if ("gluon" in t and "triton" in t) else None
        if at is not None:
            worst = max(worst, at)
        f_ = lambda k: f"{t[k]:.3f}" if k in t else "-"  # noqa: E731
        out.append(f"  {case:28s} | {f_('gluon')} | {f_('triton')} | {f_('auto')} | "
                   f"{'-' if at is None else f'{at:.3f}'}{' REGRESSION' if at and at > 1.03 else ''} | "
                   f"{'-' if gt is None else f'{gt:.3f}'}")
    out.append(f"worst auto/triton: {worst:.3f}")
    for causal, t in variants:
        base = t.get("kernel")
        out.append(f"variants causal={int(causal)} (ms; ratio to the kernel): " + ", ".join(
            f"{k} {v:.3f}" + (f" ({v / base:.2f})" if base else "") for k, v in t.items()))
    out.append(f"total {time.time() - T0:.0f}s")
    for line in out:
        log(line)
    with open(os.path.join(a.out_dir, "gluon_gpu.log"), "w") as f:
        f.write("\n".join(LOG) + "\n")


if __name__ == "__main__":
    main()
