"""A federation group's FSDP2 model around Accelerate's preparation: the plugin and policy, materialization, checks.

Functions of (model, layout, device), testable on a one-process group; the replica check
(:func:`check_identical`) runs over the world at ``prepare`` and over torchft's first quorum.
Relied on (public API; the internals are reached through :mod:`fl_accel.compat`):

* a DTensor's local shard is laid out as ``distribute_tensor`` with the same mesh and
  placements lays it out (:func:`materialize` keeps a rank's shard of a full init);
* ``FSDPModule.reshard()`` frees a unit's unsharded parameters; ``reset_iter_state()``
  (torch 2.13+) reshards every unit and clears the post-forward order kept until a backward ends.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, distribute_tensor

from . import compat
from .fsdp import local


def mixed_precision_policy(mixed_precision: str, reduce_dtype: str = "fp32") -> MixedPrecisionPolicy | None:
    """The FSDP2 policy of a ``mixed_precision``: "bf16" gives bf16 parameters and compute with
    gradients reduced in ``reduce_dtype`` ("fp32" or "bf16") and no output cast (the loss stays
    fp32); anything else None (fp32). ValueError: another ``reduce_dtype``."""
    if reduce_dtype not in ("fp32", "bf16"):
        raise ValueError(f"reduce_dtype must be 'fp32' or 'bf16', got {reduce_dtype!r}")
    if mixed_precision != "bf16":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                reduce_dtype=torch.float32 if reduce_dtype == "fp32" else torch.bfloat16)


def fsdp2_plugin(mixed_precision: str | None = None, reduce_dtype: str = "fp32",
                 activation_checkpointing: bool | None = None):
    """The one FSDP2 plugin fl_accel builds: ``fsdp_version=2``, the auto-wrap policy of
    ``FSDP_AUTO_WRAP_POLICY`` (default "transformer_based_wrap"), the precision policy of
    ``mixed_precision`` (:func:`mixed_precision_policy`; None: left for FLAccelerator to set
    from its own ``mixed_precision``) and ``activation_checkpointing`` (None: the
    ``FSDP_ACTIVATION_CHECKPOINTING`` that ``accelerate launch`` exports; the other
    ``FSDP_*`` variables too). ValueError: a bad ``reduce_dtype``."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    policy = mixed_precision_policy(mixed_precision, reduce_dtype) if mixed_precision is not None else None
    return FullyShardedDataParallelPlugin(
        fsdp_version=2, activation_checkpointing=activation_checkpointing, mixed_precision_policy=policy,
        auto_wrap_policy=os.environ.get("FSDP_AUTO_WRAP_POLICY", "transformer_based_wrap"))


def use_fsdp2(state, plugin, user_policy, mixed_precision: str, replicas: int, shards: int, device_mesh) -> None:
    """Point Accelerate's FSDP2 path (``state``) at this rank's group (``device_mesh`` of
    ``replicas`` x ``shards``), with the precision policy of ``mixed_precision``: the user's
    FSDP2 plugin as given (its own ``user_policy`` kept), else Accelerate's from ``accelerate
    launch`` (FSDP2: :func:`fl_accel.refusals.refuse_fsdp1` ran), else :func:`fsdp2_plugin`."""
    from accelerate.utils import ParallelismConfig

    from .refusals import FSDP1_FIX

    plugin = plugin or getattr(state, "fsdp_plugin", None)
    if plugin is None:
        plugin = fsdp2_plugin()  # reads the FSDP_* environment variables `accelerate launch` sets
    if getattr(plugin, "fsdp_version", 1) != 2:  # refused before start; a state that changed since
        raise ValueError("FLAccelerator: Accelerate's state holds an FSDP1 plugin. " + FSDP1_FIX + ".")
    if user_policy is None:
        plugin.mixed_precision_policy = mixed_precision_policy(mixed_precision)
    compat.set_fsdp_state(state, plugin, ParallelismConfig(dp_replicate_size=replicas, dp_shard_size=shards),
                          device_mesh)


def export_through(model, get_state_dict, no_sync) -> None:
    """Give the prepared ``model`` the two calls Accelerate's users make on it directly (instance
    attributes; the class is untouched):

    * ``save_pretrained(dir, ...)`` without ``state_dict`` passes ``get_state_dict(model)``
      (:meth:`fl_accel.FLAccelerator.get_state_dict`: the federated model, synced first):
      transformers would read the model's own state dict, FSDP2's DTensor shards, and fail writing them
      ("Attempted to access the data pointer on an invalid python storage"). Collective, like
      Accelerate's FSDP2 gather: every rank calls it (the canonical scripts do, with
      ``is_main_process``); transformers writes on rank 0.
    * ``no_sync()`` (DDP's, which FSDP2 modules lack; Accelerate's autoregressive
      gradient-accumulation example calls it) is ``no_sync(model)`` (the accelerator's)."""
    original = getattr(model, "save_pretrained", None)
    if callable(original):
        @functools.wraps(original)
        def save_pretrained(save_directory, *args, state_dict=None, **kwargs):
            if state_dict is None:
                state_dict = get_state_dict(model)
            return original(save_directory, *args, state_dict=state_dict, **kwargs)

        model.save_pretrained = save_pretrained
    if not hasattr(model, "no_sync"):
        model.no_sync = lambda: no_sync(model)


