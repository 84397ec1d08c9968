#!/usr/bin/env python3
"""The tables of docs/performance.md, generated from the committed results (no typed numbers).

    python docs/gen_performance.py          # writes docs/_generated/performance_tables.md

For each operation the newest results folder that measured it is read
(``bench/results/<YYYY-MM-DD>_<gpu>_<commit>/``: newest by the date in its name, then by the
latest run start in its ``env.json``); each table names its folder, GPU, torch, triton and the
commit measured. Rows whose ``run_status`` is not ``ok`` are shown as not finished, never as a
number. ``tests/test_docs.py`` checks that the committed file is what this script writes, so the
page cannot disagree with its CSVs.
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
OUT = os.path.join(ROOT, "docs", "_generated", "performance_tables.md")


def _env(folder: str) -> dict:
    with open(os.path.join(folder, "env.json")) as fh:
        return json.load(fh)


def newest_first(name: str) -> list[str]:
    """Paths of every committed ``<folder>/<name>``, the newest first."""
    def key(path):
        folder = os.path.dirname(path)
        started = max((r.get("started_utc") or "" for r in _env(folder).get("runs", [])), default="")
        return (os.path.basename(folder)[:10], started, os.path.basename(folder))
    return sorted(glob.glob(os.path.join(RESULTS, "*", name)), key=key, reverse=True)


def newest(name: str) -> str | None:
    """Path of the newest committed ``<folder>/<name>``, or None."""
    paths = newest_first(name)
    return paths[0] if paths else None


def rows(path: str) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def source(path: str) -> str:
    folder = os.path.dirname(path)
    env = _env(folder)
    rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
    return (f"Source: `{rel}` ({env['gpu']}, torch {env['torch']}, triton {env['triton']}, "
            f"commit {env['commit']}, {os.path.basename(folder)[:10]}).")


def num(x: str | None) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def fmt(x: float | None, suffix: str = "") -> str:
    """Three significant figures, trailing zeros kept (12.0, 1.60, 146)."""
    if x is None:
        return "–"
    digits = 0 if abs(x) >= 100 else 1 if abs(x) >= 10 else 2 if abs(x) >= 1 else 3
    return f"{x:.{digits}f}" + suffix


def as_written(r: dict | None) -> str:
    """A transcribed ratio as the CSV writes it (no digits added), or why there is none."""
    if r is None:
        return "–"
    return f"{r['value']}×" if r["run_status"] == "ok" and r["value"] else f"not finished ({r['run_status']})"


def n_label(n) -> str:
    n = int(n)
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def table(head: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in body]


# ---------------------------------------------------------------------------- attention_kl
def attention(path: str) -> list[str]:
    rs = [r for r in rows(path) if r["operation"] == "attention_kl"]

    def get(**match):
        for r in rs:
            if all(r[k] == str(v) for k, v in match.items()):
                return r
        return None

    def val(**match):
        return as_written(get(**match))

    out = ["### attention_kl: forward", "",
           "Time of `attention_kl`'s forward over the time of SDPA's forward "
           "(`scaled_dot_product_attention`, PyTorch's default dispatch: cuDNN on the H200), "
           "B=1, H=32, D=128, bf16, N_Q = N_K = N. Lower is better; 1.00 would be attention's speed.", ""]
    ns = sorted({int(r["n_q"]) for r in rs if r["pass"] == "fwd" and r["baseline"] == "sdpa_fwd"})
    out += table(["N", "non-causal", "causal"],
                 [[n_label(n)] + [val(**{"pass": "fwd", "n_q": n, "causal": c, "baseline": "sdpa_fwd"})
                                  for c in (0, 1)] for n in ns])
    out += ["", source(path), "",
            "### attention_kl: forward + backward", "",
            "Forward + backward (setting 1: gradients for side 1) over SDPA's forward + backward, and the "
            "backward alone (fwd+bwd − fwd, the worse of settings 1 and 2) over SDPA's backward; same shapes.", ""]
    ns = sorted({int(r["n_q"]) for r in rs if r["pass"] in ("fwd_bwd", "bwd") and r["baseline"].startswith("sdpa")})
    out += table(["N", "fwd+bwd, non-causal", "fwd+bwd, causal", "backward, non-causal", "backward, causal"],
                 [[n_label(n)]
                  + [val(**{"pass": "fwd_bwd", "n_q": n, "causal": c, "baseline": "sdpa_fwd_bwd"}) for c in (0, 1)]
                  + [val(**{"pass": "bwd", "n_q": n, "causal": c, "baseline": "sdpa_bwd"}) for c in (0, 1)]
                  for n in ns])
    out += ["", source(path), "",
            "### attention_kl against torch.compile", "",
            "How many times faster than `torch.compile` of the materialised loss (scores, both "
            "log-softmaxes and the KL in fp32), N = 8K, same shapes.", ""]
    body = []
    for pss, base, what in (("fwd", "torch_compile_fwd", "forward"),
                            ("fwd_bwd", "torch_compile_fwd_bwd", "forward + backward (setting 1)")):
        vals = [val(**{"pass": pss, "n_q": 8192, "causal": c, "baseline": base, "metric": "speedup_over_baseline"})
                for c in (0, 1)]
        if any(v != "–" for v in vals):
            body.append([what] + vals)
    out += table(["pass", "non-causal", "causal"], body) if body else []
    out += ["", source(path), "", "### attention_kl: decoding", "",
            "A few query rows against a long key cache (forward, non-causal, keys split over programs): "
            "time over the memory-copy floor (the bytes of K1 and K2 read once at the measured copy bandwidth).", ""]
    dec = [r for r in rs if r["baseline"] == "copy_floor"]
    out += table(["N_Q", "N_K", "time / copy floor"],
                 [[r["n_q"], n_label(r["n_k"]), as_written(r)]
                  for r in sorted(dec, key=lambda r: (int(r["n_k"]), int(r["n_q"])))])
    out += ["", source(path), "", "### attention_kl: host cost and long sequences", "",
            "Host time per call at a tiny shape (B=1, H=1, N_Q=1, N_K=64, D=64, bf16; 1000 back-to-back "
            "calls), and the time of one call at very long sequences (B=1, D=128, bf16, causal).", ""]
    body = []
    for r in rs + [r for r in rows(path) if r["operation"] == "sdpa"]:
        if r["metric"] == "us_per_call":
            what = {"host_fwd": "forward", "host_fwd_bwd": "forward + backward (setting 1)"}[r["pass"]]
            name = "SDPA" if r["operation"] == "sdpa" else "attention_kl"
            body.append([f"{name}, {what}", f"N_Q = {r['n_q']}, N_K = {r['n_k']}", f"{r['value']} µs"])
    for r in rs:
        if r["metric"] == "seconds_per_call":
            what = {"fwd": "forward", "fwd_bwd": "forward + backward (setting 1)"}[r["pass"]]
            shape = f"N = {n_label(r['n_q'])}, H = {r['h']}"
            cell = f"{r['value']} s" if r["run_status"] == "ok" else f"not finished ({r['run_status']})"
            body.append([f"attention_kl, {what}", shape, cell])
    out += table(["call", "shape", "time per call"], body)
    return out + ["", source(path), ""]


# ------------------------------------------------------------------------------ indexer_kl
TEACHERS = {
    "dsa": "DSA-like (H=128, D=576, MQA; indexer 64 heads × 128)",
    "gqa": "GQA-like (H=32, H_K=8, D=128; indexer 16 heads × 64)",
}


def indexer(path: str) -> list[str]:
    rs = [r for r in rows(path) if r["operation"] == "indexer_kl"]

    def ms(teacher, lse, pss, provider):
        for r in rs:
            if (r["teacher"], r["lse_given"], r["pass"], r["provider"]) == (teacher, str(lse), pss, provider):
                return num(r["ms"]) if r["run_status"] == "ok" else None
        return None

    out = ["### indexer_kl (dense warm-up)", "",
           "The indexer loss at N = 8K, causal, bf16, `reduction=\"mean\"`, indexer tensors requiring "
           "grad (the training case); ms. `lse given`: the teacher's per-head LSEs passed in (what "
           "FlashAttention's forward returns), so the teacher is read once. The floor is the teacher's "
           "scores once (forward), plus the indexer's forward and its two gradient products (step), at "
           "the measured bf16 matmul rate. torch.compile: the materialised loss. With training inputs and "
           "`lse` given the forward also forms the gradient (the chunk design for the MQA teacher; the GQA "
           "teacher's rows were measured with the accumulating design: see the indexer's design notes), "
           "so its time is most "
           "of the step's.", ""]
    body = []
    for teacher in ("dsa", "gqa"):
        for lse in (1, 0):
            f, fb = ms(teacher, lse, "fwd", "ours"), ms(teacher, lse, "fwd_bwd", "ours")
            if f is None and fb is None:
                continue
            cf, cfb = ms(teacher, lse, "fwd", "torch_compile"), ms(teacher, lse, "fwd_bwd", "torch_compile")
            flf, flb = ms(teacher, lse, "fwd", "floor"), ms(teacher, lse, "fwd_bwd", "floor")
            speed = (f"{fmt(cf / f, '×')} / {fmt(cfb / fb, '×')}" if None not in (cf, cfb, f, fb) else "–")
            floor = f"{fmt(flf)} / {fmt(flb)}" if None not in (flf, flb) else "–"
            step = fmt(fb / flb, "×") if None not in (fb, flb) else "–"
            body.append([TEACHERS[teacher], "yes" if lse else "no", fmt(f), fmt(fb), speed, floor, step])
    out += table(["teacher", "lse given", "forward", "forward + backward",
                  "faster than torch.compile (fwd / fwd+bwd)", "floor (fwd / step)", "fwd+bwd / step floor"], body)
    return out + ["", source(path), ""]


def indexer_topk(path: str) -> list[str]:
    rs = [r for r in rows(path) if r["run_status"] == "ok"]

    def get(measure, provider):
        for r in rs:
            if (r["measure"], r["provider"]) == (measure, provider):
                return num(r["value"])
        return None

    floor = get("floor", "matmul")
    shape = next((r["shape"] for r in rs if r["measure"] == "floor"), "")
    out = ["### indexer_kl_topk (sparse stage)", "",
           f"The indexer loss over each query's selected keys, DSA-like teacher, `{shape}` (K selected keys "
           "per query), mean loss; ms. The floor is the forward's matrix FLOPs over the used slots at the "
           f"measured bf16 rate ({fmt(floor, ' ms')}).", ""]
    body = []
    for prov, label in (("ours_lse", "indexer_kl_topk, `lse` given"), ("ours", "indexer_kl_topk, set LSEs computed"),
                        ("torch_gather_compile", "torch.compile of the PyTorch gather form"),
                        ("torch_gather_eager", "the PyTorch gather form, eager")):
        f, fb = get("fwd_ms", prov), get("fwd_bwd_ms", prov)
        if f is None and fb is None:
            continue
        peak = get("fwd_bwd_peak", prov) if get("fwd_bwd_peak", prov) is not None else get("fwd_peak", prov)
        body.append([label, fmt(f), fmt(fb), fmt(f / floor, "×") if f and floor else "–", fmt(peak, " GiB")])
    out += table(["implementation", "forward", "forward + backward", "forward × floor", "peak extra memory"], body)
    return out + ["", source(path), ""]


def varlen(path: str) -> list[str]:
    def bench_rows(p):
        return [r for r in rows(p) if r["section"] == "bench" and r["run_status"] == "ok"]

    def get(rs, provider, metric):
        for r in rs:
            if (r["provider"], r["metric"]) == (provider, metric):
                return num(r["value"])
        return None

    rs = bench_rows(path)
    older = [(bench_rows(p), p) for p in newest_first("varlen.csv") if p != path]
    case = next((r["case"] for r in rs if r["provider"] == "packed" and r["metric"] == "fwd_ms"), "")
    out = ["### attention_kl_varlen (packed sequences)", "",
           f"Documents of different lengths packed into one call ({case}; 1×16K + 2×8K + 4×4K + 8×2K + "
           "16×1K, shuffled), against one `attention_kl` call per sequence and against padding every "
           "sequence to the longest; ms.", ""]
    body, earlier = [], []
    for prov, label in (("packed", "`attention_kl_varlen`, packed"),
                        ("per_sequence", "one `attention_kl` call per sequence, summed"),
                        ("padded", "every sequence padded to 16K, one call")):
        found = rs
        if get(rs, prov, "fwd_ms") is None:  # a layout the newest run left out: the newest run that has it
            found, src = next(((o, p) for o, p in older if get(o, prov, "fwd_ms") is not None), (rs, path))
            if src != path:
                label += f" ({os.path.basename(os.path.dirname(src))[:10]}, an earlier run)"
                earlier.append(source(src))
        body.append([label, fmt(get(found, prov, "fwd_ms")), fmt(get(found, prov, "fwd_bwd_ms"))])
    out += table(["layout", "forward", "forward + backward (setting 1)"], body)
    return out + ["", source(path)] + [f"Earlier run: {e[len('Source: '):]}" for e in earlier] + [""]


def summary(attention_path: str, indexer_path: str) -> list[str]:
    """The page's summary: ranges read off the newest attention and indexer results."""
    at = [r for r in rows(attention_path) if r["operation"] == "attention_kl" and r["run_status"] == "ok"]

    def rng(**match):
        vals = [num(r["value"]) for r in at if all(r[k] == str(v) for k, v in match.items())]
        vals = [v for v in vals if v is not None]
        lo, hi = min(vals), max(vals)
        return f"{lo:.2f}×" if lo == hi else f"{lo:.2f}-{hi:.2f}×"

    def ns(**match):
        found = sorted({int(r["n_q"]) for r in at if all(r[k] == str(v) for k, v in match.items())})
        return f"{n_label(found[0])} to {n_label(found[-1])}"

    def one(**match):
        return next(r["value"] for r in at if all(r[k] == str(v) for k, v in match.items()))

    ix = [r for r in rows(indexer_path) if r["run_status"] == "ok"]

    def ims(teacher, pss, provider, lse="1"):
        return next(num(r["ms"]) for r in ix if (r["teacher"], r["pass"], r["provider"], r["lse_given"]) == (teacher, pss, provider, lse))

    dsa_step, dsa_compile, dsa_floor = ims("dsa", "fwd_bwd", "ours"), ims("dsa", "fwd_bwd", "torch_compile"), ims("dsa", "fwd_bwd", "floor")
    folder = os.path.basename(os.path.dirname(attention_path))
    return [
        f"On one H200 (the newest results, `bench/results/{folder}/`):", "",
        f"- **Forward**: {rng(**{'pass': 'fwd', 'baseline': 'sdpa_fwd'})} SDPA's forward time from "
        f"{ns(**{'pass': 'fwd', 'baseline': 'sdpa_fwd'})} (two score products and two exponentials per score "
        f"against attention's one of each); {one(**{'pass': 'fwd', 'n_q': 8192, 'causal': 0, 'baseline': 'torch_compile_fwd'})}× "
        f"(non-causal) and {one(**{'pass': 'fwd', 'n_q': 8192, 'causal': 1, 'baseline': 'torch_compile_fwd'})}× (causal) "
        "faster than `torch.compile` of the materialised loss at 8K, with memory linear in N.",
        f"- **Training step** (forward + backward, setting 1): {rng(**{'pass': 'fwd_bwd', 'baseline': 'sdpa_fwd_bwd'})} "
        f"SDPA's; the backward alone {rng(**{'pass': 'bwd', 'baseline': 'sdpa_bwd'})} SDPA's backward.",
        f"- **Decoding**: {rng(baseline='copy_floor')} the memory-copy floor at N_K = 128K.",
        f"- **Indexer loss**, DSA-like teacher at 8K, training step: {fmt(dsa_step)} ms, "
        f"{fmt(dsa_compile / dsa_step, '×')} faster than `torch.compile` of the materialised loss, "
        f"{fmt(dsa_step / dsa_floor, '×')} its matmul floor.", ""]


SECTIONS = (("attention.csv", attention), ("varlen.csv", varlen), ("indexer.csv", indexer),
            ("indexer_topk.csv", indexer_topk))


def render() -> str:
    lines = ["<!-- generated by docs/gen_performance.py from bench/results/: do not edit -->", ""]
    if newest("attention.csv") and newest("indexer.csv"):
        lines += summary(newest("attention.csv"), newest("indexer.csv"))
    for name, fn in SECTIONS:
        path = newest(name)
        if path is not None:
            lines += fn(path)
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        fh.write(render())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
