"""``streamkl_gpu.devtools.bwd_mode_sweep`` on the CPU (the interpreter): every point's steps run
with their mode forced and give the same gradients, and each row's ratio is to the faster forced
mode."""
from __future__ import annotations

import torch

from streamkl_gpu.devtools import bwd_mode_sweep as tool


def test_points_run_each_mode_and_the_modes_agree():
    groups = tool.points((16,), (64,), ("both", "s1"), causals=(True,), device="cpu", dtype=torch.float32, H=1, D=16)
    assert set(groups) == {("both", True, 16, 64), ("s1", True, 16, 64)}
    both = {mode: step() for mode, step in groups[("both", True, 16, 64)].items()}
    assert set(both) == {"fused", "separate", "auto"} and len(both["fused"]) == 4
    for mode in ("separate", "auto"):
        for got, want in zip(both[mode], both["fused"]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert len(groups[("s1", True, 16, 64)]["fused"]()) == 2  # q2, k2


def test_rows_give_each_mode_over_the_faster_forced_one():
    medians = {("both", False, 256, 32768): {"fused": 3.0, "separate": 2.0, "auto": 3.0}}
    table = {r["mode"]: r for r in tool.rows(medians, 5, "gpu", "t", "tr")}
    assert table["auto"]["over_best"] == "1.5000" and table["separate"]["over_best"] == "1.0000"
    assert (table["fused"]["n_q"], table["fused"]["causal"], table["fused"]["rounds"]) == (256, 0, 5)


def test_an_unknown_setting_is_refused_with_the_choices(capsys):
    import pytest
    with pytest.raises(SystemExit):
        tool.main(["--out", "unused.csv", "--settings", "both,s3"])
    assert "s3" in capsys.readouterr().err
