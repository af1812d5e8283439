"""fl_accel/codecs.py in-process: the encodings and aggregations of the lossy codecs on
tensors built here, without a process group (the collectives between them are an index
shuffle). The same codecs inside a real exchange over gloo: tests/dist/test_streaming_sync.py.

* int8: every value decodes within half a quantization step (absmax / 127 / 2) of its block;
  bf16 within bf16's rounding; the two-stage weighted mean of F groups (quantize, all-to-all,
  weighted sum, re-quantize, all-gather) within the sum of the two stages' bounds; the one
  all-gather mean (``sync_collectives="all_gather"``) within the first stage's bound alone,
  the same bits on every rank, a group of weight 0 counting nowhere;
* sparse: the k largest magnitudes of each 4096 are kept, decoded within half a level step,
  everything dropped is no larger than the smallest kept magnitude; two hand-built payloads
  aggregate as CCLoco says ("senders": divided by the weight of the groups that sent an
  index) or zero-filled ("zero_fill": a group that did not send an index counts as 0).
"""

from __future__ import annotations

import pytest
import torch

from fl_accel import FLConfig, wire
from fl_accel.codecs import Flight, Fp32Mean, Peers, Quantized, Sparse, codec_of, make_codec
from fl_accel.wire import BLOCK, QMAX, SPARSE_BLOCK, sparse_bytes, sparse_k


def _randn(n: int, seed: int) -> torch.Tensor:
    """Normal values times log-normal scales: blocks whose magnitudes span a few decades."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))


# ====================================================================== Quantized
def test_int8_round_trip_is_within_half_a_step_of_each_block():
    """quantize -> dequantize: payload [rows, m + 4 m / BLOCK] bytes; each value within
    absmax(block) / 127 / 2 of the original; a zero block stays exactly zero."""
    codec = Quantized("int8")
    rows, m = 2, 3 * BLOCK
    x = _randn(rows * m, seed=0)
    x[:BLOCK] = 0.0  # a block of zeros: its scale is clamped, its values decode to 0
    buf = codec.quantize(x, rows)
    assert buf.dtype == torch.uint8 and tuple(buf.shape) == (rows, m + 4 * (m // BLOCK))
    back = codec.dequantize(buf)
    assert tuple(back.shape) == (rows, m)
    blocks, err = x.view(-1, BLOCK), (back.view(-1) - x).abs().view(-1, BLOCK)
    half_step = blocks.abs().amax(dim=1, keepdim=True) / QMAX / 2
    assert (err <= half_step * (1 + 1e-6) + 1e-12).all()
    assert torch.equal(back.view(-1)[:BLOCK], torch.zeros(BLOCK))
    assert err.max() > 0  # lossy: not vacuous


def test_bf16_round_trip_is_bf16_rounding():
    codec = Quantized("bf16")
    x = _randn(4 * BLOCK, seed=1)
    back = codec.dequantize(codec.quantize(x, 4)).view(-1)
    assert torch.equal(back, x.to(torch.bfloat16).to(torch.float32))
    assert ((back - x).abs() <= x.abs() * 2 ** -8).all()


@pytest.mark.parametrize("weights", [(0.5, 0.5), (0.25, 0.75), (0.2, 0.3, 0.5)])
def test_int8_two_stage_mean_is_within_both_stages_bounds(weights):
    """The exchange's int8 path for F groups, each collective replaced by its index shuffle:
    group g's chunk quantized into F sub-chunks, sub-chunk r of every group to rank r
    (all-to-all), weighted fp32 sum, re-quantized, gathered (all-gather). Every value is within
    sum_g w_g halfstep_g (first stage) + halfstep(sum) (second) of the exact weighted mean."""
    codec = Quantized("int8")
    F, m = len(weights), 2 * BLOCK
    xs = [_randn(F * m, seed=10 + g) for g in range(F)]
    sent = [codec.quantize(x, F) for x in xs]  # [F, row bytes] per group
    gathered = []
    for r in range(F):  # rank r of the "fl" axis
        parts = codec.dequantize(torch.stack([sent[g][r] for g in range(F)]))  # [F, m]: every group's sub-chunk r
        w = torch.tensor(weights, dtype=torch.float32).unsqueeze(1)
        gathered.append(codec.quantize((parts * w).sum(dim=0), 1)[0])
    mean = codec.dequantize(torch.stack(gathered)).view(-1)
    exact = sum(w * x for w, x in zip(weights, xs))

    def half_step(t):
        return (t.view(-1, BLOCK).abs().amax(dim=1, keepdim=True) / QMAX / 2).expand(-1, BLOCK).reshape(-1)

    first = sum(w * half_step(x) for w, x in zip(weights, xs))
    second = half_step(first + exact.abs())  # the re-quantized sum's block absmax is at most this
    err = (mean - exact).abs()
    assert (err <= (first + second) * (1 + 1e-5) + 1e-12).all(), (err - first - second).max()
    assert err.max() > 0


class _Done:
    """A collective that has completed (the shuffle already put its output in place)."""

    def wait(self):
        return True


def _half_step(t: torch.Tensor) -> torch.Tensor:
    """Half an int8 step of each value's block: absmax / 127 / 2."""
    return (t.view(-1, BLOCK).abs().amax(dim=1, keepdim=True) / QMAX / 2).expand(-1, BLOCK).reshape(-1)


