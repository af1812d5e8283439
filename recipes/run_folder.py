"""The run folder and everything checked before any process group exists.

:func:`plan_run` turns the command line, the recipe YAML, ``FL_ACCEL_*`` variables and
what ``accelerate launch`` exported from its own config into a :class:`RunPlan`, in pure
Python, identically on every rank: a bad input raises one :class:`RecipeError` on every
rank before any collective, so no rank is left waiting. :func:`prepare_output_dir`,
:func:`resume` and :func:`save_checkpoint` own the folder's contents afterwards::

    <output_dir>/metrics.jsonl  all_results.json  curves.png  checkpoints/step_N  final_model/  wandb/

With ``--fault_tolerance torchft`` each federation group is its own launch and writes the
same files into ``<output_dir>/group<f>``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Any

from fl_accel import FLConfig

from .args import ParsedArgs, RecipeArguments, RecipeError, parse_args, run_identity, source_hint

OLDER_CHECKPOINTS = {"sync_collectives": "all_to_all"}
"""Identity values of FLConfig fields a checkpoint written before the field existed ran with, where they
are not the field's default (a "bf16"/"int8" exchange was all-to-all, then all-gather)."""

OUTPUTS = ("checkpoints", "final_model", "wandb", "metrics.jsonl", "metrics.superseded.jsonl", "all_results.json",
           "curves.png")
"""What a run writes into its folder (``--overwrite_output_dir`` deletes exactly these)."""


@dataclasses.dataclass
class RunPlan:
    """What :func:`plan_run` decided, before the accelerator exists."""

    parsed: ParsedArgs
    resolved: Any
    """The :class:`fl_accel.config.ResolvedFLConfig` of the launched world (and of
    ``--max_steps`` when given): resolved once, here, and handed to FLAccelerator, which owns
    it from then on (``accelerator.run_config``; the run's length from ``--num_epochs`` is
    resolved there, before the model is prepared)."""
    run_name: str
    identity: dict
    """:func:`recipes.args.run_identity`: what a checkpoint must share with this run."""
    resume_path: str | None
    mixed_precision: str
    """"bf16" or "no" (fp32)."""
    activation_checkpointing: bool
    compile: bool
    sources: dict[str, str]
    """Where ``activation_checkpointing`` and ``compile`` came from (a flag or the Accelerate config)."""
    t0: float
    """``time.perf_counter()`` at the start of ``main``: the start of this session's wall time."""
    lock: Any = None
    """The :class:`recipes.run_lock.RunLock` of the output folder (held by rank 0 until the end)."""

    @property
    def args(self) -> RecipeArguments:
        return self.parsed.args

    @property
    def fl(self):
        """The resolved FLConfig (``resolved.config``; ``parsed.fl`` is the config as given)."""
        return self.resolved.config

    @property
    def layout(self):
        """The :class:`fl_accel.mesh.FLLayout` of the launched world (``resolved.layout``)."""
        return self.resolved.layout


def plan_run(argv=None, environ=None, t0: float | None = None) -> RunPlan:
    """Parse and check everything that needs no process group (see the module docstring).

    Raises:
        RecipeError: naming the flag, YAML key, environment variable or Accelerate config
            key that is wrong, and where it was set.
    """
    t0 = time.perf_counter() if t0 is None else t0
    environ = os.environ if environ is None else environ
    parsed = parse_args(argv, environ=environ)
    args, fl = parsed.args, parsed.fl
    check_lr_schedule(args, fl, parsed.sources)
    check_launcher(environ)
    from fl_accel.mesh import ranks_per_node, world_size_from_env

    try:
        world = world_size_from_env(environ)
        resolved = plan_config(fl, world, ranks_per_node(world, environ))
    except ValueError as exc:
        raise RecipeError(f"{exc}{source_hint(str(exc), parsed.sources, set(fl.field_names()))}") from exc
    layout = resolved.layout
    run_name = args.run_name or default_run_name(layout, fl)
    if args.output_dir is None:
        args.output_dir = os.path.join("outputs", args.experiment, run_name)
    if fl.fault_tolerant:  # each group is its own launch, with its own folder and results
        check_fault_tolerant(args)
        args.output_dir = os.path.join(args.output_dir, f"group{fl.group_index}")
    from .modeling import check_model

    check_model(args.model, args.seq_len)
    identity = run_identity(args, fl)
    lock = take_lock(args.output_dir, run_name, environ)  # before anything reads the folder's contents
    try:
        return _plan_rest(parsed, resolved, run_name, identity, lock, environ, t0)
    except BaseException:
        lock.release()  # refused: the folder is left as it was (no lock, no empty folder)
        raise


