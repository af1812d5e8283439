"""A plain Accelerate training loop, federated with FLAccelerator: the README's diff, runnable.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/train_loop.py
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/train_loop.py --outer_optimizer nesterov --sync_every 8
    accelerate launch --config_file accelerate_configs/cpu_4proc.yaml examples/train_loop.py

A tiny Llama (transformers, random init) learns synthetic token sequences (each row counts
up from a random token with a random stride, modulo the vocabulary: learnable, so the loss
falls within a few dozen steps). The world is split into ``--num_groups`` federation
groups; each trains with FSDP2 over its own ranks, and every ``--sync_every`` (H) optimizer
steps the groups average their parameters. On a machine without GPUs everything runs on
gloo; with GPUs, on NCCL (one process per GPU).

Every FLConfig field can also come from an ``FL_ACCEL_<FIELD>`` variable
(``FLConfig.from_env``): ``FL_ACCEL_SYNC_DTYPE=int8 FL_ACCEL_ERROR_FEEDBACK=true torchrun ...``.
That is also how ``python -m scripts.ft_launch`` runs this script in the fault-tolerant mode
(``FL_ACCEL_FAULT_TOLERANCE=torchft``, ``FL_ACCEL_GROUP_INDEX``): each group is then its own
torchrun world (examples/torchft_two_groups.sh).

The main process prints the loss every ``--log_every`` optimizer steps and, at the end,
one ``[train_loop] result {...}`` JSON line: the layout, the steps, the syncs, the final
loss, the bytes by mesh axis, and a checksum of every rank's parameter shards after the
final sync (equal across groups for the same shard: the groups end identical;
``groups_identical`` says so, or is null in the torchft mode, where each launch holds one
group and the groups' logs are compared instead).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.distributed as dist
from accelerate.utils import set_seed
from torch.distributed.fsdp import FSDPModule
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

from fl_accel import FLAccelerator, FLConfig

MODEL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # FLConfig fields: None = not given here (the FL_ACCEL_* variable, else FLConfig's default)
    p.add_argument("--algorithm", default=None, help="fsdp | hsdp | fl_fsdp (default) | fl_hsdp")
    p.add_argument("--num_groups", type=int, default=None, help="F federation groups (default 2)")
    p.add_argument("--sync_every", type=int, default=None, help="H optimizer steps between syncs (default 8)")
    p.add_argument("--outer_optimizer", default=None, help="avg (FedAvg, default) | nesterov (DiLoCo)")
    # the training loop's own settings
    p.add_argument("--max_steps", type=int, default=24, help="optimizer steps")
    p.add_argument("--micro_batch_size", type=int, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log_every", type=int, default=4)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args(argv)


def synthetic_rows(n: int, seq_len: int, vocab: int, seed: int) -> torch.Tensor:
    """``n`` rows of ``(start + stride * t) mod vocab``, stride in 1..3."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=gen)
    stride = torch.randint(1, 4, (n, 1), generator=gen)
    return (start + stride * torch.arange(seq_len)) % vocab


