"""Pretrain a Llama from scratch with FSDP, HSDP, FL+FSDP or FL+HSDP (fl_accel).

Mittone & Aldinucci, "Accelerating Sharded Data Parallelism at Scale with Federated
Learning", Euro-Par 2026, arXiv 2609.20359. Defaults follow the paper (Sec. 4):
AdamW lr 3e-4, betas (0.9, 0.95), weight decay 0.1, 10% linear warmup then cosine,
H = 8, a global disjoint data split, perplexity at the end.

Run it (from the repository root; the embedded Shakespeare corpus needs no network):

    # 4 CPU processes, 2 federation groups x 2 ranks
    accelerate launch --config_file accelerate_configs/cpu_4proc.yaml recipes/pretrain.py \
        --config recipes/configs/cpu_fl_fsdp.yaml
    # the FSDP baseline: the same with one flag changed
    accelerate launch --config_file accelerate_configs/cpu_4proc.yaml recipes/pretrain.py \
        --config recipes/configs/cpu_fl_fsdp.yaml --algorithm fsdp
    # torchrun works too
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 recipes/pretrain.py --algorithm fl_fsdp --num_groups 2

Outputs in --output_dir: metrics.jsonl (one JSON record per log/eval step),
all_results.json (final perplexity, eval loss, tokens/s, tokens, wall time),
curves.png, checkpoints/step_N, and the offline W&B run under wandb/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

# Runnable as a script from anywhere: make the repository root importable.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import yaml  # noqa: E402

from fl_accel.config import FLConfig  # noqa: E402

PRESETS = {
    # ~3M parameters: trains on 2 CPU cores in minutes. vocab_size follows the tokenizer.
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
                 tie_word_embeddings=False),
    # The exact Llama-3.1-8B shape (Meta's config.json for meta-llama/Llama-3.1-8B).
    "llama3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000,
                        eos_token_id=128001,
                        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                             low_freq_factor=1.0, high_freq_factor=4.0,
                                             original_max_position_embeddings=8192)),
}

FL_FIELDS = ("algorithm", "num_groups", "hsdp_shard_size", "sync_every", "outer_optimizer", "outer_lr",
             "outer_momentum", "average_optimizer_state", "data_sharding", "on_nonfinite", "sync_bucket_mb")


class RecipeError(ValueError):
    """A bad argument or input; reported on every rank with a non-zero exit."""


# =========================================================================== arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=None, help="recipe YAML: any option below; FL options under 'fl:'")
    g = p.add_argument_group("model")
    g.add_argument("--model", default="tiny", help=f"preset {sorted(PRESETS)}, a config.json, or a model dir/name")
    g.add_argument("--seq_len", type=int, default=256, help="tokens per block")
    g = p.add_argument_group("data")
    g.add_argument("--dataset_name", default="shakespeare",
                   help="'shakespeare' (embedded, offline) or a datasets hub name")
    g.add_argument("--dataset_config_name", default=None, help="config of a hub dataset, e.g. 'tiny'")
    g.add_argument("--train_file", default=None, help="local .txt/.json/.jsonl/.csv/.parquet file")
    g.add_argument("--validation_file", default=None, help="local validation text (else a split of the train file)")
    g.add_argument("--text_column", default="text", help="column holding the text")
    g.add_argument("--validation_split_percentage", type=float, default=5.0,
                   help="held-out share when the dataset has no validation split")
    g.add_argument("--tokenizer", default="bpe", help="'bpe' (train one on the train split) or a name/path")
    g.add_argument("--vocab_size", type=int, default=8192, help="vocabulary of the trained BPE")
    g.add_argument("--cache_dir", default=None, help="corpus/tokenizer cache; unset: ~/.cache/fl_accel")
    g.add_argument("--preprocessing_num_workers", type=int, default=None, help="datasets.map processes")
    g = p.add_argument_group("training")
    g.add_argument("--micro_batch_size", type=int, default=4, help="blocks per rank per forward")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--max_steps", type=int, default=None, help="optimizer steps; unset: --num_epochs epochs")
    g.add_argument("--num_epochs", type=int, default=1, help="passes over the training blocks")
    g.add_argument("--learning_rate", type=float, default=3e-4, help="AdamW peak learning rate (paper)")
    g.add_argument("--adam_beta1", type=float, default=0.9, help="AdamW beta1")
    g.add_argument("--adam_beta2", type=float, default=0.95, help="AdamW beta2")
    g.add_argument("--weight_decay", type=float, default=0.1, help="AdamW weight decay")
    g.add_argument("--warmup_ratio", type=float, default=0.1, help="share of steps in linear warmup")
    g.add_argument("--lr_scheduler_type", default="cosine", help="transformers.get_scheduler name")
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--mixed_precision", default="auto", choices=["auto", "no", "bf16", "fp16"],
                   help="auto: bf16 on GPUs that support it, else fp32")
    g.add_argument("--seed", type=int, default=42, help="model init and data order")
    g = p.add_argument_group("federation (FLConfig; also FL_ACCEL_* env vars or the YAML 'fl:' section)")
    g.add_argument("--algorithm", default=None, choices=["fsdp", "hsdp", "fl_fsdp", "fl_hsdp"],
                   help="FLConfig.algorithm; unset: YAML/env, else fl_fsdp")
    g.add_argument("--num_groups", type=int, default=None, help="F")
    g.add_argument("--hsdp_shard_size", type=int, default=None, help="S")
    g.add_argument("--sync_every", type=int, default=None, help="H, optimizer steps between syncs")
    g.add_argument("--outer_optimizer", default=None, choices=["avg", "nesterov"], help="avg (FedAvg) or nesterov (DiLoCo)")
    g.add_argument("--outer_lr", type=float, default=None, help="nesterov outer learning rate (0.7)")
    g.add_argument("--outer_momentum", type=float, default=None, help="nesterov outer momentum (0.9)")
    g.add_argument("--average_optimizer_state", action="store_true", default=None,
                   help="also average AdamW moments at each sync")
    g.add_argument("--data_sharding", default=None, choices=["global", "group"],
                   help="global: disjoint slice per rank (paper); group: each group reads all data")
    g.add_argument("--on_nonfinite", default=None, choices=["abort", "reset"], help="NaN/Inf in a group at a sync")
    g.add_argument("--sync_bucket_mb", type=int, default=None, help="fp32 MiB per sync collective (256)")
    g = p.add_argument_group("evaluation, logging, checkpoints")
    g.add_argument("--eval_every", type=int, default=0,
                   help="optimizer steps between evaluations (rounded up to a multiple of H); 0: end only")
    g.add_argument("--max_eval_blocks", type=int, default=None, help="cap on validation blocks")
    g.add_argument("--log_every", type=int, default=5, help="optimizer steps between log records")
    g.add_argument("--output_dir", default=None, help="unset: outputs/<experiment>/<run_name>")
    g.add_argument("--checkpoint_every", type=int, default=0, help="optimizer steps; 0 disables")
    g.add_argument("--resume_from_checkpoint", default=None, help="'latest' or a step_N directory")
    g.add_argument("--report_to", default="wandb", choices=["wandb", "none"],
                   help="wandb (offline unless WANDB_MODE says otherwise) or none")
    g.add_argument("--wandb_project", default="fl_accel", help="W&B project")
    g.add_argument("--experiment", default="shakespeare-tiny",
                   help="W&B group: runs of one comparison share it")
    g.add_argument("--run_name", default=None, help="unset: algorithm and F/G/S/H sizes")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """CLI > YAML (--config) > defaults for recipe options; FL options via FLConfig.resolve.

    Raises:
        RecipeError: unreadable YAML, unknown keys, or values of the wrong type.
    """
    parser = build_parser()
    known, _ = parser.parse_known_args(argv)
    fl_yaml: dict = {}
    if known.config:
        try:
            with open(known.config, encoding="utf-8") as fh:
                values = yaml.safe_load(fh) or {}
        except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
            raise RecipeError(f"cannot read --config {known.config}: {exc}") from exc
        if not isinstance(values, dict):
            raise RecipeError(f"--config {known.config} must be a YAML mapping")
        fl_yaml = values.pop("fl", {}) or {}
        if not isinstance(fl_yaml, dict):
            raise RecipeError(f"'fl:' in {known.config} must be a mapping")
        actions = {a.dest: a for a in parser._actions}
        for key, value in values.items():
            if key not in actions or key in FL_FIELDS or key in ("config", "help"):
                where = "under 'fl:'" if key in FL_FIELDS else ""
                raise RecipeError(f"unknown key {key!r} in {known.config} {where}".strip())
            want = actions[key].type
            if value is not None and want in (int, float) and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or (want is int and not isinstance(value, int))
            ):
                raise RecipeError(f"{key} in {known.config} must be {want.__name__}, got {value!r}")
            if value is not None and actions[key].choices and value not in actions[key].choices:
                raise RecipeError(f"{key} in {known.config} must be one of {actions[key].choices}, got {value!r}")
        parser.set_defaults(**values)
    args = parser.parse_args(argv)
    try:
        args.fl = FLConfig.resolve(yaml_values=fl_yaml, overrides={k: getattr(args, k) for k in FL_FIELDS},
                                   source=f"'fl:' of {known.config}" if known.config else "the command line")
    except ValueError as exc:
        raise RecipeError(str(exc)) from exc
    for name in ("seq_len", "micro_batch_size", "gradient_accumulation_steps", "num_epochs", "vocab_size",
                 "log_every"):
        if getattr(args, name) < 1:
            raise RecipeError(f"--{name} must be >= 1, got {getattr(args, name)}")
    for name in ("max_steps", "max_eval_blocks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise RecipeError(f"--{name} must be >= 1, got {getattr(args, name)}")
    for name in ("eval_every", "checkpoint_every"):
        if getattr(args, name) < 0:
            raise RecipeError(f"--{name} must be >= 0, got {getattr(args, name)}")
    if not args.learning_rate > 0:
        raise RecipeError(f"--learning_rate must be > 0, got {args.learning_rate}")
    if not 0 <= args.warmup_ratio < 1:
        raise RecipeError(f"--warmup_ratio must be in [0, 1), got {args.warmup_ratio}")
    return args


def model_config(args, vocab_size: int):
    """LlamaConfig of the preset or path. Raises RecipeError if seq_len exceeds max positions."""
    from transformers import AutoConfig, LlamaConfig

    if args.model in PRESETS:
        values = dict(PRESETS[args.model])
        values.setdefault("vocab_size", vocab_size)
        config = LlamaConfig(**values)
    else:
        try:
            config = AutoConfig.from_pretrained(args.model)
        except (OSError, ValueError) as exc:
            raise RecipeError(f"--model {args.model!r} is neither a preset {sorted(PRESETS)} nor a loadable "
                              f"config: {exc}") from exc
    if args.seq_len > config.max_position_embeddings:
        raise RecipeError(f"--seq_len {args.seq_len} exceeds the model's max_position_embeddings "
                          f"{config.max_position_embeddings}")
    if vocab_size > config.vocab_size:
        raise RecipeError(f"tokenizer has {vocab_size} tokens but the model's vocab_size is {config.vocab_size}")
    return config


# =========================================================================== helpers
def default_run_name(fl: FLConfig, num_groups: int, group_size: int, shards: int) -> str:
    """``<algorithm>-F<F>-G<G>-S<S>-H<H>`` (H=0 for the baselines): sortable in W&B."""
    return f"{fl.algorithm}-F{num_groups}-G{group_size}-S{shards}-H{fl.sync_every if fl.is_federated else 0}"


def main_first(accelerator, fn):
    """Run ``fn`` on the main process first (it fills caches), then on the others.

    Unlike ``accelerator.main_process_first()``, a failure on the main process is
    broadcast, so every rank raises the same error instead of waiting in a barrier.
    """
    import torch.distributed as dist

    result, error = None, None
    if accelerator.is_main_process:
        try:
            result = fn()
        except Exception as exc:  # re-raised below on every rank
            error = f"{type(exc).__name__}: {exc}"
    box = [error]
    if accelerator.num_processes > 1:
        dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise RecipeError(box[0])
    if not accelerator.is_main_process:
        result = fn()
    return result


def eval_batches(blocks, rank: int, world: int, micro_batch: int):
    """Split validation blocks over the world with no duplicates.

    Rank ``k`` takes rows ``k, k+world, ...``. Every rank gets the same number of
    batches (FSDP needs every rank of a group in each forward); missing rows are
    filled with row 0 and a weight of 0. Yields (input_ids [b, L], weight [b]).
    """
    import torch

    mine = list(range(rank, len(blocks), world))
    per_rank = math.ceil(len(blocks) / world)
    n_batches = math.ceil(per_rank / micro_batch)
    for b in range(n_batches):
        idx = mine[b * micro_batch:(b + 1) * micro_batch]
        weight = [1.0] * len(idx) + [0.0] * (micro_batch - len(idx))
        idx = idx + [0] * (micro_batch - len(idx))
        yield torch.tensor([blocks[i] for i in idx]), torch.tensor(weight, dtype=torch.float64)


def evaluate(model, accelerator, blocks, micro_batch: int) -> tuple[float, float, int]:
    """Token-weighted perplexity over the whole validation set.

    ppl = exp(sum of token NLL / number of predicted tokens), summed over all ranks
    (not the mean of per-batch means). Returns (perplexity, mean NLL in nats, tokens).
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    model.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for ids, weight in eval_batches(blocks, accelerator.process_index, accelerator.num_processes, micro_batch):
            ids = ids.to(accelerator.device)
            logits = model(input_ids=ids).logits.float()
            nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1),
                                  reduction="none").view(ids.size(0), -1).sum(1).double().cpu()
            totals[0] += (nll * weight).sum()
            totals[1] += weight.sum() * (ids.size(1) - 1)
    if accelerator.num_processes > 1:
        dist.all_reduce(totals)
    model.train()
    mean_nll = (totals[0] / totals[1]).item()
    return math.exp(mean_nll), mean_nll, int(totals[1].item())


