"""A causal-LM pretraining script written the way Accelerate's users write them (the shape of
transformers' ``examples/pytorch/language-modeling/run_clm_no_trainer.py``), to check that
``FLAccelerator`` is a drop-in for ``Accelerator``: the only difference between the two runs
is the line that builds the accelerator (``--accelerator plain|fl``; the FL settings come from
``FL_ACCEL_*`` variables, so that line takes the same arguments).

What it does, as the canonical script does it:

* text files -> ``load_dataset("text")`` -> tokenize -> ``group_texts`` into blocks, under
  ``main_process_first()``;
* the scheduler sized the Accelerate way: warmup and length times ``num_processes``
  (``AcceleratedScheduler`` steps it ``num_processes`` times per optimizer step);
* ``accumulate`` / ``backward`` / ``clip_grad_norm_`` / ``optimizer.step`` / ``scheduler.step``;
* ``save_state`` every ``--checkpointing_steps`` into ``step_N``; ``--resume_from_checkpoint``
  with ``load_state`` and ``skip_first_batches``;
* an evaluation per epoch with ``gather_for_metrics``; a tracker (``--with_tracking``);
* the final export ``unwrap_model(model).save_pretrained(..., is_main_process=...,
  save_function=accelerator.save)`` *before* ``end_training()``, and ``all_results.json``.

Test-only additions (not part of the pattern): plain Accelerate's DDP process group is freed at
exit, not by DDP's Reducer (a deadlock at exit on a loaded machine); every optimizer step's LR goes to
``lr-rank{r}.json``; ``--stop_after N`` exits (as a crash would) after step N's checkpoint;
under ``fl`` a pre-sync hook keeps each group's full parameters of the last sync in
``groups-before-last-sync.pt`` (rank 0 of each group writes ``group{f}.pt``), so the test
can check that the export is the mean of the groups; ``--export`` picks the export call.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_scheduler


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--accelerator", choices=["plain", "fl"], required=True)
    p.add_argument("--train_file", required=True)
    p.add_argument("--validation_file", required=True)
    p.add_argument("--config_name", required=True)
    p.add_argument("--tokenizer_name", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--block_size", type=int, default=32)
    p.add_argument("--per_device_train_batch_size", type=int, default=2)
    p.add_argument("--per_device_eval_batch_size", type=int, default=2)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--num_train_epochs", type=int, default=2)
    p.add_argument("--max_train_steps", type=int, default=None)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--lr_scheduler_type", default="linear")
    p.add_argument("--num_warmup_steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--checkpointing_steps", default=None)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--with_tracking", action="store_true")
    p.add_argument("--export", choices=["save_pretrained", "save_pretrained_state_dict", "save_model"],
                   default="save_pretrained")
    p.add_argument("--stop_after", type=int, default=None)
    p.add_argument("--automatic_checkpoint_naming", action="store_true",
                   help="ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2): save_state() and, at "
                        "the end, load_state() without a folder")
    p.add_argument("--model_no_sync", action="store_true",
                   help="accumulate as Accelerate's autoregressive example does: model.no_sync() on every micro-batch "
                        "but the last of a step, no accelerator.accumulate")
    return p.parse_args(argv)


def build_accelerator(args, **kwargs):
    if args.accelerator == "plain":
        return Accelerator(cpu=True, **kwargs)
    from fl_accel import FLAccelerator

    return FLAccelerator(cpu=True, **kwargs)  # the one-line swap


def main(argv=None):
    args = parse_args(argv)
    log_kwargs = {"log_with": "wandb", "project_dir": args.output_dir} if args.with_tracking else {}
    if args.automatic_checkpoint_naming:
        from accelerate.utils import ProjectConfiguration

        log_kwargs["project_config"] = ProjectConfiguration(project_dir=args.output_dir,
                                                            automatic_checkpoint_naming=True, total_limit=2)
    accelerator = build_accelerator(args, gradient_accumulation_steps=args.gradient_accumulation_steps, **log_kwargs)
    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    raw = load_dataset("text", data_files={"train": args.train_file, "validation": args.validation_file},
                       keep_linebreaks=True)
    config = AutoConfig.from_pretrained(args.config_name)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    model = AutoModelForCausalLM.from_config(config)

    def tokenize(examples):
        return tokenizer(examples["text"])

    block_size = args.block_size

    def group_texts(examples):
        joined = {k: sum(examples[k], []) for k in examples}
        total = (len(joined["input_ids"]) // block_size) * block_size
        out = {k: [t[i:i + block_size] for i in range(0, total, block_size)] for k, t in joined.items()}
        out["labels"] = out["input_ids"].copy()
        return out

    with accelerator.main_process_first():
        tokenized = raw.map(tokenize, batched=True, remove_columns=["text"])
        blocks = tokenized.map(group_texts, batched=True)
    train_dataset, eval_dataset = blocks["train"], blocks["validation"]
    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=default_data_collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator,
                                 batch_size=args.per_device_eval_batch_size)

    no_decay = ["bias", "layer_norm.weight"]
    groups = [{"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
               "weight_decay": 0.1},
              {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
               "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate)

    overrode_max_train_steps = False
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
        overrode_max_train_steps = True
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type, optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps if overrode_max_train_steps
        else args.max_train_steps * accelerator.num_processes)

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):  # test only: plain Accelerate's DDP
        _free_process_group_at_exit(model.process_group)

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if overrode_max_train_steps:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
    checkpointing_steps = int(args.checkpointing_steps) if args.checkpointing_steps else None
    if args.with_tracking:
        accelerator.init_trackers("clm_no_trainer", {"learning_rate": args.learning_rate})
    if args.accelerator == "fl":
        _keep_groups_before_sync(accelerator, model, args.output_dir)

    completed_steps, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        resume_step = int(os.path.basename(args.resume_from_checkpoint.rstrip("/")).replace("step_", ""))
        resume_step *= args.gradient_accumulation_steps
        starting_epoch = resume_step // len(train_dataloader)
        completed_steps = resume_step // args.gradient_accumulation_steps
        resume_step -= starting_epoch * len(train_dataloader)

    lrs_path = os.path.join(args.output_dir, f"lr-rank{accelerator.process_index}.json")
    lrs = json.load(open(lrs_path)) if args.resume_from_checkpoint and os.path.exists(lrs_path) else {}
    perplexity = None
    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        total_loss = 0.0
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        if args.model_no_sync:
            completed_steps = _train_epoch_with_model_no_sync(args, accelerator, model, optimizer, lr_scheduler,
                                                              active_dataloader, completed_steps, lrs, lrs_path)
            active_dataloader = []
        for step, batch in enumerate(active_dataloader):
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                total_loss += loss.detach().float()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                lrs[str(completed_steps + 1)] = lr_scheduler.get_last_lr()[0]
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
                with open(lrs_path, "w") as fh:
                    json.dump(lrs, fh)
                if checkpointing_steps and completed_steps % checkpointing_steps == 0:
                    accelerator.save_state(None if args.automatic_checkpoint_naming else
                                           os.path.join(args.output_dir, f"step_{completed_steps}"))
                    if args.stop_after is not None and completed_steps >= args.stop_after:
                        accelerator.wait_for_everyone()
                        sys.exit(0)  # as if the job had died here
            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        losses = []
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            losses.append(accelerator.gather_for_metrics(outputs.loss.repeat(args.per_device_eval_batch_size)))
        eval_loss = torch.mean(torch.cat(losses))
        perplexity = math.exp(eval_loss)
        if args.with_tracking:
            accelerator.log({"perplexity": perplexity, "eval_loss": eval_loss.item(),
                             "train_loss": float(total_loss) / max(1, len(train_dataloader))}, step=completed_steps)

    accelerator.wait_for_everyone()
    if args.automatic_checkpoint_naming:
        accelerator.load_state()  # the latest checkpoint_<i>
    final = os.path.join(args.output_dir, "final")
    if args.export == "save_model":
        accelerator.save_model(model, final)
    else:
        unwrapped_model = accelerator.unwrap_model(model)
        extra = {"state_dict": accelerator.get_state_dict(model)} if args.export == "save_pretrained_state_dict" else {}
        unwrapped_model.save_pretrained(final, is_main_process=accelerator.is_main_process,
                                        save_function=accelerator.save, **extra)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(final)
        with open(os.path.join(args.output_dir, "all_results.json"), "w") as fh:
            json.dump({"perplexity": perplexity, "steps": completed_steps}, fh)
    accelerator.wait_for_everyone()
    accelerator.end_training()


def _train_epoch_with_model_no_sync(args, accelerator, model, optimizer, lr_scheduler, loader, completed_steps, lrs,
                                    lrs_path):
    """One epoch as Accelerate's gradient_accumulation_for_autoregressive_models.py steps:
    ``model.no_sync()`` around every micro-batch but the last of an optimizer step."""
    import contextlib

    batches = list(loader)
    n = args.gradient_accumulation_steps
    for start in range(0, len(batches), n):
        chunk = batches[start:start + n]
        for i, batch in enumerate(chunk):
            ctx = model.no_sync if i < len(chunk) - 1 and accelerator.num_processes > 1 else contextlib.nullcontext
            with ctx():
                accelerator.backward(model(**batch).loss / len(chunk))
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        lrs[str(completed_steps + 1)] = lr_scheduler.get_last_lr()[0]
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        completed_steps += 1
        with open(lrs_path, "w") as fh:
            json.dump(lrs, fh)
        if completed_steps >= args.max_train_steps:
            break
    return completed_steps


_KEPT_GROUPS: list = []


def _free_process_group_at_exit(process_group) -> None:
    """Test only: keep DDP's process group until the interpreter exits and free it then (atexit),
    so that DDP's Reducer is never its last holder. The Reducer's destructor keeps the GIL while
    ``~ProcessGroupGloo`` joins its threads, and one of them may wait for the GIL to free a
    finished collective's tensors: a hang at exit on a loaded machine (seen with Accelerate's
    LocalSGD worker, bench/peers_workers/common.py ``free_process_group_at_exit``)."""
    import atexit

    if not _KEPT_GROUPS:
        atexit.register(_KEPT_GROUPS.clear)
    _KEPT_GROUPS.append(process_group)


def _keep_groups_before_sync(accelerator, model, out_dir):
    """Test only: before every sync, rank 0 of each group keeps its group's full parameters
    (gathered over the group: a collective inside the group), overwriting the last."""
    from torch.distributed.tensor import DTensor

    def hook(synchronizer, full):
        if not full:
            return
        state = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                 for n, p in model.named_parameters()}
        if accelerator.process_index == accelerator.layout.group_ranks(accelerator.group_index)[0]:
            torch.save(state, os.path.join(out_dir, f"group{accelerator.group_index}-before-last-sync.pt"))

    accelerator.register_pre_sync_hook(hook)


if __name__ == "__main__":
    main()
