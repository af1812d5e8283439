#!/usr/bin/env bash
# The test suite: installs what the tests need, then runs them (about 15 minutes on 2 quiet cores).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r requirements.txt
export OMP_NUM_THREADS=1
python -m pytest -q -p no:cacheprovider tests "$@"
