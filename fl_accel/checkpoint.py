"""Checkpoints of the full federated state, safe at any step (also mid-round).

Why not a plain ``dcp.save({"model": model.state_dict()})``: between syncs the groups
hold different parameters under the same names and offsets, and
``torch.distributed.checkpoint`` de-duplicates such items across ranks, silently
keeping one group's values (see FACTS.md). Here every group's model and optimizer
state lives under its own key, ``group{f}/...``, so nothing is de-duplicated across
groups; within a group the HSDP replicas are identical and de-duplication is right.

Layout of ``step_N/``::

    __0_0.distcp ... .metadata        torch.distributed.checkpoint (sharded, parallel writes)
    random_states_{rank}.pkl, scheduler.bin, ...   accelerate.save_state (RNG, scheduler, samplers)
    fl_accel_checkpoint.json          written last: layout, step, counters; marks it complete

A save writes into ``step_N.partial`` and renames it when every rank has finished,
so a crash mid-save never leaves a directory that :func:`find_latest` would pick.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import torch
from accelerate import Accelerator

META_FILE = "fl_accel_checkpoint.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, or from another layout."""


def find_latest(checkpoints_dir: str) -> str | None:
    """Newest complete ``step_N`` directory under ``checkpoints_dir`` (None if none).

    Complete means it holds ``fl_accel_checkpoint.json``; ``*.partial`` directories
    left by a crash are ignored.
    """
    if not os.path.isdir(checkpoints_dir):
        return None
    best = None
    for name in os.listdir(checkpoints_dir):
        m = _STEP_DIR.match(name)
        path = os.path.join(checkpoints_dir, name)
        if m and os.path.isfile(os.path.join(path, META_FILE)):
            if best is None or int(m.group(1)) > best[0]:
                best = (int(m.group(1)), path)
    return None if best is None else best[1]


def read_meta(checkpoint_dir: str) -> dict[str, Any]:
    """Read and sanity-check ``fl_accel_checkpoint.json`` (no collectives).

    Raises:
        CheckpointError: missing directory or metadata, unreadable JSON, missing DCP
            ``.metadata``, or another format version.
    """
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"checkpoint directory {checkpoint_dir} does not exist")
    path = os.path.join(checkpoint_dir, META_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{checkpoint_dir} is not a complete fl_accel checkpoint (no {META_FILE}); "
            f"it may be from an interrupted save"
        )
    try:
        with open(path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"corrupt checkpoint metadata {path}: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unsupported checkpoint format {meta.get('format_version')!r}")
    if not os.path.isfile(os.path.join(checkpoint_dir, ".metadata")):
        raise CheckpointError(f"{checkpoint_dir}: torch.distributed.checkpoint .metadata is missing (truncated?)")
    return meta


def check_compatible(meta: dict[str, Any], here: dict[str, Any]) -> None:
    """Raise CheckpointError if the checkpoint's algorithm or mesh differs from ``here``.

    ``here`` is :func:`layout_meta` of the current run (pure; no collectives).
    """
    theirs = {k: meta.get(k) for k in here}
    if theirs != here:
        diff = {k: (theirs[k], here[k]) for k in here if theirs[k] != here[k]}
        raise CheckpointError(
            "checkpoint was written by a different setup; (checkpoint, this run): "
            + ", ".join(f"{k}={a!r} vs {b!r}" for k, (a, b) in diff.items())
        )


def layout_meta(cfg, layout) -> dict[str, Any]:
    """What a checkpoint must share with the run loading it: algorithm, world, mesh, outer optimizer."""
    return {
        "algorithm": cfg.algorithm,
        "world_size": layout.world_size,
        "num_groups": layout.num_groups,
        "replicas": layout.replicas,
        "shards": layout.shards,
        "outer_optimizer": cfg.outer_optimizer if layout.num_groups > 1 else "avg",
    }


def _as_dtensor_like(local: torch.Tensor, param) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return DTensor.from_local(local, device_mesh=param.device_mesh, placements=param.placements,
                                  shape=param.shape, stride=param.stride(), run_check=False)
    return local