def _plan_rest(parsed, resolved, run_name, identity, lock, environ, t0) -> RunPlan:
    args = parsed.args
    if args.max_steps:  # the run's length, resolved with the launch (the decay it may fill stays out of the identity)
        try:
            resolved = resolved.with_max_steps(args.max_steps)
        except ValueError as exc:
            raise run_length_error(exc, args.max_steps) from exc
    resume_path = preflight(args, resolved.config, resolved.layout, identity)
    mixed = resolve_mixed_precision(args.mixed_precision, environ)
    ac, ac_source = resolve_activation_checkpointing(args, environ)
    compiled, compile_source = resolve_compile(args, environ)
    return RunPlan(parsed, resolved, run_name, identity, resume_path, mixed, ac, compiled,
                   {"activation_checkpointing": ac_source, "compile": compile_source}, t0, lock)


def take_lock(output_dir: str, run_name: str, environ):
    """The output-folder lock (:mod:`recipes.run_lock`), taken by the global rank 0 and
    checked by every other rank, before any process group exists.

    Raises:
        RecipeError: the folder is in use by another live run (named), on every rank.
    """
    from .run_lock import RunLock, RunLockError

    try:
        return RunLock(output_dir, run_name, rank=int(environ.get("RANK", 0) or 0), environ=environ).acquire()
    except RunLockError as exc:
        raise RecipeError(str(exc)) from exc


def run_length_error(exc: ValueError, max_steps: int) -> RecipeError:
    """The RecipeError of resolving the run's length (``ResolvedFLConfig.with_max_steps``, or
    ``FLAccelerator.set_max_steps``)
    refusing a run of ``max_steps``: a decaying outer-LR schedule's warmup is not shorter than
    the run; it names the flags that set the run's length."""
    return RecipeError(f"{exc}: the run has {max_steps} optimizer steps (--max_steps / --num_epochs)")


# =========================================================================== names and layout
def default_run_name(layout, fl) -> str:
    """``<algorithm>-F<F>-G<G>-S<S>-H<H>`` (G lists unequal sizes: ``G2_4``; no H for fsdp and
    hsdp, which never sync), plus the fragment and exchange settings when they differ from the
    defaults: sortable in W&B."""
    name = f"{fl.algorithm}-F{layout.num_groups}-{layout.sizes_label()}-S{layout.shards}"
    if fl.is_federated:
        name += f"-H{fl.sync_every}"
        if fl.num_fragments > 1 or fl.sync_delay:
            name += f"-P{fl.num_fragments}-tau{fl.sync_delay}" + ("-keep" if fl.delayed_local_steps == "keep" and
                                                                   fl.sync_delay else "")
        if fl.sync_warmup_steps:
            name += f"-warm{fl.sync_warmup_steps}"
        if fl.fragment_update_alpha:
            name += f"-a{fl.fragment_update_alpha:g}"
        if fl.sync_dtype != "fp32":
            name += f"-{fl.sync_dtype}" + ("ef" if fl.error_feedback else "")
        if fl.outer_optimizer != "avg":
            name += f"-{fl.outer_optimizer}"
    return name


def plan_config(fl, world: int, ranks_per_node: int | None = None):
    """``fl`` resolved for a launch of ``world`` ranks (:meth:`fl_accel.FLConfig.for_launch`,
    the resolution FLAccelerator takes as it is), with launch hints in the error.

    Raises:
        RecipeError: the layout does not fit the world (naming the field).
    """
    try:
        return fl.for_launch(world, ranks_per_node=ranks_per_node)
    except ValueError as exc:
        hint = ""
        if world == 1 and fl.is_federated and not fl.fault_tolerant:
            hint = (" In the recipe: pass --num_groups 1 or --algorithm fsdp, or "
                    "launch several processes (torchrun --nproc_per_node N recipes/pretrain.py ..., or "
                    "accelerate launch --config_file accelerate_configs/cpu_4proc.yaml recipes/pretrain.py ...).")
        raise RecipeError(f"{exc}.{hint}") from exc


