#!/usr/bin/env python3
"""The tables of docs/performance.md, generated from the committed results (no typed numbers).

    python docs/gen_performance.py                  # writes docs/_generated/performance_tables.md
    python docs/gen_performance.py --derive FOLDER  # FOLDER/attention.csv, indexer.csv from the run's own CSVs

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


def as_written(r: dict | None, unit: str = "×") -> str:
    """A value as the CSV writes it (no digits added) with its unit, or why there is none."""
    if r is None:
        return "–"
    return f"{r['value']}{unit}" if r["run_status"] == "ok" and r["value"] else f"not finished ({r['run_status']})"


def n_label(n) -> str:
    n = int(n)
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def table(head: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in body]


def section(title: str, intro: str, head: list[str], body: list[list[str]], path: str) -> list[str]:
    """One table of the page: its heading, what it shows, the table and the file it was read from."""
    return [f"### {title}", "", intro, ""] + table(head, body) + ["", source(path), ""]


def newest_with(name: str, keep) -> tuple[str | None, list[dict]]:
    """The newest ``<folder>/<name>`` with rows that ``keep`` accepts, and those rows."""
    for path in newest_first(name):
        found = [r for r in rows(path) if keep(r)]
        if found:
            return path, found
    return None, []


# ---------------------------------------------------------------------------- attention_kl
# what each attention table shows: it is read from the newest attention.csv holding such rows, so a
# run that measured only some of them (the host section alone, a grid whose budget skipped
# torch.compile) updates those tables and leaves the others to the run that measured them
ATTENTION_KINDS = {
    "fwd": lambda r: r["operation"] == "attention_kl" and r["pass"] == "fwd" and r["baseline"] == "sdpa_fwd",
    "step": lambda r: r["operation"] == "attention_kl" and r["baseline"] in ("sdpa_fwd_bwd", "sdpa_bwd"),
    "compile": lambda r: r["baseline"].startswith("torch_compile"),
    "decode": lambda r: r["baseline"] == "copy_floor",
    "host": lambda r: r["metric"] == "us_per_call",
    "long": lambda r: r["operation"] == "attention_kl" and r["metric"] == "seconds_per_call",
}


def newest_attention(kind: str) -> tuple[str | None, list[dict]]:
    """The newest attention.csv with rows of ``kind`` (``ATTENTION_KINDS``), and those rows."""
    return newest_with("attention.csv", ATTENTION_KINDS[kind])


def _value(rs: list[dict], **match) -> str:
    return as_written(next((r for r in rs if all(r[k] == str(v) for k, v in match.items())), None))


def attention() -> list[str]:
    out = []
    path, rs = newest_attention("fwd")
    if path:
        ns = sorted({int(r["n_q"]) for r in rs})
        out += section("attention_kl: forward",
                       "Time of `attention_kl`'s forward over the time of SDPA's forward "
                       "(`scaled_dot_product_attention`, PyTorch's default dispatch: cuDNN on Hopper), "
                       "B=1, H=32, D=128, bf16, N_Q = N_K = N. Lower is better; 1.00 would be attention's speed.",
                       ["N", "non-causal", "causal"],
                       [[n_label(n)] + [_value(rs, n_q=n, causal=c) for c in (0, 1)] for n in ns], path)
    path, rs = newest_attention("step")
    if path:
        ns = sorted({int(r["n_q"]) for r in rs})
        out += section("attention_kl: forward + backward",
                       "Forward + backward (setting 1: gradients for side 1) over SDPA's forward + backward, and "
                       "the backward alone (fwd+bwd − fwd, the worse of settings 1 and 2) over SDPA's backward; "
                       "same shapes.",
                       ["N", "fwd+bwd, non-causal", "fwd+bwd, causal", "backward, non-causal", "backward, causal"],
                       [[n_label(n)] + [_value(rs, **{"pass": pss, "n_q": n, "causal": c})
                                        for pss in ("fwd_bwd", "bwd") for c in (0, 1)] for n in ns], path)
    path, rs = newest_attention("compile")
    if path:
        out += section("attention_kl against torch.compile",
                       "How many times faster than `torch.compile` of the materialised loss (scores, both "
                       "log-softmaxes and the KL in fp32), N = 8K, same shapes.",
                       ["pass", "non-causal", "causal"],
                       [[what] + [_value(rs, **{"pass": pss, "n_q": 8192, "causal": c}) for c in (0, 1)]
                        for pss, what in (("fwd", "forward"), ("fwd_bwd", "forward + backward (setting 1)"))], path)
    path, rs = newest_attention("decode")
    if path:
        out += section("attention_kl: decoding",
                       "A few query rows against a long key cache (forward, non-causal, keys split over programs): "
                       "time over the memory-copy floor (the bytes of K1 and K2 read once at the measured copy "
                       "bandwidth).",
                       ["N_Q", "N_K", "time / copy floor"],
                       [[r["n_q"], n_label(r["n_k"]), as_written(r)]
                        for r in sorted(rs, key=lambda r: (int(r["n_k"]), int(r["n_q"])))], path)
    path, rs = newest_attention("host")
    if path:
        body = []
        for pss, what in (("host_fwd", "forward"), ("host_fwd_bwd", "forward + backward")):
            for op, name in (("attention_kl", "attention_kl"), ("sdpa", "SDPA")):
                r = next((r for r in rs if (r["operation"], r["pass"]) == (op, pss)), None)
                if r is not None:
                    setting = " (setting 1)" if op == "attention_kl" and pss == "host_fwd_bwd" else ""
                    body.append([f"{name}, {what}{setting}", as_written(r, " µs")])
        out += section("attention_kl: host cost",
                       "Host time per call at a tiny shape, where the GPU's time is negligible (B=1, H=1, N_Q=1, "
                       "N_K=64, D=64, bf16; back-to-back calls, ours and SDPA's in the same process).",
                       ["call", "time per call"], body, path)
    path, rs = newest_attention("long")
    if path:
        what = {"fwd": "forward", "fwd_bwd": "forward + backward (setting 1)"}
        out += section("attention_kl: long sequences",
                       "The time of one call at very long sequences (B=1, D=128, bf16, causal).",
                       ["call", "shape", "time per call"],
                       [[f"attention_kl, {what[r['pass']]}", f"N = {n_label(r['n_q'])}, H = {r['h']}",
                         as_written(r, " s")] for r in rs], path)
    return out


# ------------------------------------------------------------------------------ indexer_kl
TEACHERS = {
    "dsa": "DSA-like (H=128, D=576, MQA; indexer 64 heads × 128)",
    "gqa": "GQA-like (H=32, H_K=8, D=128; indexer 16 heads × 64)",
}


def indexer(path: str) -> list[str]:
    def reader(p):
        rs = [r for r in rows(p) if r["operation"] == "indexer_kl"]

        def ms(teacher, lse, pss, provider):
            for r in rs:
                if (r["teacher"], r["lse_given"], r["pass"], r["provider"]) == (teacher, str(lse), pss, provider):
                    return num(r["ms"]) if r["run_status"] == "ok" else None
            return None
        return ms

    ms = reader(path)
    # torch.compile's column: its ratio to ours within one run, the newest run that timed it
    compiled = newest_with("indexer.csv", lambda r: r["provider"] == "torch_compile")[0]
    cms = reader(compiled) if compiled else (lambda *_: None)
    out = ["### indexer_kl (dense warm-up)", "",
           "The indexer loss at N = 8K, causal, bf16, `reduction=\"mean\"`, indexer tensors requiring "
           "grad (the training case); ms. `lse given`: the teacher's per-head LSEs passed in (what "
           "FlashAttention's forward returns), so the teacher is read once. The floor is the teacher's "
           "scores once (forward), plus the indexer's forward and its two gradient products (step), at "
           "the measured bf16 matmul rate. torch.compile: the materialised loss, against ours in the same "
           "run. With training inputs and `lse` given the forward also forms the gradient (see the "
           "indexer's design notes), so its time is most of the step's.", ""]
    body = []
    for teacher in ("dsa", "gqa"):
        for lse in (1, 0):
            f, fb = ms(teacher, lse, "fwd", "ours"), ms(teacher, lse, "fwd_bwd", "ours")
            if f is None and fb is None:
                continue
            cf, cfb = cms(teacher, lse, "fwd", "torch_compile"), cms(teacher, lse, "fwd_bwd", "torch_compile")
            of, ofb = cms(teacher, lse, "fwd", "ours"), cms(teacher, lse, "fwd_bwd", "ours")
            flf, flb = ms(teacher, lse, "fwd", "floor"), ms(teacher, lse, "fwd_bwd", "floor")
            speed = (f"{fmt(cf / of, '×')} / {fmt(cfb / ofb, '×')}" if None not in (cf, cfb, of, ofb) else "–")
            floor = f"{fmt(flf)} / {fmt(flb)}" if (flf, flb) != (None, None) else "–"
            step = fmt(fb / flb, "×") if None not in (fb, flb) else "–"
            body.append([TEACHERS[teacher], "yes" if lse else "no", fmt(f), fmt(fb), speed, floor, step])
    out += table(["teacher", "lse given", "forward", "forward + backward",
                  "faster than torch.compile (fwd / fwd+bwd)", "floor (fwd / step)", "fwd+bwd / step floor"], body)
    out += ["", source(path)]
    if compiled and compiled != path:
        out.append(f"The torch.compile column: {source(compiled)[len('Source: '):]}")
    return out + [""]


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


def summary(indexer_path: str) -> list[str]:
    """The page's summary: ranges read off the newest results of each kind (the tables name them)."""
    def ok(kind):
        return [r for r in newest_attention(kind)[1] if r["run_status"] == "ok" and num(r["value"]) is not None]

    def rng(rs, **match):
        vals = [num(r["value"]) for r in rs if all(r[k] == str(v) for k, v in match.items())]
        if not vals:
            return "–"
        lo, hi = min(vals), max(vals)
        return f"{lo:.2f}×" if lo == hi else f"{lo:.2f}-{hi:.2f}×"

    def ns(rs):
        found = sorted({int(r["n_q"]) for r in rs})
        return f"{n_label(found[0])} to {n_label(found[-1])}"

    ix = [r for r in rows(indexer_path) if r["run_status"] == "ok"]

    def ims(teacher, pss, provider, lse="1"):
        return next((num(r["ms"]) for r in ix
                     if (r["teacher"], r["pass"], r["provider"], r["lse_given"]) == (teacher, pss, provider, lse)), None)

    fwd, step, compiled, decode = ok("fwd"), ok("step"), ok("compile"), ok("decode")
    dsa_step, dsa_compile, dsa_floor = ims("dsa", "fwd_bwd", "ours"), ims("dsa", "fwd_bwd", "torch_compile"), ims("dsa", "fwd_bwd", "floor")
    lines = ["The newest results of each kind, on one Hopper GPU (every table below names its GPU, folder and commit):", ""]
    if fwd:
        lines.append(f"- **Forward**: {rng(fwd)} SDPA's forward time from {ns(fwd)} (two score products and two "
                     "exponentials per score against attention's one of each), with memory linear in N.")
    if compiled:
        lines.append(f"- **Against `torch.compile`** of the materialised loss at 8K: the forward "
                     f"{_value(compiled, **{'pass': 'fwd', 'causal': 0})} (non-causal) and "
                     f"{_value(compiled, **{'pass': 'fwd', 'causal': 1})} (causal) faster.")
    if step:
        lines.append(f"- **Training step** (forward + backward, setting 1): {rng(step, **{'pass': 'fwd_bwd'})} SDPA's; "
                     f"the backward alone {rng(step, **{'pass': 'bwd'})} SDPA's backward.")
    if decode:
        lines.append(f"- **Decoding**: {rng(decode)} the memory-copy floor at N_K = 128K.")
    if dsa_step is not None:
        against = [f"{fmt(dsa_compile / dsa_step, '×')} faster than `torch.compile` of the materialised loss"
                   if dsa_compile else "", f"{fmt(dsa_step / dsa_floor, '×')} its matmul floor" if dsa_floor else ""]
        lines.append(f"- **Indexer loss**, DSA-like teacher at 8K, `lse` given, training step: {fmt(dsa_step)} ms"
                     + "".join(f", {a}" for a in against if a) + ".")
    lines.append("")
    return lines


