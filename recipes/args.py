"""The recipe's arguments: one dataclass for the recipe, FLConfig for the federation.

Flags are derived from the dataclasses with ``transformers.HfArgumentParser``: every
field of :class:`RecipeArguments` and of :class:`fl_accel.FLConfig` is a flag
(``--sync_every 16``), a YAML key (recipe options at the top level, FLConfig fields
under ``fl:``) and, for FLConfig, an ``FL_ACCEL_<FIELD>`` variable, with no other
code to edit. Precedence, lowest to highest: defaults < ``--config`` YAML <
``FL_ACCEL_*`` < flags. :func:`parse_args` also reports where each non-default value
came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from fl_accel import wire
from fl_accel.config import NOT_IDENTITY_FIELDS, FLConfig
from fl_accel.mesh import world_size_from_env
from fl_accel.settings import CHOICE_HINTS, ENV_PREFIX, TEST_ENV_PREFIX, check_type, read_yaml_mapping, resolve_sources

from . import compat


class RecipeError(ValueError):
    """A bad argument or input; reported on every rank with a non-zero exit."""


def _help(text: str) -> dict:
    return {"help": " ".join(text.split())}


@dataclass
class RecipeArguments:
    """Everything of the pretraining recipe that is not an FLConfig field."""

    # ------------------------------------------------------------------ model
    model: str = field(default="tiny", metadata=_help(
        "preset (tiny, tiny-tied, llama3.2-1b, llama3.1-8b), or a config.json, a model folder or a hub id of any "
        "causal LM whose model class declares _no_split_modules (Llama, Qwen2, Mistral, ...)"))
    resize_vocab: bool = field(default=False, metadata=_help(
        "set a --model config's vocab_size to the tokenizer's size (the banner reports it); without it a "
        "vocabulary that differs from the tokenizer's is an error"))
    init_device: Literal["meta", "cpu"] = field(default="meta", metadata=_help(
        "meta: build on the meta device and initialize each rank's shard only (little host memory); "
        "cpu: build the full model on every rank first (an escape hatch)"))
    seq_len: int = field(default=256, metadata=_help("tokens per block"))
    # ------------------------------------------------------------------ data
    dataset_name: str = field(default="shakespeare", metadata=_help(
        "'shakespeare' (embedded, offline) or a datasets hub id"))
    dataset_config_name: str | None = field(default=None, metadata=_help("config of a hub dataset, e.g. 'tiny'"))
    train_file: str | None = field(default=None, metadata=_help(
        "local .txt/.json/.jsonl/.csv/.parquet file (with --streaming also a glob or comma list)"))
    validation_file: str | None = field(default=None, metadata=_help(
        "local validation text (else the dataset's validation split or a held-out part)"))
    text_column: str = field(default="text", metadata=_help("column holding the text"))
    validation_split_percentage: float = field(default=5.0, metadata=_help(
        "held-out share of the training rows when there is no validation split (map-style data)"))
    validation_holdout_docs: int = field(default=1000, metadata=_help(
        "--streaming without validation data: the first N training documents are held out for validation"))
    streaming: bool = field(default=False, metadata=_help(
        "stream and pack the training data on the fly (corpora that do not fit in memory); needs --max_steps"))
    tokenizer: str = field(default="bpe", metadata=_help(
        "'bpe' (train one on the training text) or a tokenizer name/path, e.g. meta-llama/Llama-3.1-8B"))
    vocab_size: int = field(default=8192, metadata=_help("vocabulary of the trained BPE"))
    cache_dir: str | None = field(default=None, metadata=_help("corpus/tokenizer cache; unset: ~/.cache/fl_accel"))
    preprocessing_num_workers: int | None = field(default=None, metadata=_help("datasets.map processes"))
    # ------------------------------------------------------------------ training
    micro_batch_size: int = field(default=4, metadata=_help("blocks per rank per forward (micro-batch)"))
    gradient_accumulation_steps: int = field(default=1, metadata=_help("micro-batches per optimizer step"))
    max_steps: int | None = field(default=None, metadata=_help("optimizer steps; unset: --num_epochs epochs"))
    num_epochs: int = field(default=1, metadata=_help("passes over the training blocks (map-style data)"))
    learning_rate: float = field(default=3e-4, metadata=_help("AdamW peak learning rate (paper)"))
    adam_beta1: float = field(default=0.9, metadata=_help("AdamW beta1"))
    adam_beta2: float = field(default=0.95, metadata=_help("AdamW beta2"))
    weight_decay: float = field(default=0.1, metadata=_help("AdamW weight decay"))
    warmup_ratio: float = field(default=0.1, metadata=_help("share of steps in linear warmup"))
    lr_scheduler_type: str = field(default="cosine", metadata=_help("transformers.get_scheduler name"))
    max_grad_norm: float = field(default=1.0, metadata=_help("gradient clipping norm; 0 disables clipping"))
    mixed_precision: Literal["auto", "no", "bf16"] = field(default="auto", metadata=_help(
        "auto: bf16 on GPUs that support it, else fp32. fp16 is not offered: its loss scaler can skip a step "
        "in one federation group only"))
    reduce_dtype: Literal["fp32", "bf16"] = field(default="fp32", metadata=_help(
        "under bf16: the dtype FSDP2 reduces gradients in (parameters and compute stay bf16, the loss fp32). "
        "fp32 (torchtitan's default) keeps the bits that summing bf16 gradient shards loses; bf16 reduces as "
        "plain Accelerate does"))
    activation_checkpointing: Literal["none", "full"] | None = field(default=None, metadata=_help(
        "full: recompute each decoder layer's activations in the backward (non-reentrant, applied per layer "
        "before sharding by Accelerate); none: keep them. Unset: what the Accelerate config says "
        "(fsdp_activation_checkpointing, default none)"))
    memory_check: Literal["refuse", "warn", "off"] = field(default="refuse", metadata=_help(
        "on CUDA, before preparing the model: the memory model's verdict for this run against the smallest GPU "
        "(python -m scripts.memory_model). refuse: stop a run that does not fit, naming the smallest fixes; warn: "
        "print them and go on; off: no check"))
    compile: bool = field(default=False, metadata=_help(
        "torch.compile each decoder layer in place (regional compilation, inductor), after activation "
        "checkpointing and before sharding"))
    peak_tflops: float | None = field(default=None, metadata=_help(
        "peak TFLOPS of one accelerator for MFU; unset: the dense bf16 peak of a known CUDA device "
        "(A100, H100, H200, ...), else MFU is not reported (null)"))
    seed: int = field(default=42, metadata=_help("model init and data order (the same on every rank)"))
    # ------------------------------------------------------------------ evaluation, logging, checkpoints
    eval_every: int = field(default=0, metadata=_help(
        "optimizer steps between evaluations (rounded up to a multiple of H); 0: at the end only"))
    eval_groups: bool = field(default=False, metadata=_help(
        "also evaluate each federation group's own model right before the sync of an evaluation step "
        "(eval/perplexity_group<f>)"))
    max_eval_blocks: int | None = field(default=None, metadata=_help("cap on validation blocks"))
    log_every: int = field(default=5, metadata=_help("optimizer steps between log records"))
    output_dir: str | None = field(default=None, metadata=_help("unset: outputs/<experiment>/<run_name>"))
    overwrite_output_dir: bool = field(default=False, metadata=_help(
        "start a fresh run in an output folder that holds another run's checkpoints and results (they are deleted)"))
    checkpoint_every: int = field(default=0, metadata=_help("optimizer steps between checkpoints; 0 disables"))
    checkpoints_total_limit: int = field(default=2, metadata=_help(
        "keep only the newest N checkpoints (as Accelerate's ProjectConfiguration.total_limit; the final export "
        "in final_model/ is not a checkpoint and always stays); 0 keeps every checkpoint"))
    resume_from_checkpoint: str | None = field(default=None, metadata=_help("'latest' or a step_N directory"))
    save_final_model: bool = field(default=True, metadata=_help(
        "export the final synchronized model with save_pretrained (safetensors + tokenizer) to <output_dir>/final_model"))
    report_to: Literal["wandb", "tensorboard", "all", "none"] = field(default="wandb", metadata=_help(
        "wandb (offline unless WANDB_MODE says otherwise), tensorboard (<output_dir>/tensorboard), all (both) or "
        "none; through Accelerate's trackers"))
    baseline_tokens_per_s: float | None = field(default=None, metadata=_help(
        "the baseline's tokens/s (e.g. the FSDP run's all_results.json tokens_per_s): each log record then has "
        "perf/speedup_vs_baseline, all_results.json speedup_vs_baseline"))
    wandb_project: str = field(default="fl_accel", metadata=_help("W&B project"))
    experiment: str = field(default="shakespeare-tiny", metadata=_help(
        "W&B group: runs of one comparison share it"))
    run_name: str | None = field(default=None, metadata=_help("unset: algorithm and layout sizes"))

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(RecipeArguments)
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), hints[f.name])
        for name in ("seq_len", "micro_batch_size", "gradient_accumulation_steps", "num_epochs", "vocab_size",
                     "log_every", "validation_holdout_docs"):
            if getattr(self, name) < 1:
                raise RecipeError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "max_eval_blocks", "preprocessing_num_workers"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise RecipeError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "checkpoint_every", "checkpoints_total_limit", "max_grad_norm",
                     "weight_decay"):
            if getattr(self, name) < 0:
                raise RecipeError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if not self.learning_rate > 0:
            raise RecipeError(f"--learning_rate must be > 0, got {self.learning_rate}")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise RecipeError(f"--peak_tflops must be > 0, got {self.peak_tflops}")
        if self.baseline_tokens_per_s is not None and not self.baseline_tokens_per_s > 0:
            raise RecipeError(f"--baseline_tokens_per_s must be > 0, got {self.baseline_tokens_per_s}")
        if not 0 <= self.warmup_ratio < 1:
            raise RecipeError(f"--warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0 < self.validation_split_percentage < 100:
            raise RecipeError(f"--validation_split_percentage must be in (0, 100), got "
                              f"{self.validation_split_percentage}")
        if self.streaming and self.max_steps is None:
            raise RecipeError("--streaming needs --max_steps: a stream has no length (each rank restarts its shard "
                              "in a new epoch when it runs out, so every rank has data until the last step)")


def _check_type(name: str, value: Any, hint: Any) -> None:
    """Raise RecipeError ``--<name> must be ...`` unless ``value`` fits the annotation: the
    type rules of ``fl_accel.settings.check_type`` (one owner), shared with FLConfig."""
    try:
        check_type(f"--{name}", value, hint)
    except ValueError as exc:
        raise RecipeError(str(exc)) from None


def fl_values(fl_yaml: dict, config: str | None, environ, fl_cls=FLConfig) -> tuple[dict, dict]:
    """FLConfig values of the YAML's ``fl:`` section < ``FL_ACCEL_<FIELD>`` variables, and where
    each came from, by ``fl_accel.settings.resolve_sources`` (the library's merge; flags are
    applied on top by argparse).

    Raises:
        RecipeError: an unknown or unparsable ``FL_ACCEL_*`` variable.
    """
    environ = {k: v for k, v in environ.items() if not k.startswith(TEST_ENV_PREFIX)}
    try:
        return resolve_sources(fl_cls, yaml_values=fl_yaml, yaml_source=config or "yaml", environ=environ)
    except ValueError as exc:
        raise RecipeError(str(exc)) from exc


@dataclass
class ParsedArgs:
    """What :func:`parse_args` returns."""

    args: RecipeArguments
    fl: FLConfig
    sources: dict[str, str]
    """Where each non-default value came from: the YAML path, ``FL_ACCEL_<FIELD>``, or "flag"."""


def build_parser(fl_cls=FLConfig, **kwargs):
    """The HfArgumentParser over RecipeArguments and ``fl_cls``, plus ``--config``. A bad
    flag raises RecipeError (one line on every rank, repeated in torchrun's summary) instead
    of argparse printing its usage block and exiting."""
    from transformers import HfArgumentParser

    class _Parser(HfArgumentParser):
        def error(self, message):
            choice = re.match(r"argument --(\w+): invalid choice: '([^']*)'", message)
            hint = CHOICE_HINTS.get((choice.group(1), choice.group(2).lower()), "") if choice else ""
            raise RecipeError(f"{message}{hint} (python recipes/pretrain.py --help lists the options)")

    # allow_abbrev=False: argparse would take --num_frag for --num_fragments without a word
    parser = _Parser((RecipeArguments, fl_cls), description=__doc__.split("\n\n")[0], allow_abbrev=False, **kwargs)
    docs = fl_cls.field_docs()
    for action in compat.parser_actions(parser):
        if action.dest in docs and not action.help:
            action.help = docs[action.dest]
        if any(o.startswith("--no_") for o in action.option_strings) and not action.const:
            # HfArgumentParser gives --no_<flag> (store_false) the positive flag's help text and a
            # "(default: False)"; the positive flag, registered first, sets the default
            action.help, action.default = f"turn --{action.dest} off (it is on by default)", argparse.SUPPRESS
    parser.add_argument("--config", default=None, help="recipe YAML: any option at the top level, FLConfig "
                                                       "fields under 'fl:'")
    return parser


def _expand_lists(argv: list[str], list_flags: set[str]) -> list[str]:
    """``--group_sizes 2,4`` -> ``--group_sizes 2 4`` (HfArgumentParser takes lists space-separated)."""
    out, expand = [], False
    for token in argv:
        if token.startswith("--"):
            expand = token.split("=")[0] in list_flags
            if expand and "=" in token:
                flag, value = token.split("=", 1)
                out.append(flag)
                out.extend(v for v in value.split(",") if v)
                expand = True
                continue
            out.append(token)
        elif expand and "," in token:
            out.extend(v for v in token.split(",") if v)
        else:
            out.append(token)
    return out


def parse_args(argv: list[str] | None = None, environ=None, fl_cls=FLConfig) -> ParsedArgs:
    """Parse defaults < YAML (``--config``) < ``FL_ACCEL_*`` < flags into the two dataclasses.

    Raises:
        RecipeError: unreadable YAML, unknown keys (naming the file; an FLConfig field at
            the top level "belongs under 'fl:'"), values of the wrong type or range.
            argparse's own errors (an unknown flag, with a "did you mean"; a value outside the choices).
    """
    argv = list(os.sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(fl_cls)
    list_flags = {f"--{n}" for n, h in hints.items() if list in (typing.get_origin(h),
                                                                   *map(typing.get_origin, typing.get_args(h)))}
    argv = _expand_lists(argv, list_flags)
    parser = build_parser(fl_cls)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    recipe_names = {f.name for f in fields(RecipeArguments)}
    fl_names = set(fl_cls.field_names())
    values, fl_yaml = {}, {}
    if known.config:
        try:
            values = read_yaml_mapping(known.config, what="--config")
        except ValueError as exc:
            raise RecipeError(str(exc)) from exc
        fl_yaml = values.pop("fl", None) or {}
        if not isinstance(fl_yaml, dict):
            raise RecipeError(f"'fl:' in {known.config} must be a mapping, got {type(fl_yaml).__name__}")
        _check_yaml(known.config, values, fl_yaml, recipe_names, fl_names, fl_cls)
    fl_defaults, fl_sources = fl_values(fl_yaml, known.config, environ, fl_cls)
    # Which flags were given explicitly: parse once with a sentinel as every default.
    sentinel = object()
    probe = build_parser(fl_cls, add_help=False)  # --help is the real parser's to print
    probe.set_defaults(**{a.dest: sentinel for a in compat.parser_actions(probe)})
    given, _ = probe.parse_known_args(argv)
    flags = {k: v for k, v in vars(given).items() if v is not sentinel and k != "config"}
    _check_group_sizes_sum(flags, fl_defaults, fl_sources, environ)
    defaults = {**values, **fl_defaults}
    if defaults:
        parser.set_defaults(**defaults)
    sources = {**dict.fromkeys(values, known.config), **fl_sources, **dict.fromkeys(flags, "flag")}
    try:
        parsed = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False,
                                                    return_remaining_strings=True)
        recipe_args, fl, _rest = parsed[0], parsed[1], parsed[-1]  # (a namespace with --config in between)
    except (ValueError, TypeError) as exc:
        raise RecipeError(str(exc) + source_hint(str(exc), sources, fl_names)) from exc
    if _rest:
        flags_given = [t.split("=")[0] for t in _rest if t.startswith("--")]
        hints = [f + h for f in flags_given if (h := _did_you_mean(f[2:], recipe_names | fl_names, lambda n: f"--{n}"))]
        parser.error("unrecognized arguments: " + " ".join(_rest) + ("; " + ", ".join(hints) if hints else ""))
    defaults_of = {f.name: f.default for f in (*fields(RecipeArguments), *fields(fl_cls))}
    sources = {k: v for k, v in sources.items() if k in defaults_of}
    return ParsedArgs(recipe_args, fl, sources)


ALIASES = {"lr": "learning_rate", "batch_size": "micro_batch_size", "per_device_train_batch_size": "micro_batch_size",
           "epochs": "num_epochs", "num_train_epochs": "num_epochs", "steps": "max_steps", "max_train_steps":
           "max_steps", "block_size": "seq_len", "max_seq_length": "seq_len", "model_name_or_path": "model",
           "H": "sync_every", "F": "num_groups", "P": "num_fragments", "tau": "sync_delay",
           "anchor_device": "outer_state_device", "checkpointing_steps": "checkpoint_every"}
"""Names users bring from other trainers (run_clm_no_trainer, the paper's letters), for "did you mean"."""


def _did_you_mean(key: str, names, show=repr) -> str:
    """`` (did you mean <name>?)``: the ALIASES entry or the closest of ``names`` (difflib), as
    ``show`` spells it (a YAML key, ``--flag``, ``FL_ACCEL_VAR``); "" when nothing is close."""
    guess = ALIASES.get(key) if ALIASES.get(key) in names else None
    guess = guess or next(iter(difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.6)), None)
    return f" (did you mean {show(guess)}?)" if guess else ""


def _check_yaml(config: str, values: dict, fl_yaml: dict, recipe_names: set[str], fl_names: set[str],
                fl_cls) -> None:
    """Every unknown or misplaced key of a recipe YAML (each with a "did you mean") and every
    value that is wrong on its own (type, range), at once. Constraints between fields are
    checked after the merge with the environment and the flags, naming each value's source.

    Raises:
        RecipeError: naming the file, every bad key and every bad value.
    """
    keys, bad_values = [], []
    for key in values:
        if key in fl_names:
            keys.append(f"key {key!r} is an FLConfig field: it belongs under 'fl:'")
        elif key not in recipe_names:
            hint = _did_you_mean(key, recipe_names) or _did_you_mean(key, fl_names, lambda n: f"{n!r} under 'fl:'")
            keys.append(f"unknown key {key!r}{hint}")
    for key in fl_yaml:
        if key in recipe_names:
            keys.append(f"key {key!r} under 'fl:' is a recipe option: put it at the top level")
        elif key not in fl_names:
            keys.append(f"unknown FLConfig field {key!r} under 'fl:'{_did_you_mean(key, fl_names)}")
    # Types before argparse sees them (it would convert the string '2' to 2); a message that
    # does not start with "<field> must be" is a constraint with another field's default.
    for cls, section, label, names in ((RecipeArguments, values, "--", recipe_names),
                                       (fl_cls, fl_yaml, "FLConfig.", fl_names)):
        for key in (k for k in section if k in names):
            try:
                cls(**{key: section[key]})
            except ValueError as exc:
                if str(exc).startswith(f"{label}{key} must be "):
                    bad_values.append(str(exc).removeprefix("--"))
    counts = [f"{len(found)} bad {what}{'s' if len(found) > 1 else ''}"
              for found, what in ((keys, "key"), (bad_values, "value")) if found]
    if counts:
        raise RecipeError(f"{' and '.join(counts)} in --config {config}: " + "; ".join(keys + bad_values)
                          + " (python recipes/pretrain.py --help lists the options)")


def _check_group_sizes_sum(flags: dict, fl_defaults: dict, fl_sources: dict, environ) -> None:
    """Group sizes must sum to the world size: checked before anything else about them, so
    the first error a user sees is the one to fix first (not "unequal groups need fl_hsdp").

    Raises:
        RecipeError: naming where group_sizes was set and the launched world size.
    """
    if flags.get("group_sizes") is not None:
        value, source = flags["group_sizes"], "flag"
    elif fl_defaults.get("group_sizes") is not None:
        value, source = fl_defaults["group_sizes"], fl_sources.get("group_sizes", "")
    else:
        return
    try:
        world = world_size_from_env(environ)
    except ValueError as exc:
        raise RecipeError(str(exc)) from exc
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value) and sum(value) != world:
        raise RecipeError(f"{_origin('group_sizes', source, fl=True)} {','.join(map(str, value))} sums to {sum(value)} "
                          f"ranks, but {world} were launched (WORLD_SIZE): the group sizes must add up to the number "
                          f"of processes")


