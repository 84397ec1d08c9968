"""`streamkl verify`, the numerical gate: passes on the real kernels, fails on a wrong one."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_verify(tmp_path, *extra_code):
    report = tmp_path / "report.json"
    code = "\n".join([
        "import os, sys",
        "os.environ['TRITON_INTERPRET'] = '1'",
        *extra_code,
        "from streamkl_ref.cli import main",
        f"sys.exit(main(['verify', '--quick', '--json', {str(report)!r}]))",
    ])
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc, (json.loads(report.read_text()) if report.exists() else None)


def test_verify_passes_and_writes_a_report(tmp_path):
    proc, report = run_verify(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["passed"] is True
    quantities = {r["quantity"] for r in report["rows"]}
    assert {"kl", "dq1 (fused)", "dk2 (separate)"} <= quantities
    assert all(r["pass"] and r["error"] <= r["tolerance"] for r in report["rows"])
    assert " 0 failed" in proc.stdout


def test_verify_fails_on_a_wrong_kernel(tmp_path):
    """A kernel that is off by 0.1 % in KL must not pass the gate (exit status 1)."""
    patch = ("from streamkl_gpu import api\n"
             "_orig = api.attention_kl\n"
             "api.attention_kl = lambda *a, **k: _orig(*a, **k) * 1.001")
    proc, report = run_verify(tmp_path, patch)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert report["passed"] is False
    assert any(not r["pass"] and r["quantity"] == "kl" for r in report["rows"])
