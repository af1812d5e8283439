"""Launch a fault-tolerant federation on one machine: a torchft Lighthouse and F supervised group launches.

With ``FLConfig(fault_tolerance="torchft")`` every federation group is its own
``torchrun`` world of G ranks; a torchft Lighthouse decides which groups take part in
each sync (:mod:`fl_accel.ft`). This script starts the Lighthouse (the installed torchft
build's: the groups' must be the same, 0.2.0 or a 0.3-API build; through
scripts/torchft_lighthouse.py) on a free port, then one torchrun per group, each
with its own free ``--master_port``, ``FL_ACCEL_FAULT_TOLERANCE=torchft``,
``FL_ACCEL_GROUP_INDEX=f``, ``TORCHFT_LIGHTHOUSE`` and ``OMP_NUM_THREADS=1``, and
supervises the groups until each has finished or failed (the Lighthouse is stopped at
the end)::

    python -m scripts.ft_launch --num_groups 2 --nproc_per_group 2 --max_restarts 1 --log_dir logs/ft -- \\
        recipes/pretrain.py --fault_tolerance torchft --num_groups 2 --model tiny --max_steps 40 \\
        --checkpoint_every 10 --report_to none --output_dir outputs/ft

What it prints (``[ft_launch]`` lines on this terminal):

* each group's torchrun pid and log when it starts (``group 1: torchrun pid 1234 (log:
  logs/ft/group1.log)``), and again after every restart;
* how a group ended, when it does (finished; or its status, e.g. ``ended by SIGKILL``,
  and whether it restarts);
* at the end one line per group (``finished``, ``finished after 1 restart``, ``failed with
  status 1 after 1 restart``) and ``group exit statuses: [...]`` (each group's last attempt).

Restarts (:class:`Supervisor`): a group whose torchrun exits non-zero, a signal included
(``kill -9`` of its torchrun pid, a rank that crashed, the OOM killer), is started again,
at most ``--max_restarts`` times per group (default 0: no restart), after
``--restart_delay_s`` (default: the Lighthouse's heartbeat timeout, so the Lighthouse has
dropped the dead group first). The restart runs the same command on a fresh port; for the
recipe (``recipes/pretrain.py``) it adds ``--resume_from_checkpoint latest`` unless the
command has a ``--resume_from_checkpoint`` already: the group resumes from its newest
checkpoint in ``<output_dir>/group<f>/checkpoints`` (from step 0 if it has none yet) and
heals from a live group at its first sync (the recipe prints ``[fl_accel] group 1 healed
from group 0 at step 12: 1.2 MB in 0.83 s (transfer 0.61 s, load 0.22 s)``, in the group's
log). Other scripts (examples/train_loop.py) get
the same command. Killing a group's torchrun (the pid printed for it) is therefore how to
force a restart by hand; with ``--log_dir D`` a second command does it for you::

    python -m scripts.ft_launch --restart_group 1 --log_dir logs/ft

which leaves a request file in ``D`` that the running launcher picks up within a second:
it kills group 1 (SIGKILL of its torchrun and workers) and restarts it as above. Such
restarts are not counted against ``--max_restarts``. The running launcher also keeps
``D/ft_launch.json`` (its pid, the Lighthouse, each group's pid, state, restarts and exit
statuses) up to date.

The exit status is 0 when every group finished, restarted ones included, with the same final
model; otherwise the (shell-style: 128 + N for signal N) status of the first group that failed
for good, or 3 (:data:`DIFFERENT_MODELS_STATUS`) when every group finished but their final
models differ. A group that fails does not stop the others: that is the point of the mode.
For the recipe, the summary repeats each group's final eval perplexity, final-model checksum
and folder (each group's rank 0 writes them to the file ``FT_LAUNCH_REPORT`` names), and when
the checksums differ the last line is ``[ft_launch] error: the groups ended with different
final models (...); use <output_dir>/group<f>/final_model (...)``. The recipe's groups wait
for each other at the end (``FLConfig.rejoin_timeout_s``; docs/fault_tolerance.md, "The end
of a run"), so this happens only when a group came back after that wait.
When groups failed for good with a one-line error (the recipe's bad-input or collective
message), those lines come last, after the summary: each group's torchrun gets its own
``TORCHELASTIC_ERROR_FILE`` and copies its first failure's error file there.

Each group's output goes to ``--log_dir/group<f>.log`` (restarts append to it after a
``[ft_launch]`` line; default: this terminal, where the streams interleave).

On a cluster the same pattern is one Lighthouse job step and one job (or step) per
group; see docs/fault_tolerance.md (examples/torchft_two_groups.sh runs this script).

The functions are used by tests/ft/test_ft.py and the benchmark: :func:`start_lighthouse`,
:func:`group_env`, :func:`start_group`, :func:`kill_group`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Sequence

from scripts.launch import child_env, error_file_message, free_port, start, terminate, torchrun_argv

LIGHTHOUSE_DEFAULTS = {"min_replicas": 1, "quorum_tick_ms": 100, "join_timeout_ms": 2000,
                       "heartbeat_timeout_ms": 3000}
"""Lighthouse options for one machine: a group that stops heartbeating for 3 s is left out
of the next quorum; stragglers are awaited 2 s (torchft's defaults: 60 s and 5 s)."""


def lighthouse_argv(port: int, host: str = "127.0.0.1", **options) -> list[str]:
    """The Lighthouse command bound to ``host:port``, with :data:`LIGHTHOUSE_DEFAULTS`
    updated by ``options`` (``min_replicas=2`` makes every quorum wait for two groups):
    this Python running scripts/torchft_lighthouse.py (torchft's own ``lighthouse_main``,
    without importing torch: about 0.1 instead of 3 CPU-s) when torchft is importable here,
    else the ``torchft_lighthouse`` entry point on ``PATH``.

    Raises:
        FileNotFoundError: torchft (its ``torchft_lighthouse`` entry point) is not installed.
    """
    import importlib.util

    bind = ["--bind", f"{host}:{port}"] + _flags(options)
    if importlib.util.find_spec("torchft") is not None:
        return [sys.executable, str(LIGHTHOUSE_SCRIPT)] + bind
    found = shutil.which("torchft_lighthouse")
    if found is None:
        raise FileNotFoundError("torchft_lighthouse not found: pip install torchft==0.2.0 (or the build the groups "
                                "use: the Lighthouse must be the same)")
    return [found] + bind


LIGHTHOUSE_SCRIPT = Path(__file__).resolve().with_name("torchft_lighthouse.py")
"""scripts/torchft_lighthouse.py: run as a file (the Lighthouse parses the process's own
command line, as with the entry point)."""


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
    signalled; ``proc.returncode`` is then the launcher's status (``-sig`` unless it had
    ended)."""
    import psutil

    if getattr(proc, "returncode", None) is not None:  # reaped already: its pid may be another process's now
        return []
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
    psutil.wait_procs([p for p in procs if p.pid != proc.pid], timeout=10)
    proc.wait()  # reaped here, not by psutil, so that proc.returncode is the launcher's status (-sig)
    return [p.pid for p in procs]



# ---------------------------------------------------------------------- supervision
RESUME_FLAG = "--resume_from_checkpoint"
STATE_FILE = "ft_launch.json"
"""The running launcher's state in ``--log_dir`` (pid, Lighthouse, every group's pid and state)."""


def request_file(log_dir: str | os.PathLike, group_index: int) -> Path:
    """The file whose appearance asks the launcher that writes to ``log_dir`` to restart a group."""
    return Path(log_dir) / f"restart_group{group_index}.request"


def is_recipe(script: str | os.PathLike) -> bool:
    """True when ``script`` is the recipe (``recipes/pretrain.py``, by name and folder)."""
    path = Path(script)
    return path.name == "pretrain.py" and path.parent.name == "recipes"


def restart_args(script: str | os.PathLike, args: Sequence[str]) -> list[str]:
    """The arguments of a restarted group: ``args``, plus ``--resume_from_checkpoint latest``
    for the recipe unless ``args`` name a checkpoint already (``--resume_from_checkpoint X``
    or ``--resume_from_checkpoint=X``, kept as given)."""
    args = [str(a) for a in args]
    if not is_recipe(script) or any(a == RESUME_FLAG or a.startswith(RESUME_FLAG + "=") for a in args):
        return args
    return args + [RESUME_FLAG, "latest"]


def describe(returncode: int | None) -> str:
    """``exited with status 1``, ``ended by SIGKILL (status -9)``, ``finished`` (0)."""
    if returncode == 0:
        return "finished"
    if returncode is None:
        return "ended with an unknown status"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"ended by {name} (status {returncode})"
    return f"exited with status {returncode}"


def decide(returncode: int, restarts: int, max_restarts: int) -> str:
    """What to do with a group whose torchrun ended with ``returncode`` after ``restarts``
    restarts (those ``--max_restarts`` counts): ``"finished"`` (0), ``"restart"`` (non-zero,
    a signal included, and restarts left) or ``"failed"``."""
    if returncode == 0:
        return "finished"
    return "restart" if restarts < max_restarts else "failed"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


@dataclasses.dataclass
class Group:
    """One federation group under :class:`Supervisor`."""

    index: int
    proc: Any = None
    """The running attempt's launch (a Popen of torchrun), None between attempts."""
    log: str = "this terminal"
    state: str = "starting"
    """``running``, ``waiting`` (a restart is due at ``restart_at``), ``finished``, ``failed`` or
    ``stopped`` (by :meth:`Supervisor.stop`)."""
    restarts: int = 0
    """Restarts after a failure (what ``--max_restarts`` bounds)."""
    requested: int = 0
    """Restarts asked for from outside (``--restart_group``)."""
    statuses: list = dataclasses.field(default_factory=list)
    """Exit status of every attempt that ended."""
    restart_at: float = 0.0
    watched: dict = dataclasses.field(default_factory=dict)
    """pid -> psutil.Process: the running attempt's descendants seen so far (its workers)."""
    watched_at: float = 0.0

    @property
    def attempts(self) -> int:
        return self.restarts + self.requested

    def summary(self) -> str:
        """``group 1: finished after 1 restart (ended by SIGKILL (status -9))``, ``group 0:
        finished``, ``group 1: failed with status 1 (no restart)``."""
        earlier = self.statuses[:-1]
        why = f" ({'; '.join(describe(c) for c in earlier)})" if earlier else ""
        asked = f", {self.requested} on request" if self.requested else ""
        restarted = f"after {_plural(self.attempts, 'restart')}{asked}{why}" if self.attempts else ""
        if self.state == "finished":
            return f"group {self.index}: finished{' ' + restarted if restarted else ''}"
        last = self.statuses[-1] if self.statuses else None
        return f"group {self.index}: {self.state} with status {last} {restarted or '(no restart)'}"


