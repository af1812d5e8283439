"""Federation groups that fail alone: the "fl" exchange over torchft's managed process group.

With ``fault_tolerance="torchft"`` each group is its own launch (a world of its G ranks,
FSDP2 inside). torchft (``torchft/manager.py``, ``process_group.py``) provides membership,
quorum, the reconfigurable process group and recovery; the exchange, outer step and schedule
stay ours. Two torchft APIs are supported, chosen by the installed build
(:func:`fl_accel.compat.torchft_api`): 0.2 (torchft 0.2.0: the managed group is rebuilt with
``ProcessGroup.configure`` on the quorum's store) and 0.3 (torchft-nightly 2026.10.26, torchft
0.3: ``pg.reconfigure(ReconfigureOptions)`` with handles exchanged through the Lighthouse).
Relied on (both):

* One ``Manager`` per rank; the group's rank 0 hosts the ``ManagerServer`` that asks the
  Lighthouse (``src/lighthouse.rs``) for a quorum of the heartbeating groups.
* ``start_quorum()`` (``use_async_quorum=False``) blocks until the quorum is known,
  reconfigures the managed group on a membership change (rank k of every live group is
  ``participating_rank()`` of ``num_participants()``), and heals a group whose
  ``current_step()`` is behind the quorum's max: it downloads a live group's state over
  HTTP and applies it with the ``load_state_dict`` callback.
* ``should_commit()`` is a vote of the group's ranks, False after any ``report_error``;
  the committed step then stays, so the next quorum heals the group.
* Only ``allreduce``, ``alltoall_base`` and ``allgather_into_tensor_coalesced`` are used on
  the managed group (``dist.all_gather_into_tensor`` fails: not in the world's group map).

Limits handled: torchft keeps its keys in the store it is given, which ``torchrun`` keeps
across ``--max-restarts`` attempts, so each attempt gets its own (:func:`_attempt_store`);
torchft #343: recovering rank k of group i heals from group ``(i + k) mod U``
(``src/manager.rs``), so with F >= 3 a group's ranks would heal from different groups:
:class:`_AgreedClient` makes them all use rank 0's assignment. torchft advertises
``socket.gethostname()`` for its ManagerServer, its checkpoint server and (0.3) the managed
group's rendezvous store (torchft #329: an 8B heal over the slow Ethernet took 948 s):
``FLConfig.heal_address`` advertises a chosen address or interface instead
(:func:`resolve_address`, :class:`HealTransport`, :func:`_managed_pg`). A (re)configuration
whose store is gone (the heal source died) fails within :data:`CONNECT_TIMEOUT_S` instead of
torchft's store timeout.

At the ends of a run (:meth:`ManagedTransport.finish`, :meth:`ManagedTransport.require_heal`):
a group that has trained the whole run waits for the other configured groups to reach the end
(serving their heals) before it ends, and a group restarted without its state never trains
on from fresh weights when no live group holds a committed one: it waits for one, then
raises :class:`StateLostError`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import urllib.request
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import comm, compat
from .exchange import Round
from .fsdp import local
from .mesh_transport import MeshTransport
from .sync import EventHooks

AllgatherOptions, AllreduceOptions, AllToAllOptions = compat.collective_options()

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 30.0
"""Seconds to reach a peer's server before giving up: a managed process group's
(re)configuration trying the store it is given (:func:`_managed_pg`), and torchft's RPC
connections (the Manager's ``connect_timeout``: a healing group asks its source's ManagerServer
for the checkpoint's address first). A heal source that died takes both with it, and torchft
would retry for the whole collective timeout (300 s by default) before the round fails. A live
server answers a TCP connect within milliseconds on any network; a Lighthouse that is not up
yet must be within this."""


class StateLostError(RuntimeError):
    """A federation group restarted without its state, and no live group held a committed
    state to heal from within ``FLConfig.rejoin_timeout_s`` (:meth:`ManagedTransport.require_heal`):
    training on would restart the federation from fresh weights."""


def _report(manager, exc: Exception, pg=None) -> None:
    """A collective across the groups failed: the round will not commit, and ``pg`` (the managed
    process group) is aborted, which closes its connections, so that a peer group blocked on this
    one in the same collective fails at once instead of after the collective timeout (gloo
    does not tell the others when one rank gives an operation up). The failed vote counts a
    commit failure, and torchft's Lighthouse then gives the next quorum a new id, so the
    managed group is built anew."""
    logger.warning("fl_accel sync: a collective across federation groups failed (%s: %s); this round will not "
                   "commit", type(exc).__name__, exc)
    manager.report_error(exc)
    if pg is not None:
        try:
            pg.abort()
        except Exception as abort_exc:  # already aborted, or never set up
            logger.debug("aborting the managed process group: %s", abort_exc)


class _Agreed:  # a torchft QuorumResult with the recovery fields of the group's rank 0
    def __init__(self, quorum, agreed: dict):
        self._result, self._agreed = quorum, agreed

    def __getattr__(self, name):
        return self._agreed[name] if name in self._agreed else getattr(self._result, name)


RECOVERY_FIELDS = ("heal", "recover_src_replica_rank", "recover_src_manager_address", "recover_dst_replica_ranks")


class _AgreedClient:
    """A Manager's ``ManagerClient`` whose quorums (on torchft's quorum thread) carry rank 0's
    :data:`RECOVERY_FIELDS` (broadcast over ``group``, gloo) and record each heal in
    ``transport.heal_sources`` (quorum id, the source used, the one torchft assigned)."""

    def __init__(self, client, group, transport: "ManagedTransport"):
        self._inner, self._group, self._transport = client, group, transport

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _quorum(self, *args, **kwargs):
        quorum = compat.client_quorum(self._inner, *args, **kwargs)
        box = [{k: getattr(quorum, k) for k in RECOVERY_FIELDS}]
        dist.broadcast_object_list(box, src=0, group=self._group)  # rank 0 of this group decides
        agreed = box[0]
        self._transport.behind = quorum.replica_world_size - quorum.max_world_size
        self._transport.max_step = quorum.max_step
        self._transport._heal_agreed = bool(agreed["heal"])
        if agreed["heal"]:
            names = [r.split(":")[0] for r in quorum.replica_ids]
            src, own = agreed["recover_src_replica_rank"], quorum.recover_src_replica_rank
            self._transport.heal_sources.append({"quorum_id": quorum.quorum_id, "max_step": quorum.max_step,
                                                 "source": names[src], "torchft_source": None if own is None
                                                 else names[own]})
            self._transport._heal_started = time.perf_counter()  # the download starts after this returns
        return _Agreed(quorum, agreed)


class CommitHooks(EventHooks):
    """:class:`~fl_accel.sync.EventHooks` of :class:`ManagedTransport` (the synchronizer's
    membership plug-in for torchft): sync events run even with one live group; each step with
    sync actions opens the event's quorum first (a heal there replaces this group's state and
    counters); an event's writes wait for the commit, and are dropped without it (groups keep
    their values)."""

    always_active = True

    def __init__(self, transport: "ManagedTransport"):
        self.transport, self.deferred = transport, None

    def open(self) -> bool:
        self.transport.begin()  # the quorum of this event; a heal replaces the counters
        return self.transport.healed

    @contextlib.contextmanager
    def event(self, schedule):
        self.deferred = []
        try:
            yield
            writes = self.deferred
        finally:
            self.deferred = None
        if self.transport.should_commit():
            for fn in writes:
                fn()
        else:
            logger.warning("sync %d (optimizer step %d) not committed: a federation group failed during the "
                           "exchange; every group keeps its local values", schedule.num_syncs + 1,
                           schedule.global_step)


@dataclass
class ManagedTransport:
    """:class:`~fl_accel.exchange.Transport` over torchft's managed process group.

    :meth:`begin` opens a round (a quorum; it stays open so a delayed exchange keeps its
    group) and :meth:`should_commit` closes it. F is the number of live groups, weights
    1/F (0 for groups healing in the quorum, 1/(F - H) for the others). Chunks and device
    are ``inside``'s (replica r exchanges chunk r). ``healed``: the last quorum
    healed this group; ``heals``: how often; ``heal_sources``: one record per heal
    (:meth:`begin` completes it: see :meth:`_measure_heal`); ``seconds``: host seconds in
    quorums (heals included) and commit votes, and the number of quorums.
    """

    manager: object
    pg: object
    inside: MeshTransport
    meter: object = None  # the accelerator's CommMeter ("fl" traffic is counted while it is entered)
    init_sum: float | None = None  # fp64 sum of this rank's initial local shards (_check_identical)
    group_index: int = 0  # this launch's federation group (FLConfig.group_index): its row in the round's table
    num_groups: int = 1  # the federation's configured groups F (FLConfig.num_groups): whom finish() waits for
    rejoin_timeout_s: float = 300.0  # FLConfig.rejoin_timeout_s: finish() and require_heal() wait at most this
    elastic = True  # membership is decided at every sync
    num_chunks = property(lambda self: self.inside.num_chunks)
    chunk_index = property(lambda self: self.inside.chunk_index)
    device = property(lambda self: self.inside.device)

    def __post_init__(self):
        self.round: Round | None = None
        self.healed, self.heals = False, 0
        self.heal_sources: list[dict] = []
        self.behind = 0  # groups of the last quorum behind its max step (they heal in it)
        self.max_step = 0  # the last quorum's max committed step
        self.seconds = {"quorum": 0.0, "commit": 0.0, "quorums": 0}
        self._heal_agreed = False  # the last quorum told this group to heal (rank 0's word: equal on its ranks)
        self._heal_started = 0.0  # perf_counter when that quorum returned (the download follows)
        self._heal_loaded: tuple[int, float] | None = None  # this rank's (bytes, seconds) once the state is applied
        self.end_state: dict | None = None  # finish()'s answer, once it ran
        self._lost_step: int | None = None  # require_heal(): the step this group's lost session had reached
        self.checkpoint = None  # the HealTransport the Manager sends and receives states with

    @classmethod
    def create(cls, *, group_index: int, group_rank: int, group_size: int, lighthouse_addr: str,
               timeout: timedelta, inside: MeshTransport, save: Callable[[], dict], load: Callable[[dict], None],
               init_sum: float | None = None, num_groups: int = 1, heal_address: str | None = None,
               rejoin_timeout_s: float = 300.0) -> "ManagedTransport":
        """This rank's Manager (replica id ``fl_accel_group_<f>``, synchronous quorum,
        ``init_sync=False``: groups start identical) and managed ``ProcessGroupGloo`` /
        ``ProcessGroupNCCL`` of the installed torchft API, waits bounded by ``timeout``;
        ``save``/``load``: the recovery callbacks (:func:`capture`, :func:`restore`);
        ``heal_address``: what this rank advertises (and its checkpoint server binds) instead of
        torchft's ``socket.gethostname()`` (:func:`resolve_address`'s result; None: torchft's
        default); ``num_groups`` and ``rejoin_timeout_s``: :meth:`finish`'s and
        :meth:`require_heal`'s. Collective over the group's world. ImportError without torchft
        (or with a release of neither API)."""
        api = compat.check_torchft_version()
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        base = ProcessGroupNCCL if inside.device.type == "cuda" else ProcessGroupGloo
        pg = _managed_pg(base, api, heal_address)(timeout=timeout)
        transport = cls(manager=None, pg=pg, inside=inside, init_sum=init_sum, group_index=group_index,
                        num_groups=num_groups, rejoin_timeout_s=rejoin_timeout_s)

        def on_heal(state):  # torchft calls it with the state it received (downloaded and unpickled)
            received = time.perf_counter()
            transport.healed, transport.heals = True, transport.heals + 1
            load(state)
            done = time.perf_counter()
            transport._heal_loaded = (state_nbytes(state), done - transport._heal_started,
                                      received - transport._heal_started, done - received)

        agree = dist.new_group(backend="gloo", timeout=timeout)  # the #343 guard's side channel (CPU objects)
        store_addr, store_port, transport._store = _attempt_store(group_rank, agree, timeout, heal_address)
        transport.checkpoint = HealTransport(timeout, heal_address)
        advertised = {"hostname": heal_address} if heal_address else {}  # torchft's default: socket.gethostname()
        transport.manager = Manager(
            pg=pg, load_state_dict=on_heal, state_dict=save, min_replica_size=1, use_async_quorum=False,
            timeout=timeout, quorum_timeout=timeout, connect_timeout=min(timeout, timedelta(seconds=CONNECT_TIMEOUT_S)),
            rank=group_rank, world_size=group_size,
            lighthouse_addr=lighthouse_addr, store_addr=store_addr, store_port=store_port,
            replica_id=f"fl_accel_group_{group_index}", init_sync=False, checkpoint_transport=transport.checkpoint,
            **advertised)
        compat.wrap_manager_client(transport.manager, lambda client: _AgreedClient(client, agree, transport))
        return transport

    def begin(self) -> Round:
        """The open round, or a new quorum's (blocking; it may heal this group). After
        :meth:`require_heal` the quorum is asked again until this group healed (StateLostError
        after ``rejoin_timeout_s``)."""
        if self.round is None:
            self._ask_quorum()
            deadline = None
            while self._lost_step is not None and not self._healed_on_every_rank():
                num, position = self.manager.num_participants(), self.manager.participating_rank()
                if num > 1 and self.behind and position is not None:  # a heal failed: the quorum drops the round
                    self._weights_without_healed(num, position)  # the control table its other groups expect
                deadline = self._wait_for_state(deadline)
                self._ask_quorum()
            self._lost_step = None
            self._wait_at_start()
            num, position = self.manager.num_participants(), self.manager.participating_rank()
            if position is None or num < 1:
                raise RuntimeError(f"torchft quorum left this federation group out (participating rank {position} "
                                   f"of {num})")
            self.round = Round(num, position, (1.0 / num,) * num)
            if num > 1 and self.max_step == 0 and self.init_sum is not None:  # no commit yet: the start-up check
                self._check_identical(num, position)
            if num > 1 and self.behind:  # groups healed in this quorum: they hold a source's values
                self.round = Round(num, position, self._weights_without_healed(num, position))
            if num > 1 or self.healed:
                logger.info("sync quorum: %d live federation group(s), this group at position %d%s", num, position,
                            " (healed from a live group)" if self.healed else "")
        return self.round

    def _ask_quorum(self) -> None:
        """torchft's quorum (blocking; a heal of this group is applied in it), timed."""
        self.healed, t0 = False, time.perf_counter()
        self.manager.start_quorum()
        self.seconds["quorum"] += time.perf_counter() - t0
        self.seconds["quorums"] += 1
        if self._heal_agreed:
            self._measure_heal()

    def _wait_at_start(self) -> None:
        """The first sync of a fresh federation (nobody has committed: the quorum's max step is
        0) waits for every configured group, asking the quorum again every second, at most
        ``rejoin_timeout_s``; then the groups present start without the others (those heal from
        them when they come). Without it, a group that starts a few seconds before the others
        would train the run alone until they arrive and then hand them its state. Every group of
        a waiting quorum is in this wait (max step 0, the same count), so they decide together:
        a MAX over the group's ranks and over the quorum's groups of "my deadline passed"."""
        deadline = None
        while True:
            num = self.manager.num_participants()
            if self.max_step > 0 or self.healed or num >= self.num_groups or self.manager.errored() is not None:
                return
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.rejoin_timeout_s
                logger.info("fl_accel: %d of %d federation groups at the first sync; waiting up to %g s for the others "
                            "(FLConfig.rejoin_timeout_s)", num, self.num_groups, self.rejoin_timeout_s)
            late = torch.zeros(max(1, num), dtype=torch.float32, device=self.device)
            late[self.manager.participating_rank() or 0] = float(now >= deadline)
            dist.all_reduce(late, op=dist.ReduceOp.MAX)  # any rank of this group
            if num > 1:
                self._control_all_reduce(late)  # any group of this quorum
            if late.max().item() > 0:
                logger.warning("fl_accel: starting with %d of %d federation groups after waiting %g s for the others "
                               "(FLConfig.rejoin_timeout_s); they heal from these when they come", num,
                               self.num_groups, self.rejoin_timeout_s)
                return
            self.round = None
            time.sleep(1.0)
            self._ask_quorum()

    def require_heal(self, lost_step: int) -> None:
        """This group restarted without its state: its earlier session had reached optimizer step
        ``lost_step`` and left no checkpoint. Its first quorum must heal it from a group that
        holds a committed state (a live group, or one resumed from its checkpoint): until one
        does, :meth:`begin` asks for the quorum again every second, training nothing, and after
        ``rejoin_timeout_s`` raises :class:`StateLostError` on every rank of the group (training
        on would restart the federation from fresh weights). Call it on every rank of the group
        before its first sync."""
        self._lost_step = int(lost_step)

    def _drop_round(self) -> None:
        """Close the open round, keeping nothing of it: a round in which a rank of this group hit
        an error is voted on (False: torchft counts a commit failure, so the next quorum gets a
        new id and rebuilds the managed group, which :func:`_report` may have aborted); one
        without is closed unvoted (nothing to commit, and the committed step stays). The
        decision is the group's (a MAX over its ranks)."""
        failed = torch.tensor([float(self.manager.errored() is not None)], dtype=torch.float32, device=self.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():
            self.should_commit()
        self.round = None

    def _healed_on_every_rank(self) -> bool:
        """The last quorum healed every rank of this group (a MIN over the group's world)."""
        flag = torch.tensor([float(self.healed and self.manager.errored() is None)], dtype=torch.float32,
                            device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _wait_for_state(self, deadline: float | None) -> float:
        """One wait of :meth:`begin` for a group holding a committed state; the deadline
        (set at the first); StateLostError once it passed."""
        now = time.monotonic()
        if deadline is None:
            deadline = now + self.rejoin_timeout_s
            logger.warning("fl_accel: federation group %d restarted without its state (its earlier session reached "
                           "step %d); waiting up to %g s (FLConfig.rejoin_timeout_s) for a group that holds a committed "
                           "state to heal from", self.group_index, self._lost_step, self.rejoin_timeout_s)
        if now >= deadline:
            raise StateLostError(
                f"federation group {self.group_index} restarted without its state (its earlier session reached step "
                f"{self._lost_step} and left no checkpoint), and no group holding a committed state joined its quorum "
                f"within {self.rejoin_timeout_s:g} s (FLConfig.rejoin_timeout_s): the federation's trained state is "
                f"lost, and training on would restart it from fresh weights. Restart the groups from their "
                f"checkpoints (accelerator.save_state; the recipe's --checkpoint_every), or start the run over")
        self._drop_round()  # nothing of this quorum is kept: no exchange
        time.sleep(1.0)
        return deadline

    def finish(self, checksum: Callable[[], float], poll_s: float = 1.0) -> dict:
        """The end of the run (every rank of the group, after the final sync): wait until every
        configured group (``num_groups``) is at the end, serving the heals of the groups behind.

        A loop of quorums, none voted on unless it failed (nothing is trained or exchanged here,
        so torchft's committed step stays the run's count of syncs, in every group alike;
        :meth:`_drop_round`): one in which
        groups heal (they were behind: a group restarted from an older checkpoint, or without
        one, takes over this group's final state) is followed by the next; one of this group
        alone (the others down or still training) is asked again after ``poll_s``; one in which
        nobody heals exchanges each group's checksum (``checksum()``: this rank's fp64 sum of
        its local shards, summed over the group's ranks here) and ends the wait when all
        ``num_groups`` groups are in it. After ``rejoin_timeout_s`` without that, the group ends
        alone. Idempotent (the first answer is kept). Collective over the group's world and the
        quorum's groups.

        Returns: ``{"together": bool, "groups": [group indices in the last end quorum],
        "num_groups": F, "checksum": this group's, "checksums": {group: checksum},
        "waited_s": seconds}``; ``together`` False when the wait timed out (a group is down for
        good, or came back too late): this group's final model may differ from theirs."""
        if self.end_state is not None:
            return self.end_state
        t0 = time.monotonic()
        deadline, seen, together = t0 + self.rejoin_timeout_s, {}, self.num_groups <= 1
        self._drop_round()  # an event a heal left with nothing to exchange (this group took a final state)
        while not together:
            try:
                rnd = self.begin()
            except StateLostError:
                raise
            except Exception as exc:  # a quorum that timed out (more min_replicas than live groups)
                logger.warning("fl_accel: end-of-run quorum failed (%s: %s); asking again", type(exc).__name__, exc)
                self.round, rnd = None, None
            if rnd is not None and rnd.num_groups > 1 and not self.behind:  # nobody heals: all are at the end
                seen = self._end_table(rnd, checksum())
                together = self.manager.errored() is None and len(seen) >= self.num_groups
            self._drop_round()
            if together or time.monotonic() >= deadline:
                break
            if rnd is None or rnd.num_groups == 1:
                time.sleep(poll_s)
        own = self._group_sum(checksum())
        seen = {**seen, self.group_index: own}
        self.end_state = {"together": together, "groups": sorted(seen), "num_groups": self.num_groups,
                          "checksum": own, "checksums": {int(g): c for g, c in sorted(seen.items())},
                          "waited_s": time.monotonic() - t0}
        return self.end_state

    def _group_sum(self, value: float) -> float:
        """A SUM over the group's own world (fp64)."""
        out = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return float(out.item())

    def _end_table(self, rnd: Round, local_sum: float) -> dict[int, float]:
        """{group index: checksum} of the quorum's groups (each group's sum over its ranks,
        exchanged over the managed group); {} if that exchange failed."""
        table = torch.zeros(rnd.num_groups, 2, dtype=torch.float64, device=self.device)
        table[rnd.position] = torch.tensor([self.group_index + 1.0, self._group_sum(local_sum)], dtype=torch.float64)
        self._control_all_reduce(table)
        if self.manager.errored() is not None:
            return {}
        return {int(g) - 1: float(c) for g, c in table.tolist() if g >= 1}

    def _measure_heal(self) -> None:
        """Complete the newest ``heal_sources`` record after a quorum that healed this group:
        ``source_group`` (the live group it downloaded from), ``bytes`` (what the group's
        ranks loaded, summed) and ``seconds`` (download and apply, the slowest rank).

        torchft 0.2.0 reports neither the bytes nor the time of a recovery, so each rank
        measures its own: the tensors' ``nbytes`` of the state it applied (:func:`state_nbytes`;
        the HTTP transfer is that plus pickling overhead) and the seconds from the quorum's
        answer to the end of the apply. The source is the replica id of the quorum's
        ``recover_src_replica_rank`` after the #343 guard (``fl_accel_group_<f>``, set by
        :meth:`create`), so its group index is exact. ``wire_bytes``: what the group's ranks
        downloaded (the serialized states, :class:`HealTransport`). ``seconds`` splits into
        ``transfer_seconds`` (the quorum's answer to the state received: torchft's HTTP
        download and unpickling on its quorum thread) and ``load_seconds`` (applying it: reshard,
        parameters, optimizer and sync state), each the slowest rank's. Every rank of the group runs this (the
        heal decision is rank 0's, broadcast): one SUM and one MAX over the group's world; a
        rank whose download failed counts 0 bytes (torchft then fails the round's commit).
        Collective over the group's world."""
        mine, self._heal_loaded, self._heal_agreed = self._heal_loaded or (0, 0.0, 0.0, 0.0), None, False
        wire = getattr(self.checkpoint, "received_bytes", 0) if mine[0] else 0
        nbytes = torch.tensor([float(mine[0]), float(wire)], dtype=torch.float64, device=self.device)
        seconds = torch.tensor(list(mine[1:]), dtype=torch.float64, device=self.device)
        dist.all_reduce(nbytes, op=dist.ReduceOp.SUM)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        if self.heal_sources:
            record = self.heal_sources[-1]
            name = str(record.get("source"))
            total, transfer, load = seconds.tolist()
            record.update(source_group=int(name.rsplit("_", 1)[1]) if name.startswith("fl_accel_group_") else None,
                          bytes=int(nbytes[0].item()), wire_bytes=int(nbytes[1].item()), seconds=total,
                          transfer_seconds=transfer, load_seconds=load)

    def _check_identical(self, num: int, position: int) -> None:
        """Before the first commit: ValueError on every rank when the groups' ``init_sum`` differ."""
        sums = torch.zeros(num, dtype=torch.float64, device=self.device)
        sums[position] = self.init_sum
        self._control_all_reduce(sums)
        bad = torch.tensor([float(self.manager.errored() is None and bool((sums != sums[position]).any()))],
                           device=self.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # any rank of this group
        if bad.item():
            raise ValueError(f"fault_tolerance='torchft': the federation groups started from different parameters "
                             f"(checksums of the local shards: {sums.tolist()}); build the model with the same seed "
                             f"in every group (accelerate.utils.set_seed before creating it)")

    def _weights_without_healed(self, num: int, position: int) -> tuple[float, ...]:
        """0 for the H groups that healed in this quorum (copies of their source, which would
        weigh twice), 1/(F - H) for the others; every group runs the flags' SUM. A heal that
        failed (its source died, its download broke) fails the round in every group of the
        quorum: each reports an error, so none launches the exchange (a group that did would
        wait the collective timeout for the failed one) and none commits."""
        flags = torch.zeros(2, num, dtype=torch.float32, device=self.device)
        flags[0, position] = float(self.healed)
        flags[1, position] = float(self.manager.errored() is not None)
        self._control_all_reduce(flags)
        if self.manager.errored() is None and flags[1].any():
            failed = [g for g in range(num) if flags[1, g].item()]
            self.manager.report_error(RuntimeError(f"a heal in this quorum failed (quorum positions {failed}): the "
                                                   f"round is dropped in every group"))
        live = [g for g in range(num) if flags[0, g].item() == 0]
        if self.manager.errored() is not None or not 0 < len(live) < num:
            return (1.0 / num,) * num
        return tuple(1.0 / len(live) if g in live else 0.0 for g in range(num))

    def event_hooks(self) -> CommitHooks:
        """The synchronizer's hooks into each sync event (:class:`CommitHooks`)."""
        return CommitHooks(self)

    def should_commit(self) -> bool:
        """torchft's vote of the group's ranks; closes the round. Collective."""
        t0 = time.perf_counter()
        try:
            return bool(self.manager.should_commit())
        finally:
            self.round = None
            self.seconds["commit"] += time.perf_counter() - t0

    def _call(self, launch, op: str, tensor, async_op: bool, force: bool = False):
        """Launch a collective on the managed group (none once the round is lost, unless
        ``force``) and wait for it unless ``async_op``; counted in ``meter``'s "fl" bucket as
        :mod:`fl_accel.comm` counts the single world's, while it is entered."""
        meter = self.meter if self.meter is not None and self.meter in comm._active else None
        work, t0 = None, time.perf_counter()
        if force or self.manager.errored() is None:
            try:
                work = launch()
            except Exception as exc:
                _report(self.manager, exc, self.pg)
        if work is not None and meter is not None:
            num = self.round.num_groups if self.round is not None else 1
            meter.stats.record("fl", op, int(comm.ring_bytes(op, tensor.numel() * tensor.element_size(), num)),
                               time.perf_counter() - t0)
        work = comm.TimedWork(work, meter and (lambda s: meter._add_seconds("fl", s)),
                              lambda exc: _report(self.manager, exc, self.pg))  # a peer group died: no commit
        if async_op:
            return work
        work.wait()

    def all_reduce(self, tensor, async_op=False):
        opts = AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        return self._call(lambda: self.pg.allreduce([tensor], opts), "all_reduce", tensor, async_op)

    def _control_all_reduce(self, tensor) -> None:
        """A SUM of the quorum's small control table (start-up check, heal flags, end checksums)
        launched even after this round's error: every group of the quorum makes it, so a group
        whose heal failed still answers it (its managed group is set up; one whose set-up failed
        fails the call at once) instead of leaving the others waiting the collective timeout."""
        opts = AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._call(lambda: self.pg.allreduce([tensor], opts), "all_reduce", tensor, False, force=True)

    def all_to_all(self, output, input, async_op=False):
        return self._call(lambda: self.pg.alltoall_base(output, input, [], [], AllToAllOptions()), "all_to_all",
                          input, async_op)

    def all_gather(self, output, input, async_op=False):
        return self._call(lambda: self.pg.allgather_into_tensor_coalesced(
            [output.view(-1)], [input.reshape(-1)], AllgatherOptions()), "all_gather", output, async_op)

    def share_chunks(self, flat):
        self.inside.share_chunks(flat)

    def bad_groups(self, local_bad, rnd):
        """A MAX over the group's world, then a SUM over the live groups; empty if the round failed."""
        flag = torch.tensor([float(local_bad)], dtype=torch.float32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        flags = torch.zeros(rnd.num_groups, dtype=torch.float32, device=self.device)
        flags[rnd.position] = flag[0]
        self.all_reduce(flags)
        if self.manager.errored() is not None:
            return []
        return [g for g in range(rnd.num_groups) if flags[g] > 0]

    def group_max(self, value):
        """A MAX over the group's own world (one launch)."""
        out = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return float(out.item())

    def group_table(self, vector, rnd):
        """A MAX over the group's world, then a SUM over the live groups. If that SUM failed
        (a peer group died: the round will not commit) only this group's row is filled in
        (the others' last field, the group index, is -1), so that the round state records
        what this group knows; the next quorum heals it from a live group if it fell behind."""
        mine = torch.tensor(vector, dtype=torch.float64, device=self.device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        table = torch.zeros(rnd.num_groups, len(vector), dtype=torch.float64, device=self.device)
        table[rnd.position] = mine
        self.all_reduce(table)
        if self.manager.errored() is not None:
            unknown = [0.0] * (len(vector) - 1) + [-1.0]  # trigger.FIELDS: a negative "group" is a row not filled in
            return [mine.tolist() if p == rnd.position else unknown for p in range(rnd.num_groups)]
        return table.tolist()

    def state_dict(self) -> dict:
        """The Manager's committed step, for this group's checkpoints."""
        return {"manager": self.manager.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.manager.load_state_dict(state["manager"])

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def _attempt_store(group_rank: int, group, timeout: timedelta, advertise: str | None = None):
    """``(host, port, server)``: a fresh TCPStore for this attempt's torchft keys, served by
    the group's rank 0 on a free port, advertised as rank 0's ``advertise`` (its
    ``heal_address``) or ``MASTER_ADDR`` (host and port broadcast over ``group``). With torchft's
    0.2 API the quorum's groups also rendezvous their managed group on it."""
    host = advertise or os.environ.get("MASTER_ADDR", "127.0.0.1")
    server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout) if group_rank == 0 \
        else None
    box = [(host, server.port) if server is not None else None]
    dist.broadcast_object_list(box, src=0, group=group)
    host, port = box[0]
    return host, int(port), server


def resolve_address(value: str | None) -> str | None:
    """``FLConfig.heal_address`` as this process advertises it: the IPv4 address of the network
    interface of that name (e.g. ``"ib0"``, ``"eth1"``: ``socket.if_nameindex()``, then the
    SIOCGIFADDR ioctl), else ``value`` as given (an address or a host name); None for None or
    "". Each rank resolves its own (an interface name names each node's own address). Called
    by every rank before any process group exists.

    Raises:
        ValueError: an interface of that name has no IPv4 address, or this host cannot bind
            the address (it is another host's)."""
    if not value:
        return None
    value = value.strip()
    if value in {name for _, name in socket.if_nameindex()}:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", value[:15].encode()))  # SIOCGIFADDR
            except OSError as exc:
                raise ValueError(f"FLConfig.heal_address={value!r} names a network interface without an IPv4 "
                                 f"address ({exc}); give the address itself") from None
        value = socket.inet_ntoa(packed[20:24])
    try:  # the checkpoint server binds it (HealTransport): refuse an address of another host now
        family = socket.AF_INET6 if ":" in value else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((value, 0))
    except OSError as exc:
        raise ValueError(f"FLConfig.heal_address={value!r}: this host cannot serve heals on it ({exc}); give an "
                         f"address, host name or network interface of this host") from None
    return value


def _wait_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Return once ``host:port`` accepts a TCP connection; ConnectionError after ``timeout_s``."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    deadline, last = time.monotonic() + timeout_s, None
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise ConnectionError(f"the managed process group's store {address} did not accept a connection within "
                                  f"{timeout_s:g} s (its host died?): {last}")
        time.sleep(0.2)


def _managed_pg(base, api: str, advertise: str | None):
    """A subclass of torchft's ``ProcessGroupGloo``/``ProcessGroupNCCL`` (``base``) whose
    (re)configuration (0.2: ``configure``; 0.3: ``reconfigure``) first checks that the store it
    was given accepts connections (:func:`_wait_reachable`: ConnectionError within
    :data:`CONNECT_TIMEOUT_S`, which torchft reports as the round's error, so the round fails
    and the next quorum leaves a dead group out) and, with torchft 0.3, whose reconfigure handle
    advertises ``advertise`` for its rendezvous store instead of ``socket.gethostname()``."""
    method = compat.pg_reconfigure_method(api)

    def reconfigure(self, *args, **kwargs):
        _wait_reachable(compat.pg_store_address(api, args, kwargs))
        return getattr(base, method)(self, *args, **kwargs)

    members = {method: reconfigure}
    if api == "0.3" and advertise:
        members["get_reconfigure_handle"] = lambda self: compat.advertised_handle(
            base.get_reconfigure_handle(self), advertise)
    return type(f"FL{base.__name__}", (base,), members)


class _WritableReader:
    """A binary reader over ``raw`` (an HTTP response) whose ``read`` returns writable
    ``bytearray``s, and that counts the bytes read (``nbytes``). torch's streaming loader
    (``torch.distributed._serialization``) builds each tensor's storage with ``torch.frombuffer``
    over what ``read`` returned: over ``bytes`` (immutable) torch warns "The given buffer is not
    writable" once per tensor. ``readline`` serves the unpickler of its record table."""

    def __init__(self, raw):
        self._raw, self.nbytes = raw, 0

    def readinto(self, buffer) -> int:
        n = self._raw.readinto(buffer) or 0
        self.nbytes += n
        return n

    def read(self, size: int = -1) -> bytearray:
        if size is None or size < 0:
            out = bytearray(self._raw.read())
            self.nbytes += len(out)
            return out
        out = bytearray(size)
        view, got = memoryview(out), 0
        while got < size:
            n = self.readinto(view[got:])
            if not n:
                break
            got += n
        del view
        return out if got == size else out[:got]

    def readline(self, size: int = -1) -> bytes:
        line = self._raw.readline(size)
        self.nbytes += len(line)
        return line


def _checkpoint_transport_class():
    """torchft's ``HTTPTransport`` (imported when first needed: torchft is optional)."""
    from torchft.checkpointing import HTTPTransport

    return HTTPTransport


class HealTransport:
    """torchft's ``HTTPTransport`` (the heal's checkpoint server and download, ``num_chunks=0``)
    with two changes: it advertises ``advertise`` instead of ``socket.gethostname()`` and its
    server binds that address only (torchft binds every interface), and the download reads into
    writable buffers (no "buffer is not writable" warning per tensor: :class:`_WritableReader`)
    and records the bytes it received (``received_bytes``, the wire size of the last heal).
    Made by :meth:`__new__` as an instance of a subclass of the installed torchft's class."""

    def __new__(cls, timeout: timedelta, advertise: str | None = None):
        base = _checkpoint_transport_class()

        class FLHTTPTransport(base):
            received_bytes = 0

            def address(self) -> str:
                if not advertise:
                    return base.address(self)
                host = f"[{advertise}]" if ":" in advertise else advertise
                return f"http://{host}:{compat.checkpoint_server_port(self)}/checkpoint/"

            def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
                with urllib.request.urlopen(f"{metadata}{step}/full", timeout=timeout.total_seconds()) as raw:
                    reader = _WritableReader(raw)
                    state = compat.streaming_load(reader)
                self.received_bytes = reader.nbytes
                return state

        transport = FLHTTPTransport(timeout=timeout, num_chunks=0)
        if advertise:  # checked bindable by resolve_address
            compat.rebind_checkpoint_server(transport, advertise)
        return transport


def state_nbytes(state) -> int:
    """Bytes of the tensors in a nested state (dicts, lists, tuples), as :func:`capture` builds
    it: the payload of a heal. Other values count 0."""
    if torch.is_tensor(state):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_nbytes(v) for v in state)
    return 0


def capture(sync, schedulers: list, extra: dict | None = None) -> dict:
    """What a group healing from this live one takes over (the Manager's ``state_dict``, on its
    quorum thread): cloned ``params``, ``optimizer`` (state, hyperparameters), ``outer`` (anchor,
    momentum), ``schedule``, ``round`` (the trigger's round state, or None), ``schedulers``,
    ``extra``; not the residuals or data position."""
    opt = sync.optimizer
    state = {}
    for i, p in enumerate(sync.params):
        st = opt.state.get(p)
        if st:
            state[i] = {k: (local(v).detach().clone(), hasattr(v, "to_local")) if torch.is_tensor(v) else v
                        for k, v in st.items()}
    shared, _ = sync.outer.tensors()
    return {"params": [local(p).detach().clone() for p in sync.params],
            "optimizer": {"state": state, "groups": [{k: v for k, v in g.items() if k != "params"}
                                                     for g in opt.param_groups]},
            "outer": {i: {k: v.detach().clone() for k, v in d.items()} for i, d in shared.items()},
            "schedule": sync.schedule.state_dict(),
            "round": sync.rounds.state_dict() if sync.rounds is not None else None,
            "schedulers": [s.state_dict() for s in schedulers],
            "extra": dict(extra or {})}


@torch.no_grad()
def restore(sync, schedulers: list, state: dict) -> None:
    """Inverse of :func:`capture` (residuals zeroed, nothing in flight); the caller reshards
    first and applies ``extra``. ValueError: parameter count or shard shapes differ."""
    params = sync.params
    if len(state["params"]) != len(params) or any(
            tuple(v.shape) != tuple(local(p).shape) for v, p in zip(state["params"], params)):
        raise ValueError("torchft heal: the live group's parameters do not match this group's model (count or "
                         "shard shapes differ); every federation group must run the same model and group size")
    for p, v in zip(params, state["params"]):
        local(p).copy_(v)
    opt = sync.optimizer
    for i, p in enumerate(params):
        saved = state["optimizer"]["state"].get(i)
        if saved is None:
            opt.state.pop(p, None)
            continue
        current = opt.state.setdefault(p, {})
        for k, v in saved.items():
            if not isinstance(v, tuple):
                current[k] = v
                continue
            value, distributed = v
            if torch.is_tensor(current.get(k)) and local(current[k]).shape == value.shape:
                local(current[k]).copy_(value)
            elif distributed:
                current[k] = DTensor.from_local(value.to(local(p).device), p.device_mesh, p.placements,
                                                shape=p.shape, stride=p.stride())
            else:
                current[k] = value.clone()
    for group, saved in zip(opt.param_groups, state["optimizer"]["groups"]):
        group.update(saved)
    residuals = {i: {"residual": r} for i, r in enumerate(sync.outer.residuals or ())}
    sync.outer.load(state["outer"], residuals)
    sync.outer.zero_residuals()
    sync.schedule.load_state_dict(state["schedule"])
    if sync.rounds is not None and state.get("round") is not None:  # sync_trigger "time"/"speed"
        sync.rounds.take_over(state["round"])
    for fragment in sync.fragments:
        fragment.pending = None
    for scheduler, saved in zip(schedulers, state["schedulers"]):
        scheduler.load_state_dict(saved)
