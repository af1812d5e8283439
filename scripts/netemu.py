"""Multi-tier network emulator on one Linux machine: nodes as network namespaces, shaped links.

Two tiers, as on a GPU cluster:

* intra-node: the ranks of one emulated node share a network namespace and reach each
  other through its own address, i.e. over loopback (unshaped, the fast path);
* inter-node: every node namespace has one veth "NIC" (``fln<id>n<k>``) with address
  ``<subnet>.<k+1>``, plugged into a bridge in a hub namespace. Both directions of each
  node's link are shaped with ``tc`` (tbf, or htb) to ``rate``: the node-side veth's
  egress (node -> hub) and the hub-side veth's egress (hub -> node). A node therefore
  has ``rate`` bits/s up and ``rate`` down (full duplex), like one NIC per node.
  netem (delay, loss) is not used: it is not available in every kernel.

Only addresses of the private subnet (default 10.213.0.0/24) that these namespaces
create are used; nothing is added to the root namespace. Names carry a unique
prefix (namespaces ``flnetemu-<id>-n<k>`` / ``flnetemu-<id>-hub``), so ``down`` finds
leftovers; deleting a namespace deletes its veth ends and their peers.

Distributed runs use the standard multi-node launch: one ``torchrun --nnodes K
--node_rank k --master_addr <node 0 address> --master_port P`` per namespace, with
``GLOO_SOCKET_IFNAME`` set to that node's veth so gloo binds to it.

CLI (root or CAP_NET_ADMIN + CAP_SYS_ADMIN required)::

    python scripts/netemu.py run --nodes 2 --nproc-per-node 2 --rate 100mbit -- train.py --lr 1e-3
    python scripts/netemu.py measure --rate 100mbit [--seconds 3]
    python scripts/netemu.py down [--id ID]

Everything after ``--`` goes to torchrun verbatim (torchrun options, then the script
and its arguments). ``run`` returns the worst exit code of the per-node torchruns.
Teardown runs on normal exit, on exceptions, and on SIGINT/SIGTERM.

Also runs as ``python -m scripts.netemu ...`` from the repository root. Processes are
started and ended with :mod:`scripts.launch` (own session; SIGTERM, then SIGKILL, to
the whole process group).

Importable (``from scripts.netemu import Emulator``)::

    with Emulator(nodes=2, rate="100mbit") as emu:
        print(emu.measure(seconds=2.5))
        rc = emu.run_torchrun(["script.py"], nproc_per_node=2)
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Mapping, Sequence

from scripts import launch
from scripts.launch import terminate

from recipes.run_lock import process_alive

NS_PREFIX = "flnetemu-"
IF_PREFIX = "fln"
_IF_RE = re.compile(r"^fln[0-9a-f]{5}(n\d+|h\d+|br)$")
NEED_PRIVILEGES = "needs root/CAP_NET_ADMIN to create network namespaces"
CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21

_RATE_UNITS = {  # tc's units: *bit are bits/s, *bps are BYTES/s
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
}


class NetEmuError(RuntimeError):
    """A setup step failed (the message names the command and its stderr)."""


# ---------------------------------------------------------------------- helpers
def parse_rate(rate: str | int | float) -> int:
    """Rate in bits per second from a tc-style string ("100mbit", "1gbit", "12.5mbps") or a number.

    Units follow tc: ``bit/kbit/mbit/gbit/tbit`` are bits/s (SI), ``bps/kbps/mbps/...``
    are bytes/s. A bare number is bits/s.

    Raises:
        ValueError: naming ``rate`` when it is unparsable or not positive.
    """
    if isinstance(rate, bool):
        raise ValueError(f"rate must be a positive rate such as '100mbit', got {rate!r}")
    if isinstance(rate, (int, float)):
        bits = float(rate)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(rate))
        if not m or (m.group(2) and m.group(2).lower() not in _RATE_UNITS):
            raise ValueError(f"rate must look like '100mbit', '1gbit' or '12.5mbps' (tc units), got {rate!r}")
        bits = float(m.group(1)) * _RATE_UNITS.get(m.group(2).lower() or "bit")
    if not bits > 0 or bits != bits or bits == float("inf"):
        raise ValueError(f"rate must be positive, got {rate!r}")
    return int(round(bits))


def check_privileges() -> tuple[bool, str]:
    """``(ok, reason)``: whether this process may create namespaces, links and qdiscs.

    Needs CAP_NET_ADMIN (links, tc) and CAP_SYS_ADMIN (``ip netns add`` bind-mounts),
    both held by root, and the ``ip`` and ``tc`` programs (iproute2).
    """
    caps = 0
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    caps = int(line.split()[1], 16)
    except OSError:
        caps = (1 << 64) - 1 if os.geteuid() == 0 else 0
    missing = [name for name, bit in (("CAP_NET_ADMIN", CAP_NET_ADMIN), ("CAP_SYS_ADMIN", CAP_SYS_ADMIN))
               if not caps >> bit & 1]
    if missing:
        return False, f"netemu {NEED_PRIVILEGES} (euid {os.geteuid()}, missing {', '.join(missing)})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"netemu needs the '{tool}' program (iproute2), not found on PATH"
    return True, ""


def require_privileges() -> None:
    """Raise :class:`PermissionError` with a clear message unless :func:`check_privileges` passes."""
    ok, reason = check_privileges()
    if not ok:
        raise PermissionError(reason)


def _run(argv: Sequence[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise NetEmuError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def list_namespaces() -> list[str]:
    """Names of all network namespaces (``ip netns list``)."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def leftovers() -> dict[str, list[str]]:
    """Namespaces (``flnetemu-*``) and root-namespace links (``fln<id>...``) of any emulator."""
    links = []
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    for line in out.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if _IF_RE.match(name):
                links.append(name)
    return {"namespaces": [n for n in list_namespaces() if n.startswith(NS_PREFIX)], "links": links}


