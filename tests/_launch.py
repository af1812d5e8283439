"""Helpers to launch real multi-process gloo runs with torchrun from the tests.

Every launch uses ``sys.executable -m torch.distributed.run`` (the interpreter that
runs pytest), a fresh free ``--master_port``, ``OMP_NUM_THREADS=1``, the repository
root on ``PYTHONPATH`` and a wall-clock timeout, after which the whole process tree
is killed, so a hang fails the test instead of blocking the suite.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a launch: ours, minus FL_ACCEL_* (a caller's settings must
    not leak into the tests), plus single-threaded BLAS/OpenMP, the repo on
    PYTHONPATH, offline Hugging Face libraries and a short collective timeout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FL_ACCEL_")}
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        FL_TIMEOUT_S="120",  # a dead peer makes collectives fail, not hang
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
    )
    env.update(extra or {})
    return env


def torchrun_cmd(nproc: int, script: Path | str, *args: str, port: int | None = None) -> list[str]:
    """``python -m torch.distributed.run --nproc_per_node N --master_port P script args``."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1",
        "--master_port", str(port if port is not None else free_port()),
        str(script), *map(str, args),
    ]


@dataclass
class Launch:
    returncode: int | None
    """Exit status of torchrun; None when the timeout killed it."""
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool

    def tail(self, n: int = 6000) -> str:
        """The end of the combined output, for assertion messages."""
        return f"rc={self.returncode} timed_out={self.timed_out} after {self.seconds:.1f}s\n" \
               f"--- stdout ---\n{self.stdout[-n:]}\n--- stderr ---\n{self.stderr[-n:]}"


def run_torchrun(nproc: int, script: Path | str, *args: str, timeout: float,
                 env: dict[str, str] | None = None) -> Launch:
    """Run torchrun to completion or until ``timeout`` seconds, then kill its process group."""
    cmd = torchrun_cmd(nproc, script, *args)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=launch_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the workers it started
        out, err = proc.communicate()
        timed_out = True
    return Launch(None if timed_out else proc.returncode, out, err, time.monotonic() - t0, timed_out)


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj, indent=1))
    return path
