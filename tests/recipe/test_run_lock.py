"""The output-folder lock (recipes/run_lock.py): unit tests of its rules (no process is
started: the 'other runs' are lock files written by hand), and two real launches into one
folder at the same moment (tests/test_run_lock.py::test_two_launches_into_one_folder)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from recipes import run_lock
from recipes.run_lock import LOCK_NAME, RunLock, RunLockError

ENV_A = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29001", "TORCHELASTIC_RUN_ID": "a"}
ENV_B = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29002", "TORCHELASTIC_RUN_ID": "b"}


def _plant(folder, **holder):
    folder.mkdir(parents=True, exist_ok=True)
    base = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "launch": "other",
            "run_name": "the-other-run"}
    (folder / LOCK_NAME).write_text(json.dumps({**base, **holder}))
    return folder / LOCK_NAME


def test_rank0_takes_the_lock_and_releases_it(tmp_path):
    out = tmp_path / "run"
    lock = RunLock(str(out), "mine", rank=0, environ=ENV_A).acquire()
    holder = json.loads((out / LOCK_NAME).read_text())
    assert holder["launch"] == "127.0.0.1:29001/a" and holder["pid"] == os.getpid() and holder["run_name"] == "mine"
    RunLock(str(out), "mine", rank=1, environ=ENV_A).acquire()  # another rank of the same launch
    lock.release()
    assert not (out / LOCK_NAME).exists() and not out.exists()  # nothing written: no empty folder left


def test_a_live_run_refuses_every_rank_and_is_named(tmp_path):
    out = tmp_path / "run"
    _plant(out)  # held by this very process: alive
    for rank in (0, 1):
        with pytest.raises(RunLockError, match=r"is in use by run 'the-other-run' \(host .*, pid \d+"):
            RunLock(str(out), "mine", rank=rank, environ=ENV_B).acquire()
    assert json.loads((out / LOCK_NAME).read_text())["run_name"] == "the-other-run"  # untouched


def test_a_dead_holder_on_this_host_is_stale(tmp_path):
    out = tmp_path / "run"
    proc_pid = os.fork()
    if proc_pid == 0:
        os._exit(0)
    os.waitpid(proc_pid, 0)  # a pid that ran here and is gone
    _plant(out, pid=proc_pid)
    lock = RunLock(str(out), "mine", rank=0, environ=ENV_B).acquire()
    assert json.loads((out / LOCK_NAME).read_text())["run_name"] == "mine"
    lock.release()


def test_a_killed_but_unreaped_holder_is_stale(tmp_path):
    """A rank killed by a signal stays a zombie until its launcher reaps it: not alive."""
    out = tmp_path / "run"
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    os.kill(pid, 9)
    time.sleep(0.3)  # dead, not reaped yet
    _plant(out, pid=pid)
    try:
        RunLock(str(out), "mine", rank=0, environ=ENV_B).acquire().release()
    finally:
        os.waitpid(pid, 0)


def test_another_hosts_lock_is_stale_only_after_its_heartbeat_stops(tmp_path):
    out = tmp_path / "run"
    path = _plant(out, host="some-other-host", pid=1)
    with pytest.raises(RunLockError, match="some-other-host"):
        RunLock(str(out), "mine", rank=0, environ=ENV_B).acquire()
    old = time.time() - run_lock.STALE_S - 5
    os.utime(path, (old, old))
    RunLock(str(out), "mine", rank=0, environ=ENV_B).acquire().release()


def test_a_relaunch_of_the_same_launch_keeps_the_lock(tmp_path):
    out = tmp_path / "run"
    _plant(out, launch="127.0.0.1:29001/a")  # e.g. torchrun --max-restarts: same address, port and run id
    lock = RunLock(str(out), "mine", rank=0, environ=ENV_A).acquire()
    assert lock.held
    lock.release()


def test_other_ranks_check_the_lock_they_find(tmp_path):
    """A rank other than 0 creates nothing: without a lock (rank 0 not there yet) it goes on,
    with its own launch's lock it goes on, with another live launch's it refuses."""
    out = tmp_path / "run"
    RunLock(str(out), "mine", rank=1, environ=ENV_A).acquire()
    assert not out.exists()
    lock = RunLock(str(out), "mine", rank=0, environ=ENV_A).acquire()
    RunLock(str(out), "mine", rank=1, environ=ENV_A).acquire()
    with pytest.raises(RunLockError, match="is in use by run 'mine'"):
        RunLock(str(out), "theirs", rank=1, environ=ENV_B).acquire()
    lock.release()


def test_heartbeat_refreshes_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    out = tmp_path / "run"
    lock = RunLock(str(out), "mine", rank=0, environ=ENV_A).acquire()
    old = time.time() - 1000
    os.utime(out / LOCK_NAME, (old, old))
    time.sleep(0.5)
    assert time.time() - os.path.getmtime(out / LOCK_NAME) < 5
    lock.release()
