"""The ends of a torchft run: the first sync waits for every group, a stateless restart heals, the last waits.

Functions of a :class:`fl_accel.ft.ManagedTransport` (``transport``), called by its
:meth:`~fl_accel.ft.ManagedTransport.begin` and :meth:`~fl_accel.ft.ManagedTransport.finish`,
on every rank of the group (each is collective over the group's world and, where it says so,
the quorum's groups):

* :func:`wait_at_start`: the first sync of a fresh federation waits for every configured group
  (else a group that starts a few seconds early trains alone, then hands the others its state),
  and :func:`check_identical_start` checks that the groups start from identical parameters;
* :func:`heal_lost_state`: a group restarted without its state (``require_heal``) never trains
  on from fresh weights when no live group holds a committed state: it waits for one, then
  raises :class:`StateLostError`;
* :func:`finish`: a group that has trained the whole run waits for the other configured groups
  to reach the end, serving their heals, and the groups compare checksums.

Each wait is bounded by ``FLConfig.rejoin_timeout_s`` (docs/fault_tolerance.md).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

import torch
import torch.distributed as dist

from .fsdp_model import check_identical

logger = logging.getLogger(__name__)


class StateLostError(RuntimeError):
    """A federation group restarted without its state, and no live group held a committed
    state to heal from within ``FLConfig.rejoin_timeout_s`` (:func:`heal_lost_state`):
    training on would restart the federation from fresh weights."""


def wait_at_start(transport) -> None:
    """The first sync of a fresh federation (nobody has committed: the quorum's max step is
    0) waits for every configured group, asking the quorum again every second, at most
    ``rejoin_timeout_s``; then the groups present start without the others (those heal from
    them when they come). Every group of a waiting quorum is in this wait (max step 0, the same
    count), so they decide together: a MAX over the group's ranks and over the quorum's groups
    of "my deadline passed"."""
    manager, deadline = transport.manager, None
    while True:
        num = manager.num_participants()
        if transport.max_step > 0 or transport.healed or num >= transport.num_groups or manager.errored() is not None:
            return
        now = time.monotonic()
        if deadline is None:
            deadline = now + transport.rejoin_timeout_s
            logger.info("fl_accel: %d of %d federation groups at the first sync; waiting up to %g s for the others "
                        "(FLConfig.rejoin_timeout_s)", num, transport.num_groups, transport.rejoin_timeout_s)
        late = torch.zeros(max(1, num), dtype=torch.float32, device=transport.device)
        late[manager.participating_rank() or 0] = float(now >= deadline)
        dist.all_reduce(late, op=dist.ReduceOp.MAX)  # any rank of this group
        if num > 1:
            transport.control_all_reduce(late)  # any group of this quorum
        if late.max().item() > 0:
            logger.warning("fl_accel: starting with %d of %d federation groups after waiting %g s for the others "
                           "(FLConfig.rejoin_timeout_s); they heal from these when they come", num,
                           transport.num_groups, transport.rejoin_timeout_s)
            return
        transport.round = None
        time.sleep(1.0)
        transport.ask_quorum()


def check_identical_start(transport, num: int, position: int) -> None:
    """Before the first commit: :func:`fl_accel.fsdp_model.check_identical` of the quorum's
    groups (their ``init_checksum``, summed over the managed group); ValueError on every rank
    of this group when any rank saw a difference."""
    table = torch.zeros(num, 3, dtype=torch.float64, device=transport.device)
    table[position] = transport.init_checksum
    transport.control_all_reduce(table)  # even after an error: the others wait for it
    error = None
    try:
        check_identical(table, [0] * num, list(range(num)), context=" (fault_tolerance='torchft', positions in the "
                        "first quorum: the groups started from different parameters)")
    except ValueError as exc:
        error = exc
    bad = torch.tensor([float(transport.manager.errored() is None and error is not None)], device=transport.device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # any rank of this group
    if bad.item():
        raise error or ValueError("fault_tolerance='torchft': the federation groups started from different "
                                  "parameters (seen by another rank of this group); seed identically")


def heal_lost_state(transport) -> None:
    """After ``transport.require_heal(lost_step)`` (``transport.lost_step`` set): until a quorum
    healed every rank of this group, ask again every second, training nothing (a quorum in which
    the heal failed answers the quorum's control table, which its other groups expect, and is
    dropped); :class:`StateLostError` on every rank after ``rejoin_timeout_s``. Then
    ``lost_step`` is cleared. Collective over the group's world and the quorum's groups."""
    deadline = None
    while transport.lost_step is not None and not _healed_on_every_rank(transport):
        num, position = transport.manager.num_participants(), transport.manager.participating_rank()
        if num > 1 and transport.behind and position is not None:  # a heal failed: the quorum drops the round
            transport.weights_without_healed(num, position)
        now = time.monotonic()
        if deadline is None:
            deadline = now + transport.rejoin_timeout_s
            logger.warning("fl_accel: federation group %d restarted without its state (its earlier session reached "
                           "step %d); waiting up to %g s (FLConfig.rejoin_timeout_s) for a group that holds a "
                           "committed state to heal from", transport.group_index, transport.lost_step,
                           transport.rejoin_timeout_s)
        if now >= deadline:
            raise StateLostError(
                f"federation group {transport.group_index} restarted without its state (its earlier session reached "
                f"step {transport.lost_step} and left no checkpoint), and no group holding a committed state joined "
                f"its quorum within {transport.rejoin_timeout_s:g} s (FLConfig.rejoin_timeout_s): the federation's "
                f"trained state is lost, and training on would restart it from fresh weights. Restart the groups from "
                f"their checkpoints (accelerator.save_state; the recipe's --checkpoint_every), or start the run over")
        drop_round(transport)  # nothing of this quorum is kept: no exchange
        time.sleep(1.0)
        transport.ask_quorum()
    transport.lost_step = None


def drop_round(transport) -> None:
    """Close the open round, keeping nothing of it: a round in which a rank of this group hit
    an error is voted on (False: torchft counts a commit failure, so the next quorum gets a
    new id and rebuilds the managed group, which a failed collective may have aborted); one
    without is closed unvoted (nothing to commit, and the committed step stays). The
    decision is the group's (a MAX over its ranks)."""
    failed = torch.tensor([float(transport.manager.errored() is not None)], dtype=torch.float32,
                          device=transport.device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        transport.should_commit()
    transport.round = None


def _healed_on_every_rank(transport) -> bool:
    """The last quorum healed every rank of this group (a MIN over the group's world)."""
    flag = torch.tensor([float(transport.healed and transport.manager.errored() is None)], dtype=torch.float32,
                        device=transport.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def finish(transport, checksum: Callable[[], float], poll_s: float = 1.0) -> dict:
    """The end of the run (every rank of the group, after the final sync): wait until every
    configured group (``transport.num_groups``) is at the end, serving the heals of the groups
    behind.

    A loop of quorums, none voted on unless it failed (nothing is trained or exchanged here,
    so torchft's committed step stays the run's count of syncs, in every group alike;
    :func:`drop_round`): one in which groups heal (they were behind: a group restarted from an
    older checkpoint, or without one, takes over this group's final state) is followed by the
    next; one of this group alone (the others down or still training) is asked again after
    ``poll_s``; one in which nobody heals exchanges each group's checksum (``checksum()``:
    this rank's fp64 sum of its local shards, summed over the group's ranks here). The wait
    ends when that exchange holds all ``num_groups`` groups (each group's row reached this one:
    :func:`_end_table`): ``together`` when their checksums are equal, else the groups are apart
    (a warning; waiting longer changes nothing). After ``rejoin_timeout_s`` without that, the
    group ends alone. A quorum in which a group heals from the groups at the end restarts that
    wait (at most ``num_groups - 1`` times): the healed group holds the final model and joins
    the end quorum right after, which on a loaded machine may take seconds, and a group that
    gave up just then would report the federation apart though every group ends with its
    model. Collective over the group's world and the quorum's groups.

    Returns: ``{"together": bool, "groups": [group indices in the last end quorum],
    "num_groups": F, "checksum": this group's, "checksums": {group: checksum},
    "waited_s": seconds}``; ``together`` False when the wait timed out (a group is down for
    good, or came back too late: this group's final model may differ from theirs) or the
    checksums differ."""
    t0 = time.monotonic()
    deadline, seen, together = t0 + transport.rejoin_timeout_s, {}, transport.num_groups <= 1
    restarts = 0  # waits restarted by a heal from the end state
    drop_round(transport)  # an event a heal left with nothing to exchange (this group took a final state)
    while not together:
        try:
            rnd = transport.begin()
        except StateLostError:
            raise
        except Exception as exc:  # a quorum that timed out (more min_replicas than live groups)
            logger.warning("fl_accel: end-of-run quorum failed (%s: %s); asking again", type(exc).__name__, exc)
            transport.round, rnd = None, None
        complete = False
        if rnd is not None and rnd.num_groups > 1 and not transport.behind:  # nobody heals: all are at the end
            seen = _end_table(transport, rnd, checksum())
            complete = set(seen) >= set(range(transport.num_groups))
            together = complete and _equal(seen.values())
        elif rnd is not None and rnd.num_groups > 1 and restarts < transport.num_groups - 1:
            restarts += 1  # a group heals from the end state: it is at the end right after this quorum
            deadline = max(deadline, time.monotonic() + transport.rejoin_timeout_s)
        drop_round(transport)
        if complete and not together:
            logger.warning("fl_accel: every federation group reached the end, but their final models differ "
                           "(checksums by group: %s)", {g: seen[g] for g in sorted(seen)})
        if together or complete or time.monotonic() >= deadline:
            break
        if rnd is None or rnd.num_groups == 1:
            time.sleep(poll_s)
    own = _group_sum(transport, checksum())
    seen = {**seen, transport.group_index: own}
    return {"together": together, "groups": sorted(seen), "num_groups": transport.num_groups, "checksum": own,
            "checksums": {int(g): c for g, c in sorted(seen.items())}, "waited_s": time.monotonic() - t0}


def _equal(checksums) -> bool:
    """Checksums of identical models: equal up to the order of the fp64 sums (groups of
    different shapes sum their shards in different orders); a model that differs in one element
    by 1e-7 differs far more than this."""
    values = list(checksums)
    return all(math.isclose(v, values[0], rel_tol=1e-12, abs_tol=1e-12) for v in values)


def _group_sum(transport, value: float) -> float:
    """A SUM over the group's own world (fp64)."""
    out = torch.tensor([float(value)], dtype=torch.float64, device=transport.device)
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return float(out.item())


def _end_table(transport, membership, local_sum: float) -> dict[int, float]:
    """{group index: checksum} of the quorum's groups (each group's sum over its ranks,
    exchanged over the managed group): the rows that reached this group. A row is written by
    its group alone (the others add 0), so a collective that failed part-way leaves rows
    missing, never a wrong one: rows that hold a valid group index (1..F, once) are that
    group's, whether or not this group's wait on the collective then reported an error (e.g. a
    peer that had sent everything closed its connection before this group read it)."""
    table = torch.zeros(membership.num_groups, 2, dtype=torch.float64, device=transport.device)
    table[membership.position] = torch.tensor([transport.group_index + 1.0, _group_sum(transport, local_sum)],
                                              dtype=torch.float64)
    transport.control_all_reduce(table)
    rows = [(g, c) for g, c in table.tolist() if g >= 1]
    indices = [g for g, _ in rows]
    if any(g != int(g) or g > transport.num_groups for g in indices) or len(set(indices)) != len(indices):
        return {}  # not rows of one exchange (a collective failed): nothing is known of the others
    return {int(g) - 1: float(c) for g, c in rows}
