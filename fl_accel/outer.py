"""The outer state of the sync and the outer step: anchor, momentum, residuals, placement.

The anchor is this rank's fp32 copy of its local shards after their last sync, kept for
"nesterov" and for a compressed exchange (which sends Delta = anchor - theta). With the
weighted mean over groups of what was sent::

    global = anchor - mean(Delta)        compressed, "avg"
    global = mean(theta)                 "fp32", "avg" (the paper's FedAvg, no anchor)
    global = SGD-Nesterov(anchor, g)     "nesterov" (DiLoCo, arXiv 2311.08105, Alg. 1), with
                                         g = mean(Delta), or anchor - mean(theta) for "fp32"
    anchor <- global;  theta <- global + alpha (theta - global)

``outer_state_device="cpu"`` keeps the state in host memory (anchor and residuals pinned
with CUDA parameters). Collectives see accelerator tensors only (NCCL rejects CPU ones):
Delta is computed there per tensor while packing (a ``non_blocking`` copy of the anchor,
minus theta); the means come back to the host for the outer step. Values equal "same"
(bitwise on CPU; on CUDA up to host fp32 rounding). CUDA events recorded after each copy
out of the host state fence the host's next write.
"""

from __future__ import annotations

import torch

from .fsdp import local
from .lr_schedule import outer_lr


class OuterState:
    """Anchor, outer momentum (SGD over the anchors) and residuals of ``params``' local shards
    (fp32, shaped like each local shard), as the FLConfig asks."""

    def __init__(self, params: list, config):
        self.params, self.config = params, config
        self.step = 0  # the optimizer step of the sync being applied (set by the synchronizer)
        self.anchor: list[torch.Tensor] | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.residuals: list[torch.Tensor] | None = None
        self._events: list = []

    def lr_at(self, step: int) -> float:
        """:func:`fl_accel.lr_schedule.outer_lr` of this config at optimizer step ``step`` (1-based)."""
        return outer_lr(self.config, step)

    @property
    def on_host(self) -> bool:
        return self.anchor is not None and self.anchor[0].device != local(self.params[0]).device

    def _zeros(self, shape) -> torch.Tensor:
        pin = local(self.params[0]).device.type == "cuda" and torch.cuda.is_available()
        return torch.zeros(shape, dtype=torch.float32, device="cpu", pin_memory=pin)

    @torch.no_grad()
    def reset(self) -> None:
        """(Re)take the anchor from the parameters (if kept); zero momentum and residuals."""
        if not self.config.keeps_outer_state:
            return
        self.fence()
        host = self.config.outer_state_device == "cpu"
        self.anchor = [torch.nn.Parameter(self._zeros(local(p).shape).copy_(local(p).detach()) if host
                                          else local(p).detach().to(torch.float32).clone(), requires_grad=False)
                       for p in self.params]
        if self.config.outer_optimizer == "nesterov":
            m = float(self.config.outer_momentum)
            self.optimizer = torch.optim.SGD(self.anchor, lr=float(self.config.outer_lr), momentum=m, nesterov=m > 0)
        if self.config.compressed and self.config.error_feedback:
            self.residuals = [self._zeros(a.shape) if host else torch.zeros_like(a) for a in self.anchor]

    def _record(self, stream=None) -> None:
        """Note copies out of the host state queued on ``stream`` (default: current)."""
        if self.on_host and torch.cuda.is_available():
            event = torch.cuda.Event()
            event.record(stream if stream is not None else torch.cuda.current_stream())
            self._events.append(event)

    def fence(self) -> None:
        """Wait for them; call before the host writes the state."""
        for event in self._events:
            event.synchronize()
        self._events.clear()

    def source(self, i: int):
        """What parameter i sends: theta ("fp32") or a callable giving fp32 Delta on its device."""
        theta = local(self.params[i])
        if not self.config.compressed:
            return theta

        def delta() -> torch.Tensor:
            anchor = self.anchor[i]
            if anchor.device == theta.device:
                return anchor - theta.float()
            out = anchor.detach().to(theta.device, non_blocking=True)
            self._record()
            return out.sub_(theta.float())

        return delta

    @torch.no_grad()
    def apply(self, indices: list[int], means: list[torch.Tensor], alpha: float) -> None:
        """The outer step of parameters ``indices`` given the means of what they sent."""
        host = self.on_host
        if host:
            self.fence()
            means = [m.to(self.anchor[i].device) for i, m in zip(indices, means)]
        if self.config.compressed and self.optimizer is None:
            globals_ = [self.anchor[i].sub_(m) for i, m in zip(indices, means)]
        elif self.config.compressed:
            globals_ = self._outer_step(indices, means)
        elif self.optimizer is None:
            globals_ = means
            if self.anchor is not None:
                for i, m in zip(indices, means):
                    self.anchor[i].copy_(m)
        else:
            globals_ = self._outer_step(indices, [self.anchor[i].detach() - m for i, m in zip(indices, means)])
        for i, g in zip(indices, globals_):
            t = local(self.params[i])
            if alpha:
                t.copy_(torch.lerp(g.to(t.device, non_blocking=True), t.to(g.dtype), alpha))
            else:
                t.copy_(g, non_blocking=g.device != t.device)
        if host:
            self._record()

    def _outer_step(self, indices: list[int], grads: list[torch.Tensor]) -> list[torch.Tensor]:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        for i, g in zip(indices, grads):
            self.anchor[i].grad = g
        self.optimizer.step()  # anchors without .grad (other fragments) are skipped
        self.optimizer.zero_grad(set_to_none=True)
        return [self.anchor[i] for i in indices]

    @torch.no_grad()
    def set_global(self, indices: list[int], values: list[torch.Tensor]) -> None:
        """anchor <- values (the non-finite reset), if kept."""
        if self.anchor is not None:
            self.fence()
            for i, v in zip(indices, values):
                self.anchor[i].copy_(v)

    def zero_residuals(self) -> None:
        for r in self.residuals or ():
            r.zero_()

    def tensors(self) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, dict[str, torch.Tensor]]]:
        """``(shared, per_rank)`` by parameter index: "anchor", "momentum" (identical everywhere);
        "residual" (a replica's own chunk's)."""
        self.fence()  # a checkpoint load writes into these tensors
        shared: dict = {}
        if self.anchor is not None:
            state = self.optimizer.state_dict()["state"] if self.optimizer is not None else {}
            for i, a in enumerate(self.anchor):
                shared[i] = {"anchor": a.detach()}
                if self.optimizer is not None:
                    buf = state.get(i, {}).get("momentum_buffer")
                    shared[i]["momentum"] = buf if buf is not None else torch.zeros_like(a)
        return shared, {i: {"residual": r} for i, r in enumerate(self.residuals or ())}

    @torch.no_grad()
    def load(self, shared: dict, per_rank: dict) -> None:
        """Inverse of :meth:`tensors`, into this placement."""
        self.fence()
        if self.anchor is not None:
            for i, a in enumerate(self.anchor):
                a.copy_(shared[i]["anchor"])
            if self.optimizer is not None:
                sd = self.optimizer.state_dict()
                for i in range(len(self.anchor)):
                    sd["state"].setdefault(i, {})["momentum_buffer"] = shared[i]["momentum"].clone()
                self.optimizer.load_state_dict(sd)
        for i, r in enumerate(self.residuals or ()):
            r.copy_(per_rank[i]["residual"])
