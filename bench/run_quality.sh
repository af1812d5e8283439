#!/usr/bin/env bash
# The two quality suites of issue 21, in priority order, at low CPU priority on a shared
# machine. Resumable: run the same command again (same DATE) and it continues where it
# stopped (finished runs are skipped, the others resume from their last checkpoint).
#
#   DATE=2026-12-01 nohup bench/run_quality.sh > bench/work/quality.log 2>&1 &
#
# 1. the paper regime's two main rows (FSDP over 8 ranks, FL+FSDP 8 groups of 1);
# 2. the convergence rows that carry most (FSDP, blocking fp32, int8 + error feedback, and
#    FSDP's second seed: a first seed band);
# 3. the rest of the paper regime (F=4 x G=2, second seeds; about an hour);
# 4. the rest of the convergence suite.
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
DATE=${DATE:-$(date +%F)}
BENCH=(nice -n 15 python -m bench.run_bench --report-to none)
"${BENCH[@]}" --suite paper-regime --name "$DATE-paper-regime" --only fsdp-8p,fl_fsdp-f8g1
"${BENCH[@]}" --suite convergence --name "$DATE-convergence" --only fsdp,fl_fsdp-h8,fl_fsdp-h8-p2-tau2-int8-ef,fsdp-seed43
"${BENCH[@]}" --suite paper-regime --name "$DATE-paper-regime"
"${BENCH[@]}" --suite convergence --name "$DATE-convergence"
