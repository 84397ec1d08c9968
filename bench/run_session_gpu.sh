#!/usr/bin/env bash
# One GPU call that runs several bench scripts, each under its own time limit, keeps going when
# one fails, and packs every output into $OUT/results.tgz (the device tool returns few files).
#   bash bench/run_session_gpu.sh "name:seconds:script args" ...
# e.g. bash bench/run_session_gpu.sh "gluon:170:bench/gluon_gpu.py {out} --quick"
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
work=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader > "$work/env.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$work/env.txt" 2>&1
date -u >> "$work/env.txt"
for spec in "$@"; do
  name=${spec%%:*}; rest=${spec#*:}; secs=${rest%%:*}; cmd=${rest#*:}
  mkdir -p "$work/$name"
  cmd=${cmd//\{out\}/$work/$name}
  t0=$(date +%s)
  timeout --signal=INT --kill-after=10 "$secs" python3 $cmd > "$work/$name/stdout.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" >> "$work/status.txt"
  tar czf "$OUT/results.tgz" -C "$work" .  # after every script: a run cut short keeps what it has
done
cat "$work/env.txt" "$work/status.txt"
for spec in "$@"; do
  name=${spec%%:*}
  echo "=================== $name (tail)"
  tail -n "${TAIL_LINES:-25}" "$work/$name/stdout.log" | cut -c1-220
done
