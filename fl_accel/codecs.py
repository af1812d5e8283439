"""The sync's codecs: what one ``sync_dtype`` puts on the "fl" wire, stage by stage.

An :class:`~fl_accel.exchange.Exchange` drives one codec per bucket: :meth:`Codec.launch`
(encode this rank's chunk, start the first collective), :meth:`Codec.advance` (a second one,
if any) and :meth:`Codec.complete` (wait, write the weighted mean into the chunk). A codec sees
the exchange's :class:`Peers` and keeps what it has in flight in its own :class:`Flight`; it
writes nothing of the exchange's. Padding and bytes are :mod:`fl_accel.wire`'s formulas
(torch-free, shared with the cost model); every tensor stays on the input's device.

* :class:`Fp32Mean` ("fp32"): an in-place SUM all-reduce, pre-scaled by w_f when the weights
  differ, else divided by F afterwards (the paper's FedAvg, arXiv 2609.20359 Sec. 3).
* :class:`Quantized` ("bf16", "int8"; INTELLECT-1, arXiv 2412.01152): quantize (int8: one fp32
  absmax scale per ``BLOCK`` = 256 values). ``sync_collectives`` "all_to_all": into F sub-chunks,
  all-to-all, sum this rank's sub-chunk weighted in fp32, re-quantize, all-gather (two roundings,
  two collectives); "all_gather": all-gather every group's payload and sum them weighted in fp32,
  group by group in order (one rounding, one collective: an exchange's whole window to cross the
  link; the same bytes at F = 2, :func:`fl_accel.wire.collectives`).
* :class:`Sparse` ("sparse"; SparseLoCo, arXiv 2508.15706, and its code CCLoco,
  ``src/tplr/ccloco.py``): keep the k largest magnitudes of every 4096 values
  (:func:`~fl_accel.wire.sparse_k`), code each in ``bits`` bits (a sign and one of L =
  2^(bits-1) levels lo + j (hi - lo)/(L-1) between the block's smallest and largest kept
  magnitude), all-gather every group's payload, then aggregate: ``"senders"`` (CCLoco) divides
  each index's weighted sum by the weight of the groups that sent it; ``"zero_fill"`` counts a
  group that did not send an index as a zero (the mean shrinks by about 1/F where groups pick
  different indices). Payload for nb blocks: [lo, step fp32 (8 nb)] [indices int16 (2 nb k)]
  [codes (nb k bits/8)].

Error feedback: a lossy codec returns what it dropped of this rank's chunk (packed -
decoded(sent)) in :attr:`Flight.dropped`; the exchange keeps it (``Exchange.keep_residual``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import wire
from .wire import BLOCK, QMAX, SPARSE_AGGREGATIONS, SPARSE_BLOCK, sparse_k


class Peers(NamedTuple):
    """What a codec sees of one exchange: the transport's "fl" collectives, F, this group's
    ``position``, the ``weights`` w_g (sum 1), ``scale_first`` (pre-scale by w_f: the weights
    differ or a mask dropped groups), C = ``num_chunks`` and ``feedback`` (the exchange keeps
    residuals: a lossy codec reports what it dropped)."""

    transport: Any
    num_groups: int
    position: int
    weights: tuple[float, ...]
    scale_first: bool
    num_chunks: int
    feedback: bool


class Flight:
    """A bucket's collective in flight, the codec's own: ``work`` to wait for, the tensors it
    holds (``held``, counted in the exchange's peak bytes) and, from a lossy codec's launch,
    what it ``dropped`` of this rank's chunk (None: nothing)."""

    __slots__ = ("work", "held", "dropped")

    def __init__(self, work, *held: torch.Tensor, dropped: torch.Tensor | None = None):
        self.work, self.held, self.dropped = work, held, dropped


class Codec:
    """What one ``sync_dtype`` puts on the "fl" wire. Subclasses set ``name`` and ``lossy``."""

    name = ""
    lossy = False
    """True: the decoded mean differs from the exact one (error feedback applies)."""
    density, bits, collectives = 1 / 64, 2, "auto"
    """"sparse"'s fraction of values kept and bits per value, "bf16"/"int8"'s ``sync_collectives``
    (the wire formulas take them)."""

    def padding(self, num_groups: int, num_chunks: int) -> int:
        """A bucket's fp32 length is padded to a multiple of this (C chunks of whole blocks)."""
        return wire.padding(self.name, num_groups, num_chunks)

    def wire(self, chunk_values: int, num_groups: int) -> list[tuple[str, float]]:
        """:func:`fl_accel.wire.wire_ops`: ``[(op, bytes)]`` of one chunk over F groups."""
        return wire.wire_ops(self.name, chunk_values, num_groups, self.density, self.bits, self.collectives)

    def launch(self, mine: torch.Tensor, peers: Peers) -> Flight:
        """Encode ``mine`` (this rank's chunk of a bucket) and start the first collective."""
        raise NotImplementedError

    def advance(self, flight: Flight, peers: Peers) -> Flight:
        """Second stage (codecs with two collectives); the default has none."""
        return flight

    def complete(self, flight: Flight, peers: Peers, mine: torch.Tensor) -> None:
        """Wait for the collective and write the weighted mean into ``mine``."""
        raise NotImplementedError


class Fp32Mean(Codec):
    """"fp32": the exact weighted mean (all-reduce SUM); it drops nothing."""

    name = "fp32"

    def launch(self, mine, peers):
        piece = mine.clone() if peers.num_chunks > 1 else mine
        if peers.scale_first:
            w = peers.weights[peers.position]
            piece.mul_(w) if w else piece.zero_()  # zero, not 0 * NaN, for a dropped group
        return Flight(peers.transport.all_reduce(piece, async_op=True), piece)

    def complete(self, flight, peers, mine):
        flight.work.wait()
        piece = flight.held[0]
        if not peers.scale_first:
            piece.div_(peers.num_groups)
        if piece is not mine:
            mine.copy_(piece)


class Quantized(Codec):
    """"bf16" / "int8", ``value_bytes`` per value, over ``collectives`` (module docstring; "auto"
    resolved per exchange by :func:`fl_accel.wire.collectives`). ValueError: an unknown one."""

    lossy = True

    def __init__(self, name: str, collectives: str = "auto"):
        wire.collectives(collectives, 2)
        self.name, self.collectives = name, collectives
        self.value_bytes = wire.VALUE_BYTES[name]

    def gathers(self, peers: Peers) -> bool:
        """One all-gather of every group's payload (else all-to-all, then all-gather)."""
        return wire.collectives(self.collectives, peers.num_groups) == "all_gather"

    def quantize(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """fp32 ``x`` (numel divisible by ``rows`` x BLOCK for int8) -> uint8 ``[rows, row_bytes]``,
        row i sub-chunk i (int8: the payload, then the fp32 scales)."""
        x = x.view(rows, -1)
        if self.name == "bf16":
            return x.to(torch.bfloat16).view(torch.uint8).view(rows, -1)
        m = x.shape[1]
        blocks = x.view(rows, m // BLOCK, BLOCK)
        scale = blocks.abs().amax(dim=2).div_(QMAX).clamp_(min=torch.finfo(torch.float32).tiny)
        q = torch.round(blocks / scale.unsqueeze(2)).clamp_(-QMAX, QMAX).to(torch.int8)
        out = torch.empty(rows, m + 4 * (m // BLOCK), dtype=torch.uint8, device=x.device)
        out[:, :m].view(torch.int8).copy_(q.view(rows, m))
        out[:, m:].view(torch.float32).copy_(scale)
        return out

    def dequantize(self, buf: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`quantize`: ``[rows, row_bytes]`` uint8 -> ``[rows, m]`` fp32."""
        rows = buf.shape[0]
        if self.name == "bf16":
            return buf.contiguous().view(torch.bfloat16).view(rows, -1).to(torch.float32)
        m = buf.shape[1] * BLOCK // (BLOCK + 4)
        q = buf[:, :m].contiguous().view(torch.int8).to(torch.float32)
        scale = buf[:, m:].contiguous().view(torch.float32)
        return (q.view(rows, m // BLOCK, BLOCK) * scale.unsqueeze(2)).view(rows, m)

    def launch(self, mine, peers):
        gathers = self.gathers(peers)
        sent = self.quantize(mine, 1 if gathers else peers.num_groups)
        dropped = mine - self.dequantize(sent).view(-1) if peers.feedback else None
        if gathers:  # [F, payload]: row g is group g's (gloo: every rank's rows the same size)
            gathered = torch.empty(peers.num_groups, sent.shape[1], dtype=torch.uint8, device=mine.device)
            return Flight(peers.transport.all_gather(gathered, sent, async_op=True), gathered, sent, dropped=dropped)
        recv = torch.empty_like(sent)
        return Flight(peers.transport.all_to_all(recv, sent, async_op=True), sent, recv, dropped=dropped)

    def advance(self, flight, peers):
        if self.gathers(peers):
            return flight
        flight.work.wait()
        parts = self.dequantize(flight.held[1])  # [F, m]: group g's sub-chunk
        w = torch.tensor(peers.weights, dtype=torch.float32, device=parts.device).unsqueeze(1)
        mine = self.quantize((parts * w).sum(dim=0), 1)
        gathered = torch.empty(peers.num_groups, mine.shape[1], dtype=torch.uint8, device=mine.device)
        return Flight(peers.transport.all_gather(gathered, mine, async_op=True), gathered)

    def complete(self, flight, peers, mine):
        flight.work.wait()
        if not self.gathers(peers):
            mine.copy_(self.dequantize(flight.held[0]).view(-1))
            return
        gathered = flight.held[0]  # [F, payload], identical on every rank: summed in group order
        mine.zero_()
        for g, w in enumerate(peers.weights):
            if w:  # a dropped group (weight 0) counts nowhere, not as 0 x NaN; one fp32 row at a time
                mine.add_(self.dequantize(gathered[g:g + 1]).view(-1), alpha=w)


class Sparse(Codec):
    """"sparse": top-k per 4096 values, ``bits``-bit codes, one all-gather, aggregated as
    ``aggregation`` says (module docstring). ValueError: an unknown aggregation."""

    name = "sparse"
    lossy = True

    def __init__(self, density: float = 1 / 64, bits: int = 2, aggregation: str = "senders"):
        if aggregation not in SPARSE_AGGREGATIONS:
            raise ValueError(f"sparse aggregation must be one of {SPARSE_AGGREGATIONS}, got {aggregation!r}")
        self.density, self.bits, self.aggregation = density, bits, aggregation
        self.k, self.levels = sparse_k(density, bits), 2 ** (bits - 1)

    def _shifts(self, device) -> torch.Tensor:
        return torch.arange(0, 8, self.bits, dtype=torch.int32, device=device)

    def _values(self, lo, step, codes) -> torch.Tensor:
        """fp32 values of ``codes`` [nb, k] given the blocks' ``lo``, ``step`` [nb, 1]."""
        mag = lo + (codes % self.levels).to(torch.float32) * step
        return torch.where(codes >= self.levels, -mag, mag)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(payload, sent)`` of fp32 ``x`` (numel a multiple of 4096): the uint8 payload and its
        dense fp32 decoding (``x - sent`` is what error feedback keeps)."""
        nb, k, levels, bits = x.numel() // SPARSE_BLOCK, self.k, self.levels, self.bits
        blocks = x.view(nb, SPARSE_BLOCK)
        idx = blocks.abs().topk(k, dim=1, sorted=False).indices
        vals = blocks.gather(1, idx)
        mag = vals.abs()
        lo, hi = mag.amin(dim=1, keepdim=True), mag.amax(dim=1, keepdim=True)
        step = (hi - lo) / max(1, levels - 1)
        level = torch.round((mag - lo) / step.clamp(min=torch.finfo(torch.float32).tiny)).clamp_(0, levels - 1)
        codes = (level + levels * (vals < 0)).to(torch.int32)
        payload = torch.empty(nb * (8 + 2 * k) + nb * k * bits // 8, dtype=torch.uint8, device=x.device)
        payload[:8 * nb].view(torch.float32).view(nb, 2).copy_(torch.cat([lo, step], dim=1))
        payload[8 * nb:(8 + 2 * k) * nb].view(torch.int16).copy_(idx.view(-1))
        per = 8 // bits
        payload[(8 + 2 * k) * nb:].copy_((codes.view(-1, per) << self._shifts(x.device)).sum(dim=1))
        sent = torch.zeros_like(blocks).scatter_(1, idx, self._values(lo, step, codes))
        return payload, sent.view(-1)

    def aggregate(self, gathered: torch.Tensor, weights: list[float]) -> torch.Tensor:
        """fp32 aggregate of ``gathered`` ``[F, payload bytes]`` with group weights w_g (sum 1):
        "zero_fill" sum_g w_g decode_g; "senders" that sum over sum_{g sent i} w_g at each index
        i (0 where nobody sent it). Group by group in order: deterministic, equal on every rank."""
        k, bits = self.k, self.bits
        nb = gathered.shape[1] // (8 + 2 * k + k * bits // 8)
        out = torch.zeros(nb, SPARSE_BLOCK, dtype=torch.float32, device=gathered.device)
        senders = torch.zeros_like(out) if self.aggregation == "senders" else None
        for g, w in enumerate(weights):
            if not w:
                continue  # a dropped group (weight 0) counts nowhere
            row = gathered[g]
            scales = row[:8 * nb].view(torch.float32).view(nb, 2)
            idx = row[8 * nb:(8 + 2 * k) * nb].view(torch.int16).view(nb, k).long()
            packed = row[(8 + 2 * k) * nb:].to(torch.int32).unsqueeze(1)
            codes = ((packed >> self._shifts(row.device)) & (2 ** bits - 1)).view(nb, k)
            out.scatter_add_(1, idx, self._values(scales[:, :1], scales[:, 1:], codes) * w)
            if senders is not None:
                senders.scatter_add_(1, idx, torch.full(idx.shape, float(w), device=out.device))
        if senders is not None:
            out = torch.where(senders > 0, out / senders.clamp(min=torch.finfo(torch.float32).tiny), out)
        return out.view(-1)

    def launch(self, mine, peers):
        payload, sent = self.encode(mine)
        gathered = torch.empty(peers.num_groups, payload.numel(), dtype=torch.uint8, device=mine.device)
        work = peers.transport.all_gather(gathered, payload.view(1, -1), async_op=True)  # gloo: rows match
        return Flight(work, gathered, payload, dropped=mine - sent if peers.feedback else None)

    def complete(self, flight, peers, mine):
        flight.work.wait()
        mine.copy_(self.aggregate(flight.held[0], peers.weights))


def make_codec(sync_dtype: str, *, density: float = 1 / 64, value_bits: int = 2,
               aggregation: str = "senders", collectives: str = "auto") -> Codec:
    """The codec of ``sync_dtype`` (:data:`fl_accel.wire.SYNC_DTYPES`); ValueError otherwise."""
    wire.check_sync_dtype(sync_dtype)
    makers = {"fp32": Fp32Mean, "bf16": lambda: Quantized("bf16", collectives),
              "int8": lambda: Quantized("int8", collectives),
              "sparse": lambda: Sparse(density, value_bits, aggregation)}
    return makers[sync_dtype]()


def codec_of(config, exact: bool = False) -> Codec:
    """The codec an FLConfig's sync uses (``exact``: the fp32 mean, e.g. the final sync)."""
    if exact:
        return Fp32Mean()
    return make_codec(config.sync_dtype, density=config.sync_density, value_bits=config.sync_value_bits,
                      aggregation=config.sparse_aggregation, collectives=config.sync_collectives)
