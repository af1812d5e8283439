"""A torchrun stand-in for the tests: ranks forked from one pre-imported server.

Why: importing torch, accelerate, transformers, datasets and fl_accel costs about 10 s of
CPU per process (``python -X importtime``), and torchrun's agent about 3 s more. The suite
launches about 100 jobs of 2-6 processes; on a 2-core machine the imports alone were
about 3,500 CPU-s, most of the suite's wall time. Here those modules are imported once per
pytest session, by a ``multiprocessing`` fork server (``set_forkserver_preload``), and
every rank is a fork of it: a rank starts in a fraction of a second.

What a rank sees (as under ``torchrun --nproc_per_node N script args``):

* ``os.environ`` = the launch's environment plus torchrun's variables (``RANK``,
  ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``,
  ``ROLE_NAME``, ``GROUP_WORLD_SIZE``, ``ROLE_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
  ``TORCHELASTIC_RESTART_COUNT=0``, ``TORCHELASTIC_MAX_RESTARTS=0``, ``TORCHELASTIC_RUN_ID``,
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING``), read from torch 2.13's
  ``LocalElasticAgent._start_workers``. ``TORCHELASTIC_USE_AGENT_STORE=False``: there is
  no agent, so rank 0 hosts the rendezvous store on ``MASTER_PORT`` (``env://``), as
  with a plain multi-process launch;
* the working directory, ``sys.argv = [script, *args]``, and ``sys.path`` as
  ``python script.py`` builds it: the script's folder, then ``PYTHONPATH``, then the
  interpreter's own entries (``runpy.run_path`` alone would not add the folder);
* its own session (process group), stdout/stderr on per-rank files (``dup2`` of fds 1
  and 2), the script run by ``runpy.run_path(script, run_name="__main__")``;
* at the end, as an interpreter exit: non-daemon threads joined, ``atexit`` callbacks
  run, streams flushed. Exit status: the ``SystemExit`` code, 1 after an uncaught
  exception (traceback printed), or the signal that killed it.

The parent acts like torchrun's agent: when a rank exits non-zero it waits up to
:data:`FAIL_GRACE_S` for the others, then sends SIGTERM to their process groups (SIGKILL
after :data:`KILL_GRACE_S`) and returns that rank's exit status; on a timeout every rank
is killed and ``timed_out`` is set. The Result's stdout/stderr are the ranks' outputs
concatenated in rank order (whole lines, never interleaved).

A hang explains itself: every rank registers :mod:`faulthandler` on :data:`STACKS_SIGNAL`
(all threads, to its stderr file), and a launch that runs past its timeout
(:func:`run_forked`, :meth:`ForkedLaunch.wait`) first sends that signal to each rank still
running, so the ranks' stderr ends with the Python stack of every thread at the moment of
the timeout (:meth:`ForkedLaunch.dump_stacks`), followed, where gdb is installed, by their
native stacks (a deadlock in C++, e.g. a destructor joining a thread that waits for the GIL,
shows only there), before they are killed.

Not covered here (those tests keep ``launcher="torchrun"``):

* torchrun itself: ``--max-restarts`` and restarts (``TORCHELASTIC_RESTART_COUNT`` > 0),
  its failure summary ("Root Cause", ``TORCHELASTIC_ERROR_FILE``), signal forwarding
  (Ctrl-C), ``accelerate launch``;
* per-exec process state: peak memory (``ru_maxrss``/``VmHWM`` start at the server's
  footprint), environment read at import time (below), allocator/OpenMP settings;
* CUDA (tests/gpu/test_cuda.py): the server never initializes CUDA, but those tests are the
  GPU launch path and stay real.

Import-time environment: variables that a module reads when imported (the Hugging Face
offline switches, thread counts, progress-bar switches, cache folders) must be right in the
server. It is started with the static part of the tests' launch environment, and a launch
whose environment differs from the server's in one of :data:`IMPORT_TIME_VARS` is refused
with a ValueError (use ``launcher="torchrun"`` for it).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["run_forked", "start_forked", "ForkedLaunch", "PRELOAD", "IMPORT_TIME_VARS"]

PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "torch.distributed.tensor", "accelerate", "transformers", "transformers.models.llama.modeling_llama",
           "datasets", "tokenizers", "fl_accel", "recipes.pretrain",
           "matplotlib.pyplot", "wandb", "wandb.sdk.launch"]
"""Modules the server imports once; every rank inherits them. The last three are imported by
the recipe's main process only (curves.png; W&B's ``init`` imports ``wandb.sdk.launch``):
about 0.6 and 2.5 CPU-s per launch that draws curves or logs to W&B, against 3 CPU-s once
per server (measured 2026-12-02 on this 2-core machine)."""

IMPORT_TIME_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONUNBUFFERED", "PYTHONHASHSEED",
                    "PYTHONDONTWRITEBYTECODE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE",
                    "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "XDG_CACHE_HOME",
                    "HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS", "TORCH_LOGS",
                    "TORCHINDUCTOR_CACHE_DIR", "CUDA_VISIBLE_DEVICES", "MPLBACKEND", "MPLCONFIGDIR")
"""Variables read when a module is imported (or at interpreter start): they must be equal
in the launch's environment and the server's."""

FAIL_GRACE_S = 2.0
"""After a rank fails, how long the others get to end on their own (and print their own
error) before SIGTERM."""

KILL_GRACE_S = 10.0
"""SIGTERM to SIGKILL."""

STACKS_SIGNAL = signal.SIGUSR1
"""The signal on which a rank writes every thread's Python stack to its stderr
(``faulthandler.register``); sent to the ranks still running when a launch times out."""

STACKS_GRACE_S = 5.0
"""How long the ranks get to write their stacks (a signal handler's write; seconds only on
a loaded machine) before they are killed."""

_server: dict[str, Any] = {}


# ---------------------------------------------------------------------- in the rank
def _reseed() -> None:
    """A fresh interpreter seeds Python's and numpy's global RNGs from the OS; forks would
    share the server's state."""
    import random

    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


