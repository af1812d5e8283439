"""The synchronizer's FSDP2 shard plumbing: local shards, canonical parameter names, FSDP units.

Torch only (``torch.distributed.fsdp.fully_shard``), testable on a one-process group. (The
group's model around Accelerate's preparation: :mod:`fl_accel.fsdp_model`.) Relied on
(public API; the internals are reached through :mod:`fl_accel.compat`):

* FSDP2 parameters are DTensors whose ``to_local()`` is this rank's shard, laid out as
  ``distribute_tensor`` with the same mesh and placements lays it out.
* The modules of one ``fully_shard`` call form a unit (:func:`fl_accel.compat.fsdp_unit_key`;
  Accelerate shards [final norm, lm_head] as one).
* Activation checkpointing and ``torch.compile`` insert prefixes into parameter names
  (:func:`fl_accel.compat.wrapper_prefixes`); DCP's ``get_model_state_dict`` strips both.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from . import compat

WRAPPER_PREFIXES = compat.wrapper_prefixes()


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor (a plain tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def canonical_name(name: str) -> str:
    """``name`` without the AC and compile wrappers' prefixes (checkpoints resume across them)."""
    return WRAPPER_PREFIXES.sub("", name)


def fsdp_units(model: torch.nn.Module, params: list) -> list[list[int]]:
    """Indices into ``params`` per FSDP unit (``FSDPModule``s grouped by :func:`compat.fsdp_unit_key`),
    in registration order, root last: the parameters no nested unit holds, each in the first
    unit reaching it (tied weights); parameters of no unit form one unit each."""
    index = {id(p): i for i, p in enumerate(params)}
    units: dict[int, list[int]] = {}
    root_state, taken = None, set()

    def own(module):
        for p in module.parameters(recurse=False):
            yield p
        for child in module.children():
            if not isinstance(child, FSDPModule):
                yield from own(child)

    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            state = compat.fsdp_unit_key(module)
            root_state = state if name == "" else root_state
            for p in own(module):
                if id(p) in index and id(p) not in taken:
                    taken.add(id(p))
                    units.setdefault(state, []).append(index[id(p)])
    ordered = [sorted(u) for s, u in units.items() if s != root_state] + [sorted(units.get(root_state, []))]
    ordered = [u for u in ordered if u]
    return ordered + [[i] for i in range(len(params)) if i not in {j for u in ordered for j in u}]

