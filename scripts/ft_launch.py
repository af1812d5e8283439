"""Launch a fault-tolerant federation on one machine: a torchft Lighthouse and F group launches.

With ``FLConfig(fault_tolerance="torchft")`` every federation group is its own
``torchrun`` world of G ranks; a torchft Lighthouse decides which groups take part in
each sync (:mod:`fl_accel.ft`). This script starts the Lighthouse
(``torchft_lighthouse``, torchft 0.2.0) on a free port, then one torchrun per group,
each with its own free ``--master_port``, ``FL_ACCEL_FAULT_TOLERANCE=torchft``,
``FL_ACCEL_GROUP_INDEX=f``, ``TORCHFT_LIGHTHOUSE`` and ``OMP_NUM_THREADS=1``, and waits
for the groups (the Lighthouse is stopped at the end)::

    python -m scripts.ft_launch --num_groups 2 --nproc_per_group 2 -- \\
        recipes/pretrain.py --config recipes/configs/cpu_fl_fsdp.yaml --max_steps 40

Each group's output goes to ``--log_dir/group<f>.log`` (default: this terminal, with a
``[group f]`` prefix nowhere: the streams interleave). A group that exits non-zero does
not stop the others: that is the point of the mode. The exit status is the first
non-zero group status.

On a cluster the same pattern is one Lighthouse job step and one job (or step) per
group; see docs/fault_tolerance.md (examples/torchft_two_groups.sh runs this script).

The functions are used by tests/ft/test_ft.py and the benchmark: :func:`start_lighthouse`,
:func:`group_env`, :func:`start_group`, :func:`kill_group`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import IO, Mapping, Sequence

from scripts.launch import child_env, free_port, start, terminate, torchrun_argv, wait

LIGHTHOUSE_DEFAULTS = {"min_replicas": 1, "quorum_tick_ms": 100, "join_timeout_ms": 2000,
                       "heartbeat_timeout_ms": 3000}
"""Lighthouse options for one machine: a group that stops heartbeating for 3 s is left out
of the next quorum; stragglers are awaited 2 s (torchft's defaults: 60 s and 5 s)."""


def lighthouse_argv(port: int, host: str = "127.0.0.1", **options) -> list[str]:
    """The ``torchft_lighthouse`` command (the entry point installed next to this Python,
    run by this Python) bound to ``host:port``, with :data:`LIGHTHOUSE_DEFAULTS` updated
    by ``options`` (``min_replicas=2`` makes every quorum wait for two groups).

    Raises:
        FileNotFoundError: torchft (its ``torchft_lighthouse`` entry point) is not installed.
    """
    script = Path(sys.executable).parent / "torchft_lighthouse"
    if not script.exists():
        found = shutil.which("torchft_lighthouse")
        if found is None:
            raise FileNotFoundError("torchft_lighthouse not found: pip install torchft==0.2.0")
        return [found, "--bind", f"{host}:{port}"] + _flags(options)
    return [sys.executable, str(script), "--bind", f"{host}:{port}"] + _flags(options)


def _flags(options: Mapping) -> list[str]:
    merged = {**LIGHTHOUSE_DEFAULTS, **options}
    return [x for k, v in merged.items() for x in (f"--{k}", str(v))]


def start_lighthouse(*, port: int | None = None, host: str = "127.0.0.1", log: IO | None = None,
                     **options):
    """Start a Lighthouse; returns ``(Popen, address)`` with address ``http://host:port``
    once it accepts connections (at most 120 s: a loaded machine; RuntimeError if it exits
    or never listens)."""
    import socket

    port = port or free_port(host)
    proc = start(lighthouse_argv(port, host, **options), env=child_env(), stdout=log, stderr=log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"torchft_lighthouse exited with status {proc.returncode}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return proc, f"http://{host}:{port}"
        except OSError:
            time.sleep(0.1)
    terminate(proc)
    raise RuntimeError(f"torchft_lighthouse did not listen on {host}:{port} within 120 s")


def group_env(group_index: int, lighthouse: str, extra: Mapping[str, str] | None = None,
              pythonpath: Sequence[str] = ()) -> dict[str, str]:
    """The environment of group ``group_index``'s launch: :func:`scripts.launch.child_env`
    (single-threaded, offline; the caller's ``FL_ACCEL_*`` dropped) plus the fault-tolerant
    mode, the group index and the Lighthouse, then ``extra``."""
    return child_env({"FL_ACCEL_FAULT_TOLERANCE": "torchft", "FL_ACCEL_GROUP_INDEX": str(group_index),
                      "TORCHFT_LIGHTHOUSE": lighthouse, **(extra or {})}, pythonpath=pythonpath)


def start_group(group_index: int, nproc: int, script: str | os.PathLike, *args, lighthouse: str,
                env: Mapping[str, str] | None = None, cwd=None, stdout=None, stderr=None,
                pythonpath: Sequence[str] = (), max_restarts: int = 0):
    """Start group ``group_index`` as ``torchrun --nproc_per_node nproc script args`` on a
    fresh ``--master_port`` (its own store and world) in its own session, so that
    ``os.killpg(proc.pid, SIGKILL)`` ends every process of the group. ``max_restarts``:
    torchrun's ``--max-restarts`` (a failed attempt restarts the group's ranks, which
    resume with ``--resume_from_checkpoint latest`` or heal from live groups). Returns the Popen."""
    argv = torchrun_argv(nproc, script, *args, port=free_port(), extra_flags=["--max-restarts", str(max_restarts)])
    return start(argv, env=group_env(group_index, lighthouse, env, pythonpath), cwd=cwd, stdout=stdout,
                 stderr=stderr)


def kill_group(proc, sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` (default SIGKILL, i.e. ``kill -9``) to a group launch and every process
    below it, then reap the launcher. torchrun starts each worker in a session of its own
    (torch 2.13 ``elastic/multiprocessing/subprocess_handler``), so signalling the
    launcher's process group alone would leave the workers running. Returns the pids
    signalled."""
    import psutil

    try:
        procs = [psutil.Process(proc.pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
    proc.wait()
    return [p.pid for p in procs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_groups", type=int, required=True, help="F, federation groups (one torchrun each)")
    parser.add_argument("--nproc_per_group", type=int, required=True, help="G, ranks per group")
    parser.add_argument("--min_replicas", type=int, default=1, help="groups a quorum needs (Lighthouse)")
    parser.add_argument("--join_timeout_ms", type=int, default=LIGHTHOUSE_DEFAULTS["join_timeout_ms"])
    parser.add_argument("--heartbeat_timeout_ms", type=int, default=LIGHTHOUSE_DEFAULTS["heartbeat_timeout_ms"])
    parser.add_argument("--max_restarts", type=int, default=0, help="torchrun --max-restarts of every group")
    parser.add_argument("--log_dir", default=None, help="write group<f>.log and lighthouse.log here")
    parser.add_argument("script", help="the training script, e.g. recipes/pretrain.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    a = parser.parse_args(argv)
    if a.num_groups < 1 or a.nproc_per_group < 1:
        parser.error("--num_groups and --nproc_per_group must be >= 1")
    logs = Path(a.log_dir) if a.log_dir else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    lh_log = open(logs / "lighthouse.log", "w") if logs else None
    lighthouse, addr = start_lighthouse(log=lh_log, min_replicas=a.min_replicas, join_timeout_ms=a.join_timeout_ms,
                                        heartbeat_timeout_ms=a.heartbeat_timeout_ms)
    args = [x for x in a.args if x != "--"] if a.args[:1] == ["--"] else a.args
    root = str(Path(__file__).resolve().parents[1])
    groups = []
    try:
        for f in range(a.num_groups):
            out = open(logs / f"group{f}.log", "w") if logs else None
            groups.append(start_group(f, a.nproc_per_group, a.script, *args, lighthouse=addr, stdout=out,
                                      stderr=out, pythonpath=[root], max_restarts=a.max_restarts))
        print(f"[ft_launch] Lighthouse {addr}; {a.num_groups} group(s) of {a.nproc_per_group} started "
              f"(pids {[g.pid for g in groups]})", flush=True)
        codes = [wait(g, None).returncode for g in groups]
    finally:
        for g in groups:
            terminate(g)
        terminate(lighthouse)
    print(f"[ft_launch] group exit statuses: {codes}", flush=True)
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
