"""docs/_generated/perf_tables.md is what bench/tables.py makes of the committed CSVs."""
import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_committed_tables_are_up_to_date(tmp_path):
    out = tmp_path / "perf_tables.md"
    subprocess.run([sys.executable, str(ROOT / "bench" / "tables.py"), "--out", str(out)], check=True,
                   capture_output=True, timeout=60)
    assert out.read_text() == (ROOT / "docs" / "_generated" / "perf_tables.md").read_text()


def test_table_ratio_matches_csv():
    """The 8K non-causal forward row: ours and torch.compile from the CSV, ratio as printed."""
    csv_path = next((ROOT / "bench" / "results").glob("*_bench.csv"))
    rows = list(csv.DictReader(csv_path.open()))

    def p50(provider):
        return next(float(r["p50_ms"]) for r in rows if r["kernel"] == "fwd" and r["provider"] == provider
                    and r["causal"] == "0" and r["n_q"] == "8192" and r["status"] == "ok")

    ratio = p50("compile") / p50("ours")
    page = (ROOT / "docs" / "_generated" / "perf_tables.md").read_text()
    line = next(l for l in page.splitlines() if l.startswith("| 8K | no |") and "eager" not in l
                and l.count("|") == 10 and f"{p50('ours'):.3g}" in l)
    assert f"{ratio:.2f}×" in line