@pytest.mark.parametrize("weights", [(0.5, 0.5), (0.25, 0.75), (0.0, 1.0), (0.2, 0.3, 0.5)])
def test_int8_all_gather_mean_is_within_one_rounding_and_equal_on_every_rank(weights):
    """The one-all-gather path: every group's chunk quantized once and gathered ([F, payload], the
    same on every rank), summed in fp32 group by group. Every rank's mean has the same bits, and
    every value is within sum_g w_g halfstep_g of the exact weighted mean: the first stage's bound
    alone (no re-quantization). A group of weight 0 counts nowhere, even holding NaN."""
    codec = Quantized("int8", "all_gather")
    F, m = len(weights), 2 * BLOCK
    xs = [_randn(F * m, seed=20 + g) for g in range(F)]
    if weights[0] == 0:
        xs[0] = torch.full_like(xs[0], float("nan"))  # a dropped group's garbage
    gathered = torch.cat([codec.quantize(x, 1) for x in xs])  # what the all-gather leaves on every rank
    peers = Peers(None, F, 0, tuple(weights), True, 1, False)
    means = []
    for position in range(F):
        mine = xs[position].clone()
        codec.complete(Flight(_Done(), gathered), peers._replace(position=position), mine)
        means.append(mine)
    assert all(torch.equal(means[0], mean) for mean in means[1:])
    exact = sum(w * x for w, x in zip(weights, xs) if w)
    bound = sum(w * _half_step(x) for w, x in zip(weights, xs) if w)
    err = (means[0] - exact).abs()
    assert torch.isfinite(means[0]).all() and (err <= bound * (1 + 1e-5) + 1e-12).all(), (err - bound).max()
    assert err.max() > 0


def test_sync_collectives_choose_the_wire():
    """"auto": one all-gather at F = 2 (the same bytes as all-to-all + all-gather), all-to-all at F > 2;
    an unknown choice is a ValueError naming the field."""
    assert wire.collectives("auto", 2) == "all_gather" and wire.collectives("auto", 3) == "all_to_all"
    assert wire.collectives("all_to_all", 2) == "all_to_all" and wire.collectives("all_gather", 4) == "all_gather"
    n = 1024 * (1 + 4 / BLOCK)
    assert Quantized("int8").wire(1024, 2) == [("all_gather", 2 * n)]
    assert Quantized("int8", "all_to_all").wire(1024, 2) == [("all_to_all", n), ("all_gather", n)]
    two = [wire.ring_bytes(op, b, 2) for op, b in Quantized("int8", "all_to_all").wire(1024, 2)]
    assert wire.ring_bytes("all_gather", 2 * n, 2) == sum(two)  # F = 2: equal bytes
    with pytest.raises(ValueError, match="sync_collectives must be one of"):
        Quantized("int8", "ring")
    with pytest.raises(ValueError, match="sync_collectives"):
        FLConfig(sync_dtype="int8", sync_collectives="ring")
    assert codec_of(FLConfig(sync_dtype="bf16", sync_collectives="all_to_all")).collectives == "all_to_all"
    assert "sync_collectives" in FLConfig(sync_dtype="fp32", sync_collectives="all_gather").ignored_fields()


def test_quantized_padding_and_wire_bytes():
    int8, bf16 = Quantized("int8", "all_to_all"), Quantized("bf16", "all_to_all")
    assert int8.padding(num_groups=3, num_chunks=2) == 2 * 3 * BLOCK
    assert int8.wire(1024, 3) == [("all_to_all", 1024 * (1 + 4 / BLOCK)), ("all_gather", 1024 * (1 + 4 / BLOCK))]
    assert bf16.wire(1024, 3) == [("all_to_all", 2048.0), ("all_gather", 2048.0)]
    assert Fp32Mean().wire(1024, 3) == [("all_reduce", 4096.0)] and not Fp32Mean.lossy and int8.lossy