def write_curves(records: list[dict], path: str, title: str) -> None:
    """Train loss and eval perplexity against tokens, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if "train/loss" in r]
    evals = [r for r in records if "eval/perplexity" in r]
    from matplotlib.ticker import EngFormatter

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax in (a, b):
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    a.plot([r["tokens"] for r in train], [r["train/loss"] for r in train])
    a.set_xlabel("tokens"), a.set_ylabel("train loss"), a.grid(alpha=0.3)
    b.plot([r["tokens"] for r in evals], [r["eval/perplexity"] for r in evals], marker="o")
    b.set_xlabel("tokens"), b.set_ylabel("eval perplexity"), b.set_yscale("log"), b.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# =========================================================================== main
def preflight(args) -> None:
    """Checks that need no process group, run on every rank before any collective.

    Local data files exist, are UTF-8 and hold text; a checkpoint to resume from is
    complete and was written by the same algorithm, world size and mesh. Sets
    ``args.resume_path`` (None when there is nothing to resume).

    Raises:
        RecipeError: naming the file or the mismatching setting.
    """
    from recipes import data as data_lib

    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        layout = args.fl.sizes(world)
    except ValueError as exc:
        raise RecipeError(str(exc)) from exc
    for flag in ("train_file", "validation_file"):
        path = getattr(args, flag)
        if path:
            if not os.path.isfile(path):
                raise RecipeError(f"--{flag} {path} does not exist")
            data_lib.check_text_file(path, flag)
    args.resume_path = None
    if args.resume_from_checkpoint:
        from fl_accel.checkpoint import CheckpointError, check_compatible, find_latest, layout_meta, read_meta
        from fl_accel.mesh import FLLayout

        if args.resume_from_checkpoint == "latest":
            args.resume_path = find_latest(os.path.join(args.output_dir, "checkpoints"))
        else:
            args.resume_path = args.resume_from_checkpoint
        if args.resume_path:
            try:
                check_compatible(read_meta(args.resume_path), layout_meta(args.fl, FLLayout(*layout)))
            except CheckpointError as exc:
                raise RecipeError(str(exc)) from exc


class FaultInjector:
    """Test hook: ``FL_FAULT_INJECT=<kind>:<rank>:<step>`` acts on one rank after that optimizer step.

    kind ``kill`` sends SIGKILL to the process (a crashed rank); ``stop`` sends SIGSTOP
    (a hung rank). Only in the first attempt of a torchrun job
    (``TORCHELASTIC_RESTART_COUNT`` 0), so ``--max-restarts`` runs recover. Unset: inert.
    """

    def __init__(self, rank: int):
        spec = os.environ.get("FL_FAULT_INJECT", "")
        self.kind, self.step = None, None
        if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            kind, fault_rank, step = spec.split(":")
            if kind not in ("kill", "stop"):
                raise RecipeError(f"FL_FAULT_INJECT kind must be kill or stop, got {kind!r}")
            if int(fault_rank) == rank:
                self.kind, self.step = kind, int(step)

    def after_step(self, step: int) -> None:
        if self.kind and step == self.step:
            import signal

            print(f"[fl_accel] FL_FAULT_INJECT: {self.kind} rank {os.environ.get('RANK')} at step {step}",
                  file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL if self.kind == "kill" else signal.SIGSTOP)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.output_dir is None:
        F0, R0, S0 = args.fl.sizes(int(os.environ.get("WORLD_SIZE", "1")))
        args.output_dir = os.path.join("outputs", args.experiment,
                                       args.run_name or default_run_name(args.fl, F0, R0 * S0, S0))
    preflight(args)
    os.environ.setdefault("WANDB_MODE", "offline")  # never prompt for a login
    os.environ.setdefault("WANDB_SILENT", "true")

    import torch
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm
    from transformers import LlamaForCausalLM, default_data_collator, get_scheduler

    from fl_accel import FLAccelerator
    from recipes import data as data_lib

    if args.model in PRESETS and args.seq_len > PRESETS[args.model]["max_position_embeddings"]:
        raise RecipeError(f"--seq_len {args.seq_len} exceeds the model's max_position_embeddings "
                          f"{PRESETS[args.model]['max_position_embeddings']}")
    mixed = args.mixed_precision
    if mixed == "auto":
        mixed = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    os.makedirs(args.output_dir, exist_ok=True)
    accelerator = FLAccelerator(
        args.fl,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=mixed,
        log_with=None if args.report_to == "none" else args.report_to,
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=args.output_dir),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
    )
    fl = args.fl
    F_, R_, S_ = accelerator.layout.shape
    G_ = accelerator.layout.group_size
    world = accelerator.num_processes
    set_seed(args.seed)

    # ---------------------------------------------------------------- data
    cache_dir = args.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "fl_accel")

    def prepare_data():
        raw = data_lib.load_raw(args, cache_dir)
        tokenizer = data_lib.get_tokenizer(args, raw, cache_dir)
        packed = data_lib.tokenize_and_pack(raw, tokenizer, args.text_column, args.seq_len,
                                            args.preprocessing_num_workers)
        return tokenizer, packed

    tokenizer, packed = main_first(accelerator, prepare_data)
    config = model_config(args, len(tokenizer))
    train_set, val_set = packed["train"], packed["validation"]
    val_blocks = val_set["input_ids"][: args.max_eval_blocks] if args.max_eval_blocks else val_set["input_ids"]
    if len(val_blocks) < world * args.micro_batch_size:
        raise RecipeError(f"validation split has {len(val_blocks)} blocks of {args.seq_len} tokens; need at least "
                          f"{world * args.micro_batch_size} (one micro-batch of {args.micro_batch_size} per rank "
                          f"x {world} ranks). Lower --seq_len/--micro_batch_size or add validation text.")
    if len(train_set) < world * args.micro_batch_size * args.gradient_accumulation_steps:
        raise RecipeError(f"training split has {len(train_set)} blocks; one optimizer step needs "
                          f"{world * args.micro_batch_size * args.gradient_accumulation_steps}")

    train_loader = DataLoader(train_set.with_format("torch"), batch_size=args.micro_batch_size, shuffle=True,
                              drop_last=True, collate_fn=default_data_collator)

    # ---------------------------------------------------------------- model, optimizer
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate,
                                  betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.weight_decay)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)

    batches_per_epoch = len(train_loader)
    steps_per_epoch = batches_per_epoch // args.gradient_accumulation_steps
    if steps_per_epoch < 1:
        raise RecipeError("fewer micro-batches per rank than --gradient_accumulation_steps")
    max_steps = args.max_steps or args.num_epochs * steps_per_epoch
    num_epochs = math.ceil(max_steps / steps_per_epoch)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer,
                              num_warmup_steps=math.ceil(args.warmup_ratio * max_steps),
                              num_training_steps=max_steps)
    accelerator.register_for_checkpointing(scheduler)
    if fl.is_federated and fl.sync_every > max_steps:
        accelerator.print(f"WARNING: sync_every={fl.sync_every} exceeds the {max_steps} training steps: groups "
                          f"only synchronize once, at the end")
    eval_every = args.eval_every
    if eval_every and fl.is_federated and eval_every % fl.sync_every:
        eval_every = math.ceil(eval_every / fl.sync_every) * fl.sync_every
        accelerator.print(f"eval_every rounded up to {eval_every}, a multiple of sync_every, so the "
                          f"synchronized model is evaluated")

    tokens_per_rank_step = args.micro_batch_size * args.seq_len * args.gradient_accumulation_steps
    tokens_per_step = tokens_per_rank_step * world
    run_name = args.run_name or default_run_name(fl, F_, G_, S_)
    accelerator.print(
        f"[fl_accel] {fl.algorithm}: world {world} = {F_} group(s) x {G_} ranks "
        f"(R={R_} replicas x S={S_} shards), sync_every H={fl.sync_every if fl.is_federated else '-'}, "
        f"outer={fl.outer_optimizer if fl.is_federated else '-'}\n"
        f"[fl_accel] model {args.model}: {n_params / 1e6:.2f}M params, vocab {config.vocab_size}, "
        f"seq_len {args.seq_len}, precision {mixed}\n"
        f"[fl_accel] micro-batch {args.micro_batch_size} blocks/rank x accumulation {args.gradient_accumulation_steps}"
        f" = {tokens_per_rank_step} tokens/rank/step; {tokens_per_rank_step * G_} tokens/step per group; "
        f"{tokens_per_step} tokens/step in total (global batch {tokens_per_step // args.seq_len} blocks)\n"
        f"[fl_accel] train {len(train_set)} blocks ({steps_per_epoch} steps/epoch), {max_steps} steps, "
        f"validation {len(val_blocks)} blocks"
    )

    # ---------------------------------------------------------------- trackers
    run_config = {k: v for k, v in vars(args).items() if k != "fl"}
    run_config.update({f"fl/{k}": v for k, v in fl.to_dict().items()})
    run_config.update(world_size=world, num_groups=F_, group_size=G_, replicas=R_, shards=S_,
                      n_params=n_params, tokens_per_step=tokens_per_step, max_steps=max_steps)
    if args.report_to != "none":
        init_kwargs = {"wandb": {"group": args.experiment, "name": run_name, "dir": args.output_dir,
                                 "tags": [fl.algorithm]}}
        accelerator.init_trackers(args.wandb_project, config=run_config, init_kwargs=init_kwargs)
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    records: list[dict] = []

    def log(record: dict) -> None:
        records.append(record)
        if args.report_to != "none":
            accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float))},
                            step=record["step"])
        if accelerator.is_main_process:
            with open(metrics_path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")

    # ---------------------------------------------------------------- resume
    completed_steps, resumed_train_seconds = 0, 0.0
    checkpoints_dir = os.path.join(args.output_dir, "checkpoints")
    if args.resume_from_checkpoint:
        path = args.resume_path
        if path is None:
            accelerator.print(f"[fl_accel] no complete checkpoint in {checkpoints_dir}; starting from step 0")
        else:
            meta = accelerator.load_state(path)
            completed_steps = int(meta["completed_steps"])
            resumed_train_seconds = float(meta.get("train_seconds", 0.0))
            accelerator.print(f"[fl_accel] resumed from {path} at step {completed_steps}")
    elif accelerator.is_main_process and os.path.exists(metrics_path):
        os.remove(metrics_path)
    if accelerator.is_main_process and completed_steps and os.path.exists(metrics_path):
        with open(metrics_path, encoding="utf-8") as fh:  # keep the history up to the checkpoint
            kept = [line for line in fh if json.loads(line).get("step", 0) <= completed_steps]
        with open(metrics_path, "w", encoding="utf-8") as fh:
            fh.writelines(kept)

    def save_checkpoint(step: int) -> None:
        accelerator.save_state(os.path.join(checkpoints_dir, f"step_{step}"),
                               extra_meta={"completed_steps": step, "train_seconds": train_seconds})

    # ---------------------------------------------------------------- train
    resumed_steps = completed_steps
    faults = FaultInjector(accelerator.process_index)
    progress = tqdm(total=max_steps, initial=completed_steps, disable=not accelerator.is_local_main_process,
                    desc=run_name, unit="step", dynamic_ncols=True)
    start_epoch = completed_steps // steps_per_epoch
    skip = (completed_steps % steps_per_epoch) * args.gradient_accumulation_steps
    train_seconds, eval_seconds = resumed_train_seconds, 0.0
    # Loss summed on the device: no host sync per micro-batch, one .item() per log step.
    window_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    window_n, window_t0 = 0, time.perf_counter()
    window_tokens = 0
    tokens_seen = completed_steps * tokens_per_step
    wall_t0 = time.perf_counter()
    t_step = time.perf_counter()
    model.train()
    done = completed_steps >= max_steps
    for epoch in range(start_epoch, num_epochs):
        if done:
            break
        train_loader.set_epoch(epoch)
        loader = accelerator.skip_first_batches(train_loader, skip) if (epoch == start_epoch and skip) else train_loader
        for batch in loader:
            with accelerator.accumulate(model):
                out = model(input_ids=batch["input_ids"], labels=batch["input_ids"])
                accelerator.backward(out.loss)
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            window_loss += out.loss.detach().double()
            window_n += 1
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            completed_steps += 1
            tokens_seen += tokens_per_step
            window_tokens += tokens_per_step
            now = time.perf_counter()
            train_seconds += now - t_step
            progress.update(1)
            faults.after_step(completed_steps)
            if completed_steps % args.log_every == 0 or completed_steps == max_steps:
                loss = window_loss / window_n
                if world > 1:
                    torch.distributed.all_reduce(loss)
                    loss /= world
                elapsed = now - window_t0
                comm = accelerator.comm_stats
                record = {"step": completed_steps, "tokens": tokens_seen, "time_s": train_seconds,
                          "train/loss": loss.item(),
                          "lr": scheduler.get_last_lr()[0], "tokens_per_s": window_tokens / elapsed,
                          "tokens_per_s_per_process": window_tokens / elapsed / world,
                          "step_time_s": elapsed / max(1, window_n // args.gradient_accumulation_steps),
                          "sync_time_share": comm["fl"].seconds / max(train_seconds - resumed_train_seconds, 1e-9),
                          **comm.flat()}
                log(record)
                progress.set_postfix(loss=f"{record['train/loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                window_loss.zero_()
                window_t0 = time.perf_counter()
                window_n, window_tokens = 0, 0
            extra = time.perf_counter()
            if eval_every and completed_steps % eval_every == 0 and completed_steps < max_steps:
                ppl, nll, _ = evaluate(model, accelerator, val_blocks, args.micro_batch_size)
                log({"step": completed_steps, "tokens": tokens_seen, "time_s": train_seconds,
                     "eval/perplexity": ppl, "eval/loss": nll})
            if args.checkpoint_every and completed_steps % args.checkpoint_every == 0 and completed_steps < max_steps:
                save_checkpoint(completed_steps)
            spent = time.perf_counter() - extra
            eval_seconds += spent
            window_t0 += spent  # keep throughput about training only
            t_step = time.perf_counter()
            if completed_steps >= max_steps:
                done = True
                break
    progress.close()

    # ---------------------------------------------------------------- final sync + eval
    if accelerator.sync_if_pending():
        accelerator.print("[fl_accel] final synchronization of the federation groups done")
    ppl, nll, n_tokens = evaluate(model, accelerator, val_blocks, args.micro_batch_size)
    log({"step": completed_steps, "tokens": tokens_seen, "time_s": train_seconds,
         "eval/perplexity": ppl, "eval/loss": nll})
    wall = time.perf_counter() - wall_t0
    comm = accelerator.comm_stats.as_dict()
    results = {
        "algorithm": fl.algorithm, "world_size": world, "num_groups": F_, "group_size": G_, "replicas": R_,
        "shards": S_, "sync_every": fl.sync_every if fl.is_federated else None,
        "eval_perplexity": ppl, "eval_loss": nll, "eval_tokens": n_tokens,
        "train_tokens": tokens_seen, "steps": completed_steps,
        "tokens_per_s": (tokens_per_step * (completed_steps - resumed_steps) / (train_seconds - resumed_train_seconds)
                         if completed_steps > resumed_steps else None),
        "train_seconds": train_seconds, "wall_seconds": wall, "eval_and_checkpoint_seconds": eval_seconds,
        "comm": comm, "n_params": n_params, "run_name": run_name, "vocab_size": config.vocab_size,
    }
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "all_results.json"), "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
        try:
            write_curves(records, os.path.join(args.output_dir, "curves.png"), f"{run_name} ({args.model})")
        except Exception as exc:  # a plot must never fail a training run
            print(f"[fl_accel] could not draw curves.png: {exc}", file=sys.stderr)
    if args.checkpoint_every:
        save_checkpoint(completed_steps)
    accelerator.end_training()
    if accelerator.is_main_process:
        wandb_dir = os.path.join(args.output_dir, "wandb")
        print(f"[fl_accel] done: eval perplexity {ppl:.2f} (loss {nll:.4f}) after {completed_steps} steps, "
              f"{results['tokens_per_s'] or 0:.0f} tokens/s\n"
              f"[fl_accel] results: {os.path.join(args.output_dir, 'all_results.json')}, metrics.jsonl, curves.png\n"
              + (f"[fl_accel] W&B offline run under {wandb_dir} (upload: wandb sync {wandb_dir}/offline-run-*)"
                 if args.report_to == "wandb" else ""))
    return results


def _say(line: str) -> None:
    """One write per line, so lines of concurrent ranks sharing a pipe do not interleave."""
    sys.stderr.write(line.replace("\n", " ") + "\n")
    sys.stderr.flush()


def _on_sigterm(signum, frame):
    # torchrun sends SIGTERM to the surviving ranks when one rank fails.
    _say(f"[fl_accel] rank {os.environ.get('RANK', '0')}: stopped by the launcher (another rank failed "
         f"or the job was cancelled)")
    sys.exit(143)


def cli(argv=None) -> int:
    import signal

    signal.signal(signal.SIGTERM, _on_sigterm)
    rank = os.environ.get("RANK", "0")
    try:
        main(argv)
    except (RecipeError, ValueError) as exc:
        _say(f"[fl_accel] error (rank {rank}): {exc}")
        return 2
    except KeyboardInterrupt:
        _say(f"[fl_accel] rank {rank}: interrupted; resume with --resume_from_checkpoint latest "
             f"(checkpoints every --checkpoint_every steps)")
        return 130
    except RuntimeError as exc:
        text = str(exc)
        if any(word in text for word in ("Gloo", "gloo", "NCCL", "Connection", "Timed out", "timed out")):
            _say(f"[fl_accel] error (rank {rank}): a collective failed; a peer rank died or hung "
                 f"(collective timeout FL_TIMEOUT_S={os.environ.get('FL_TIMEOUT_S', '300')} s): {text[:500]}")
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(cli())
