"""Checkpoints of the full federated state, safe at any step (also mid-round).

Not a plain ``dcp.save({"model": model.state_dict()})``: between syncs the groups hold
different values under the same names and offsets, and ``torch.distributed.checkpoint``
de-duplicates such items across ranks, keeping one group's (seen on 4 gloo ranks). So
each group's model and optimizer state lives under ``group{f}.`` whenever the groups may
differ; right after a full sync they are identical and stored once (``model_0``). HSDP
replicas are identical, and de-duplication is right. The sync's tensors are keyed by
shard coordinate (``fl.anchor/<param>/shard{s}``), saved and loaded where they live.

Layout of ``step_N/``::

    __0_0.distcp ... .metadata        torch.distributed.checkpoint (sharded, parallel writes)
    random_states_{rank}.pkl, scheduler.bin, ...   Accelerate (RNG, scheduler, samplers)
    rank_state/rank{k}.json           optional per-rank JSON (e.g. a data stream's position)
    fl_accel_checkpoint.json          written last: layout, step, counters; marks it complete

A save writes ``step_N.partial`` and renames it when every rank has finished, so a crash
never leaves a folder :func:`find_latest` would pick; without a folder, Accelerate's automatic
naming (:func:`automatic_checkpoint_dir`). With ``fault_tolerance="torchft"`` each group saves
its own checkpoint, with the Manager's committed step and its ``group_index``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from .schedule import inflight_of

META_FILE = "fl_accel_checkpoint.json"
FORMAT_VERSION = 3
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, or from another layout (every rank)."""


@dataclass
class CheckpointIO:
    """What a save or load needs from the accelerator (which builds it; no Accelerate here):
    ``extras("save_state" | "load_state", folder)`` writes/reads what is not models and
    optimizers; ``rank``: in the layout; ``is_main_process``: of the launch's world."""

    models: list
    optimizers: list
    synchronizer: Any
    layout: Any
    config: Any
    rank: int
    barrier: Callable[[], None]
    extras: Callable[[str, str], None]
    is_main_process: bool

    group_index = property(lambda self: self.layout.coords(self.rank)[0])
    replica_index = property(lambda self: self.layout.coords(self.rank)[1])


def find_latest(checkpoints_dir: str) -> str | None:
    """Newest complete ``step_N`` directory under ``checkpoints_dir``, or None."""
    steps = list_checkpoints(checkpoints_dir)
    return steps[-1][1] if steps else None


def list_checkpoints(checkpoints_dir: str) -> list[tuple[int, str]]:
    """Complete ``(step, path)`` checkpoints (with ``fl_accel_checkpoint.json``), oldest first."""
    names = os.listdir(checkpoints_dir) if os.path.isdir(checkpoints_dir) else []
    return sorted((int(m.group(1)), os.path.join(checkpoints_dir, n)) for n in names
                  if (m := _STEP_DIR.match(n)) and os.path.isfile(os.path.join(checkpoints_dir, n, META_FILE)))


