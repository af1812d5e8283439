"""The non-finite guard of every sync: NaN/Inf in a group's shards or last loss.

Each sync event first runs :func:`check_finite` (one MAX over the world). Under
``on_nonfinite="abort"`` (the default) a bad group raises :class:`NonFiniteError` on every
rank; under "reset" the bad groups are dropped for the round: any exchange in flight is
completed and discarded, every parameter and anchor is set to the weighted mean of the
healthy groups, residuals are zeroed, and the bad groups' optimizer state (every group's,
with ``average_optimizer_state``) to the healthy mean; counters and momentum are kept.
"""

from __future__ import annotations

import logging
import math

import torch

from .fsdp import local
from .state_mean import mean_into, optimizer_state_tensors

logger = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Raised by a sync on every rank when a federation group holds NaN/Inf and on_nonfinite='abort'."""


def check_finite(sync, rnd) -> bool:
    """The NaN/Inf check every sync runs first: True when no group has NaN/Inf in a shard or
    the last loss (a collective); else, under ``on_nonfinite="reset"``, the reset (module
    docstring) and False. NonFiniteError on every rank under "abort" or when every group is bad."""
    s, loss = sync.schedule, sync.last_loss
    local_bad = any(not torch.isfinite(local(p)).all() for p in sync.params) or \
        (loss is not None and not math.isfinite(loss))
    with sync.arriving():  # the first world collective of a "steps" event: every rank waits for the last
        bad = sync.transport.bad_groups(local_bad, rnd)
    if bad and (sync.config.on_nonfinite == "abort" or len(bad) == rnd.num_groups):
        raise NonFiniteError(f"non-finite parameters or loss in federation group(s) {bad} at optimizer step "
                             f"{s.global_step} (sync {s.num_syncs + 1}); aborting. Set on_nonfinite='reset' to "
                             f"drop such groups for the round instead.")
    if not bad:
        return True
    for fragment in sync.fragments:  # complete the collectives, discard what they carried
        if fragment.pending is not None:
            fragment.finish()
    mask = tuple(0 if g in bad else 1 for g in range(rnd.num_groups))
    mean_into(sync, [local(p) for p in sync.params], rnd, mask, also=sync.outer.set_global)
    sync.hooks.write(sync.outer.zero_residuals)
    tensors = optimizer_state_tensors(sync.optimizer, sync.params, list(range(len(sync.params))))
    if tensors:
        mean_into(sync, tensors, rnd, mask, write=rnd.position in bad or sync.config.average_optimizer_state)
    logger.warning("sync %d: dropped federation group(s) %s (non-finite) and reset every group to the healthy "
                   "mean (parameters and the bad groups' optimizer state)", s.num_syncs + 1, bad)
    sync.last_loss = None
    return False
