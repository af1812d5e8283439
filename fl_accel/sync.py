"""The federated synchronization: shard averaging across groups and outer optimizers.

Paper (Mittone & Aldinucci, Euro-Par 2026, arXiv 2609.20359), Sec. 3 / Alg. 1: after
every H-th optimizer step each rank replaces its local parameter shard with the
mean of the shards at the same mesh coordinate in all F groups,

    theta_f <- (1/F) * sum_{g=1..F} theta_g          (FedAvg, "avg")

There is no full-parameter gather: a rank only exchanges its own shard with its F-1
peers on the "fl" mesh axis. Averaging is SUM followed by a division by F in fp32
(gloo has no ReduceOp.AVG; summing without dividing is a known bug of the reference
code). Parameters stay DTensors with unchanged placements, shape and stride, because
only their local tensors are written in place.

"nesterov" (DiLoCo, Douillard et al., arXiv 2311.08105, Alg. 1): with anchor
``a`` (the parameters after the previous sync) and mean ``m``, the pseudo-gradient
``delta = a - m`` is fed to ``torch.optim.SGD(lr, momentum, nesterov=True)`` over the
anchor; the result becomes both the new parameters and the new anchor. With lr 1 and
momentum 0 this is ``a - (a - m) = m``, i.e. "avg".

FL+HSDP (improves on the reference code, where all R replicas of a group send the
same bytes across groups): replica ``r`` reduces only chunk ``r`` of the R equal
chunks of its flat shard buffer over the "fl" axis, then the replicas all-gather the
chunks over "dp_replicate". Inter-group bytes per rank fall to 1/R.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Raised by a sync when a federation group holds NaN/Inf and on_nonfinite='abort'."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a (DTensor) parameter or state tensor, as a plain tensor view."""
    return t.to_local() if hasattr(t, "to_local") else t


