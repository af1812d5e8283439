"""Unit tests of fl_accel.cost_model: hand-computed cases, the Llama-3.1-8B figures, CLI, errors."""

import math
import subprocess
import sys

import pytest

from fl_accel import FLConfig
from fl_accel import cost_model as cm


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-9)


# ------------------------------------------------------------------ ring formulas
@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce"])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_ring_bytes_matches_comm_accounting(op, p):
    from fl_accel.comm import ring_bytes as measured

    m = 4096 * p  # divisible, so the integer accounting is exact
    assert cm.ring_bytes(op, m, p) == measured(op, m, p)


def test_ring_bytes_values():
    assert cm.ring_bytes("all_gather", 1000, 4) == 750
    assert cm.ring_bytes("reduce_scatter", 1000, 4) == 750
    assert cm.ring_bytes("all_reduce", 1000, 4) == 1500
    assert cm.ring_bytes("all_reduce", 1000, 1) == 0


# ------------------------------------------------------------------ hand-computed small cases
def test_fsdp_small():
    e = cm.estimate("fsdp", 8, 1000, param_bytes=2)
    assert (e.num_groups, e.replicas, e.shards) == (1, 1, 8)
    assert e.step_bytes["dp_shard"]["all_gather"] == approx(2 * 2000 * 7 / 8)
    assert e.step_bytes["dp_shard"]["reduce_scatter"] == approx(2000 * 7 / 8)
    assert e.by_axis() == {"fl": 0, "dp_replicate": 0, "dp_shard": approx(5250)}
    assert e.inter_group == 0 and e.intra_group == approx(5250)
    assert e.inter_node is None and e.intra_node is None  # no ranks_per_node given


def test_hsdp_small():
    e = cm.estimate("hsdp", 8, 1000, shard_size=2, param_bytes=2, grad_bytes=4)
    assert (e.num_groups, e.replicas, e.shards) == (1, 4, 2)
    assert e.step_bytes["dp_shard"]["all_gather"] == approx(2 * 2000 / 2)
    assert e.step_bytes["dp_shard"]["reduce_scatter"] == approx(4000 / 2)
    assert e.step_bytes["dp_replicate"]["all_reduce"] == approx(2 * 3 / 4 * 4000 / 2)
    assert e.sync_bytes == {}


def test_fl_fsdp_small():
    e = cm.estimate("fl_fsdp", 8, 1000, group_size=2, sync_every=4, param_bytes=2, sync_bytes=4)
    assert (e.num_groups, e.replicas, e.shards) == (4, 1, 2)
    m_sync = 1000 / 2 * 4
    assert e.sync_bytes["fl"]["all_reduce"] == approx(2 * 3 / 4 * m_sync)
    assert e.by_axis()["fl"] == approx(2 * 3 / 4 * m_sync / 4)
    assert e.by_axis(amortized=False)["fl"] == 0
    assert e.by_axis()["dp_shard"] == approx(3 * 2000 / 2)


def test_fl_hsdp_small_split_and_reference():
    e = cm.estimate("fl_hsdp", 8, 1000, group_size=4, shard_size=2, sync_every=2)
    assert (e.num_groups, e.replicas, e.shards) == (2, 2, 2)
    m_sync = 1000 / 2 * 4
    assert e.sync_bytes["fl"]["all_reduce"] == approx(2 * 1 / 2 * m_sync / 2)
    assert e.sync_bytes["dp_replicate"]["all_gather"] == approx(1 / 2 * m_sync)
    grad_ar = 2 * 1 / 2 * 2000 / 2
    assert e.by_axis()["dp_replicate"] == approx(grad_ar + m_sync / 2 / 2)
    ref = cm.estimate("fl_hsdp", 8, 1000, group_size=4, shard_size=2, sync_every=2, split_replicas=False)
    assert ref.sync_bytes["fl"]["all_reduce"] == approx(2 * 1 / 2 * m_sync)
    assert "dp_replicate" not in ref.sync_bytes
    assert ref.inter_group == approx(2 * e.inter_group)  # R = 2 times more across groups


def test_reshard_and_micro_batches_and_padding():
    units = [cm.ShardUnit("a", 15, True, ((5, 3),)), cm.ShardUnit("b", 8, False, ((8,),))]
    assert units[0].padded_numel(4) == 8 * 3 and units[1].padded_numel(4) == 8
    e = cm.estimate("fsdp", 4, units, param_bytes=1, grad_bytes=1, micro_batches=3)
    m_ag = 3 * (2 * 24 + 1 * 8)
    assert e.step_bytes["dp_shard"]["all_gather"] == approx(3 / 4 * m_ag)
    assert e.step_bytes["dp_shard"]["reduce_scatter"] == approx(3 / 4 * 32)
    assert cm.ShardUnit("x", 6, True).padded_numel(4) == 6  # no shapes: no padding


