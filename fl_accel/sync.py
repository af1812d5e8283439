"""The federated sync: the optimizer hook that runs the schedule on fragments.

Paper (arXiv 2609.20359) Sec. 3, Alg. 1: after every H-th optimizer step each rank
replaces its local shard with the weighted mean of the shards at the same coordinate in
all F groups (FedAvg). No full-parameter gather: a rank exchanges its own shard
(:mod:`fl_accel.exchange`); parameters stay DTensors, only their local tensors are
written, in place. :class:`~fl_accel.schedule.SyncSchedule` decides when,
:class:`~fl_accel.outer.OuterState` runs the outer step, :func:`fl_accel.nonfinite.check_finite`
checks for NaN/Inf first.

Two extension points, chosen once when the synchronizer is built:

* round planning: :class:`FixedPlanner` (H steps for every group), or
  :class:`fl_accel.trigger.TriggerPlanner` (rounds by time or speed);
* membership and transport: a :class:`~fl_accel.exchange.Transport` and its
  :class:`EventHooks` (the world mesh's: :mod:`fl_accel.mesh_transport`, no-ops; torchft's:
  :class:`fl_accel.ft.CommitHooks`, a quorum per event and writes held until the commit).

Memory per rank besides the model (n = local numel): the outer state (4n bytes each),
two ``sync_bucket_mb`` buckets during a blocking sync, a delayed exchange's fragment.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .comm import WaitClock
from .compress import codec_of
from .exchange import Exchange, Round, Transport
from .fsdp import canonical_name, local
from .nonfinite import check_finite
from .outer import OuterState
from .schedule import ADVANCE, APPLY, FULL, LAUNCH, SyncSchedule, deal_fragments
from .state_mean import average_optimizer_state


@dataclass
class Fragment:
    """``pending``: the exchange in flight (or its means, after a checkpoint), else None."""

    index: int
    params: list[int]
    names: list[str]
    pending: Exchange | list | None = field(default=None, repr=False)

    def finish(self) -> list[torch.Tensor]:
        means = self.pending if isinstance(self.pending, list) else self.pending.finish()
        self.pending = None
        return means


class EventHooks:
    """A transport's hooks into each sync event (``transport.event_hooks()``, where it has one):
    these no-op defaults are the world mesh's (membership fixed for the run, writes at once);
    torchft's (membership per sync, writes held for the commit) are :class:`fl_accel.ft.CommitHooks`."""

    always_active = False
    """Sync events run even with one group (membership decided at each sync)."""
    deferred: list | None = None
    """The open event's writes, held for a commit (None: each write runs at once)."""

    def open(self) -> bool:
        """A step with sync actions starts; True: this group's state was just replaced (a
        heal), so the actions due are asked again."""
        return False

    def write(self, fn) -> None:
        """Run the write ``fn()`` now, or hold it for the commit."""
        if self.deferred is None:
            fn()
        else:
            self.deferred.append(fn)

    def event(self, schedule: SyncSchedule):
        """A context manager around one sync event's exchanges and writes."""
        return contextlib.nullcontext()


class FixedPlanner:
    """Round planning, the paper's fixed H (every group syncs after the schedule's H steps):
    the interface the synchronizer calls, all no-ops here. The other planner is
    :class:`fl_accel.trigger.TriggerPlanner` (rounds by time or speed)."""

    rounds = None
    """The planner's round state (:class:`fl_accel.trigger.RoundState`), else None."""

    def before_step(self, sync) -> None:
        """Count an optimizer step into the round (before the schedule's actions); may set
        ``sync.schedule.round_steps``."""

    def rejoin(self, schedule) -> None:
        """This group's state was replaced by a live group's (a torchft heal)."""

    def close(self, sync, rnd: Round) -> Round:
        """A full sync's round (collective for a planner that exchanges figures): ``rnd`` with
        the round's merge weights."""
        return rnd

    def after_sync(self) -> None:
        """A full sync ended."""

    def restart_clock(self) -> None:
        """Leave the time since the last step out of the round's training time (a timed planner)."""

    def set_run_length(self, sync, max_steps: int) -> None:
        """The run ends after optimizer step ``max_steps``: its sync is the final one."""
        sync.final_step = max_steps

    def state_dict(self) -> dict:
        """The planner's entries of a checkpoint's ``sync`` (JSON)."""
        return {}

    def load_state_dict(self, state: dict, schedule) -> None:
        """Inverse of :meth:`state_dict` (``state``: the checkpoint's ``sync``)."""


