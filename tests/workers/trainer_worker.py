"""A causal-LM script written the way ``transformers.Trainer`` users write them, run under plain
``Trainer``, ``FLTrainer`` or TRL's ``SFTTrainer`` made federated (``--trainer plain|fl|sft``):
the only difference between the runs is the line that builds the trainer (the FL settings come
from ``FL_ACCEL_*`` variables, ``FLConfig.from_env()``).

The script: text files -> ``load_dataset("text")`` -> tokenize -> ``group_texts`` into blocks
(under ``main_process_first``), a Llama from a local config, ``TrainingArguments`` with FSDP2
(``fsdp="full_shard"``, ``fsdp_config={"version": 2}``), gradient accumulation, a linear
schedule with warmup, ``save_steps``, ``resume_from_checkpoint``, ``logging_steps=1``; after
``train()``: ``trainer.evaluate()`` and ``trainer.save_model(<out>/final)``.

Test-only additions: ``results.json`` (main process) holds Trainer's log history (the LR and
loss of every step), the evaluation's metrics and the steps, ``eval_blocks.pt`` the
evaluation's token blocks; under ``fl``/``sft`` a pre-sync
hook keeps each group's full parameters before the last sync in
``group{f}-before-last-sync.pt`` (rank 0 of each group), so the test can check that the export
is the groups' mean; ``--stop_after N`` exits (as a crash would) right after step N's checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from datasets import load_dataset
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback,
                          TrainingArguments, default_data_collator, set_seed)


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--trainer", choices=["plain", "fl", "sft"], required=True)
    p.add_argument("--train_file", required=True)
    p.add_argument("--validation_file", required=True)
    p.add_argument("--config_name", required=True)
    p.add_argument("--tokenizer_name", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--block_size", type=int, default=32)
    p.add_argument("--max_steps", type=int, default=10)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--save_steps", type=int, default=0)
    p.add_argument("--eval_steps", type=int, default=0)
    p.add_argument("--stop_after", type=int, default=None)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--report_to", default="none")
    return p.parse_args(argv)


class StopAfter(TrainerCallback):
    """Exit every rank right after the checkpoint of step ``n`` is written (a crash there)."""

    def __init__(self, n: int):
        self.n = n

    def on_save(self, args, state, control, **kwargs):
        if state.global_step >= self.n:
            torch.distributed.barrier()
            sys.exit(0)


class KeepGroups(TrainerCallback):
    """Once training starts, a pre-sync hook keeps each group's full parameters (rank 0 of the group)."""

    def __init__(self, trainer, out):
        self.trainer, self.out = trainer, out

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from torch.distributed.tensor import DTensor

        acc = self.trainer.accelerator
        model = self.trainer.model_wrapped

        def hook(synchronizer, full):
            if not full:
                return
            params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                      for n, p in model.named_parameters()}
            if acc.process_index == acc.layout.group_ranks(acc.group_index)[0]:
                torch.save(params, os.path.join(self.out, f"group{acc.group_index}-before-last-sync.pt"))

        acc.register_pre_sync_hook(hook)


def main(argv=None):
    args = parse_args(argv)
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=2,
        per_device_eval_batch_size=2, gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=3, weight_decay=0.1, logging_steps=1,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        eval_strategy="steps" if args.eval_steps else "no", eval_steps=args.eval_steps or None,
        fsdp="full_shard", fsdp_config={"version": 2}, use_cpu=True, report_to=args.report_to, seed=42,
        dataloader_drop_last=True, disable_tqdm=True)

    raw = load_dataset("text", data_files={"train": args.train_file, "validation": args.validation_file},
                       keep_linebreaks=True)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    set_seed(training_args.seed)  # as run_clm.py does: every rank builds the same initial model
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.config_name))

    def group_texts(examples):
        joined = {k: sum(examples[k], []) for k in examples}
        total = (len(joined["input_ids"]) // args.block_size) * args.block_size
        out = {k: [t[i:i + args.block_size] for i in range(0, total, args.block_size)] for k, t in joined.items()}
        out["labels"] = out["input_ids"].copy()
        return out

    with training_args.main_process_first():
        blocks = raw.map(lambda ex: tokenizer(ex["text"]), batched=True, remove_columns=["text"]) \
            .map(group_texts, batched=True)
    common = dict(model=model, train_dataset=blocks["train"], eval_dataset=blocks["validation"],
                  processing_class=tokenizer)
    if args.trainer == "plain":
        trainer = Trainer(args=training_args, data_collator=default_data_collator, **common)
    elif args.trainer == "fl":
        from fl_accel import FLTrainer

        trainer = FLTrainer(args=training_args, data_collator=default_data_collator, **common)  # the one-line swap
    else:
        from trl import SFTConfig, SFTTrainer

        from fl_accel.trainer import federated

        sft_args = SFTConfig(**{**training_args.to_dict(), "fsdp": "full_shard", "fsdp_config": {"version": 2}},
                             dataset_text_field=None, packing=False, max_length=args.block_size)
        trainer = federated(SFTTrainer)(args=sft_args, **common)
    if args.trainer != "plain":
        trainer.add_callback(KeepGroups(trainer, args.output_dir))
    if args.stop_after is not None:
        trainer.add_callback(StopAfter(args.stop_after))

    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(args.output_dir, "final"))
    if trainer.is_world_process_zero():
        torch.save(torch.tensor(blocks["validation"]["input_ids"]), os.path.join(args.output_dir, "eval_blocks.pt"))
        with open(os.path.join(args.output_dir, "results.json"), "w") as fh:
            json.dump({"log_history": trainer.state.log_history, "eval": metrics, "steps": trainer.state.global_step,
                       "world_size": training_args.world_size}, fh)


if __name__ == "__main__":
    main()
