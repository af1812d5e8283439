"""Peak accelerator memory of one rank in a training step: an analytic model (no torch).

Peak memory per rank (:func:`estimate`), in bytes, for FSDP2 as accelerate 1.15 applies
it (units: :func:`fl_accel.planning.units.llama_units`) and the sync of :mod:`fl_accel.sync`.
n = this rank's local shard elements (FSDP2 pads dim 0 to a multiple of S); t = micro-batch
x seq_len tokens; p = compute bytes (2 bf16, 4 fp32); V, h, I, L, a heads, k KV heads, d head
dim. Components:

- parameters 4n (fp32 sharded master); gradients 4n (FSDP2 casts the reduced gradient to the
  parameter's dtype); AdamW m and v 8n; its step's temporaries: foreach (torch's default
  on CUDA) one fp32 copy of every shard (``_foreach_sqrt`` of v, ``torch/optim/adam.py``)
  4n, fused 0, for-loop (CPU) two of the largest local tensor;
- outer state (F > 1, ``outer_state_device="same"``; 0 with "cpu"; :class:`fl_accel.sync.
  Synchronizer`): anchor 4n ("nesterov" or a compressed ``sync_dtype``), momentum
  4n ("nesterov"), residuals 4n (``error_feedback`` with a compressed ``sync_dtype``);
- activations, the tensors autograd saves per decoder layer (counted tensor by tensor with
  ``saved_tensors_hooks`` on transformers 5 ``modeling_llama``; the method of Korthikanti et
  al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4, adapted
  to Llama: RMSNorm saves its fp32 input and two normalized copies, SwiGLU four t x I tensors,
  GQA keeps k and v at k heads, no dropout)::

      sdpa (flash, cuDNN, CPU flash): t [(8 + 4p) h + 2p a d + 2p k d + 4p I + 4a]
      eager (scores materialized):    t [(8 + 4p) h + 4p a d + 4p I] + (4 + p) b a s^2 (4 b a s^2 in fp32)

  x L, plus the final norm t h (4 + 2p). Full checkpointing (non-reentrant, per layer)
  keeps each layer's input, L t h p, and recomputes one layer at a time in the backward;
- loss: the logits t V p, held by the recipe's output until the next forward, and at the
  loss's backward the fp32 log-softmax, its gradient and the nll gradient: (p + 12) t V
  (transformers' ``ForCausalLMLoss`` upcasts, then ``cross_entropy``);
- FSDP2 buffers (torch 2.13 ``fully_shard``): gathered units in p. The tail [norm, lm_head]
  is not resharded after forward and stays gathered until its backward; when its gradients
  are reduced the last layer is prefetched. A reduce-scatter holds the unit's unsharded
  gradients (p), their copy in the reduce dtype r and the shard out: (p + r (1 + 1/S)) x
  unit, counted for the largest unit (the tail at 8B; a middle layer's moment is smaller);
- sync (per fragment of n_k local elements, C = R_min chunks): the exchange's fp32 buffer
  4 n_k (``sync_bucket_mb`` buckets, all packed at once; ``buckets_in_flight`` bounds it),
  a chunk copy 4 n_k / C (fp32, C > 1) or the quantized copies 3 b n_k / C (b = 2 bf16,
  1 + 4/256 int8; F + 1 of them with ``sync_collectives`` "all_gather"; "sparse": 12 n_k / C for |x|, the dense sent values and the residual's
  difference, plus F + 1 payloads of :func:`fl_accel.wire.sparse_bytes`, the gathered
  ones and this rank's), and "nesterov" on fp32 means: anchor - mean, 4 n_k (with the outer
  state on the host: one anchor tensor at a time instead). With ``sync_delay`` > 0 a
  fragment's exchange stays in flight during training, up to m = min(P, ceil(tau P / H)) of
  them at once (m x the buffers of the largest fragment); with ``delayed_local_steps="keep"``
  each rank also keeps its fp32 parameters at each launch, 4 n_k per fragment in flight (in
  the outer state, on ``outer_state_device``). The warm-up (``sync_warmup_steps``) exchanges
  the gradients in fp32 buckets like a blocking sync, after the backward: within the "sync" moment;
- CUDA context and NCCL: :data:`CUDA_CONTEXT_BYTES` (not in ``max_memory_allocated``).

The peak is the largest of four moments (each a sum of what lives then): "loss" (end of
forward and the loss's backward: no gradients yet, they are None after ``zero_grad``),
"backward" (the tail's reduce-scatter; with checkpointing one layer recomputed), "optimizer"
(AdamW step) and "sync" (the post-step hook, gradients still alive). Not modelled: the CUDA
caching allocator's fragmentation (:data:`ALLOCATOR_HEADROOM` in :meth:`MemoryEstimate.fits`),
backward temporaries inside a layer, ``torch.compile``'s buffers, a KV cache (training runs
with ``use_cache=False``). Llama-3.1-8B, FL+FSDP G = 4, 2 x 2048 tokens, bf16:
``python -m scripts.memory_model`` (the command line, with a verdict for a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import math

from fl_accel.mesh import FLLayout
from fl_accel.planning.cost import _int
from fl_accel.planning.units import config_value as _get, llama_units
from fl_accel.wire import SPARSE_BLOCK, collectives, sparse_bytes

CUDA_CONTEXT_BYTES = 2 * 2**30
"""CUDA context, cuBLAS/cuDNN workspaces and NCCL communicator buffers per rank on a GPU (an
estimate: FACTS "Memory at the paper's setting"; outside ``max_memory_allocated``)."""
ALLOCATOR_HEADROOM = 0.10
"""Share of the device kept free by :meth:`MemoryEstimate.fits` for the caching allocator's
fragmentation and cached blocks (an assumption, to be calibrated by ``bench/gpu_check.sh``)."""
SYNC_BUCKETS_IN_FLIGHT: int | None = 2
"""Buckets a blocking exchange holds at once (``fl_accel.exchange.Exchange.run`` packs bucket
k+1 before completing bucket k); None = the whole fragment. A delayed exchange
(``sync_delay > 0``) packs every bucket of the fragment at once whatever this says."""
COMPONENTS = ("parameters", "gradients", "optimizer_state", "optimizer_temporaries", "outer_state", "activations",
              "loss", "fsdp_buffers", "sync_buffers", "cuda_context")
_BYTES = {"bf16": 2, "fp32": 4}


@dataclass(frozen=True)
class MemoryEstimate:
    """What :func:`estimate` returns. ``phases[phase][component]``: bytes live at that moment
    (module docstring); ``total``: the largest phase sum, at ``peak_phase``; ``components``:
    the peak phase's dict."""

    phases: dict
    inputs: dict

    total = property(lambda self: max(sum(c.values()) for c in self.phases.values()))
    peak_phase = property(lambda self: max(self.phases, key=lambda k: sum(self.phases[k].values())))
    components = property(lambda self: self.phases[self.peak_phase])

    def fits(self, gpu_memory_bytes: float, headroom: float = ALLOCATOR_HEADROOM) -> bool:
        """True when ``total`` <= ``gpu_memory_bytes`` x (1 - ``headroom``). Raises ValueError
        for a non-positive memory or a headroom outside [0, 1)."""
        if not gpu_memory_bytes > 0 or not 0 <= headroom < 1:
            raise ValueError(f"need gpu_memory_bytes > 0 and 0 <= headroom < 1, got {gpu_memory_bytes}, {headroom}")
        return self.total <= gpu_memory_bytes * (1 - headroom)

    def table(self, unit: float = 2**30) -> str:
        """Markdown: one row per component, one column per phase (GiB by default); the peak's
        column is marked with *."""
        names = [k for k in COMPONENTS if any(c.get(k) for c in self.phases.values())]
        head = [f"{p}{'*' if p == self.peak_phase else ''}" for p in self.phases]
        rows = [f"| component | {' | '.join(head)} |", "|---" * (len(head) + 1) + "|"]
        for n in names + ["total"]:
            vals = [sum(c.values()) if n == "total" else c.get(n, 0.0) for c in self.phases.values()]
            rows.append(f"| {n} | " + " | ".join(f"{v / unit:.2f}" for v in vals) + " |")
        return "\n".join(rows)

    def as_dict(self) -> dict:
        """JSON-ready: ``{"inputs", "phases" (bytes), "total" (bytes), "peak_phase"}``."""
        return {"inputs": self.inputs, "phases": self.phases, "total": self.total, "peak_phase": self.peak_phase}


