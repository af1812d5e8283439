"""The tests' fork launcher (tests/_forkserver.py) explains a hang: a launch that runs past its
timeout leaves every running rank's Python stacks (all threads) in its output before the ranks
are killed, so a test that fails on a timeout says where each rank was."""

from __future__ import annotations

import shutil
import time

from _launch import launch_env, start_forked

HUNG = '''
import sys, threading, time

def blocked_in_a_helper_thread():
    threading.Event().wait()

def blocked_in_the_main_thread():
    time.sleep(600)

threading.Thread(target=blocked_in_a_helper_thread, daemon=True).start()
print("started", flush=True)
blocked_in_the_main_thread()
'''


def test_a_timed_out_launch_reports_each_ranks_python_stacks(tmp_path):
    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    launch = start_forked(2, script, env=launch_env(), log_dir=tmp_path / "logs")
    try:
        deadline = time.monotonic() + 120  # the ranks start in a second on an idle machine
        while "started" not in launch.output()[0].replace("started", "", 1):
            assert time.monotonic() < deadline and launch.poll() is None, launch.output()
            time.sleep(0.1)
        assert launch.wait(0.5) is None  # the timeout: the ranks are asked for their stacks
        assert launch.stacks_dumped == [0, 1]
        assert launch.poll() is None  # dumping the stacks does not end a rank
    finally:
        launch.kill()
    out, err = launch.output()
    assert out.count("started") == 2, out
    ranks = err.split("--- rank 0: native stacks")[0].split("--- rank ")[1:]  # each rank's stderr
    assert [r.split(" ---")[0] for r in ranks] == ["0", "1"], err
    for text in ranks:
        assert "most recent call first" in text and "blocked_in_the_main_thread" in text, err
        assert "blocked_in_a_helper_thread" in text, err  # every thread, not only the main one
    assert "[fork launcher] timed out after" in err and "ranks still running then: [0, 1]" in err, err
    if shutil.which("gdb"):  # the native stacks too: where a C++ deadlock shows
        for r in (0, 1):
            native = err.split(f"--- rank {r}: native stacks (gdb) ---")[1]
            assert "Thread 1 " in native and "#0 " in native, err