SECTIONS = (("varlen.csv", varlen), ("indexer.csv", indexer),
            ("indexer_topk.csv", indexer_topk))


# ---------------------------------------------------------------------------- first use
FIRST_CALL_ENTRIES = {  # first_call's entries -> what the table calls them
    "fwd": "forward", "fwd_bwd_auto_s1": "forward + backward, setting 1", "fwd_bwd_auto_s2": "forward + backward, setting 2",
    "fwd_bwd_auto_both": "forward + backward, both settings", "varlen_fwd_bwd_s1": "packed sequences, setting 1",
    "indexer_dense_step": "indexer loss, per-row losses summed", "indexer_mean_step": "indexer loss, mean training step",
    "indexer_topk_step": "indexer loss, top-k training step", "decode_splitk": "split-K decoding",
}


def _newest_gpu(name: str) -> str | None:
    """The newest ``<folder>/<name>`` measured on a GPU (not the interpreter)."""
    return next((p for p in newest_first(name) if "interpreter" not in _env(os.path.dirname(p))["gpu"]
                 and "cpu" not in os.path.basename(os.path.dirname(p))), None)


def first_use() -> list[str]:
    """``streamkl verify`` on the GPU and each entry point's first call, from empty caches: the
    newest GPU run of each."""
    out = []
    cold = _newest_gpu("verify_cold.json")
    if cold:
        folder = os.path.dirname(cold)
        body = []
        for name, what in (("verify_cold.json", "empty Triton and streamkl caches"), ("verify_warm.json", "warm caches"),
                           ("verify_quick_cold.json", "`--quick`, empty caches")):
            path = os.path.join(folder, name)
            if os.path.exists(path):
                with open(path) as fh:
                    run = json.load(fh)
                body.append([what, run["summary"], fmt(run["elapsed_s"], " s")])
        out += section("First use: `streamkl verify` on the GPU",
                       "The conformance battery on the GPU, its own clock (starting the command adds a few "
                       "seconds: [verify](verify.md)).", ["caches", "checks", "time"], body, cold)
    calls = _newest_gpu("first_call.csv")
    if calls:
        rs = [r for r in rows(calls) if r["run_status"] == "ok"]

        def value(entry, measure):
            return next((num(r["value"]) for r in rs if (r["entry"], r["measure"]) == (entry, measure)), None)

        body = [[label, fmt(value(e, "first_call_s"), " s"), fmt(value(e, "compile_s")),
                 str(int(value(e, "kernels_compiled") or 0))]
                for e, label in FIRST_CALL_ENTRIES.items() if value(e, "first_call_s") is not None]
        shape = next((r["shape"] for r in rs if r["entry"] == "fwd"), "")
        out += section("First use: each entry point's first call",
                       f"A fresh process with empty caches, one call at a new shape (`{shape}` for attention; the "
                       "indexer an MQA teacher of 64 heads, D = 576, indexer 64 x 128), the API name resolved "
                       "inside the timed call; compiler seconds summed over the compile threads, which run side "
                       "by side.", ["entry", "first call", "compiler seconds", "kernels compiled"], body, calls)
    return out


