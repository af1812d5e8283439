"""What crosses the "fl" wire, in numbers: the one torch-free home of the sync's wire constants.

The codecs (:mod:`fl_accel.codecs`), the exchange's buckets (:mod:`fl_accel.exchange`), the
comm meter (:mod:`fl_accel.comm`) and the analytic models (:mod:`fl_accel.planning`) all
import their constants and byte formulas from here, so a prediction and a measurement count
the same bytes, and ``import fl_accel.planning.memory`` loads no torch
(tests/unit/test_torch_free.py). Units: fp32 values, bytes.

* A ring collective over p ranks of M bytes sends ``RING[op] (p-1)/p M`` bytes per rank
  (:func:`ring_bytes`; all-to-all: M is this rank's input).
* "fp32": one all-reduce of 4 bytes per value (FedAvg, arXiv 2609.20359 Sec. 3).
* "bf16", "int8" (INTELLECT-1, arXiv 2412.01152): with ``sync_collectives`` "all_to_all", an
  all-to-all and an all-gather, each of :data:`VALUE_BYTES` per value (int8: one fp32 absmax scale
  per :data:`BLOCK` values), 2 (F-1)/F x the payload; "all_gather", one all-gather of every group's
  payload, (F-1) x: equal at F = 2, where "auto" picks it (:func:`collectives`).
* "sparse" (SparseLoCo, arXiv 2508.15706): one all-gather of every group's payload,
  :func:`sparse_bytes` per chunk (k = :func:`sparse_k` values kept per :data:`SPARSE_BLOCK`).
"""

from __future__ import annotations

import math

SYNC_DTYPES = ("fp32", "bf16", "int8", "sparse")
"""Every ``FLConfig.sync_dtype``; all but "fp32" lose information (error feedback applies)."""
BLOCK = 256
"""Values per fp32 absmax scale of "int8"."""
QMAX = 127.0
"""The largest int8 code magnitude of "int8"."""
VALUE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / BLOCK}
"""Bytes per value on "fl" of the dense codecs (int8: the code and its share of a scale)."""
QUANTIZED = ("bf16", "int8")
"""The ``sync_dtype`` values that quantize densely (and read ``sync_collectives``)."""
COLLECTIVES = ("auto", "all_to_all", "all_gather")
"""``FLConfig.sync_collectives``: how "bf16"/"int8" cross the wire (:func:`collectives`)."""
SPARSE_BLOCK = 4096
"""Values per top-k block of "sparse" (int16 indices inside a block)."""
SPARSE_AGGREGATIONS = ("senders", "zero_fill")
"""``FLConfig.sparse_aggregation``: how "sparse" averages an index some groups did not send."""
RING = {"all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "broadcast": 1, "all_reduce": 2}
"""A ring collective over p ranks of M bytes sends RING[op] x (p-1)/p x M bytes per rank."""


def ring_bytes(op: str, tensor_bytes: float, group_size: int) -> float:
    """Bytes one rank sends in a ring ``op`` of ``tensor_bytes`` over ``group_size`` ranks
    (``int()`` of it is the exact floor). ValueError: unknown op, bytes < 0, group_size < 1."""
    if op not in RING:
        raise ValueError(f"op must be one of {sorted(RING)}, got {op!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    if isinstance(tensor_bytes, bool) or not isinstance(tensor_bytes, (int, float)) or not tensor_bytes >= 0 \
            or tensor_bytes == float("inf"):
        raise ValueError(f"tensor_bytes must be a non-negative finite number, got {tensor_bytes!r}")
    return RING[op] * float(tensor_bytes) * (group_size - 1) / group_size


def sparse_k(density: float, bits: int) -> int:
    """Values kept per 4096 by "sparse": ``density`` x 4096 rounded up to a multiple of 32 /
    ``bits`` (whole bytes of codes, fields 4-byte aligned), at least that multiple, at most 4096."""
    q = 32 // bits
    return min(SPARSE_BLOCK, max(q, math.ceil(density * SPARSE_BLOCK / q) * q))


def sparse_bytes(numel: int, density: float, bits: int) -> int:
    """"sparse" payload bytes of ``numel`` values (a multiple of 4096): per block two fp32
    (lowest kept magnitude, level step), k int16 indices, k ``bits``-bit codes."""
    k = sparse_k(density, bits)
    return numel // SPARSE_BLOCK * (8 + 2 * k + k * bits // 8)


def collectives(choice: str, num_groups: int) -> str:
    """"all_to_all" or "all_gather", what "bf16"/"int8" use for ``sync_collectives`` = ``choice`` over
    F = ``num_groups`` groups: "auto" is "all_gather" at F <= 2 (the same bytes, one collective, one
    rounding), else "all_to_all" (fewer bytes). ValueError: an unknown ``choice``."""
    if choice not in COLLECTIVES:
        raise ValueError(f"sync_collectives must be one of {list(COLLECTIVES)}, got {choice!r}")
    return ("all_gather" if num_groups <= 2 else "all_to_all") if choice == "auto" else choice


def check_sync_dtype(sync_dtype: str) -> None:
    """ValueError naming the known ones unless ``sync_dtype`` is one of :data:`SYNC_DTYPES`."""
    if sync_dtype not in SYNC_DTYPES:
        raise ValueError(f"sync_dtype must be one of {sorted(SYNC_DTYPES)}, got {sync_dtype!r}")


def padding(sync_dtype: str, num_groups: int, num_chunks: int) -> int:
    """An exchange bucket's fp32 length is padded to a multiple of this: ``num_chunks`` chunks,
    each of whole codec blocks (int8/bf16: F = ``num_groups`` sub-chunks of :data:`BLOCK`;
    sparse: :data:`SPARSE_BLOCK`; fp32: 1). ValueError: an unknown ``sync_dtype``."""
    check_sync_dtype(sync_dtype)
    if sync_dtype == "fp32":
        return num_chunks
    if sync_dtype == "sparse":
        return num_chunks * SPARSE_BLOCK
    return num_chunks * num_groups * BLOCK


def wire_ops(sync_dtype: str, chunk_values: int, num_groups: int, density: float = 1 / 64,
             bits: int = 2, sync_collectives: str = "auto") -> list[tuple[str, float]]:
    """``[(op, tensor_bytes)]``: the "fl" collectives of one chunk of ``chunk_values`` fp32
    values over F = ``num_groups`` groups, in :func:`ring_bytes`'s terms (``density`` and
    ``bits`` are "sparse"'s, ``sync_collectives`` "bf16"/"int8"'s). ValueError: an unknown
    ``sync_dtype`` or ``sync_collectives``."""
    check_sync_dtype(sync_dtype)
    if sync_dtype == "fp32":
        return [("all_reduce", 4.0 * chunk_values)]
    if sync_dtype == "sparse":
        return [("all_gather", num_groups * sparse_bytes(chunk_values, density, bits))]
    nbytes = chunk_values * VALUE_BYTES[sync_dtype]
    if collectives(sync_collectives, num_groups) == "all_gather":
        return [("all_gather", num_groups * nbytes)]
    return [("all_to_all", nbytes), ("all_gather", nbytes)]


def plan_buckets(sizes: list[int], bucket_values: int) -> list[list[int]]:
    """The exchange's buckets: indices of ``sizes`` (fp32 values per tensor) grouped in order,
    at most ``bucket_values`` values each (a larger tensor alone)."""
    out, total = [], 0
    for i, n in enumerate(sizes):
        if not out or total + n > bucket_values:
            out.append([])
            total = 0
        out[-1].append(i)
        total += n
    return out
