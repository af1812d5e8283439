"""FLConfig, the federation settings (paper Sec. 3), and ResolvedFLConfig, their one resolution for a launch.

Precedence: defaults < YAML < ``FL_ACCEL_<FIELD>`` variables < keyword overrides, merged and
typed by :mod:`fl_accel.settings`. An :class:`FLConfig` is frozen and checked once, at
construction (:mod:`fl_accel.config_checks`; ``ValueError`` naming the field, in pure Python,
on every rank before any collective); ``dataclasses.replace`` makes a checked copy. The
run-time config is :class:`ResolvedFLConfig`, made once by :func:`resolve_launch` with the
launch's layout and the run's length; ``FLAccelerator`` holds it (``run_config``).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import textwrap
from dataclasses import dataclass, fields
from typing import Any, Literal, Mapping, get_args

from . import mesh, wire
from .config_checks import check_fields
from .settings import read_yaml_mapping, resolve_sources


Algorithm = Literal["fsdp", "hsdp", "fl_fsdp", "fl_hsdp"]
assert get_args(Algorithm) == mesh.ALGORITHMS
SyncDtype = Literal["fp32", "bf16", "int8", "sparse"]
assert get_args(SyncDtype) == wire.SYNC_DTYPES  # the names are the wire's (tests/unit/test_codecs.py)


NOT_IDENTITY_FIELDS = ("outer_state_device", "collective_timeout_s", "group_index", "lighthouse_addr", "heal_address",
                       "rejoin_timeout_s")
"""Fields that place state or bound waits without changing any value: left out of run and
checkpoint identity (a run may resume a checkpoint written with other values)."""


@dataclass(frozen=True)
class FLConfig:
    """Settings of the federated sync (paper Sec. 3, Alg. 1), fragments, sync delay, compressed exchange
    (Streaming DiLoCo, arXiv 2501.18512), overlap, a synchronous warm-up and unequal groups. Frozen: assigning a field raises
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
    seconds per step, so that the groups arrive together (the slowest group does H). "time"/"speed": P=1, tau 0 or H (overlapped rounds)."""
    sync_window_s: float | None = None
    """"time": seconds of training per round (each group's own clock; evaluations between rounds excluded)."""
    num_fragments: int = 1
    """P: FSDP units, in forward order, are dealt round-robin into P fragments, one syncing every H/P steps."""
    sync_delay: int = 0
    """tau, optimizer steps between launching a fragment's exchange and applying it; 0 <= tau <= H (tau = H: round
    k's exchange runs during round k+1). A launch that would fall at or before the run's start is skipped."""
    delayed_local_steps: Literal["discard", "keep"] = "discard"
    """What a delayed result (tau > 0) does with the local steps taken while its exchange ran: "discard", parameters
    <- global + alpha (local - global) (Streaming DiLoCo); "keep", parameters <- global + (local - local at launch)
    (eager updates, arXiv 2502.12996; needs fragment_update_alpha=0; +4 bytes per parameter in flight)."""
    fragment_update_alpha: float = 0.0
    """alpha in [0, 1]: a delayed result sets the parameters to global + alpha (local - global)."""
    sync_warmup_steps: int = 0
    """K: the first K optimizer steps train the groups as one data-parallel job (gradients averaged across groups
    before each step, as PostLocalSGDOptimizer's start_localSGD_iter); rounds count from step K (first sync K + H)."""
    sync_dtype: SyncDtype = "fp32"
    """What crosses "fl": "fp32" (exact mean of the parameters); "bf16", "int8" (quantized mean of the
    pseudo-gradients: ~1/2, ~1/4 of the bytes); "sparse" (SparseLoCo, arXiv 2508.15706: top-k)."""
    sync_collectives: Literal["auto", "all_to_all", "all_gather"] = "auto"
    """"bf16"/"int8": "all_to_all" (then all-gather of the re-quantized sum: 2 (F-1)/F x the payload), "all_gather"
    (every group's payload, summed in fp32: (F-1) x, one rounding, one collective); "auto": all_gather at F = 2."""
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
    """"none": one world, a dead rank ends the job. "torchft": each group is its own launch and torchft (0.2.0, or
    the 0.3 API) lets the live groups sync and a restarted one heal (:mod:`fl_accel.ft`); equal federated groups."""
    group_index: int | None = None
    """"torchft": this launch's group, 0 <= f < ``num_groups``; names it and picks its data slice."""
    lighthouse_addr: str | None = None
    """"torchft": the Lighthouse's address, e.g. ``http://127.0.0.1:29510``; None: ``TORCHFT_LIGHTHOUSE``."""
    heal_address: str | None = None
    """"torchft": the address, or network interface name (e.g. "ib0"), that heals and the exchange's rendezvous
    use: advertised by this rank (its checkpoint server binds it); None: torchft's default, the host name."""
    rejoin_timeout_s: float = 300.0
    """"torchft": seconds a group that trained the whole run waits for the other groups to reach the end (serving
    their heals), and a group restarted without its state waits for a group holding one, before ending alone
    with a warning, or with StateLostError."""

    def __post_init__(self) -> None:
        """Validate every field once (:func:`fl_accel.config_checks.check_fields`); ``group_sizes``
        given as a tuple is stored as a list. ValueError naming the field."""
        if isinstance(self.group_sizes, tuple):
            object.__setattr__(self, "group_sizes", list(self.group_sizes))
        check_fields(self)

    @property
    def federation_size(self) -> int:
        """F as configured: ``len(group_sizes)`` when given, else ``num_groups``."""
        return len(self.group_sizes) if self.group_sizes is not None else self.num_groups

    _explicit = property(lambda self: {f.name for f in fields(self) if getattr(self, f.name) != f.default})

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

    compressed = property(lambda self: self.sync_dtype != "fp32", doc='``sync_dtype`` is not "fp32".')
    fault_tolerant = property(lambda self: self.fault_tolerance == "torchft",
                              doc='``fault_tolerance="torchft"``: each group is its own launch; the one test of it.')

    @property
    def residual_decay(self) -> float:
        """beta of the error-feedback buffer: ``error_feedback_decay``, or its mode's default."""
        if self.error_feedback_decay is not None:
            return float(self.error_feedback_decay)
        return 0.95 if self.sync_dtype == "sparse" else 1.0

    keeps_outer_state = property(lambda self: self.outer_optimizer == "nesterov" or self.compressed,
                                 doc='The sync keeps an fp32 anchor ("nesterov" or a compressed exchange).')

    def sync_state(self, num_groups: int) -> dict[str, Any]:
        """The settings deciding which sync state exists on ``num_groups`` groups (a checkpoint's key;
        ``delayed_local_steps`` only when "keep", which stores each rank's parameters at launch)."""
        syncs = num_groups > 1  # F > 1 groups exchange something (one group keeps no sync state)
        keep = syncs and self.delayed_local_steps == "keep" and self.sync_delay > 0
        return {"outer_optimizer": self.outer_optimizer if syncs else "avg",
                "sync_dtype": self.sync_dtype if syncs else "fp32",
                "error_feedback": bool(self.error_feedback and self.compressed and syncs),
                "num_fragments": self.num_fragments if syncs else 1, **({"delayed_local_steps": "keep"} if keep else {})}

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
            (["delayed_local_steps"], self.sync_delay == 0, "with sync_delay 0",
             "with sync_delay 0 (no exchange runs behind local steps)"),
            (["sync_window_s"], self.sync_trigger != "time", f"with sync_trigger {self.sync_trigger!r}",
             f"with sync_trigger {self.sync_trigger!r} (only 'time' has a window)"),
            (["group_index", "lighthouse_addr", "heal_address", "rejoin_timeout_s"], not self.fault_tolerant,
             "outside torchft mode",
             "with fault_tolerance 'none' (one world)"),
            (["sync_density", "sync_value_bits", "sparse_aggregation"], dtype != "sparse",
             f"with sync_dtype {dtype!r}", f"with sync_dtype {dtype!r} (only 'sparse' uses it)"),
            (["sync_collectives"], dtype not in wire.QUANTIZED, f"with sync_dtype {dtype!r}",
             f"with sync_dtype {dtype!r} (only 'bf16' and 'int8' use it)"),
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
    """The run-time config: an :class:`FLConfig` resolved once against the launch and, when
    known, the run's length. The one owner of the run's settings: ``FLAccelerator.run_config``,
    read by every reader (never a copy kept in step by hand). Frozen; made only by
    :func:`resolve_launch`."""

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

    fault_tolerant = property(lambda self: self.config.fault_tolerant,
                              doc=':attr:`FLConfig.fault_tolerant`: each group is its own launch.')

    def with_max_steps(self, max_steps: int) -> ResolvedFLConfig:
        """The same launch resolved for a run of ``max_steps`` (``self`` when it already is):
        :func:`resolve_launch` of ``source``. ValueError as there."""
        if max_steps == self.max_steps and not isinstance(max_steps, bool):
            return self
        return resolve_launch(self.source, self.world_size, ranks_per_node=self.ranks_per_node, max_steps=max_steps)


def resolve_launch(config: FLConfig, world_size: int, *, ranks_per_node: int | None = None,
                   max_steps: int | None = None) -> ResolvedFLConfig:
    """Resolve ``config`` once for a launch of ``world_size`` ranks (``ranks_per_node`` default
    ``world_size``) and, when given, a run of ``max_steps`` steps: the federation's layout, this
    launch's part of it, the config filled for the run's length. Pure Python: ValueError naming
    the field (F not dividing the world, S not dividing a group, a bad ``max_steps``, the
    outer-LR warmup not shorter than the run) on every rank before any process group."""
    if not isinstance(config, FLConfig):
        raise ValueError(f"fl_config must be an FLConfig, got {type(config).__name__}")
    layout = mesh.FLLayout.for_launch(config, world_size, ranks_per_node=ranks_per_node)
    filled = config
    if max_steps is not None:
        check_max_steps(max_steps)
        filled = config.with_max_steps(max_steps)
    return ResolvedFLConfig(config=filled, source=config, world_size=world_size, ranks_per_node=ranks_per_node,
                            layout=layout, launch_layout=layout.launch_part(config), max_steps=max_steps)


def resolve_for_world(fl_config: FLConfig | ResolvedFLConfig, world: int, max_steps: int | None) -> ResolvedFLConfig:
    """The run-time config of a launch of ``world`` ranks: ``fl_config`` resolved
    (:meth:`FLConfig.for_launch`, ``LOCAL_WORLD_SIZE`` ranks per node), or a resolved one of
    this world taken as it is (with ``max_steps``, resolved for it). ValueError, before any
    process group: a resolved config of another world, a bad layout or run length (naming the field)."""
    if isinstance(fl_config, ResolvedFLConfig):
        if fl_config.world_size != world:
            raise ValueError(f"fl_config was resolved for a world of {fl_config.world_size} ranks, but WORLD_SIZE is "
                             f"{world}")
        return fl_config if max_steps is None else fl_config.with_max_steps(max_steps)
    return fl_config.for_launch(world, ranks_per_node=mesh.ranks_per_node(world), max_steps=max_steps)
