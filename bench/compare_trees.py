"""The no-regression check: two source trees of streamkl timed in one GPU job.

    python bench/compare_trees.py --tree before=/path/to/old --tree after=. --rounds 5 --out DIR
    python bench/bench_gpu.py --sections compare --section-args compare="--tree before=/path/to/old --tree after=."

(Also the suite's ``nan_cost`` section: this tree against the one before the NaN guards.) Each
round runs one subprocess per tree (the order alternates), with that tree as its PYTHONPATH and its
own STREAMKL_CACHE_DIR; it times every grid point through the public API only with the suite's
timing helper (``streamkl_bench.timing.time_ms``, do_bench median; from this script's folder: the
same code for both trees). The first pass (index 0) pays compiles and tuning: the warm-up, not counted.
The rule (DEVELOPERS.md): over the grid the geometric mean of after/before is at most 1.01 and no
point is above 1.03; a point above 1.03 is re-timed once with 10 rounds before it counts.
Writes ``DIR/compare_rounds.csv`` (long format: one row per tree, point and round, with GPU,
timestamp and each tree's commit) and ``DIR/compare_summary.csv``; prints a short table last.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

# name -> (kind, spec). kind: fwd | step (forward + backward) | idx_step | idx_fwd
BOTH_POINTS = ((8192, True), (8192, False), (16384, True))  # both settings' steps
GRID = {
    # attention_kl, B=1, H=32, D=128, bf16 unless said
    "fwd_4k_nc": ("fwd", dict(n=4096, causal=False)),
    "fwd_4k_c": ("fwd", dict(n=4096, causal=True)),
    "fwd_8k_nc": ("fwd", dict(n=8192, causal=False)),
    "fwd_8k_c": ("fwd", dict(n=8192, causal=True)),
    "fwd_16k_nc": ("fwd", dict(n=16384, causal=False)),
    "fwd_16k_c": ("fwd", dict(n=16384, causal=True)),
    "fwd_8k_c_d64": ("fwd", dict(n=8192, causal=True, d=64)),
    "fwd_4k_c_d256": ("fwd", dict(n=4096, causal=True, d=256)),
    "fwd_8k_c_fp16": ("fwd", dict(n=8192, causal=True, dtype="float16")),
    "fwd_q4k_k8k_c": ("fwd", dict(n=4096, n_k=8192, causal=True)),
    "decode_q1_k128k": ("fwd", dict(n=1, n_k=131072, causal=False)),
    "decode_q16_k128k": ("fwd", dict(n=16, n_k=131072, causal=True)),
    "step1_4k_nc": ("step", dict(n=4096, causal=False, train=2)),
    "step1_4k_c": ("step", dict(n=4096, causal=True, train=2)),
    "step1_8k_nc": ("step", dict(n=8192, causal=False, train=2)),
    "step1_8k_c": ("step", dict(n=8192, causal=True, train=2)),
    "step2_8k_c": ("step", dict(n=8192, causal=True, train=1)),
    **{f"stepboth_{n // 1024}k_{'c' if c else 'nc'}": ("step", dict(n=n, causal=c, train=3)) for n, c in BOTH_POINTS},
    "step1_8k_c_gqa": ("step", dict(n=8192, causal=True, train=2, h_k=8)),
    "step1_8k_c_d64": ("step", dict(n=8192, causal=True, train=2, d=64)),
    "step2_4k_nc_fp16": ("step", dict(n=4096, causal=False, train=1, dtype="float16")),
    # attention_kl_varlen: 80K tokens in 31 documents of 1K to 16K (the varlen section's mix, unshuffled) and 24K
    # in 7 of 2K to 8K, under TUNING_WORK_LIMIT (where STREAMKL_AUTOTUNE=1 times the picks on the batch itself)
    **{f"varlen_{s}_{n * d // 1024}k_{'c' if c else 'nc'}": ("step" if t else "fwd", dict(n=n, docs=d, causal=c, train=t))
       for n, d in ((16384, 5), (8192, 3)) for s, t in (("fwd", 0), ("step1", 2), ("stepboth", 3)) for c in (True, False)},
    # indexer_kl, 8K causal, indexer inputs requiring grad, reduction="mean"
    "idx_dsa_8k_lse_step": ("idx_step", dict(teacher="dsa", n=8192, lse=True)),
    "idx_gqa_8k_lse_step": ("idx_step", dict(teacher="gqa", n=8192, lse=True)),
    "idx_dsa_8k_fwd": ("idx_fwd", dict(teacher="dsa", n=8192, lse=False)),
    "idx_gqa_8k_fwd": ("idx_fwd", dict(teacher="gqa", n=8192, lse=False)),
}
# The record of the shape rules (--tuning-log): other sizes, the step without lse, per-row losses (reduction
# "none", summed), an MQA teacher of 64 heads (first_call's), the top-k loss, decoding at other key counts.
TUNING_POINTS = {
    **{f"idx_{t}_{n // 1024}k_lse_step": ("idx_step", dict(teacher=t, n=n, lse=True))
       for t in ("dsa", "gqa") for n in (4096, 16384)},
    **{f"idx_{t}_16k_fwd": ("idx_fwd", dict(teacher=t, n=16384, lse=False)) for t in ("dsa", "gqa")},
    **{f"idx_{t}_8k_{r}step": ("idx_step", dict(teacher=t, n=8192, lse=False, reduction=r and "none"))
       for t in ("dsa", "gqa", "mqa64") for r in ("", "rows_")},
    **{f"idx_{t}_8k_topk_step": ("idx_step", dict(teacher=t, n=8192, lse=False, topk=2048)) for t in ("dsa", "mqa64")},
    **{f"decode_q{q}_k{k // 1024}k": ("fwd", dict(n=q, n_k=k, causal=q > 1))
       for q, k in ((1, 8192), (1, 32768), (4, 32768), (64, 131072), (1, 524288))},
}
RULE_POINTS = tuple(GRID)  # the grid the no-regression rule is judged on: the default of a comparison
GRID.update(TUNING_POINTS)
GEOMEAN_LIMIT, POINT_LIMIT = 1.01, 1.03


# ---------------------------------------------------------------- worker (runs inside one tree)
def _attention_case(kind, spec, torch, streamkl_gpu):
    dtype = getattr(torch, spec.get("dtype", "bfloat16"))
    h, d, h_k = 32, spec.get("d", 128), spec.get("h_k", 32)
    n_q, n_k = spec["n"], spec.get("n_k", spec["n"])
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    causal = spec["causal"]
    if spec.get("docs"):  # packed documents: 1 of n tokens, 2 of n/2, ..., 2^(docs-1) of n/2^(docs-1)
        lens = [n_q >> i for i in range(spec["docs"]) for _ in range(1 << i)]
        cu = torch.tensor([0, *itertools.accumulate(lens)], device="cuda", dtype=torch.int32)
        q1, k1, q2, k2 = (rand(sum(lens), h, d) for _ in range(4))
        call = lambda: streamkl_gpu.attention_kl_varlen(q1, k1, q2, k2, cu, cu, n_q, n_q, causal=causal)  # noqa: E731
    else:
        q1, k1, q2, k2 = rand(1, h, n_q, d), rand(1, h, n_k, d), rand(1, h, n_q, d), rand(1, h_k, n_k, d)
        call = lambda: streamkl_gpu.attention_kl(q1, k1, q2, k2, causal=causal)  # noqa: E731
    if kind == "fwd":
        return call, None
    train = spec["train"]
    leaves = [t.requires_grad_() for t in ([q2, k2] if train & 2 else []) + ([q1, k1] if train & 1 else [])]
    return (lambda: call().mean().backward()), leaves


def _indexer_case(kind, spec, torch, streamkl_gpu):
    from streamkl_bench.indexer import TEACHERS, make, scale_of, teacher_lse  # (this tree's streamkl_gpu)

    n = spec["n"]
    cfg = TEACHERS.get(spec["teacher"]) or dict(TEACHERS["dsa"], H=64, scale=None)  # mqa64: first_call's
    q, k, q_idx, k_idx, weights = make(cfg, 1, n, n, torch.bfloat16, "cuda")
    scale = scale_of(cfg)
    lse = teacher_lse(q, k, True, scale) if spec["lse"] else None
    leaves = [q_idx, k_idx, weights]
    reduction = spec.get("reduction") or "mean"
    if spec.get("topk"):  # the last topk keys of each row (-1 past the first keys)
        rows = torch.arange(n, device="cuda")[:, None]
        idx = (rows - torch.arange(spec["topk"], device="cuda")[None, :]).clamp(min=-1).to(torch.int32)[None]

    def loss():
        if spec.get("topk"):
            out = streamkl_gpu.indexer_kl_topk(q, k, q_idx, k_idx, weights, idx, causal=True, scale=scale,
                                               reduction=reduction)
        else:
            out = streamkl_gpu.indexer_kl(q, k, q_idx, k_idx, weights, causal=True, scale=scale, lse=lse,
                                          reduction=reduction)
        return out.sum() if reduction == "none" else out  # per-row losses: summed, as a user would

    if kind == "idx_fwd":
        return loss, None
    return (lambda: loss().backward()), [t.requires_grad_() for t in leaves]


def worker(points, json_path):
    import torch

    import streamkl_gpu
    from streamkl_bench.timing import time_ms  # bench/ is this script's folder: the one timing helper

    rows = {}
    tuning_log = os.environ.get("STREAMKL_BENCH_TUNING_LOG") == "1"
    for name in points:
        kind, spec = GRID[name]
        build = _indexer_case if kind.startswith("idx") else _attention_case
        fn, leaves = build(kind, spec, torch, streamkl_gpu)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        if tuning_log:  # the tuner's record of this point's first call; nothing else timed
            from streamkl_gpu._core import tuning
            rows[name] = {"first_call_s": first_s, "picks": [
                {"key": repr(key), "config": repr(cfg), "ms": t, "retimed_ms": tuning.TUNING_RETIMED.get(key, {}).get(cfg)}
                for key, measured in tuning.TUNING_LOG.items() for cfg, t in measured]}
            tuning.TUNING_LOG.clear()
            tuning.TUNING_RETIMED.clear()
        else:
            rows[name] = {"ms": time_ms(fn, cuda=True, warmup=25, rep=150, grad_to_none=leaves),
                          "first_call_s": first_s}
        del fn, leaves
        torch.cuda.empty_cache()
    with open(json_path, "w") as f:
        json.dump({"file": streamkl_gpu.__file__, "rows": rows}, f)


def write_tuning_log(tree, points, out, timeout):
    """``--tuning-log``: one fresh process of ``tree``, ``STREAMKL_AUTOTUNE=1``, empty caches, runs each
    point once; every candidate the tuner timed, with its median, goes to ``out/tuning_log.csv``."""
    import torch

    rows = _run_round("tuned", tree, points, {"tuned": tempfile.mkdtemp(prefix="streamkl-tuning-")}, timeout,
                      extra_env={"STREAMKL_AUTOTUNE": "1", "STREAMKL_BENCH_TUNING_LOG": "1"})
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tuning_log.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["gpu_name", "timestamp", "commit", "point", "first_call_s", "key",
                                          "config", "ms", "retimed_ms", "run_status"])
        w.writeheader()
        fixed = dict(gpu_name=torch.cuda.get_device_name(), commit=_commit(tree), run_status="ok",
                     timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        for point, row in rows.items():
            print(f"{point:28s} first call {row['first_call_s']:7.2f} s, {len(row['picks'])} candidates timed")
            w.writerows(dict(fixed, point=point, first_call_s=f"{row['first_call_s']:.3f}", **p) for p in row["picks"])
    return 0


# ---------------------------------------------------------------- orchestrator
def _commit(tree):
    """The tree's short commit: from git, or from a COMMIT file (a `git archive` export has no .git)."""
    marker = os.path.join(tree, "COMMIT")
    if os.path.exists(marker):
        return open(marker).read().strip()
    try:
        return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"


