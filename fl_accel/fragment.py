"""A fragment of the model and the sync state it owns: anchor, outer momentum, residuals, exchange in flight.

Fragment k holds the FSDP units u with u mod P = k (:func:`fl_accel.schedule.deal_fragments`)
and, for its parameters' local shards, the anchor (the fp32 copy after their last sync, kept
for "nesterov" and for a compressed exchange, which sends Delta = anchor - theta), its outer
optimizer (SGD over its anchors), the error-feedback residuals and its exchange in flight
(after a checkpoint: that exchange's means). With the weighted mean over groups of what was sent::

    global = anchor - mean(Delta)        compressed, "avg"
    global = mean(theta)                 "fp32", "avg" (the paper's FedAvg, no anchor)
    global = SGD-Nesterov(anchor, g)     "nesterov" (DiLoCo, arXiv 2311.08105, Alg. 1), with
                                         g = mean(Delta), or anchor - mean(theta) for "fp32"
    anchor <- global;  theta <- global + alpha (theta - global)          "discard" (and tau = 0)
                       theta <- global + (theta - theta_launch)          "keep", a delayed exchange

``theta_launch`` (``launched``) is this rank's fp32 copy of the parameters at the launch (what
its pseudo-gradient was computed from), kept on ``outer_state_device`` while the exchange is
in flight: so the local steps taken meanwhile are kept (eager updates, arXiv 2502.12996).
The module's functions take ``parts``, (fragment, position) pairs in the model's order, so one
exchange may span fragments (a full sync, the non-finite reset) as it always has.
``outer_state_device="cpu"`` keeps the state in host memory (pinned with CUDA parameters):
Delta is computed on the accelerator while packing (NCCL rejects CPU tensors), the means come
back to the host for the outer step; values equal "same" (bitwise on CPU), and CUDA events
after each copy out of the host state fence its next write. Memory per rank besides the
model (n = local numel): 4n bytes per kept tensor (``launched``: per fragment in flight).
"""

from __future__ import annotations

from itertools import groupby

import torch

from .codecs import codec_of
from .exchange import Channel, Exchange
from .fsdp import local
from .lr_schedule import outer_lr