def shard_checksum(model: torch.nn.Module) -> float:
    """fp64 sum of this rank's parameter shards (``to_local()`` of FSDP2's DTensors). FSDP2
    keeps the root unit's parameters unsharded after a forward without backward (the root's
    ``reshard_after_forward`` is False), and ``model.parameters()`` then yields full tensors:
    every unit is resharded first, so equal models give equal checksums."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    shards = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return float(sum(s.detach().double().sum() for s in shards))


def main(argv=None) -> None:
    args = parse_args(argv)
    # flags over FL_ACCEL_* variables over FLConfig's defaults; a flag not given is None (not set here)
    config = FLConfig.from_env(**{k: getattr(args, k) for k in ("algorithm", "num_groups", "sync_every",
                                                                "outer_optimizer")})
    accelerator = FLAccelerator(config, gradient_accumulation_steps=args.gradient_accumulation_steps)

    set_seed(args.seed)  # the same seed on every rank: all groups must start from identical parameters
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    # as with Accelerator: a prepared scheduler steps num_processes times per optimizer step
    n = accelerator.num_processes
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=max(1, args.max_steps // 10) * n,
                                                num_training_steps=args.max_steps * n)
    world = accelerator.layout.world_size  # the federation's ranks (also in the torchft mode)
    rows = synthetic_rows(world * args.micro_batch_size * args.gradient_accumulation_steps * args.max_steps,
                          args.seq_len, MODEL["vocab_size"], args.seed)
    loader = torch.utils.data.DataLoader(rows, batch_size=args.micro_batch_size, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    federation = accelerator.federation  # the sync's public status (docs/api.md)

    if accelerator.is_main_process:
        layout = accelerator.layout
        print(f"[train_loop] {config.algorithm}: {layout.num_groups} group(s), {accelerator.num_processes} "
              f"process(es) in this launch, H={config.sync_every}, outer={config.outer_optimizer}, "
              f"fault_tolerance={config.fault_tolerance}, device {accelerator.device}", flush=True)

    own_steps, loss, heals_seen, show_next = 0, torch.zeros(()), 0, False

    def steps_done() -> int:
        # a torchft group that healed from a live one takes over its optimizer-step count
        return federation.step if federation.active else own_steps

    model.train()
    with accelerator.meter_comm():  # bytes and seconds by mesh axis ("fl", "dp_shard", ...) and "world"
        while steps_done() < args.max_steps:
            for batch in loader:
                with accelerator.accumulate(model):
                    loss = model(input_ids=batch, labels=batch, use_cache=False).loss
                    accelerator.backward(loss)
                    optimizer.step()  # every H-th real optimizer step also averages the groups
                    scheduler.step()
                    optimizer.zero_grad()
                if not accelerator.sync_gradients:
                    continue  # mid-accumulation: no optimizer step happened
                own_steps += 1
                step = steps_done()
                if federation.heals > heals_seen:  # torchft: this step's sync replaced the state (a heal)
                    heals_seen, show_next = federation.heals, True
                    if accelerator.is_main_process:  # this step's loss was the old state's: the next one is shown
                        source = federation.heal_log[-1].get("source_group")
                        print(f"[train_loop] step {step}: healed from group {source} (its parameters, optimizer "
                              f"state and step count)", flush=True)
                    if step >= args.max_steps:
                        break
                    continue
                if show_next or step % args.log_every == 0 or step == args.max_steps:
                    show_next = False
                    mean = accelerator.reduce(loss.detach().float(), reduction="mean").item()
                    if accelerator.is_main_process:
                        print(f"[train_loop] step {step}: loss {mean:.4f} (mean over this launch's ranks), "
                              f"lr {scheduler.get_last_lr()[0]:.2e}, syncs {federation.syncs_done}", flush=True)
                if step >= args.max_steps:
                    break
        if show_next:  # the run ended on a heal: the last loss was the old state's, score the healed one
            with torch.no_grad():
                loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        final_loss = accelerator.reduce(loss.detach().float(), reduction="mean").item()
        # the final sync: end_training() would run it too, but it also shuts the process groups
        # down, so anything that needs the federated model (a save, a checksum) comes before
        accelerator.sync_if_pending()

    mine = {"group": accelerator.group_index, "replica": accelerator.replica_index,
            "shard": accelerator.shard_index, "checksum": shard_checksum(model)}
    every = [None] * accelerator.num_processes
    dist.all_gather_object(every, mine)  # over this launch's world (one group in the torchft mode)
    if accelerator.is_main_process:
        by_shard: dict[int, set] = {}
        for rec in every:
            by_shard.setdefault(rec["shard"], set()).add(rec["checksum"])
        result = {"algorithm": config.algorithm, "num_groups": accelerator.num_groups,
                  "group_index": accelerator.group_index, "fault_tolerance": config.fault_tolerance,
                  "steps": steps_done(), "num_syncs": federation.syncs_done, "final_loss": final_loss,
                  "loss_finite": math.isfinite(final_loss),
                  "comm_bytes": {axis: s["bytes"] for axis, s in accelerator.comm_stats.as_dict().items()},
                  "shards": every,
                  # one group per launch in the torchft mode: compare the groups' logs instead
                  "groups_identical": all(len(v) == 1 for v in by_shard.values()) if not config.fault_tolerant
                  else None}
        print("[train_loop] result " + json.dumps(result), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