def estimate(config: Any, *, seq_len: int, micro_batch: int, layout: Any = None, shards: int | None = None,
             param_dtype: str = "bf16", reduce_dtype: str = "fp32", activation_checkpointing: str = "none",
             attention: str = "sdpa", optimizer: str = "foreach", outer_optimizer: str = "avg",
             sync_dtype: str = "fp32", error_feedback: bool = False, outer_state_device: str = "same",
             sync_bucket_mb: int = 256, num_fragments: int = 1, sync_delay: int = 0, sync_every: int = 8,
             sync_density: float = 1 / 64, sync_value_bits: int = 2, delayed_local_steps: str = "discard",
             sync_collectives: str = "auto", gradient_accumulation_steps: int = 1, accelerator: str = "cuda", units: Any = None,
             buckets_in_flight: int | None = SYNC_BUCKETS_IN_FLIGHT) -> MemoryEstimate:
    """Peak accelerator memory of one rank, in bytes, by component and moment (module docstring).

    Args:
        config: Llama-shaped ``transformers`` config or mapping (as :func:`fl_accel.planning.flops.model_flops_per_token`,
            plus ``intermediate_size``, ``num_key_value_heads``).
        seq_len, micro_batch: tokens per sequence and sequences per forward (t = their product).
        layout: an :class:`fl_accel.mesh.FLLayout` (S, F and R_min from it); or ``shards`` S
            alone (one group, no sync).
        param_dtype, reduce_dtype: "bf16" | "fp32": FSDP2's compute (gathered parameters,
            activations, logits) and gradient reduce-scatter dtypes.
        activation_checkpointing: "none" | "full". attention: "sdpa" | "eager".
        optimizer: AdamW's implementation: "foreach" | "fused" | "for-loop".
        outer_optimizer, sync_dtype, error_feedback, outer_state_device, sync_bucket_mb,
            num_fragments, sync_delay, sync_every, sync_density, sync_value_bits, delayed_local_steps,
            sync_collectives:
            as :class:`fl_accel.config.FLConfig` (H only counts the exchanges in flight).
        gradient_accumulation_steps: > 1 keeps gradients alive through the next forward.
        accelerator: "cuda" (adds :data:`CUDA_CONTEXT_BYTES`) | "cpu".
        units: :class:`fl_accel.planning.cost.ShardUnit` list (default ``llama_units(config)``).
        buckets_in_flight: exchange buckets alive at once (None: the whole fragment).

    Raises:
        ValueError: naming the argument or config field (bad choice, size < 1, no layout).
    """
    inputs = {k: v for k, v in locals().items() if k not in ("config", "layout", "units")}  # the arguments
    b, T = _int("micro_batch", micro_batch), _int("seq_len", seq_len)
    V, H, I, L, a = (_int(f"config.{k}", _get(config, k)) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"))
    k = _int("config.num_key_value_heads", _get(config, "num_key_value_heads", a))
    d = _int("config.head_dim", _get(config, "head_dim", H // a))
    for name, allowed in (("param_dtype", _BYTES), ("reduce_dtype", _BYTES),
                          ("activation_checkpointing", ("none", "full")), ("attention", ("sdpa", "eager")),
                          ("optimizer", ("foreach", "fused", "for-loop")), ("outer_optimizer", ("avg", "nesterov")),
                          ("sync_dtype", ("fp32", "bf16", "int8", "sparse")), ("outer_state_device", ("same", "cpu")),
                          ("delayed_local_steps", ("discard", "keep")),
                          ("accelerator", ("cuda", "cpu"))):
        if inputs[name] not in allowed:
            raise ValueError(f"{name} must be one of {list(allowed)}, got {inputs[name]!r}")
    p, r = _BYTES[param_dtype], _BYTES[reduce_dtype]
    ac = activation_checkpointing == "full"
    if layout is not None:
        S, F, C = layout.shards, layout.num_groups, layout.min_replicas
    elif shards is not None:
        S, F, C = _int("shards", shards), 1, 1
    else:
        raise ValueError("give layout (an FLLayout) or shards (S)")
    P, A = _int("num_fragments", num_fragments), _int("gradient_accumulation_steps", gradient_accumulation_steps)
    units = list(units) if units is not None else llama_units(config)
    if P > len(units):
        raise ValueError(f"num_fragments={P} exceeds the {len(units)} FSDP units")
    local = [sum(u.local_sizes(S)) for u in units]
    n, t, biggest = sum(local), b * T, max(max(u.local_sizes(S)) for u in units)  # biggest: one tensor
    gathered = {u.name: p * u.padded_numel(S) for u in units}
    tail = gathered.get("tail", 0)
    tail_local = next((n_ for u, n_ in zip(units, local) if u.name == "tail"), 0)
    layer = max((v for name, v in gathered.items() if name not in ("tail", "embed", "root")), default=0)
    reduce = max((p + r * (1 + 1 / S)) * u.padded_numel(S) for u in units) if S > 1 else 0

    # activations saved for the backward, per layer; the final norm; the loss path
    if attention == "sdpa":
        per_layer = t * ((8 + 4 * p) * H + 2 * p * a * d + 2 * p * k * d + 4 * p * I + 4 * a)
    else:
        per_layer = t * ((8 + 4 * p) * H + 4 * p * a * d + 4 * p * I) + (4 + p * (p < 4)) * b * a * T * T
    saved = (L * t * H * p if ac else L * per_layer) + t * H * (4 + 2 * p)
    logits = p * t * V

    # outer state and sync buffers (fl_accel.sync / fl_accel.exchange)
    compressed, federated = sync_dtype != "fp32", F > 1
    outer = 0.0
    if federated and outer_state_device == "same":
        outer = 4 * n * ((outer_optimizer == "nesterov" or compressed) + (outer_optimizer == "nesterov")
                         + (compressed and bool(error_feedback)))
    sync, inflight = 0.0, 0.0
    if federated:
        nk = max(sum(local[i::P]) for i in range(P))
        held = nk if buckets_in_flight is None or sync_delay else \
            min(nk, _int("buckets_in_flight", buckets_in_flight) * _int("sync_bucket_mb", sync_bucket_mb) * 2**18)
        q = {"bf16": 2.0, "int8": 1 + 4 / 256}.get(sync_dtype, 0.0)
        copies = F + 1 if q and collectives(sync_collectives, F) == "all_gather" else 3  # sent + gathered
        inflight = 4 * held * (1 + 1 / C if C > 1 and not compressed else 1) + copies * q * held / C
        if sync_dtype == "sparse":  # held / C values per chunk, padded to whole 4096-value blocks
            chunk = math.ceil(held / C / SPARSE_BLOCK) * SPARSE_BLOCK
            inflight += 12 * held / C + (F + 1) * sparse_bytes(chunk, sync_density, sync_value_bits)
        tau, H = _int("sync_delay", sync_delay, minimum=0), _int("sync_every", sync_every)
        flying = min(P, math.ceil(tau * P / H)) if tau else 0  # exchanges in flight at once
        host = outer_state_device == "cpu" and (outer_optimizer == "nesterov" or compressed)
        sync = inflight * max(1, flying) + 4 * nk * (outer_optimizer == "nesterov" and not compressed and not host) \
            + 4 * biggest * host * (1 + bool(error_feedback))  # one anchor (residual) tensor copied at a time
        inflight *= flying
        if delayed_local_steps == "keep" and outer_state_device == "same":
            outer += 4 * nk * flying
    temps = {"foreach": 4 * n, "fused": 0, "for-loop": 8 * biggest}[optimizer]
    grads = 4 * n
    base = {"parameters": 4 * n, "optimizer_state": 8 * n, "outer_state": outer}
    context = {"cuda_context": CUDA_CONTEXT_BYTES if accelerator == "cuda" else 0}
    early_grads = grads if A > 1 else 0.0
    phases = {
        "loss": {**base, "gradients": early_grads, "activations": saved, "loss": logits + 12 * t * V,
                 "fsdp_buffers": tail, "sync_buffers": inflight, **context},
        "backward": {**base, "gradients": early_grads or 4 * tail_local,
                     "activations": saved + (per_layer if ac else 0), "loss": logits,
                     "fsdp_buffers": tail + layer + reduce, "sync_buffers": inflight, **context},
        "optimizer": {**base, "gradients": grads, "optimizer_temporaries": temps, "loss": logits,
                      "sync_buffers": inflight, **context},
    }
    if federated:
        phases["sync"] = {**base, "gradients": grads, "loss": logits, "sync_buffers": sync, **context}
    inputs.update(shards=S, num_groups=F, local_shard_elements=n)
    return MemoryEstimate({k2: {c: float(ph.get(c, 0)) for c in COMPONENTS} for k2, ph in phases.items()}, inputs)


def estimate_for_run(model_config: Any, fl: Any, world_size: int, **kw: Any) -> MemoryEstimate:
    """:func:`estimate` for an :class:`fl_accel.config.FLConfig` on ``world_size`` ranks: the
    layout (``FLLayout.from_config``) and the sync fields come from ``fl`` (``outer_state_device``,
    or ``anchor_device`` before its rename); ``kw`` gives the rest and overrides.

    Raises:
        ValueError: as :func:`estimate`, or ``world_size`` not a layout of ``fl``
            (``FLLayout.from_config``).
    """

    names = ("outer_optimizer", "sync_dtype", "error_feedback", "sync_bucket_mb", "num_fragments", "sync_delay",
             "sync_every", "sync_density", "sync_value_bits", "delayed_local_steps", "sync_collectives")
    fields = {n: getattr(fl, n) for n in names if hasattr(fl, n)}
    fields["outer_state_device"] = getattr(fl, "outer_state_device", getattr(fl, "anchor_device", "same"))
    return estimate(model_config, layout=FLLayout.from_config(fl, world_size), **{**fields, **kw})