class Supervisor:
    """Runs F group launches to the end, restarting the ones that fail (see the module
    docstring for the policy and what it prints).

    Args:
        num_groups: F.
        start: ``start(f, attempt) -> (launch, log)``: start attempt ``attempt`` (0 first)
            of group ``f`` and say where it logs; ``launch`` has ``pid``, ``poll()`` and
            ``wait()`` (a Popen). The caller decides the command (:func:`restart_args`).
        max_restarts: restarts after failures, per group.
        restart_delay_s: seconds between a group's end and its restart.
        control_dir: where :data:`STATE_FILE` is kept and :func:`request_file` requests
            are looked for (None: neither).
        kill: ends a running launch and its workers (default :func:`kill_group`, SIGKILL).
        watch: follow each launch's descendants (psutil) so that workers a killed torchrun
            left behind are ended before the restart.
        out: where the ``[ft_launch]`` lines go.
        clock, sleep: the time source and the wait between polls.
        info: extra entries for :data:`STATE_FILE` (the Lighthouse's address).
    """

    def __init__(self, num_groups: int, start: Callable[[int, int], tuple[Any, str]], *, max_restarts: int = 0,
                 restart_delay_s: float = 3.0, control_dir: str | os.PathLike | None = None,
                 kill: Callable[[Any], Any] = None, watch: bool = True, out: IO | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 info: Mapping | None = None):
        if num_groups < 1 or max_restarts < 0:
            raise ValueError(f"need num_groups >= 1 and max_restarts >= 0, got {num_groups}, {max_restarts}")
        self.groups = [Group(f) for f in range(num_groups)]
        self._start, self.max_restarts, self.restart_delay_s = start, max_restarts, restart_delay_s
        self.control_dir = Path(control_dir) if control_dir is not None else None
        self._kill = kill or kill_group
        self._watch, self._out, self._clock, self._sleep = watch, out, clock, sleep
        self.info = dict(info or {})

    # -------------------------------------------------------------- output
    def say(self, line: str) -> None:
        print(f"[ft_launch] {line}", file=self._out or sys.stdout, flush=True)

    def _write_state(self) -> None:
        if self.control_dir is None:
            return
        state = {"pid": os.getpid(), **self.info, "max_restarts": self.max_restarts,
                 "groups": [{"group": g.index, "pid": g.proc.pid if g.proc is not None else None, "state": g.state,
                             "restarts": g.restarts, "requested": g.requested, "statuses": g.statuses,
                             "log": g.log} for g in self.groups]}
        tmp = self.control_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self.control_dir / STATE_FILE)

    # -------------------------------------------------------------- attempts
    def _launch(self, g: Group) -> None:
        g.proc, g.log = self._start(g.index, g.attempts)
        g.state, g.watched, g.watched_at = "running", {}, 0.0
        what = "" if not g.attempts else \
            f" (restart {g.attempts}{'' if g.requested else f' of {self.max_restarts}'})"
        self.say(f"group {g.index}: torchrun pid {g.proc.pid}{what} (log: {g.log})")

    def start_all(self) -> None:
        """Start every group (attempt 0)."""
        for g in self.groups:
            self._launch(g)
        self._write_state()

    def _follow(self, g: Group, now: float) -> None:
        """Remember the running attempt's descendants (every 2 s)."""
        if not self._watch or now - g.watched_at < 2.0:
            return
        g.watched_at = now
        import psutil

        try:
            for p in psutil.Process(g.proc.pid).children(recursive=True):
                g.watched.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def _end_leftovers(self, g: Group) -> None:
        """SIGTERM, then after 5 s SIGKILL, the descendants of an ended attempt still running (a
        torchrun killed by a signal leaves its workers, each in a session of its own)."""
        if not g.watched:
            return
        import psutil

        alive = [p for p in g.watched.values() if p.is_running()]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in alive:
                try:
                    p.send_signal(sig)
                except psutil.Error:
                    pass
            _, alive = psutil.wait_procs(alive, timeout=5)
            if not alive:
                break
        g.watched = {}

    def _ended(self, g: Group, code: int) -> None:
        pid, g.proc = g.proc.pid, None
        g.statuses.append(code)
        self._end_leftovers(g)
        action = decide(code, g.restarts, self.max_restarts)
        if action == "finished":
            g.state = "finished"
            self.say(f"group {g.index}: torchrun pid {pid} finished")
        elif action == "restart":
            g.restarts += 1
            g.state, g.restart_at = "waiting", self._clock() + self.restart_delay_s
            self.say(f"group {g.index}: torchrun pid {pid} {describe(code)}; restarting it ({g.restarts} of "
                     f"{self.max_restarts}) in {self.restart_delay_s:g} s")
        else:
            g.state = "failed"
            self.say(f"group {g.index}: torchrun pid {pid} {describe(code)}; no restart left (--max_restarts "
                     f"{self.max_restarts})")

    def _requests(self) -> None:
        """Act on :func:`request_file` requests (``--restart_group``)."""
        if self.control_dir is None:
            return
        for g in self.groups:
            path = request_file(self.control_dir, g.index)
            if not path.exists():
                continue
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            if g.state == "finished":
                self.say(f"group {g.index}: restart requested, but it has finished; ignored")
                continue
            g.requested += 1
            if g.state == "running":
                self.say(f"group {g.index}: restart requested; killing torchrun pid {g.proc.pid} and its workers")
                self._kill(g.proc)
                g.statuses.append(g.proc.wait())
                g.proc = None
                self._end_leftovers(g)
            else:
                self.say(f"group {g.index}: restart requested ({g.state})")
            g.state, g.restart_at = "waiting", self._clock() + self.restart_delay_s
            self._write_state()

    def poll(self) -> bool:
        """One round: requests, ended attempts, due restarts. True while a group is running
        or waiting for its restart."""
        self._requests()
        changed = False
        now = self._clock()
        for g in self.groups:
            if g.state == "running":
                code = g.proc.poll()
                if code is None:
                    self._follow(g, now)
                    continue
                self._ended(g, code)
                changed = True
            if g.state == "waiting" and self._clock() >= g.restart_at:
                self._launch(g)
                changed = True
        if changed:
            self._write_state()
        return any(g.state in ("running", "waiting") for g in self.groups)

    def run(self, poll_s: float = 0.25) -> int:
        """Start the groups (unless started) and supervise them to the end; prints the summary
        and returns :meth:`exit_status`."""
        if all(g.state == "starting" for g in self.groups):
            self.start_all()
        while self.poll():
            self._sleep(poll_s)
        for g in self.groups:
            self.say(g.summary())
        self.say(f"group exit statuses: {[g.statuses[-1] if g.statuses else None for g in self.groups]}")
        return self.exit_status()

    def exit_status(self) -> int:
        """0 when every group finished; else the shell-style status of the first failed group's
        last attempt (128 + N for signal N)."""
        from scripts.launch import exit_code

        failed = [g for g in self.groups if g.state != "finished"]
        return exit_code(failed[0].statuses[-1] if failed[0].statuses else None) if failed else 0

    def stop(self) -> None:
        """End every running attempt (SIGTERM to its torchrun, which stops its workers; SIGKILL
        after 5 s; then any descendant left). For an interrupted launcher."""
        stopped = False
        for g in self.groups:
            if g.proc is not None and g.proc.poll() is None:
                self.say(f"group {g.index}: stopping torchrun pid {g.proc.pid} (the launcher is stopping)")
                self._follow(g, float("inf"))
                terminate(g.proc)
                self._end_leftovers(g)
                g.statuses.append(g.proc.returncode)
                g.proc, g.state, stopped = None, "stopped", True
            elif g.state == "waiting":
                g.state, stopped = "stopped", True
        if stopped:
            self._write_state()


