"""scripts/launch_guard.py's parts without a launch (issue 42): the error file torchelastic
writes (as the recipe fills it) read back, the closing lines of a failed rank, and a command
that is neither torchrun nor accelerate launch. A real bad input through torchrun:
tests/recipe/test_bad_inputs.py; through the quickstart's accelerate launch:
tests/tools/test_quickstart.py."""

import json

from _launch import assert_one_line_error
from scripts import launch_guard
from scripts.launch import error_file_message


def test_error_file_message_and_the_closing_lines(tmp_path):
    line = "[fl_accel] error (rank 1): --max_steps must be >= 1, got -3"
    recipe = tmp_path / "recipe.json"  # what the recipe writes (fl_accel.errors.record_for_launcher)
    recipe.write_text(json.dumps({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                             "timestamp": "1"}}}))
    assert error_file_message(recipe) == (line, None)
    recorded = tmp_path / "record.json"  # torch's @record: a traceback beside the one-line message
    recorded.write_text(json.dumps({"message": {"message": "ValueError: bad", "extraInfo": {
        "py_callstack": "Traceback (most recent call last):\n  ...\nValueError: bad", "timestamp": "1"}}}))
    assert error_file_message(recorded) == ("ValueError: bad", "Traceback (most recent call last):\n  ...\n"
                                                               "ValueError: bad")
    for missing in (None, tmp_path / "none.json"):
        assert error_file_message(missing) == (None, None)
    (tmp_path / "bad.json").write_text("{not json")
    assert error_file_message(tmp_path / "bad.json") == (None, None)

    assert launch_guard.failure_lines("recipes/pretrain.py", 1, 2, str(recipe)) == [
        "[launch_guard] recipes/pretrain.py failed: rank 1 ended with status 2 (the launcher stopped the other "
        "ranks); its error:", line]
    lines = launch_guard.failure_lines("train.py", 0, 1, str(recorded))
    assert lines[-1] == "ValueError: bad" and lines[1].startswith("Traceback")
    assert launch_guard.failure_lines("train.py", 0, -9, str(tmp_path / "none.json")) is None  # torchrun's box


def test_status_of_a_refused_input_cut_short_by_the_launcher(tmp_path):
    """A rank that recorded its refused input and then died by the launcher's SIGTERM (sent when
    another rank exited first; the full suite met it once under load) ends with the recipe's
    status 2; other signals and statuses pass through."""
    recipe = tmp_path / "recipe.json"
    line = "[fl_accel] error (rank 3): --max_steps must be >= 1, got -3"
    recipe.write_text(json.dumps({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                             "timestamp": "1"}}}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"message": {"message": "RuntimeError: boom", "extraInfo": {
        "py_callstack": "RuntimeError: boom", "timestamp": "1"}}}))
    assert launch_guard.status_of(-15, str(recipe)) == 2
    assert launch_guard.status_of(2, str(recipe)) == 2
    assert launch_guard.status_of(-15, str(other)) == 143
    assert launch_guard.status_of(-9, str(tmp_path / "none.json")) == 137
    assert launch_guard.status_of(1, None) == 1


def test_only_torchrun_or_accelerate_launch(capsys):
    for bad in ([], ["python", "train.py"], ["accelerate", "config"]):
        assert_one_line_error(launch_guard.main, bad, capsys)
