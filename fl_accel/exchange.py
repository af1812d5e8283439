"""The wire protocol of the sync: a weighted mean across federation groups, shard by shard.

A :class:`Transport` gives each sync event a :class:`Membership` (F, this group's position,
the weights), three collectives over "fl" and its :class:`EventHooks` (when a write may
happen); the world mesh's (:mod:`fl_accel.mesh_transport`) and torchft's (:mod:`fl_accel.ft`)
declare what they are (:attr:`Transport.elastic`) instead of being probed. A :class:`Channel`
is one event's link as fragments use it. An :class:`Exchange` packs local tensors into flat
fp32 buckets (:func:`fl_accel.wire.plan_buckets`) and drives one
:class:`~fl_accel.codecs.Codec` through its stages, issuing collectives from the caller's
thread in program order (every rank in one order, as NCCL requires).

Chunking (FL+HSDP's 1/R rule, unequal groups): a buffer is cut into ``C = R_min`` chunks;
replica ``c < C`` of every group exchanges chunk c over "fl", then the group's replicas
share the chunks over "dp_replicate" (all-gather if ``R_f == C``, else C broadcasts).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from .codecs import Codec, Fp32Mean, Peers
from .wire import plan_buckets


@dataclass(frozen=True)
class Membership:
    """One sync event's groups: ``num_groups`` F, this group's ``position``, the merge
    ``weights`` w_g (sum 1, :func:`fl_accel.mesh.merge_weights`)."""

    num_groups: int
    position: int
    weights: tuple[float, ...]


class EventHooks:
    """A transport's hooks into each sync event: the world mesh's no-ops (writes at once);
    torchft's are :class:`fl_accel.ft.CommitHooks` (a quorum per event, writes held for the commit)."""

    deferred: list | None = None
    """The open event's writes, held for a commit (None: each write runs at once)."""

    def open(self, schedule) -> bool:
        """A step with sync actions starts (``schedule``: its counters); True: this group's state
        was just replaced (a heal), so the actions due are asked again."""
        return False

    def write(self, fn: Callable[[], None]) -> None:
        """Run the write ``fn()`` now, or hold it for the commit."""
        if self.deferred is None:
            fn()
        else:
            self.deferred.append(fn)

    def event(self, schedule):
        """A context manager around one sync event's exchanges and writes."""
        return contextlib.nullcontext()


class Transport(Protocol):
    """This rank's side: ``num_chunks`` C, ``chunk_index`` (None: sends nothing across
    groups), ``device`` (of every tensor given to a collective), ``group_index`` (this group's
    index in the federation, whatever its position in a membership) and ``elastic``
    (membership is decided at every event, and events run even with one live group)."""

    num_chunks: int
    chunk_index: int | None
    device: torch.device
    group_index: int
    elastic: bool

    def begin(self) -> Membership:
        """The membership of the sync event starting now."""

    def hooks(self) -> EventHooks:
        """The hooks of this transport's events (made once, by the synchronizer)."""

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        """In-place SUM over the ranks holding this chunk in every group."""

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Row g of ``input`` ``[F, m]`` goes to group g; row g of ``output`` comes from it."""

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Row g of ``output`` ``[F, m]`` is group g's ``input`` ``[m]``."""

    def share_chunks(self, flat: torch.Tensor) -> None:
        """Give every replica of this group every chunk of ``flat``."""

    def bad_groups(self, local_bad: bool, membership: Membership) -> list[int]:
        """Positions of the groups where a rank reported ``local_bad`` (a collective)."""

    def group_max(self, value: float) -> float:
        """The MAX of ``value`` over this federation group's ranks (never across groups)."""

    def group_table(self, vector: list[float], membership: Membership) -> list[list[float]]:
        """Row f: group f's ``vector`` (non-negative; the MAX over its ranks), on every rank."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the transport ({}: nothing); ``load_state_dict`` its inverse."""

    def load_state_dict(self, state: dict) -> None: ...

    def shutdown(self) -> None:
        """Release what the transport started (end of training)."""


