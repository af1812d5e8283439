"""Pretrain a causal LM from scratch with FSDP, HSDP, FL+FSDP or FL+HSDP (fl_accel).

Mittone & Aldinucci, "Accelerating Sharded Data Parallelism at Scale with Federated
Learning", Euro-Par 2026, arXiv 2609.20359. Defaults follow the paper (Sec. 4):
AdamW lr 3e-4, betas (0.9, 0.95), weight decay 0.1, 10% linear warmup then cosine,
H = 8, a global disjoint data split, perplexity at the end. The model is a Llama preset
or any causal LM config whose model class declares ``_no_split_modules`` (Qwen2,
Mistral, ...: ``--model <dir with config.json>``).

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
    # an error ends with its one line instead of torchrun's ~40-line summary (scripts/launch_guard.py)
    OMP_NUM_THREADS=1 python -m scripts.launch_guard torchrun --nproc_per_node 4 recipes/pretrain.py --num_groups 2
    # on GPUs: bf16 (gradients reduced in fp32), activation checkpointing, regional compile
    PYTORCH_ALLOC_CONF=expandable_segments:True accelerate launch --config_file ... recipes/pretrain.py \
        --config ... --mixed_precision bf16 --activation_checkpointing full --compile

Every FLConfig field is a flag (``python recipes/pretrain.py --help``), a YAML key under
``fl:`` and an ``FL_ACCEL_<FIELD>`` variable. Outputs in --output_dir: metrics.jsonl (one
JSON record per log/eval step, the whole history), all_results.json (whole-run figures,
explained in recipes/metrics.py), curves.png (recipes/plots.py; when matplotlib is installed),
checkpoints/step_N, final_model/ (save_pretrained), the offline W&B run under wandb/.

This file reads top to bottom: :func:`main` (the stages in order), the stages, the training
loops, the entry point :func:`cli`. Where the rest lives: recipes/args.py (flags),
recipes/run_folder.py (checks before any collective, the output folder, checkpoints),
recipes/inputs.py (data), recipes/modeling.py (models, optimizer, export), recipes/run_state.py
(:class:`Run`, the state the loops share: logs, evaluations, checkpoints), recipes/results.py
(the final phase, all_results.json and the closing lines), recipes/process.py (signals, the
launcher's death, one-line errors and exit statuses), recipes/metrics.py (time, throughput,
MFU, memory, traffic, evaluation), recipes/sync_log.py (records summed over the world at
syncs, so that federation groups never wait for each other between syncs), recipes/banner.py
(the start-up banner), recipes/host_load.py (the CPU load of the machine meanwhile; psutil,
imported lazily), recipes/plots.py (curves.png), recipes/compat.py (every reach into another
library's internals), recipes/testing_hooks.py (the tests' fault injection and block
recording, switched on from the environment). FLOPs per token and MFU: fl_accel.planning.flops.

Run as a file, Python puts recipes/ (not the repository root) first on the module search
path: the recipe imports its siblings as ``recipes.x`` from the installed repository
(``pip install -e .``); it never edits the search path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, TorchDynamoPlugin, set_seed
from transformers import get_scheduler

try:  # run as a file (accelerate launch / torchrun / python recipes/pretrain.py), the package is found
    import recipes  # noqa: F401  because it is installed (the module docstring)
except ModuleNotFoundError as exc:
    raise SystemExit("[fl_accel] error: recipes/pretrain.py imports its package 'recipes', which is not installed: "
                     "run `pip install -e .` in the repository root") from exc

import fl_accel  # fl_accel.FLAccelerator is looked up when built (a unit test replaces it)
from fl_accel.fsdp_model import fsdp2_plugin
from fl_accel.ft_ends import StateLostError
from fl_accel.lr_schedule import lr_multiplier
from fl_accel.planning.flops import model_flops_per_token, peak_tflops
from recipes import compat, process, testing_hooks
from recipes.banner import banner_lines
from recipes.host_load import HostLoad
from recipes.inputs import batches, build_data, repeat_note, steps_per_epoch
from recipes.memory_check import check_memory
from recipes.metrics import Clock, Meter, fl_accel_origin, groups_differ_after_syncs, launch_seconds, peak_host_mb
from recipes.modeling import build_model, build_optimizer, embedding_params, resolve_config
from recipes.results import add_session_results, finish, write_results
from recipes.run_folder import ROUNDS_LR_SCHEDULES, RunPlan, plan_run, prepare_output_dir, resume, run_length_error
from recipes.run_state import Run


# =========================================================================== main
def main(argv=None) -> dict:
    """Train as the flags, the recipe YAML and ``FL_ACCEL_*`` say; returns all_results.json's dict.

    A sequence of stages, the functions below in this order (the last three, the final phase,
    in :mod:`recipes.results`), the same on every rank (so every rank makes the same
    collectives in the same order); the training loop is the run's mode's, chosen once
    (:func:`select_training_loop`).

    Raises:
        RecipeError (a ValueError): bad input, on every rank before any collective where it
            can be found without one.
    """
    plan, host, launched = plan_session(argv)  # no collective: a bad input fails here, on every rank
    accelerator = build_accelerator(plan)
    prepare_output_dir(accelerator, plan.args)
    parts = build_parts(plan, accelerator)  # data, model, optimizer; the run's length
    parts = prepare_parts(accelerator, parts, plan.args)  # sharded, materialized
    scheduler = build_lr_scheduler(accelerator, parts.optimizer, plan.args, parts.max_steps)
    figures = plan_figures(plan, accelerator, parts)
    print_banner(plan, accelerator, parts, figures)
    run = start_run(plan, accelerator, parts, scheduler, figures)  # resumed, hooks installed; the clock starts
    train_loop = select_training_loop(run)  # fixed steps, rounds by time/speed, or torchft
    with accelerator.meter_comm():  # traffic by mesh axis: training and the final phase
        train_loop(run)
        run.progress.close()
        results = finish(run, setup_record(plan, parts, figures))  # the final sync, evaluation and export
    add_session_results(results, run, host, launched)
    write_results(run, results)
    return results


# =========================================================================== the stages, in main's order
def plan_session(argv) -> tuple[RunPlan, HostLoad | None, float | None]:
    """No collective: the flags, the recipe YAML and ``FL_ACCEL_*`` planned into a
    :class:`recipes.run_folder.RunPlan` (:func:`recipes.run_folder.plan_run`: every check that
    needs no process group, so that a bad input raises the same RecipeError on every rank),
    this session's host-load meter started and W&B's environment defaults set. Returns the
    plan, the meter (None without psutil) and the launcher's start-up seconds
    (:func:`recipes.metrics.launch_seconds`)."""
    t0, launched = time.perf_counter(), launch_seconds()
    try:  # CPU load of this session; psutil is optional (without it all_results.json's host is null)
        host = HostLoad(pid=os.getppid() if "LOCAL_RANK" in os.environ else None).start()
    except ModuleNotFoundError:
        host = None
    plan = plan_run(argv, t0=t0)
    for key, value in (("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"), ("HF_UPDATE_DOWNLOAD_COUNTS", "0")):
        os.environ.setdefault(key, value)  # W&B never prompts for a login
    return plan, host, launched


TRACKERS = {"none": None, "wandb": ["wandb"], "tensorboard": ["tensorboard"], "all": ["wandb", "tensorboard"]}
"""``--report_to`` -> Accelerate's ``log_with``: its own trackers (W&B offline unless WANDB_MODE says
otherwise; TensorBoard event files under ``<output_dir>/tensorboard``)."""


def build_accelerator(plan):
    """FLAccelerator with what the plan decided: mixed precision, the library's FSDP2 plugin
    (:func:`fl_accel.fsdp_model.fsdp2_plugin`: bf16 parameters and compute, gradients reduced
    in ``--reduce_dtype``, no output cast: the loss stays fp32), activation checkpointing and
    regional compilation, all applied by
    Accelerate's own FSDP2 path (``Accelerator._prepare_fsdp2``: checkpointing, then compile,
    then ``fully_shard``)."""
    args = plan.args
    plugin = fsdp2_plugin(mixed_precision=plan.mixed_precision, reduce_dtype=args.reduce_dtype,
                          activation_checkpointing=plan.activation_checkpointing)
    extra = {"dynamo_plugin": TorchDynamoPlugin(backend="inductor", use_regional_compilation=True)} \
        if args.compile else {}
    accelerator = fl_accel.FLAccelerator(  # the plan's resolved config, owned by the accelerator from here on
        plan.resolved, gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=plan.mixed_precision,
        log_with=TRACKERS[args.report_to], fsdp_plugin=plugin,  # TensorBoard: <output_dir>/tensorboard/<project>
        project_config=ProjectConfiguration(project_dir=args.output_dir,
                                            logging_dir=os.path.join(args.output_dir, "tensorboard")),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed), **extra)
    return accelerator


@dataclasses.dataclass
class Parts:
    """The data, the model and its optimizer (:func:`build_parts`; prepared by :func:`prepare_parts`)."""

    data: Any  # recipes.inputs.Data: the tokenizer, the training data (a loader or a stream), validation blocks
    train_loader: Any  # prepared (map-style data) or the stream's own
    steps_per_epoch: int | None  # map-style data (None: a stream)
    max_steps: int  # the run's length, set on the accelerator
    config: Any  # the model's transformers config
    vocab_note: str  # what the banner says about the vocabulary ("" when it is the tokenizer's)
    model: Any
    optimizer: Any
    n_params: int
    n_embedding: int  # embedding parameters (left out of the FLOPs per token)
    peak_host_mb: float | None = None  # after prepare, the largest over the world (prepare_parts)


def build_parts(plan: RunPlan, accelerator) -> Parts:
    """The data (:func:`recipes.inputs.build_data`), the model's config, the model
    (seeded right before it: every rank of every group builds the same weights), the optimizer,
    and the run's length (``--max_steps``, else ``--num_epochs`` epochs of the loader) set on
    the accelerator, into its run_config, before the synchronizer is built from it: the last
    step's sync is the final (exact) one, and a decaying outer LR without its steps spans the
    run. The map-style loader is prepared here, before the model: Accelerate's FSDP2 prepare
    prepares it first anyway.

    Raises:
        RecipeError: a length the run's config refuses (:func:`recipes.run_folder.run_length_error`),
            on every rank (each computes the same length); on CUDA, a run the memory model says
            does not fit (``--memory_check refuse``: :mod:`recipes.memory_check`).
    """
    args = plan.args
    data = build_data(args, accelerator)
    config, vocab_note = resolve_config(args.model, args.seq_len, len(data.tokenizer), args.resize_vocab)
    check_memory(accelerator, args, config, plan.mixed_precision, plan.activation_checkpointing)  # CUDA: will it fit?
    set_seed(args.seed)  # right before the model: every rank (every group) builds the same weights
    model = build_model(config, args.init_device)
    n_params, n_embedding = sum(p.numel() for p in model.parameters()), embedding_params(model)
    optimizer = build_optimizer(model, args, accelerator.device.type)
    train_loader = data.train_loader if data.stream is not None else accelerator.prepare(data.train_loader)
    per_epoch = None if data.stream is not None else steps_per_epoch(train_loader, args.gradient_accumulation_steps)
    max_steps = args.max_steps or args.num_epochs * per_epoch
    try:
        accelerator.set_max_steps(max_steps)
    except ValueError as exc:
        raise run_length_error(exc, max_steps) from exc
    return Parts(data=data, train_loader=train_loader, steps_per_epoch=per_epoch, max_steps=max_steps, config=config,
                 vocab_note=vocab_note, model=model, optimizer=optimizer, n_params=n_params, n_embedding=n_embedding)


def prepare_parts(accelerator, parts: Parts, args) -> Parts:
    """Collectives: the model and optimizer prepared (FSDP2; the federation's
    synchronizer is built from the accelerator's run_config), the weights materialized on the
    ranks' devices (``--init_device meta``), and the peak host memory after prepare, the largest
    over the world (an all-reduce). Returns ``parts`` with those."""
    model, optimizer = accelerator.prepare(parts.model, parts.optimizer)
    if args.init_device == "meta":
        accelerator.materialize(model, compat.init_weights(model), seed=args.seed)
    peak = torch.tensor([peak_host_mb()], dtype=torch.float64, device=accelerator.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return dataclasses.replace(parts, model=model, optimizer=optimizer, peak_host_mb=peak.item())


def build_lr_scheduler(accelerator, optimizer, args, max_steps: int):
    """The inner LR schedule ``--lr_scheduler_type``, its first ``--warmup_ratio`` of
    the run's steps a linear warmup, prepared. Under ``sync_trigger`` "time"/"speed" it follows
    the federation's progress (:func:`federation_schedule`); otherwise it is transformers'
    ``get_scheduler``, sized as Accelerate steps a prepared scheduler: ``num_processes`` times
    per optimizer step."""
    warmup = math.ceil(args.warmup_ratio * max_steps)
    if accelerator.federation.triggered:
        return accelerator.prepare(federation_schedule(optimizer, accelerator, args.lr_scheduler_type, warmup,
                                                       max_steps))
    n = accelerator.num_processes
    return accelerator.prepare(get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=warmup * n,
                                             num_training_steps=max_steps * n))


def federation_schedule(optimizer, accelerator, name: str, warmup_steps: int, total_steps: int):
    """Under ``sync_trigger`` "time"/"speed" the inner LR schedule follows the federation's
    progress (``accelerator.federation.progress_step``, in optimizer steps), not this group's own
    step count: a fast group does more steps than ``total_steps`` and a slow one fewer, and both
    end the schedule together. A ``LambdaLR`` whose multiplier is
    :func:`fl_accel.lr_schedule.lr_multiplier` (transformers' formulas, bit for bit) of the
    schedule that ``name`` maps to in :data:`recipes.run_folder.ROUNDS_LR_SCHEDULES` (checked by
    ``plan_run``), over ``warmup_steps`` and ``total_steps``, at that progress, whatever the
    scheduler's own count (Accelerate steps it ``num_processes`` times per optimizer step).
    Within a round the progress extrapolates this group's steps to every group, so a fast
    group's LR may step back slightly at a sync (exact there)."""
    schedule, has_warmup = ROUNDS_LR_SCHEDULES[name]
    warmup, federation = warmup_steps if has_warmup else 0, accelerator.federation
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: lr_multiplier(
        schedule, federation.progress_step, warmup_steps=warmup, total_steps=total_steps))


@dataclasses.dataclass
class Figures:
    """The run's figures per step and what ran (:func:`plan_figures`): for the banner, the
    Meter, the trackers and all_results.json."""

    eval_every: int  # optimizer steps between evaluations (federated: a multiple of H); 0: at the end only
    notes: list[str]  # the banner's closing notes
    tokens_per_rank_step: int
    tokens_per_step: int  # the world's
    launch_tokens_per_step: int  # this launch's (the torchft mode: this group's)
    flops_per_token: float
    peak_tflops: float | None  # of one accelerator, for MFU (None: MFU is not reported)
    what_ran: dict  # precision policy, activation checkpointing, compile, where fl_accel was imported from


def plan_figures(plan: RunPlan, accelerator, parts: Parts) -> Figures:
    """No collective: the evaluation interval and the banner's notes
    (:func:`plan_evaluations`, a repeat of the data), tokens per step, FLOPs per token, the
    accelerator's peak TFLOPS (``--peak_tflops``, else a known CUDA device's) and what ran."""
    args, fl, layout = plan.args, accelerator.fl_config, accelerator.layout
    eval_every, notes = plan_evaluations(args, fl, parts.max_steps)
    notes += [n for n in [repeat_note(parts.max_steps, parts.steps_per_epoch, args.max_steps, args.num_epochs)] if n]
    tokens_per_rank_step = args.micro_batch_size * args.seq_len * args.gradient_accumulation_steps
    return Figures(
        eval_every=eval_every, notes=notes, tokens_per_rank_step=tokens_per_rank_step,
        tokens_per_step=tokens_per_rank_step * layout.world_size,
        launch_tokens_per_step=tokens_per_rank_step * accelerator.num_processes,
        flops_per_token=model_flops_per_token(parts.config, args.seq_len, num_params=parts.n_params,
                                              embedding_params=parts.n_embedding),
        peak_tflops=args.peak_tflops or (peak_tflops(torch.cuda.get_device_name(accelerator.device))
                                         if accelerator.device.type == "cuda" else None),
        what_ran={"precision_policy": accelerator.precision_policy,
                  "activation_checkpointing": accelerator.activation_checkpointing,
                  "compile": accelerator.compiled, "fl_accel": fl_accel_origin()})


def plan_evaluations(args, fl, max_steps: int) -> tuple[int, list[str]]:
    """``eval_every`` (a multiple of H for federated runs, so the synchronized model is
    scored) and the notes the banner ends with."""
    notes, eval_every = [], args.eval_every
    if fl.is_federated and fl.sync_every > max_steps:
        notes.append(f"WARNING: sync_every={fl.sync_every} exceeds the {max_steps} training steps: groups only "
                     f"synchronize once, at the end")
    if eval_every and fl.is_federated and eval_every % fl.sync_every:
        eval_every = math.ceil(eval_every / fl.sync_every) * fl.sync_every
        notes.append(f"eval_every rounded up to {eval_every}, a multiple of sync_every, so the synchronized model "
                     f"is evaluated")
    if eval_every and fl.is_federated and groups_differ_after_syncs(fl):
        notes.append("note: with fragments (or alpha > 0, delayed local steps kept, a warm-up not a multiple of "
                     "sync_every) the groups are not synchronized at the evaluation steps: a "
                     "mid-run evaluation scores each rank's rows with its own group's model (eval/scored: "
                     "'own group per rank'; --eval_groups scores every group's model before the sync); the final "
                     "one follows the final full sync")
    return eval_every, notes


def print_banner(plan: RunPlan, accelerator, parts: Parts, figures: Figures) -> None:
    """The start-up banner (:func:`recipes.banner.banner_lines`) and its notes, one
    block printed by the main process."""
    args, fl, layout, data, what_ran = plan.args, accelerator.fl_config, accelerator.layout, parts.data, figures.what_ran
    data_line = (f"train {data.train_size} blocks ({len(parts.train_loader)} micro-batches per rank per epoch, "
                 f"{parts.steps_per_epoch} steps/epoch), {parts.max_steps} steps, " if data.stream is None
                 else f"streaming training data, {parts.max_steps} steps, ") + f"validation {len(data.val_blocks)} blocks"
    banner = banner_lines(
        plan=plan, fl=fl, layout=layout, origin=what_ran["fl_accel"], model_name=args.model,
        model_type=parts.config.model_type, n_params=parts.n_params, vocab=parts.config.vocab_size,
        vocab_note=parts.vocab_note, flops_per_token=figures.flops_per_token, policy=what_ran["precision_policy"],
        activation_checkpointing=what_ran["activation_checkpointing"], compiled=what_ran["compile"],
        peak_mb=parts.peak_host_mb, tokens_per_rank_step=figures.tokens_per_rank_step,
        tokens_per_step=figures.tokens_per_step, data_line=data_line, tokenizer=data.tokenizer,
        param_bytes=next(parts.model.parameters()).element_size())
    notes = list(figures.notes)
    if accelerator.run_config.fault_tolerant:
        notes.append(f"fault tolerance: torchft; this launch is federation group {fl.group_index} of "
                     f"{layout.num_groups} ({accelerator.num_processes} ranks); its tokens/s and results are its own, "
                     f"in {args.output_dir}")
    accelerator.print("\n".join(f"[fl_accel] {line}" for line in banner + notes))


def start_run(plan: RunPlan, accelerator, parts: Parts, scheduler, figures: Figures) -> Run:
    """Collectives: the checkpoint resumed from (if any), the Meter, the :class:`Run`,
    its trackers, the pre-sync hooks (the deferred log's, ``--eval_groups``) and the tests'
    hooks; last, the clock's training time starts and this launch's batches begin at its own
    data position (the torchft mode: not a healed count)."""
    args = plan.args
    completed_steps, restored = resume(accelerator, plan, parts.data.stream)
    lost = restored.get("earlier_session_step", 0)
    if accelerator.run_config.fault_tolerant and lost >= accelerator.federation.round_length:  # it had passed a sync
        accelerator.federation.require_heal(lost)  # heal from a group holding a committed state, or StateLostError
    if accelerator.federation.triggered:  # a checkpoint is named by the federation's step; each group counts its own
        completed_steps = accelerator.federation.step
    clock = Clock(plan.t0, restored)
    meter = Meter(accelerator, clock, tokens_per_step=figures.launch_tokens_per_step, completed_steps=completed_steps,
                  flops_per_token=figures.flops_per_token, peak_tflops=figures.peak_tflops, restored=restored,
                  baseline_tokens_per_s=args.baseline_tokens_per_s)
    run = Run(plan=plan, accelerator=accelerator, model=parts.model, optimizer=parts.optimizer, scheduler=scheduler,
              data=parts.data, meter=meter, eval_every=figures.eval_every, config=parts.config,
              wandb_id=restored.get("wandb_id"), steps_per_epoch=parts.steps_per_epoch, start_step=completed_steps)
    run.start_trackers(n_params=parts.n_params, tokens_per_step=figures.tokens_per_step)
    if run.sync_log.deferred:  # world figures are summed at syncs (recipes/sync_log.py), the first hook
        accelerator.register_pre_sync_hook(lambda _sync, full: run.sync_log.pre_sync(accelerator.federation, full))
    if args.eval_groups and run.layout.num_groups > 1:
        accelerator.register_pre_sync_hook(run.evaluate_groups_before_sync)
    testing_hooks.install(parts.model, parts.optimizer, accelerator.process_index, completed_steps, parts.data.epoch,
                          group_index=accelerator.group_index, accelerator=accelerator)
    clock.start_training()
    run.batches = batches(parts.data, parts.train_loader, meter.data_steps, parts.steps_per_epoch,
                          args.gradient_accumulation_steps, accelerator)
    return run


def setup_record(plan: RunPlan, parts: Parts, figures: Figures) -> dict:
    """all_results.json's entries on what was set up: what ran, the peak host memory after
    prepare, the model's size, vocabulary and type, the precision."""
    return {**figures.what_ran, "peak_host_mb_after_prepare": parts.peak_host_mb, "n_params": parts.n_params,
            "vocab_size": parts.config.vocab_size, "model_type": parts.config.model_type,
            "mixed_precision": plan.mixed_precision}


# =========================================================================== the training loops
def select_training_loop(run: Run) -> Callable[[Run], None]:
    """The training loop of the run's mode, chosen once:

    * ``sync_trigger`` "time"/"speed" (``run.rounds``): :func:`train_rounds`;
    * ``--fault_tolerance torchft``: the fixed-steps loop :func:`train_steps` with
      ``heals=True``, its only difference in this mode: the line after a heal (:func:`report_heals`);
    * otherwise, fixed steps: :func:`train_steps`.
    """
    if run.rounds:
        return train_rounds
    if run.accelerator.run_config.fault_tolerant:
        return functools.partial(train_steps, heals=True)
    return train_steps


def optimizer_steps(run: Run) -> Iterator[int]:
    """The part of the training loop every mode shares, in run_clm_no_trainer's shape: each
    micro-batch's forward and backward under ``accelerator.accumulate``; a step is complete when
    ``accelerator.sync_gradients`` (gradients clipped, the optimizer and the LR scheduler
    stepped). The federated sync runs inside ``optimizer.step()`` (FLAccelerator's hook).
    Yields the step count (:meth:`recipes.metrics.Meter.step_done`) after each completed step;
    the caller's loop logs, evaluates, checkpoints and stops."""
    accelerator, model, optimizer, meter, args = run.accelerator, run.model, run.optimizer, run.meter, run.args
    for input_ids in run.batches:
        with accelerator.accumulate(model):
            loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                meter.set_grad_norm(accelerator.clip_grad_norm_(model.parameters(),
                                                                args.max_grad_norm or float("inf")))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        meter.micro_batch(loss)
        if accelerator.sync_gradients:
            run.scheduler.step()
            yield meter.step_done()


def train_steps(run: Run, heals: bool = False) -> None:
    """Fixed steps (``sync_trigger`` "steps"): every group does the run's ``max_steps``; logs,
    evaluations and checkpoints every ``--log_every``, ``--eval_every`` and
    ``--checkpoint_every`` steps of its own count. Also the torchft mode's loop, where a heal
    takes over a live group's count (:meth:`recipes.metrics.Meter.step_done`): ``heals``
    prints a line after each (:func:`report_heals`). Nothing to train when resumed at the end."""
    args, meter = run.args, run.meter
    if meter.completed_steps >= run.max_steps:
        return
    for step in optimizer_steps(run):
        run.progress.update(step - run.progress.n)  # 1, or more after a heal (Meter.step_done)
        if heals:
            report_heals(run, step)
        if step % args.log_every == 0 or step == run.max_steps:
            run.log_train()
        with meter.outside_training():
            if run.eval_every and step % run.eval_every == 0 and step < run.max_steps:
                run.evaluate(step)
            if args.checkpoint_every and step % args.checkpoint_every == 0 and step < run.max_steps:
                run.save_checkpoint(step)
        if step >= run.max_steps:
            break


def train_rounds(run: Run) -> None:
    """Rounds by time or speed (``sync_trigger`` "time"/"speed"), where each group counts its own
    steps: logs (their figures are a world collective), evaluations and checkpoints right after
    the round that crosses a multiple of their interval in federation steps
    (``accelerator.federation.progress_step``, agreed at the sync: the only points every group shares),
    until the federation has trained the run's tokens (``accelerator.federation.training_done``, decided
    at a sync: every group stops after the same one). Nothing to train when resumed at the end."""
    acc, args = run.accelerator, run.args
    if acc.federation.training_done:
        return
    last = acc.federation.progress_step  # the federation step at the end of the last round (resumed: its checkpoint's)
    for _ in optimizer_steps(run):
        if acc.federation.local_step:  # mid-round
            continue
        fed = acc.federation.progress_step
        run.progress.update(max(0, min(fed, run.max_steps) - run.progress.n))
        done = acc.federation.training_done
        if done or crossed(args.log_every, last, fed):  # a world collective (Meter.gather)
            run.log_train()
        with run.meter.outside_training():
            if not done and crossed(run.eval_every, last, fed):
                run.evaluate(fed)
            if not done and crossed(args.checkpoint_every, last, fed):
                run.save_checkpoint(fed)
        acc.federation.restart_round_clock()  # the speeds measured are the training steps' own
        last = fed
        if done:
            break


def crossed(every: int, last: int, step: int) -> bool:
    """A multiple of ``every`` lies in (``last``, ``step``] (never for ``every`` 0)."""
    return bool(every) and step // every > last // every


def report_heals(run: Run, step: int) -> None:
    """In the torchft mode, after each optimizer step: if this group healed since the last
    call, rank 0 of the group prints :func:`heal_line` (torchft's own log says "healing is
    required"; this says it is done, from where, and what it cost; the library's record has
    the step it continued from). Called by :func:`train_steps` in the torchft mode only."""
    accelerator = run.accelerator
    federation = accelerator.federation
    heals = federation.heals
    if heals <= run.heals_reported:
        return
    run.heals_reported = heals
    record = federation.heal_log[-1] if federation.heal_log else {}
    if accelerator.is_main_process:
        process.say(heal_line(accelerator.group_index, record, step))  # on a line of its own, past the progress bar


def heal_line(group_index: int, record: dict, step: int) -> str:
    """The line the recipe prints when its group healed: ``record`` is the transport's
    ``heal_sources`` entry (fl_accel/heal.py ``measure_heal``: source group,
    bytes over the group's ranks, seconds of the slowest rank, split into the transfer and the
    load), ``step`` the step the group continues from (the live group's count, taken over)."""
    src = record.get("source_group")
    nbytes = record.get("bytes")
    size = "? MB" if nbytes is None else f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.1f} kB"
    when, transfer, load = ("?" if record.get(k) is None else f"{record[k]:.2f}" if record[k] < 1 else
                            f"{record[k]:.1f}" for k in ("seconds", "transfer_seconds", "load_seconds"))
    return (f"[fl_accel] group {group_index} healed from group {'?' if src is None else src} at step {step}: "
            f"{size} in {when} s (transfer {transfer} s, load {load} s)")


# =========================================================================== entry point
def cli(argv=None) -> int:
    """The entry point (``python recipes/pretrain.py``, torchrun, ``accelerate launch``):
    :func:`main` inside the process plumbing of :mod:`recipes.process`. Exit status 0 when
    done; 2 for a refused input (a ValueError: RecipeError, DataError, CheckpointError,
    FLConfig's); 1 for a torchft group restarted without a state no group holds
    (StateLostError) or a failed collective; any other exception ends with its traceback."""
    process.install()  # SIGTERM/SIGINT end the rank with one line; it ends with its launcher; one-line warnings
    try:
        main(argv)
    except ValueError as exc:  # RecipeError, DataError, CheckpointError, FLConfig errors
        return process.refused(exc, status=2)
    except StateLostError as exc:  # torchft: restarted without a state, and no group holds one
        return process.refused(exc, status=1)
    except RuntimeError as exc:
        if process.classify_failure(exc) != "collective":
            raise
        return process.collective_failed(exc)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
