"""Worker of tests/dist/test_accelerator_api.py: the GPU-path features of FLAccelerator on gloo (CPU).

    python -m torch.distributed.run --nproc_per_node 4 tests/workers/features_worker.py MODE OUT_DIR

Every scenario is FL+FSDP, 2 groups x 2 ranks, a tiny causal LM built after
``torch.manual_seed(0)`` (identical on every rank), inner SGD, the per-rank batches of
:func:`batch`, through the user loop ``loss = model(...).loss; acc.backward(loss);
opt.step(); opt.zero_grad()``. Several scenarios per launch (a launch costs ~10 s of
imports); between them Accelerate's singletons are reset (tests/workers/_scenario.py).

MODE ``features``:

* ``precision_default``: ``mixed_precision="bf16"``; records each FSDP unit's policy, the
  loss dtype and ``precision_policy``; then a second ``prepare(model2, opt2)``, whose error
  is recorded.
* ``precision_user``: the same with a user ``MixedPrecisionPolicy`` (all bf16) in the plugin.
* ``ac_on`` / ``ac_off``: "nesterov", H=2, 5 steps, activation checkpointing on / off,
  a checkpoint after step 3 (mid-round); ``off_from_on`` / ``on_from_off`` resume the
  other setting's checkpoint and train steps 4-5.
* ``qwen2`` / ``mistral``: tiny Qwen2 and Mistral, H=2, 2 steps (a sync), a checkpoint
  saved and loaded straight back.

MODE ``compile``: ``eager`` and ``compiled`` (Accelerate's regional compilation with
inductor), H=3, 3 steps (a sync at step 3), a checkpoint round trip after it.

Each rank writes ``OUT_DIR/<scenario>/rank<k>.pt``: losses, local shards after every step,
and what the scenario records.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import _scenario

LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)


def batch(step: int, rank: int):
    import torch

    return torch.randint(0, LLAMA["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1000 * step + rank))


def build(family: str = "llama"):
    import torch
    import transformers

    cls = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[family]
    config = getattr(transformers, f"{cls}Config")(**LLAMA, use_cache=False)
    torch.manual_seed(0)
    return getattr(transformers, f"{cls}ForCausalLM")(config)


def run(name: str, out: Path, rank: int, last: bool, *, steps: int, fl: dict, family: str = "llama",
        kwargs: dict | None = None, save_at: int | None = None, resume: str | None = None, roundtrip: bool = False,
        second_prepare: bool = False, state_dict_check: bool = False) -> None:
    import torch
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from fl_accel import FLAccelerator, FLConfig
    from fl_accel.fsdp import local

    acc = FLAccelerator(FLConfig(algorithm="fl_fsdp", num_groups=2, **fl), cpu=True, **(kwargs or {}))
    model = build(family)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = acc.prepare(model, opt)
    params = [p for _, p in model.named_parameters()]
    rec = {"rank": rank, "group": acc.group_index, "losses": {}, "params": {}, "precision_policy": acc.precision_policy,
           "activation_checkpointing": acc.activation_checkpointing, "compiled": acc.compiled,
           "names": list(acc.synchronizer.names), "unit_policies": []}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            policy = fully_shard.state(module)._mp_policy  # test-only look at FSDP2's unit state
            rec["unit_policies"].append([str(policy.param_dtype), str(policy.reduce_dtype), str(policy.output_dtype)])
    start = 0
    if resume:
        start = int(acc.load_state(str(out / resume))["completed_steps"])
    for step in range(start, steps):
        x = batch(step, acc.process_index)
        loss = model(input_ids=x, labels=x).loss
        rec["loss_dtype"] = str(loss.dtype)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        rec["losses"][step + 1] = loss.item()
        rec["params"][step + 1] = _scenario.local_shards(params)
        if save_at == step + 1:
            acc.save_state(str(out / name / f"step_{step + 1}"), extra_meta={"completed_steps": step + 1})
    if roundtrip:
        acc.save_state(str(out / name / "roundtrip"), extra_meta={"completed_steps": steps})
        rec["saved"] = _scenario.local_shards(params)
        with torch.no_grad():
            for p in params:
                local(p).add_(1.0)  # the load must overwrite this
        acc.load_state(str(out / name / "roundtrip"))
        rec["after_load"] = _scenario.local_shards(params)
    rec["sync_wait_seconds"] = acc.federation.sync_wait_seconds
    if second_prepare:
        other = build(family)
        try:
            acc.prepare(other, torch.optim.SGD(other.parameters(), lr=0.1))
        except ValueError as exc:
            rec["second_prepare_error"] = str(exc)
    if state_dict_check:  # the groups differ after the last step unless it was a sync step
        import warnings

        rec["groups_differed"] = acc._groups_differ()
        for when in ("before", "after"):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                state = acc.get_state_dict(model)
            rec[f"state_dict_warnings_{when}"] = [str(w.message) for w in caught if "[fl_accel]" in str(w.message)]
            rec[f"state_dict_sum_{when}"] = float(sum(v.double().sum() for v in state.values())) if state else None
            rec[f"synced_{when}"] = acc.sync_if_pending()
    _scenario.end_training(acc, last)
    rec["final"] = _scenario.local_shards(params)
    _scenario.save_record(rec, out, name, rank, last)


def main() -> None:
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin, TorchDynamoPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mode, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])

    def plugin(**kw):
        return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap", **kw)

    nesterov = {"sync_every": 2, "outer_optimizer": "nesterov"}
    if mode == "features":
        user = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.bfloat16)
        scenarios = [
            ("precision_default", dict(steps=1, fl={"sync_every": 1}, kwargs={"mixed_precision": "bf16"},
                                       second_prepare=True, state_dict_check=True)),
            ("precision_user", dict(steps=1, fl={"sync_every": 1},
                                    kwargs={"mixed_precision": "bf16", "fsdp_plugin": plugin(mixed_precision_policy=user)})),
            ("ac_on", dict(steps=5, fl=nesterov, kwargs={"fsdp_plugin": plugin(activation_checkpointing=True)},
                           save_at=3)),
            ("ac_off", dict(steps=5, fl=nesterov, kwargs={"fsdp_plugin": plugin()}, save_at=3, state_dict_check=True)),
            ("off_from_on", dict(steps=5, fl=nesterov, kwargs={"fsdp_plugin": plugin()}, resume="ac_on/step_3")),
            ("on_from_off", dict(steps=5, fl=nesterov, kwargs={"fsdp_plugin": plugin(activation_checkpointing=True)},
                                 resume="ac_off/step_3")),
            ("qwen2", dict(steps=2, fl=nesterov, family="qwen2", roundtrip=True)),
            ("mistral", dict(steps=2, fl=nesterov, family="mistral", roundtrip=True)),
        ]
    elif mode == "compile":
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1  # no pool of compile workers per rank (each would import torch)
        regional = TorchDynamoPlugin(backend="inductor", use_regional_compilation=True)
        scenarios = [("eager", dict(steps=3, fl={"sync_every": 3})),
                     ("compiled", dict(steps=3, fl={"sync_every": 3}, kwargs={"dynamo_plugin": regional},
                                       roundtrip=True))]
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    for i, (name, kw) in enumerate(scenarios):
        run(name, out, rank, last=i == len(scenarios) - 1, **kw)


if __name__ == "__main__":
    main()
