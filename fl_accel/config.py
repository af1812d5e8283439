"""FLConfig: the federation settings, loadable from YAML and the environment.

Precedence, lowest to highest: dataclass defaults < YAML file < ``FL_ACCEL_*``
environment variables < explicit keyword overrides (the recipe's flags).

The method is Mittone & Aldinucci, "Accelerating Sharded Data Parallelism at Scale
with Federated Learning", Euro-Par 2026, arXiv 2609.20359 (Sec. 3): the world is
split into federation groups; each group trains with FSDP (``fl_fsdp``) or HSDP
(``fl_hsdp``) and the groups average their parameters every ``sync_every`` optimizer
steps. The layout arithmetic (sizes, coordinates, process groups) lives in
:mod:`fl_accel.mesh`; this module only holds and checks the settings.

Construction checks each field's type and range (``__post_init__``) and the
constraints between fields; :meth:`FLConfig.validate` adds the checks that need the
world size. Both raise ``ValueError`` naming the field, in pure Python, so every rank
raises the same error before any collective.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import os
import textwrap
import typing
from dataclasses import dataclass, fields
from typing import Any, Literal, Mapping, get_args

import yaml

from .mesh import ALGORITHMS, FLLayout

OuterOptimizer = Literal["avg", "nesterov"]
DataSharding = Literal["global", "group"]
OnNonfinite = Literal["abort", "reset"]
SyncDtype = Literal["fp32", "bf16", "int8"]
GroupWeighting = Literal["size", "uniform"]
AnchorDevice = Literal["same", "cpu"]
Algorithm = Literal["fsdp", "hsdp", "fl_fsdp", "fl_hsdp"]
assert get_args(Algorithm) == ALGORITHMS

ENV_PREFIX = "FL_ACCEL_"

PLACEMENT_ONLY_FIELDS = ("anchor_device",)
"""FLConfig fields that choose where state lives, not what its values are: a run may
resume a checkpoint written with another value of them (checkpoint and run identity
checks leave them out)."""


@dataclass
class FLConfig:
    """Settings of the federated synchronization (paper Sec. 3, Alg. 1), plus streaming
    fragments and compressed exchange (Streaming DiLoCo, arXiv 2501.18512) and unequal
    federation groups.

    Raises:
        ValueError: at construction and from :meth:`validate`, naming the offending
            field, e.g. ``FLConfig.num_groups must be >= 1, got 0``.
    """

    algorithm: Algorithm = "fl_fsdp"
    """One of "fsdp", "hsdp" (baselines, one group spanning the world), "fl_fsdp",
    "fl_hsdp" (federation groups running FSDP or HSDP inside)."""

    num_groups: int = 2
    """F, the number of federation groups of equal size; must divide the world size.
    Ignored (taken as 1) by the baselines "fsdp" and "hsdp", so switching
    ``algorithm`` alone switches between an FL run and its baseline."""

    group_sizes: list[int] | None = None
    """Ranks per federation group, for groups of unequal size, e.g. [2, 4] on 6
    processes: contiguous rank blocks in that order, summing to the world size. Needs
    "fl_hsdp" and an ``hsdp_shard_size`` S dividing every size (group f then has
    size_f / S HSDP replicas). None: ``num_groups`` equal groups."""

    group_weighting: GroupWeighting = "size"
    """Weight of each group in the average: "size" (w_f = size_f / world, proportional
    to the samples a group processes per step) or "uniform" (w_f = 1/F, what the
    paper and xffl do). Identical for equal groups."""

    hsdp_shard_size: int | None = None
    """S, the number of ranks one HSDP replica shards over ("hsdp", "fl_hsdp"). Must
    divide every group size; R = G / S replicas per group. None: the ranks per node
    (LOCAL_WORLD_SIZE) when that divides the group. Ignored by "fsdp" and "fl_fsdp",
    which shard over the whole group."""

    sync_every: int = 8
    """H, the number of optimizer steps (after gradient accumulation) between two
    synchronizations of the same parameters. The paper uses H = 8."""

    num_fragments: int = 1
    """P, streaming fragments (Streaming DiLoCo): the FSDP units, in forward order, are
    dealt round-robin into P fragments, and one fragment is synchronized every H/P
    steps. 1: the whole model every H steps. ``sync_every`` must be a multiple of P."""

    sync_delay: int = 0
    """tau, optimizer steps between launching a fragment's exchange and applying its
    result; the exchange runs in the background meanwhile. 0 <= tau < H/P."""

    fragment_update_alpha: float = 0.0
    """alpha in [0, 1]: when a delayed result is applied, the parameters become
    global + alpha * (local - global). 0 takes the global result."""

    sync_dtype: SyncDtype = "fp32"
    """What crosses the "fl" axis: "fp32" (the exact mean of the parameters), "bf16" or
    "int8" (the mean of pseudo-gradients, quantized: int8 with one fp32 scale per
    block of 256 values; about 1/2 and 1/4 of the fp32 bytes)."""

    error_feedback: bool = False
    """For "bf16"/"int8": each rank keeps what quantization dropped from its
    pseudo-gradient and adds it to the next one (error feedback)."""

    outer_optimizer: OuterOptimizer = "avg"
    """"avg": plain FedAvg, the new parameters are the (weighted) mean over groups.
    "nesterov": DiLoCo (Douillard et al. 2023, arXiv 2311.08105): the
    pseudo-gradient ``anchor - mean`` is applied to the anchor (last synchronized
    parameters) with SGD and Nesterov momentum."""

    outer_lr: float = 0.7
    """Learning rate of the "nesterov" outer optimizer (DiLoCo default 0.7). With
    ``outer_lr=1`` and ``outer_momentum=0`` it reproduces "avg"."""

    outer_momentum: float = 0.9
    """Momentum of the "nesterov" outer optimizer (DiLoCo default 0.9), in [0, 1)."""

    average_optimizer_state: bool = False
    """Also average the inner optimizer's floating-point state tensors (e.g. AdamW
    exp_avg, exp_avg_sq) across groups at each full sync. Off by default, as in the
    paper, where optimizer state stays per group."""

    data_sharding: DataSharding = "global"
    """"global": every rank of the world reads a disjoint slice of the data (the
    paper's setting). "group": each group reads the whole dataset, split over its
    own ranks, in a group-specific shuffle order."""

    on_nonfinite: OnNonfinite = "abort"
    """What a sync does when a group's parameters or last loss hold NaN/Inf: "abort"
    raises naming the group and step; "reset" drops that group's contribution for
    the round and resets its parameters to the healthy groups' mean and its
    optimizer state to the healthy groups' mean state."""

    sync_bucket_mb: int = 256
    """Size, in MiB of fp32, of the flat buffers the sync packs local shards into.
    Larger buckets mean fewer collectives; smaller ones less extra memory."""

    anchor_device: AnchorDevice = "same"
    """Where the sync's fp32 outer state lives: the anchor (kept for "nesterov" or a
    compressed ``sync_dtype``), the "nesterov" momentum and the ``error_feedback``
    residuals. "same": on the parameters' device. "cpu": in host memory (pinned when
    the parameters are on CUDA), sparing per rank 4 bytes x the local shard's numel
    of accelerator memory for the anchor, and as much again for the momentum and for
    the residuals when used; the exchange stays on the accelerator and the values are
    the same (a checkpoint resumes with either setting)."""

    def __post_init__(self) -> None:
        self._check_fields()

    # ------------------------------------------------------------------ validation
    def _check_fields(self) -> None:
        """Types, ranges and constraints between fields; no world size needed."""
        hints = _type_hints(type(self))
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), hints[f.name])
        if self.group_sizes is not None:
            self.group_sizes = list(self.group_sizes)
            if not self.group_sizes:
                raise ValueError("FLConfig.group_sizes must list at least one group size, got []")
        for name in ("num_groups", "sync_every", "num_fragments", "sync_bucket_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"FLConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hsdp_shard_size is not None and self.hsdp_shard_size < 1:
            raise ValueError(f"FLConfig.hsdp_shard_size must be >= 1, got {self.hsdp_shard_size}")
        for size in self.group_sizes or ():
            if size < 1:
                raise ValueError(f"FLConfig.group_sizes must be positive, got {self.group_sizes}")
        if not self.outer_lr > 0:
            raise ValueError(f"FLConfig.outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"FLConfig.outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if not 0 <= self.fragment_update_alpha <= 1:
            raise ValueError(f"FLConfig.fragment_update_alpha must be in [0, 1], got {self.fragment_update_alpha}")
        if self.sync_every % self.num_fragments:
            raise ValueError(f"FLConfig.sync_every={self.sync_every} must be a multiple of "
                             f"FLConfig.num_fragments={self.num_fragments} (one fragment syncs every H/P steps)")
        period = self.sync_every // self.num_fragments
        if not 0 <= self.sync_delay < period:
            raise ValueError(f"FLConfig.sync_delay must satisfy 0 <= sync_delay < sync_every/num_fragments = "
                             f"{period}, got {self.sync_delay}")
        if self.group_sizes is not None and self.is_federated:
            if "num_groups" in self._explicit and self.num_groups != len(self.group_sizes):
                raise ValueError(f"FLConfig.num_groups={self.num_groups} disagrees with FLConfig.group_sizes="
                                 f"{self.group_sizes} ({len(self.group_sizes)} groups)")
            unequal = len(set(self.group_sizes)) > 1
            if unequal and self.algorithm == "fl_fsdp":
                raise ValueError(f"FLConfig.group_sizes={self.group_sizes} are unequal: algorithm 'fl_fsdp' needs "
                                 f"equal groups; use algorithm='fl_hsdp' with an hsdp_shard_size S dividing every "
                                 f"size (e.g. S={_gcd_all(self.group_sizes)})")
            if self.hsdp_shard_size is not None and self.uses_hsdp:
                bad = [g for g in self.group_sizes if g % self.hsdp_shard_size]
                if bad:
                    raise ValueError(f"FLConfig.hsdp_shard_size={self.hsdp_shard_size} must divide every group "
                                     f"size; it does not divide {bad} of group_sizes={self.group_sizes}")
        if self.group_sizes is not None and self.is_federated and len(set(self.group_sizes)) > 1 \
                and self.hsdp_shard_size is None:
            raise ValueError(f"FLConfig.hsdp_shard_size must be set for unequal group_sizes={self.group_sizes} "
                             f"(a shard size dividing every group size, e.g. {_gcd_all(self.group_sizes)})")

    @property
    def _explicit(self) -> set[str]:
        """Fields given a non-default value (used to tell 'num_groups left at its default')."""
        return {f.name for f in fields(self) if getattr(self, f.name) != f.default}

    def validate(self, world_size: int | None = None, ranks_per_node: int | None = None) -> "FLConfig":
        """Check every field, and, given ``world_size``, that the layout fits it.

        Pure Python: runs before any collective, so every rank raises the same
        error and nothing hangs. Returns ``self``.

        Raises:
            ValueError: naming the field: a wrong type or range, an unknown choice,
                ``sync_every`` not a multiple of ``num_fragments``, ``sync_delay`` out
                of range, a world size not divisible by ``num_groups``, group sizes
                not summing to the world, an ``hsdp_shard_size`` not dividing a group.
        """
        self._check_fields()
        if world_size is not None:
            FLLayout.from_config(self, world_size, ranks_per_node=ranks_per_node)
        return self

    @property
    def uses_hsdp(self) -> bool:
        """True for "hsdp" and "fl_hsdp"."""
        return self.algorithm in ("hsdp", "fl_hsdp")

    @property
    def is_federated(self) -> bool:
        """True for "fl_fsdp" and "fl_hsdp"."""
        return self.algorithm.startswith("fl_")

    @property
    def streaming(self) -> bool:
        """True when the sync is split into fragments, delayed, mixed or compressed."""
        return (self.num_fragments > 1 or self.sync_delay > 0 or self.fragment_update_alpha > 0
                or self.sync_dtype != "fp32")

    @property
    def keeps_outer_state(self) -> bool:
        """True when the sync keeps an fp32 anchor (and so honours ``anchor_device``):
        outer optimizer "nesterov" or a compressed ``sync_dtype``."""
        return self.outer_optimizer == "nesterov" or self.sync_dtype != "fp32"

    def ignored_settings(self) -> list[str]:
        """Non-default settings the chosen ``algorithm`` ignores, one sentence each.

        E.g. ``num_groups=3`` with "fsdp". The recipe and FLAccelerator warn about them once.
        """
        out = []
        if not self.is_federated:
            fl_only = ("num_groups", "group_sizes", "group_weighting", "sync_every", "num_fragments", "sync_delay",
                       "fragment_update_alpha", "sync_dtype", "error_feedback", "outer_optimizer", "outer_lr",
                       "outer_momentum", "average_optimizer_state", "on_nonfinite", "sync_bucket_mb",
                       "data_sharding", "anchor_device")
            for name in fl_only:
                if name in self._explicit:
                    out.append(f"{name}={getattr(self, name)!r} is ignored by algorithm {self.algorithm!r} "
                               f"(one group spans the world)")
        if not self.uses_hsdp and self.hsdp_shard_size is not None:
            out.append(f"hsdp_shard_size={self.hsdp_shard_size} is ignored by algorithm {self.algorithm!r} "
                       f"(it shards over the whole group)")
        if self.is_federated and self.outer_optimizer == "avg":
            for name in ("outer_lr", "outer_momentum"):
                if name in self._explicit:
                    out.append(f"{name}={getattr(self, name)!r} is ignored by outer_optimizer 'avg'")
        if self.error_feedback and self.sync_dtype == "fp32":
            out.append("error_feedback=True is ignored with sync_dtype 'fp32' (nothing is quantized)")
        if self.is_federated and self.anchor_device != "same" and not self.keeps_outer_state:
            out.append(f"anchor_device={self.anchor_device!r} is ignored with outer_optimizer 'avg' and "
                       f"sync_dtype 'fp32' (the sync keeps no anchor)")
        return out

    # ------------------------------------------------------------------ loading
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """The attribute docstring of each field, as one line (used for CLI help)."""
        return dict(_field_docs(cls))

    @classmethod
    def env_names(cls) -> dict[str, str]:
        """``FL_ACCEL_<FIELD>`` variable name -> field name, for every field."""
        return {ENV_PREFIX + name.upper(): name for name in cls.field_names()}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "dict") -> "FLConfig":
        """Build from a mapping; unknown keys raise ValueError naming them and the source."""
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"unknown FLConfig field(s) {unknown} in {source}; known: {cls.field_names()}")
        return cls(**dict(values))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides: Any) -> "FLConfig":
        """Load a YAML mapping (top level, or under an ``fl:`` key), then env, then overrides."""
        return cls.resolve(yaml_path=path, overrides=overrides)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "FLConfig":
        """Defaults overridden by ``FL_ACCEL_<FIELD>`` variables, then by ``overrides``."""
        return cls.resolve(environ=environ, overrides=overrides)

    @classmethod
    def resolve(
        cls,
        yaml_path: str | os.PathLike | None = None,
        yaml_values: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
        source: str | None = None,
    ) -> "FLConfig":
        """Merge defaults < YAML < environment < overrides and validate.

        ``source`` names where ``yaml_values`` came from, for error messages. ``None``
        values in ``overrides`` mean "not given". See :func:`resolve_sources` for where
        each value came from.

        Raises:
            ValueError: for unreadable YAML, unknown keys, or values of the wrong type.
        """
        values, _ = resolve_sources(yaml_path, yaml_values, environ, overrides, source, cls=cls)
        return cls.from_dict(values, source=str(yaml_path or source or "defaults"))


