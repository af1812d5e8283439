"""How much of the machine other processes used while a run of ours ran (:class:`HostLoad`).

The recipe records it in ``all_results.json`` (``host``, read by ``scripts/compare.py``); the
tests and the benchmark meter their launches with it. Needs psutil, imported when a meter is
made, not by importing this module (Accelerate depends on psutil, so a training environment
has it; should it be missing, the recipe records a null ``host``).
"""

from __future__ import annotations

import os
import time
from typing import Any


def _machine_busy_s() -> float:
    """Busy CPU seconds of all CPUs since boot (everything but idle and iowait; guest time
    is already inside user/nice on Linux, so it is not added again)."""
    import psutil

    t = psutil.cpu_times()
    busy = t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) \
        + getattr(t, "steal", 0.0)
    return float(busy)


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and every live descendant, each with the children it has
    reaped (``children_user``/``children_system``). The sum is continuous across a
    child's exit: its time moves into its parent's ``children_*`` when it is reaped."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        total += t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)
    return total


class HostLoad:
    """How much of the machine other processes used while something of ours ran.

    Over the interval between :meth:`start` and :meth:`stop` (or a ``with`` block) it
    measures the machine-wide busy CPU seconds and the CPU seconds of one process tree
    (``pid`` and its descendants, with the children they reaped), then

        background_cpu_share = (machine_busy_s - own_cpu_s) / (cpus * wall_s)

    i.e. the share of all CPUs that other processes kept busy: 0 on a quiet machine,
    0.5 when others used one of two cores throughout. Kernel time spent for us outside
    our processes (e.g. softirq of emulated links) counts as background.

    Args:
        pid: root of the process tree that counts as ours; default this process (then
            everything it starts counts, while it runs and after it is reaped). Under
            torchrun, rank 0 passes ``os.getppid()`` (the agent) to count all local ranks.
            A tree that another tree's processes are not part of (e.g. the other node's
            torchrun under an emulator) sees them as background. The root must still
            be alive (not reaped) at :meth:`stop`; to meter a child of yours that ends
            first, meter this process instead (its reaped children count).

    Raises:
        ModuleNotFoundError: psutil is not installed (at construction; importing this module
            does not need it).

    Attributes (after :meth:`stop`): ``wall_s``, ``machine_busy_s``, ``own_cpu_s`` (CPU
    seconds), ``cpus`` (``psutil.cpu_count()``, the CPUs ``/proc/stat`` covers) and
    ``background_cpu_share`` (a fraction in [0, 1]; None for a zero-length interval).
    """

    def __init__(self, pid: int | None = None):
        import psutil

        self.pid = os.getpid() if pid is None else int(pid)
        self.cpus = psutil.cpu_count() or 1
        self._t0: float | None = None
        self.wall_s = self.machine_busy_s = self.own_cpu_s = 0.0
        self.background_cpu_share: float | None = None

    def start(self) -> "HostLoad":
        """Begin the interval (machine and tree CPU seconds now); returns ``self``."""
        self._t0, self._busy0, self._own0 = time.monotonic(), _machine_busy_s(), _tree_cpu_s(self.pid)
        return self

    def sample(self) -> dict[str, Any]:
        """The figures from :meth:`start` until now, without stopping (see :meth:`as_dict`)."""
        if self._t0 is None:
            raise RuntimeError("HostLoad.sample() before start()")
        self.wall_s = time.monotonic() - self._t0
        self.machine_busy_s = max(0.0, _machine_busy_s() - self._busy0)
        self.own_cpu_s = max(0.0, _tree_cpu_s(self.pid) - self._own0)
        if self.wall_s > 0:
            share = (self.machine_busy_s - self.own_cpu_s) / (self.cpus * self.wall_s)
            self.background_cpu_share = min(1.0, max(0.0, share))
        return self.as_dict()

    def stop(self) -> dict[str, Any]:
        """End the interval; returns :meth:`as_dict`."""
        return self.sample()

    def as_dict(self) -> dict[str, Any]:
        """``{"background_cpu_share", "cpus", "wall_s", "machine_busy_cpu_s", "own_cpu_s"}``:
        the ``host`` entry of a recipe's ``all_results.json`` (read by scripts/compare.py)."""
        return {"background_cpu_share": self.background_cpu_share, "cpus": self.cpus, "wall_s": self.wall_s,
                "machine_busy_cpu_s": self.machine_busy_s, "own_cpu_s": self.own_cpu_s}

    def __enter__(self) -> "HostLoad":
        """:meth:`start`."""
        return self.start()

    def __exit__(self, *exc: Any) -> bool:
        """:meth:`stop`; exceptions propagate."""
        self.stop()
        return False