def _state_for_dcp(accelerator) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    models, optimizers = accelerator._models, accelerator._optimizers
    group_state: dict[str, Any] = {}
    for i, model in enumerate(models):
        group_state[f"model_{i}"] = get_model_state_dict(model)
        if i < len(optimizers):
            group_state[f"optimizer_{i}"] = get_optimizer_state_dict(model, optimizers[i].optimizer)
    state: dict[str, Any] = {f"group{accelerator.group_index}": group_state}
    sync = accelerator.synchronizer
    if sync is not None and sync.outer_optimizer is not None:
        names = [n for n, _ in models[0].named_parameters()]
        outer = sync.outer_optimizer.state_dict()["state"]
        fl_state = {}
        for idx, (name, param, anchor) in enumerate(zip(names, sync.params, sync.anchor)):
            fl_state[f"anchor/{name}"] = _as_dtensor_like(anchor.detach(), param)
            buf = outer.get(idx, {}).get("momentum_buffer")
            if buf is None:
                buf = torch.zeros_like(anchor)
            fl_state[f"momentum/{name}"] = _as_dtensor_like(buf, param)
        state["fl"] = fl_state
    return state


def save_federated_state(accelerator, output_dir: str, extra_meta: dict | None = None) -> str:
    """Save models, optimizers, FL state (DCP) plus Accelerate's RNG/scheduler/sampler state.

    Collective: every rank calls it. Returns ``output_dir``. Atomic: writes
    ``output_dir + ".partial"`` and renames it after all ranks finished.
    """
    import torch.distributed.checkpoint as dcp

    output_dir = os.path.normpath(output_dir)
    tmp = output_dir + ".partial"
    if accelerator.is_main_process:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp, exist_ok=True)
    accelerator.wait_for_everyone()

    dcp.save(_state_for_dcp(accelerator), checkpoint_id=tmp)
    models, optimizers = accelerator._models, accelerator._optimizers
    try:  # Accelerate saves RNG states (per rank), schedulers, samplers, custom objects.
        accelerator._models, accelerator._optimizers = [], []
        Accelerator.save_state(accelerator, tmp)
    finally:
        accelerator._models, accelerator._optimizers = models, optimizers
    accelerator.wait_for_everyone()

    if accelerator.is_main_process:
        sync = accelerator.synchronizer
        meta = {
            "format_version": FORMAT_VERSION,
            **layout_meta(accelerator.fl_config, accelerator.layout),
            "sync": None if sync is None else {
                "local_step": sync.local_step, "global_step": sync.global_step, "num_syncs": sync.num_syncs,
            },
            **(extra_meta or {}),
        }
        with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as fh:
            json.dump(meta, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        if os.path.exists(output_dir):
            shutil.rmtree(output_dir)
        os.replace(tmp, output_dir)
    accelerator.wait_for_everyone()
    return output_dir


def load_federated_state(accelerator, input_dir: str) -> dict[str, Any]:
    """Inverse of :func:`save_federated_state`; returns the checkpoint metadata.

    Raises:
        CheckpointError: on every rank, before any collective, if the checkpoint is
            incomplete or from another algorithm / world size / mesh.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    meta = read_meta(input_dir)
    check_compatible(meta, layout_meta(accelerator.fl_config, accelerator.layout))
    state = _state_for_dcp(accelerator)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, checkpoint_id=input_dir)
    except (Exception, CheckpointException) as exc:
        # DCP gathers the per-rank read failures and raises CheckpointException (a
        # BaseException) on every rank, so every rank reports the same error.
        raise CheckpointError(f"cannot load checkpoint {input_dir}: {str(exc)[:2000]}") from exc
    group_state = state[f"group{accelerator.group_index}"]
    for i, model in enumerate(accelerator._models):
        set_model_state_dict(model, group_state[f"model_{i}"])
        if i < len(accelerator._optimizers):
            set_optimizer_state_dict(model, accelerator._optimizers[i].optimizer, group_state[f"optimizer_{i}"])
    sync = accelerator.synchronizer
    if sync is not None and meta.get("sync"):
        sync.local_step = int(meta["sync"]["local_step"])
        sync.global_step = int(meta["sync"]["global_step"])
        sync.num_syncs = int(meta["sync"]["num_syncs"])
        if sync.outer_optimizer is not None:
            names = [n for n, _ in accelerator._models[0].named_parameters()]
            outer_sd = sync.outer_optimizer.state_dict()
            with torch.no_grad():
                for idx, (name, anchor) in enumerate(zip(names, sync.anchor)):
                    anchor.copy_(_local(state["fl"][f"anchor/{name}"]))
                    outer_sd["state"].setdefault(idx, {})["momentum_buffer"] = (
                        _local(state["fl"][f"momentum/{name}"]).clone()
                    )
            sync.outer_optimizer.load_state_dict(outer_sd)
    models, optimizers = accelerator._models, accelerator._optimizers
    try:
        accelerator._models, accelerator._optimizers = [], []
        Accelerator.load_state(accelerator, input_dir)
    finally:
        accelerator._models, accelerator._optimizers = models, optimizers
    return meta


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t
