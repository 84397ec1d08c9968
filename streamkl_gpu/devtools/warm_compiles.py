"""Which compiles of a warm ``streamkl verify`` run repeat the cold run's, and which are new.

    python -m streamkl_gpu.devtools.warm_compiles COLD.json WARM.json

Both files are ``streamkl verify --json`` reports of one battery on one cache directory, the cold
run first. Every compile a case started is listed there (``case_seconds[...]["compiles"]``: kernel,
seconds, fingerprint of what it asked Triton for, and Triton's own source hash and cache key). With
warm caches a compile should be a load of milliseconds; one that took longer is

- ``loaded``: its cache key is one the cold run wrote, so Triton loaded the binary; slow for other
  reasons (a process's first compile call also sets up Triton's backend: 0.2-0.6 s on an H100);
- ``source``: the cold run compiled the same request (kernel and fingerprint) under another source
  hash: the kernel's text, or a function or global it reads, hashed differently;
- ``rekeyed``: the same request and source under another cache key: the options after parsing, the
  backend or a cache-invalidating environment variable differed;
- ``repeat``: the same request, in a report without Triton's keys;
- ``new``: a specialisation the cold run never met (the call's arguments or options differ).
"""
from __future__ import annotations

import argparse
import json

SLOW_S = 0.2  # a warm compile longer than this is listed (a load takes milliseconds, a process's first up to 0.6 s)
KINDS = ("loaded", "source", "rekeyed", "repeat", "new")


def classify(cold: dict, warm: dict, slow_s: float = SLOW_S) -> list:
    """(case, kernel, seconds, kind) for each warm compile longer than ``slow_s``, kind one of
    :data:`KINDS` (the module's docstring)."""
    def compiles(report):
        for case, figures in report.get("case_seconds", {}).items():
            for kernel, seconds, fp, *keys in figures.get("compiles", []):
                source, key = (list(keys) + ["", ""])[:2]
                yield case, kernel, seconds, fp, source, key

    keys_made = {key for *_, key in compiles(cold) if key}
    sources_made = {}  # (kernel, fingerprint) -> source hashes the cold run compiled it under
    for _, kernel, _, fp, source, _ in compiles(cold):
        sources_made.setdefault((kernel, fp), set()).add(source)

    def kind(kernel, fp, source, key):
        if key and key in keys_made:
            return "loaded"
        if (kernel, fp) not in sources_made:
            return "new"
        if not key or not source:
            return "repeat"
        return "rekeyed" if source in sources_made[(kernel, fp)] else "source"

    return [(case, kernel, seconds, kind(kernel, fp, source, key))
            for case, kernel, seconds, fp, source, key in compiles(warm) if seconds > slow_s]


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
    counts = ", ".join(f"{sum(r[3] == k for r in rows)} {k}" for k in KINDS if any(r[3] == k for r in rows))
    print(f"{len(rows)} warm compiles over {args.slow_s} s" + (f": {counts}" if counts else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
