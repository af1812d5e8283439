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
# finished: fsdp-lr1e-3, nesterov seed 43 and lr 1e-3, outer LR 0.6, H=16 nesterov, int8 + EF and sparse
# with nesterov (P=2, tau=2), sparse with avg (the senders' mean). Next, most telling first:
"${BENCH[@]}" --only fl_fsdp-h8-p2-tau2-nesterov         # fragments alone, fp32, with nesterov
"${BENCH[@]}" --only fl_fsdp-h8-lr1e-3                   # avg at FSDP's better LR
"${BENCH[@]}" --only fl_fsdp-h8-p2-tau2-int8-ef-nesterov-lr1e-3
"${BENCH[@]}" --only fl_fsdp-h8-int8-ef-nesterov         # blocking int8
"${BENCH[@]}" --only fl_fsdp-h32-nesterov,fl_fsdp-h8-nesterov-olr0.4
# everything else of the suite (the density 1/16, sparse with nesterov at lr 1e-3, the rest)
"${BENCH[@]}"
