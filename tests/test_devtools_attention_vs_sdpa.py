"""``streamkl_gpu.devtools.attention_vs_sdpa`` on the CPU (the interpreter): the points it builds
run and return what they time, each point's providers are timed in rotated order, and the CSV rows
carry the ratio to the pinned cuDNN where one was measured."""
from __future__ import annotations

import torch

from streamkl_gpu.devtools import attention_vs_sdpa as tool


def test_points_build_forward_and_training_steps_that_run():
    groups = tool.points((32,), (32,), variants=("eager_max",), device="cpu", dtype=torch.float32, H=1, D=16)
    assert set(groups) == {f"{kind} n=32 causal={c}" for kind in ("fwd", "fwdbwd_s1", "fwdbwd_s2") for c in (0, 1)}
    fwd = groups["fwd n=32 causal=1"]
    assert set(fwd) == {"ours", "ours_eager_max", "sdpa_default"}  # no cuDNN on a CPU
    assert fwd["ours"]().shape == (1, 1, 32)
    grads = groups["fwdbwd_s1 n=32 causal=0"]["ours"]()
    assert len(grads) == 2 and all(g.shape == (1, 1, 32, 16) and torch.isfinite(g).all() for g in grads)
    assert len(groups["fwdbwd_s2 n=32 causal=1"]["sdpa_default"]()) == 3  # dq, dk, dv


def test_measure_rotates_each_points_providers_and_rows_give_the_cudnn_ratio():
    calls = []
    groups = {"p": {name: (lambda name=name: calls.append(name)) for name in ("a", "sdpa_cudnn", "c")}}
    cost = {"a": 3.0, "sdpa_cudnn": 2.0, "c": 1.0}
    medians = tool.measure(groups, 3, lambda fn: fn() or cost[calls[-1]])
    assert calls[:3] == ["a", "sdpa_cudnn", "c"]  # once each before timing
    assert calls[3:] == ["a", "sdpa_cudnn", "c", "sdpa_cudnn", "c", "a", "c", "a", "sdpa_cudnn"]
    table = {r["provider"]: r for r in tool.rows(medians, 3, "cpu", "t", "tr")}
    assert table["a"]["median_ms"] == "3.0000" and table["a"]["over_cudnn"] == "1.5000"
    assert table["c"]["over_cudnn"] == "0.5000" and table["a"]["rounds"] == 3 and table["a"]["run_status"] == "ok"