@dataclass(frozen=True)
class Channel:
    """One sync event's link to the other groups, as fragments use it (``bucket_values``: fp32
    values per exchange bucket)."""

    transport: Transport
    membership: Membership
    hooks: EventHooks
    bucket_values: int

    def exchange(self, sources: list, **kwargs) -> "Exchange":
        """An :class:`Exchange` of ``sources`` over this event (``kwargs`` as there)."""
        return Exchange(self.transport, self.membership, sources, bucket_values=self.bucket_values, **kwargs)

    write = property(lambda self: self.hooks.write, doc="``write(fn)``: :meth:`EventHooks.write`.")

    def mean_into(self, tensors: list[torch.Tensor], mask=None, also=None, write: bool = True) -> None:
        """``tensors`` <- their exact fp32 weighted mean over the event's groups (``mask``:
        per-group 0/1, weights renormalized over the 1s), then ``also(positions, means)``;
        with ``write`` False only the collectives run (a group keeping its own values). Each
        bucket's writes go through :meth:`write`. Collective: every rank of every group, the
        same shapes in one order."""
        def copy(pos, means):
            for j, m in zip(pos, means):
                if write:
                    tensors[j].copy_(m)
            if also is not None:
                also(pos, means)

        def put(pos, means):
            if self.hooks.deferred is None:
                copy(pos, means)
            else:  # the bucket is released after this call
                kept = [m.clone() for m in means]
                self.hooks.deferred.append(lambda: copy(pos, kept))

        self.exchange(tensors, mask=mask).run(put)


class _Bucket:
    __slots__ = ("idx", "flat", "flight", "stage")

    def __init__(self, idx, flat):
        self.idx, self.flat, self.flight, self.stage = idx, flat, None, 0

    def nbytes(self) -> int:
        tensors = (self.flat,) + (self.flight.held if self.flight is not None else ())
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(held.values())


