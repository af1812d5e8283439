"""The federation's public status: ``accelerator.federation``, what a training loop reads.

What a script, the recipe or an example reads about the sync instead of the synchronizer (an
internal): steps and sync events, the last event's membership, bytes per axis, the fragment
plan, rounds by time/speed, waits and torchft's heals. Every attribute is a read-only view
computed when read (what is not a number is a copy); before ``prepare`` and with one group
the counters read as a run with no sync. Two calls act: :meth:`Federation.arriving` and
:meth:`Federation.restart_round_clock`; two more in the torchft mode, at the ends of a run:
:meth:`Federation.wait_for_groups` and :meth:`Federation.require_heal`. Units: optimizer steps,
ring bytes this rank sent, seconds. tests/unit/test_layering.py keeps recipes/, examples/ and
scripts/ on this API.
"""

from __future__ import annotations

import contextlib
import copy

from .fsdp import local


class Federation:
    """The status of one :class:`fl_accel.FLAccelerator`'s federation (``accelerator.federation``)."""

    def __init__(self, accelerator):
        self._acc = accelerator

    _sync = property(lambda self: self._acc.synchronizer)
    config = property(lambda self: self._acc.fl_config, doc="The run's :class:`fl_accel.FLConfig`.")
    layout = property(lambda self: self._acc.layout,
                      doc="The federation's :class:`fl_accel.FLLayout` (every group, also in the torchft mode).")
    group_index = property(lambda self: self._acc.group_index, doc="This rank's federation group f.")

    @property
    def prepared(self) -> bool:
        """``prepare(model, optimizer)`` has made the synchronizer (False before)."""
        return self._sync is not None

    @property
    def active(self) -> bool:
        """The groups sync: F > 1, or the torchft mode (False before ``prepare``)."""
        return self._sync is not None and self._sync.schedule.active

    @property
    def step(self) -> int:
        """This group's optimizer steps as the sync counts them (a torchft heal takes over a live
        group's count); 0 while not :attr:`active`."""
        return self._sync.schedule.global_step if self.active else 0

    @property
    def syncs_done(self) -> int:
        """Sync events completed (full and fragment syncs; ``SyncSchedule.num_syncs``)."""
        return self._sync.schedule.num_syncs if self.active else 0

    rounds_done = property(lambda self: self.syncs_done, doc="Deprecated name of :attr:`syncs_done`.")

    @property
    def local_step(self) -> int:
        """Optimizer steps since the last sync event (0: one just ended, or not :attr:`active`)."""
        return self._sync.schedule.local_step if self.active else 0

    @property
    def round_length(self) -> int:
        """Optimizer steps between sync events as planned now (H/P; a "time"/"speed" round's
        planned length); ``sync_every`` while not :attr:`active`."""
        return self._sync.schedule.round_length if self.active else self.config.sync_every

    @property
    def sync_pending(self) -> bool:
        """The groups may differ (optimizer steps since their last full sync): ``sync_if_pending``
        would sync now."""
        return self.active and not self._sync.schedule.in_sync

    @property
    def last_weights(self) -> tuple[float, ...] | None:
        """The merge weights w_g (sum 1) of the last sync event, one per group in it; None before any."""
        last = self._sync.last_membership if self._sync is not None else None
        return None if last is None else tuple(last.weights)

    @property
    def last_num_groups(self) -> int | None:
        """The groups the last sync event covered (torchft: its quorum's); None before any."""
        last = self._sync.last_membership if self._sync is not None else None
        return None if last is None else last.num_groups

    @property
    def bytes_by_axis(self) -> dict[str, int]:
        """Ring bytes this rank sent per bucket ("fl", "dp_replicate", "dp_shard", "world") while
        ``accelerator.meter_comm()`` was entered."""
        return {axis: stats.bytes for axis, stats in self._acc.comm_stats.items()}

    @property
    def fragment_plan(self) -> list[list[str]]:
        """Parameter names (canonical) per fragment k, synced at fragment syncs k, k + P, ...; [] before ``prepare``."""
        return [list(f.names) for f in self._sync.fragments] if self._sync is not None else []

    _round_state = property(lambda self: self._sync.planner.rounds if self._sync is not None else None)

    @property
    def triggered(self) -> bool:
        """Rounds end by time or speed (``sync_trigger`` "time"/"speed"): each group counts its own steps."""
        return self._round_state is not None

    @property
    def rounds(self):
        """``sync_trigger`` "time"/"speed": a copy of the round state (:class:`fl_accel.trigger.RoundState`:
        steps per round, seconds per step, ``summary()``); else None."""
        return copy.deepcopy(self._round_state)

    @property
    def progress_step(self) -> int:
        """The federation's progress in optimizer steps of a "steps" run: with rounds by
        time/speed every group's rank-steps at the last sync over the world size plus this
        group's steps since (:meth:`fl_accel.trigger.RoundState.progress_steps`, exact at syncs);
        else this group's :attr:`step` (0 before ``prepare``)."""
        if self._sync is None:
            return 0
        if self.triggered:
            return int(self._round_state.progress_steps())
        return self._sync.schedule.global_step

    @property
    def training_done(self) -> bool:
        """Rounds by time/speed: the run's tokens are trained (decided at a sync, so every group
        stops after the same one). Always False otherwise (the loop counts its own steps)."""
        return self.triggered and self._round_state.done

    def counters(self) -> dict:
        """The sync's counters as a checkpoint keeps them (:meth:`fl_accel.schedule.SyncSchedule.state_dict`:
        global_step, num_syncs, ...); {} before ``prepare``."""
        return self._sync.schedule.state_dict() if self._sync is not None else {}

    @property
    def sync_wait_seconds(self) -> float:
        """Seconds the training stream spent in sync events (:class:`fl_accel.comm.WaitClock`)."""
        return self._sync.clock.seconds if self._sync is not None else 0.0

    @property
    def sync_arrival_seconds(self) -> float:
        """Of :attr:`sync_wait_seconds`, the seconds waiting for the other groups to arrive (each
        event's first world collective), without the exchange."""
        return self._sync.arrival.seconds if self._sync is not None else 0.0

    def arriving(self):
        """A context manager for a pre-sync hook's first world collective: its wait for the other
        groups counts as the sync's arrival (:attr:`sync_arrival_seconds`)."""
        return self._sync.arriving() if self._sync is not None else contextlib.nullcontext()

    def restart_round_clock(self) -> None:
        """Rounds by time/speed: leave the time since the last optimizer step (logs, evaluations,
        checkpoints) out of the round's training time; harmless otherwise."""
        if self._sync is not None:
            self._sync.planner.restart_clock()

    _transport = property(lambda self: self._sync.transport if self._sync is not None and
                          self._acc.run_config.fault_tolerant else None)

    @property
    def heals(self) -> int:
        """torchft mode: how often this group healed from a live group this session; else 0."""
        return self._transport.heals if self._transport is not None else 0

    @property
    def heal_log(self) -> list[dict]:
        """torchft mode: a copy of the records of this session's heals, one each (source group,
        ``step`` the group continued from, bytes, seconds, transfer and load seconds); else []."""
        return [dict(r) for r in self._transport.heal_sources] if self._transport is not None else []

    def wait_for_groups(self) -> dict | None:
        """torchft mode, at the end of the run (after the final sync; ``end_training`` calls it):
        wait until every configured group has reached the end, serving the heals of groups behind
        (a group restarted from an older checkpoint takes over this group's final state), at most
        ``FLConfig.rejoin_timeout_s`` (:func:`fl_accel.ft_ends.finish`). Returns
        :attr:`end_state` (a copy); None outside the torchft mode. Collective; idempotent."""
        transport = self._transport
        if transport is None:
            return None
        params = self._sync.params
        return copy.deepcopy(transport.finish(lambda: sum(float(local(p).detach().double().sum()) for p in params)))

    @property
    def end_state(self) -> dict | None:
        """torchft mode, after :meth:`wait_for_groups`: ``together`` (every configured group
        reached the end, in one quorum), ``groups`` (those in the last end quorum), ``checksums``
        by group (fp64 sums of the parameters; equal when the groups ended identical),
        ``checksum`` (this group's), ``waited_s`` (a copy); else None."""
        return copy.deepcopy(self._transport.end_state) if self._transport is not None else None

    def require_heal(self, lost_step: int) -> None:
        """torchft mode: this group restarted without its state (its earlier session reached
        optimizer step ``lost_step`` and left no checkpoint), so its first sync must heal it from
        a group holding a committed state; without one within ``FLConfig.rejoin_timeout_s`` it
        raises :class:`fl_accel.ft_ends.StateLostError` rather than train the federation on from fresh
        weights (:func:`fl_accel.ft_ends.heal_lost_state`). Every rank of the group,
        before its first sync; a no-op outside the torchft mode."""
        if self._transport is not None:
            self._transport.require_heal(lost_step)

    @property
    def membership_seconds(self) -> dict:
        """torchft mode: host seconds in quorums and commit votes, and the number of quorums; else {}."""
        return dict(self._transport.seconds) if self._transport is not None else {}
