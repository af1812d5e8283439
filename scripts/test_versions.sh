#!/usr/bin/env bash
# The tested range's ends: the unit tier and the core gloo tests (sync, FSDP, checkpoints, the
# accelerator's API, the drop-in) on the oldest and the newest torch/accelerate pair that
# pyproject.toml accepts, each in its own virtual environment (what `.ci/run` runs after the
# default suite). The default pair (requirements.txt) is what `bash scripts/test.sh` tests.
#
#   bash scripts/test_versions.sh                 # both pairs
#   bash scripts/test_versions.sh 2.15.0:1.16.0   # one pair (torch:accelerate)
#
# Environments are kept in $FL_ACCEL_VENV_CACHE (default ~/.cache/fl_accel/venvs), one folder per
# pair, and reused while their torch and accelerate are the pair's (a flock guards a build, so two
# runs at once do not collide). torch from PyPI is a CUDA build of about 3 GB per environment: the
# first build takes minutes; this machine's pip constraint file (torch<=2.14.1) is lifted for that
# install only (PIP_CONSTRAINT=/dev/null).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -gt 0 ]; then PAIRS=("$@"); else PAIRS=(2.12.1:1.14.0 2.15.0:1.16.0); fi
CACHE="${FL_ACCEL_VENV_CACHE:-$HOME/.cache/fl_accel/venvs}"
CORE=(tests/unit tests/dist/test_sync_gloo.py tests/dist/test_fsdp.py tests/dist/test_checkpoint_gloo.py
      tests/dist/test_accelerator_api.py tests/dist/test_drop_in.py)
mkdir -p "$CACHE"
status=0
for pair in "${PAIRS[@]}"; do
  torch_v="${pair%%:*}"; accel_v="${pair##*:}"
  venv="$CACHE/torch$torch_v-accelerate$accel_v"
  echo "[test_versions] torch $torch_v, accelerate $accel_v: $venv"
  (
    flock 9
    if ! "$venv/bin/python" - "$torch_v" "$accel_v" 2>/dev/null <<'EOF'
import sys
from importlib.metadata import version
assert version("torch").split("+")[0] == sys.argv[1] and version("accelerate") == sys.argv[2]
import transformers, datasets, pytest, xdist  # noqa: F401,E401  the tests' stack is there
EOF
    then
      echo "[test_versions] building $venv (a CUDA torch from PyPI: minutes)"
      rm -rf "$venv"
      python -m venv "$venv"
      PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q "torch==$torch_v" "accelerate==$accel_v" \
        -e ".[recipe,test]"
    fi
    # this checkout's fl_accel (the cached environment may have been built from another folder)
    PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q --no-deps -e .
  ) 9>"$venv.lock"
  cores="$(nproc 2>/dev/null || echo 2)"
  workers=$(( cores < 2 ? 2 : (cores > 8 ? 8 : cores) ))
  if ! OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider -p no:benchmark -n "$workers" \
      --dist loadgroup "${CORE[@]}"; then
    echo "[test_versions] FAILED on torch $torch_v, accelerate $accel_v"
    status=1
  fi
done
exit $status
