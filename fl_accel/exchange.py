"""The wire protocol of the sync: a weighted mean across federation groups, shard by shard.

:class:`Transport` holds this rank's side of the exchange (process groups, weights,
chunking); :meth:`Transport.start` packs a list of local tensors and returns an
:class:`Exchange`, whose :meth:`~Exchange.advance` and :meth:`~Exchange.finish` move
it on. All collectives are issued from the caller's thread, in program order, so
every rank issues them in the same order (what NCCL requires of concurrent
communicators); the asynchronous ones (``async_op=True``) run behind compute until
waited for.

Chunking (the 1/R rule of FL+HSDP, and unequal groups). A rank's flat buffer is cut
into ``C = R_min`` equal chunks; replica ``c < C`` of every group exchanges chunk
``c`` over the "fl" axis, so each shard crosses groups exactly once. Afterwards the
replicas of a group share the chunks over "dp_replicate": an all-gather when every
replica owns a chunk (``R_f == C``), else one broadcast per chunk from its owner.

Modes (``sync_dtype``), for a buffer of n fp32 values per rank (n padded, see below):

* "fp32": ``all_reduce(SUM)`` of the values (pre-scaled by w_f when the weights are
  unequal; divided by F afterwards when they are equal, which keeps the pre-streaming
  sync bitwise). Bytes on "fl": 2 (F-1)/F * 4n.
* "bf16" / "int8" (INTELLECT-1, arXiv 2412.01152; torchft's quantized all-reduce):
  each rank quantizes its buffer once (bf16, or int8 with one fp32 absmax scale per
  block of ``BLOCK`` = 256 values) into F sub-chunks, exchanges them with
  ``all_to_all_single`` (a reduce-scatter), dequantizes and sums its sub-chunk in fp32
  with the weights, re-quantizes the sum and ``all_gather_into_tensor``-s it. Bytes on
  "fl": 2 (F-1)/F * n * b with b = 2 (bf16) or 1 + 4/256 (int8): about 1/2 and 1/4
  of fp32. Payload and scales travel in one uint8 buffer per collective.

Padding: n is rounded up to a multiple of C (fp32), or of C * F * BLOCK (compressed).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

BLOCK = 256
"""Values per int8 scale (one fp32 absmax scale per block)."""
QMAX = 127.0


def _bytes_per_value(sync_dtype: str) -> float:
    return {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / BLOCK}[sync_dtype]


def wire_bytes(sync_dtype: str, values: int, fl_size: int) -> float:
    """Bytes one rank sends on the "fl" axis to average ``values`` fp32 values over
    ``fl_size`` ranks in ``sync_dtype`` (ring formulas; see the module docstring)."""
    if fl_size <= 1:
        return 0.0
    return 2.0 * (fl_size - 1) / fl_size * values * _bytes_per_value(sync_dtype)


# ---------------------------------------------------------------------- quantization
def quantize(x: torch.Tensor, sync_dtype: str, rows: int) -> torch.Tensor:
    """Quantize fp32 ``x`` (numel divisible by ``rows`` * BLOCK for int8) into a uint8
    tensor ``[rows, row_bytes]``: row i holds sub-chunk i (payload, then int8 scales)."""
    x = x.view(rows, -1)
    if sync_dtype == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8).view(rows, -1)
    m = x.shape[1]
    blocks = x.view(rows, m // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=2).div_(QMAX).clamp_(min=torch.finfo(torch.float32).tiny)
    q = torch.round(blocks / scale.unsqueeze(2)).clamp_(-QMAX, QMAX).to(torch.int8)
    out = torch.empty(rows, m + 4 * (m // BLOCK), dtype=torch.uint8, device=x.device)
    out[:, :m].view(torch.int8).copy_(q.view(rows, m))
    out[:, m:].view(torch.float32).copy_(scale)
    return out


def dequantize(buf: torch.Tensor, sync_dtype: str) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``[rows, row_bytes]`` uint8 -> ``[rows, m]`` fp32."""
    rows = buf.shape[0]
    if sync_dtype == "bf16":
        return buf.contiguous().view(torch.bfloat16).view(rows, -1).to(torch.float32)
    m = buf.shape[1] * BLOCK // (BLOCK + 4)
    q = buf[:, :m].contiguous().view(torch.int8).to(torch.float32)
    scale = buf[:, m:].contiguous().view(torch.float32)
    return (q.view(rows, m // BLOCK, BLOCK) * scale.unsqueeze(2)).view(rows, m)


def quantization_error_bound(x: torch.Tensor, sync_dtype: str) -> torch.Tensor:
    """Per-element bound of ``|dequantize(quantize(x)) - x|`` as computed in fp32: half an
    int8 step ``scale / 2`` of the element's block, widened by the fp32 roundings of
    ``x / scale`` (|q| <= 127, so at most 127 * 2^-24 of a step) and of ``q * scale`` and
    the difference (2^-23 |x|); or, for bf16, half an ulp of its 8 significant bits
    (at most 2^-8 |x|)."""
    if sync_dtype == "bf16":
        return x.abs() * 2.0 ** -8 + torch.finfo(torch.float32).tiny
    blocks = x.reshape(-1, BLOCK)
    scale = blocks.abs().amax(dim=1, keepdim=True) / QMAX
    return (scale * 0.5 * (1 + 2.0 ** -15)).expand_as(blocks).reshape(x.shape) + x.abs() * 2.0 ** -23


# ---------------------------------------------------------------------- transport
@dataclass
class Transport:
    """This rank's side of the group average.

    Attributes:
        fl_group: ProcessGroup of the "fl" exchange, or None (F == 1, or this rank
            owns no chunk: replica index >= R_min with unequal groups).
        replicate_group: ProcessGroup of "dp_replicate" in this group, or None (R_f == 1).
        num_groups: F.
        group_index: f.
        weights: w_g for g = 0..F-1 (sum 1).
        num_chunks: C = R_min.
        chunk_index: this rank's chunk (its replica index) or None.
        replicas: R_f of this rank's group.
        chunk_owners: global rank of the owner of chunk c in this group, c = 0..C-1
            (broadcast sources when R_f > C).
        sync_dtype: "fp32", "bf16" or "int8".
        bucket_values: fp32 values per bucket (``sync_bucket_mb``).
    """

    fl_group: object
    replicate_group: object
    num_groups: int
    group_index: int
    weights: tuple
    num_chunks: int
    chunk_index: int | None
    replicas: int
    chunk_owners: tuple
    sync_dtype: str = "fp32"
    bucket_values: int = 64 * 2**20

    @property
    def uniform(self) -> bool:
        return len(set(self.weights)) == 1

    def _padding(self, compressed: bool) -> int:
        return self.num_chunks * (self.num_groups * BLOCK if compressed else 1)

    def buckets(self, shapes: list[tuple[int, ...]]) -> list[list[int]]:
        """Indices of the tensors grouped into buckets of at most ``bucket_values`` values."""
        out, cur, size = [], [], 0
        for i, shape in enumerate(shapes):
            n = math.prod(shape)
            if cur and size + n > self.bucket_values:
                out.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += n
        if cur:
            out.append(cur)
        return out

    def start(self, tensors: list, *, shapes: list[tuple[int, ...]] | None = None, device=None,
              compressed: bool | None = None, mask: tuple | None = None,
              residuals: list[torch.Tensor] | None = None) -> "Exchange":
        """Pack ``tensors`` (local shards or pseudo-gradients) and launch their exchange.

        Args:
            tensors: this rank's values, or callables returning them (called one at a time
                while packing, so a computed value never exists for all tensors at once);
                read now, not later (the exchange owns copies).
            shapes, device: required when ``tensors`` holds callables.
            compressed: quantize per ``sync_dtype`` (default: ``sync_dtype != "fp32"``).
            mask: per-group 0/1 flags; groups flagged 0 contribute nothing and the
                weights are renormalized over the others (the non-finite reset).
            residuals: error feedback, one fp32 tensor per input (same shape): added to
                the values before quantization and overwritten with what quantization
                dropped from this rank's chunk. They may live in host memory while the
                exchange runs on ``device``.
        """
        compressed = (self.sync_dtype != "fp32") if compressed is None else compressed
        weights = list(self.weights)
        if mask is not None:
            total = sum(w * m for w, m in zip(weights, mask))
            weights = [w * m / total for w, m in zip(weights, mask)]
        if shapes is None:
            shapes = [tuple(x.shape) for x in tensors]
            device = tensors[0].device if tensors else torch.device("cpu")
        return Exchange(self, tensors, shapes, device, compressed, weights, mask is not None, residuals)


class Exchange:
    """One in-flight group average of a list of tensors; see :class:`Transport`.

    ``advance()`` moves a compressed exchange from its all-to-all to its all-gather
    (both asynchronous); ``finish()`` completes it and returns the fp32 means, one per
    input tensor, identical on every rank of every group.
    """

    def __init__(self, transport: Transport, tensors, shapes, device, compressed: bool, weights: list[float],
                 masked: bool, residuals):
        self.t = transport
        self.shapes = [tuple(s) for s in shapes]
        self.compressed = compressed
        self.weights = weights
        self.scale_first = masked or not transport.uniform
        self.stage = 0
        self.buckets = []
        self.stream = _side_stream(device)
        compute = torch.cuda.current_stream(device) if self.stream is not None else None
        with self._on_stream():
            for idx in transport.buckets(self.shapes):
                numel = sum(math.prod(self.shapes[i]) for i in idx)
                pad = transport._padding(compressed)
                flat = torch.zeros(math.ceil(numel / pad) * pad, dtype=torch.float32, device=device)
                offset = 0
                for i in idx:
                    n = math.prod(self.shapes[i])
                    value = tensors[i]() if callable(tensors[i]) else tensors[i]
                    flat[offset:offset + n].copy_(value.reshape(-1))
                    del value
                    if residuals is not None:  # a host residual (anchor_device="cpu") is copied here per tensor
                        flat[offset:offset + n].add_(residuals[i].reshape(-1).to(device, non_blocking=True))
                    offset += n
                self.buckets.append(_Bucket(idx, flat))
            if compute is not None:
                # Packing read theta on the side stream; the next optimizer step writes theta
                # on the compute stream, which must not overtake it (waits for packing only:
                # the collectives launched next run on the process group's own stream).
                compute.wait_stream(self.stream)
            self._launch(residuals)

    # ------------------------------------------------------------------ stages
    def _chunk(self, b: "_Bucket") -> torch.Tensor | None:
        t = self.t
        if t.chunk_index is None:
            return None
        size = b.flat.numel() // t.num_chunks
        return b.flat[t.chunk_index * size:(t.chunk_index + 1) * size]

    def _launch(self, residuals) -> None:
        t = self.t
        for b in self.buckets:
            mine = self._chunk(b)
            if mine is None or t.fl_group is None:
                continue
            if not self.compressed:
                b.piece = mine.clone() if t.num_chunks > 1 else mine
                if self.scale_first:
                    w = self.weights[t.group_index]
                    b.piece.mul_(w) if w else b.piece.zero_()  # zero, not 0 * NaN, for a dropped group
                b.work = dist.all_reduce(b.piece, op=dist.ReduceOp.SUM, group=t.fl_group, async_op=True)
                continue
            sent = quantize(mine, t.sync_dtype, t.num_groups)
            if residuals is not None:
                dropped = mine - dequantize(sent, t.sync_dtype).view(-1)
                self._store_residual(b, dropped, residuals)
            b.recv = torch.empty_like(sent)
            b.work = dist.all_to_all_single(b.recv, sent, group=t.fl_group, async_op=True)
            b.sent = sent
        self.stage = 1

    def _store_residual(self, b: "_Bucket", dropped: torch.Tensor, residuals) -> None:
        """residual <- (value + old residual) - dequantized(sent), on this rank's chunk only.

        Residuals in host memory (``anchor_device="cpu"``) receive it through one blocking
        device-to-host copy of this bucket's chunk."""
        t = self.t
        if residuals[b.idx[0]].device != dropped.device:
            dropped = dropped.to(residuals[b.idx[0]].device)
        size = b.flat.numel() // t.num_chunks
        lo, hi = t.chunk_index * size, (t.chunk_index + 1) * size
        offset = 0
        for i in b.idx:
            n = math.prod(self.shapes[i])
            a, z = max(lo, offset), min(hi, offset + n)
            res = residuals[i].view(-1)
            res.zero_()
            if a < z:
                res[a - offset:z - offset].copy_(dropped[a - lo:z - lo])
            offset += n

    def advance(self) -> None:
        """Compressed: wait for the all-to-all, reduce this rank's sub-chunk, launch the all-gather."""
        if self.stage != 1:
            return
        t = self.t
        with self._on_stream():
            for b in self.buckets:
                if b.work is None:
                    continue
                if not self.compressed:
                    continue
                b.work.wait()
                parts = dequantize(b.recv, t.sync_dtype)  # [F, m]: group g's sub-chunk
                w = torch.tensor(self.weights, dtype=torch.float32, device=parts.device).unsqueeze(1)
                reduced = (parts * w).sum(dim=0)
                mine = quantize(reduced, t.sync_dtype, 1)
                b.gathered = torch.empty(t.num_groups, mine.shape[1], dtype=torch.uint8, device=mine.device)
                b.work = dist.all_gather_single(b.gathered, mine, group=t.fl_group, async_op=True)
                b.recv = b.sent = None
        self.stage = 2

    def finish(self) -> list[torch.Tensor]:
        """Complete the exchange; returns one fp32 tensor per input (the weighted mean)."""
        t = self.t
        if self.stage == 1 and self.compressed:
            self.advance()
        with self._on_stream():
            for b in self.buckets:
                mine = self._chunk(b)
                if b.work is not None:
                    b.work.wait()
                    if self.compressed:
                        mine.copy_(dequantize(b.gathered, t.sync_dtype).view(-1))
                    else:
                        if not self.scale_first:
                            b.piece.div_(t.num_groups)
                        if b.piece is not mine:
                            mine.copy_(b.piece)
                self._share_chunks(b)
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
            for b in self.buckets:  # allocated on the side stream, read on the compute stream from now on
                b.flat.record_stream(torch.cuda.current_stream())
        out: list[torch.Tensor | None] = [None] * len(self.shapes)
        for b in self.buckets:
            offset = 0
            for i in b.idx:
                n = math.prod(self.shapes[i])
                out[i] = b.flat[offset:offset + n].view(self.shapes[i])
                offset += n
        self.stage = 3
        return out

    def _share_chunks(self, b: "_Bucket") -> None:
        """Give every replica of this group every chunk (over "dp_replicate")."""
        t = self.t
        if t.replicate_group is None or t.replicas <= 1:
            return
        size = b.flat.numel() // t.num_chunks
        if t.replicas == t.num_chunks:
            piece = b.flat[t.chunk_index * size:(t.chunk_index + 1) * size].clone()
            dist.all_gather_single(b.flat, piece, group=t.replicate_group)
            return
        for c in range(t.num_chunks):
            dist.broadcast(b.flat[c * size:(c + 1) * size], src=t.chunk_owners[c], group=t.replicate_group)

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()


class _Bucket:
    __slots__ = ("idx", "flat", "piece", "work", "recv", "sent", "gathered")

    def __init__(self, idx, flat):
        self.idx, self.flat = idx, flat
        self.piece = self.work = self.recv = self.sent = self.gathered = None


_STREAMS: dict = {}


def _side_stream(device: torch.device):
    """A CUDA stream for packing and quantizing off the compute stream (torchft's habit);
    None on CPU. It first waits for the compute stream, so it reads finished values."""
    if device.type != "cuda":
        return None
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream
