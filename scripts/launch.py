"""Process launching for tests, scripts and the benchmark: one copy, standard library only.

Everything here starts processes in a new session (their own process group), so a
timeout or Ctrl-C can end a whole tree (``torchrun`` and the workers it started) at
once; :class:`recipes.host_load.HostLoad` measures what the machine did meanwhile:

    from recipes.host_load import HostLoad
    from scripts.launch import child_env, run, torchrun_argv

    argv = torchrun_argv(4, "recipes/pretrain.py", "--max_steps", "4")
    with HostLoad() as load:                  # this process and everything it starts
        result = run(argv, timeout=600, env=child_env())
    print(result.returncode, result.seconds, load.background_cpu_share)

Distributed launches always use ``python -m torch.distributed.run`` of the running
interpreter (never a ``torchrun`` found on PATH, which may belong to another Python).
Importing this module imports neither torch nor accelerate.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import IO, Any, Mapping, Sequence

__all__ = ["free_port", "child_env", "torchrun_argv", "start", "wait", "run", "run_torchrun", "terminate",
           "exit_code", "error_file_message", "Result", "ADDRESS_IN_USE"]

ADDRESS_IN_USE = ("address already in use", "EADDRINUSE", "Address in use")
"""Substrings of a launcher's stderr that mean its rendezvous port was taken meanwhile."""


# ---------------------------------------------------------------------- ports and argv
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now and that the kernel does not hand out by itself.

    The port is drawn at random below the kernel's ephemeral range
    (``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), from 20000 up, and
    checked by binding it. The kernel gives ports of the ephemeral range to every ``bind(0)``
    and outgoing connection (gloo's listeners, torchft's servers, a TCPStore on port 0), so a
    port drawn there could be taken in the seconds before a launched rank 0 binds it: a
    concurrent test suite saw ``EADDRINUSE`` that way. A port below the range can only be
    taken by another explicit choice. The port is released before returning, so that remains
    possible; :func:`run_torchrun` retries once with a new port when it happens. Falls back to
    a kernel-chosen port when the range leaves no room below it or 200 draws were all in use.
    """
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    draw = random.SystemRandom()  # not the seeded module-level generator: launches must not agree
    for _ in range(200 if low > 21000 else 0):
        port = draw.randrange(20000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_env(extra: Mapping[str, str | None] | None = None, *, pythonpath: Sequence[str] = (),
              drop_prefixes: Sequence[str] = ("FL_ACCEL_",)) -> dict[str, str]:
    """Environment of a launched job: ours, single-threaded and offline.

    Args:
        extra: variables set last (they win over everything here); a None value removes
            the variable (e.g. ``{"WANDB_MODE": None}``: a launch as from a bare shell).
        pythonpath: folders put in front of ``PYTHONPATH``.
        drop_prefixes: variables starting with one of these are removed first (the
            caller's ``FL_ACCEL_*`` settings must not leak into a launch that sets its
            own on the command line).

    Returns:
        A new dict: ``os.environ`` minus ``drop_prefixes``, plus ``OMP_NUM_THREADS=1``,
        ``MKL_NUM_THREADS=1``, ``TOKENIZERS_PARALLELISM=false``, the Hugging Face
        offline switches, ``PYTHONUNBUFFERED=1`` and ``WANDB_MODE=offline`` (unless
        already set), then ``extra``.
    """
    env = {k: v for k, v in os.environ.items() if not any(k.startswith(p) for p in drop_prefixes)}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.setdefault("WANDB_MODE", "offline")
    paths = [str(p) for p in pythonpath] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def torchrun_argv(nproc: int | None, script_or_module: str | os.PathLike, *args: Any, port: int | None = None,
                  master_addr: str = "127.0.0.1", nnodes: int = 1, node_rank: int = 0, module: bool = False,
                  extra_flags: Sequence[str] = ()) -> list[str]:
    """``python -m torch.distributed.run`` with a static rendezvous, as a list of strings.

    Args:
        nproc: processes on this node (``--nproc_per_node``); None leaves it out (the
            caller passes it in ``extra_flags`` or ``args``).
        script_or_module: the training script's path, or a module name with ``module=True``.
        args: the script's arguments (converted with ``str``).
        port: ``--master_port``; None picks :func:`free_port`.
        master_addr: address of node 0.
        nnodes, node_rank: multi-node launches (one call per node).
        module: run ``script_or_module`` as ``-m module``.
        extra_flags: more launcher options, placed before the script.

    Raises:
        ValueError: ``nproc``/``nnodes`` < 1 or ``node_rank`` outside ``[0, nnodes)``.
    """
    if nproc is not None and (isinstance(nproc, bool) or int(nproc) < 1):
        raise ValueError(f"nproc must be >= 1, got {nproc!r}")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"need nnodes >= 1 and 0 <= node_rank < nnodes, got nnodes={nnodes}, node_rank={node_rank}")
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node_rank", str(node_rank),
            "--master_addr", master_addr, "--master_port", str(port if port is not None else free_port())]
    if nproc is not None:
        argv += ["--nproc_per_node", str(nproc)]
    argv += [str(f) for f in extra_flags]
    argv += (["-m"] if module else []) + [str(script_or_module)]
    return argv + [str(a) for a in args]


# ---------------------------------------------------------------------- processes
@dataclass
class Result:
    """What :func:`wait` saw of one process."""

    returncode: int | None
    """Exit status (negative: killed by that signal); None when the timeout killed it."""
    stdout: str
    """Captured standard output ("" when it was not a pipe)."""
    stderr: str
    """Captured standard error ("" when it was not a pipe)."""
    seconds: float
    """Wall seconds from :func:`start` to the end."""
    timed_out: bool
    """True when the timeout ended it."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def tail(self, n: int = 6000) -> str:
        """The end of both outputs, for an assertion or error message."""
        return (f"rc={self.returncode} timed_out={self.timed_out} after {self.seconds:.1f}s\n"
                f"--- stdout ---\n{self.stdout[-n:]}\n--- stderr ---\n{self.stderr[-n:]}")


