"""FLConfig: the federation settings (paper Sec. 3), from YAML and the environment.

Precedence: defaults < YAML < ``FL_ACCEL_<FIELD>`` variables < keyword overrides (the
recipe's flags); ``FL_ACCEL_TEST_*`` (test hooks) are skipped. The merge and type rules
(:func:`resolve_sources`, :func:`check_type`) are shared with the recipe's parser, which
accepts and refuses the same values with the same words; layout checks live in
:mod:`fl_accel.mesh`. Every check raises ``ValueError`` naming the field (or variable), in
pure Python, so every rank raises it before any collective.

An :class:`FLConfig` is frozen and validated once, at construction: a changed copy is made
with ``dataclasses.replace`` (validated like a new one), e.g. :meth:`FLConfig.with_max_steps`.
The run-time config is :class:`ResolvedFLConfig`, made once by :func:`resolve_launch`
(:meth:`FLConfig.for_launch`) with the launch's layout and the run's length; ``FLAccelerator``
holds it (``accelerator.run_config``) and every reader reads it.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import os
import textwrap
import typing
from dataclasses import dataclass, fields
from typing import Any, Callable, Literal, Mapping, get_args

import yaml

from . import mesh
from .trigger import check_trigger


def read_yaml_mapping(path: str | os.PathLike, what: str = "config") -> dict:
    """A YAML mapping (empty file: ``{}``). ValueError: unreadable, invalid, not a mapping."""
    try:
        with open(path, encoding="utf-8") as fh:
            loaded = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {what} {path}: {exc}") from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"{what} {path} must be a YAML mapping, got {type(loaded).__name__}")
    return loaded


@functools.lru_cache(maxsize=None)
def _type_hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    args = get_args(hint)
    if type(None) in args and typing.get_origin(hint) is not Literal:
        return next(a for a in args if a is not type(None)), True
    return hint, False


CHOICE_HINTS = {
    ("algorithm", "diloco"): ": DiLoCo is a federated algorithm with the Nesterov outer optimizer: algorithm "
                             "'fl_fsdp' (or 'fl_hsdp') with outer_optimizer='nesterov' (recipe: --outer_optimizer "
                             "nesterov)",
    ("algorithm", "fedavg"): ": FedAvg is algorithm 'fl_fsdp' (or 'fl_hsdp') with outer_optimizer='avg', the default",
    ("algorithm", "localsgd"): ": local SGD with periodic averaging is algorithm 'fl_fsdp' with outer_optimizer='avg'",
    ("algorithm", "ddp"): ": for plain data parallelism use 'fsdp' (the baseline; FSDP2 over every rank)",
    ("outer_optimizer", "diloco"): ": DiLoCo's outer optimizer is 'nesterov'",
    ("outer_optimizer", "sgd"): ": 'nesterov' is SGD with Nesterov momentum (outer_momentum=0 gives plain SGD)",
}
"""(field, refused value) -> the hint appended to the "must be one of" error: names users bring
from papers and other libraries, mapped to this library's settings."""


def check_type(label: str, value: Any, hint: Any) -> None:
    """ValueError ``"<label> must be ..."`` unless ``value`` fits ``hint``: Literal, ``X | None``,
    ``list[int]``, bool, int, float (int or float), str (bool is no number)."""
    hint, optional = _unwrap_optional(hint)
    if optional and value is None:
        return
    if typing.get_origin(hint) is Literal:
        if value not in get_args(hint):
            raise ValueError(f"{label} must be one of {list(get_args(hint))}, got {value!r}"
                             + CHOICE_HINTS.get((label.rpartition(".")[2], str(value).lower()), ""))
        return
    if typing.get_origin(hint) is list:
        ok, what = isinstance(value, (list, tuple)) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value), "a list of integers"
    else:
        ok, what = {bool: (isinstance(value, bool), "a boolean"),
                    int: (isinstance(value, int) and not isinstance(value, bool), "an integer"),
                    float: (isinstance(value, (int, float)) and not isinstance(value, bool), "a number"),
                    str: (isinstance(value, str), "a string")}.get(hint, (True, ""))
    if not ok:
        raise ValueError(f"{label} must be {what}, got {value!r} ({type(value).__name__})")


