#!/usr/bin/env bash
# The test suite: installs what the tests need, then runs them (about 45 minutes on 2 cores; CI: 42 min
# before the torchft tests).
set -euo pipefail
cd "$(dirname "$0")/.."
# the virtual environment scripts/quickstart.sh created, unless another one is active
if [ -z "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ] && [ -x .venv/bin/python ]; then
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
python -m pip install -q -r requirements.txt
export OMP_NUM_THREADS=1
python -m pytest -q -p no:cacheprovider tests "$@"
