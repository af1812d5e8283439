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

Where things live: recipes/args.py (flags), recipes/run_folder.py (checks before any
collective, the output folder, checkpoints), recipes/inputs.py (data), recipes/modeling.py
(models, optimizer, export), recipes/metrics.py (time, throughput, MFU, memory, traffic,
evaluation), recipes/sync_log.py (records summed over the world at syncs, so that federation
groups never wait for each other between syncs), recipes/banner.py (the start-up banner), recipes/host_load.py (the CPU load of
the machine meanwhile; psutil, imported lazily), recipes/plots.py
(curves.png), recipes/testing_hooks.py (the tests' fault injection and block recording,
switched on from the environment). FLOPs per token and MFU: fl_accel.planning.flops.

Run as a file, Python puts recipes/ (not the repository root) first on the module search
path: the recipe imports its siblings as ``recipes.x`` from the installed repository
(``pip install -e .``); it never edits the search path.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import math
import os
import secrets
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, TorchDynamoPlugin, set_seed
from tqdm.auto import tqdm
from transformers import get_scheduler

try:  # run as a file (accelerate launch / torchrun / python recipes/pretrain.py), the package is found
    import recipes  # noqa: F401  because it is installed (the module docstring)
except ModuleNotFoundError as exc:
    raise SystemExit("[fl_accel] error: recipes/pretrain.py imports its package 'recipes', which is not installed: "
                     "run `pip install -e .` in the repository root") from exc

import fl_accel  # fl_accel.FLAccelerator is looked up when built (a unit test replaces it)
from fl_accel.errors import record_for_launcher, release_process_groups, say_once
from fl_accel.fsdp_model import fsdp2_plugin
from fl_accel.ft_ends import StateLostError
from fl_accel.lr_schedule import lr_multiplier
from fl_accel.mesh import ranks_per_node
from fl_accel.planning.flops import model_flops_per_token, peak_tflops
from recipes import testing_hooks
from recipes.banner import banner_lines
from recipes.host_load import HostLoad
from recipes.inputs import batches, build_data, data_record, repeat_note, steps_per_epoch, stream_note
from recipes.memory_check import check_memory
from recipes.metrics import SCORED, Clock, Meter, eval_figures, eval_totals, evaluate, fl_accel_origin, \
    groups_differ_after_syncs, launch_seconds, peak_host_mb, scored
from recipes.modeling import build_model, build_optimizer, embedding_params, export_final_model, resolve_config
from recipes.plots import plot_run_curves
from recipes.run_folder import ROUNDS_LR_SCHEDULES, RunPlan, plan_run, prepare_output_dir, read_metrics, resume, \
    run_length_error, save_checkpoint
from recipes.sync_log import SyncLog, wait_text

# re-exported: tests and workers import these from the recipe
from recipes.args import RecipeError  # noqa: F401
from recipes.inputs import main_first  # noqa: F401  (tests/workers/api_worker.py)
from recipes.metrics import eval_batches  # noqa: F401
from recipes.run_folder import default_run_name, plan_layout, preflight, resolve_mixed_precision  # noqa: F401


