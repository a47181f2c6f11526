#!/usr/bin/env bash
# The heterogeneous demo (`make demo`): train on scikit-learn's digits with two
# simulated vendor groups on this machine's CPUs. Group cpu0 gets a whole core,
# group cpu1 a third of one (a cgroup CPU quota set by kaitianrun), so cpu1 is
# really about 3x slower - no sleeps anywhere. Backend "kaitian", exact
# gradients for the unequal batches, online re-balancing on; rank 0 prints each
# group's batch and throughput per epoch and the final test accuracy, and
# kaitianrun --monitor writes a plot and a summary table at the end.
#
# Extra arguments go to the training script (e.g. --epochs 10, --no-rebalance).
set -euo pipefail
cd "$(dirname "$0")/.."

if command -v kaitianrun >/dev/null 2>&1; then
  KAITIANRUN=(kaitianrun)
else
  KAITIANRUN=("${PYTHON:-python3}" -m kaitian.launcher.cli)
fi
MONITOR_DIR=${MONITOR_DIR:-kaitian-monitor}

set -x
"${KAITIANRUN[@]}" --nproc-auto --cpu-slots 2 --cpu-groups 2 --cpu-quota 1,0.33 \
  --monitor "$MONITOR_DIR" \
  examples/train_digits.py --backend kaitian --epochs 20 --batch-size 64 "$@"
