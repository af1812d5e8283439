"""Worker of tests/dist/test_streaming_sync.py, run under torchrun on gloo (CPU).

    python -m torch.distributed.run --nproc_per_node N tests/workers/stream_worker.py SPEC.json OUT_DIR

SPEC.json holds ``bad_cases`` (invalid settings every rank tries before anything
else; see :func:`run_bad_cases`) and ``scenarios``. Each scenario trains a tiny
``transformers.LlamaForCausalLM`` (built after ``torch.manual_seed(0)``, identical on
every rank) with inner SGD through the user loop::

    acc = FLAccelerator(FLConfig(**fl), cpu=True)
    model, opt = acc.prepare(model, opt)
    with acc.meter_comm():
        for step in ...:
            loss = model(input_ids=x, labels=x).loss
            acc.backward(loss); opt.step(); opt.zero_grad()
        acc.end_training()

on fixed per-rank batches (:func:`batch`: a function of the step and the global
rank only, so a resumed run reads the same data). It writes
``OUT_DIR/<scenario>/rank<k>.pt`` with this rank's local parameter shards at init,
after every optimizer step and after ``end_training``, the losses, the batches, the
cumulative ``comm_stats`` after every step, the fragments, and with ``spy`` what the
exchange saw: the pseudo-gradients and error-feedback residuals at every launch and
the means at every apply (by wrapping :func:`fl_accel.fragment.exchange` and
:func:`fl_accel.fragment.apply` for the scenario; nothing else changes), and where the synchronizer's outer state lives
(``state_devices``: the devices and pinned flags of the anchor, momentum and residuals).

Scenario keys: ``name``, ``fl`` (FLConfig fields), ``steps``, ``lr``, optional
``save_at`` (steps after which to ``save_state`` into ``OUT_DIR/<name>/step_<k>``),
``resume`` (``[scenario, k]``: ``load_state`` that checkpoint first and continue from
step k), ``roundtrip_at`` (steps among ``save_at`` after which the checkpoint is loaded
straight back, recording the parameters, anchors and residuals before and after),
``record_load_error`` (record an exception of that ``load_state`` instead of
raising it, and train no step), ``momentum`` (of the inner SGD, default 0), ``spy``.

Several scenarios run in one launch (a launch costs ~10 s of imports): between
scenarios ``end_training`` runs with the process-group teardown suppressed and
Accelerate's singletons are reset, as tests/workers/sync_worker.py does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import _scenario

MODEL = dict(  # tiny Llama: units layer0, layer1, root (embed, norm, lm_head); vocab 255 shards 128/127 rows
    vocab_size=255, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
)
MICRO_BATCH, SEQ_LEN = 2, 16


def batch(step: int, rank: int):
    """The micro-batch of global ``rank`` at optimizer step ``step`` (0-based)."""
    import torch

    g = torch.Generator().manual_seed(100_003 * step + rank + 17)
    return torch.randint(0, MODEL["vocab_size"], (MICRO_BATCH, SEQ_LEN), generator=g)


# ---------------------------------------------------------------------- bad settings
def run_bad_cases(cases: list[dict], out: Path, rank: int) -> None:
    """Every rank tries every case and records what was raised, where, and whether
    torch.distributed was initialized by then (it must not be: a rank that raised
    before any collective cannot leave another rank waiting).

    ``case["fl"]`` is passed to ``FLConfig(...)`` (the dataclass validates in
    ``__post_init__``); with ``case["set"]`` a valid FLConfig is built and a copy with those
    fields changed is made (``dataclasses.replace``, which must raise: FLConfig is frozen and
    validates every copy); a config that passes both goes to ``FLAccelerator(config)``."""
    import torch.distributed as dist

    from fl_accel import FLAccelerator, FLConfig

    for case in cases:
        t0 = time.monotonic()
        stage = "FLConfig"
        try:
            config = FLConfig(**case.get("fl", {}))
            if case.get("set"):
                stage = "replace"
                config = dataclasses.replace(config, **case["set"])
            stage = "FLAccelerator"
            FLAccelerator(config, cpu=True)
        except Exception as exc:  # noqa: BLE001 (recorded and asserted on by the test)
            record = {"type": type(exc).__name__, "message": str(exc), "stage": stage}
        else:
            record = {"type": None, "message": "", "stage": "none"}
        record.update(rank=rank, seconds=time.monotonic() - t0, dist_initialized=dist.is_initialized())
        (out / "bad" / case["name"]).mkdir(parents=True, exist_ok=True)
        (out / "bad" / case["name"] / f"rank{rank}.json").write_text(json.dumps(record))


# ---------------------------------------------------------------------- training scenarios
def run_scenario(sc: dict, out: Path, rank: int, last: bool) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fl_accel import FLAccelerator, FLConfig
    from fl_accel.fsdp import local

    acc = FLAccelerator(FLConfig(**sc["fl"]), cpu=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    opt = torch.optim.SGD(model.parameters(), lr=sc["lr"], momentum=sc.get("momentum", 0.0))
    model, opt = acc.prepare(model, opt)
    sync = acc.synchronizer
    params = [p for _, p in model.named_parameters()]

    def snap():
        return _scenario.local_shards(params)

    outer, schedule = _scenario.outer_view(sync), sync.schedule

    def sync_tensors():
        return {"params": snap(),
                "anchor": None if outer.anchor is None else [a.detach().clone() for a in outer.anchor],
                "residual": None if outer.residuals is None else [r.clone() for r in outer.residuals]}

    rec = {"scenario": sc["name"], "rank": rank, "coords": [acc.group_index, acc.replica_index, acc.shard_index],
           "layout": list(acc.layout.shape), "names": list(sync.names),
           "fragment_indices": [list(f.indices) for f in sync.fragments], "init": snap(),
           "steps": [], "launches": [], "applies": [], "saved": [], "start": 0}

    import fl_accel.fragment as fragment_module

    real_exchange, real_apply = fragment_module.exchange, fragment_module.apply
    if sc.get("spy"):  # launches and applies alternate: one exchange in flight at most
        def spy_exchange(parts, channel, exact=False):
            indices = [f.indices[j] for f, j in parts]
            with torch.no_grad():
                rec["launches"].append({
                    "step": schedule.global_step, "indices": indices,
                    "theta": [local(params[i]).detach().clone() for i in indices],
                    "anchor": None if outer.anchor is None else [outer.anchor[i].detach().clone() for i in indices],
                    "residual_before": None if outer.residuals is None else
                    [outer.residuals[i].clone() for i in indices], "exact": exact})
            return real_exchange(parts, channel, exact)

        def spy_apply(parts, means, alpha, step):
            indices = [f.indices[j] for f, j in parts]
            launch = rec["launches"][-1]
            if "residual_after" not in launch:  # the exchange quantized (and kept the residuals) at its launch
                launch["residual_after"] = None if outer.residuals is None else \
                    [outer.residuals[i].clone() for i in launch["indices"]]
            rec["applies"].append({"step": schedule.global_step, "indices": list(indices), "alpha": alpha,
                                   "means": [m.detach().clone() for m in means]})
            return real_apply(parts, means, alpha, step)

        fragment_module.exchange, fragment_module.apply = spy_exchange, spy_apply

    start, steps = 0, sc["steps"]
    rec["load_error"] = None
    if sc.get("resume"):
        src, k = sc["resume"]
        try:
            meta = acc.load_state(str(out / src / f"step_{k}"))
        except Exception as exc:  # noqa: BLE001 (DCP raises on every rank alike; recorded for the test)
            if not sc.get("record_load_error"):
                raise
            rec["load_error"] = f"{type(exc).__name__}: {str(exc)[:3000]}"
            steps = 0
        else:
            start = int(meta["completed_steps"])
            rec["resumed_sync_state"] = schedule.state_dict()
        rec["start"] = start
    with acc.meter_comm():
        for step in range(start, steps):
            x = batch(step, acc.process_index)
            loss = model(input_ids=x, labels=x).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            rec["steps"].append({"step": step + 1, "loss": loss.item(), "batch": x, "params": snap(),
                                 "comm": acc.comm_stats.as_dict(), "local_step": schedule.local_step,
                                 "num_fragment_syncs": schedule.num_fragment_syncs,
                                 "inflight": schedule.inflight,
                                 "inflight_fragments": list(schedule.inflight_fragments)})
            if step + 1 in sc.get("save_at", ()):
                acc.save_state(str(out / sc["name"] / f"step_{step + 1}"), extra_meta={"completed_steps": step + 1})
                rec["saved"].append({"step": step + 1, "sync_state": schedule.state_dict(), "params": snap()})
                if step + 1 in sc.get("roundtrip_at", ()):  # load it back at once: nothing may change
                    before = sync_tensors()
                    acc.load_state(str(out / sc["name"] / f"step_{step + 1}"))
                    rec["roundtrip"] = {"step": step + 1, "before": before, "after": sync_tensors()}
        _scenario.end_training(acc, last)
    fragment_module.exchange, fragment_module.apply = real_exchange, real_apply
    rec["final"] = snap()
    rec["state_devices"] = state_devices(sync)
    rec["final_comm"] = acc.comm_stats.as_dict()
    rec["num_syncs"] = schedule.num_syncs
    rec["num_fragment_syncs"] = schedule.num_fragment_syncs
    _scenario.save_record(rec, out, sc["name"], rank, last)


def state_devices(sync) -> dict:
    """``{kind: [sorted device names, any pinned]}`` of the synchronizer's outer state (None: none kept)."""
    outer = _scenario.outer_view(sync)
    momentum = None if outer.optimizer is None else \
        [s["momentum_buffer"] for s in outer.optimizer.state.values() if "momentum_buffer" in s]

    def where(tensors):
        return None if tensors is None else [sorted({str(t.device) for t in tensors}), any(t.is_pinned() for t in tensors)]

    return {"anchor": where(outer.anchor), "momentum": where(momentum), "residual": where(outer.residuals)}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    run_bad_cases(spec.get("bad_cases", []), out, rank)
    scenarios = spec.get("scenarios", [])
    timings = {}
    for i, sc in enumerate(scenarios):
        t0 = time.monotonic()
        run_scenario(sc, out, rank, last=i == len(scenarios) - 1)
        timings[sc["name"]] = time.monotonic() - t0
    if rank == 0:
        (out / "timings.json").write_text(json.dumps(timings))


if __name__ == "__main__":
    main()
