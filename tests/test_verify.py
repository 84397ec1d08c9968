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
    # the committed quick run docs/verify.md quotes (docs/gen_verify_counts.py) has the same rows
    committed = json.loads((ROOT / "docs" / "_generated" / "verify_cpu_quick.json").read_text())
    assert len(report["rows"]) == len(committed["rows"]) and set(report["cases"]) == set(committed["cases"])
    assert report["case_seconds"] and all({"compile_s", "kernels", "check_s"} <= set(v)
                                          for v in report["case_seconds"].values())


def test_verify_fails_on_a_wrong_kernel(tmp_path):
    """A kernel that is off by 0.1 % in KL must not pass the gate (exit status 1)."""
    patch = ("from streamkl_gpu import api\n"
             "_orig = api.attention_kl\n"
             "api.attention_kl = lambda *a, **k: _orig(*a, **k) * 1.001")
    proc, report = run_verify(tmp_path, patch)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert report["passed"] is False
    assert any(not r["pass"] and r["quantity"] == "kl" for r in report["rows"])


def _own_battery_case_names():
    """The cases a full CPU run of streamkl's own kernels reports, from the battery definitions."""
    sys.path.insert(0, str(ROOT))
    from streamkl_gpu.verify import VARLEN_CPU_CASES
    from streamkl_ref.testing import attention_cases, indexer_cases

    names = {c.name for c in attention_cases("cpu")} | {c[0] for c in VARLEN_CPU_CASES}
    names |= {f"indexer:{c.name}" for c in indexer_cases("cpu")}
    names |= {f"indexer(mean):{c.name}" for c in indexer_cases("cpu") if c.name in ("causal_nq>nk", "gqa")}
    return names


def test_the_counts_and_times_docs_verify_quotes_come_from_a_committed_run():
    """docs/verify.md includes docs/_generated/verify_cpu.md, rendered from the JSON reports of a
    real run (docs/gen_verify_counts.py); a battery that changed since makes this fail."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import gen_verify_counts as gen
    finally:
        sys.path.remove(str(ROOT / "docs"))
    out = ROOT / "docs" / "_generated"
    full, quick = gen.summary(out / "verify_cpu_full.json"), gen.summary(out / "verify_cpu_quick.json")
    assert (out / "verify_cpu.md").read_text() == gen.render(full, quick)
    assert '--8<-- "_generated/verify_cpu.md"' in (ROOT / "docs" / "verify.md").read_text()
    data = json.loads((out / "verify_cpu_full.json").read_text())
    assert data["passed"] and full["passed"] == full["rows"]
    assert set(data["cases"]) == _own_battery_case_names()