# ------------------------------------------------------------------ a folder's attention.csv
# ``--derive FOLDER``: the headline rows of one results folder (the form the attention tables read),
# derived from whichever of its own measurements it holds; what it lacks gives no rows:
# - bench.csv (the core sections): the forward over SDPA's forward, the training step (setting 1,
#   bwd_mode="auto") over SDPA's forward + backward, the backward alone (the step less the forward,
#   the worse of settings 1 and 2) over SDPA's backward (its step less its forward), each at B = 1,
#   H = 32, D = 128, bf16 for every N from 4K the grid ran; torch.compile of the materialised loss
#   at 8K over ours (where the run's budget let it run); decoding over the copy floor at N_K = 128K;
#   the long section's calls at its two longest N;
# - host_cost.csv (the host section): host time per call at the tiny shape, ours and SDPA's.
# Every ratio is of two medians of the same run. A measurement whose status is not ok gives a row
# with that status and no value (shown as not finished).
DERIVED_COLUMNS = ["operation", "pass", "n_q", "n_k", "b", "h", "d", "dtype", "causal", "setting", "metric",
                   "value", "baseline", "run_status"]
MIN_N = 4096  # the headline's range: below it launches, not the streaming pass, set the ratios
DIGITS = {"ratio_to_baseline": "{:.2f}", "speedup_over_baseline": "{:.2f}", "us_per_call": "{:.1f}",
          "seconds_per_call": "{:.3g}"}
