"""Worker of tests/dist/test_unequal_groups.py: unequal federation groups on gloo (CPU).

    python -m torch.distributed.run --nproc_per_node N tests/workers/unequal_worker.py SPEC.json OUT_DIR

SPEC.json holds ``{"bad_configs": [...], "scenarios": [...]}``; both lists are optional.

``bad_configs`` run first, before anything touches torch.distributed: each case builds
``FLAccelerator(FLConfig(**case["fl"]))`` and records the exception type, its message
and whether a process group existed afterwards (it must not: the error comes before
any collective). Nothing is re-raised, so the scenarios can follow in the same launch.

Each scenario trains a tiny ``transformers.LlamaForCausalLM`` with the plain loop a
user writes (no gradient accumulation)::

    acc = FLAccelerator(FLConfig(**fl), cpu=True)
    model, opt, loader = acc.prepare(model, opt, loader)     # loader: a map-style index dataset
    with acc.meter_comm():
        for t in steps: loss = model(x_t).loss; acc.backward(loss); opt.step(); opt.zero_grad()
    acc.end_training()

The loader yields sample indices into a fixed token table; it is iterated once, in
full, right after ``prepare`` (the data-sharding check reads that epoch), and training
step t uses the t-th batch of that epoch. Scenario keys: ``name``, ``fl`` (FLConfig
kwargs), ``optimizer`` ("sgd" without momentum, or "adamw"), ``lr``, ``steps``,
``save_at`` (steps after which ``acc.save_state(save_dir/step_<t>)`` runs), ``save_dir``,
``load`` (a checkpoint to ``acc.load_state`` before training; training then starts at
the step it records), ``expect_load_error`` (record the load's error and stop), ``plan``
(``sync_trigger`` "speed": steps per group per round through ``_scenario.inject_round_plan``, the loop
runs until ``acc.federation.training_done`` with ``steps`` as the budget; ``weights``: each round's).

Each rank writes ``OUT_DIR/<scenario>/rank<k>.pt``: coordinates, the index batches,
its local shards at init and after every step (after the hook, so after the sync at
a sync step), after ``end_training`` (the final sync), the "fl"/"dp_replicate"
byte counters after every step, and a load error if any. Between scenarios
``end_training`` keeps the world process group and Accelerate's singletons are reset
(as tests/workers/sync_worker.py does), so one launch serves several scenarios.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import _scenario

MODEL = dict(  # tiny Llama; vocab 255: FSDP2 shards the embeddings unevenly (128 / 127 rows at S=2)
    vocab_size=255, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
)
SEQ_LEN = 16
MICRO_BATCH = 2
DATASET = 96  # samples: divisible by MICRO_BATCH x every group size and the world (no padding)


def build_model():
    """The model every rank and the test's simulation build (call after torch.manual_seed(0))."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**MODEL))


def token_table():
    """Sample i of the dataset is row i of this table (the same on every rank)."""
    import torch

    return torch.randint(0, MODEL["vocab_size"], (DATASET, SEQ_LEN), generator=torch.Generator().manual_seed(1234))


def run_bad_configs(cases: list, out: Path, rank: int) -> None:
    import torch.distributed as dist

    from fl_accel import FLAccelerator, FLConfig

    for case in cases:
        try:
            FLAccelerator(FLConfig(**case["fl"]), cpu=True)
        except Exception as exc:  # noqa: BLE001 - recorded, the test judges it
            record = {"type": type(exc).__name__, "message": str(exc)}
        else:
            record = {"type": None, "message": ""}
        record["dist_initialized"] = dist.is_initialized()
        (out / "bad" / case["name"]).mkdir(parents=True, exist_ok=True)
        (out / "bad" / case["name"] / f"rank{rank}.json").write_text(json.dumps(record))


def run_scenario(sc: dict, out: Path, rank: int, last: bool) -> None:
    import torch

    from fl_accel import FLAccelerator, FLConfig

    acc = FLAccelerator(FLConfig(**sc["fl"]), cpu=True)
    torch.manual_seed(0)  # the same initial model on every rank and in every scenario
    model = build_model()
    if sc["optimizer"] == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=sc["lr"], momentum=0.0)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=sc["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    loader = torch.utils.data.DataLoader(list(range(DATASET)), batch_size=MICRO_BATCH, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    params = list(model.parameters())

    def snap():
        return [p.to_local().detach().clone() for p in params]

    index_batches = [b.tolist() for b in loader]  # one full epoch, before any RNG restore
    tokens = token_table()
    rec = {"scenario": sc["name"], "rank": rank, "coords": [acc.group_index, acc.replica_index, acc.shard_index],
           "names": [n for n, _ in model.named_parameters()], "index_batches": index_batches,
           "init": snap(), "steps": {}, "comm": {}, "load_error": None}
    start = 0
    if sc.get("load"):
        try:
            meta = acc.load_state(sc["load"])
            start = int(meta["completed_steps"])
            rec["loaded"] = snap()
        except Exception as exc:  # noqa: BLE001
            rec["load_error"] = f"{type(exc).__name__}: {exc}"
            if not sc.get("expect_load_error"):
                traceback.print_exc()
    rec["start"] = start
    sync = acc.synchronizer
    if sc.get("plan") is not None:  # sync_trigger "speed" with a fixed per-round plan: rounds of unequal length
        plan = sc["plan"]
        _scenario.inject_round_plan(sync, plan)
        acc.set_max_steps(sc["steps"])
        t = 0
        with acc.meter_comm():
            while not acc.federation.training_done:
                x = tokens[index_batches[t]]
                acc.backward(model(input_ids=x, labels=x).loss)
                opt.step()
                opt.zero_grad()
                t += 1
                rec["steps"][t] = snap()
                if sync.schedule.local_step == 0:
                    rec.setdefault("weights", {})[t] = list(sync.last_membership.weights)
    elif rec["load_error"] is None:
        with acc.meter_comm():
            for t in range(start, sc["steps"]):
                x = tokens[index_batches[t]]
                loss = model(input_ids=x, labels=x).loss
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
                rec["steps"][t + 1] = snap()
                rec["comm"][t + 1] = {axis: acc.comm_stats[axis].bytes for axis in ("fl", "dp_replicate", "world")}
                if t + 1 in sc.get("save_at", ()):
                    acc.save_state(f"{sc['save_dir']}/step_{t + 1}", extra_meta={"completed_steps": t + 1})
    rec["num_syncs_before_end"] = sync.schedule.num_syncs
    with acc.meter_comm():  # the final sync's bytes count too (end_training stops the meter)
        _scenario.end_training(acc, last)
    rec["final"] = snap()
    rec["final_comm"] = {axis: acc.comm_stats[axis].bytes for axis in ("fl", "dp_replicate", "world")}
    rec["num_syncs"] = sync.schedule.num_syncs
    _scenario.save_record(rec, out, sc["name"], rank, last)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    run_bad_configs(spec.get("bad_configs", []), out, rank)
    scenarios = spec.get("scenarios", [])
    for i, sc in enumerate(scenarios):
        run_scenario(sc, out, rank, last=i == len(scenarios) - 1)


if __name__ == "__main__":
    main()
