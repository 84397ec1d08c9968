"""Plots from the benchmark suite's CSVs only (no typed-in numbers).

    python bench/plot.py                                  # the newest bench/results/*/bench.csv -> docs/assets/*.png
    python bench/plot.py --results DIR --out DIR

--results: the newest results folder (by date, then by the start in its env.json) with a
``bench*.csv`` (bench_gpu.py's long format); rows not ``ok`` are left out; several runs are
labelled by folder and file. Legends carry readable labels (``LABELS``); each figure is stamped
with the GPU, torch, triton and the commit measured (the folder's env.json).

Writes (only those with data):
  fwd_time.png            forward time vs N, non-causal | causal, per provider
  fwd_bwd_time.png        fwd+bwd time vs N, rows: non-causal / causal, columns: s1 / s2 / both
  peak_memory.png         peak extra memory vs N (forward providers, ours up to 512K, ours fwd+bwd)
  decode.png              small-N_Q forward: time per provider (incl. the bandwidth floor)
  smallq_bwd.png          fused vs separate vs auto backward vs N_Q at fixed N_K
All axes with N are log-log (base 2 for N).

SDPA labels: ``sdpa`` is PyTorch's default backend dispatch, ``sdpa_flash`` the FlashAttention
backend (older files with ``sdpa`` rows only, e.g. 2026-11-29_h200_f87f3b3/bench.csv, forced the
flash backend; plot them from their own commit: ``git show 1cab9b7:bench/plot.py``).
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every figure is saved at DPI; no text is smaller than MIN_FONT_PT (docs/check_browser.py checks
# that this text stays readable at the width the performance page shows the plots).
DPI = 130
MIN_FONT_PT = 8
WIDTH_IN = 8  # every figure is at most this wide: the page shows it at ~690 px, text stays >= 9 px
FONTS = {"font.size": 10, "axes.titlesize": 10.5, "axes.labelsize": 10, "xtick.labelsize": 9,
         "ytick.labelsize": 9, "legend.fontsize": 9, "figure.titlesize": MIN_FONT_PT}
SDPA_DEFAULT, SDPA_FLASH = "SDPA (default dispatch)", "SDPA (flash backend)"
# the CSV's provider names -> the labels the legends show
LABELS = {
    "ours": "streamkl", "ours_auto": "streamkl (auto backward)", "ours_fused": "streamkl fused backward",
    "ours_separate": "streamkl separate backward", "ours_split1": "streamkl, split_k=1",
    "eager": "eager PyTorch", "compile": "torch.compile", "chunked": "eager, 1024-row query chunks",
    "floor": "bandwidth floor",
}
STYLE = {  # display label -> (color, marker); anything else gets matplotlib's cycle
    LABELS["ours"]: ("C3", "o"), LABELS["ours_auto"]: ("C3", "o"), LABELS["ours_fused"]: ("C1", "^"),
    LABELS["ours_separate"]: ("C5", "v"), LABELS["ours_split1"]: ("C6", "x"), SDPA_DEFAULT: ("C0", "s"),
    SDPA_FLASH: ("C9", "d"), LABELS["eager"]: ("C7", "D"), LABELS["compile"]: ("C2", "P"),
    LABELS["chunked"]: ("C4", "*"), LABELS["floor"]: ("k", "_"),
}
DASHED = (LABELS["floor"], LABELS["eager"], LABELS["chunked"])  # references drawn dashed
# the CSV's settings and modes -> words (legends and titles show no column values)
SETTINGS = {"s1": "setting 1", "s2": "setting 2", "both": "both settings"}
MODES = {"fwd": "forward", **{f"fwd_bwd_{k}": f"fwd+bwd, {v}" for k, v in SETTINGS.items()}}


def newest_results(pattern):
    """The newest folder under bench/results/ holding a file matching ``pattern``: by the date its
    name starts with, then by the latest run start recorded in its env.json."""
    def key(folder):
        started = ""
        try:
            with open(os.path.join(folder, "env.json")) as fh:
                started = max((r.get("started_utc") or "" for r in json.load(fh).get("runs", [])), default="")
        except (OSError, ValueError):
            pass
        return (os.path.basename(folder)[:10], started)
    folders = [d for d in glob.glob(os.path.join(ROOT, "bench", "results", "*")) if glob.glob(os.path.join(d, pattern))]
    return max(folders, key=key) if folders else os.path.join(ROOT, "bench", "results")


def commit_of(folder):
    try:
        with open(os.path.join(folder, "env.json")) as fh:
            return json.load(fh).get("commit", "?")
    except (OSError, ValueError):
        return "?"


def load(results_dir):
    files = sorted(glob.glob(os.path.join(results_dir, "bench*.csv")))
    rows = []
    for f in files:
        folder = os.path.dirname(os.path.abspath(f))
        commit = commit_of(folder)
        with open(f, newline="") as fh:
            for r in csv.DictReader(fh):
                r["_file"] = os.path.basename(folder) + "/" + os.path.splitext(os.path.basename(f))[0]
                r["_commit"] = commit
                rows.append(r)
    for r in rows:
        r["_prov"] = display_provider(r)
    return files, rows


def display_provider(r):
    return {"sdpa": SDPA_DEFAULT, "sdpa_flash": SDPA_FLASH}.get(r["provider"], LABELS.get(r["provider"], r["provider"]))


def display_mode(mode):
    return MODES.get(mode, mode)


def fnum(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def ok(r, field="p50_ms"):
    return r.get("status") == "ok" and fnum(r.get(field)) is not None


def series(rows, multi, x="n_k", y="p50_ms", key=("_prov",)):
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
    for name in sorted(STYLE, key=len, reverse=True):  # "ours_auto ..." is not "ours"
        if label == name or label.startswith((name + " ", name + ",")):
            return STYLE[name]
    return (None, ".")


def plain_log_y(ax):
    """Log y axis labelled 0.1, 1, 10 (not 10^k); under ~1.5 decades the minor ticks get labels too."""
    import math

    import matplotlib.ticker as mt
    fmt = mt.FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(fmt)
    lo, hi = ax.get_ylim()
    if lo > 0 and hi / lo < 30:
        ax.yaxis.set_minor_formatter(fmt)
        ax.tick_params(axis="y", which="minor", labelsize=MIN_FONT_PT)
    elif lo > 0 and hi / lo < 1000:  # 2 and 5 of each decade, as plain numbers (not 2 x 10^-1)
        def minor(v, _):
            mantissa = v / 10 ** math.floor(math.log10(v) + 1e-9)
            return f"{v:g}" if round(mantissa) in (2, 5) else ""
        ax.yaxis.set_minor_formatter(mt.FuncFormatter(minor))
        ax.tick_params(axis="y", which="minor", labelsize=MIN_FONT_PT)
    else:  # many decades: the powers of ten alone
        ax.yaxis.set_minor_formatter(mt.NullFormatter())


def draw(ax, data, title, ylabel, xlabel="N (= N_Q = N_K)", legend="in"):
    """One log-log panel; ``legend``: "in" (inside the axes), "below" (under them) or None (the
    figure's shared legend, see shared_legend)."""
    import matplotlib.ticker as mt
    for label, pts in data.items():
        xs = [p[0] for p in pts]
        ys = [p[1] for p in pts]
        color, marker = style_for(label)
        ax.plot(xs, ys, marker=marker, color=color, label=label, linewidth=1.4, markersize=5,
                linestyle=":" if " causal" in label else ("--" if label.startswith(DASHED) else "-"))
        if all(p[2] is not None and p[3] is not None for p in pts):
            ax.fill_between(xs, [p[2] for p in pts], [p[3] for p in pts], color=color, alpha=0.15, linewidth=0)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(mt.FuncFormatter(lambda v, _: f"{int(v) // 1024}K" if v >= 1024 else f"{int(v)}"))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    if data:
        plain_log_y(ax)
        if legend == "below":
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
        elif legend == "in":
            ax.legend()
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def shared_legend(fig, axes, ncol=3):
    """One legend above the panels for every line of every panel (same label, same style)."""
    seen = {}
    for ax in axes:
        for h, l in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(l, h)
    if seen:
        fig.legend(list(seen.values()), list(seen), loc="upper center", ncol=ncol, frameon=False,
                   bbox_to_anchor=(0.5, 0.975))
    return len(seen)


def legend_rows(fig, n, ncol=3):
    """The top fraction of the figure the shared legend (n entries) and the suptitle take."""
    height = fig.get_figheight()
    return min(0.3, (0.3 + 0.22 * -(-n // ncol)) / height)


def subtitle(rows):
    keys = sorted({(r.get("gpu", ""), r.get("torch", ""), r.get("triton", ""), r.get("_commit", "?"))
                   for r in rows})
    return "; ".join(f"{g} | torch {t} | triton {tr} | commit {c}" for g, t, tr, c in keys[:3])


def shape_note(rows):
    s = sorted({(r["b"], r["h"], r["d1"], r["dtype"]) for r in rows})
    return ", ".join(f"B={b} H={h} D={d} {dt}" for b, h, d, dt in s[:2])


def fmt_n(n):
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=None, help="a results folder (default: the newest with a bench CSV)")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "assets"))
    a = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update(FONTS)

    os.makedirs(a.out, exist_ok=True)
    written = []
    a.results = a.results or newest_results("bench*.csv")
    print(f"bench CSVs from {a.results}")

    files, rows = load(a.results)
    if not rows:
        print(f"no rows in {a.results}/bench*.csv", file=sys.stderr)
        return 1
    multi = len({r["_file"] for r in rows}) > 1
    sub = subtitle(rows)

    def save(fig, name, rows_in=None, top=1.0):
        """``top``: the fraction of the height left to the panels (a shared legend takes the rest)."""
        fig.suptitle(sub, y=0.995)
        fig.tight_layout(rect=(0, 0.0, 1, min(top, 0.98)))
        path = os.path.join(a.out, name)
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        written.append(path)

    # forward
    fwd = [r for r in rows if r["kernel"] == "fwd" and r["mode"] == "fwd"]
    if any(ok(r) for r in fwd):
        fig, axes = plt.subplots(2, 1, figsize=(WIDTH_IN, 8.5), sharex=True)
        for ax, c in zip(axes, ("0", "1")):
            sel = [r for r in fwd if r["causal"] == c]
            draw(ax, series(sel, multi), f"forward, {'causal' if c == '1' else 'non-causal'} ({shape_note(sel)})",
                 "time (ms, median; band p20-p80)", legend=None)
        n = shared_legend(fig, axes)
        save(fig, "fwd_time.png", fwd, top=1 - legend_rows(fig, n))

    # forward + backward
    fb = [r for r in rows if r["kernel"] == "fwd_bwd"]
    if any(ok(r) for r in fb):
        # rows: settings s1 / s2 / both; columns: non-causal / causal
        fig, axes = plt.subplots(3, 2, figsize=(WIDTH_IN, 11), sharey=True, sharex=True)
        for j, c in enumerate(("0", "1")):
            for i, st in enumerate(("s1", "s2", "both")):
                sel = [r for r in fb if r["causal"] == c and r["mode"] in (f"fwd_bwd_{st}", "fwd_bwd_sdpa")]
                # SDPA fwd+bwd does not depend on the setting: drawn in every panel as the reference
                draw(axes[i][j], series(sel, multi),
                     f"{SETTINGS[st]}, {'causal' if c == '1' else 'non-causal'}", "fwd+bwd time (ms)", legend=None)
        n = shared_legend(fig, axes.flat)
        save(fig, "fwd_bwd_time.png", fb, top=1 - legend_rows(fig, n))

    # peak extra memory vs N
    mem = [r for r in rows if ok(r, "peak_extra_gib") and (
        (r["kernel"] == "fwd" and r["mode"] == "fwd") or r["kernel"] == "long")]
    if mem:
        fig, ax = plt.subplots(figsize=(WIDTH_IN, 7.5))
        data = {}
        for r in mem:
            tag = display_mode("fwd" if r["kernel"] == "fwd" else r["mode"])
            label = f"{r['_prov']}, {tag}, H={r['h']}{' causal' if r['causal'] == '1' else ''}"
            if multi:
                label += f" [{r['_file']}]"
            v = max(fnum(r["peak_extra_gib"]), 1e-4)  # log axis: an O(N_Q) output can be ~0 GiB
            data.setdefault(label, []).append((int(r["n_k"]), v, None, None))
        data = {k: sorted(v) for k, v in sorted(data.items())}
        draw(ax, data, "peak extra memory\n(max_memory_allocated - inputs; includes outputs/grads)",
             "GiB (floored at 1e-4 for the log axis)", legend="below")
        save(fig, "peak_memory.png", mem)

    # decode
    dec = [r for r in rows if r["kernel"] == "decode" and ok(r)]
    if dec and multi:  # one bar per provider and run
        for r in dec:
            r["_prov"] = f"{r['_prov']} [{r['_file']}]"
    if dec:
        shapes = sorted({(int(r["n_q"]), int(r["n_k"])) for r in dec})
        order = list(STYLE)
        provs = sorted({r["_prov"] for r in dec},
                       key=lambda p: (next((order.index(n) for n in sorted(order, key=len, reverse=True)
                                            if p == n or p.startswith(n + " ")), 99), p))
        fig, ax = plt.subplots(figsize=(WIDTH_IN, 5))
        width = 0.8 / max(1, len(provs))
        for k, prov in enumerate(provs):
            ys = []
            for s in shapes:
                v = [fnum(r["p50_ms"]) for r in dec if r["_prov"] == prov and (int(r["n_q"]), int(r["n_k"])) == s]
                ys.append(v[0] if v else 0.0)
            color = style_for(prov)[0]
            ax.bar([i + k * width for i in range(len(shapes))], ys, width, label=prov, color=color)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))])
        ax.set_xticklabels([f"N_Q={q}\nN_K={k // 1024}K" if k >= 1024 else f"N_Q={q}\nN_K={k}" for q, k in shapes])
        ax.set_yscale("log")
        plain_log_y(ax)
        ax.set_ylabel("time (ms, median)")
        ax.set_title("small query blocks, forward, non-causal\n(floor = K1+K2 bytes / copy bandwidth)")
        ax.legend()
        ax.grid(True, axis="y", which="both", alpha=0.3)
        save(fig, "decode.png", dec)

    # fused vs separate at small N_Q
    sq = [r for r in rows if r["kernel"] == "smallq_bwd"]
    if any(ok(r) for r in sq):
        fig, axes = plt.subplots(3, 1, figsize=(WIDTH_IN, 10), sharex=True)
        for ax, st in zip(axes, ("s1", "s2", "both")):
            sel = [r for r in sq if r["mode"] == f"fwd_bwd_{st}"]
            nk = sorted({int(r["n_k"]) for r in sel})
            draw(ax, series(sel, multi, x="n_q"), f"fwd+bwd, {SETTINGS[st]}, N_K = {', '.join(map(fmt_n, nk))}",
                 "time (ms)", xlabel="N_Q",
                 legend=None)
        n = shared_legend(fig, axes)
        save(fig, "smallq_bwd.png", sq, top=1 - legend_rows(fig, n))

    for w in written:
        print(w)
    print(f"{len(written)} plots from {len(files)} bench CSV file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
