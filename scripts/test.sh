#!/usr/bin/env bash
# The test suite: installs what the tests need, then runs them in parallel workers. Measured from a fresh
# clone on 2 otherwise idle cores (FL_ACCEL_TEST_CPU=30 /usr/bin/time -v bash .ci/run, 2026-12-02): 14 min 35 s
# wall, 553 passed, 6 skipped, 1,549 CPU-s summed per test (863 CPU-s user+system by /usr/bin/time, fork
# servers not counted). The same tree (main 5f012b7 from git archive) at 08:45 UTC that day, 98% of the 2 cores:
# 8 min 24 s in pytest, 897 CPU-s summed per test: CPU seconds on this shared VM depend on its host's load.
# Branch suite4 (forked torchft recipe groups, ...) at 09:00 UTC, 95% of the 2 cores: 7 min 16 s, 769 CPU-s.
# FL_ACCEL_TEST_CPU=30 lists the tests using the most CPU seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
# the virtual environment scripts/quickstart.sh created, unless another one is active
if [ -z "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ] && [ -x .venv/bin/python ]; then
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
python -m pip install -q -r requirements.txt
export OMP_NUM_THREADS=1
# parallel workers (pytest-xdist): most tests wait on their launched processes, so more workers than
# cores keep the cores busy; tests that share one launch stay on one worker (tests/conftest.py).
# FL_ACCEL_TEST_WORKERS=0 runs the tests serially.
workers="${FL_ACCEL_TEST_WORKERS:-4}"
if [ "$workers" = 0 ]; then
  python -m pytest -q -p no:cacheprovider tests "$@"
else
  # -p no:benchmark: pytest-benchmark, where installed, only warns that xdist disables it (no test uses it)
  python -m pytest -q -p no:cacheprovider -p no:benchmark -n "$workers" --dist loadgroup tests "$@"
fi
