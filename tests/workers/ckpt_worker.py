"""Worker of tests/dist/test_checkpoint_gloo.py (torchrun, gloo, 4 ranks = 2 groups x 2).

    ckpt_worker.py MODE OUT_DIR [extra]
    ckpt_worker.py batch OUT_DIR MODE:EXTRA [MODE:EXTRA ...]

``batch`` runs several modes one after the other in one launch (tests/workers/_scenario.py:
the world process group is kept, Accelerate's singletons reset between them); a mode that
ends in an error (``nan:abort``) must be the last.

MODE ``full``: train 8 optimizer steps (H=3, outer "nesterov" with a cosine outer-LR schedule
(warmup 4, decay over the 8 steps), AdamW, cosine LR) and
save a checkpoint after steps 3 (a sync boundary) and 4 (mid-round); record per-step
losses and the final local shards. MODE ``resume``: load ``OUT_DIR/step_<extra>`` and
continue to step 8, recording the same. MODE ``nan``: make group 1's parameters NaN
after step 2 and let the sync at step 3 react (``extra`` = on_nonfinite). MODE
``load_corrupt``: load the checkpoint folder ``extra`` and record the error. MODE
``load_other``: with one FLConfig field changed (``extra`` = ``sync_every=6``), load
``OUT_DIR/step_4`` and record the error.
Each rank writes ``OUT_DIR/<mode>-<extra>-rank<k>.pt``.
"""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, get_scheduler

import _scenario
from fl_accel import FLAccelerator, FLConfig

STEPS, H = 8, 3
BEGIN = "[ckpt_worker] begin "
"""Printed on stderr before each mode, so a test can tell the modes' messages apart."""


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)  # different data per rank and step
    return torch.randint(0, 128, (2, 16), generator=g)


def main() -> None:
    mode, out_dir = sys.argv[1], sys.argv[2]
    if mode == "batch":
        items = sys.argv[3:]
        for i, item in enumerate(items):
            m, _, e = item.partition(":")
            run(m, out_dir, e, last=(i == len(items) - 1))
        return
    run(mode, out_dir, sys.argv[3] if len(sys.argv) > 3 else "", last=True)


def run(mode: str, out_dir: str, extra: str, last: bool) -> None:
    print(f"{BEGIN}{mode}:{extra}", file=sys.stderr, flush=True)
    if mode == "nan_loss":
        return nan_through_loss(out_dir, average_state=(extra == "avg_state"), last=last)
    on_nonfinite = extra if mode == "nan" else "abort"
    outer = "avg" if mode == "opt_state" else "nesterov"
    scheduled = {"outer_lr_schedule": "cosine", "outer_lr_warmup_steps": 4, "outer_lr_decay_steps": STEPS}
    other = {k: int(v) for k, v in [extra.split("=")]} if mode == "load_other" else {}  # e.g. sync_every=6
    acc = FLAccelerator(FLConfig(**{"algorithm": "fl_fsdp", "num_groups": 2, "sync_every": H, "outer_optimizer": outer,
                                    "on_nonfinite": on_nonfinite, **(scheduled if mode in ("full", "resume") else {}),
                                    "average_optimizer_state": (mode == "opt_state" and extra == "on"), **other}),
                        cpu=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    sched = get_scheduler("cosine", opt, num_warmup_steps=2, num_training_steps=STEPS)
    acc.register_for_checkpointing(sched)
    model, opt = acc.prepare(model, opt)
    rec = {"losses": {}, "lr": {}, "error": None}
    start = 0
    if mode == "resume":
        meta = acc.load_state(f"{out_dir}/step_{extra}")
        start = int(meta["completed_steps"])
    if mode in ("load_corrupt", "load_other"):
        try:
            acc.load_state(extra if mode == "load_corrupt" else f"{out_dir}/step_4")
        except ValueError as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"
        name = mode if mode == "load_corrupt" else f"{mode}-{extra.split('=')[0]}"
        torch.save(rec, f"{out_dir}/{name}-rank{acc.process_index}.pt")
        _next(acc, last)
        return
    for step in range(start, STEPS):
        x = batch(step, acc.process_index)
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        if mode == "nan" and step == 2 and acc.group_index == 1:
            with torch.no_grad():
                next(model.parameters()).to_local().fill_(float("nan"))
        try:
            opt.step()
        except RuntimeError as exc:  # NonFiniteError from the sync hook
            rec["error"] = f"{type(exc).__name__}: {exc}"
            break
        sched.step()
        opt.zero_grad()
        rec["losses"][step + 1] = loss.item()
        # the LR each group actually uses, and the scheduler's value
        rec["lr"][step + 1] = (opt.param_groups[0]["lr"], sched.get_last_lr()[0])
        outer = _scenario.outer_view(acc.synchronizer)
        if (step + 1) % H == 0 and outer.optimizer is not None:  # the outer LR of this sync
            rec.setdefault("outer_lr", {})[step + 1] = outer.optimizer.param_groups[0]["lr"]
        if mode == "full" and step + 1 in (3, 4):
            acc.save_state(f"{out_dir}/step_{step + 1}", extra_meta={"completed_steps": step + 1})
        if mode in ("nan", "opt_state") and step + 1 == 3:
            break
    rec["params"] = [p.to_local().detach().clone() for p in model.parameters()]
    rec["num_syncs"] = acc.synchronizer.schedule.num_syncs
    rec["opt_state"] = [opt.optimizer.state[p][k].to_local().detach().clone()
                        for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")]
    torch.save(rec, f"{out_dir}/{mode}-{extra}-rank{acc.process_index}.pt")
    if rec["error"] is None:
        _next(acc, last)
    elif not last:
        raise RuntimeError(f"mode {mode}:{extra} ended in an error and must be the last of the batch")


def _next(acc, last: bool) -> None:
    """end_training; before another mode of the batch, keep the world group and reset Accelerate."""
    _scenario.end_training(acc, last)
    if not last:
        _scenario.reset_for_next_scenario()


def nan_through_loss(out_dir: str, average_state: bool, last: bool = True) -> None:
    acc = FLAccelerator(FLConfig(algorithm="fl_fsdp", num_groups=2, sync_every=2, on_nonfinite="reset",
                                 average_optimizer_state=average_state), cpu=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    rec = {"params": {}, "moments": {}, "finite": {}, "num_syncs": {}}
    for step in range(4):
        x = batch(step, acc.process_index)
        loss = model(input_ids=x, labels=x).loss
        if step + 1 == 2 and acc.group_index == 1:
            loss = loss * float("nan")
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        params = [p.to_local().detach().clone() for p in model.parameters()]
        moments = [opt.optimizer.state[p][k].to_local().detach().clone() for p in model.parameters()
                   for k in ("exp_avg", "exp_avg_sq")]
        rec["params"][step + 1], rec["moments"][step + 1] = params, moments
        rec["finite"][step + 1] = all(torch.isfinite(t).all().item() for t in params + moments)
        rec["num_syncs"][step + 1] = acc.synchronizer.schedule.num_syncs
    torch.save(rec, f"{out_dir}/nan_loss-{'avg' if average_state else 'own'}-rank{acc.process_index}.pt")
    _next(acc, last)


if __name__ == "__main__":
    main()
