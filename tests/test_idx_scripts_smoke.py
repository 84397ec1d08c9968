"""CPU smokes of two of the GPU scripts (bench/idx_gqa_gpu.py, bench/idx_pacc_gpu.py), their
``--tiny --final`` runs under the interpreter: a broken script would waste a GPU session's slot.
Each must exit 0, time every variant of its final list, and check each timed variant against
float64 within the tolerance rule (the CSV's check rows, parsed here). ~30 s in all."""
import csv
import os
import subprocess
import sys
from pathlib import Path

import torch  # noqa: F401  (a missing install must fail, not skip)
import triton  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, script):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), str(tmp_path), "--tiny", "--final"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    name = script.replace("_gpu.py", ".csv")
    with open(tmp_path / name, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == ["measure", "provider", "shape", "value", "unit", "note"]
        return list(reader), proc.stdout


def _checks_pass(rows, measure):
    checks = [r for r in rows if r["measure"] == measure]
    assert checks
    for r in checks:
        tol = float(r["note"].split("tol ")[1].split()[0])
        assert float(r["value"]) <= tol and r["note"].endswith(" ok"), r
    return checks


def test_gqa_final_tiny(tmp_path):
    rows, out = _run(tmp_path, "idx_gqa_gpu.py")
    timed = {r["provider"].removeprefix("ours_lse ") for r in rows if r["measure"] == "fwd_ms"}
    assert "api-default (autotune off)" in timed and len(timed) >= 4, out[-2000:]
    checked = {r["provider"] for r in _checks_pass(rows, "check_kl_rel_err")}
    assert checked >= timed - {p for p in timed if p.endswith("host-merge")}, (checked, timed)
    assert "0 failure(s)" in out


def test_pacc_final_tiny(tmp_path):
    rows, out = _run(tmp_path, "idx_pacc_gpu.py")
    timed = [r for r in rows if r["measure"] in ("fwd", "bwd", "fwd+bwd")]
    assert {r["measure"] for r in timed} == {"fwd", "bwd", "fwd+bwd"}
    assert any("chunk" in r["provider"] for r in timed)  # the chunk design runs there
    checks = _checks_pass(rows, "check_rel_err")
    assert {r["provider"].rsplit(" ", 1)[1] for r in checks} == {"loss", "dq_idx", "dk_idx", "dweights"}
    assert any(r["provider"].startswith("chunk") for r in checks)
