"""The wire: one codec per ``sync_dtype``, each owning its padding, its stages and its bytes.

An :class:`~fl_accel.exchange.Exchange` packs fp32 buckets and drives a codec through three
stages per bucket: :meth:`Codec.launch` (encode this rank's chunk, start the first "fl"
collective), :meth:`Codec.advance` (a second collective, for codecs that have one) and
:meth:`Codec.complete` (wait, write the weighted mean of the chunk over the groups into it).
:meth:`Codec.padding` and :meth:`Codec.wire` are :mod:`fl_accel.wire`'s formulas for the
codec's name (torch-free: :mod:`fl_accel.planning.cost` reads the same ones), turned into
bytes per rank with the ring formulas :mod:`fl_accel.comm` counts.

* :class:`Fp32Mean` ("fp32"): an in-place SUM all-reduce, pre-scaled by w_f when the weights
  differ, else divided by F afterwards (the paper's FedAvg, arXiv 2609.20359 Sec. 3).
* the lossy codecs ("bf16", "int8", "sparse") live in :mod:`fl_accel.compress`, behind the
  same interface.

Error feedback (a codec that loses information): the exchange adds ``decay`` x the residual
to what it packs; the codec stores (packed - decoded(sent)) of this rank's chunk back in it.
Every tensor stays on the input's device (NCCL takes accelerator tensors only).
"""

from __future__ import annotations

import torch

from . import wire


class Codec:
    """What one ``sync_dtype`` puts on the "fl" wire. Subclasses set ``name`` and ``lossy``."""

    name = ""
    lossy = False
    """True: the decoded mean differs from the exact one (error feedback applies)."""
    density, bits = 1 / 64, 2
    """"sparse"'s fraction of values kept and bits per value (the wire formulas take them)."""

    def padding(self, num_groups: int, num_chunks: int) -> int:
        """A bucket's fp32 length is padded to a multiple of this (C chunks of whole blocks)."""
        return wire.padding(self.name, num_groups, num_chunks)

    def wire(self, chunk_values: int, num_groups: int) -> list[tuple[str, float]]:
        """``[(op, tensor_bytes)]``: the "fl" collectives of one chunk of ``chunk_values`` fp32
        values over F groups, in :func:`fl_accel.wire.ring_bytes`'s terms
        (:func:`fl_accel.wire.wire_ops`)."""
        return wire.wire_ops(self.name, chunk_values, num_groups, self.density, self.bits)

    def launch(self, ex, b, mine: torch.Tensor) -> None:
        """Encode ``mine`` (this rank's chunk of bucket ``b``) and start the first collective."""
        raise NotImplementedError

    def advance(self, ex, b) -> None:
        """Second stage (codecs with two collectives); the default has none."""

    def complete(self, ex, b, mine: torch.Tensor) -> None:
        """Wait for ``b``'s collective and write the weighted mean into ``mine``."""
        raise NotImplementedError


class Fp32Mean(Codec):
    """"fp32": the exact weighted mean (all-reduce SUM). With residuals (the exact final sync of
    a lossy mode) nothing is dropped, so they are zeroed."""

    name = "fp32"

    def launch(self, ex, b, mine):
        b.piece = mine.clone() if ex.t.num_chunks > 1 else mine
        if ex.scale_first:
            w = ex.weights[ex.round.position]
            b.piece.mul_(w) if w else b.piece.zero_()  # zero, not 0 * NaN, for a dropped group
        for i in b.idx if ex.residuals is not None else ():
            ex.residuals[i].zero_()
        b.work = ex.t.all_reduce(b.piece, async_op=True)

    def complete(self, ex, b, mine):
        b.work.wait()
        if not ex.scale_first:
            b.piece.div_(ex.round.num_groups)
        if b.piece is not mine:
            mine.copy_(b.piece)

