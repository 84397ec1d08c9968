#!/usr/bin/env python3
"""Regenerate the tutorial's worked example from ``streamkl trace``.

    .venv/bin/python docs/gen_trace_example.py              # -> docs/_generated/trace_example.md
    .venv/bin/python docs/gen_trace_example.py --out PATH   # somewhere else (the docs test does this)

Every number in the snippet comes from ``streamkl trace --json`` (run in-process through
``streamkl_ref.cli.main``), or is computed here from those numbers with the formulas the
tutorial states (the rescale factors, the finalisation). Nothing is typed in by hand.
``tests/test_docs.py`` regenerates the file and fails if the committed copy is stale.
The output is deterministic: the trace's inputs come from ``numpy.random.default_rng(seed)``.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "docs", "_generated", "trace_example.md")

# The three traces the tutorial walks through (arguments of `streamkl trace`).
MAIN_ARGS = ["--rows", "2"]
BASE2_ARGS = ["--rows", "2", "--base2"]
CAUSAL_ARGS = ["--causal", "--nq", "6", "--nk", "6", "--block-q", "2", "--block-k", "2", "--rows", "0,5"]

STATE = ("m1", "l1", "m2", "l2", "acc")


def run_trace(args: list[str]) -> dict:
    """``streamkl trace --json ARGS``, parsed (non-finite numbers become floats again)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from streamkl_ref.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["trace", "--json", *args])
    if code != 0:
        raise SystemExit(f"streamkl trace {' '.join(args)} exited with {code}")

    def revive(x):
        if isinstance(x, dict):
            return {k: revive(v) for k, v in x.items()}
        if isinstance(x, list):
            return [revive(v) for v in x]
        if x in ("-inf", "inf", "nan"):
            return float(x)
        return x

    return revive(json.loads(buf.getvalue()))


