"""Where a call's GPU time goes: the device time of each kernel over warm calls (torch.profiler's
CUDA activity), per call, largest first. The measurement behind "which kernel of a training step
to work on"; the per-kernel times add up to the step's device time, not its wall time (host gaps
and launch latency are outside them).

    from streamkl_gpu.devtools.kernel_split import kernel_split, format_split
    rows = kernel_split(lambda: loss_fn().backward(), calls=3)
    print(format_split(rows))
"""
from __future__ import annotations

import collections

import torch


def kernel_split(fn, calls: int = 3, warm: int = 2) -> list[dict]:
    """Rows ``{"kernel", "launches", "us"}``: per call of ``fn`` (after ``warm`` unprofiled calls),
    each kernel's launches and device microseconds, largest first, then a ``"(all kernels)"`` row."""
    if calls < 1:
        raise ValueError(f"calls must be at least 1, got {calls}")
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    launches, us = collections.Counter(), collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:  # kernels, copies and fills on the GPU
            launches[ev.name] += 1
            us[ev.name] += ev.time_range.elapsed_us()
    rows = [{"kernel": name, "launches": launches[name] / calls, "us": us[name] / calls}
            for name, _ in us.most_common()]
    rows.append({"kernel": "(all kernels)", "launches": sum(launches.values()) / calls,
                 "us": sum(us.values()) / calls})
    return rows


def format_split(rows: list[dict], width: int = 60) -> str:
    """The rows as a table: microseconds, share of the total, launches per call, kernel name."""
    total = rows[-1]["us"] if rows else 0.0
    lines = [f"{'us/call':>10s} {'share':>6s} {'launches':>8s}  kernel"]
    for r in rows:
        share = r["us"] / total if total else float("nan")
        lines.append(f"{r['us']:10.1f} {share:6.1%} {r['launches']:8.1f}  {r['kernel'][:width]}")
    return "\n".join(lines)
