"""The synchronizer: the optimizer hook that counts steps and drives fragments through each sync event.

Paper (arXiv 2609.20359) Sec. 3, Alg. 1: after every H-th optimizer step each rank replaces
its local shard with the weighted mean of the shards at the same coordinate in all F groups
(FedAvg); parameters stay DTensors, only their local tensors are written, in place. One sync
event reads in three files: this one (when, the non-finite check, which fragments),
:mod:`fl_accel.fragment` (what a fragment sends, its outer step) and :mod:`fl_accel.exchange`
/ :mod:`fl_accel.codecs` (the mean across the wire). Two plug-ins, each seeing a
:class:`SyncEvent`, never the synchronizer: the round planner
(:class:`~fl_accel.schedule.FixedPlanner`, or :class:`fl_accel.trigger.TriggerPlanner`) and
the transport's :class:`~fl_accel.exchange.EventHooks` (torchft's: :class:`fl_accel.ft.CommitHooks`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch

from . import fragment as fr
from .codecs import codec_of
from .comm import WaitClock
from .exchange import Channel, Membership, Transport
from .fsdp import canonical_name, local
from .lr_schedule import outer_lr
from .schedule import ADVANCE, ANCHOR, APPLY, FULL, LAUNCH, SKIP, FixedPlanner, SyncSchedule, deal_fragments

logger = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Raised by a sync on every rank when a federation group holds NaN/Inf and on_nonfinite='abort'."""


@dataclass(frozen=True)
class SyncEvent:
    """What a plug-in (round planner, pre-sync hook) sees of a step or sync event: counters,
    transport, the event's ``membership`` (None before it opens), the ``clock`` of seconds in
    sync events, ``arriving()`` (times a first world collective as the wait for the others)."""

    schedule: SyncSchedule
    transport: Transport
    membership: Membership | None
    clock: WaitClock
    arriving: Callable


