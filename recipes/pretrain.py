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
    # one plain process, no launcher (debugging)
    python recipes/pretrain.py --algorithm fsdp --max_steps 4

Every FLConfig field is a flag (``python recipes/pretrain.py --help``), a YAML key under
``fl:`` and an ``FL_ACCEL_<FIELD>`` variable. Outputs in --output_dir: metrics.jsonl (one
JSON record per log/eval step, the whole history), all_results.json (whole-run figures),
curves.png, checkpoints/step_N, final_model/ (save_pretrained), the offline W&B run
under wandb/.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time

if __package__ in (None, ""):  # run as a script (accelerate launch / torchrun / python recipes/pretrain.py)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from recipes.args import RecipeError, describe_sources, parse_args, run_identity
from recipes.modeling import check_seq_len


# =========================================================================== helpers
def default_run_name(layout, fl) -> str:
    """``<algorithm>-F<F>-G<G>-S<S>-H<H>`` (G lists unequal sizes: ``G2_4``), plus the
    streaming settings when they differ from the defaults: sortable in W&B."""
    name = f"{fl.algorithm}-F{layout.num_groups}-{layout.sizes_label()}-S{layout.shards}-" \
           f"H{fl.sync_every if fl.is_federated else 0}"
    if fl.is_federated:
        if fl.num_fragments > 1 or fl.sync_delay:
            name += f"-P{fl.num_fragments}-tau{fl.sync_delay}"
        if fl.fragment_update_alpha:
            name += f"-a{fl.fragment_update_alpha:g}"
        if fl.sync_dtype != "fp32":
            name += f"-{fl.sync_dtype}" + ("ef" if fl.error_feedback else "")
        if fl.outer_optimizer != "avg":
            name += f"-{fl.outer_optimizer}"
    return name


