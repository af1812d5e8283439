"""Where torchft's servers are reached: FLConfig.heal_address, each attempt's store, a dead peer's store given up on.

torchft advertises ``socket.gethostname()`` for its ManagerServer, its checkpoint server and
(0.3) the managed group's rendezvous store (torchft #329: an 8B heal over the slow Ethernet
took 948 s); ``FLConfig.heal_address`` advertises a chosen address or interface instead
(:func:`resolve_address`; :func:`managed_pg` for the rendezvous store,
:class:`fl_accel.heal.HealTransport` for the checkpoint server). A (re)configuration whose
store is gone (the heal source died) fails within :data:`CONNECT_TIMEOUT_S` instead of
torchft's store timeout. :mod:`fl_accel.ft` wires them in.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from . import compat

CONNECT_TIMEOUT_S = 30.0
"""Seconds to reach a peer's server before giving up: a managed process group's
(re)configuration trying the store it is given (:func:`managed_pg`), and torchft's RPC
connections (the Manager's ``connect_timeout``: a healing group asks its source's ManagerServer
for the checkpoint's address first). A heal source that died takes both with it, and torchft
would retry for the whole collective timeout (300 s by default) before the round fails. A live
server answers a TCP connect within milliseconds on any network; a Lighthouse that is not up
yet must be within this."""


def attempt_store(group_rank: int, group, timeout: timedelta, advertise: str | None = None):
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


def wait_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
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


def managed_pg(base, api: str, advertise: str | None):
    """A subclass of torchft's ``ProcessGroupGloo``/``ProcessGroupNCCL`` (``base``) whose
    (re)configuration (0.2: ``configure``; 0.3: ``reconfigure``) first checks that the store it
    was given accepts connections (:func:`wait_reachable`: ConnectionError within
    :data:`CONNECT_TIMEOUT_S`, which torchft reports as the round's error, so the round fails
    and the next quorum leaves a dead group out) and, with torchft 0.3, whose reconfigure handle
    advertises ``advertise`` for its rendezvous store instead of ``socket.gethostname()``."""
    method = compat.pg_reconfigure_method(api)

    def reconfigure(self, *args, **kwargs):
        wait_reachable(compat.pg_store_address(api, args, kwargs))
        return getattr(base, method)(self, *args, **kwargs)

    members = {method: reconfigure}
    if api == "0.3" and advertise:
        members["get_reconfigure_handle"] = lambda self: compat.advertised_handle(
            base.get_reconfigure_handle(self), advertise)
    return type(f"FL{base.__name__}", (base,), members)


def lighthouse_addr(config) -> str:
    """``FLConfig.lighthouse_addr`` or ``TORCHFT_LIGHTHOUSE``. ImportError without the tested
    torchft (:func:`fl_accel.compat.check_torchft_version`); ValueError when neither is set or
    torchft cannot be imported. Every rank, before any collective."""
    compat.check_torchft_version()
    addr = config.lighthouse_addr or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not addr:
        raise ValueError("fault_tolerance='torchft' needs the Lighthouse's address: set FLConfig.lighthouse_addr "
                         "(FL_ACCEL_LIGHTHOUSE_ADDR, --lighthouse_addr) or TORCHFT_LIGHTHOUSE, e.g. "
                         "http://127.0.0.1:29510 (scripts/ft_launch.py starts one)")
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"fault_tolerance='torchft' needs torchft: pip install torchft==0.2.0 (or the 0.3 API: "
                         f"torchft-nightly) ({exc})") from exc
    return addr
