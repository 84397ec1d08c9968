"""Section ``indexer``: the indexer loss, dense (``indexer_kl``) and top-k (``indexer_kl_topk``), its
training step on every path: the tables of docs/indexer.md's training section.

    python bench/bench_gpu.py --sections indexer                    # one H200: ~6 min, compiles included
    python bench/bench_gpu.py --sections indexer --section-args indexer="--memory-n 131072"   # + 128K memory
    PYTHONPATH=bench:. python -m streamkl_bench.indexer --out /tmp/x --tiny   # CPU smoke (< 20 s)

Times (medians of ``--rounds`` >= 5 interleaved rounds) at 8K, causal, bf16, B = 1, indexer inputs
requiring grad, ``reduction="mean"``, for a DSA-like teacher (H=128, D=576, MQA, sigma=192^-0.5;
indexer 64 x 128) and a GQA-like one (H=32 over 8 key heads, D=128; indexer 16 x 64), on every path
(``lse`` given, no ``lse``, ``row_weights=`` with and without ``lse``): forward, forward+backward,
extra memory; ``torch.compile`` of the materialised loss (or its OOM); ``indexer_kl_topk`` at 8K and
32K with 2048 random visible keys per row against ``torch.compile`` of the top-k loss; each point's
floor at this process's bf16 matmul rate (FLOPs, causal):
      lse given   2 * N^2/2 * (H D + 3 H_I D_I)
      no lse      2 * N^2/2 * (2 H D + 3 H_I D_I)        (row weights: as their lse case)
      top-k       2 * N * topk * (H D + 3 H_I D_I)
Checks against float64 (streamkl_ref) on every path at odd shapes (B = 2, N_Q = 200, N_K = 264):
loss within 1e-5 (relative to max(1, |loss|)), gradients within 5e-3 relative; top-k likewise.
Output: OUT/indexer_training.csv (long format: section, measure, teacher, path, provider, n, value,
unit, note, gpu, timestamp, torch, triton, streamkl); the summary table on stdout."""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import itertools
import math
import os
import statistics
import sys
import time
import traceback
from unittest import mock

if "--tiny" in sys.argv:  # the interpreter must be chosen before Triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

import streamkl_ref  # noqa: E402
import streamkl_gpu  # noqa: E402
from streamkl_gpu._core.forcing import forcing  # noqa: E402
from streamkl_gpu.indexer.api import indexer_kl_naive  # noqa: E402
from streamkl_gpu.indexer.topk import indexer_kl_topk_naive  # noqa: E402
from streamkl_ref.testing import relative_error  # noqa: E402

from . import timing  # noqa: E402
from .timing import extra_memory_gib, is_oom  # noqa: E402,F401

COLUMNS = ["section", "measure", "teacher", "path", "provider", "n", "value", "unit", "note",
           "gpu", "timestamp", "torch", "triton", "streamkl"]
TEACHERS = {
    "dsa": dict(H=128, HK=1, D=576, HI=64, HKI=1, DI=128, scale=192 ** -0.5),
    "gqa": dict(H=32, HK=8, D=128, HI=16, HKI=1, DI=64, scale=None),
    "mqa64": dict(H=64, HK=1, D=576, HI=64, HKI=1, DI=128, scale=576 ** -0.5),  # the first-call section's teacher
}
TINY_TEACHERS = {  # the same head layouts, small (the interpreter runs programs one after another)
    "dsa": dict(H=4, HK=1, D=40, HI=4, HKI=1, DI=16, scale=0.2),
    "gqa": dict(H=4, HK=2, D=16, HI=2, HKI=1, DI=16, scale=None),
    "mqa64": dict(H=4, HK=1, D=40, HI=4, HKI=1, DI=16, scale=0.2),
}
PATHS = ("lse", "no_lse", "row_weights_lse", "row_weights_no_lse")
LOSS_TOL, GRAD_TOL = 1e-5, 5e-3
GRADS = ("dq_idx", "dk_idx", "dweights")


