"""Peak accelerator memory per rank, by component and by moment, and whether it fits a GPU.

The command line of the memory model: the model and its method are in
:mod:`fl_accel.planning.memory` (FLOPs per token and MFU: :mod:`fl_accel.planning.flops`).
Defaults: the paper's setting (Llama-3.1-8B, FL+FSDP with G=4, micro-batch 2 x 2048 tokens,
bf16 parameters and fp32 reduce, AdamW, FedAvg) on an A100-64GB::

    python -m scripts.memory_model                                 # the table and the verdict
    python -m scripts.memory_model --matrix                        # paper layouts x checkpointing x avg/nesterov
    python -m scripts.memory_model --activation-checkpointing full --outer-optimizer nesterov --outer-state-device cpu
    python -m scripts.memory_model --model llama3.2-1b --world-size 1 --group-size 1 --gpu-memory-gib 141 --json
    python -m scripts.memory_model --sync-dtype int8 --num-fragments 2 --sync-every 16 --sync-delay 16 \
        --delayed-local-steps keep             # overlap: 2 fragments in flight, +4 bytes/parameter each

Verdict (:func:`fl_accel.planning.fit.verdict`): "does not fit" when the peak exceeds the
GPU's memory less ``--headroom`` (default ALLOCATOR_HEADROOM, for the caching allocator);
"tight" when it fits with a margin under TIGHT_MARGIN of the GPU's memory; else "fits". When
it does not fit the command names the smallest changes that make it fit (activation
checkpointing, the outer state on the host, a smaller micro-batch with more accumulation,
larger groups or shards: :func:`fl_accel.planning.fit.smallest_fixes`), as flags of this
command, and exits with status 1; 0 otherwise (``--matrix``: always 0, it surveys options);
2 with one ``error:`` line for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from fl_accel.planning.cost import _int
from fl_accel.mesh import FLLayout
from fl_accel.planning.fit import TIGHT_MARGIN, smallest_fixes
from fl_accel.planning.fit import verdict as _verdict
from fl_accel.planning.memory import ALLOCATOR_HEADROOM, estimate
from fl_accel.planning.units import LLAMA_3_1_8B
from scripts.cli import fail

GIB = 2**30
PAPER_LAYOUTS = {"FL+FSDP G=4": (512, 4, 4), "FL+HSDP G=32 S=4": (512, 32, 4)}
"""The paper's layouts (Sec. 4): (world size, group size G, shard size S) on 128 nodes x 4 GPUs."""


def model_config(name: str | None) -> tuple[Any, str]:
    """``(config, display name)``: Llama-3.1-8B by default; a preset of recipes/modeling.py
    or its short name (``PRESET_ALIASES``: ``llama-8b``, as scripts.link_guide takes it; not
    ``tiny``: its vocabulary follows the tokenizer) or a config.json path.

    Raises:
        ValueError: neither a preset with a vocabulary nor a readable config.json.
    """
    if name is None:
        return LLAMA_3_1_8B, "Llama-3.1-8B"
    from recipes.modeling import PRESET_ALIASES, PRESETS, preset_name

    preset = preset_name(name)
    if preset is not None and "vocab_size" in PRESETS[preset]:
        return PRESETS[preset], preset
    try:
        with open(name, encoding="utf-8") as fh:
            return json.load(fh), name
    except (OSError, ValueError) as exc:
        names = [k for k, v in PRESETS.items() if "vocab_size" in v]
        names += [k for k, v in PRESET_ALIASES.items() if v in names]
        raise ValueError(f"--model {name!r} is neither a preset with a vocabulary {sorted(names)} nor a readable "
                         f"config.json: {exc}")


def verdict(total: float, gpu_bytes: float, headroom: float) -> str:
    """:func:`fl_accel.planning.fit.verdict`: "fits", "tight" or "does not fit"."""
    return _verdict(total, gpu_bytes, headroom)


FLAGS = {"activation_checkpointing": "--activation-checkpointing", "outer_state_device": "--outer-state-device",
         "micro_batch": "--micro-batch", "gradient_accumulation_steps": "--gradient-accumulation-steps",
         "group_size": "--group-size", "shards": "--shard-size"}
"""The flag of this command for each setting a :class:`~fl_accel.planning.fit.MemoryFix` changes."""


def fix_text(changes: dict, flags: dict = FLAGS) -> str:
    """``--activation-checkpointing full --group-size 8``: a fix as flags."""
    return " ".join(f"{flags[k]} {v}" for k, v in changes.items())