def parse_env_value(var: str, raw: str, hint: Any) -> Any:
    """Parse variable ``var``'s text as ``hint``; ValueError naming ``var``."""
    text = raw.strip()
    hint, optional = _unwrap_optional(hint)
    if optional and text.lower() in ("", "none", "null"):
        return None
    try:
        if typing.get_origin(hint) is list:
            return [int(x) for x in text.replace(",", " ").split()]
        if hint is bool:
            return {"1": True, "true": True, "yes": True, "on": True,
                    "0": False, "false": False, "no": False, "off": False}[text.lower()]
        if hint in (int, float):
            return hint(text)
    except (KeyError, ValueError):
        what = {bool: "a boolean", int: "an integer", float: "a number"}.get(hint, "a list of integers (e.g. '2,4')")
        raise ValueError(f"{var}={raw!r} is not {what}") from None
    return text


ENV_PREFIX = "FL_ACCEL_"
TEST_ENV_PREFIX = "FL_ACCEL_TEST_"  # test hooks (FL_ACCEL_TEST_FAULT_INJECT, ...), skipped


def resolve_sources(cls, yaml_values: Mapping[str, Any] | None = None, yaml_source: str = "yaml",
                    environ: Mapping[str, str] | None = None,
                    overrides: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Merge YAML < ``FL_ACCEL_<FIELD>`` of ``environ`` (default ``os.environ``) < ``overrides``
    (None skipped) for the dataclass ``cls``. Returns ``(values, sources)``, a source being
    ``yaml_source``, the variable or "override". ValueError: a bad ``FL_ACCEL_*`` variable."""
    values, sources = dict(yaml_values or {}), dict.fromkeys(yaml_values or {}, yaml_source)
    env = env_overrides(os.environ if environ is None else environ, cls)
    values.update(env)
    sources.update({k: ENV_PREFIX + k.upper() for k in env})
    for k, v in (overrides or {}).items():
        if v is not None:
            values[k], sources[k] = v, "override"
    return values, sources


def env_overrides(environ: Mapping[str, str], cls=None) -> dict[str, Any]:
    """``cls``'s (default FLConfig) typed values from the ``FL_ACCEL_<FIELD>`` variables.
    ValueError: an unknown ``FL_ACCEL_*`` name or an unparsable value."""
    cls = FLConfig if cls is None else cls
    by_env = {ENV_PREFIX + name.upper(): name for name in cls.field_names()}
    hints = _type_hints(cls)
    out: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key.startswith(TEST_ENV_PREFIX):
            continue
        if key not in by_env:
            close = difflib.get_close_matches(key[len(ENV_PREFIX):].lower(), cls.field_names(), n=1)
            raise ValueError(f"unknown environment variable {key}"
                             f"{f' (did you mean {ENV_PREFIX}{close[0].upper()}?)' if close else ''}; "
                             f"known: {sorted(by_env)}")
        out[by_env[key]] = parse_env_value(key, raw, hints[by_env[key]])
    return out


Algorithm = Literal["fsdp", "hsdp", "fl_fsdp", "fl_hsdp"]
assert get_args(Algorithm) == mesh.ALGORITHMS


NOT_IDENTITY_FIELDS = ("outer_state_device", "collective_timeout_s", "group_index", "lighthouse_addr")
"""Fields that place state or bound waits without changing any value: left out of run and
checkpoint identity (a run may resume a checkpoint written with other values)."""


@dataclass(frozen=True)
class FLConfig:
    """Settings of the federated sync (paper Sec. 3, Alg. 1), fragments, sync delay, compressed exchange
    (Streaming DiLoCo, arXiv 2501.18512) and unequal groups. Frozen: assigning a field raises
    ``dataclasses.FrozenInstanceError``; ``dataclasses.replace(config, **changes)`` makes a changed copy.
    ValueError naming the field, at construction (and so in ``replace``)."""

    algorithm: Algorithm = "fl_fsdp"
    """Baselines "fsdp", "hsdp" (one group spans the world); "fl_fsdp", "fl_hsdp" (groups run FSDP/HSDP inside)."""
    num_groups: int = 2
    """F, equal federation groups; divides the world size. Taken as 1 by the baselines."""
    group_sizes: list[int] | None = None
    """Ranks per group for unequal groups, e.g. [2, 4] on 6 processes (contiguous blocks summing to the
    world size). Needs "fl_hsdp" and an ``hsdp_shard_size`` dividing each."""
    group_weighting: Literal["tokens", "size", "uniform"] = "tokens"
    """Weights of the mean: "tokens", the tokens each group trained on since the last sync (ranks x steps; with
    ``sync_trigger="steps"`` every group does H steps, so its size share); "size", w_f = size_f / world whatever
    the steps; "uniform", w_f = 1/F (the paper's). Equal groups doing equal steps: all the same."""
    hsdp_shard_size: int | None = None
    """S, the ranks one HSDP replica shards over; divides every group size (R = G / S). None: the ranks per
    node (LOCAL_WORLD_SIZE) that divide the group."""
    sync_every: int = 8
    """H, optimizer steps (after gradient accumulation) between two syncs of the same parameters (paper: 8)."""
    sync_trigger: Literal["steps", "time", "speed"] = "steps"
    """What ends a round (:mod:`fl_accel.trigger`): "steps", H steps in every group (the paper's); "time", every
    group trains ``sync_window_s`` seconds; "speed", group f trains H_f = H x t_slowest / t_f steps, t its measured
    seconds per step, so that the groups arrive together (the slowest group does H). "time"/"speed": blocking sync only (P=1, tau=0)."""
    sync_window_s: float | None = None
    """"time": seconds of training per round (each group's own clock; evaluations between rounds excluded)."""
    num_fragments: int = 1
    """P: FSDP units, in forward order, are dealt round-robin into P fragments, one syncing every H/P steps."""
    sync_delay: int = 0
    """tau, optimizer steps between launching a fragment's exchange and applying it; 0 <= tau < H/P."""
    fragment_update_alpha: float = 0.0
    """alpha in [0, 1]: a delayed result sets the parameters to global + alpha (local - global)."""
    sync_dtype: Literal["fp32", "bf16", "int8", "sparse"] = "fp32"
    """What crosses "fl": "fp32" (exact mean of the parameters); "bf16", "int8" (quantized mean of the
    pseudo-gradients: ~1/2, ~1/4 of the bytes); "sparse" (SparseLoCo, arXiv 2508.15706: top-k)."""
    sync_density: float = 1 / 64
    """"sparse": the share of every 4096 values sent (largest magnitudes), in (0, 1]."""
    sync_value_bits: int = 2
    """"sparse": bits per sent value, 2, 4 or 8 (a sign and a magnitude level)."""
    error_feedback: bool = False
    """Compressed: each rank adds what compression dropped to its next pseudo-gradient ("sparse" needs it)."""
    error_feedback_decay: float | None = None
    """beta in (0, 1]: the error-feedback buffer is multiplied by beta before it is added (e <- beta e + Delta,
    then e <- e - sent). None: 0.95 for "sparse" (SparseLoCo, arXiv 2508.15706), 1 for "bf16"/"int8"."""
    sparse_aggregation: Literal["senders", "zero_fill"] = "senders"
    """"sparse": "senders", each index's weighted mean over the groups that sent it (CCLoco); "zero_fill", the
    weighted sum with zeros where a group sent nothing (shrinks the update by about 1/F)."""
    final_sync: Literal["exact", "compressed"] = "exact"
    """Compressed: "exact", the end-of-training sync sends pseudo-gradient + error-feedback residual in fp32, so
    the final model carries everything the groups learned; "compressed", it uses ``sync_dtype`` like the others."""
    outer_optimizer: Literal["avg", "nesterov"] = "avg"
    """"avg": FedAvg, the weighted mean. "nesterov": DiLoCo (arXiv 2311.08105), SGD-Nesterov on anchor - mean."""
    outer_lr: float = 0.7
    """"nesterov" learning rate (DiLoCo: 0.7); with 1 and ``outer_momentum=0`` it is "avg"."""
    outer_momentum: float = 0.9
    """"nesterov" momentum (DiLoCo: 0.9), in [0, 1)."""
    outer_lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """"nesterov" outer LR over the run (transformers' formulas: :func:`fl_accel.lr_schedule.lr_multiplier`)."""
    outer_lr_warmup_steps: int = 0
    """Optimizer steps of linear outer-LR warmup from 0 (any schedule)."""
    outer_lr_decay_steps: int | None = None
    """Optimizer steps of the "cosine"/"linear" decay to 0; None: the recipe's ``max_steps``."""
    average_optimizer_state: bool = False
    """Also average the inner optimizer's floating-point state (e.g. AdamW moments); off in the paper."""
    data_sharding: Literal["global", "group"] = "global"
    """"global": a disjoint slice per rank of the world (the paper). "group": each group reads all, shuffled."""
    on_nonfinite: Literal["abort", "reset"] = "abort"
    """NaN/Inf in a group at a sync: "abort" raises; "reset" resets it to the healthy groups' mean."""
    sync_bucket_mb: int = 256
    """MiB of fp32 per flat sync buffer; a blocking sync keeps at most two in flight."""
    outer_state_device: Literal["same", "cpu"] = "same"
    """Where the fp32 anchor, momentum and residuals live: "same" as the parameters, or "cpu" (pinned with
    CUDA), sparing 4 bytes x local numel each; same values, each resumes the other's checkpoints."""
    collective_timeout_s: float = 300.0
    """Seconds a collective (default and mesh groups) waits for a peer before failing instead of hanging."""
    fault_tolerance: Literal["none", "torchft"] = "none"
    """"none": one world, a dead rank ends the job. "torchft": each group is its own launch and torchft 0.2.0
    lets the live groups sync and a restarted one heal (:mod:`fl_accel.ft`); equal federated groups."""
    group_index: int | None = None
    """"torchft": this launch's group, 0 <= f < ``num_groups``; names it and picks its data slice."""
    lighthouse_addr: str | None = None
    """"torchft": the Lighthouse's address, e.g. ``http://127.0.0.1:29510``; None: ``TORCHFT_LIGHTHOUSE``."""

    def __post_init__(self) -> None:
        """Validate every field once (:func:`check_fields`); ``group_sizes`` given as a tuple is
        stored as a list. ValueError naming the field."""
        if isinstance(self.group_sizes, tuple):
            object.__setattr__(self, "group_sizes", list(self.group_sizes))
        check_fields(self)

    @property
    def federation_size(self) -> int:
        """F as configured: ``len(group_sizes)`` when given, else ``num_groups``."""
        return len(self.group_sizes) if self.group_sizes is not None else self.num_groups

    _explicit = property(lambda self: {f.name for f in fields(self) if getattr(self, f.name) != f.default})

    def validate(self, world_size: int | None = None, ranks_per_node: int | None = None) -> "FLConfig":
        """Check the layout against ``world_size`` ranks (:meth:`fl_accel.mesh.FLLayout.from_config`;
        the fields were checked at construction, and a frozen config cannot change since).
        Returns ``self``; ValueError naming the field (e.g. F not dividing the world)."""
        if world_size is not None:
            mesh.FLLayout.from_config(self, world_size, ranks_per_node=ranks_per_node)
        return self

    def for_launch(self, world_size: int, *, ranks_per_node: int | None = None,
                   max_steps: int | None = None) -> ResolvedFLConfig:
        """The one resolution of this config for a launch of ``world_size`` ranks
        (:func:`resolve_launch`): the layouts, the run's length and the config filled for it.
        ValueError naming the field, in pure Python (every rank, before any collective)."""
        return resolve_launch(self, world_size, ranks_per_node=ranks_per_node, max_steps=max_steps)

    def with_max_steps(self, max_steps: int) -> "FLConfig":
        """This config for a run of ``max_steps`` optimizer steps: a decaying outer-LR schedule
        ("cosine"/"linear") without ``outer_lr_decay_steps`` spans the run (a replaced copy with
        ``outer_lr_decay_steps=max_steps``); otherwise ``self``. Raises ValueError: ``max_steps``
        not a positive integer; the warmup not shorter than the run (naming
        ``FLConfig.outer_lr_warmup_steps`` and ``FLConfig.outer_lr_decay_steps``)."""
        check_max_steps(max_steps)
        if self.outer_lr_schedule == "constant" or self.outer_lr_decay_steps is not None:
            return self
        return dataclasses.replace(self, outer_lr_decay_steps=max_steps)

    uses_hsdp = property(lambda self: mesh.uses_hsdp(self.algorithm), doc='True for "hsdp" and "fl_hsdp".')
    is_federated = property(lambda self: mesh.is_federated(self.algorithm),
                            doc='True for "fl_fsdp", "fl_hsdp" (:func:`fl_accel.mesh.is_federated`, the one test).')

    fragmented = property(lambda self: self.num_fragments > 1 or self.sync_delay > 0 or self.fragment_update_alpha > 0,
                          doc="P > 1, tau > 0 or alpha > 0.")
    compressed = property(lambda self: self.sync_dtype != "fp32", doc='``sync_dtype`` is not "fp32".')

    @property
    def residual_decay(self) -> float:
        """beta of the error-feedback buffer: ``error_feedback_decay``, or its mode's default."""
        if self.error_feedback_decay is not None:
            return float(self.error_feedback_decay)
        return 0.95 if self.sync_dtype == "sparse" else 1.0

    keeps_outer_state = property(lambda self: self.outer_optimizer == "nesterov" or self.compressed,
                                 doc='The sync keeps an fp32 anchor ("nesterov" or a compressed exchange).')

    def sync_state(self, num_groups: int) -> dict[str, Any]:
        """The settings deciding which sync state exists on ``num_groups`` groups (a checkpoint's key)."""
        syncs = num_groups > 1  # F > 1 groups exchange something (one group keeps no sync state)
        return {"outer_optimizer": self.outer_optimizer if syncs else "avg",
                "sync_dtype": self.sync_dtype if syncs else "fp32",
                "error_feedback": bool(self.error_feedback and self.compressed and syncs),
                "num_fragments": self.num_fragments if syncs else 1}

    def _ignored(self) -> dict[str, tuple[str, str]]:
        """The one rule of what is ignored: field -> (mark, why), whatever the field's value; the
        first rule naming a field gives its reason."""
        alg, dtype = self.algorithm, self.sync_dtype
        rules = [  # (names, ignored when, mark, why)
            ([n for n in self.field_names() if n not in ("algorithm", "hsdp_shard_size", "collective_timeout_s",
                                                         "fault_tolerance")],
             not self.is_federated, f"by {alg}", f"by algorithm {alg!r} (one group spans the world)"),
            (["hsdp_shard_size"], not self.uses_hsdp, f"by {alg}",
             f"by algorithm {alg!r} (it shards over the whole group)"),
            (["outer_lr", "outer_momentum", "outer_lr_schedule", "outer_lr_warmup_steps", "outer_lr_decay_steps"],
             self.outer_optimizer == "avg", "by outer_optimizer 'avg'", "by outer_optimizer 'avg'"),
            (["sync_window_s"], self.sync_trigger != "time", f"with sync_trigger {self.sync_trigger!r}",
             f"with sync_trigger {self.sync_trigger!r} (only 'time' has a window)"),
            (["group_index", "lighthouse_addr"], self.fault_tolerance == "none", "outside torchft mode",
             "with fault_tolerance 'none' (one world)"),
            (["sync_density", "sync_value_bits", "sparse_aggregation"], dtype != "sparse",
             f"with sync_dtype {dtype!r}", f"with sync_dtype {dtype!r} (only 'sparse' uses it)"),
            (["error_feedback", "error_feedback_decay", "final_sync"], not self.compressed,
             "with sync_dtype 'fp32'", "with sync_dtype 'fp32' (nothing is quantized)"),
            (["error_feedback_decay"], self.compressed and not self.error_feedback, "without error_feedback",
             "without error_feedback (no residual to decay)"),
            (["outer_state_device"], not self.keeps_outer_state, "with outer_optimizer 'avg' and sync_dtype 'fp32'",
             "with outer_optimizer 'avg' and sync_dtype 'fp32' (the sync keeps no anchor)")]
        out: dict[str, tuple[str, str]] = {}
        for names, when, mark, why in rules:
            if when:
                for name in names:
                    out.setdefault(name, (mark, why))
        return out

    def ignored_fields(self) -> dict[str, str]:
        """The fields the ``algorithm`` and modes do not read, whatever their value, each with a
        short reason ("by fsdp", "outside torchft mode"): what the recipe's banner marks."""
        return {name: mark for name, (mark, _) in self._ignored().items()}

    def ignored_settings(self) -> list[str]:
        """Non-default settings the ``algorithm`` and modes ignore, one sentence each (the rule of
        :meth:`ignored_fields`)."""
        explicit = self._explicit
        return [f"{n}={getattr(self, n)!r} is ignored {why}" for n, (_, why) in self._ignored().items()
                if n in explicit]

    # ------------------------------------------------------------------ loading
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """The attribute docstring of each field, as one line (used for CLI help)."""
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        return {node.target.id: " ".join(nxt.value.value.split()) for node, nxt in zip(body, body[1:])
                if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)}

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides: Any) -> "FLConfig":
        """:meth:`resolve` of a YAML mapping (top level, or under an ``fl:`` key) and ``overrides``."""
        return cls.resolve(yaml_path=path, overrides=overrides)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "FLConfig":
        """:meth:`resolve` of the ``FL_ACCEL_<FIELD>`` variables and ``overrides``."""
        return cls.resolve(environ=environ, overrides=overrides)

    @classmethod
    def resolve(cls, yaml_path: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> "FLConfig":
        """Merge defaults < YAML < environment < overrides (None: not given) and validate.
        Raises ValueError: unreadable YAML, unknown keys (naming them and the source), values of the
        wrong type."""
        yaml_values = None
        if yaml_path is not None:
            yaml_values = read_yaml_mapping(yaml_path, what="FL config")
            if "fl" in yaml_values:
                yaml_values = yaml_values["fl"] or {}  # an empty `fl:` section means the defaults
                if not isinstance(yaml_values, dict):
                    raise ValueError(f"'fl:' in {yaml_path} must be a mapping, got {type(yaml_values).__name__}")
        values, _ = resolve_sources(cls, yaml_values, str(yaml_path), environ, overrides)
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"unknown FLConfig field(s) {unknown} in {yaml_path or 'overrides'}; known: "
                             f"{cls.field_names()}")
        return cls(**values)


