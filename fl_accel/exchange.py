"""The wire protocol of the sync: a weighted mean across federation groups, shard by shard.

A :class:`Transport` gives each sync a :class:`Round` (F, this group's position, the
weights: membership may change between syncs) and three collectives over "fl".
:class:`MeshTransport` runs them on the mesh's process groups. An :class:`Exchange` packs
local tensors into flat fp32 buckets; collectives are issued from the caller's thread in
program order, so every rank issues them in one order (as NCCL requires).

Chunking (FL+HSDP's 1/R rule, unequal groups): a buffer is cut into ``C = R_min`` chunks;
replica ``c < C`` of every group exchanges chunk c over "fl", then the group's replicas
share the chunks over "dp_replicate" (all-gather if ``R_f == C``, else C broadcasts).
Modes (``sync_dtype``; bytes per rank: :mod:`fl_accel.cost_model`): "fp32" all-reduces
(SUM; pre-scaled by w_f if weights differ, else divided by F); "bf16"/"int8" (INTELLECT-1,
arXiv 2412.01152; :mod:`fl_accel.compress`) quantize into F sub-chunks, all-to-all, sum
this rank's sub-chunk weighted in fp32, re-quantize, all-gather; "sparse" (SparseLoCo,
arXiv 2508.15706) all-gathers every group's top-k payload and sums the decoded values.
Buffers are padded to a multiple of C (fp32), C F ``BLOCK`` (bf16, int8) or C 4096 (sparse).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from .compress import QMAX, dequantize, quantize, sparse_encode, sparse_sum  # noqa: F401 (QMAX: tests)
from .cost_model import BLOCK, SPARSE_BLOCK, plan_buckets
from .mesh import DP_REPLICATE, FL


@dataclass(frozen=True)
class Round:
    """One sync's ``num_groups`` F, this group's ``position``, the ``weights`` w_g (sum 1)."""

    num_groups: int
    position: int
    weights: tuple[float, ...]


class Transport(Protocol):
    """This rank's side: ``num_chunks`` C, ``chunk_index`` (None: sends nothing across
    groups), ``device`` (of every tensor given to a collective)."""

    num_chunks: int
    chunk_index: int | None
    device: torch.device

    def begin(self) -> Round:
        """The membership of the sync starting now."""

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        """In-place SUM over the ranks holding this chunk in every group."""

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Row g of ``input`` ``[F, m]`` goes to group g; row g of ``output`` comes from it."""

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Row g of ``output`` ``[F, m]`` is group g's ``input`` ``[m]``."""

    def share_chunks(self, flat: torch.Tensor) -> None:
        """Give every replica of this group every chunk of ``flat``."""

    def bad_groups(self, local_bad: bool, rnd: Round) -> list[int]:
        """Positions of the groups where a rank reported ``local_bad`` (a collective)."""


@dataclass
class MeshTransport:
    """:class:`Transport` on the mesh's process groups (one world): a fixed ``round``;
    ``chunk_owners[c]``: the rank holding chunk c in this group (broadcast sources)."""

    fl_group: object
    replicate_group: object
    round: Round
    num_chunks: int
    chunk_index: int | None
    replicas: int
    chunk_owners: tuple
    device: torch.device = torch.device("cpu")

    @classmethod
    def from_mesh(cls, mesh, rank: int, weighting: str, device: torch.device) -> "MeshTransport":
        layout = mesh.layout
        f, r, s = layout.coords(rank)
        C, groups = layout.min_replicas, mesh.groups
        return cls(fl_group=groups.get(FL) if r < C else None, replicate_group=groups.get(DP_REPLICATE),
                   round=Round(layout.num_groups, f, layout.weights(weighting)), num_chunks=C,
                   chunk_index=r if r < C else None, replicas=layout.replicas_of(f),
                   chunk_owners=tuple(layout.rank(f, c, s) for c in range(C)), device=device)

    def begin(self) -> Round:
        return self.round

    def all_reduce(self, tensor, async_op=False):
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.fl_group, async_op=async_op)

    def all_to_all(self, output, input, async_op=False):
        return dist.all_to_all_single(output, input, group=self.fl_group, async_op=async_op)

    def all_gather(self, output, input, async_op=False):
        return dist.all_gather_single(output, input, group=self.fl_group, async_op=async_op)

    def share_chunks(self, flat):
        if self.replicate_group is None or self.replicas <= 1:
            return
        size = flat.numel() // self.num_chunks
        if self.replicas == self.num_chunks:
            piece = flat[self.chunk_index * size:(self.chunk_index + 1) * size].clone()
            dist.all_gather_single(flat, piece, group=self.replicate_group)
            return
        for c in range(self.num_chunks):
            dist.broadcast(flat[c * size:(c + 1) * size], src=self.chunk_owners[c], group=self.replicate_group)

    def bad_groups(self, local_bad, rnd):
        flags = torch.zeros(rnd.num_groups, dtype=torch.float32, device=self.device)
        flags[rnd.position] = float(local_bad)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # the world: every rank of every group
        return [g for g in range(rnd.num_groups) if flags[g] > 0]