class Exchange:
    """One weighted mean of ``sources`` (tensors, or callables called while packing; then
    ``shapes`` and ``device`` are required) over ``transport`` for ``membership``, on ``codec``'s
    wire (default fp32). ``mask``: per-group 0/1, weights renormalized over the 1s;
    ``residuals``: error feedback, fp32 per source: ``residual_decay`` x residual is added
    before encoding and replaced by what the codec dropped (:meth:`keep_residual`);
    ``bucket_values``: fp32 values per bucket; ``peak_bytes``: the most the buffers held.
    ``start``/``advance``/``finish``: a delayed exchange; ``run``: a blocking one."""

    def __init__(self, transport: Transport, membership: Membership, sources: list, *, shapes=None, device=None,
                 mask=None, residuals=None, bucket_values: int = 64 * 2**20, codec: Codec | None = None,
                 residual_decay: float = 1.0):
        self.transport, self.membership, self.sources, self.residuals = transport, membership, sources, residuals
        self.codec = codec if codec is not None else Fp32Mean()
        self.residual_decay = float(residual_decay)
        self.shapes = [tuple(s) for s in (shapes if shapes is not None else [x.shape for x in sources])]
        self.device = device if device is not None else (sources[0].device if sources else torch.device("cpu"))
        weights = list(membership.weights)
        if mask is not None:
            total = sum(w * m for w, m in zip(weights, mask))
            weights = [w * m / total for w, m in zip(weights, mask)]
        self.peers = Peers(transport, membership.num_groups, membership.position, tuple(weights),
                           mask is not None or len(set(membership.weights)) > 1, transport.num_chunks,
                           residuals is not None)
        self.sizes = [math.prod(s) for s in self.shapes]
        self.plan = plan_buckets(self.sizes, bucket_values)
        self.buckets: list[_Bucket] = []
        self.stream = _side_stream(self.device) if self.device.type == "cuda" else None
        if self.stream is not None:  # packing waits for the compute stream's writes
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.peak_bytes = 0

    def start(self) -> "Exchange":
        """Pack every bucket and launch its "fl" collective without waiting."""
        for idx in self.plan:
            self._launch(self._pack(idx))
        return self

    def advance(self) -> None:
        """The codec's second stage of every bucket (e.g. wait for the all-to-all, reduce, launch
        the all-gather); nothing for a one-collective codec."""
        for b in self.buckets:
            self._advance(b)

    def finish(self) -> list[torch.Tensor]:
        """One fp32 mean per source, identical on every rank of every group."""
        return [m for b in self.buckets for m in self._complete(b)]  # buckets hold the sources in order

    def run(self, on_bucket: Callable[[list[int], list[torch.Tensor]], None]) -> None:
        """Launch bucket k+1, then complete bucket k and call ``on_bucket(indices, means)``
        (views into the bucket, released after the call)."""
        prev = None
        for idx in self.plan + [None]:
            cur = self._launch(self._pack(idx)) if idx is not None else None
            if prev is not None:
                on_bucket(prev.idx, self._complete(prev))
                self.buckets.remove(prev)
            prev = cur

    def keep_residual(self, b: _Bucket, dropped: torch.Tensor | None) -> None:
        """Error feedback: the residual of each source in bucket ``b`` <- ``dropped`` (what the
        codec dropped of this rank's chunk) on this rank's chunk, zero elsewhere; all zero when
        nothing was dropped (an exact codec)."""
        if dropped is None:
            for i in b.idx:
                self.residuals[i].zero_()
            return
        size = b.flat.numel() // self.transport.num_chunks
        lo, hi = self.transport.chunk_index * size, (self.transport.chunk_index + 1) * size
        dropped = dropped.to(self.residuals[b.idx[0]].device)
        offset = 0
        for i in b.idx:
            n = self.sizes[i]
            a, z = max(lo, offset), min(hi, offset + n)
            res = self.residuals[i].view(-1)
            res.zero_()
            if a < z:
                res[a - offset:z - offset].copy_(dropped[a - lo:z - lo])
            offset += n

    def _stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _track(self) -> None:
        self.peak_bytes = max(self.peak_bytes, sum(b.nbytes() for b in self.buckets))

    def _pack(self, idx: list[int]) -> _Bucket:
        pad = self.codec.padding(self.membership.num_groups, self.transport.num_chunks)
        numel = sum(self.sizes[i] for i in idx)
        with self._stream():
            flat = torch.zeros(math.ceil(numel / pad) * pad, dtype=torch.float32, device=self.device)
            for i, part in zip(idx, self._parts(flat, idx)):
                value = self.sources[i]() if callable(self.sources[i]) else self.sources[i]
                part.copy_(value.reshape(-1))
                del value
                if self.residuals is not None:
                    part.add_(self.residuals[i].reshape(-1).to(self.device, non_blocking=True),
                              alpha=self.residual_decay)
        if self.stream is not None:  # the next optimizer step (compute stream) must not overtake packing
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.buckets.append(_Bucket(idx, flat))
        self._track()
        return self.buckets[-1]

    def _chunk(self, b: _Bucket) -> torch.Tensor | None:
        c = self.transport.chunk_index
        size = b.flat.numel() // self.transport.num_chunks
        return None if c is None else b.flat[c * size:(c + 1) * size]

    def _launch(self, b: _Bucket) -> _Bucket:
        mine, b.stage = self._chunk(b), 1
        if mine is None:  # a replica beyond R_min: it receives the chunks from its group
            return b
        with self._stream():
            b.flight = self.codec.launch(mine, self.peers)
            if self.residuals is not None:
                self.keep_residual(b, b.flight.dropped)
            b.flight.dropped = None
        self._track()
        return b

    def _advance(self, b: _Bucket) -> None:
        if b.stage != 1 or b.flight is None:
            return
        with self._stream():
            b.flight = self.codec.advance(b.flight, self.peers)
        b.stage = 2
        self._track()

    def _complete(self, b: _Bucket) -> list[torch.Tensor]:
        self._advance(b)
        mine = self._chunk(b)
        with self._stream():
            if b.flight is not None:
                self.codec.complete(b.flight, self.peers, mine)
                b.flight = None
            self.transport.share_chunks(b.flat)
        if self.stream is not None:  # read on the compute stream from now on
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            b.flat.record_stream(torch.cuda.current_stream(self.device))
        return [part.view(self.shapes[i]) for i, part in zip(b.idx, self._parts(b.flat, b.idx))]

    def _parts(self, flat: torch.Tensor, idx: list[int]) -> tuple[torch.Tensor, ...]:
        """Views of ``flat`` holding sources ``idx`` in order (the padding after them left out)."""
        sizes = [self.sizes[i] for i in idx]
        return flat[:sum(sizes)].split(sizes)


@functools.cache
def _side_stream(device: torch.device):
    """One CUDA stream per device for packing off the compute stream."""
    return torch.cuda.Stream(device=device)