def _origin(name: str, source: str, fl: bool) -> str:
    """Where the user set ``name``: ``--name``, the variable, or the key in the YAML file ``source``."""
    if source == "flag":
        return f"--{name}"
    if source.startswith(ENV_PREFIX):
        return source
    return f"{name} under 'fl:' in {source}" if fl else f"{name} in {source}"


def source_hint(message: str, sources: dict[str, str], fl_names: set[str]) -> str:
    """`` (values from ...)``: where each field that ``message`` names was set, unless it says so already."""
    said = [_origin(n, s, n in fl_names) for n, s in sources.items() if re.search(rf"\b{n}\b", message)]
    said = [w for w in said if w not in message]
    return f" (values from {', '.join(said)})" if said else ""


def describe_sources(parsed: ParsedArgs, ignored: dict[str, str] | None = None,
                     fl: FLConfig | None = None) -> list[str]:
    """One line per non-default FLConfig value (or one a file, variable or flag set), saying
    where it came from; values from ``FL_ACCEL_*`` variables are marked, since a leftover
    variable silently changes a run, and so are the fields in ``ignored`` (those the
    algorithm and modes do not read, mapped to why: "by fsdp"), whatever their value.
    ``fl``: the values to describe (default ``parsed.fl``; the recipe's banner gives the
    resolved config, whose run-length fill is a default's)."""
    ignored, fl = ignored or {}, parsed.fl if fl is None else fl
    lines = []
    for f in fields(fl):
        value = getattr(fl, f.name)
        if value != f.default or f.name in parsed.sources:
            where = parsed.sources.get(f.name, "default")
            if f.name in ignored:
                where += f"; ignored {ignored[f.name]}"
            mark = "  <- environment variable" if where.startswith(ENV_PREFIX) else ""
            lines.append(f"{f.name}={value!r} ({where}){mark}")
    return lines


