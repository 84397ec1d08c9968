#!/usr/bin/env bash
# Nsight Compute on the warm target calls of bench/profile/ncu_targets.py: sections (speed of light,
# pipe utilisation, warp stalls, scheduler, memory) and a few named pipe metrics, as text.
#   bash bench/profile/ncu_run.sh OUTDIR CASE [CASE ...]    (from the repository root)
set -u
out=$1; shift
mkdir -p "$out"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"; "$NCU" --version | tail -1
for case in "$@"; do
  "$NCU" --clock-control none --profile-from-start off \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
    --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats -f -o "$out/$case" env PYTHONPATH=. python3 bench/profile/ncu_targets.py "$case" > "$out/$case.run.log" 2>&1
  echo "$case sections rc=$?"
  "$NCU" --import "$out/$case.ncu-rep" --page details --print-details all > "$out/$case.details.txt" 2>&1
  "$NCU" --import "$out/$case.ncu-rep" --page raw --csv --metrics \
sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__issue_active.avg.pct_of_peak_sustained_active,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes.sum.per_second,gpu__time_duration.sum \
    > "$out/$case.metrics.csv" 2>&1
  grep -E "^  [A-Za-z].*\(|Duration|Throughput|Pipe|Issue|Stall|Registers|Theoretical Occupancy|Achieved Occupancy|L2 |DRAM " "$out/$case.details.txt" | head -80
done
