"""What the compressed exchange puts on the wire (:mod:`fl_accel.exchange`), on the input's device.

* "bf16" / "int8": :func:`quantize`, :func:`dequantize` (int8: one fp32 absmax scale per
  ``BLOCK`` = 256 values, INTELLECT-1, arXiv 2412.01152).
* "sparse" (SparseLoCo, arXiv 2508.15706): :func:`sparse_encode` keeps the k largest
  magnitudes of every 4096 values (:func:`~fl_accel.cost_model.sparse_k`) and codes each in
  ``bits`` bits: a sign and one of L = 2^(bits-1) levels lo + j (hi - lo)/(L-1) between the
  block's smallest and largest kept magnitude (nearest). Payload for nb blocks: [lo, step
  fp32 (8 nb)] [indices int16 (2 nb k)] [codes, 8/bits per byte (nb k bits/8)].
"""

from __future__ import annotations

import torch

from .cost_model import BLOCK, SPARSE_BLOCK, sparse_k

QMAX = 127.0


def quantize(x: torch.Tensor, sync_dtype: str, rows: int) -> torch.Tensor:
    """fp32 ``x`` (numel divisible by ``rows`` * BLOCK for int8) -> uint8 ``[rows, row_bytes]``,
    row i sub-chunk i (payload, then the int8 scales)."""
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


def _shifts(bits: int, device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.int32, device=device)


def sparse_encode(x: torch.Tensor, density: float, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(payload, sent)`` of fp32 ``x`` (numel a multiple of 4096): uint8 payload and its
    dense fp32 decoding (``x - sent`` is what error feedback keeps)."""
    nb, k, levels = x.numel() // SPARSE_BLOCK, sparse_k(density, bits), 2 ** (bits - 1)
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
    payload[(8 + 2 * k) * nb:].copy_((codes.view(-1, per) << _shifts(bits, x.device)).sum(dim=1))
    sent = torch.zeros_like(blocks).scatter_(1, idx, _values(lo, step, codes, levels))
    return payload, sent.view(-1)


def _values(lo, step, codes, levels) -> torch.Tensor:
    """fp32 values of ``codes`` [nb, k] given the blocks' ``lo``, ``step`` [nb, 1]."""
    mag = lo + (codes % levels).to(torch.float32) * step
    return torch.where(codes >= levels, -mag, mag)


def sparse_sum(gathered: torch.Tensor, weights: list[float], density: float, bits: int) -> torch.Tensor:
    """fp32 sum_g w_g decode(``gathered[g]``), group by group (distinct indices per block:
    deterministic, the same on every rank)."""
    k, levels = sparse_k(density, bits), 2 ** (bits - 1)
    nb = gathered.shape[1] // (8 + 2 * k + k * bits // 8)
    out = torch.zeros(nb, SPARSE_BLOCK, dtype=torch.float32, device=gathered.device)
    for g, w in enumerate(weights):
        row = gathered[g]
        scales = row[:8 * nb].view(torch.float32).view(nb, 2)
        idx = row[8 * nb:(8 + 2 * k) * nb].view(torch.int16).view(nb, k).long()
        packed = row[(8 + 2 * k) * nb:].to(torch.int32).unsqueeze(1)
        codes = ((packed >> _shifts(bits, row.device)) & (2 ** bits - 1)).view(nb, k)
        out.scatter_add_(1, idx, _values(scales[:, :1], scales[:, 1:], codes, levels) * w)
    return out.view(-1)
