"""fl_accel/compat.py: the tested release range, and every reach into another library's internals.

* Each entry of :data:`REACHES` (an internal one function of fl_accel/compat.py reads) is
  checked on the installed releases; a release that moves
  the internal fails here with a message naming it (and what in fl_accel relies on it).
* No other module of fl_accel reads those internals (a scan of the code, strings and
  comments left out).
* A release outside the tested range warns at import instead of refusing; torchft's mode
  takes the API of the installed build (0.2.0, or 0.3's: torchft-nightly), warns on an untested
  build of a known API and refuses one of neither, naming the tested builds.
* The fallbacks chosen by existence (``all_gather_single``, ``reset_iter_state``) take the
  other path when the newer function is missing (control flow; the real older torch runs
  in CI's oldest environment, scripts/test_versions.sh).
"""

from __future__ import annotations

import importlib.util
import inspect
import io
import re
import tokenize
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from fl_accel import compat

ROOT = Path(__file__).resolve().parents[2]


# ======================================================================== the reaches and their checks
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
    found = [n for n in compat.COLLECTIVE_ENTRY_POINTS if f"dist.{n}(" in source]
    return None if found else ("FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) calls none of "
                               f"{list(compat.COLLECTIVE_ENTRY_POINTS)} through torch.distributed: the meter misses its bytes")


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
        compat.collective_options()
    except ImportError as exc:
        return f"torch.distributed.distributed_c10d: {exc}"
    return None


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


def _torchft_api() -> str:
    api = compat.torchft_api()
    if api is None:
        raise RuntimeError(f"the installed torchft ({compat.torchft_installed()}) has neither API")
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
    Reach("transformers.trainer.Accelerator (Trainer.create_accelerator_and_postprocess calls Accelerator(**args))",
          "trainer_accelerator: FLTrainer builds an FLAccelerator with Trainer's arguments", _trainer_accelerator,
          package="transformers"),
    Reach("transformers.Trainer methods " + ", ".join(TRAINER_OVERRIDES),
          "fl_accel.trainer overrides them (federated checkpoints, group-local token counts, the run's length)",
          _trainer_overrides, package="transformers"),
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


@pytest.mark.parametrize("reach", REACHES, ids=lambda r: r.internal)
def test_every_internal_fl_accel_relies_on_is_still_there(reach):
    if reach.package is not None and importlib.util.find_spec(reach.package) is None:
        pytest.skip(f"{reach.package} is not installed: the reach is used only by its optional mode "
                    f"(pip install -r requirements.txt installs it)")
    problem = reach.check()
    assert problem is None, f"{reach.internal} moved ({problem}); fl_accel relies on it in compat.{reach.used_by}"


# Names of other libraries' internals: allowed in fl_accel/compat.py only.
FOREIGN_INTERNALS = ("_shared_state", "._models", "._optimizers", "._schedulers", "._dataloaders", "_prepare_fsdp2",
                     "._parameters", "._client", "._quorum", "_orig_mod", "_checkpoint_wrapped_module",
                     "_CHECKPOINT_PREFIX", "distributed_c10d", "fully_shard.state", ".reset_iter_state",
                     "dist.all_gather_single", "setattr(dist", ".data_ptr =", "._server", "._serve",
                     "_streaming_load")


