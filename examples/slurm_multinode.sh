#!/usr/bin/env bash
# Your own training script on several SLURM nodes, one federation group per node: one torchrun
# per node (srun), joined through torchrun's c10d rendezvous on the first node.
#
#   sbatch --nodes 4 examples/slurm_multinode.sh                                # examples/trainer.py, F = 4 groups
#   sbatch --nodes 4 examples/slurm_multinode.sh examples/train_loop.py --sync_every 16
#   NUM_GROUPS=2 sbatch --nodes 4 examples/slurm_multinode.sh my_script.py      # groups of 2 nodes (FL+FSDP G=8)
#
# fl_accel places federation group f on ranks f*G .. f*G+G-1 and torchrun numbers ranks node by
# node, so with NUM_GROUPS = nodes (the default) each group is one node: FSDP2's traffic stays on
# the node's NVLink/PCIe and only the sync every H steps crosses the network. The script reads its
# FLConfig from FL_ACCEL_* variables (FLConfig.from_env(), FLTrainer/FLAccelerator without a config);
# set more of them here (FL_ACCEL_SYNC_EVERY, FL_ACCEL_OUTER_OPTIMIZER, ...). For the recipe use
# scripts/slurm_pretrain.sh. Through scripts.launch_guard a failed rank's one-line error ends each
# node's log. Check memory first: python -m scripts.memory_model --world-size $((NODES * 4)) --group-size 4
#SBATCH --job-name=fl_accel_own
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --output=logs/%x-%j.out
set -euo pipefail
SCRIPT=${1:-examples/trainer.py}
[ $# -gt 0 ] && shift
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${MASTER_PORT:-29500}
export FL_ACCEL_ALGORITHM=${FL_ACCEL_ALGORITHM:-fl_fsdp}
export FL_ACCEL_NUM_GROUPS=${NUM_GROUPS:-$SLURM_NNODES}
export FL_ACCEL_COLLECTIVE_TIMEOUT_S=${FL_ACCEL_COLLECTIVE_TIMEOUT_S:-600}   # a dead rank ends the job, never hangs it
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export WANDB_MODE=${WANDB_MODE:-offline}
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}   # less fragmentation on long runs
mkdir -p logs
echo "[slurm] $SLURM_NNODES nodes x $GPUS_PER_NODE GPUs, $FL_ACCEL_NUM_GROUPS federation groups, rendezvous $HEAD:$PORT"
srun --kill-on-bad-exit=1 python -m scripts.launch_guard torchrun \
  --nnodes "$SLURM_NNODES" --nproc_per_node "$GPUS_PER_NODE" \
  --rdzv_backend c10d --rdzv_endpoint "$HEAD:$PORT" --rdzv_id "${SLURM_JOB_ID:-fl_accel}" \
  "$SCRIPT" "$@"