HOST_SHAPE = dict(n_q=1, n_k=64, b=1, h=1, d=64, dtype="bf16", causal=0)
# the host section's providers -> (operation, pass)
HOST_PROVIDERS = {"forward": ("attention_kl", "host_fwd"), "forward+backward": ("attention_kl", "host_fwd_bwd"),
                  "sdpa_forward": ("sdpa", "host_fwd"), "sdpa_forward+backward": ("sdpa", "host_fwd_bwd")}


def _row(operation, pss, metric, value, *, baseline="", setting="", status="ok", **shape):
    row = dict.fromkeys(DERIVED_COLUMNS, "")
    row.update(operation=operation, metric=metric, baseline=baseline, setting=setting, run_status=status,
               **{k: str(v) for k, v in shape.items()})
    row["pass"] = pss
    row["value"] = "" if value is None or status != "ok" else DIGITS[metric].format(value)
    return row


def grid_rows(bench):
    """Ratios from a core-sections ``bench.csv``."""
    def p50(kernel, provider, mode, causal, n_q, n_k=None, h=32):
        for r in bench:
            if (r["kernel"], r["provider"], r["mode"], r["causal"], r["n_q"], r["n_k"], r["h"]) == (
                    kernel, provider, mode, str(causal), str(n_q), str(n_q if n_k is None else n_k), str(h)) \
                    and r["d1"] == r["d2"] == "128" and r["dtype"] == "bf16" and r["b"] == "1":
                return (float(r["p50_ms"]) if r["status"] == "ok" and r["p50_ms"] else None), r["status"]
        return None, "missing"

    def combine(op, x, y):
        """``op`` of two (median, status) pairs, as such a pair: no value where either has none."""
        (a, sa), (b, sb) = x, y
        if a is not None and b is not None:
            return op(a, b), "ok"
        return None, next((s for s in (sa, sb) if s != "ok"), "no value")

    def ratio(x, y):
        return combine(lambda a, b: a / b, x, y)

    def less(x, y):
        return combine(lambda a, b: a - b, x, y)

    out = []
    shape = dict(b=1, h=32, d=128, dtype="bf16")
    ns = sorted({int(r["n_q"]) for r in bench if r["kernel"] in ("fwd", "fwd_bwd") and r["n_q"] == r["n_k"]
                 and int(r["n_q"]) >= MIN_N})
    for n in ns:
        for c in (0, 1):
            at = dict(n_q=n, n_k=n, causal=c, **shape)
            fwd, sdpa_fwd = p50("fwd", "ours", "fwd", c, n), p50("fwd", "sdpa", "fwd", c, n)
            if fwd[1] != "missing":
                v, s = ratio(fwd, sdpa_fwd)
                out.append(_row("attention_kl", "fwd", "ratio_to_baseline", v, baseline="sdpa_fwd", status=s, **at))
            sdpa_step = p50("fwd_bwd", "sdpa", "fwd_bwd_sdpa", c, n)
            step = {s: p50("fwd_bwd", "ours_auto", f"fwd_bwd_{s}", c, n) for s in ("s1", "s2")}
            if step["s1"][1] != "missing":
                v, s = ratio(step["s1"], sdpa_step)
                out.append(_row("attention_kl", "fwd_bwd", "ratio_to_baseline", v, baseline="sdpa_fwd_bwd",
                                setting="s1", status=s, **at))
                # the backward alone: each step less its forward
                backs = [ratio(less(step[x], fwd), less(sdpa_step, sdpa_fwd)) for x in ("s1", "s2")]
                failed = [b for b in backs if b[1] != "ok"]
                v, s = failed[0] if failed else max(backs)
                out.append(_row("attention_kl", "bwd", "ratio_to_baseline", v, baseline="sdpa_bwd",
                                setting="worst of s1 s2", status=s, **at))
    for c in (0, 1):
        at = dict(n_q=8192, n_k=8192, causal=c, **shape)
        for pss, mode, ours in (("fwd", "fwd", ("fwd", "ours", "fwd")),
                                ("fwd_bwd", "fwd_bwd_s1", ("fwd_bwd", "ours_auto", "fwd_bwd_s1"))):
            compiled = p50(pss, "compile", mode, c, 8192)
            if compiled[0] is not None:  # skipped by the run's budget: no row (the table takes an older run's)
                v, s = ratio(compiled, p50(*ours, c, 8192))
                out.append(_row("attention_kl", pss, "speedup_over_baseline", v, baseline=f"torch_compile_{pss}",
                                setting="s1" if pss == "fwd_bwd" else "", status=s, **at))
    for n_q in (1, 16):
        ours = p50("decode", "ours", "fwd", 0, n_q, 131072)
        if ours[1] != "missing":
            v, s = ratio(ours, p50("decode", "floor", "fwd", 0, n_q, 131072))
            out.append(_row("attention_kl", "fwd", "ratio_to_baseline", v, baseline="copy_floor", status=s,
                            n_q=n_q, n_k=131072, dtype="bf16", causal=0))
    longs = [r for r in bench if r["kernel"] == "long"]
    for n in sorted({int(r["n_q"]) for r in longs})[-2:]:
        for r in longs:
            if int(r["n_q"]) == n and r["provider"] in ("ours", "ours_auto"):
                pss = "fwd" if r["mode"] == "fwd" else "fwd_bwd"
                value = float(r["p50_ms"]) / 1000 if r["status"] == "ok" and r["p50_ms"] else None
                out.append(_row("attention_kl", pss, "seconds_per_call", value, setting="" if pss == "fwd" else "s1",
                                status="ok" if value is not None else r["status"], n_q=n, n_k=n, b=r["b"], h=r["h"],
                                d=r["d1"], dtype=r["dtype"], causal=r["causal"]))
    return out


