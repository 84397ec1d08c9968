"""The command line of bench/bench_gpu.py (its docstring is the --help text)."""

import argparse
import os

from .cases import CORE_SECTIONS
from .delegated import DELEGATED, parse_overrides


def parse_args(argv=None, doc=None):
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(CORE_SECTIONS),
                   help="comma list, run in this order, of the in-process sections " + ",".join(CORE_SECTIONS)
                        + " and the delegated ones " + ",".join(DELEGATED) + "; 'core' = the first list (the "
                        "default), 'extra' = the second, 'all' = both")
    p.add_argument("--quick", action="store_true", help="fewer N points and shorter do_bench reps")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test / GPU sanity)")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out", help="output dir (default $OUT or ./bench_out); {date}, {gpu}, {commit} are filled in")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-time budget for the whole run; perf points that would overrun are recorded "
                        "as 'skipped(budget)'. Default 460 (quick: 300, tiny: 600). Checks are never skipped.")
    p.add_argument("--compile-fwd-n", default=None, help="N list for torch.compile forward (priority order)")
    p.add_argument("--compile-bwd-n", default=None, help="N list for torch.compile fwd+bwd (priority order)")
    p.add_argument("--mem-limit-gb", type=float, default=100.0, help="skip eager/compile points estimated above this")
    p.add_argument("--check-autotune", action="store_true",
                   help="let streamkl_gpu tune launch configs during the check section (default: "
                        "STREAMKL_AUTOTUNE=0 there, i.e. the first candidate config; saves compiles)")
    p.add_argument("--full-check", action="store_true",
                   help="the full dtype x setting x mode product and more feature cases (~2x the compiles)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-v", "--verbose", action="store_true", help="one stdout line per measurement (always in bench.log)")
    p.add_argument("--section-budget", action="append", default=[], metavar="NAME=S",
                   help="time limit in seconds of a delegated section (repeatable); defaults in bench/README.md")
    p.add_argument("--section-args", action="append", default=[], metavar="NAME=ARGS",
                   help="arguments after OUT_DIR for a delegated section's script, replacing its defaults "
                        "(repeatable; e.g. 'host=--profile'); --quick/--tiny/--device cpu still add theirs")
    p.add_argument("--tail-lines", type=int, default=20,
                   help="lines of each delegated section's stdout printed before the summary")
    p.add_argument("--pack", action="store_true", help="pack everything under --out into --out/results.tgz at the end")
    a = p.parse_args(argv)
    a.sections = expand_sections(a.sections)
    known = CORE_SECTIONS + list(DELEGATED)
    bad = [s for s in a.sections if s not in known]
    if bad:
        p.error(f"unknown sections {bad}; choose from {known} (or core, extra, all)")
    try:
        a.section_budget = parse_overrides(a.section_budget, "--section-budget", float)
        a.section_args = parse_overrides(a.section_args, "--section-args")
    except ValueError as e:
        p.error(str(e))
    return a


def expand_sections(text):
    """'core,host' -> the section list, groups expanded, each name once, in the order given."""
    groups = {"core": CORE_SECTIONS, "extra": list(DELEGATED), "all": CORE_SECTIONS + list(DELEGATED)}
    out = []
    for s in (x.strip() for x in text.split(",")):
        for name in groups.get(s, [s] if s else []):
            if name not in out:
                out.append(name)
    return out

