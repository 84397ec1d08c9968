"""The ``streamkl`` command.

- ``streamkl trace``: runs the streaming recurrence of :mod:`streamkl_ref._online` on a small
  random example (``B = H = 1``, inputs drawn from ``numpy.random.default_rng(seed)`` in the
  order ``q1, k1, q2, k2``, standard normal) and prints, for the chosen query rows, the five
  running scalars after every key tile, then the final KL next to the dense float64 and the
  mpmath values. Deterministic for a given set of options (no GPU, no torch). ``--json`` emits
  the same trace as standard JSON (non-finite numbers as the strings ``"-inf"``, ``"inf"``,
  ``"nan"``; mpmath values also as decimal strings). ``--accumulator max_referenced`` traces the form of
  ``acc`` the GPU kernels keep (``Σ e^(s1−m1)·((s1−m1) − (s2−m2))``) instead of MATH.md's plain
  ``Σ e^(s1−m1)·(s1 − s2)`` (the default; its output is unchanged).
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
import sys
from typing import Optional, Sequence

import mpmath
import numpy as np

__all__ = ["main", "build_trace"]

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
            status = "skipped" if ev.skipped else ("masked" if ev.masked else "full")
            entry = {"k_tile": ev.k_tile, "key_start": ev.key_start, "key_stop": ev.key_stop, "status": status}
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
                   "accumulator": accumulator},
        "scale1": dims.scale1,
        "scale2": dims.scale2,
        "state_units": "bits (base 2)" if base2 else "nats (base e)",
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
    if p.get("accumulator", "plain") != "plain":  # the default header stays as it was
        out.append("acc is max-referenced, as the GPU kernels keep it: "
                   "acc = sum exp(s1 - m1) * ((s1 - m1) - (s2 - m2)); KL = acc/l1 + log(l2/l1)")
    out.append(f"tiles per (batch, head): {trace['tiles_visited']} visited, {trace['tiles_skipped']} skipped")
    cols = ("m1", "l1", "m2", "l2", "acc")
    for row in trace["rows"]:
        out.append("")
        out.append(f"row {row['row']} (query block {row['q_block']}, sees {row['visible_keys']} keys): "
                   f"state after each key tile")
        out.append(f"{'tile':>4}  {'keys':<9}{'status':<8}" + "".join(f"{c:>21}" for c in cols))
        for t in row["tiles"]:
            keys = f"{t['key_start']}-{t['key_stop'] - 1}"
            out.append(f"{t['k_tile']:>4}  {keys:<9}{t['status']:<8}" + "".join(f"{_fmt(t[c]):>21}" for c in cols))
    out.append("")
    out.append("final KL (nats)")
    out.append(f"{'row':>4}{'online float64':>25}{'dense float64':>25}{'mpmath':>30}{'online-dense':>14}{'dense-mpmath':>14}")
    for row in trace["rows"]:
        out.append(
            f"{row['row']:>4}{_fmt(row['kl_online'], '.17g'):>25}{_fmt(row['kl_dense'], '.17g'):>25}"
            f"{row['kl_mp_digits']:>30}{_fmt(row['diff_online_dense'], '.2e'):>14}{_fmt(row['diff_dense_mp'], '.2e'):>14}"
        )
    return "\n".join(out)


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
                   help="form of acc: 'plain' (MATH.md, default) or 'max_referenced' "
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
    if args.json:
        print(json.dumps(_jsonable(trace), indent=2, allow_nan=False))
    else:
        print(_render_text(trace))
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


# --------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``streamkl`` command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "verify":
        return _run_verify(argv[1:])
    parser = argparse.ArgumentParser(prog="streamkl", description="Streaming attention KL divergence.")
    sub = parser.add_subparsers(dest="command", metavar="{trace,verify}")
    trace_parser = _trace_parser(sub)
    sub.add_parser("verify", add_help=False,
                   help="check the GPU kernels against the references (arguments go to streamkl_gpu.verify)")
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        return _run_trace(args, trace_parser)
    except SystemExit as exc:  # argparse: --help (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else 2


if __name__ == "__main__":
    sys.exit(main())
