"""Unit tests of fl_accel.planning.cost: hand-computed cases, the wire protocol of
fl_accel.exchange, Llama units against real models, the 8B figures, the time model, CLI."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fl_accel import FLConfig
from fl_accel.planning import cost as cm
from fl_accel import codecs, wire
from scripts import cost_model as cost_cli
from fl_accel.planning import units as mu
from fl_accel.comm import ring_bytes as measured_ring_bytes
from fl_accel.mesh import FLLayout

EQ = FLLayout.equal


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-9)


def est(layout, units=1000, **kw):
    kw.setdefault("sync_every", 1)
    return cm.estimate(layout, units, **kw)


def estimate_from_config(config, world_size: int, units, *, ranks_per_node=None, **kw) -> cm.CommEstimate:
    """:func:`fl_accel.planning.cost.estimate` of an FLConfig's layout and sync fields (``kw``
    overrides them): the model of the run an FLConfig makes, for the tests that compare it
    with what a run measured (tests/dist/test_streaming_sync.py, test_overlap_sync.py,
    tests/recipe/test_recipe.py)."""
    layout = FLLayout.from_config(config, world_size, ranks_per_node)
    names = ("sync_every", "num_fragments", "sync_dtype", "sync_delay", "sync_bucket_mb", "sync_density",
             "sync_value_bits", "final_sync", "delayed_local_steps", "sync_warmup_steps", "sync_collectives")
    return cm.estimate(layout, units, ranks_per_node=ranks_per_node, **{**{k: getattr(config, k) for k in names}, **kw})


# ------------------------------------------------------------------ ring formulas
@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast"])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_ring_bytes_matches_comm_accounting(op, p):
    m = 4096 * p  # divisible: the integer accounting is exact
    assert cm.ring_bytes(op, m, p) == measured_ring_bytes(op, m, p)


def test_value_bytes_are_the_exchange_s():
    """The exchange quantizes in blocks of wire.BLOCK values: b bytes per value on the wire."""
    import torch

    assert wire.BLOCK == 256
    x = torch.randn(4 * wire.BLOCK)
    for dtype in ("bf16", "int8"):
        assert codecs.Quantized(dtype).quantize(x, 4).numel() == approx(x.numel() * wire.VALUE_BYTES[dtype])


# ------------------------------------------------------------------ the four algorithms, by hand
def test_fsdp_small():
    e = est(EQ(1, 1, 8), param_bytes=2)
    assert e.step[0].bytes == {"dp_shard": {"all_gather": approx(2 * 2000 * 7 / 8),
                                            "reduce_scatter": approx(2000 * 7 / 8)}}
    assert e.by_axis() == {"fl": 0, "dp_replicate": 0, "dp_shard": approx(5250), "world": 0}
    assert e.inter_group == 0 and e.intra_group == approx(5250) == e.total
    assert e.inter_node is None and e.spans_nodes is None and e.peak_sync_bytes == 0


def test_hsdp_small():
    e = est(EQ(1, 4, 2), param_bytes=2, grad_bytes=4)
    assert e.layout.algorithm == "hsdp"
    assert e.step[0].bytes == {"dp_shard": {"all_gather": approx(2000), "reduce_scatter": approx(2000)},
                               "dp_replicate": {"all_reduce": approx(2 * 3 / 4 * 4000 / 2)}}
    assert e.fragments == [] and e.by_axis()["fl"] == 0


def test_fl_fsdp_small():
    e = est(EQ(4, 1, 2), sync_every=4, param_bytes=2)
    shard = 1000 / 2 * 4  # fp32 local shard bytes
    assert e.sync_by_axis() == {"fl": approx(2 * 3 / 4 * shard), "dp_replicate": 0, "dp_shard": 0,
                                "world": approx(2 * 7 / 8 * 4 * 4)}
    assert e.by_axis()["fl"] == approx(2 * 3 / 4 * shard / 4)
    assert e.by_axis(amortized=False)["fl"] == 0
    assert e.by_axis()["dp_shard"] == approx(3 * 2000 / 2)
    assert e.fragments[0][0].calls == {"fl": 1, "world": 1}


def test_fl_hsdp_small_chunks_cross_groups_once():
    e = est(EQ(2, 2, 2), sync_every=2)
    shard = 1000 / 2 * 4
    sync = e.fragments[0][0].bytes
    assert sync["fl"] == {"all_reduce": approx(2 * 1 / 2 * shard / 2)}  # chunk 1/R per replica
    assert sync["dp_replicate"] == {"all_gather": approx(1 / 2 * shard)}
    grad = 2 * 1 / 2 * 4000 / 2
    assert e.by_axis()["dp_replicate"] == approx(grad + shard / 2 / 2)


def test_unequal_groups_broadcast_inside_larger_group():
    unit = [cm.ShardUnit("w", 32, True, ((8, 4),))]  # local shard at S=2: 16 values
    e = est(FLLayout((2, 4), 2, "fl_hsdp"), unit, sync_every=2, param_bytes=4)
    small, large = e.fragments[0]
    assert e.layout.min_replicas == 1
    assert small.of("fl") == large.of("fl") == approx(2 * 1 / 2 * 16 * 4)
    assert small.of("dp_replicate") == 0 and large.bytes["dp_replicate"] == {"broadcast": approx(1 / 2 * 64)}
    assert large.calls["dp_replicate"] == 1
    g0, g1 = e.by_group()
    assert g0["dp_replicate"] == 0 and g1["dp_replicate"] == approx(2 * 1 / 2 * 32 * 4 / 2 + 32 / 2)
    assert e.by_axis()["dp_replicate"] == g1["dp_replicate"]  # max over groups
    # groups of 2 and 3 replicas: 2 chunks; all-gather in the first, 2 broadcasts in the second
    e = est(FLLayout((4, 6), 2, "fl_hsdp"), unit)
    a, b = e.fragments[0]
    assert a.bytes["fl"] == b.bytes["fl"] == {"all_reduce": approx(2 * 1 / 2 * 8 * 4)}
    assert a.bytes["dp_replicate"] == {"all_gather": approx(1 / 2 * 64)}
    assert b.bytes["dp_replicate"] == {"broadcast": approx(2 * 2 / 3 * 32)} and b.calls["dp_replicate"] == 2


@pytest.mark.parametrize("dtype,limit", [("bf16", 0.52), ("int8", 0.27)])
def test_sync_dtypes(dtype, limit):
    units = cm.units_from_param_count(2**20)  # local 2**19 values: no padding at C*F*256 = 1024
    fp32 = est(EQ(4, 1, 2), units)
    low = est(EQ(4, 1, 2), units, sync_dtype=dtype)
    assert low.sync_by_axis()["fl"] == approx(2 * 3 / 4 * 2**19 * wire.VALUE_BYTES[dtype])  # ring, F=4
    assert low.sync_by_axis()["fl"] <= limit * fp32.sync_by_axis()["fl"]
    assert set(low.fragments[0][0].bytes["fl"]) == {"all_to_all", "all_gather"}
    assert low.fragments[0][0].calls["fl"] == 2
    assert low.by_axis()["dp_shard"] == fp32.by_axis()["dp_shard"]


def test_sparse_bytes_formula_and_payload():
    """"sparse": an all-gather of (F-1) x the payload per rank, the payload being per 4096
    values 8 + 2k + k bits/8 bytes (k = density x 4096 rounded up to 32/bits); it is what
    fl_accel.codecs.Sparse.encode really builds, and at the default density (1/64, 2
    bits) it is <= 0.05x the fp32 all-reduce for F <= 10 groups (F x 0.00464)."""
    from fl_accel.codecs import Sparse

    assert [wire.sparse_k(d, b) for d, b in ((1 / 64, 2), (0.02, 2), (0.02, 8), (1e-6, 4), (1.0, 2))] == \
        [64, 96, 84, 8, 4096]
    for density, bits in ((1 / 64, 2), (0.02, 4), (0.1, 8)):
        payload, _ = Sparse(density, bits).encode(torch.randn(3 * wire.SPARSE_BLOCK))
        assert payload.dtype == torch.uint8 and payload.numel() == wire.sparse_bytes(3 * wire.SPARSE_BLOCK, density, bits)
    units = cm.units_from_param_count(2**22)  # local 2**21 values: a multiple of 4096
    for F in (2, 4, 10, 16):
        fp32 = est(EQ(F, 1, 2), units).sync_by_axis()["fl"]
        sparse = est(EQ(F, 1, 2), units, sync_dtype="sparse")
        assert sparse.sync_by_axis()["fl"] == approx((F - 1) * 2**21 // 4096 * (8 + 2 * 64 + 64 // 4))
        assert set(sparse.fragments[0][0].bytes["fl"]) == {"all_gather"} and sparse.fragments[0][0].calls["fl"] == 1
        assert (sparse.sync_by_axis()["fl"] / fp32 <= 0.05) == (F <= 10)
    low = est(EQ(2, 1, 2), units, sync_dtype="sparse", sync_density=0.01, sync_value_bits=8)
    assert low.sync_by_axis()["fl"] == approx(2**21 // 4096 * (8 + 3 * 44))


def test_fragments_cut_peak_not_amortized_bytes():
    units = [cm.ShardUnit(f"u{i}", 4096, True, ((64, 64),)) for i in range(8)]
    one = est(EQ(4, 1, 2), units, sync_every=8)
    four = est(EQ(4, 1, 2), units, sync_every=8, num_fragments=4)
    assert four.peak_sync_bytes == approx(one.peak_sync_bytes / 4)
    for axis in ("fl", "dp_replicate", "dp_shard"):
        assert four.by_axis()[axis] == approx(one.by_axis()[axis])
    assert four.by_axis()["world"] == approx(4 * one.by_axis()["world"])  # one flag check per sync event
    assert four.weights == [1 / 8] * 4 and [len(f) for f in four.fragments] == [4] * 4


def test_units_are_dealt_strided_and_a_fragment_is_never_empty():
    """Fragment k holds units k, k+P, ... (the synchronizer deals the same way: fl_accel.sync);
    more fragments than units is a ValueError naming num_fragments, also from estimate."""
    assert cm.deal_fragments(list("abcde"), 2) == [["a", "c", "e"], ["b", "d"]]
    assert cm.deal_fragments(list("ab"), 2) == [["a"], ["b"]]
    with pytest.raises(ValueError, match="num_fragments=3 exceeds the 2 FSDP units"):
        cm.deal_fragments(list("ab"), 3)
    units = [cm.ShardUnit(f"u{i}", 64, True, ((8, 8),)) for i in range(2)]
    with pytest.raises(ValueError, match="num_fragments=4 exceeds the 2 FSDP units"):
        est(EQ(2, 1, 2), units, sync_every=8, num_fragments=4)


def test_padding():
    unit = cm.ShardUnit("a", 15, True, ((5, 3),))
    assert unit.padded_numel(4) == 8 * 3 and unit.local_sizes(4) == [6]
    assert cm.ShardUnit("x", 6).padded_numel(4) == 6  # no shapes: no padding
    five = [cm.ShardUnit("b", 5, True, ((5,),))]  # local shard: 3 values
    e = est(EQ(2, 2, 2), five)  # fp32: padded to C = 2 -> 4 values, chunks of 2
    assert e.sync_by_axis()["fl"] == approx(2 * 1 / 2 * 2 * 4)
    e = est(EQ(2, 2, 2), five, sync_dtype="int8")  # C * F * 256 = 1024 values, chunks of 512
    assert e.sync_by_axis()["fl"] == approx(2 * 1 / 2 * 512 * (1 + 4 / 256))
    assert e.sync_by_axis()["dp_replicate"] == approx(1 / 2 * 1024 * 4)


def test_buckets_pad_and_count_separately():
    units = [cm.ShardUnit(f"u{i}", 400_000, True, ((400_000,),)) for i in range(3)]  # 200k local each
    e = est(EQ(2, 1, 2), units, sync_bucket_mb=1)  # 262,144 values per bucket: 3 buckets
    assert e.fragments[0][0].calls["fl"] == 3
    for collectives, calls in (("all_to_all", 6), ("all_gather", 3), ("auto", 3)):  # F = 2: "auto" gathers
        e = est(EQ(2, 1, 2), units, sync_bucket_mb=1, sync_dtype="int8", sync_collectives=collectives)
        assert e.fragments[0][0].calls["fl"] == calls, collectives
        # the same bytes either way at F = 2; 200,192 = 391 * 512
        assert e.sync_by_axis()["fl"] == approx(3 * 2 * 1 / 2 * 200_192 * (1 + 4 / 256)), collectives
    gathered, reduced = (est(EQ(4, 1, 2), units, sync_bucket_mb=1, sync_dtype="int8", sync_collectives=c)
                         for c in ("all_gather", "all_to_all"))  # F = 4: (F-1) x against 2 (F-1)/F x the payload
    assert gathered.sync_by_axis()["fl"] == pytest.approx(2 * reduced.sync_by_axis()["fl"], rel=0.01)


def test_reshard_and_micro_batches():
    units = [cm.ShardUnit("a", 15, True, ((5, 3),)), cm.ShardUnit("b", 8, False, ((8,),))]
    e = est(EQ(1, 1, 4), units, param_bytes=1, grad_bytes=1, micro_batches=3)
    assert e.step[0].bytes["dp_shard"] == {"all_gather": approx(3 / 4 * 3 * (2 * 24 + 8)),
                                           "reduce_scatter": approx(3 / 4 * 32)}
    assert e.step[0].calls["dp_shard"] == 3 * (2 + 1) + 2


def test_total_steps_counts_the_runs_syncs():
    e = est(EQ(4, 1, 2), sync_every=8, total_steps=20)  # syncs after steps 8, 16 and the last (20)
    assert (e.weights, e.full_weight) == ([2 / 20], 1 / 20)
    assert est(EQ(4, 1, 2), sync_every=4, total_steps=20).full_weight == 0  # step 20 synced
    units = [cm.ShardUnit(f"u{i}", 8) for i in range(4)]
    e = est(EQ(4, 1, 2), units, sync_every=8, num_fragments=4, sync_delay=1, total_steps=20)
    assert e.weights == [3 / 20, 3 / 20, 2 / 20, 2 / 20] and e.full_weight == 1 / 20
    e = est(EQ(4, 1, 2), units, sync_every=8, num_fragments=4, sync_delay=1, total_steps=21)
    assert e.weights == [3 / 21, 3 / 21, 3 / 21, 2 / 21]  # fragment 2 launched at step 21
    assert est(EQ(1, 1, 8), total_steps=20).weights == []


def test_node_split():
    e = est(EQ(4, 1, 4), ranks_per_node=4)
    assert e.spans_nodes == {"fl": True, "dp_replicate": False, "dp_shard": False, "world": True}
    assert e.inter_node == approx(e.inter_group) and e.intra_node == approx(e.intra_group)
    assert est(EQ(2, 4, 2), ranks_per_node=4).spans_nodes["dp_replicate"] is True
    assert est(EQ(1, 1, 4), ranks_per_node=4).inter_node == 0


def test_estimate_from_config_and_as_dict():
    cfg = FLConfig(algorithm="fl_hsdp", num_groups=2, hsdp_shard_size=2, sync_every=4, num_fragments=2,
                   sync_dtype="int8")
    units = [cm.ShardUnit("a", 8), cm.ShardUnit("b", 8)]
    e = estimate_from_config(cfg, 8, units, ranks_per_node=4)
    assert (e.layout.shape, e.sync_every, e.num_fragments, e.sync_dtype) == ((2, 2, 2), 4, 2, "int8")
    assert json.loads(json.dumps(e.as_dict()))["sync_dtype"] == "int8"
    with pytest.raises(ValueError, match="num_groups"):
        estimate_from_config(FLConfig(algorithm="fl_fsdp", num_groups=3), 8, 1000)


@pytest.mark.parametrize("kwargs,name", [
    (dict(sync_every=0), "sync_every"), (dict(sync_every=8, num_fragments=3), "num_fragments"),
    (dict(sync_every=8, num_fragments=2, sync_delay=9), "sync_delay"), (dict(sync_dtype="fp8"), "sync_dtype"),
    (dict(param_bytes=0), "param_bytes"), (dict(grad_bytes=-2), "grad_bytes"),
    (dict(grad_bytes=float("nan")), "grad_bytes"), (dict(micro_batches=0), "micro_batches"),
    (dict(ranks_per_node=0), "ranks_per_node"), (dict(units=-5), "params"), (dict(units=[]), "units"),
    (dict(total_steps=0), "total_steps"), (dict(units=0.4), "params"),
    (dict(sync_every=2, num_fragments=2, units=7), "num_fragments"),  # 1 unit, 2 fragments
])
def test_bad_inputs_raise_naming_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        est(EQ(2, 1, 4), **kwargs)


def test_bad_inputs_other_functions():
    with pytest.raises(ValueError, match="op"):
        cm.ring_bytes("scatter", 10, 2)
    with pytest.raises(ValueError, match="group_size"):
        cm.ring_bytes("all_reduce", 10, 0)
    with pytest.raises(ValueError, match="config.hidden_size"):
        mu.llama_units({"vocab_size": 10, "intermediate_size": 4, "num_hidden_layers": 1, "num_attention_heads": 1})
    with pytest.raises(ValueError, match="numel"):
        cm.ShardUnit("x", 5, True, ((2, 2),))
    with pytest.raises(ValueError, match="wrap_cls_names"):
        mu.units_from_module(torch.nn.Linear(2, 2), ["Block"])


# ------------------------------------------------------------------ time model
def _two_nodes(**kw):  # 2 groups x 4 ranks, one node each; H = 2
    return est(EQ(2, 1, 4), sync_every=2, param_bytes=2, ranks_per_node=4, **kw)


def test_time_model_hand_case_with_nic_sharing():
    e = _two_nodes()
    t = cm.predict_step_time(e, compute_s=1.0, intra_node_bw=1000.0, inter_node_bw=100.0, tokens_per_rank=10)
    intra = 3 * 3 / 4 * 2000  # dp_shard bytes per step
    fl = 2 * 1 / 2 * 250 * 4  # per sync; 4 rings leave each node at once: 100/4 B/s each
    world = 2 * 7 / 8 * 4 * 2
    assert t.comm_s_by_axis == {"dp_shard": approx(intra / 1000), "fl": approx(fl / 25 / 2),
                                "world": approx(world / 100 / 2), "dp_replicate": 0}
    assert t.exposed_sync_s == approx((fl / 25 + world / 100) / 2)
    assert t.step_s == approx(1.0 + intra / 1000 + t.exposed_sync_s)
    assert t.comm_s == approx(sum(t.comm_s_by_axis.values()))
    assert t.tokens_per_s == approx(8 * 10 / t.step_s)
    one_nic_each = cm.predict_step_time(e, compute_s=1.0, intra_node_bw=1000.0, inter_node_bw=100.0, ranks_per_nic=1)
    assert one_nic_each.comm_s_by_axis["fl"] == approx(fl / 100 / 2) and one_nic_each.tokens_per_s is None
    by_axis = cm.predict_step_time(e, compute_s=1.0, intra_node_bw=1000.0, inter_node_bw=100.0,
                                   ranks_per_nic={"fl": 2})
    assert by_axis.comm_s_by_axis["fl"] == approx(fl / 50 / 2)


def test_time_model_latency_counts_collectives():
    e = _two_nodes()
    kw = dict(compute_s=1.0, intra_node_bw=1000.0, inter_node_bw=100.0)
    base, slow = cm.predict_step_time(e, **kw), cm.predict_step_time(e, latency_s=0.01, **kw)
    # per step: 2 all-gathers + 1 reduce-scatter; per sync (every 2 steps): fl all-reduce + flags
    assert slow.step_s - base.step_s == approx(0.03 + 0.02 / 2)


def test_time_model_tau_overlaps_the_fl_exchange():
    e = est(EQ(2, 1, 4), sync_every=4, ranks_per_node=4)
    kw = dict(intra_node_bw=1e12, inter_node_bw=100.0)
    t_fl = 2 * 1 / 2 * 250 * 4 / 25  # 40 s
    t_world = 2 * 7 / 8 * 8 / 100
    blocking = cm.predict_step_time(e, compute_s=10.0, **kw)
    assert blocking.exposed_sync_s == approx((t_fl + t_world) / 4)
    partial = cm.predict_step_time(e, compute_s=10.0, sync_delay=1, **kw)
    assert partial.exposed_sync_s == approx((t_fl - 10.0 + t_world) / 4)
    hidden = cm.predict_step_time(e, compute_s=100.0, sync_delay=3, **kw)
    assert hidden.exposed_sync_s == approx(t_world / 4) and hidden.comm_s == approx(blocking.comm_s)
    assert cm.predict_step_time(est(EQ(2, 1, 4), sync_every=4, sync_delay=3, ranks_per_node=4), compute_s=100.0,
                                **kw).exposed_sync_s == approx(hidden.exposed_sync_s)  # default: the estimate's tau


def test_time_model_unequal_groups_take_the_slowest():
    e = est(FLLayout((2, 4), 2, "fl_hsdp"), sync_every=2, ranks_per_node=2)
    t = cm.predict_step_time(e, compute_s=0.0, intra_node_bw=1e3, inter_node_bw=1e2)
    assert t.comm_s_by_axis["dp_replicate"] > 0  # the larger group's replicas


def test_time_model_bad_inputs():
    kw = dict(compute_s=1.0, intra_node_bw=1.0, inter_node_bw=1.0)
    with pytest.raises(ValueError, match="ranks_per_node"):
        cm.predict_step_time(est(EQ(1, 1, 8)), **kw)
    e = _two_nodes()
    for bad, name in [({"inter_node_bw": 0}, "inter_node_bw"), ({"compute_s": -1}, "compute_s"),
                      ({"latency_s": -1}, "latency_s"), ({"sync_delay": 3}, "sync_delay"),
                      ({"ranks_per_nic": -1}, "ranks_per_nic")]:
        with pytest.raises(ValueError, match=name):
            cm.predict_step_time(e, **{**kw, **bad})


# ------------------------------------------------------------------ Llama units
def test_llama_8b_param_count_and_units():
    units = mu.llama_units(mu.LLAMA_3_1_8B)
    assert sum(u.numel for u in units) == 8_030_261_248 and len(units) == 34
    assert [u.name for u in units[:2]] == ["embed", "model.layers.0"] and units[-1].name == "tail"
    assert units[0].reshard_after_forward and not units[-1].reshard_after_forward
    assert units[-1].numel == 128256 * 4096 + 4096


@pytest.mark.parametrize("tied,bias", [(False, False), (True, False), (False, True), (True, True)])
def test_llama_units_equal_units_from_module(tied, bias):
    cfg = LlamaConfig(
        vocab_size=101, hidden_size=24, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied, attention_bias=bias, mlp_bias=bias)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    units = mu.units_from_module(model)
    assert units == mu.llama_units(cfg)
    assert sum(u.numel for u in units) == sum(p.numel() for p in model.parameters())
    assert [u.name for u in units][0] == ("tail" if tied else "embed")  # the tied tail sits at the embedding


# ------------------------------------------------------------------ the 8B figures (128 nodes x 4 GPUs)
def test_8b_fsdp_about_48gb_all_inter_node():
    e = est(EQ(1, 1, 512), 8.03e9, param_bytes=2, ranks_per_node=4)
    assert e.total / 1e9 == pytest.approx(48.09, abs=0.01) and e.inter_node == approx(e.total)
    exact = est(EQ(1, 1, 512), mu.llama_units(mu.LLAMA_3_1_8B), param_bytes=2, ranks_per_node=4)
    assert exact.total / 1e9 == pytest.approx(47.05, abs=0.01)  # the tail is not resharded


def test_8b_fl_fsdp_inter_node_per_step():
    e = est(EQ(128, 1, 4), 8.03e9, sync_every=8, param_bytes=2, ranks_per_node=4)
    assert e.inter_node / 1e9 == pytest.approx(1.992, abs=0.002)
    assert e.intra_node / 1e9 == pytest.approx(36.13, abs=0.01)
    units = mu.llama_units(mu.LLAMA_3_1_8B)
    blocking = est(EQ(128, 1, 4), units, sync_every=8, param_bytes=2, ranks_per_node=4)
    streaming = est(EQ(128, 1, 4), units, sync_every=8, num_fragments=4, param_bytes=2, ranks_per_node=4)
    assert streaming.inter_node == pytest.approx(blocking.inter_node, rel=1e-6)
    assert 0.25 <= streaming.peak_sync_bytes / blocking.peak_sync_bytes < 0.3  # embed + 8 layers of 34 units


# ------------------------------------------------------------------ CLI
def test_cli_json(capsys):
    assert cost_cli.main(["--params", "8.03e9", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["num_fragments"] for d in data] == [1, 1, 4, 4, 4] and data[0]["time"] is None
    assert data[1]["inter_node"] == pytest.approx(1.992e9, rel=1e-3)



def test_intra_node_link_has_presets_and_a_stated_default(capsys):
    """Issue 42: step times need no invented intra-node speed. Without ``--intra-node-link`` or
    ``--intra-node-gbs`` the model uses the ``nvlink`` preset (300 GB/s per direction, the
    paper's A100 nodes) and says so in the table's footer, the JSON and ``--help``; a preset
    equals its figure given as ``--intra-node-gbs``; PCIe makes FL+FSDP's step (its groups within a node) slower; an
    unknown preset, or a link without step times, is a one-line error."""
    from _launch import assert_one_line_error
    from fl_accel.planning.links import DEFAULT_INTRA_NODE_LINK, INTRA_NODE_LINKS, intra_node_link

    assert DEFAULT_INTRA_NODE_LINK == "nvlink" and INTRA_NODE_LINKS["nvlink"].bytes_per_s == 300e9
    assert {"nvlink", "pcie", "loopback"} <= set(INTRA_NODE_LINKS)
    assert all(link.source and link.bytes_per_s > 0 for link in INTRA_NODE_LINKS.values())
    with pytest.raises(ValueError, match="unknown intra-node link 'infiniband': one of nvlink"):
        intra_node_link("infiniband")
    times = {}
    for name, extra in (("default", []), ("nvlink", ["--intra-node-link", "nvlink"]),
                        ("300", ["--intra-node-gbs", "300"]), ("pcie", ["--intra-node-link", "pcie"])):
        assert cost_cli.main(["--compute-s", "1", "--inter-node-gbs", "12.5", "--json", *extra]) == 0
        rows = json.loads(capsys.readouterr().out)
        times[name] = [r["time"]["step_s"] for r in rows]
        link = rows[0]["time"]["intra_node_link"]
        if name == "default":
            assert link["name"] == "nvlink" and link["default"] and link["bytes_per_s"] == 300e9, link
        if name == "pcie":
            assert link["bytes_per_s"] == 32e9 and not link["default"], link
    assert times["default"] == times["nvlink"] == times["300"]
    assert times["pcie"][1] > times["nvlink"][1]  # FL+FSDP: each group's gathers stay inside its node
    assert cost_cli.main(["--compute-s", "1", "--inter-node-gbs", "12.5"]) == 0
    footer = capsys.readouterr().out.splitlines()[-1]
    assert footer.startswith("intra-node link: 300 GB/s per direction per GPU, preset nvlink (A100 SXM, NVLink 3") \
        and "the default" in footer, footer
    with pytest.raises(SystemExit):
        cost_cli.main(["--help"])
    assert "Default: nvlink" in " ".join(capsys.readouterr().out.split())
    for bad in (["--compute-s", "1", "--inter-node-gbs", "1", "--intra-node-link", "infiniband"],
                ["--intra-node-link", "pcie"], ["--compute-s", "1"],
                ["--compute-s", "1", "--inter-node-gbs", "1", "--intra-node-gbs", "100", "--intra-node-link", "pcie"]):
        assert_one_line_error(cost_cli.main, bad, capsys)