def _kill_namespace_processes(ns: str, grace: float = 3.0) -> None:
    pids = [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split() if p.isdigit()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(process_alive(p) for p in alive):
            time.sleep(0.05)
        pids = [p for p in alive if process_alive(p)]


def down_all(emulator_id: str | None = None) -> dict[str, list[str]]:
    """Remove emulator leftovers (processes in them, namespaces, stray links); returns what was found.

    Args:
        emulator_id: only the emulator with this id (``Emulator.id``, the 5 hex digits
            in its names); None removes every emulator's, also one that is still
            running in another process.
    """
    require_privileges()
    found = leftovers()
    if emulator_id is not None:
        found = {"namespaces": [n for n in found["namespaces"] if n.startswith(f"{NS_PREFIX}{emulator_id}-")],
                 "links": [n for n in found["links"] if n.startswith(f"{IF_PREFIX}{emulator_id}")]}
    for ns in found["namespaces"]:
        _kill_namespace_processes(ns)
        _run(["ip", "netns", "del", ns], check=False)
    for link in found["links"]:
        _run(["ip", "link", "del", link], check=False)
    return found


# ---------------------------------------------------------------------- the emulator
_RECEIVER = r"""
import json, socket, sys, time
addr, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((addr, port)); srv.listen(1); srv.settimeout(timeout)
print("READY", flush=True)
conn, _ = srv.accept(); conn.settimeout(timeout)
buf = bytearray(1 << 20); total = 0; first = last = None; first_len = 0
while True:
    k = conn.recv_into(buf)
    if not k:
        break
    now = time.perf_counter()
    if first is None:
        first, first_len = now, k
    total += k; last = now
conn.close(); srv.close()
# The clock starts when the first chunk arrives, so that chunk's bytes are not counted.
print(json.dumps({"bytes": total - first_len, "seconds": (last - first) if first is not None else 0.0,
                  "total_bytes": total}), flush=True)
"""

_SENDER = r"""
import socket, sys, time
addr, port, seconds, max_bytes = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
deadline = time.monotonic() + 10
while True:
    try:
        s = socket.create_connection((addr, port), timeout=10); break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
chunk = b"\0" * (1 << 16); sent = 0; end = time.monotonic() + seconds
while time.monotonic() < end and (max_bytes <= 0 or sent < max_bytes):
    s.sendall(chunk); sent += len(chunk)
s.shutdown(socket.SHUT_WR)
s.recv(1)
s.close()
"""


class Emulator:
    """K emulated nodes (network namespaces) joined by shaped veth links to a hub bridge.

    Args:
        nodes: K >= 1 emulated nodes.
        rate: per-node link rate per direction, tc style ("100mbit") or bits/s; None for
            unshaped links.
        subnet: private IPv4 /24 (or larger) the node addresses come from; node k gets
            host k+1. Used only inside the emulator's namespaces.
        qdisc: "tbf" (token bucket, default) or "htb".
        burst_bytes: tbf/htb burst; default max(rate/250 s, 32 KiB).
        latency_ms: tbf queue length expressed as delay at ``rate`` (default 50 ms).

    Use as a context manager (``up()`` on enter, ``down()`` on exit, also after
    exceptions). ``down()`` is idempotent.

    Raises:
        PermissionError: without root/CAP_NET_ADMIN (before anything is created).
        ValueError: naming a bad argument.
        NetEmuError: when an ``ip``/``tc`` command fails (everything created so far is
            removed first).
    """

    def __init__(self, nodes: int = 2, rate: str | int | float | None = "100mbit", *,
                 subnet: str = "10.213.0.0/24", qdisc: str = "tbf", burst_bytes: int | None = None,
                 latency_ms: float = 50.0):
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"nodes must be a positive integer, got {nodes!r}")
        self.nodes = nodes
        self.rate_bps = None if rate is None else parse_rate(rate)
        try:
            net = ipaddress.IPv4Network(subnet, strict=True)
        except ValueError as exc:
            raise ValueError(f"subnet must be an IPv4 network such as 10.213.0.0/24, got {subnet!r}: {exc}") from None
        if not net.is_private:
            raise ValueError(f"subnet must be a private network, got {subnet!r}")
        if net.num_addresses - 2 < nodes:
            raise ValueError(f"subnet {subnet} has room for {net.num_addresses - 2} nodes, asked for {nodes}")
        self.subnet = net
        if qdisc not in ("tbf", "htb"):
            raise ValueError(f"qdisc must be 'tbf' or 'htb', got {qdisc!r}")
        self.qdisc = qdisc
        if burst_bytes is not None and (isinstance(burst_bytes, bool) or not isinstance(burst_bytes, int)
                                        or burst_bytes < 1600):
            raise ValueError(f"burst_bytes must be an integer >= 1600, got {burst_bytes!r}")
        self.burst_bytes = burst_bytes
        if not latency_ms > 0:
            raise ValueError(f"latency_ms must be > 0, got {latency_ms!r}")
        self.latency_ms = float(latency_ms)
        self.id = secrets.token_hex(3)[:5]
        self.hub = f"{NS_PREFIX}{self.id}-hub"
        self.bridge = f"{IF_PREFIX}{self.id}br"
        self._procs: list[subprocess.Popen] = []
        self._created: list[str] = []
        self.is_up = False

    # ------------------------------------------------------------ names
    def namespace(self, k: int) -> str:
        """Namespace of node ``k``."""
        self._check_node(k)
        return f"{NS_PREFIX}{self.id}-n{k}"

    def ifname(self, k: int) -> str:
        """The node-side veth of node ``k`` (its NIC; use as GLOO_SOCKET_IFNAME)."""
        self._check_node(k)
        return f"{IF_PREFIX}{self.id}n{k}"

    def hub_ifname(self, k: int) -> str:
        self._check_node(k)
        return f"{IF_PREFIX}{self.id}h{k}"

    def address(self, k: int) -> str:
        """IPv4 address of node ``k``."""
        self._check_node(k)
        return str(self.subnet.network_address + k + 1)

    @property
    def namespaces(self) -> list[str]:
        return [self.hub] + [self.namespace(k) for k in range(self.nodes)]

    def _check_node(self, k: int) -> None:
        if not 0 <= k < self.nodes:
            raise ValueError(f"node index must be in [0, {self.nodes}), got {k}")

    # ------------------------------------------------------------ lifecycle
    def _ns(self, ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run(["ip", "netns", "exec", ns, *argv], check=check)

    def _shape(self, ns: str, dev: str) -> None:
        if self.rate_bps is None:
            return
        rate = f"{self.rate_bps}bit"
        burst = self.burst_bytes or max(self.rate_bps // 8 // 250, 32 * 1024)
        if self.qdisc == "tbf":
            self._ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", str(burst), "latency", f"{self.latency_ms:g}ms")
        else:
            self._ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
            self._ns(ns, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
                     "rate", rate, "ceil", rate, "burst", str(burst), "cburst", str(burst))

    def up(self) -> "Emulator":
        """Create the namespaces, bridge, veth links, addresses and qdiscs.

        Raises:
            PermissionError: without the needed privileges (nothing is created).
            NetEmuError: a command failed (what was created is removed again).
        """
        require_privileges()
        if self.is_up:
            return self
        self.is_up = True
        try:
            prefix = self.subnet.prefixlen
            _run(["ip", "netns", "add", self.hub])
            self._created.append(self.hub)
            self._ns(self.hub, "ip", "link", "set", "lo", "up")
            self._ns(self.hub, "ip", "link", "add", self.bridge, "type", "bridge")
            self._ns(self.hub, "ip", "link", "set", self.bridge, "up")
            for k in range(self.nodes):
                ns = self.namespace(k)
                _run(["ip", "netns", "add", ns])
                self._created.append(ns)
                self._ns(ns, "ip", "link", "set", "lo", "up")
                # Both ends are created directly inside their namespaces: nothing touches the root namespace.
                _run(["ip", "link", "add", self.ifname(k), "netns", ns, "type", "veth",
                      "peer", "name", self.hub_ifname(k), "netns", self.hub])
                self._ns(ns, "ip", "addr", "add", f"{self.address(k)}/{prefix}", "dev", self.ifname(k))
                self._ns(ns, "ip", "link", "set", self.ifname(k), "up")
                self._ns(self.hub, "ip", "link", "set", self.hub_ifname(k), "master", self.bridge)
                self._ns(self.hub, "ip", "link", "set", self.hub_ifname(k), "up")
                self._shape(ns, self.ifname(k))
                self._shape(self.hub, self.hub_ifname(k))
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Stop processes started here, delete this emulator's namespaces (and so its links). Idempotent.

        SIGINT/SIGTERM are held off while it runs (in the main thread), so a second Ctrl-C
        cannot interrupt the teardown.
        """
        with _signals_deferred():
            self._down()

    def _down(self) -> None:
        for proc in self._procs:
            terminate(proc)
        self._procs.clear()
        existing = set(list_namespaces()) if self._created else set()
        for ns in reversed(self._created):
            if ns in existing:
                _kill_namespace_processes(ns)
                _run(["ip", "netns", "del", ns], check=False)
        self._created.clear()
        self.is_up = False

    def exists(self) -> bool:
        """True while any namespace of this emulator exists."""
        return bool(set(self.namespaces) & set(list_namespaces()))

    def __enter__(self) -> "Emulator":
        return self.up()

    def __exit__(self, *exc: Any) -> bool:
        self.down()
        return False

    # ------------------------------------------------------------ processes
    def popen(self, k: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside node ``k``'s namespace (own session, tracked for teardown).

        ``env`` is added to this process's environment, plus ``GLOO_SOCKET_IFNAME`` (the
        node's veth) and ``OMP_NUM_THREADS=1`` unless given.
        """
        if not self.is_up:
            raise RuntimeError("Emulator is not up: call up() or use it as a context manager")
        full_env = dict(os.environ)
        full_env.setdefault("OMP_NUM_THREADS", "1")
        full_env["GLOO_SOCKET_IFNAME"] = self.ifname(k)
        full_env.update(env or {})
        proc = launch.start(["ip", "netns", "exec", self.namespace(k), *argv], full_env, **kwargs)
        self._procs.append(proc)
        return proc

    def torchrun_argv(self, k: int, args: Sequence[str], *, nproc_per_node: int | None = None,
                      master_port: int = 29500) -> list[str]:
        """The ``torchrun`` command line of node ``k`` (static rendezvous on node 0's address)."""
        if not args:
            raise ValueError("torchrun arguments are empty: give at least the script to run")
        return launch.torchrun_argv(nproc_per_node, args[0], *args[1:], port=master_port,
                                    master_addr=self.address(0), nnodes=self.nodes, node_rank=k)

    def run_torchrun(self, args: Sequence[str], *, nproc_per_node: int | None = None, master_port: int = 29500,
                     env: Mapping[str, str] | None = None, timeout: float | None = None, grace: float = 30.0,
                     **popen_kwargs: Any) -> int:
        """Run one torchrun per node and wait; return the worst exit code.

        Args:
            args: torchrun options and then the script and its arguments.
            nproc_per_node: processes per node (else whatever ``args`` says).
            master_port: rendezvous port on node 0 (namespaces have their own ports).
            env: extra environment for every node.
            timeout: seconds before all nodes are killed (exit code 124).
            grace: seconds the other nodes get to finish after one fails.
            popen_kwargs: e.g. ``stdout=`` / ``stderr=`` for the torchruns.

        Returns:
            0 if every node exited 0; 124 on timeout; else the largest non-zero code of
            the nodes that ended by themselves (a death by signal N counts as 128 + N).
            Nodes killed after ``grace`` (e.g. torchrun agents waiting in their exit
            barrier for a failed peer) do not count.
        """
        procs = [self.popen(k, self.torchrun_argv(k, args, nproc_per_node=nproc_per_node, master_port=master_port),
                            env=env, **popen_kwargs) for k in range(self.nodes)]
        start = time.monotonic()
        failed_at = None
        timed_out = False
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                    failed_at = now
                if timeout is not None and now - start > timeout:
                    timed_out = True
                    break
                if failed_at is not None and now - failed_at > grace:
                    break
                time.sleep(0.1)
        finally:
            # Codes of nodes that ended by themselves; the ones killed below only waited on a failed peer.
            own = [launch.exit_code(p.returncode) for p in procs if p.poll() is not None]
            for p in procs:
                terminate(p)
        if timed_out:
            return 124
        if any(own):
            return max(own)
        codes = [launch.exit_code(p.returncode) for p in procs]
        return max(codes) if any(codes) else 0

    # ------------------------------------------------------------ measurement
    def link_bytes(self) -> dict[int, dict[str, int]]:
        """Bytes each node's NIC (its node-side veth) has sent and received since ``up()``.

        Returns:
            ``{k: {"tx_bytes": int, "rx_bytes": int}}``: the kernel's interface counters
            (``ip -s link``), i.e. everything on the wire: payload, TCP/IP headers,
            rendezvous and store traffic. Take the difference of two calls to meter one run.

        Raises:
            RuntimeError: the emulator is not up.
            NetEmuError: ``ip`` failed or printed something unexpected.
        """
        if not self.is_up:
            raise RuntimeError("Emulator is not up: call up() or use it as a context manager")
        out = {}
        for k in range(self.nodes):
            text = _run(["ip", "-n", self.namespace(k), "-s", "-j", "link", "show", "dev", self.ifname(k)]).stdout
            try:
                stats = json.loads(text)[0]["stats64"]
                out[k] = {"tx_bytes": int(stats["tx"]["bytes"]), "rx_bytes": int(stats["rx"]["bytes"])}
            except (ValueError, LookupError, TypeError) as exc:
                raise NetEmuError(f"unexpected `ip -s -j link` output for {self.ifname(k)}: {exc}: {text[:200]}") \
                    from None
        return out

    def measure(self, src: int = 0, dst: int = 1, *, seconds: float = 2.5, max_bytes: int = 0,
                port: int = 5201) -> dict[str, float]:
        """One TCP stream from node ``src`` to node ``dst`` for ``seconds`` (or ``max_bytes``).

        Returns:
            ``{"bits_per_s", "bytes", "seconds", "set_bits_per_s", "ratio"}``; the rate is
            measured at the receiver from its first to its last received chunk.
            ``set_bits_per_s`` and ``ratio`` are None for unshaped links.

        Raises:
            ValueError: ``src == dst`` or a bad index / duration.
            NetEmuError: the stream failed.
        """
        self._check_node(src)
        self._check_node(dst)
        if src == dst:
            raise ValueError("src and dst must be different nodes (same-node traffic is loopback)")
        if not seconds > 0:
            raise ValueError(f"seconds must be > 0, got {seconds!r}")
        limit = seconds + 30
        recv = self.popen(dst, [sys.executable, "-c", _RECEIVER, self.address(dst), str(port), str(limit)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = recv.stdout.readline()
            if line.strip() != "READY":
                raise NetEmuError(f"receiver in {self.namespace(dst)} did not start: {line!r} {recv.stderr.read()}")
            send = self.popen(src, [sys.executable, "-c", _SENDER, self.address(dst), str(port), str(seconds),
                                    str(int(max_bytes))], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                _, send_err = send.communicate(timeout=limit)
                out, recv_err = recv.communicate(timeout=limit)
            except subprocess.TimeoutExpired:
                raise NetEmuError(f"measurement between nodes {src} and {dst} timed out") from None
            if send.returncode != 0 or recv.returncode != 0:
                raise NetEmuError(f"measurement failed: sender rc {send.returncode} {send_err.strip()}; "
                                  f"receiver rc {recv.returncode} {recv_err.strip()}")
        finally:
            terminate(recv)
            if "send" in locals():
                terminate(send)
        result = json.loads(out.strip().splitlines()[-1])
        bits = 8 * result["bytes"] / result["seconds"] if result["seconds"] > 0 else 0.0
        return {"bits_per_s": bits, "bytes": result["bytes"], "seconds": result["seconds"],
                "set_bits_per_s": self.rate_bps,
                "ratio": bits / self.rate_bps if self.rate_bps else None}


class _signals_deferred:
    """Context manager: ignore SIGINT/SIGTERM inside, re-deliver a caught one on exit (main thread only)."""

    def __enter__(self):
        self._saved = {}
        self._pending = []
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._saved[sig] = signal.signal(sig, lambda s, f: self._pending.append(s))
        return self

    def __exit__(self, *exc):
        for sig, old in self._saved.items():
            signal.signal(sig, old)
        if self._pending and exc[0] is None:
            os.kill(os.getpid(), self._pending[0])
        return False


# ---------------------------------------------------------------------- CLI
def _install_signal_handlers() -> None:
    def handler(signum, frame):  # turn SIGTERM into an exception so finally/with blocks tear down
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, handler)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/netemu.py",
                                description="Emulate K cluster nodes with shaped links (network namespaces + tc).")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--nodes", type=int, default=2, help="emulated nodes (namespaces)")
        sp.add_argument("--rate", default="100mbit", help="per-node link rate per direction, tc units; 'none' = unshaped")
        sp.add_argument("--subnet", default="10.213.0.0/24", help="private subnet for node addresses")
        sp.add_argument("--qdisc", choices=("tbf", "htb"), default="tbf")
        sp.add_argument("--burst-bytes", type=int, default=None)

    run = sub.add_parser("run", help="run one torchrun per node; args after -- go to torchrun")
    common(run)
    run.add_argument("--nproc-per-node", type=int, default=None)
    run.add_argument("--master-port", type=int, default=29500)
    run.add_argument("--timeout", type=float, default=None, help="seconds before everything is killed (rc 124)")
    run.add_argument("--grace", type=float, default=30.0,
                     help="seconds the other nodes get after one node fails, before they are killed")
    run.add_argument("torchrun_args", nargs=argparse.REMAINDER)

    meas = sub.add_parser("measure", help="TCP throughput between node 0 and node 1 vs the set rate")
    common(meas)
    meas.add_argument("--seconds", type=float, default=3.0)

    down = sub.add_parser("down", help="remove every emulator namespace/link left over")
    down.add_argument("--id", default=None, help="only the emulator with this id (5 hex digits in its names)")
    sub.add_parser("check", help="say whether this process has the needed privileges")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    ok, reason = check_privileges()
    if args.command == "check":
        print("ok" if ok else reason)
        return 0 if ok else 1
    if not ok:
        print(f"error: {reason}", file=sys.stderr)
        return 1
    _install_signal_handlers()
    if args.command == "down":
        found = down_all(args.id)
        print(f"removed {len(found['namespaces'])} namespace(s) {found['namespaces']} and "
              f"{len(found['links'])} link(s) {found['links']}")
        return 0
    rate = None if str(args.rate).lower() in ("none", "0", "off") else args.rate
    nodes = args.nodes if args.command == "run" else max(2, args.nodes)
    try:
        emu = Emulator(nodes, rate, subnet=args.subnet, qdisc=args.qdisc, burst_bytes=args.burst_bytes)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        with emu:
            if args.command == "measure":
                r = emu.measure(0, 1, seconds=args.seconds)
                achieved = r["bits_per_s"] / 1e6
                if r["set_bits_per_s"]:
                    print(f"set {r['set_bits_per_s'] / 1e6:.1f} Mbit/s, achieved {achieved:.1f} Mbit/s "
                          f"({100 * r['ratio']:.1f}%), {r['bytes'] / 1e6:.1f} MB in {r['seconds']:.2f} s")
                else:
                    print(f"unshaped: achieved {achieved:.1f} Mbit/s, {r['bytes'] / 1e6:.1f} MB in {r['seconds']:.2f} s")
                return 0
            targs = list(args.torchrun_args)
            if targs and targs[0] == "--":
                targs = targs[1:]
            if not targs:
                print("error: nothing to run: give torchrun arguments after --", file=sys.stderr)
                return 2
            print(f"netemu: {emu.nodes} node(s) at {emu.rate_bps or 'unshaped'} bit/s; node addresses "
                  f"{[emu.address(k) for k in range(emu.nodes)]}; NICs {[emu.ifname(k) for k in range(emu.nodes)]}",
                  file=sys.stderr)
            print(f"netemu: namespaces {json.dumps(emu.namespaces)}", file=sys.stderr, flush=True)
            return emu.run_torchrun(targs, nproc_per_node=args.nproc_per_node, master_port=args.master_port,
                                    timeout=args.timeout, grace=args.grace)
    except KeyboardInterrupt:
        print("netemu: interrupted, torn down", file=sys.stderr)
        return 130
    except NetEmuError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