def test_total_steps_amortization():
    e = cm.estimate("fl_fsdp", 8, 1000, group_size=2, sync_every=8, total_steps=20)
    assert e.syncs_per_step == approx(3 / 20)  # syncs after steps 8, 16 and the last (20)
    assert cm.estimate("fsdp", 8, 1000, total_steps=20).syncs_per_step == 0


def test_node_split_groups_map_to_nodes():
    e = cm.estimate("fl_fsdp", 16, 1000, group_size=4, ranks_per_node=4)
    assert e.spans_nodes == {"fl": True, "dp_replicate": False, "dp_shard": False}
    assert e.inter_node == approx(e.inter_group) and e.intra_node == approx(e.intra_group)
    e = cm.estimate("fl_hsdp", 16, 1000, group_size=8, shard_size=2, ranks_per_node=4)
    assert e.spans_nodes == {"fl": True, "dp_replicate": True, "dp_shard": False}
    e = cm.estimate("fsdp", 4, 1000, ranks_per_node=4)
    assert e.spans_nodes["dp_shard"] is False and e.inter_node == 0


def test_axis_spans_nodes_misaligned():
    # S = 3 shards, 2 ranks per node: block [0, 3) crosses node 0/1.
    assert cm.axis_spans_nodes("dp_shard", (1, 2, 3), 2)
    assert not cm.axis_spans_nodes("dp_shard", (2, 2, 2), 2)
    assert not cm.axis_spans_nodes("fl", (1, 4, 2), 1)  # F = 1: no traffic


def test_estimate_from_config():
    cfg = FLConfig(algorithm="fl_hsdp", num_groups=2, hsdp_shard_size=2, sync_every=4)
    e = cm.estimate_from_config(cfg, 8, 1000)
    assert (e.num_groups, e.replicas, e.shards, e.sync_every) == (2, 2, 2, 4)
    with pytest.raises(ValueError, match="num_groups"):
        cm.estimate_from_config(FLConfig(algorithm="fl_fsdp", num_groups=3), 8, 1000)


# ------------------------------------------------------------------ Llama units
def test_llama_8b_param_count_and_units():
    units = cm.llama_units(cm.LLAMA_3_1_8B)
    assert cm.total_params(units) == 8_030_261_248
    assert [u.name for u in units][:2] == ["embed", "layers.0"] and units[-1].name == "tail"
    assert units[0].reshard_after_forward and not units[-1].reshard_after_forward
    assert units[-1].numel == 128256 * 4096 + 4096


@pytest.mark.parametrize("tied,bias", [(False, False), (True, True)])
def test_llama_units_match_real_model(tied, bias):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=101, hidden_size=24, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied, attention_bias=bias, mlp_bias=bias)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    from_model = cm.units_from_module(model)
    from_cfg = cm.llama_units(cfg)
    assert cm.total_params(from_model) == sum(p.numel() for p in model.parameters())
    assert [(u.numel, u.reshard_after_forward) for u in from_model] == \
        [(u.numel, u.reshard_after_forward) for u in from_cfg]
    for a, b in zip(from_model, from_cfg):
        assert sorted(a.shapes) == sorted(b.shapes)
        assert a.padded_numel(4) == b.padded_numel(4)
    assert [u.name for u in from_model][-1] == "tail"
    assert ("embed" in [u.name for u in from_model]) == (not tied)


# ------------------------------------------------------------------ the 8B ballpark figures
def test_8b_fsdp_about_48gb_all_inter_node():
    e = cm.estimate("fsdp", 512, 8.03e9, param_bytes=2, ranks_per_node=4)
    assert e.total / 1e9 == pytest.approx(48.09, abs=0.01)
    assert e.inter_node == approx(e.total) and e.intra_node == 0
    real = cm.estimate("fsdp", 512, cm.llama_units(cm.LLAMA_3_1_8B), param_bytes=2, ranks_per_node=4)
    assert 46.5 < real.total / 1e9 < 48.1  # tail not resharded: 47.0 GB