def run_identity(args: RecipeArguments, fl: FLConfig) -> dict[str, Any]:
    """The settings a checkpoint must share with a run that resumes it: everything that
    shapes the model, the data order and the optimization, except the step count and the
    FLConfig fields a resumed run may change (``NOT_IDENTITY_FIELDS``). Activation
    checkpointing and compile change neither values nor parameter names, so a run may
    resume with either setting; ``reduce_dtype`` and ``resize_vocab`` are recorded only when
    not at their default, so checkpoints written before they existed still resume (so is
    ``group_weighting`` "tokens" under ``sync_trigger="steps"``, recorded as the equal "size")."""
    keep = ("model", "seq_len", "dataset_name", "dataset_config_name", "train_file", "text_column", "streaming",
            "tokenizer", "vocab_size", "micro_batch_size", "gradient_accumulation_steps", "learning_rate",
            "adam_beta1", "adam_beta2", "weight_decay", "warmup_ratio", "lr_scheduler_type", "max_grad_norm",
            "seed", "mixed_precision")
    out = {k: getattr(args, k) for k in keep}
    defaults = {f.name: f.default for f in fields(RecipeArguments)}
    out.update({k: getattr(args, k) for k in ("reduce_dtype", "resize_vocab") if getattr(args, k) != defaults[k]})
    out["fl"] = {k: v for k, v in dataclasses.asdict(fl).items() if k not in NOT_IDENTITY_FIELDS}
    collectives = out["fl"].pop("sync_collectives")  # what "bf16"/"int8" ran, "auto" resolved; nothing otherwise
    if fl.sync_dtype in wire.QUANTIZED:
        out["fl"]["sync_collectives"] = wire.collectives(collectives, fl.federation_size)
    if fl.sync_trigger == "steps" and fl.group_weighting == "tokens":  # every group does H steps: its size share,
        out["fl"]["group_weighting"] = "size"  # as checkpoints written before "tokens" existed recorded it
    return out
