#!/usr/bin/env bash
# Multi-node launch of recipes/pretrain.py under SLURM: one `accelerate launch` per node.
#
#   sbatch --nodes 128 scripts/slurm_pretrain.sh recipes/configs/paper_fl_fsdp.yaml [extra recipe flags]
#
# Mapping of federation groups to nodes: fl_accel places groups on contiguous rank
# blocks (group f = ranks f*G .. f*G+G-1) and torchrun numbers ranks node by node, so
# with G = GPUs per node (paper FL+FSDP, G=4) each federation group is exactly one
# node: FSDP traffic stays on NVLink/PCIe, and only the sync every H steps crosses the
# inter-node network. With G = k * GPUs per node (paper FL+HSDP, G=32 = 8 nodes) a
# group spans k nodes; put S <= GPUs per node so HSDP shards stay inside a node.
#SBATCH --job-name=fl_accel
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --output=logs/%x-%j.out
set -euo pipefail
CONFIG=${1:?usage: sbatch --nodes N scripts/slurm_pretrain.sh RECIPE_CONFIG [flags]}
shift
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
NUM_PROCESSES=$((SLURM_NNODES * GPUS_PER_NODE))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export WANDB_MODE=${WANDB_MODE:-offline}
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}   # less fragmentation on long runs
export FL_ACCEL_COLLECTIVE_TIMEOUT_S=${FL_ACCEL_COLLECTIVE_TIMEOUT_S:-600}   # a dead rank ends the job instead of hanging it
mkdir -p logs
srun --kill-on-bad-exit=1 bash -c "accelerate launch \
  --config_file accelerate_configs/paper_128x4.yaml \
  --num_machines $SLURM_NNODES --num_processes $NUM_PROCESSES \
  --machine_rank \$SLURM_NODEID --main_process_ip $MASTER_ADDR --main_process_port $MASTER_PORT \
  recipes/pretrain.py --config $CONFIG $*"