def check_fault_tolerant(args) -> None:
    """Flags the torchft mode does not support (``FLConfig.fault_tolerance="torchft"``).
    Checkpoints are per group: ``<output_dir>/group<f>/checkpoints``, and
    ``--resume_from_checkpoint`` restarts one group (it then heals from live groups ahead
    of it, if any) or, given to every group, the whole federation.

    Raises:
        RecipeError: ``--eval_groups`` (a group's launch holds only its own model).
    """
    if args.eval_groups:
        raise RecipeError("--eval_groups is not supported with --fault_tolerance torchft: each group's launch "
                          "holds only its own model, and every group evaluates it into its own folder "
                          "(<output_dir>/group<f>)")


ROUNDS_LR_SCHEDULES = {"constant": ("constant", False), "constant_with_warmup": ("constant", True),
                       "linear": ("linear", True), "cosine": ("cosine", True)}
"""The ``--lr_scheduler_type`` names supported under ``sync_trigger`` "time"/"speed", where the
inner LR follows the federation's progress (recipes/pretrain.py ``build_lr_scheduler``): each
maps to the :func:`fl_accel.lr_schedule.lr_multiplier` schedule of transformers' formula of that
name and says whether it has the ``--warmup_ratio`` warmup (transformers' "constant" has none)."""


def check_lr_schedule(args, fl, sources: dict[str, str]) -> None:
    """Under ``sync_trigger`` "time"/"speed" the recipe builds the inner LR schedule itself (from
    :func:`fl_accel.lr_schedule.lr_multiplier`), for the names in :data:`ROUNDS_LR_SCHEDULES`
    only; with "steps" any ``transformers.get_scheduler`` name goes.

    Raises:
        RecipeError: another name under "time"/"speed", naming the flag and the supported names.
    """
    if fl.sync_trigger == "steps" or args.lr_scheduler_type in ROUNDS_LR_SCHEDULES:
        return
    message = (f"--lr_scheduler_type {args.lr_scheduler_type!r} is not supported with sync_trigger="
               f"{fl.sync_trigger!r} (the LR schedule follows the federation's progress, not a step count): "
               f"use one of {', '.join(ROUNDS_LR_SCHEDULES)}")
    raise RecipeError(message + source_hint(message, sources, set(fl.field_names())))


