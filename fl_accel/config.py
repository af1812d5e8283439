"""FLConfig: the federation settings, loadable from YAML and the environment.

Precedence, lowest to highest: dataclass defaults < YAML file < ``FL_ACCEL_*``
environment variables < explicit keyword overrides.

The method is Mittone & Aldinucci, "Accelerating Sharded Data Parallelism at Scale
with Federated Learning", Euro-Par 2026, arXiv 2609.20359 (Sec. 3): the world is
split into ``num_groups`` federation groups of ``G = world_size / num_groups``
ranks; each group trains with FSDP (``fl_fsdp``) or HSDP (``fl_hsdp``) and the
groups average their parameters every ``sync_every`` optimizer steps.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

import yaml

ALGORITHMS = ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp")
OUTER_OPTIMIZERS = ("avg", "nesterov")
DATA_SHARDINGS = ("global", "group")
ON_NONFINITE = ("abort", "reset")
ENV_PREFIX = "FL_ACCEL_"


@dataclass
class FLConfig:
    """Settings of the federated synchronization (paper Sec. 3, Alg. 1).

    Raises:
        ValueError: from :meth:`validate` (called by every constructor helper and by
            ``FLAccelerator``) naming the offending field, e.g. ``num_groups``.
    """

    algorithm: str = "fl_fsdp"
    """One of "fsdp", "hsdp" (baselines, one group spanning the world), "fl_fsdp",
    "fl_hsdp" (federation groups running FSDP or HSDP inside)."""

    num_groups: int = 2
    """F, the number of federation groups. Must divide the world size. Ignored (taken
    as 1) by the baselines "fsdp" and "hsdp", so switching ``algorithm`` alone
    switches between an FL run and its baseline."""

    hsdp_shard_size: int | None = None
    """S, the number of ranks one HSDP replica shards over ("hsdp", "fl_hsdp"). Must
    divide the group size G; R = G / S replicas per group. Ignored by "fsdp" and
    "fl_fsdp", which shard over the whole group."""

    sync_every: int = 8
    """H, the number of optimizer steps (after gradient accumulation) between two
    synchronizations. The paper uses H = 8."""

    outer_optimizer: str = "avg"
    """"avg": plain FedAvg, the new parameters are the arithmetic mean over groups.
    "nesterov": DiLoCo-style (Douillard et al. 2023, arXiv 2311.08105): the
    pseudo-gradient ``anchor - mean`` is applied to the anchor (last synchronized
    parameters) with SGD and Nesterov momentum."""

    outer_lr: float = 0.7
    """Learning rate of the "nesterov" outer optimizer (DiLoCo default 0.7). With
    ``outer_lr=1`` and ``outer_momentum=0`` it reproduces "avg"."""

    outer_momentum: float = 0.9
    """Momentum of the "nesterov" outer optimizer (DiLoCo default 0.9), in [0, 1)."""

    average_optimizer_state: bool = False
    """Also average the inner optimizer's floating-point state tensors (e.g. AdamW
    exp_avg, exp_avg_sq) across groups at each sync. Off by default, as in the
    paper, where optimizer state stays per group."""

    data_sharding: str = "global"
    """"global": every rank of the world reads a disjoint slice of the data (the
    paper's setting). "group": each group reads the whole dataset, split over its
    own G ranks, in a group-specific shuffle order."""

    on_nonfinite: str = "abort"
    """What a sync does when a group's parameters hold NaN/Inf: "abort" raises
    naming the group and step; "reset" drops that group's contribution for the
    round and resets it to the mean of the healthy groups."""

    sync_bucket_mb: int = 256
    """Size, in MiB of fp32, of the flat buffers the sync packs local shards into.
    Larger buckets mean fewer collectives; smaller ones less extra memory."""

    # ------------------------------------------------------------------ validation
    def validate(self, world_size: int | None = None) -> "FLConfig":
        """Check types and ranges, and, given ``world_size``, the mesh arithmetic.

        Pure Python: runs before any collective, so every rank raises the same
        error and nothing hangs.

        Raises:
            ValueError: naming the field, for an unknown ``algorithm``,
                ``outer_optimizer``, ``data_sharding`` or ``on_nonfinite``; a
                non-integer or < 1 size; a world size not divisible by
                ``num_groups``; an ``hsdp_shard_size`` that does not divide the group.
        """
        def need_int(name: str, minimum: int = 1, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"FLConfig.{name} must be an integer, got {value!r} ({type(value).__name__})")
            if value < minimum:
                raise ValueError(f"FLConfig.{name} must be >= {minimum}, got {value}")

        def need_choice(name: str, choices: tuple[str, ...]) -> None:
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"FLConfig.{name} must be one of {list(choices)}, got {value!r}")

        need_choice("algorithm", ALGORITHMS)
        need_choice("outer_optimizer", OUTER_OPTIMIZERS)
        need_choice("data_sharding", DATA_SHARDINGS)
        need_choice("on_nonfinite", ON_NONFINITE)
        need_int("num_groups")
        need_int("sync_every")
        need_int("hsdp_shard_size", allow_none=True)
        need_int("sync_bucket_mb")
        for name in ("outer_lr", "outer_momentum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"FLConfig.{name} must be a number, got {value!r} ({type(value).__name__})")
        if not self.outer_lr > 0:
            raise ValueError(f"FLConfig.outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"FLConfig.outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if not isinstance(self.average_optimizer_state, bool):
            raise ValueError(
                f"FLConfig.average_optimizer_state must be a boolean, got {self.average_optimizer_state!r}"
            )
        if self.uses_hsdp and self.hsdp_shard_size is None:
            raise ValueError(f"FLConfig.hsdp_shard_size must be set for algorithm {self.algorithm!r}")
        if world_size is not None:
            self.sizes(world_size)
        return self

    @property
    def uses_hsdp(self) -> bool:
        """True for "hsdp" and "fl_hsdp"."""
        return self.algorithm in ("hsdp", "fl_hsdp")

    @property
    def is_federated(self) -> bool:
        """True for "fl_fsdp" and "fl_hsdp"."""
        return self.algorithm.startswith("fl_")

    def sizes(self, world_size: int) -> tuple[int, int, int]:
        """Return the mesh shape ``(F, R, S)`` for ``world_size`` ranks.

        F = effective number of groups (1 for the baselines), R = HSDP replicas per
        group (1 without HSDP), S = ranks one model copy is sharded over; F*R*S
        equals ``world_size``.

        Raises:
            ValueError: naming ``num_groups`` or ``hsdp_shard_size`` when they do not
                divide the world or the group.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        num_groups = self.num_groups if self.is_federated else 1
        if world_size % num_groups != 0:
            raise ValueError(
                f"FLConfig.num_groups={num_groups} does not divide the world size {world_size}: "
                f"every federation group needs the same number of ranks"
            )
        group_size = world_size // num_groups
        if self.uses_hsdp:
            shard = self.hsdp_shard_size
            if group_size % shard != 0:
                raise ValueError(
                    f"FLConfig.hsdp_shard_size={shard} does not divide the group size {group_size} "
                    f"(world size {world_size} / num_groups {num_groups})"
                )
            return num_groups, group_size // shard, shard
        return num_groups, 1, group_size

    def describe(self, world_size: int) -> str:
        """One-line summary, e.g. ``fl_fsdp F=2 G=2 R=1 S=2 H=8``; used in run names."""
        f, r, s = self.sizes(world_size)
        return f"{self.algorithm} F={f} G={r * s} R={r} S={s} H={self.sync_every}"

    # ------------------------------------------------------------------ loading
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "dict") -> "FLConfig":
        """Build from a mapping; unknown keys raise ValueError naming them and the source."""
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"unknown FLConfig field(s) {unknown} in {source}; known: {cls.field_names()}")
        return cls(**dict(values)).validate()

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

        ``source`` names where ``yaml_values`` came from, for error messages.

        Raises:
            ValueError: for unreadable YAML, unknown keys, or values of the wrong type.
        """
        values: dict[str, Any] = {}
        source = source or "defaults"
        if yaml_path is not None:
            source = str(yaml_path)
            try:
                with open(yaml_path, encoding="utf-8") as fh:
                    loaded = yaml.safe_load(fh) or {}
            except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
                raise ValueError(f"cannot read FL config {yaml_path}: {exc}") from exc
            if isinstance(loaded, dict) and "fl" in loaded:
                loaded = loaded["fl"] or {}  # an empty `fl:` section means the defaults
            if not isinstance(loaded, dict):
                raise ValueError(f"FL config {yaml_path} must be a mapping, got {type(loaded).__name__}")
            values.update(loaded)
        if yaml_values:
            values.update(yaml_values)
        values.update(env_overrides(os.environ if environ is None else environ))
        if overrides:
            values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_dict(values, source=source)


def _parse_env_value(name: str, raw: str, default: Any, annotation: str) -> Any:
    text = raw.strip()
    if "bool" in annotation:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a boolean")
    if "int" in annotation:
        if "None" in annotation and text.lower() in ("", "none", "null"):
            return None
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not an integer") from None
    if "float" in annotation:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a number") from None
    return text


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Parse ``FL_ACCEL_<FIELD>`` variables into typed FLConfig values.

    Raises:
        ValueError: for an unknown ``FL_ACCEL_*`` name or an unparsable value.
    """
    by_env = {ENV_PREFIX + f.name.upper(): f for f in fields(FLConfig)}
    out: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        if key not in by_env:
            raise ValueError(f"unknown environment variable {key}; known: {sorted(by_env)}")
        f = by_env[key]
        out[f.name] = _parse_env_value(f.name, raw, f.default, str(f.type))
    return out