class Out:
    def __init__(self, out_dir, device):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "indexer_training.csv")
        self.f = open(self.path, "w", newline="")
        self.w = csv.DictWriter(self.f, fieldnames=COLUMNS)
        self.w.writeheader()
        self.common = dict(gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
                           timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           torch=torch.__version__, triton=triton.__version__, streamkl=streamkl_gpu.__version__)
        self.failures = 0

    def row(self, section, measure, teacher, path, provider, n, value, unit, note=""):
        self.w.writerow(dict(self.common, section=section, measure=measure, teacher=teacher, path=path,
                             provider=provider, n=n, value=value, unit=unit, note=note))
        self.f.flush()


def scale_of(cfg):
    return cfg["scale"] if cfg["scale"] is not None else cfg["D"] ** -0.5


def make(cfg, B, NQ, NK, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, s=1.0):  # drawn on the device in the inputs' dtype (DSA-like 128K: 19 GB of q)
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype).mul_(s)

    return [rnd(B, cfg["H"], NQ, cfg["D"]), rnd(B, cfg["HK"], NK, cfg["D"]),
            rnd(B, cfg["HI"], NQ, cfg["DI"], s=cfg["DI"] ** -0.25), rnd(B, cfg["HKI"], NK, cfg["DI"], s=cfg["DI"] ** -0.25),
            rnd(B, cfg["HI"], NQ, s=cfg["HI"] ** -0.5)]


