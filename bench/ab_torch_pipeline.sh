#!/usr/bin/env bash
# Before / after in one run for bench/torch_pipeline.py, whose figures are fastpe/SDPA ratios
# measured in one process (bench/ab_processes.py compares times, which drift between processes
# on a shared machine): one round of the default setting per checkout, alternating.
#
#   bench/ab_torch_pipeline.sh BEFORE_PYTHON:BEFORE_TREE AFTER_PYTHON:AFTER_TREE ROUNDS [DTYPE [ARGS…]]
#
# Each PYTHON's editable install maps fastpe to its TREE; the script runs from each TREE (copy
# this checkout's torch_pipeline.py into an older TREE that lacks its options).
set -euo pipefail
before=$1 after=$2 rounds=$3 dtype=${4:-float32}
shift $(( $# < 4 ? $# : 4 ))  # the rest: more arguments of torch_pipeline.py (--backward)
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
for i in $(seq 1 "$rounds"); do
  for side in before after; do
    spec=${!side}
    (cd "${spec#*:}" && "${spec%%:*}" bench/torch_pipeline.py --settings default --rounds 1 \
      --dtype "$dtype" "$@") | grep "\[round" | sed "s/^\[round 1\]/[round $i] $side/"
  done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
