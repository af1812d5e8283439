"""A table of bad inputs, and the few that need real processes to show how the user sees them.

Every input in :data:`CASES` is refused in pure Python by ``recipes.run_folder.plan_run``,
which every rank runs before any process group exists: the same ``RecipeError`` (a
ValueError naming the flag, key, file or setting) on every rank, and nothing written, so no
rank is left waiting in a collective. They run in-process here (a launch per case cost
about 10 s of imports each). The launched tests check the user's view end to end: the
one-line error on the ranks and in torchrun's "Root Cause" box, an error found after
data preparation on the main rank reaching the other rank, and settings of an Accelerate
config file refused with the file's name.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from fl_accel.checkpoint import FORMAT_VERSION
from _launch import REPO_ROOT, free_port, launch_env, run_torchrun
from recipes.run_folder import plan_run

RECIPE = REPO_ROOT / "recipes" / "pretrain.py"
NPROC = 2


def _yaml(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return ["--config", str(path)]


def _file(tmp_path, name, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def _foreign_checkpoint(tmp_path, **overrides):
    """A complete-looking checkpoint whose metadata says another setup wrote it."""
    ckpt = tmp_path / "ckpt" / "step_4"
    ckpt.mkdir(parents=True)
    meta = {"format_version": FORMAT_VERSION, "algorithm": "fl_fsdp", "world_size": 4, "group_sizes": [2, 2], "shards": 2,
            "outer_optimizer": "avg", "sync_dtype": "fp32", "error_feedback": False, "num_fragments": 1,
            "completed_steps": 4, **overrides}
    (ckpt / "fl_accel_checkpoint.json").write_text(json.dumps(meta))
    (ckpt / ".metadata").write_bytes(b"")
    return str(ckpt)


CASES = {
    # name: (builder(tmp_path) -> extra args, expected message fragment)
    "yaml_wrong_type": (lambda t: _yaml(t, "micro_batch_size: four\n"), "micro_batch_size must be an integer"),
    "yaml_fl_wrong_type": (lambda t: _yaml(t, "fl:\n  num_groups: '2'\n"), "FLConfig.num_groups must be an integer"),
    "yaml_not_a_mapping": (lambda t: _yaml(t, "- a\n- b\n"), "must be a YAML mapping"),
    "yaml_unknown_key": (lambda t: _yaml(t, "learning_rat: 0.1\n"),
                         "unknown key 'learning_rat' (did you mean 'learning_rate'?)"),
    "zero_micro_batch": (lambda t: ["--micro_batch_size", "0"], "--micro_batch_size must be >= 1"),
    "negative_groups": (lambda t: ["--num_groups", "-2"], "FLConfig.num_groups must be >= 1"),
    "zero_sync_every": (lambda t: ["--sync_every", "0"], "FLConfig.sync_every must be >= 1"),
    "unknown_algorithm": (lambda t: _yaml(t, "fl:\n  algorithm: fedprox\n"), "FLConfig.algorithm must be one of"),
    "algorithm_diloco": (lambda t: ["--algorithm", "diloco"], "with outer_optimizer='nesterov' (recipe: "
                                                              "--outer_optimizer nesterov)"),
    "unknown_outer_optimizer": (lambda t: _yaml(t, "fl:\n  outer_optimizer: adam\n"),
                                "FLConfig.outer_optimizer must be one of"),
    "world_not_divisible": (lambda t: ["--num_groups", "3"], "num_groups=3 does not divide the world size 2: "
                                                             "equal federation groups need the same number of ranks "
                                                             "(valid for 2 ranks: 1, 2;"),
    "group_sizes_sum": (lambda t: ["--group_sizes", "1,2"], "--group_sizes 1,2 sums to 3 ranks, but 2 were launched"),
    "shard_not_dividing_group": (lambda t: ["--algorithm", "fl_hsdp", "--num_groups", "1", "--hsdp_shard_size", "3"],
                                 "hsdp_shard_size=3 does not divide the group size 2"),
    "seq_len_too_long": (lambda t: ["--seq_len", "4096"], "exceeds the model's max_position_embeddings 1024"),
    "missing_train_file": (lambda t: ["--train_file", str(t / "nope.txt")], "does not exist"),
    "empty_corpus": (lambda t: ["--train_file", _file(t, "empty.txt", b"\n  \n")], "is empty: no text"),
    "non_utf8_text": (lambda t: ["--train_file", _file(t, "latin1.txt", "caf\xe9 cr\xe8me\n".encode("latin-1"))],
                      "is not UTF-8 text"),
    "checkpoint_other_world_size": (lambda t: ["--num_groups", "2", "--resume_from_checkpoint", _foreign_checkpoint(t)],
                                    "world_size=4 vs 2"),
    "checkpoint_other_algorithm": (lambda t: ["--algorithm", "fsdp", "--resume_from_checkpoint",
                                              _foreign_checkpoint(t, world_size=2, group_sizes=[2], shards=2)],
                                   "algorithm='fl_fsdp' vs 'fsdp'"),
    "checkpoint_incomplete": (lambda t: ["--resume_from_checkpoint", str(t)], "is not a complete fl_accel checkpoint"),
    "checkpoint_corrupt_metadata": (
        lambda t: ["--resume_from_checkpoint",
                   os.path.dirname(_file(t, "fl_accel_checkpoint.json", b"{not json"))],
        "corrupt checkpoint metadata"),
    "fsdp_version_1": (lambda t: [], "fl_accel needs FSDP2"),
    "fp16_from_the_launcher": (lambda t: [], "does not support fp16"),
}
ENVIRON = {"fsdp_version_1": {"FSDP_VERSION": "1"}, "fp16_from_the_launcher": {"ACCELERATE_MIXED_PRECISION": "fp16"}}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_refused_before_any_collective(case, tmp_path):
    """In-process, as each of 2 ranks runs it: one line naming the problem, nothing written."""
    build, expected = CASES[case]
    out_dir = tmp_path / "out"
    argv = ["--report_to", "none", "--output_dir", str(out_dir), "--checkpoint_every", "1", *build(tmp_path)]
    for rank in ("0", "1"):
        environ = {"WORLD_SIZE": str(NPROC), "LOCAL_WORLD_SIZE": str(NPROC), "RANK": rank, **ENVIRON.get(case, {})}
        with pytest.raises(ValueError) as err:  # RecipeError, or recipes.data.DataError for data files
            plan_run(argv, environ=environ)
        assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not out_dir.exists()


def assert_every_rank_failed(result, expected: str) -> None:
    """The error reached the user: at least one rank printed it (each rank raises it before any
    collective; whichever exits first makes torchrun stop the others, possibly before they
    print, or even before they install their SIGTERM handler, so that part is not asserted)."""
    errored = {line.split("(rank ")[1].split(")")[0] for line in result.stderr.splitlines()
               if line.startswith("[fl_accel] error (rank ") and expected in line}
    assert errored, result.tail()
    # torchrun's failure summary, printed last, repeats the one-line error (the recipe hands it
    # over through TORCHELASTIC_ERROR_FILE) instead of "To enable traceback see ..."
    summary = result.stderr.rsplit("Root Cause", 1)[-1]
    assert expected in summary, result.tail()


def test_launched_bad_input_is_one_line_and_torchruns_root_cause(tmp_path):
    """What a user sees from torchrun: the one-line error, printed once (every rank refuses it,
    the first to get there on the node prints it: fl_accel.errors.say_once), no traceback of a
    rank, and the line again last in the launcher's "Root Cause" box; no checkpoint."""
    out_dir = tmp_path / "out"
    result = run_torchrun(NPROC, RECIPE, "--report_to", "none", "--output_dir", str(out_dir), "--checkpoint_every",
                          "1", *_yaml(tmp_path, "max_step: 3\nlr: 0.1\n"), timeout=120,
                          launcher="torchrun")
    assert not result.timed_out and result.returncode != 0, result.tail()
    assert_every_rank_failed(result, "2 bad keys in --config")
    assert "did you mean 'max_steps'?" in result.stderr and "did you mean 'learning_rate'?" in result.stderr
    printed = [line for line in result.stderr.splitlines() if line.startswith("[fl_accel] error (rank ")]
    assert len(printed) == 1, result.tail()
    assert result.stderr.count("Traceback (most recent call last)") == 1, result.tail()  # torchrun's own only
    assert not (out_dir / "checkpoints").exists()


