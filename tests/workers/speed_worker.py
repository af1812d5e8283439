"""Worker of tests/dist/test_unequal_speed.py: rounds of unequal length on gloo (CPU).

    python -m torch.distributed.run --nproc_per_node 4 tests/workers/speed_worker.py SPEC.json OUT_DIR

FL+FSDP, 2 federation groups of 2 ranks. Each scenario (keys: ``name``, ``fl`` FLConfig
kwargs, ``max_steps`` the token budget in steps of a "steps" run, ``plan`` steps per group
per round injected through ``_scenario.inject_round_plan`` or None, ``slow_factor`` per group:
k, sleep k times each step's own time after it (the test hook that slows a group down),
``save_after_round``/``save_dir``, ``load``, ``spy_exchange``: record the steps at which fragment
0's exchange is launched and completed) trains the tiny Llama of unequal_worker with SGD
(lr 1, no momentum) in the loop a user writes::

    acc.set_max_steps(T)
    while not acc.federation.training_done and (acc.federation.triggered or t < sc["max_steps"]):
        loss = model(x).loss; acc.backward(loss); opt.step(); opt.zero_grad()
    acc.end_training()

Rank k's step t (its group's own count) uses the t-th batch of its one-epoch index list
(global sharding: each rank its own slice). Each rank writes ``OUT_DIR/<scenario>/rank<k>.pt``:
coordinates, index batches, local shards at init and after each step, the sync count and
the round's merge weights after each step, the round summary and the final shards.
``bad_configs`` (optional) run first, as in unequal_worker.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import _scenario
import unequal_worker as U


def run_scenario(sc: dict, out: Path, rank: int, last: bool) -> None:
    import torch

    from fl_accel import FLAccelerator, FLConfig

    acc = FLAccelerator(FLConfig(**sc["fl"]), cpu=True)
    torch.manual_seed(0)
    model = U.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0)
    loader = torch.utils.data.DataLoader(list(range(U.DATASET)), batch_size=U.MICRO_BATCH, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    params = list(model.parameters())
    index_batches = [b.tolist() for b in loader]
    tokens = U.token_table()
    sync = acc.synchronizer
    if sc.get("plan") is not None:
        plan = sc["plan"]
        _scenario.inject_round_plan(sync, plan)
    acc.set_max_steps(sc["max_steps"])
    rec = {"scenario": sc["name"], "rank": rank, "coords": [acc.group_index, acc.replica_index, acc.shard_index],
           "index_batches": index_batches, "init": _scenario.local_shards(params), "steps": {}, "syncs": {},
           "weights": {}, "start": 0, "inflight": {}, "launched_at": [], "completed_at": []}
    if sc.get("spy_exchange"):  # the steps at which fragment 0's exchange is launched and completed
        frag = sync.fragments[0]
        launch, finish = frag.launch, frag.finish
        frag.launch = lambda *a: (rec["launched_at"].append(sync.schedule.global_step), launch(*a))[1]
        frag.finish = lambda: (rec["completed_at"].append(sync.schedule.global_step), finish())[1]
    if sc.get("load"):
        meta = acc.load_state(sc["load"])
        rec["start"] = int(meta["group_steps"][acc.group_index])
        rec["loaded"] = _scenario.local_shards(params)
    factor = (sc.get("slow_factor") or [0.0, 0.0])[acc.group_index]
    t, step_end = rec["start"], time.perf_counter()
    loop_start = step_end
    while not acc.federation.training_done and (sync.planner.rounds is not None
                                                 or t < sc["max_steps"]):  # "steps": counted here
        x = tokens[index_batches[t % len(index_batches)]]
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        t += 1
        rec["steps"][t] = _scenario.local_shards(params)
        rec["syncs"][t] = sync.schedule.num_syncs
        rec["inflight"][t] = list(sync.schedule.inflight_fragments)
        if sync.schedule.local_step == 0:  # this step ended a round
            rec["weights"][t] = list(sync.last_membership.weights)
            if sync.planner.rounds is not None and sc.get("save_after_round") == len(sync.planner.rounds.rounds):
                acc.save_state(sc["save_dir"], extra_meta={"group_steps": list(sync.planner.rounds.group_steps)})
        if factor:  # sleep k times this step's own time: k + 1 times slower under any load
            time.sleep(factor * (time.perf_counter() - step_end))
        step_end = time.perf_counter()
    rec["loop_s"], rec["sync_s"], rec["arrival_s"] = time.perf_counter() - loop_start, sync.clock.seconds, \
        sync.arrival.seconds
    rec["rounds"] = sync.planner.rounds.summary() if sync.planner.rounds is not None else None
    rec["federation_step"] = acc.federation.progress_step
    _scenario.end_training(acc, last)
    rec["final"] = _scenario.local_shards(params)
    _scenario.save_record(rec, out, sc["name"], rank, last)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    U.run_bad_configs(spec.get("bad_configs", []), out, rank)  # before anything touches torch.distributed
    scenarios = spec["scenarios"]
    for i, sc in enumerate(scenarios):
        run_scenario(sc, out, rank, last=i == len(scenarios) - 1)


if __name__ == "__main__":
    main()
