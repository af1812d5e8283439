"""Every reach of fl_accel into the internals of torch, Accelerate, torchft and transformers, in one module.

fl_accel is tested on torch 2.12-2.15 and accelerate 1.14-1.16 (:data:`TESTED`; CI runs the
oldest and the newest pair, ``scripts/test_versions.sh``). A release outside that range gets a
warning at import (:func:`check_versions`), not an error. Where two releases differ, the code
below picks its path by checking what exists (``hasattr``, a signature, a source line), never
by version number; except torchft, whose 0.2 and 0.3 APIs (managed group rebuilt, Lighthouse
protocol) no attribute tells apart: the installed build picks the path (:func:`torchft_api`).

Each reach is a function here; ``tests/unit/test_compat.py`` lists them (``REACHES``: the
internal, what relies on it, and a check it runs on the installed releases, failing with a
message that names the internal if a release moves it). Nothing else in fl_accel reads a
private attribute of another library (``tests/unit/test_compat.py`` greps for it).

Why the FSDP2 sharding goes through Accelerate's private preparation (one reach: the state,
:func:`set_fsdp_state`), and the public APIs used instead of internals: docs/api.md, "Versions".
"""

from __future__ import annotations

import contextlib
import inspect
import json
import re
import warnings
from importlib.metadata import PackageNotFoundError, version as _version
from typing import Callable

TESTED = {"torch": ((2, 12), (2, 15)), "accelerate": ((1, 14), (1, 16))}
"""Inclusive (major, minor) ranges fl_accel is tested on (pyproject.toml says the same)."""
TORCHFT_TESTED = {"torchft": "0.2.0", "torchft-nightly": "2026.10.26"}
"""The torchft builds (distribution: version) the torchft mode is tested with, 0.2's API and
0.3's (the nightly); CI runs tests/ft on both (``scripts/test_versions.sh``)."""


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
    never raises: an untested release may work, and tests/unit/test_compat.py says what to check."""
    problems = version_problems()
    if problems:
        warnings.warn("fl_accel: " + "; ".join(problems) + ". It may work; if something breaks, "
                      "`python -m pytest tests/unit/test_compat.py` names the internal that moved.",
                      UserWarning, stacklevel=3)


def torchft_installed() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed torchft (``torchft`` or ``torchft-nightly``); None."""
    for dist in TORCHFT_TESTED:
        with contextlib.suppress(PackageNotFoundError):
            return dist, _version(dist)
    return None


def torchft_api(installed: tuple[str, str] | None = None) -> str | None:
    """The API of a torchft build (default: the installed one): ``"0.2"`` (0.2.x: the managed group is
    rebuilt with ``ProcessGroup.configure(store_addr, ...)``), ``"0.3"`` (0.3.x and torchft-nightly:
    ``pg.reconfigure(ReconfigureOptions)`` with handles exchanged through the Lighthouse; a 0.3
    replica cannot talk to a 0.2 Lighthouse); None: no torchft, or neither API."""
    installed = torchft_installed() if installed is None else installed
    if installed is None or installed[0] == "torchft-nightly":  # nightly builds carry 0.3's API
        return None if installed is None else "0.3"
    return {(0, 2): "0.2", (0, 3): "0.3"}.get(_minor(installed[1]))


def check_torchft_version() -> str:
    """The API of the installed torchft (:func:`torchft_api`), for ``fault_tolerance="torchft"``.
    Another build than :data:`TORCHFT_TESTED` of a known API warns (``UserWarning``) and runs its
    API's path; the Lighthouse must come from the same build (scripts/ft_launch.py starts it).
    ImportError: torchft is not installed, or has neither API (naming the tested builds)."""
    tested, installed = " or ".join(f"{d}=={v}" for d, v in TORCHFT_TESTED.items()), torchft_installed()
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


# ======================================================================== transformers (fl_accel.trainer)
@contextlib.contextmanager
def trainer_accelerator(factory):
    """While entered, ``Trainer.create_accelerator_and_postprocess`` builds its accelerator with
    ``factory(**args)``: its ``Accelerator(**args)`` looks up ``transformers.trainer.Accelerator``,
    swapped meanwhile (Trainer has no parameter for the class; fl_accel.trainer overrides some of
    Trainer's private methods too: tests/unit/test_compat.py's ``TRAINER_OVERRIDES`` checks them)."""
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
    """The wrapped client's ``_quorum`` call (0.3 adds the ``reconfigure_handle`` keyword: passed on)."""
    return client._quorum(*args, **kwargs)


def pg_reconfigure_method(api: str) -> str:
    """The managed group's method torchft's ``Manager`` calls on a new quorum: ``"configure"`` (0.2:
    ``configure(store_addr, replica_id, rank, world_size, ...)``), ``"reconfigure"`` (0.3: ``(ReconfigureOptions)``)."""
    return {"0.2": "configure", "0.3": "reconfigure"}[api]


def pg_store_address(api: str, args: tuple, kwargs: dict) -> str:
    """``host:port`` of the store a (re)configuration call (:func:`pg_reconfigure_method`) connects
    to: 0.2, its ``store_addr`` (``host:port/prefix``); 0.3, the ``store`` of ``opts.handles[0]``
    (torchft's ``_rendezvous``: every rank rendezvouses on the first handle's store)."""
    if api == "0.2":
        addr = kwargs["store_addr"] if "store_addr" in kwargs else args[0]
        return addr.split("/", 1)[0]
    opts = kwargs["opts"] if "opts" in kwargs else args[0]
    return json.loads(list(opts.handles)[0])["store"]


def advertised_handle(handle: str, host: str) -> str:
    """A torchft 0.3 reconfigure handle (``ProcessGroup.get_reconfigure_handle``: JSON, ``"store":
    "<socket.gethostname()>:<port>"``, the store this process serves) with the store's host ``host``."""
    data = json.loads(handle)
    _, _, port = data["store"].rpartition(":")
    data["store"] = f"{f'[{host}]' if ':' in host else host}:{port}"
    return json.dumps(data)


def checkpoint_server_port(transport) -> int:
    """The port of a torchft ``HTTPTransport``'s checkpoint server (``HTTPTransport._server``)."""
    return transport._server.socket.getsockname()[1]


def rebind_checkpoint_server(transport, host: str) -> None:
    """Serve a torchft ``HTTPTransport``'s checkpoints on ``host`` only: its server (``_server``, run by
    ``_thread`` in ``_serve``), bound to every interface, is replaced by one bound to ``(host, 0)``."""
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
    """torch's loader of a streamed state (``torch.distributed._serialization._streaming_load``, as
    torchft's ``HTTPTransport``; ``weights_only=False`` as torchft: the state holds Python values)."""
    from torch.distributed._serialization import _streaming_load

    return _streaming_load(f, weights_only=False)
