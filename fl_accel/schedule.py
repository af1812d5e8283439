"""When the federation groups synchronize: the schedule's counters and the fixed-H round planner (pure logic).

Paper (arXiv 2609.20359) Sec. 3, Alg. 1: after every H-th optimizer step the groups
average. With fragments (Streaming DiLoCo, arXiv 2501.18512) fragment k mod P syncs at the
k-th fragment sync, every H/P steps: its exchange launches at local step H/P - tau, a
compressed one advances to its all-gather a step later (if before the apply), and the
result is applied at local step H/P. P = 1, tau = 0 is the paper's blocking sync. A full
sync (``end_training``) completes the fragment in flight, then syncs every fragment.
The caller runs the actions :meth:`SyncSchedule.step` returns and reports each event with
:meth:`~SyncSchedule.applied` (a fragment) or :meth:`~SyncSchedule.synced` (a full sync).
:class:`FixedPlanner` is the round planner of that fixed H (the synchronizer's default; the
other is :class:`fl_accel.trigger.TriggerPlanner`). No tensors, no processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

LAUNCH, ADVANCE, APPLY, FULL = "launch", "advance", "apply", "full"


@dataclass
class SyncSchedule:
    """The schedule (H, P, tau, alpha as FLConfig) and its counters (a checkpoint's ``sync``):
    ``active`` False with one group (steps are counted, nothing syncs); ``local_step``
    since the last event; ``num_syncs`` events; ``num_fragment_syncs`` k (fragment k mod P
    is next); ``in_sync``: groups equal (no step since a full sync); ``inflight`` fragment."""

    sync_every: int
    num_fragments: int = 1
    sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    active: bool = True
    local_step: int = 0
    global_step: int = 0
    num_syncs: int = 0
    num_fragment_syncs: int = 0
    in_sync: bool = True
    inflight: int | None = None
    round_steps: int | None = None
    """This round's optimizer steps when a round planner sets them (rounds by time or speed,
    :class:`fl_accel.trigger.TriggerPlanner`; blocking only); None: H."""
    final_step: int | None = None
    """The run's last optimizer step, if known (``FLAccelerator.set_max_steps``, through the
    planner): its sync is the final one. Not a counter: a checkpoint does not keep it."""

    period = property(lambda self: self.sync_every // self.num_fragments, doc="H/P.")
    blocking = property(lambda self: self.num_fragments == 1 and self.sync_delay == 0, doc="The paper's sync.")

    def step(self) -> list[tuple[str, int | None]]:
        """Count one optimizer step; return the actions due: ``(LAUNCH, k)``, ``(ADVANCE, k)``,
        ``(APPLY, k)`` (launching first if k is not in flight) or ``(FULL, None)``."""
        self.local_step += 1
        self.global_step += 1
        self.in_sync = False
        return self.actions()

    def actions(self) -> list[tuple[str, int | None]]:
        """The actions due from the counters as they are (asked again after a heal)."""
        if not self.active:
            return []
        k, tau, out = self.num_fragment_syncs % self.num_fragments, self.sync_delay, []
        if tau and self.local_step == self.period - tau:
            self.inflight = k
            out.append((LAUNCH, k))
        elif self.inflight is not None and self.local_step == self.period - tau + 1 < self.period:
            out.append((ADVANCE, self.inflight))
        if self.local_step >= self.round_length:
            out.append((FULL, None) if self.blocking else (APPLY, k))
        return out

    @property
    def round_length(self) -> int:
        """Steps from one event to the next: ``round_steps`` if set (blocking), else H/P."""
        return self.round_steps if self.round_steps is not None and self.blocking else self.period

    @property
    def final(self) -> bool:
        """This step is the run's last (:attr:`final_step`): its sync is the final one."""
        return self.final_step is not None and self.global_step >= self.final_step

    def due(self) -> bool:
        """The next optimizer step ends with a sync event."""
        return self.active and self.local_step + 1 >= self.round_length

    def applied(self) -> None:
        """A fragment sync (APPLY) completed."""
        self.inflight = None
        self.num_fragment_syncs += 1
        self._end(full=self.num_fragments == 1 and self.fragment_update_alpha == 0)

    def synced(self, alpha: float = 0.0) -> None:
        """A full sync completed (with the fragment in flight); ``alpha`` 0: groups equal."""
        if not self.active:
            self.local_step, self.in_sync = 0, True
            return
        if self.inflight is not None:
            self.inflight = None
            self.num_fragment_syncs += 1
        self._end(full=alpha == 0)

    def _end(self, full: bool) -> None:
        self.local_step = 0
        self.num_syncs += 1
        self.in_sync = self.in_sync or full

    def state_dict(self) -> dict:
        """The counters (JSON)."""
        return {"local_step": self.local_step, "global_step": self.global_step, "num_syncs": self.num_syncs,
                "num_fragment_syncs": self.num_fragment_syncs, "in_sync": self.in_sync,
                "inflight_fragment": self.inflight}

    def load_state_dict(self, state: dict) -> None:
        self.local_step, self.global_step = int(state["local_step"]), int(state["global_step"])
        self.num_syncs, self.num_fragment_syncs = int(state["num_syncs"]), int(state.get("num_fragment_syncs", 0))
        self.in_sync = bool(state.get("in_sync", self.local_step == 0))
        fragment = state.get("inflight_fragment")
        self.inflight = None if fragment is None else int(fragment)


class FixedPlanner:
    """Round planning at the paper's fixed H: the interface the synchronizer calls, no-ops but
    the run's length (the other planner: :class:`fl_accel.trigger.TriggerPlanner`)."""

    rounds = None
    """The planner's round state (:class:`fl_accel.trigger.RoundState`), else None."""

    def before_step(self, event) -> None:
        """Count an optimizer step into the round (before the schedule's actions; ``event``: a
        :class:`fl_accel.sync.SyncEvent`); may set ``event.schedule.round_steps``."""

    def rejoin(self, schedule: SyncSchedule) -> None:
        """This group's state was replaced by a live group's (a torchft heal)."""

    def close(self, event):
        """A full sync's round (collective for a planner that exchanges figures): the event's
        membership with the round's merge weights."""
        return event.membership

    def after_sync(self) -> None:
        """A full sync ended."""

    def restart_clock(self) -> None:
        """Leave the time since the last step out of the round's training time (a timed planner)."""

    def set_run_length(self, schedule: SyncSchedule, max_steps: int) -> None:
        """The run ends after optimizer step ``max_steps``: its sync is the final one."""
        schedule.final_step = max_steps

    def state_dict(self) -> dict:
        """The planner's entries of a checkpoint's ``sync`` (JSON)."""
        return {}

    def load_state_dict(self, state: dict, schedule: SyncSchedule) -> None:
        """Inverse of :meth:`state_dict` (``state``: the checkpoint's ``sync``)."""

    def take_over(self, state: dict) -> None:
        """A heal: this group continues from a live group's :meth:`state_dict` entries."""


def deal_fragments(units: Sequence, num_fragments: int) -> list[list]:
    """Fragment k of P = ``num_fragments`` holds the units u with u mod P = k (streaming
    DiLoCo's strided deal, arXiv 2501.18512 Sec. 2.2), in order. ValueError: P exceeds
    the number of units (a fragment would be empty)."""
    if num_fragments > len(units):
        raise ValueError(f"num_fragments={num_fragments} exceeds the {len(units)} FSDP units of the model; "
                         "each fragment needs at least one unit")
    return [list(units[k::num_fragments]) for k in range(num_fragments)]
