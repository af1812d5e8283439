"""Helpers on a federation group's FSDP2 model around Accelerate's preparation: torch only,
functions of (model, layout, device), testable on a one-process group. Relied on (public
API; the internals are reached through :mod:`fl_accel.compat`):

* a DTensor's local shard is laid out as ``distribute_tensor`` with the same mesh and
  placements lays it out (:func:`materialize` keeps a rank's shard of a full init);
* ``FSDPModule.reshard()`` frees a unit's unsharded parameters; ``reset_iter_state()``
  (torch 2.13+) reshards every unit and clears the post-forward order kept until a backward ends.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from . import compat
from .fsdp import local


@torch.no_grad()
def materialize(model: torch.nn.Module, init_fn, device: torch.device, seed: int = 0) -> None:
    """Allocate and initialize a model sharded on the meta device, module by module (children
    first): full-shape parameters on ``device``, ``init_fn(module)`` (e.g. transformers'
    ``_init_weights``), keep this rank's shard (``distribute_tensor(src_data_rank=None)``, no
    communication). Values as a full init after ``torch.manual_seed(seed)``; peak memory the
    sharded model plus the largest module."""
    model.to_empty(device=device)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    done: set[int] = set()

    def visit(module):
        for child in module.children():
            visit(child)
        swapped = {name: (p, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                requires_grad=p.requires_grad))
                   for name, p in compat.own_parameters(module).items()}
        with compat.swapped_parameters(module, {name: full for name, (_, full) in swapped.items()}):
            init_fn(module)
        for p, full in swapped.values():
            if id(p) not in done:
                done.add(id(p))
                if isinstance(p, DTensor):
                    shard = distribute_tensor(full.data, p.device_mesh, p.placements, src_data_rank=None)
                    p.to_local().copy_(shard.to_local())
                else:
                    p.data.copy_(full.data)

    visit(model)


def reshard(models) -> None:
    """Free every unit's unsharded parameters; call before writing local shards (an evaluation
    leaves the tail unit unsharded, and the next forward would use stale full weights)."""
    for model in models:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def track_forward_only(model: torch.nn.Module, accumulating) -> object | None:
    """``reset_iter_state()`` before the first forward with grad after ``no_grad`` forwards (an
    evaluation, which FSDP2 records in its post-forward order until a backward ends: the
    next backward would all-gather its last unit for nothing), unless ``accumulating()``.
    Returns the hook handle, or None for a model that is not an ``FSDPModule``."""
    if not isinstance(model, FSDPModule):
        return None
    forward_only = [False]

    def before_forward(module, args):
        if not torch.is_grad_enabled():
            forward_only[0] = True
        elif forward_only[0]:
            forward_only[0] = False
            if not accumulating():
                compat.reset_iter_state(module)

    return model.register_forward_pre_hook(before_forward, prepend=True)


@torch.no_grad()
def check_replicas_identical(model: torch.nn.Module, layout, rank: int, device: torch.device) -> None:
    """ValueError on every rank unless all groups and replicas hold identical parameters:
    fp64 sum, sum of squares and position-weighted sum per rank (in 2**20-value chunks),
    all-reduced over the world, compared per shard coordinate. Collective."""
    world = layout.world_size
    sums = torch.zeros(world, 3, dtype=torch.float64, device=device)
    chunk = 1 << 20
    for p in model.parameters():
        t = local(p).detach().reshape(-1)
        for start in range(0, t.numel(), chunk):
            c = t[start:start + chunk].to(torch.float64)
            w = torch.arange(start + 1, start + c.numel() + 1, dtype=torch.float64, device=c.device).remainder_(97)
            sums[rank] += torch.stack([c.sum(), (c * c).sum(), (c * w).sum()])
    dist.all_reduce(sums)
    first: dict[int, int] = {}
    differ = set()
    for k in range(world):
        f, r, s = layout.coords(k)
        if not torch.equal(sums[k], sums[first.setdefault(s, k)]):
            differ.add((f, r))
    if differ:
        groups = sorted({f for f, _ in differ})
        where = f"group(s) {groups}" + (f" (group, HSDP replica): {sorted(differ)}" if layout.uses_hsdp else "")
        raise ValueError(
            f"the federation groups do not start from identical parameters: {where} differ from group 0's "
            f"first replica. Seed identically on every rank before building the model "
            f"(accelerate.utils.set_seed(seed), not seed + rank); averaging differently initialized models "
            f"destroys training at the first sync.")
