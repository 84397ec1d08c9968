"""CPU smoke of the benchmark's ``indexer`` section (bench/streamkl_bench/indexer.py: dense, top-k, the training-step tables): its ``--tiny`` run under the
interpreter must exit 0, time every teacher x path and the top-k point, and check each against
float64 within the loss's tolerances (loss 1e-5, gradients 5e-3) (the CSV's check rows, parsed here); the floors are the
documented formulas (the published H200 numbers at 752 TFLOP/s). ~15 s."""
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module():
    from streamkl_bench import indexer  # bench/ is on pytest's pythonpath (pyproject.toml)
    return indexer


def test_tiny_run(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "bench"), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-m", "streamkl_bench.indexer", "--out", str(tmp_path), "--tiny"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    mod = _module()
    with open(tmp_path / "indexer_training.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == mod.COLUMNS
        rows = list(reader)
    assert not [r for r in rows if r["measure"] == "error"], [r for r in rows if r["measure"] == "error"]
    timed = {(r["teacher"], r["path"], r["provider"]) for r in rows if r["measure"] == "fwd_bwd_ms" and float(r["value"]) > 0}
    want = {(t, p, "streamkl") for t in ("dsa", "gqa") for p in mod.PATHS} | {("dsa", "topk=4", "streamkl")}
    # the accumulating design beside the default (STREAMKL_INDEXER_TRAINING=accumulate), lse given
    assert timed == want | {(t, "lse", "streamkl_accumulating") for t in ("dsa", "gqa")}, timed ^ want
    want = {w[:2] for w in want}
    checks = [r for r in rows if r["measure"].startswith("check_")]
    assert {(r["teacher"], r["path"]) for r in checks} == want
    assert {r["measure"] for r in checks} == {"check_loss_err", "check_dq_idx_rel_err", "check_dk_idx_rel_err",
                                             "check_dweights_rel_err"}
    for r in checks:
        tol = float(r["note"].split("tol ")[1].split()[0])
        assert float(r["value"]) <= tol and r["note"].endswith(" ok"), r
    assert {r["gpu"] for r in rows} == {"cpu (interpreter)"} and all(r["timestamp"] and r["triton"] for r in rows)
    assert "0 check failure(s)" in proc.stdout


@pytest.mark.parametrize("teacher,path,ms", [
    ("dsa", "lse", 8.77), ("dsa", "no_lse", 15.35), ("gqa", "lse", 0.64), ("gqa", "no_lse", 1.00),
    ("dsa", "row_weights_lse", 8.77), ("dsa", "row_weights_no_lse", 15.35),
])
def test_floors_are_the_published_ones(teacher, path, ms):
    """The published step floors (docs/indexer.md's formulas) at 8K causal and 752 TFLOP/s."""
    mod = _module()
    got = mod.floor_flops(mod.TEACHERS[teacher], 8192, path) / 752e12 * 1e3
    assert abs(got - ms) <= 0.006 * ms, got


def test_topk_floor():
    mod = _module()
    cfg = mod.TEACHERS["dsa"]
    assert mod.floor_flops(cfg, 32768, "", topk=2048) == 2.0 * 32768 * 2048 * (128 * 576 + 3 * 64 * 128)


def test_tiny_run_with_forced_choices(tmp_path):
    """``--teachers mqa64 --forced previous_tiles,branch_layout``: the first-call section's teacher,
    each path also with the chunk design's previous tiles and with the gradient kernel's
    "keys_branch" variant (through the forcing hook)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "bench"), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-m", "streamkl_bench.indexer", "--out", str(tmp_path), "--tiny", "--teachers",
                           "mqa64", "--paths", "no_lse", "--forced", "previous_tiles,branch_layout", "--no-topk", "--no-check"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    with open(tmp_path / "indexer_training.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    timed = {(r["teacher"], r["path"], r["provider"]) for r in rows if r["measure"] == "fwd_bwd_ms" and float(r["value"]) > 0}
    assert timed == {("mqa64", "no_lse", p) for p in ("streamkl", "streamkl_previous_tiles", "streamkl_branch_layout")}, timed