def request_restart(log_dir: str | os.PathLike, group_index: int, timeout: float = 120.0,
                    out: IO | None = None) -> int:
    """Ask the launcher running with ``--log_dir log_dir`` to restart group ``group_index``
    (it kills the group's torchrun and workers, then starts it again: see the module
    docstring) and wait until it has; prints the new torchrun pid. Returns 0.

    Raises:
        FileNotFoundError: no launcher state in ``log_dir`` (no launcher ever ran with it).
        RuntimeError: that launcher is not running, or the group has finished.
        ValueError: ``group_index`` is not one of its groups.
        TimeoutError: the launcher did not restart the group within ``timeout`` seconds.
    """
    state_path = Path(log_dir) / STATE_FILE
    if not state_path.exists():
        raise FileNotFoundError(f"{state_path} does not exist: is `python -m scripts.ft_launch --log_dir {log_dir} "
                                f"...` running?")
    state = json.loads(state_path.read_text())
    try:
        os.kill(int(state["pid"]), 0)
    except ProcessLookupError:
        raise RuntimeError(f"the launcher of {log_dir} (pid {state['pid']}) is not running") from None
    except PermissionError:
        pass
    groups = state["groups"]
    if not 0 <= group_index < len(groups):
        raise ValueError(f"--restart_group {group_index}: the launcher runs groups 0..{len(groups) - 1}")
    before = groups[group_index]
    if before["state"] == "finished":
        raise RuntimeError(f"group {group_index} has finished; nothing to restart")
    request = request_file(log_dir, group_index)
    tmp = request.with_name(request.name + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
    os.replace(tmp, request)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            g = json.loads(state_path.read_text())["groups"][group_index]
        except (OSError, ValueError):
            g = before
        if g["requested"] > before["requested"] and g["state"] == "running":
            print(f"[ft_launch] group {group_index}: restarted on request: torchrun pid {g['pid']} "
                  f"(log: {g['log']})", file=out or sys.stdout, flush=True)
            return 0
        time.sleep(0.2)
    raise TimeoutError(f"the launcher (pid {state['pid']}) did not restart group {group_index} within {timeout:g} s "
                       f"(request {request} {'still pending' if request.exists() else 'taken'})")


# ---------------------------------------------------------------------- command line
def _restart_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.ft_launch --restart_group",
                                     description="Ask a running launcher (same --log_dir) to restart one group.")
    parser.add_argument("--restart_group", type=int, required=True, help="the group to restart")
    parser.add_argument("--log_dir", required=True, help="the running launcher's --log_dir")
    parser.add_argument("--timeout_s", type=float, default=120.0, help="how long to wait for the restart")
    a = parser.parse_args(argv)
    try:
        return request_restart(a.log_dir, a.restart_group, a.timeout_s)
    except (OSError, RuntimeError, ValueError) as exc:  # TimeoutError and FileNotFoundError are OSErrors
        print(f"[ft_launch] {exc}", file=sys.stderr, flush=True)
        return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    options = argv[:argv.index("--")] if "--" in argv else argv
    if any(x == "--restart_group" or x.startswith("--restart_group=") for x in options):
        return _restart_main(options)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_groups", type=int, required=True, help="F, federation groups (one torchrun each)")
    parser.add_argument("--nproc_per_group", type=int, required=True, help="G, ranks per group")
    parser.add_argument("--min_replicas", type=int, default=1, help="groups a quorum needs (Lighthouse)")
    parser.add_argument("--join_timeout_ms", type=int, default=LIGHTHOUSE_DEFAULTS["join_timeout_ms"])
    parser.add_argument("--heartbeat_timeout_ms", type=int, default=LIGHTHOUSE_DEFAULTS["heartbeat_timeout_ms"])
    parser.add_argument("--max_restarts", type=int, default=0,
                        help="restart a group whose torchrun exits non-zero (or is killed) up to N times; the "
                             "recipe restarts with --resume_from_checkpoint latest")
    parser.add_argument("--restart_delay_s", type=float, default=None,
                        help="seconds before a restart (default: --heartbeat_timeout_ms)")
    parser.add_argument("--log_dir", default=None, help="write group<f>.log, lighthouse.log and ft_launch.json here "
                        "(and take --restart_group requests)")
    parser.add_argument("--restart_group", type=int, metavar="F", default=None,
                        help="with --log_dir D only, from a second terminal: ask the launcher running with --log_dir "
                             "D to kill and restart group F (python -m scripts.ft_launch --restart_group F --log_dir "
                             "D; not counted against --max_restarts)")
    parser.add_argument("script", help="the training script, e.g. recipes/pretrain.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    a = parser.parse_args(argv)
    if a.num_groups < 1 or a.nproc_per_group < 1:
        parser.error("--num_groups and --nproc_per_group must be >= 1")
    if a.max_restarts < 0:
        parser.error("--max_restarts must be >= 0")
    logs = Path(a.log_dir) if a.log_dir else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
        for stale in logs.glob("restart_group*.request"):  # left by an earlier launch
            stale.unlink()
    args = [x for x in a.args if x != "--"] if a.args[:1] == ["--"] else a.args
    root = str(Path(__file__).resolve().parents[1])
    delay = a.heartbeat_timeout_ms / 1000 if a.restart_delay_s is None else a.restart_delay_s
    lh_log = open(logs / "lighthouse.log", "w") if logs else None
    lighthouse, addr = start_lighthouse(log=lh_log, min_replicas=a.min_replicas, join_timeout_ms=a.join_timeout_ms,
                                        heartbeat_timeout_ms=a.heartbeat_timeout_ms)

    errors_dir = Path(tempfile.mkdtemp(prefix="ft_launch_errors_"))
    error_files: dict[int, Path] = {}  # group -> its last attempt's error file (torchrun's @record copies into it)
    reports = {f: errors_dir / f"group{f}_end.json" for f in range(a.num_groups)}  # the recipe's end reports

    def start_attempt(f: int, attempt: int):
        argv_f = args if attempt == 0 else restart_args(a.script, args)
        error_files[f] = errors_dir / f"group{f}_attempt{attempt}.json"
        reports[f].unlink(missing_ok=True)
        env = {"TORCHELASTIC_ERROR_FILE": str(error_files[f]), REPORT_VAR: str(reports[f])}
        if logs is None:
            return start_group(f, a.nproc_per_group, a.script, *argv_f, lighthouse=addr, env=env,
                               pythonpath=[root]), "this terminal"
        path = logs / f"group{f}.log"
        with open(path, "a" if attempt else "w") as out:
            if attempt:
                out.write(f"[ft_launch] ---- attempt {attempt + 1} of group {f}: {a.script} {' '.join(argv_f)}\n")
                out.flush()
            proc = start_group(f, a.nproc_per_group, a.script, *argv_f, lighthouse=addr, env=env, stdout=out,
                               stderr=out, pythonpath=[root])
        return proc, str(path)

    supervisor = Supervisor(a.num_groups, start_attempt, max_restarts=a.max_restarts, restart_delay_s=delay,
                            control_dir=logs, info={"lighthouse": addr, "lighthouse_pid": lighthouse.pid})

    def on_sigterm(signum, frame):  # a scheduler cancelling the job: end the groups too (finally below)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        supervisor.say(f"Lighthouse {addr} (pid {lighthouse.pid}); {a.num_groups} group(s) of {a.nproc_per_group} "
                       f"rank(s); --max_restarts {a.max_restarts}"
                       + (f"; restart one with: python -m scripts.ft_launch --restart_group F --log_dir {logs}"
                          if logs else ""))
        status = supervisor.run()
    except KeyboardInterrupt:
        supervisor.say("interrupted: stopping the groups")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        supervisor.stop()
        terminate(lighthouse)
        messages = failed_group_errors(supervisor, error_files)
        finished = read_reports({g.index: reports[g.index] for g in supervisor.groups if g.state == "finished"})
        shutil.rmtree(errors_dir, ignore_errors=True)
    lines, different = compare_models(finished)
    for line in lines:
        supervisor.say(line)
    if different:  # every group finished, apart: the run has no one result
        messages.append(different)
        status = status or DIFFERENT_MODELS_STATUS
    if messages:  # last: the groups' one-line errors, not torchrun's failure summaries above
        sys.stdout.flush()
        print("\n".join(messages), file=sys.stderr, flush=True)
    return status


