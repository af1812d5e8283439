"""Communication accounting: bytes and seconds of every collective, by mesh axis.

FSDP2 communicates through ``torch.distributed.all_gather_single``,
``reduce_scatter_single`` (torch 2.12: ``all_gather_into_tensor``, ``reduce_scatter_tensor``)
and ``all_reduce`` (HSDP's replicate group;
``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``); the sync adds
``all_to_all_single`` and ``broadcast``. While a :class:`CommMeter` is entered the entry
points this torch has are wrapped (:func:`fl_accel.compat.collective_entry_points`): each call goes to a bucket (the mesh axes, or "world" for the default
group) and is charged :func:`ring_bytes` (all-to-all: M is this rank's
input), so measurement and model compare axis by axis. Seconds are host time in the call
and in ``wait()`` (with CUDA streams a lower bound). Several meters may be entered at once,
each counting its own process groups. :class:`WaitClock` measures what the training stream
waits for the sync: CUDA events on GPUs, where host time reads ~0.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import compat
from .mesh import BUCKETS, WORLD
from .wire import ring_bytes

# entry point -> (collective kind, name of the "full tensor" argument, its position)
_OPS = {
    "all_gather_single": ("all_gather", "output_tensor", 0),
    "all_gather_into_tensor": ("all_gather", "output_tensor", 0),
    "reduce_scatter_single": ("reduce_scatter", "input", 1),
    "reduce_scatter_tensor": ("reduce_scatter", "input", 1),
    "all_reduce": ("all_reduce", "tensor", 0),
    "all_to_all_single": ("all_to_all", "input", 1),
    "broadcast": ("broadcast", "tensor", 0),
}
_GROUP_POS = {"all_reduce": 2, "broadcast": 2}


@dataclass
class AxisStats:
    """One bucket's totals on this rank: ring ``bytes``, host ``seconds``, ``calls``, ``by_op`` bytes."""

    bytes: int = 0
    seconds: float = 0.0
    calls: int = 0
    by_op: dict = field(default_factory=lambda: defaultdict(int))


class CommStats(dict):
    """Per-bucket counters: ``stats["fl"].bytes`` etc."""

    def __init__(self, buckets=BUCKETS):
        super().__init__({a: AxisStats() for a in buckets})

    def record(self, bucket: str, op: str, nbytes: int, seconds: float) -> None:
        s = self[bucket]
        s.bytes += int(nbytes)
        s.seconds += seconds
        s.calls += 1
        s.by_op[op] += int(nbytes)

    def as_dict(self) -> dict:
        return {a: {"bytes": s.bytes, "seconds": s.seconds, "calls": s.calls, "by_op": dict(s.by_op)}
                for a, s in self.items()}

    def load_dict(self, values: dict) -> None:
        for a, v in values.items():
            if a in self:
                s = self[a]
                s.bytes, s.seconds, s.calls = int(v["bytes"]), float(v["seconds"]), int(v["calls"])
                s.by_op = defaultdict(int, {k: int(b) for k, b in v.get("by_op", {}).items()})


class TimedWork:
    """An async ``dist.Work`` (None: abandoned, its wait is a no-op) whose ``wait()`` seconds go
    to ``on_wait``; with ``on_error``, a failure goes there instead of raising."""

    def __init__(self, work, on_wait=None, on_error=None):
        self._work, self._on_wait, self._on_error = work, on_wait, on_error

    def wait(self, *args, **kwargs):
        if self._work is None:
            return True
        t0, out = time.perf_counter(), True
        try:
            out = self._work.wait(*args, **kwargs)
        except Exception as exc:
            if self._on_error is None:
                raise
            self._on_error(exc)
        if self._on_wait is not None:
            self._on_wait(time.perf_counter() - t0)
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


_lock = threading.RLock()
_active: list["CommMeter"] = []
_originals: dict[str, object] = {}


def _wrap(name: str, original):
    op, arg_name, arg_pos = _OPS[name]

    def wrapper(*args, **kwargs):
        group = kwargs.get("group")
        if group is None and len(args) > _GROUP_POS.get(name, 99):
            group = args[_GROUP_POS[name]]
        claims = [(m, b) for m in list(_active) if (b := m.bucket_of(group)) is not None]
        if not claims:
            return original(*args, **kwargs)
        full = kwargs.get(arg_name, args[arg_pos] if len(args) > arg_pos else None)
        nbytes = int(ring_bytes(op, full.numel() * full.element_size(), dist.get_world_size(group)))
        t0 = time.perf_counter()
        work = original(*args, **kwargs)
        elapsed = time.perf_counter() - t0
        for m, bucket in claims:
            m.stats.record(bucket, op, nbytes, elapsed)
        if work is not None and kwargs.get("async_op", False):
            return TimedWork(work, lambda s: [m._add_seconds(b, s) for m, b in claims])
        return work

    wrapper.__wrapped__ = original
    return wrapper


class CommMeter:
    """Counts collectives into ``stats`` while entered (re-entrant): the default group as
    "world", others by ``group_buckets`` (ProcessGroup -> bucket), else ``rank_buckets``
    (sorted global ranks -> bucket, e.g. a library's group of the same ranks), else not."""

    def __init__(self, stats: CommStats, group_buckets: dict | None = None,
                 rank_buckets: dict[tuple[int, ...], str] | None = None):
        self.stats = stats
        self.group_buckets = dict(group_buckets or {})
        self.rank_buckets = dict(rank_buckets or {})
        self._cache: dict[int, str | None] = {}
        self._depth = 0

    def bucket_of(self, group) -> str | None:
        if group is None or group is dist.group.WORLD:
            return WORLD
        if group in self.group_buckets:
            return self.group_buckets[group]
        key = id(group)
        if key not in self._cache:
            ranks = tuple(sorted(dist.get_process_group_ranks(group)))
            self._cache[key] = self.rank_buckets.get(ranks)
        return self._cache[key]

    def _add_seconds(self, bucket: str, seconds: float) -> None:
        self.stats[bucket].seconds += seconds

    def __enter__(self) -> "CommMeter":
        with _lock:
            if self._depth == 0:
                if not _active:  # the first meter wraps the entry points
                    for name in compat.collective_entry_points():
                        _originals[name] = getattr(dist, name)
                        compat.replace_dist_function(name, _wrap(name, _originals[name]))
                _active.append(self)
            self._depth += 1
        return self

    def __exit__(self, *exc) -> bool:
        with _lock:
            if self._depth == 0:  # end_training stopped it inside the with block
                return False
            self._depth -= 1
            if self._depth == 0:
                _active.remove(self)
                if not _active:
                    for name, original in _originals.items():
                        compat.replace_dist_function(name, original)
                    _originals.clear()
        return False

    def stop(self) -> None:
        """Leave completely, however often it was entered."""
        while self._depth:
            self.__exit__(None, None, None)


class WaitClock:
    """Seconds the training stream spends in sync events: host time on CPU; on CUDA events
    on the compute stream around each (NCCL waits included), resolved when read."""

    def __init__(self):
        self.host_seconds, self.pairs, self.depth = 0.0, [], 0

    @contextlib.contextmanager
    def measure(self, device: torch.device):
        self.depth += 1
        cuda = device.type == "cuda"
        start = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
        if cuda and self.depth == 1:
            start.record()
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0 and cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.pairs.append((start, end))
            elif self.depth == 0:
                self.host_seconds += time.perf_counter() - start

    @property
    def seconds(self) -> float:
        for start, end in self.pairs:
            end.synchronize()
            self.host_seconds += start.elapsed_time(end) / 1000.0
        self.pairs.clear()
        return self.host_seconds
