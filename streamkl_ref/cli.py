"""The ``streamkl`` command.

- ``streamkl trace``: runs the streaming recurrence of :mod:`streamkl_ref._online` on a small
  random example (``B = H = 1``, inputs drawn from ``numpy.random.default_rng(seed)`` in the
  order ``q1, k1, q2, k2``, standard normal) and prints, for the chosen query rows, the five
  running scalars after every key tile with the tile's status *for that row* (see
  :data:`STATUS_LEGEND`), how the KL comes out of the final five numbers (the formula of the
  accumulator form and base in use, then the same with the numbers put in), then the final KL
  next to the dense float64 and the mpmath values. Deterministic for a given set of options (no
  GPU, no torch). ``--json`` emits the same trace as standard JSON (non-finite numbers as the
  strings ``"-inf"``, ``"inf"``, ``"nan"``; mpmath values also as decimal strings), with the
  shapes and every option of the case. ``--accumulator max_referenced`` traces the form of
  ``acc`` the GPU kernels keep (``Σ e^(s1−m1)·((s1−m1) − (s2−m2))``) instead of the plain
  ``Σ e^(s1−m1)·(s1 − s2)`` of docs/math.md (the default). Output cut short by the reader
  (``streamkl trace --json | head``) ends quietly.
- ``streamkl verify ...``: hands every argument after ``verify`` to
  ``streamkl_gpu.verify.main(argv)`` (imported only then) and returns its exit code.

``main(argv)`` returns the exit code instead of raising ``SystemExit`` (the console-script
wrapper passes it to ``sys.exit``).
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from typing import Optional, Sequence

import mpmath
import numpy as np

__all__ = ["main", "build_trace", "STATUS_LEGEND", "kl_formula", "version_text"]

GPU_PACKAGES = ("torch", "triton")
INSTALL_HINT = "pip install 'streamkl[gpu]'"


# --------------------------------------------------------------------------------------------
# trace
# --------------------------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _parse_rows(text: str, nq: int) -> list[int]:
    """``"all"`` or a comma list of rows and ``a-b`` ranges (inclusive), e.g. ``0,2-4``."""
    if text.strip().lower() == "all":
        return list(range(nq))
    rows: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                rows.extend(range(lo, hi + 1))
            else:
                rows.append(int(part))
        except ValueError:
            raise ValueError(f"--rows: cannot read {part!r} (use e.g. 'all', '3' or '0,2-4')") from None
    bad = [r for r in rows if not 0 <= r < nq]
    if bad or not rows:
        raise ValueError(f"--rows must name rows in 0..{nq - 1}, got {text!r}")
    return sorted(set(rows))


# The status of a key tile, for one query row (not for the whole query block: a block's padding
# rows past N_Q, or its other rows' causal frontier, do not make a row's visible keys "masked").
STATUS_LEGEND = {
    "whole": "the row sees every key column of the tile",
    "masked": "computed, but the row sees only some (or none) of its key columns; the others are "
              "past the row's causal frontier, or past N_K (ragged last tile)",
    "skipped": "no row of the query block sees the tile: not computed, the state passes through",
}


def kl_formula(accumulator: str, base2: bool) -> dict:
    """How the KL comes out of the final ``(m1, l1, m2, l2, acc)``, as :func:`finalize_state`
    computes it, in words a reader can check: ``acc`` (the form of the accumulator), ``lse``,
    ``kl`` (in the state's units), ``nats`` (the conversion, base 2 only)."""
    if base2:  # the state is in bits: scores times log2(e), exp2/log2
        acc = ("acc = sum_j 2^(s1_j - m1) * ((s1_j - m1) - (s2_j - m2))" if accumulator == "max_referenced"
               else "acc = sum_j 2^(s1_j - m1) * (s1_j - s2_j)")
        acc += "   (s_j: scores times log2(e), in bits)"
        lse = "LSE1_bits = m1 + log2(l1), LSE2_bits = m2 + log2(l2)"
        kl = ("KL_bits = acc/l1 + log2(l2/l1)" if accumulator == "max_referenced"
              else "KL_bits = acc/l1 + (m2 - m1) + log2(l2/l1) = acc/l1 + LSE2_bits - LSE1_bits")
        return {"acc": acc, "lse": lse, "kl": kl, "nats": "KL = ln(2) * KL_bits (nats)"}
    acc = ("acc = sum_j exp(s1_j - m1) * ((s1_j - m1) - (s2_j - m2))" if accumulator == "max_referenced"
           else "acc = sum_j exp(s1_j - m1) * (s1_j - s2_j)")
    kl = ("KL = acc/l1 + ln(l2/l1)" if accumulator == "max_referenced"
          else "KL = acc/l1 + (m2 - m1) + ln(l2/l1) = acc/l1 + LSE2 - LSE1")
    return {"acc": acc, "lse": "LSE1 = m1 + ln(l1), LSE2 = m2 + ln(l2)", "kl": kl, "nats": None}


def _finish(last: dict, accumulator: str, base2: bool) -> dict:
    """:func:`kl_formula` evaluated on one row's final state (plain float arithmetic, in the
    formula's order), for the printout; a row that saw no key has KL 0 by definition."""
    log = math.log2 if base2 else math.log
    if last["m1"] == -math.inf:
        return {"empty": True, "kl": 0.0, "kl_nats": 0.0}
    lse1, lse2 = last["m1"] + log(last["l1"]), last["m2"] + log(last["l2"])
    if accumulator == "max_referenced":
        kl = last["acc"] / last["l1"] + log(last["l2"] / last["l1"])
    else:
        kl = last["acc"] / last["l1"] + (last["m2"] - last["m1"]) + log(last["l2"] / last["l1"])
    return {"empty": False, "lse1": lse1, "lse2": lse2, "kl": kl,
            "kl_nats": kl * math.log(2) if base2 else kl}


def _example_inputs(nq: int, nk: int, d1: int, d2: int, seed: int):
    rng = np.random.default_rng(seed)
    q1 = rng.standard_normal((1, 1, nq, d1))
    k1 = rng.standard_normal((1, 1, nk, d1))
    q2 = rng.standard_normal((1, 1, nq, d2))
    k2 = rng.standard_normal((1, 1, nk, d2))
    return q1, k1, q2, k2


def build_trace(*, nq=4, nk=10, d1=8, d2=4, seed=0, block_q=4, block_k=4, rows=None,
                causal=False, base2=False, dps=50, accumulator="plain") -> dict:
    """The trace as a plain dict (what ``--json`` prints, with floats still floats).

    ``rows``: list of query rows to report (``None``: all). ``accumulator``: the form of ``acc``
    in the reported states, ``"plain"`` or ``"max_referenced"`` (see :mod:`streamkl_ref._online`).
    """
    from . import attention_kl, attention_kl_mp, attention_kl_online
    from ._checks import check_inputs
    from ._scores import visible

    q1, k1, q2, k2 = _example_inputs(nq, nk, d1, d2, seed)
    dims = check_inputs(q1, k1, q2, k2)
    rows = list(range(nq)) if rows is None else list(rows)
    events = []
    online = attention_kl_online(q1, k1, q2, k2, causal=causal, block_q=block_q, block_k=block_k,
                                 base2=base2, accumulator=accumulator, on_tile=events.append)
    kl_dense, lse1_dense, lse2_dense = attention_kl(q1, k1, q2, k2, causal=causal, return_lse=True)
    kl_mp = attention_kl_mp(q1, k1, q2, k2, causal=causal, dps=dps, return_mpf=True)

    report_rows = []
    for r in rows:
        n_visible = min(nk, r + 1 + nk - nq) if causal else nk
        tiles = []
        for ev in events:
            if not ev.row_start <= r < ev.row_stop:
                continue
            local = r - ev.row_start
            # this row's view of the tile (block_k key columns, some maybe past N_K)
            cols = np.arange(ev.key_start, ev.key_start + block_k)
            seen = int(visible(np.array([r]), cols, nq, nk, causal).sum())
            status = "skipped" if ev.skipped else ("whole" if seen == block_k else "masked")
            entry = {"k_tile": ev.k_tile, "key_start": ev.key_start, "key_stop": ev.key_stop, "status": status,
                     "keys_seen": 0 if ev.skipped else seen}
            for name, arr in zip(ev.state._fields, ev.state):
                entry[name] = float(arr[0, 0, local])
            tiles.append(entry)
        kl_o, kl_d = float(online.kl[0, 0, r]), float(kl_dense[0, 0, r])
        kl_m = kl_mp[0, 0, r]
        with mpmath.workdps(dps):
            diff_dense_mp = float(mpmath.mpf(kl_d) - kl_m)
            mp_digits = mpmath.nstr(kl_m, 25)
        report_rows.append({
            "row": r,
            "q_block": r // block_q,
            "visible_keys": max(n_visible, 0),
            "tiles": tiles,
            "finish": _finish(tiles[-1], accumulator, base2),
            "kl_online": kl_o,
            "kl_dense": kl_d,
            "kl_mp": float(kl_m),
            "kl_mp_digits": mp_digits,
            "diff_online_dense": kl_o - kl_d,
            "diff_dense_mp": diff_dense_mp,
            "lse1_online": float(online.lse1[0, 0, r]),
            "lse2_online": float(online.lse2[0, 0, r]),
            "lse1_dense": float(lse1_dense[0, 0, r]),
            "lse2_dense": float(lse2_dense[0, 0, r]),
        })
    return {
        "params": {"nq": nq, "nk": nk, "d1": d1, "d2": d2, "seed": seed, "block_q": block_q,
                   "block_k": block_k, "causal": causal, "base2": base2, "dps": dps,
                   "accumulator": accumulator, "rows": rows},
        "shapes": {"q1": list(q1.shape), "k1": list(k1.shape), "q2": list(q2.shape), "k2": list(k2.shape),
                   "kl": [1, 1, nq]},
        "scale1": dims.scale1,
        "scale2": dims.scale2,
        "state_units": "bits (base 2)" if base2 else "nats (base e)",
        "status_legend": dict(STATUS_LEGEND),
        "kl_formula": kl_formula(accumulator, base2),
        "tiles_visited": online.tiles_visited,
        "tiles_skipped": online.tiles_skipped,
        "inputs": {"q1": q1[0, 0].tolist(), "k1": k1[0, 0].tolist(), "q2": q2[0, 0].tolist(), "k2": k2[0, 0].tolist()},
        "rows": report_rows,
    }


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    return x


def _fmt(x: float, spec: str = ".12g") -> str:
    return format(x, spec) if math.isfinite(x) else str(x)


def _render_text(trace: dict) -> str:
    p = trace["params"]
    out = [
        f"streamkl trace: N_Q={p['nq']} N_K={p['nk']} D1={p['d1']} D2={p['d2']} seed={p['seed']} "
        f"block_q={p['block_q']} block_k={p['block_k']} causal={p['causal']} base2={p['base2']}",
        f"inputs: numpy.random.default_rng({p['seed']}).standard_normal, drawn in the order q1, k1, q2, k2",
        f"scale1={trace['scale1']!r} scale2={trace['scale2']!r}; state (m1, l1, m2, l2, acc) in "
        f"{trace['state_units']}; causal is bottom-right aligned",
    ]
    formula = trace["kl_formula"]
    out.append(f"accumulator {p['accumulator']}: {formula['acc']}")
    out.append("status of a key tile, for the row shown:")
    out += [f"  {name:<8}{text}" for name, text in trace["status_legend"].items()]
    out.append(f"tiles per (batch, head): {trace['tiles_visited']} visited, {trace['tiles_skipped']} skipped")
    cols = ("m1", "l1", "m2", "l2", "acc")
    for row in trace["rows"]:
        out.append("")
        out.append(f"row {row['row']} (query block {row['q_block']}, sees {row['visible_keys']} keys): "
                   f"state after each key tile")
        out.append(f"{'tile':>4}  {'keys':<9}{'status':<15}" + "".join(f"{c:>21}" for c in cols))
        for t in row["tiles"]:
            keys = f"{t['key_start']}-{t['key_stop'] - 1}"
            status = t["status"] if t["status"] == "skipped" else f"{t['status']} {t['keys_seen']}/{p['block_k']}"
            out.append(f"{t['k_tile']:>4}  {keys:<9}{status:<15}" + "".join(f"{_fmt(t[c]):>21}" for c in cols))
        out += _render_finish(row, trace)
    out.append("")
    out.append("final KL (nats)")
    out.append(f"{'row':>4}{'online float64':>25}{'dense float64':>25}{'mpmath':>30}{'online-dense':>14}{'dense-mpmath':>14}")
    for row in trace["rows"]:
        out.append(
            f"{row['row']:>4}{_fmt(row['kl_online'], '.17g'):>25}{_fmt(row['kl_dense'], '.17g'):>25}"
            f"{row['kl_mp_digits']:>30}{_fmt(row['diff_online_dense'], '.2e'):>14}{_fmt(row['diff_dense_mp'], '.2e'):>14}"
        )
    return "\n".join(out)


def _render_finish(row: dict, trace: dict) -> list[str]:
    """How this row's KL comes out of its last state: the formula, then the numbers."""
    formula, fin, last = trace["kl_formula"], row["finish"], row["tiles"][-1]
    units = "bits" if trace["params"]["base2"] else "nats"
    if fin["empty"]:
        return ["KL of the row: it sees no key (m1 = -inf): KL = 0 and LSE = -inf by definition"]
    log = "log2" if trace["params"]["base2"] else "ln"
    out = [f"KL from the last state: {formula['lse']}; {formula['kl']}"]
    lse_names = ("LSE1_bits", "LSE2_bits") if units == "bits" else ("LSE1", "LSE2")
    out.append(f"  {lse_names[0]} = {_fmt(last['m1'])} + {log}({_fmt(last['l1'])}) = {_fmt(fin['lse1'])}, "
               f"{lse_names[1]} = {_fmt(last['m2'])} + {log}({_fmt(last['l2'])}) = {_fmt(fin['lse2'])}")
    name = "KL_bits" if units == "bits" else "KL"
    if trace["params"]["accumulator"] == "max_referenced":
        out.append(f"  {name} = {_fmt(last['acc'])}/{_fmt(last['l1'])} + {log}({_fmt(last['l2'])}/{_fmt(last['l1'])})"
                   f" = {_fmt(fin['kl'])} {units}")
    else:
        out.append(f"  {name} = {_fmt(last['acc'])}/{_fmt(last['l1'])} + {_fmt(fin['lse2'])} - {_fmt(fin['lse1'])}"
                   f" = {_fmt(fin['kl'])} {units}")
    if formula["nats"]:
        out.append(f"  {formula['nats']}: ln(2) * {_fmt(fin['kl'])} = {_fmt(fin['kl_nats'])} nats")
    return out


def _trace_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("trace", help="print the five running scalars of the streaming KL, tile by tile",
                       description="Trace the online attention-KL recurrence on a small random example "
                                   "(B=H=1) and compare the result with dense float64 and mpmath.")
    p.add_argument("--nq", type=_positive_int, default=4, help="query rows N_Q (default 4)")
    p.add_argument("--nk", type=_positive_int, default=10, help="key rows N_K (default 10)")
    p.add_argument("--d1", type=_positive_int, default=8, help="head dim of side 1 (default 8)")
    p.add_argument("--d2", type=_positive_int, default=4, help="head dim of side 2 (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of numpy.random.default_rng (default 0)")
    p.add_argument("--block-q", type=_positive_int, default=4, help="query rows per block (default 4)")
    p.add_argument("--block-k", type=_positive_int, default=4, help="keys per tile (default 4)")
    p.add_argument("--rows", default="all", help="rows to show: 'all' or e.g. '0,2-3' (default all)")
    p.add_argument("--causal", action="store_true", help="bottom-right aligned causal mask")
    p.add_argument("--base2", action="store_true", help="fold log2(e) into the scores, use exp2/log2")
    p.add_argument("--accumulator", choices=("plain", "max_referenced"), default="plain",
                   help="form of acc: 'plain' (docs/math.md, default) or 'max_referenced' "
                        "(re-referenced to the running maxima, as the GPU kernels keep it)")
    p.add_argument("--dps", type=_positive_int, default=50, help="mpmath digits (default 50)")
    p.add_argument("--json", action="store_true", help="emit the trace as JSON instead of a table")
    return p


def _run_trace(args, parser) -> int:
    try:
        rows = _parse_rows(args.rows, args.nq)
    except ValueError as exc:
        parser.error(str(exc))
    if args.dps < 15:
        parser.error("--dps must be at least 15")
    trace = build_trace(nq=args.nq, nk=args.nk, d1=args.d1, d2=args.d2, seed=args.seed,
                        block_q=args.block_q, block_k=args.block_k, rows=rows, causal=args.causal,
                        base2=args.base2, dps=args.dps, accumulator=args.accumulator)
    text = json.dumps(_jsonable(trace), indent=2, allow_nan=False) if args.json else _render_text(trace)
    return _write(text)


def _write(text: str) -> int:
    """Print ``text``; a reader that stops early (``| head``) ends it quietly, exit status 0."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python would report the broken pipe again when it flushes stdout at exit: point the
        # file descriptor at /dev/null first (the recipe of Python's signal docs).
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # not a real file (e.g. captured)
            pass
    return 0


# --------------------------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------------------------
def _run_verify(argv: list[str]) -> int:
    try:
        verify = importlib.import_module("streamkl_gpu.verify")
    except ImportError as exc:
        missing = (getattr(exc, "name", None) or "").split(".")[0]
        if missing in GPU_PACKAGES:
            print(f"streamkl verify needs PyTorch and Triton, but the package {missing!r} is not "
                  f"installed.\nInstall the GPU extra: {INSTALL_HINT}", file=sys.stderr)
        else:
            print(f"streamkl verify could not import streamkl_gpu.verify: {exc}\n"
                  f"(the GPU part is installed with: {INSTALL_HINT})", file=sys.stderr)
        return 2
    code = verify.main(argv)
    return int(code or 0)


def version_text() -> str:
    """``streamkl 0.1.0 (torch 2.13.0, triton 3.9.0, numpy ..., python ...)``: what is installed,
    found without importing torch or triton (``not installed`` where absent)."""
    import platform
    from importlib import metadata

    from . import __version__

    def installed(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return (f"streamkl {__version__} (torch {installed('torch')}, triton {installed('triton')}, "
            f"numpy {np.__version__}, python {platform.python_version()})")


# --------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``streamkl`` command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "verify":
        return _run_verify(argv[1:])
    parser = argparse.ArgumentParser(
        prog="streamkl", description="Streaming attention KL divergence.",
        epilog="examples:\n  streamkl trace --nk 12 --block-k 4 --rows 0\n  streamkl verify --quick\n"
               "  streamkl verify --impl mypkg.kl:my_kl --cases all --json report.json\n"
               "streamkl verify --help lists every option of the numerical gate.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="store_true",
                        help="print the versions of streamkl, torch and triton (those installed) and exit")
    sub = parser.add_subparsers(dest="command", metavar="{trace,verify}")
    trace_parser = _trace_parser(sub)
    sub.add_parser("verify", add_help=False,
                   help="the numerical gate: streamkl's kernels against the float64 references, or, with "
                        "--impl MODULE:FUNCTION, your own callable through the conformance suite "
                        "(streamkl verify --help: every option)")
    try:
        args = parser.parse_args(argv)
        if args.version:
            return _write(version_text())
        if args.command is None:
            parser.print_help()
            return 2
        return _run_trace(args, trace_parser)
    except SystemExit as exc:  # argparse: --help (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else 2


if __name__ == "__main__":
    sys.exit(main())
