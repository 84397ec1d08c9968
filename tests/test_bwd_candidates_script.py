"""CPU smoke run of the backward candidates' GPU script (bench/bwd_s6.py) under the interpreter:
prewarm worker, timings, comparisons with the reference kernels, float64 checks and the CSV /
table it leaves, with the reference kernels and one candidate (the dK kernel with packed row
constants)."""
import csv
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_backward_candidates_script_tiny_run(tmp_path):
    only = "dq 128x64x8x3 (auto),dk 64x128x8x3 rows (auto),dk 64x128x8x3 pack"
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bwd_s6.py"), str(tmp_path), "--tiny",
                          "--workers", "1", "--only", only], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(tmp_path / "bwd_s6.csv") as f:
        rows = list(csv.DictReader(f))
    timed = {(r["provider"], r["shape"]) for r in rows if r["measure"] == "bwd_kernel" and float(r["value"]) > 0}
    assert ("dk 64x128x8x3 pack", "8K causal s2") in timed
    assert ("dk 64x128x8x3 pack", "nq512 nk32K s1") in timed  # (tiny: 16 x 64)
    # each candidate's output against the reference kernel's, and every float64 check passed
    diffs = [r for r in rows if r["measure"] == "bwd_kernel" and "vs_ref=" in r["note"]]
    assert diffs and all(float(r["note"].split("vs_ref=")[1].split()[0]) < 1e-3 for r in diffs)
    checks = [r for r in rows if r["measure"] == "check_err_vs_f64"]
    assert len(checks) == 2 * 3 + 2 * 3, checks  # settings x candidates x (non-causal, causal)
    assert not any("FAIL" in r["note"] for r in checks)
    assert "bwd_s6: kernel-alone ms" in (tmp_path / "bwd_s6_table.txt").read_text()