# ====================================================================== Sparse
@pytest.mark.parametrize("density,bits", [(1 / 64, 2), (0.02, 4), (1 / 4096, 8)])
def test_sparse_encode_keeps_the_top_k_within_half_a_level(density, bits):
    """encode: a payload of sparse_bytes; per block exactly k values sent, at the k largest
    magnitudes, with their signs, each within half a level step of the original (the smallest
    and the largest kept magnitude exactly); every value not sent is no larger than the
    smallest kept magnitude (so x - sent, the error feedback residual, holds only those)."""
    codec = Sparse(density, bits)
    nb = 3
    x = _randn(nb * SPARSE_BLOCK, seed=2)
    payload, sent = codec.encode(x)
    k = sparse_k(density, bits)
    assert codec.k == k and payload.dtype == torch.uint8 and payload.numel() == sparse_bytes(x.numel(), density, bits)
    xb, sb = x.view(nb, SPARSE_BLOCK), sent.view(nb, SPARSE_BLOCK)
    for b in range(nb):
        kept = sb[b].nonzero().view(-1)
        assert kept.numel() == k
        assert set(kept.tolist()) == set(xb[b].abs().topk(k).indices.tolist())
        mags = xb[b, kept].abs()
        lo, hi = mags.min(), mags.max()
        step = (hi - lo) / max(1, 2 ** (bits - 1) - 1)
        assert torch.equal(torch.sign(sb[b, kept]), torch.sign(xb[b, kept]))
        assert ((sb[b, kept] - xb[b, kept]).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all()
        assert torch.allclose(sb[b, kept].abs().min(), lo) and torch.allclose(sb[b, kept].abs().max(), hi)
        dropped = torch.ones(SPARSE_BLOCK, dtype=torch.bool)
        dropped[kept] = False
        assert (xb[b, dropped].abs() <= lo).all()


def _block(values: dict[range, float]) -> torch.Tensor:
    """One 4096-value block: ``value`` at every index of each range, 0 elsewhere."""
    x = torch.zeros(SPARSE_BLOCK)
    for where, value in values.items():
        x[list(where)] = value
    return x


@pytest.mark.parametrize("aggregation,weights,want", [
    # group 0 sends +1 at 0..15, group 1 sends -3 at 8..23 (k = 16, equal magnitudes decode exactly)
    ("senders", (0.5, 0.5), {range(0, 8): 1.0, range(8, 16): -1.0, range(16, 24): -3.0}),
    ("zero_fill", (0.5, 0.5), {range(0, 8): 0.5, range(8, 16): -1.0, range(16, 24): -1.5}),
    ("senders", (0.25, 0.75), {range(0, 8): 1.0, range(8, 16): -2.0, range(16, 24): -3.0}),
    ("zero_fill", (0.25, 0.75), {range(0, 8): 0.25, range(8, 16): -2.0, range(16, 24): -2.25}),
    ("senders", (1.0, 0.0), {range(0, 16): 1.0}),  # a dropped group (weight 0) counts nowhere
    ("zero_fill", (1.0, 0.0), {range(0, 16): 1.0}),
])
def test_sparse_aggregate_of_two_hand_built_payloads(aggregation, weights, want):
    """Two groups' payloads, gathered as the all-gather lays them out ([F, payload bytes]):
    "senders" divides each index's weighted sum by the weight of the groups that sent it,
    "zero_fill" by nothing (a group that did not send an index counts as 0); an index nobody
    sent is 0 either way."""
    codec = Sparse(density=16 / SPARSE_BLOCK, bits=2, aggregation=aggregation)
    assert codec.k == 16
    x0 = torch.cat([_block({range(0, 16): 1.0}), _block({range(100, 116): 2.0})])
    x1 = torch.cat([_block({range(8, 24): -3.0}), _block({range(108, 124): 2.0})])
    (p0, s0), (p1, s1) = codec.encode(x0), codec.encode(x1)
    assert torch.equal(s0, x0) and torch.equal(s1, x1)  # equal kept magnitudes: exact
    out = codec.aggregate(torch.stack([p0, p1]), list(weights))
    expected = torch.cat([_block(want), _block({range(100, 124): 0.0})])
    # the second block: both send 2.0 at 108..115, one of them at 100..107 and 116..123
    w0, w1 = weights
    for where, by in ((range(100, 108), (w0, 0)), (range(108, 116), (w0, w1)), (range(116, 124), (0, w1))):
        total = 2.0 * sum(by)
        expected[SPARSE_BLOCK + where.start:SPARSE_BLOCK + where.stop] = \
            (total / sum(by) if sum(by) else 0.0) if aggregation == "senders" else total
    assert torch.allclose(out, expected, atol=1e-6), (out - expected).abs().max()


def test_codec_choice_and_errors():
    assert isinstance(make_codec("fp32"), Fp32Mean) and make_codec("int8").name == "int8"
    sparse = make_codec("sparse", density=0.02, value_bits=4, aggregation="zero_fill")
    assert (sparse.density, sparse.bits, sparse.aggregation) == (0.02, 4, "zero_fill")
    with pytest.raises(ValueError, match="sync_dtype must be one of"):
        make_codec("fp8")
    with pytest.raises(ValueError, match="sparse aggregation must be one of"):
        Sparse(aggregation="mean")
    cfg = FLConfig(sync_dtype="sparse", error_feedback=True, sync_density=0.02)
    assert isinstance(codec_of(cfg), Sparse) and codec_of(cfg).density == 0.02
    assert isinstance(codec_of(cfg, exact=True), Fp32Mean)  # the exact final sync


def test_the_config_s_sync_dtypes_are_the_wire_s_names():
    """One home for the names: FLConfig.sync_dtype's choices are fl_accel.wire.SYNC_DTYPES (in
    order), and every one of them has a codec of that name."""
    import typing

    choices = typing.get_args(typing.get_type_hints(FLConfig)["sync_dtype"])
    assert choices == wire.SYNC_DTYPES
    assert [make_codec(name).name for name in choices] == list(wire.SYNC_DTYPES)
