#!/usr/bin/env bash
# The main job, end to end, on a fresh machine: install, then train FL+FSDP and the FSDP
# baseline (4 CPU processes, tiny Llama, embedded Shakespeare corpus, same everything
# else), then print the side-by-side table and where the results and W&B runs are.
# About 2 minutes on 2 quiet CPU cores (measured from a fresh clone). Extra arguments go to both recipe runs.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r requirements.txt
export OMP_NUM_THREADS=1
export WANDB_MODE=${WANDB_MODE:-offline}
EXP=${EXP:-quickstart-$(date +%Y%m%d-%H%M%S)}
for algorithm in fl_fsdp fsdp; do
  accelerate launch --config_file accelerate_configs/cpu_4proc.yaml recipes/pretrain.py \
    --config recipes/configs/cpu_fl_fsdp.yaml --algorithm "$algorithm" --experiment "$EXP" "$@"
done
# compare.py prints the table and a verdict computed from the two runs' figures (throughput
# ratio, perplexity, bytes per step, background CPU load).
python -m scripts.compare "outputs/$EXP"
echo "On one machine every link is loopback; for FL+FSDP on slow inter-node links see bench/README.md."
