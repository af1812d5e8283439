#!/usr/bin/env bash
# The test suite: installs what the tests need, then runs them in parallel workers (docs/testing.md).
# CPU seconds on a shared VM depend on its host's load: compare figures from one sitting only.
# FL_ACCEL_TEST_CPU=30 lists the tests using the most CPU seconds. Arguments go to pytest: `bash scripts/test.sh -m unit`
# runs one tier (tests/unit, dist, recipe, ft, tools, gpu: tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
# the virtual environment scripts/quickstart.sh created, unless another one is active
if [ -z "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ] && [ -x .venv/bin/python ]; then
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
python -m pip install -q -r requirements.txt
export OMP_NUM_THREADS=1
# the machine's load now, as scripts/quickstart.sh checks it (python -m scripts.busy): a warning when other
# processes keep more than 5% of the CPUs busy; the expected time assumes idle cores
python -m scripts.busy --prefix "[test] " --job "the test suite" \
  --expect "roughly 7 to 15 minutes on 2 CPU cores (one tier, e.g. -m unit, less)"
# parallel workers (pytest-xdist): one per core, 2 to 8. Most tests wait on the processes they
# launch, but those processes are busy: on 2 cores, 4 workers took as long as 2 and more CPU
# seconds (processes competing for the cores). Tests that share one launch stay on one worker
# (tests/conftest.py). FL_ACCEL_TEST_WORKERS=0 runs the tests serially.
cores="$(nproc 2>/dev/null || echo 2)"
workers="${FL_ACCEL_TEST_WORKERS:-$(( cores < 2 ? 2 : (cores > 8 ? 8 : cores) ))}"
if [ "$workers" = 0 ]; then
  python -m pytest -q -p no:cacheprovider tests "$@"
else
  # -p no:benchmark: pytest-benchmark, where installed, only warns that xdist disables it (no test uses it)
  python -m pytest -q -p no:cacheprovider -p no:benchmark -n "$workers" --dist loadgroup tests "$@"
fi
