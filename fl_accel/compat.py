"""Every reach of fl_accel into the internals of torch, Accelerate and torchft, in one module.

fl_accel is tested on torch 2.12-2.15 and accelerate 1.14-1.16 (:data:`TESTED`; CI runs the
oldest and the newest pair, ``scripts/test_versions.sh``). A release outside that range gets a
warning at import (:func:`check_versions`), not an error. Where two releases differ, the code
below picks its path by checking what exists (``hasattr``, a signature, a source line), never
by version number.

Each reach is a function here, and :data:`REACHES` lists them: the internal, what relies on
it, and a check that ``tests/unit/test_compat.py`` runs on the installed releases, failing with
a message that names the internal if a release moves it. Nothing else in fl_accel reads a
private attribute of another library (``tests/unit/test_compat.py`` greps for it).

Why the FSDP2 sharding goes through Accelerate's private preparation rather than calling
``fully_shard`` on the group's mesh directly: ``Accelerator.prepare`` also applies activation
checkpointing and regional compilation in the order FSDP2 needs, re-points the optimizer at
the sharded parameters, groups tied weights into one unit, and every later call of the user's
script (``clip_grad_norm_``, ``no_sync``, ``get_state_dict``, ``save_model``, ``unwrap_model``)
takes its FSDP2 branch only when the state says FSDP. Sharding ourselves would copy that
preparation and still need the state written (:func:`set_fsdp_state`), so the one reach is
the state, and Accelerate does the rest as it does for its own users.

Public API used instead of an internal, where one exists: ``FSDPModule.reshard``,
``set_requires_gradient_sync`` and ``DTensor.to_local``/``full_tensor``;
``torch.distributed.checkpoint.state_dict`` (not FSDP's own state-dict hooks);
``DeviceMesh.from_group`` (not a mesh built over private group names);
``AcceleratedOptimizer.optimizer`` (a documented attribute).
"""

from __future__ import annotations

import contextlib
import inspect
import re
import warnings
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version as _version
from typing import Callable

TESTED = {"torch": ((2, 12), (2, 15)), "accelerate": ((1, 14), (1, 16))}
"""Inclusive (major, minor) ranges fl_accel is tested on (pyproject.toml says the same)."""
TORCHFT_TESTED = "0.2.0"
"""The one torchft release the fault-tolerant mode is tested with (``fl_accel.ft``)."""