def test_8b_fl_fsdp_inter_node_per_step():
    kw = dict(group_size=4, sync_every=8, param_bytes=2, ranks_per_node=4)
    e = cm.estimate("fl_fsdp", 512, 8.03e9, **kw)  # fp32 sync, as fl_accel.sync
    assert e.inter_node / 1e9 == pytest.approx(1.992, abs=0.005)
    assert e.intra_node / 1e9 == pytest.approx(36.13, abs=0.01)
    bf16 = cm.estimate("fl_fsdp", 512, 8.03e9, sync_bytes=2, **kw)  # the "about 1 GB"
    assert bf16.inter_node / 1e9 == pytest.approx(0.996, abs=0.005)
    fsdp = cm.estimate("fsdp", 512, 8.03e9, param_bytes=2, ranks_per_node=4)
    assert fsdp.inter_node / e.inter_node > 20


# ------------------------------------------------------------------ time model
def test_time_model_hand_case():
    e = cm.estimate("fl_fsdp", 8, 1000, group_size=4, sync_every=2, param_bytes=2, ranks_per_node=4)
    t = cm.predict_step_time(e, compute_s=1.0, intra_node_bw=1000.0, inter_node_bw=100.0, tokens_per_rank=10)
    intra = 3 * 3 / 4 * 2000  # dp_shard
    inter = 2 * 1 / 2 * (1000 / 4 * 4) / 2  # fl, amortized over H = 2
    assert t.comm_s_by_axis["dp_shard"] == approx(intra / 1000)
    assert t.comm_s_by_axis["fl"] == approx(inter / 100)
    assert t.step_s == approx(1.0 + intra / 1000 + inter / 100)
    assert t.tokens_per_s == approx(8 * 10 / t.step_s)


def test_time_model_fl_faster_than_fsdp_on_slow_links():
    ests = cm.compare(512, 8.03e9, group_size=4, shard_size=4, ranks_per_node=4)
    times = [cm.predict_step_time(e, compute_s=1.0, intra_node_bw=100e9, inter_node_bw=12.5e9) for e in ests]
    assert times[2].step_s < times[1].step_s < times[0].step_s
    assert times[0].tokens_per_s is None


# ------------------------------------------------------------------ bad inputs
@pytest.mark.parametrize("kwargs,name", [
    (dict(algorithm="ddp"), "algorithm"),
    (dict(world_size=0), "world_size"),
    (dict(algorithm="fl_fsdp", group_size=3), "group_size"),
    (dict(algorithm="fl_fsdp", group_size=0), "group_size"),
    (dict(algorithm="fl_fsdp"), "group_size"),
    (dict(algorithm="hsdp", shard_size=3), "shard_size"),
    (dict(algorithm="hsdp"), "shard_size"),
    (dict(algorithm="fl_hsdp", group_size=4, shard_size=3), "shard_size"),
    (dict(sync_every=0), "sync_every"),
    (dict(param_bytes=0), "param_bytes"),
    (dict(grad_bytes=-2), "grad_bytes"),
    (dict(sync_bytes=float("nan")), "sync_bytes"),
    (dict(ranks_per_node=3), "ranks_per_node"),
    (dict(micro_batches=0), "micro_batches"),
    (dict(units=-5), "params"),
    (dict(units=[]), "units"),
    (dict(total_steps=0), "total_steps"),
])
def test_bad_inputs_raise_naming_argument(kwargs, name):
    args = dict(algorithm="fsdp", world_size=8, units=1000)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        cm.estimate(args.pop("algorithm"), args.pop("world_size"), args.pop("units"), **args)


def test_bad_inputs_other_functions():
    with pytest.raises(ValueError, match="op"):
        cm.ring_bytes("broadcast", 10, 2)
    with pytest.raises(ValueError, match="group_size"):
        cm.ring_bytes("all_reduce", 10, 0)
    with pytest.raises(ValueError, match="config.hidden_size"):
        cm.llama_units({"vocab_size": 10, "intermediate_size": 4, "num_hidden_layers": 1,
                        "num_attention_heads": 1})
    e = cm.estimate("fsdp", 8, 1000)
    with pytest.raises(ValueError, match="ranks_per_node"):
        cm.predict_step_time(e, compute_s=1, intra_node_bw=1, inter_node_bw=1)
    e = cm.estimate("fsdp", 8, 1000, ranks_per_node=4)
    with pytest.raises(ValueError, match="inter_node_bw"):
        cm.predict_step_time(e, compute_s=1, intra_node_bw=1, inter_node_bw=0)
    with pytest.raises(ValueError, match="compute_s"):
        cm.predict_step_time(e, compute_s=-1, intra_node_bw=1, inter_node_bw=1)
    with pytest.raises(ValueError, match="numel"):
        cm.ShardUnit("x", 5, True, ((2, 2),))


