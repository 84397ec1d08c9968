"""Long-format CSV of the figures that matter from `ncu --page details --print-details all` text.

    python bench/profile/ncu_summary.py OUT.csv CASE=DETAILS.txt [CASE=DETAILS.txt ...] [--trim DIR]

One row per (case, kernel, metric): duration, pipe activity (tensor, MUFU = XU, FMA, ALU), issue
slots, L2 / DRAM throughput, registers, shared memory, occupancy and every warp-stall reason
(cycles per issued instruction). Only kernels named like ours (a leading underscore: the Triton
and Gluon kernels); PyTorch's small elementwise kernels are left out. ``--trim DIR`` also writes
each details file cut to those kernels' sections.
"""
import csv
import re
import sys

METRICS = {
    "Duration": "duration", "SM: Pipe Tensor Cycles Active": "tensor_pipe_pct",
    "SM: Inst Executed Pipe Xu": "mufu_xu_pct", "SM: Pipe Fma Cycles Active": "fma_pipe_pct",
    "SM: Pipe Alu Cycles Active": "alu_pipe_pct", "Issue Slots Busy": "issue_slots_pct",
    "L2 Cache Throughput": "l2_pct", "DRAM Throughput": "dram_pct", "Registers Per Thread": "registers",
    "Dynamic Shared Memory Per Block": "dyn_smem", "Achieved Occupancy": "achieved_occupancy_pct",
    "Warp Cycles Per Issued Instruction": "cycles_per_issue",
}
HEADER = re.compile(r"^  (\S.*?) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\)")
VALUE = re.compile(r"^    (.+?)\s{2,}(\S+(?:/\S+)?)?\s+([-0-9.,]+)\s*$")


def sections(text):
    """(kernel name, grid, block, lines) per kernel section."""
    cur = None
    for line in text.splitlines():
        m = HEADER.match(line)
        if m:
            if cur:
                yield cur
            cur = (m.group(1), "x".join(m.group(i) for i in (2, 3, 4)), "x".join(m.group(i) for i in (5, 6, 7)), [line])
        elif cur:
            cur[3].append(line)
    if cur:
        yield cur


def rows(case, text):
    for name, grid, block, lines in sections(text):
        if not name.startswith("_"):
            continue
        seen = set()
        for line in lines:
            m = VALUE.match(line)
            if not m:
                continue
            label, unit, value = m.group(1).strip(), (m.group(2) or "").strip(), m.group(3).replace(",", "")
            metric = METRICS.get(label)
            if metric is None and label.startswith("Stall "):
                metric = "stall_" + label[6:].lower().replace(" ", "_")
                unit = "cycles/issue"
            if metric is None or metric in seen:
                continue
            seen.add(metric)
            yield dict(case=case, kernel=name, grid=grid, block=block, metric=metric, value=value, unit=unit)


def main(argv):
    out, trim = argv[0], None
    args = argv[1:]
    if "--trim" in args:
        i = args.index("--trim")
        trim = args[i + 1]
        args = args[:i] + args[i + 2:]
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, ["case", "kernel", "grid", "block", "metric", "value", "unit"])
        w.writeheader()
        for spec in args:
            case, path = spec.split("=", 1)
            text = open(path).read()
            for r in rows(case, text):
                w.writerow(r)
            if trim:
                keep = [ln for name, _, _, lines in sections(text) if name.startswith("_") for ln in lines]
                with open(f"{trim}/{case}.txt", "w") as g:
                    g.write("\n".join(keep) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
