"""The output-folder lock: one live run per ``--output_dir``.

Two runs writing into one folder interleave ``metrics.jsonl``, overwrite each other's
``all_results.json`` and checkpoints, and nothing says so. So the recipe takes a lock before
any process group exists, and a second run into a live folder is refused on every rank.

The lock is ``<output_dir>/.fl_accel.lock``, a small JSON file naming the run that holds it:
host, pid, start time, run name and a *launch id* that every rank of one launch computes
alike from its launcher's environment (``MASTER_ADDR:MASTER_PORT`` and torchrun's
``TORCHELASTIC_RUN_ID``; a plain ``python`` run: its host and pid). It works on shared
filesystems: the global rank 0 creates it with ``os.link`` of a complete temporary file
(atomic and exclusive on POSIX filesystems, NFS included), so no rank ever reads half a lock,
and refreshes its modification time every :data:`HEARTBEAT_S` seconds. Every other rank refuses
when the lock it finds belongs to another live launch. (Two launches started in the same
instant: the loser's other ranks may find no lock yet; its rank 0 refuses and the launcher
then stops them, before their first collective completes.)

A lock is *stale*, and is taken over, when its holder is gone: on the same host, its pid no
longer runs; on another host, its heartbeat is older than :data:`STALE_S`. A relaunch of the
same launch (torchrun ``--max-restarts``: the same address, port and run id) keeps the lock.
The holder removes it when the run ends; a killed run leaves it stale.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

LOCK_NAME = ".fl_accel.lock"
HEARTBEAT_S = 30.0
"""Seconds between two refreshes of the lock's modification time by its holder."""
STALE_S = 180.0
"""A lock from another host whose heartbeat is older than this is stale."""


class RunLockError(RuntimeError):
    """The folder is held by another live run (the message names it), or rank 0 never locked it."""


def launch_id(environ=None) -> str:
    """The same string on every rank of one launch, another for every other live launch."""
    env = os.environ if environ is None else environ
    if "MASTER_PORT" in env:
        return (f"{env.get('MASTER_ADDR', 'localhost')}:{env['MASTER_PORT']}/"
                f"{env.get('TORCHELASTIC_RUN_ID', 'none')}")
    return f"{socket.gethostname()}/pid{os.getpid()}"


def _read(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: treated as held by an unknown run until it goes stale


def process_alive(pid: int) -> bool:
    """The process runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:  # gone between the two checks
        return False
    except (OSError, IndexError):
        return True


def is_stale(holder: dict, path: str, now: float | None = None) -> bool:
    """True when the run that wrote ``holder`` (the lock at ``path``) is gone."""
    now = time.time() if now is None else now
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        return not process_alive(holder["pid"])
    try:
        return now - os.path.getmtime(path) > STALE_S
    except FileNotFoundError:
        return True


def describe(holder: dict) -> str:
    if not holder:
        return "an unknown run (unreadable lock)"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return (f"run {holder.get('run_name')!r} (host {holder.get('host')}, pid {holder.get('pid')}, started "
            f"{started}, launch {holder.get('launch')})")


class RunLock:
    """The lock of ``output_dir`` for this rank (``rank`` 0 holds it; the others check it).

    ``acquire()`` raises :class:`RunLockError` naming the live run that holds the folder; on
    rank 0 it starts the heartbeat, and ``release()`` (also at interpreter exit) removes the
    lock if it is still this launch's."""

    def __init__(self, output_dir: str, run_name: str, rank: int = 0, environ=None):
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.output_dir, self.run_name, self.rank = output_dir, run_name, rank
        self.launch = launch_id(environ)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held = False
        self._created = False

    def _refuse(self, holder: dict) -> RunLockError:
        return RunLockError(f"the output folder {self.output_dir} is in use by {describe(holder)}. Two runs in "
                            f"one folder would mix their metrics, results and checkpoints: wait for that run to "
                            f"end (or stop it), or choose another --output_dir / --run_name")

    def acquire(self) -> "RunLock":
        if self.rank != 0:  # only rank 0 creates the folder (and removes it if the run wrote nothing)
            return self._check()
        self._created = not os.path.isdir(self.output_dir)
        os.makedirs(self.output_dir, exist_ok=True)
        return self._take()

    def _take(self) -> "RunLock":
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "launch": self.launch,
              "run_name": self.run_name}
        tmp = f"{self.path}.{me['host']}.{me['pid']}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(me, fh)
        try:
            for _ in range(3):
                try:
                    os.link(tmp, self.path)  # exclusive: fails if a lock exists
                    break
                except FileExistsError:
                    holder = _read(self.path)
                    if holder is None:
                        continue  # removed meanwhile: try again
                    if holder.get("launch") == self.launch:  # a relaunch of this launch keeps it
                        os.replace(tmp, self.path)
                        break
                    if not is_stale(holder, self.path):
                        raise self._refuse(holder) from None
                    stale = f"{self.path}.stale.{me['pid']}"
                    try:
                        os.rename(self.path, stale)  # only one taker wins the rename
                        os.remove(stale)
                    except FileNotFoundError:
                        pass
            else:
                raise self._refuse(_read(self.path) or {})
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        self.held = True
        self._thread = threading.Thread(target=self._beat, name="fl_accel-run-lock", daemon=True)
        self._thread.start()
        import atexit

        atexit.register(self.release)
        return self

    def _check(self) -> "RunLock":
        """Refuse if another live launch holds the folder; otherwise go on (rank 0 takes the lock
        or refuses, and the launcher then ends this rank before any collective completes)."""
        holder = _read(self.path)
        if holder and holder.get("launch") != self.launch and not is_stale(holder, self.path):
            raise self._refuse(holder)
        return self

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        """Remove the lock if this launch still holds it (rank 0); idempotent."""
        self._stop.set()
        if not self.held:
            return
        self.held = False
        holder = _read(self.path)
        if holder and holder.get("launch") == self.launch and holder.get("pid") == os.getpid():
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
            if self._created:  # a run refused before writing anything leaves no empty folder behind
                try:
                    os.rmdir(self.output_dir)
                except OSError:
                    pass