def _exit_status(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish() -> None:
    """What the interpreter does at exit (CPython ``Py_FinalizeEx``): ``threading._shutdown``
    (threading's own exit hooks first, e.g. ``concurrent.futures``' one that tells idle
    ThreadPoolExecutor workers to end, then the join of every non-daemon thread; joining the
    threads without those hooks waits forever on an idle executor's worker), then atexit,
    then flushing the streams."""
    import atexit

    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _rank_main(script: str, args: Sequence[str], env: Mapping[str, str], cwd: str, base_path: Sequence[str],
               out_path: str, err_path: str) -> None:
    """Body of one forked rank (see the module docstring). Never returns."""
    os.setsid()
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    # a hung rank tells where it is: every thread's Python stack to fd 2 (this rank's stderr
    # file) on STACKS_SIGNAL, written from the signal handler, without the GIL or a lock
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    code = 1
    try:
        import runpy

        # a rank is a main process, as under torchrun: named so, and without a parent
        # whose death multiprocessing would watch for
        multiprocessing.current_process().name = "MainProcess"
        multiprocessing.process._parent_process = None
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        pythonpath = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.path.dirname(os.path.abspath(script))] + pythonpath + list(base_path)
        sys.argv = [script, *args]
        _reseed()
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_status(exc)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    try:
        _finish()
    finally:
        os._exit(code)


# ---------------------------------------------------------------------- in the parent
def _base_sys_path() -> list[str]:
    """The interpreter's own ``sys.path`` entries (stdlib, site-packages, .pth additions),
    i.e. those of ``python -c`` without PYTHONPATH, minus the leading script folder."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", "import sys, json; print(json.dumps(sys.path[1:]))"],
                         capture_output=True, text=True, env=env, check=True, cwd="/")
    import json

    return json.loads(out.stdout)


def _ensure_server(static_env: Mapping[str, str]) -> dict[str, Any]:
    """Start the fork server (once per process) with ``static_env`` as its environment."""
    if _server.get("ctx") is not None:
        return _server
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(static_env)
        from multiprocessing import forkserver

        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    _server.update(ctx=ctx, env=dict(static_env), base_path=_base_sys_path())
    return _server


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


NATIVE_STACKS_TIMEOUT_S = 60.0
"""At most this long for gdb to attach to a hung rank and print its threads' native stacks."""


def _native_stacks(pid: int, frames: int = 16) -> str:
    """Every thread's C/C++ stack of process ``pid`` (``gdb -batch``, the innermost ``frames``
    frames each), or "" without gdb. A Python stack that ends in a C call (a destructor, a lock,
    a collective) says where, not why: a deadlock between a thread holding the GIL and one
    waiting for it shows only here."""
    import shutil

    gdb = shutil.which("gdb")
    if gdb is None:
        return ""
    try:
        out = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex", "set pagination off",
                              "-ex", f"thread apply all bt {frames}"], capture_output=True, text=True,
                             timeout=NATIVE_STACKS_TIMEOUT_S, stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(gdb failed: {exc})"
    import re

    keep = []
    for line in out.splitlines():
        if line.startswith("Thread "):
            keep.append(line)
        elif line.startswith("#"):  # "#3  0x7f.. in fn (args...) at file.c:12" -> "#3 fn  at file.c:12"
            m = re.match(r"#(\d+)\s+(?:0x[0-9a-f]+ in )?(\S+)", line)
            where = re.search(r" (?:at|from) (\S+)$", line)
            keep.append(f"  #{m.group(1)} {m.group(2)}" + (f"  {where.group(0).strip()}" if where else "") if m
                        else line[:160])
    return "\n".join(keep)