# =========================================================================== what the launcher exported
def launcher_config_file(environ=None) -> str | None:
    """The Accelerate config file of the ``accelerate launch`` that started this process:
    the ``--config_file`` on the launcher's command line (``/proc/<parent>/cmdline``; the
    launcher runs torch's elastic agent in its own process, so it is the parent), else
    Accelerate's default config when the parent is ``accelerate launch`` without one.
    None under torchrun, a plain ``python``, or where ``/proc`` is not readable."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
            argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return None
    # `accelerate launch ...` (console script) or `python -m accelerate.commands.accelerate_cli launch ...`
    if "launch" not in argv[:4] or not any(os.path.basename(a).startswith("accelerate") for a in argv[:3]):
        return None
    script = next((i for i, a in enumerate(argv) if a.endswith(".py") and i > 1), len(argv))
    argv = argv[:script]  # the launcher's own options, not the script's
    for i, token in enumerate(argv):
        if token == "--config_file" and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith("--config_file="):
            return token.split("=", 1)[1]
    from accelerate.commands.config.config_args import default_yaml_config_file

    return default_yaml_config_file if os.path.isfile(default_yaml_config_file) else None


def _where(key: str, variable: str, environ) -> str:
    """``"<key>: <value> in the Accelerate config <file>"``, or the variable when no file is known."""
    from fl_accel.settings import read_yaml_mapping

    path = launcher_config_file(environ)
    value = environ.get(variable)
    if path:
        try:
            cfg = read_yaml_mapping(path, "Accelerate config")
        except ValueError:
            cfg = {}
        fsdp = cfg.get("fsdp_config")
        in_file = cfg.get(key, fsdp.get(key) if isinstance(fsdp, dict) else None)  # fsdp_version sits under it
        if in_file is None:
            return (f"{key}: {value} from accelerate launch (its --{key} flag or default; the Accelerate config "
                    f"{path} does not set it; exported as {variable}={value})")
        if str(in_file).lower() != str(value).lower():  # the launch flag overrode the file
            return f"--{key} {value} given to accelerate launch (the Accelerate config {path} says {key}: {in_file})"
        return f"{key}: {value} in the Accelerate config {path} (accelerate launch exports it as {variable}={value})"
    return f"{variable}={value} (set by `accelerate launch` from its config's {key}, or by you)"


def check_launcher(environ) -> None:
    """Settings of an Accelerate config that fl_accel cannot honour, refused with the key to change.

    Imports no torch: planning refuses these before anything heavy is imported.

    Raises:
        RecipeError: ``fsdp_version`` other than 2 (fl_accel shards with FSDP2), fp16
            (:func:`resolve_mixed_precision`), or a whole-model ``torch.compile``
            (``dynamo_backend`` without ``dynamo_use_regional_compilation: true``: an
            ``OptimizedModule`` around the model bypasses FSDP2's hooks).
    """
    version = environ.get("FSDP_VERSION")
    if version is not None and version.strip() != "2":
        raise RecipeError(f"fl_accel needs FSDP2, got {_where('fsdp_version', 'FSDP_VERSION', environ)}: set "
                          f"fsdp_version: 2 under fsdp_config (accelerate_configs/cpu_4proc.yaml shows a complete one)")
    _refuse_launcher_fp16(environ)
    from fl_accel.refusals import refuse_whole_model_compile

    backend = environ.get("ACCELERATE_DYNAMO_BACKEND", "NO").upper()
    regional = environ.get("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "False").lower() in ("true", "1")
    try:
        refuse_whole_model_compile(backend not in ("NO", ""), regional,
                                   lambda: _where('dynamo_backend', 'ACCELERATE_DYNAMO_BACKEND', environ))
    except ValueError as exc:
        raise RecipeError(f"{exc}; or use the recipe's --compile") from exc


def _refuse_launcher_fp16(environ) -> str:
    """``ACCELERATE_MIXED_PRECISION`` in lower case; RecipeError when it is fp16, naming the
    Accelerate config key (fl_accel.config ``refuse_fp16``)."""
    from fl_accel.refusals import refuse_fp16

    launcher = environ.get("ACCELERATE_MIXED_PRECISION", "").lower()
    try:
        refuse_fp16(launcher, lambda: _where('mixed_precision', 'ACCELERATE_MIXED_PRECISION', environ))
    except ValueError as exc:
        raise RecipeError(str(exc)) from exc
    return launcher


def resolve_mixed_precision(flag: str, environ=None) -> str:
    """The precision to train in: the flag; "auto" takes bf16 from `accelerate launch
    --mixed_precision bf16` (ACCELERATE_MIXED_PRECISION), else bf16 on GPUs that support it,
    else fp32 ("no").

    Raises:
        RecipeError: fp16 requested by the launcher, naming the Accelerate config key (see
            FLAccelerator: its per-rank loss scaler can skip a step in one federation group only).
    """
    environ = os.environ if environ is None else environ
    launcher = _refuse_launcher_fp16(environ)
    if flag != "auto":
        return flag
    if launcher == "bf16":
        return "bf16"
    import torch

    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


def resolve_activation_checkpointing(args, environ) -> tuple[bool, str]:
    """``--activation_checkpointing`` when given, else the Accelerate config's
    ``fsdp_activation_checkpointing`` (exported as ``FSDP_ACTIVATION_CHECKPOINTING``).
    Returns (on, where it came from)."""
    if args.activation_checkpointing is not None:
        return args.activation_checkpointing == "full", "--activation_checkpointing"
    value = environ.get("FSDP_ACTIVATION_CHECKPOINTING")
    if value is not None:
        return value.lower() in ("true", "1"), "fsdp_activation_checkpointing in the Accelerate config"
    return False, "default"


def resolve_compile(args, environ) -> tuple[bool, str]:
    """``--compile``, or the Accelerate config's ``dynamo_backend`` with regional compilation."""
    if args.compile:
        return True, "--compile"
    if environ.get("ACCELERATE_DYNAMO_BACKEND", "NO").upper() not in ("NO", ""):
        return True, "dynamo_backend in the Accelerate config"
    return False, "default"


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
    from fl_accel.checkpoint import CheckpointError, check_compatible, find_latest, layout_meta, list_checkpoints, \
        read_meta

    from . import data as data_lib

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
        try:
            last = read_meta(old[-1][1]) if old else {}
        except CheckpointError:  # unreadable: the general advice below
            last = {}
        if old and _finished(last):
            raise RecipeError(f"the output folder {args.output_dir} holds a finished run (its checkpoint "
                              f"{os.path.basename(old[-1][1])} is step {last['completed_steps']} of "
                              f"{last['max_steps']}). Start over with --overwrite_output_dir (deletes it), or "
                              f"choose another --output_dir / --run_name")
        if old:
            raise RecipeError(f"the output folder {args.output_dir} already holds checkpoints "
                              f"{[os.path.basename(p) for _, p in old][-3:]} of a run. Continue that run with "
                              f"--resume_from_checkpoint latest, start over with --overwrite_output_dir (deletes "
                              f"them), or choose another --output_dir / --run_name")
        if os.path.isfile(os.path.join(args.output_dir, "all_results.json")):
            raise RecipeError(f"the output folder {args.output_dir} holds the results of a finished run (and no "
                              f"checkpoint to continue from). Start over with --overwrite_output_dir (deletes "
                              f"them), or choose another --output_dir / --run_name")
    if resume:
        if os.path.normpath(resume).endswith(".partial"):
            done = [os.path.basename(p) for _, p in list_checkpoints(os.path.dirname(os.path.normpath(resume)))]
            raise RecipeError(f"--resume_from_checkpoint {resume} is an unfinished save (interrupted while writing; "
                              f"a complete one is renamed to step_N): resume from a complete checkpoint "
                              f"({', '.join(done[-3:]) or 'none there'}) or with --resume_from_checkpoint latest")
        try:
            meta = read_meta(resume)
        except CheckpointError as exc:
            raise RecipeError(str(exc)) from exc
        try:
            check_compatible(meta, layout_meta(fl, layout))
        except CheckpointError as exc:
            raise RecipeError(f"{exc} The layout comes from the number of processes launched, --algorithm, "
                              f"--num_groups or --group_sizes, and --hsdp_shard_size; the sync state from the "
                              f"FLConfig flags. Or start over with --overwrite_output_dir, or choose another "
                              f"--output_dir / --run_name") from exc
        _check_resume(resume, meta, args, identity)
    return resume


def _finished(meta: dict) -> bool:
    """The checkpoint's run had trained all its ``max_steps``."""
    return meta.get("max_steps") is not None and meta.get("completed_steps", 0) >= meta["max_steps"]


def _check_resume(resume: str, meta: dict, args, identity: dict) -> None:
    theirs = meta.get("run_identity")
    if theirs is not None and isinstance(theirs.get("fl"), dict):  # FLConfig fields newer than the checkpoint
        defaults = {f.name: f.default for f in dataclasses.fields(FLConfig) if f.name in identity.get("fl", {})}
        defaults.update({k: v for k, v in OLDER_CHECKPOINTS.items() if k in defaults})
        theirs = {**theirs, "fl": {**defaults, **theirs["fl"]}}
    here = json.loads(json.dumps(identity))  # as the checkpoint stored it
    if theirs is not None and theirs != here:
        def flat(d: dict) -> dict:  # the FLConfig fields one by one: "fl.sync_every", not the whole "fl"
            fl = d.get("fl")
            return {**d, **{f"fl.{k}": v for k, v in fl.items()}, "fl": None} if isinstance(fl, dict) else d
        theirs, here = flat(theirs), flat(here)
        diff = sorted(k for k in set(theirs) | set(here) if theirs.get(k) != here.get(k))
        raise RecipeError(f"checkpoint {resume} was written by another run: {diff} differ "
                          f"(e.g. {diff[0]}={theirs.get(diff[0])!r} there, {here.get(diff[0])!r} here). "
                          f"Resume with that run's settings, or start over with --overwrite_output_dir")
    steps, their_max = meta.get("completed_steps", 0), meta.get("max_steps")
    if _finished(meta) and args.max_steps in (None, their_max):
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


# =========================================================================== the folder's contents
def prepare_output_dir(accelerator, args) -> None:
    """Create the run folder; with ``--overwrite_output_dir`` (and no resume) first delete
    what an earlier run wrote there (:data:`OUTPUTS`, nothing else). Collective (a barrier)."""
    if accelerator.is_main_process:
        if args.overwrite_output_dir and not args.resume_from_checkpoint:
            for name in OUTPUTS:
                path = os.path.join(args.output_dir, name)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.remove(path)
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()


def read_metrics(path: str) -> list[dict]:
    """The records of a ``metrics.jsonl`` ([] when absent). A last line cut short (its writer
    was killed mid-line) is left out; a bad line elsewhere raises ``json.JSONDecodeError``."""
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as fh:
        lines = [line for line in fh.read().splitlines() if line.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except ValueError:
            if i < len(lines) - 1:
                raise
    return out


SUPERSEDED = "metrics.superseded.jsonl"
"""Beside ``metrics.jsonl``: the records a resume took out of it (steps past the checkpoint it
resumed from, or every record of a session that left no checkpoint), each with
``"superseded": {"unix_time", "resumed_from_step"}``. Nothing a run logged is ever deleted."""


def resume(accelerator, plan: RunPlan, stream=None) -> tuple[int, dict]:
    """Load the checkpoint the plan resumes from (if any) and cut ``metrics.jsonl`` to the
    history up to it; the records cut are moved to :data:`SUPERSEDED`, never deleted. Every
    rank reads the file before the main process rewrites it (a barrier between; the rewrite
    is atomic). Collective. Returns ``(completed_steps, totals)``: ``totals`` are the
    whole-run figures stored with the checkpoint (seconds, peak memory, W&B id) plus this
    rank's own stored figures (``rank_extra`` of :func:`save_checkpoint`); {} when starting
    at step 0, ``{"earlier_session_lost": True, "earlier_session_step": N}`` when a resume
    found no checkpoint but ``metrics.jsonl`` holds an earlier session's records, up to step N
    (it ended before its first checkpoint: its traffic and time are not carried over)."""
    args = plan.args
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    earlier = read_metrics(metrics_path)  # every rank, before the main process rewrites it below
    completed_steps, totals = 0, {}
    if plan.resume_path:
        meta = accelerator.load_state(plan.resume_path)
        rank_state = meta.get("rank_state", {})
        completed_steps = int(meta["completed_steps"])
        totals = {**meta.get("totals", {}), **{k: v for k, v in rank_state.items() if k not in ("comm", "data")}}
        accelerator.comm_stats.load_dict(rank_state.get("comm", {}))
        if stream is not None:
            stream.load_state_dict(rank_state["data"])
        accelerator.print(f"[fl_accel] resumed from {plan.resume_path} at step {completed_steps}")
    elif args.resume_from_checkpoint:
        accelerator.print(f"[fl_accel] no complete checkpoint in {os.path.join(args.output_dir, 'checkpoints')}; "
                          f"starting from step 0")
        if earlier:  # an earlier session trained here and left no checkpoint
            totals["earlier_session_lost"] = True
            totals["earlier_session_step"] = max(int(r.get("step", 0)) for r in earlier)
    accelerator.wait_for_everyone()  # every rank has read metrics.jsonl
    if accelerator.is_main_process:
        keep = [r.get("step", 0) <= completed_steps if completed_steps else False for r in earlier]
        moved = [r for r, k in zip(earlier, keep) if not k]
        if moved:
            note = {"unix_time": time.time(), "resumed_from_step": completed_steps}
            with open(os.path.join(args.output_dir, SUPERSEDED), "a", encoding="utf-8") as fh:
                fh.writelines(json.dumps({**r, "superseded": note}) + "\n" for r in moved)
        tmp = metrics_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r) + "\n" for r, k in zip(earlier, keep) if k)
        os.replace(tmp, metrics_path)
    return completed_steps, totals


