"""Accelerate's LocalSGD, written as its documentation shows it (``accelerate.local_sgd.LocalSGD``
around the loop, ``local_sgd.step()`` after each optimizer step), on the recipe's model, data,
optimizer and schedule (:mod:`bench.peers_workers.common`).

LocalSGD runs on DDP only: its constructor raises ``NotImplementedError`` for any distributed
type but NO and the MULTI_* (DDP) ones, so for FSDP too (``accelerate/local_sgd.py``). Every
rank therefore holds a whole replica (no sharding inside a node), trains on its own micro-batches
(DDP's gradient all-reduce is off inside LocalSGD: ``model.no_sync()``) and every ``H`` steps the
parameters are averaged over the whole world, one ``accelerator.reduce(mean)`` per parameter.
Its outer step is that plain average (no outer optimizer), and leaving the ``with`` block
averages once more (``LocalSGD.__exit__``), which the run's training seconds include.

One world over both emulated nodes, as an Accelerate user launches it::

    torchrun --nnodes 2 --node_rank k --nproc_per_node 2 --master_addr <node 0> --master_port P \\
        bench/peers_workers/accelerate_localsgd.py --max_steps 64 --sync_every 8 --cache_dir ... --output_dir ...

Accelerate prepares the loader with the recipe's seedable sampler (``DataLoaderConfiguration(
use_seedable_sampler=True, data_seed=--seed)``), so rank r reads what rank r of the recipe reads;
the model is wrapped in DDP (rank 0's weights broadcast at ``prepare``). Outputs (rank 0):
``metrics.jsonl``, ``all_results.json``.
"""

from __future__ import annotations

import argparse
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    from bench.peers_workers.common import add_common_args

    p = argparse.ArgumentParser(prog="bench/peers_workers/accelerate_localsgd.py",
                                description=__doc__.split("\n\n")[0])
    add_common_args(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from bench.peers_workers import common

    common.check_common(args)
    if args.outer_optimizer != "avg":
        raise ValueError("--outer_optimizer: Accelerate's LocalSGD averages the parameters (avg); it has no outer "
                         "optimizer")
    import torch.distributed as dist
    from accelerate import Accelerator, DistributedType
    from accelerate.local_sgd import LocalSGD
    from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    t0 = time.perf_counter()  # after the imports, as the recipe's clock
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True,
                                                                                 data_seed=args.seed),
                              kwargs_handlers=[InitProcessGroupKwargs(timeout=common.timeout(args))])
    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        raise RuntimeError(f"expected DDP over gloo (MULTI_CPU), got {accelerator.distributed_type}: launch with "
                           f"torchrun")
    ra = common.recipe_arguments(args)
    tokenizer, train_set, val_blocks = common.load_corpus(ra)
    loader = DataLoader(train_set.with_format("torch"), batch_size=args.micro_batch_size, shuffle=True,
                        drop_last=True, collate_fn=default_data_collator)
    model = common.build_model(tokenizer, ra)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer, scheduler = common.inner_optimizer(model, ra)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    common.free_process_group_at_exit(model.process_group)  # not from DDP's Reducer: a deadlock at exit
    world, rank = accelerator.num_processes, accelerator.process_index
    records = common.Records(args.output_dir, accelerator.is_main_process, t0)
    tokens_per_step = world * args.micro_batch_size * args.seq_len
    every = common.eval_interval(args.eval_every, args.sync_every)
    stream = common.batches(loader)
    plain = accelerator.unwrap_model(model)
    accelerator.wait_for_everyone()
    model.train()
    records.start_training()
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=args.sync_every, enabled=True) as local_sgd:
        for step in range(1, args.max_steps + 1):
            ids = next(stream)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            accelerator.backward(loss)
            if ra.max_grad_norm:
                accelerator.clip_grad_norm_(model.parameters(), ra.max_grad_norm)
            optimizer.step()
            scheduler.step()  # not prepared: once per optimizer step
            optimizer.zero_grad(set_to_none=True)
            local_sgd.step()  # averages the parameters over the world every H steps
            records.tick()
            if step % args.log_every == 0 or step == args.max_steps:
                mean = loss.detach().reshape(1).double()
                dist.all_reduce(mean)
                records.write({**records.stamp(step, step * tokens_per_step), "train/loss": mean.item() / world,
                               "lr": scheduler.get_last_lr()[0]})
                records.tick()
            if step < args.max_steps and step % every == 0:
                with records.paused():
                    nll, tokens = common.evaluate(plain, val_blocks, rank, world, args.micro_batch_size)
                records.write({**records.stamp(step, step * tokens_per_step), "eval/loss": nll / tokens,
                               "eval/nll_sum": nll, "eval/tokens": tokens, "eval/scored": "synchronized"})
    with records.paused():  # the time since the last tick (LocalSGD.__exit__'s average) is training time
        nll, tokens = common.evaluate(plain, val_blocks, rank, world, args.micro_batch_size)
    records.write({**records.stamp(args.max_steps, args.max_steps * tokens_per_step), "eval/loss": nll / tokens,
                   "eval/nll_sum": nll, "eval/tokens": tokens, "eval/scored": "synchronized"})
    records.finish({"tool": "accelerate", "algorithm": "localsgd",
                    "distributed_type": str(accelerator.distributed_type),
                    "world_size": world, "steps": args.max_steps, "train_tokens": args.max_steps * tokens_per_step,
                    "tokens_per_step": tokens_per_step, "syncs": local_sgd.num_steps // args.sync_every + 1,
                    "n_params": n_params, "args": vars(args)})
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