# =========================================================================== main
def main(argv=None) -> dict:
    """Train as the flags, the recipe YAML and ``FL_ACCEL_*`` say; returns all_results.json's dict.

    A sequence of stages, the functions below in this order, the same on every rank (so every
    rank makes the same collectives in the same order); the training loop is the run's mode's,
    chosen once (:func:`select_training_loop`).

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


def tracker_config(config: dict) -> dict:
    """The run's config as every tracker takes it: TensorBoard's hyperparameters accept only
    numbers, strings and booleans, so other values (lists, None, dicts) become their JSON text."""
    return {k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v) for k, v in config.items()}


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
        accelerator.materialize(model, model._init_weights, seed=args.seed)
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


def add_session_results(results: dict, run: Run, host: HostLoad | None, launched: float | None) -> None:
    """The last stage before :func:`write_results`: all_results.json's ``session`` (this
    session's steps and seconds), ``host`` (the host-load meter's figures; null without
    psutil) and, in the torchft mode, ``fault_tolerance`` (:func:`fault_tolerance_results`)."""
    meter, clock = run.meter, run.meter.clock
    results["session"] = {"resumed_from_step": run.start_step, "steps": meter.completed_steps - run.start_step,
                          "launch_seconds": launched, "wall_seconds": sum(clock.session.values()), **clock.session}
    results["host"] = host.stop() if host is not None else None
    if run.accelerator.run_config.fault_tolerant:
        results["fault_tolerance"] = fault_tolerance_results(run.accelerator, meter)


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
        _say(heal_line(accelerator.group_index, record, step))  # on a line of its own, past the progress bar


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


# =========================================================================== one run's state
@dataclasses.dataclass
class Run:
    """The objects the loop, the logging and the final phase share."""

    plan: Any
    accelerator: Any
    model: Any
    optimizer: Any
    scheduler: Any
    data: Any
    meter: Any
    eval_every: int
    config: Any
    wandb_id: str | None = None
    batches: Any = None
    progress: Any = None
    group_evals: dict = dataclasses.field(default_factory=dict)
    sync_log: Any = None  # recipes.sync_log.SyncLog: records whose world figures wait for the next sync
    heals_reported: int = 0  # torchft mode: heals already announced (report_heals)
    steps_per_epoch: int | None = None  # map-style data (None: a stream)
    start_step: int = 0  # the step this session started from (resumed; under rounds: the federation's)

    @property
    def args(self):
        return self.plan.args

    fl = property(lambda self: self.accelerator.fl_config, doc="The run's FLConfig (the accelerator's run_config).")
    max_steps = property(lambda self: self.accelerator.max_steps, doc="The run's length (the accelerator's).")
    layout = property(lambda self: self.accelerator.layout, doc="The federation's layout (the accelerator's).")

    @property
    def rounds(self) -> bool:
        """A ``sync_trigger`` other than "steps": groups count their own steps (:func:`train_rounds`)."""
        return self.accelerator.federation.triggered

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.args.output_dir, "metrics.jsonl")

    def start_trackers(self, **extra) -> None:
        """W&B (offline unless WANDB_MODE says otherwise; the run id survives resumes), the progress bar
        and the log (``sync_log``: with several groups in this launch, figures summed at syncs)."""
        args, acc, layout = self.args, self.accelerator, self.layout
        if args.report_to != "none":
            self.wandb_id = self.wandb_id or secrets.token_hex(4)  # the main process's is used (it owns the tracker)
            ignored = set(self.fl.ignored_fields())  # e.g. num_groups for the baselines: not what ran
            run_config = {**dataclasses.asdict(args),
                          **{f"fl/{k}": v for k, v in self.fl.to_dict().items() if k not in ignored},
                          "fl/num_groups": layout.num_groups,  # the effective F (1 for the baselines)
                          "world_size": layout.world_size, "num_groups": layout.num_groups,
                          "group_sizes": list(layout.group_sizes), "shards": layout.shards,
                          "max_steps": self.max_steps, "model_flops_per_token": self.meter.flops_per_token, **extra}
            init_kwargs = {"wandb": {"group": args.experiment, "name": self.plan.run_name, "dir": args.output_dir,
                                     "tags": [self.fl.algorithm], "id": self.wandb_id, "resume": "allow"}}
            acc.init_trackers(args.wandb_project, config=tracker_config(run_config), init_kwargs=init_kwargs)
        self.progress = tqdm(total=self.max_steps, initial=self.meter.completed_steps, unit="step",
                             disable=not acc.is_local_main_process, desc=self.plan.run_name, dynamic_ncols=True)
        self.sync_log = SyncLog(  # several groups in this launch's world: they meet only at syncs
            deferred=acc.launch_layout.num_groups > 1, progress=self.progress,
            until=lambda step: wait_text(acc.federation, step, self.max_steps, args.checkpoint_every,
                                         self.rounds))

    def log(self, record: dict) -> None:
        """One record to W&B (numbers only) and metrics.jsonl (main process)."""
        if self.args.report_to != "none":
            self.accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float))},
                                 step=record["step"])
        if self.accelerator.is_main_process:
            with open(self.metrics_path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")

    def log_train(self) -> None:
        """This step's train record: taken now, summed over the world and written by ``sync_log``."""
        part, record = self.meter.train_snapshot(self.scheduler.get_last_lr()[0])
        fed = self.accelerator.federation.progress_step if self.rounds else None  # one step axis for every group

        def write(summed):
            rec = record(summed)
            if fed is not None:
                rec.update(step=fed, group_step=rec["step"])
            self.log(rec)
            self.sync_log.show(f"loss={rec['train/loss']:.3f}, {rec['perf/tokens_per_s'] or 0:,.0f} tokens/s over the "
                               f"last {self.args.log_every} steps")

        self.sync_log.add(self.meter.completed_steps if fed is None else fed, part, write)

    def evaluate_groups_before_sync(self, _synchronizer, full) -> None:
        """Pre-sync hook: each group's own model, scored right before the sync of an evaluation step."""
        step = self.accelerator.federation.step
        if self.rounds:  # groups at different steps: --eval_groups scores at the end only
            return
        if self.eval_every and step % self.eval_every == 0 and step < self.max_steps:
            self.group_evals[step] = evaluate(self.model, self.accelerator, self.data.val_blocks,
                                              self.args.micro_batch_size, per_group=True)

    def groups_in_last_sync(self) -> int | None:
        """The federation groups the last sync covered (None before any; torchft: the quorum's,
        and after the run's end, the groups ending with this group's model: :func:`groups_ending_alike`)."""
        end = self.accelerator.federation.end_state
        return groups_ending_alike(end) if end is not None else self.accelerator.federation.last_num_groups

    def evaluate(self, step: int, final: bool = False) -> tuple | None:
        """Score the model (and, with ``--eval_groups``, each group's), log and print what was scored
        (mid-run: when ``sync_log`` has summed it over the world). Returns the overall (perplexity,
        mean NLL, tokens) when written now (always when ``final``), else None."""
        args, layout, fl = self.args, self.layout, self.fl
        if final:
            self.sync_log.flush()  # the records of earlier steps first
        totals = eval_totals(self.model, self.accelerator, self.data.val_blocks, args.micro_batch_size)
        groups = self.group_evals.pop(step, [])
        if final and args.eval_groups and layout.num_groups > 1:
            groups = evaluate(self.model, self.accelerator, self.data.val_blocks, args.micro_batch_size, True)
        what = scored(fl, final, self.groups_in_last_sync())
        # ``step`` under rounds is the federation's: every group's tokens, not this group's own
        now = {"step": step, "tokens": step * self.meter.tokens_per_step if self.rounds else self.meter.tokens,
               "time_s": self.meter.clock.total("train_seconds"), "wall_s": self.meter.clock.wall_now(),
               "unix_time": time.time()}  # when: a restarted torchft group's sessions share step numbers
        done = []

        def write(summed):
            ppl, nll, tokens = eval_figures(summed)[0]
            record = {**now, "eval/perplexity": ppl, "eval/loss": nll, "eval/scored": what}
            if groups:
                record.update({f"eval/perplexity_group{f}": r[0] for f, r in enumerate(groups)})
                record.update({f"eval/loss_group{f}": r[1] for f, r in enumerate(groups)})
                record["eval/scored_groups"] = "after the final sync" if final else "before the sync"
            self.log(record)
            if self.accelerator.is_main_process:  # above the progress bar (tqdm.write clears and redraws it)
                self.progress.write(
                    f"[fl_accel] step {step}: eval perplexity {ppl:.2f} ({SCORED[what].split(' (')[0]})"
                    + (f"; each group's own model {record['eval/scored_groups']}: "
                       + ", ".join(f"group {f} {r[0]:.2f}" for f, r in enumerate(groups)) if groups else ""),
                    file=sys.stdout)
            done.append((ppl, nll, tokens))

        self.sync_log.add(step, totals, write)
        if final:
            self.sync_log.flush()
        return done[0] if done else None

    def save_checkpoint(self, step: int) -> None:
        """A checkpoint of the run at ``step`` (:func:`recipes.run_folder.save_checkpoint`), with the
        whole-run figures so far and the torchft counters."""
        self.sync_log.flush()  # a checkpoint is a world event: metrics.jsonl then holds every record up to it
        totals = {**self.meter.checkpoint_totals(self.wandb_id), "fault_tolerance": ft_counters(self.accelerator,
                                                                                               self.meter.restored)}
        save_checkpoint(self.accelerator, self.plan, step, self.max_steps, totals, self.data.stream,
                        rank_extra=self.meter.rank_state)