# ------------------------------------------------------------------ CLI
CLI = ["--params", "8.03e9", "--bytes-per-element", "2", "--world-size", "512", "--group-size", "4",
       "--shard-size", "4", "--sync-every", "8"]


def test_cli_prints_markdown_table():
    out = subprocess.run([sys.executable, "-m", "fl_accel.cost_model", *CLI], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| algorithm |")
    names = [r.split("|")[1].strip() for r in rows[1:]]
    assert names == ["FSDP", "HSDP", "FL+FSDP", "FL+HSDP"]
    fsdp = [c.strip() for c in rows[1].split("|")]
    assert fsdp[fsdp.index("FSDP") + 11] == "48.086"  # total GB column


def test_cli_time_model_and_json(capsys):
    assert cm.main(["--model", "llama-3.1-8b", "--world-size", "512", "--group-size", "4", "--shard-size", "4",
                    "--hsdp-group-size", "32", "--compute-s", "1", "--tokens-per-rank", "4096"]) == 0
    out = capsys.readouterr().out
    assert "speedup vs FSDP" in out and "tokens/s" in out and "no compute/communication overlap" in out
    import json
    assert cm.main([*CLI, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["algorithm"] for d in data] == list(cm.ALGORITHMS)
    assert data[2]["inter_node"] == pytest.approx(1.992e9, rel=1e-3)
    assert math.isclose(data[0]["total"], data[0]["inter_node"])


def test_cli_bad_input_exits_with_message():
    bad = list(CLI)
    bad[bad.index("--group-size") + 1] = "3"  # does not divide 512
    proc = subprocess.run([sys.executable, "-m", "fl_accel.cost_model", *bad], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "group_size" in proc.stderr


# ------------------------------------------------------------------ model == measured comm accounting
_MEASURE_SCRIPT = r'''
import json, os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
import transformers
from fl_accel.comm import CommMeter, CommStats
from fl_accel.mesh import FLLayout
from fl_accel import cost_model as cm

dist.init_process_group("gloo")
rank, N = dist.get_rank(), dist.get_world_size()
R, S = 2, N // 2
cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg)
units = cm.units_from_module(model)
mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("dp_replicate", "dp_shard"))
# Accelerate's fsdp2_prepare_model wrapping, with bf16 mixed precision as set_mixed_precision("bf16").
kw = dict(mesh=mesh, reshard_after_forward=True,
          mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))
for layer in model.model.layers:
    fully_shard(layer, **kw)
fully_shard(model.model.embed_tokens, **kw)
fully_shard([model.model.norm, model.lm_head], **{**kw, "reshard_after_forward": False})
kw.pop("reshard_after_forward")
fully_shard(model, **kw)
layout = FLLayout(1, R, S)
axis_of = {tuple(sorted(layout.axis_ranks(a, rank))): a for a in ("dp_replicate", "dp_shard")}
stats = CommStats()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randint(0, 101, (2, 8))
steps = 2
with CommMeter(stats, axis_of):
    for _ in range(steps):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
est = cm.estimate("hsdp", N, units, shard_size=S, param_bytes=2)
if rank == 0:
    measured = {a: {op: b / steps for op, b in s["by_op"].items()} for a, s in stats.as_dict().items() if s["bytes"]}
    json.dump({"measured": measured, "model": est.step_bytes}, open(sys.argv[1], "w"))
dist.destroy_process_group()
'''


def test_model_equals_measured_fsdp2_hsdp_bytes(tmp_path):
    """4 gloo ranks, HSDP R=2 x S=2 on a tiny Llama wrapped like Accelerate: the model's
    per-axis, per-op bytes equal fl_accel.comm's accounting of the real collectives."""
    import json
    import os

    pytest.importorskip("transformers")
    script = tmp_path / "measure.py"
    script.write_text(_MEASURE_SCRIPT)
    out = tmp_path / "out.json"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    from fl_accel.launch import child_env, run_torchrun

    res = run_torchrun(4, script, out, timeout=120, env=child_env(pythonpath=[repo]), cwd=repo)
    assert res.returncode == 0, res.tail(3000)
    data = json.loads(out.read_text())
    assert data["measured"] == data["model"]
