"""The federated synchronization: when groups average, what they average, the outer step.

Paper (Mittone & Aldinucci, Euro-Par 2026, arXiv 2609.20359), Sec. 3 / Alg. 1: after
every H-th optimizer step each rank replaces its local parameter shard with the mean
of the shards at the same coordinate in all F groups::

    theta_f <- sum_g w_g theta_g        (FedAvg, "avg"; w_g = 1/F for equal groups)

There is no full-parameter gather: a rank exchanges only its own shard (see
:mod:`fl_accel.exchange` for the wire protocol, the 1/R rule and unequal groups).
Parameters stay DTensors with unchanged placements, shape and stride: only their
local tensors are written, in place.

Streaming (Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512; torchft
``DiLoCo`` with ``fragment_sync_delay``/``fragment_update_alpha``). The FSDP units, in
forward order, are dealt round-robin into P fragments. Every H/P optimizer steps one
fragment syncs, fragment k mod P at the k-th fragment sync:

1. at local step H/P - tau: take the pseudo-gradient Delta = anchor - theta of its
   shards (or theta itself for the exact "fp32" exchange) and launch its weighted
   mean over the "fl" axis without waiting;
2. at local step H/P: wait; global = outer step on the anchor with mean(Delta)
   ("avg": anchor - mean(Delta); "nesterov": SGD with Nesterov momentum, lr
   ``outer_lr``, momentum ``outer_momentum``); anchor <- global;
   theta <- global + alpha * (theta_now - global).

The anchor is the fragment's parameters after its last sync (initially the initial
parameters). P=1, tau=0, alpha=0, "fp32", "avg" is exactly the paper's FedAvg.
:meth:`FederatedSynchronizer.sync` (and so ``end_training``) completes an in-flight
exchange, then syncs every fragment at once with alpha=0, so the groups end identical.

"nesterov" (DiLoCo, arXiv 2311.08105, Alg. 1): with lr 1 and momentum 0 the outer
step is ``anchor - mean(Delta) = mean(theta)``, i.e. "avg".

Non-finite values. At every sync each group checks its parameters and last loss; one
world all-reduce of F flags tells every rank which groups are bad. "abort" raises
:class:`NonFiniteError` on every rank; "reset" completes any in-flight exchange and
discards it, then sets every parameter of every group to the weighted mean of the
healthy groups (all fragments: a bad group is bad everywhere once NaN gradients have
run through it), the anchors to the same values, and the bad groups' optimizer state
(AdamW moments) to the healthy groups' weighted mean state. Step counters are equal
in all groups and are kept. With ``average_optimizer_state`` every group takes that
healthy mean state. The outer momentum is kept.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Sequence

import torch
import torch.distributed as dist

from .exchange import Transport
from .mesh import DP_REPLICATE, FL

logger = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Raised by a sync on every rank when a federation group holds NaN/Inf and on_nonfinite='abort'."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a (DTensor) parameter or state tensor, as a plain tensor view."""
    return t.to_local() if hasattr(t, "to_local") else t


def deal_fragments(units: Sequence[Sequence[int]], num_fragments: int) -> list[list[int]]:
    """Strided partition: unit u (in forward order) goes to fragment u mod P.

    Returns P sorted lists of parameter indices. Raises ValueError when P exceeds the
    number of units (a fragment would be empty)."""
    if num_fragments > len(units):
        raise ValueError(f"FLConfig.num_fragments={num_fragments} exceeds the {len(units)} FSDP units of the model; "
                         f"each fragment needs at least one unit")
    out = [[] for _ in range(num_fragments)]
    for u, unit in enumerate(units):
        out[u % num_fragments].extend(unit)
    return [sorted(f) for f in out]