def check_max_steps(max_steps: Any) -> None:
    """ValueError unless ``max_steps`` is a positive integer (optimizer steps)."""
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps must be a positive number of optimizer steps, got {max_steps!r}")


@dataclass(frozen=True)
class ResolvedFLConfig:
    """The run-time config: an :class:`FLConfig` resolved once against the launch (its world
    size and ranks per node) and, when known, the run's length. The one owner of the run's
    settings: :class:`fl_accel.FLAccelerator` holds it as ``run_config`` and every reader
    (the synchronizer, the checkpoint, ``accelerator.federation``, the recipe) reads it or
    the objects in it, never a copy kept in step by hand. Frozen (assigning raises
    ``dataclasses.FrozenInstanceError``); made only by :func:`resolve_launch`."""

    config: FLConfig
    """The config the run uses: ``source``, or with a decaying outer-LR schedule without
    ``outer_lr_decay_steps`` and a known ``max_steps``, a copy spanning the run
    (:meth:`FLConfig.with_max_steps`)."""
    source: FLConfig
    """The config as given (the run's identity: the fill above stays out of it)."""
    world_size: int
    """This launch's world (``WORLD_SIZE``; "torchft": one group's ranks)."""
    ranks_per_node: int | None
    layout: mesh.FLLayout
    """The federation's layout (every group; "torchft": F groups of ``world_size`` ranks)."""
    launch_layout: mesh.FLLayout
    """This launch's own world: ``layout``, or with "torchft" the group alone."""
    max_steps: int | None = None
    """The run's length in optimizer steps (None: not known yet)."""

    fault_tolerant = property(lambda self: self.config.fault_tolerance == "torchft",
                              doc='``fault_tolerance="torchft"``: each group is its own launch.')

    def with_max_steps(self, max_steps: int) -> ResolvedFLConfig:
        """The same launch resolved for a run of ``max_steps`` (``self`` when it already is):
        :func:`resolve_launch` of ``source``. ValueError as there."""
        if max_steps == self.max_steps and not isinstance(max_steps, bool):
            return self
        return resolve_launch(self.source, self.world_size, ranks_per_node=self.ranks_per_node, max_steps=max_steps)


