"""Compute per token, the accelerator's peak (what MFU is measured against), and peak memory
per rank: planning tools beside the library (the recipe reports MFU with them), not part of it.

Model FLOPs per token follow torchtitan (``models/utils.py`` ``get_nparams_and_flops``;
PaLM, Chowdhery et al. 2022, App. B): a dense matmul costs 6 FLOPs per parameter per
token in forward + backward, and causal self-attention adds 12 L h d_head T (scores and
values, forward + backward, over a sequence of T tokens)::

    flops_per_token = 6 (N - N_emb) + 12 L h d_head T

N counts every parameter once; N_emb is the input embedding, a lookup and not a
matmul. The output projection (lm_head) is a matmul and counts; when it is tied to the
input embedding it is absent from N - N_emb, so it is added back: the count is the same
for a tied and an untied model of one shape. Llama-3.1-8B at T = 2048: 48.25 GFLOP per
token.

MFU = flops_per_token x tokens/s per process / peak FLOPS of one device (dense bf16,
no sparsity), as torchtitan reports it.

Peak memory per rank (:func:`estimate`), in bytes, for FSDP2 as accelerate 1.15 applies
it (units: :func:`scripts.model_units.llama_units`) and the sync of :mod:`fl_accel.sync`.
n = this rank's local shard elements (FSDP2 pads dim 0 to a multiple of S); t = micro-batch
x seq_len tokens; p = compute bytes (2 bf16, 4 fp32); V, h, I, L, a heads, k KV heads, d head
dim. Components:

- parameters 4n (fp32 sharded master); gradients 4n (FSDP2 casts the reduced gradient to the
  parameter's dtype); AdamW m and v 8n; its step's temporaries: foreach (torch's default
  on CUDA) one fp32 copy of every shard (``_foreach_sqrt`` of v, ``torch/optim/adam.py``)
  4n, fused 0, for-loop (CPU) two of the largest local tensor;
- outer state (F > 1, ``outer_state_device="same"``; 0 with "cpu"; :class:`fl_accel.sync.
  FederatedSynchronizer`): anchor 4n ("nesterov" or a compressed ``sync_dtype``), momentum
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
  1 + 4/256 int8), and "nesterov" on fp32 means: anchor - mean, 4 n_k (with the outer
  state on the host: one anchor tensor at a time instead). With ``sync_delay`` > 0 a
  fragment's exchange stays in flight during training;
- CUDA context and NCCL: :data:`CUDA_CONTEXT_BYTES` (not in ``max_memory_allocated``).

The peak is the largest of four moments (each a sum of what lives then): "loss" (end of
forward and the loss's backward: no gradients yet, they are None after ``zero_grad``),
"backward" (the tail's reduce-scatter; with checkpointing one layer recomputed), "optimizer"
(AdamW step) and "sync" (the post-step hook, gradients still alive). Not modelled: the CUDA
caching allocator's fragmentation (:data:`ALLOCATOR_HEADROOM` in :meth:`MemoryEstimate.fits`),
backward temporaries inside a layer, ``torch.compile``'s buffers, a KV cache (training runs
with ``use_cache=False``). Llama-3.1-8B, FL+FSDP G = 4, 2 x 2048 tokens, bf16:
``python -m scripts.memory_model``.

Command line: peak accelerator memory per rank, by component and by moment, and whether it
fits a GPU. Defaults: the paper's setting (Llama-3.1-8B, FL+FSDP with G=4, micro-batch
2 x 2048 tokens, bf16 parameters and fp32 reduce, AdamW, FedAvg) on an A100-64GB::

    python -m scripts.memory_model                                 # the table and the verdict
    python -m scripts.memory_model --matrix                        # paper layouts x checkpointing x avg/nesterov
    python -m scripts.memory_model --activation-checkpointing full --outer-optimizer nesterov --outer-state-device cpu
    python -m scripts.memory_model --model llama3.2-1b --world-size 1 --group-size 1 --gpu-memory-gib 141 --json

Verdict: "fits" when the peak is at most the GPU's memory less ``--headroom`` (default
ALLOCATOR_HEADROOM, for the caching allocator), "tight" when it fits
only without that headroom, else "does not fit".
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from fl_accel.planning.cost import _int
from fl_accel.mesh import FLLayout
from scripts.model_units import LLAMA_3_1_8B, _cfg as _get, llama_units

PEAK_BF16_TFLOPS = {
    # dense bf16 tensor-core peaks from the vendors' data sheets (as torchtitan's
    # ``get_peak_flops``); the first key contained in the device name wins.
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,  # SXM (and NVL per GPU)
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 70.0,
}


def peak_tflops(device_name: str | None) -> float | None:
    """Dense bf16 peak TFLOPS of a device from its name (``torch.cuda.get_device_name()``,
    e.g. "NVIDIA H100 80GB HBM3"), or None when the name is unknown (e.g. a CPU)."""
    if not device_name:
        return None
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return value
    return None


def model_flops_per_token(config: Any, seq_len: int, num_params: int | None = None,
                          embedding_params: int | None = None) -> float:
    """Training FLOPs per token (forward + backward) of a decoder-only transformer.

    Args:
        config: a ``transformers`` config (or a mapping of its fields): ``vocab_size``,
            ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, optional
            ``head_dim`` (default hidden / heads), ``tie_word_embeddings``.
        seq_len: T, tokens per sequence.
        num_params: N, the model's parameters counted once (a tied weight once);
            default: counted by :func:`scripts.model_units.llama_units` from a Llama-shaped
            config.
        embedding_params: N_emb, the input embedding's parameters; default vocab x hidden.

    Returns:
        FLOPs per token, ``6 (N - N_emb + tied lm_head) + 12 L h d_head T``.

    Raises:
        ValueError: a missing or non-positive field, or ``seq_len < 1``.
    """
    T = _int("seq_len", seq_len)
    V, H, L, h = (_int(f"config.{k}", _get(config, k)) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"))
    d_head = _int("config.head_dim", _get(config, "head_dim", H // h))
    if num_params is None:
        num_params = sum(u.numel for u in llama_units(config))
    n_emb = V * H if embedding_params is None else embedding_params
    matmul = num_params - n_emb + (V * H if _get(config, "tie_word_embeddings", False) else 0)
    return 6.0 * matmul + 12.0 * L * h * d_head * T


def mfu(flops_per_token: float, tokens_per_s_per_process: float, peak: float | None) -> float | None:
    """Model FLOPs utilization in [0, 1]: achieved FLOPS of one process / its device's peak
    (``peak`` in TFLOPS); None when the peak is unknown."""
    if not peak:
        return None
    return flops_per_token * tokens_per_s_per_process / (peak * 1e12)


# ---------------------------------------------------------------------- memory
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
        return {"inputs": self.inputs, "phases": self.phases, "total": self.total, "peak_phase": self.peak_phase}


def estimate(config: Any, *, seq_len: int, micro_batch: int, layout: Any = None, shards: int | None = None,
             param_dtype: str = "bf16", reduce_dtype: str = "fp32", activation_checkpointing: str = "none",
             attention: str = "sdpa", optimizer: str = "foreach", outer_optimizer: str = "avg",
             sync_dtype: str = "fp32", error_feedback: bool = False, outer_state_device: str = "same",
             sync_bucket_mb: int = 256, num_fragments: int = 1, sync_delay: int = 0,
             gradient_accumulation_steps: int = 1, accelerator: str = "cuda", units: Any = None,
             buckets_in_flight: int | None = SYNC_BUCKETS_IN_FLIGHT) -> MemoryEstimate:
    """Peak accelerator memory of one rank, in bytes, by component and moment (module docstring).

    Args:
        config: Llama-shaped ``transformers`` config or mapping (as :func:`model_flops_per_token`,
            plus ``intermediate_size``, ``num_key_value_heads``).
        seq_len, micro_batch: tokens per sequence and sequences per forward (t = their product).
        layout: an :class:`fl_accel.mesh.FLLayout` (S, F and R_min from it); or ``shards`` S
            alone (one group, no sync).
        param_dtype, reduce_dtype: "bf16" | "fp32": FSDP2's compute (gathered parameters,
            activations, logits) and gradient reduce-scatter dtypes.
        activation_checkpointing: "none" | "full". attention: "sdpa" | "eager".
        optimizer: AdamW's implementation: "foreach" | "fused" | "for-loop".
        outer_optimizer, sync_dtype, error_feedback, outer_state_device, sync_bucket_mb,
            num_fragments, sync_delay: as :class:`fl_accel.config.FLConfig`.
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
                          ("sync_dtype", ("fp32", "bf16", "int8")), ("outer_state_device", ("same", "cpu")),
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
        inflight = 4 * held * (1 + 1 / C if C > 1 and not compressed else 1) + 3 * q * held / C
        host = outer_state_device == "cpu" and (outer_optimizer == "nesterov" or compressed)
        sync = inflight + 4 * nk * (outer_optimizer == "nesterov" and not compressed and not host) \
            + 4 * biggest * host * (1 + bool(error_feedback))  # one anchor (residual) tensor copied at a time
        inflight = inflight if _int("sync_delay", sync_delay, minimum=0) else 0.0
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
    or ``anchor_device`` before its rename); ``kw`` gives the rest and overrides."""

    names = ("outer_optimizer", "sync_dtype", "error_feedback", "sync_bucket_mb", "num_fragments", "sync_delay")
    fields = {n: getattr(fl, n) for n in names}
    fields["outer_state_device"] = getattr(fl, "outer_state_device", getattr(fl, "anchor_device", "same"))
    return estimate(model_config, layout=FLLayout.from_config(fl, world_size), **{**fields, **kw})


# ---------------------------------------------------------------------- command line

GIB = 2**30
PAPER_LAYOUTS = {"FL+FSDP G=4": (512, 4, 4), "FL+HSDP G=32 S=4": (512, 32, 4)}
"""The paper's layouts (Sec. 4): (world size, group size G, shard size S) on 128 nodes x 4 GPUs."""


