"""Which compiles of a warm ``streamkl verify`` run repeat the cold run's, and which are new.

    python -m streamkl_gpu.devtools.warm_compiles COLD.json WARM.json

Both files are ``streamkl verify --json`` reports of one battery on one cache directory, the cold
run first. Every compile a case started is listed there (``case_seconds[...]["compiles"]``: kernel,
seconds, fingerprint of what it asked Triton for). With warm caches a compile should be a load of
milliseconds; one that took longer either asked for a binary the cold run made (``repeat``: the
cache did not serve it) or for a specialisation the cold run never met (``new``: the call's
arguments or options differ between the runs).
"""
from __future__ import annotations

import argparse
import json

SLOW_S = 0.2  # a compile longer than this with warm caches did not come from the cache


def classify(cold: dict, warm: dict, slow_s: float = SLOW_S) -> list:
    """(case, kernel, seconds, "repeat" | "new") for each warm compile longer than ``slow_s``."""
    def compiles(report):
        for case, figures in report.get("case_seconds", {}).items():
            for kernel, seconds, fp in figures.get("compiles", []):
                yield case, kernel, seconds, fp

    made = {(kernel, fp) for _, kernel, _, fp in compiles(cold)}
    return [(case, kernel, seconds, "repeat" if (kernel, fp) in made else "new")
            for case, kernel, seconds, fp in compiles(warm) if seconds > slow_s]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cold")
    ap.add_argument("warm")
    ap.add_argument("--slow-s", type=float, default=SLOW_S, help="a warm compile longer than this is listed")
    args = ap.parse_args(argv)
    with open(args.cold) as f:
        cold = json.load(f)
    with open(args.warm) as f:
        warm = json.load(f)
    rows = classify(cold, warm, args.slow_s)
    for case, kernel, seconds, kind in rows:
        print(f"{kind:7s} {seconds:7.2f} s  {kernel:32s} {case}")
    print(f"{len(rows)} warm compiles over {args.slow_s} s: {sum(r[3] == 'repeat' for r in rows)} repeat a cold "
          f"one, {sum(r[3] == 'new' for r in rows)} new")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
