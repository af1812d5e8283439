"""The unit tier starts no process: while a test of tests/unit sets up, runs and tears down,
every way of starting one (subprocess, multiprocessing, os.fork, os.posix_spawn, os.system)
raises, and the test fails naming what it tried to start, even if the code under test caught
the error. A test that needs another process belongs to tests/tools, tests/recipe or
tests/dist (tests/conftest.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import traceback

import _posixsubprocess
import pytest

_STARTERS = [(subprocess, "_fork_exec"), (_posixsubprocess, "fork_exec"), (os, "fork"), (os, "forkpty"),
             (os, "posix_spawn"), (os, "posix_spawnp"), (os, "system")]
"""What subprocess (``_fork_exec``, or ``os.posix_spawn`` where it uses it), multiprocessing
(``os.fork``; ``_posixsubprocess.fork_exec`` for spawn and forkserver), pty and os.system
start processes with."""


class ProcessInUnitTest(RuntimeError):
    """Raised where a unit test would have started a process."""


@contextlib.contextmanager
def _no_processes(nodeid: str, phase: str):
    tried: list[str] = []

    def refuse(name):
        def starter(*args, **kwargs):
            where = "".join(traceback.format_stack(limit=6)[:-1])
            tried.append(f"{name} from\n{where}")
            raise ProcessInUnitTest(f"{nodeid} tried to start a process ({name}) during {phase}: tests/unit starts "
                                    f"none; move the test to tests/tools, tests/recipe or tests/dist")
        return starter

    saved = [(mod, name, getattr(mod, name)) for mod, name in _STARTERS if hasattr(mod, name)]
    for mod, name, _ in saved:
        setattr(mod, name, refuse(f"{mod.__name__}.{name}"))
    try:
        yield
    finally:
        for mod, name, original in saved:
            setattr(mod, name, original)
    if tried:  # the code under test may have caught ProcessInUnitTest and carried on
        pytest.fail(f"{nodeid} tried to start a process during {phase} ({len(tried)} time(s)); tests/unit starts "
                    f"none: move the test to tests/tools, tests/recipe or tests/dist. First attempt: {tried[0]}",
                    pytrace=False)


def _build_font_cache() -> None:
    """matplotlib builds its font cache at its first import on a machine, asking ``fc-list``
    (a process): build it when this file loads, before any test, so a fresh machine's first
    plot test does not trip the guard."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.font_manager  # noqa: F401


_build_font_cache()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _no_processes(item.nodeid, "setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _no_processes(item.nodeid, "the call"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with _no_processes(item.nodeid, "teardown"):
        return (yield)
