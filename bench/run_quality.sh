#!/usr/bin/env bash
# The decisive convergence grid of issue 28, in priority order, at low CPU priority on a
# shared machine. Resumable: run the same command again (same NAME) and it continues where
# it stopped (finished runs are skipped, the others resume from their last checkpoint).
#
#   NAME=2026-12-03-grid nohup bench/run_quality.sh > bench/work/quality.log 2>&1 &
#
# The rows and the decision rules are in bench/plan.py (CONVERGENCE_ROWS, GRID_RULES).
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
NAME=${NAME:-$(date +%F)-grid}
# time to target per link reads the measured tokens/s of these committed throughput results
SOURCES=${SOURCES:-2026-12-01-baselines,2026-12-01-streaming}
BENCH=(nice -n 15 python -m bench.run_bench --report-to none --suite convergence --name "$NAME"
       --throughput-sources "$SOURCES")
# 1. is nesterov below FSDP real or an LR effect; a second nesterov seed; the outer LR
"${BENCH[@]}" --only fsdp-lr1e-3
"${BENCH[@]}" --only fl_fsdp-h8-nesterov-seed43
"${BENCH[@]}" --only fl_fsdp-h8-nesterov-lr1e-3
"${BENCH[@]}" --only fl_fsdp-h8-nesterov-olr0.6
# 2. fewer syncs with the outer momentum; fragments alone
"${BENCH[@]}" --only fl_fsdp-h16-nesterov,fl_fsdp-h32-nesterov,fl_fsdp-h8-p2-tau2-nesterov
# 3. everything else of the suite (compressed rows with nesterov, sparse, the rest)
"${BENCH[@]}"