class Fragment:
    """Fragment ``index``: ``indices`` (positions in the model's order), canonical ``names``,
    ``params``, and their sync state as the FLConfig asks: ``anchor``, ``outer`` (the outer
    optimizer), ``residuals`` (fp32 like each local shard; None: not kept), ``pending`` (the
    exchange in flight, or its means after a checkpoint; None) and ``launched`` (with "keep":
    the parameters at its launch, fp32; None)."""

    def __init__(self, index: int, indices: list[int], names: list[str], params: list, config):
        self.index, self.indices, self.names, self.params, self.config = index, list(indices), list(names), \
            list(params), config
        self.anchor: list[torch.Tensor] | None = None
        self.outer: torch.optim.Optimizer | None = None
        self.residuals: list[torch.Tensor] | None = None
        self.pending: Exchange | list | None = None
        self.launched: list[torch.Tensor] | None = None
        self._events: list = []

    parts = property(lambda self: [(self, j) for j in range(len(self.params))],
                     doc="(self, position) of each parameter, for the module's functions.")

    @property
    def on_host(self) -> bool:
        return self.anchor is not None and self.anchor[0].device != local(self.params[0]).device

    def _zeros(self, shape) -> torch.Tensor:
        pin = local(self.params[0]).device.type == "cuda" and torch.cuda.is_available()
        return torch.zeros(shape, dtype=torch.float32, device="cpu", pin_memory=pin)

    @torch.no_grad()
    def reset(self) -> None:
        """(Re)take the anchor from the parameters (if kept); zero momentum and residuals."""
        cfg = self.config
        if not cfg.keeps_outer_state:
            return
        self.fence()
        host = cfg.outer_state_device == "cpu"
        self.anchor = [torch.nn.Parameter(self._zeros(local(p).shape).copy_(local(p).detach()) if host
                                          else local(p).detach().to(torch.float32).clone(), requires_grad=False)
                       for p in self.params]
        if cfg.outer_optimizer == "nesterov":
            m = float(cfg.outer_momentum)
            self.outer = torch.optim.SGD(self.anchor, lr=float(cfg.outer_lr), momentum=m, nesterov=m > 0)
        if cfg.compressed and cfg.error_feedback:
            self.residuals = [self._zeros(a.shape) if host else torch.zeros_like(a) for a in self.anchor]

    def _record(self) -> None:
        """Note copies out of the host state queued on the current stream."""
        if self.on_host and torch.cuda.is_available():
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
            self._events.append(event)

    def fence(self) -> None:
        """Wait for them; call before the host writes the state."""
        for event in self._events:
            event.synchronize()
        self._events.clear()

    def source(self, j: int):
        """What parameter j sends: theta ("fp32") or a callable giving fp32 Delta on its device."""
        theta = local(self.params[j])
        if not self.config.compressed:
            return theta

        def delta() -> torch.Tensor:
            anchor = self.anchor[j]
            if anchor.device == theta.device:
                return anchor - theta.float()
            out = anchor.detach().to(theta.device, non_blocking=True)
            self._record()
            return out.sub_(theta.float())

        return delta

    # ------------------------------------------------------------------ its exchange
    def launch(self, channel: Channel) -> None:
        """Pack this fragment's sources and launch their exchange without waiting (a delayed sync);
        with "keep", copy the parameters as they are now (``launched``)."""
        if self.config.delayed_local_steps == "keep":
            self.fence()
            host = self.config.outer_state_device == "cpu"
            self.launched = [self._zeros(local(p).shape).copy_(local(p).detach()) if host
                             else local(p).detach().to(torch.float32, copy=True) for p in self.params]
        self.pending = exchange(self.parts, channel).start()

    def advance(self) -> None:
        """The exchange in flight's second stage (a two-collective codec), if any."""
        if isinstance(self.pending, Exchange):
            self.pending.advance()

    def finish(self) -> list[torch.Tensor]:
        """The means of the exchange in flight (completed here); nothing is in flight after."""
        means = self.pending if isinstance(self.pending, list) else self.pending.finish()
        self.pending = None
        return means

    def discard(self) -> None:
        """Complete the exchange in flight (its collectives) and drop what it carried."""
        if self.pending is not None:
            self.finish()
        self.launched = None

    # ------------------------------------------------------------------ the outer step
    @torch.no_grad()
    def apply(self, positions: list[int], means: list[torch.Tensor], alpha: float, step: int) -> None:
        """The outer step of parameters ``positions`` given the means of what they sent, at
        optimizer step ``step`` (the outer LR's); after a launch with "keep", the parameters
        become global + (theta_now - theta_launch) (``alpha`` is 0 then)."""
        cfg, host = self.config, self.on_host
        if host:
            self.fence()
            means = [m.to(self.anchor[j].device) for j, m in zip(positions, means)]
        if cfg.compressed and self.outer is None:
            globals_ = [self.anchor[j].sub_(m) for j, m in zip(positions, means)]
        elif cfg.compressed:
            globals_ = self._outer_step(positions, means, step)
        elif self.outer is None:
            globals_ = means
            if self.anchor is not None:
                for j, m in zip(positions, means):
                    self.anchor[j].copy_(m)
        else:
            globals_ = self._outer_step(positions, [self.anchor[j].detach() - m for j, m in zip(positions, means)],
                                        step)
        for j, g in zip(positions, globals_):
            t = local(self.params[j])
            if self.launched is not None:  # "keep": the local steps since the launch, on the new global
                kept = t.float() - self.launched[j].to(t.device, non_blocking=True)
                t.copy_(kept.add_(g.to(t.device, non_blocking=True)))
            elif alpha:
                t.copy_(torch.lerp(g.to(t.device, non_blocking=True), t.to(g.dtype), alpha))
            else:
                t.copy_(g, non_blocking=g.device != t.device)
        if host:
            self._record()
        if self.launched is not None and len(positions) == len(self.params):
            self.launched = None

    def _outer_step(self, positions: list[int], grads: list[torch.Tensor], step: int) -> list[torch.Tensor]:
        for group in self.outer.param_groups:
            group["lr"] = outer_lr(self.config, step)
        for j, g in zip(positions, grads):
            self.anchor[j].grad = g
        self.outer.step()  # anchors without .grad (outside this bucket) are skipped
        self.outer.zero_grad(set_to_none=True)
        return [self.anchor[j] for j in positions]

    @torch.no_grad()
    def set_global(self, positions: list[int], values: list[torch.Tensor]) -> None:
        """anchor <- values (the non-finite reset), if kept."""
        if self.anchor is not None:
            self.fence()
            for j, v in zip(positions, values):
                self.anchor[j].copy_(v)

    def zero_residuals(self) -> None:
        for r in self.residuals or ():
            r.zero_()

    def inner_state(self, optimizer, positions: list[int]) -> list[torch.Tensor]:
        """Local shards of the inner optimizer's floating-point state of parameters
        ``positions`` (AdamW ``exp_avg``, ``exp_avg_sq``; not ``step``), in one order on every rank."""
        out = []
        for j in positions:
            state = optimizer.state.get(self.params[j], {})
            out += [local(state[k]) for k in sorted(state)
                    if torch.is_tensor(state[k]) and state[k].is_floating_point() and state[k].dim() > 0]
        return out

    # ------------------------------------------------------------------ save and load
    def outer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """By parameter name: "anchor", "momentum" (identical in every group); {} if not kept."""
        self.fence()  # a load writes into these tensors
        out: dict = {}
        if self.anchor is not None:
            state = self.outer.state_dict()["state"] if self.outer is not None else {}
            for j, (name, a) in enumerate(zip(self.names, self.anchor)):
                out[name] = {"anchor": a.detach()}
                if self.outer is not None:
                    buf = state.get(j, {}).get("momentum_buffer")
                    out[name]["momentum"] = buf if buf is not None else torch.zeros_like(a)
        return out

    def residual_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """By parameter name: "residual" (this replica's own chunk's) and, in flight with "keep",
        "launched" (this group's parameters at the launch); {} if neither is kept."""
        out = {name: {"residual": r} for name, r in zip(self.names, self.residuals or ())}
        for name, t in zip(self.names, self.launched or ()):
            out.setdefault(name, {})["launched"] = t
        return out

    def templates(self) -> tuple[dict, dict]:
        """``(shared, per_rank)`` tensors a load of this fragment in flight fills: "inflight"
        (and "launched" with "keep"), fp32 like each local shard."""
        zeros = [torch.zeros_like(local(p), dtype=torch.float32) for p in self.params]
        keep = self.config.delayed_local_steps == "keep" and self.config.sync_delay > 0
        return ({n: {"inflight": z} for n, z in zip(self.names, zeros)},
                {n: {"launched": torch.zeros_like(z)} for n, z in zip(self.names, zeros)} if keep else {})

    def inflight_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """By parameter name: "inflight", the means of the exchange in flight (a collective)."""
        if self.pending is None:
            return {}
        self.pending = self.finish()
        return {name: {"inflight": m} for name, m in zip(self.names, self.pending)}

    @torch.no_grad()
    def load_state(self, shared: dict, per_rank: dict | None = None, inflight: bool = False) -> None:
        """Inverse of the three above (``per_rank`` None: residuals kept; nothing in flight
        unless ``inflight``)."""
        self.fence()
        if self.anchor is not None:
            for name, a in zip(self.names, self.anchor):
                a.copy_(shared[name]["anchor"])
            if self.outer is not None:
                sd = self.outer.state_dict()
                for j, name in enumerate(self.names):
                    sd["state"].setdefault(j, {})["momentum_buffer"] = shared[name]["momentum"].clone()
                self.outer.load_state_dict(sd)
        for name, r in zip(self.names, self.residuals or ()) if per_rank is not None else ():
            r.copy_(per_rank[name]["residual"])
        self.pending = [shared[name]["inflight"].clone() for name in self.names] if inflight else None
        kept = inflight and per_rank is not None and all("launched" in per_rank.get(n, {}) for n in self.names)
        host = self.config.outer_state_device == "cpu"
        self.launched = [self._zeros(local(p).shape).copy_(per_rank[n]["launched"]) if host else
                         per_rank[n]["launched"].to(local(p).device, torch.float32, copy=True)
                         for n, p in zip(self.names, self.params)] if kept else None


