"""The compressed codecs of the sync, behind :class:`fl_accel.codecs.Codec` (the core holds
only the exact "fp32" mean), and the choice of a codec by ``sync_dtype``
(:func:`make_codec`, :func:`codec_of`).

* :class:`Quantized` ("bf16", "int8"; INTELLECT-1, arXiv 2412.01152): quantize into F
  sub-chunks (int8: one fp32 absmax scale per ``BLOCK`` = 256 values), all-to-all, sum this
  rank's sub-chunk weighted in fp32, re-quantize, all-gather.
* :class:`Sparse` ("sparse"; SparseLoCo, arXiv 2508.15706, and its code CCLoco,
  ``src/tplr/ccloco.py``): keep the k largest magnitudes of every 4096 values
  (:func:`~fl_accel.wire.sparse_k`), code each in ``bits`` bits (a sign and one of L = 2^(bits-1) levels
  lo + j (hi - lo)/(L-1) between the block's smallest and largest kept magnitude), all-gather
  every group's payload, then aggregate: ``"senders"`` (CCLoco) divides each index's weighted
  sum by the weight of the groups that sent it; ``"zero_fill"`` counts a group that did not
  send an index as a zero (the mean shrinks by about 1/F where groups pick different indices).
  Payload for nb blocks: [lo, step fp32 (8 nb)] [indices int16 (2 nb k)] [codes (nb k bits/8)].

Error feedback: the exchange adds ``decay`` x the residual to what it packs; these codecs
store (packed - decoded(sent)) of this rank's chunk back in it
(:func:`store_residual`). Every tensor stays on the input's
device (NCCL takes accelerator tensors only).
"""

from __future__ import annotations

import torch

from . import wire
from .codecs import Codec, Fp32Mean
from .wire import BLOCK, QMAX, SPARSE_AGGREGATIONS, SPARSE_BLOCK, sparse_k


def store_residual(ex, b, dropped: torch.Tensor) -> None:
    """Error feedback: the residual of each source in bucket ``b`` of exchange ``ex`` <-
    ``dropped`` (packed - decoded(sent), this rank's chunk) on this rank's chunk, zero
    elsewhere. Called by a lossy codec while launching."""
    size = b.flat.numel() // ex.t.num_chunks
    lo, hi = ex.t.chunk_index * size, (ex.t.chunk_index + 1) * size
    dropped = dropped.to(ex.residuals[b.idx[0]].device)
    offset = 0
    for i in b.idx:
        n = ex.sizes[i]
        a, z = max(lo, offset), min(hi, offset + n)
        res = ex.residuals[i].view(-1)
        res.zero_()
        if a < z:
            res[a - offset:z - offset].copy_(dropped[a - lo:z - lo])
        offset += n


class Quantized(Codec):
    """"bf16" / "int8": two collectives, both carrying ``value_bytes`` per value."""

    lossy = True

    def __init__(self, name: str):
        self.name = name
        self.value_bytes = wire.VALUE_BYTES[name]

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

    def launch(self, ex, b, mine):
        b.sent = self.quantize(mine, ex.round.num_groups)
        if ex.residuals is not None:
            store_residual(ex, b, mine - self.dequantize(b.sent).view(-1))
        b.recv = torch.empty_like(b.sent)
        b.work = ex.t.all_to_all(b.recv, b.sent, async_op=True)

    def advance(self, ex, b):
        b.work.wait()
        parts = self.dequantize(b.recv)  # [F, m]: group g's sub-chunk
        w = torch.tensor(ex.weights, dtype=torch.float32, device=parts.device).unsqueeze(1)
        mine = self.quantize((parts * w).sum(dim=0), 1)
        b.gathered = torch.empty(ex.round.num_groups, mine.shape[1], dtype=torch.uint8, device=mine.device)
        b.recv = b.sent = None
        b.work = ex.t.all_gather(b.gathered, mine, async_op=True)

    def complete(self, ex, b, mine):
        b.work.wait()
        mine.copy_(self.dequantize(b.gathered).view(-1))


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

    def launch(self, ex, b, mine):
        payload, sent = self.encode(mine)
        if ex.residuals is not None:
            store_residual(ex, b, mine - sent)
        b.gathered = torch.empty(ex.round.num_groups, payload.numel(), dtype=torch.uint8, device=mine.device)
        b.sent = payload
        b.work = ex.t.all_gather(b.gathered, payload.view(1, -1), async_op=True)  # gloo: rows match

    def complete(self, ex, b, mine):
        b.work.wait()
        mine.copy_(self.aggregate(b.gathered, ex.weights))


def make_codec(sync_dtype: str, *, density: float = 1 / 64, value_bits: int = 2,
               aggregation: str = "senders") -> Codec:
    """The codec of ``sync_dtype`` ("fp32", "bf16", "int8", "sparse"); ValueError otherwise."""
    makers = {"fp32": Fp32Mean, "bf16": lambda: Quantized("bf16"), "int8": lambda: Quantized("int8"),
              "sparse": lambda: Sparse(density, value_bits, aggregation)}
    if sync_dtype not in makers:
        raise ValueError(f"sync_dtype must be one of {sorted(makers)}, got {sync_dtype!r}")
    return makers[sync_dtype]()


def codec_of(config, exact: bool = False) -> Codec:
    """The codec an FLConfig's sync uses (``exact``: the fp32 mean, e.g. the final sync)."""
    if exact:
        return Fp32Mean()
    return make_codec(config.sync_dtype, density=config.sync_density, value_bits=config.sync_value_bits,
                      aggregation=config.sparse_aggregation)

