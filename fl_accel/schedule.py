"""When the federation groups synchronize: the schedule's counters and the fixed-H round planner (pure logic).

Paper (arXiv 2609.20359) Sec. 3, Alg. 1: after every H-th optimizer step the groups
average. With fragments (Streaming DiLoCo, arXiv 2501.18512) there is an event every H/P
steps, fragment (event number mod P) round-robin, so fragment k is applied at steps
(k+1) H/P + n H; its exchange launches tau steps before its event (0 <= tau <= H, so up to
ceil(tau P/H) fragments are in flight, each at most once), an exchange advances to its second
collective (bf16/int8 over all-to-all; a no-op for the others) halfway through its window (launch +
max(1, floor(tau/2)) steps, if before its event: each collective gets half the window to cross the
link), and at an event the fragment whose
exchange completes is applied first, then a launch due at the same step is made. A launch
that would fall at or before the schedule's start (step 0, the end of the warm-up, a full
sync) is skipped: that event applies nothing (SKIP). P = 1, tau = 0 is the paper's blocking
sync; P = 1, tau = H overlaps rounds (round k's exchange runs during round k+1, also for
rounds by time/speed). ``warmup_steps`` K: the first K steps are a data-parallel warm-up
(no events; ANCHOR at step K), and events count from step K. A full sync (``end_training``)
completes every exchange in flight in launch order, then syncs every fragment.
The caller runs the actions :meth:`SyncSchedule.step` returns and reports each event with
:meth:`~SyncSchedule.applied` (a fragment) or :meth:`~SyncSchedule.synced` (a full sync).
:class:`FixedPlanner` is the round planner of that fixed H (the synchronizer's default; the
other is :class:`fl_accel.trigger.TriggerPlanner`). No tensors, no processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

LAUNCH, ADVANCE, APPLY, SKIP, FULL, ANCHOR = "launch", "advance", "apply", "skip", "full", "anchor"


@dataclass
class SyncSchedule:
    """The schedule (H, P, tau, alpha, ``delayed_local_steps``, K as FLConfig) and its counters
    (a checkpoint's ``sync``): ``active`` False with one group (steps are counted, nothing
    syncs); ``local_step`` since the last event; ``num_syncs`` events; ``num_fragment_syncs``
    k (fragment k mod P is next); ``in_sync``: groups equal (no step since a full sync, nothing
    in flight); ``inflight_fragments``: the fragments whose exchange is in flight, in launch order."""

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
    inflight_fragments: list[int] = field(default_factory=list)
    round_steps: int | None = None
    """This round's optimizer steps when a round planner sets them (rounds by time or speed,
    :class:`fl_accel.trigger.TriggerPlanner`; P = 1, tau 0 or H); None: H."""
    final_step: int | None = None
    """The run's last optimizer step, if known (``FLAccelerator.set_max_steps``, through the
    planner): its sync is the final one. Not a counter: a checkpoint does not keep it."""
    delayed_local_steps: str = "discard"
    warmup_steps: int = 0

    period = property(lambda self: self.sync_every // self.num_fragments, doc="H/P.")
    blocking = property(lambda self: self.num_fragments == 1 and self.sync_delay == 0, doc="The paper's sync.")
    overlaps_rounds = property(lambda self: self.num_fragments == 1 and 0 < self.sync_delay == self.sync_every,
                               doc="P = 1, tau = H: launch at an event, apply at the next (any round length).")
    inflight = property(lambda self: self.inflight_fragments[0] if self.inflight_fragments else None,
                        doc="The oldest fragment in flight (the next applied), or None.")
    warming_up = property(lambda self: self.active and self.global_step < self.warmup_steps,
                          doc="The next optimizer step is a warm-up step (gradients averaged across groups).")

    def step(self) -> list[tuple[str, int | None]]:
        """Count one optimizer step; return the actions due: ``(ADVANCE, k)``, ``(APPLY, k)``
        (k's exchange in flight, or a blocking one with tau = 0), ``(SKIP, k)``, ``(FULL,
        None)``, then ``(LAUNCH, k)``; ``(ANCHOR, None)`` at the last warm-up step."""
        self.global_step += 1
        if self.global_step <= self.warmup_steps:  # one data-parallel job: the groups stay identical
            return [(ANCHOR, None)] if self.active and self.global_step == self.warmup_steps else []
        self.local_step += 1
        self.in_sync = False
        return self.actions()

    def actions(self) -> list[tuple[str, int | None]]:
        """The actions due from the counters as they are (asked again after a heal, which
        replaces them). Records a launch, and drops the applied fragment from the flight."""
        if not self.active:
            return []
        P, tau, flight, out = self.num_fragments, self.sync_delay, self.inflight_fragments, []
        for i, k in enumerate(flight):
            launch, event = self._window(i)
            if self.local_step == launch + max(1, (event - launch) // 2) < event:  # halfway: each stage half the window
                out.append((ADVANCE, k))
        due = self.local_step >= self.round_length
        if due:
            k = self.num_fragment_syncs % P
            if self.blocking:
                out.append((FULL, None))
            elif flight[:1] == [k]:
                flight.pop(0)
                out.append((APPLY, k))
            elif tau < self.period:  # launched this round, yet not in flight (a heal): a blocking exchange
                out.append((APPLY, k))
            else:  # its launch fell at or before the schedule's start (step 0, the warm-up's end, a full sync)
                out.append((SKIP, k))
        ahead = (1 if due else None) if self.overlaps_rounds else self._launch_ahead()
        if ahead is not None and tau:
            k = (self.num_fragment_syncs + ahead) % P
            if k not in flight:  # (a fragment is in flight once; asked again after a heal: launched already)
                flight.append(k)
                out.append((LAUNCH, k))
        return out

    def _window(self, i: int) -> tuple[int, int]:
        """``(launch, event)``: local steps (from the last event) of the i-th exchange in flight."""
        if self.overlaps_rounds:
            return 0, self.round_length
        period, tau = self.period, self.sync_delay
        j = (self.local_step - 1 + tau) // period - len(self.inflight_fragments) + i  # events ahead
        return (j + 1) * period - tau, (j + 1) * period

    def _launch_ahead(self) -> int | None:
        """j when the exchange of the j-th event ahead (0: the next) launches at this local step."""
        q, r = divmod(self.local_step + self.sync_delay, self.period)
        return q - 1 if r == 0 and q >= 1 else None

    @property
    def round_length(self) -> int:
        """Steps from one event to the next: ``round_steps`` if set (P = 1), else H/P."""
        return self.round_steps if self.round_steps is not None and self.num_fragments == 1 else self.period

    @property
    def final(self) -> bool:
        """This step is the run's last (:attr:`final_step`): its sync is the final one."""
        return self.final_step is not None and self.global_step >= self.final_step

    def due(self) -> bool:
        """The next optimizer step ends with a sync event."""
        return self.active and self.global_step >= self.warmup_steps and self.local_step + 1 >= self.round_length

    def applied(self, skipped: bool = False) -> None:
        """A fragment event (APPLY, or SKIP: nothing applied) completed."""
        self.num_fragment_syncs += 1
        kept = self.delayed_local_steps == "keep" and self.sync_delay > 0
        self._end(full=self.num_fragments == 1 and self.fragment_update_alpha == 0 and not kept and not skipped
                  and not self.inflight_fragments)

    def synced(self, alpha: float = 0.0) -> None:
        """A full sync completed (with the exchanges in flight); ``alpha`` 0: groups equal."""
        if not self.active:
            self.local_step, self.in_sync = 0, True
            return
        self.num_fragment_syncs += len(self.inflight_fragments)
        self.inflight_fragments.clear()
        self._end(full=alpha == 0)

    def _end(self, full: bool) -> None:
        self.local_step = 0
        self.num_syncs += 1
        self.in_sync = self.in_sync or full

    def state_dict(self) -> dict:
        """The counters (JSON): ``inflight_fragment``, the oldest in flight, and with several in
        flight ``inflight_fragments``, all of them in launch order."""
        several = {"inflight_fragments": list(self.inflight_fragments)} if len(self.inflight_fragments) > 1 else {}
        return {"local_step": self.local_step, "global_step": self.global_step, "num_syncs": self.num_syncs,
                "num_fragment_syncs": self.num_fragment_syncs, "in_sync": self.in_sync,
                "inflight_fragment": self.inflight, **several}

    def load_state_dict(self, state: dict) -> None:
        self.local_step, self.global_step = int(state["local_step"]), int(state["global_step"])
        self.num_syncs, self.num_fragment_syncs = int(state["num_syncs"]), int(state.get("num_fragment_syncs", 0))
        self.in_sync = bool(state.get("in_sync", self.local_step == 0))
        self.inflight_fragments = inflight_of(state)


def inflight_of(counters: dict) -> list[int]:
    """The fragments in flight of a checkpoint's ``sync`` counters, in launch order (``inflight_fragments``,
    or the one ``inflight_fragment`` that older checkpoints and runs with at most one in flight write)."""
    several, one = counters.get("inflight_fragments"), counters.get("inflight_fragment")
    return [int(k) for k in several] if several is not None else [] if one is None else [int(one)]


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
