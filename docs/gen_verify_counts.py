"""Regenerate docs/_generated/verify_cpu.{json,md}: run `streamkl verify` on CPU (the Triton
interpreter), full and --quick, and render the counts and times docs/verify.md quotes.

    python docs/gen_verify_counts.py            # runs both (about a minute on 2 cores)
    python docs/gen_verify_counts.py --render   # re-render the .md from the committed JSON

tests/test_verify.py checks that the page quotes this rendering and that the committed run has
every case of the current battery.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "_generated"
RUNS = {"full": [], "quick": ["--quick"]}


def summary(path: Path) -> dict:
    data = json.loads(path.read_text())
    rows = data["rows"]
    return {"rows": len(rows), "passed": sum(r["status"] == "pass" for r in rows), "cases": len(data["cases"]),
            "elapsed_s": data["elapsed_s"], "cpu_s": data.get("cpu_s"), "date": data["date"],
            "torch": data["torch"], "triton": data["triton"]}


def render(full: dict, quick: dict) -> str:
    return (f"On CPU (the Triton interpreter) the full battery ({full['rows']} rows over {full['cases']} cases: "
            f"attention, packed sequences, NaN planting and the indexer) took {full['elapsed_s']:.0f} s "
            f"({full['cpu_s']:.0f} s of CPU time), `--quick` ({quick['rows']} rows) {quick['elapsed_s']:.0f} s "
            f"({quick['cpu_s']:.0f} s of CPU time): measured {full['date']} on a 2-core machine shared with "
            f"other work, torch {full['torch']}, triton {full['triton']} "
            f"(`docs/gen_verify_counts.py`, `docs/_generated/verify_cpu_full.json`).\n")


def main(argv) -> int:
    if "--render" not in argv:
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
        for name, extra in RUNS.items():
            cmd = [sys.executable, "-m", "streamkl_ref", "verify", "--device", "cpu", "-q", *extra,
                   "--json", str(OUT / f"verify_cpu_{name}.json")]
            if subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL).returncode != 0:
                print(f"streamkl verify ({name}) failed", file=sys.stderr)
                return 1
    (OUT / "verify_cpu.md").write_text(render(summary(OUT / "verify_cpu_full.json"),
                                              summary(OUT / "verify_cpu_quick.json")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
