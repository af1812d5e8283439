"""The only module that knows the F x R x S layout of the world.

Federation groups are contiguous blocks of ranks (paper Sec. 3; as in the authors'
reference code): global rank ``k`` sits at mesh coordinate
``(f, r, s) = (k // (R*S), (k // S) % R, k % S)`` of a DeviceMesh with axes
``("fl", "dp_replicate", "dp_shard")``. With ``--nproc_per_node`` equal to the group
size, a group is exactly one node, so intra-group FSDP traffic stays on fast links
and only the sync crosses nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import FLConfig

AXES = ("fl", "dp_replicate", "dp_shard")


@dataclass(frozen=True)
class FLLayout:
    """Pure mesh arithmetic, no processes: safe to build and test anywhere.

    Attributes:
        num_groups: F, federation groups (1 for the baselines).
        replicas: R, HSDP replicas inside a group (1 without HSDP).
        shards: S, ranks one model copy is sharded over.
    """

    num_groups: int
    replicas: int
    shards: int

    @classmethod
    def from_config(cls, config: FLConfig, world_size: int) -> "FLLayout":
        """Raises ValueError (naming the FLConfig field) when the sizes do not divide."""
        return cls(*config.validate(world_size).sizes(world_size))

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.num_groups, self.replicas, self.shards)

    @property
    def group_size(self) -> int:
        """G = R * S ranks per federation group."""
        return self.replicas * self.shards

    @property
    def world_size(self) -> int:
        return self.num_groups * self.group_size

    def coords(self, rank: int) -> tuple[int, int, int]:
        """Mesh coordinate ``(f, r, s)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        return rank // self.group_size, (rank // self.shards) % self.replicas, rank % self.shards

    def rank(self, f: int, r: int, s: int) -> int:
        return f * self.group_size + r * self.shards + s

    def axis_ranks(self, axis: str, rank: int) -> tuple[int, ...]:
        """Global ranks of the process group along ``axis`` that contains ``rank``."""
        f, r, s = self.coords(rank)
        if axis == "fl":
            return tuple(self.rank(i, r, s) for i in range(self.num_groups))
        if axis == "dp_replicate":
            return tuple(self.rank(f, i, s) for i in range(self.replicas))
        if axis == "dp_shard":
            return tuple(self.rank(f, r, i) for i in range(self.shards))
        raise ValueError(f"unknown mesh axis {axis!r}; axes are {AXES}")

    def group_ranks(self, group_index: int) -> tuple[int, ...]:
        """Global ranks of federation group ``group_index`` (a contiguous block)."""
        start = group_index * self.group_size
        return tuple(range(start, start + self.group_size))


def build_device_mesh(layout: FLLayout, device_type: str):
    """Create the world DeviceMesh with axes ("fl", "dp_replicate", "dp_shard").

    Also registers the flattened alias "dp_shard_cp" of "dp_shard", the name
    Accelerate's ``fsdp2_prepare_model`` slices (``ParallelismConfig.fsdp_dim_names``).
    Collective over the whole world: every rank must call it.
    """
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=AXES)
    mesh["dp_shard"]._flatten("dp_shard_cp")
    return mesh
