"""streamkl_gpu.devtools.power_log: nvidia-smi's samples parsed into clock, power and the power-cap
share; no nvidia-smi (a CPU machine): an empty log, no error. A stand-in nvidia-smi on PATH prints
what the real one prints with ``--format=csv,noheader,nounits``."""
import os
import stat
import time

from streamkl_gpu.devtools import power_log as pl

STAND_IN = """#!/bin/sh
echo "$@" > "$(dirname "$0")/args"
echo "1980, 130.5, 0x0000000000000000"
echo "1545, 699.7, 0x0000000000000004"
echo "1500, 700.2, 0x0000000000000004"
echo "[N/A], [N/A], [N/A]"
exec sleep 30
"""


def test_samples_are_parsed_and_summarised(tmp_path, monkeypatch):
    exe = tmp_path / "nvidia-smi"
    exe.write_text(STAND_IN)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + os.environ.get("PATH", ""))
    t0 = time.perf_counter()
    with pl.power_log(interval_ms=100, device=1) as log:
        time.sleep(0.5)
    assert time.perf_counter() - t0 < 10  # the sampler is stopped when the block ends
    assert log.samples == [(1980.0, 130.5, 0), (1545.0, 699.7, 4), (1500.0, 700.2, 4)]
    summary = log.summary()
    assert summary == {"samples": 3, "sm_clock_mhz": 1545.0, "power_w": 699.7, "power_capped": 2 / 3}
    args = (tmp_path / "args").read_text().split()
    assert f"--query-gpu={pl.QUERY}" in args and args[args.index("-lms") + 1] == "100"
    assert args[args.index("-i") + 1] == "1"


def test_no_nvidia_smi_gives_an_empty_log(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pl.power_log() as log:
        pass
    assert log.samples == [] and log.summary()["samples"] == 0
