r"""Per-rank communication and step-time model of FSDP, HSDP, FL+FSDP and FL+HSDP.

Method: arXiv 2609.20359 Sec. 3, with the fragmented and compressed sync of
:mod:`fl_accel.exchange`, whose bytes on "fl" each codec states (:func:`fl_accel.wire.wire_ops`, torch-free; the codecs read it too). Units: bytes one rank sends per optimizer step, seconds, GB =
1e9 bytes; per group for its busiest rank; ``by_axis`` and the splits take the max over
groups. A ring collective over p ranks of M bytes sends (p-1)/p M (all-reduce twice that;
:func:`ring_bytes`, as :mod:`fl_accel.comm` charges).

FSDP2 (torch 2.13 ``fully_shard`` as accelerate 1.15 applies it): unit u of padded_u
elements is gathered k_u = 2 (``reshard_after_forward``) or 1 times per micro-batch in
b_p = ``param_bytes`` and reduced once per step in b_g = ``grad_bytes``::

    dp_shard = (S-1)/S (A sum k_u padded_u b_p + sum padded_u b_g);  dp_replicate = 2 (R_f-1)/R_f sum padded_u b_g/S

Sync (F > 1), byte for byte the exchange: fragment k holds units u = k mod P and syncs
every H/P steps, n fp32 values per bucket (:func:`plan_buckets`), padded as the exchange
pads; a world all-reduce of F fp32 flags checks for NaN/Inf::

    fl = 2 (F-1)/F n/C b  (b = 4 fp32, 2 bf16, 1 + 4/256 int8);  dp_replicate = (R_f-1)/R_f 4n;  world = 2 (N-1)/N 4F
    sparse: fl = (F-1) n/(4096 C) (8 + k (2 + bits/8))   (an all-gather; k = :func:`fl_accel.wire.sparse_k`)

With ``total_steps`` T, K = ``sync_warmup_steps`` of them a warm-up (an fp32 mean of every gradient
shard per step, K/T per step): the events of the T - K steps after it, one every H/P, less those
launched at or before step K, plus those launched by step T (end_training completes them), and
``end_training``'s full sync unless step T ended one with nothing in flight (P = 1, "discard"); with
a lossy ``sync_dtype`` and ``final_sync="exact"`` that final sync is fp32.

Time (:func:`predict_step_time`), per axis: bytes / bw + latency_s per collective; bw =
``intra_node_bw``, or ``inter_node_bw`` / ranks sharing a NIC for an axis spanning nodes.
FSDP's collectives are not overlapped (an upper bound); an exchange overlaps d = min(tau, H/P)
steps (one fragment's exchange per H/P steps on the link: a longer delay hides no more bytes):
exposed = max(0, t_fl - d compute_s) per fragment sync, plus chunk sharing, flags, the warm-up.
:func:`share_of_limit`: tokens/s over the no-sync limit's, (step_s - exposed) / step_s;
:func:`link_for_share`: the slowest link that keeps a share. CLIs: ``python -m scripts.cost_model``, ``scripts.link_guide``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..mesh import AXES, BUCKETS, DP_REPLICATE, DP_SHARD, FL, WORLD, FLLayout
from ..schedule import deal_fragments
from ..wire import SYNC_DTYPES, padding, plan_buckets, ring_bytes, wire_ops

GB = 1e9


def _int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _num(name: str, value: Any, zero_ok: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{name} must be a {'non-negative' if zero_ok else 'positive'} finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ShardUnit:
    """One ``fully_shard`` call of ``numel`` parameters, gathered twice per micro-batch if
    ``reshard_after_forward``; ``shapes`` give FSDP2's dim-0 padding (ValueError: not numel)."""

    name: str
    numel: int
    reshard_after_forward: bool = True
    shapes: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        _int("ShardUnit.numel", self.numel, minimum=0)
        if self.shapes is not None and sum(map(math.prod, self.shapes)) != self.numel:
            raise ValueError(f"ShardUnit.shapes of {self.name!r} do not hold numel={self.numel} elements")

    gathers = property(lambda self: 2 if self.reshard_after_forward else 1)

    def local_sizes(self, shards: int) -> list[int]:
        """Elements per parameter on shard 0, the largest: ceil(dim0 / S) rows."""
        return [math.ceil(self.numel / shards)] if self.shapes is None else \
            [math.ceil((s or (1,))[0] / shards) * math.prod(s[1:]) for s in self.shapes]

    def padded_numel(self, shards: int) -> int:
        """Elements of FSDP2's all-gather output (``numel`` without shapes)."""
        return self.numel if self.shapes is None else shards * sum(self.local_sizes(shards))


