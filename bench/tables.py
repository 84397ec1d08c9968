#!/usr/bin/env python3
"""Key-ratio tables for docs/performance.md, generated from the committed CSVs (no typed numbers).

    python bench/tables.py            # writes docs/_generated/perf_tables.md

Reads bench/results/*bench*.csv (bench/bench_gpu.py's long format) and
bench/results/*fwd_configs_sdpa_backends.csv (forward vs the SDPA backends, one machine).
tests/test_perf_tables.py checks that the committed page is what this script writes.
"""
from __future__ import annotations

import argparse
import csv
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
OUT = os.path.join(ROOT, "docs", "_generated", "perf_tables.md")


def _rows(pattern):
    rows = []
    for path in sorted(glob.glob(os.path.join(RESULTS, pattern))):
        with open(path, newline="") as fh:
            for r in csv.DictReader(fh):
                r["_file"] = os.path.basename(path)
                rows.append(r)
    return rows


def _p50(rows, **match):
    for r in rows:
        if all(str(r.get(k)) == str(v) for k, v in match.items()) and r.get("status", "ok") == "ok" and r["p50_ms"]:
            return float(r["p50_ms"])
    return None


def _ms(x):
    return "–" if x is None else (f"{x:.3g}" if x < 100 else f"{x:.0f}")


def _ratio(a, b):
    return "–" if a is None or b is None else f"{a / b:.2f}×"


def _n(n):
    return f"{int(n) // 1024}K"


def backends_table(rows):
    if not rows:
        return []
    env = rows[0]
    out = [f"**Forward vs the SDPA backends** (`{rows[0]['_file']}`: {env['gpu']}, torch {env['torch']}, "
           f"triton {env['triton']}, {env['date'][:10]}; B=1, H=32, D=128, bf16; medians in ms)", "",
           "| N | causal | ours | SDPA default dispatch | SDPA flash | SDPA cuDNN | torch.compile | ours / SDPA default | compile / ours |",
           "|---|---|---|---|---|---|---|---|---|"]
    for n in (8192, 16384):
        for c in (0, 1):
            get = lambda p: _p50(rows, provider=p, causal=c, n_q=n)  # noqa: E731
            ours, dflt = get("streamkl(autotuned)"), get("sdpa(default dispatch)")
            comp = get("compile")
            out.append(f"| {_n(n)} | {'yes' if c else 'no'} | {_ms(ours)} | {_ms(dflt)} | {_ms(get('sdpa(flash backend)'))} "
                       f"| {_ms(get('sdpa(cudnn backend)'))} | {_ms(comp)} | {_ratio(ours, dflt)} | {_ratio(comp, ours)} |")
    return out + [""]


def bench_tables(rows):
    if not rows:
        return []
    env = next((r for r in rows if r["kernel"] == "env"), rows[0])
    flash_only = not any(r["provider"] == "sdpa_flash" for r in rows)
    sdpa_label = "SDPA (flash backend)" if flash_only else "SDPA (default dispatch)"
    head = (f"(`{rows[0]['_file']}`: {env['gpu']}, torch {env['torch']}, triton {env['triton']}, "
            f"{env['date'][:10]}; B=1, H=32, D=128, bf16; medians in ms)")
    out = [f"**Forward** {head}", "",
           f"| N | causal | ours | eager | torch.compile | {sdpa_label} | eager / ours | compile / ours | ours / SDPA |",
           "|---|---|---|---|---|---|---|---|---|"]
    for n in (4096, 8192, 16384, 32768, 65536):
        for c in (0, 1):
            get = lambda p: _p50(rows, kernel="fwd", provider=p, causal=c, n_q=n)  # noqa: E731
            ours = get("ours")
            if ours is None:
                continue
            e, comp, s = get("eager"), get("compile"), get("sdpa")
            out.append(f"| {_n(n)} | {'yes' if c else 'no'} | {_ms(ours)} | {_ms(e)} | {_ms(comp)} | {_ms(s)} "
                       f"| {_ratio(e, ours)} | {_ratio(comp, ours)} | {_ratio(ours, s)} |")
    out += ["", f"**Forward + backward** {head}", "",
            f"| N | causal | setting | ours (auto) | fused | separate | eager | torch.compile | {sdpa_label} fwd+bwd | eager / ours | compile / ours |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in (4096, 8192, 16384, 32768):
        for c in (0, 1):
            s = _p50(rows, kernel="fwd_bwd", provider="sdpa", mode="fwd_bwd_sdpa", causal=c, n_q=n)
            for setting in ("s1", "s2", "both"):
                get = lambda p: _p50(rows, kernel="fwd_bwd", provider=p, mode=f"fwd_bwd_{setting}", causal=c, n_q=n)  # noqa: E731
                auto, fused, sep = get("ours_auto"), get("ours_fused"), get("ours_separate")
                ours = auto if auto is not None else (min(x for x in (fused, sep) if x is not None) if (fused or sep) else None)
                if ours is None:
                    continue
                e, comp = get("eager"), get("compile")
                out.append(f"| {_n(n)} | {'yes' if c else 'no'} | {setting} | {_ms(auto)} | {_ms(fused)} | {_ms(sep)} "
                           f"| {_ms(e)} | {_ms(comp)} | {_ms(s)} | {_ratio(e, ours)} | {_ratio(comp, ours)} |")
    out += ["", "'ours' in the ratio columns is `auto` where it was timed, else the faster of fused and separate.", "",
            f"**Decoding** (short query blocks, non-causal forward) {head}", "",
            "| N_Q | N_K | ours (split-K auto) | ours (`split_k=1`) | SDPA | bandwidth floor | ours / floor |",
            "|---|---|---|---|---|---|---|"]
    for nq, nk in ((1, 131072), (16, 131072), (1, 32768)):
        get = lambda p: _p50(rows, kernel="decode", provider=p, n_q=nq, n_k=nk)  # noqa: E731
        ours, floor = get("ours"), get("floor")
        out.append(f"| {nq} | {_n(nk)} | {_ms(ours)} | {_ms(get('ours_split1'))} | {_ms(get('sdpa'))} "
                   f"| {_ms(floor)} | {_ratio(ours, floor)} |")
    return out + [""]


def render() -> str:
    lines = ["<!-- generated by bench/tables.py from bench/results/*.csv: do not edit -->", ""]
    lines += backends_table(_rows("*fwd_configs_sdpa_backends.csv"))
    for path in sorted(glob.glob(os.path.join(RESULTS, "*bench*.csv"))):
        lines += bench_tables(_rows(os.path.basename(path)))
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        fh.write(render())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