def row_weights_of(B, NQ, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand((B, NQ), generator=gen) * 2.0
    w[:, ::7] = 0.0  # masked rows
    return w.to(device)


def teacher_lse(q, k, causal, scale):
    """The teacher's own per-head LSEs (what its attention kernel returns), float32, natural log,
    by one materialised row chunk at a time."""
    B, H, NQ, D = q.shape
    HK, NK = k.shape[1], k.shape[2]
    out = torch.empty((B, H, NQ), dtype=torch.float32, device=q.device)
    kk = k.float().repeat_interleave(H // HK, dim=1)
    chunk = max(1, (1 << 28) // (H * NK))
    for t0 in range(0, NQ, chunk):
        rows = torch.arange(t0, min(NQ, t0 + chunk), device=q.device)
        s = (q[:, :, rows].float() @ kk.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(torch.arange(NK, device=q.device)[None, :] > rows[:, None] + (NK - NQ), float("-inf"))
        out[:, :, rows] = torch.logsumexp(s, dim=-1)
    return out


def floor_flops(cfg, N, path, topk=None):
    if topk is not None:
        return 2.0 * N * topk * (cfg["H"] * cfg["D"] + 3 * cfg["HI"] * cfg["DI"])
    teacher = cfg["H"] * cfg["D"] * (1 if path in ("lse", "row_weights_lse") else 2)  # no lse: the teacher twice
    return 2.0 * N * N / 2 * (teacher + 3 * cfg["HI"] * cfg["DI"])


def matmul_rate(device):
    return timing.matmul_tflops(device=device) * 1e12 if device == "cuda" else float("nan")


def time_ms(fn, device, quick):
    """Median ms (the interpreter: one call, the code path, not a time)."""
    return timing.time_ms(fn, cuda=device == "cuda", warmup=5 if quick else 25, rep=20 if quick else 100)


# The timed points: (section, teacher, path, provider, n) -> {measure: callable}. FORCED (forcing hook), each also timed
# and checked on request: the chunk design's previous tiles, the "keys_branch" gradient, the storing forward's and
# the teacher-LSE pass's kernels
DESIGN_VAR = "STREAMKL_INDEXER_TRAINING"
FORCED = dict(previous_tiles=dict(indexer_chunk_gradient_order="rows_first", indexer_storing_forward_order="candidates"),
              branch_layout=dict(indexer_chunk_gradient_order="branch_first"),
              triton_store=dict(indexer_storing_forward_backend="triton"),
              gluon_store=dict(indexer_storing_forward_backend="gluon"),
              triton_lse=dict(indexer_teacher_lse_config="triton"), gluon_lse=dict(indexer_teacher_lse_config="gluon"))


def Design(value):
    """``STREAMKL_INDEXER_TRAINING`` (the documented design switch) set for a call; None: nothing patched
    (a patch copies and restores the whole environment: 0.9 ms of host time per step on an H100 machine)."""
    return contextlib.nullcontext() if value is None else mock.patch.dict(os.environ, {DESIGN_VAR: value})


def dense_point(cfg, N, path, device, dtype, design=None, force=None):
    xs = make(cfg, 1, N, N, dtype, device, seed=N)
    q, k, leaves = xs[0], xs[1], [x.clone().requires_grad_(True) for x in xs[2:]]
    lse = teacher_lse(q, k, True, scale_of(cfg)) if path in ("lse", "row_weights_lse") else None
    rw = row_weights_of(1, N, device) if path.startswith("row_weights") else None
    kw = dict(causal=True, scale=cfg["scale"], reduction="mean", lse=lse, row_weights=rw)

    def fwd():
        with Design(design), forcing(**force) if force else contextlib.nullcontext():  # (none: as a user calls it)
            return streamkl_gpu.indexer_kl(q, k, *leaves, **kw)

    def fwd_bwd():
        loss = fwd()
        with Design(design), forcing(**force) if force else contextlib.nullcontext():
            loss.backward()

    return {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd}, fwd_bwd


def measures(fwd):
    """A point's timed measures from its loss callable; its fwd+bwd is also the memory figure's call."""
    def fwd_bwd():
        fwd().backward()
    return {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd}, fwd_bwd


def rows_with_keys(NQ, NK, causal, B=1):
    return B * (min(NQ, NK) if causal else NQ)


def compile_point(cfg, N, device, dtype):
    """torch.compile of the materialised loss (fp32 products of the bf16 inputs, masked mean)."""
    xs = make(cfg, 1, N, N, dtype, device, seed=N)
    q, k, leaves = xs[0], xs[1], [x.clone().requires_grad_(True) for x in xs[2:]]
    scale, rows = cfg["scale"], rows_with_keys(N, N, True)

    def loss(q, k, qi, ki, w):
        return indexer_kl_naive(q, k, qi, ki, w, causal=True, scale=scale).sum() / rows

    compiled = torch.compile(loss)
    return measures(lambda: compiled(q, k, *leaves))


def random_sets(B, N, K, device, seed=0):
    """``[B, N, K]`` int32: per row min(K, visible) random distinct visible keys (causal), -1 padding."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = torch.full((B, N, K), -1, dtype=torch.int32, device=device)
    chunk = max(1, (1 << 26) // N)
    for b in range(B):
        for t0 in range(0, N, chunk):
            rows = torch.arange(t0, min(N, t0 + chunk), device=device)
            r = torch.rand((len(rows), N), generator=gen, device=device)
            r = r.masked_fill(torch.arange(N, device=device)[None, :] > rows[:, None], -1.0)
            val, idx = r.topk(min(K, N), dim=-1)
            out[b, t0:t0 + len(rows), :idx.shape[1]] = torch.where(val < 0, -1, idx).to(torch.int32)
    return out


def topk_point(cfg, N, K, device, dtype, compiled=False):
    xs = make(cfg, 1, N, N, dtype, device, seed=N + 1)
    q, k, leaves = xs[0], xs[1], [x.clone().requires_grad_(True) for x in xs[2:]]
    topk = random_sets(1, N, K, device)
    scale, rows = cfg["scale"], rows_with_keys(N, N, True)
    if compiled:
        loss = torch.compile(lambda q, k, qi, ki, w, t: indexer_kl_topk_naive(
            q, k, qi, ki, w, t, causal=True, scale=scale, compute_dtype=None).sum() / rows)
        return measures(lambda: loss(q, k, *leaves, topk))
    return measures(lambda: streamkl_gpu.indexer_kl_topk(q, k, *leaves, topk, causal=True, scale=scale, reduction="mean"))


# Checks against float64

def check_dense(out, cfg, name, path, device, dtype, B, NQ, NK, label=None):
    xs = make(cfg, B, NQ, NK, dtype, device, seed=7)
    leaves = [x.clone().requires_grad_(True) for x in xs[2:]]
    lse = teacher_lse(xs[0], xs[1], True, scale_of(cfg)) if path in ("lse", "row_weights_lse") else None
    rw = row_weights_of(B, NQ, device) if path.startswith("row_weights") else None
    loss = streamkl_gpu.indexer_kl(xs[0], xs[1], *leaves, causal=True, scale=cfg["scale"], reduction="mean",
                                   lse=lse, row_weights=rw)
    loss.backward()
    x64 = [x.detach().double().cpu().numpy() for x in xs]
    kl = streamkl_ref.indexer_kl(*x64, causal=True, scale=cfg["scale"])
    w = np.ones_like(kl) if rw is None else rw.double().cpu().numpy()
    rows = rows_with_keys(NQ, NK, True, B)
    ref = streamkl_ref.indexer_kl_grad(*x64, w / rows, causal=True, scale=cfg["scale"])
    _report_check(out, "dense", name, label or path, NQ, loss, (w * kl).sum() / rows, leaves, ref)


def check_topk(out, cfg, name, device, dtype, B, N, K):
    xs = make(cfg, B, N, N, dtype, device, seed=8)
    leaves = [x.clone().requires_grad_(True) for x in xs[2:]]
    topk = random_sets(B, N, K, device, seed=3)
    loss = streamkl_gpu.indexer_kl_topk(xs[0], xs[1], *leaves, topk, causal=True, scale=cfg["scale"], reduction="mean")
    loss.backward()
    x64 = [x.detach().double().cpu().numpy() for x in xs]
    t = topk.cpu().numpy()
    kl = streamkl_ref.indexer_kl_topk(*x64, t, causal=True, scale=cfg["scale"])
    rows = rows_with_keys(N, N, True, B)  # every causal row sees its diagonal key: no empty set
    ref = streamkl_ref.indexer_kl_topk_grad(*x64, t, np.full(kl.shape, 1.0 / rows), causal=True, scale=cfg["scale"])
    _report_check(out, "topk", name, f"topk={K}", N, loss, kl.sum() / rows, leaves, ref)


def _report_check(out, section, name, path, n, loss, ref_loss, leaves, ref):
    err = abs(loss.item() - float(ref_loss)) / max(1.0, abs(float(ref_loss)))
    results = [("check_loss_err", err, LOSS_TOL)]
    for g, leaf in zip(GRADS, leaves):
        results.append((f"check_{g}_rel_err", relative_error(leaf.grad.double().cpu(), torch.from_numpy(ref[g])), GRAD_TOL))
    for measure, value, tol in results:
        ok = value <= tol
        out.failures += not ok
        out.row(section, measure, name, path, "streamkl", n, f"{value:.3e}", "rel", f"tol {tol:g} {'ok' if ok else 'FAIL'}")
        print(f"check {section:5s} {name:3s} {path:20s} {measure:24s} {value:.2e} (tol {tol:g}) {'ok' if ok else 'FAIL'}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="CPU smoke under the interpreter (tiny shapes, fp16)")
    p.add_argument("--n", type=int, default=None, help="tokens of the dense points (default 8192; --tiny 40)")
    p.add_argument("--topk-n", default=None, help="tokens of the top-k points (default 8192,32768; --tiny 40)")
    p.add_argument("--topk", type=int, default=None, help="keys per row (default 2048; --tiny 8)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; --tiny 1)")
    p.add_argument("--teachers", default="dsa,gqa", help="of: dsa, gqa, mqa64 (the first-call section's 64 heads)")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    p.add_argument("--no-topk", action="store_true")
    p.add_argument("--forced", default="", help=f"comma list: also each path forced so, of {sorted(FORCED)}")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--quick", action="store_true", help="shorter do_bench reps")
    p.add_argument("--memory-n", type=int, default=None,
                   help="also one DSA-like fwd+bwd at this N (no lse): its extra memory (e.g. 131072)")
    a = p.parse_args(argv)
    a.n = a.n or (24 if a.tiny else 8192)
    a.topk_n = [int(x) for x in (a.topk_n or ("16" if a.tiny else "8192,32768")).split(",") if x]
    a.topk = a.topk or (4 if a.tiny else 2048)
    a.rounds = a.rounds or (1 if a.tiny else 5)
    return a


def main(argv=None):
    a = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not a.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter's bf16 dot is not usable
    teachers = TINY_TEACHERS if a.tiny else TEACHERS
    names = [t for t in a.teachers.split(",") if t]
    paths = [p for p in a.paths.split(",") if p]
    out = Out(a.out, device)
    rate = matmul_rate(device)
    out.row("env", "matmul_rate", "", "", "torch bf16 8192^3", 8192, f"{rate / 1e12:.1f}", "TFLOP/s")
    print(f"matmul rate {rate / 1e12:.1f} TFLOP/s ({out.common['gpu']})")

    # the points: key -> (measures, fwd_bwd callable for the memory figure, floor FLOPs or None)
    points = {}

    def failed(key, exc, when=""):  # an OOM or a failure: recorded, the run goes on
        what = f"{type(exc).__name__}: {str(exc)[:200]}"
        out.row(key[0], "error", *key[1:5], "oom" if is_oom(exc) else "error", "", what)
        print(f"{key}: {'OOM' if is_oom(exc) else 'ERROR'}{when} {what}")
        torch.cuda.empty_cache() if device == "cuda" else None

    def add(key, build, floor):
        try:
            measures, fb = build()
            points[key] = (measures, fb, floor)
        except Exception as exc:  # noqa: BLE001
            failed(key, exc)

    orders = [("streamkl", None)] + [(f"streamkl_{name}", FORCED[name]) for name in a.forced.split(",") if name]
    for name in names:
        cfg = teachers[name]
        for path, (provider, force) in itertools.product(paths, orders):  # (force: a FORCED entry, or none)
            add(("dense", name, path, provider, a.n), lambda cfg=cfg, path=path, force=force: dense_point(
                cfg, a.n, path, device, dtype, force=force), floor_flops(cfg, a.n, path))
        if "lse" in paths:  # the accumulating design beside the default (chunk), lse given
            add(("dense", name, "lse", "streamkl_accumulating", a.n),
                lambda cfg=cfg: dense_point(cfg, a.n, "lse", device, dtype, design="accumulate"), floor_flops(cfg, a.n, "lse"))
        if not a.no_compile and device == "cuda":
            add(("dense", name, "any", "torch_compile", a.n), lambda cfg=cfg: compile_point(cfg, a.n, device, dtype), None)
    if not a.no_topk:
        cfg = teachers["dsa"]
        for n in a.topk_n:
            add(("topk", "dsa", f"topk={a.topk}", "streamkl", n), lambda n=n: topk_point(cfg, n, a.topk, device, dtype),
                floor_flops(cfg, n, "", topk=a.topk))
            if not a.no_compile and device == "cuda":
                add(("topk", "dsa", f"topk={a.topk}", "torch_compile", n),
                    lambda n=n: topk_point(cfg, n, a.topk, device, dtype, compiled=True), None)

    # warm-up (compiles, tuning) and the extra memory of one fwd+bwd; a point that fails here is
    # dropped. The interpreter (a smoke of the code paths): no warm-up, no memory figure, and the
    # fwd+bwd measure alone
    for key in list(points) if device == "cuda" else ():
        measures, fb, _ = points[key]
        try:
            t0 = time.perf_counter()
            for fn in measures.values():
                fn()
                torch.cuda.synchronize()
                if t0 is not None:  # the first call: compiles and tuning included
                    out.row(key[0], "first_call_s", *key[1:5], f"{time.perf_counter() - t0:.2f}", "s")
                    t0 = None
            mem = extra_memory_gib(fb, device == "cuda")
            out.row(key[0], "extra_mem_fwd_bwd", *key[1:5], f"{mem:.3f}", "GiB")
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc() if not is_oom(exc) else None
            failed(key, exc, " at warm-up:")
            del points[key]

    if device != "cuda":
        points = {key: ({"fwd_bwd_ms": ms["fwd_bwd_ms"]}, fb, fl) for key, (ms, fb, fl) in points.items()}
    times = {(key, m): [] for key, (measures, _, _) in points.items() for m in measures}
    for r in range(a.rounds):  # interleaved: every point's every measure once per round
        for key, (measures, _, _) in points.items():
            for m, fn in measures.items():
                times[(key, m)].append(time_ms(fn, device, a.quick or a.tiny))
    med = {}
    for (key, m), ts in times.items():
        med[(key, m)] = statistics.median(ts)
        out.row(key[0], m, *key[1:5], f"{med[(key, m)]:.4f}", "ms", f"median of {len(ts)} interleaved rounds: " + " ".join(f"{t:.3f}" for t in ts))

    print(f"\n{'section':6s} {'teacher':7s} {'path':20s} {'N':>6s} {'fwd ms':>9s} {'fwd+bwd':>9s} "
          f"{'vs compile':>10s} {'floor ms':>9s} {'/ floor':>8s}")
    for key, (measures, _, floor) in points.items():
        if not key[3].startswith("streamkl"):
            continue
        fb = med.get((key, "fwd_bwd_ms"), float("nan"))
        base_key = ((key[0], key[1], "any", "torch_compile", key[4]) if key[0] == "dense"
                    else (key[0], key[1], key[2], "torch_compile", key[4]))
        base = med.get((base_key, "fwd_bwd_ms"), float("nan"))
        floor_ms = floor / rate * 1e3 if floor else float("nan")
        ratio_c, ratio_f = base / fb, fb / floor_ms
        if math.isfinite(floor_ms):
            out.row(key[0], "floor_ms", key[1], key[2], "floor", key[4], f"{floor_ms:.4f}", "ms", f"{floor:.4g} FLOP")
            out.row(key[0], "fwd_bwd_over_floor", *key[1:5], f"{ratio_f:.3f}", "x")
        if math.isfinite(base):
            out.row(key[0], "compile_over_fwd_bwd", *key[1:5], f"{ratio_c:.3f}", "x")
        label = key[2] if key[3] == "streamkl" else f"{key[2]} ({key[3][9:]})"
        print(f"{key[0]:6s} {key[1]:7s} {label:20s} {key[4]:6d} {med.get((key, 'fwd_ms'), float('nan')):9.3f} "
              f"{fb:9.3f} {ratio_c:9.2f}x {floor_ms:9.3f} {ratio_f:7.2f}x")

    if a.memory_n and device == "cuda":
        cfg = teachers["dsa"]
        try:
            _, fb = dense_point(cfg, a.memory_n, "no_lse", device, dtype)
            mem = extra_memory_gib(fb, device == "cuda")
            out.row("memory", "extra_mem_fwd_bwd", "dsa", "no_lse", "streamkl", a.memory_n, f"{mem:.3f}", "GiB")
            print(f"DSA-like {a.memory_n} fwd+bwd (no lse) extra memory {mem:.2f} GiB")
        except Exception as exc:  # noqa: BLE001
            failed(("memory", "dsa", "no_lse", "streamkl", a.memory_n), exc)

    if not a.no_check:
        B, NQ, NK = (2, 13, 19) if a.tiny else (2, 200, 264)
        for name, path, (provider, force) in itertools.product(names, paths, orders):
            try:  # (a forced choice that does not apply to a teacher raises, saying why: an error row)
                with forcing(**(force or {})):
                    check_dense(out, teachers[name], name, path, device, dtype, B, NQ, NK, force and f"{path} ({provider[9:]})")
            except ValueError as exc:
                failed(("dense", name, path, provider, NQ), exc)
        if not a.no_topk:
            check_topk(out, teachers["dsa"], "dsa", device, dtype, B, 13 if a.tiny else 200, 4 if a.tiny else 64)
    print(f"\n{out.failures} check failure(s); CSV: {out.path}")
    out.f.close()
    return 1 if out.failures else 0


if __name__ == "__main__":
    sys.exit(main())