def _code_only(path: Path) -> str:
    """The file's code without strings, comments and calls of ``compat.<name>``."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type not in (tokenize.STRING, tokenize.COMMENT):
            out.append(tok.string)
    return re.sub(r"compat\.\w+", "", "".join(out))


def test_no_module_but_compat_reaches_into_internals():
    found = {}
    for path in sorted((ROOT / "fl_accel").rglob("*.py")):
        if path.name == "compat.py":
            continue
        code = _code_only(path)
        hits = [name for name in FOREIGN_INTERNALS if name.replace(" ", "") in code]
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert not found, f"internals of torch/accelerate/torchft read outside fl_accel/compat.py: {found}"


def test_a_planted_reach_is_found(tmp_path):
    """The scan above sees a reach in code and ignores one in a docstring."""
    planted = tmp_path / "m.py"
    planted.write_text('"""PartialState._shared_state in a docstring"""\nx = acc._models\n')
    code = _code_only(planted)
    assert "._models" in code and "_shared_state" not in code


@pytest.mark.parametrize("installed,expected", [
    ({"torch": "2.13.0+cpu", "accelerate": "1.15.0"}, []),
    ({"torch": "2.12.1", "accelerate": "1.14.0"}, []),
    ({"torch": "2.15.0", "accelerate": "1.16.0"}, []),
    ({"torch": "2.16.0", "accelerate": "1.16.0"}, ["torch 2.16.0 is installed; fl_accel is tested with torch 2.12 to 2.15"]),
    ({"torch": "2.13.0", "accelerate": "1.13.2"},
     ["accelerate 1.13.2 is installed; fl_accel is tested with accelerate 1.14 to 1.16"]),
    ({"torch": "2.13.0", "accelerate": None}, ["accelerate is not installed (fl_accel is tested with accelerate 1.14 to 1.16)"]),
])
def test_version_range(installed, expected):
    assert compat.version_problems(installed) == expected


def test_an_untested_release_warns_and_imports(monkeypatch):
    """Outside the range: a UserWarning naming the tested range, and no ImportError."""
    monkeypatch.setattr(compat, "_version", lambda name: {"torch": "2.99.0", "accelerate": "1.15.0"}[name])
    with pytest.warns(UserWarning, match=r"torch 2\.99\.0 is installed; fl_accel is tested with torch 2\.12 to 2\.15"):
        compat.check_versions()
    monkeypatch.setattr(compat, "_version", lambda name: {"torch": "2.14.1", "accelerate": "1.16.0"}[name])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.check_versions()


def test_pyproject_states_the_same_range():
    text = (ROOT / "pyproject.toml").read_text()
    (tl, th), (al, ah) = compat.TESTED["torch"], compat.TESTED["accelerate"]
    assert f'"torch>={tl[0]}.{tl[1]},<{th[0]}.{th[1] + 1}"' in text
    assert f'"accelerate>={al[0]}.{al[1]},<{ah[0]}.{ah[1] + 1}"' in text


def _installed(monkeypatch, builds: dict):
    """``compat._version`` answering for the distributions in ``builds`` only (others: missing)."""
    def fake(name):
        if name not in builds:
            raise compat.PackageNotFoundError(name)
        return builds[name]

    monkeypatch.setattr(compat, "_version", fake)


@pytest.mark.parametrize("builds,api", [({"torchft": "0.2.0"}, "0.2"), ({"torchft-nightly": "2026.10.26"}, "0.3")])
def test_torchft_mode_takes_the_api_of_the_tested_builds_silently(monkeypatch, builds, api):
    """torchft 0.2.0 runs the 0.2 path, the torchft-nightly build (0.3's API) the 0.3 path, no warning."""
    _installed(monkeypatch, builds)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.check_torchft_version() == api
    assert compat.pg_reconfigure_method(api) == {"0.2": "configure", "0.3": "reconfigure"}[api]


@pytest.mark.parametrize("builds,api", [({"torchft": "0.3.1"}, "0.3"), ({"torchft": "0.2.1"}, "0.2"),
                                        ({"torchft-nightly": "2026.11.2"}, "0.3")])
def test_torchft_mode_warns_on_an_untested_build_of_a_known_api(monkeypatch, builds, api):
    _installed(monkeypatch, builds)
    with pytest.warns(UserWarning, match=r"the torchft mode is tested with torchft==0\.2\.0 or "
                                         r"torchft-nightly==2026\.10\.26 \(its 0\.\d API is used\)"):
        assert compat.check_torchft_version() == api


@pytest.mark.parametrize("builds,match", [({"torchft": "0.1.1"}, r"supports torchft's 0\.2 and 0\.3 APIs.*found "
                                                                  r"torchft 0\.1\.1"),
                                          ({}, r"needs torchft \(`pip install torchft==0\.2\.0`")])
def test_torchft_mode_refuses_a_torchft_of_neither_api(monkeypatch, builds, match):
    _installed(monkeypatch, builds)
    with pytest.raises(ImportError, match=match):
        compat.check_torchft_version()


def test_the_pg_store_address_and_the_advertised_handle():
    """The store a (re)configuration connects to, for both APIs, and a 0.3 handle whose
    store host is replaced (the port kept; an IPv6 host in brackets)."""
    import json
    from types import SimpleNamespace

    assert compat.pg_store_address("0.2", ("10.0.0.1:1234/torchft/3/0", "r", 0, 2), {}) == "10.0.0.1:1234"
    assert compat.pg_store_address("0.2", (), {"store_addr": "h:5/p"}) == "h:5"
    handles = [json.dumps({"id": "a", "store": "vm:777", "global_rank": 0}), json.dumps({"id": "b", "store": "x:1"})]
    assert compat.pg_store_address("0.3", (SimpleNamespace(handles=handles),), {}) == "vm:777"
    moved = json.loads(compat.advertised_handle(handles[0], "10.213.0.2"))
    assert moved == {"id": "a", "store": "10.213.0.2:777", "global_rank": 0}
    assert json.loads(compat.advertised_handle(handles[0], "fe80::1"))["store"] == "[fe80::1]:777"


def test_fallbacks_follow_what_exists(monkeypatch):
    """Without ``dist.all_gather_single`` (torch 2.12) the gather is ``all_gather_into_tensor``
    with the same arguments; without ``reset_iter_state`` nothing runs."""
    import torch.distributed as dist

    calls = []
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda *a, **k: calls.append((a, k)))
    compat.all_gather_single("out", "in", group="g", async_op=True)
    assert calls == [(("out", "in"), {"group": "g", "async_op": True})]
    assert "all_gather_single" not in compat.collective_entry_points()

    class Old:
        pass

    class New:
        def __init__(self):
            self.ran = False

        def reset_iter_state(self):
            self.ran = True

    new = New()
    assert compat.reset_iter_state(Old()) is False
    assert compat.reset_iter_state(new) is True and new.ran
