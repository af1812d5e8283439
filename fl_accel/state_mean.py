"""Weighted means over the federation groups besides the sync's exchange of pseudo-gradients:
the inner optimizer's state (``FLConfig.average_optimizer_state``) and the non-finite reset's
(:mod:`fl_accel.nonfinite`). Both run inside a sync event, on the event's round, through
the same :class:`~fl_accel.exchange.Exchange` (the exact fp32 mean) and the transport's
:class:`~fl_accel.sync.EventHooks` (torchft: writes held until the commit).
"""

from __future__ import annotations

import torch

from .exchange import Exchange, Round
from .fsdp import local


def optimizer_state_tensors(optimizer, params: list, indices: list[int]) -> list[torch.Tensor]:
    """Local shards of the inner optimizer's floating-point state of parameters ``indices``
    (AdamW ``exp_avg``, ``exp_avg_sq``; not ``step``), in one order on every rank."""
    out = []
    for i in indices:
        state = optimizer.state.get(params[i], {})
        out += [local(state[k]) for k in sorted(state)
                if torch.is_tensor(state[k]) and state[k].is_floating_point() and state[k].dim() > 0]
    return out


def mean_into(sync, tensors: list[torch.Tensor], rnd: Round, mask=None, also=None, write: bool = True) -> None:
    """``tensors`` <- their fp32 weighted mean over the groups of ``rnd`` (``mask``: per-group
    0/1, weights renormalized over the 1s), then ``also(positions, means)``; with ``write``
    False only the collectives run (a group that keeps its own values). Collective: every rank
    of every group, the same tensors' shapes in one order. ``sync``: the
    :class:`~fl_accel.sync.FederatedSynchronizer` (transport, hooks, bucket size)."""
    def copy(pos, means):
        for j, m in zip(pos, means):
            if write:
                tensors[j].copy_(m)
        if also is not None:
            also(pos, means)

    def put(pos, means):
        if sync.hooks.deferred is None:
            copy(pos, means)
        else:  # the bucket is released after this call
            kept = [m.clone() for m in means]
            sync.hooks.deferred.append(lambda: copy(pos, kept))

    Exchange(sync.transport, rnd, tensors, mask=mask,
             bucket_values=max(1, sync.config.sync_bucket_mb * 2**18)).run(put)


def average_optimizer_state(sync, indices: list[int], rnd: Round) -> None:
    """The inner optimizer's state of parameters ``indices`` <- its mean over the groups
    (after their exchange; ``FLConfig.average_optimizer_state``). Collective."""
    tensors = optimizer_state_tensors(sync.optimizer, sync.params, indices)
    if tensors:
        mean_into(sync, tensors, rnd)
