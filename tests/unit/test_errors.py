"""fl_accel/errors.py without processes: which exceptions are refusals, the once-per-node print,
the error file torchrun reads, and the excepthook's install (the launched view:
tests/dist/test_launch_errors.py); the hints on refused choices (num_groups, diloco)."""

from __future__ import annotations

import sys

import pytest

from fl_accel import FLConfig, errors
from scripts.launch import error_file_message


def _raised(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return exc
    raise AssertionError("nothing raised")


def test_a_value_error_raised_inside_fl_accel_is_a_refusal(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    inside = _raised(lambda: FLConfig(sync_every=0))
    assert errors.refusal_line(inside) == f"[fl_accel] error (rank 3): {inside}"

    def outside():
        raise ValueError("a user's own error")

    assert errors.refusal_line(_raised(outside)) is None
    assert errors.refusal_line(RuntimeError("x")) is None


def _attempt(tmp_path, rank: int):
    """torchelastic's layout: <run>/attempt_0/<local rank>/error.json."""
    folder = tmp_path / "attempt_0" / str(rank)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "error.json"


def test_say_once_prints_once_per_node_and_key(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(_attempt(tmp_path, 0)))
    assert errors.say_once("[fl_accel] error (rank 0): bad", key="bad")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(_attempt(tmp_path, 1)))
    assert not errors.say_once("[fl_accel] error (rank 1): bad", key="bad")  # another rank, same message
    assert errors.say_once("[fl_accel] error (rank 1): other", key="other")
    assert capsys.readouterr().err.splitlines() == ["[fl_accel] error (rank 0): bad", "[fl_accel] error (rank 1): other"]
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")  # no launcher: always
    assert errors.say_once("x") and errors.say_once("x")


def test_the_error_file_is_what_torchrun_and_launch_guard_read(tmp_path, monkeypatch):
    path = _attempt(tmp_path, 0)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    errors.record_for_launcher("[fl_accel] error (rank 0): bad")
    assert error_file_message(path) == ("[fl_accel] error (rank 0): bad", None)
    errors.record_for_launcher("RuntimeError: x", "Traceback ...\nRuntimeError: x")
    assert error_file_message(path) == ("RuntimeError: x", "Traceback ...\nRuntimeError: x")
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))  # torchrun's own reader
    assert failure.message["extraInfo"]["py_callstack"] == "Traceback ...\nRuntimeError: x"


def test_the_hook_is_installed_only_under_a_launcher_chained_and_once(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: calls.append(a))
    monkeypatch.setattr(errors, "_previous_hook", None)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    errors.install()
    assert sys.excepthook is not errors.excepthook
    path = _attempt(tmp_path, 0)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setenv("RANK", "0")
    errors.install()
    errors.install()
    assert sys.excepthook is errors.excepthook
    refusal = _raised(lambda: FLConfig(num_groups=0))
    errors.excepthook(type(refusal), refusal, refusal.__traceback__)
    assert calls == [] and capsys.readouterr().err == f"[fl_accel] error (rank 0): {refusal}\n"  # no traceback
    assert error_file_message(path)[0] == f"[fl_accel] error (rank 0): {refusal}"
    path.unlink()
    other = _raised(lambda: 1 / 0)
    errors.excepthook(type(other), other, other.__traceback__)
    assert len(calls) == 1 and calls[0][1] is other  # the hook before prints it
    assert error_file_message(path)[0] == "ZeroDivisionError: division by zero"


@pytest.mark.parametrize("fields,hint", [
    ({"algorithm": "diloco"}, "outer_optimizer='nesterov' (recipe: --outer_optimizer nesterov)"),
    ({"algorithm": "FedAvg"}, "outer_optimizer='avg'"),
    ({"outer_optimizer": "diloco"}, "DiLoCo's outer optimizer is 'nesterov'"),
])
def test_names_from_papers_get_a_hint(fields, hint):
    with pytest.raises(ValueError, match="must be one of") as err:
        FLConfig(**fields)
    assert hint in str(err.value)


def test_num_groups_that_do_not_divide_the_world_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"num_groups=5 does not divide the world size 12: .*valid for 12 ranks: "
                                         r"1, 2, 3, 4, 6, 12;"):
        FLConfig(num_groups=5).for_launch(12)