def start(argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
          stdout: int | IO | None = None, stderr: int | IO | None = None, *, text: bool = True) -> subprocess.Popen:
    """Start ``argv`` in a new session (its own process group) and return the Popen.

    ``stdout``/``stderr`` are as for :class:`subprocess.Popen` (``subprocess.PIPE``, a
    file, ``subprocess.STDOUT``). The start time is kept on the object
    (``proc.started_at``, ``time.monotonic()``) for :func:`wait`.

    Raises:
        FileNotFoundError: the program does not exist.
    """
    proc = subprocess.Popen(list(argv), env=dict(env) if env is not None else None, cwd=cwd, stdout=stdout,
                            stderr=stderr, text=text, start_new_session=True)
    proc.started_at = time.monotonic()
    return proc


def terminate(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """End the process group of ``proc`` (started by :func:`start`): SIGTERM, then SIGKILL
    after ``grace`` seconds. Returns when ``proc`` is reaped; a no-op if it already was.

    The group is signalled even when ``proc`` itself has exited, so workers it left
    behind (same group) go too.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            if proc.poll() is not None:
                return
        try:
            proc.wait(timeout=grace)
            if not _group_alive(proc.pid):
                return
            time.sleep(min(grace, 0.2))  # let the rest of the group handle SIGTERM
            if not _group_alive(proc.pid):
                return
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def wait(proc: subprocess.Popen, timeout: float | None, *, grace: float = 5.0) -> Result:
    """Wait for ``proc`` up to ``timeout`` seconds; on timeout end its whole process group.

    Captures stdout/stderr when they are pipes. Never raises on a timeout: the result
    says ``timed_out=True`` and ``returncode=None``.
    """
    t0 = getattr(proc, "started_at", time.monotonic())
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        terminate(proc, grace)
        out, err = proc.communicate()
        timed_out = True
    return Result(None if timed_out else proc.returncode, _text(out), _text(err), time.monotonic() - t0, timed_out)


def _text(x: Any) -> str:
    if x is None:
        return ""
    return x.decode(errors="replace") if isinstance(x, bytes) else x


def run(argv: Sequence[str], *, timeout: float | None, env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None, capture: bool = True) -> Result:
    """:func:`start` then :func:`wait`; with ``capture`` both outputs come back in the Result."""
    pipe = subprocess.PIPE if capture else None
    return wait(start(argv, env, cwd, pipe, pipe), timeout)


def run_torchrun(nproc: int, script_or_module: str | os.PathLike, *args: Any, timeout: float,
                 env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None, module: bool = False,
                 extra_flags: Sequence[str] = (), port_retries: int = 1) -> Result:
    """A single-node torchrun on a fresh port, to completion or ``timeout`` seconds.

    When the rendezvous port was taken between :func:`free_port` and torchrun binding it
    (a concurrent test suite), the launch is retried with a new port, ``port_retries``
    times at most.
    """
    for attempt in range(port_retries + 1):
        res = run(torchrun_argv(nproc, script_or_module, *args, module=module, extra_flags=extra_flags),
                  timeout=timeout, env=env, cwd=cwd)
        clash = res.returncode not in (0, None) and any(s in res.stderr for s in ADDRESS_IN_USE)
        if not clash or attempt == port_retries:
            return res
    return res  # pragma: no cover (the loop always returns)


def exit_code(returncode: int | None) -> int:
    """A shell-style exit status: 128 + N for a death by signal N, 1 for None (unknown)."""
    if returncode is None:
        return 1
    return 128 - returncode if returncode < 0 else returncode


def error_file_message(path: str | os.PathLike | None) -> tuple[str | None, str | None]:
    """``(message, traceback)`` of a torchelastic error file (``TORCHELASTIC_ERROR_FILE``: what
    ``torch.distributed.elastic.multiprocessing.errors.record`` writes for a failed worker, and
    what torchrun's own ``@record`` copies its first failure's file to when the launcher itself
    was given one): ``message`` the one-line ``message.message`` (the recipe writes its
    ``[fl_accel] error ...`` line there), ``traceback`` ``extraInfo.py_callstack`` when it is
    more than that line. ``(None, None)`` when ``path`` is None, missing or not such a file."""
    import json

    if not path or not os.path.isfile(path):
        return None, None
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None, None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, str):
        return (message.strip() or None), None
    if not isinstance(message, dict) or not isinstance(message.get("message"), str):
        return None, None
    text = message["message"].strip()
    stack = (message.get("extraInfo") or {}).get("py_callstack")
    stack = stack.strip() if isinstance(stack, str) and stack.strip() != text else None
    return text or None, stack
