"""scripts.launch starting real processes: process groups, timeouts, CPU metering, a fresh
interpreter's imports, and one real torchrun launch (argv, environment and ports without a
process: tests/unit/test_launch_args.py)."""

import os
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
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))).stdout
    assert out.split() == ["False", "False"]


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
