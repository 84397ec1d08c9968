#!/usr/bin/env python3
"""Plots from benchmark CSVs only (no typed-in numbers).

    python bench/plot.py                                  # bench/results/*bench*.csv -> docs/assets/*.png
    python bench/plot.py --results DIR --out DIR

Reads every file matching ``*bench*.csv`` under --results (the long format bench_gpu.py writes:
kernel, provider, mode, causal, n_q, n_k, ..., p50_ms, peak_extra_gib, status, ...). Rows whose
status is not ``ok`` are left out. When the CSVs come from more than one GPU/run, each run's line
is labelled with its file name.

Writes (only those with data):
  fwd_time.png            forward time vs N, non-causal | causal, per provider
  fwd_bwd_time.png        fwd+bwd time vs N, rows: non-causal / causal, columns: s1 / s2 / both
  peak_memory.png         peak extra memory vs N (forward providers, ours up to 512K, ours fwd+bwd)
  decode.png              small-N_Q forward: time per provider (incl. the bandwidth floor)
  smallq_bwd.png          fused vs separate vs auto backward vs N_Q at fixed N_K
All axes with N are log-log (base 2 for N).
"""
from __future__ import annotations

import argparse
import csv
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STYLE = {  # provider -> (color, marker); anything else gets matplotlib's cycle
    "ours": ("C3", "o"), "ours_auto": ("C3", "o"), "ours_fused": ("C1", "^"), "ours_separate": ("C5", "v"),
    "ours_split1": ("C6", "x"), "sdpa": ("C0", "s"), "eager": ("C7", "D"), "compile": ("C2", "P"),
    "chunked": ("C4", "*"), "floor": ("k", "_"),
}


def load(results_dir):
    files = sorted(glob.glob(os.path.join(results_dir, "*bench*.csv")))
    rows = []
    for f in files:
        with open(f, newline="") as fh:
            for r in csv.DictReader(fh):
                r["_file"] = os.path.splitext(os.path.basename(f))[0]
                rows.append(r)
    return files, rows


