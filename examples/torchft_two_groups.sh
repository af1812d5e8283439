#!/usr/bin/env bash
# Two federation groups that fail alone (FLConfig.fault_tolerance="torchft"), on one machine.
#
#   bash examples/torchft_two_groups.sh                       # 2 groups x 2 ranks, 24 steps, H=4
#   bash examples/torchft_two_groups.sh --max_steps 48 --outer_optimizer nesterov
#
# python -m scripts.ft_launch starts a torchft Lighthouse on a free port, then one torchrun
# per federation group, each its own world with its own --master_port and the variables
# FL_ACCEL_FAULT_TOLERANCE=torchft, FL_ACCEL_GROUP_INDEX=f and TORCHFT_LIGHTHOUSE, which
# examples/train_loop.py reads through FLConfig.from_env. Every sync is a torchft quorum of
# the live groups. Arguments go to examples/train_loop.py.
#
# Settings (environment):
#   NPROC_PER_GROUP  ranks per group (default 2)
#   MIN_REPLICAS     groups a quorum needs (default 1: a live group syncs on alone while the other
#                    is down; the first sync still waits for both groups, and a group that reaches
#                    the end waits there for the other, FLConfig.rejoin_timeout_s; 2: every sync
#                    waits for both, and a group down for good stops the other)
#   MAX_RESTARTS     restarts per group by the launcher (default 1: a group whose rank dies, or
#                    whose torchrun is killed, restarts and heals from the live group at its
#                    first sync; python -m scripts.ft_launch --restart_group 1 --log_dir
#                    "$LOG_DIR" restarts group 1 on demand)
#   LOG_DIR          where lighthouse.log and group<f>.log go (default logs/torchft_two_groups,
#                    git-ignored)
#
# Each group's [train_loop] lines: its loss every --log_every steps; after a heal, "healed from
# group F" and then the healed state's loss (the loss of the step that healed was the old state's);
# at the end its result line, and a last line comparing the groups' parameter checksums.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
LOG_DIR=${LOG_DIR:-logs/torchft_two_groups}
status=0
python -m scripts.ft_launch --num_groups 2 --nproc_per_group "${NPROC_PER_GROUP:-2}" \
    --min_replicas "${MIN_REPLICAS:-1}" --max_restarts "${MAX_RESTARTS:-1}" --log_dir "$LOG_DIR" -- \
    examples/train_loop.py --num_groups 2 --sync_every 4 "$@" || status=$?
for f in 0 1; do
  echo "--- group $f ($LOG_DIR/group$f.log)"
  grep -h '^\[train_loop\]' "$LOG_DIR/group$f.log" || tail -n 20 "$LOG_DIR/group$f.log"
done
# the groups end identical: the same shard holds the same values in both (fp64 sums)
python - "$LOG_DIR" <<'PY' || true
import json, pathlib, sys
sums = {}
for f in (0, 1):
    lines = [ln for ln in pathlib.Path(sys.argv[1], f"group{f}.log").read_text().splitlines()
             if ln.startswith("[train_loop] result ")]
    if lines:
        sums[f] = {s["shard"]: s["checksum"] for s in json.loads(lines[-1].split(" ", 2)[2])["shards"]}
if len(sums) == 2:
    print(f"--- checksums by shard: group 0 {sums[0]}, group 1 {sums[1]}: "
          f"{'equal' if sums[0] == sums[1] else 'DIFFERENT'}")
PY
exit "$status"
