"""Worker of tests/test_ft.py: one federation group (or the single world), under torchrun on gloo.

    python -m torch.distributed.run --nproc_per_node G tests/workers/ft_worker.py SPEC.json OUT_DIR

The mode comes from the environment as a user would set it: ``FL_ACCEL_FAULT_TOLERANCE``
and ``FL_ACCEL_GROUP_INDEX`` (scripts/ft_launch.py sets both), else the single world.
SPEC.json: ``fl`` (FLConfig fields), ``optimizer`` ("sgd" | "adamw"), ``lr``,
``max_steps``, ``step_sleep`` (seconds after each optimizer step), ``record_steps``
(snapshot the local shards after every step), ``scheduler`` (a LambdaLR) and
``stop_file`` (when OUT_DIR/stop_at exists, its number replaces ``max_steps``: the test
ends a run with a kill and restart once the restarted group healed).

The plain Accelerate loop runs until the synchronizer's ``global_step`` reaches
``max_steps`` (a healed group takes over its peer's step count), then ``end_training``
(the final sync). Written to OUT_DIR:

* ``progress/g<f>_r<k>``: the last finished optimizer step and the time (rewritten each step);
* ``healed/g<f>_r<k>_a<attempt>``: written when this rank's group healed from a live group
  (JSON: the manager's step and ``transport.heal_sources``, the group it healed from);
* ``g<f>_r<k>_a<attempt>.pt`` (``FT_TEST_ATTEMPT``): the records: ``steps`` (global step,
  local shards), ``quorums`` (at every new torchft round: the manager's committed step,
  whether this group healed, live groups, and the full state compared across groups:
  local shards, inner optimizer state, anchor, momentum, schedule counters, LR),
  ``final`` (after end_training's sync), ``times`` (step finish times), ``heals`` and
  ``heal_sources``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

MODEL = dict(vocab_size=255, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
SEQ_LEN = 16


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def full_state(acc, optimizer, scheduler) -> dict:
    """Everything a healed group must share with its source, as plain local tensors."""
    sync = acc.synchronizer
    opt_state = {}
    for i, p in enumerate(sync.params):
        st = optimizer.state.get(p, {})
        opt_state[i] = {k: local(v).detach().clone() if hasattr(v, "shape") else v for k, v in st.items()}
    outer = sync.outer
    shared, _ = outer.tensors()
    return {"params": [local(p).detach().clone() for p in sync.params], "optimizer": opt_state,
            "outer": {i: {k: v.detach().clone() for k, v in d.items()} for i, d in shared.items()},
            "schedule": sync.schedule.state_dict(), "lr": [g["lr"] for g in optimizer.param_groups],
            "scheduler": scheduler.state_dict() if scheduler is not None else None}


def main() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fl_accel import FLAccelerator, FLConfig

    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    (out / "progress").mkdir(parents=True, exist_ok=True)
    acc = FLAccelerator(FLConfig.from_env(**spec["fl"]), cpu=True)
    f, rank = acc.group_index, acc.process_index
    attempt = os.environ.get("FT_TEST_ATTEMPT", "0")

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    if spec["optimizer"] == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    world = acc.layout.world_size  # the federation's ranks, in either mode
    micro_batch, steps = 2, int(spec["max_steps"])
    gen = torch.Generator().manual_seed(1234)
    data = list(torch.randint(0, MODEL["vocab_size"], (world * micro_batch * steps, SEQ_LEN), generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=micro_batch, shuffle=False)
    scheduler = None
    if spec.get("scheduler"):
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.1 * s))
        model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    else:
        model, optimizer, loader = acc.prepare(model, optimizer, loader)
    sync = acc.synchronizer
    torch_opt = optimizer.optimizer
    rec = {"group": f, "rank": rank, "attempt": attempt, "steps": [], "quorums": [], "times": []}

    transport = sync.transport
    if getattr(transport, "elastic", False):
        real_begin = transport.begin

        def spy_begin():
            opened = transport.round is None
            rnd = real_begin()
            if opened and transport.healed:
                (out / "healed").mkdir(exist_ok=True)
                (out / "healed" / f"g{f}_r{rank}_a{attempt}").write_text(json.dumps(
                    {"manager_step": transport.manager.current_step(), "sources": transport.heal_sources}))
            if opened and rnd.num_groups > 1:
                rec["quorums"].append({"manager_step": transport.manager.current_step(), "healed": transport.healed,
                                       "num_groups": rnd.num_groups, "position": rnd.position,
                                       "state": full_state(acc, torch_opt, scheduler)})
            return rnd

        transport.begin = spy_begin

    progress = out / "progress" / f"g{f}_r{rank}"

    def target() -> int:
        stop = out / "stop_at"
        return int(stop.read_text()) if spec.get("stop_file") and stop.exists() else steps

    while sync.schedule.global_step < target():
        for batch in loader:
            loss = model(input_ids=batch, labels=batch).loss
            acc.backward(loss)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad()
            step = sync.schedule.global_step
            now = time.time()
            rec["times"].append((step, now))
            if spec.get("record_steps"):
                rec["steps"].append((step, [local(p).detach().clone() for p in sync.params]))
            progress.write_text(f"{step} {now} {attempt}")
            if spec.get("step_sleep"):
                time.sleep(float(spec["step_sleep"]))
            if step >= target():
                break
    acc.end_training()
    rec["final"] = full_state(acc, torch_opt, scheduler)
    rec["heals"] = getattr(transport, "heals", 0)
    rec["heal_sources"] = list(getattr(transport, "heal_sources", []))
    torch.save(rec, out / f"g{f}_r{rank}_a{attempt}.pt")


if __name__ == "__main__":
    main()
