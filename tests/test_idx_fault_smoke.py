"""CPU smoke of bench/idx_fault_gpu.py (the GPU fault ladder of the indexer's store and chunk
designs): four of its steps at the tiny size under the interpreter, each in its own process and
bounds-checked there; every step must run and match float64 within the tolerance rule; an
unknown step is a usage error. torch and triton are plain imports: a missing install fails."""
import csv
import os
import subprocess
import sys
from pathlib import Path

import torch  # noqa: F401
import triton  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "idx_fault_gpu.py"


def _run(tmp_path, *extra):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--tiny", "--parallel", "2", *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_fault_ladder_tiny_cpu(tmp_path):
    steps = ["control-dqk", "store-fwd-keys", "store-bwd", "chunk"]
    proc = _run(tmp_path, "--steps", ",".join(steps))
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    with open(tmp_path / "idx_fault.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == ["measure", "provider", "shape", "value", "unit", "note"]
        rows = list(reader)
    status = {r["provider"]: (r["value"], r["note"]) for r in rows if r["measure"] == "status"}
    assert status == {s: ("ran", "ok") for s in steps}, tail
    errs = [r for r in rows if r["measure"] == "rel_err"]
    assert {r["provider"].split()[0] for r in errs} == set(steps)
    assert len(errs) == 3 + 3 + 3 + 4  # the student share's three gradients (vs float64 grad of sum LSE_I);
    # loss, lse_idx, p; three gradients; loss and three gradients
    for r in errs:
        assert float(r["value"]) <= float(r["note"].split()[1]), r
        assert r["note"].endswith(" ok"), r


def test_unknown_step_is_a_usage_error(tmp_path):
    proc = _run(tmp_path, "--steps", "store-fwd-keys,nonsense")
    assert proc.returncode == 2
    assert "nonsense" in proc.stderr
