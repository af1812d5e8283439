"""Communication accounting: bytes and seconds of every collective, by mesh axis.

FSDP2 issues its collectives through ``torch.distributed.all_gather_single``,
``reduce_scatter_single`` (parameters, gradients) and ``all_reduce`` (the HSDP
gradient all-reduce over the replicate group); see
``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``. While a
:class:`CommMeter` is installed, those three entry points (plus
``all_gather_into_tensor``, used by the FL+HSDP sync) are wrapped: each call is
attributed to the mesh axis whose rank set equals the call's process group, and
charged with the bytes a ring algorithm sends per rank:

* all-gather / reduce-scatter of a full tensor of M bytes over p ranks: (p-1)/p * M;
* all-reduce of M bytes over p ranks: 2 (p-1)/p * M.

These are the same formulas as :mod:`fl_accel.cost_model`, so measurement and
model can be compared axis by axis. Seconds are host wall time spent inside the
call (and in ``wait()`` of asynchronous work); with CUDA streams that is a lower
bound of the link time.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch.distributed as dist

_PATCHED = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "all_reduce")


@dataclass
class AxisStats:
    """Totals for one mesh axis on this rank."""

    bytes: int = 0
    """Ring-algorithm bytes sent by this rank (see module docstring)."""
    seconds: float = 0.0
    """Host seconds spent in the collectives (including wait())."""
    calls: int = 0
    """Number of collectives."""
    by_op: dict = field(default_factory=lambda: defaultdict(int))
    """Bytes per collective kind ("all_gather", "reduce_scatter", "all_reduce")."""


class CommStats:
    """Per-axis counters; ``stats["fl"].bytes`` etc. Axes with no traffic read as 0."""

    def __init__(self, axes=("fl", "dp_replicate", "dp_shard")):
        self.axes = tuple(axes)
        self._stats = {a: AxisStats() for a in self.axes}

    def __getitem__(self, axis: str) -> AxisStats:
        return self._stats[axis]

    def record(self, axis: str, op: str, nbytes: int, seconds: float) -> None:
        s = self._stats[axis]
        s.bytes += int(nbytes)
        s.seconds += seconds
        s.calls += 1
        s.by_op[op] += int(nbytes)

    def __repr__(self) -> str:
        return f"CommStats({ {a: (s.bytes, round(s.seconds, 4), s.calls) for a, s in self._stats.items()} }"

    def reset(self) -> None:
        self._stats = {a: AxisStats() for a in self.axes}

    def as_dict(self) -> dict:
        """``{"fl": {"bytes": int, "seconds": float, "calls": int}, ...}``."""
        return {
            a: {"bytes": s.bytes, "seconds": s.seconds, "calls": s.calls, "by_op": dict(s.by_op)}
            for a, s in self._stats.items()
        }

    def flat(self, prefix: str = "comm") -> dict:
        """Flat dict for trackers: ``comm/fl/bytes``, ``comm/fl/seconds``, ..."""
        out = {}
        for a, s in self._stats.items():
            out[f"{prefix}/{a}/bytes"] = s.bytes
            out[f"{prefix}/{a}/seconds"] = s.seconds
            out[f"{prefix}/{a}/calls"] = s.calls
        return out


def ring_bytes(op: str, tensor_bytes: int, group_size: int) -> int:
    """Bytes one rank sends in a ring collective over ``group_size`` ranks.

    ``tensor_bytes`` is the *full* size M: the all-gather output, the
    reduce-scatter input, or the all-reduce buffer.
    """
    p = group_size
    if p <= 1:
        return 0
    if op in ("all_gather", "reduce_scatter"):
        return tensor_bytes * (p - 1) // p
    if op == "all_reduce":
        return 2 * tensor_bytes * (p - 1) // p
    raise ValueError(f"unknown collective {op!r}")


class _TimedWork:
    """Wraps an async ``dist.Work`` so the time spent in ``wait()`` is charged too."""

    def __init__(self, work, on_wait):
        self._work = work
        self._on_wait = on_wait

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self._work.wait(*args, **kwargs)
        self._on_wait(time.perf_counter() - t0)
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


class CommMeter:
    """Installs the counting wrappers on ``torch.distributed`` while active.

    Args:
        stats: where to add the counts.
        axis_of_ranks: maps a sorted tuple of global ranks to a mesh-axis name.
            A process group whose rank set is not in the map is not counted.

    Only one meter can be installed per process; nested installs raise RuntimeError.
    """

    _lock = threading.Lock()
    _active: "CommMeter | None" = None

    def __init__(self, stats: CommStats, axis_of_ranks: dict[tuple[int, ...], str]):
        self.stats = stats
        self.axis_of_ranks = dict(axis_of_ranks)
        self._cache: dict[int, str | None] = {}
        self._originals: dict[str, object] = {}

    def _axis(self, group) -> str | None:
        key = id(group)
        if key not in self._cache:
            g = group if group is not None else dist.group.WORLD
            ranks = tuple(sorted(dist.get_process_group_ranks(g)))
            self._cache[key] = self.axis_of_ranks.get(ranks)
        return self._cache[key]

    def _wrap(self, name: str, original):
        op = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
              "reduce_scatter_single": "reduce_scatter", "all_reduce": "all_reduce"}[name]
        meter = self

        def wrapper(*args, **kwargs):
            group = kwargs.get("group")
            if group is None and name == "all_reduce" and len(args) >= 3:
                group = args[2]
            axis = meter._axis(group)
            if axis is None:
                return original(*args, **kwargs)
            if op == "all_gather":
                full = kwargs.get("output_tensor", args[0] if args else None)
            elif op == "reduce_scatter":
                full = kwargs.get("input", args[1] if len(args) > 1 else None)
            else:
                full = kwargs.get("tensor", args[0] if args else None)
            p = dist.get_world_size(group)
            nbytes = ring_bytes(op, full.numel() * full.element_size(), p)
            t0 = time.perf_counter()
            work = original(*args, **kwargs)
            elapsed = time.perf_counter() - t0
            meter.stats.record(axis, op, nbytes, elapsed)
            if work is not None and kwargs.get("async_op", False):
                return _TimedWork(work, lambda s: meter._add_seconds(axis, s))
            return work

        wrapper.__wrapped__ = original
        return wrapper

    def _add_seconds(self, axis: str, seconds: float) -> None:
        self.stats[axis].seconds += seconds

    def install(self) -> "CommMeter":
        with CommMeter._lock:
            if CommMeter._active is not None:
                raise RuntimeError("a CommMeter is already installed in this process")
            for name in _PATCHED:
                original = getattr(dist, name)
                self._originals[name] = original
                setattr(dist, name, self._wrap(name, original))
            CommMeter._active = self
        return self

    def uninstall(self) -> None:
        with CommMeter._lock:
            if CommMeter._active is not self:
                return
            for name, original in self._originals.items():
                setattr(dist, name, original)
            self._originals.clear()
            CommMeter._active = None

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()
        return False
