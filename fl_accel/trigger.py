"""When a round ends for groups of unequal speed: the round planner of the synchronizer.

:class:`RoundState` is pure logic (no tensors, no processes); :class:`TriggerPlanner` plugs
it into the synchronizer's round-planning extension point (the interface of
:class:`fl_accel.schedule.FixedPlanner`, the paper's fixed H), and :func:`make_planner` picks it
(``sync_trigger`` other than "steps", the one predicate).

With ``sync_trigger="steps"`` (the paper's Alg. 1) every federation group syncs after the
same H optimizer steps, so at every sync the fastest group waits for the slowest. The two
other triggers end a round by time or by speed instead (cf. Async Local-SGD, arXiv
2401.09135, which scales local steps to each worker's speed; Decoupled DiLoCo, arXiv
2604.21428, which merges by tokens):

* ``"time"``: every group trains until ``sync_window_s`` seconds of training have passed
  since the round began, then all sync. The ranks of one group agree on "time is up" by a
  one-value MAX over the group at each optimizer step (never across groups).
* ``"speed"``: group f trains ``H_f = max(1, round(H * t_max / t_f))`` steps, ``t_f`` its
  mean seconds per optimizer step in the last round: the slowest group does H (the syncs per
  hour of the barrier), a group k times faster k H, and all arrive together (up to half of a
  fast group's step). The first round is H for every group.

At each sync the groups exchange one small vector per group (:data:`FIELDS`): steps and
training seconds of the round, the time spent waiting at syncs, and the group's index. From
it every rank computes the same merge weights (:func:`fl_accel.mesh.merge_weights`), the
next round's steps, and the federation's progress in tokens.

With ``fault_tolerance="torchft"`` the table has one row per group of the sync's quorum
(torchft's ``participating_rank`` order, which may change between quorums), so the rows
carry the group index and the per-group counters are kept by index. A group missing from
a quorum trained nothing the federation counts in that round; the next round is planned
from the groups present. A group that heals takes over a live group's state
(:meth:`RoundState.take_over`) and enters the round with no steps of its own, so its merge
weight is 0, as torchft's healed groups have in the "steps" mode.

Run length: T optimizer steps become the tokens of a "steps" run, ``T x sum_f G_f``
rank-steps; the round that reaches them is planned in steps, shared in proportion to the
groups' rates (docs/unequal_groups.md).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Sequence

from .mesh import merge_weights

FIELDS = ("steps", "train_s", "wait_s", "timed_steps", "group")
"""The per-group vector exchanged at each sync (:meth:`RoundState.vector`)."""


def speed_steps(sync_every: int, seconds_per_step: Sequence[float]) -> list[int]:
    """H_f = max(1, round(H * t_max / t_f)) for the "speed" trigger: the slowest group does H
    steps, a group twice as fast 2H. A group without a measurement (t <= 0) gets H."""
    known = [t for t in seconds_per_step if t > 0]
    if not known:
        return [sync_every] * len(seconds_per_step)
    slowest = max(known)
    return [max(1, round(sync_every * slowest / t)) if t > 0 else sync_every for t in seconds_per_step]


def last_round(remaining: float, rates: Sequence[float], sizes: Sequence[int]) -> list[int]:
    """Steps per group for the round that ends the run: ``remaining`` rank-steps shared in
    proportion to each group's rate (``rates[f]``: its steps in a typical round), so that
    ``sum_f G_f n_f`` is ``remaining`` up to rounding; at least 1 step each."""
    per_round = sum(g * r for g, r in zip(sizes, rates))
    scale = remaining / per_round if per_round > 0 else 0.0
    return [max(1, round(r * scale)) for r in rates]


@dataclass
class RoundState:
    """The trigger's state on one rank (a checkpoint's ``sync.round``; the same on every rank
    right after a sync, except ``train_s``/``steps`` mid-round).

    ``sizes``: G_f; ``plan``: steps per group of the current round (None: by time, or H);
    ``group_steps``: optimizer steps per group at the last sync; ``tokens``: the federation's
    rank-steps at the last sync; ``budget``: rank-steps of the run (None: unbounded);
    ``seconds_per_step``: per group, from the last round; ``wait_s``/``train_s_total``: per
    group, summed over the run; ``timed_total``: per group, the steps ``train_s_total`` timed
    (a run's first step and the first after a resume are not); ``done``: the budget is
    reached (the loop stops)."""

    trigger: str
    sync_every: int
    sizes: tuple[int, ...]
    position: int
    window_s: float | None = None
    plan: list[int] | None = None
    group_steps: list[int] = field(default_factory=list)
    tokens: int = 0
    budget: int | None = None
    seconds_per_step: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    train_s_total: list[float] = field(default_factory=list)
    timed_total: list[int] = field(default_factory=list)
    rounds: list[list[int]] = field(default_factory=list)
    ends_s: list[float] = field(default_factory=list)
    """Seconds from the synchronizer's creation (this rank's clock) at each round's end."""
    done: bool = False
    steps: int = 0  # this group's steps in the current round
    train_s: float = 0.0  # this group's training seconds in the current round
    timed: int = 0  # of those steps, the ones timed (a step after a restart of the clock is not)

    def __post_init__(self):
        F = len(self.sizes)
        self.group_steps = self.group_steps or [0] * F
        self.seconds_per_step = self.seconds_per_step or [0.0] * F
        self.wait_s = self.wait_s or [0.0] * F
        self.train_s_total = self.train_s_total or [0.0] * F
        self.timed_total = self.timed_total or [0] * F

    @property
    def round_steps(self) -> int | None:
        """This group's steps in the current round, if known in advance (None: by time)."""
        if self.plan is not None:
            return self.plan[self.position]
        return None if self.trigger == "time" else self.sync_every

    def time_up(self) -> bool:
        """This rank's view: the round's window has passed (the group agrees by a MAX)."""
        return self.trigger == "time" and self.plan is None and self.train_s >= float(self.window_s)

    def vector(self, wait_s: float) -> list[float]:
        """This group's entry of the exchange (:data:`FIELDS`); ``wait_s``: seconds at syncs so far."""
        return [float(self.steps), float(self.train_s), float(wait_s), float(self.timed), float(self.position)]

    def close(self, table: Sequence[Sequence[float]], weighting: str, now_s: float | None = None,
              copies: Sequence[int] = ()) -> tuple[float, ...]:
        """End the round with the groups' vectors (``table[p]``, :data:`FIELDS`: row p of the
        round's membership, its ``group`` field the group's index; a table without that field
        has row f for group f): update the per-group counters, plan the next round from the
        groups present; return the round's merge weights, one per row (``copies``: rows of
        groups that healed in this quorum, weight 0: :func:`fl_accel.mesh.merge_weights`).
        ``now_s``: the round's end in seconds from the start (for :meth:`summary`). A row whose
        ``group`` is negative was not filled in (a failed torchft exchange): weight 0, nothing
        counted. ValueError: a group index out of range or twice, or no row filled in."""
        F = len(self.sizes)
        every = [int(round(row[4])) if len(row) > 4 else p for p, row in enumerate(table)]
        rows = [p for p, g in enumerate(every) if g >= 0]  # a negative index: a row nobody filled in
        groups = [every[p] for p in rows]
        if not rows or len(set(groups)) != len(groups) or not all(g < F for g in groups):
            raise ValueError(f"the round's table names groups {every}; expected distinct indices below {F}")
        row_steps = [int(round(table[p][0])) for p in rows]
        kept = dict(zip(rows, merge_weights(weighting, row_steps, [self.sizes[g] for g in groups],
                                            [i for i, p in enumerate(rows) if p in set(copies)])))
        weights = tuple(kept.get(p, 0.0) for p in range(len(table)))
        steps = [0] * F  # a group outside the round's membership trained nothing the federation counts
        for g, n in zip(groups, row_steps):
            steps[g] = n
        self.rounds.append(steps)
        if now_s is not None:
            self.ends_s.append(float(now_s))
        for g, n, row in zip(groups, row_steps, [table[p] for p in rows]):
            self.group_steps[g] += n
            self.train_s_total[g] += float(row[1])
            self.wait_s[g] = float(row[2])
            timed = int(round(row[3])) if len(row) > 3 else n
            self.timed_total[g] += timed
            if timed > 0 and row[1] > 0:
                self.seconds_per_step[g] = float(row[1]) / timed
        self.tokens += sum(g * n for g, n in zip(self.sizes, steps))
        self.steps, self.train_s, self.timed = 0, 0.0, 0
        self.done = self.budget is not None and self.tokens >= self.budget
        self.plan = self._next_plan(steps, groups)
        return weights

    def _next_plan(self, last: list[int], present: Sequence[int] | None = None) -> list[int] | None:
        present = set(range(len(self.sizes)) if present is None else present)
        if self.trigger == "speed":  # from the groups present; the others (no fresh measurement) do H
            timed = [t if f in present else 0.0 for f, t in enumerate(self.seconds_per_step)]
            rates = speed_steps(self.sync_every, timed)
        elif self.trigger == "time":
            rates = [max(1, n) for n in last]  # steps in one window, as measured
        else:
            rates = [self.sync_every] * len(self.sizes)
        if self.budget is not None and not self.done:
            remaining = self.budget - self.tokens
            share = [r if f in present else 0 for f, r in enumerate(rates)]  # what the groups present will train
            if sum(g * r for g, r in zip(self.sizes, share)) >= remaining:
                return last_round(remaining, share, self.sizes)
        return rates if self.trigger == "speed" else None

    def take_over(self, state: dict) -> None:
        """A torchft heal: load a live group's round state (:meth:`state_dict`), keeping this
        group's index; it enters the round with no steps of its own ("tokens" weight 0: a copy
        would weigh twice). The rounds' end times up to the heal are the source's clock."""
        self.load_state_dict(state)
        self.steps, self.train_s, self.timed = 0, 0.0, 0

    def progress_steps(self) -> float:
        """The federation's progress in optimizer steps of a "steps" run (rank-steps over N),
        with this group's steps since the last sync extrapolated to every group."""
        return (self.tokens + self.steps * sum(self.sizes)) / sum(self.sizes)

    def state_dict(self) -> dict:
        return {"trigger": self.trigger, "plan": None if self.plan is None else list(self.plan), "group_steps": list(self.group_steps),
                "tokens": self.tokens, "budget": self.budget, "seconds_per_step": list(self.seconds_per_step),
                "wait_s": list(self.wait_s), "train_s_total": list(self.train_s_total),
                "timed_total": list(self.timed_total), "rounds": [list(r) for r in self.rounds],
                "ends_s": list(self.ends_s),
                "done": self.done, "steps": self.steps, "train_s": self.train_s, "timed": self.timed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("trigger") != self.trigger:
            raise ValueError(f"the checkpoint's sync_trigger {state.get('trigger')!r} differs from this run's "
                             f"{self.trigger!r}")
        self.plan = state["plan"]
        self.group_steps, self.tokens = [int(n) for n in state["group_steps"]], int(state["tokens"])
        self.seconds_per_step = [float(t) for t in state["seconds_per_step"]]
        self.wait_s = [float(t) for t in state["wait_s"]]
        self.train_s_total = [float(t) for t in state["train_s_total"]]
        self.timed_total = [int(n) for n in state.get("timed_total", self.group_steps)]  # older: all timed
        self.rounds = [list(r) for r in state["rounds"]]
        self.ends_s = [float(t) for t in state.get("ends_s", [])]
        self.done, self.steps, self.train_s = bool(state["done"]), int(state["steps"]), float(state["train_s"])
        self.timed = int(state.get("timed", self.steps))

    def summary(self) -> dict:
        """all_results.json's ``rounds``: per group, steps per round, the share of wall time spent
        waiting at syncs (and its seconds, ``wait_s``, beside the seconds of training steps,
        ``train_s``), and tokens (rank-steps x tokens per rank-step is the caller's)."""
        F = len(self.sizes)
        wall = [self.train_s_total[f] + self.wait_s[f] for f in range(F)]
        return {"trigger": self.trigger, "num_rounds": len(self.rounds),
                "steps_per_round": [[r[f] for r in self.rounds] for f in range(F)],
                "group_steps": list(self.group_steps),
                "wait_share": [self.wait_s[f] / wall[f] if wall[f] > 0 else 0.0 for f in range(F)],
                "seconds_per_step": list(self.seconds_per_step), "timed_steps": list(self.timed_total),
                "wait_s": list(self.wait_s), "train_s": list(self.train_s_total),
                "rank_steps": self.tokens,
                "round_end_s": list(self.ends_s)}


class TriggerPlanner:
    """The synchronizer's round planner for ``sync_trigger`` "time"/"speed" (the interface of
    :class:`fl_accel.schedule.FixedPlanner`): counts and times each optimizer step into the round,
    sets the schedule's round length (``SyncSchedule.round_steps``), and at each full sync
    exchanges the groups' round figures and returns the round's merge weights.

    ``rounds``: the :class:`RoundState` (a checkpoint's ``sync.round``)."""

    def __init__(self, rounds: RoundState, weighting: str = "tokens"):
        self.rounds, self.weighting = rounds, weighting
        self._started = time.perf_counter()
        self._mark: float | None = None  # the last optimizer step's end (None: the next step is not timed)

    def before_step(self, event) -> None:
        """Count this step into the round and set the schedule's round length: planned steps,
        or (by time) this step ends the round when a rank of the group saw the window pass
        (``event``: a :class:`fl_accel.sync.SyncEvent`)."""
        r, now = self.rounds, time.perf_counter()
        if self._mark is not None:  # the step since the last one (not after a restart of the clock)
            r.train_s += now - self._mark
            r.timed += 1
        self._mark = now
        r.steps += 1
        planned = r.round_steps
        if planned is None:  # by time: the group agrees (a MAX over its ranks, never across groups)
            planned = r.steps if event.transport.group_max(float(r.time_up())) > 0 else r.steps + 1
        event.schedule.round_steps = planned

    def rejoin(self, schedule) -> None:
        """This group's state was replaced by a live group's (a torchft heal): it came to sync,
        and syncs now whatever its source's count."""
        schedule.round_steps = schedule.local_step

    def close(self, event):
        """Exchange the groups' round figures (``Transport.group_table``), close the round and
        return the event's membership (a :class:`fl_accel.exchange.Membership`) with the
        round's merge weights (``group_weighting``; a group healed in this torchft quorum, weight
        0 in the membership, is a copy of its source and keeps weight 0)."""
        r, membership = self.rounds, event.membership
        with event.arriving():
            table = event.transport.group_table(r.vector(event.clock.seconds), membership)
        steps = [row[0] for row in table]
        now_s = time.perf_counter() - self._started
        copies = [p for p, w in enumerate(membership.weights) if w <= 0]
        if not any(steps):  # nothing trained since the last sync (e.g. the exact final one)
            table = [[0.0] + list(row[1:]) for row in table]
            weights = r.close(table, "size", now_s=now_s, copies=copies)
        else:
            weights = r.close(table, self.weighting, now_s=now_s, copies=copies)
        return dataclasses.replace(membership, weights=tuple(weights))

    def after_sync(self) -> None:
        """A full sync ended: the next round's training starts now."""
        self._mark = time.perf_counter()

    def restart_clock(self) -> None:
        """Leave out the time since the last optimizer step (or sync) from the round's training
        time: call right after work between steps that is not training (logs, evaluations,
        checkpoints); the next step is timed from here. (Before a run's first step, and after a
        resume, the clock is unset: that step counts, untimed.)"""
        self._mark = time.perf_counter()

    def set_run_length(self, schedule, max_steps: int) -> None:
        """A budget of tokens, not of steps (groups of unequal speed): the run ends after the
        rank-steps of a "steps" run of ``max_steps`` steps (``rounds.done`` at that sync)."""
        r = self.rounds
        r.budget = int(max_steps) * sum(r.sizes)
        if not r.rounds:  # a run shorter than one round is planned as its last
            r.plan = r._next_plan([r.sync_every] * len(r.sizes))

    def state_dict(self) -> dict:
        """A checkpoint's ``sync`` entries: ``round`` (:meth:`RoundState.state_dict`)."""
        return {"round": self.rounds.state_dict()}

    def load_state_dict(self, state: dict, schedule) -> None:
        """Inverse of :meth:`state_dict`; the schedule's ``global_step`` becomes this group's
        own count. ValueError: no round state (a checkpoint of a "steps" run) or another trigger."""
        if "round" not in state:
            raise ValueError(f"the checkpoint has no round state; it was written with sync_trigger='steps', "
                             f"this run has {self.rounds.trigger!r}")
        self.rounds.load_state_dict(state["round"])
        schedule.global_step = self.rounds.group_steps[self.rounds.position]

    def take_over(self, state: dict) -> None:
        """A torchft heal: :meth:`RoundState.take_over` of the live group's ``round``."""
        if state.get("round") is not None:
            self.rounds.take_over(state["round"])


def make_planner(config, transport, group_sizes=None) -> TriggerPlanner | None:
    """The round planner of an FLConfig: a :class:`TriggerPlanner` when ``sync_trigger`` is not
    "steps", else None (the synchronizer's fixed H). ``transport``: this rank's (an ``elastic``
    one, torchft's, has the configured groups, each known by its index, as positions change per
    quorum); ``group_sizes``: ranks per group (the "tokens" weights; default equal)."""
    if config.sync_trigger == "steps":
        return None
    num = config.num_groups if transport.elastic else transport.begin().num_groups
    sizes = tuple(group_sizes) if group_sizes is not None else (1,) * num
    return TriggerPlanner(RoundState(config.sync_trigger, config.sync_every, sizes, int(transport.group_index),
                                     window_s=config.sync_window_s), config.group_weighting)