def _fail(message: Any):
    print(f"error: {message}", file=sys.stderr)  # bad input: one line, exit status 2
    raise SystemExit(2)


def model_config(name: str | None) -> tuple[Any, str]:
    """Llama-3.1-8B by default; a preset of recipes/modeling.py (not ``tiny``: its vocabulary
    follows the tokenizer) or a config.json path."""
    if name is None:
        return LLAMA_3_1_8B, "Llama-3.1-8B"
    from recipes.modeling import PRESETS

    if name in PRESETS and "vocab_size" in PRESETS[name]:
        return PRESETS[name], name
    try:
        with open(name, encoding="utf-8") as fh:
            return json.load(fh), name
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model {name!r} is neither a preset with a vocabulary "
                         f"{[k for k, v in PRESETS.items() if 'vocab_size' in v]} nor a readable config.json: {exc}")


def verdict(total: float, gpu_bytes: float, headroom: float) -> str:
    if total <= gpu_bytes * (1 - headroom):
        return "fits"
    return "tight" if total <= gpu_bytes else "does not fit"


def layout_of(world: int, group: int, shards: int | None) -> FLLayout:
    N, G = _int("--world-size", world), _int("--group-size", group)
    S = G if shards is None else _int("--shard-size", shards)
    if N % G or G % S:
        raise ValueError(f"--group-size {G} must divide --world-size {N}, and --shard-size {S} the group size")
    return FLLayout.equal(N // G, G // S, S)


def matrix(config: Any, kw: dict, gpu_bytes: float, headroom: float) -> list[dict]:
    """The paper's layouts x checkpointing none/full x outer optimizer avg/nesterov x outer
    state on the GPU or the host; one row each with the peak, its moment and the verdict."""
    rows = []
    for name, (world, group, shards) in PAPER_LAYOUTS.items():
        for ac in ("none", "full"):
            for outer in ("avg", "nesterov"):
                for device in (("same",) if outer == "avg" else ("same", "cpu")):
                    est = estimate(config, layout=layout_of(world, group, shards), **{
                        **kw, "activation_checkpointing": ac, "outer_optimizer": outer, "outer_state_device": device})
                    rows.append({"layout": name, "activation_checkpointing": ac, "outer_optimizer": outer,
                                 "outer_state_device": device, "peak_gib": est.total / GIB,
                                 "peak_phase": est.peak_phase, "verdict": verdict(est.total, gpu_bytes, headroom)})
    return rows


def matrix_markdown(rows: list[dict], gpu_gib: float, headroom: float) -> str:
    lines = [f"| layout | activation checkpointing | outer optimizer | outer state | peak (GiB) | at | "
             f"{gpu_gib:g} GiB, {headroom:.0%} headroom |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['activation_checkpointing']} | {r['outer_optimizer']} | "
                     f"{'GPU' if r['outer_state_device'] == 'same' else 'host'} | {r['peak_gib']:.1f} | "
                     f"{r['peak_phase']} | {r['verdict']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Defaults: the paper's setting (FL+FSDP G=4 on A100-64GB)."""
    p = argparse.ArgumentParser(prog="python -m scripts.memory_model", description=__doc__.split("\n\n")[0])
    p.error = _fail
    p.add_argument("--model", default=None, help="preset (llama3.1-8b, llama3.2-1b) or config.json "
                                                 "(default: Llama-3.1-8B)")
    for flag, kind, default, text in [
            ("world-size", int, 512, "N"), ("group-size", int, 4, "G"), ("shard-size", int, None, "S (default G)"),
            ("seq-len", int, 2048, "tokens per sequence"), ("micro-batch", int, 2, "sequences per forward"),
            ("sync-bucket-mb", int, 256, "FLConfig.sync_bucket_mb"), ("num-fragments", int, 1, "P"),
            ("sync-delay", int, 0, "tau"), ("gradient-accumulation-steps", int, 1, ""),
            ("gpu-memory-gib", float, 64.0, "GPU memory (A100-64GB)"),
            ("headroom", float, ALLOCATOR_HEADROOM, "share kept free for the allocator")]:
        p.add_argument("--" + flag, type=kind, default=default, help=f"{text} (default: %(default)s)")
    for flag, choices in [("param-dtype", ("bf16", "fp32")), ("reduce-dtype", ("fp32", "bf16")),
                          ("activation-checkpointing", ("none", "full")), ("attention", ("sdpa", "eager")),
                          ("optimizer", ("foreach", "fused", "for-loop")), ("outer-optimizer", ("avg", "nesterov")),
                          ("sync-dtype", ("fp32", "bf16", "int8")), ("outer-state-device", ("same", "cpu")),
                          ("accelerator", ("cuda", "cpu"))]:
        p.add_argument("--" + flag, choices=choices, default=choices[0], help="(default: %(default)s)")
    p.add_argument("--error-feedback", action="store_true")
    p.add_argument("--matrix", action="store_true", help="the paper's layouts x checkpointing x avg/nesterov")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        config, name = model_config(a.model)
        gpu = a.gpu_memory_gib * GIB
        if not gpu > 0 or not 0 <= a.headroom < 1:
            raise ValueError(f"need --gpu-memory-gib > 0 and 0 <= --headroom < 1, got {a.gpu_memory_gib}, {a.headroom}")
        kw = dict(seq_len=a.seq_len, micro_batch=a.micro_batch, param_dtype=a.param_dtype, reduce_dtype=a.reduce_dtype,
                  attention=a.attention, optimizer=a.optimizer, sync_dtype=a.sync_dtype,
                  error_feedback=a.error_feedback, sync_bucket_mb=a.sync_bucket_mb, num_fragments=a.num_fragments,
                  sync_delay=a.sync_delay, gradient_accumulation_steps=a.gradient_accumulation_steps,
                  accelerator=a.accelerator)
        if a.matrix:
            rows = matrix(config, kw, gpu, a.headroom)
            print(json.dumps(rows, indent=1) if a.json else
                  f"{name}, micro-batch {a.micro_batch} x {a.seq_len}, {a.param_dtype} (reduce {a.reduce_dtype}), "
                  f"AdamW {a.optimizer}\n\n" + matrix_markdown(rows, a.gpu_memory_gib, a.headroom))
            return 0
        layout = layout_of(a.world_size, a.group_size, a.shard_size)
        est = estimate(config, layout=layout, activation_checkpointing=a.activation_checkpointing,
                       outer_optimizer=a.outer_optimizer, outer_state_device=a.outer_state_device, **kw)
    except ValueError as exc:
        _fail(exc)
    answer = verdict(est.total, gpu, a.headroom)
    if a.json:
        print(json.dumps({"model": name, "layout": layout.as_dict(), **est.as_dict(), "gpu_memory_bytes": gpu,
                          "headroom": a.headroom, "verdict": answer}, indent=1))
        return 0
    print(f"{name}, {layout.describe()}, micro-batch {a.micro_batch} x {a.seq_len}, {a.param_dtype} "
          f"(reduce {a.reduce_dtype}), checkpointing {a.activation_checkpointing}, outer {a.outer_optimizer} "
          f"(state: {a.outer_state_device}), AdamW {a.optimizer}; GiB per rank at each moment:\n")
    print(est.table())
    usable = gpu * (1 - a.headroom)
    print(f"\npeak {est.total / GIB:.1f} GiB ({est.peak_phase}); {a.gpu_memory_gib:g} GiB GPU, {a.headroom:.0%} "
          f"headroom -> {usable / GIB:.1f} GiB usable: {answer} (margin {(usable - est.total) / GIB:+.1f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
