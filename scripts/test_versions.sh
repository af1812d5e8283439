#!/usr/bin/env bash
# The tested range's ends: the unit tier and the core gloo tests (sync, FSDP, checkpoints, the
# accelerator's API, the drop-in) on the oldest and the newest torch/accelerate pair that
# pyproject.toml accepts, and the fault-tolerant mode's tests (tests/ft, and the compat checks of
# torchft's internals) on the torchft build with 0.3's API (torchft-nightly), each in its own
# virtual environment (what `.ci/run` runs after the default suite). The default pair and
# torchft 0.2.0 (requirements.txt) are what `bash scripts/test.sh` tests.
#
#   bash scripts/test_versions.sh                               # both pairs and the torchft build
#   bash scripts/test_versions.sh 2.15.0:1.16.0                 # one pair (torch:accelerate)
#   bash scripts/test_versions.sh torchft-nightly==2026.10.26   # one torchft build (default torch/accelerate)
#
# Environments are kept in $FL_ACCEL_VENV_CACHE (default ~/.cache/fl_accel/venvs), one folder per
# pair or build, and reused while their versions are the ones asked for (a flock guards a build, so
# two runs at once do not collide). torch from PyPI is a CUDA build of about 3 GB per environment: the
# first build takes minutes; this machine's pip constraint file (torch<=2.14.1) is lifted for that
# install only (PIP_CONSTRAINT=/dev/null). The torchft build's environment takes requirements.txt's
# torch (a CPU wheel here) and the recipe's stack, without torchft 0.2.0 (both install `torchft`).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -gt 0 ]; then PAIRS=("$@"); else PAIRS=(2.12.1:1.14.0 2.15.0:1.16.0 torchft-nightly==2026.10.26); fi
CACHE="${FL_ACCEL_VENV_CACHE:-$HOME/.cache/fl_accel/venvs}"
CORE=(tests/unit tests/dist/test_sync_gloo.py tests/dist/test_fsdp.py tests/dist/test_checkpoint_gloo.py
      tests/dist/test_accelerator_api.py tests/dist/test_drop_in.py)
FT=(tests/ft tests/unit/test_compat.py)
DEFAULT_TORCH="$(sed -n 's/^torch==//p' requirements.txt)"
DEFAULT_ACCELERATE="$(sed -n 's/^accelerate==//p' requirements.txt)"
mkdir -p "$CACHE"
status=0
for pair in "${PAIRS[@]}"; do
  if [[ "$pair" == *"=="* ]]; then  # a torchft build: distribution==version
    ft_dist="${pair%%==*}"; ft_v="${pair##*==}"; torch_v="$DEFAULT_TORCH"; accel_v="$DEFAULT_ACCELERATE"
    venv="$CACHE/torch$torch_v-accelerate$accel_v-$ft_dist$ft_v"
    tests=("${FT[@]}")
  else
    ft_dist=""; ft_v=""; torch_v="${pair%%:*}"; accel_v="${pair##*:}"
    venv="$CACHE/torch$torch_v-accelerate$accel_v"
    tests=("${CORE[@]}")
  fi
  echo "[test_versions] torch $torch_v, accelerate $accel_v${ft_dist:+, $ft_dist $ft_v}: $venv"
  (
    flock 9
    if ! "$venv/bin/python" - "$torch_v" "$accel_v" "$ft_dist" "$ft_v" 2>/dev/null <<'EOF'
import sys
from importlib.metadata import version
assert version("torch").split("+")[0] == sys.argv[1] and version("accelerate") == sys.argv[2]
assert not sys.argv[3] or version(sys.argv[3]) == sys.argv[4]
import transformers, datasets, pytest, xdist  # noqa: F401,E401  the tests' stack is there
EOF
    then
      echo "[test_versions] building $venv (minutes)"
      rm -rf "$venv"
      python -m venv "$venv"
      if [ -n "$ft_dist" ]; then
        "$venv/bin/python" -m pip install -q "torch==$torch_v" "accelerate==$accel_v" "$ft_dist==$ft_v" \
          "pytest>=8,<9.2" "pytest-xdist>=3.8" -e ".[recipe]"
      else
        PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q "torch==$torch_v" "accelerate==$accel_v" \
          -e ".[recipe,test]"
      fi
    fi
    # this checkout's fl_accel (the cached environment may have been built from another folder)
    PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q --no-deps -e .
  ) 9>"$venv.lock"
  cores="$(nproc 2>/dev/null || echo 2)"
  workers=$(( cores < 2 ? 2 : (cores > 8 ? 8 : cores) ))
  # PATH: torchrun and the Lighthouse of this environment (scripts/ft_launch.py starts the installed torchft's)
  if ! PATH="$venv/bin:$PATH" OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider -p no:benchmark \
      -n "$workers" --dist loadgroup "${tests[@]}"; then
    echo "[test_versions] FAILED on torch $torch_v, accelerate $accel_v${ft_dist:+, $ft_dist $ft_v}"
    status=1
  fi
done
exit $status
