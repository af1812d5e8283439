"""scripts.launch without starting a process: argv, environment, ports, the retry on a taken
port (a stand-in for the launch). Its process groups, timeouts, metering and a real torchrun
launch: tests/recipe/test_launch.py."""

import os
import socket
import sys

import pytest

from scripts import launch


def test_free_port_is_bindable_varies_and_is_below_the_ephemeral_range():
    """Below the range the kernel hands to bind(0) and outgoing connections, so that a
    listener of another process cannot take it before a launched rank 0 binds it (a CI run
    lost a torchft group to EADDRINUSE on a port drawn inside that range)."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = {launch.free_port() for _ in range(5)}
    assert len(ports) > 1
    assert all(20000 <= p < low for p in ports), (ports, low)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_torchrun_argv():
    argv = launch.torchrun_argv(4, "train.py", "--lr", 1e-3, port=1234)
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert argv[argv.index("--nproc_per_node") + 1] == "4" and argv[argv.index("--master_port") + 1] == "1234"
    assert argv[-3:] == ["train.py", "--lr", "0.001"]
    mod = launch.torchrun_argv(2, "recipes.pretrain", nnodes=2, node_rank=1, master_addr="10.0.0.1", module=True,
                               extra_flags=["--max_restarts", "1"])
    assert mod[-2:] == ["-m", "recipes.pretrain"] and mod[mod.index("--node_rank") + 1] == "1"
    assert mod.index("--max_restarts") < mod.index("recipes.pretrain")
    assert "--nproc_per_node" not in launch.torchrun_argv(None, "x.py", port=1)
    with pytest.raises(ValueError, match="nproc"):
        launch.torchrun_argv(0, "x.py")
    with pytest.raises(ValueError, match="node_rank"):
        launch.torchrun_argv(1, "x.py", nnodes=2, node_rank=2)


def test_child_env(monkeypatch):
    monkeypatch.setenv("FL_ACCEL_SYNC_EVERY", "3")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    env = launch.child_env({"FOO": "1"}, pythonpath=["/repo"])
    assert "FL_ACCEL_SYNC_EVERY" not in env and env["FOO"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert env["PYTHONPATH"] == os.pathsep.join(["/repo", "/elsewhere"])
    assert os.environ["FL_ACCEL_SYNC_EVERY"] == "3"  # ours is untouched
    assert env["WANDB_MODE"] == "offline" and "WANDB_MODE" not in launch.child_env({"WANDB_MODE": None})


def test_run_torchrun_retries_on_a_taken_port(monkeypatch):
    calls = []

    def fake_run(argv, **kw):
        calls.append(argv)
        if len(calls) == 1:
            return launch.Result(1, "", "RuntimeError: EADDRINUSE: address already in use", 0.1, False)
        return launch.Result(0, "ok", "", 0.1, False)

    monkeypatch.setattr(launch, "run", fake_run)
    assert launch.run_torchrun(2, "x.py", timeout=5).ok and len(calls) == 2
    calls.clear()
    monkeypatch.setattr(launch, "run", lambda argv, **kw: calls.append(argv) or launch.Result(1, "", "boom", 0, False))
    assert launch.run_torchrun(2, "x.py", timeout=5).returncode == 1 and len(calls) == 1