def resolve_launch(config: FLConfig, world_size: int, *, ranks_per_node: int | None = None,
                   max_steps: int | None = None) -> ResolvedFLConfig:
    """Resolve ``config`` once for a launch of ``world_size`` ranks (``ranks_per_node``:
    ``LOCAL_WORLD_SIZE``, default ``world_size``) and, when given, a run of ``max_steps``
    optimizer steps: the federation's layout (:meth:`fl_accel.mesh.FLLayout.for_launch`), this
    launch's part of it, and the config filled for the run's length. Pure Python: raises
    ValueError naming the field (F not dividing the world, S not dividing a group, ``max_steps``
    not a positive integer, the outer-LR warmup not shorter than the run) on every rank before
    any process group is touched."""
    if not isinstance(config, FLConfig):
        raise ValueError(f"fl_config must be an FLConfig, got {type(config).__name__}")
    layout = mesh.FLLayout.for_launch(config, world_size, ranks_per_node=ranks_per_node)
    filled = config
    if max_steps is not None:
        check_max_steps(max_steps)
        filled = config.with_max_steps(max_steps)
    return ResolvedFLConfig(config=filled, source=config, world_size=world_size, ranks_per_node=ranks_per_node,
                            layout=layout, launch_layout=layout.launch_part(config), max_steps=max_steps)