def _last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def test_launch_guard_ends_a_torchrun_bad_input_with_its_one_line_error(tmp_path):
    """Issue 42: through ``python -m scripts.launch_guard torchrun ...`` (2 ranks) the last line
    a user sees (stdout and stderr as one terminal shows them) is the recipe's one-line error,
    the exit status is the rank's (2: bad input), and there is no launcher traceback: torchrun's
    ``ChildFailedError`` was caught and the failed rank's error file read."""
    cmd = [sys.executable, "-m", "scripts.launch_guard", "torchrun", "--nproc_per_node", str(NPROC), "--master_port",
           str(free_port()), str(RECIPE), "--report_to", "none", "--output_dir", str(tmp_path / "out"),
           "--max_steps", "-3"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 2, out[-4000:]
    assert re.fullmatch(r"\[fl_accel\] error \(rank \d\): --max_steps must be >= 1, got -3", _last_line(out)), out[-4000:]
    assert re.search(r"\[launch_guard\] .*pretrain\.py failed: rank \d ended with status 2", out), out[-4000:]
    assert "Traceback" not in out and "ChildFailedError" not in out and "Root Cause" not in out, out[-4000:]


def test_validation_split_too_small_fails_on_every_rank(tmp_path):
    """Found after data preparation (main rank first); the other rank must fail too, not wait."""
    train = _file(tmp_path, "train.txt", ("To be, or not to be, that is the question.\n" * 400).encode())
    val = _file(tmp_path, "val.txt", b"Brief.\n")
    result = run_torchrun(NPROC, RECIPE, "--report_to", "none", "--output_dir", str(tmp_path / "out"),
                          "--train_file", train, "--validation_file", val, "--seq_len", "32",
                          "--vocab_size", "300", "--cache_dir", str(tmp_path / "cache"), timeout=240)
    assert not result.timed_out, result.tail()
    assert result.returncode != 0
    assert_every_rank_failed(result, "validation split has 0 blocks")
    # Both ranks were well past start-up (their SIGTERM handler installed): each either printed
    # the error itself or was stopped by torchrun after its peer failed; none waited in a collective.
    reported = {line.split("rank ")[1].split(")")[0].split(":")[0] for line in result.stderr.splitlines()
                if "validation split has 0 blocks" in line and line.startswith("[fl_accel] error")
                or "stopped by the launcher" in line}
    assert reported == {"0", "1"}, result.tail()


@pytest.mark.parametrize("setting,expected", [
    ("fsdp_version: 1", "fl_accel needs FSDP2, got fsdp_version: 1 in the Accelerate config"),
    ("mixed_precision: fp16", "requested by mixed_precision: fp16 in the Accelerate config"),
])
def test_accelerate_config_settings_fl_accel_cannot_honour_name_the_file(tmp_path, setting, expected):
    """``accelerate launch --config_file <yaml>`` with FSDP1 or fp16: one line per rank naming the
    setting and the file (not four tracebacks of a raw Accelerate error)."""
    text = (REPO_ROOT / "accelerate_configs" / "cpu_4proc.yaml").read_text().replace("num_processes: 4",
                                                                                     f"num_processes: {NPROC}")
    key = setting.split(":")[0]
    text = "\n".join(line for line in text.splitlines() if not line.strip().startswith(f"{key}:"))
    text = text.replace("fsdp_config:\n", f"fsdp_config:\n  {setting}\n") if key == "fsdp_version" \
        else text + f"\n{setting}\n"
    cfg = tmp_path / "accelerate.yaml"
    cfg.write_text(text)
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(cfg),
           "--main_process_port", str(free_port()), str(RECIPE), "--report_to", "none", "--output_dir",
           str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=launch_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("[fl_accel] error (rank ")]
    assert lines and all(expected in line and str(cfg) in line for line in lines), proc.stderr[-3000:]
    assert "There are currently no available devices found" not in proc.stderr
