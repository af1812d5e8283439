"""Several training scenarios in one launch (a launch costs ~10 s of imports on a small CPU box).

Between scenarios ``end_training`` runs with the process-group teardown suppressed, and
Accelerate's singletons are reset so the next FLAccelerator builds a fresh mesh on the same
world process group, as a new process would. The last scenario's end_training is the real one.
"""

from __future__ import annotations


def inject_round_plan(sync, plan) -> None:
    """Rounds of a fixed length (a test hook, for exact comparisons): round k's steps per
    group are ``plan[min(k, len(plan) - 1)]``, replacing the trigger planner's plan
    (:class:`fl_accel.trigger.TriggerPlanner`) as each round starts, before its first step
    is counted."""
    planner = sync.planner
    count = planner.before_step

    def before_step(synchronizer) -> None:
        r = planner.rounds
        if r.steps == 0:  # a round starts at this step
            r.plan = [int(n) for n in plan[min(len(r.rounds), len(plan) - 1)]]
        count(synchronizer)

    planner.before_step = before_step


def end_training(acc, last: bool) -> None:
    """``acc.end_training()``; before the last scenario, without destroying the process groups."""
    from accelerate.state import AcceleratorState

    if last:
        acc.end_training()
        return
    from unittest import mock

    with mock.patch.object(AcceleratorState, "destroy_process_group", lambda self, group=None: None):
        acc.end_training()


def reset_for_next_scenario() -> None:
    """Keep the world process group (PartialState); forget everything else."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_CPU


def local_shards(params) -> list:
    """Copies of this rank's local shards (:func:`fl_accel.fsdp.local`)."""
    from fl_accel.fsdp import local

    return [local(p).detach().clone() for p in params]


def save_record(rec: dict, out, name: str, rank: int, last: bool) -> None:
    """Write ``out/<name>/rank<k>.pt``; before the next scenario, reset Accelerate's singletons."""
    import torch

    (out / name).mkdir(parents=True, exist_ok=True)
    torch.save(rec, out / name / f"rank{rank}.pt")
    if not last:
        reset_for_next_scenario()


class _OuterView:
    def __init__(self, sync):
        self.sync = sync

    def _gather(self, kind):
        parts, first = self.sync.parts, self.sync.fragments[0]
        return None if getattr(first, kind) is None else [getattr(f, kind)[j] for f, j in parts]

    anchor = property(lambda self: self._gather("anchor"))
    residuals = property(lambda self: self._gather("residuals"))
    on_host = property(lambda self: self.sync.fragments[0].on_host)

    @property
    def optimizer(self):
        from types import SimpleNamespace

        parts, first = self.sync.parts, self.sync.fragments[0]
        if first.outer is None:
            return None
        return SimpleNamespace(state={i: f.outer.state[f.anchor[j]] for i, (f, j) in enumerate(parts)
                                      if f.anchor[j] in f.outer.state}, param_groups=first.outer.param_groups)


def outer_view(sync):
    """The synchronizer's outer state by parameter index (the model's order), gathered from its
    fragments (:class:`fl_accel.fragment.Fragment` owns its own) when read: ``anchor``,
    ``residuals`` (lists, or None when not kept), ``on_host`` and ``optimizer`` (None without
    "nesterov"; ``state``: each stepped anchor's SGD state, ``param_groups``: fragment 0's,
    e.g. the outer LR)."""
    return _OuterView(sync)


def exchange_mean(transport, tensors, sync_dtype: str = "fp32", collectives: str = "auto"):
    """The weighted mean of ``tensors`` over the transport's membership, on ``sync_dtype``'s codec
    (bf16/int8 over ``collectives``)."""
    from fl_accel.codecs import make_codec
    from fl_accel.exchange import Exchange

    codec = make_codec(sync_dtype, collectives=collectives)
    return Exchange(transport, transport.begin(), tensors, codec=codec).start().finish()


def validated(config, world_size: int | None = None, ranks_per_node: int | None = None):
    """``config`` after the layout check for ``world_size`` ranks (FLLayout.from_config: ValueError
    naming the field, e.g. F not dividing the world); the fields were checked at construction."""
    from fl_accel.mesh import FLLayout

    if world_size is not None:
        FLLayout.from_config(config, world_size, ranks_per_node=ranks_per_node)
    return config