def layout_of(world: int, group: int, shards: int | None) -> FLLayout:
    """The equal layout of N = ``world`` ranks in groups of G = ``group``, sharded over S =
    ``shards`` (default G). ValueError: a size < 1, or G not dividing N, or S not dividing G."""
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
    p.error = fail
    p.add_argument("--model", default=None, help="preset (llama3.1-8b or llama-8b, llama3.2-1b or llama-1b) or "
                                                 "config.json (default: Llama-3.1-8B)")
    for flag, kind, default, text in [
            ("world-size", int, 512, "N"), ("group-size", int, 4, "G"), ("shard-size", int, None, "S (default G)"),
            ("seq-len", int, 2048, "tokens per sequence"), ("micro-batch", int, 2, "sequences per forward"),
            ("sync-bucket-mb", int, 256, "FLConfig.sync_bucket_mb"), ("num-fragments", int, 1, "P"),
            ("sync-delay", int, 0, "tau"), ("sync-every", int, 8, "H (with tau: the exchanges in flight)"),
            ("gradient-accumulation-steps", int, 1, ""),
            ("sync-density", float, 1 / 64, "FLConfig.sync_density (sparse)"),
            ("sync-value-bits", int, 2, "FLConfig.sync_value_bits (sparse)"),
            ("gpu-memory-gib", float, 64.0, "GPU memory (A100-64GB)"),
            ("headroom", float, ALLOCATOR_HEADROOM, "share kept free for the allocator")]:
        p.add_argument("--" + flag, type=kind, default=default, help=f"{text} (default: %(default)s)")
    for flag, choices in [("param-dtype", ("bf16", "fp32")), ("reduce-dtype", ("fp32", "bf16")),
                          ("activation-checkpointing", ("none", "full")), ("attention", ("sdpa", "eager")),
                          ("optimizer", ("foreach", "fused", "for-loop")), ("outer-optimizer", ("avg", "nesterov")),
                          ("sync-dtype", ("fp32", "bf16", "int8", "sparse")), ("outer-state-device", ("same", "cpu")),
                          ("accelerator", ("cuda", "cpu")), ("delayed-local-steps", ("discard", "keep")),
                          ("sync-collectives", ("auto", "all_to_all", "all_gather"))]:
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
                  sync_delay=a.sync_delay, sync_every=a.sync_every, delayed_local_steps=a.delayed_local_steps,
                  gradient_accumulation_steps=a.gradient_accumulation_steps,
                  sync_density=a.sync_density, sync_value_bits=a.sync_value_bits,
                  sync_collectives=a.sync_collectives, accelerator=a.accelerator)
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
        fail(exc)
    answer = verdict(est.total, gpu, a.headroom)
    fixes = []
    if answer == "does not fit":
        fixes = smallest_fixes(config, gpu, a.headroom, layout=layout, activation_checkpointing=a.activation_checkpointing,
                               outer_optimizer=a.outer_optimizer, outer_state_device=a.outer_state_device, **kw)
    status = 1 if answer == "does not fit" else 0
    if a.json:
        print(json.dumps({"model": name, "layout": layout.as_dict(), **est.as_dict(), "gpu_memory_bytes": gpu,
                          "headroom": a.headroom, "verdict": answer,
                          "fixes": [{"changes": f.changes, "flags": fix_text(f.changes), "total": f.total,
                                     "verdict": f.verdict, "note": f.note} for f in fixes]}, indent=1))
        return status
    print(f"{name}, {layout.describe()}, micro-batch {a.micro_batch} x {a.seq_len}, {a.param_dtype} "
          f"(reduce {a.reduce_dtype}), checkpointing {a.activation_checkpointing}, outer {a.outer_optimizer} "
          f"(state: {a.outer_state_device}), AdamW {a.optimizer}; GiB per rank at each moment:\n")
    print(est.table())
    usable = gpu * (1 - a.headroom)
    print(f"\npeak {est.total / GIB:.1f} GiB ({est.peak_phase}); {a.gpu_memory_gib:g} GiB GPU, {a.headroom:.0%} "
          f"headroom -> {usable / GIB:.1f} GiB usable: {answer} (margin {(usable - est.total) / GIB:+.1f} GiB)")
    if answer == "tight":
        print(f"tight: less than {TIGHT_MARGIN:.0%} of the GPU left beyond the headroom; the model's activations are "
              f"an estimate (+-30% at 8B): a run may still run out of memory")
    if fixes:
        print("fits with (the smallest changes found; each line alone):")
        for f in fixes[:4]:
            print(f"  {fix_text(f.changes)}: peak {f.total / GIB:.1f} GiB ({f.verdict}"
                  + (f"; {f.note})" if f.note else ")"))
    elif answer == "does not fit":
        print("no single change tried makes it fit (activation checkpointing, the outer state on the host, a smaller "
              "micro-batch, larger groups or shards, and their combinations): a larger GPU or a smaller model")
    return status


if __name__ == "__main__":
    sys.exit(main())