def _kill_group(pid: int | None, sig: int, *, alive: bool = True) -> None:
    """Signal the rank's process group; a live rank that has not called setsid yet gets it
    directly (an ended one never: its pid may be reused)."""
    if pid is None:
        return
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        if alive:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _end(procs: list, grace: float) -> None:
    """SIGTERM the process group of every live rank, SIGKILL after ``grace`` seconds."""
    live = [p for p in procs if p.exitcode is None]
    for p in live:
        _kill_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in live:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            _kill_group(p.pid, signal.SIGKILL)
            p.join()
        else:  # what the rank left in its process group goes too
            _kill_group(p.pid, signal.SIGKILL, alive=False)


class ForkedLaunch:
    """``nproc`` ranks of a script forked from the server, running (see :func:`start_forked`).

    Like a torchrun launch seen from outside: :meth:`poll` (None while running; when a
    rank failed, the others get :data:`FAIL_GRACE_S` to end, then are stopped), :meth:`wait`
    and :meth:`kill` (a signal to every rank's process group, i.e. the rank and whatever it
    started). ``pids``: the ranks' process ids; ``logs``: ``(stdout, stderr)`` paths per rank.
    """

    def __init__(self, procs: list, logs: list[tuple[str, str]], t0: float):
        self.procs, self.logs, self.t0 = procs, logs, t0
        self.pids = [p.pid for p in procs]
        self.returncode: int | None = None
        self._failed_at: float | None = None
        self._first_failure: int | None = None
        self.stacks_dumped: list[int] | None = None  # the ranks asked for their stacks (dump_stacks)
        self._dumped_after = 0.0  # seconds from the start to dump_stacks
        self.native_stacks: dict[int, str] = {}  # rank -> its threads' C/C++ stacks (gdb), at dump_stacks

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        # ranks first seen failed in the same poll: one killed by a signal before one that
        # exited with an error (most likely the killed rank's peer, whose collective failed)
        failed = sorted((p for p in self.procs if p.exitcode not in (None, 0)), key=lambda p: p.exitcode >= 0)
        if failed and self._failed_at is None:
            self._failed_at, self._first_failure = time.monotonic(), failed[0].exitcode
        if all(p.exitcode is not None for p in self.procs):
            self.returncode = self._first_failure if self._first_failure is not None else 0
        elif self._failed_at is not None and time.monotonic() - self._failed_at >= FAIL_GRACE_S:
            _end(self.procs, KILL_GRACE_S)
            self.returncode = self._first_failure
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait until every rank ended (or was stopped after a failure); None after
        ``timeout`` seconds, when the ranks still running have written their stacks to their
        stderr (:meth:`dump_stacks`; they keep running)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                self.dump_stacks()
                return None
            wait_s = 5.0 if deadline is None else deadline - now
            if self._failed_at is not None:
                wait_s = min(wait_s, FAIL_GRACE_S - (now - self._failed_at))
            live = [p.sentinel for p in self.procs if p.exitcode is None]
            multiprocessing.connection.wait(live, timeout=max(0.01, min(wait_s, 5.0)))
        return self.returncode

    def kill(self, sig: int = signal.SIGKILL) -> list[int]:
        """``sig`` to every live rank's process group; with SIGKILL the ranks are reaped.
        Returns the pids signalled."""
        live = [p for p in self.procs if p.exitcode is None]
        for p in live:
            _kill_group(p.pid, sig)
        if sig == signal.SIGKILL:
            for p in live:
                p.join()
            self.poll()
        return [p.pid for p in live]

    def dump_stacks(self, grace: float = STACKS_GRACE_S) -> list[int]:
        """:data:`STACKS_SIGNAL` to every rank still running (the rank itself, not its process
        group: what it started has no handler for it), then up to ``grace`` seconds for their
        stderr files to grow: each then ends with "Thread 0x... (most recent call first)" and
        the stack of every Python thread. Returns the ranks signalled. A rank that dies of the
        signal (exit status -SIGUSR1) had not reached :func:`_rank_main` yet."""
        live = [r for r, p in enumerate(self.procs) if p.exitcode is None]
        sizes = {}
        for r in live:
            sizes[r] = _size(self.logs[r][1])
            try:
                os.kill(self.procs[r].pid, STACKS_SIGNAL)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_size(self.logs[r][1]) == sizes[r] for r in live
                                                  if self.procs[r].exitcode is None):
            time.sleep(0.1)
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))  # the rest of a dump in progress
        self.stacks_dumped, self._dumped_after = live, time.monotonic() - self.t0
        hung = [r for r in live if self.procs[r].exitcode is None]
        if hung:  # one gdb per rank, side by side: at most NATIVE_STACKS_TIMEOUT_S in all
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=len(hung)) as pool:
                self.native_stacks = dict(zip(hung, pool.map(_native_stacks, [self.procs[r].pid for r in hung])))
        return live

    def output(self) -> tuple[str, str]:
        """The ranks' stdout and stderr, each concatenated in rank order. After a timeout
        (:meth:`dump_stacks`) each rank's part starts with a ``--- rank r ---`` line, and the
        stderr ends with a line naming the ranks that were still running."""
        labelled = self.stacks_dumped is not None
        texts = []
        for i in (0, 1):
            parts = []
            for r, f in enumerate(self.logs):
                text = Path(f[i]).read_text(errors="replace") if os.path.exists(f[i]) else ""
                parts.append(f"--- rank {r} ---\n{text}" if labelled and text else text)
            texts.append("".join(parts))
        if labelled:
            for r, text in sorted(self.native_stacks.items()):
                if text:
                    texts[1] += f"\n--- rank {r}: native stacks (gdb) ---\n{text}"
            texts[1] += (f"\n[fork launcher] timed out after {self._dumped_after:.0f} s; ranks still running "
                         f"then: {self.stacks_dumped} (each one's stderr above ends with its threads' Python stacks "
                         f"at that moment; native stacks follow them where gdb is installed)\n")
        return tuple(texts)