class FederatedSynchronizer:
    """Averages a model's local shards across federation groups, every H optimizer steps
    (or, streaming, one fragment every H/P steps).

    Args:
        named_params: ``(name, parameter)`` pairs of the sharded model (DTensors or plain
            tensors), one per distinct parameter (a tied weight appears once), in the
            same order on every rank.
        optimizer: the inner torch optimizer (its state is averaged when
            ``average_optimizer_state`` and reset on a non-finite group).
        layout: the :class:`~fl_accel.mesh.FLLayout`.
        mesh: the :class:`~fl_accel.mesh.FLMesh` (its "fl" and "dp_replicate" groups).
        rank: this rank's global rank.
        config: the :class:`~fl_accel.config.FLConfig`.
        units: parameter indices per FSDP unit, in forward order (default: one unit per
            parameter); fragments are dealt from them.

    Memory (per rank, besides the model; n = numel of this rank's local shards): an
    fp32 anchor of the local shards (4n bytes) when ``outer_optimizer="nesterov"`` or
    ``sync_dtype != "fp32"``; one outer momentum buffer per shard for "nesterov" (4n
    bytes); one fp32 error-feedback residual per shard with ``error_feedback`` (4n
    bytes); during an exchange, one fp32 buffer of the fragment's shards (split into
    ``sync_bucket_mb`` buckets, padded to a multiple of the chunk count) plus,
    compressed, its quantized copies (1/2 or ~1/4 of it) in flight.

    Placement (``anchor_device``). "same": the anchor, momentum and residuals live on
    the parameters' device. "cpu": they live in host memory, which spares per rank 4n
    bytes of accelerator memory for the anchor, plus 4n for the momentum ("nesterov")
    and 4n for the residuals (``error_feedback``) when used: with both, 12n bytes, i.e.
    3 fp32 copies of the local shards. The anchor and the residuals, which are copied to
    the accelerator at every exchange, are pinned when the parameters are on CUDA; the
    momentum never leaves the host and stays pageable. Everything a collective touches
    stays on the accelerator (NCCL rejects CPU tensors): Delta = anchor - theta is
    computed on the accelerator one tensor at a time while packing, by copying that
    anchor tensor there (``non_blocking`` from pinned memory) and subtracting theta in
    place, so the placement adds at most one shard-sized tensor (and, with error
    feedback, one residual tensor) of accelerator memory at a time beside the bucket;
    taking theta to the host instead would need a blocking device-to-host copy of every
    tensor before the exchange could start. The means come back to the host (one
    blocking copy per tensor), the outer step runs there, where the anchor lives, and the
    global values are copied to the parameters. What quantization drops is copied back
    to the host residuals once per bucket. The values are those of "same" (bitwise on
    CPU; on CUDA up to the fp32 rounding differences of the outer step's CPU kernels).

    Counters: ``global_step`` (optimizer steps), ``local_step`` (steps since the last
    sync event), ``num_syncs`` (completed sync events: fragment syncs and full syncs),
    ``num_fragment_syncs`` (k: fragment k mod P syncs next).
    """

    def __init__(self, named_params, optimizer, *, layout, mesh, rank: int, config, units=None):
        named_params = list(named_params)
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.optimizer = optimizer
        self.config = config
        self.layout = layout
        self.num_groups = layout.num_groups
        self.group_index, self.replica_index, _ = layout.coords(rank)
        units = units if units is not None else [[i] for i in range(len(self.params))]
        self.fragment_indices = deal_fragments(units, config.num_fragments)
        owner = self.replica_index if self.replica_index < layout.min_replicas else None
        f, s = self.group_index, layout.coords(rank)[2]
        self.transport = Transport(
            fl_group=mesh.group(FL) if owner is not None else None,
            replicate_group=mesh.group(DP_REPLICATE),
            num_groups=self.num_groups, group_index=f, weights=layout.weights(config.group_weighting),
            num_chunks=layout.min_replicas, chunk_index=owner, replicas=layout.replicas_of(f),
            chunk_owners=tuple(layout.rank(f, c, s) for c in range(layout.min_replicas)),
            sync_dtype=config.sync_dtype, bucket_values=max(1, config.sync_bucket_mb * 2**20 // 4))
        self.period = config.sync_every // config.num_fragments
        self.compressed = config.sync_dtype != "fp32"
        self.local_step = 0
        self.global_step = 0
        self.num_syncs = 0
        self.num_fragment_syncs = 0
        self.in_sync = True
        self.last_loss: float | None = None
        self._inflight = None  # (fragment, Exchange) or (fragment, list of results)
        self.anchor: list[torch.Tensor] | None = None
        self.outer_optimizer: torch.optim.Optimizer | None = None
        self.residuals: list[torch.Tensor] | None = None
        self.needs_anchor = config.outer_optimizer == "nesterov" or self.compressed
        self._h2d_events: list = []  # CUDA events after non-blocking copies out of the host state
        self.pre_sync_hooks: list = []
        self._suspended = 0
        if self.num_groups > 1 and not any(_local(p).is_meta for p in self.params):
            self.reset_anchor()

    # ------------------------------------------------------------------ outer state
    @property
    def fragments(self) -> list[list[str]]:
        """The P fragments as lists of parameter names (as in ``model.named_parameters()``)."""
        return [[self.names[i] for i in frag] for frag in self.fragment_indices]

    @property
    def _pin(self) -> bool:
        """Host outer state is pinned when the parameters are on CUDA (fast, non-blocking copies)."""
        return self.config.anchor_device == "cpu" and _local(self.params[0]).device.type == "cuda" \
            and torch.cuda.is_available()

    def _host_zeros(self, shape) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float32, device="cpu", pin_memory=self._pin)

    @torch.no_grad()
    def reset_anchor(self) -> None:
        """(Re)take the anchor from the current parameters: call after (re)initializing
        the model's weights. Resets the outer momentum and residuals. The anchor and the
        residuals are placed per ``anchor_device`` (see the class docstring)."""
        if not self.needs_anchor:
            return
        self._fence()
        if self.config.anchor_device == "cpu":
            self.anchor = [torch.nn.Parameter(self._host_zeros(_local(p).shape).copy_(_local(p).detach()),
                                              requires_grad=False) for p in self.params]
        else:
            self.anchor = [torch.nn.Parameter(_local(p).detach().to(torch.float32).clone(), requires_grad=False)
                           for p in self.params]
        if self.config.outer_optimizer == "nesterov":
            momentum = float(self.config.outer_momentum)
            self.outer_optimizer = torch.optim.SGD(self.anchor, lr=float(self.config.outer_lr),
                                                   momentum=momentum, nesterov=momentum > 0)
        if self.compressed and self.config.error_feedback:
            if self.config.anchor_device == "cpu":
                self.residuals = [self._host_zeros(a.shape) for a in self.anchor]
            else:
                self.residuals = [torch.zeros_like(a) for a in self.anchor]

    def _state_on_host(self) -> bool:
        """True when the outer state lives on another device than the parameters
        (``anchor_device="cpu"`` with parameters on an accelerator)."""
        return self.anchor is not None and self.anchor[0].device != _local(self.params[0]).device

    def _after_h2d(self, stream=None) -> None:
        """Record that non-blocking copies out of the (pinned) host state were queued on
        ``stream`` (default: the current stream): the host must not write that state
        before they ran (see :meth:`_fence`)."""
        if self._state_on_host() and torch.cuda.is_available():
            event = torch.cuda.Event()
            event.record(stream if stream is not None else torch.cuda.current_stream())
            self._h2d_events.append(event)

    def _fence(self) -> None:
        """Wait for the queued non-blocking copies out of the host state; call before the
        host writes the anchor or the residuals (outer step, reset, checkpoint load)."""
        for event in self._h2d_events:
            event.synchronize()
        self._h2d_events.clear()

    def _delta(self, i: int) -> torch.Tensor:
        """Delta = anchor - theta of parameter i, on the parameter's device, in fp32."""
        theta = _local(self.params[i])
        anchor = self.anchor[i]
        if anchor.device == theta.device:
            return anchor - theta.float()
        # host anchor: one device copy of this tensor (non-blocking from pinned memory), theta subtracted in place
        return anchor.detach().to(theta.device, non_blocking=True).sub_(theta.float())

    # ------------------------------------------------------------------ the hook
    @contextlib.contextmanager
    def suspended(self):
        """Ignore optimizer steps taken inside (not training steps: e.g. the zero-lr step
        with which torch.distributed.checkpoint's get/set_optimizer_state_dict initialize
        an optimizer that has no state yet)."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def on_optimizer_step(self) -> bool:
        """Call after every real optimizer step. Returns True if a sync event completed.
        A no-op inside :meth:`suspended`."""
        if self._suspended:
            return False
        self.local_step += 1
        self.global_step += 1
        self.in_sync = False
        if self.num_groups <= 1:
            return False
        tau = self.config.sync_delay
        fragment = self.num_fragment_syncs % self.config.num_fragments
        if tau and self.local_step == self.period - tau:
            self._launch(fragment)
        elif self._inflight is not None and self.local_step == self.period - tau + 1 < self.period \
                and not isinstance(self._inflight[1], list):
            self._inflight[1].advance()
        if self.local_step >= self.period:
            if self.config.num_fragments == 1 and tau == 0:
                self.sync(alpha=self.config.fragment_update_alpha)  # the paper's sync (through the instance)
            else:
                self._apply_fragment(fragment)
            return True
        return False

    def sync_due(self) -> bool:
        """True when the next optimizer step ends with a sync event (the caller then hands
        over the loss for the non-finite check)."""
        return self.num_groups > 1 and self.local_step + 1 >= self.period

    @property
    def pending(self) -> bool:
        """True when the groups may differ: optimizer steps (or an alpha mix) since the last full sync."""
        return not self.in_sync

    # ------------------------------------------------------------------ exchange
    @torch.no_grad()
    def _start(self, indices: Sequence[int]):
        """Launch the exchange of what these parameters send: theta (exact "fp32" mode) or
        Delta = anchor - theta (compressed), computed one tensor at a time while packing.

        Without autograd: the optimizer's post-step hook runs in the caller's grad mode,
        and packing parameters that require grad would record a graph into the buffers;
        an exchange finished outside ``no_grad`` (``state_tensors``, for a checkpoint)
        then fails in its in-place all-gather over "dp_replicate"."""
        if self.compressed:
            sources = [(lambda i=i: self._delta(i)) for i in indices]
        else:
            sources = [_local(self.params[i]) for i in indices]
        residuals = [self.residuals[i] for i in indices] if self.residuals is not None else None
        exchange = self.transport.start(sources, shapes=[tuple(_local(self.params[i]).shape) for i in indices],
                                        device=_local(self.params[0]).device, residuals=residuals)
        self._after_h2d(exchange.stream)  # the anchor (and residual) copies were queued on the packing stream
        return exchange

    def _launch(self, fragment: int) -> None:
        self._inflight = (fragment, self._start(self.fragment_indices[fragment]))

    def _finish_inflight(self):
        """Complete the in-flight exchange; returns (fragment, results) or None."""
        if self._inflight is None:
            return None
        fragment, ex = self._inflight
        results = ex if isinstance(ex, list) else ex.finish()
        self._inflight = None
        return fragment, results

    # ------------------------------------------------------------------ sync events
    def _pre_sync(self, full: bool) -> None:
        for hook in list(self.pre_sync_hooks):
            hook(self, full)

    @torch.no_grad()
    def _apply_fragment(self, fragment: int) -> None:
        self._pre_sync(full=False)
        if self._inflight is None:
            self._launch(fragment)
        if self._check_finite():
            done = self._finish_inflight()
            self._apply(self.fragment_indices[fragment], done[1], self.config.fragment_update_alpha)
        self.num_fragment_syncs += 1
        self._end_event(full=self.config.num_fragments == 1 and self.config.fragment_update_alpha == 0)

    @torch.no_grad()
    def sync(self, alpha: float = 0.0) -> None:
        """Synchronize every fragment now, completing an in-flight exchange first.

        Collective over the "fl" (and "dp_replicate") axes and, for the non-finite
        check, the world: every rank must call it at the same optimizer step. A no-op
        when F == 1. With ``alpha=0`` (the default) all groups end identical.

        Raises:
            NonFiniteError: a group holds NaN/Inf and ``on_nonfinite='abort'``.
        """
        if self.num_groups <= 1:
            self.local_step, self.in_sync = 0, True
            return
        self._pre_sync(full=True)
        healthy = self._check_finite()
        done = self._finish_inflight()
        if healthy:
            if done is not None:  # the fragment whose exchange was in flight: apply as scheduled
                self._apply(self.fragment_indices[done[0]], done[1], self.config.fragment_update_alpha)
                self.num_fragment_syncs += 1
            idx = list(range(len(self.params)))
            self._apply(idx, self._start(idx).finish(), alpha)
        self._end_event(full=alpha == 0)

    def _end_event(self, full: bool) -> None:
        self.local_step = 0
        self.num_syncs += 1
        if full:
            self.in_sync = True

    @torch.no_grad()
    def _apply(self, indices: Sequence[int], means: list[torch.Tensor], alpha: float) -> None:
        """global = outer step with the means; anchor <- global; theta <- global + alpha (theta - global).

        With the outer state in host memory the means are copied there first and the
        outer step runs on the host; the global values are then copied to the parameters."""
        locals_ = [_local(self.params[i]) for i in indices]
        host = self._state_on_host()
        if host:
            self._fence()
            means = [m.to(self.anchor[i].device) for i, m in zip(indices, means)]
        if self.compressed:  # means are mean(Delta)
            if self.outer_optimizer is None:
                globals_ = [self.anchor[i].sub_(m) for i, m in zip(indices, means)]
            else:
                globals_ = self._outer_step(indices, means)
        else:  # means are mean(theta)
            if self.outer_optimizer is None:
                globals_ = means
                if self.anchor is not None:
                    for i, m in zip(indices, means):
                        self.anchor[i].copy_(m)
            else:
                grads = [self.anchor[i].detach() - m for i, m in zip(indices, means)]
                globals_ = self._outer_step(indices, grads)
        for t, g in zip(locals_, globals_):
            if alpha:
                if g.device != t.device:
                    g = g.to(t.device, non_blocking=True)
                t.copy_(torch.lerp(g, t.to(g.dtype), alpha))
            else:
                t.copy_(g, non_blocking=g.device != t.device)
        if host:
            self._after_h2d()
        if self.config.average_optimizer_state:
            self._average_optimizer_state(indices)

    def _outer_step(self, indices: Sequence[int], grads: list[torch.Tensor]) -> list[torch.Tensor]:
        for i, g in zip(indices, grads):
            self.anchor[i].grad = g
        self.outer_optimizer.step()  # parameters without .grad (other fragments) are skipped
        self.outer_optimizer.zero_grad(set_to_none=True)
        return [self.anchor[i] for i in indices]

    # ------------------------------------------------------------------ optimizer state
    def _state_tensors(self, indices: Sequence[int]) -> list[torch.Tensor]:
        out = []
        for i in indices:
            state = self.optimizer.state.get(self.params[i], {})
            for key in sorted(state):
                v = state[key]
                if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0:
                    out.append(_local(v))
        return out

    def _average_optimizer_state(self, indices: Sequence[int]) -> None:
        tensors = self._state_tensors(indices)
        if not tensors:
            return
        means = self.transport.start(tensors, compressed=False).finish()
        for t, m in zip(tensors, means):
            t.copy_(m)

    # ------------------------------------------------------------------ non-finite values
    def _check_finite(self) -> bool:
        """All-reduce one flag per group over the world; True if every group is finite.

        On a bad group: raises NonFiniteError (on every rank) under "abort", else runs
        the reset described in the module docstring and returns False.
        """
        device = _local(self.params[0]).device
        local_bad = any(not torch.isfinite(_local(p)).all() for p in self.params)
        if self.last_loss is not None and not math.isfinite(self.last_loss):
            local_bad = True
        flags = torch.zeros(self.num_groups, dtype=torch.float32, device=device)
        flags[self.group_index] = float(local_bad)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad = [i for i in range(self.num_groups) if flags[i] > 0]
        if not bad:
            return True
        if self.config.on_nonfinite == "abort" or len(bad) == self.num_groups:
            raise NonFiniteError(
                f"non-finite parameters or loss in federation group(s) {bad} at optimizer step "
                f"{self.global_step} (sync {self.num_syncs + 1}); aborting. Set on_nonfinite='reset' to "
                f"drop such groups for the round instead.")
        self._reset(bad)
        return False

    def _reset(self, bad: list[int]) -> None:
        self._finish_inflight()  # complete the collectives, discard what they carried
        mask = tuple(0 if g in bad else 1 for g in range(self.num_groups))
        idx = list(range(len(self.params)))
        locals_ = [_local(p) for p in self.params]
        means = self.transport.start(locals_, compressed=False, mask=mask).finish()
        for t, m in zip(locals_, means):
            t.copy_(m)
        self._fence()
        if self.anchor is not None:
            for a, m in zip(self.anchor, means):
                a.copy_(m)
        if self.residuals is not None:
            for r in self.residuals:
                r.zero_()
        tensors = self._state_tensors(idx)
        if tensors:
            state_means = self.transport.start(tensors, compressed=False, mask=mask).finish()
            if self.group_index in bad or self.config.average_optimizer_state:
                for t, m in zip(tensors, state_means):
                    t.copy_(m)
        logger.warning("sync %d: dropped federation group(s) %s (non-finite) and reset every group to the healthy "
                       "mean (parameters and the bad groups' optimizer state)", self.num_syncs + 1, bad)
        self.last_loss = None

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """Counters (JSON-able). Tensors: :meth:`state_tensors`."""
        return {"local_step": self.local_step, "global_step": self.global_step, "num_syncs": self.num_syncs,
                "num_fragment_syncs": self.num_fragment_syncs, "in_sync": self.in_sync,
                "inflight_fragment": None if self._inflight is None else self._inflight[0]}

    def state_tensors(self) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, dict[str, torch.Tensor]]]:
        """This rank's synchronizer tensors, by parameter index, for checkpoints.

        Returns ``(shared, per_rank)``: ``shared[i]`` holds what is identical in every
        group and replica ("anchor", "momentum", and "inflight", the completed result of an
        exchange in flight: finishing it here changes no value), ``per_rank[i]`` what
        differs between groups and between the replicas of a group ("residual": each
        replica keeps the error of the chunk it sends). Each tensor has the shape of
        parameter i's local shard.
        """
        if self._inflight is not None and not isinstance(self._inflight[1], list):
            fragment, results = self._finish_inflight()
            self._inflight = (fragment, results)
        self._fence()  # a checkpoint load writes into these tensors
        shared: dict[int, dict[str, torch.Tensor]] = {}
        per_group: dict[int, dict[str, torch.Tensor]] = {}
        if self.anchor is not None:
            outer = self.outer_optimizer.state_dict()["state"] if self.outer_optimizer is not None else {}
            for i, a in enumerate(self.anchor):
                shared.setdefault(i, {})["anchor"] = a.detach()
                if self.outer_optimizer is not None:
                    buf = outer.get(i, {}).get("momentum_buffer")
                    shared[i]["momentum"] = buf if buf is not None else torch.zeros_like(a)
        if self._inflight is not None:
            fragment, results = self._inflight
            for i, r in zip(self.fragment_indices[fragment], results):
                shared.setdefault(i, {})["inflight"] = r
        if self.residuals is not None:
            for i, r in enumerate(self.residuals):
                per_group.setdefault(i, {})["residual"] = r
        return shared, per_group

    def load_state_dict(self, state: dict, shared: dict | None = None, per_group: dict | None = None) -> None:
        """Inverse of :meth:`state_dict` / :meth:`state_tensors` (tensors as returned there)."""
        self.local_step = int(state["local_step"])
        self.global_step = int(state["global_step"])
        self.num_syncs = int(state["num_syncs"])
        self.num_fragment_syncs = int(state.get("num_fragment_syncs", 0))
        self.in_sync = bool(state.get("in_sync", self.local_step == 0))
        shared, per_group = shared or {}, per_group or {}
        self._fence()
        with torch.no_grad():
            if self.anchor is not None:
                for i, a in enumerate(self.anchor):
                    a.copy_(shared[i]["anchor"])
                if self.outer_optimizer is not None:
                    sd = self.outer_optimizer.state_dict()
                    for i in range(len(self.anchor)):
                        sd["state"].setdefault(i, {})["momentum_buffer"] = shared[i]["momentum"].clone()
                    self.outer_optimizer.load_state_dict(sd)
            if self.residuals is not None:
                for i, r in enumerate(self.residuals):
                    r.copy_(per_group[i]["residual"])
        fragment = state.get("inflight_fragment")
        self._inflight = None if fragment is None else \
            (int(fragment), [shared[i]["inflight"].clone() for i in self.fragment_indices[int(fragment)]])
