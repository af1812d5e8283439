"""Every reach of fl_accel into the internals of torch, Accelerate and torchft, in one module.

fl_accel is tested on torch 2.12-2.15 and accelerate 1.14-1.16 (:data:`TESTED`; CI runs the
oldest and the newest pair, ``scripts/test_versions.sh``). A release outside that range gets a
warning at import (:func:`check_versions`), not an error. Where two releases differ, the code
below picks its path by checking what exists (``hasattr``, a signature, a source line), never
by version number; torchft is the exception: its 0.2 and 0.3 APIs differ in how the Manager
rebuilds the managed process group and in the Lighthouse's protocol (which no attribute shows),
so the installed build picks the path (:func:`torchft_api`; :data:`TORCHFT_TESTED`, both run by
CI), and the reaches of that path are checked.

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
TORCHFT_TESTED = {"torchft": "0.2.0", "torchft-nightly": "2026.10.26"}
"""The torchft builds the fault-tolerant mode (``fl_accel.ft``) is tested with, by distribution:
torchft 0.2.0 (its 0.2 API) and the torchft-nightly build 2026.10.26, which carries torchft
0.3's API. CI runs tests/ft on both (``scripts/test_versions.sh``)."""


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


def torchft_installed() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed torchft: ``("torchft", "0.2.0")`` or
    ``("torchft-nightly", "2026.10.26")`` (both install the ``torchft`` package); None if neither."""
    for dist in TORCHFT_TESTED:
        try:
            return dist, _version(dist)
        except PackageNotFoundError:
            continue
    return None


def torchft_api(installed: tuple[str, str] | None = None) -> str | None:
    """The torchft API a build carries, from its distribution and version: ``"0.2"`` (torchft
    0.2.x: the managed process group is rebuilt with ``ProcessGroup.configure(store_addr, ...)``
    on the quorum's store) or ``"0.3"`` (torchft 0.3.x and torchft-nightly builds, which took
    0.3's API: ``Manager`` requires ``pg.supports_reconfigure`` and calls
    ``pg.reconfigure(ReconfigureOptions)`` with the handles every replica sent the Lighthouse;
    a 0.3 replica cannot talk to a 0.2 Lighthouse). None: no torchft, or a release with neither
    API (0.1, or a later one fl_accel does not know). ``installed``: default what is installed."""
    installed = torchft_installed() if installed is None else installed
    if installed is None:
        return None
    dist, found = installed
    if dist == "torchft-nightly":
        return "0.3"
    minor = _minor(found)
    return {(0, 2): "0.2", (0, 3): "0.3"}.get(minor)


def check_torchft_version() -> str:
    """The API of the installed torchft (:func:`torchft_api`), for ``fault_tolerance="torchft"``.

    Tested: :data:`TORCHFT_TESTED`. Another 0.2.x or 0.3.x release, or another nightly, gets a
    ``UserWarning`` naming the tested builds and runs the path of its API. The Lighthouse must
    come from the same build as the replicas (scripts/ft_launch.py starts the installed one).

    Raises:
        ImportError: torchft is not installed, or its release has neither API (naming it and
            the tested builds)."""
    tested = " or ".join(f"{d}=={v}" for d, v in TORCHFT_TESTED.items())
    installed = torchft_installed()
    if installed is None:
        raise ImportError(f"fault_tolerance='torchft' needs torchft (`pip install torchft==0.2.0`, or "
                          f"`pip install -e .[ft]`; tested: {tested})") from None
    api = torchft_api(installed)
    if api is None:
        raise ImportError(f"fault_tolerance='torchft' supports torchft's 0.2 and 0.3 APIs (tested: {tested}); found "
                          f"{installed[0]} {installed[1]}: install one of the tested builds")
    if TORCHFT_TESTED.get(installed[0]) != installed[1]:
        warnings.warn(f"fl_accel: {installed[0]} {installed[1]} is installed; the torchft mode is tested with "
                      f"{tested} (its {api} API is used)", UserWarning, stacklevel=3)
    return api


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
    """The wrapped client's ``_quorum`` call (0.3 adds the ``reconfigure_handle`` keyword: passed on)."""
    return client._quorum(*args, **kwargs)


def pg_reconfigure_method(api: str) -> str:
    """The managed process group's method torchft's ``Manager`` calls on a new quorum:
    ``"configure"`` (0.2: ``configure(store_addr, replica_id, rank, world_size, ...)``) or
    ``"reconfigure"`` (0.3: ``reconfigure(ReconfigureOptions)``)."""
    return {"0.2": "configure", "0.3": "reconfigure"}[api]