def start_forked(nproc: int, script: str | os.PathLike, *args: Any, env: Mapping[str, str],
                 static_env: Mapping[str, str], cwd: str | os.PathLike, port: int,
                 log_dir: str | os.PathLike) -> ForkedLaunch:
    """Start ``script args`` as ``nproc`` forked ranks on rendezvous port ``port`` and return
    at once; rank r writes ``log_dir/r.out`` and ``log_dir/r.err``.

    Args:
        env: the ranks' environment (torchrun's variables are added).
        static_env: the environment the server is started with (the first call's wins);
            ``env`` must agree with it on :data:`IMPORT_TIME_VARS`.

    Raises:
        ValueError: ``env`` differs from the server's environment in an import-time variable.
    """
    server = _ensure_server(static_env)
    bad = [k for k in IMPORT_TIME_VARS if env.get(k) != server["env"].get(k)]
    if bad:
        raise ValueError(f"the fork launcher's server imported its modules with {', '.join(bad)}="
                         f"{[server['env'].get(k) for k in bad]}, this launch sets {[env.get(k) for k in bad]}: "
                         f"these are read at import time; launch with launcher='torchrun'")
    script = str(script)
    t0 = time.monotonic()
    common = {"GROUP_RANK": "0", "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc),
              "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
              "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False",
              "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}
    logs = [(os.path.join(log_dir, f"{r}.out"), os.path.join(log_dir, f"{r}.err")) for r in range(nproc)]
    procs: list = []
    try:
        for r in range(nproc):
            rank_env = {**env, **common, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)}
            p = server["ctx"].Process(target=_rank_main, name=f"rank{r}", daemon=False,
                                      args=(script, [str(a) for a in args], rank_env, str(cwd),
                                            server["base_path"], *logs[r]))
            p.start()
            procs.append(p)
    except BaseException:
        _end(procs, 0.0)
        raise
    return ForkedLaunch(procs, logs, t0)


def run_forked(nproc: int, script: str | os.PathLike, *args: Any, timeout: float, env: Mapping[str, str],
               static_env: Mapping[str, str], cwd: str | os.PathLike, port: int) -> tuple[int | None, str, str,
                                                                                          float, bool]:
    """Run ``script args`` as ``nproc`` forked ranks on rendezvous port ``port`` to the end
    (:func:`start_forked`, then :meth:`ForkedLaunch.wait`).

    Returns:
        ``(returncode, stdout, stderr, seconds, timed_out)``: returncode 0, the first failed
        rank's exit status (negative: its signal), or None on timeout, when every rank is
        killed after writing its threads' Python stacks to its stderr
        (:meth:`ForkedLaunch.dump_stacks`).

    Raises:
        ValueError: ``env`` differs from the server's environment in an import-time variable.
    """
    with tempfile.TemporaryDirectory(prefix="fl_accel_fork_") as logs:
        launch = start_forked(nproc, script, *args, env=env, static_env=static_env, cwd=cwd, port=port,
                              log_dir=logs)
        try:
            returncode = launch.wait(max(0.0, timeout - (time.monotonic() - launch.t0)))
            timed_out = returncode is None
        finally:
            _end(launch.procs, 0.0)
        stdout, stderr = launch.output()
    return returncode, stdout, stderr, time.monotonic() - launch.t0, timed_out