# ======================================================================== versions
def _minor(text: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def version_problems(installed: dict[str, str | None] | None = None) -> list[str]:
    """One sentence per package of :data:`TESTED` that is missing or outside its range.
    ``installed``: package -> version (None: not installed); default: what is installed."""
    if installed is None:
        installed = {}
        for package in TESTED:
            try:
                installed[package] = _version(package)
            except PackageNotFoundError:
                installed[package] = None
    out = []
    for package, (low, high) in TESTED.items():
        found = installed.get(package)
        span = f"{low[0]}.{low[1]} to {high[0]}.{high[1]}"
        if found is None:
            out.append(f"{package} is not installed (fl_accel is tested with {package} {span})")
            continue
        minor = _minor(found)
        if minor is None or not low <= minor <= high:
            out.append(f"{package} {found} is installed; fl_accel is tested with {package} {span}")
    return out


def check_versions() -> None:
    """Warn (``UserWarning``, once at import) when torch or accelerate is outside :data:`TESTED`;
    never raises: an untested release may work, and :data:`REACHES` says what to check."""
    problems = version_problems()
    if problems:
        warnings.warn("fl_accel: " + "; ".join(problems) + ". It may work; if something breaks, "
                      "`python -m pytest tests/unit/test_compat.py` names the internal that moved.",
                      UserWarning, stacklevel=3)


def check_torchft_version() -> None:
    """ImportError naming the tested release unless torchft :data:`TORCHFT_TESTED` is installed.

    torchft 0.3 removed ``ProcessGroup.configure()`` and needs its Lighthouse and replicas of
    the same release (a 0.3 replica retries forever against a 0.2 Lighthouse); fl_accel's
    torchft mode is written against 0.2.0 (docs/fault_tolerance.md)."""
    try:
        found = _version("torchft")
    except PackageNotFoundError:
        raise ImportError(f"fault_tolerance='torchft' needs torchft=={TORCHFT_TESTED} (`pip install "
                          f"torchft=={TORCHFT_TESTED}`, or `pip install -e .[ft]`)") from None
    if found != TORCHFT_TESTED:
        raise ImportError(f"fault_tolerance='torchft' is tested with torchft=={TORCHFT_TESTED}, found {found} "
                          f"(0.3 removed ProcessGroup.configure() and needs a Lighthouse of the same release); "
                          f"install it with `pip install torchft=={TORCHFT_TESTED}`")


# ======================================================================== accelerate
def set_fsdp_state(state, plugin, parallelism_config, device_mesh) -> None:
    """Make Accelerate's state say FSDP2 over ``device_mesh`` (this federation group's), so that
    ``prepare`` shards with ``fully_shard`` on gloo as on NCCL and every later call takes its
    FSDP2 branch. Accelerate does not pick FSDP on CPU, and has no public setter: this writes
    ``AcceleratorState``'s ``distributed_type``/``fsdp_plugin``/``parallelism_config``/
    ``device_mesh`` and ``PartialState._shared_state["distributed_type"]`` (which every later
    ``AcceleratorState()`` copies)."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.parallelism_config = parallelism_config
    state.device_mesh = device_mesh


def _prepare_maps_by_data_ptr() -> bool:
    from accelerate import Accelerator

    source = inspect.getsource(Accelerator._prepare_fsdp2)
    return "data_ptr" in source


@contextlib.contextmanager
def meta_parameter_keys(models):
    """While entered, meta parameters report distinct ``data_ptr()`` values, where Accelerate's
    ``_prepare_fsdp2`` maps old to new parameters by ``data_ptr()`` (every meta tensor reports 0,
    so the optimizer would be re-pointed at one parameter). Releases that key by ``id()``
    (accelerate 1.16) need nothing."""
    stand_ins = []
    if _prepare_maps_by_data_ptr():
        for model in models:
            for i, p in enumerate(dict.fromkeys(model.parameters())):
                if p.is_meta:
                    p.data_ptr = (lambda v: (lambda: v))(-(i + 1))
                    stand_ins.append(p)
    try:
        yield
    finally:
        for p in stand_ins:
            del p.data_ptr


def prepared(acc, kind: str) -> list:
    """The objects Accelerate's ``prepare`` registered: ``kind`` "models", "optimizers",
    "schedulers" or "dataloaders" (``Accelerator._models`` etc.; the list itself, not a copy)."""
    return getattr(acc, f"_{kind}")


@contextlib.contextmanager
def without_models_and_optimizers(acc):
    """``save_state``/``load_state`` inside handle RNG states, schedulers, samplers and
    registered objects only: ``Accelerator._models``/``_optimizers`` are emptied meanwhile
    (fl_accel writes those itself, per federation group: fl_accel/checkpoint.py)."""
    models, optimizers = acc._models, acc._optimizers
    try:
        acc._models, acc._optimizers = [], []
        yield
    finally:
        acc._models, acc._optimizers = models, optimizers


def accumulation_counter(acc) -> int:
    """Accelerate's count of micro-batches toward the next optimizer step (``Accelerator.step``)."""
    return acc.step


def set_accumulation_counter(acc, value: int) -> None:
    acc.step = value


# ======================================================================== transformers (fl_accel.trainer)
TRAINER_OVERRIDES = {"create_accelerator_and_postprocess": ("self",),
                     "_prepare_for_training": ("self", "max_steps", "train_dataloader", "resume_from_checkpoint"),
                     "_finalize_training": ("self", "trial", "num_train_samples", "start_time"),
                     "_get_num_items_in_batch": ("self", "batch_samples", "device"),
                     "_save_optimizer_and_scheduler": ("self", "output_dir"),
                     "_load_from_checkpoint": ("self", "resume_from_checkpoint", "model"),
                     "_load_optimizer_and_scheduler": ("self", "checkpoint"),
                     "save_model": ("self", "output_dir", "_internal_call")}
"""``transformers.Trainer`` methods :class:`fl_accel.trainer.FederatedTrainerMixin` overrides,
with the parameters it relies on (private ones included: Trainer has no public hook for them)."""


@contextlib.contextmanager
def trainer_accelerator(factory):
    """While entered, ``Trainer.create_accelerator_and_postprocess`` builds its accelerator with
    ``factory(**args)``: it calls ``Accelerator(**args)`` by the name ``Accelerator`` of the
    module ``transformers.trainer``, which is swapped meanwhile (Trainer has no parameter for
    the class)."""
    import transformers.trainer as module

    original = module.Accelerator
    module.Accelerator = factory
    try:
        yield
    finally:
        module.Accelerator = original


# ======================================================================== torch
COLLECTIVE_ENTRY_POINTS = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                           "reduce_scatter_tensor", "all_reduce", "all_to_all_single", "broadcast")
"""``torch.distributed`` functions the comm meter wraps while entered (fl_accel/comm.py): FSDP2
looks them up on the module at call time (torch 2.13+: ``all_gather_single`` and
``reduce_scatter_single``; 2.12: the ``_tensor`` forms). Those a release lacks are skipped."""