class _Bucket:
    __slots__ = ("idx", "flat", "piece", "work", "recv", "sent", "gathered", "stage")

    def __init__(self, idx, flat):
        self.idx, self.flat, self.stage = idx, flat, 0
        self.piece = self.work = self.recv = self.sent = self.gathered = None

    def nbytes(self) -> int:
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (self.flat, self.piece, self.recv, self.sent, self.gathered) if t is not None}
        return sum(held.values())


class Exchange:
    """One weighted mean of ``sources`` (tensors, or callables called one at a time while
    packing; then ``shapes`` and ``device`` are required) over ``transport`` in round ``rnd``.
    ``mask``: per-group 0/1, weights renormalized over the 1s (the non-finite reset);
    ``residuals``: error feedback, fp32 per source (maybe on the host), added before
    quantization and replaced by what it dropped of this rank's chunk; ``bucket_values``:
    fp32 values per bucket; ``density``, ``value_bits``: "sparse". ``peak_bytes``: the most
    the buffers held at once. ``start``/``advance``/``finish`` run a delayed exchange (all
    buckets at once); ``run`` a blocking one."""

    def __init__(self, transport: Transport, rnd: Round, sources: list, *, shapes=None, device=None,
                 sync_dtype: str = "fp32", mask=None, residuals=None, bucket_values: int = 64 * 2**20,
                 density: float = 1 / 64, value_bits: int = 2):
        self.t, self.round, self.sources, self.residuals = transport, rnd, sources, residuals
        self.shapes = [tuple(s) for s in (shapes if shapes is not None else [x.shape for x in sources])]
        self.device = device if device is not None else (sources[0].device if sources else torch.device("cpu"))
        self.sync_dtype, self.compressed = sync_dtype, sync_dtype != "fp32"
        self.sparse = (density, value_bits) if sync_dtype == "sparse" else None
        self.weights = list(rnd.weights)
        if mask is not None:
            total = sum(w * m for w, m in zip(self.weights, mask))
            self.weights = [w * m / total for w, m in zip(self.weights, mask)]
        self.scale_first = mask is not None or len(set(rnd.weights)) > 1
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
        """Compressed: wait for each bucket's all-to-all, reduce, launch its all-gather."""
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

    def _stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _track(self) -> None:
        self.peak_bytes = max(self.peak_bytes, sum(b.nbytes() for b in self.buckets))

    def _pack(self, idx: list[int]) -> _Bucket:
        pad = self.t.num_chunks * (SPARSE_BLOCK if self.sparse else self.round.num_groups * BLOCK if self.compressed
                                   else 1)
        numel = sum(self.sizes[i] for i in idx)
        with self._stream():
            flat = torch.zeros(math.ceil(numel / pad) * pad, dtype=torch.float32, device=self.device)
            for i, part in zip(idx, self._parts(flat, idx)):
                value = self.sources[i]() if callable(self.sources[i]) else self.sources[i]
                part.copy_(value.reshape(-1))
                del value
                if self.residuals is not None:
                    part.add_(self.residuals[i].reshape(-1).to(self.device, non_blocking=True))
        if self.stream is not None:  # the next optimizer step (compute stream) must not overtake packing
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.buckets.append(_Bucket(idx, flat))
        self._track()
        return self.buckets[-1]

    def _chunk(self, b: _Bucket) -> torch.Tensor | None:
        c = self.t.chunk_index
        size = b.flat.numel() // self.t.num_chunks
        return None if c is None else b.flat[c * size:(c + 1) * size]

    def _launch(self, b: _Bucket) -> _Bucket:
        mine, b.stage = self._chunk(b), 1
        if mine is None:  # a replica beyond R_min: it receives the chunks from its group
            return b
        with self._stream():
            if not self.compressed:
                b.piece = mine.clone() if self.t.num_chunks > 1 else mine
                if self.scale_first:
                    w = self.weights[self.round.position]
                    b.piece.mul_(w) if w else b.piece.zero_()  # zero, not 0 * NaN, for a dropped group
                b.work = self.t.all_reduce(b.piece, async_op=True)
            elif self.sparse:  # one stage: the all-gather of every group's top-k
                payload, sent = sparse_encode(mine, *self.sparse)
                if self.residuals is not None:
                    self._store_residual(b, mine - sent)
                b.gathered = torch.empty(self.round.num_groups, payload.numel(), dtype=torch.uint8, device=mine.device)
                b.sent, b.stage = payload, 2
                b.work = self.t.all_gather(b.gathered, payload.view(1, -1), async_op=True)  # gloo: rows match
            else:
                b.sent = quantize(mine, self.sync_dtype, self.round.num_groups)
                if self.residuals is not None:
                    self._store_residual(b, mine - dequantize(b.sent, self.sync_dtype).view(-1))
                b.recv = torch.empty_like(b.sent)
                b.work = self.t.all_to_all(b.recv, b.sent, async_op=True)
        self._track()
        return b

    def _store_residual(self, b: _Bucket, dropped: torch.Tensor) -> None:
        """residual <- (value + old residual) - decoded(sent), on this rank's chunk only."""
        dropped = dropped.to(self.residuals[b.idx[0]].device)
        size = b.flat.numel() // self.t.num_chunks
        lo, hi = self.t.chunk_index * size, (self.t.chunk_index + 1) * size
        offset = 0
        for i in b.idx:
            n = self.sizes[i]
            a, z = max(lo, offset), min(hi, offset + n)
            res = self.residuals[i].view(-1)
            res.zero_()
            if a < z:
                res[a - offset:z - offset].copy_(dropped[a - lo:z - lo])
            offset += n

    def _advance(self, b: _Bucket) -> None:
        if b.stage != 1 or not self.compressed or b.work is None:
            return
        with self._stream():
            b.work.wait()
            parts = dequantize(b.recv, self.sync_dtype)  # [F, m]: group g's sub-chunk
            w = torch.tensor(self.weights, dtype=torch.float32, device=parts.device).unsqueeze(1)
            mine = quantize((parts * w).sum(dim=0), self.sync_dtype, 1)
            b.gathered = torch.empty(self.round.num_groups, mine.shape[1], dtype=torch.uint8, device=mine.device)
            b.recv = b.sent = None
            b.work = self.t.all_gather(b.gathered, mine, async_op=True)
        b.stage = 2
        self._track()

    def _complete(self, b: _Bucket) -> list[torch.Tensor]:
        self._advance(b)
        mine = self._chunk(b)
        with self._stream():
            if b.work is not None:
                b.work.wait()
                if self.sparse:
                    mine.copy_(sparse_sum(b.gathered, self.weights, *self.sparse))
                elif self.compressed:
                    mine.copy_(dequantize(b.gathered, self.sync_dtype).view(-1))
                else:
                    if not self.scale_first:
                        b.piece.div_(self.round.num_groups)
                    if b.piece is not mine:
                        mine.copy_(b.piece)
                b.work = b.piece = b.gathered = b.sent = None
            self.t.share_chunks(b.flat)
        if self.stream is not None:  # read on the compute stream from now on
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            b.flat.record_stream(torch.cuda.current_stream(self.device))
        return [part.view(self.shapes[i]) for i, part in zip(b.idx, self._parts(b.flat, b.idx))]

    def _parts(self, flat: torch.Tensor, idx: list[int]) -> tuple[torch.Tensor, ...]:
        """Views of ``flat`` holding sources ``idx`` in order (the padding after them left out)."""
        sizes = [self.sizes[i] for i in idx]
        return flat[:sum(sizes)].split(sizes)


def mean(transport: Transport, tensors: list[torch.Tensor], sync_dtype: str = "fp32") -> list[torch.Tensor]:
    """The weighted mean of ``tensors`` over the transport's round (for tests and tools)."""
    return Exchange(transport, transport.begin(), tensors, sync_dtype=sync_dtype).start().finish()


@functools.cache
def _side_stream(device: torch.device):
    """One CUDA stream per device for packing off the compute stream."""
    return torch.cuda.Stream(device=device)