def resolve_sources(yaml_path=None, yaml_values=None, environ=None, overrides=None, source=None, cls=None):
    """The merged FLConfig values and, for each value, where it came from.

    Returns ``(values, sources)``: ``sources[field]`` is the YAML path (or ``source``),
    ``"FL_ACCEL_<FIELD>"``, or ``"override"``; fields left at their default are absent.

    Raises:
        ValueError: unreadable YAML, a YAML that is not a mapping, an unknown or
            unparsable ``FL_ACCEL_*`` variable.
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if yaml_path is not None:
        loaded = read_yaml_mapping(yaml_path, what="FL config")
        if "fl" in loaded:
            loaded = loaded["fl"] or {}  # an empty `fl:` section means the defaults
            if not isinstance(loaded, dict):
                raise ValueError(f"'fl:' in {yaml_path} must be a mapping, got {type(loaded).__name__}")
        values.update(loaded)
        sources.update({k: str(yaml_path) for k in loaded})
    if yaml_values:
        values.update(yaml_values)
        sources.update({k: source or "yaml" for k in yaml_values})
    env = env_overrides(os.environ if environ is None else environ, cls=cls or FLConfig)
    values.update(env)
    sources.update({k: ENV_PREFIX + k.upper() for k in env})
    for k, v in (overrides or {}).items():
        if v is not None:
            values[k] = v
            sources[k] = "override"
    return values, sources


def read_yaml_mapping(path: str | os.PathLike, what: str = "config") -> dict:
    """Read a YAML file holding a mapping (an empty file is ``{}``).

    Raises:
        ValueError: unreadable file, invalid YAML, non-UTF-8 text, or not a mapping.
    """
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


# ---------------------------------------------------------------------- field helpers
@functools.lru_cache(maxsize=None)
def _type_hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _gcd_all(values) -> int:
    import math

    out = 0
    for v in values:
        out = math.gcd(out, v)
    return out


def _check_type(name: str, value: Any, hint: Any) -> None:
    """Raise ValueError naming ``FLConfig.<name>`` unless ``value`` fits the annotation."""
    args = get_args(hint)
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in args:
            raise ValueError(f"FLConfig.{name} must be one of {list(args)}, got {value!r}")
        return
    if type(None) in args:  # X | None
        if value is None:
            return
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), get_args(hint)
    if origin is list:
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ValueError(f"FLConfig.{name} must be a list of integers, got {value!r}")
        return
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"FLConfig.{name} must be a boolean, got {value!r} ({type(value).__name__})")
    elif hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"FLConfig.{name} must be an integer, got {value!r} ({type(value).__name__})")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"FLConfig.{name} must be a number, got {value!r} ({type(value).__name__})")


def _field_docs(cls) -> list[tuple[str, str]]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    out = []
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
                and isinstance(nxt.value.value, str):
            out.append((node.target.id, " ".join(nxt.value.value.split())))
    return out


def parse_env_value(name: str, raw: str, cls=None) -> Any:
    """Parse the text of ``FL_ACCEL_<NAME>`` into the field's type (from its annotation).

    Raises:
        ValueError: naming the variable when the text does not parse.
    """
    hint = _type_hints(cls or FLConfig)[name]
    args = get_args(hint)
    text = raw.strip()
    var = f"{ENV_PREFIX}{name.upper()}"
    if type(None) in args:
        if text.lower() in ("", "none", "null"):
            return None
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is list:
        try:
            return [int(x) for x in text.replace(",", " ").split()]
        except ValueError:
            raise ValueError(f"{var}={raw!r} is not a list of integers (e.g. '2,4')") from None
    if hint is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{var}={raw!r} is not a boolean")
    if hint is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{var}={raw!r} is not an integer") from None
    if hint is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{var}={raw!r} is not a number") from None
    return text


def env_overrides(environ: Mapping[str, str], cls=None) -> dict[str, Any]:
    """Parse ``FL_ACCEL_<FIELD>`` variables into typed values of ``cls`` (FLConfig).

    Raises:
        ValueError: for an unknown ``FL_ACCEL_*`` name or an unparsable value.
    """
    cls = cls or FLConfig
    by_env = cls.env_names()
    out: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        if key not in by_env:
            raise ValueError(f"unknown environment variable {key}; known: {sorted(by_env)}")
        out[by_env[key]] = parse_env_value(by_env[key], raw, cls)
    return out
