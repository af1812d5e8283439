"""fl_accel/compat.py: the tested release range, and every reach into another library's internals.

* Each entry of ``compat.REACHES`` is checked on the installed releases; a release that moves
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
import io
import re
import tokenize
import warnings
from pathlib import Path

import pytest

from fl_accel import compat

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("reach", compat.REACHES, ids=lambda r: r.internal)
def test_every_internal_fl_accel_relies_on_is_still_there(reach):
    if reach.package is not None and importlib.util.find_spec(reach.package) is None:
        pytest.skip(f"{reach.package} is not installed: the reach is used only by its optional mode")
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
