"""torchft's DiLoCo and Streaming DiLoCo, written as a torchft user writes them: one replica group
per launch (``torchrun --nproc_per_node G``), FSDP2 inside the group, a ``torchft.Manager`` per
rank talking to a Lighthouse, and ``torchft.local_sgd.DiLoCo`` around the inner optimizer.

Per replica group ``f`` (the bench starts one per emulated node, and the Lighthouse)::

    TORCHFT_LIGHTHOUSE=http://<lighthouse>:<port> torchrun --nproc_per_node 2 --master_addr <node address> \\
        --master_port P bench/peers_workers/torchft_diloco.py --replica_group f --num_replica_groups 2 \\
        --hostname <node address> --max_steps 64 --sync_every 8 [--num_fragments 2 --sync_delay 2] \\
        --cache_dir ... --output_dir .../group<f>

The setup follows the verified recipe for torchft 0.2.0 on this project's machines (FACTS.md:
"torchft's DiLoCo as a side-by-side peer on this machine works"):

* ``Manager(pg=ProcessGroupGloo(timeout), use_async_quorum=False, init_sync=False, hostname=<the
  group's own address>, min_replica_size=--min_replicas, replica_id=peers_group_<f>)``: DiLoCo
  needs the synchronous quorum (torchft raises otherwise); every group builds the same weights
  from the seed, so none downloads another's at step 0; the address is what the Lighthouse
  hands the other group (``socket.gethostname()`` is not reachable across the emulated link).
* FSDP2 (``fully_shard`` per decoder layer, then the root) on the group's own mesh; the managed
  process group pairs each rank with the rank of the same group rank in the other groups, so
  each all-reduce averages one shard (torchft averages ``DTensor`` local shards).
* Fragments: the units fl_accel deals its fragments from (the embedding, each decoder layer,
  the final norm with the LM head: :func:`bench.peers_workers.common.fsdp_units`) dealt
  round-robin into ``--num_fragments`` ``nn.ModuleList``s, so each fragment holds the
  parameters of fl_accel's fragment of the same index; one outer optimizer per fragment
  (torchtitan's semi-sync setup). torchft syncs one fragment
  every ``H / P`` steps, launching its all-reduce ``--sync_delay`` steps before
  (``fragment_sync_delay`` must stay below ``H / P``: torchft's own check).
* The first quorum is formed before the timed loop (``manager.start_quorum()``), so that a
  group's late start is not charged to the first sync; the Lighthouse waits for every group
  (``--min_replicas`` of the bench's Lighthouse = the number of groups).

Outputs (group rank 0): ``metrics.jsonl`` (this group's evaluation part: ``eval/nll_sum`` and
``eval/tokens`` over the rows its ranks scored, world rank = f x G + group rank) and
``all_results.json`` (``commits``: torchft's committed syncs, which the bench checks).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    from bench.peers_workers.common import add_common_args

    p = argparse.ArgumentParser(prog="bench/peers_workers/torchft_diloco.py", description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--replica_group", type=int, required=True, help="f: this launch's replica group")
    p.add_argument("--num_replica_groups", type=int, required=True)
    p.add_argument("--hostname", required=True, help="the address the Lighthouse hands the other groups")
    p.add_argument("--lighthouse", default=None, help="http://host:port (default: $TORCHFT_LIGHTHOUSE)")
    p.add_argument("--min_replicas", type=int, default=None, help="the Manager's min_replica_size (default: all)")
    p.add_argument("--num_fragments", type=int, default=1)
    p.add_argument("--sync_delay", type=int, default=0, help="torchft's fragment_sync_delay (tau)")
    p.add_argument("--fragment_update_alpha", type=float, default=0.0)
    return p


def check(args) -> None:
    """ValueError naming the flag, before any collective (torchft's own rules included)."""
    from bench.peers_workers.common import check_common

    check_common(args)
    if not 0 <= args.replica_group < args.num_replica_groups:
        raise ValueError(f"--replica_group must be in [0, {args.num_replica_groups}), got {args.replica_group}")
    if args.num_fragments < 1 or args.sync_every % args.num_fragments:
        raise ValueError(f"--sync_every {args.sync_every} must be a multiple of --num_fragments {args.num_fragments}")
    if not 0 <= args.sync_delay < args.sync_every // args.num_fragments:
        raise ValueError(f"--sync_delay must be in [0, H/P = {args.sync_every // args.num_fragments}) (torchft: "
                         f"a fragment is synced before it is reduced again), got {args.sync_delay}")
    if not (args.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
        raise ValueError("no Lighthouse: pass --lighthouse http://host:port or set TORCHFT_LIGHTHOUSE")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check(args)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchft import Manager
    from torchft.local_sgd import DiLoCo
    from torchft.process_group import ProcessGroupGloo

    from bench.peers_workers import common

    t0 = time.perf_counter()  # after the imports, as the recipe's clock
    timeout = common.timeout(args)
    dist.init_process_group("gloo", timeout=timeout)
    rank, size = dist.get_rank(), dist.get_world_size()
    world, world_rank = size * args.num_replica_groups, args.replica_group * size + rank
    ra = common.recipe_arguments(args)
    tokenizer, train_set, val_blocks = common.load_corpus(ra)
    loader = common.train_loader(train_set, args.micro_batch_size, world, world_rank, args.seed)
    model = common.build_model(tokenizer, ra)
    n_params = sum(p.numel() for p in model.parameters())
    units = common.fsdp_units(model)  # fully_shard keeps the module objects
    common.shard(model, init_device_mesh("cpu", (size,)))
    inner, scheduler = common.inner_optimizer(model, ra)
    fragments = common.deal(units, args.num_fragments)
    outers = [common.outer_optimizer(f.parameters(), args) for f in fragments]

    def state_dict():  # what a recovering group would download (never used here: no faults)
        return {"model": model.state_dict(), "inner": inner.state_dict(), "scheduler": scheduler.state_dict()}

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])
        scheduler.load_state_dict(state["scheduler"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
                      min_replica_size=args.min_replicas or args.num_replica_groups, use_async_quorum=False,
                      timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                      lighthouse_addr=args.lighthouse, replica_id=f"peers_group_{args.replica_group}",
                      hostname=args.hostname, init_sync=False)
    records = common.Records(args.output_dir, rank == 0, t0)
    tokens_per_step = world * args.micro_batch_size * args.seq_len
    every = common.eval_interval(args.eval_every, args.sync_every)
    stream = common.batches(loader)
    manager.start_quorum()  # the first quorum (every group: the Lighthouse waits for them) before the clock
    participants = manager.num_participants()
    model.train()
    records.start_training()
    with DiLoCo(manager, fragments, inner, outers, sync_every=args.sync_every, fragment_sync_delay=args.sync_delay,
                fragment_update_alpha=args.fragment_update_alpha):
        for step in range(1, args.max_steps + 1):
            ids = next(stream)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            common.clip(model, ra.max_grad_norm)
            inner.step()  # DiLoCo's step hooks prepare and perform the fragment syncs
            scheduler.step()
            inner.zero_grad(set_to_none=True)
            records.tick()
            if step % args.log_every == 0 or step == args.max_steps:
                mean = loss.detach().reshape(1).double()
                dist.all_reduce(mean)
                records.write({**records.stamp(step, step * tokens_per_step), "train/loss": mean.item() / size,
                               "lr": scheduler.get_last_lr()[0], "commits": manager.current_step(), "group":
                               args.replica_group})
                records.tick()
            if step % every == 0 or step == args.max_steps:
                with records.paused():
                    nll, tokens = common.evaluate(model, val_blocks, world_rank, world, args.micro_batch_size)
                records.write({**records.stamp(step, step * tokens_per_step), "eval/loss": nll / tokens,
                               "eval/nll_sum": nll, "eval/tokens": tokens, "group": args.replica_group,
                               "eval/scored": "own group per rank"})
    commits = manager.current_step()
    records.finish({"tool": "torchft", "algorithm": "streaming_diloco" if args.num_fragments > 1 else "diloco",
                    "replica_group": args.replica_group, "num_replica_groups": args.num_replica_groups,
                    "group_size": size, "world_size": world, "steps": args.max_steps,
                    "train_tokens": args.max_steps * tokens_per_step, "tokens_per_step": tokens_per_step,
                    "commits": commits, "expected_commits": args.max_steps // (args.sync_every // args.num_fragments),
                    "first_quorum_participants": participants, "n_params": n_params,
                    "fragments": [[n for n, _ in f.named_parameters()] for f in fragments],
                    "args": vars(args)})
    manager.shutdown(wait=False)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