def checkpoint_bytes(n_params: int, param_bytes: int, num_groups: int, fl, mid_round: bool) -> int:
    """Estimated bytes of one checkpoint's tensors (``fl_accel/checkpoint.py``'s layout).

    The model's parameters (``n_params`` of ``param_bytes`` each, the stored dtype: fp32
    unless the parameters themselves are bf16) once, or once per federation group when
    ``mid_round`` (the groups differ); AdamW's two moments per group (once when one group,
    or ``average_optimizer_state`` right after a sync); the sync's fp32 anchor (a kept outer
    state: ``FLConfig.keeps_outer_state``) and outer momentum ("nesterov") once; the
    error-feedback residuals (fp32) once per group. With ``fault_tolerance="torchft"`` each
    group writes its own checkpoint: one group's state. RNG, scheduler and metadata files and
    DCP's per-tensor overhead are left out: the real folder is about 1% larger on the tiny
    preset (2.88M parameters), 6% on a 0.86M-parameter one. Measured against real checkpoints in tests/recipe/test_recipe_lifecycle.py.

    Args:
        num_groups: federation groups F of the run (1: FSDP/HSDP).
        fl: the run's ``FLConfig``.
    """
    F = num_groups if fl.is_federated else 1
    stored = 1 if fl.fault_tolerant else F  # torchft: each group checkpoints its own state
    per_copy = n_params * param_bytes
    synced = not mid_round or stored == 1
    total = per_copy * (1 if synced else stored)
    total += 2 * per_copy * (1 if stored == 1 or (synced and fl.average_optimizer_state) else stored)
    if F > 1 and fl.keeps_outer_state:
        total += 4 * n_params * (2 if fl.outer_optimizer == "nesterov" else 1)
    if F > 1 and fl.compressed and fl.error_feedback:
        total += 4 * n_params * stored
    return total