# =========================================================================== the end of a run
def finish(run: Run, recorded: dict) -> dict:
    """The final sync (all groups end identical), the final evaluation, checkpoint and export,
    and the whole-run figures (collective). Returns all_results.json's dict (without ``host``
    and ``session``, which :func:`add_session_results` adds)."""
    acc, args, fl, layout = run.accelerator, run.args, run.fl, run.layout
    passes = None
    if run.data.stream is not None:  # the most-read shard: ranks read shards of different lengths
        passes = torch.tensor([run.data.stream.epoch], dtype=torch.int64, device=acc.device)
        if dist.is_initialized():
            dist.all_reduce(passes, op=dist.ReduceOp.MAX)
        passes = int(passes.item())
        note = stream_note(passes, run.max_steps)
        if note:
            acc.print(f"[fl_accel] {note}")
    with run.meter.outside_training():
        step = acc.federation.progress_step if run.rounds else run.meter.completed_steps  # the same on every group
        synced = acc.sync_if_pending(final=True)
        end = acc.federation.wait_for_groups()  # torchft: the other groups reach the end (or are given up on)
        covered = run.groups_in_last_sync()
        if end is not None and end["together"] and covered == fl.federation_size:
            acc.print(f"[fl_accel] the run's end: all {covered} federation groups hold the same final model "
                      f"(checksum {end['checksum']:.6e})")
        elif scored(fl, True, covered) == "own group":
            waited = (f" after waiting {end['waited_s']:.0f} s for them (FLConfig.rejoin_timeout_s)"
                      if end is not None else "")
            acc.print(f"[fl_accel] warning: the last sync (step {step}) covered {covered} of the run's "
                      f"{fl.federation_size} federation groups (the others had ended or were down{waited}): this "
                      f"group's final model is its own and may differ from theirs")
        elif synced:
            acc.print(f"[fl_accel] final synchronization: the federation groups synchronized at step {step}")
        elif fl.is_federated:
            acc.print(f"[fl_accel] final synchronization: none needed (the groups synchronized at step {step})")
        ppl, nll, n_tokens = run.evaluate(step, final=True)
        if args.checkpoint_every:
            run.save_checkpoint(step)
        if args.save_final_model:
            export_final_model(run.model, run.config, run.data.tokenizer,
                               os.path.join(args.output_dir, "final_model"), acc.is_main_process)
    S_ = layout.shards
    return {
        "algorithm": fl.algorithm, "world_size": layout.world_size, "num_groups": layout.num_groups,
        "nodes": -(-acc.num_processes // ranks_per_node(acc.num_processes)),  # this launch's (scripts.compare)
        "group_sizes": list(layout.group_sizes),
        "group_size": layout.group_size if layout.is_uniform else list(layout.group_sizes),
        "replicas": layout.replicas if layout.is_uniform else [g // S_ for g in layout.group_sizes], "shards": S_,
        "group_weights": list(layout.weights(fl.group_weighting)) if fl.is_federated else [1.0],
        "sync_every": fl.sync_every if fl.is_federated else None, "fl": fl.to_dict(),
        "eval_perplexity": ppl, "eval_loss": nll, "eval_tokens": n_tokens,
        "eval_scored": scored(fl, final=True, groups_in_last_sync=covered),
        "data": data_record(run.meter.completed_steps, run.steps_per_epoch, passes),
        **run.meter.run_figures(), "model": args.model, **recorded, "run_name": run.plan.run_name,
        "args": dataclasses.asdict(args),
        "final_model": os.path.join(args.output_dir, "final_model") if args.save_final_model else None,
        "wandb_id": run.wandb_id, "counters": counters_scope(run), **(federation_figures(run) if run.rounds else {}),
    }


def groups_ending_alike(end: dict) -> int:
    """Of ``accelerator.federation.end_state`` (torchft mode): how many groups, this one
    included, ended with this group's final model (equal checksums in the last end quorum)."""
    return sum(1 for c in end["checksums"].values() if c == end["checksum"])


END_REPORT_VAR = "FT_LAUNCH_REPORT"
"""A file path (set by ``python -m scripts.ft_launch`` for each group's launch) where the
torchft mode's rank 0 writes :func:`end_report` at the end, for the launcher's summary."""


def end_report(run: Run, results: dict) -> dict:
    """What ``python -m scripts.ft_launch`` compares across groups at the end: the group, its
    steps, the final model's checksum (``federation.end_state``), whether every group ended
    together, the final eval perplexity and loss, and where the final model is."""
    end = run.accelerator.federation.end_state or {}
    return {"group": run.accelerator.group_index, "steps": results.get("steps"), "checksum": end.get("checksum"),
            "together": end.get("together"), "groups": end.get("groups"), "eval_perplexity": results["eval_perplexity"],
            "eval_loss": results["eval_loss"], "final_model": results.get("final_model"),
            "output_dir": run.args.output_dir}


def federation_figures(run: Run) -> dict:
    """all_results.json under ``sync_trigger`` "time"/"speed": ``rounds`` (:func:`round_results`),
    and ``steps``/``train_tokens``/``tokens_per_s`` of the whole federation (the same on every
    group), where :meth:`Meter.run_figures` counts this group's own steps."""
    rounds = round_results(run)
    step = run.accelerator.federation.progress_step
    return {"rounds": rounds, "steps": step, "train_tokens": step * run.meter.tokens_per_step,
            "tokens_per_s": rounds["tokens_per_s"]}


def round_results(run: Run) -> dict:
    """all_results.json's ``rounds`` (sync_trigger "time"/"speed"): per group the steps of each
    round, the share of its wall time spent waiting at syncs, its standalone tokens/s (its
    tokens per second of training, no waiting: its timed steps' mean), and the federation's
    tokens/s (every group's tokens over this process's training seconds, syncs included, as
    a "steps" run's ``tokens_per_s``) against their sum."""
    rounds = run.accelerator.federation.rounds
    summary = rounds.summary()
    per_rank_step = run.meter.tokens_per_step / run.layout.world_size
    standalone = [g * per_rank_step / t if t > 0 else None for g, t in
                  zip(rounds.sizes, [s / n if n else 0.0 for s, n in zip(rounds.train_s_total, rounds.timed_total)])]
    train_s = run.meter.clock.totals()["train_seconds"]  # this process's training time, syncs included
    federation = summary["rank_steps"] * per_rank_step / train_s if train_s else None
    known = [r for r in standalone if r is not None]
    return {**summary, "standalone_tokens_per_s": standalone, "tokens_per_s": federation,
            "of_standalone_sum": federation / sum(known) if federation and known else None}


def fault_tolerance_results(accelerator, meter) -> dict:
    """all_results.json's ``fault_tolerance`` entry (``--fault_tolerance torchft``): this
    launch's federation group and world size, how often it healed from a live group and
    each heal (``heal_log``: source group, step, bytes, seconds, transfer and load seconds;
    :func:`report_heals`), the sync's counters (``accelerator.federation.counters()``:
    global_step, num_syncs, ...), the optimizer steps this launch trained itself (``steps``
    minus those taken over in a heal), rank 0's host seconds in torchft's quorums and
    commit votes, and ``end``: how the run ended (``federation.end_state``: whether every
    group reached the end together, and their checksums). ``heals``, ``heal_log`` and ``torchft_seconds`` cover the whole run: a
    group resumed from its checkpoint adds the counts stored there (:func:`ft_counters`)."""
    counters = ft_counters(accelerator, meter.restored)
    return {"mode": accelerator.fl_config.fault_tolerance, "group_index": accelerator.group_index,
            "group_world_size": accelerator.num_processes, **counters, "sync": accelerator.federation.counters(),
            "steps_trained": meter.tokens // meter.tokens_per_step, "end": accelerator.federation.end_state}


def ft_counters(accelerator, restored: dict) -> dict:
    """``heals``, ``heal_log`` and ``torchft_seconds`` of the whole run: this session's (the
    torchft transport's) added to those a resumed checkpoint stored (``restored
    ["fault_tolerance"]``, written by :meth:`Run.save_checkpoint`); {} outside the torchft mode."""
    if not accelerator.run_config.fault_tolerant:
        return {}
    federation = accelerator.federation
    before = restored.get("fault_tolerance") or {}
    log = [{k: h.get(k) for k in ("source_group", "step", "bytes", "wire_bytes", "seconds", "transfer_seconds",
                                  "load_seconds")}
           for h in federation.heal_log]
    seconds = dict(before.get("torchft_seconds") or {})
    for k, v in federation.membership_seconds.items():
        seconds[k] = seconds.get(k, 0) + v
    return {"heals": int(before.get("heals", 0)) + federation.heals,
            "heal_log": list(before.get("heal_log") or []) + log, "torchft_seconds": seconds}


def counters_scope(run: Run) -> dict:
    """all_results.json's ``counters``: what the whole-run counters (tokens, seconds, bytes,
    calls and seconds by mesh axis, sync waits, torchft heals) cover. ``since``: "the run's
    start" (a fresh run, or one resumed from a checkpoint, which carried them over:
    ``carried_over_from``), or "this process's start" (an earlier session trained in this
    folder and ended before its first checkpoint, e.g. a torchft group killed and restarted:
    that session's counts are lost); ``steps_counted``: the optimizer steps they cover, this
    launch's own (a torchft group that healed took over ``steps`` it did not train)."""
    lost = bool(run.meter.restored.get("earlier_session_lost"))
    return {"since": "this process's start" if lost else "the run's start",
            "carried_over_from": run.plan.resume_path, "steps_counted": run.meter.data_steps}


def write_results(run: Run, results: dict) -> None:
    """all_results.json and curves.png (main process; without matplotlib no curves.png, one
    note instead), end of training, the closing lines."""
    acc, args, fl = run.accelerator, run.args, run.fl
    curves = False
    if results.get("rounds") and args.report_to != "none":  # the round figures on the W&B run too
        r = results["rounds"]
        acc.log({"fl/rounds/num_rounds": r["num_rounds"], "fl/rounds/tokens_per_s": r["tokens_per_s"] or 0.0,
                 **{f"fl/rounds/wait_share_group{f}": w for f, w in enumerate(r["wait_share"])},
                 **{f"fl/rounds/arrival_share_group{f}": a for f, a in
                    enumerate(results.get("sync_arrival_share_by_group") or []) if a is not None},
                 **{f"fl/rounds/steps_group{f}": n for f, n in enumerate(r["group_steps"])}})
    counters = results["counters"]
    if args.report_to != "none":  # what the whole-run counters cover, on the W&B run too
        acc.log({"perf/counters/since_process_start": int(counters["since"] == "this process's start"),
                 "perf/counters/steps_counted": counters["steps_counted"]})
    if acc.is_main_process:
        with open(os.path.join(args.output_dir, "all_results.json"), "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
        if acc.run_config.fault_tolerant and os.environ.get(END_REPORT_VAR):
            with open(os.environ[END_REPORT_VAR], "w", encoding="utf-8") as fh:
                json.dump(end_report(run, results), fh)
        try:
            import matplotlib  # noqa: F401  (optional: the recipe trains without it)
        except ImportError:
            print("[fl_accel] note: matplotlib is not installed: no curves.png (pip install matplotlib draws it)",
                  file=sys.stderr)
        else:
            try:  # the whole history, also after a resume
                plot_run_curves(read_metrics(run.metrics_path), os.path.join(args.output_dir, "curves.png"),
                                f"{run.plan.run_name} ({args.model})", sync_every=fl.sync_every if fl.is_federated
                                else None, num_fragments=fl.num_fragments)
                curves = True
            except Exception as exc:  # a plot must never fail a training run
                print(f"[fl_accel] could not draw curves.png: {exc}", file=sys.stderr)
    acc.end_training()
    if acc.is_main_process:
        wandb_dir = os.path.join(args.output_dir, "wandb")
        mfu = results["mfu"]
        print(f"[fl_accel] done: eval perplexity {results['eval_perplexity']:.2f} (loss {results['eval_loss']:.4f}) "
              f"after {results['steps']} steps, {results['tokens_per_s'] or 0:,.0f} tokens/s (the whole run's tokens over "
              f"its training time; the progress bar shows the last window's)"
              + (f", MFU {100 * mfu:.1f}%" if mfu is not None else "") + "\n"
              f"[fl_accel] results: {os.path.join(args.output_dir, 'all_results.json')}, metrics.jsonl"
              + (", curves.png" if curves else "")
              + (", final_model/" if args.save_final_model else "")
              + (f"\n[fl_accel] W&B offline run under {wandb_dir} (upload: wandb sync {wandb_dir}/offline-run-*)"
                 if args.report_to in ("wandb", "all") else "")
              + (f"\n[fl_accel] TensorBoard: tensorboard --logdir {os.path.join(args.output_dir, 'tensorboard')}"
                 if args.report_to in ("tensorboard", "all") else "") + arrival_line(results, fl.is_federated)
              + rounds_line(results.get("rounds")) + counters_line(counters))


def counters_line(counters: dict) -> str:
    """The closing line saying what tokens, time and traffic cover after a resume or restart
    (:func:`counters_scope`); "" for a run of one session."""
    if counters["since"] == "this process's start":
        return (f"\n[fl_accel] note: tokens, time and traffic count since this process started ("
                f"{counters['steps_counted']} steps): an earlier session in this folder ended before its first "
                f"checkpoint, and its counts are lost")
    if counters["carried_over_from"]:
        return (f"\n[fl_accel] tokens, time and traffic cover the whole run: the sessions before "
                f"{counters['carried_over_from']} carried over from it")
    return ""


def arrival_line(results: dict, federated: bool) -> str:
    """The closing line of a federated run: the share of each group's training time spent waiting
    for the other groups to arrive at the syncs (the exchange itself excluded)."""
    shares = results.get("sync_arrival_share_by_group") or []
    if not federated or len(shares) < 2 or any(a is None for a in shares):
        return ""
    return ("\n[fl_accel] waiting for the other groups at syncs (exchange excluded): "
            + ", ".join(f"group {f} {100 * a:.0f}%" for f, a in enumerate(shares)) + " of training time")


def rounds_line(rounds: dict | None) -> str:
    """The closing line of a ``sync_trigger`` "time"/"speed" run: per group its steps, its mean
    steps per round and its share of wall time in syncs (exchange included); the federation's
    tokens/s against the standalone sum."""
    if not rounds:
        return ""
    groups = "; ".join(f"group {f}: {n} steps ({n / max(1, rounds['num_rounds']):.1f}/round), in syncs "
                       f"{100 * w:.0f}%" for f, (n, w) in enumerate(zip(rounds["group_steps"], rounds["wait_share"])))
    share = rounds.get("of_standalone_sum")
    return (f"\n[fl_accel] {rounds['num_rounds']} rounds by {rounds['trigger']}: {groups}"
            + (f"; {rounds['tokens_per_s']:.0f} tokens/s = {100 * share:.0f}% of the groups' standalone sum"
               if share else ""))


# =========================================================================== entry point
def classify_failure(exc: BaseException) -> str | None:
    """'collective' when ``exc`` came out of torch.distributed (a peer died or hung: gloo
    raises a plain RuntimeError from inside torch.distributed, NCCL a DistBackendError),
    else None."""
    if isinstance(exc, (dist.DistError,)):
        return "collective"
    tb = exc.__traceback__
    while tb is not None:
        if f"torch{os.sep}distributed{os.sep}" in tb.tb_frame.f_code.co_filename:
            return "collective"
        tb = tb.tb_next
    return None


def _say(line: str) -> None:
    """One write per line, so lines of concurrent ranks sharing a pipe do not interleave; on a
    new line when this rank draws a progress bar (tqdm leaves its line open)."""
    bars = getattr(sys.modules.get("tqdm.std"), "tqdm", None)
    lead = "\n" if bars is not None and getattr(bars, "_instances", None) else ""
    sys.stderr.write(lead + line.replace("\n", " ") + "\n")
    sys.stderr.flush()


_STOPPING = []


def _on_sigterm(signum, frame):
    # torchrun sends SIGTERM to the surviving ranks when one rank fails. Exit at once: an
    # interpreter shutdown would run atexit handlers that wait on the dead peers.
    if not _STOPPING:
        _say(f"[fl_accel] rank {os.environ.get('RANK', '0')}: stopped by the launcher (another rank failed, "
             f"the job was cancelled or the launcher died)")
    sys.stdout.flush()
    os._exit(143)


def _on_sigint(signum, frame):
    # Ctrl-C (torchrun forwards it to every rank): one line per rank, then exit at once, so no
    # traceback of wherever the rank was and no atexit handler waiting on peers that left.
    _STOPPING.append(signum)
    _say(f"[fl_accel] rank {os.environ.get('RANK', '0')}: interrupted; resume with --resume_from_checkpoint latest "
         f"(checkpoints every --checkpoint_every steps)")
    sys.stdout.flush()
    os._exit(130)


def _one_line_warnings() -> None:
    """fl_accel's own warnings ("[fl_accel] ...") print as their message, on one line, not as
    ``file:line: UserWarning`` plus a source line."""
    default = warnings.formatwarning

    def fmt(message, category, filename, lineno, line=None):
        text = str(message)
        return text.replace("\n", " ") + "\n" if text.startswith("[fl_accel]") else \
            default(message, category, filename, lineno, line)

    warnings.formatwarning = fmt


def _timeout_text() -> str:
    """How the collective timeout was set (``FLConfig.collective_timeout_s``)."""
    env = os.environ.get("FL_ACCEL_COLLECTIVE_TIMEOUT_S")
    return (f"FL_ACCEL_COLLECTIVE_TIMEOUT_S={env} s" if env else
            f"FLConfig.collective_timeout_s, {fl_accel.FLConfig.collective_timeout_s:g} s unless the --config YAML sets it")


def _end_with_launcher() -> None:
    """Under torchrun/accelerate launch (LOCAL_RANK set), on Linux: SIGTERM this rank when its
    launcher dies (prctl(2) PR_SET_PDEATHSIG), so a SIGKILLed launcher (OOM killer, kill -9 of
    its process group) leaves no rank training on: torchrun starts each rank in its own session,
    out of reach of a group kill. The signal comes when the *thread* that forked the rank ends:
    torchrun's agent starts its workers from its main thread (elastic SubprocessContext, Popen),
    the tests' fork launcher from the fork server's main thread (tests/_forkserver.py); both live
    as long as the ranks. A launcher that died between the two getppid() calls is caught too
    (the rank was reparented); one gone before cli() ran (interpreter start-up) is not."""
    if not sys.platform.startswith("linux") or "LOCAL_RANK" not in os.environ:
        return
    parent = os.getppid()
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def cli(argv=None) -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, _on_sigint)
    _end_with_launcher()
    _one_line_warnings()
    rank = os.environ.get("RANK", "0")
    try:
        main(argv)
    except ValueError as exc:  # RecipeError, DataError, CheckpointError, FLConfig errors
        message = f"[fl_accel] error (rank {rank}): {exc}"
        _STOPPING.append("error")  # the launcher's SIGTERM that follows adds no line
        say_once(message, key=str(exc))  # once per node and message (every rank refuses alike)
        record_for_launcher(message)  # torchrun's Root Cause box shows it
        release_process_groups()
        return 2
    except StateLostError as exc:  # torchft: restarted without a state, and no group holds one
        message = f"[fl_accel] error (rank {rank}): {exc}"
        _STOPPING.append("error")
        say_once(message, key=str(exc))  # every rank of the group raises it alike
        record_for_launcher(message)
        release_process_groups()
        return 1
    except RuntimeError as exc:
        if classify_failure(exc) == "collective":
            message = (f"[fl_accel] error (rank {rank}): a collective failed; a peer rank died or hung (collective "
                       f"timeout {_timeout_text()}): {str(exc)[:500]}")
            _STOPPING.append("error")
            _say(message)
            record_for_launcher(message)
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(cli())
