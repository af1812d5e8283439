"""Before a CUDA run prepares its model: will it fit? (``--memory_check``, docs/gpus_and_memory.md)

The memory model's verdict (:func:`fl_accel.planning.fit.verdict`) for the run's model,
layout, precision, checkpointing, micro-batch and sync settings, against the smallest GPU
memory of the world (one all-reduce, so every rank decides alike). "does not fit": with
``--memory_check refuse`` (the default) a RecipeError on every rank naming the smallest
changes that make it fit, as recipe flags (:func:`fl_accel.planning.fit.smallest_fixes`);
``warn`` prints the same and goes on; "tight" is a warning. Off CUDA (no GPU memory to
exceed) and with ``--memory_check off`` nothing is checked.
"""

from __future__ import annotations

import warnings
from typing import Any

from fl_accel.planning.fit import smallest_fixes, verdict
from fl_accel.planning.memory import estimate_for_run
from recipes.args import RecipeError

GIB = 2**30


def fix_flags(changes: dict, world_size: int) -> str:
    """A :class:`~fl_accel.planning.fit.MemoryFix`'s changes as recipe flags
    (``--activation_checkpointing full --num_groups 16``)."""
    out = []
    for key, value in changes.items():
        if key == "group_size":
            out.append(f"--num_groups {world_size // value}")
        else:
            flag = {"micro_batch": "micro_batch_size", "shards": "hsdp_shard_size"}.get(key, key)
            out.append(f"--{flag} {value}")
    return " ".join(out)


def settings(args, mixed_precision: str, activation_checkpointing: bool) -> dict[str, Any]:
    """The memory model's keyword arguments for the recipe's ``args`` (AdamW fused on CUDA, as
    :func:`recipes.modeling.build_optimizer` builds it)."""
    return dict(seq_len=args.seq_len, micro_batch=args.micro_batch_size,
                param_dtype="bf16" if mixed_precision == "bf16" else "fp32", reduce_dtype=args.reduce_dtype,
                activation_checkpointing="full" if activation_checkpointing else "none", optimizer="fused",
                gradient_accumulation_steps=args.gradient_accumulation_steps, accelerator="cuda")


def judge(config, fl, world_size: int, gpu_memory_bytes: float, kw: dict) -> tuple[str, str]:
    """``(verdict, message)`` of the run on GPUs of ``gpu_memory_bytes``: the message names the
    peak and, when it does not fit, the smallest fixes as recipe flags. No torch."""
    from fl_accel.mesh import FLLayout

    est = estimate_for_run(config, fl, world_size, **kw)
    answer = verdict(est.total, gpu_memory_bytes)
    text = (f"the memory model puts this run's peak at {est.total / GIB:.1f} GiB per GPU ({est.peak_phase}), against "
            f"{gpu_memory_bytes / GIB:.1f} GiB GPUs less 10% for the allocator: {answer}")
    if answer != "does not fit":
        return answer, text
    layout = FLLayout.from_config(fl, world_size)
    sync = {n: getattr(fl, n) for n in ("outer_optimizer", "sync_dtype", "error_feedback", "sync_bucket_mb",
                                        "num_fragments", "sync_delay", "sync_density", "sync_value_bits",
                                        "outer_state_device", "sync_collectives")}
    fixes = smallest_fixes(config, gpu_memory_bytes, layout=layout, **{**sync, **kw})
    if fixes:
        text += "; it fits with " + "; or ".join(
            f"{fix_flags(f.changes, world_size)} ({f.total / GIB:.1f} GiB{'; ' + f.note if f.note else ''})"
            for f in fixes[:3])
    else:
        text += "; no change of checkpointing, outer state, micro-batch or group size makes it fit"
    return answer, text + " (python -m scripts.memory_model explains the estimate; --memory_check warn runs anyway)"


def _gpu_memory(accelerator) -> float:
    """The smallest total memory of the world's GPUs, in bytes (an all-reduce MIN: every rank
    decides alike)."""
    import torch
    import torch.distributed as dist

    memory = torch.tensor([float(torch.cuda.get_device_properties(accelerator.device).total_memory)],
                          dtype=torch.float64, device=accelerator.device)
    dist.all_reduce(memory, op=dist.ReduceOp.MIN)
    return memory.item()


def check_memory(accelerator, args, config, mixed_precision: str, activation_checkpointing: bool) -> None:
    """The check (module docstring). Collective on CUDA (an all-reduce MIN of the GPUs'
    memory); nothing elsewhere. RecipeError on every rank: does not fit, with ``refuse``."""
    if accelerator.device.type != "cuda" or args.memory_check == "off":
        return
    answer, text = judge(config, accelerator.fl_config, accelerator.layout.world_size, _gpu_memory(accelerator),
                         settings(args, mixed_precision, activation_checkpointing))
    if answer == "does not fit" and args.memory_check == "refuse":
        raise RecipeError(text)
    if answer != "fits" and accelerator.is_main_process:
        warnings.warn(f"[fl_accel] {text}", UserWarning, stacklevel=2)
