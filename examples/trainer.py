"""A transformers.Trainer script, federated with FLTrainer: the README's Trainer swap, runnable.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/trainer.py
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/trainer.py --sync_every 4 --save_steps 8
    accelerate launch --config_file accelerate_configs/cpu_4proc.yaml examples/trainer.py

The script is an ordinary Trainer script: a tiny Llama (random init, seeded alike on every rank)
learns synthetic token sequences (each row counts up from a random token with a random stride,
modulo the vocabulary), with ``TrainingArguments`` that ask for FSDP2 (``fsdp=True``,
``fsdp_config={"version": 2}``), gradient accumulation, a cosine schedule with warmup,
checkpoints every ``--save_steps`` and an evaluation at the end. The one line that differs
from plain Trainer builds ``FLTrainer`` with an ``FLConfig`` (for TRL's trainers,
``fl_accel.trainer.federated(SFTTrainer)`` the same way: docs/trainer.md): each of ``--num_groups`` federation groups shards the model over its own ranks,
and every ``--sync_every`` (H) optimizer steps the groups average their parameters.

``--resume`` continues from the latest checkpoint in ``--output_dir`` (exactly, also from one
taken mid-round). The main process prints Trainer's logs (with ``fl/syncs``), then one
``[trainer] result {...}`` JSON line: the layout, steps, syncs, the evaluation loss of the
federated model, and where ``save_model`` wrote it (loadable with ``from_pretrained``).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments, set_seed

from fl_accel import FLConfig, FLTrainer

MODEL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # FLConfig fields: None = not given here (the FL_ACCEL_* variable, else FLConfig's default)
    p.add_argument("--algorithm", default=None, help="fsdp | hsdp | fl_fsdp (default) | fl_hsdp")
    p.add_argument("--num_groups", type=int, default=None, help="F federation groups (default 2)")
    p.add_argument("--sync_every", type=int, default=None, help="H optimizer steps between syncs (default 8)")
    p.add_argument("--outer_optimizer", default=None, help="avg (FedAvg, default) | nesterov (DiLoCo)")
    # Trainer's settings
    p.add_argument("--output_dir", default="outputs/trainer_example")
    p.add_argument("--max_steps", type=int, default=24)
    p.add_argument("--save_steps", type=int, default=8, help="a multiple of H also writes the model files")
    p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --output_dir")
    p.add_argument("--bf16", action="store_true", help="bf16 parameters and compute, fp32 gradient reduction")
    p.add_argument("--report_to", default="none", help="none | tensorboard | wandb | all")
    return p.parse_args(argv)


def synthetic_rows(n: int, seq_len: int, vocab: int, seed: int) -> list[dict]:
    """``n`` rows ``{"input_ids", "labels"}`` of ``(start + stride * t) mod vocab``, stride in 1..3."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=gen)
    stride = torch.randint(1, 4, (n, 1), generator=gen)
    rows = ((start + stride * torch.arange(seq_len)) % vocab).tolist()
    return [{"input_ids": r, "labels": r} for r in rows]


def main(argv=None) -> None:
    args = parse_args(argv)
    config = FLConfig.from_env(**{k: getattr(args, k) for k in ("algorithm", "num_groups", "sync_every",
                                                                "outer_optimizer")})
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=2,
        weight_decay=0.1, adam_beta2=0.95, logging_steps=4, save_steps=args.save_steps, eval_strategy="no",
        fsdp=True, fsdp_config={"version": 2}, use_cpu=not torch.cuda.is_available(), report_to=args.report_to,
        bf16=args.bf16, seed=42, disable_tqdm=True)
    set_seed(training_args.seed)  # the same seed on every rank: all groups must start from identical parameters
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    train = synthetic_rows(4 * 4 * 2 * args.max_steps, 64, MODEL["vocab_size"], seed=0)
    evaluation = synthetic_rows(64, 64, MODEL["vocab_size"], seed=1)

    # trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=evaluation)
    trainer = FLTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=evaluation,
                        fl_config=config)  # the one-line swap

    trainer.train(resume_from_checkpoint=True if args.resume else None)
    metrics = trainer.evaluate()  # the federated model: train() ends with the final sync
    final = os.path.join(args.output_dir, "final")
    trainer.save_model(final)  # every rank calls it (FSDP2 gathers the shards); rank 0 writes
    acc = trainer.accelerator
    if trainer.is_world_process_zero():
        result = {"algorithm": acc.fl_config.algorithm, "num_groups": acc.num_groups, "world_size": acc.num_processes,
                  "sync_every": acc.fl_config.sync_every, "steps": trainer.state.global_step,
                  "num_syncs": acc.federation.syncs_done, "eval_loss": metrics["eval_loss"], "final_model": final,
                  "trainer": type(trainer).__name__}
        print("[trainer] result " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
