"""bench/profile/ncu_summary.py reads the committed Nsight Compute text (H200, 2026-12-01): our kernels' rows
only, the figures the docs quote, every stall reason; --trim keeps only our kernels' sections."""
import csv
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("ncu_summary", ROOT / "bench" / "profile" / "ncu_summary.py")
ncu_summary = importlib.util.module_from_spec(_spec)  # a standalone tool (bench/profile/), loaded by its path
_spec.loader.exec_module(ncu_summary)

RESULTS = ROOT / "bench" / "results" / "2026-12-01_h200_5702577"


def test_summary_of_the_forward_profile(tmp_path):
    out = tmp_path / "s.csv"
    src = RESULTS / "ncu_fwd8k.txt"
    ncu_summary.main([str(out), f"fwd={src}", "--trim", str(tmp_path)])
    rows = list(csv.DictReader(open(out)))
    assert {r["kernel"] for r in rows} == {"_gluon_kl_fwd_kernel"}
    got = {r["metric"]: (float(r["value"]), r["unit"]) for r in rows}
    assert got["duration"] == (2.50, "ms")
    assert got["tensor_pipe_pct"][0] == 45.89 and got["mufu_xu_pct"][0] == 47.33
    assert got["registers"][0] == 168
    stalls = {m for m in got if m.startswith("stall_")}
    assert {"stall_barrier", "stall_wait", "stall_gmma"} <= stalls and len(stalls) >= 15
    trimmed = (tmp_path / "fwd.txt").read_text()
    assert "_gluon_kl_fwd_kernel" in trimmed and "elementwise" not in trimmed


def test_summary_skips_pytorch_kernels(tmp_path):
    src = tmp_path / "d.txt"
    src.write_text("  void at::fill_kernel (1, 1, 1)x(128, 1, 1), Context 1\n"
                   "    Duration                         us         1.76\n"
                   "  _kl_bwd_dk_kernel (64, 32, 1)x(256, 1, 1), Context 1\n"
                   "    Duration                         ms         6.80\n"
                   "    Stall Barrier                   inst         2.56\n")
    out = tmp_path / "s.csv"
    ncu_summary.main([str(out), f"b={src}"])
    rows = list(csv.DictReader(open(out)))
    assert [(r["kernel"], r["metric"], r["value"]) for r in rows] == [
        ("_kl_bwd_dk_kernel", "duration", "6.80"), ("_kl_bwd_dk_kernel", "stall_barrier", "2.56")]
    assert rows[0]["grid"] == "64x32x1" and rows[0]["block"] == "256x1x1"
