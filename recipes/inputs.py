"""The recipe's data, built in one place: tokenizer, training loader or stream, validation blocks.

:func:`build_data` calls the public functions of :mod:`recipes.data` (corpus, tokenizer,
packing, streaming) on the main process first, so it fills the caches once, and then on
the others; a failure on the main process is raised on every rank (:func:`main_first`).
Training data are sharded by the accelerator's ``data_shard()`` (``FLConfig.data_sharding``):
map-style blocks through Accelerate's data loader, a stream by
``datasets.distributed.split_dataset_by_node`` inside :mod:`recipes.data`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from .args import RecipeError


@dataclasses.dataclass
class Data:
    """What :func:`build_data` returns."""

    tokenizer: Any
    train_loader: Any
    """A ``torch.utils.data.DataLoader`` over this rank's training blocks (map-style: not yet
    prepared by the accelerator) or over its stream."""
    val_blocks: list
    """Validation blocks, each a list of ``seq_len`` token ids, the same on every rank."""
    stream: Any = None
    """The ``PackedStream`` (``--streaming``): its position travels in checkpoints."""
    train_size: int | None = None
    """Training blocks of the map-style data (None for a stream)."""

    def epoch(self):
        """The stream's epoch (None for map-style data), for the block recorder."""
        return self.stream.epoch if self.stream is not None else None


DATA_WAIT_S = 4 * 3600.0
"""How long the other ranks wait for the main process to prepare data (seconds): tokenizing
a large corpus can take far longer than the collective timeout that catches dead peers."""
_WAIT_GROUP: list = []


def _wait_group():
    """A gloo process group over the world whose timeout is :data:`DATA_WAIT_S`, created on
    first use (every rank calls :func:`main_first` in the same order). gloo takes CPU
    tensors on any default backend, so the wait costs no accelerator memory."""
    import torch.distributed as dist
    from datetime import timedelta

    if not _WAIT_GROUP:
        _WAIT_GROUP.append(dist.new_group(backend="gloo", timeout=timedelta(seconds=DATA_WAIT_S)))
    return _WAIT_GROUP[0]


def main_first(accelerator, fn):
    """Run ``fn`` on the main process first (it fills caches), then on the others.

    Unlike ``accelerator.main_process_first()``, a failure on the main process is
    broadcast, so every rank raises the same error instead of waiting in a barrier. The
    others wait in a broadcast on a gloo group of its own with a timeout of
    :data:`DATA_WAIT_S` (the world's collective timeout is short, to catch dead peers; a
    dead main process still ends the job, through the launcher).

    Raises:
        RecipeError: ``"<type>: <message>"`` of the main process's exception, on every rank.
    """
    import torch
    import torch.distributed as dist

    group = _wait_group() if dist.is_initialized() and dist.get_world_size() > 1 else None
    result, error = None, None
    if accelerator.is_main_process:
        try:
            result = fn()
        except Exception as exc:  # re-raised below on every rank
            error = f"{type(exc).__name__}: {exc}"
    box = [error]
    if group is not None:
        dist.broadcast_object_list(box, src=0, group=group, device=torch.device("cpu"))
    if box[0] is not None:
        raise RecipeError(box[0])
    if not accelerator.is_main_process:
        result = fn()
    return result


def prepare_corpus(args, cache_dir: str):
    """Load, tokenize and pack the map-style corpus of ``args`` into ``cache_dir`` (or read
    it from there: :mod:`recipes.data`'s caches). Returns ``(tokenizer, packed
    DatasetDict)`` with "train" and "validation" splits of ``args.seq_len``-token blocks."""
    from . import data as data_lib

    raw = data_lib.load_raw(args, cache_dir)
    tok = data_lib.get_tokenizer(args, raw, cache_dir)
    packed = data_lib.tokenize_and_pack_cached(raw, tok, args.text_column, args.seq_len, cache_dir,
                                               args.preprocessing_num_workers)
    return tok, packed.dataset