class FederatedSynchronizer:
    """Averages a model's local shards across federation groups every H optimizer steps.

    Args:
        params: the model's parameters after FSDP2 sharding (DTensors or plain tensors);
            the order must be the same on every rank.
        optimizer: the inner torch optimizer (its floating-point state is averaged when
            ``average_optimizer_state``).
        fl_group: process group of the "fl" axis (ranks with this rank's shard
            coordinate in every group), or None when F == 1.
        replicate_group: process group of the "dp_replicate" axis, or None when R == 1.
        num_groups, replicas, replica_index, group_index: F, R, this rank's r, this rank's f.
        config: the FLConfig (sync_every, outer_optimizer, outer_lr, outer_momentum,
            average_optimizer_state, on_nonfinite, sync_bucket_mb).

    The step counters count optimizer steps (``local_step`` within the round,
    ``global_step`` overall); ``num_syncs`` counts completed syncs.
    """

    def __init__(self, params, optimizer, fl_group, replicate_group, *, num_groups, replicas,
                 replica_index, group_index, config):
        self.params = [p for p in params]
        self.optimizer = optimizer
        self.fl_group = fl_group
        self.replicate_group = replicate_group
        self.num_groups = num_groups
        self.replicas = replicas
        self.replica_index = replica_index
        self.group_index = group_index
        self.config = config
        self.local_step = 0
        self.global_step = 0
        self.num_syncs = 0
        self.last_loss: float | None = None
        self.anchor: list[torch.Tensor] | None = None
        self.outer_optimizer: torch.optim.Optimizer | None = None
        if config.outer_optimizer == "nesterov" and num_groups > 1:
            self._init_outer()

    # ------------------------------------------------------------------ outer state
    def _init_outer(self) -> None:
        with torch.no_grad():
            self.anchor = [
                torch.nn.Parameter(_local(p).detach().to(torch.float32).clone(), requires_grad=False)
                for p in self.params
            ]
        momentum = float(self.config.outer_momentum)
        self.outer_optimizer = torch.optim.SGD(
            self.anchor, lr=float(self.config.outer_lr), momentum=momentum, nesterov=momentum > 0
        )

    # ------------------------------------------------------------------ the hook
    def on_optimizer_step(self) -> bool:
        """Call after every real optimizer step; syncs on every H-th. Returns True if it synced."""
        self.local_step += 1
        self.global_step += 1
        if self.local_step >= self.config.sync_every:
            self.sync()
            return True
        return False

    @property
    def pending(self) -> bool:
        """True when optimizer steps were taken since the last sync."""
        return self.local_step > 0

    # ------------------------------------------------------------------ the sync
    def _buckets(self, tensors: list[torch.Tensor]):
        limit = max(1, self.config.sync_bucket_mb * 2**20 // 4)
        bucket, size = [], 0
        for t in tensors:
            n = t.numel()
            if bucket and size + n > limit:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += n
        if bucket:
            yield bucket

    def _all_reduce_mean_(self, flat: torch.Tensor) -> None:
        """In place: ``flat`` <- sum over the "fl" axis / F, using the 1/R split under HSDP."""
        F, R = self.num_groups, self.replicas
        if R > 1:
            chunk = flat.numel() // R
            mine = flat[self.replica_index * chunk:(self.replica_index + 1) * chunk]
            piece = mine.clone()
            dist.all_reduce(piece, op=dist.ReduceOp.SUM, group=self.fl_group)
            piece.div_(F)
            dist.all_gather_into_tensor(flat, piece, group=self.replicate_group)
        else:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.fl_group)
            flat.div_(F)

    def _average_tensors_(self, tensors: list[torch.Tensor], weights: torch.Tensor | None = None) -> None:
        """Replace each tensor by its fp32 mean over the "fl" axis, bucket by bucket."""
        R = self.replicas
        for bucket in self._buckets(tensors):
            numel = sum(t.numel() for t in bucket)
            padded = math.ceil(numel / R) * R
            flat = torch.zeros(padded, dtype=torch.float32, device=bucket[0].device)
            offset = 0
            for t in bucket:
                flat[offset:offset + t.numel()].copy_(t.reshape(-1))
                offset += t.numel()
            self._all_reduce_mean_(flat)
            offset = 0
            for t in bucket:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def _check_finite(self) -> bool:
        """All-reduce one flag per group: returns True if every group is finite.

        Raises NonFiniteError on every rank (naming the groups) under on_nonfinite='abort'.
        """
        local_bad = any(not torch.isfinite(_local(p)).all() for p in self.params)
        if self.last_loss is not None and not math.isfinite(self.last_loss):
            local_bad = True
        flags = torch.zeros(self.num_groups, dtype=torch.float32, device=self.params[0].device)
        flags[self.group_index] = float(local_bad)
        # The flag vector is tiny; reduce it over the whole world so every rank of every
        # group learns which groups are bad (a bad shard anywhere taints its group).
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad = [i for i in range(self.num_groups) if flags[i] > 0]
        if not bad:
            return True
        if self.config.on_nonfinite == "abort" or len(bad) == self.num_groups:
            raise NonFiniteError(
                f"non-finite parameters or loss in federation group(s) {bad} at optimizer step "
                f"{self.global_step} (sync {self.num_syncs + 1}); aborting. Set on_nonfinite='reset' to "
                f"drop such groups for the round instead."
            )
        self._bad_groups = bad
        return False

    @torch.no_grad()
    def sync(self) -> None:
        """Average parameters (and optionally optimizer state) across groups now.

        Collective over the "fl" (and, under HSDP, "dp_replicate") axis: every rank must
        call it at the same optimizer step. A no-op when F == 1.

        Raises:
            NonFiniteError: a group holds NaN/Inf and ``on_nonfinite='abort'``.
        """
        if self.num_groups <= 1:
            self.local_step = 0
            return
        self._bad_groups = []
        all_finite = self._check_finite()
        locals_ = [_local(p) for p in self.params]
        if not all_finite:
            self._masked_mean_(locals_)
        elif self.outer_optimizer is None:
            self._average_tensors_(locals_)
        else:
            self._outer_step_(locals_)
        if self.config.average_optimizer_state:
            self._average_tensors_(self._optimizer_state_tensors())
        self.local_step = 0
        self.num_syncs += 1

    def _masked_mean_(self, locals_: list[torch.Tensor]) -> None:
        """on_nonfinite='reset': mean over healthy groups; bad groups contribute zeros."""
        bad = self._bad_groups
        healthy = self.num_groups - len(bad)
        if self.group_index in bad:
            for t in locals_:
                t.zero_()
        self._average_tensors_(locals_)
        for t in locals_:
            t.mul_(self.num_groups / healthy)
        if self.outer_optimizer is not None:
            for a, t in zip(self.anchor, locals_):
                a.copy_(t)
        logger.warning("sync %d: dropped federation group(s) %s (non-finite) and reset them to the mean",
                       self.num_syncs + 1, bad)

    def _outer_step_(self, locals_: list[torch.Tensor]) -> None:
        self._average_tensors_(locals_)
        for a, t in zip(self.anchor, locals_):
            a.grad = a.detach() - t.to(torch.float32)  # pseudo-gradient: anchor - mean
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        for a, t in zip(self.anchor, locals_):
            t.copy_(a)

    def _optimizer_state_tensors(self) -> list[torch.Tensor]:
        out = []
        for p in self.params:
            state = self.optimizer.state.get(p, {})
            for key in sorted(state):
                v = state[key]
                if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0:
                    out.append(_local(v))
        return out

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """Counters and outer state. Tensors are this rank's local shards (fp32)."""
        out = {"local_step": self.local_step, "global_step": self.global_step, "num_syncs": self.num_syncs}
        if self.outer_optimizer is not None:
            out["anchor"] = [a.detach().clone() for a in self.anchor]
            out["outer_optimizer"] = self.outer_optimizer.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        self.local_step = int(state["local_step"])
        self.global_step = int(state["global_step"])
        self.num_syncs = int(state["num_syncs"])
        if self.outer_optimizer is not None:
            if "anchor" not in state:
                raise ValueError("checkpoint has no outer-optimizer anchor, but outer_optimizer='nesterov'")
            with torch.no_grad():
                for a, saved in zip(self.anchor, state["anchor"]):
                    a.copy_(saved)
            self.outer_optimizer.load_state_dict(state["outer_optimizer"])
