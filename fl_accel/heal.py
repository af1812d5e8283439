"""torchft heals: one source per group, the state taken over, how it travels, and the record of what it cost.

A group behind the quorum's committed step downloads a live group's state (:func:`capture`
there) and applies it (:func:`restore`). torchft (#343, ``src/manager.rs``) heals recovering
rank k of group i from group ``(i + k) mod U``: :class:`AgreedClient` makes every rank of a
group use rank 0's source and records the heal; :func:`measure_heal` completes the record
(bytes, seconds: torchft reports neither). The state travels over :class:`HealTransport`
(torchft's HTTP transport on ``FLConfig.heal_address``, into writable buffers). :mod:`fl_accel.ft`
wires them in.
"""

from __future__ import annotations

import time
import urllib.request
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import compat
from .fsdp import local
from .mesh import merge_weights


class _Agreed:  # a torchft QuorumResult with the recovery fields of the group's rank 0
    def __init__(self, quorum, agreed: dict):
        self._result, self._agreed = quorum, agreed

    def __getattr__(self, name):
        return self._agreed[name] if name in self._agreed else getattr(self._result, name)


RECOVERY_FIELDS = ("heal", "recover_src_replica_rank", "recover_src_manager_address", "recover_dst_replica_ranks")


class AgreedClient:
    """A Manager's ``ManagerClient`` whose quorums (on torchft's quorum thread) carry rank 0's
    :data:`RECOVERY_FIELDS` (broadcast over ``group``, gloo) and record each heal in
    ``transport.heal_sources`` (a :class:`fl_accel.ft.ManagedTransport`'s: quorum id, the
    source used, the one torchft assigned)."""

    def __init__(self, client, group, transport):
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


def measure_heal(transport) -> None:
    """Complete the newest ``heal_sources`` record of ``transport`` (a
    :class:`fl_accel.ft.ManagedTransport`) after a quorum that healed this group:
    ``source_group`` (from the source's replica id ``fl_accel_group_<f>``, after the #343
    guard: exact), ``bytes`` (the tensors' ``nbytes`` each rank applied, :func:`state_nbytes`,
    summed; the HTTP transfer is that plus pickling; ``wire_bytes``: what the ranks downloaded,
    :class:`HealTransport`) and ``seconds`` from the quorum's answer to
    the applied state, split into ``transfer_seconds`` (torchft's download and unpickling on its
    quorum thread) and ``load_seconds`` (reshard, parameters, optimizer and sync state), each
    the slowest rank's. A rank whose download failed counts 0 bytes (the commit then fails).
    Collective over the group's world (one SUM, one MAX; every rank runs it, the heal decision
    is rank 0's)."""
    mine = transport._heal_loaded or (0, 0.0, 0.0, 0.0)
    transport._heal_loaded, transport._heal_agreed = None, False
    wire = transport.checkpoint.received_bytes if mine[0] and transport.checkpoint is not None else 0
    nbytes = torch.tensor([float(mine[0]), float(wire)], dtype=torch.float64, device=transport.device)
    seconds = torch.tensor(list(mine[1:]), dtype=torch.float64, device=transport.device)
    dist.all_reduce(nbytes, op=dist.ReduceOp.SUM)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if transport.heal_sources:
        record = transport.heal_sources[-1]
        name = str(record.get("source"))
        total, transfer, load = seconds.tolist()
        record.update(source_group=int(name.rsplit("_", 1)[1]) if name.startswith("fl_accel_group_") else None,
                      bytes=int(nbytes[0].item()), wire_bytes=int(nbytes[1].item()), seconds=total,
                      transfer_seconds=transfer, load_seconds=load)


def weights_without_healed(transport, num: int, position: int) -> tuple[float, ...]:
    """The weights of a quorum (``num`` groups, this one at ``position``) in which groups healed:
    :func:`fl_accel.mesh.merge_weights` with the H groups that healed as copies (of their
    source, which would weigh twice): 0 for them, 1/(F - H) for the others; every group runs
    the flags' SUM (``transport.control_all_reduce``). A heal that failed (its source died, its
    download broke) fails the round in every group of the quorum: each reports an error, so
    none launches the exchange (one that did would wait the collective timeout) or commits."""
    flags = torch.zeros(2, num, dtype=torch.float32, device=transport.device)
    flags[0, position] = float(transport.healed)
    flags[1, position] = float(transport.manager.errored() is not None)
    transport.control_all_reduce(flags)
    if transport.manager.errored() is None and flags[1].any():
        failed = [g for g in range(num) if flags[1, g].item()]
        transport.manager.report_error(RuntimeError(f"a heal in this quorum failed (quorum positions {failed}): "
                                                    f"the round is dropped in every group"))
    healed = [g for g in range(num) if flags[0, g].item() != 0] if transport.manager.errored() is None else []
    return merge_weights("uniform", None, (1,) * num, copies=healed)


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
    quorum thread): cloned ``params``, ``optimizer`` (state, hyperparameters), the
    synchronizer's ``outer`` (anchor, momentum) and ``sync`` (counters, the trigger's round
    state: :meth:`fl_accel.sync.Synchronizer.heal_state`), ``schedulers``, ``extra``; not the
    residuals or data position."""
    opt = sync.optimizer
    state = {}
    for i, p in enumerate(sync.params):
        st = opt.state.get(p)
        if st:
            state[i] = {k: (local(v).detach().clone(), hasattr(v, "to_local")) if torch.is_tensor(v) else v
                        for k, v in st.items()}
    return {"params": [local(p).detach().clone() for p in sync.params],
            "optimizer": {"state": state, "groups": [{k: v for k, v in g.items() if k != "params"}
                                                     for g in opt.param_groups]},
            **sync.heal_state(),
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
    sync.take_over(state)
    for scheduler, saved in zip(schedulers, state["schedulers"]):
        scheduler.load_state_dict(saved)