def host_rows(host):
    """Per-call host time at the tiny shape from the ``host`` section's ``host_cost.csv``."""
    out = []
    for r in host:
        if r["measure"] == "host_us_per_call" and r["provider"] in HOST_PROVIDERS:
            operation, pss = HOST_PROVIDERS[r["provider"]]
            ok = r["run_status"] == "ok" and r["value"]
            out.append(_row(operation, pss, "us_per_call", float(r["value"]) if ok else None,
                            setting="s1" if pss == "host_fwd_bwd" else "", status=r["run_status"] if not ok else "ok",
                            **HOST_SHAPE))
    return out


INDEXER_COLUMNS = ["operation", "teacher", "lse_given", "n", "causal", "reduction", "pass", "provider", "ms",
                   "run_status"]


def indexer_rows(training: list[dict]) -> list[dict]:
    """indexer.csv rows from the indexer section's ``indexer_training.csv`` (8K, causal, mean): ours
    and, where the run measured it, torch.compile, forward and step; the step's matmul floor."""
    get = {(r["section"], r["measure"], r["teacher"], r["path"], r["provider"], r["n"]): r for r in training}
    out = []

    def row(teacher, lse, pss, provider, r):
        ms = num(r["value"]) if r["run_status"] == "ok" else None
        out.append(dict(operation="indexer_kl", teacher=teacher, lse_given=lse, n="8192", causal="1",
                        reduction="mean", provider=provider, ms="" if ms is None else f"{ms:.3g}",
                        run_status=r["run_status"], **{"pass": pss}))

    for teacher in ("dsa", "gqa"):
        for path, lse in (("lse", "1"), ("no_lse", "0")):
            for measure, pss in (("fwd_ms", "fwd"), ("fwd_bwd_ms", "fwd_bwd")):
                for provider, name, at in (("streamkl", "ours", path), ("torch_compile", "torch_compile", "any")):
                    r = get.get(("dense", measure, teacher, at, provider, "8192"))
                    if r is not None:
                        row(teacher, lse, pss, name, r)
            r = get.get(("dense", "floor_ms", teacher, path, "floor", "8192"))
            if r is not None:
                row(teacher, lse, "fwd_bwd", "floor", r)
    return out


