"""The GPU's SM clock, power draw and clock event reasons, sampled by ``nvidia-smi`` while a block runs.

Long calls (N = 1M tokens and more) can run at the board's power limit: the driver then lowers the
SM clock, and time follows energy rather than instructions issued (an H100 at 700 W ran the 2^31-
element training step at 1440-1800 MHz of 1980: bench/results/2026-12-07_h100_b840538/, its
gpu_power_*.csv). A timing of such a call is read with its clock beside it.

    from streamkl_gpu.devtools.power_log import power_log

    with power_log() as log:
        loss_fn().backward()
        torch.cuda.synchronize()
    print(log.summary())   # {"samples": ..., "sm_clock_mhz": median, "power_w": median, "power_capped": share}

Where ``nvidia-smi`` is not on PATH (a CPU machine) the log stays empty and ``summary()`` says so
with ``samples == 0``; nothing raises.
"""
from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess

QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"
POWER_CAP = 0x4  # clock event reason bit: software power cap (nvidia-smi -q -d PERFORMANCE)


class PowerLog:
    """Samples as ``(sm_clock_mhz, power_w, reasons)``; filled when the ``power_log`` block ends."""

    def __init__(self):
        self.samples: list[tuple[float, float, int]] = []

    def add_lines(self, text: str) -> None:
        """Parse ``nvidia-smi --format=csv,noheader,nounits`` lines of ``QUERY`` (others are skipped)."""
        for line in text.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 3:
                continue
            try:
                self.samples.append((float(parts[0]), float(parts[1]), int(parts[2], 16)))
            except ValueError:  # "[N/A]" and the like
                continue

    def summary(self) -> dict:
        """Medians of the SM clock and the power draw, and the share of samples at the power cap."""
        if not self.samples:
            return {"samples": 0, "sm_clock_mhz": None, "power_w": None, "power_capped": None}
        return {"samples": len(self.samples),
                "sm_clock_mhz": statistics.median(s[0] for s in self.samples),
                "power_w": statistics.median(s[1] for s in self.samples),
                "power_capped": sum(bool(s[2] & POWER_CAP) for s in self.samples) / len(self.samples)}


@contextlib.contextmanager
def power_log(interval_ms: int = 250, device: int = 0):
    """Sample GPU ``device`` every ``interval_ms`` while the block runs; yields the :class:`PowerLog`."""
    log = PowerLog()
    exe = shutil.which("nvidia-smi")
    proc = None
    if exe is not None:
        proc = subprocess.Popen([exe, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                 "-lms", str(int(interval_ms)), "-i", str(int(device))],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        yield log
    finally:
        if proc is not None:
            proc.terminate()
            try:
                out, _ = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            log.add_lines(out)
