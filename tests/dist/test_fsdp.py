"""fl_accel.fsdp without Accelerate: one process, a one-rank gloo group, real fully_shard.

The units the sync deals into fragments come from the public FSDPModules; they must equal
FSDP2's own parameter groups (read here through its private state, in the test only),
with and without activation checkpointing, whose wrapper must not leak into the names.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from fl_accel import fsdp, fsdp_model

CONFIG = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=16, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _shard_like_accelerate(model, checkpointing=False):
    """fully_shard per decoder layer, the embedding, the tail [norm, lm_head] as one unit, the root."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    layers = model.model.layers
    for i, layer in enumerate(layers):
        if checkpointing:
            layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
        fully_shard(layer, mesh=mesh)
    fully_shard(model.model.embed_tokens, mesh=mesh)
    fully_shard([model.model.norm, model.lm_head], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    return model


@pytest.mark.parametrize("checkpointing", [False, True])
def test_units_are_fsdp2_param_groups_in_forward_order(group, checkpointing):
    from torch.distributed.fsdp import FSDPModule

    torch.manual_seed(0)
    model = _shard_like_accelerate(LlamaForCausalLM(LlamaConfig(**CONFIG)), checkpointing)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    units = fsdp.fsdp_units(model, params)
    index = {id(p): i for i, p in enumerate(params)}
    seen, want = set(), []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()  # FSDP2's own assignment, private: test only
            if id(state) not in seen:
                seen.add(id(state))
                group = state._fsdp_param_group  # None for a unit without parameters
                want.append(sorted(index[id(fp.sharded_param)] for fp in (group.fsdp_params if group else [])))
    want = [u for u in want[1:] + want[:1] if u]  # the root (first in modules()) goes last
    assert units == want and len(units) == 5  # embed, 3 layers, tail (the root holds nothing)
    names = [fsdp.canonical_name(n) for n, _ in named]
    assert any("_checkpoint_wrapped_module" in n for n, _ in named) == checkpointing
    assert names == [n for n, _ in LlamaForCausalLM(LlamaConfig(**CONFIG)).named_parameters()]
    assert [names[i] for i in units[-1]] == ["model.norm.weight", "lm_head.weight"]


def test_materialize_initializes_each_shard_deterministically(group):
    """Two meta-built, sharded models materialized with one seed are equal; the values are
    the model's own initialization (RMSNorm weights 1, linear weights of std
    initializer_range), on the requested device."""
    models = []
    for _ in range(2):
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        model = _shard_like_accelerate(model)
        fsdp_model.materialize(model, model._init_weights, torch.device("cpu"), seed=3)
        models.append({n: fsdp.local(p).detach() for n, p in model.named_parameters()})
    a, b = models
    assert all(torch.equal(a[n], b[n]) and a[n].device.type == "cpu" for n in a)
    assert torch.equal(a["model.norm.weight"], torch.ones(CONFIG["hidden_size"]))
    std = a["model.layers.0.mlp.up_proj.weight"].std().item()
    assert abs(std - LlamaConfig(**CONFIG).initializer_range) < 0.005, std