class FederatedSynchronizer:
    """Averages local shards across federation groups every H optimizer steps (a fragment
    every H/P). ``named_params``: (name, parameter) of the sharded model, one per parameter,
    one order on every rank (names via :func:`fl_accel.fsdp.canonical_name`); ``optimizer``:
    the inner one; ``transport``: this rank's :class:`~fl_accel.exchange.Transport`;
    ``units``: parameter indices per FSDP unit in forward order (default one per parameter),
    unit u into fragment u mod P (ValueError: P > units). ``pre_sync_hooks``: ``hook(synchronizer,
    full)`` before each event. ``planner``: the round planner (default :class:`FixedPlanner`;
    ignored with one group), e.g. :func:`fl_accel.trigger.make_planner`'s."""

    def __init__(self, named_params, optimizer, *, transport: Transport, config, units=None, planner=None):
        named = list(named_params)
        self.names = [canonical_name(n) for n, _ in named]
        self.params = [p for _, p in named]
        self.optimizer, self.transport, self.config = optimizer, transport, config
        units, P = units if units is not None else [[i] for i in range(len(self.params))], config.num_fragments
        dealt = [sorted(i for unit in part for i in unit) for part in deal_fragments(units, P)]
        self.fragments = [Fragment(k, idx, [self.names[i] for i in idx]) for k, idx in enumerate(dealt)]
        self.hooks = transport.event_hooks() if hasattr(transport, "event_hooks") else EventHooks()
        active = self.hooks.always_active or transport.begin().num_groups > 1
        self.schedule = SyncSchedule(config.sync_every, config.num_fragments, config.sync_delay,
                                     config.fragment_update_alpha, active=active)
        self.outer = OuterState(self.params, config)
        self.last_round: Round | None = None  # the membership of the last sync event (torchft: it may be partial)
        self.clock = WaitClock()
        self.arrival = WaitClock()
        """Seconds in the first world collective of each sync event: the wait for the last rank
        (the slowest group) to arrive, without the exchange itself (a subset of :attr:`clock`)."""
        self._arrived = True  # the current event's first world collective is done (timed)
        self.last_loss: float | None = None
        self.pre_sync_hooks: list = []
        self._suspended, self._hook = 0, None
        self.final_step: int | None = None
        """The run's last optimizer step, if known (:meth:`FLAccelerator.set_max_steps`): its sync is the final one."""
        self.final_synced = False  # the last sync event was the exact final one (nothing left to send)
        self.planner = planner if planner is not None and self.schedule.active else FixedPlanner()
        self.after_exchange = average_optimizer_state if config.average_optimizer_state else lambda *_: None
        """``after_exchange(sync, indices, rnd)`` after each exchange (:mod:`fl_accel.state_mean`)."""
        if self.schedule.active and not any(local(p).is_meta for p in self.params):
            self.outer.reset()

    device = property(lambda self: local(self.params[0]).device)
    rounds = property(lambda self: self.planner.rounds, doc="The planner's round state, else None.")

    def attach(self, loss_fn=None) -> None:
        """Run :meth:`on_optimizer_step` after each inner optimizer step (none with one group);
        ``loss_fn()``: the last loss (or None) for the non-finite check."""
        if not self.schedule.active:
            return

        def hook(optimizer, args, kwargs):
            if self._suspended:
                return
            if self.config.keeps_outer_state and self.outer.anchor is None:
                raise RuntimeError("the model was prepared on the meta device: call accelerator.materialize(model, "
                                   "init_fn) before training")
            if self.outer.optimizer is not None and self.schedule.due():
                self.outer.lr_at(1)  # an outer-LR schedule without its length raises before any collective
            loss = loss_fn() if loss_fn is not None and self.schedule.due() else None
            if loss is not None:
                self.last_loss = float(loss)
            self.on_optimizer_step()

        self._hook = self.optimizer.register_step_post_hook(hook)

    def detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @contextlib.contextmanager
    def suspended(self):
        """Ignore optimizer steps taken inside (e.g. DCP's zero-lr step initializing state)."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    @torch.no_grad()
    def on_optimizer_step(self) -> bool:
        """Count one optimizer step and run the actions due; True if a sync event completed."""
        if self._suspended:
            return False
        self.planner.before_step(self)
        actions = self.schedule.step()
        with self.clock.measure(self.device) if actions else contextlib.nullcontext():
            if actions and self.hooks.open():  # this group's state was replaced (a heal): ask again
                self.planner.rejoin(self.schedule)
                actions = self.schedule.actions()
            for kind, k in actions:
                pending = self.fragments[k].pending if k is not None else None
                if kind == LAUNCH:
                    self.fragments[k].pending = self._exchange(self.fragments[k].params).start()
                elif kind == ADVANCE and isinstance(pending, Exchange):
                    pending.advance()
                elif kind == APPLY:
                    self._event(False, self.config.fragment_update_alpha, self.fragments[k])
                    self.schedule.applied()
                elif kind == FULL:  # through the instance: tests spy on it
                    final = self.final_step is not None and self.schedule.global_step >= self.final_step
                    self.sync(alpha=self.config.fragment_update_alpha, final=final)
        return any(kind in (APPLY, FULL) for kind, _ in actions)

    @contextlib.contextmanager
    def arriving(self):
        """Time the event's first world collective into :attr:`arrival` (later ones pass). A
        pre-sync hook whose world collective comes first (e.g. a recipe's deferred log sums)
        wraps it in this, so that the wait for the last group is counted as arrival."""
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
        """True when :meth:`sync` with ``final=True`` would change something: the groups have trained
        since their last full sync, or residuals of a lossy exchange wait for the exact final sync.
        The same answer on every rank (it reads counters and settings only)."""
        if not self.schedule.active:
            return False
        waiting = self.exact_final and self.outer.residuals is not None and not self.final_synced \
            and self.schedule.num_syncs > 0
        return not self.schedule.in_sync or waiting

    def _exchange(self, indices: list[int], rnd: Round | None = None, exact: bool = False) -> Exchange:
        cfg = self.config
        return Exchange(self.transport, rnd or self.transport.begin(), [self.outer.source(i) for i in indices],
                        shapes=[tuple(local(self.params[i]).shape) for i in indices], device=self.device,
                        codec=codec_of(cfg, exact=exact), bucket_values=max(1, cfg.sync_bucket_mb * 2**18),
                        residual_decay=cfg.residual_decay,
                        residuals=None if self.outer.residuals is None else [self.outer.residuals[i] for i in indices])

    def _run(self, indices: list[int], rnd: Round, alpha: float, exact: bool = False) -> None:
        """A blocking exchange, applied bucket by bucket (gated: whole, after the commit)."""
        if self.hooks.deferred is not None:
            means = self._exchange(indices, rnd, exact).start().finish()
            self.hooks.write(lambda: self._apply(indices, means, alpha))
        else:
            self._exchange(indices, rnd, exact).run(
                lambda pos, means: self._apply([indices[j] for j in pos], means, alpha))
        self.after_exchange(self, indices, rnd)

    def _apply(self, indices: list[int], means: list[torch.Tensor], alpha: float) -> None:
        self.outer.step = self.schedule.global_step
        self.outer.apply(indices, means, alpha)

    def _event(self, full: bool, alpha: float, fragment: Fragment | None = None, final: bool = False) -> None:
        """One sync event: the pre-sync hooks, the round, the non-finite check, then (gated) the
        results in flight and a blocking exchange: of ``fragment`` unless its own is in flight,
        or of every parameter (``fragment`` None, a full sync; exact if ``final`` and
        :attr:`exact_final`)."""
        self._arrived = False  # a hook's world collective may be the event's first (:meth:`arriving`)
        for hook in list(self.pre_sync_hooks):
            hook(self, full)
        rnd = self.transport.begin()
        if full:
            rnd = self.planner.close(self, rnd)
        self.last_round = rnd
        exact = final and self.exact_final
        with self.hooks.event(self.schedule):
            if check_finite(self, rnd):
                ready = [f for f in ([fragment] if fragment else self.fragments) if f.pending is not None]
                for f in ready:  # apply as scheduled
                    self._apply_pending(f, rnd)
                if not (fragment and ready):
                    self._run(fragment.params if fragment else list(range(len(self.params))), rnd, alpha, exact)
        self.final_synced = exact

    def _apply_pending(self, fragment: Fragment, rnd: Round) -> None:
        means = fragment.finish()
        self.hooks.write(lambda: self._apply(fragment.params, means, self.config.fragment_update_alpha))
        self.after_exchange(self, fragment.params, rnd)

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

    def counters(self) -> dict:
        """A checkpoint's ``sync``: :meth:`SyncSchedule.state_dict` and the planner's entries
        (``round``: :meth:`fl_accel.trigger.RoundState.state_dict`, rounds by time/speed)."""
        return {**self.schedule.state_dict(), **self.planner.state_dict()}

    def state_tensors(self) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, dict[str, torch.Tensor]]]:
        """``(shared, per_rank)`` as :meth:`OuterState.tensors`, plus "inflight" in ``shared``
        (the means of an exchange in flight, completed here: no value changes)."""
        shared, per_rank = self.outer.tensors()
        for fragment in self.fragments:
            if fragment.pending is not None:
                fragment.pending = fragment.finish()
                for i, m in zip(fragment.params, fragment.pending):
                    shared.setdefault(i, {})["inflight"] = m
        return shared, per_rank

    def load_state_dict(self, state: dict, shared: dict | None = None, per_rank: dict | None = None) -> None:
        """Restore :meth:`counters` and :meth:`state_tensors`. ValueError: the planner's (a
        checkpoint without the round state this run's planner keeps)."""
        shared = shared or {}
        self.schedule.load_state_dict(state)
        self.planner.load_state_dict(state, self.schedule)
        self.outer.load(shared, per_rank or {})
        for fragment in self.fragments:
            inflight = fragment.index == self.schedule.inflight
            fragment.pending = [shared[i]["inflight"].clone() for i in fragment.params] if inflight else None