def check_fields(cfg: FLConfig) -> None:
    """Types, ranges and constraints between the fields of ``cfg``, without a world size (run
    once, by ``FLConfig.__post_init__``). Raises ValueError naming the field."""
    hints = _type_hints(type(cfg))
    for f in fields(cfg):
        check_type(f"FLConfig.{f.name}", getattr(cfg, f.name), hints[f.name])
    for name, ok, what in (*((n, getattr(cfg, n) >= 1, ">= 1") for n in ("num_groups", "sync_every", "num_fragments",
                                                                          "sync_bucket_mb")),
                           ("outer_lr", cfg.outer_lr > 0, "> 0"),
                           ("outer_momentum", 0 <= cfg.outer_momentum < 1, "in [0, 1)"),
                           ("fragment_update_alpha", 0 <= cfg.fragment_update_alpha <= 1, "in [0, 1]"),
                           ("sync_density", 1 / 4096 <= cfg.sync_density <= 1,
                            "in [1/4096, 1] (at least one value of every 4096 is sent)"),
                           ("error_feedback_decay", cfg.error_feedback_decay is None
                            or 0 < cfg.error_feedback_decay <= 1, "None or in (0, 1]"),
                           ("sync_value_bits", cfg.sync_value_bits in (2, 4, 8), "2, 4 or 8"),
                           ("collective_timeout_s", cfg.collective_timeout_s > 0, "> 0 seconds")):
        if not ok:
            raise ValueError(f"FLConfig.{name} must be {what}, got {getattr(cfg, name)}")
    warmup, decay = cfg.outer_lr_warmup_steps, cfg.outer_lr_decay_steps
    if cfg.outer_lr_schedule != "constant" or warmup:
        if cfg.outer_optimizer != "nesterov":
            raise ValueError(f"FLConfig.outer_lr_schedule={cfg.outer_lr_schedule!r} with outer_lr_warmup_steps="
                             f"{warmup} needs outer_optimizer='nesterov' ('avg' has no outer LR)")
        if warmup < 0:
            raise ValueError(f"FLConfig.outer_lr_warmup_steps must be >= 0, got {warmup}")
        if decay is not None and not warmup < decay:
            raise ValueError(f"FLConfig.outer_lr_warmup_steps={warmup} must be shorter than the run "
                             f"(FLConfig.outer_lr_decay_steps={decay} optimizer steps)")
    check_trigger(cfg.sync_trigger, cfg.sync_window_s)
    if cfg.sync_trigger != "steps":
        if not cfg.is_federated:
            raise ValueError(f"FLConfig.sync_trigger={cfg.sync_trigger!r} needs federation groups: algorithm "
                             f"{cfg.algorithm!r} has one group spanning the world (use 'fl_fsdp' or 'fl_hsdp')")
        for name, value, plain in (("num_fragments", cfg.num_fragments, 1), ("sync_delay", cfg.sync_delay, 0),
                                   ("fragment_update_alpha", cfg.fragment_update_alpha, 0.0)):
            if value != plain:
                raise ValueError(f"FLConfig.{name}={value} is not supported with sync_trigger={cfg.sync_trigger!r}: "
                                 f"rounds of unequal length run the blocking sync only (num_fragments=1, "
                                 f"sync_delay=0, fragment_update_alpha=0)")
    if cfg.sync_dtype == "sparse" and not cfg.error_feedback:
        raise ValueError("FLConfig.error_feedback must be True with sync_dtype='sparse' (--error_feedback, "
                         "FL_ACCEL_ERROR_FEEDBACK=1): top-k leaves most of each pseudo-gradient for later syncs")
    if cfg.sync_every % cfg.num_fragments:
        raise ValueError(f"FLConfig.sync_every={cfg.sync_every} must be a multiple of "
                         f"FLConfig.num_fragments={cfg.num_fragments} (one fragment syncs every H/P steps)")
    period = cfg.sync_every // cfg.num_fragments
    if not 0 <= cfg.sync_delay < period:
        raise ValueError(f"FLConfig.sync_delay must satisfy 0 <= sync_delay < sync_every/num_fragments = "
                         f"{period}, got {cfg.sync_delay}")
    if cfg.fault_tolerance == "torchft":
        if not cfg.is_federated:
            raise ValueError(f"FLConfig.fault_tolerance='torchft' needs a federated algorithm ('fl_fsdp' or "
                             f"'fl_hsdp'), got algorithm={cfg.algorithm!r}")
        if cfg.group_sizes is not None and len(set(cfg.group_sizes)) > 1:
            raise ValueError(f"FLConfig.fault_tolerance='torchft' does not support unequal groups (group_sizes="
                             f"{cfg.group_sizes}): torchft pairs the ranks of the live groups by their rank inside "
                             f"the group, and a group heals rank by rank from a peer of the same size. Use equal "
                             f"groups (num_groups) or fault_tolerance='none'.")
        if cfg.group_index is None:
            raise ValueError("FLConfig.group_index must be set with fault_tolerance='torchft' (each federation "
                             "group is its own launch): FL_ACCEL_GROUP_INDEX=f or --group_index f")
        if not 0 <= cfg.group_index < cfg.federation_size:
            raise ValueError(f"FLConfig.group_index must be in [0, num_groups={cfg.federation_size}), got "
                             f"{cfg.group_index}")
    mesh.check_group_fields(cfg, explicit_num_groups="num_groups" in cfg._explicit)