def checkpoints_mid_round(fl, num_groups: int, checkpoint_every: int) -> bool:
    """Whether some checkpoints of the run fall where the groups differ (every group's model
    stored): a federated run of F > 1 groups whose checkpoints are not all at full syncs
    (``checkpoint_every`` not a multiple of H under ``sync_trigger`` "steps", or fragments /
    alpha > 0, which leave the groups different between full syncs). The final checkpoint
    follows the final sync."""
    if not fl.is_federated or num_groups < 2 or not checkpoint_every:
        return False
    if fl.num_fragments > 1 or fl.fragment_update_alpha:
        return True
    return fl.sync_trigger == "steps" and checkpoint_every % fl.sync_every != 0


def save_checkpoint(accelerator, plan: RunPlan, step: int, max_steps: int, totals: dict, stream=None,
                    rank_extra=None) -> None:
    """``checkpoints/step_<step>`` (atomic): the federated state, the run's identity and
    whole-run totals, and per rank the comm counters, the data stream's position and
    ``rank_extra()`` (taken after the save's own collectives, so a resumed run counts them
    too). Prunes to ``--checkpoints_total_limit``. Collective."""
    from fl_accel.checkpoint import prune_checkpoints

    args = plan.args
    checkpoints_dir = os.path.join(args.output_dir, "checkpoints")

    def rank_state():
        state = {"comm": accelerator.comm_stats.as_dict(), **(rank_extra() if rank_extra else {})}
        if stream is not None:
            state["data"] = stream.state_dict()
        return state

    accelerator.save_state(os.path.join(checkpoints_dir, f"step_{step}"),
                           extra_meta={"completed_steps": step, "max_steps": max_steps, "totals": totals,
                                       "run_identity": plan.identity, "run_name": plan.run_name},
                           rank_state=rank_state)
    if args.checkpoints_total_limit and accelerator.is_main_process:
        prune_checkpoints(checkpoints_dir, args.checkpoints_total_limit)
