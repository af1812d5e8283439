#!/usr/bin/env bash
# The main job, end to end, on a fresh machine: install, then train FL+FSDP and the FSDP
# baseline (4 CPU processes, tiny Llama, embedded Shakespeare corpus, same everything
# else), then print the side-by-side table and where the results and W&B runs are.
# The two runs take 2 to 5 minutes on 2 idle CPU cores (longer on a loaded machine), the first
# install several more. Extra arguments go to both recipe runs.
#
# Where it installs: into the active virtual environment (VIRTUAL_ENV or CONDA_PREFIX set), else
# into ./.venv, which it creates once (scripts/test.sh then uses it too). QUICKSTART_VENV=none
# installs into whatever Python is active instead; QUICKSTART_DRY_RUN=1 only says which.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ]; then
  where="the active environment ${VIRTUAL_ENV:-${CONDA_PREFIX:-}}"
elif [ "${QUICKSTART_VENV:-.venv}" = none ]; then
  where="the active Python $(command -v python) (QUICKSTART_VENV=none)"
else
  where="./.venv"
fi
echo "[quickstart] installing into $where"
if [ "${QUICKSTART_DRY_RUN:-0}" = 1 ]; then
  exit 0
fi
if [ "$where" = "./.venv" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
python -m pip install -q -r requirements.txt
export OMP_NUM_THREADS=1
export WANDB_MODE=${WANDB_MODE:-offline}
# On GPUs: fewer out-of-memory failures from fragmentation (PyTorch's caching allocator); no effect on CPU.
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}
# the machine's load now (python -m scripts.busy): a warning when other processes keep more than 5% of the
# CPUs busy, as scripts.compare flags each run afterwards
python -m scripts.busy --prefix "[quickstart] " --job "the two runs" --expect "2 to 5 minutes on 2 CPU cores"
EXP=${EXP:-quickstart-$(date +%Y%m%d-%H%M%S)}
# accelerate launch through scripts.launch_guard: a bad input ends with the recipe's one-line error,
# not with torchrun's failure summary (python -m scripts.launch_guard -h). The FSDP baseline first:
# its tokens/s is then the FL+FSDP run's --baseline_tokens_per_s (perf/speedup_vs_baseline on W&B).
baseline=()
for algorithm in fsdp fl_fsdp; do
  python -m scripts.launch_guard accelerate launch --config_file accelerate_configs/cpu_4proc.yaml recipes/pretrain.py \
    --config recipes/configs/cpu_fl_fsdp.yaml --algorithm "$algorithm" --experiment "$EXP" ${baseline[@]+"${baseline[@]}"} "$@"
  if [ "$algorithm" = fsdp ] && tps="$(python -m scripts.compare "outputs/$EXP" --tokens-per-s fsdp 2>/dev/null)"; then
    baseline=(--baseline_tokens_per_s "$tps")
  fi
done
# compare.py prints the table and a verdict computed from the two runs' figures (throughput
# ratio with its caveats, perplexity, bytes per step, background CPU load).
python -m scripts.compare "outputs/$EXP"
echo "On one machine every link is loopback; for FL+FSDP on slow inter-node links see bench/README.md."