def fnum(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def ok(r, field="p50_ms"):
    return r.get("status") == "ok" and fnum(r.get(field)) is not None


def series(rows, multi, x="n_k", y="p50_ms", key=("provider",)):
    """{label: sorted [(x, y, y20, y80)]}."""
    out = {}
    for r in rows:
        if not ok(r, y):
            continue
        label = " ".join(r[k] for k in key)
        if multi:
            label += f" [{r['_file']}]"
        yv = fnum(r[y])
        lo, hi = (fnum(r.get("p20_ms")), fnum(r.get("p80_ms"))) if y == "p50_ms" else (None, None)
        out.setdefault(label, []).append((int(r[x]), yv, lo, hi))
    return {k: sorted(v) for k, v in sorted(out.items())}


def style_for(label):
    prov = label.split(" ")[0]
    return STYLE.get(prov, (None, "."))


def draw(ax, data, title, ylabel, xlabel="N (= N_Q = N_K)"):
    import matplotlib.ticker as mt
    for label, pts in data.items():
        xs = [p[0] for p in pts]
        ys = [p[1] for p in pts]
        color, marker = style_for(label)
        ax.plot(xs, ys, marker=marker, color=color, label=label, linewidth=1.4, markersize=5,
                linestyle=":" if " causal" in label else ("--" if label.startswith(("floor", "eager", "chunked")) else "-"))
        if all(p[2] is not None and p[3] is not None for p in pts):
            ax.fill_between(xs, [p[2] for p in pts], [p[3] for p in pts], color=color, alpha=0.15, linewidth=0)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(mt.FuncFormatter(lambda v, _: f"{int(v) // 1024}K" if v >= 1024 else f"{int(v)}"))
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    if data:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def subtitle(rows):
    keys = sorted({(r.get("gpu", ""), r.get("torch", ""), r.get("triton", ""), r.get("streamkl_version", ""))
                   for r in rows})
    return "; ".join(f"{g} | torch {t} | triton {tr} | streamkl {v}" for g, t, tr, v in keys[:3])


def shape_note(rows):
    s = sorted({(r["b"], r["h"], r["d1"], r["dtype"]) for r in rows})
    return ", ".join(f"B={b} H={h} D={d} {dt}" for b, h, d, dt in s[:2])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "assets"))
    a = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files, rows = load(a.results)
    if not rows:
        print(f"no rows in {a.results}/*bench*.csv; nothing plotted", file=sys.stderr)
        return 1
    multi = len({r["_file"] for r in rows}) > 1
    os.makedirs(a.out, exist_ok=True)
    written = []
    sub = subtitle(rows)

    def save(fig, name):
        fig.suptitle(sub, fontsize=8, y=0.995)
        fig.tight_layout()
        path = os.path.join(a.out, name)
        fig.savefig(path, dpi=130)
        plt.close(fig)
        written.append(path)

    # forward
    fwd = [r for r in rows if r["kernel"] == "fwd" and r["mode"] == "fwd"]
    if any(ok(r) for r in fwd):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
        for ax, c in zip(axes, ("0", "1")):
            sel = [r for r in fwd if r["causal"] == c]
            draw(ax, series(sel, multi), f"forward, {'causal' if c == '1' else 'non-causal'} ({shape_note(sel)})",
                 "time (ms, median; band p20-p80)")
        save(fig, "fwd_time.png")

    # forward + backward
    fb = [r for r in rows if r["kernel"] == "fwd_bwd"]
    if any(ok(r) for r in fb):
        fig, axes = plt.subplots(2, 3, figsize=(16, 9), sharey=True)
        for i, c in enumerate(("0", "1")):
            for j, st in enumerate(("s1", "s2", "both")):
                sel = [r for r in fb if r["causal"] == c and r["mode"] in (f"fwd_bwd_{st}", "fwd_bwd_sdpa")]
                # SDPA fwd+bwd does not depend on the setting: drawn in every panel as the reference
                draw(axes[i][j], series(sel, multi),
                     f"fwd+bwd setting {st}, {'causal' if c == '1' else 'non-causal'}", "time (ms)")
        save(fig, "fwd_bwd_time.png")

    # peak extra memory vs N
    mem = [r for r in rows if ok(r, "peak_extra_gib") and (
        (r["kernel"] == "fwd" and r["mode"] == "fwd") or r["kernel"] == "long")]
    if mem:
        fig, ax = plt.subplots(figsize=(8, 5))
        data = {}
        for r in mem:
            tag = "fwd" if r["kernel"] == "fwd" else r["mode"]
            label = f"{r['provider']} {tag} H={r['h']}{' causal' if r['causal'] == '1' else ''}"
            if multi:
                label += f" [{r['_file']}]"
            v = max(fnum(r["peak_extra_gib"]), 1e-4)  # log axis: an O(N_Q) output can be ~0 GiB
            data.setdefault(label, []).append((int(r["n_k"]), v, None, None))
        data = {k: sorted(v) for k, v in sorted(data.items())}
        draw(ax, data, "peak extra memory (max_memory_allocated - inputs; includes outputs/grads)",
             "GiB (floored at 1e-4 for the log axis)")
        save(fig, "peak_memory.png")

    # decode
    dec = [r for r in rows if r["kernel"] == "decode" and ok(r)]
    if dec:
        shapes = sorted({(int(r["n_q"]), int(r["n_k"])) for r in dec})
        provs = sorted({r["provider"] for r in dec}, key=lambda p: list(STYLE).index(p) if p in STYLE else 99)
        fig, ax = plt.subplots(figsize=(max(7, 2.2 * len(shapes)), 4.8))
        width = 0.8 / max(1, len(provs))
        for k, prov in enumerate(provs):
            ys = []
            for s in shapes:
                v = [fnum(r["p50_ms"]) for r in dec if r["provider"] == prov and (int(r["n_q"]), int(r["n_k"])) == s]
                ys.append(v[0] if v else 0.0)
            color = STYLE.get(prov, (None, None))[0]
            ax.bar([i + k * width for i in range(len(shapes))], ys, width, label=prov, color=color)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))])
        ax.set_xticklabels([f"N_Q={q}\nN_K={k // 1024}K" if k >= 1024 else f"N_Q={q}\nN_K={k}" for q, k in shapes])
        ax.set_yscale("log")
        ax.set_ylabel("time (ms, median)")
        ax.set_title("small query blocks, forward, non-causal (floor = K1+K2 bytes / copy bandwidth)", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        save(fig, "decode.png")

    # fused vs separate at small N_Q
    sq = [r for r in rows if r["kernel"] == "smallq_bwd"]
    if any(ok(r) for r in sq):
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
        for ax, st in zip(axes, ("s1", "s2", "both")):
            sel = [r for r in sq if r["mode"] == f"fwd_bwd_{st}"]
            nk = sorted({r["n_k"] for r in sel})
            draw(ax, series(sel, multi, x="n_q"), f"fwd+bwd {st}, N_K={','.join(nk)}", "time (ms)", xlabel="N_Q")
        save(fig, "smallq_bwd.png")

    for w in written:
        print(w)
    print(f"{len(written)} plots from {len(files)} CSV file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