def collective_entry_points() -> list[str]:
    """The names of :data:`COLLECTIVE_ENTRY_POINTS` this torch has."""
    import torch.distributed as dist

    return [name for name in COLLECTIVE_ENTRY_POINTS if hasattr(dist, name)]


def replace_dist_function(name: str, fn) -> object:
    """Set ``torch.distributed.<name>`` to ``fn``; returns the previous one (to restore)."""
    import torch.distributed as dist

    old = getattr(dist, name)
    setattr(dist, name, fn)
    return old


def all_gather_single(output, input, group, async_op: bool = False):
    """``dist.all_gather_single`` (torch >= 2.13), else ``dist.all_gather_into_tensor``: the same
    result (``output`` holds every rank's ``input`` in rank order)."""
    import torch.distributed as dist

    if hasattr(dist, "all_gather_single"):
        return dist.all_gather_single(output, input, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)


def fsdp_unit_key(module) -> int:
    """An id shared by the modules of one ``fully_shard`` call (``fully_shard.state(module)``)."""
    from torch.distributed.fsdp import fully_shard

    return id(fully_shard.state(module))


def reset_iter_state(module) -> bool:
    """``FSDPModule.reset_iter_state()`` where torch has it (2.13+): reshard every unit and clear
    the post-forward order an evaluation left; without it (2.12) nothing is done, which costs
    one extra all-gather of the last unit in the next backward. True if it ran."""
    fn = getattr(module, "reset_iter_state", None)
    if fn is None:
        return False
    fn()
    return True


def wrapper_prefixes() -> re.Pattern:
    """The name prefixes that activation checkpointing (``checkpoint_wrapper``) and
    ``torch.compile`` (``OptimizedModule``) insert into parameter names."""
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

    return re.compile(re.escape(cw._CHECKPOINT_PREFIX) + r"|_orig_mod\.")


@contextlib.contextmanager
def swapped_parameters(module, replacements: dict):
    """While entered, ``module``'s own parameters named in ``replacements`` are those tensors
    (``nn.Module._parameters``): an ``init_fn`` written for full tensors initializes them."""
    old = {name: module._parameters[name] for name in replacements}
    for name, p in replacements.items():
        module._parameters[name] = p
    try:
        yield
    finally:
        for name, p in old.items():
            module._parameters[name] = p


def own_parameters(module) -> dict:
    """``module``'s own (not its children's) parameters by name, Nones left out."""
    return {name: p for name, p in module._parameters.items() if p is not None}


def collective_options():
    """``(AllgatherOptions, AllreduceOptions, AllToAllOptions)`` for a torchft process group's
    low-level calls (``torch.distributed.distributed_c10d``)."""
    from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions

    return AllgatherOptions, AllreduceOptions, AllToAllOptions


# ======================================================================== torchft
def wrap_manager_client(manager, wrap: Callable) -> None:
    """Replace a torchft ``Manager``'s ``ManagerClient`` (``Manager._client``) by ``wrap(client)``,
    whose ``_quorum`` (the client's quorum call, run on torchft's quorum thread) fl_accel wraps
    so that a group's ranks agree on one heal source (torchft #343)."""
    manager._client = wrap(manager._client)


def client_quorum(client, *args, **kwargs):
    """The wrapped client's ``_quorum`` call."""
    return client._quorum(*args, **kwargs)


