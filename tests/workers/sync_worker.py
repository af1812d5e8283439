"""Worker of tests/dist/test_sync_gloo.py, run under torchrun on gloo (CPU).

    python -m torch.distributed.run --nproc_per_node N tests/workers/sync_worker.py SPEC.json OUT_DIR

SPEC.json is either ``{"mode": "bad_configs", "cases": [...]}`` (construct FLAccelerator
with invalid FLConfigs and record the errors; see :func:`run_bad_configs`) or
``{"scenarios": [...]}``. Each scenario trains a tiny ``transformers.LlamaForCausalLM``
through the plain Accelerate loop that a user would write::

    accelerator = FLAccelerator(FLConfig(**fl), cpu=True, gradient_accumulation_steps=K)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
    accelerator.end_training()

and writes ``OUT_DIR/<scenario>/rank<k>.pt`` with what the test asserts on: this
rank's local parameter shards (at init, after every micro-batch when asked, just
before and just after every sync, at the end), the comm_stats and synchronizer
counters after every micro-batch, the batches it saw, and DTensor metadata.

Pre-sync shards are captured by wrapping ``accelerator.synchronizer.sync`` on the
instance: the hook (``on_optimizer_step``) and ``end_training`` both call it through
the instance, so the wrapper sees every real sync and nothing else changes.

Several scenarios run in one launch (a launch costs ~10 s of imports on a small
CPU box): between scenarios ``end_training`` runs with the process-group teardown
suppressed, and Accelerate's singletons are reset so the next FLAccelerator builds a
fresh mesh on the same world process group. The last scenario's end_training is
the real one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import _scenario

MODEL = dict(  # tiny Llama; vocab 255 makes FSDP2 shard the embeddings unevenly (128/127 rows)
    vocab_size=255, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
)
SEQ_LEN = 16


def file_barrier(directory: Path, rank: int, world: int, timeout: float = 60.0) -> bool:
    """Wait until all ``world`` ranks touched ``directory/<rank>``; no torch.distributed."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / str(rank)).touch()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((directory / str(r)).exists() for r in range(world)):
            return True
        time.sleep(0.01)
    return False


# ---------------------------------------------------------------------- bad configs
def run_bad_configs(spec: dict, out: Path, rank: int, world: int) -> None:
    """For each case, construct FLAccelerator with an invalid config (``case["fl"]``, or
    the FL_ACCEL_* environment when absent), record what it raised, whether
    torch.distributed was initialized at that point and how long the constructor ran,
    and print one ``[rank k] case: Type: message`` line to stderr.

    No rank exits before every rank has recorded every case (a file barrier): torchrun
    kills the remaining workers as soon as one fails, which must not cut a slow rank
    short. Then the last case's exception propagates, so the launch must fail.
    """
    import torch.distributed as dist

    from fl_accel import FLAccelerator, FLConfig

    last_exc = None
    for case in spec["cases"]:
        t0 = time.monotonic()
        try:
            config = FLConfig(**case["fl"]) if "fl" in case else None  # the dataclass itself does not validate
            FLAccelerator(config, cpu=True)
        except Exception as exc:
            last_exc = exc
            record = {"type": type(exc).__name__, "message": str(exc)}
            print(f"[rank {rank}] {case['name']}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        else:
            record = {"type": None, "message": ""}
        record.update(rank=rank, case=case["name"], seconds=time.monotonic() - t0,
                      dist_initialized=dist.is_available() and dist.is_initialized())
        (out / case["name"]).mkdir(parents=True, exist_ok=True)
        (out / case["name"] / f"rank{rank}.json").write_text(json.dumps(record))
    file_barrier(out / "recorded", rank, world, timeout=30)
    if last_exc is not None:
        raise last_exc


# ---------------------------------------------------------------------- training scenarios
def run_scenario(sc: dict, out: Path, rank: int, world: int, last: bool) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fl_accel import FLAccelerator, FLConfig
    from fl_accel.fsdp import local

    accum = int(sc.get("grad_accum", 1))
    acc = FLAccelerator(FLConfig(**sc["fl"]), cpu=True, gradient_accumulation_steps=accum)

    torch.manual_seed(0)  # same initial model on every rank and in every scenario
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    if sc["optimizer"] == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=sc["lr"], momentum=0.0)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=sc["lr"])
    # The same global dataset on every rank; FLAccelerator's loader gives each rank of
    # the world a disjoint slice ("global" data sharding), so groups see different data.
    micro_batch, n_micro = 2, int(sc["micro_batches"])
    gen = torch.Generator().manual_seed(1234)
    data = list(torch.randint(0, MODEL["vocab_size"], (world * micro_batch * n_micro, SEQ_LEN), generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=micro_batch, shuffle=False)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)

    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]

    def snap():
        return _scenario.local_shards(params)

    def meta():
        return [{"type": type(p).__name__, "placements": str(getattr(p, "placements", None)),
                 "shape": list(p.shape), "stride": list(p.stride()), "local_shape": list(local(p).shape),
                 "data_ptr": local(p).data_ptr()} for p in params]

    rec = {"scenario": sc["name"], "rank": rank, "world": world,
           "coords": [acc.group_index, acc.replica_index, acc.shard_index],
           "layout": list(acc.layout.shape), "fragments": [f.names for f in sync.fragments] if (sync := acc.synchronizer) else None, "num_groups": acc.num_groups, "is_fsdp2": bool(acc.is_fsdp2),
           "names": names, "meta": meta(), "init": snap(),
           "pre_sync": [], "post_sync": [], "sync_meta": [], "sync_global_step": [], "steps": [], "snaps": []}

    sync = acc.synchronizer
    real_sync = sync.sync

    def spy_sync(*args, **kwargs):
        pre, pre_meta = snap(), meta()
        real_sync(*args, **kwargs)
        rec["pre_sync"].append(pre)
        rec["post_sync"].append(snap())
        rec["sync_meta"].append([pre_meta, meta()])
        rec["sync_global_step"].append(sync.schedule.global_step)

    sync.sync = spy_sync

    acc.meter_comm().__enter__()  # left by end_training
    for i, batch in enumerate(loader):
        with acc.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        rec["steps"].append({
            "micro_batch": i + 1, "loss": loss.item(), "sync_gradients": bool(acc.sync_gradients),
            "local_step": sync.schedule.local_step, "global_step": sync.schedule.global_step,
            "num_syncs": sync.schedule.num_syncs,
            "comm": acc.comm_stats.as_dict(), "batch": batch.tolist(),
        })
        if sc.get("snap_steps"):
            rec["snaps"].append(snap())

    _scenario.end_training(acc, last)
    rec["final"] = snap()
    rec["final_num_syncs"] = sync.schedule.num_syncs
    rec["final_comm"] = acc.comm_stats.as_dict()
    _scenario.save_record(rec, out, sc["name"], rank, last)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if spec.get("mode") == "bad_configs":
        run_bad_configs(spec, out, rank, world)
        return
    scenarios = spec["scenarios"]
    for i, sc in enumerate(scenarios):
        run_scenario(sc, out, rank, world, last=i == len(scenarios) - 1)


if __name__ == "__main__":
    main()
