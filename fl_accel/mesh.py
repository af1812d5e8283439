"""The only module that knows the layout of the world: sizes, coordinates, axes, nodes.

Federation groups are contiguous blocks of ranks (paper Sec. 3, as in the authors'
reference code). Group ``f`` holds ``G_f`` ranks, split into ``R_f = G_f / S`` HSDP
replicas of ``S`` shards; global rank ``k`` of group ``f`` (offset ``o_f``) sits at
coordinate ``(f, r, s)`` with ``k = o_f + r*S + s``. With equal groups this is a
DeviceMesh of shape ``(F, R, S)`` and axes ``("fl", "dp_replicate", "dp_shard")``;
with ``--nproc_per_node`` equal to the group size, a group is exactly one node, so
intra-group FSDP traffic stays on fast links and only the sync crosses nodes.

Axes (the process groups a rank belongs to):

* ``dp_shard``: the S ranks of one model copy (same f, r);
* ``dp_replicate``: the R_f replicas of a shard inside group f (same f, s);
* ``fl``: the ranks that exchange a shard across groups. With equal groups these are
  the F ranks with the same (r, s). With unequal groups the shard is exchanged in
  ``R_min = min_f R_f`` chunks: chunk c by replica c of every group, so the ranks with
  ``r < R_min`` form the "fl" groups and the others receive the result from their
  group's replicas (see :mod:`fl_accel.sync`).

:class:`FLLayout` is pure arithmetic (no processes); :func:`build_mesh` creates the
process groups, every one of them with the collective timeout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

ALGORITHMS = ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp")
FL, DP_REPLICATE, DP_SHARD = "fl", "dp_replicate", "dp_shard"
AXES = (FL, DP_REPLICATE, DP_SHARD)
WORLD = "world"
"""Name of the comm bucket for collectives over the whole world (not a mesh axis)."""
FSDP_SHARD_DIM = "dp_shard_cp"
"""The flattened alias of "dp_shard" that Accelerate's ``fsdp2_prepare_model`` slices
(``ParallelismConfig.fsdp_dim_names`` in accelerate 1.15)."""


@dataclass(frozen=True)
class FLLayout:
    """Pure layout arithmetic, no processes: safe to build and test anywhere.

    Attributes:
        group_sizes: G_f, ranks per federation group (one entry for the baselines).
        shards: S, ranks one model copy is sharded over (divides every G_f).
        algorithm: "fsdp", "hsdp", "fl_fsdp" or "fl_hsdp".

    Raises:
        ValueError: a non-positive size, or S not dividing a group size.
    """

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

    # ------------------------------------------------------------------ construction
    @classmethod
    def equal(cls, num_groups: int, replicas: int, shards: int, algorithm: str | None = None) -> "FLLayout":
        """F equal groups of R x S ranks. ``algorithm`` defaults to the one this shape implies."""
        if algorithm is None:
            algorithm = ("fl_hsdp" if replicas > 1 else "fl_fsdp") if num_groups > 1 else \
                ("hsdp" if replicas > 1 else "fsdp")
        return cls((replicas * shards,) * num_groups, shards, algorithm)

    @classmethod
    def from_config(cls, config: Any, world_size: int, ranks_per_node: int | None = None) -> "FLLayout":
        """The layout of ``config`` (an FLConfig) on ``world_size`` ranks.

        An unset ``hsdp_shard_size`` under HSDP becomes the largest divisor of
        ``ranks_per_node`` that divides every group (shard inside a node, replicate
        across nodes).

        Raises:
            ValueError: naming the FLConfig field: ``num_groups`` not dividing the world,
                ``group_sizes`` not summing to it, ``hsdp_shard_size`` missing or not
                dividing a group.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        federated = config.algorithm.startswith("fl_")
        if federated and config.group_sizes is not None:
            sizes = tuple(config.group_sizes)
            if sum(sizes) != world_size:
                raise ValueError(f"FLConfig.group_sizes={list(sizes)} sum to {sum(sizes)}, but the world size is "
                                 f"{world_size}: the groups must cover every rank exactly once")
        else:
            num_groups = config.num_groups if federated else 1
            if world_size % num_groups:
                raise ValueError(f"FLConfig.num_groups={num_groups} does not divide the world size {world_size}: "
                                 f"equal federation groups need the same number of ranks (or set group_sizes)")
            sizes = (world_size // num_groups,) * num_groups
        if config.algorithm in ("hsdp", "fl_hsdp"):
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
        else:
            if len(set(sizes)) > 1:
                raise ValueError(f"FLConfig.group_sizes={list(sizes)} are unequal: use algorithm='fl_hsdp' with an "
                                 f"hsdp_shard_size dividing every size")
            shards = sizes[0]
        return cls(sizes, shards, config.algorithm)

    # ------------------------------------------------------------------ sizes
    @property
    def num_groups(self) -> int:
        """F, federation groups (1 for the baselines)."""
        return len(self.group_sizes)

    @property
    def world_size(self) -> int:
        return sum(self.group_sizes)

    @property
    def is_uniform(self) -> bool:
        """True when every group has the same size (a regular F x R x S mesh)."""
        return len(set(self.group_sizes)) == 1

    @property
    def is_federated(self) -> bool:
        return self.algorithm.startswith("fl_")

    @property
    def uses_hsdp(self) -> bool:
        return self.algorithm in ("hsdp", "fl_hsdp")

    def _need_uniform(self, what: str) -> None:
        if not self.is_uniform:
            raise ValueError(f"{what} is not defined for unequal groups {list(self.group_sizes)}; "
                             f"use group_size_of(f) / replicas_of(f)")

    @property
    def group_size(self) -> int:
        """G = R * S, ranks per federation group (equal groups only)."""
        self._need_uniform("group_size")
        return self.group_sizes[0]

    @property
    def replicas(self) -> int:
        """R, HSDP replicas per group (equal groups only)."""
        self._need_uniform("replicas")
        return self.group_sizes[0] // self.shards

    @property
    def shape(self) -> tuple[int, int, int]:
        """(F, R, S) of the world DeviceMesh (equal groups only)."""
        return (self.num_groups, self.replicas, self.shards)

    def group_size_of(self, f: int) -> int:
        return self.group_sizes[f]

    def replicas_of(self, f: int) -> int:
        """R_f = G_f / S."""
        return self.group_sizes[f] // self.shards

    @property
    def max_replicas(self) -> int:
        """The largest R_f."""
        return max(self.group_sizes) // self.shards

    @property
    def min_replicas(self) -> int:
        """R_min: the number of chunks a shard is exchanged in across groups."""
        return min(self.group_sizes) // self.shards

    def group_offset(self, f: int) -> int:
        """First global rank of group ``f``."""
        return sum(self.group_sizes[:f])

    def weights(self, weighting: str = "size") -> tuple[float, ...]:
        """w_f of the group average: "size" -> G_f / N, "uniform" -> 1 / F. Sums to 1."""
        if weighting == "uniform" or self.is_uniform:
            return (1.0 / self.num_groups,) * self.num_groups
        if weighting != "size":
            raise ValueError(f"FLConfig.group_weighting must be 'size' or 'uniform', got {weighting!r}")
        return tuple(g / self.world_size for g in self.group_sizes)

    # ------------------------------------------------------------------ coordinates
    def coords(self, rank: int) -> tuple[int, int, int]:
        """Coordinate ``(f, r, s)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        f, offset = 0, 0
        while rank >= offset + self.group_sizes[f]:
            offset += self.group_sizes[f]
            f += 1
        local = rank - offset
        return f, local // self.shards, local % self.shards

    def rank(self, f: int, r: int, s: int) -> int:
        return self.group_offset(f) + r * self.shards + s

    def group_of(self, rank: int) -> int:
        return self.coords(rank)[0]

    def group_local_rank(self, rank: int) -> int:
        """Index of ``rank`` inside its federation group (0 .. G_f - 1)."""
        return rank - self.group_offset(self.group_of(rank))

    def group_ranks(self, f: int) -> tuple[int, ...]:
        """Global ranks of federation group ``f`` (a contiguous block)."""
        start = self.group_offset(f)
        return tuple(range(start, start + self.group_sizes[f]))

    def axis_groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every process group of ``axis`` as a tuple of global ranks, in a fixed order
        (the order in which process groups must be created on every rank)."""
        F, S = self.num_groups, self.shards
        if axis == DP_SHARD:
            return [tuple(self.rank(f, r, s) for s in range(S)) for f in range(F) for r in range(self.replicas_of(f))]
        if axis == DP_REPLICATE:
            return [tuple(self.rank(f, r, s) for r in range(self.replicas_of(f))) for f in range(F) for s in range(S)]
        if axis == FL:
            return [tuple(self.rank(f, r, s) for f in range(F)) for r in range(self.min_replicas) for s in range(S)]
        raise ValueError(f"unknown mesh axis {axis!r}; axes are {AXES}")

    def axis_ranks(self, axis: str, rank: int) -> tuple[int, ...]:
        """Global ranks of the process group along ``axis`` that contains ``rank``.

        ``()`` for the "fl" axis of a rank whose replica index is >= R_min (it takes no
        part in the inter-group exchange; only with unequal groups).
        """
        f, r, s = self.coords(rank)
        if axis == FL:
            return tuple(self.rank(g, r, s) for g in range(self.num_groups)) if r < self.min_replicas else ()
        if axis == DP_REPLICATE:
            return tuple(self.rank(f, i, s) for i in range(self.replicas_of(f)))
        if axis == DP_SHARD:
            return tuple(self.rank(f, r, i) for i in range(self.shards))
        raise ValueError(f"unknown mesh axis {axis!r}; axes are {AXES}")

    # ------------------------------------------------------------------ nodes
    def spans_nodes(self, axis: str, ranks_per_node: int) -> bool:
        """True when some process group of ``axis`` holds ranks of two or more nodes
        (ranks are numbered node by node, ``ranks_per_node`` each)."""
        return any(len({k // ranks_per_node for k in ranks}) > 1 for ranks in self.axis_groups(axis))

    def link_share(self, axis: str, ranks_per_node: int) -> int:
        """How many ring hops of ``axis`` leave one node in the same direction at once.

        The process groups of an axis run concurrently, each a ring in rank order in
        which every rank sends to its successor. A node's link per direction is shared
        by the ranks of that node whose successor is on another node: FSDP over 4 ranks
        on 2 nodes has one such rank per node; the "fl" axis of FL+FSDP 2x2 has two.
        Returns the max over nodes (0 when the axis stays inside nodes).
        """
        out: dict[int, int] = {}
        for ranks in self.axis_groups(axis):
            if len(ranks) < 2:
                continue
            for i, a in enumerate(ranks):
                b = ranks[(i + 1) % len(ranks)]
                if a // ranks_per_node != b // ranks_per_node:
                    out[a // ranks_per_node] = out.get(a // ranks_per_node, 0) + 1
        return max(out.values(), default=0)

    # ------------------------------------------------------------------ names
    def sizes_label(self) -> str:
        """``G2`` for equal groups of 2, ``G2_4`` for groups of 2 and 4 ranks."""
        return "G" + ("_".join(map(str, self.group_sizes)) if not self.is_uniform else str(self.group_sizes[0]))

    def describe(self, sync_every: int | None = None) -> str:
        """One line, e.g. ``fl_fsdp F=2 G=2 R=1 S=2 H=8`` or ``fl_hsdp F=2 G=[2, 4] R=[1, 2] S=2``."""
        if self.is_uniform:
            g, r = self.group_sizes[0], self.replicas
        else:
            g, r = list(self.group_sizes), [self.replicas_of(f) for f in range(self.num_groups)]
        h = f" H={sync_every}" if sync_every is not None and self.is_federated else ""
        return f"{self.algorithm} F={self.num_groups} G={g} R={r} S={self.shards}{h}"

    def as_dict(self) -> dict[str, Any]:
        """What a checkpoint records of the layout."""
        return {"algorithm": self.algorithm, "world_size": self.world_size, "group_sizes": list(self.group_sizes),
                "shards": self.shards}


# ---------------------------------------------------------------------- process groups
def _pg_options(backend: str, timeout: timedelta):
    """Process-group options carrying ``timeout``: DeviceMesh passes ``options._timeout``
    to ``new_group``/``split_group`` (torch 2.13 ``DeviceMesh._init_one_process_group``);
    without it every mesh sub-group gets the backend's default (30 min on gloo)."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import Backend as C10dBackend

    if "nccl" in backend:
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
    else:
        options = C10dBackend.Options("gloo")
    options._timeout = timeout
    return options


class FLMesh:
    """This rank's process groups and the DeviceMesh Accelerate shards over.

    Attributes:
        layout: the FLLayout.
        device_mesh: equal groups: the world mesh ``(F, R, S)`` with axes
            ("fl", "dp_replicate", "dp_shard") and the flattened alias "dp_shard_cp";
            unequal groups: this group's mesh ``(R_f, S)`` with axes ("dp_replicate",
            "dp_shard_cp"). Either way
            ``device_mesh["dp_shard_cp"]`` / ``device_mesh[("dp_replicate", "dp_shard_cp")]``
            is this rank's own group, which is what Accelerate's FSDP2 path slices.
        groups: axis name -> ProcessGroup of this rank on that axis (absent when the
            axis has one rank, or, for "fl", when this rank takes no part).
    """

    def __init__(self, layout: FLLayout, device_mesh, groups: dict):
        self.layout, self.device_mesh, self.groups = layout, device_mesh, groups

    def group(self, axis: str):
        """The ProcessGroup of ``axis`` containing this rank, or None."""
        return self.groups.get(axis)


def build_mesh(layout: FLLayout, device_type: str, timeout: timedelta, rank: int) -> FLMesh:
    """Create every process group of the layout, each with the collective ``timeout``.

    Collective over the whole world: every rank must call it, in the same order.
    Equal groups use ``init_device_mesh``; unequal groups create the groups with
    ``new_group`` (every rank creates every group, in one order: ``new_group`` is a world
    collective) and wrap this group's in a 2-D DeviceMesh (``DeviceMesh.from_group``).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    backend = dist.get_backend()
    options = _pg_options(backend, timeout)
    if layout.is_uniform:
        mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=AXES,
                                backend_override={axis: options for axis in AXES})
        mesh[DP_SHARD]._flatten(FSDP_SHARD_DIM, backend_override=options)
        groups = {axis: mesh.get_group(axis) for axis in AXES if mesh[axis].size() > 1}
        return FLMesh(layout, mesh, groups)

    import torch

    groups: dict = {}
    for axis in (DP_SHARD, DP_REPLICATE, FL):
        for ranks in layout.axis_groups(axis):
            pg = dist.new_group(list(ranks), timeout=timeout, group_desc=f"fl_accel_{axis}")
            if rank in ranks:
                groups[axis] = pg
    f = layout.group_of(rank)
    ranks = torch.tensor(layout.group_ranks(f)).view(layout.replicas_of(f), layout.shards)
    # Name the shard dim as Accelerate slices it: flattening would create new process groups,
    # a world collective that the groups (each with its own mesh) cannot call in step.
    mesh = DeviceMesh.from_group([groups[DP_REPLICATE], groups[DP_SHARD]], device_type, mesh=ranks,
                                 mesh_dim_names=(DP_REPLICATE, FSDP_SHARD_DIM))
    groups = {axis: pg for axis, pg in groups.items() if len(layout.axis_ranks(axis, rank)) > 1}
    return FLMesh(layout, mesh, groups)
