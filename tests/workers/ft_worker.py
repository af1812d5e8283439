"""Worker of tests/ft/test_ft.py: one federation group (or the single world), under torchrun on gloo.

    python -m torch.distributed.run --nproc_per_node G tests/workers/ft_worker.py SPEC.json OUT_DIR

The mode comes from the environment as a user would set it: ``FL_ACCEL_FAULT_TOLERANCE``
and ``FL_ACCEL_GROUP_INDEX`` (scripts/ft_launch.py sets both), else the single world.
SPEC.json: ``cases`` (optional: ``{name: fields}``, run one after the other in this
process and world, each into OUT_DIR/name, with ``fields`` (``fl`` merged) over the rest
of the spec: one launch for several configurations), ``fl`` (FLConfig fields), ``optimizer`` ("sgd" | "adamw"), ``lr``,
``max_steps``, ``step_sleep`` (seconds after each optimizer step), ``record_steps``
(snapshot the local shards after every step), ``scheduler`` (a LambdaLR) and
``stop_file`` (when OUT_DIR/stop_at exists, its number replaces ``max_steps``: the test
ends a run with a kill and restart once the restarted group healed). Checkpoints (per
group, ``FLAccelerator.save_state``): ``checkpoint_every`` (save
``<checkpoint_dir>/g<f>/step_<n>`` after every n-th step, with this rank's data position,
the batches it consumed, as ``rank_state``), ``checkpoint_dir`` (default OUT_DIR/ckpt),
``checkpoint_groups`` (only these groups save), ``plan`` (with an ``fl.sync_trigger``
other than "steps": the steps per group of each round, injected through
``_scenario.inject_round_plan``; the loop then runs until ``federation.training_done``, the token
budget of ``max_steps``), ``resume`` (load the newest complete
checkpoint of this group first, if any, and skip the batches it had consumed),
``seed_by_group`` (each group seeds its model with its index), ``expect_error`` (a
case's ValueError is recorded in ``<case>/error_g<f>_r<k>.json`` with the step), ``crash`` (``{"group": f, "step": n}``: on the first attempt
of a torchrun with ``--max-restarts``, every rank of group f exits with status 3 right
after step n and its checkpoint: torchrun starts the next attempt), ``die_serving_heal`` (groups
of which the first to serve a heal dies half-way through the transfer: one rank per group).

The plain Accelerate loop runs until the synchronizer's ``global_step`` reaches
``max_steps`` (a healed group takes over its peer's step count), then ``end_training``
(the final sync). Written to OUT_DIR:

* ``progress/g<f>_r<k>``: the last finished optimizer step and the time (rewritten each step);
* ``healed/g<f>_r<k>_a<attempt>``: written when this rank's group healed from a live group
  (JSON: the manager's step and ``transport.heal_sources``, the group it healed from),
  after ``g<f>_r<k>_a<attempt>.heal.pt`` (the records below up to the heal);
* ``g<f>_r<k>_a<attempt>.pt`` (``FT_TEST_ATTEMPT``): the records: ``resumed`` (the
  checkpoint's step, data position and torchft step; None), ``restart_count``
  (``TORCHELASTIC_RESTART_COUNT``), ``batches`` (consumed at the end), ``steps`` (global step,
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

import _scenario
from tests._launch import write_whole

MODEL = dict(vocab_size=255, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
SEQ_LEN = 16


def full_state(acc, optimizer, scheduler) -> dict:
    """Everything a healed group must share with its source, as plain local tensors."""
    from fl_accel.fsdp import local

    sync = acc.synchronizer
    opt_state = {}
    for i, p in enumerate(sync.params):
        st = optimizer.state.get(p, {})
        opt_state[i] = {k: local(v).detach().clone() if hasattr(v, "shape") else v for k, v in st.items()}
    shared = {n: d for fragment in sync.fragments for n, d in fragment.outer_state().items()}
    return {"params": [local(p).detach().clone() for p in sync.params], "optimizer": opt_state,
            "outer": {i: {k: v.detach().clone() for k, v in shared[n].items()} for i, n in enumerate(sync.names)
                      if n in shared},
            "schedule": sync.schedule.state_dict(), "lr": [g["lr"] for g in optimizer.param_groups],
            "scheduler": scheduler.state_dict() if scheduler is not None else None}


def main() -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    cases = spec.get("cases") or {"": {}}
    for n, (name, fields) in enumerate(cases.items()):
        last = n == len(cases) - 1
        destroy = PartialState.destroy_process_group
        if not last:  # the next case reuses this world: Accelerate's end_training must not destroy it
            PartialState.destroy_process_group = lambda self, group=None: None
        try:
            run_case({**spec, **fields, "fl": {**spec.get("fl", {}), **fields.get("fl", {})}}, out / name)
        except ValueError as exc:  # an expected refusal: recorded, and the next case runs
            if not fields.get("expect_error"):
                raise
            acc = CURRENT.pop("acc")
            sync = acc.synchronizer
            (out / name / f"error_g{acc.group_index}_r{acc.process_index}.json").write_text(json.dumps({
                "message": str(exc), "step": sync.schedule.global_step if sync is not None else None}))
            if sync is not None and hasattr(sync.transport, "shutdown"):
                sync.transport.shutdown()
        finally:
            PartialState.destroy_process_group = destroy
        AcceleratorState._reset_state()  # the next case's FLAccelerator sets Accelerate up anew
        GradientState._reset_state()


CURRENT: dict = {}  # the case's accelerator (main() shuts an expected refusal's torchft Manager down)


def _die_in_the_middle_of_serving_a_heal(out: Path) -> None:
    """The first group (of those given ``die_serving_heal``) whose checkpoint server serves a
    heal sends half of the state, writes ``OUT_DIR/heal_source_died`` (the time) and SIGKILLs
    its own process (one rank per group): the heal's source dies mid-transfer. Test code only:
    it replaces torchft's ``_streaming_save`` in its HTTP transport's module."""
    import io
    import signal

    import torchft.checkpointing.http_transport as http_transport

    real = http_transport._streaming_save

    def dying_save(obj, f):
        try:
            fd = os.open(out / "heal_source_died", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:  # another group died serving already: serve normally
            return real(obj, f)
        buf = io.BytesIO()
        real(obj, buf)
        data = buf.getvalue()
        f.write(data[:len(data) // 2])
        f.flush()
        os.write(fd, str(time.time()).encode())
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)

    http_transport._streaming_save = dying_save


def run_case(spec: dict, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fl_accel import FLAccelerator, FLConfig
    from fl_accel.checkpoint import find_latest
    from fl_accel.fsdp import local

    (out / "progress").mkdir(parents=True, exist_ok=True)
    acc = FLAccelerator(FLConfig.from_env(**spec["fl"]), cpu=True)
    CURRENT["acc"] = acc
    f, rank = acc.group_index, acc.process_index
    attempt = os.environ.get("FT_TEST_ATTEMPT", "0")

    torch.manual_seed(f if spec.get("seed_by_group") else 0)
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
        # sized the Accelerate way: the prepared scheduler steps num_processes times per optimizer
        # step (the group's processes in torchft mode, the world's in the single world)
        per_step = acc.num_processes
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.1 * (s // per_step)))
        model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    else:
        model, optimizer, loader = acc.prepare(model, optimizer, loader)
    sync = acc.synchronizer
    torch_opt = optimizer.optimizer
    rec = {"group": f, "rank": rank, "attempt": attempt, "steps": [], "quorums": [], "times": []}

    transport = sync.transport
    ending = []  # set once training is over: end_training's wait for the groups (ManagedTransport.finish) follows
    if transport.elastic:
        real_begin = transport.begin

        def spy_begin():
            opened = transport.round is None
            rnd = real_begin()
            if opened and rnd.num_groups > 1 and not ending:  # the sync events' quorums
                rec["quorums"].append({"manager_step": transport.manager.current_step(), "healed": transport.healed,
                                       "num_groups": rnd.num_groups, "position": rnd.position,
                                       "state": full_state(acc, torch_opt, scheduler),
                                       "round": sync.planner.rounds.state_dict() if sync.planner.rounds is not None
                                       else None})
            if opened and transport.healed:  # the records so far (a later kill loses the final ones), then the mark
                rec["heals"], rec["heal_sources"] = transport.heals, list(transport.heal_sources)
                torch.save(rec, out / f"g{f}_r{rank}_a{attempt}.heal.pt")
                (out / "healed").mkdir(exist_ok=True)
                (out / "healed" / f"g{f}_r{rank}_a{attempt}").write_text(json.dumps(
                    {"manager_step": transport.manager.current_step(), "sources": transport.heal_sources}))
            return rnd

        transport.begin = spy_begin

    if f in spec.get("die_serving_heal", []):
        _die_in_the_middle_of_serving_a_heal(out)

    progress = out / "progress" / f"g{f}_r{rank}"
    ckpt_dir = Path(spec.get("checkpoint_dir") or out / "ckpt") / (f"g{f}" if acc.run_config.fault_tolerant else "world")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rec.update(restart_count=restart, resumed=None)
    consumed = 0  # this rank's data position: batches taken from its loader
    latest = find_latest(str(ckpt_dir)) if spec.get("resume") else None
    if latest is not None:
        meta = acc.load_state(latest)
        consumed = meta["rank_state"]["batches"]
        rec["resumed"] = {"step": sync.schedule.global_step, "batches": consumed, "path": latest,
                          "manager_step": transport.manager.current_step() if hasattr(transport, "manager") else None}

    def target() -> int:
        stop = out / "stop_at"
        return int(stop.read_text()) if spec.get("stop_file") and stop.exists() else steps

    if sync.planner.rounds is not None:  # a sync_trigger: a budget of tokens, this group's plan per round injected
        plan = spec["plan"]
        _scenario.inject_round_plan(sync, plan)
        acc.set_max_steps(steps)
        rec["weights"] = []

    def more() -> bool:
        return not acc.federation.training_done if sync.planner.rounds is not None else sync.schedule.global_step < target()

    while more():
        skip = consumed % len(loader)
        for batch in acc.skip_first_batches(loader, skip) if skip else loader:
            consumed += 1
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
            every = spec.get("checkpoint_every") if f in spec.get("checkpoint_groups", [f]) else None
            if every and step % every == 0 and step < target():
                acc.save_state(str(ckpt_dir / f"step_{step}"), rank_state={"batches": consumed})
            crash = spec.get("crash") or {}
            if restart == 0 and crash.get("group") == f and crash.get("step") == step:
                os._exit(3)  # a crash of the whole group: torchrun --max-restarts starts the next attempt
            write_whole(progress, f"{step} {now} {attempt}")  # the test reads it mid-run: never torn
            if spec.get("step_sleep"):
                time.sleep(float(spec["step_sleep"]))
            if sync.planner.rounds is not None and sync.schedule.local_step == 0:  # this step ended a round
                rec["weights"].append((step, list(sync.last_membership.weights)))
            if not more():
                break
    acc.sync_if_pending(final=True)  # the final sync's quorum is recorded; the wait at the end's are not
    ending.append(True)
    acc.end_training()
    rec["final"] = full_state(acc, torch_opt, scheduler)
    rec["end"] = transport.end_state if transport.elastic else None
    rec["batches"] = consumed
    rec["heals"] = getattr(transport, "heals", 0)
    rec["heal_sources"] = list(getattr(transport, "heal_sources", []))
    rec["rounds"] = sync.planner.rounds.summary() if sync.planner.rounds is not None else None
    torch.save(rec, out / f"g{f}_r{rank}_a{attempt}.pt")


if __name__ == "__main__":
    main()
