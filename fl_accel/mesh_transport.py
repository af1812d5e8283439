"""The world mesh's transport: the federation is the launched world, F fixed for the run.

:class:`MeshTransport` plugs the mesh's process groups (:mod:`fl_accel.mesh`) into the
synchronizer's transport extension point (:class:`fl_accel.exchange.Transport`): every
group is in one launch (not ``elastic``), the weights are the layout's (``group_weighting``),
writes run at once (the default :class:`~fl_accel.exchange.EventHooks`), and the "fl"
collectives run on the ``fl`` process group of this rank's shard coordinate. The other
transport is torchft's (:class:`fl_accel.ft.ManagedTransport`, membership decided per sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import compat
from .exchange import EventHooks, Membership
from .mesh import DP_REPLICATE, DP_SHARD, FL


@dataclass
class MeshTransport:
    """:class:`~fl_accel.exchange.Transport` on the mesh's process groups (one world): a fixed
    ``membership``; ``chunk_owners[c]``: the rank holding chunk c in this group (broadcast sources)."""

    fl_group: object
    replicate_group: object
    membership: Membership
    num_chunks: int
    chunk_index: int | None
    replicas: int
    chunk_owners: tuple
    device: torch.device = torch.device("cpu")
    shard_group: object = None
    elastic = False  # every group is in this launch, for the whole run

    group_index = property(lambda self: self.membership.position)

    @classmethod
    def from_mesh(cls, mesh, rank: int, weighting: str, device: torch.device) -> "MeshTransport":
        layout = mesh.layout
        f, r, s = layout.coords(rank)
        C, groups = layout.min_replicas, mesh.groups
        return cls(fl_group=groups.get(FL) if r < C else None, replicate_group=groups.get(DP_REPLICATE),
                   membership=Membership(layout.num_groups, f, layout.weights(weighting)), num_chunks=C,
                   chunk_index=r if r < C else None, replicas=layout.replicas_of(f),
                   chunk_owners=tuple(layout.rank(f, c, s) for c in range(C)), device=device,
                   shard_group=groups.get(DP_SHARD))

    def begin(self) -> Membership:
        return self.membership

    def hooks(self) -> EventHooks:
        return EventHooks()

    def all_reduce(self, tensor, async_op=False):
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.fl_group, async_op=async_op)

    def all_to_all(self, output, input, async_op=False):
        return dist.all_to_all_single(output, input, group=self.fl_group, async_op=async_op)

    def all_gather(self, output, input, async_op=False):
        return compat.all_gather_single(output, input, group=self.fl_group, async_op=async_op)

    def share_chunks(self, flat):
        if self.replicate_group is None or self.replicas <= 1:
            return
        size = flat.numel() // self.num_chunks
        if self.replicas == self.num_chunks:
            piece = flat[self.chunk_index * size:(self.chunk_index + 1) * size].clone()
            compat.all_gather_single(flat, piece, group=self.replicate_group)
            return
        for c in range(self.num_chunks):
            dist.broadcast(flat[c * size:(c + 1) * size], src=self.chunk_owners[c], group=self.replicate_group)

    def bad_groups(self, local_bad, membership):
        flags = torch.zeros(membership.num_groups, dtype=torch.float32, device=self.device)
        flags[membership.position] = float(local_bad)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # the world: every rank of every group
        return [g for g in range(membership.num_groups) if flags[g] > 0]

    def group_max(self, value):
        """Over "dp_shard", then "dp_replicate": the group's ranks only, so groups never wait for each other."""
        out = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        for pg in (self.shard_group, self.replicate_group):
            if pg is not None:
                dist.all_reduce(out, op=dist.ReduceOp.MAX, group=pg)
        return float(out.item())

    def group_table(self, vector, membership):
        """One MAX over the world (the sync's only world collective besides :meth:`bad_groups`)."""
        table = torch.zeros(membership.num_groups, len(vector), dtype=torch.float64, device=self.device)
        table[membership.position] = torch.tensor(vector, dtype=torch.float64)
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
        return table.tolist()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def shutdown(self) -> None:
        pass