def exchange(parts: list, channel: Channel, exact: bool = False) -> Exchange:
    """One exchange of ``parts`` ((fragment, position) pairs, in order) over ``channel``, on
    the config's codec (``exact``: the fp32 mean, sending pseudo-gradient + residual)."""
    cfg = parts[0][0].config
    residuals = None if parts[0][0].residuals is None else [f.residuals[j] for f, j in parts]
    return channel.exchange([f.source(j) for f, j in parts], codec=codec_of(cfg, exact=exact), residuals=residuals,
                            shapes=[tuple(local(f.params[j]).shape) for f, j in parts],
                            device=local(parts[0][0].params[0]).device, residual_decay=cfg.residual_decay)


def _by_fragment(parts: list, values: list):
    """``(fragment, positions, values)`` for each run of consecutive ``parts`` in one fragment."""
    for _, run in groupby(zip(parts, values), key=lambda pv: id(pv[0][0])):
        run = list(run)
        yield run[0][0][0], [j for (_, j), _ in run], [v for _, v in run]


def apply(parts: list, means: list[torch.Tensor], alpha: float, step: int) -> None:
    """The outer step of ``parts`` given their means, fragment by fragment (:meth:`Fragment.apply`)."""
    for fragment, positions, values in _by_fragment(parts, means):
        fragment.apply(positions, values, alpha, step)


def reset_to_mean(parts: list, channel: Channel, mask) -> None:
    """The non-finite reset of ``parts``: parameters and anchors <- the mean of the groups
    ``mask`` keeps (per-group 0/1), residuals zeroed (writes through ``channel``). Collective."""
    def set_global(pos, means):
        for fragment, positions, values in _by_fragment([parts[p] for p in pos], means):
            fragment.set_global(positions, values)

    channel.mean_into([local(f.params[j]) for f, j in parts], mask, also=set_global)
    fragments = list({id(f): f for f, _ in parts}.values())
    channel.write(lambda: [f.zero_residuals() for f in fragments])


def average_inner_state(parts: list, optimizer, channel: Channel, mask=None, write: bool = True) -> None:
    """The inner optimizer's state of ``parts`` <- its mean over the groups (``mask``, ``write``:
    :meth:`fl_accel.exchange.Channel.mean_into`; ``FLConfig.average_optimizer_state``, and the
    non-finite reset). Collective."""
    tensors = [t for f, j in parts for t in f.inner_state(optimizer, [j])]
    if tensors:
        channel.mean_into(tensors, mask, write=write)