class Synchronizer:
    """Averages local shards across groups every H optimizer steps (a fragment every H/P).
    ``named_params``: the sharded model's, one order on every rank; ``units``: parameter indices
    per FSDP unit in forward order (unit u into fragment u mod P; ValueError: P > units);
    ``planner``: None (or one group) is :class:`~fl_accel.schedule.FixedPlanner`.
    ``pre_sync_hooks``: ``hook(event, full)`` before each event."""

    def __init__(self, named_params, optimizer, *, transport: Transport, config, units=None, planner=None):
        named = list(named_params)
        self.names = [canonical_name(n) for n, _ in named]
        self.params = [p for _, p in named]
        self.optimizer, self.transport, self.config = optimizer, transport, config
        units, P = units if units is not None else [[i] for i in range(len(self.params))], config.num_fragments
        dealt = [sorted(i for unit in part for i in unit) for part in deal_fragments(units, P)]
        self.fragments = [fr.Fragment(k, idx, [self.names[i] for i in idx], [self.params[i] for i in idx], config)
                          for k, idx in enumerate(dealt)]
        self.parts = sorted((part for f in self.fragments for part in f.parts), key=lambda fj: fj[0].indices[fj[1]])
        """(fragment, position) of every parameter, in the model's order (a full sync's exchange)."""
        self.hooks = transport.hooks()
        active = transport.elastic or transport.begin().num_groups > 1
        self.schedule = SyncSchedule(config.sync_every, config.num_fragments, config.sync_delay,
                                     config.fragment_update_alpha, active=active,
                                     delayed_local_steps=config.delayed_local_steps,
                                     warmup_steps=config.sync_warmup_steps)
        self.last_membership: Membership | None = None  # of the last sync event (torchft: it may be partial)
        self.clock = WaitClock()
        self.arrival = WaitClock()
        """Seconds in the first world collective of each sync event: the wait for the last rank
        (the slowest group) to arrive, without the exchange itself (a subset of :attr:`clock`)."""
        self._arrived = True  # the current event's first world collective is done (timed)
        self.last_loss: float | None = None
        self.pre_sync_hooks: list = []
        self._suspended, self._hook, self._pre_hook = 0, None, None
        self.final_synced = False  # the last sync event was the exact final one (nothing left to send)
        self.planner = planner if planner is not None and active else FixedPlanner()
        if active and not any(local(p).is_meta for p in self.params):
            self.reset_anchors()

    device = property(lambda self: local(self.params[0]).device)

    def reset_anchors(self) -> None:
        """Every fragment takes its anchor from the parameters (momentum, residuals zero)."""
        for f in self.fragments:
            f.reset()

    def attach(self, loss_fn=None) -> None:
        """Run :meth:`on_optimizer_step` after each inner optimizer step (none with one group)
        and, in the warm-up, :meth:`average_gradients` before it; ``loss_fn()``: the last loss
        (or None) for the non-finite check."""
        if not self.schedule.active:
            return

        def hook(optimizer, args, kwargs):
            if self._suspended:
                return
            if self.config.keeps_outer_state and self.fragments[0].anchor is None:
                raise RuntimeError("the model was prepared on the meta device: call accelerator.materialize(model, "
                                   "init_fn) before training")
            if self.config.outer_optimizer == "nesterov" and self.schedule.due():
                outer_lr(self.config, 1)  # an outer-LR schedule without its length raises before any collective
            loss = loss_fn() if loss_fn is not None and self.schedule.due() else None
            if loss is not None:
                self.last_loss = float(loss)
            self.on_optimizer_step()

        self._hook = self.optimizer.register_step_post_hook(hook)
        if self.config.sync_warmup_steps:
            self._pre_hook = self.optimizer.register_step_pre_hook(
                lambda *_: None if self._suspended or not self.schedule.warming_up else self.average_gradients())

    def detach(self) -> None:
        for handle in (self._hook, self._pre_hook):
            if handle is not None:
                handle.remove()
        self._hook = self._pre_hook = None

    @torch.no_grad()
    def average_gradients(self) -> None:
        """The warm-up's step (``sync_warmup_steps``; PostLocalSGDOptimizer's all-reduce before
        ``start_localSGD_iter``): every gradient's local shard <- its weighted mean over the groups
        (fp32 on the wire, written back in the gradient's dtype), so every group takes the same
        step. Collective: every rank, before each optimizer step of the warm-up."""
        grads = [local(p.grad) for p in self.params if p.grad is not None]
        with self.clock.measure(self.device):
            self._channel(self.transport.begin()).mean_into(grads)

    @contextlib.contextmanager
    def suspended(self):
        """Ignore optimizer steps taken inside (e.g. DCP's zero-lr step initializing state)."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def event(self, membership: Membership | None = None) -> SyncEvent:
        """The :class:`SyncEvent` plug-ins see now."""
        return SyncEvent(self.schedule, self.transport, membership, self.clock, self.arriving)

    def _channel(self, membership: Membership) -> Channel:
        return Channel(self.transport, membership, self.hooks, max(1, self.config.sync_bucket_mb * 2**18))

    @torch.no_grad()
    def on_optimizer_step(self) -> bool:
        """Count one optimizer step and run the actions due; True if a sync event completed."""
        if self._suspended:
            return False
        self.planner.before_step(self.event())
        actions, membership = self.schedule.step(), None
        with self.clock.measure(self.device) if actions else contextlib.nullcontext():
            if actions and self.hooks.open(self.schedule):  # this group's state was replaced (a heal): ask again
                self.planner.rejoin(self.schedule)
                actions = self.schedule.actions()
            for kind, k in actions:
                fragment = self.fragments[k] if k is not None else None
                if kind == LAUNCH:  # after an event at this step: with that event's membership (its round's weights)
                    fragment.launch(self._channel(membership or self.transport.begin()))
                elif kind == ADVANCE:
                    fragment.advance()
                elif kind in (APPLY, SKIP):
                    membership = self._event(False, self.config.fragment_update_alpha, fragment, skip=kind == SKIP)
                    self.schedule.applied(skipped=kind == SKIP)
                    self.planner.after_sync()
                elif kind == FULL:  # through the instance: tests spy on it
                    self.sync(alpha=self.config.fragment_update_alpha, final=self.schedule.final)
                elif kind == ANCHOR:  # the warm-up ends: rounds start from the (identical) parameters
                    self.reset_anchors()
        return any(kind in (APPLY, SKIP, FULL) for kind, _ in actions)

    @contextlib.contextmanager
    def arriving(self):
        """Time the event's first world collective into :attr:`arrival` (later ones pass; a
        pre-sync hook whose world collective comes first wraps it in this)."""
        if self._arrived:
            yield
            return
        self._arrived = True
        with self.arrival.measure(self.device):
            yield

    @property
    def exact_final(self) -> bool:
        """The final sync sends pseudo-gradient + residual in fp32 (``final_sync="exact"``, lossy codec)."""
        return self.config.final_sync == "exact" and codec_of(self.config).lossy

    def needs_final_sync(self) -> bool:
        """:meth:`sync` with ``final=True`` would change something: the groups trained since their
        last full sync, or residuals wait for the exact final sync. The same on every rank."""
        if not self.schedule.active:
            return False
        waiting = self.exact_final and self.fragments[0].residuals is not None and not self.final_synced \
            and self.schedule.num_syncs > 0
        return not self.schedule.in_sync or waiting or bool(self.schedule.inflight_fragments)

    def _event(self, full: bool, alpha: float, fragment: fr.Fragment | None = None, final: bool = False,
               skip: bool = False) -> Membership:
        """One sync event: the pre-sync hooks, the membership (a full sync's, and with P = 1 every
        event's, closes the round), the non-finite check, then (gated) the results in flight and
        a blocking exchange: of ``fragment`` unless its own is in flight or ``skip`` (its launch
        fell before the schedule's start), or of every parameter (``fragment`` None, a full sync,
        after every exchange in flight in launch order; exact if ``final`` and :attr:`exact_final`).
        Returns the event's membership."""
        self._arrived = False  # a hook's world collective may be the event's first (:meth:`arriving`)
        for hook in list(self.pre_sync_hooks):
            hook(self.event(), full)
        membership = self.transport.begin()
        if full or self.schedule.num_fragments == 1:
            membership = self.planner.close(self.event(membership))
        self.last_membership = membership
        exact = final and self.exact_final
        channel = self._channel(membership)
        with self.hooks.event(self.schedule):
            if self._check_finite(channel):
                order = [fragment] if fragment else [self.fragments[k] for k in self.schedule.inflight_fragments]
                ready = list(dict.fromkeys(f for f in order + ([] if fragment else self.fragments)
                                           if f.pending is not None))
                for f in ready:  # apply as scheduled, in launch order
                    self._apply_pending(f, channel)
                if not (fragment and (ready or skip)):
                    self._run(fragment.parts if fragment else self.parts, channel, alpha, exact)
        self.final_synced = exact
        return membership

    def _run(self, parts: list, channel: Channel, alpha: float, exact: bool) -> None:
        """A blocking exchange of ``parts``, applied bucket by bucket (gated: whole, after the commit)."""
        step, ex = self.schedule.global_step, fr.exchange(parts, channel, exact)
        if self.hooks.deferred is not None:
            means = ex.start().finish()
            channel.write(lambda: fr.apply(parts, means, alpha, step))
        else:
            ex.run(lambda pos, means: fr.apply([parts[j] for j in pos], means, alpha, step))
        self._after_exchange(parts, channel)

    def _apply_pending(self, fragment: fr.Fragment, channel: Channel) -> None:
        means, step, alpha = fragment.finish(), self.schedule.global_step, self.config.fragment_update_alpha
        channel.write(lambda: fr.apply(fragment.parts, means, alpha, step))
        self._after_exchange(fragment.parts, channel)

    def _after_exchange(self, parts: list, channel: Channel) -> None:
        if self.config.average_optimizer_state:
            fr.average_inner_state(parts, self.optimizer, channel)

    def _check_finite(self, channel: Channel) -> bool:
        """The NaN/Inf check every event runs first (one MAX over the world): True when no group
        has NaN/Inf in a shard or the last loss. Else, under "reset": exchanges in flight are
        discarded, parameters and anchors set to the healthy groups' mean, residuals zeroed, the
        bad groups' optimizer state (every group's, with ``average_optimizer_state``) averaged;
        counters and momentum kept; False. NonFiniteError on every rank under "abort" or when
        every group is bad."""
        s, loss, membership = self.schedule, self.last_loss, channel.membership
        local_bad = any(not torch.isfinite(local(p)).all() for p in self.params) or \
            (loss is not None and not math.isfinite(loss))
        with self.arriving():  # the first world collective of a "steps" event: every rank waits for the last
            bad = self.transport.bad_groups(local_bad, membership)
        if bad and (self.config.on_nonfinite == "abort" or len(bad) == membership.num_groups):
            raise NonFiniteError(f"non-finite parameters or loss in federation group(s) {bad} at optimizer step "
                                 f"{s.global_step} (sync {s.num_syncs + 1}); aborting. Set on_nonfinite='reset' to "
                                 f"drop such groups for the round instead.")
        if not bad:
            return True
        for f in self.fragments:
            f.discard()
        mask = tuple(0 if g in bad else 1 for g in range(membership.num_groups))
        fr.reset_to_mean(self.parts, channel, mask)
        fr.average_inner_state(self.parts, self.optimizer, channel, mask,
                               write=membership.position in bad or self.config.average_optimizer_state)
        logger.warning("sync %d: dropped federation group(s) %s (non-finite) and reset every group to the healthy "
                       "mean (parameters and the bad groups' optimizer state)", s.num_syncs + 1, bad)
        self.last_loss = None
        return False

    @torch.no_grad()
    def sync(self, alpha: float = 0.0, final: bool = False) -> None:
        """Sync every fragment now (an exchange in flight first); with ``alpha=0`` the groups end
        identical. ``final``: the end of training; with :attr:`exact_final` the exchange sends
        pseudo-gradient + residual in fp32 and leaves the residuals zero. Collective (every rank,
        same step); a no-op with one group. NonFiniteError: NaN/Inf under "abort"."""
        if not self.schedule.active:
            return self.schedule.synced(alpha)
        with self.clock.measure(self.device):
            self._event(True, alpha, final=final)
            self.schedule.synced(alpha)
        self.planner.after_sync()

    # ------------------------------------------------------------------ state
    def counters(self) -> dict:
        """A checkpoint's ``sync``: :meth:`SyncSchedule.state_dict` and the planner's entries
        (``round``: :meth:`fl_accel.trigger.RoundState.state_dict`, rounds by time/speed)."""
        return {**self.schedule.state_dict(), **self.planner.state_dict()}

    def state_tensors(self, inflight: list[int] | None = None) -> tuple[dict, dict]:
        """``(shared, per_rank)`` by parameter name (tensors): the fragments' ``outer_state`` and
        ``inflight_state`` (a collective: the exchanges in flight complete, in launch order), their
        ``residual_state`` (residuals; with "keep" the parameters at each launch in flight).
        ``inflight``: fragments a load will restore in flight (their :meth:`Fragment.templates`)."""
        shared: dict = {}
        for f in self.fragments:
            shared.update(f.outer_state())
        flight = [self.fragments[k] for k in self.schedule.inflight_fragments]
        for f in dict.fromkeys(flight + self.fragments):
            for name, d in f.inflight_state().items():
                shared.setdefault(name, {}).update(d)
        per_rank = {name: d for f in self.fragments for name, d in f.residual_state().items()}
        for k in inflight or ():
            for out, templates in zip((shared, per_rank), self.fragments[k].templates()):
                for name, d in templates.items():
                    out.setdefault(name, {}).update(d)
        return shared, per_rank

    def load_state_dict(self, state: dict, shared: dict | None = None, per_rank: dict | None = None) -> None:
        """Restore :meth:`counters` and :meth:`state_tensors`. ValueError: the planner's (a
        checkpoint without the round state this run's planner keeps)."""
        self.schedule.load_state_dict(state)
        self.planner.load_state_dict(state, self.schedule)
        for f in self.fragments:
            f.load_state(shared or {}, per_rank or {}, inflight=f.index in self.schedule.inflight_fragments)

    def heal_state(self) -> dict:
        """What a group healing from this one takes over (cloned): ``outer`` (by name), ``sync``."""
        outer = {n: {k: v.detach().clone() for k, v in d.items()} for f in self.fragments
                 for n, d in f.outer_state().items()}
        return {"outer": outer, "sync": self.counters()}

    @torch.no_grad()
    def take_over(self, state: dict) -> None:
        """Inverse of :meth:`heal_state`: residuals zeroed, nothing in flight."""
        for f in self.fragments:
            f.load_state(state["outer"])
            f.zero_residuals()
        self.schedule.load_state_dict(state["sync"])
        self.planner.take_over(state["sync"])
