"""What a group healing from a live one takes over (``fault_tolerance="torchft"``): torchft
0.2.0's Manager calls :func:`capture` on a live group and :func:`restore` on the healing one.
"""

from __future__ import annotations

import torch

from .fsdp import local


def capture(sync, schedulers: list, extra: dict | None = None) -> dict:
    """Cloned local tensors to continue as this group: ``params``, ``optimizer`` (state and
    hyperparameters), ``outer`` (anchor, momentum), ``schedule``, ``schedulers``, ``extra``;
    not the residuals or data position (each group's own). On torchft's quorum thread."""
    opt = sync.optimizer
    state = {}
    for i, p in enumerate(sync.params):
        st = opt.state.get(p)
        if st:
            state[i] = {k: (local(v).detach().clone(), hasattr(v, "to_local")) if torch.is_tensor(v) else v
                        for k, v in st.items()}
    shared, _ = sync.outer.tensors()
    return {"params": [local(p).detach().clone() for p in sync.params],
            "optimizer": {"state": state, "groups": [{k: v for k, v in g.items() if k != "params"}
                                                     for g in opt.param_groups]},
            "outer": {i: {k: v.detach().clone() for k, v in d.items()} for i, d in shared.items()},
            "schedule": sync.schedule.state_dict(),
            "schedulers": [s.state_dict() for s in schedulers],
            "extra": dict(extra or {})}


@torch.no_grad()
def restore(sync, schedulers: list, state: dict) -> None:
    """Inverse of :func:`capture` (residuals zeroed, nothing in flight); the caller reshards
    first and applies ``extra``. ValueError: parameter count or shard shapes differ."""
    params = sync.params
    if len(state["params"]) != len(params) or any(
            tuple(v.shape) != tuple(local(p).shape) for v, p in zip(state["params"], params)):
        raise ValueError("torchft heal: the live group's parameters do not match this group's model (count or "
                         "shard shapes differ); every federation group must run the same model and group size")
    for p, v in zip(params, state["params"]):
        local(p).copy_(v)
    opt = sync.optimizer
    for i, p in enumerate(params):
        saved = state["optimizer"]["state"].get(i)
        if saved is None:
            opt.state.pop(p, None)
            continue
        current = opt.state.setdefault(p, {})
        for k, v in saved.items():
            if not isinstance(v, tuple):
                current[k] = v
                continue
            value, distributed = v
            if torch.is_tensor(current.get(k)) and local(current[k]).shape == value.shape:
                local(current[k]).copy_(value)
            elif distributed:
                from torch.distributed.tensor import DTensor
                current[k] = DTensor.from_local(value.to(local(p).device), p.device_mesh, p.placements,
                                                shape=p.shape, stride=p.stride())
            else:
                current[k] = value.clone()
    for group, saved in zip(opt.param_groups, state["optimizer"]["groups"]):
        group.update(saved)
    residuals = {i: {"residual": r} for i, r in enumerate(sync.outer.residuals or ())}
    sync.outer.load(state["outer"], residuals)
    sync.outer.zero_residuals()
    sync.schedule.load_state_dict(state["schedule"])
    for fragment in sync.fragments:
        fragment.pending = None
    for scheduler, saved in zip(schedulers, state["schedulers"]):
        scheduler.load_state_dict(saved)
