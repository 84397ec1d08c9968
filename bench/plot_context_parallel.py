#!/usr/bin/env python3
"""Plot of the context-parallel scaling run, from its CSVs only (no typed-in numbers).

    python bench/plot_context_parallel.py                 # bench/results/*/context_parallel_scaling*.csv
    python bench/plot_context_parallel.py --results DIR --out DIR

Reads every ``*context_parallel_scaling*.csv`` (written by bench/context_parallel_gpu.py; rows
with status ``ok`` of section ``scale``) and writes ``context_parallel.png``: forward+backward
time per step vs N (one GPU and W GPUs), the speedup over one GPU with the ideal W and the goal
0.85 W, and the peak memory per rank. Log-log axes, base 2 for N.
"""
from __future__ import annotations

import argparse
import csv
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(results):
    rows = []
    for path in sorted(glob.glob(os.path.join(results, "*", "*context_parallel_scaling*.csv"))):
        with open(path, newline="") as fh:
            for r in csv.DictReader(fh):
                if r.get("status") == "ok" and r.get("section") == "scale":
                    r["file"] = os.path.basename(path)
                    rows.append(r)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "assets"))
    a = p.parse_args(argv)
    rows = load(a.results)
    if not rows:
        print(f"no */context_parallel_scaling*.csv rows with status ok under {a.results}: nothing to plot")
        return 0
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    series = {}  # (file, provider, world, mode) -> [(n, row)]
    for r in rows:
        series.setdefault((r["file"], r["provider"], int(r["world"]), r["mode"]), []).append((int(r["n"]), r))
    files = sorted({k[0] for k in series})
    for (file, provider, world, mode), pts in sorted(series.items()):
        pts.sort()
        ns = [n for n, _ in pts]
        tag = ("one GPU" if provider == "single" else f"{world} GPUs ({provider})") + \
            (f" [{file}]" if len(files) > 1 else "")
        style = "-o" if mode == "fwd+bwd" else "--s"
        axes[0].plot(ns, [float(r["ms_per_step"]) for _, r in pts], style, label=f"{tag} {mode}")
        peaks = [float(r["peak_gib_per_rank"]) for _, r in pts if r.get("peak_gib_per_rank")]
        if mode == "fwd+bwd" and len(peaks) == len(pts):
            axes[2].plot(ns, peaks, "-o", label=tag)
        if provider != "single":
            sp = [(n, float(r["speedup_vs_single"])) for n, r in pts if r.get("speedup_vs_single")]
            if sp:
                axes[1].plot([n for n, _ in sp], [s for _, s in sp], style, label=f"{tag} {mode}")
                axes[1].axhline(world, color="gray", lw=0.8, ls=":")
                axes[1].axhline(0.85 * world, color="gray", lw=0.8, ls="-.")
    axes[0].set(title="time per step (slowest rank)", xlabel="N (tokens)", ylabel="ms", xscale="log", yscale="log")
    axes[1].set(title="speedup over one GPU (dotted: W, dash-dot: 0.85 W)", xlabel="N (tokens)", xscale="log")
    axes[2].set(title="peak memory per rank, fwd+bwd", xlabel="N (tokens)", ylabel="GiB", xscale="log")
    for ax in axes:
        ax.set_xscale("log", base=2)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    first = rows[0]
    fig.suptitle(f"context parallel attention_kl: B={first['b']}, H={first['h']}, D={first['d1']}, "
                 f"{first['dtype']}, causal, zigzag, setting 1 ({first.get('gpu', '')})", fontsize=10)
    fig.tight_layout()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "context_parallel.png")
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