# ======================================================================== the list
@dataclass(frozen=True)
class Reach:
    """One internal fl_accel relies on: ``internal`` (dotted name), ``used_by`` (the function
    above and why), ``check()`` -> None or a sentence saying what moved; ``package`` to skip
    the check when that optional package is absent."""

    internal: str
    used_by: str
    check: Callable[[], str | None]
    package: str | None = None


def _has(obj_path: str, attr: str) -> str | None:
    import importlib

    module, _, name = obj_path.rpartition(".")
    obj = getattr(importlib.import_module(module), name)
    return None if hasattr(obj, attr) else f"{obj_path} has no attribute {attr!r}"


def _in_source(fn_path: str, *needles: str) -> str | None:
    import importlib

    module, _, rest = fn_path.partition(":")
    obj = importlib.import_module(module)
    for part in rest.split("."):
        obj = inspect.getattr_static(obj, part, None) if inspect.isclass(obj) else getattr(obj, part, None)
        if obj is None:
            return f"{module}:{rest} does not exist"
    if isinstance(obj, property):
        obj = obj.fget
    elif isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    source = inspect.getsource(obj)
    missing = [n for n in needles if n not in source]
    return f"{module}:{rest} no longer contains {missing}" if missing else None


def _shared_state() -> str | None:
    from accelerate import PartialState

    if not isinstance(getattr(PartialState, "_shared_state", None), dict):
        return "accelerate.PartialState._shared_state is not a class-level dict"
    return _in_source("accelerate.state:AcceleratorState.__init__", "distributed_type")


def _state_attributes() -> str | None:
    return _in_source("accelerate.state:AcceleratorState.__init__", "fsdp_plugin", "parallelism_config",
                      "device_mesh") or _in_source("accelerate.state:AcceleratorState.is_fsdp2",
                                                   "distributed_type", "fsdp_version")


def _prepare_fsdp2() -> str | None:
    return _in_source("accelerate.accelerator:Accelerator._prepare_fsdp2", "fsdp2_prepare_model") or \
        _in_source("accelerate.accelerator:Accelerator.prepare", "_prepare_fsdp2")


def _registered_lists() -> str | None:
    return _in_source("accelerate.accelerator:Accelerator.__init__", "self._models", "self._optimizers",
                      "self._schedulers", "self._dataloaders")


def _save_state_loops() -> str | None:
    return _in_source("accelerate.accelerator:Accelerator.save_state", "self._models", "self._optimizers") or \
        _in_source("accelerate.accelerator:Accelerator.load_state", "self._models", "self._optimizers")


def _accumulation_counter() -> str | None:
    return _in_source("accelerate.accelerator:Accelerator._do_sync", "self.step")


def _fully_shard_state() -> str | None:
    from torch.distributed.fsdp import fully_shard

    return None if callable(getattr(fully_shard, "state", None)) else "torch.distributed.fsdp.fully_shard.state is gone"


def _entry_points() -> str | None:
    import torch.distributed as dist

    missing = [n for n in ("all_reduce", "all_to_all_single", "broadcast", "all_gather_into_tensor",
                           "reduce_scatter_tensor") if not hasattr(dist, n)]
    return f"torch.distributed lacks {missing}" if missing else None


def _fsdp_collectives() -> str | None:
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as c

    source = inspect.getsource(c)
    found = [n for n in COLLECTIVE_ENTRY_POINTS if f"dist.{n}(" in source]
    return None if found else ("FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) calls none of "
                               f"{list(COLLECTIVE_ENTRY_POINTS)} through torch.distributed: the meter misses its bytes")


def _checkpoint_prefix() -> str | None:
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

    return None if getattr(cw, "_CHECKPOINT_PREFIX", None) == "_checkpoint_wrapped_module." else \
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper._CHECKPOINT_PREFIX changed"


def _orig_mod() -> str | None:
    return _in_source("torch._dynamo.eval_frame:OptimizedModule.__init__", "_orig_mod")


def _module_parameters() -> str | None:
    import torch

    return None if isinstance(getattr(torch.nn.Linear(1, 1), "_parameters", None), dict) else \
        "torch.nn.Module._parameters is not a dict"


