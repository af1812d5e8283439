"""Causal-LM pretraining in the shape of transformers' ``run_clm_no_trainer.py``, federated: one line changes.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/run_clm_no_trainer.py
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/run_clm_no_trainer.py --train_file my.txt \\
        --validation_file my_val.txt --checkpointing_steps 20 --with_tracking
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/run_clm_no_trainer.py --train_file my.txt \\
        --validation_file my_val.txt --with_tracking --resume_from_checkpoint outputs/clm/step_20
    FL_ACCEL_SYNC_EVERY=16 accelerate launch --config_file accelerate_configs/cpu_4proc.yaml \\
        examples/run_clm_no_trainer.py --output_dir outputs/clm_h16

A resume takes the settings the checkpoint was written with (the ``FL_ACCEL_*`` variables
too: ``load_state`` refuses another ``sync_every``, layout or sync settings).

The canonical script's steps, as Accelerate users know them: text files -> ``load_dataset("text")``
-> tokenize -> ``group_texts`` into blocks under ``main_process_first()``; AdamW; the scheduler sized
the Accelerate way (warmup and length x ``num_processes``: a prepared scheduler steps once per
process per optimizer step); ``accumulate`` / ``backward`` / ``clip_grad_norm_``; ``save_state`` every
``--checkpointing_steps`` into ``step_N``; ``--resume_from_checkpoint`` with ``load_state`` and
``skip_first_batches``; an evaluation per epoch with ``gather_for_metrics``; the final
``save_pretrained`` before ``end_training()``; ``all_results.json``. The line marked "the swap"
builds ``FLAccelerator`` instead of ``Accelerator``; its ``FLConfig`` comes from ``FL_ACCEL_*``
variables (default: FL+FSDP, 2 groups, H=8).

Offline defaults: without ``--train_file`` the embedded Shakespeare corpus (``recipes.data``);
without ``--tokenizer_name`` a byte-level BPE trained on the training text (about a second);
without ``--config_name`` a 4-layer Llama. Two of the canonical script's faults are not copied:
its perplexity is the mean of per-batch losses (here token-weighted), and its "latest
checkpoint" branch is dead code (here a folder is named). Checkpoints written mid-round resume
exactly (fl_accel keeps every group's state).
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, default_data_collator, \
    get_scheduler

from fl_accel import FLAccelerator


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train_file", default=None, help="a text file (default: the embedded Shakespeare corpus)")
    p.add_argument("--validation_file", default=None)
    p.add_argument("--config_name", default=None, help="a config.json folder (default: a 4-layer Llama)")
    p.add_argument("--tokenizer_name", default=None, help="a tokenizer folder (default: a BPE trained on the text)")
    p.add_argument("--vocab_size", type=int, default=4096, help="the trained BPE's size")
    p.add_argument("--output_dir", default="outputs/clm")
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--per_device_train_batch_size", type=int, default=4)
    p.add_argument("--per_device_eval_batch_size", type=int, default=4)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--num_train_epochs", type=int, default=1)
    p.add_argument("--max_train_steps", type=int, default=40, help="overrides --num_train_epochs (as canonical); "
                                                                     "0: the epochs' steps")
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--lr_scheduler_type", default="cosine")
    p.add_argument("--num_warmup_steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--checkpointing_steps", type=int, default=None, help="save_state every N optimizer steps")
    p.add_argument("--resume_from_checkpoint", default=None, help="a step_N folder")
    p.add_argument("--with_tracking", action="store_true", help="W&B (offline unless WANDB_MODE says otherwise), "
                                                                "its run under <output_dir>/wandb")
    return p.parse_args(argv)


def text_files(args, accelerator) -> dict[str, str]:
    if args.train_file:
        return {"train": args.train_file, "validation": args.validation_file or args.train_file}
    from recipes.data import write_shakespeare  # the embedded corpus as two text files

    with accelerator.main_process_first():
        return write_shakespeare(os.path.join(args.output_dir, "corpus"))


def main(argv=None):
    args = parse_args(argv)
    if args.with_tracking:  # W&B never asks for a login: offline unless WANDB_MODE says otherwise
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
    accelerator = FLAccelerator(  # the swap: was Accelerator(...); FLConfig from FL_ACCEL_* variables
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with="wandb" if args.with_tracking else None, project_dir=args.output_dir)
    set_seed(args.seed)  # the same seed on every rank: every federation group starts from the same model
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    raw = load_dataset("text", data_files=text_files(args, accelerator), keep_linebreaks=True)
    with accelerator.main_process_first():
        if args.tokenizer_name:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
        else:
            from recipes.data import train_bpe_tokenizer

            tokenizer = train_bpe_tokenizer(raw["train"]["text"], args.vocab_size, os.path.join(args.output_dir,
                                                                                                "tokenizer"))
    config = AutoConfig.from_pretrained(args.config_name) if args.config_name else LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max(512, args.block_size), tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)

    def group_texts(examples):
        joined = {k: sum(examples[k], []) for k in examples}
        total = (len(joined["input_ids"]) // args.block_size) * args.block_size
        out = {k: [t[i:i + args.block_size] for i in range(0, total, args.block_size)] for k, t in joined.items()}
        out["labels"] = out["input_ids"].copy()
        return out

    with accelerator.main_process_first():
        tokenized = raw.map(lambda ex: tokenizer(ex["text"]), batched=True, remove_columns=["text"])
        blocks = tokenized.map(group_texts, batched=True)
    train_dataloader = DataLoader(blocks["train"], shuffle=True, collate_fn=default_data_collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(blocks["validation"], collate_fn=default_data_collator,
                                 batch_size=args.per_device_eval_batch_size)

    no_decay = ["bias", "norm.weight"]
    groups = [{"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
               "weight_decay": args.weight_decay},
              {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
               "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.95))
    updates_per_epoch = math.ceil(len(train_dataloader) / accelerator.num_processes / args.gradient_accumulation_steps)
    max_steps = args.max_train_steps or args.num_train_epochs * updates_per_epoch
    lr_scheduler = get_scheduler(args.lr_scheduler_type, optimizer,
                                 num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
                                 num_training_steps=max_steps * accelerator.num_processes)
    accelerator.set_max_steps(max_steps)  # fl_accel: the sync after the last step is the final one
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    if args.with_tracking:
        accelerator.init_trackers("clm_no_trainer", vars(args),
                                  init_kwargs={"wandb": {"dir": args.output_dir}})  # <output_dir>/wandb, not the cwd

    completed_steps, starting_epoch, resume_batches = 0, 0, 0
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        completed_steps = int(os.path.basename(os.path.normpath(args.resume_from_checkpoint)).replace("step_", ""))
        batches = completed_steps * args.gradient_accumulation_steps
        starting_epoch, resume_batches = divmod(batches, len(train_dataloader))
    epochs = math.ceil(max_steps / math.ceil(len(train_dataloader) / args.gradient_accumulation_steps))
    perplexity = eval_loss = None
    for epoch in range(starting_epoch, epochs):
        model.train()
        active = accelerator.skip_first_batches(train_dataloader, resume_batches) \
            if epoch == starting_epoch and resume_batches else train_dataloader
        for batch in active:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()  # every H-th optimizer step also syncs the federation groups
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
                if args.checkpointing_steps and completed_steps % args.checkpointing_steps == 0:
                    accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
            if completed_steps >= max_steps:
                break

        if completed_steps >= max_steps:
            accelerator.sync_if_pending(final=True)  # fl_accel: the last evaluation scores the federated model
        model.eval()
        nll, tokens = torch.zeros((), device=accelerator.device), torch.zeros((), device=accelerator.device)
        for batch in eval_dataloader:
            with torch.no_grad():
                loss = model(**batch).loss
            n = (batch["labels"][:, 1:] != -100).sum()  # tokens the loss averaged over
            nll += loss.detach().float() * n
            tokens += n
        nll, tokens = accelerator.reduce(nll, "sum"), accelerator.reduce(tokens, "sum")
        eval_loss = (nll / tokens).item()  # token-weighted over every rank's rows
        perplexity = math.exp(eval_loss)
        accelerator.print(f"epoch {epoch}: step {completed_steps}, eval loss {eval_loss:.4f}, perplexity "
                          f"{perplexity:.2f}, syncs {accelerator.federation.syncs_done}")
        if args.with_tracking:
            accelerator.log({"eval/perplexity": perplexity, "eval/loss": eval_loss}, step=completed_steps)

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(os.path.join(args.output_dir, "final"), is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)  # the federated model (the groups sync first)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
        with open(os.path.join(args.output_dir, "all_results.json"), "w") as fh:
            json.dump({"perplexity": perplexity, "eval_loss": eval_loss, "steps": completed_steps,
                       "syncs": accelerator.federation.syncs_done}, fh)
    accelerator.print(f"wrote the federated model to {os.path.join(args.output_dir, 'final')} and its figures to "
                      f"{os.path.join(args.output_dir, 'all_results.json')}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