def derive(folder: str, host: str | None = None) -> list[dict]:
    """The rows of ``folder/attention.csv`` from the measurements it holds."""
    bench_path, host_path = os.path.join(folder, "bench.csv"), host or os.path.join(folder, "host_cost.csv")
    found = grid_rows(rows(bench_path)) if os.path.exists(bench_path) else []
    return found + (host_rows(rows(host_path)) if os.path.exists(host_path) else [])


def render() -> str:
    lines = ["<!-- generated by docs/gen_performance.py from bench/results/: do not edit -->", ""]
    if newest("indexer.csv"):
        lines += summary(newest("indexer.csv"))
    lines += attention()
    for name, fn in SECTIONS:
        path = newest(name)
        if path is not None:
            lines += fn(path)
    lines += first_use()
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=OUT)
    p.add_argument("--derive", metavar="FOLDER", help="write FOLDER/attention.csv (from its bench.csv and "
                   "host_cost.csv) and FOLDER/indexer.csv (from its indexer_training.csv) instead")
    p.add_argument("--host", help="with --derive: the host section's CSV (default FOLDER/host_cost.csv)")
    args = p.parse_args(argv)
    if args.derive:
        training = os.path.join(args.derive, "indexer_training.csv")
        outputs = (("attention.csv", DERIVED_COLUMNS, derive(args.derive, args.host)),
                   ("indexer.csv", INDEXER_COLUMNS, indexer_rows(rows(training)) if os.path.exists(training) else []))
        if not any(found for _, _, found in outputs):
            raise SystemExit(f"{args.derive}: no bench.csv, host_cost.csv or indexer_training.csv rows to derive from")
        for name, columns, found in outputs:
            if found:
                path = os.path.join(args.derive, name)
                with open(path, "w", newline="") as fh:
                    w = csv.DictWriter(fh, fieldnames=columns, lineterminator="\n")
                    w.writeheader()
                    w.writerows(found)
                print(f"wrote {path}: {len(found)} rows")
        return
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        fh.write(render())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