def _c10d_options() -> str | None:
    try:
        collective_options()
    except ImportError as exc:
        return f"torch.distributed.distributed_c10d: {exc}"
    return None


def _trainer_accelerator() -> str | None:
    import accelerate
    import transformers.trainer as module

    if getattr(module, "Accelerator", None) is not accelerate.Accelerator:
        return "transformers.trainer.Accelerator is not accelerate.Accelerator"
    return _in_source("transformers.trainer:Trainer.create_accelerator_and_postprocess", "Accelerator(**args)")


def _trainer_overrides() -> str | None:
    from transformers import Trainer

    for name, params in TRAINER_OVERRIDES.items():
        method = getattr(Trainer, name, None)
        if method is None:
            return f"transformers.Trainer.{name} is gone"
        found = tuple(inspect.signature(method).parameters)[:len(params)]
        if found != params:
            return f"transformers.Trainer.{name} takes {found}, fl_accel.trainer relies on {params}"
    return None


def _manager_client() -> str | None:
    return _in_source("torchft.manager:Manager.__init__", "self._client") or \
        _has("torchft._torchft.ManagerClient", "_quorum")


REACHES: tuple[Reach, ...] = (
    Reach("accelerate.PartialState._shared_state['distributed_type']",
          "set_fsdp_state: FSDP on CPU too, and in every AcceleratorState() made later", _shared_state),
    Reach("accelerate AcceleratorState.distributed_type / fsdp_plugin / parallelism_config / device_mesh",
          "set_fsdp_state: Accelerate's FSDP2 branches read them (AcceleratorState.is_fsdp2)", _state_attributes),
    Reach("accelerate Accelerator._prepare_fsdp2",
          "prepare shards with fully_shard over the group's mesh (AC, regional compile, optimizer re-pointing); "
          "meta_parameter_keys where it maps parameters by data_ptr()", _prepare_fsdp2),
    Reach("accelerate Accelerator._models / _optimizers / _schedulers / _dataloaders",
          "prepared(): the synchronizer, checkpoints and torchft heals reach the prepared objects", _registered_lists),
    Reach("accelerate Accelerator.save_state / load_state iterate _models and _optimizers",
          "without_models_and_optimizers: Accelerate saves the rest of the state beside fl_accel's checkpoint",
          _save_state_loops),
    Reach("accelerate Accelerator.step (the accumulation counter)",
          "accumulation_counter: a torchft heal carries it", _accumulation_counter),
    Reach("torch.distributed collective entry points",
          "collective_entry_points / replace_dist_function: the comm meter wraps them", _entry_points),
    Reach("torch FSDP2 calls torch.distributed.<collective> at call time (_fsdp_collectives.py)",
          "the comm meter counts FSDP2's bytes by mesh axis", _fsdp_collectives),
    Reach("torch.distributed.fsdp.fully_shard.state",
          "fsdp_unit_key: parameters grouped by FSDP unit (fragments are whole units)", _fully_shard_state),
    Reach("torch checkpoint_wrapper._CHECKPOINT_PREFIX",
          "wrapper_prefixes: checkpoints resume across activation checkpointing", _checkpoint_prefix),
    Reach("torch._dynamo OptimizedModule._orig_mod",
          "wrapper_prefixes: checkpoints resume across compile", _orig_mod),
    Reach("torch.nn.Module._parameters",
          "swapped_parameters / own_parameters: meta-device materialization per module", _module_parameters),
    Reach("torch.distributed.distributed_c10d AllgatherOptions / AllreduceOptions / AllToAllOptions",
          "collective_options: torchft's process group takes them", _c10d_options),
    Reach("transformers.trainer.Accelerator (Trainer.create_accelerator_and_postprocess calls Accelerator(**args))",
          "trainer_accelerator: FLTrainer builds an FLAccelerator with Trainer's arguments", _trainer_accelerator,
          package="transformers"),
    Reach("transformers.Trainer methods " + ", ".join(TRAINER_OVERRIDES),
          "fl_accel.trainer overrides them (federated checkpoints, group-local token counts, the run's length)",
          _trainer_overrides, package="transformers"),
    Reach("torchft Manager._client / ManagerClient._quorum",
          "wrap_manager_client: one heal source per group (torchft #343)", _manager_client, package="torchft"),
)
