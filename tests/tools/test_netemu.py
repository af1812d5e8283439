"""scripts/netemu.py: shaped links between network namespaces, gloo across them, full teardown.

Needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN); skips otherwise. CI runs as root.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from scripts import netemu
from scripts.netemu import Emulator

_ok, _reason = netemu.check_privileges()
needs_root = pytest.mark.skipif(not _ok, reason="needs root/CAP_NET_ADMIN to create network namespaces")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gone(emu: Emulator) -> None:
    names = netemu.list_namespaces()
    assert not any(ns in names for ns in emu.namespaces), names
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert emu.id not in links  # no veth end or bridge of ours survives in the root namespace
    assert not emu.exists()


@needs_root
def test_shaped_link_rate_and_teardown():
    emu = Emulator(nodes=2, rate="100mbit")
    with emu:
        assert emu.exists()
        assert emu.address(0) == "10.213.0.1" and emu.address(1) == "10.213.0.2"
        r = emu.measure(0, 1, seconds=2.5)
        back = emu.measure(1, 0, seconds=1.0)
    print(f"set {r['set_bits_per_s'] / 1e6:.0f} Mbit/s, achieved {r['bits_per_s'] / 1e6:.1f} Mbit/s "
          f"(reverse {back['bits_per_s'] / 1e6:.1f})")
    assert r["set_bits_per_s"] == 100_000_000
    assert 0.8 <= r["ratio"] <= 1.2, r
    assert 0.8 <= back["ratio"] <= 1.2, back
    _gone(emu)


@needs_root
def test_teardown_after_exception():
    emu = Emulator(nodes=3, rate="50mbit", qdisc="htb")
    with pytest.raises(RuntimeError, match="boom"):
        with emu:
            assert len(emu.namespaces) == 4 and emu.exists()
            raise RuntimeError("boom")
    _gone(emu)


# gloo across the emulator (2 nodes x 2 processes, a 1 MiB all-reduce: right on every rank,
# each node's ranks on its own interface, the bytes through both shaped links): asserted on the
# launch of tests/tools/test_bench_runs.py::test_runner_meters_a_launch_over_the_emulator, which goes through
# Emulator.run_torchrun too (one launch of 4 torch processes for both).


@needs_root
def test_cli_run_reports_failure_of_one_node(tmp_path):
    script = tmp_path / "fail_on_node1.py"
    script.write_text("import os, sys\nsys.exit(7 if os.environ['GROUP_RANK'] == '1' else 0)\n")
    proc = subprocess.run([sys.executable, "-m", "scripts.netemu", "run", "--nodes", "2",
                           "--rate", "100mbit", "--timeout", "50", "--grace", "3", "--", "--nproc_per_node", "1", str(script)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    # torchrun exits 1 when a worker fails (the worker's own code, 7, is in its report);
    # node 0's agent, left waiting in its exit barrier, was killed after --grace and does not count.
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "exitcode  : 7" in proc.stderr
    ours = json.loads(proc.stderr.split("netemu: namespaces ", 1)[1].splitlines()[0])
    assert len(ours) == 3 and not set(ours) & set(netemu.list_namespaces())


@needs_root
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_cli_signal_tears_down(tmp_path, signum):
    script = tmp_path / "sleep.py"
    started = tmp_path / "started"
    script.write_text(f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep(300)\n")
    proc = subprocess.Popen([sys.executable, "-m", "scripts.netemu", "run", "--nodes", "2",
                             "--rate", "100mbit", "--", "--nproc_per_node", "1", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and not started.exists() and proc.poll() is None:
            time.sleep(0.1)
        assert started.exists(), "the emulated job did not start"
        proc.send_signal(signum)
        try:  # teardown: SIGTERM to each torchrun's group, 5 s grace, then the namespaces (a loaded CI box is slow)
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"netemu did not tear down within 120 s of the signal; its stderr:\n"
                                 f"{(exc.stderr or b'')[-3000:]}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-2000:]
    ours = json.loads(err.split("netemu: namespaces ", 1)[1].splitlines()[0])
    assert not set(ours) & set(netemu.list_namespaces())
    # the sleeping workers were stopped too
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(script) not in ps


@needs_root
def test_cli_down_removes_leftovers_of_a_crashed_emulator():
    emu = Emulator(nodes=2, rate="100mbit").up()  # never torn down: as after a SIGKILL
    sleeper = emu.popen(0, ["sleep", "300"])
    emu._procs.clear()  # forget it, like a crashed parent would
    assert emu.exists()
    proc = subprocess.run([sys.executable, "-m", "scripts.netemu", "down", "--id", emu.id],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert emu.hub in proc.stdout
    assert sleeper.wait(timeout=10) is not None
    _gone(emu)
