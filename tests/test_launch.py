"""scripts.launch: argv, environment, process groups, timeouts; recipes.host_load: CPU metering
(no torch needed except the one real torchrun launch)."""

import os
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from recipes.host_load import HostLoad
from scripts import launch

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_import_pulls_in_neither_torch_nor_accelerate():
    code = "import sys, scripts.launch; print('torch' in sys.modules, 'accelerate' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout
    assert out.split() == ["False", "False"]


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
    env = launch.child_env({"FOO": "1"}, pythonpath=["/repo"])
    assert "FL_ACCEL_SYNC_EVERY" not in env and env["FOO"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert env["PYTHONPATH"] == os.pathsep.join(["/repo", "/elsewhere"])
    assert os.environ["FL_ACCEL_SYNC_EVERY"] == "3"  # ours is untouched


def test_run_captures_output_and_exit_code():
    res = launch.run([sys.executable, "-c", "import sys; print('hi'); print('oops', file=sys.stderr); sys.exit(3)"],
                     timeout=30)
    assert (res.returncode, res.stdout.strip(), res.stderr.strip(), res.timed_out) == (3, "hi", "oops", False)
    assert not res.ok and "rc=3" in res.tail() and res.seconds > 0


def test_timeout_kills_the_whole_process_group(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    code = textwrap.dedent(f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        open({str(pidfile)!r}, "w").write(str(p.pid))
        time.sleep(300)
    """)
    t0 = time.monotonic()
    res = launch.run([sys.executable, "-c", code], timeout=3)
    assert res.timed_out and res.returncode is None and time.monotonic() - t0 < 20
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while psutil.pid_exists(grandchild) and psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the grandchild survived the timeout"
        time.sleep(0.05)


def test_terminate_escalates_to_sigkill():
    code = "import signal, time, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(300)"
    proc = launch.start([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    launch.terminate(proc, grace=0.5)
    assert proc.returncode == -9 and time.monotonic() - t0 < 10
    assert launch.exit_code(proc.returncode) == 137 and launch.exit_code(None) == 1 and launch.exit_code(2) == 2
    launch.terminate(proc)  # already gone: a no-op


def test_hostload_counts_our_tree_and_sees_other_processes():
    # A burns CPU inside the metered tree (a parent that runs and reaps it, then waits);
    # B burns CPU outside it: B must show up as background, A as ours.
    parent = launch.start([sys.executable, "-c", "import subprocess, sys, time\n"
                                                 f"subprocess.run([sys.executable, '-c', {BURN.format(s=0.6)!r}])\n"
                                                 "print('done', flush=True); time.sleep(300)"],
                          stdout=subprocess.PIPE)
    load = HostLoad(pid=parent.pid).start()
    outsider = launch.start([sys.executable, "-c", BURN.format(s=0.6)])
    p_out = psutil.Process(outsider.pid)
    out_cpu = 0.0
    while outsider.poll() is None:
        try:
            t = p_out.cpu_times()
            out_cpu = t.user + t.system
        except psutil.NoSuchProcess:
            break
        time.sleep(0.02)
    assert parent.stdout.readline().strip() == "done"  # A has exited and was reaped by the parent
    res = load.stop()
    launch.terminate(parent)
    assert res["own_cpu_s"] >= 0.4, res  # A's 0.6 s survived A's exit (moved into the parent's children time)
    background_cpu = res["background_cpu_share"] * res["cpus"] * res["wall_s"]
    assert background_cpu >= 0.5 * out_cpu > 0, (res, out_cpu)
    assert 0.0 <= res["background_cpu_share"] <= 1.0 and res["cpus"] == psutil.cpu_count()


def test_hostload_default_tree_is_this_process_and_its_reaped_children():
    with HostLoad() as load:
        assert launch.run([sys.executable, "-c", BURN.format(s=0.5)], timeout=60).ok
    assert load.own_cpu_s >= 0.45 and load.wall_s > 0 and load.background_cpu_share is not None
    assert set(load.as_dict()) >= {"background_cpu_share", "cpus"}
    with pytest.raises(RuntimeError, match="start"):
        HostLoad().sample()


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


def test_real_torchrun_two_processes(tmp_path):
    script = tmp_path / "hello.py"
    # One os.write per rank: a single write of under PIPE_BUF bytes to a pipe is atomic, whereas
    # print() may flush its pieces separately and the two ranks' lines can interleave.
    script.write_text("import os\nline = 'rank %s of %s omp %s\\n' % (os.environ['RANK'], "
                      "os.environ['WORLD_SIZE'], os.environ['OMP_NUM_THREADS'])\n"
                      "os.write(1, line.encode())\n")
    res = launch.run_torchrun(2, script, timeout=120, env=launch.child_env())
    assert res.ok, res.tail()
    lines = sorted(line for line in res.stdout.splitlines() if line.startswith("rank"))
    assert lines == ["rank 0 of 2 omp 1", "rank 1 of 2 omp 1"], res.stdout
