"""The cost model (fl_accel.planning.cost) against real collectives: 4 gloo ranks count the
bytes of FSDP2/HSDP training and of fl_accel.exchange's sync (fl_accel.comm), which must equal
the model's figures. The model's hand-computed cases: tests/unit/test_cost_model.py."""

import pytest


# ------------------------------------------------------------------ model == measured comm accounting
_MEASURE_SCRIPT = r'''
import json, os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
import transformers
from fl_accel.comm import CommMeter, CommStats
from fl_accel.mesh import FLLayout
from fl_accel.planning import cost as cm
from fl_accel.planning import units as mu

dist.init_process_group("gloo")
rank, N = dist.get_rank(), dist.get_world_size()
R, S = 2, N // 2
cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg)
units = mu.units_from_module(model)
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
layout = FLLayout.equal(1, R, S)
axis_of = {tuple(sorted(layout.axis_ranks(a, rank))): a for a in ("dp_replicate", "dp_shard")}
stats = CommStats()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randint(0, 101, (2, 8))
steps = 2
with CommMeter(stats, rank_buckets=axis_of):
    for _ in range(steps):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
est = cm.estimate(layout, units, sync_every=1, param_bytes=2)
measured = {a: {op: b / steps for op, b in s["by_op"].items()} for a, s in stats.as_dict().items() if s["bytes"]}
out = {"measured": measured, "model": est.step[0].bytes}

# The sync's wire protocol on unequal groups of 1 and 3 ranks (S = 1, C = 1: rank 1 owns the
# chunk of group 1 and broadcasts it to ranks 2, 3), tensors shaped like the model's parameters.
from fl_accel.codecs import make_codec
from fl_accel.exchange import Exchange, Membership
from fl_accel.mesh_transport import MeshTransport
fl = FLLayout((1, 3), 1, "fl_hsdp")
pgs = {}
for axis in ("fl", "dp_replicate"):
    for ranks in fl.axis_groups(axis):
        pg = dist.new_group(list(ranks))
        if rank in ranks and len(ranks) > 1:
            pgs[axis] = pg
f, r, s = fl.coords(rank)
tensors = [torch.randn(shape) for u in units for shape in u.shapes]
for dtype in ("fp32", "int8"):
    t = MeshTransport(fl_group=pgs.get("fl"), replicate_group=pgs.get("dp_replicate"),
                      membership=Membership(2, f, fl.weights("size")), num_chunks=1, chunk_index=0 if r == 0 else None,
                      replicas=fl.replicas_of(f), chunk_owners=(fl.rank(f, 0, s),))
    sync_stats = CommStats()
    with CommMeter(sync_stats, {pg: a for a, pg in pgs.items()}):
        Exchange(t, t.begin(), tensors, codec=make_codec(dtype)).start().finish()
    model = cm.estimate(fl, units, sync_every=1, sync_dtype=dtype).fragments[0][f]
    out[dtype] = {"measured": {a: dict(v["by_op"]) for a, v in sync_stats.as_dict().items() if v["bytes"]},
                  "model": {a: ops for a, ops in model.bytes.items() if a != "world"}}
json.dump(out, open(f"{sys.argv[1]}.{rank}", "w"))
dist.destroy_process_group()
'''


def test_model_equals_measured_fsdp2_hsdp_bytes(tmp_path):
    """4 gloo ranks, HSDP R=2 x S=2 on a tiny Llama wrapped like Accelerate: the model's
    per-axis, per-op bytes equal fl_accel.comm's accounting of the real collectives; then
    fl_accel.exchange's sync over unequal groups (1 and 3 ranks), fp32 and int8, likewise."""
    import json

    script = tmp_path / "measure.py"
    script.write_text(_MEASURE_SCRIPT)
    out = tmp_path / "out.json"
    from _launch import run_torchrun

    res = run_torchrun(4, script, out, timeout=120)
    assert res.returncode == 0, res.tail(3000)
    data = json.loads(open(f"{out}.0").read())
    assert data["measured"] == data["model"] and set(data["model"]) == {"dp_shard", "dp_replicate"}
    # rank 0: group 0 (1 replica); rank 1: owner of group 1's chunk; rank 2: a receiving replica,
    # which the model does not report (it reports each group's busiest rank, replica 0)
    for rank, axes in [(0, {"fl"}), (1, {"fl", "dp_replicate"}), (2, {"dp_replicate"})]:
        data = json.loads(open(f"{out}.{rank}").read())
        for dtype in ("fp32", "int8"):  # the accounting floors each call to whole bytes
            measured, model = data[dtype]["measured"], data[dtype]["model"]
            assert set(measured) == axes and measured == {a: pytest.approx(model[a], abs=1) for a in axes}