def pg_store_address(api: str, args: tuple, kwargs: dict) -> str:
    """``host:port`` of the store a (re)configuration call (:func:`pg_reconfigure_method`) will
    connect to: 0.2, its ``store_addr`` (``host:port/prefix``: the quorum's store); 0.3, the
    ``store`` of the first handle of ``opts.handles`` (torchft's ``_rendezvous``: every rank
    rendezvouses on the first handle's store)."""
    import json

    if api == "0.2":
        addr = kwargs["store_addr"] if "store_addr" in kwargs else args[0]
        return addr.split("/", 1)[0]
    opts = kwargs["opts"] if "opts" in kwargs else args[0]
    return json.loads(list(opts.handles)[0])["store"]


def advertised_handle(handle: str, host: str) -> str:
    """A torchft 0.3 reconfigure handle (``ProcessGroup.get_reconfigure_handle``: JSON with
    ``"store": "<socket.gethostname()>:<port>"`` of the store the group's own process serves)
    with the store's host replaced by ``host``."""
    import json

    data = json.loads(handle)
    _, _, port = data["store"].rpartition(":")
    data["store"] = f"{f'[{host}]' if ':' in host else host}:{port}"
    return json.dumps(data)


def checkpoint_server_port(transport) -> int:
    """The port of a torchft ``HTTPTransport``'s checkpoint server (``HTTPTransport._server``)."""
    return transport._server.socket.getsockname()[1]


def rebind_checkpoint_server(transport, host: str) -> None:
    """Serve a torchft ``HTTPTransport``'s checkpoints on ``host`` only: torchft binds its
    server (``_server``, served by ``_thread`` running ``_serve``) to every interface ("::");
    it is shut down and a server of the same request handler is bound to ``(host, 0)``."""
    import socket
    import threading
    from http.server import ThreadingHTTPServer

    old = transport._server
    handler = old.RequestHandlerClass
    old.shutdown()
    transport._thread.join()
    old.server_close()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type("CheckpointServer", (ThreadingHTTPServer,), {"address_family": family,
                                                                     "request_queue_size": 1024})
    transport._server = server_class((host, 0), handler)
    transport._thread = threading.Thread(target=transport._serve, daemon=True)
    transport._thread.start()


def streaming_load(f):
    """torch's loader of a streamed state (``torch.distributed._serialization._streaming_load``,
    which torchft's ``HTTPTransport`` uses; ``weights_only=False`` as torchft: the state holds
    Python values, e.g. the LR schedulers')."""
    from torch.distributed._serialization import _streaming_load

    return _streaming_load(f, weights_only=False)


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


def _manager_client() -> str | None:
    return _in_source("torchft.manager:Manager.__init__", "self._client") or \
        _has("torchft._torchft.ManagerClient", "_quorum")


def _torchft_api() -> str:
    api = torchft_api()
    if api is None:
        raise RuntimeError(f"the installed torchft ({torchft_installed()}) has neither API")
    return api


def _pg_reconfigure() -> str | None:
    if _torchft_api() == "0.2":
        return _has("torchft.process_group.ProcessGroup", "configure") or \
            _in_source("torchft.manager:Manager._async_quorum", "store_prefixed_addr", "self._pg.configure(")
    return _has("torchft.process_group.ProcessGroup", "reconfigure") or \
        _in_source("torchft.manager:Manager._async_quorum", "reconfigure_handle=self._pg.get_reconfigure_handle()") \
        or _in_source("torchft.process_group:_rendezvous", "peers[0]['store']")


def _reconfigure_handle() -> str | None:
    if _torchft_api() == "0.2":
        return None
    return _in_source("torchft.process_group:ProcessGroup.get_reconfigure_handle", '"store"', "store.port")


def _checkpoint_server() -> str | None:
    return _in_source("torchft.checkpointing.http_transport:HTTPTransport.__init__", "self._server",
                      "self._thread", "RequestHandler") or \
        _has("torchft.checkpointing.http_transport.HTTPTransport", "_serve")


def _streaming_load() -> str | None:
    return _has("torch.distributed._serialization", "_streaming_load") or \
        _in_source("torch.distributed._serialization:_PseudoZipFile.read_from", "f.read(")


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
    Reach("torchft Manager._client / ManagerClient._quorum",
          "wrap_manager_client: one heal source per group (torchft #343)", _manager_client, package="torchft"),
    Reach("torchft ProcessGroup.configure (0.2) / reconfigure with the first handle's store (0.3)",
          "pg_reconfigure_method / pg_store_address: a dead heal source's store fails the round within seconds",
          _pg_reconfigure, package="torchft"),
    Reach("torchft 0.3 ProcessGroup.get_reconfigure_handle's JSON (store host:port)",
          "advertised_handle: FLConfig.heal_address for the managed group's rendezvous store", _reconfigure_handle,
          package="torchft"),
    Reach("torchft HTTPTransport._server / _thread / _serve",
          "checkpoint_server_port / rebind_checkpoint_server: FLConfig.heal_address for the heal's server",
          _checkpoint_server, package="torchft"),
    Reach("torch.distributed._serialization._streaming_load (reads tensors with f.read)",
          "streaming_load: the heal's download into writable buffers", _streaming_load),
)
