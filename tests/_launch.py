"""The tests' launch names, as thin wrappers over :mod:`scripts.launch`.

Every launch uses ``sys.executable -m torch.distributed.run`` (the interpreter that
runs pytest), a fresh free ``--master_port`` (retried once if another suite took it),
``OMP_NUM_THREADS=1``, the repository root on ``PYTHONPATH`` and a wall-clock timeout,
after which the whole process tree is killed, so a hang fails the test instead of
blocking the suite.
"""

from __future__ import annotations

import json
from pathlib import Path

from scripts import launch as _launch
from scripts.launch import free_port  # noqa: F401  (re-exported for the tests)

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"

Launch = _launch.Result
"""Outcome of a launch: ``returncode`` (None on timeout), ``stdout``, ``stderr``,
``seconds``, ``timed_out`` and ``tail()`` for assertion messages."""


def launch_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a launch: ours, minus FL_ACCEL_* (a caller's settings must
    not leak into the tests), plus single-threaded BLAS/OpenMP, the repo on
    PYTHONPATH, offline Hugging Face libraries and a short collective timeout."""
    return _launch.child_env({"FL_ACCEL_COLLECTIVE_TIMEOUT_S": "120", **(extra or {})}, pythonpath=[str(REPO_ROOT)])


def torchrun_cmd(nproc: int, script: Path | str, *args: str, port: int | None = None) -> list[str]:
    """``python -m torch.distributed.run --nproc_per_node N --master_port P script args``."""
    return _launch.torchrun_argv(nproc, script, *args, port=port)


def run_torchrun(nproc: int, script: Path | str, *args: str, timeout: float,
                 env: dict[str, str] | None = None) -> Launch:
    """Run torchrun to completion or until ``timeout`` seconds, then kill its process group."""
    return _launch.run_torchrun(nproc, script, *args, timeout=timeout, env=launch_env(env), cwd=REPO_ROOT)


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj, indent=1))
    return path