def plan_layout(fl, world: int):
    """The FLLayout for ``world`` ranks, with launch hints in the error."""
    from fl_accel.mesh import FLLayout

    try:
        return FLLayout.from_config(fl, world, ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    except ValueError as exc:
        hint = ""
        if world == 1 and fl.is_federated:
            hint = (" A single process holds one federation group: pass --num_groups 1 or --algorithm fsdp, or "
                    "launch several processes (torchrun --nproc_per_node N recipes/pretrain.py ..., or "
                    "accelerate launch --config_file accelerate_configs/cpu_4proc.yaml recipes/pretrain.py ...).")
        raise RecipeError(f"{exc}.{hint}") from exc


def main_first(accelerator, fn):
    """Run ``fn`` on the main process first (it fills caches), then on the others.

    Unlike ``accelerator.main_process_first()``, a failure on the main process is
    broadcast, so every rank raises the same error instead of waiting in a barrier.
    The flag travels as a tensor on ``accelerator.device`` (NCCL needs device tensors).
    """
    import torch
    import torch.distributed as dist

    result, error = None, None
    if accelerator.is_main_process:
        try:
            result = fn()
        except Exception as exc:  # re-raised below on every rank
            error = f"{type(exc).__name__}: {exc}"
    box = [error]
    if dist.is_initialized():
        # broadcast_object_list moves its byte tensors to the current CUDA device on NCCL
        if accelerator.device.type == "cuda":
            torch.cuda.set_device(accelerator.device)
        dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise RecipeError(box[0])
    if not accelerator.is_main_process:
        result = fn()
    return result


def eval_batches(blocks, index: int, count: int, micro_batch: int):
    """Split validation blocks over ``count`` ranks with no duplicates.

    Rank ``index`` takes rows ``index, index+count, ...``. Every rank gets the same
    number of batches (FSDP needs every rank of a group in each forward); missing rows
    are filled with row 0 and a weight of 0. Yields (input_ids [b, L], weight [b]).
    """
    import torch

    mine = list(range(index, len(blocks), count))
    per_rank = math.ceil(len(blocks) / count)
    for b in range(math.ceil(per_rank / micro_batch)):
        idx = mine[b * micro_batch:(b + 1) * micro_batch]
        weight = [1.0] * len(idx) + [0.0] * (micro_batch - len(idx))
        idx = idx + [0] * (micro_batch - len(idx))
        yield torch.tensor([blocks[i] for i in idx]), torch.tensor(weight, dtype=torch.float64)


def evaluate(model, accelerator, blocks, micro_batch: int, per_group: bool = False):
    """Token-weighted perplexity over the whole validation set.

    ppl = exp(sum of token NLL / number of predicted tokens), summed over ranks (not the
    mean of per-batch means). The totals live on ``accelerator.device`` and are
    all-reduced over the world (also at world size 1), so the same code runs on gloo
    and NCCL. ``per_group=False``: the world's ranks split the rows. ``per_group=True``:
    each federation group evaluates every row with its own model, split over its own
    ranks. Returns a list of (perplexity, mean NLL in nats, tokens): one entry, or one
    per group.
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    layout, rank = accelerator.layout, accelerator.process_index
    slots = layout.num_groups if per_group else 1
    slot = accelerator.group_index if per_group else 0
    index, count = ((layout.group_local_rank(rank), layout.group_size_of(accelerator.group_index)) if per_group
                    else (rank, accelerator.num_processes))
    was_training = model.training
    model.eval()
    totals = torch.zeros(slots, 2, dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        for ids, weight in eval_batches(blocks, index, count, micro_batch):
            ids, weight = ids.to(accelerator.device), weight.to(accelerator.device)
            logits = model(input_ids=ids).logits.float()
            nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1),
                                  reduction="none").view(ids.size(0), -1).sum(1).double()
            totals[slot, 0] += (nll * weight).sum()
            totals[slot, 1] += weight.sum() * (ids.size(1) - 1)
    dist.all_reduce(totals)  # a group's ranks evaluated disjoint rows: the sum is the group's total
    if was_training:
        model.train()
    out = []
    for s in range(slots):
        mean_nll = (totals[s, 0] / totals[s, 1]).item()
        out.append((math.exp(mean_nll), mean_nll, int(totals[s, 1].item())))
    return out


def read_metrics(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


# =========================================================================== checks before any collective
def preflight(args, fl, layout, identity: dict) -> str | None:
    """Checks that need no process group, on every rank before any collective.

    Local data files exist, are UTF-8 and hold text; the validation cap fits the world;
    a checkpoint to resume from is complete, written by the same layout and run, and not
    past ``--max_steps``; a fresh run does not silently mix with another run's files.
    Returns the checkpoint path to resume from (None: start at step 0).

    Raises:
        RecipeError: naming the file, flag or mismatching setting.
    """
    from recipes import data as data_lib

    from fl_accel.checkpoint import CheckpointError, check_compatible, find_latest, layout_meta, list_checkpoints, \
        read_meta

    world = layout.world_size
    for flag in ("train_file", "validation_file"):
        path = getattr(args, flag)
        if path and not args.streaming:
            if not os.path.isfile(path):
                raise RecipeError(f"--{flag} {path} does not exist")
            data_lib.check_text_file(path, flag)
    if args.max_eval_blocks is not None and args.max_eval_blocks < world * args.micro_batch_size:
        raise RecipeError(f"--max_eval_blocks {args.max_eval_blocks} is fewer than one micro-batch per rank "
                          f"({world} ranks x --micro_batch_size {args.micro_batch_size} = "
                          f"{world * args.micro_batch_size} blocks): raise --max_eval_blocks or lower "
                          f"--micro_batch_size")
    checkpoints_dir = os.path.join(args.output_dir, "checkpoints")
    resume = None
    if args.resume_from_checkpoint:
        resume = find_latest(checkpoints_dir) if args.resume_from_checkpoint == "latest" \
            else args.resume_from_checkpoint
    elif not args.overwrite_output_dir:
        old = list_checkpoints(checkpoints_dir)
        done = os.path.isfile(os.path.join(args.output_dir, "all_results.json"))
        if old:
            raise RecipeError(f"the output folder {args.output_dir} already holds checkpoints "
                              f"{[os.path.basename(p) for _, p in old][-3:]} of a run. Continue that run with "
                              f"--resume_from_checkpoint latest, start over with --overwrite_output_dir (deletes "
                              f"them), or choose another --output_dir / --run_name")
        if done:
            raise RecipeError(f"the output folder {args.output_dir} holds the results of a finished run (and no "
                              f"checkpoint to continue from). Start over with --overwrite_output_dir (deletes "
                              f"them), or choose another --output_dir / --run_name")
    if resume:
        try:
            meta = read_meta(resume)
            check_compatible(meta, layout_meta(fl, layout))
        except CheckpointError as exc:
            raise RecipeError(str(exc)) from exc
        theirs = meta.get("run_identity")
        if theirs is not None and theirs != json.loads(json.dumps(identity)):
            diff = sorted(k for k in set(theirs) | set(identity) if theirs.get(k) != identity.get(k))
            raise RecipeError(f"checkpoint {resume} was written by another run: {diff} differ "
                              f"(e.g. {diff[0]}={theirs.get(diff[0])!r} there, {identity.get(diff[0])!r} here). "
                              f"Resume with that run's settings, or start over with --overwrite_output_dir")
        steps, their_max = meta.get("completed_steps", 0), meta.get("max_steps")
        if their_max is not None and steps >= their_max and args.max_steps in (None, their_max):
            raise RecipeError(f"checkpoint {resume} is the end of a finished run ({steps} of {their_max} steps): "
                              f"nothing is left to train. Its results are in {args.output_dir}; start over with "
                              f"--overwrite_output_dir or choose another --output_dir / --run_name")
        if args.max_steps is not None and steps > args.max_steps:
            raise RecipeError(f"checkpoint {resume} is at step {steps}, past --max_steps {args.max_steps}")
        if args.max_steps is not None and their_max is not None and their_max != args.max_steps:
            raise RecipeError(f"checkpoint {resume} belongs to a run of {their_max} steps; resuming with --max_steps "
                              f"{args.max_steps} would rebuild the {args.lr_scheduler_type} LR schedule for another "
                              f"length (the LR at every later step would change). Resume with --max_steps "
                              f"{their_max}, or start a new run")
    return resume


def resolve_mixed_precision(flag: str) -> str:
    """The precision to train in: the flag; "auto" takes bf16 from `accelerate launch
    --mixed_precision bf16` (ACCELERATE_MIXED_PRECISION), else bf16 on GPUs that support it,
    else fp32 ("no").

    Raises:
        RecipeError: fp16 requested by the launcher (see FLAccelerator: its per-rank loss
            scaler can skip a step in one federation group only).
    """
    import torch

    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "").lower()
    if launcher == "fp16":
        raise RecipeError("the launcher asks for mixed_precision fp16 (accelerate launch --mixed_precision fp16 or "
                          "ACCELERATE_MIXED_PRECISION=fp16), which fl_accel does not support: use bf16 (its loss "
                          "scaler can skip a step in one federation group only)")
    if flag != "auto":
        return flag
    if launcher == "bf16":
        return "bf16"
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


def classify_failure(exc: BaseException) -> str | None:
    """'collective' when ``exc`` came out of torch.distributed (a peer died or hung: gloo
    raises a plain RuntimeError from inside torch.distributed, NCCL a DistBackendError),
    else None."""
    import torch.distributed as dist

    if isinstance(exc, (dist.DistError,)):
        return "collective"
    tb = exc.__traceback__
    while tb is not None:
        if f"torch{os.sep}distributed{os.sep}" in tb.tb_frame.f_code.co_filename:
            return "collective"
        tb = tb.tb_next
    return None


class FaultInjector:
    """Test hook: ``FL_ACCEL_TEST_FAULT_INJECT=<kind>:<rank>:<step>`` acts on one rank after that optimizer step.

    kind ``kill`` sends SIGKILL to the process (a crashed rank); ``stop`` sends SIGSTOP
    (a hung rank); ``nan`` makes that rank's loss NaN at that step (the NaN then flows
    through the gradients into the optimizer state). Only in the first attempt of a
    torchrun job (``TORCHELASTIC_RESTART_COUNT`` 0), so ``--max-restarts`` runs recover.
    """

    def __init__(self, rank: int):
        spec = os.environ.get("FL_ACCEL_TEST_FAULT_INJECT", "")
        self.kind, self.step = None, None
        if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            kind, fault_rank, step = spec.split(":")
            if kind not in ("kill", "stop", "nan"):
                raise RecipeError(f"FL_ACCEL_TEST_FAULT_INJECT kind must be kill, stop or nan, got {kind!r}")
            if int(fault_rank) == rank:
                self.kind, self.step = kind, int(step)

    def loss_scale(self, step: int) -> float:
        """NaN for the configured step of a ``nan`` fault, else 1."""
        return float("nan") if self.kind == "nan" and step == self.step else 1.0

    def after_step(self, step: int) -> None:
        if self.kind in ("kill", "stop") and step == self.step:
            import signal

            print(f"[fl_accel] FL_ACCEL_TEST_FAULT_INJECT: {self.kind} rank {os.environ.get('RANK')} at step {step}",
                  file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL if self.kind == "kill" else signal.SIGSTOP)


class BlockRecorder:
    """Test hook: ``FL_ACCEL_TEST_RECORD_BLOCKS=<dir>`` makes every rank append one JSON line per
    micro-batch to ``<dir>/rank<k>.jsonl``: ``{"step": the optimizer step it belongs to,
    "epoch": the data stream's epoch after this micro-batch (``PackedStream.epoch``;
    None for map-style data), "input_ids": the blocks as lists of token ids}``. Tests
    read which samples each rank trained on (disjoint shards, nothing seen twice after a
    resume). Unset: no cost."""

    def __init__(self, rank: int):
        folder = os.environ.get("FL_ACCEL_TEST_RECORD_BLOCKS")
        self.path = os.path.join(folder, f"rank{rank}.jsonl") if folder else None
        if folder:
            os.makedirs(folder, exist_ok=True)

    def record(self, step: int, input_ids, epoch: int | None = None) -> None:
        if self.path:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"step": step, "epoch": epoch, "input_ids": input_ids.tolist()}) + "\n")


# =========================================================================== main
def main(argv=None) -> dict:
    parsed = parse_args(argv)
    args, fl = parsed.args, parsed.fl
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = plan_layout(fl, world)
    run_name = args.run_name or default_run_name(layout, fl)
    if args.output_dir is None:
        args.output_dir = os.path.join("outputs", args.experiment, run_name)
    check_seq_len(args.model, args.seq_len)
    identity = run_identity(args, fl)
    resume_path = preflight(args, fl, layout, identity)
    os.environ.setdefault("WANDB_MODE", "offline")  # never prompt for a login
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("HF_UPDATE_DOWNLOAD_COUNTS", "0")

    import torch
    import torch.distributed as dist
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm
    from transformers import default_data_collator, get_scheduler

    from fl_accel import FLAccelerator
    from fl_accel.checkpoint import prune_checkpoints
    from scripts.launch import HostLoad
    from scripts.plots import plot_run_curves
    from recipes import data as data_lib
    from recipes.modeling import build_model, export_final_model, model_config, peak_host_mb

    mixed = resolve_mixed_precision(args.mixed_precision)
    wall_t0 = time.perf_counter()
    accelerator = FLAccelerator(
        fl,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=mixed,
        log_with=None if args.report_to == "none" else args.report_to,
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=args.output_dir),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
    )
    F_, S_ = layout.num_groups, layout.shards
    if accelerator.is_main_process:
        if args.overwrite_output_dir and not args.resume_from_checkpoint:
            for name in ("checkpoints", "final_model", "wandb", "metrics.jsonl", "all_results.json", "curves.png"):
                path = os.path.join(args.output_dir, name)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.remove(path)
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    # ---------------------------------------------------------------- data
    cache_dir = args.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "fl_accel")
    num_shards, shard_index, data_seed = accelerator.data_shard()
    if args.streaming:
        source = main_first(accelerator, lambda: data_lib.stream_source(args, cache_dir))
        tokenizer = main_first(accelerator, lambda: data_lib.get_stream_tokenizer(args, source, cache_dir))
        val_blocks = main_first(accelerator, lambda: data_lib.build_validation_blocks(
            source, tokenizer, args.seq_len, args.max_eval_blocks))
        stream = data_lib.build_train_stream(source, tokenizer, args.seq_len, num_shards, shard_index,
                                             args.seed if data_seed is None else data_seed)
        train_loader, train_size = DataLoader(stream, batch_size=args.micro_batch_size), None
    else:
        def prepare_data():
            raw = data_lib.load_raw(args, cache_dir)
            tok = data_lib.get_tokenizer(args, raw, cache_dir)
            packed = data_lib.tokenize_and_pack_cached(raw, tok, args.text_column, args.seq_len, cache_dir,
                                                       args.preprocessing_num_workers)
            return tok, packed.dataset

        tokenizer, packed = main_first(accelerator, prepare_data)
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
        train_loader = DataLoader(train_set.with_format("torch"), batch_size=args.micro_batch_size, shuffle=True,
                                  drop_last=True, collate_fn=default_data_collator)
        train_size = len(train_set)

    # ---------------------------------------------------------------- model, optimizer
    config = model_config(args.model, args.seq_len, len(tokenizer))
    set_seed(args.seed)  # right before the model: every rank (every group) builds the same weights
    model = build_model(config, args.init_device)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate,
                                  betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.weight_decay)
    if args.streaming:
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    if args.init_device == "meta":
        accelerator.materialize(model, model._init_weights, seed=args.seed)
    peak = torch.tensor([peak_host_mb()], dtype=torch.float64, device=accelerator.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    peak_host_mb_after_prepare = peak.item()

    if args.streaming:
        steps_per_epoch = None
        max_steps = args.max_steps
    else:
        # Accelerate forces an optimizer step at the end of the dataloader, so an epoch of
        # B micro-batches per rank has ceil(B / accumulation) optimizer steps.
        batches_per_epoch = len(train_loader)
        steps_per_epoch = math.ceil(batches_per_epoch / args.gradient_accumulation_steps)
        max_steps = args.max_steps or args.num_epochs * steps_per_epoch
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=math.ceil(args.warmup_ratio *
                                                                                            max_steps),
                              num_training_steps=max_steps)
    scheduler = accelerator.prepare(scheduler)  # FLAccelerator: one scheduler step per optimizer step
    if fl.is_federated and fl.sync_every > max_steps:
        accelerator.print(f"WARNING: sync_every={fl.sync_every} exceeds the {max_steps} training steps: groups "
                          f"only synchronize once, at the end")
    eval_every = args.eval_every
    if eval_every and fl.is_federated and eval_every % fl.sync_every:
        eval_every = math.ceil(eval_every / fl.sync_every) * fl.sync_every
        accelerator.print(f"eval_every rounded up to {eval_every}, a multiple of sync_every, so the "
                          f"synchronized model is evaluated")
    if eval_every and fl.is_federated and (fl.num_fragments > 1 or fl.fragment_update_alpha):
        accelerator.print("note: with streaming fragments (or alpha > 0) the groups are never fully synchronized "
                          "mid-run; a mid-run evaluation scores each rank's rows with its own group's model "
                          "(--eval_groups scores every group's model separately); the final one follows the "
                          "final full sync")

    tokens_per_rank_step = args.micro_batch_size * args.seq_len * args.gradient_accumulation_steps
    tokens_per_step = tokens_per_rank_step * world
    accelerator.print(
        f"[fl_accel] {layout.describe(fl.sync_every)}, outer={fl.outer_optimizer if fl.is_federated else '-'}"
        + (f", fragments P={fl.num_fragments} delay={fl.sync_delay} alpha={fl.fragment_update_alpha} "
           f"exchange={fl.sync_dtype}{' +error feedback' if fl.error_feedback else ''}"
           if fl.is_federated and (fl.fragmented or fl.compressed) else "") + "\n"
        f"[fl_accel] FLConfig: {'; '.join(describe_sources(parsed)) or 'all defaults'}\n"
        f"[fl_accel] model {args.model}: {n_params / 1e6:.2f}M params, vocab {config.vocab_size}, "
        f"seq_len {args.seq_len}, precision {mixed}, init on {args.init_device} "
        f"(peak host memory {peak_host_mb_after_prepare:.0f} MiB per rank)\n"
        f"[fl_accel] micro-batch {args.micro_batch_size} blocks/rank x accumulation {args.gradient_accumulation_steps}"
        f" = {tokens_per_rank_step} tokens/rank/step; {tokens_per_step} tokens/step in total "
        f"(global batch {tokens_per_step // args.seq_len} blocks)\n"
        + (f"[fl_accel] train {train_size} blocks ({batches_per_epoch} micro-batches per rank per epoch, "
           f"{steps_per_epoch} steps/epoch), {max_steps} steps, "
           if not args.streaming else f"[fl_accel] streaming training data, {max_steps} steps, ")
        + f"validation {len(val_blocks)} blocks"
    )

    # ---------------------------------------------------------------- resume
    checkpoints_dir = os.path.join(args.output_dir, "checkpoints")
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    completed_steps, restored = 0, {}
    if resume_path:
        meta = accelerator.load_state(resume_path)
        completed_steps = int(meta["completed_steps"])
        restored = meta.get("totals", {})
        rank_state = meta.get("rank_state", {})
        accelerator.comm_stats.load_dict(rank_state.get("comm", {}))
        if args.streaming:
            stream.load_state_dict(rank_state["data"])
        accelerator.print(f"[fl_accel] resumed from {resume_path} at step {completed_steps}")
    elif args.resume_from_checkpoint:
        accelerator.print(f"[fl_accel] no complete checkpoint in {checkpoints_dir}; starting from step 0")
    if accelerator.is_main_process:
        kept = [r for r in read_metrics(metrics_path) if r.get("step", 0) <= completed_steps] if completed_steps \
            else []
        with open(metrics_path, "w", encoding="utf-8") as fh:  # the history up to the checkpoint
            fh.writelines(json.dumps(r) + "\n" for r in kept)

    # ---------------------------------------------------------------- trackers
    wandb_id = restored.get("wandb_id")
    if args.report_to != "none":
        import secrets

        wandb_id = wandb_id or secrets.token_hex(4)  # only the main process's is used (it owns the tracker)
        run_config = {**{k: v for k, v in dataclasses.asdict(args).items()},
                      **{f"fl/{k}": v for k, v in fl.to_dict().items()},
                      "world_size": world, "num_groups": F_, "group_sizes": list(layout.group_sizes), "shards": S_,
                      "n_params": n_params, "tokens_per_step": tokens_per_step, "max_steps": max_steps}
        init_kwargs = {"wandb": {"group": args.experiment, "name": run_name, "dir": args.output_dir,
                                 "tags": [fl.algorithm], "id": wandb_id, "resume": "allow"}}
        accelerator.init_trackers(args.wandb_project, config=run_config, init_kwargs=init_kwargs)

    def log(record: dict) -> None:
        if args.report_to != "none":
            accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])
        if accelerator.is_main_process:
            with open(metrics_path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")

    # ---------------------------------------------------------------- per-group evaluation
    eval_steps_groups: dict[int, list] = {}
    if args.eval_groups and F_ > 1:
        def evaluate_groups_before_sync(synchronizer, full):
            step = synchronizer.schedule.global_step
            if eval_every and step % eval_every == 0 and step < max_steps:
                eval_steps_groups[step] = evaluate(model, accelerator, val_blocks, args.micro_batch_size,
                                                   per_group=True)

        accelerator.register_pre_sync_hook(evaluate_groups_before_sync)

    def group_eval_record(results) -> dict:
        return {f"eval/perplexity_group{f}": r[0] for f, r in enumerate(results)} | \
            {f"eval/loss_group{f}": r[1] for f, r in enumerate(results)}

    # ---------------------------------------------------------------- checkpoints
    train_seconds = float(restored.get("train_seconds", 0.0))
    eval_seconds = float(restored.get("eval_and_checkpoint_seconds", 0.0))
    wall_before = float(restored.get("wall_seconds", 0.0))

    def save_checkpoint(step: int) -> None:
        totals = {"train_seconds": train_seconds, "eval_and_checkpoint_seconds": eval_seconds,
                  "wall_seconds": wall_before + time.perf_counter() - wall_t0, "wandb_id": wandb_id}
        def rank_state():  # after the save's own collectives, so a resumed run counts them too
            state = {"comm": accelerator.comm_stats.as_dict()}
            if args.streaming:
                state["data"] = stream.state_dict()
            return state

        accelerator.save_state(os.path.join(checkpoints_dir, f"step_{step}"),
                               extra_meta={"completed_steps": step, "max_steps": max_steps, "totals": totals,
                                           "run_identity": identity, "run_name": run_name},
                               rank_state=rank_state)
        if args.checkpoints_total_limit and accelerator.is_main_process:
            prune_checkpoints(checkpoints_dir, args.checkpoints_total_limit)

    # ---------------------------------------------------------------- train
    resumed_steps = completed_steps
    faults = FaultInjector(accelerator.process_index)
    recorder = BlockRecorder(accelerator.process_index)
    host = HostLoad(pid=os.getppid() if "LOCAL_RANK" in os.environ else None).start()
    progress = tqdm(total=max_steps, initial=completed_steps, disable=not accelerator.is_local_main_process,
                    desc=run_name, unit="step", dynamic_ncols=True)
    tokens_seen = completed_steps * tokens_per_step
    window_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)  # summed on the device
    window_n, window_tokens, window_t0 = 0, 0, time.perf_counter()
    grad_norm = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    t_step = time.perf_counter()
    session_t0 = time.perf_counter()
    model.train()

    def batches():
        """Micro-batches from the resume point on: epochs of the map-style loader, or the endless stream."""
        if args.streaming:
            while True:
                for batch in train_loader:
                    yield {"input_ids": batch["input_ids"].to(accelerator.device)}
        epoch = completed_steps // steps_per_epoch
        skip = (completed_steps % steps_per_epoch) * args.gradient_accumulation_steps
        while True:
            train_loader.set_epoch(epoch)
            yield from (accelerator.skip_first_batches(train_loader, skip) if skip else train_loader)
            epoch, skip = epoch + 1, 0

    with accelerator.meter_comm():
        for batch in (batches() if completed_steps < max_steps else ()):
            recorder.record(completed_steps + 1, batch["input_ids"], stream.epoch if args.streaming else None)
            with accelerator.accumulate(model):
                out = model(input_ids=batch["input_ids"], labels=batch["input_ids"])
                loss = out.loss * faults.loss_scale(completed_steps + 1)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or float("inf"))
                    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
                    grad_norm = torch.as_tensor(norm, device=accelerator.device).double()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            window_loss += loss.detach().double()
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
                stats = torch.zeros(1 + F_, dtype=torch.float64, device=accelerator.device)
                stats[0] = window_loss / window_n / world
                stats[1 + accelerator.group_index] = grad_norm / layout.group_size_of(accelerator.group_index)
                dist.all_reduce(stats)  # counted in the "world" bucket of comm_stats
                elapsed = now - window_t0
                comm = accelerator.comm_stats
                record = {"step": completed_steps, "tokens": tokens_seen, "time_s": train_seconds,
                          "train/loss": stats[0].item(), "lr": scheduler.get_last_lr()[0],
                          "train/grad_norm": stats[1:].mean().item(),
                          **{f"train/grad_norm_group{f}": stats[1 + f].item() for f in range(F_) if F_ > 1},
                          "tokens_per_s": window_tokens / elapsed,
                          "tokens_per_s_per_process": window_tokens / elapsed / world,
                          "step_time_s": elapsed / max(1, window_n // args.gradient_accumulation_steps),
                          "sync_time_share": comm["fl"].seconds / max(now - session_t0, 1e-9),
                          **comm.flat()}
                log(record)
                progress.set_postfix(loss=f"{record['train/loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                window_loss.zero_()
                window_t0 = time.perf_counter()
                window_n, window_tokens = 0, 0
            extra = time.perf_counter()
            if eval_every and completed_steps % eval_every == 0 and completed_steps < max_steps:
                ppl, nll, _ = evaluate(model, accelerator, val_blocks, args.micro_batch_size)[0]
                log({"step": completed_steps, "tokens": tokens_seen, "time_s": train_seconds,
                     "eval/perplexity": ppl, "eval/loss": nll,
                     **group_eval_record(eval_steps_groups.pop(completed_steps, []))})
            if args.checkpoint_every and completed_steps % args.checkpoint_every == 0 and completed_steps < max_steps:
                save_checkpoint(completed_steps)
            spent = time.perf_counter() - extra
            eval_seconds += spent
            window_t0 += spent  # keep throughput about training only
            t_step = time.perf_counter()
            if completed_steps >= max_steps:
                break
        progress.close()

        # ------------------------------------------------------------ final sync, evaluation, exports
        extra = time.perf_counter()
        if accelerator.sync_if_pending():
            accelerator.print("[fl_accel] final synchronization of the federation groups done")
        ppl, nll, n_tokens = evaluate(model, accelerator, val_blocks, args.micro_batch_size)[0]
        final = {"step": completed_steps, "tokens": tokens_seen, "time_s": train_seconds,
                 "eval/perplexity": ppl, "eval/loss": nll}
        if args.eval_groups and F_ > 1:
            final.update(group_eval_record(evaluate(model, accelerator, val_blocks, args.micro_batch_size,
                                                    per_group=True)))
        log(final)
        if args.checkpoint_every:
            save_checkpoint(completed_steps)
        if args.save_final_model:
            export_final_model(model, config, tokenizer, os.path.join(args.output_dir, "final_model"),
                               accelerator.is_main_process)
        eval_seconds += time.perf_counter() - extra
    host_load = host.stop()
    wall = wall_before + time.perf_counter() - wall_t0
    session_steps = completed_steps - resumed_steps
    results = {
        "algorithm": fl.algorithm, "world_size": world, "num_groups": F_, "group_sizes": list(layout.group_sizes),
        "group_size": layout.group_size if layout.is_uniform else list(layout.group_sizes),
        "replicas": layout.replicas if layout.is_uniform else [g // S_ for g in layout.group_sizes], "shards": S_,
        "sync_every": fl.sync_every if fl.is_federated else None, "fl": fl.to_dict(),
        "eval_perplexity": ppl, "eval_loss": nll, "eval_tokens": n_tokens,
        "train_tokens": tokens_seen, "steps": completed_steps, "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_seen / train_seconds if train_seconds > 0 else None,
        "train_seconds": train_seconds, "wall_seconds": wall, "eval_and_checkpoint_seconds": eval_seconds,
        "comm": accelerator.comm_stats.as_dict(), "n_params": n_params, "run_name": run_name,
        "vocab_size": config.vocab_size, "peak_host_mb_after_prepare": peak_host_mb_after_prepare,
        "host": host_load,
        "session": {"resumed_from_step": resumed_steps, "steps": session_steps,
                    "wall_seconds": time.perf_counter() - wall_t0},
        "final_model": os.path.join(args.output_dir, "final_model") if args.save_final_model else None,
        "wandb_id": wandb_id,
    }
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "all_results.json"), "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
        try:  # the whole history, also after a resume
            plot_run_curves(read_metrics(metrics_path), os.path.join(args.output_dir, "curves.png"),
                            f"{run_name} ({args.model})")
        except Exception as exc:  # a plot must never fail a training run
            print(f"[fl_accel] could not draw curves.png: {exc}", file=sys.stderr)
    accelerator.end_training()
    if accelerator.is_main_process:
        wandb_dir = os.path.join(args.output_dir, "wandb")
        print(f"[fl_accel] done: eval perplexity {ppl:.2f} (loss {nll:.4f}) after {completed_steps} steps, "
              f"{results['tokens_per_s'] or 0:.0f} tokens/s\n"
              f"[fl_accel] results: {os.path.join(args.output_dir, 'all_results.json')}, metrics.jsonl, curves.png"
              + (", final_model/" if args.save_final_model else "") + "\n"
              + (f"[fl_accel] W&B offline run under {wandb_dir} (upload: wandb sync {wandb_dir}/offline-run-*)"
                 if args.report_to == "wandb" else ""))
    return results


# =========================================================================== entry point
def _say(line: str) -> None:
    """One write per line, so lines of concurrent ranks sharing a pipe do not interleave."""
    sys.stderr.write(line.replace("\n", " ") + "\n")
    sys.stderr.flush()


def _on_sigterm(signum, frame):
    # torchrun sends SIGTERM to the surviving ranks when one rank fails. Exit at once: an
    # interpreter shutdown would run atexit handlers that wait on the dead peers.
    _say(f"[fl_accel] rank {os.environ.get('RANK', '0')}: stopped by the launcher (another rank failed "
         f"or the job was cancelled)")
    sys.stdout.flush()
    os._exit(143)


def _record_for_launcher(message: str) -> None:
    """Hand the one-line error to torchrun's failure summary (its "Root Cause" box, printed
    last), through the error file torchelastic gives each worker (TORCHELASTIC_ERROR_FILE)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                    "timestamp": str(int(time.time()))}}}, fh)
    except OSError:
        pass


def cli(argv=None) -> int:
    import signal

    signal.signal(signal.SIGTERM, _on_sigterm)
    rank = os.environ.get("RANK", "0")
    try:
        main(argv)
    except ValueError as exc:  # RecipeError, DataError, CheckpointError, FLConfig errors
        message = f"[fl_accel] error (rank {rank}): {exc}"
        _say(message)
        _record_for_launcher(message)
        return 2
    except KeyboardInterrupt:
        _say(f"[fl_accel] rank {rank}: interrupted; resume with --resume_from_checkpoint latest "
             f"(checkpoints every --checkpoint_every steps)")
        return 130
    except RuntimeError as exc:
        if classify_failure(exc) == "collective":
            message = (f"[fl_accel] error (rank {rank}): a collective failed; a peer rank died or hung (collective "
                       f"timeout collective_timeout_s={os.environ.get('FL_ACCEL_COLLECTIVE_TIMEOUT_S', '300')} s): "
                       f"{str(exc)[:500]}")
            _say(message)
            _record_for_launcher(message)
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(cli())