def f(x: float, digits: int = 12) -> str:
    """A number for the page: ``digits`` significant digits (ASCII minus: it also goes into
    LaTeX), infinities as ``−∞``/``+∞``."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "−∞" if x < 0 else "+∞"
    return format(x, f".{digits}g")


def command(args: list[str]) -> str:
    return "streamkl trace " + " ".join(args)


def status_cell(t: dict, block_k: int) -> str:
    """The tile's status for this row (``streamkl trace``'s legend) and how many of the tile's
    ``block_k`` key columns the row sees."""
    if t["status"] == "skipped":
        return "skipped"
    return f"{t['status']} ({t['keys_seen']} of {block_k})"


def state_table(row: dict, units: str, block_k: int) -> list[str]:
    out = [
        f"| tile | keys | status | $m_1$ | $\\ell_1$ | $m_2$ | $\\ell_2$ | $\\mathrm{{acc}}$ |",
        "|---:|:---:|:---|---:|---:|---:|---:|---:|",
        "| start | — | — | −∞ | 0 | −∞ | 0 | 0 |",
    ]
    for t in row["tiles"]:
        keys = f"{t['key_start']}–{t['key_stop'] - 1}"
        out.append(f"| {t['k_tile']} | {keys} | {status_cell(t, block_k)} | "
                   + " | ".join(f(t[c]) for c in STATE) + " |")
    out.append("")
    out.append(f"*State after each key tile of row {row['row']}, in {units}.*")
    return out


def rescale_table(row: dict, exp) -> list[str]:
    """The factors ``a_t = exp(m_t - m_t')`` each tile applied to the old sums."""
    out = [
        "| tile | new $m_1$? | $a_1 = e^{m_1 - m_1'}$ | new $m_2$? | $a_2 = e^{m_2 - m_2'}$ |",
        "|---:|:---:|---:|:---:|---:|",
    ]
    prev = {"m1": -math.inf, "m2": -math.inf}
    for t in row["tiles"]:
        cells = []
        for m in ("m1", "m2"):
            old, new = prev[m], t[m]
            if old == -math.inf:
                cells += ["first keys", "— (old sums are 0)"]
            else:
                cells += ["yes" if new > old else "no", f(exp(old - new))]
            prev[m] = new
        out.append(f"| {t['k_tile']} | " + " | ".join(cells) + " |")
    return out


def main_section(tr: dict) -> list[str]:
    p = tr["params"]
    row = tr["rows"][0]
    last = row["tiles"][-1]
    lse1 = last["m1"] + math.log(last["l1"])
    lse2 = last["m2"] + math.log(last["l2"])
    kl = last["acc"] / last["l1"] + lse2 - lse1
    out = [
        "### The run",
        "",
        "```console",
        f"$ {command(MAIN_ARGS)}",
        "```",
        "",
        f"One batch, one head: $N_Q = {p['nq']}$ query rows, $N_K = {p['nk']}$ keys, head dims "
        f"$D_1 = {p['d1']}$ (side 1) and $D_2 = {p['d2']}$ (side 2), inputs drawn from "
        f"`numpy.random.default_rng({p['seed']})` in the order `q1, k1, q2, k2`. The scales are the "
        f"defaults $\\sigma_1 = 1/\\sqrt{{{p['d1']}}} = {f(tr['scale1'])}$ and "
        f"$\\sigma_2 = 1/\\sqrt{{{p['d2']}}} = {f(tr['scale2'])}$. Tiles are {p['block_q']} query rows "
        f"by {p['block_k']} keys, so row {row['row']} meets {len(row['tiles'])} key tiles; the last "
        f"one has only {last['key_stop'] - last['key_start']} real keys and runs with a mask.",
        "",
        "The status of a tile is the row's own view of it (`streamkl trace` prints this legend):",
        "",
        *[f"- **{name}**: {text}." for name, text in tr["status_legend"].items()],
        "",
        "The number in brackets is how many of the tile's key columns the row sees.",
        "",
        *state_table(row, tr["state_units"], p["block_k"]),
        "",
        "### The rescale factors",
        "",
        "Whenever a tile raises a running maximum, the old sums are multiplied by "
        "$a_t = e^{m_t - m_t'} < 1$ before the tile's own terms are added "
        "(computed here from the table above):",
        "",
        *rescale_table(row, math.exp),
        "",
        "### Finishing the row",
        "",
        "From the final state:",
        "",
        "$$",
        "\\begin{aligned}",
        f"\\mathrm{{LSE}}_1 &= m_1 + \\ln \\ell_1 = {f(last['m1'])} + \\ln {f(last['l1'])} = {f(lse1)},\\\\",
        f"\\mathrm{{LSE}}_2 &= m_2 + \\ln \\ell_2 = {f(last['m2'])} + \\ln {f(last['l2'])} = {f(lse2)},\\\\",
        "\\mathrm{KL} &= \\frac{\\mathrm{acc}}{\\ell_1} + \\mathrm{LSE}_2 - \\mathrm{LSE}_1\\\\",
        f"&= \\frac{{{f(last['acc'])}}}{{{f(last['l1'])}}} + {f(lse2)} - {f(lse1)} = {f(kl)}.",
        "\\end{aligned}",
        "$$",
        "",
        "The trace's own results, next to the dense float64 reference (both score matrices "
        "materialised) and mpmath at 50 digits:",
        "",
        "| quantity | streaming (float64) | dense (float64) | mpmath |",
        "|---|---:|---:|---:|",
        f"| KL (nats) | {f(row['kl_online'], 17)} | {f(row['kl_dense'], 17)} | {row['kl_mp_digits']} |",
        f"| LSE₁ | {f(row['lse1_online'], 17)} | {f(row['lse1_dense'], 17)} | |",
        f"| LSE₂ | {f(row['lse2_online'], 17)} | {f(row['lse2_dense'], 17)} | |",
        "",
        f"Streaming minus dense: {f(row['diff_online_dense'], 2)}; dense minus mpmath: "
        f"{f(row['diff_dense_mp'], 2)}: both at the level of float64 rounding "
        f"(machine epsilon is {f(2.0 ** -52, 3)}).",
    ]
    return out


def base2_section(tr2: dict, tr_e: dict) -> list[str]:
    row2, row_e = tr2["rows"][0], tr_e["rows"][0]
    last2, last_e = row2["tiles"][-1], row_e["tiles"][-1]
    lse1 = last2["m1"] + math.log2(last2["l1"])
    lse2 = last2["m2"] + math.log2(last2["l2"])
    kl_bits = last2["acc"] / last2["l1"] + lse2 - lse1
    return [
        "### The same row in base 2",
        "",
        "```console",
        f"$ {command(BASE2_ARGS)}",
        "```",
        "",
        *state_table(row2, tr2["state_units"], tr2["params"]["block_k"]),
        "",
        f"The maxima are the base-$e$ ones times $\\log_2 e$ "
        f"({f(last2['m1'])} / {f(last_e['m1'])} = {f(last2['m1'] / last_e['m1'])} "
        f"and {f(last2['m2'])} / {f(last_e['m2'])} = {f(last2['m2'] / last_e['m2'])}; "
        f"$\\log_2 e = {f(1 / math.log(2))}$). The sums $\\ell_1, \\ell_2$ are the same numbers as "
        "before: $2^{x \\log_2 e - m \\log_2 e} = e^{x - m}$. Finishing in bits:",
        "",
        "$$",
        "\\begin{aligned}",
        "\\mathrm{KL}_{\\text{bits}} &= \\frac{\\mathrm{acc}}{\\ell_1} + \\mathrm{LSE}_2 - \\mathrm{LSE}_1"
        " \\quad\\text{(LSEs in bits: } m_t + \\log_2 \\ell_t)\\\\",
        f"&= \\frac{{{f(last2['acc'])}}}{{{f(last2['l1'])}}} + {f(lse2)} - {f(lse1)} = {f(kl_bits)},\\\\",
        f"\\ln 2 \\cdot \\mathrm{{KL}}_{{\\text{{bits}}}} &= {f(math.log(2) * kl_bits)}\\ \\text{{nats}},",
        "\\end{aligned}",
        "$$",
        "",
        f"the same KL as in base $e$ ({f(row_e['kl_online'])} nats; the trace reports "
        f"{f(row2['kl_online'])} after its own conversion).",
    ]


def causal_section(tr: dict) -> list[str]:
    p = tr["params"]
    out = [
        "### A causal run: skipped tiles",
        "",
        "```console",
        f"$ {command(CAUSAL_ARGS)}",
        "```",
        "",
        f"$N_Q = N_K = {p['nq']}$ with {p['block_q']}×{p['block_k']} tiles: "
        f"{tr['tiles_visited']} (query block, key tile) pairs are computed and "
        f"{tr['tiles_skipped']} lie entirely past the causal frontier and are skipped "
        "(the state passes through unchanged). A tile on the diagonal runs with a mask, but a row "
        "that sees all of its keys counts it as whole: the status is the row's, not the block's.",
        "",
    ]
    for row in tr["rows"]:
        out.append(f"Row {row['row']} (query block {row['q_block']}, sees {row['visible_keys']} "
                   f"key{'s' if row['visible_keys'] != 1 else ''}):")
        out.append("")
        out += state_table(row, tr["state_units"], p["block_k"])
        out.append("")
        out.append(f"KL: streaming {f(row['kl_online'], 17)}, dense {f(row['kl_dense'], 17)}, "
                   f"mpmath {row['kl_mp_digits']}.")
        out.append("")
        if row["visible_keys"] == 1:
            t = row["tiles"][-1]
            out.append(
                f"With a single visible key both distributions put all their mass on it, so the KL is 0. "
                f"The state shows why the formula agrees: $\\ell_1 = \\ell_2 = 1$ and "
                f"$\\mathrm{{acc}} = s - t = m_1 - m_2$ ({f(t['acc'])} vs {f(t['m1'] - t['m2'])}), so "
                f"$\\mathrm{{acc}}/\\ell_1 + \\mathrm{{LSE}}_2 - \\mathrm{{LSE}}_1 = (m_1 - m_2) + m_2 - m_1 = 0$.")
            out.append("")
    return out


def render() -> str:
    tr_main = run_trace(MAIN_ARGS)
    tr_b2 = run_trace(BASE2_ARGS)
    tr_causal = run_trace(CAUSAL_ARGS)
    lines = [
        "<!-- Generated by docs/gen_trace_example.py from `streamkl trace --json`. Do not edit by hand. -->",
        "",
        *main_section(tr_main),
        "",
        *base2_section(tr_b2, tr_main),
        "",
        *causal_section(tr_causal),
    ]
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"output file (default {os.path.relpath(DEFAULT_OUT, ROOT)})")
    args = ap.parse_args(argv)
    text = render()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8", newline="\n") as fh:
        fh.write(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