REPORT_VAR = "FT_LAUNCH_REPORT"
"""The variable naming the file where a group's recipe writes its end report (the recipe's
``recipes.results.END_REPORT_VAR``; tests/ft/test_ft_faults.py checks they agree): group,
steps, the final model's checksum, eval perplexity and loss, where the final model is."""
DIFFERENT_MODELS_STATUS = 3
"""The launcher's exit status when every group finished but their final models differ."""


def read_reports(paths: Mapping[int, Path]) -> dict[int, dict]:
    """The end reports that exist, by group (a group that failed, or a script other than the
    recipe, leaves none)."""
    out = {}
    for f, path in paths.items():
        try:
            out[f] = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue
    return out


def compare_models(reports: Mapping[int, dict]) -> tuple[list[str], str | None]:
    """``(lines, error)``: one summary line per reported group (its eval perplexity, the
    checksum of its final model, where it is) and, when the checksums differ, the one-line
    error naming the final model to use: the one most groups share, then the lowest eval
    loss. ``error`` None when the models are equal (or fewer than two groups reported)."""
    lines = [f"group {f}: eval perplexity {r.get('eval_perplexity', float('nan')):.2f}, final model checksum "
             f"{r.get('checksum') if r.get('checksum') is None else format(r['checksum'], '.6e')}, "
             f"{r.get('final_model') or r.get('output_dir')}" for f, r in sorted(reports.items())]
    sums = {f: r.get("checksum") for f, r in reports.items()}
    if len(reports) < 2 or len(set(sums.values())) == 1:
        return lines, None

    def rank(f):
        return (-sum(1 for c in sums.values() if c == sums[f]), reports[f].get("eval_loss") or float("inf"), f)

    best = min(reports, key=rank)
    r = reports[best]
    groups = sorted(f for f, c in sums.items() if c == sums[best])
    return lines, (f"[ft_launch] error: the groups ended with different final models ("
                   + "; ".join(f"group {f}: perplexity {reports[f].get('eval_perplexity', float('nan')):.2f}"
                               for f in sorted(reports))
                   + f"); use {r.get('final_model') or r.get('output_dir')} (group{'s' if len(groups) > 1 else ''} "
                   f"{', '.join(map(str, groups))}, eval perplexity {r.get('eval_perplexity', float('nan')):.2f})")


def failed_group_errors(supervisor: "Supervisor", error_files: Mapping[int, Path]) -> list[str]:
    """The one-line errors of the groups whose last attempt failed, from the error file torchrun
    copied its first failure's into (``TORCHELASTIC_ERROR_FILE`` given to each group's torchrun;
    :func:`scripts.launch.error_file_message`), each once, groups in order: what
    :func:`main` prints last, so that a bad input ends with its own line, not with the ~40 lines
    of each torchrun's ``ChildFailedError`` summary."""
    out: list[str] = []
    for g in supervisor.groups:
        if g.state == "finished" or g.index not in error_files:
            continue
        message, _ = error_file_message(error_files[g.index])
        if message and message not in out:
            out.append(message)
    return out


if __name__ == "__main__":
    sys.exit(main())