def _run_round(label, tree, points, cache_dirs, timeout, extra_env=None):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), STREAMKL_CACHE_DIR=cache_dirs[label],
               PYTHONUNBUFFERED="1", **(extra_env or {}))
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        path = tmp.name
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--points", ",".join(points), "--json", path]
    proc = subprocess.run(cmd, cwd=os.path.abspath(tree), env=env, timeout=timeout, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{label}: worker failed (rc={proc.returncode})\n{proc.stderr[-3000:]}")
    with open(path) as f:
        data = json.load(f)
    os.unlink(path)
    if not data["file"].startswith(os.path.abspath(tree)):
        raise RuntimeError(f"{label}: imported {data['file']}, not from {tree}")
    return data["rows"]


def _medians(records, labels, points, rounds):
    def median(values):
        return statistics.median(values) if values else math.nan  # (no such rounds: a run cut short)
    return {(lab, p): median([r["ms"] for r in records if r["tree"] == lab and r["point"] == p
                              and r["round"] in rounds]) for lab in labels for p in points}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", default=[], help="LABEL=PATH, twice: before first, after second")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--retime-rounds", type=int, default=10)
    ap.add_argument("--points", help="comma-separated point names (default: the rule's grid, "
                    f"{len(RULE_POINTS)} points; with --tuning-log every point, the tuning points too)")
    ap.add_argument("--out", default=os.environ.get("OUT", "compare_out"))
    ap.add_argument("--cache-root", help="folder for each tree's STREAMKL_CACHE_DIR (default: a new temp dir)")
    ap.add_argument("--round-timeout", type=float, default=1800, help="seconds one pass of one tree may take")
    ap.add_argument("--from-rounds", help="a compare_rounds.csv: its verdict, nothing timed (a run cut short)")
    ap.add_argument("--tuning-log", metavar="TREE", help="no comparison: TREE's tuner record of every point "
                    "(STREAMKL_AUTOTUNE=1, empty caches) to OUT/tuning_log.csv")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    default = GRID if args.tuning_log else RULE_POINTS
    points = [p for p in args.points.split(",") if p] if args.points else list(default)
    if unknown := [p for p in points if p not in GRID]:
        ap.error(f"unknown points {unknown}; known: {', '.join(GRID)}")
    if args.worker:
        return worker(points, args.json)
    if args.tuning_log:
        return write_tuning_log(args.tuning_log, points, args.out, args.round_timeout)
    if len(args.tree) != 2 and not args.from_rounds:
        ap.error("give --tree twice: LABEL=PATH for before, then after")
    trees, commits = {}, {}
    for t in args.tree:  # LABEL=PATH or LABEL=PATH@COMMIT (a copied tree whose .git is not its own)
        label, path = t.split("=", 1)
        path, _, commit = path.partition("@")
        trees[label], commits[label] = path, commit or _commit(path)
    labels = list(trees)
    os.makedirs(args.out, exist_ok=True)
    cache_root = args.cache_root or tempfile.mkdtemp(prefix="streamkl-compare-")
    cache_dirs = {lab: os.path.join(cache_root, lab) for lab in labels}
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    records = []

    def write_rounds():
        with open(os.path.join(args.out, "compare_rounds.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["gpu_name", "timestamp", "tree", "commit", "point", "round", "ms",
                                              "first_call_s", "run_status"])
            w.writeheader()
            w.writerows(dict(gpu_name=gpu, timestamp=stamp, run_status="ok", **rec) for rec in records)

    def run_rounds(first, count, pts):
        for r in range(first, first + count):
            order = labels if r % 2 == 0 else labels[::-1]
            for lab in order:
                t0 = time.time()
                rows = _run_round(lab, trees[lab], pts, cache_dirs, args.round_timeout)
                for p, row in rows.items():
                    records.append(dict(tree=lab, commit=commits[lab], point=p, round=r, **row))
                print(f"pass {r} {lab}: {time.time() - t0:.1f} s", flush=True)
                write_rounds()  # after every round: a run stopped at its limit keeps what it timed

    if args.from_rounds:  # the verdict of a run stopped at its limit, from the rounds it wrote
        with open(args.from_rounds) as f:
            records = [dict(r, round=int(r["round"]), ms=float(r["ms"])) for r in csv.DictReader(f)]
        labels = list(dict.fromkeys(r["tree"] for r in records))
        commits = {r["tree"]: r["commit"] for r in records}
        points = [p for p in points if any(r["point"] == p for r in records)]
        gpu, stamp = records[0]["gpu_name"], records[0]["timestamp"]
    else:
        run_rounds(0, args.rounds + 1, points)  # index 0: compiles and tuning (warm-up, not counted)
    timed = set(range(1, args.rounds + 1))
    med = _medians(records, labels, points, timed)
    before, after = labels
    ratio = {p: med[(after, p)] / med[(before, p)] for p in points}
    failing = [p for p in points if ratio[p] > POINT_LIMIT]
    retimed = {}
    if failing:
        first = args.rounds + 1
        if not args.from_rounds:
            run_rounds(first, args.retime_rounds, failing)
        re_rounds = set(range(first, first + args.retime_rounds))
        re_med = _medians(records, labels, failing, re_rounds)
        for p in failing:
            if not math.isnan(re_med[(after, p)] + re_med[(before, p)]):
                retimed[p] = ratio[p] = re_med[(after, p)] / re_med[(before, p)]
    geo = math.exp(statistics.fmean(math.log(v) for v in ratio.values()))
    if not args.from_rounds:
        write_rounds()
    with open(os.path.join(args.out, "compare_summary.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["gpu_name", "timestamp", "point", f"{before}_ms", f"{after}_ms", "ratio", "retimed",
                    "status", "run_status"])
        for p in points:
            status = "ok" if ratio[p] <= POINT_LIMIT else "slower"
            w.writerow([gpu, stamp, p, f"{med[(before, p)]:.4f}", f"{med[(after, p)]:.4f}", f"{ratio[p]:.4f}",
                        "yes" if p in retimed else "no", status, "ok"])
        w.writerow([gpu, stamp, "geomean", "", "", f"{geo:.4f}", "", "ok" if geo <= GEOMEAN_LIMIT else "slower", "ok"])
    done = len({r["round"] for r in records if r["round"] in timed})
    print(f"\n{before} = {commits[before]}, {after} = {commits[after]}, {gpu}, {done} rounds (+ warm-up)")
    print(f"{'point':24s} {before + ' ms':>12s} {after + ' ms':>12s} {'ratio':>7s}")
    for p in points:
        flag = " (re-timed)" if p in retimed else ""
        print(f"{p:24s} {med[(before, p)]:12.4f} {med[(after, p)]:12.4f} {ratio[p]:7.3f}{flag}")
    ok = geo <= GEOMEAN_LIMIT and all(v <= POINT_LIMIT for v in ratio.values())
    print(f"geomean {geo:.4f} (limit {GEOMEAN_LIMIT}); worst {max(ratio.values()):.4f} (limit {POINT_LIMIT}): "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
