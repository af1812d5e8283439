"""Make the repository root importable (fl_accel, recipes, scripts) however pytest is started,
and, with ``FL_ACCEL_TEST_CPU=N``, report the N tests that used the most CPU seconds.

CPU of a test = this process's user+system time, plus that of every child it reaped
(subprocesses, torchrun and its ranks), plus that of the ranks the fork launcher's server
reaped (tests/_forkserver.py), over the test's setup, call and teardown. On a loaded
machine wall seconds (``--durations``) mostly measure the load; CPU seconds do not.
"""

import os
import resource
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

_CPU: dict[str, tuple[float, float]] = {}


def _cpu_now() -> float:
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    server = sys.modules.get("_forkserver")
    pid = getattr(getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None), "_forkserver_pid", None)
    if server is not None and pid:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
        except OSError:
            pass
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not os.environ.get("FL_ACCEL_TEST_CPU"):
        yield
        return
    c0, t0 = _cpu_now(), time.monotonic()
    yield
    _CPU[item.nodeid] = (_cpu_now() - c0, time.monotonic() - t0)


def pytest_terminal_summary(terminalreporter):
    n = int(os.environ.get("FL_ACCEL_TEST_CPU") or 0)
    if not n or not _CPU:
        return
    total = sum(c for c, _ in _CPU.values())
    terminalreporter.write_sep("=", f"CPU seconds per test (top {n}; all {len(_CPU)} tests: {total:.0f} CPU-s)")
    for nodeid, (cpu, wall) in sorted(_CPU.items(), key=lambda kv: -kv[1][0])[:n]:
        terminalreporter.write_line(f"{cpu:8.1f} CPU-s {wall:8.1f} s  {nodeid}")
