"""The layout of the world (sizes, coordinates, axes, nodes, group weights) and the process bootstrap.

The only module that knows the layout; it also creates the default process group and every
mesh sub-group, and owns the one formula of the groups' merge weights (:func:`merge_weights`).

Federation groups are contiguous rank blocks (paper Sec. 3). Group ``f`` holds ``G_f =
R_f * S`` ranks (``R_f`` HSDP replicas of ``S`` shards); its global rank ``k = o_f + r*S
+ s`` sits at ``(f, r, s)`` (row-major, a DeviceMesh ``(F, R, S)`` for equal groups).
Axes: ``dp_shard`` the S ranks of one model copy; ``dp_replicate`` the R_f replicas of a
shard in group f; ``fl`` the ranks exchanging a shard across groups: with equal groups the
F ranks with the same (r, s); with unequal ones the shard goes in ``R_min = min_f R_f``
chunks, chunk c by replica c of every group (ranks with ``r >= R_min`` receive it from
their group, :mod:`fl_accel.exchange`).
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, NamedTuple, Sequence

ALGORITHMS = ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp")
FL, DP_REPLICATE, DP_SHARD = "fl", "dp_replicate", "dp_shard"
AXES = (FL, DP_REPLICATE, DP_SHARD)
WORLD = "world"  # the comm bucket of the default process group (not a mesh axis)
BUCKETS = AXES + (WORLD,)  # the comm accounting buckets (fl_accel.comm, fl_accel.planning.cost)
FSDP_SHARD_DIM = "dp_shard_cp"  # "dp_shard" as accelerate 1.15 fsdp2_prepare_model slices it (fsdp_dim_names)


def is_federated(algorithm: str) -> bool:
    """The one test of "federated": the algorithm syncs groups ("fl_fsdp", "fl_hsdp"); the
    baselines "fsdp" and "hsdp" are one group spanning the world. (``FLConfig.is_federated``
    and ``FLLayout.is_federated`` ask this; F > 1 is a separate question: how many groups.)"""
    return algorithm.startswith("fl_")


def uses_hsdp(algorithm: str) -> bool:
    return algorithm in ("hsdp", "fl_hsdp")


WEIGHTINGS = ("tokens", "size", "uniform")


def merge_weights(weighting: str, steps: Sequence[int] | None, sizes: Sequence[int],
                  copies: Sequence[int] = ()) -> tuple[float, ...]:
    """w_f of a sync's weighted mean, one per group, summing to 1: the one formula of the group
    weights (the layout's, the rounds by time/speed, torchft's quorums). "tokens": ``G_f n_f /
    sum_g G_g n_g`` (``sizes`` G_f ranks x ``steps`` n_f, the tokens each group trained on;
    ``steps`` None: equal steps); "size": ``G_f / N``; "uniform": ``1 / F``. ``copies``: groups
    holding another's values (torchft: healed in this quorum) weigh 0 and the others share 1
    (all copies, or no tokens without them: ignored). ValueError: unknown weighting, lengths
    that differ, or no tokens at all."""
    if steps is not None and len(steps) != len(sizes):
        raise ValueError(f"steps {list(steps)} and sizes {list(sizes)} must have one entry per group")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown group_weighting {weighting!r}: 'tokens', 'size' or 'uniform'")
    tokens = [g * n for g, n in zip(sizes, steps)] if weighting == "tokens" and steps is not None else None
    kept = [f for f in range(len(sizes)) if f not in set(copies)]
    if not kept or (tokens is not None and sum(tokens[f] for f in kept) <= 0):
        kept = list(range(len(sizes)))
    if weighting == "uniform":
        share = {f: 1.0 / len(kept) for f in kept}
    elif tokens is None:
        share = {f: sizes[f] / sum(sizes[g] for g in kept) for f in kept}
    else:
        if sum(tokens) <= 0:
            raise ValueError(f"no group trained in this round (steps {list(steps)})")
        share = {f: tokens[f] / sum(tokens[g] for g in kept) for f in kept}
    return tuple(share.get(f, 0.0) for f in range(len(sizes)))


@dataclass(frozen=True)
class FLLayout:
    """Layout arithmetic, no processes: ``group_sizes`` G_f (one entry for the baselines),
    ``shards`` S (divides every G_f), ``algorithm``. ValueError: a size < 1, S not dividing."""

    group_sizes: tuple[int, ...]
    shards: int
    algorithm: str = "fl_fsdp"

    def __post_init__(self) -> None:
        object.__setattr__(self, "group_sizes", tuple(int(g) for g in self.group_sizes))
        if not self.group_sizes or any(g < 1 for g in self.group_sizes) or self.shards < 1:
            raise ValueError(f"layout sizes must be positive: group_sizes={self.group_sizes}, shards={self.shards}")
        if any(g % self.shards for g in self.group_sizes):
            raise ValueError(f"shards={self.shards} must divide every group size {list(self.group_sizes)}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {list(ALGORITHMS)}, got {self.algorithm!r}")

    @classmethod
    def equal(cls, num_groups: int, replicas: int, shards: int, algorithm: str | None = None) -> "FLLayout":
        """F equal groups of R x S ranks. ``algorithm`` defaults to the one this shape implies."""
        if algorithm is None:
            algorithm = ("fl_hsdp" if replicas > 1 else "fl_fsdp") if num_groups > 1 else \
                ("hsdp" if replicas > 1 else "fsdp")
        return cls((replicas * shards,) * num_groups, shards, algorithm)

    @classmethod
    def from_config(cls, config: Any, world_size: int, ranks_per_node: int | None = None) -> "FLLayout":
        """The layout of an FLConfig on ``world_size`` ranks; an unset ``hsdp_shard_size``
        under HSDP is the gcd of ``ranks_per_node`` and the group sizes (shard in a node).
        Raises ValueError naming the field: F not dividing the world, ``group_sizes`` not
        summing to it, S missing or not dividing a group."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        federated = is_federated(config.algorithm)
        if federated and config.group_sizes is not None:
            sizes = tuple(config.group_sizes)
            if sum(sizes) != world_size:
                raise ValueError(f"FLConfig.group_sizes={list(sizes)} sum to {sum(sizes)}, but the world size is "
                                 f"{world_size}: the groups must cover every rank exactly once")
        else:
            num_groups = config.num_groups if federated else 1
            if world_size % num_groups:
                valid = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
                raise ValueError(f"FLConfig.num_groups={num_groups} does not divide the world size {world_size}: "
                                 f"equal federation groups need the same number of ranks (valid for {world_size} "
                                 f"ranks: {valid}; or set group_sizes)"
                                 + ("; a single process (no launcher) is one group: num_groups=1" if world_size == 1
                                    else ""))
            sizes = (world_size // num_groups,) * num_groups
        if uses_hsdp(config.algorithm):
            shards = config.hsdp_shard_size
            if shards is None:
                if not ranks_per_node:
                    raise ValueError(f"FLConfig.hsdp_shard_size must be set for algorithm {config.algorithm!r} "
                                     f"(S, the ranks one HSDP replica shards over)")
                shards = math.gcd(ranks_per_node, *sizes)
            bad = [g for g in sizes if g % shards]
            if bad:
                what = "group size" if len(sizes) > 1 or federated else "world size"
                raise ValueError(f"FLConfig.hsdp_shard_size={shards} does not divide the {what} {bad[0]} "
                                 f"(world size {world_size}, group sizes {list(sizes)})")
        else:  # unequal sizes need HSDP (fl_accel.config_checks.check_group_fields)
            shards = sizes[0]
        return cls(sizes, shards, config.algorithm)

    @classmethod
    def for_launch(cls, config: Any, launch_world: int, ranks_per_node: int | None = None) -> "FLLayout":
        """The federation's layout as one launch of ``launch_world`` ranks sees it: the launch's
        world, or with ``fault_tolerance="torchft"`` (each group is its own launch) F equal groups
        of ``launch_world`` ranks, ``launch_world x F`` in all. ``ranks_per_node`` (default
        ``launch_world``) as in :meth:`from_config`. Raises ValueError naming the field, as
        :meth:`from_config`."""
        ranks_per_node = ranks_per_node or launch_world
        world = launch_world * config.federation_size if config.fault_tolerant else launch_world
        return cls.from_config(config, world, ranks_per_node=ranks_per_node)

    def launch_part(self, config: Any) -> "FLLayout":
        """The layout of one launch's own world: ``self``, or with ``fault_tolerance="torchft"``
        one group alone (``group_sizes[group_index]`` ranks, the same S), as "hsdp" or "fsdp"."""
        if not config.fault_tolerant:
            return self
        return FLLayout((self.group_sizes[config.group_index],), self.shards, "hsdp" if self.uses_hsdp else "fsdp")

    num_groups = property(lambda self: len(self.group_sizes), doc="F, federation groups (1 for the baselines).")
    world_size = property(lambda self: sum(self.group_sizes))
    is_uniform = property(lambda self: len(set(self.group_sizes)) == 1, doc="Every group has the same size.")
    max_replicas = property(lambda self: max(self.group_sizes) // self.shards)
    min_replicas = property(lambda self: min(self.group_sizes) // self.shards, doc="R_min: chunks per shard on fl.")
    is_federated = property(lambda self: is_federated(self.algorithm))
    uses_hsdp = property(lambda self: uses_hsdp(self.algorithm))

    @property
    def group_size(self) -> int:
        """G = R * S; equal groups only, like ``replicas`` R and ``shape`` (F, R, S) (else ValueError)."""
        if not self.is_uniform:
            raise ValueError(f"group_size is not defined for unequal groups {list(self.group_sizes)}; "
                             f"use group_size_of(f) / replicas_of(f)")
        return self.group_sizes[0]

    replicas = property(lambda self: self.group_size // self.shards)
    shape = property(lambda self: (self.num_groups, self.replicas, self.shards))

    def group_size_of(self, f: int) -> int:
        return self.group_sizes[f]

    def replicas_of(self, f: int) -> int:
        return self.group_sizes[f] // self.shards

    def group_offset(self, f: int) -> int:
        return sum(self.group_sizes[:f])

    def weights(self, weighting: str = "size") -> tuple[float, ...]:
        """w_f of the group average when every group does the same steps (:func:`merge_weights`
        of ``FLConfig.group_weighting``): "tokens" and "size" G_f / N, "uniform" 1 / F. Sums to 1."""
        return merge_weights(weighting, None, self.group_sizes)

    def coords(self, rank: int) -> tuple[int, int, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        f = bisect.bisect_right(list(itertools.accumulate(self.group_sizes)), rank)
        r, s = divmod(rank - self.group_offset(f), self.shards)
        return f, r, s

    def rank(self, f: int, r: int, s: int) -> int:
        return self.group_offset(f) + r * self.shards + s

    def group_of(self, rank: int) -> int:
        return self.coords(rank)[0]

    def group_local_rank(self, rank: int) -> int:
        return rank - self.group_offset(self.group_of(rank))

    def group_ranks(self, f: int) -> tuple[int, ...]:
        start = self.group_offset(f)
        return tuple(range(start, start + self.group_sizes[f]))

    def axis_groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every process group of ``axis`` as global ranks, in the order every rank creates them."""
        F, S = self.num_groups, self.shards
        if axis == DP_SHARD:
            return [tuple(self.rank(f, r, s) for s in range(S)) for f in range(F) for r in range(self.replicas_of(f))]
        if axis == DP_REPLICATE:
            return [tuple(self.rank(f, r, s) for r in range(self.replicas_of(f))) for f in range(F) for s in range(S)]
        if axis == FL:
            return [tuple(self.rank(f, r, s) for f in range(F)) for r in range(self.min_replicas) for s in range(S)]
        raise ValueError(f"unknown mesh axis {axis!r}; axes are {AXES}")

    def axis_ranks(self, axis: str, rank: int) -> tuple[int, ...]:
        """Ranks of ``rank``'s process group on ``axis``; ``()`` on "fl" for a replica >= R_min
        (unequal groups). ValueError: unknown axis or rank."""
        self.coords(rank)
        return next((ranks for ranks in self.axis_groups(axis) if rank in ranks), ())

    def spans_nodes(self, axis: str, ranks_per_node: int) -> bool:
        """Some process group of ``axis`` holds ranks of two nodes (numbered node by node)."""
        return any(len({k // ranks_per_node for k in ranks}) > 1 for ranks in self.axis_groups(axis))

    def link_share(self, axis: str, ranks_per_node: int) -> int:
        """Ring hops of ``axis`` leaving one node in one direction at once (max over nodes; 0
        inside nodes): the axis's groups run concurrently as rings in rank order, so a node's
        link is shared by its ranks whose successor is off-node (FSDP 4 ranks on 2 nodes: 1;
        "fl" of FL+FSDP 2x2: 2)."""
        out: dict[int, int] = {}
        for ranks in self.axis_groups(axis):
            if len(ranks) < 2:
                continue
            for i, a in enumerate(ranks):
                b = ranks[(i + 1) % len(ranks)]
                if a // ranks_per_node != b // ranks_per_node:
                    out[a // ranks_per_node] = out.get(a // ranks_per_node, 0) + 1
        return max(out.values(), default=0)

    def sizes_label(self) -> str:
        """``G2`` for equal groups of 2, ``G2_4`` for groups of 2 and 4."""
        return "G" + ("_".join(map(str, self.group_sizes)) if not self.is_uniform else str(self.group_sizes[0]))

    def describe(self, sync_every: int | None = None) -> str:
        """E.g. ``fl_fsdp F=2 G=2 R=1 S=2 H=8`` or ``fl_hsdp F=2 G=[2, 4] R=[1, 2] S=2``."""
        if self.is_uniform:
            g, r = self.group_sizes[0], self.replicas
        else:
            g, r = list(self.group_sizes), [self.replicas_of(f) for f in range(self.num_groups)]
        h = f" H={sync_every}" if sync_every is not None and self.is_federated else ""
        return f"{self.algorithm} F={self.num_groups} G={g} R={r} S={self.shards}{h}"

    def as_dict(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm, "world_size": self.world_size, "group_sizes": list(self.group_sizes),
                "shards": self.shards}


def _env_int(environ: Mapping[str, str] | None, name: str, default: int) -> int:
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}={raw!r} must be a positive integer (the launcher sets it)")
    return value


def world_size_from_env(environ: Mapping[str, str] | None = None) -> int:
    """The launched world size: ``WORLD_SIZE`` of ``environ`` (default ``os.environ``), as
    torchrun / accelerate launch set it; 1 without it (a plain process). The one reader of
    ``WORLD_SIZE``. ValueError: not a positive integer."""
    return _env_int(environ, "WORLD_SIZE", 1)


def ranks_per_node(world_size: int, environ: Mapping[str, str] | None = None) -> int:
    """``LOCAL_WORLD_SIZE`` of ``environ`` (default ``os.environ``), else ``world_size`` (one
    node). ValueError: not a positive integer."""
    return _env_int(environ, "LOCAL_WORLD_SIZE", world_size)


def init_process_group(backend: str, timeout: timedelta) -> None:
    """Create the default process group where Accelerate's start would fail or hang (it then
    uses this one): under ``torchrun --max-restarts`` attempt n>0 reuses attempt 0's store
    keys and gloo dials dead peers (torch 2.13, cf. pytorch/pytorch#167288), so the store is
    prefixed with ``TORCHELASTIC_RESTART_COUNT``; a plain ``python script.py`` (no ``RANK``)
    gets a one-process group on a HashStore, so the same FSDP2 code runs."""
    import torch.distributed as dist

    world = world_size_from_env()
    if dist.is_initialized():
        return
    if "RANK" not in os.environ and world == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif world > 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore(f"/fl_accel/attempt_{attempt}", store),
                                rank=int(os.environ["RANK"]), world_size=world, timeout=timeout)


class FLMesh(NamedTuple):
    """``device_mesh``: this group's ``(R_f, S)`` mesh ("dp_replicate", "dp_shard_cp") that
    Accelerate's FSDP2 path slices (FSDP2 never crosses groups); ``groups``: axis -> this
    rank's ProcessGroup (absent for one rank, or on "fl" for a rank taking no part)."""

    layout: FLLayout
    device_mesh: Any
    groups: dict


def build_mesh(layout: FLLayout, device_type: str, timeout: timedelta, rank: int) -> FLMesh:
    """Create every process group of the layout (``dist.new_group``, a world collective: every
    rank, one order) and wrap this group's two in ``DeviceMesh.from_group``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    groups: dict = {}
    for axis in (DP_SHARD, DP_REPLICATE, FL):
        for ranks in layout.axis_groups(axis):
            pg = dist.new_group(list(ranks), timeout=timeout, group_desc=f"fl_accel_{axis}")
            if rank in ranks:
                groups[axis] = pg
    f = layout.group_of(rank)
    ranks = torch.tensor(layout.group_ranks(f)).view(layout.replicas_of(f), layout.shards)
    device_mesh = DeviceMesh.from_group([groups[DP_REPLICATE], groups[DP_SHARD]], device_type, mesh=ranks,
                                        mesh_dim_names=(DP_REPLICATE, FSDP_SHARD_DIM))
    groups = {axis: pg for axis, pg in groups.items() if len(layout.axis_ranks(axis, rank)) > 1}
    return FLMesh(layout, device_mesh, groups)