def prune_checkpoints(checkpoints_dir: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints; returns them. One process."""
    deleted = [path for _, path in list_checkpoints(checkpoints_dir)[:-keep]] if keep > 0 else []
    for path in deleted:
        shutil.rmtree(path, ignore_errors=True)
    return deleted


def automatic_checkpoint_dir(project, project_dir: str, method: str, is_main_process: bool, barrier) -> str:
    """Accelerate's automatic checkpoint folder under ``project_dir`` (``project``: the
    accelerator's ``ProjectConfiguration``): the next ``checkpoints/checkpoint_<iteration>``
    (``method`` "save_state"; the main process removes the oldest beyond ``total_limit``,
    then ``barrier()``) or the latest (``method`` "load_state"). ValueError: automatic naming
    is off, or there is nothing to load."""
    if not project.automatic_checkpoint_naming:
        raise ValueError(f"FLAccelerator.{method} needs a folder, or Accelerator(project_config="
                         f"ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True))")
    root = os.path.join(project_dir, "checkpoints")
    numbered = sorted((int(m.group(1)), name) for name in (os.listdir(root) if os.path.isdir(root) else [])
                      if (m := re.fullmatch(r"checkpoint_(\d+)", name)))
    if method == "load_state":
        if not numbered:
            raise ValueError(f"FLAccelerator.load_state: no checkpoint_<i> folder in {root}")
        return os.path.join(root, numbered[-1][1])
    if is_main_process:
        os.makedirs(root, exist_ok=True)
        extra = len(numbered) + 1 - project.total_limit if project.total_limit is not None else 0
        for _, name in numbered[:max(0, extra)]:
            shutil.rmtree(os.path.join(root, name))
    barrier()
    return os.path.join(root, f"checkpoint_{project.iteration}")


def folder_iteration(folder: str) -> int | None:
    """The number a folder's name ends with (``checkpoint_3``: 3), else None."""
    digits = re.findall(r"(\d+)$", os.path.normpath(folder))
    return int(digits[0]) if digits else None


@contextlib.contextmanager
def automatic_naming_off(project):
    """Accelerate's own save/load inside FLAccelerator's use the folder fl_accel chose, not its
    automatic naming (which would pick another folder and count the iteration twice)."""
    automatic = project.automatic_checkpoint_naming
    project.automatic_checkpoint_naming = False
    try:
        yield
    finally:
        project.automatic_checkpoint_naming = automatic


def read_meta(checkpoint_dir: str) -> dict[str, Any]:
    """Read and check ``fl_accel_checkpoint.json`` (no collectives). CheckpointError: missing
    folder or metadata, bad JSON, no DCP ``.metadata``, another format version."""
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"checkpoint directory {checkpoint_dir} does not exist")
    path = os.path.join(checkpoint_dir, META_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{checkpoint_dir} is not a complete fl_accel checkpoint (no {META_FILE}); "
            f"it may be from an interrupted save")
    try:
        with open(path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"corrupt checkpoint metadata {path}: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        got = meta.get("format_version") if isinstance(meta, dict) else None
        raise CheckpointError(f"{path}: unsupported checkpoint format {got!r} (this fl_accel reads {FORMAT_VERSION})")
    if not os.path.isfile(os.path.join(checkpoint_dir, ".metadata")):
        raise CheckpointError(f"{checkpoint_dir}: torch.distributed.checkpoint .metadata is missing (truncated?)")
    return meta


SCHEDULE_KEYS = ("sync_every", "sync_delay")
"""The sync schedule a checkpoint was written with (F > 1): its round position, anchor and any
exchange in flight belong to that H and tau. Checkpoints written before these keys were stored
load without this check."""


def layout_meta(config, layout) -> dict[str, Any]:
    """What a checkpoint shares with the run loading it: layout, ``FLConfig.sync_state``, the
    sync schedule (:data:`SCHEDULE_KEYS`, when F > 1) and ("torchft") the group."""
    per_group = {"fault_tolerance": config.fault_tolerance, "group_index": config.group_index} \
        if config.fault_tolerant else {}
    schedule = {k: getattr(config, k) for k in SCHEDULE_KEYS} if layout.num_groups > 1 else {}
    return {**layout.as_dict(), **config.sync_state(layout.num_groups), **schedule, **per_group}


def check_compatible(meta: dict[str, Any], here: dict[str, Any]) -> None:
    """CheckpointError if ``meta`` differs from ``here`` (:func:`layout_meta` of this run),
    naming every differing setting; no collective, so every rank raises alike. A key of
    :data:`SCHEDULE_KEYS` is compared only when the checkpoint stores it (older ones do not)."""
    here = {**dict.fromkeys(k for k in ("fault_tolerance", "group_index") if k in meta), **here}
    here = {k: v for k, v in here.items() if k not in SCHEDULE_KEYS or k in meta}
    theirs = {k: meta.get(k) for k in here}
    if theirs != here:
        diff = {k: (theirs[k], here[k]) for k in here if theirs[k] != here[k]}
        raise CheckpointError(
            "checkpoint was written by a different setup; (checkpoint, this run): "
            + ", ".join(f"{k}={a!r} vs {b!r}" for k, (a, b) in diff.items())
            + ". Resume with the settings it was written with.")


def _not_a_training_step(io: CheckpointIO):
    """DCP's get/set_optimizer_state_dict step an optimizer without state at lr 0: not a training step."""
    return io.synchronizer.suspended() if io.synchronizer is not None else contextlib.nullcontext()


def _state_for_dcp(io: CheckpointIO, scopes: dict[str, str], inflight: list[int] | None = None) -> dict[str, Any]:
    """This rank's DCP state: ``model_0``/``optimizer_0``, shared or under ``group{f}.``;
    ``fl.{anchor,momentum,inflight}/<param>/shard{s}``; ``group{f}.replica{r}.{residual,launched}/...``
    (replicas' residuals and groups' parameters at a launch differ). ``inflight``: fragments
    in flight, whose templates a load fills."""
    group_key = f"group{io.group_index}"
    state: dict[str, Any] = {}

    def put(scope: str, key: str, value) -> None:
        (state if scope == "shared" else state.setdefault(group_key, {}))[key] = value

    for i, model in enumerate(io.models):
        put(scopes["model"], f"model_{i}", get_model_state_dict(model))
        if i < len(io.optimizers):
            with _not_a_training_step(io):
                put(scopes["optimizer"], f"optimizer_{i}", get_optimizer_state_dict(model, io.optimizers[i]))
    sync = io.synchronizer
    if sync is not None and io.layout.num_groups > 1:
        shared, per_rank = sync.state_tensors(inflight)
        shard = io.layout.coords(io.rank)[2]
        for scope, key, tensors in (("shared", "fl", shared), ("group", f"replica{io.replica_index}", per_rank)):
            entries = {f"{kind}/{name}/shard{shard}": t for name, kinds in tensors.items()
                       for kind, t in kinds.items()}
            if entries:
                put(scope, key, entries)
    return state


def save_federated_state(io: CheckpointIO, output_dir: str, extra_meta: dict | None = None,
                         rank_state: dict | None = None) -> str:
    """Save models, optimizers, sync state (DCP) and Accelerate's, atomically. Collective.
    ``extra_meta``: JSON, once in the metadata; ``rank_state``: JSON (or a callable, called
    after the DCP save) per rank, back as the load's ``meta["rank_state"]``."""
    output_dir = os.path.normpath(output_dir)
    tmp = output_dir + ".partial"
    sync = io.synchronizer
    if sync is not None and sync.planner.rounds is not None and sync.schedule.local_step:
        raise CheckpointError(f"with sync_trigger={io.config.sync_trigger!r} a checkpoint is taken right after a "
                              f"sync (the groups are at different steps mid-round); this group is "
                              f"{sync.schedule.local_step} step(s) into a round")
    if io.is_main_process:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp, exist_ok=True)
    io.barrier()
    # "shared" when all groups hold the same values (right after a full sync)
    identical = sync is None or io.layout.num_groups == 1 or sync.schedule.in_sync
    shared_optim = identical and (io.layout.num_groups == 1 or io.config.average_optimizer_state)
    scopes = {"model": "shared" if identical else "group", "optimizer": "shared" if shared_optim else "group"}
    dcp.save(_state_for_dcp(io, scopes), checkpoint_id=tmp)
    io.extras("save_state", tmp)
    if callable(rank_state):  # evaluated after the save's own collectives (e.g. comm counters)
        rank_state = rank_state()
    if rank_state is not None:
        os.makedirs(os.path.join(tmp, "rank_state"), exist_ok=True)
        with open(os.path.join(tmp, "rank_state", f"rank{io.rank}.json"), "w", encoding="utf-8") as fh:
            json.dump(rank_state, fh)
    io.barrier()
    if io.is_main_process:
        meta = {"format_version": FORMAT_VERSION, **layout_meta(io.config, io.layout), "scopes": scopes,
                "sync": None if sync is None else sync.counters(), **(extra_meta or {})}
        transport = sync.transport.state_dict() if sync is not None else {}
        if transport:  # torchft mode: the Manager's step
            meta["transport"] = transport
        with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as fh:
            json.dump(meta, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        if os.path.exists(output_dir):
            shutil.rmtree(output_dir)
        os.replace(tmp, output_dir)
    io.barrier()
    return output_dir


def load_federated_state(io: CheckpointIO, input_dir: str) -> dict[str, Any]:
    """Inverse of :func:`save_federated_state`; returns the metadata. CheckpointError on every
    rank: incomplete or another layout (before any collective), or a corrupt file."""
    meta = read_meta(input_dir)
    check_compatible(meta, layout_meta(io.config, io.layout))
    scopes = meta.get("scopes", {"model": "group", "optimizer": "group"})
    state = _state_for_dcp(io, scopes, inflight=inflight_of(meta.get("sync") or {}))
    try:
        dcp.load(state, checkpoint_id=input_dir)
    except (Exception, CheckpointException) as exc:
        # DCP raises CheckpointException (a BaseException) with every rank's traceback on every rank
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        gist = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
        earlier = [os.path.basename(p) for _, p in list_checkpoints(os.path.dirname(os.path.normpath(input_dir)))
                   if os.path.normpath(p) != os.path.normpath(input_dir)]
        hint = (f"; resume from an earlier checkpoint ({', '.join(earlier[-3:])}) or delete this one"
                if earlier else "")
        raise CheckpointError(f"cannot load checkpoint {input_dir}: its files are truncated or corrupt "
                              f"({type(exc).__name__}: {gist[:300]}){hint}") from exc
    group_state = state.get(f"group{io.group_index}", {})

    def get(scope: str, key: str):
        return (state if scope == "shared" else group_state)[key]

    for i, model in enumerate(io.models):
        set_model_state_dict(model, get(scopes["model"], f"model_{i}"))
        if i < len(io.optimizers):
            with _not_a_training_step(io):
                set_optimizer_state_dict(model, io.optimizers[i], get(scopes["optimizer"], f"optimizer_{i}"))
    sync = io.synchronizer
    if sync is not None and meta.get("sync"):
        parsed: list[dict[str, dict[str, torch.Tensor]]] = []
        for source in (state.get("fl", {}), group_state.get(f"replica{io.replica_index}", {})):
            out: dict[str, dict[str, torch.Tensor]] = {}
            for key, t in source.items():
                kind, name, _ = key.split("/")
                out.setdefault(name, {})[kind] = t
            parsed.append(out)
        sync.load_state_dict(meta["sync"], parsed[0], parsed[1])
        if meta.get("transport") is not None:
            sync.transport.load_state_dict(meta["transport"])
    io.extras("load_state", input_dir)
    rank_file = os.path.join(input_dir, "rank_state", f"rank{io.rank}.json")
    if os.path.isfile(rank_file):
        with open(rank_file, encoding="utf-8") as fh:
            meta["rank_state"] = json.load(fh)
    return meta