def lighthouse_addr(config: FLConfig) -> str:
    """``FLConfig.lighthouse_addr`` or ``TORCHFT_LIGHTHOUSE``; ValueError (every rank, before any
    collective) when neither is set or torchft is missing."""
    addr = config.lighthouse_addr or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not addr:
        raise ValueError("fault_tolerance='torchft' needs the Lighthouse's address: set FLConfig.lighthouse_addr "
                         "(FL_ACCEL_LIGHTHOUSE_ADDR, --lighthouse_addr) or TORCHFT_LIGHTHOUSE, e.g. "
                         "http://127.0.0.1:29510 (scripts/ft_launch.py starts one)")
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"fault_tolerance='torchft' needs torchft: pip install torchft==0.2.0 ({exc})") from exc
    return addr


def start_notes(cfg: FLConfig, layout: "mesh.FLLayout", device_type: str, mixed_precision: str) -> list[str]:
    """The warnings printed once at start: ignored settings, a defaulted S, slow bf16 on CPU."""
    notes = cfg.ignored_settings()
    if cfg.uses_hsdp and cfg.hsdp_shard_size is None:
        notes.append(f"hsdp_shard_size not set: using S={layout.shards} (the ranks per node that divide every "
                     f"group)" + (f"; that leaves one replica per group (R=1): set hsdp_shard_size="
                                  f"{layout.shards // 2} (the recipe's --hsdp_shard_size {layout.shards // 2}) "
                                  f"for 2 replicas"
                                  if layout.max_replicas == 1 and layout.shards % 2 == 0 else ""))
    if device_type == "cpu" and mixed_precision != "no":
        notes.append(f"mixed_precision={mixed_precision!r} on CPU runs several times slower than fp32")
    return notes