@torch.no_grad()
def materialize(model: torch.nn.Module, init_fn, device: torch.device, seed: int = 0) -> None:
    """Allocate and initialize a model sharded on the meta device, module by module (children
    first): full-shape parameters on ``device``, ``init_fn(module)`` (e.g. transformers'
    ``_init_weights``), keep this rank's shard (``distribute_tensor(src_data_rank=None)``, no
    communication). Values as a full init after ``torch.manual_seed(seed)``; peak memory the
    sharded model plus the largest module."""
    model.to_empty(device=device)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    done: set[int] = set()

    def visit(module):
        for child in module.children():
            visit(child)
        swapped = {name: (p, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                requires_grad=p.requires_grad))
                   for name, p in compat.own_parameters(module).items()}
        with compat.swapped_parameters(module, {name: full for name, (_, full) in swapped.items()}):
            init_fn(module)
        for p, full in swapped.values():
            if id(p) not in done:
                done.add(id(p))
                if isinstance(p, DTensor):
                    shard = distribute_tensor(full.data, p.device_mesh, p.placements, src_data_rank=None)
                    p.to_local().copy_(shard.to_local())
                else:
                    p.data.copy_(full.data)

    visit(model)


def reshard(models) -> None:
    """Free every unit's unsharded parameters; call before writing local shards (an evaluation
    leaves the tail unit unsharded, and the next forward would use stale full weights)."""
    for model in models:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def track_forward_only(model: torch.nn.Module, accumulating) -> object | None:
    """``reset_iter_state()`` before the first forward with grad after ``no_grad`` forwards (an
    evaluation, which FSDP2 records in its post-forward order until a backward ends: the
    next backward would all-gather its last unit for nothing), unless ``accumulating()``.
    Returns the hook handle, or None for a model that is not an ``FSDPModule``."""
    if not isinstance(model, FSDPModule):
        return None
    forward_only = [False]

    def before_forward(module, args):
        if not torch.is_grad_enabled():
            forward_only[0] = True
        elif forward_only[0]:
            forward_only[0] = False
            if not accumulating():
                compat.reset_iter_state(module)

    return model.register_forward_pre_hook(before_forward, prepend=True)


@torch.no_grad()
def shard_checksum(params, device: torch.device) -> torch.Tensor:
    """fp64 ``[3]``: the sum, sum of squares and position-weighted sum (weights 1..97, in
    2**20-value chunks) of this rank's local shards of ``params``, on ``device``."""
    out = torch.zeros(3, dtype=torch.float64, device=device)
    chunk = 1 << 20
    for p in params:
        t = local(p).detach().reshape(-1)
        for start in range(0, t.numel(), chunk):
            c = t[start:start + chunk].to(torch.float64)
            w = torch.arange(start + 1, start + c.numel() + 1, dtype=torch.float64, device=c.device).remainder_(97)
            out += torch.stack([c.sum(), (c * c).sum(), (c * w).sum()]).to(device)
    return out


def check_identical(table: torch.Tensor, keys: list, groups: list, replicas: list | None = None,
                    context: str = "") -> None:
    """The one identity check of the groups' (and replicas') parameters: ``table[k]`` is row
    k's :func:`shard_checksum` (of group ``groups[k]``, HSDP replica ``replicas[k]``); rows with
    the same ``keys`` entry (a shard coordinate) must equal the first such row. ValueError on
    every rank holding the table, naming the differing groups (and ``context``)."""
    first: dict = {}
    differ = {(groups[k], None if replicas is None else replicas[k]) for k in range(len(keys))
              if not torch.equal(table[k], table[first.setdefault(keys[k], k)])}
    if differ:
        where = f"group(s) {sorted({f for f, _ in differ})}" + \
            (f" (group, HSDP replica): {sorted(differ)}" if replicas is not None else "")
        raise ValueError(
            f"the federation groups do not start from identical parameters: {where} differ from group 0's first "
            f"replica{context}. Seed identically on every rank before building the model "
            f"(accelerate.utils.set_seed(seed), not seed + rank); averaging differently initialized models destroys "
            f"training at the first sync.")


def check_replicas_identical(model: torch.nn.Module, layout, rank: int, device: torch.device) -> None:
    """:func:`check_identical` over the world (``layout``'s ranks, all-reduced): every group and
    HSDP replica holds the same parameters at each shard coordinate. Collective."""
    table = torch.zeros(layout.world_size, 3, dtype=torch.float64, device=device)
    table[rank] = shard_checksum(model.parameters(), device)
    dist.all_reduce(table)
    coords = [layout.coords(k) for k in range(layout.world_size)]
    check_identical(table, [s for _, _, s in coords], [f for f, _, _ in coords],
                    [r for _, r, _ in coords] if layout.uses_hsdp else None)
