#!/usr/bin/env bash
# The GPU check of issue 17 (item 9), one command for a machine with at least one CUDA GPU:
# the CUDA-gated tests, then Llama-3.2-1B-shaped training runs in bf16 with activation
# checkpointing off/on and compile off/on, recording tokens/s, MFU, peak_accelerator_mb and the
# memory model's prediction in bench/results/<date>-gpu/ (gpu_check.json, table.md).
# Under 8 minutes on one H100/H200. Without a GPU: one line on stderr, exit status 2.
# Options are passed on: bash bench/gpu_check.sh --steps 30 --skip-tests   (see bench/gpu_check.py)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "${PYTHON:-python}" -m bench.gpu_check "$@"
