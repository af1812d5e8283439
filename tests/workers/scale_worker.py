"""Worker of tests/dist/test_scale.py (torchrun, gloo, 4 ranks = 2 federation groups x 2 shards).

    scale_worker.py init OUT_DIR      # scenarios "meta", "per_rank_seed", "tied_avg", "tied_nesterov"
    scale_worker.py resume OUT_DIR    # "tied_avg" again, resumed from OUT_DIR/step_3

Models are the recipe's own presets (``recipes.modeling``), built as the recipe builds
them. Scenarios (several per launch: a launch costs ~10 s of imports here):

* ``meta``: "tiny" on the meta device, prepared (FSDP2 over the group), then
  ``FLAccelerator.materialize(model, model._init_weights, seed)``. Records the full
  tensors' mean/std (``full_tensor()``, gathered within the group), this rank's local
  shards, and the same statistics of the CPU-initialized model (``--init_device cpu``).
* ``per_rank_seed``: "tiny" built on the CPU after ``torch.manual_seed(rank)`` (the
  mistake); records what ``prepare`` raised on this rank.
* ``tied_avg`` / ``tied_nesterov``: "tiny-tied" on meta, materialized, FL+FSDP F=2,
  H=2, AdamW, 4 optimizer steps with per-rank data. ``nesterov`` uses outer lr 1 and
  momentum 0. Records per step the loss and whether lm_head is still the embedding's
  tensor; around every sync the local shards (before and after); the final shards. A
  pre-sync hook evaluates a probe batch (as ``--eval_groups`` does); right after each
  sync the probe is evaluated again as the model is, and after resharding it.
  ``tied_avg`` of ``init`` saves a checkpoint after step 3 (mid-round).

Each rank writes ``OUT_DIR/<mode>-<scenario>-rank<k>.pt``.
"""

from __future__ import annotations

import sys

import torch

import _scenario
from fl_accel.fsdp import local

STEPS, H, SEQ, VOCAB, SEED = 4, 2, 32, 512, 42


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)  # different data per rank and step
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


def end(acc, last: bool) -> None:
    """end_training; before the next scenario keep the world group and reset Accelerate's singletons."""
    _scenario.end_training(acc, last)
    if not last:
        _scenario.reset_for_next_scenario()


def accelerator(outer: str = "avg"):
    from fl_accel import FLAccelerator, FLConfig

    extra = {"outer_lr": 1.0, "outer_momentum": 0.0} if outer == "nesterov" else {}
    return FLAccelerator(FLConfig(algorithm="fl_fsdp", num_groups=2, sync_every=H, outer_optimizer=outer, **extra),
                         cpu=True)


def stats(t: torch.Tensor) -> tuple[float, float]:
    t = t.detach().double()
    return t.mean().item(), t.std().item() if t.numel() > 1 else 0.0


def scenario_meta(rank: int) -> dict:
    from accelerate.utils import set_seed

    from recipes.modeling import build_model, model_config

    acc = accelerator()
    config = model_config("tiny", SEQ, VOCAB)
    set_seed(SEED)
    model = build_model(config, "meta")
    was_meta = all(p.is_meta for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    acc.materialize(model, model._init_weights, seed=SEED)
    rec = {"was_meta": was_meta, "initializer_range": config.initializer_range,
           "meta_stats": {n: stats(p.full_tensor()) for n, p in model.named_parameters()},
           "shards": {n: local(p).detach().clone() for n, p in model.named_parameters()},
           "coords": (acc.group_index, acc.replica_index, acc.shard_index)}
    set_seed(SEED)
    cpu = build_model(config, "cpu")
    rec["cpu_stats"] = {n: stats(p) for n, p in cpu.named_parameters()}
    end(acc, last=False)
    return rec


def scenario_per_rank_seed(rank: int) -> dict:
    from recipes.modeling import build_model, model_config

    acc = accelerator()
    torch.manual_seed(rank)  # the mistake: a different initial model on every rank
    model = build_model(model_config("tiny", SEQ, VOCAB), "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = {"error": None}
    try:
        acc.prepare(model, opt)
    except ValueError as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    end(acc, last=False)
    return rec


def scenario_tied(rank: int, outer: str, out_dir: str, mode: str, last: bool) -> dict:
    from accelerate.utils import set_seed
    from torch.distributed.fsdp import FSDPModule

    from recipes.modeling import build_model, model_config

    acc = accelerator(outer)
    set_seed(SEED)
    model = build_model(model_config("tiny-tied", SEQ, VOCAB), "meta")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    model, opt = acc.prepare(model, opt)
    acc.materialize(model, model._init_weights, seed=SEED)

    def tied() -> bool:
        return model.lm_head.weight is model.model.embed_tokens.weight

    names = [n for n, _ in model.named_parameters()]  # a tied weight appears once
    rec = {"tied_after_materialize": tied(), "names": names, "losses": {}, "tied": {},
           "pre_sync": [], "post_sync": [], "tied_after_sync": [], "sync_steps": [],
           "probe_before_sync": [], "probe_after_sync": []}
    sync = acc.synchronizer
    real_sync = sync.sync

    def spy_sync(*args, **kwargs):
        pre = [local(p).detach().clone() for p in model.parameters()]
        real_sync(*args, **kwargs)
        as_is = probe_loss()  # the model as the next forward finds it
        reshard()
        rec["probe_after_sync"].append((as_is, probe_loss()))  # (as is, freshly all-gathered)
        reshard()  # unsharded modules list their full tensors in model.parameters()
        rec["pre_sync"].append(pre)
        rec["post_sync"].append([local(p).detach().clone() for p in model.parameters()])
        rec["tied_after_sync"].append(tied())
        rec["sync_steps"].append(sync.schedule.global_step)

    sync.sync = spy_sync
    probe = batch(99, 0)  # the same batch on every rank

    def reshard() -> None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def probe_loss() -> float:
        with torch.no_grad():
            return model(input_ids=probe, labels=probe).loss.item()

    def evaluate_before_sync(synchronizer, full):  # as the recipe's --eval_groups does
        rec["probe_before_sync"].append(probe_loss())

    acc.register_pre_sync_hook(evaluate_before_sync)
    start = 0
    if mode == "resume":
        start = int(acc.load_state(f"{out_dir}/step_3")["completed_steps"])
        rec["tied_after_load"] = tied()
    for step in range(start, STEPS):
        x = batch(step, rank)
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        rec["losses"][step + 1] = loss.item()
        rec["tied"][step + 1] = tied()
        if mode == "init" and outer == "avg" and step + 1 == 3:
            acc.save_state(f"{out_dir}/step_3", extra_meta={"completed_steps": 3})
    rec["final"] = [local(p).detach().clone() for p in model.parameters()]
    end(acc, last=last)
    return rec


def main() -> None:
    import os

    mode, out_dir = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])

    def save(name: str, rec: dict) -> None:
        torch.save(rec, f"{out_dir}/{mode}-{name}-rank{rank}.pt")

    if mode == "init":
        save("meta", scenario_meta(rank))
        save("per_rank_seed", scenario_per_rank_seed(rank))
        save("tied_avg", scenario_tied(rank, "avg", out_dir, mode, last=False))
        save("tied_nesterov", scenario_tied(rank, "nesterov", out_dir, mode, last=True))
    elif mode == "resume":
        save("tied_avg", scenario_tied(rank, "avg", out_dir, mode, last=True))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
