"""CPU smoke test of bench/bench_gpu.py: the tiny end-to-end run under the Triton interpreter.

Runs ``bench/bench_gpu.py --device cpu --tiny --sections check,fwd`` in a subprocess (the script
sets TRITON_INTERPRET=1 before importing streamkl_gpu; it is set here too) and checks the CSVs:
the columns, that every correctness row passed, and that the forward rows include our kernel.
About 30 s on a 2-core machine.
"""
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "bench_gpu.py"

BENCH_COLUMNS = ["kernel", "provider", "mode", "causal", "n_q", "n_k", "b", "h", "d1", "d2", "dtype",
                 "p20_ms", "p50_ms", "p80_ms", "peak_extra_gib", "status", "gpu", "torch", "triton",
                 "date", "streamkl_version", "extra"]
CHECK_COLUMNS = ["case", "dtype", "setting", "err", "tol", "pass", "tensor", "eager_err", "detail"]

pytest.importorskip("torch")
pytest.importorskip("triton")
if not (ROOT / "streamkl_gpu" / "__init__.py").exists():  # pragma: no cover - before the kernels land
    pytest.skip("streamkl_gpu is not written yet", allow_module_level=True)


def _read(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_bench_tiny_cpu(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--sections", "check,fwd", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail

    cols, checks = _read(tmp_path / "check.csv")
    assert cols == CHECK_COLUMNS
    assert len(checks) >= 50, tail
    failed = [r for r in checks if r["pass"] != "True"]
    assert not failed, failed[:5]
    for r in checks:
        if r["err"] and r["tol"]:
            assert float(r["err"]) <= float(r["tol"])
    settings = {r["setting"] for r in checks}
    assert {"fwd", "s1", "s2", "both"} <= settings
    assert {"fp32", "fp16", "bf16"} <= {r["dtype"] for r in checks}
    assert any("split" in r["tensor"] for r in checks)
    assert any("bitwise" in r["tensor"] for r in checks)

    cols, rows = _read(tmp_path / "bench.csv")
    assert cols == BENCH_COLUMNS
    fwd = [r for r in rows if r["kernel"] == "fwd"]
    providers = {r["provider"] for r in fwd if r["status"] == "ok"}
    assert {"ours", "sdpa", "eager", "chunked"} <= providers, providers
    for r in fwd:
        if r["status"] == "ok":
            assert 0 < float(r["p20_ms"]) <= float(r["p50_ms"]) <= float(r["p80_ms"])
    assert {r["causal"] for r in fwd} == {"0", "1"}
    assert (tmp_path / "summary.txt").read_text().count("\n") <= 60
