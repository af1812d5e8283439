"""Federation groups that fail alone: the "fl" exchange over torchft's managed process group.

With ``fault_tolerance="torchft"`` each group is its own launch (a world of its G ranks,
FSDP2 inside). torchft (``torchft/manager.py``, ``process_group.py``) provides membership,
quorum, the reconfigurable process group and recovery; the exchange, outer step and schedule
stay ours. Two torchft APIs, chosen by the installed build (:func:`fl_accel.compat.torchft_api`):
0.2 (torchft 0.2.0: the managed group is rebuilt with ``ProcessGroup.configure`` on the quorum's
store) and 0.3 (torchft-nightly 2026.10.26: ``pg.reconfigure(ReconfigureOptions)`` with handles
exchanged through the Lighthouse). Relied on (both):

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
across ``--max-restarts`` attempts, so each attempt gets its own
(:func:`fl_accel.ft_net.attempt_store`); a failed collective aborts the managed group
(:func:`_report`). What a heal carries and records is :mod:`fl_accel.heal`'s, where torchft's
servers are reached (``FLConfig.heal_address``, a dead peer's store) :mod:`fl_accel.ft_net`'s,
and the ends of a run (every group at the first sync and at the end, a restart without its
state) :mod:`fl_accel.ft_ends`'s.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from . import comm, compat, ft_ends, ft_net
from .exchange import EventHooks, Membership
from .fsdp_model import reshard, shard_checksum
from .heal import AgreedClient, HealTransport, capture, measure_heal, restore, state_nbytes, weights_without_healed
from .mesh import merge_weights
from .mesh_transport import MeshTransport

AllgatherOptions, AllreduceOptions, AllToAllOptions = compat.collective_options()

logger = logging.getLogger(__name__)


def _report(manager, exc: Exception, pg=None) -> None:
    """A collective across the groups failed: the round will not commit, and ``pg`` (the managed
    group) is aborted, so a peer group blocked on this one fails at once, not after the collective
    timeout (gloo does not tell it). The failed vote gives the next quorum a new id: a new group."""
    logger.warning("fl_accel sync: a collective across federation groups failed (%s: %s); this round will not "
                   "commit", type(exc).__name__, exc)
    manager.report_error(exc)
    if pg is not None:
        try:
            pg.abort()
        except Exception as abort_exc:  # already aborted, or never set up
            logger.debug("aborting the managed process group: %s", abort_exc)


class CommitHooks(EventHooks):
    """:class:`~fl_accel.exchange.EventHooks` of :class:`ManagedTransport` (the synchronizer's
    membership plug-in for torchft): each step with sync actions opens the event's quorum first
    (a heal there replaces this group's state and counters, and the heal's record gets the
    step this group continues from); an event's writes wait for the commit, and are dropped
    without it (groups keep their values)."""

    def __init__(self, transport: "ManagedTransport"):
        self.transport, self.deferred = transport, None

    def open(self, schedule) -> bool:
        self.transport.begin()  # the quorum of this event; a heal replaces the counters
        if self.transport.healed and self.transport.heal_sources:
            self.transport.heal_sources[-1]["step"] = schedule.global_step
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

    :meth:`begin` opens a membership (a quorum; it stays open so a delayed exchange keeps its
    group) and :meth:`should_commit` closes it. F is the number of live groups, weights 1/F
    (0 for groups healing in the quorum, 1/(F - H) for the others: :func:`fl_accel.mesh.merge_weights`).
    Chunks and device are ``inside``'s (replica r exchanges chunk r). ``healed``: the last
    quorum healed this group; ``heals``: how often; ``heal_sources``: one record per heal
    (:func:`fl_accel.heal.measure_heal` completes it, :class:`CommitHooks` adds its ``step``);
    ``seconds``: host seconds in quorums (heals included) and commit votes, and the number of quorums;
    ``end_state``: :meth:`finish`'s answer, once it ran."""

    manager: object
    pg: object
    inside: MeshTransport
    meter: object = None  # the accelerator's CommMeter ("fl" traffic is counted while it is entered)
    init_checksum: torch.Tensor | None = None  # fsdp_model.shard_checksum of the initial shards (the start-up check)
    group_index: int = 0  # this launch's federation group (FLConfig.group_index): its row in the round's table
    num_groups: int = 1  # the federation's configured groups F (FLConfig.num_groups): whom the ends wait for
    rejoin_timeout_s: float = 300.0  # FLConfig.rejoin_timeout_s: the waits of fl_accel.ft_ends are at most this
    elastic = True  # membership is decided at every sync event, which runs even with one live group
    num_chunks = property(lambda self: self.inside.num_chunks)
    chunk_index = property(lambda self: self.inside.chunk_index)
    device = property(lambda self: self.inside.device)

    def __post_init__(self):
        self.round: Membership | None = None
        self.healed, self.heals = False, 0
        self.heal_sources: list[dict] = []
        self.behind = 0  # groups of the last quorum behind its max step (they heal in it)
        self.max_step = 0  # the last quorum's max committed step
        self.seconds = {"quorum": 0.0, "commit": 0.0, "quorums": 0}
        self._heal_agreed = False  # the last quorum told this group to heal (rank 0's word: equal on its ranks)
        self._heal_started = 0.0  # perf_counter when that quorum returned (the download follows)
        self._heal_loaded: tuple[int, float] | None = None  # this rank's (bytes, seconds) once the state is applied
        self.end_state: dict | None = None
        self.lost_step: int | None = None  # require_heal(): the step this group's lost session had reached
        self.checkpoint = None  # the HealTransport the Manager sends and receives states with

    @classmethod
    def create(cls, *, group_index: int, group_rank: int, group_size: int, lighthouse_addr: str,
               timeout: timedelta, inside: MeshTransport, save: Callable[[], dict], load: Callable[[dict], None],
               init_checksum: torch.Tensor | None = None, num_groups: int = 1, heal_address: str | None = None,
               rejoin_timeout_s: float = 300.0) -> "ManagedTransport":
        """This rank's Manager (replica id ``fl_accel_group_<f>``, synchronous quorum,
        ``init_sync=False``: groups start identical) and managed ``ProcessGroupGloo`` /
        ``ProcessGroupNCCL`` of the installed torchft API (:func:`fl_accel.ft_net.managed_pg`),
        waits bounded by ``timeout``; ``save``/``load``: the recovery callbacks (:func:`capture`,
        :func:`restore`); ``heal_address``: what this rank advertises (and its checkpoint server
        binds) instead of ``socket.gethostname()`` (:func:`fl_accel.ft_net.resolve_address`'s
        result; None: torchft's default). Collective over the group's world. ImportError without
        torchft (or with a release of neither API)."""
        api = compat.check_torchft_version()
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        base = ProcessGroupNCCL if inside.device.type == "cuda" else ProcessGroupGloo
        pg = ft_net.managed_pg(base, api, heal_address)(timeout=timeout)
        transport = cls(manager=None, pg=pg, inside=inside, init_checksum=init_checksum, group_index=group_index,
                        num_groups=num_groups, rejoin_timeout_s=rejoin_timeout_s)

        def on_heal(state):  # torchft calls it with the state it received (downloaded and unpickled)
            received = time.perf_counter()
            transport.healed, transport.heals = True, transport.heals + 1
            load(state)
            done = time.perf_counter()
            transport._heal_loaded = (state_nbytes(state), done - transport._heal_started,
                                      received - transport._heal_started, done - received)

        agree = dist.new_group(backend="gloo", timeout=timeout)  # the #343 guard's side channel (CPU objects)
        store_addr, store_port, transport._store = ft_net.attempt_store(group_rank, agree, timeout, heal_address)
        transport.checkpoint = HealTransport(timeout, heal_address)
        advertised = {"hostname": heal_address} if heal_address else {}  # torchft's default: socket.gethostname()
        connect_s = ft_net.CONNECT_TIMEOUT_S  # a dead heal source's ManagerServer: given up on (fl_accel.ft_net)
        transport.manager = Manager(
            pg=pg, load_state_dict=on_heal, state_dict=save, min_replica_size=1, use_async_quorum=False,
            timeout=timeout, quorum_timeout=timeout, connect_timeout=min(timeout, timedelta(seconds=connect_s)),
            rank=group_rank, world_size=group_size, lighthouse_addr=lighthouse_addr, store_addr=store_addr,
            store_port=store_port, replica_id=f"fl_accel_group_{group_index}", init_sync=False,
            checkpoint_transport=transport.checkpoint, **advertised)
        compat.wrap_manager_client(transport.manager, lambda client: AgreedClient(client, agree, transport))
        return transport

    def begin(self) -> Membership:
        """The open round, or a new quorum's (blocking; it may heal this group). After
        :meth:`require_heal` the quorum is asked again until this group healed (StateLostError
        after ``rejoin_timeout_s``: :func:`fl_accel.ft_ends.heal_lost_state`); a fresh
        federation's first quorum waits for every group (:func:`fl_accel.ft_ends.wait_at_start`)."""
        if self.round is None:
            self.ask_quorum()
            ft_ends.heal_lost_state(self)
            ft_ends.wait_at_start(self)
            num, position = self.manager.num_participants(), self.manager.participating_rank()
            if position is None or num < 1:
                raise RuntimeError(f"torchft quorum left this federation group out (participating rank {position} "
                                   f"of {num})")
            self.round = Membership(num, position, merge_weights("uniform", None, (1,) * num))
            if num > 1 and self.max_step == 0 and self.init_checksum is not None:  # no commit yet: the start-up check
                ft_ends.check_identical_start(self, num, position)
            if num > 1 and self.behind:  # groups healed in this quorum: they hold a source's values
                self.round = Membership(num, position, weights_without_healed(self, num, position))
            if num > 1 or self.healed:
                logger.info("sync quorum: %d live federation group(s), this group at position %d%s", num, position,
                            " (healed from a live group)" if self.healed else "")
        return self.round

    def ask_quorum(self) -> None:
        """torchft's quorum (blocking; a heal of this group is applied in it), timed."""
        self.healed, t0 = False, time.perf_counter()
        self.manager.start_quorum()
        self.seconds["quorum"] += time.perf_counter() - t0
        self.seconds["quorums"] += 1
        if self._heal_agreed:
            measure_heal(self)

    def require_heal(self, lost_step: int) -> None:
        """This group restarted without its state: its earlier session had reached optimizer step
        ``lost_step`` and left no checkpoint. Its first quorum must heal it from a group that
        holds a committed state (:func:`fl_accel.ft_ends.heal_lost_state`, in :meth:`begin`).
        Every rank of the group, before its first sync."""
        self.lost_step = int(lost_step)

    def finish(self, checksum, poll_s: float = 1.0) -> dict:
        """:func:`fl_accel.ft_ends.finish` (wait for every configured group at the end), once:
        the first answer is kept in :attr:`end_state`. Collective."""
        if self.end_state is None:
            self.end_state = ft_ends.finish(self, checksum, poll_s)
        return self.end_state

    def hooks(self) -> CommitHooks:
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

    def control_all_reduce(self, tensor) -> None:
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

    def bad_groups(self, local_bad, membership):
        """A MAX over the group's world, then a SUM over the live groups; empty if the round failed."""
        flag = torch.tensor([float(local_bad)], dtype=torch.float32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        flags = torch.zeros(membership.num_groups, dtype=torch.float32, device=self.device)
        flags[membership.position] = flag[0]
        self.all_reduce(flags)
        if self.manager.errored() is not None:
            return []
        return [g for g in range(membership.num_groups) if flags[g] > 0]

    def group_max(self, value):
        """A MAX over the group's own world (one launch)."""
        out = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return float(out.item())

    def group_table(self, vector, membership):
        """A MAX over the group's world, then a SUM over the live groups. If that SUM failed
        (a peer group died: the round will not commit) only this group's row is filled in
        (the others' last field, the group index, is -1), so that the round state records
        what this group knows; the next quorum heals it from a live group if it fell behind."""
        mine = torch.tensor(vector, dtype=torch.float64, device=self.device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        table = torch.zeros(membership.num_groups, len(vector), dtype=torch.float64, device=self.device)
        table[membership.position] = mine
        self.all_reduce(table)
        if self.manager.errored() is not None:
            unknown = [0.0] * (len(vector) - 1) + [-1.0]  # trigger.FIELDS: a negative "group" is a row not filled in
            return [mine.tolist() if p == membership.position else unknown for p in range(membership.num_groups)]
        return table.tolist()

    def state_dict(self) -> dict:
        """The Manager's committed step, for this group's checkpoints."""
        return {"manager": self.manager.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.manager.load_state_dict(state["manager"])

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def managed_transport(acc, inside: MeshTransport, params: list) -> ManagedTransport:
    """The torchft transport of FLAccelerator ``acc`` (its group, its Lighthouse, ``inside``:
    the group's own mesh transport); a heal carries the synchronizer's, the schedulers' and
    Accelerate's step state (:func:`capture`, :func:`restore`). Collective over the group's world."""
    def save():
        return capture(acc.synchronizer, compat.prepared(acc, "schedulers"),
                       {"accelerate_step": compat.accumulation_counter(acc)})

    def load(state):
        reshard(compat.prepared(acc, "models"))
        restore(acc.synchronizer, compat.prepared(acc, "schedulers"), state)
        compat.set_accumulation_counter(acc, state["extra"].get("accelerate_step", compat.accumulation_counter(acc)))

    transport = ManagedTransport.create(
        group_index=acc.group_index, group_rank=acc.process_index, group_size=acc.num_processes,
        lighthouse_addr=ft_net.lighthouse_addr(acc.fl_config), inside=inside, save=save, load=load,
        timeout=timedelta(seconds=acc.fl_config.collective_timeout_s),
        init_checksum=None if any(p.is_meta for p in params) else shard_checksum(params, inside.device),
        num_groups=acc.layout.num_groups, heal_address=acc._heal_address,
        rejoin_timeout_s=acc.fl_config.rejoin_timeout_s)
    transport.meter = acc._comm_meter  # the exchange's traffic in the "fl" bucket
    return transport