def units_from_param_count(params: float, num_units: int = 1) -> list[ShardUnit]:
    """``num_units`` equal resharded units of ``params`` elements in all (ValueError unless
    params >= num_units >= 1)."""
    n, k = round(_num("params", params)), _int("num_units", num_units)
    if n < k:
        raise ValueError(f"params must be a number of parameters >= num_units={k}, got {params!r}")
    return [ShardUnit(f"unit{i}", n // k + (i < n % k)) for i in range(k)]


@dataclass
class Traffic:
    """What one rank sends: ``bytes[axis][op]`` and ``calls[axis]`` (collectives)."""

    bytes: dict = field(default_factory=dict)
    calls: dict = field(default_factory=dict)

    def add(self, axis: str, op: str, tensor_bytes: float, p: int, calls: int = 1) -> None:
        if p > 1:
            ops = self.bytes.setdefault(axis, {})
            ops[op] = ops.get(op, 0.0) + calls * ring_bytes(op, tensor_bytes, p)
            self.calls[axis] = self.calls.get(axis, 0) + calls

    def of(self, axis: str) -> float:
        return sum(self.bytes.get(axis, {}).values())


def _sync_event(layout: FLLayout, sizes: list[int], wire: tuple, bucket_values: int, flags: bool = True) -> list:
    """Per group, the Traffic of one exchange of tensors of ``sizes`` fp32 values on the wire
    ``(sync_dtype, density, bits, collectives)`` (:func:`fl_accel.wire.padding`, :func:`fl_accel.wire.wire_ops`),
    with the non-finite ``flags`` of a sync event."""
    F, C, N, out = layout.num_groups, layout.min_replicas, layout.world_size, []
    buckets = [sum(sizes[i] for i in b) for b in plan_buckets(sizes, bucket_values)]
    pad = padding(wire[0], F, C)
    for f in range(F):
        t, R = Traffic(), layout.replicas_of(f)
        for n in buckets:
            chunk = math.ceil(n / pad) * pad // C
            for op, nbytes in wire_ops(wire[0], chunk, F, *wire[1:]):
                t.add(FL, op, nbytes, F)
            if R == C:
                t.add(DP_REPLICATE, "all_gather", 4 * chunk * C, R)
            else:
                t.add(DP_REPLICATE, "broadcast", 4 * chunk, R, calls=C)
        t.add(WORLD, "all_reduce", 4 * F, N if flags else 1)  # p = 1: nothing sent
        out.append(t)
    return out


@dataclass
class CommEstimate:
    """:func:`estimate`'s bytes per rank: Traffic of a step (``step[f]``), a sync of fragment
    k (``fragments[k][f]``), a full sync (``full[f]``), a warm-up's gradient mean (``warmup[f]``),
    such events per step (``weights``, ``full_weight``, ``warmup_weight``). Splits per step, max
    over groups: ``total``, ``intra_group``, ``inter_group`` (fl + world), ``intra_node``/``inter_node``."""

    layout: FLLayout
    sync_every: int
    num_fragments: int
    sync_dtype: str
    sync_delay: int
    step: list
    fragments: list
    full: list
    weights: list
    full_weight: float
    ranks_per_node: int | None
    params: int
    warmup: list = field(default_factory=list)
    warmup_weight: float = 0.0

    def by_group(self, amortized: bool = True) -> list[dict[str, float]]:
        """Per group: ``{bucket: bytes per step}``."""
        out = []
        for f in range(self.layout.num_groups):
            ev = [(self.step[f], 1.0)]
            if amortized and self.full:
                ev += [(fr[f], w) for fr, w in zip(self.fragments, self.weights)] + [(self.full[f], self.full_weight)]
                ev += [(self.warmup[f], self.warmup_weight)] if self.warmup else []
            out.append({a: sum(w * t.of(a) for t, w in ev) for a in BUCKETS})
        return out

    def by_axis(self, amortized: bool = True) -> dict[str, float]:
        """``{bucket: bytes per rank per step}``, the max over groups."""
        groups = self.by_group(amortized)
        return {a: max(g[a] for g in groups) for a in BUCKETS}

    def sync_by_axis(self, fragment: int | None = None) -> dict[str, float]:
        """``{bucket: bytes}`` of one sync of ``fragment`` (default: the most "fl" bytes)."""
        if not self.fragments:
            return dict.fromkeys(BUCKETS, 0.0)
        if fragment is None:
            fragment = max(range(self.num_fragments), key=lambda k: max(t.of(FL) for t in self.fragments[k]))
        return {a: max(t.of(a) for t in self.fragments[fragment]) for a in BUCKETS}

    peak_sync_bytes = property(lambda self: self.sync_by_axis()[FL],
                               doc='Bytes per rank on "fl" of the largest fragment sync (not the final full one).')

    @functools.cached_property
    def spans_nodes(self) -> dict[str, bool] | None:
        if self.ranks_per_node is None:
            return None
        spans = {a: self.layout.spans_nodes(a, self.ranks_per_node) for a in AXES}
        return {**spans, WORLD: self.layout.world_size > self.ranks_per_node}

    def _sum(self, keep) -> float | None:
        if keep is None:
            return None
        return max(sum(b for a, b in g.items() if keep(a)) for g in self.by_group())

    def _node(self, inter: bool):
        return None if self.spans_nodes is None else lambda a: self.spans_nodes[a] == inter

    total = property(lambda self: self._sum(lambda a: True))
    intra_group = property(lambda self: self._sum(lambda a: a in (DP_SHARD, DP_REPLICATE)))
    inter_group = property(lambda self: self._sum(lambda a: a in (FL, WORLD)))
    intra_node = property(lambda self: self._sum(self._node(False)))
    inter_node = property(lambda self: self._sum(self._node(True)))

    def as_dict(self) -> dict[str, Any]:
        keys = ("sync_every", "num_fragments", "sync_delay", "sync_dtype", "params", "ranks_per_node", "spans_nodes",
                "warmup_weight",
                "peak_sync_bytes", "total", "intra_group", "inter_group", "intra_node", "inter_node")
        return {"layout": self.layout.as_dict(), "by_axis": self.by_axis(), "by_group": self.by_group(),
                "sync_by_axis": self.sync_by_axis(), **{k: getattr(self, k) for k in keys}}


def estimate(layout: FLLayout, units: Sequence[ShardUnit] | float, *, sync_every: int, num_fragments: int = 1,
             sync_dtype: str = "fp32", param_bytes: float = 4, grad_bytes: float | None = None,
             micro_batches: int = 1, ranks_per_node: int | None = None, total_steps: int | None = None,
             sync_delay: int = 0, sync_bucket_mb: int = 256, sync_density: float = 1 / 64,
             sync_value_bits: int = 2, final_sync: str = "exact", delayed_local_steps: str = "discard",
             sync_warmup_steps: int = 0, sync_collectives: str = "auto") -> CommEstimate:
    """Bytes per rank per step of ``layout`` training ``units`` (ShardUnits or a parameter
    count); sync arguments as FLConfig's; bytes per gathered parameter / reduced gradient;
    A micro-batches; ``ranks_per_node``: the node split; ``total_steps`` T: a T-step run's
    syncs (and warm-up) instead of 1/H per step, the final full sync in fp32 when
    ``final_sync="exact"`` and ``sync_dtype`` is lossy. ValueError naming the argument."""
    H, P, A = _int("sync_every", sync_every), _int("num_fragments", num_fragments), _int("micro_batches", micro_batches)
    period, tau, K = H // P, _int("sync_delay", sync_delay, minimum=0), _int("sync_warmup_steps", sync_warmup_steps, 0)
    if H % P or tau > H:
        raise ValueError(f"sync_every={H} must be a multiple of num_fragments={P}, and sync_delay={tau} <= H")
    if sync_dtype not in SYNC_DTYPES:
        raise ValueError(f"sync_dtype must be one of {list(SYNC_DTYPES)}, got {sync_dtype!r}")
    pb = _num("param_bytes", param_bytes)
    gb = pb if grad_bytes is None else _num("grad_bytes", grad_bytes)
    _int("ranks_per_node", ranks_per_node) if ranks_per_node is not None else None
    units = units_from_param_count(units) if isinstance(units, (int, float)) else list(units)
    if not units or not all(isinstance(u, ShardUnit) for u in units):
        raise ValueError("units must be a non-empty list of ShardUnit or a positive parameter count")
    S, F = layout.shards, layout.num_groups
    step = [Traffic() for _ in range(F)]
    for f, t in enumerate(step):
        for u in units:
            n = u.padded_numel(S)
            t.add(DP_SHARD, "all_gather", n * pb, S, calls=A * u.gathers)
            t.add(DP_SHARD, "reduce_scatter", n * gb, S)
            t.add(DP_REPLICATE, "all_reduce", n * gb / S, layout.replicas_of(f))
    fragments, full, weights, full_weight, warmup, warmup_weight = [], [], [], 0.0, [], 0.0
    if layout.is_federated and F > 1:
        bucket = max(1, _int("sync_bucket_mb", sync_bucket_mb) * 2**20 // 4)
        sizes = [[n for u in part for n in u.local_sizes(S)] for part in deal_fragments(units, P)]
        wire = (sync_dtype, sync_density, sync_value_bits, sync_collectives)
        exact = sync_dtype != "fp32" and final_sync == "exact"  # a lossy codec's last sync is fp32
        fragments = [_sync_event(layout, s, wire, bucket) for s in sizes]
        every = [n for u in units for n in u.local_sizes(S)]
        full = _sync_event(layout, every, ("fp32",) if exact else wire, bucket)
        weights = [1.0 / H] * P
        if total_steps is not None:
            T = _int("total_steps", total_steps)
            warmup, warmup_weight = _sync_event(layout, every, ("fp32",), bucket, flags=False), min(K, T) / T
            n, rest = divmod(T - min(K, T), period)
            last = n + ((rest + tau) // period if tau else 0)  # events launched by step T (end_training completes)
            counts = [sum(1 for e in range(tau // period + 1, last + 1) if (e - 1) % P == k) for k in range(P)]
            held = last > n or (delayed_local_steps == "keep" and tau > 0)  # the groups differ after step T
            full_weight = 0.0 if (P == 1 and rest == 0 and not held) or T <= K else 1.0 / T
            if exact and not full_weight and n:  # step T's sync is the final one: exact
                counts[0], full_weight = counts[0] - 1, 1.0 / T
            weights = [c / T for c in counts]
    return CommEstimate(layout, H, P, sync_dtype, tau, step, fragments, full, weights, full_weight, ranks_per_node,
                        sum(u.numel for u in units), warmup, warmup_weight)


@dataclass(frozen=True)
class StepTime:
    """``step_s`` = compute + FSDP comm + ``exposed_sync_s``; ``comm_s(_by_axis)``: link-busy
    seconds per step (syncs amortized); ``tokens_per_s``: global, or None."""

    step_s: float
    comm_s: float
    comm_s_by_axis: dict
    exposed_sync_s: float
    tokens_per_s: float | None


def predict_step_time(est: CommEstimate, *, compute_s: float, intra_node_bw: float, inter_node_bw: float,
                      ranks_per_nic: int | Mapping[str, int] | None = None, latency_s: float = 0.0,
                      sync_delay: int | None = None, tokens_per_rank: float | None = None) -> StepTime:
    """Step time of the slowest group: bandwidths in bytes/s per direction; ``ranks_per_nic``
    an int or ``{axis: int}`` (default ``layout.link_share``). ValueError: no
    ``ranks_per_node`` in ``est``, a bandwidth <= 0, tau not in [0, H]."""
    compute_s, latency_s = _num("compute_s", compute_s, True), _num("latency_s", latency_s, True)
    intra, inter = _num("intra_node_bw", intra_node_bw), _num("inter_node_bw", inter_node_bw)
    tau = est.sync_delay if sync_delay is None else _int("sync_delay", sync_delay, minimum=0)
    if tau > est.sync_every:
        raise ValueError(f"sync_delay={tau} must be <= sync_every")
    if est.spans_nodes is None:
        raise ValueError("estimate(..., ranks_per_node=...) is needed to tell intra- from inter-node links")
    nic = ranks_per_nic if isinstance(ranks_per_nic, Mapping) else dict.fromkeys(BUCKETS, ranks_per_nic)
    bw = {}
    for a in BUCKETS:
        share = nic.get(a) or (est.layout.link_share(a, est.ranks_per_node) if a != WORLD else 1)
        bw[a] = inter / max(1, _int(f"ranks_per_nic[{a!r}]", share, 0)) if est.spans_nodes[a] else intra

    def secs(t: Traffic) -> dict[str, float]:
        return {a: t.of(a) / bw[a] + latency_s * t.calls.get(a, 0) for a in BUCKETS}

    worst = None
    for f in range(est.layout.num_groups):
        train = secs(est.step[f])
        events = [(secs(fr[f]), w, min(tau, est.sync_every // est.num_fragments))  # one exchange per H/P steps
                  for fr, w in zip(est.fragments, est.weights)]
        events += [(secs(t[f]), w, 0) for t, w in ((est.full, est.full_weight), (est.warmup, est.warmup_weight)) if t]
        busy = {a: train[a] + sum(w * s[a] for s, w, _ in events) for a in BUCKETS}
        exposed = sum(w * (max(0.0, s[FL] - d * compute_s) + s[DP_REPLICATE] + s[WORLD]) for s, w, d in events)
        step_s = compute_s + sum(train.values()) + exposed
        if worst is None or step_s > worst.step_s:
            tps = None if tokens_per_rank is None else \
                est.layout.world_size * _num("tokens_per_rank", tokens_per_rank) / step_s if step_s else math.inf
            worst = StepTime(step_s, sum(busy.values()), busy, exposed, tps)
    return worst


def share_of_limit(t: StepTime) -> float:
    """Tokens/s of ``t`` over the tokens/s of the same layout with no inter-group traffic
    (the "no-sync limit"): the step without its exposed sync over the step, in (0, 1]."""
    return (t.step_s - t.exposed_sync_s) / t.step_s if t.step_s > 0 else 1.0


def link_for_share(est: CommEstimate, share: float, *, compute_s: float, intra_node_bw: float,
                   ranks_per_nic: int | Mapping[str, int] | None = None, latency_s: float = 0.0,
                   highest_bw: float = 1e15) -> float | None:
    """The slowest ``inter_node_bw`` (bytes/s per direction) at which :func:`share_of_limit`
    of :func:`predict_step_time` reaches ``share`` (bisection, within 0.1%), or None when
    even ``highest_bw`` does not (latency-bound). ValueError: ``share`` not in (0, 1]."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ValueError(f"share must be a number in (0, 1], got {share!r}")

    def ok(bw: float) -> bool:
        return share_of_limit(predict_step_time(est, compute_s=compute_s, intra_node_bw=intra_node_bw,
                                                inter_node_bw=bw, ranks_per_nic=ranks_per_nic,
                                                latency_s=latency_s)) >= share

    lo, hi = 1.0, _num("highest_bw", highest_bw)
    if ok(lo) or not ok(hi):  # the slowest link already keeps it, or none does (latency-bound)
        return lo if ok(hi) else None
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi
