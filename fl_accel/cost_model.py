r"""Analytical per-rank communication and step-time model for FSDP, HSDP, FL+FSDP, FL+HSDP.

Method: Mittone & Aldinucci, "Accelerating Sharded Data Parallelism at Scale with
Federated Learning", Euro-Par 2026, arXiv 2609.20359. Layout and names as in
:mod:`fl_accel.mesh`: N ranks = F federation groups x G ranks, G = R*S (R HSDP
replicas of S shards); mesh axes "fl" (size F), "dp_replicate" (R), "dp_shard" (S).
The baselines are F = 1: FSDP is (1, 1, N), HSDP is (1, N/S, S). Groups are
contiguous rank blocks, so with G ranks per node a group is a node.

Units: bytes sent by ONE rank per optimizer step (GB below = 1e9 bytes).

Ring collectives (the same formulas :mod:`fl_accel.comm` charges measured calls with)
------------------------------------------------------------------------------------
For a collective over p ranks of a *full* tensor of M bytes (the all-gather output,
the reduce-scatter input, the all-reduce buffer)::

    all-gather, reduce-scatter:  (p-1)/p * M
    all-reduce:                2 (p-1)/p * M      (= reduce-scatter + all-gather)

FSDP2 per optimizer step (inside one model copy, axis "dp_shard", p = S)
------------------------------------------------------------------------
The model is split into FSDP units (``fully_shard`` calls). A unit u with P_u
parameters is sharded on dim 0 of every parameter, padded to a multiple of S
(``padded_u(S)``, exactly what FSDP2's all-gather / reduce-scatter buffers hold).
With b_p bytes per gathered parameter element (``param_bytes``: the MixedPrecisionPolicy
param_dtype, else the parameter dtype), b_g per reduced gradient element
(``grad_bytes``: reduce_dtype; Accelerate's ``set_mixed_precision("bf16")`` sets
reduce_dtype = param_dtype = bf16, and FSDP2 itself reduces in the compute dtype when
reduce_dtype is None, so the default is b_g = b_p), k_u all-gathers of the unit per
micro-batch (k_u = 2, forward and backward, when ``reshard_after_forward`` is True;
k_u = 1 otherwise) and A micro-batches per step (gradient accumulation without
reduction on the first A-1)::

    M_ag = A * sum_u k_u * padded_u(S) * b_p        all-gathered bytes (full size)
    M_rs =     sum_u       padded_u(S) * b_g        reduce-scattered bytes (full size)
    dp_shard     = (S-1)/S * (M_ag + M_rs)
    dp_replicate = 2 (R-1)/R * M_rs / S            (HSDP: all-reduce of the 1/S shard)

Accelerate's ``fsdp2_prepare_model`` wraps each decoder layer and the input embedding
with the plugin's ``reshard_after_forward`` (True), the tail [final norm, lm_head] with
False, and the root (leftovers) with None -> False: see :func:`units_from_module`
(exact, from a model) and :func:`llama_units` (from a LlamaConfig, no torch needed).
:func:`units_from_param_count` is the simple "everything reshards" model (3 * M per step).

Federated sync every H optimizer steps (axis "fl", p = F)
---------------------------------------------------------
Each rank averages its own local shard, packed in fp32 (``sync_bytes`` = 4 as in
:mod:`fl_accel.sync`), with the F ranks of the same coordinate in the other groups.
With M_sync = sum_u padded_u(S)/S * b_s (the shard of shard-coordinate 0, which holds
the full ceil(dim0/S) rows; later coordinates may hold slightly fewer)::

    FL+FSDP:  fl = 2 (F-1)/F * M_sync                                   per sync
    FL+HSDP:  fl = 2 (F-1)/F * M_sync / R,  dp_replicate += (R-1)/R * M_sync
              (replica r reduces chunk r of R over "fl", then the replicas all-gather
              the chunks; the reference code instead sends all of M_sync from every
              replica: ``split_replicas=False``)

Amortized per step, the sync costs ``1/H`` of that (or ``ceil(T/H)/T`` for a run of T
steps with the final sync). "fl" is the only inter-group axis; "dp_shard" and
"dp_replicate" are intra-group.

Intra-node vs inter-node (given ranks per node P)
-------------------------------------------------
An axis is inter-node when any of its process groups (an arithmetic progression of
ranks: "dp_shard" stride 1, "dp_replicate" stride S, "fl" stride G) spans more than one
node. All of that axis's bytes are then charged to the inter-node link: the NCCL
bus-bandwidth view, in which a ring runs at the speed of its slowest hop and every
rank's (p-1)/p * M crosses it (e.g. one NIC per GPU, as on 4xA100 nodes with 4 HCAs).

Worked example: Llama-3.1-8B (8.03e9 parameters), bf16, N = 512, P = 4
-----------------------------------------------------------------------
* FSDP (S = 512), everything resharding: 3 * 511/512 * 8.03e9 * 2 B = 48.1 GB per GPU
  per step, all inter-node (the issue's "about 48 GB"). With Accelerate's real wrapping
  (tail not resharded, 47.0 GB).
* FL+FSDP, G = 4, H = 8: the same 3 * 3/4 * 16.06 GB = 36.1 GB stays inside the node,
  and the sync sends 2 * 127/128 * (8.03e9 / 4 * 4 B) = 15.9 GB per sync, i.e.
  **1.99 GB inter-node per GPU per step** amortized. The issue text says "about 1 GB":
  that figure is reproduced when the shard is exchanged in bf16 (``sync_bytes=2``:
  0.996 GB), or equivalently when the fp32 all-reduce is counted as M instead of the
  ring's 2 (F-1)/F * M. :mod:`fl_accel.sync` averages in fp32 on the wire, so the
  default here is 4 bytes and the honest figure for this code is ~2 GB; either way it is
  ~24x (fp32) to ~48x (bf16) less inter-node traffic than FSDP.

Time model (:func:`predict_step_time`)
--------------------------------------
No overlap of computation and communication, no per-collective latency, each axis at
the bandwidth of its tier (per-rank bytes / per-rank link bytes/s)::

    step_s = compute_s + sum_axis bytes_axis / bw(tier(axis))    (sync amortized 1/H)
    tokens/s = N * tokens_per_rank / step_s

Real FSDP overlaps most of the all-gathers with compute, so this is an upper bound of
the step time (a lower bound of throughput) when the links are the bottleneck.

CLI::

    python -m fl_accel.cost_model --params 8.03e9 --bytes-per-element 2 \
        --world-size 512 --group-size 4 --shard-size 4 --sync-every 8
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

ALGORITHMS = ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp")
AXES = ("fl", "dp_replicate", "dp_shard")
INTRA_GROUP_AXES = ("dp_replicate", "dp_shard")
INTER_GROUP_AXES = ("fl",)
GB = 1e9


# ---------------------------------------------------------------------- validation
def _need_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _need_positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def _need_nonnegative(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative finite number, got {value!r}")
    return float(value)


# ---------------------------------------------------------------------- ring formulas
def ring_bytes(op: str, tensor_bytes: float, group_size: int) -> float:
    """Bytes one rank sends in a ring collective (float version of ``fl_accel.comm.ring_bytes``).

    Args:
        op: "all_gather", "reduce_scatter" or "all_reduce".
        tensor_bytes: M, the *full* tensor size in bytes (all-gather output,
            reduce-scatter input, all-reduce buffer); >= 0.
        group_size: p, ranks in the collective; >= 1 (p = 1 sends nothing).

    Returns:
        (p-1)/p * M for all-gather / reduce-scatter, 2 (p-1)/p * M for all-reduce.

    Raises:
        ValueError: unknown ``op``, negative ``tensor_bytes``, ``group_size`` < 1.
    """
    tensor_bytes = _need_nonnegative("tensor_bytes", tensor_bytes)
    p = _need_int("group_size", group_size)
    if op in ("all_gather", "reduce_scatter"):
        factor = 1.0
    elif op == "all_reduce":
        factor = 2.0
    else:
        raise ValueError(f"op must be 'all_gather', 'reduce_scatter' or 'all_reduce', got {op!r}")
    return factor * (p - 1) / p * tensor_bytes


# ---------------------------------------------------------------------- FSDP units
@dataclass(frozen=True)
class ShardUnit:
    """One FSDP unit (one ``fully_shard`` call).

    Attributes:
        name: label, e.g. "embed", "layers.0", "tail", "root".
        numel: parameters the unit manages (elements, not bytes), >= 0.
        reshard_after_forward: True -> gathered twice per micro-batch (forward and
            backward); False -> once (kept unsharded from forward to backward).
        shapes: optional shapes of the unit's parameters, for FSDP2's dim-0 padding to
            a multiple of the shard size; None means "no padding" (``numel`` as is).
    """

    name: str
    numel: int
    reshard_after_forward: bool = True
    shapes: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        _need_int("ShardUnit.numel", self.numel, minimum=0)
        if self.shapes is not None:
            total = sum(math.prod(s) for s in self.shapes)
            if total != self.numel:
                raise ValueError(f"ShardUnit.shapes of {self.name!r} hold {total} elements, numel says {self.numel}")

    @property
    def gathers(self) -> int:
        """All-gathers per micro-batch: 2 if ``reshard_after_forward`` else 1."""
        return 2 if self.reshard_after_forward else 1

    def padded_numel(self, shard_size: int) -> int:
        """Elements in FSDP2's all-gather output / reduce-scatter input over ``shard_size`` ranks.

        Each parameter's dim 0 is padded to a multiple of ``shard_size`` (0-dim
        parameters count as shape (1,)). Without ``shapes``, returns ``numel``.
        """
        s = _need_int("shard_size", shard_size)
        if self.shapes is None:
            return self.numel
        total = 0
        for shape in self.shapes:
            if len(shape) == 0:
                shape = (1,)
            rows = math.ceil(shape[0] / s) * s
            total += rows * math.prod(shape[1:])
        return total


def units_from_param_count(params: int | float) -> list[ShardUnit]:
    """The simple model: one unit of ``params`` elements that reshards after forward.

    Gives 2 all-gathers + 1 reduce-scatter of the whole model per step (no padding).

    Raises:
        ValueError: naming ``params`` when it is not a positive whole number
            (floats such as 8.03e9 are rounded to the nearest integer).
    """
    if isinstance(params, bool) or not isinstance(params, (int, float)) or not math.isfinite(params) or params <= 0:
        raise ValueError(f"params must be a positive number of parameters, got {params!r}")
    return [ShardUnit("model", int(round(params)), True)]


def _cfg(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


def llama_units(config: Any, reshard_after_forward: bool = True) -> list[ShardUnit]:
    """FSDP units of a ``LlamaForCausalLM`` as Accelerate's ``fsdp2_prepare_model`` wraps it.

    Units, in forward order: "embed" (embed_tokens, resharded; absent when the word
    embeddings are tied), one "layers.i" per LlamaDecoderLayer (resharded), "tail"
    [final norm, lm_head] (plus embed_tokens when tied; not resharded), and "root"
    (leftover parameters: none for Llama; omitted). Source: accelerate 1.15
    ``accelerate/utils/fsdp_utils.py::fsdp2_prepare_model``; shapes from
    transformers ``modeling_llama.py`` (q/k/v/o projections with ``attention_bias``,
    gate/up/down with ``mlp_bias``, two RMSNorm weights per layer).

    Args:
        config: a ``transformers.LlamaConfig`` or a mapping with the same keys
            (vocab_size, hidden_size, intermediate_size, num_hidden_layers,
            num_attention_heads, optional num_key_value_heads, head_dim,
            attention_bias, mlp_bias, tie_word_embeddings).
        reshard_after_forward: the plugin's setting for embed and layers.

    Returns:
        list of :class:`ShardUnit` with shapes (so padding is exact).

    Raises:
        ValueError: naming a missing or non-positive config field.
    """
    V = _need_int("config.vocab_size", _cfg(config, "vocab_size"))
    H = _need_int("config.hidden_size", _cfg(config, "hidden_size"))
    inter = _need_int("config.intermediate_size", _cfg(config, "intermediate_size"))
    L = _need_int("config.num_hidden_layers", _cfg(config, "num_hidden_layers"))
    nh = _need_int("config.num_attention_heads", _cfg(config, "num_attention_heads"))
    nkv = _need_int("config.num_key_value_heads", _cfg(config, "num_key_value_heads", nh))
    hd = _need_int("config.head_dim", _cfg(config, "head_dim", H // nh))
    attn_bias = bool(_cfg(config, "attention_bias", False))
    mlp_bias = bool(_cfg(config, "mlp_bias", False))
    tied = bool(_cfg(config, "tie_word_embeddings", False))

    layer: list[tuple[int, ...]] = [(nh * hd, H), (nkv * hd, H), (nkv * hd, H), (H, nh * hd)]
    if attn_bias:
        layer += [(nh * hd,), (nkv * hd,), (nkv * hd,), (H,)]
    layer += [(inter, H), (inter, H), (H, inter)]
    if mlp_bias:
        layer += [(inter,), (inter,), (H,)]
    layer += [(H,), (H,)]
    layer_t = tuple(layer)

    def unit(name: str, shapes: Sequence[tuple[int, ...]], reshard: bool) -> ShardUnit:
        shapes = tuple(tuple(s) for s in shapes)
        return ShardUnit(name, sum(math.prod(s) for s in shapes), reshard, shapes)

    units = []
    if not tied:
        units.append(unit("embed", [(V, H)], reshard_after_forward))
    units += [unit(f"layers.{i}", layer_t, reshard_after_forward) for i in range(L)]
    units.append(unit("tail", [(H,), (V, H)], False))  # [final norm, lm_head (= embed when tied)]
    return units


def units_from_module(model: Any, wrap_cls_names: Iterable[str] | None = None,
                      reshard_after_forward: bool = True) -> list[ShardUnit]:
    """FSDP units of any ``torch.nn.Module`` as Accelerate's ``fsdp2_prepare_model`` wraps it.

    Mirrors accelerate 1.15 (``accelerate/utils/fsdp_utils.py``): bottom-up, every
    module whose class name is in ``wrap_cls_names`` (default ``model._no_split_modules``,
    the transformer_based_wrap policy) becomes a unit; then the input embedding (if not
    tied to the output embedding); then the tail [last "*Norm*" child of the base model,
    output embedding] (with the input embedding first when tied) with
    reshard_after_forward=False; then the root with the leftover parameters (False).
    Each parameter belongs to the innermost unit that holds it; tied parameters count
    once. Works on a meta-device model (only shapes are read).

    Returns:
        list of :class:`ShardUnit` with shapes; units without parameters are dropped.

    Raises:
        ValueError: naming ``wrap_cls_names`` when a class name matches no module.
    """
    names = list(wrap_cls_names) if wrap_cls_names is not None else list(getattr(model, "_no_split_modules", None) or [])
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in names if n not in present]
    if missing:
        raise ValueError(f"wrap_cls_names {missing} match no module of {type(model).__name__}")
    owned: set[int] = set()
    wrapped: set[int] = set()

    def take(name: str, modules: Sequence[Any], reshard: bool) -> list[ShardUnit]:
        shapes = []
        for m in modules:
            wrapped.add(id(m))
            for p in m.parameters():
                if id(p) not in owned:
                    owned.add(id(p))
                    shapes.append(tuple(p.shape))
        return [ShardUnit(name, sum(math.prod(s) for s in shapes), reshard, tuple(shapes))] if shapes else []

    def post_order(prefix: str, module: Any):
        for child_name, child in module.named_children():
            yield from post_order(f"{prefix}.{child_name}" if prefix else child_name, child)
        yield prefix, module

    input_embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    output_embed = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_w = getattr(input_embed, "weight", None)
    tied = in_w is not None and in_w is getattr(output_embed, "weight", None)

    body: list[ShardUnit] = []  # wrapped bottom-up, like accelerate
    for path, module in post_order("", model):
        if module is not model and type(module).__name__ in names and id(module) not in wrapped:
            body += take(path, [module], reshard_after_forward)
    embed: list[ShardUnit] = []
    if not tied and input_embed is not None and id(input_embed) not in wrapped:
        embed = take("embed", [input_embed], reshard_after_forward)
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else model
    final_norm = None
    if base is not None and hasattr(base, "named_children"):
        for _, child in base.named_children():
            if "Norm" in type(child).__name__:
                final_norm = child
    tail_modules = (final_norm, input_embed, output_embed) if tied else (final_norm, output_embed)
    tail = take("tail", [m for m in tail_modules if m is not None and id(m) not in wrapped], False)
    root = take("root", [model], False)
    return embed + body + tail + root


def total_params(units: Sequence[ShardUnit]) -> int:
    """Sum of ``numel`` over units (the model's parameter count)."""
    return sum(u.numel for u in units)


# ---------------------------------------------------------------------- layout
def layout_for(algorithm: str, world_size: int, group_size: int | None = None,
               shard_size: int | None = None) -> tuple[int, int, int]:
    """Mesh shape ``(F, R, S)`` of ``algorithm`` on ``world_size`` ranks.

    "fsdp": (1, 1, N); "hsdp": (1, N/S, S); "fl_fsdp": (N/G, 1, G);
    "fl_hsdp": (N/G, G/S, S). ``group_size`` is only read by the FL algorithms,
    ``shard_size`` only by the HSDP ones (same conventions as :class:`fl_accel.FLConfig`).

    Raises:
        ValueError: naming ``algorithm``, ``world_size``, ``group_size`` (missing, < 1,
            or not dividing ``world_size``) or ``shard_size`` (missing, < 1, or not
            dividing the group / world).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {list(ALGORITHMS)}, got {algorithm!r}")
    N = _need_int("world_size", world_size)
    if algorithm.startswith("fl_"):
        if group_size is None:
            raise ValueError(f"group_size is required for algorithm {algorithm!r}")
        G = _need_int("group_size", group_size)
        if N % G:
            raise ValueError(f"group_size={G} does not divide world_size={N}")
    else:
        G = N
    F = N // G
    if algorithm.endswith("hsdp"):
        if shard_size is None:
            raise ValueError(f"shard_size is required for algorithm {algorithm!r}")
        S = _need_int("shard_size", shard_size)
        if G % S:
            raise ValueError(f"shard_size={S} does not divide the group size {G} (world_size={N})")
    else:
        S = G
    return F, G // S, S


def axis_spans_nodes(axis: str, shape: tuple[int, int, int], ranks_per_node: int) -> bool:
    """True when any process group of ``axis`` holds ranks of more than one node.

    Ranks ``k`` live on node ``k // ranks_per_node``; groups are contiguous blocks
    (:mod:`fl_accel.mesh`). Exact and O(N / axis size): each group of an axis is an
    arithmetic progression ("dp_shard" stride 1, "dp_replicate" stride S, "fl" stride G).

    Raises:
        ValueError: unknown ``axis``; ``ranks_per_node`` < 1.
    """
    P = _need_int("ranks_per_node", ranks_per_node)
    F, R, S = shape
    G = R * S
    if axis == "dp_shard":
        starts, stride, count = (f * G + r * S for f in range(F) for r in range(R)), 1, S
    elif axis == "dp_replicate":
        starts, stride, count = (f * G + s for f in range(F) for s in range(S)), S, R
    elif axis == "fl":
        starts, stride, count = (r * S + s for r in range(R) for s in range(S)), G, F
    else:
        raise ValueError(f"axis must be one of {list(AXES)}, got {axis!r}")
    if count <= 1:
        return False
    return any(a // P != (a + (count - 1) * stride) // P for a in starts)


# ---------------------------------------------------------------------- the estimate
@dataclass
class CommEstimate:
    """Per-rank bytes of one algorithm. Build with :func:`estimate`.

    Attributes:
        algorithm, num_groups (F), replicas (R), shards (S), sync_every (H).
        step_bytes: ``{axis: {op: bytes}}`` sent per optimizer step by the FSDP/HSDP
            training itself (no sync).
        sync_bytes: ``{axis: {op: bytes}}`` sent by one federated sync (empty for the
            baselines).
        syncs_per_step: the amortization factor (1/H, or ceil(T/H)/T for a run of T).
        spans_nodes: ``{axis: bool}`` (inter-node axes), or None when ``ranks_per_node``
            was not given.
        params: total parameters of the model.
    """

    algorithm: str
    num_groups: int
    replicas: int
    shards: int
    sync_every: int
    step_bytes: dict[str, dict[str, float]]
    sync_bytes: dict[str, dict[str, float]]
    syncs_per_step: float
    spans_nodes: dict[str, bool] | None
    params: int
    ranks_per_node: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.num_groups * self.replicas * self.shards

    @property
    def group_size(self) -> int:
        return self.replicas * self.shards

    def by_axis(self, amortized: bool = True) -> dict[str, float]:
        """Bytes per optimizer step per axis; with ``amortized`` the sync adds ``syncs_per_step`` of its bytes."""
        out = {}
        for a in AXES:
            total = sum(self.step_bytes.get(a, {}).values())
            if amortized:
                total += self.syncs_per_step * sum(self.sync_bytes.get(a, {}).values())
            out[a] = total
        return out

    def sync_by_axis(self) -> dict[str, float]:
        """Bytes of one sync per axis (not amortized)."""
        return {a: sum(self.sync_bytes.get(a, {}).values()) for a in AXES}

    @property
    def total(self) -> float:
        """All bytes per rank per optimizer step, sync amortized."""
        return sum(self.by_axis().values())

    @property
    def intra_group(self) -> float:
        """Bytes per step on "dp_shard" + "dp_replicate" (inside a federation group)."""
        b = self.by_axis()
        return sum(b[a] for a in INTRA_GROUP_AXES)

    @property
    def inter_group(self) -> float:
        """Bytes per step on "fl" (between groups), sync amortized."""
        b = self.by_axis()
        return sum(b[a] for a in INTER_GROUP_AXES)

    @property
    def inter_node(self) -> float | None:
        """Bytes per step on axes that span nodes (None without ``ranks_per_node``)."""
        if self.spans_nodes is None:
            return None
        b = self.by_axis()
        return sum(b[a] for a in AXES if self.spans_nodes[a])

    @property
    def intra_node(self) -> float | None:
        """Bytes per step on axes that stay inside one node (None without ``ranks_per_node``)."""
        if self.spans_nodes is None:
            return None
        b = self.by_axis()
        return sum(b[a] for a in AXES if not self.spans_nodes[a])

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly summary (bytes per rank per optimizer step)."""
        return {
            "algorithm": self.algorithm, "F": self.num_groups, "R": self.replicas, "S": self.shards,
            "G": self.group_size, "H": self.sync_every, "params": self.params,
            "by_axis": self.by_axis(), "sync_by_axis": self.sync_by_axis(),
            "step_bytes": self.step_bytes, "sync_bytes": self.sync_bytes,
            "intra_group": self.intra_group, "inter_group": self.inter_group,
            "intra_node": self.intra_node, "inter_node": self.inter_node, "total": self.total,
            "spans_nodes": self.spans_nodes, "ranks_per_node": self.ranks_per_node,
        }


def estimate(
    algorithm: str,
    world_size: int,
    units: Sequence[ShardUnit] | int | float,
    *,
    group_size: int | None = None,
    shard_size: int | None = None,
    sync_every: int = 8,
    param_bytes: float = 2,
    grad_bytes: float | None = None,
    sync_bytes: float = 4,
    ranks_per_node: int | None = None,
    micro_batches: int = 1,
    split_replicas: bool = True,
    total_steps: int | None = None,
) -> CommEstimate:
    """Per-rank bytes per optimizer step of one algorithm (formulas in the module docstring).

    Args:
        algorithm: "fsdp", "hsdp", "fl_fsdp" or "fl_hsdp".
        world_size: N ranks.
        units: FSDP units (:func:`llama_units`, :func:`units_from_module`), or a raw
            parameter count (:func:`units_from_param_count`).
        group_size: G, ranks per federation group (FL algorithms).
        shard_size: S, ranks one HSDP replica shards over (HSDP algorithms).
        sync_every: H, optimizer steps between syncs (FL algorithms).
        param_bytes: bytes per all-gathered parameter element (param_dtype; bf16 = 2).
        grad_bytes: bytes per reduced gradient element (reduce_dtype); default
            ``param_bytes``.
        sync_bytes: bytes per element of the sync's flat buffer (fl_accel.sync: fp32 = 4).
        ranks_per_node: P; enables the intra-/inter-node split. Must divide N.
        micro_batches: A, micro-batches per optimizer step (all-gathers repeat per
            micro-batch, the gradient reduction happens once).
        split_replicas: FL+HSDP sends 1/R of the shard per replica over "fl" then
            all-gathers over "dp_replicate" (fl_accel); False: every replica sends it
            all (reference code).
        total_steps: T; amortize ceil(T/H) syncs (the last step always syncs) over T
            steps instead of 1/H.

    Returns:
        :class:`CommEstimate`.

    Raises:
        ValueError: naming the argument: unknown ``algorithm``; non-positive sizes or
            byte widths; ``group_size`` / ``shard_size`` that do not divide;
            ``ranks_per_node`` not dividing ``world_size``; an empty ``units`` list.
    """
    F, R, S = layout_for(algorithm, world_size, group_size, shard_size)
    H = _need_int("sync_every", sync_every)
    pb = _need_positive("param_bytes", param_bytes)
    gb = pb if grad_bytes is None else _need_positive("grad_bytes", grad_bytes)
    sb = _need_positive("sync_bytes", sync_bytes)
    A = _need_int("micro_batches", micro_batches)
    if isinstance(units, (int, float)) and not isinstance(units, bool):
        units = units_from_param_count(units)
    units = list(units)
    if not units or not all(isinstance(u, ShardUnit) for u in units):
        raise ValueError("units must be a non-empty list of ShardUnit or a positive parameter count")
    if ranks_per_node is not None:
        P = _need_int("ranks_per_node", ranks_per_node)
        if world_size % P:
            raise ValueError(f"ranks_per_node={P} does not divide world_size={world_size}")

    padded = [u.padded_numel(S) for u in units]
    m_ag = A * sum(u.gathers * n for u, n in zip(units, padded)) * pb
    m_rs = sum(padded) * gb
    step = {a: {} for a in AXES}
    if S > 1:
        step["dp_shard"]["all_gather"] = ring_bytes("all_gather", m_ag, S)
        step["dp_shard"]["reduce_scatter"] = ring_bytes("reduce_scatter", m_rs, S)
    if R > 1:
        step["dp_replicate"]["all_reduce"] = ring_bytes("all_reduce", m_rs / S, R)

    sync = {a: {} for a in AXES}
    federated = algorithm.startswith("fl_")
    if federated:
        m_sync = sum(padded) / S * sb
        if R > 1 and split_replicas:
            if F > 1:
                sync["fl"]["all_reduce"] = ring_bytes("all_reduce", m_sync / R, F)
            sync["dp_replicate"]["all_gather"] = ring_bytes("all_gather", m_sync, R)
        elif F > 1:
            sync["fl"]["all_reduce"] = ring_bytes("all_reduce", m_sync, F)
    if total_steps is not None:
        T = _need_int("total_steps", total_steps)
        syncs_per_step = math.ceil(T / H) / T
    else:
        syncs_per_step = 1.0 / H
    if not federated:
        syncs_per_step = 0.0
    step = {a: ops for a, ops in step.items() if ops}
    sync = {a: ops for a, ops in sync.items() if ops}
    spans = None
    if ranks_per_node is not None:
        spans = {a: axis_spans_nodes(a, (F, R, S), ranks_per_node) for a in AXES}
    return CommEstimate(
        algorithm=algorithm, num_groups=F, replicas=R, shards=S, sync_every=H,
        step_bytes=step, sync_bytes=sync, syncs_per_step=syncs_per_step, spans_nodes=spans,
        params=total_params(units), ranks_per_node=ranks_per_node,
        meta={"param_bytes": pb, "grad_bytes": gb, "sync_bytes": sb, "micro_batches": A,
              "split_replicas": split_replicas},
    )


def estimate_from_config(config: Any, world_size: int, units: Sequence[ShardUnit] | int | float,
                         **kwargs: Any) -> CommEstimate:
    """:func:`estimate` for an :class:`fl_accel.FLConfig` (algorithm, num_groups, hsdp_shard_size, sync_every).

    Raises:
        ValueError: from ``config.validate(world_size)`` (naming the FLConfig field) or
            from :func:`estimate`.
    """
    F, R, S = config.validate(world_size).sizes(world_size)
    return estimate(config.algorithm, world_size, units, group_size=R * S, shard_size=S,
                    sync_every=config.sync_every, **kwargs)


def compare(world_size: int, units: Sequence[ShardUnit] | int | float, *, group_size: int,
            shard_size: int, sync_every: int = 8, hsdp_group_size: int | None = None,
            **kwargs: Any) -> list[CommEstimate]:
    """Estimates for FSDP, HSDP (shard_size), FL+FSDP (group_size) and FL+HSDP.

    FL+HSDP uses ``hsdp_group_size`` (default ``group_size``) ranks per group and
    ``shard_size`` shards. Other keyword arguments go to :func:`estimate`.
    """
    gh = group_size if hsdp_group_size is None else hsdp_group_size
    return [
        estimate("fsdp", world_size, units, sync_every=sync_every, **kwargs),
        estimate("hsdp", world_size, units, shard_size=shard_size, sync_every=sync_every, **kwargs),
        estimate("fl_fsdp", world_size, units, group_size=group_size, sync_every=sync_every, **kwargs),
        estimate("fl_hsdp", world_size, units, group_size=gh, shard_size=shard_size,
                 sync_every=sync_every, **kwargs),
    ]


# ---------------------------------------------------------------------- time model
@dataclass(frozen=True)
class StepTime:
    """Predicted time of one optimizer step (seconds) and throughput.

    Attributes:
        compute_s: the given compute time.
        comm_s_by_axis: ``{axis: seconds}`` per step, sync amortized.
        comm_s: sum of ``comm_s_by_axis``.
        step_s: ``compute_s + comm_s`` (no overlap).
        tokens_per_s: global tokens per second, or None without ``tokens_per_rank``.
    """

    compute_s: float
    comm_s_by_axis: dict[str, float]
    comm_s: float
    step_s: float
    tokens_per_s: float | None


def predict_step_time(est: CommEstimate, *, compute_s: float, intra_node_bw: float,
                      inter_node_bw: float, tokens_per_rank: float | None = None) -> StepTime:
    """Step time and tokens/s under the no-overlap model (module docstring).

    Args:
        est: from :func:`estimate` with ``ranks_per_node`` set.
        compute_s: forward+backward+optimizer seconds per step, >= 0.
        intra_node_bw: per-rank bytes/s on links inside a node, > 0.
        inter_node_bw: per-rank bytes/s on links between nodes, > 0.
        tokens_per_rank: tokens one rank processes per optimizer step
            (micro-batch * sequence length * micro-batches), > 0; optional.

    Raises:
        ValueError: naming ``est.ranks_per_node`` when the estimate has no node split,
            or naming a non-positive bandwidth / negative ``compute_s`` / ``tokens_per_rank``.
    """
    compute_s = _need_nonnegative("compute_s", compute_s)
    intra = _need_positive("intra_node_bw", intra_node_bw)
    inter = _need_positive("inter_node_bw", inter_node_bw)
    if est.spans_nodes is None:
        raise ValueError("est.ranks_per_node must be set (pass ranks_per_node to estimate()) for a time model")
    by_axis = est.by_axis()
    comm = {a: by_axis[a] / (inter if est.spans_nodes[a] else intra) for a in AXES}
    comm_s = sum(comm.values())
    step_s = compute_s + comm_s
    tps = None
    if tokens_per_rank is not None:
        tokens_per_rank = _need_positive("tokens_per_rank", tokens_per_rank)
        tps = est.world_size * tokens_per_rank / step_s if step_s > 0 else math.inf
    return StepTime(compute_s, comm, comm_s, step_s, tps)


# ---------------------------------------------------------------------- CLI
LLAMA_3_1_8B = {
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False,
}
"""Shape of Llama-3.1-8B (meta-llama/Llama-3.1-8B config.json): 8,030,261,248 parameters."""

MODELS = {"llama-3.1-8b": LLAMA_3_1_8B}

_NAMES = {"fsdp": "FSDP", "hsdp": "HSDP", "fl_fsdp": "FL+FSDP", "fl_hsdp": "FL+HSDP"}


def _gb(x: float | None) -> str:
    return "n/a" if x is None else f"{x / GB:.3f}"


def format_table(estimates: Sequence[CommEstimate], times: Sequence[StepTime] | None = None) -> str:
    """Markdown table of estimates (GB = 1e9 bytes per rank per optimizer step, sync amortized)."""
    head = ["algorithm", "F", "R", "S", "dp_shard GB", "dp_replicate GB", "fl GB", "intra-group GB",
            "inter-group GB", "intra-node GB", "inter-node GB", "total GB", "fl GB/sync"]
    if times is not None:
        head += ["comm s", "step s", "tokens/s", "speedup vs FSDP"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    base = times[0].step_s if times else None
    for i, e in enumerate(estimates):
        b = e.by_axis()
        row = [_NAMES.get(e.algorithm, e.algorithm), str(e.num_groups), str(e.replicas), str(e.shards),
               _gb(b["dp_shard"]), _gb(b["dp_replicate"]), _gb(b["fl"]), _gb(e.intra_group),
               _gb(e.inter_group), _gb(e.intra_node), _gb(e.inter_node), _gb(e.total),
               _gb(e.sync_by_axis()["fl"]) if e.algorithm.startswith("fl_") else "-"]
        if times is not None:
            t = times[i]
            row += [f"{t.comm_s:.3f}", f"{t.step_s:.3f}",
                    "n/a" if t.tokens_per_s is None else f"{t.tokens_per_s:,.0f}",
                    f"{base / t.step_s:.2f}x" if t.step_s > 0 else "inf"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fl_accel.cost_model",
        description="Per-rank communication per optimizer step of FSDP, HSDP, FL+FSDP, FL+HSDP "
                    "(ring collectives; see the module docstring for the formulas).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=float, help="raw parameter count; every unit reshards (3 x M per step)")
    src.add_argument("--model", choices=sorted(MODELS), help="built-in model shape with Accelerate's wrapping")
    src.add_argument("--llama-config", metavar="JSON", help="a LlamaConfig config.json, with Accelerate's wrapping")
    p.add_argument("--bytes-per-element", type=float, default=2, help="param all-gather bytes per element (bf16: 2)")
    p.add_argument("--grad-bytes-per-element", type=float, default=None, help="gradient reduce bytes (default: same)")
    p.add_argument("--sync-bytes-per-element", type=float, default=4, help="FL sync buffer bytes (fl_accel: fp32 = 4)")
    p.add_argument("--world-size", type=int, required=True, help="N ranks")
    p.add_argument("--group-size", type=int, required=True, help="G ranks per federation group (FL+FSDP, FL+HSDP)")
    p.add_argument("--shard-size", type=int, required=True, help="S ranks per HSDP replica (HSDP, FL+HSDP)")
    p.add_argument("--hsdp-group-size", type=int, default=None, help="G for FL+HSDP (default --group-size)")
    p.add_argument("--sync-every", type=int, default=8, help="H optimizer steps between syncs")
    p.add_argument("--ranks-per-node", type=int, default=4, help="P ranks per node (default 4, as 4xA100 nodes)")
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--total-steps", type=int, default=None, help="amortize ceil(T/H) syncs over T steps")
    p.add_argument("--no-split-replicas", action="store_true",
                   help="FL+HSDP as the reference code: every replica sends its whole shard over 'fl'")
    p.add_argument("--compute-s", type=float, default=None, help="compute seconds per step: enables the time model")
    p.add_argument("--intra-node-gbs", type=float, default=100.0, help="per-rank intra-node GB/s (time model)")
    p.add_argument("--inter-node-gbs", type=float, default=12.5, help="per-rank inter-node GB/s (time model)")
    p.add_argument("--tokens-per-rank", type=float, default=None, help="tokens per rank per step (time model)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.params is not None:
        units = units_from_param_count(args.params)
        source = f"{args.params:.4g} parameters, every unit resharded after forward"
    else:
        if args.model is not None:
            cfg = MODELS[args.model]
            name = args.model
        else:
            with open(args.llama_config, encoding="utf-8") as fh:
                cfg = json.load(fh)
            name = args.llama_config
        units = llama_units(cfg)
        source = f"{name}: {total_params(units):,} parameters in {len(units)} FSDP units (Accelerate wrapping)"
    ests = compare(
        args.world_size, units, group_size=args.group_size, shard_size=args.shard_size,
        sync_every=args.sync_every, hsdp_group_size=args.hsdp_group_size,
        param_bytes=args.bytes_per_element, grad_bytes=args.grad_bytes_per_element,
        sync_bytes=args.sync_bytes_per_element, ranks_per_node=args.ranks_per_node,
        micro_batches=args.micro_batches, split_replicas=not args.no_split_replicas,
        total_steps=args.total_steps,
    )
    times = None
    if args.compute_s is not None:
        times = [predict_step_time(e, compute_s=args.compute_s, intra_node_bw=args.intra_node_gbs * GB,
                                   inter_node_bw=args.inter_node_gbs * GB, tokens_per_rank=args.tokens_per_rank)
                 for e in ests]
    if args.json:
        out = [e.as_dict() for e in ests]
        if times:
            for d, t in zip(out, times):
                d["time"] = {"compute_s": t.compute_s, "comm_s_by_axis": t.comm_s_by_axis, "comm_s": t.comm_s,
                             "step_s": t.step_s, "tokens_per_s": t.tokens_per_s}
        print(json.dumps(out, indent=2))
        return 0
    print(f"Per-rank bytes per optimizer step, GB = 1e9 bytes; {source}; N={args.world_size}, "
          f"{args.ranks_per_node} ranks/node; params {args.bytes_per_element:g} B, grads "
          f"{args.grad_bytes_per_element or args.bytes_per_element:g} B, sync {args.sync_bytes_per_element:g} B "
          f"per element; fl amortized over H={args.sync_every}.\n")
    print(format_table(ests, times))
    if times:
        print(f"\nTime model: no compute/communication overlap; compute {args.compute_s:g} s/step; "
              f"intra-node {args.intra_node_gbs:g} GB/s, inter-node {args.inter_node_gbs:g} GB/s per rank.")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