# ---------------------------------------------------------------------- refusals of launcher settings
FP16_REASON = ("fp16 needs a loss scaler, and Accelerate's per-rank GradScaler can skip an optimizer step in one "
               "federation group only: the groups' step counters then diverge and the sync's collectives mismatch "
               "until they time out")


def _said(requested_by: str | Callable[[], str]) -> str:
    return requested_by() if callable(requested_by) else requested_by


def refuse_fp16(precision: str | None, requested_by: str | Callable[[], str]) -> None:
    """The one fp16 refusal (FLAccelerator's and the recipe's; in this module, which imports no
    torch, so that the recipe's planning refuses before importing it). Raises ValueError when
    ``precision`` is "fp16", naming ``requested_by`` (where the setting came from, or a function
    saying it, called only then) and the fix."""
    if str(precision or "no").lower() == "fp16":
        raise ValueError(f"fl_accel does not support fp16, requested by {_said(requested_by)}: use bf16 or 'no' "
                         f"there ({FP16_REASON})")


def refuse_whole_model_compile(compiles: bool, regional: bool, requested_by: str | Callable[[], str]) -> None:
    """The one whole-model-compile refusal (FLAccelerator's and the recipe's). Raises
    ValueError when ``compiles`` without ``regional`` compilation, naming ``requested_by`` (as
    :func:`refuse_fp16`): a whole-model ``torch.compile`` returns an OptimizedModule that
    bypasses FSDP2's hooks."""
    if compiles and not regional:
        raise ValueError(f"{_said(requested_by)} compiles the whole model, but fl_accel compiles regionally only (a "
                         f"whole-model torch.compile returns an OptimizedModule that bypasses FSDP2's hooks): set "
                         f"use_regional_compilation=True (TorchDynamoPlugin; in the Accelerate config "
                         f"dynamo_use_regional_compilation: true, each decoder layer is compiled in place)")