def build_data(args, accelerator) -> Data:
    """Tokenizer, training loader and validation blocks for this rank. Collective.

    Raises:
        RecipeError: (on every rank) data errors of :mod:`recipes.data`, and splits too
            small for one micro-batch per rank.
    """
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    from . import data as data_lib

    cache_dir = args.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "fl_accel")
    world = accelerator.num_processes
    if args.streaming:
        num_shards, shard_index, data_seed = accelerator.data_shard()
        source = main_first(accelerator, lambda: data_lib.stream_source(args, cache_dir))
        tokenizer = main_first(accelerator, lambda: data_lib.get_stream_tokenizer(args, source, cache_dir))
        val_blocks = main_first(accelerator, lambda: data_lib.build_validation_blocks(
            source, tokenizer, args.seq_len, args.max_eval_blocks))
        stream = data_lib.build_train_stream(source, tokenizer, args.seq_len, num_shards, shard_index,
                                             args.seed if data_seed is None else data_seed)
        return Data(tokenizer, DataLoader(stream, batch_size=args.micro_batch_size), val_blocks, stream=stream)

    tokenizer, packed = main_first(accelerator, lambda: prepare_corpus(args, cache_dir))
    train_set, val_set = packed["train"], packed["validation"]
    val_blocks = val_set["input_ids"][: args.max_eval_blocks] if args.max_eval_blocks else val_set["input_ids"]
    if len(val_blocks) < world * args.micro_batch_size:
        raise RecipeError(f"the validation split has {len(val_blocks)} blocks of {args.seq_len} tokens; one "
                          f"micro-batch per rank needs {world * args.micro_batch_size} ({world} ranks x "
                          f"--micro_batch_size {args.micro_batch_size}). Lower --seq_len or --micro_batch_size, "
                          f"or give more validation text (--validation_file)")
    if len(train_set) < world * args.micro_batch_size:
        raise RecipeError(f"the training split has {len(train_set)} blocks; one micro-batch per rank needs "
                          f"{world * args.micro_batch_size}")
    loader = DataLoader(train_set.with_format("torch"), batch_size=args.micro_batch_size, shuffle=True,
                        drop_last=True, collate_fn=default_data_collator)
    return Data(tokenizer, loader, val_blocks, train_size=len(train_set))


def batches(data: Data, train_loader, completed_steps: int, steps_per_epoch: int | None, accumulation: int,
            accelerator):
    """Micro-batches of input ids ``[micro_batch, seq_len]`` on the device, from the resume
    point on: epochs of the (prepared) map-style loader, skipping what the checkpointed
    steps consumed, or the endless stream."""
    if data.stream is not None:
        while True:
            for batch in train_loader:
                yield batch["input_ids"].to(accelerator.device)
    epoch = completed_steps // steps_per_epoch
    skip = (completed_steps % steps_per_epoch) * accumulation
    while True:
        train_loader.set_epoch(epoch)
        for batch in (accelerator.skip_first_batches(train_loader, skip) if skip else train_loader):
            yield batch["input_ids"]
        epoch, skip = epoch + 1, 0


def steps_per_epoch(train_loader, accumulation: int) -> int:
    """Accelerate forces an optimizer step at the end of the data loader, so an epoch of B
    micro-batches per rank has ceil(B / accumulation) optimizer steps."""
    return math.ceil(len(train_loader) / accumulation)


def data_epochs(steps: int, steps_per_epoch: int | None) -> float | None:
    """Passes over the map-style training data that ``steps`` optimizer steps take (None for a stream)."""
    return steps / steps_per_epoch if steps_per_epoch else None


def repeat_note(max_steps: int, steps_per_epoch: int | None, max_steps_flag: int | None,
                num_epochs: int) -> str | None:
    """The banner's line when ``--max_steps`` takes more than one pass over the map-style
    training data (the loader starts over, reshuffled; the run still ends at ``max_steps``):
    how many epochs that is and how many are needed. None otherwise (a stream, or the run's
    length from ``--num_epochs``)."""
    epochs = data_epochs(max_steps, steps_per_epoch)
    if max_steps_flag is None or epochs is None or epochs <= 1:
        return None
    needed = math.ceil(epochs)
    return (f"note: --max_steps {max_steps} is {epochs:.2f} epochs of the training data ({steps_per_epoch} "
            f"steps/epoch): the data repeat, {needed} epochs are needed" + (
                f" (--num_epochs {num_epochs} applies only without --max_steps)" if num_epochs != needed else ""))


def stream_note(passes: int, max_steps: int) -> str | None:
    """The closing line when the training stream read a rank's shard to its end (``passes``
    times, the most over the ranks) and went on from its start: the corpus holds fewer
    tokens than ``max_steps`` took. None when no shard was read to its end."""
    if passes < 1:
        return None
    times = "once" if passes == 1 else f"{passes} times"
    return (f"note: the training stream reached the end of a rank's shard {times} and went on from its start (the "
            f"data repeat): --max_steps {max_steps} needs more than {passes} pass{'es' if passes > 1 else ''} over "
            f"this corpus")


def data_record(steps: int, steps_per_epoch: int | None, stream_passes: int | None) -> dict:
    """``all_results.json``'s ``data``: ``source`` ("map-style" or "stream"), ``steps_per_epoch``
    and ``epochs`` (map-style: optimizer steps / steps per epoch), ``stream_passes`` (stream:
    times the most-read rank's shard was read to its end), ``repeated`` (map-style: more than
    one epoch; stream: a shard was read to its end, so what follows repeats)."""
    epochs = data_epochs(steps, steps_per_epoch)
    if steps_per_epoch is not None:
        return {"source": "map-style", "steps_per_epoch": steps_per_epoch, "epochs": epochs, "stream_passes": None,
                "repeated": epochs > 1}
    return {"source": "stream", "steps_per_epoch": None, "epochs": None, "stream_passes": stream_passes,
            "repeated": bool(stream_passes)}
