"""What every peer worker shares with the recipe (``recipes/pretrain.py``), so that a row of the
peers suite differs from an fl_accel row only in the library that federates it.

* **Data**: the recipe's tokenized Shakespeare blocks (:func:`recipes.inputs.prepare_corpus`,
  from the cache the bench fills before its first launch), the recipe's loader
  (``DataLoader(shuffle=True, drop_last=True)``) sharded the recipe's way: Accelerate's
  ``prepare_data_loader`` with a seedable sampler seeded by ``--seed``, over the whole world
  (``num_processes`` = every rank of every group, ``process_index`` = the rank's place in it,
  groups as contiguous rank blocks), re-seeded per epoch with ``set_epoch``. Rank r of the
  peers reads the micro-batches rank r of the recipe reads.
* **Model**: the recipe's preset (``tiny``) with the tokenizer's vocabulary
  (:func:`recipes.modeling.resolve_config`), built on the CPU right after ``set_seed(--seed)``
  (the recipe with ``--init_device cpu`` builds the same weights).
* **Optimizer and schedule**: the recipe's AdamW (:func:`recipes.modeling.build_optimizer`, its
  defaults: lr 3e-4, betas (0.9, 0.95), weight decay 0.1), gradient clipping at 1.0, and
  ``transformers.get_scheduler`` (cosine, 10 % linear warmup) over ``--max_steps``.
* **Evaluation**: the first ``--max_eval_blocks`` validation blocks, split over the world's ranks
  as the recipe splits them (:func:`recipes.metrics.eval_batches`), token-weighted NLL (sum of
  token NLL in nats and the number of predicted tokens). A rank scores its rows with its own
  group's model (as the recipe's "own group per rank" does while groups differ).
* **Records** (:class:`Records`): ``metrics.jsonl`` lines with the recipe's keys (``step``,
  ``tokens`` of the whole world, ``time_s`` = training seconds, ``wall_s`` = seconds since the
  worker's start after its imports (the recipe's clock starts there too), ``train/loss``,
  ``eval/loss``) plus ``eval/nll_sum`` and ``eval/tokens`` (so that the bench can add the
  groups' parts), and ``all_results.json`` at the end.

``python -m bench.peers_workers.common --cache_dir DIR`` fills the corpus and tokenizer cache
once (the bench runs it before its first launch, so that concurrent workers only read it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from contextlib import contextmanager
from datetime import timedelta
from importlib import metadata


def add_common_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags every worker takes (the recipe's names)."""
    from recipes.args import RecipeArguments

    lr = RecipeArguments.__dataclass_fields__["learning_rate"].default
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--micro_batch_size", type=int, default=4)
    p.add_argument("--max_steps", type=int, required=True)
    p.add_argument("--learning_rate", type=float, default=lr, help=f"AdamW peak LR (the recipe's default {lr:g})")
    p.add_argument("--sync_every", type=int, required=True, help="H: inner optimizer steps per round")
    p.add_argument("--outer_optimizer", choices=("nesterov", "avg"), default="nesterov",
                   help="nesterov: SGD(lr=--outer_lr, momentum=--outer_momentum, nesterov=True) on the "
                        "pseudo-gradient; avg: the plain average (SGD lr 1, no momentum)")
    p.add_argument("--outer_lr", type=float, default=0.7)
    p.add_argument("--outer_momentum", type=float, default=0.9)
    p.add_argument("--eval_every", type=int, default=8, help="rounded up to a multiple of --sync_every, as the "
                   "recipe does; the last step is always evaluated")
    p.add_argument("--max_eval_blocks", type=int, default=64)
    p.add_argument("--log_every", type=int, default=1)
    p.add_argument("--cache_dir", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--timeout_s", type=float, default=600.0, help="collective and quorum timeouts, seconds")
    return p


def check_common(args) -> None:
    """Raise ValueError naming the flag: steps not a multiple of H, values < 1."""
    for name in ("max_steps", "sync_every", "eval_every", "max_eval_blocks", "log_every", "micro_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.max_steps % args.sync_every:
        raise ValueError(f"--max_steps {args.max_steps} must be a multiple of --sync_every {args.sync_every}")


def recipe_arguments(args):
    """The recipe's arguments for data, model and optimizer: its defaults and the flags given."""
    from recipes.args import RecipeArguments

    return RecipeArguments(seq_len=args.seq_len, micro_batch_size=args.micro_batch_size, max_steps=args.max_steps,
                           learning_rate=args.learning_rate, cache_dir=args.cache_dir, seed=args.seed,
                           max_eval_blocks=args.max_eval_blocks, init_device="cpu")


def load_corpus(ra):
    """``(tokenizer, train split, validation blocks)`` of the recipe's corpus (read from the cache)."""
    from recipes.inputs import prepare_corpus

    tokenizer, packed = prepare_corpus(ra, ra.cache_dir)
    val = packed["validation"]["input_ids"]
    return tokenizer, packed["train"], val[: ra.max_eval_blocks] if ra.max_eval_blocks else val


def train_loader(train_set, micro_batch: int, num_processes: int, process_index: int, seed: int):
    """The recipe's training loader for world rank ``process_index`` of ``num_processes``."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    loader = DataLoader(train_set.with_format("torch"), batch_size=micro_batch, shuffle=True, drop_last=True,
                        collate_fn=default_data_collator)
    return prepare_data_loader(loader, None, num_processes=num_processes, process_index=process_index,
                               put_on_device=False, rng_types=["generator"], use_seedable_sampler=True,
                               data_seed=seed)


def batches(loader):
    """Micro-batches of input ids ``[micro_batch, seq_len]``, epoch after epoch (``set_epoch``)."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        for batch in loader:
            yield batch["input_ids"]
        epoch += 1


def build_model(tokenizer, ra):
    """The recipe's model, fully initialized on the CPU right after ``set_seed(ra.seed)``."""
    from accelerate.utils import set_seed
    from recipes.modeling import build_model as recipe_build_model, resolve_config

    config, _ = resolve_config(ra.model, ra.seq_len, len(tokenizer), ra.resize_vocab)
    set_seed(ra.seed)
    return recipe_build_model(config, "cpu")


def fsdp_units(model) -> list:
    """The units fl_accel deals its fragments from, in forward order, as ``torch.nn.Module``s: the
    input embedding, each decoder layer, then the final norm with the LM head. They are the FSDP2
    units of fl_accel's model (Accelerate 1.15's FSDP2 path shards each decoder layer and carves
    the embedding and the tail [final norm, LM head] into units of their own; with P = 2 fl_accel's
    ``federation.fragment_plan`` for the ``tiny`` preset is [embedding, layers 1, 3] and [layers
    0, 2, norm, LM head]), so the peers' fragments hold the same parameters as fl_accel's.

    Raises:
        ValueError: the units do not hold every parameter exactly once (a model of another shape).
    """
    import torch

    inner = model.model
    units = [inner.embed_tokens, *inner.layers, torch.nn.ModuleList([inner.norm, model.lm_head])]
    seen = [id(p) for u in units for p in u.parameters()]
    if sorted(seen) != sorted(id(p) for p in model.parameters()) or len(set(seen)) != len(seen):
        raise ValueError("the embedding, the decoder layers and the tail (norm, lm_head) do not hold every parameter "
                         "exactly once: not a Llama-shaped causal LM with untied embeddings")
    return units


def deal(units: list, num_fragments: int) -> list:
    """Fragment k of P holds the units u with u mod P = k, in order (``torch.nn.ModuleList``s).

    Raises:
        ValueError: P < 1 or P > the number of units.
    """
    import torch

    if not 1 <= num_fragments <= len(units):
        raise ValueError(f"num_fragments must be in [1, {len(units)}] (the model's FSDP units), got {num_fragments}")
    return [torch.nn.ModuleList(units[k::num_fragments]) for k in range(num_fragments)]


def shard(model, mesh) -> None:
    """FSDP2 as torchtitan applies it: ``fully_shard`` per decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def outer_optimizer(params, args):
    """The outer optimizer of the pseudo-gradient: SGD Nesterov (DiLoCo) or the plain average."""
    import torch

    if args.outer_optimizer == "avg":
        return torch.optim.SGD(params, lr=1.0)
    return torch.optim.SGD(params, lr=args.outer_lr, momentum=args.outer_momentum, nesterov=args.outer_momentum > 0)


def inner_optimizer(model, ra):
    """``(AdamW, LR scheduler)``: the recipe's optimizer and schedule, stepped once per optimizer step."""
    from recipes.modeling import build_optimizer
    from transformers import get_scheduler

    optimizer = build_optimizer(model, ra, "cpu")
    warmup = math.ceil(ra.warmup_ratio * ra.max_steps)
    return optimizer, get_scheduler(ra.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                                    num_training_steps=ra.max_steps)


def clip(model, max_norm: float):
    """Gradient clipping at ``max_norm`` (0: none) over the whole model (DTensor shards included)."""
    import torch

    if max_norm:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def eval_interval(eval_every: int, sync_every: int) -> int:
    """The recipe's rule: evaluations at multiples of H, so a blocking sync's model is scored."""
    return math.ceil(eval_every / sync_every) * sync_every


def evaluate(model, blocks, index: int, count: int, micro_batch: int, group=None) -> tuple[float, int]:
    """``(sum of token NLL in nats, predicted tokens)`` of the rows ``index, index + count, ...``
    of ``blocks`` (:func:`recipes.metrics.eval_batches`), summed over ``group``'s ranks (an
    all-reduce; every rank of an FSDP group runs the same number of forwards)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from recipes.metrics import eval_batches

    model.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for ids, weight in eval_batches(blocks, index, count, micro_batch):
            logits = model(input_ids=ids, use_cache=False).logits.float()
            nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1),
                                  reduction="none").view(ids.size(0), -1).sum(1).double()
            totals[0] += (nll * weight).sum()
            totals[1] += weight.sum() * (ids.size(1) - 1)
    model.train()
    dist.all_reduce(totals, group=group)
    return totals[0].item(), int(totals[1].item())


class Records:
    """The worker's clock and its files (written by the process with ``writer=True``).

    ``time_s``: training seconds, from the first step on, evaluation pauses excluded (the
    recipe's ``train_seconds``); ``wall_s``: seconds since the worker started (``t0``)."""

    def __init__(self, output_dir: str, writer: bool, t0: float):
        self.output_dir, self.writer, self.t0 = output_dir, writer, t0
        self.train_s, self.eval_s = 0.0, 0.0
        self.started: float | None = None
        self._last: float | None = None
        if writer:
            os.makedirs(output_dir, exist_ok=True)
            open(self.path, "w").close()

    path = property(lambda self: os.path.join(self.output_dir, "metrics.jsonl"))

    def start_training(self) -> None:
        self.started = self._last = time.perf_counter()

    def tick(self) -> None:
        """Charge the time since the last tick to training."""
        now = time.perf_counter()
        self.train_s += now - self._last
        self._last = now

    @contextmanager
    def paused(self):
        """An evaluation: its seconds are not training seconds."""
        self.tick()
        t = time.perf_counter()
        try:
            yield
        finally:
            self.eval_s += time.perf_counter() - t
            self._last = time.perf_counter()

    def stamp(self, step: int, tokens: int) -> dict:
        return {"step": step, "tokens": tokens, "time_s": self.train_s, "wall_s": time.perf_counter() - self.t0}

    def write(self, record: dict) -> None:
        if self.writer:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")

    def finish(self, results: dict) -> None:
        """all_results.json (through a temporary file: its presence marks a finished launch)."""
        if not self.writer:
            return
        out = {"train_seconds": self.train_s, "eval_seconds": self.eval_s,
               "startup_seconds": (self.started or self.t0) - self.t0,
               "wall_seconds": time.perf_counter() - self.t0, "versions": versions(), **results}
        tmp = os.path.join(self.output_dir, "all_results.json.partial")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
        os.replace(tmp, os.path.join(self.output_dir, "all_results.json"))


def versions() -> dict:
    out = {}
    for pkg in ("torch", "torchft", "accelerate", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def timeout(args) -> timedelta:
    return timedelta(seconds=args.timeout_s)


_KEPT_GROUPS: list = []


def free_process_group_at_exit(process_group) -> None:
    """Keep ``process_group`` (a ``torch.distributed.ProcessGroup``: DDP's ``model.process_group``)
    alive until the interpreter exits, and free it then, from an ``atexit`` callback.

    Why: DDP's C++ ``Reducer`` holds its process group. Where the Reducer is the last holder (at
    the end of ``main()``, when its locals go), it frees the group from its pybind11 destructor,
    which keeps the GIL, and ``~ProcessGroupGloo`` joins its worker threads; a worker thread still
    freeing a finished collective's tensors needs the GIL to drop their Python objects, so both
    wait forever. Seen on a loaded 2-core machine (a test launch of this script hung at exit, rank 0
    done): the main thread in ``~Reducer -> ~ProcessGroupGloo -> std::thread::join``, a
    ``pt_gloo_runloop`` thread in ``~AsyncAllreduceWork -> decref_pyobject -> gil_scoped_acquire``
    (torch 2.13; pytorch/pytorch#56297 lists such blocking destructors). The Python
    ``ProcessGroup``'s own destructor releases the GIL first (torch >= 2.8), so a group freed from
    Python after the Reducer is gone cannot deadlock."""
    import atexit

    if not _KEPT_GROUPS:
        atexit.register(_KEPT_GROUPS.clear)
    _KEPT_GROUPS.append(process_group)


def main(argv=None) -> int:
    """Fill the corpus and tokenizer cache (one process, no collective)."""
    p = argparse.ArgumentParser(prog="python -m bench.peers_workers.common", description=main.__doc__)
    p.add_argument("--cache_dir", required=True)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args(argv)
    from recipes.args import RecipeArguments
    from recipes.inputs import prepare_corpus

    t = time.perf_counter()
    tokenizer, packed = prepare_corpus(RecipeArguments(seq_len=args.seq_len, cache_dir=args.cache_dir,
                                                       seed=args.seed), args.cache_dir)
    print(f"[peers] corpus cache {args.cache_dir}: {len(packed['train'])} training and {len(packed['validation'])} "
          f"validation blocks of {args.seq_len} tokens, vocabulary {len(tokenizer)} ({time.perf_counter() - t:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
