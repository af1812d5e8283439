"""FLAccelerator's public behaviour beyond the sync numerics, and the project's own rules.

* fp16 is refused (its per-rank loss scaler can skip a step in one group only);
* a scheduler prepared by FLAccelerator steps once per optimizer step;
* communication metering is explicit and two meters can count side by side;
* only fl_accel/accelerator.py imports Accelerate; recipes/, scripts/ and bench/ do not
  touch sys.path;
* a new FLConfig field becomes a recipe flag, a YAML key and an FL_ACCEL_* variable with
  no other edit.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from _launch import REPO_ROOT, WORKERS, run_torchrun
from fl_accel import FLConfig

WORKER = WORKERS / "api_worker.py"


# ====================================================================== precision
@pytest.mark.parametrize("how", ["kwarg", "env"])
def test_fp16_is_refused_before_any_collective(monkeypatch, how):
    """mixed_precision="fp16" (argument, or ACCELERATE_MIXED_PRECISION from `accelerate launch`)
    raises ValueError naming mixed_precision and suggesting bf16, before a process group exists."""
    import torch.distributed as dist

    from fl_accel import FLAccelerator

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    kwargs = {"mixed_precision": "fp16"} if how == "kwarg" else {}
    if how == "env":
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(ValueError, match=r"mixed_precision='fp16'.*bf16"):
        FLAccelerator(FLConfig(algorithm="fsdp"), **kwargs)
    assert not dist.is_initialized()


def test_recipe_does_not_offer_fp16(monkeypatch):
    """--mixed_precision fp16 is not a choice, and fp16 requested by the launcher
    (`accelerate launch --mixed_precision fp16` sets ACCELERATE_MIXED_PRECISION) is refused too."""
    from recipes.args import RecipeError, parse_args
    from recipes.pretrain import resolve_mixed_precision

    with pytest.raises(RecipeError, match="invalid choice: 'fp16'"):
        parse_args(["--mixed_precision", "fp16"], environ={})
    assert parse_args(["--mixed_precision", "bf16"], environ={}).args.mixed_precision == "bf16"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(RecipeError, match="fp16"):
        resolve_mixed_precision("auto")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert resolve_mixed_precision("auto") == "bf16" and resolve_mixed_precision("no") == "no"


def test_help_shows_the_real_defaults(capsys):
    """`--help` lists every option with its default (FLConfig's fields included)."""
    from recipes.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"], environ={})
    out = capsys.readouterr().out
    assert "object object" not in out
    assert re.search(r"--sync_every SYNC_EVERY.*?\(default: 8\)", out, re.S)
    assert re.search(r"--seq_len SEQ_LEN.*?\(default: 256\)", out, re.S)


# ====================================================================== scheduler
def test_prepared_scheduler_steps_once_per_optimizer_step(tmp_path):
    """4 processes, F=2, accumulation 2, a linear schedule 1 -> 0 over 10 steps through
    FLAccelerator.prepare: after optimizer steps 1, 2, 3 the LR is 0.9, 0.8, 0.7 of the peak on
    every rank. (Accelerate alone steps it num_processes times per optimizer step: 0.0 after 3.)"""
    res = run_torchrun(4, WORKER, "scheduler", str(tmp_path), timeout=240)
    assert res.returncode == 0, res.tail()
    for rank in range(4):
        rec = json.loads((tmp_path / f"scheduler-rank{rank}.json").read_text())
        assert rec["lrs"] == pytest.approx([0.9, 0.8, 0.7]), rec
        assert rec["sched_lr"] == pytest.approx(0.7)


# ====================================================================== metering
def test_two_meters_count_side_by_side():
    """Two CommMeters entered at once (two accelerators in one process) each count the process
    groups they were given; collectives on the default group land in both "world" buckets;
    leaving restores torch.distributed's functions."""
    import torch.distributed as dist

    from fl_accel.comm import CommMeter, CommStats

    original = dist.all_reduce
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ga, gb = dist.new_group([0]), dist.new_group([0])
        sa, sb = CommStats(), CommStats()
        with CommMeter(sa, {ga: "fl"}), CommMeter(sb, {gb: "dp_shard"}):
            assert dist.all_reduce is not original
            dist.all_reduce(torch.ones(4), group=ga)
            dist.all_reduce(torch.ones(4), group=gb)
            dist.all_reduce(torch.ones(4))
        assert dist.all_reduce is original
        assert (sa["fl"].calls, sa["dp_shard"].calls, sa["world"].calls) == (1, 0, 1)
        assert (sb["fl"].calls, sb["dp_shard"].calls, sb["world"].calls) == (0, 1, 1)
        dist.all_reduce(torch.ones(4), group=ga)  # not entered: not counted
        assert sa["fl"].calls == 1
    finally:
        dist.destroy_process_group()


# ====================================================================== project rules
def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_only_accelerator_module_imports_accelerate():
    """Accelerate internals are touched in one module: fl_accel/accelerator.py."""
    users = sorted(p.name for p in (REPO_ROOT / "fl_accel").glob("*.py") if "accelerate" in _imports(p))
    assert users == ["accelerator.py"], users


def test_no_sys_path_manipulation_outside_tests():
    """recipes/, scripts/ and bench/ run as installed packages (pip install -e .), not via sys.path edits."""
    offenders = [str(p.relative_to(REPO_ROOT)) for d in ("recipes", "scripts", "bench", "fl_accel")
                 for p in (REPO_ROOT / d).rglob("*.py") if re.search(r"sys\.path\.(insert|append)", p.read_text())]
    assert offenders == []


def test_a_new_flconfig_field_is_a_flag_a_yaml_key_and_an_env_variable(tmp_path):
    """Adding a field to FLConfig needs no other edit: the recipe parses it from a flag, from
    the YAML's 'fl:' section and from FL_ACCEL_<FIELD>, with the usual precedence."""
    from recipes.args import parse_args

    @dataclasses.dataclass
    class Extended(FLConfig):
        gossip_rounds: int = 3
        """A new setting."""

    assert parse_args([], environ={}, fl_cls=Extended).fl.gossip_rounds == 3
    assert parse_args(["--gossip_rounds", "5"], environ={}, fl_cls=Extended).fl.gossip_rounds == 5
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("fl:\n  gossip_rounds: 7\n")
    parsed = parse_args(["--config", str(yaml_file)], environ={}, fl_cls=Extended)
    assert parsed.fl.gossip_rounds == 7 and parsed.sources["gossip_rounds"] == str(yaml_file)
    env = {"FL_ACCEL_GOSSIP_ROUNDS": "9"}
    parsed = parse_args(["--config", str(yaml_file)], environ=env, fl_cls=Extended)
    assert parsed.fl.gossip_rounds == 9 and parsed.sources["gossip_rounds"] == "FL_ACCEL_GOSSIP_ROUNDS"
    parsed = parse_args(["--config", str(yaml_file), "--gossip_rounds", "11"], environ=env, fl_cls=Extended)
    assert parsed.fl.gossip_rounds == 11 and parsed.sources["gossip_rounds"] == "flag"


def test_anchor_device_is_a_flag_a_yaml_key_and_an_env_variable_but_not_run_identity(tmp_path, capsys):
    """anchor_device comes through the derived flag (with its choices in --help), the YAML's 'fl:'
    section and FL_ACCEL_ANCHOR_DEVICE; a bad value is refused naming the allowed ones; and it
    is left out of the run identity a resume compares (it places state, the values are equal)."""
    from recipes.args import RecipeError, parse_args, run_identity

    assert parse_args([], environ={}).fl.anchor_device == "same"
    assert parse_args(["--anchor_device", "cpu"], environ={}).fl.anchor_device == "cpu"
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("fl:\n  anchor_device: cpu\n")
    assert parse_args(["--config", str(yaml_file)], environ={}).fl.anchor_device == "cpu"
    parsed = parse_args([], environ={"FL_ACCEL_ANCHOR_DEVICE": "cpu"})
    assert parsed.fl.anchor_device == "cpu" and parsed.sources["anchor_device"] == "FL_ACCEL_ANCHOR_DEVICE"
    with pytest.raises(RecipeError, match="invalid choice: 'gpu'"):
        parse_args(["--anchor_device", "gpu"], environ={})
    with pytest.raises((RecipeError, ValueError), match="anchor_device must be one of"):
        parse_args([], environ={"FL_ACCEL_ANCHOR_DEVICE": "gpu"})
    with pytest.raises(SystemExit):
        parse_args(["--help"], environ={})
    assert re.search(r"--anchor_device \{same,cpu\}.*?\(default: same\)", capsys.readouterr().out, re.S)
    same, cpu = parse_args([], environ={}), parse_args(["--anchor_device", "cpu"], environ={})
    assert run_identity(same.args, same.fl) == run_identity(cpu.args, cpu.fl)
    assert "anchor_device" not in run_identity(cpu.args, cpu.fl)["fl"]
    other = parse_args(["--sync_dtype", "int8"], environ={})
    assert run_identity(other.args, other.fl) != run_identity(same.args, same.fl)


def test_recipe_argument_precedence_and_sources(tmp_path):
    """defaults < YAML < FL_ACCEL_* < flags, for FLConfig fields and recipe options; lists as '2,4';
    a top-level FLConfig key in the YAML is said to belong under 'fl:'; the start-up lines mark
    values that came from environment variables."""
    from recipes.args import RecipeError, describe_sources, parse_args

    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("seq_len: 128\nfl:\n  algorithm: fl_hsdp\n  hsdp_shard_size: 2\n  sync_every: 4\n")
    parsed = parse_args(["--config", str(yaml_file), "--group_sizes", "2,4", "--sync_every", "6"],
                        environ={"FL_ACCEL_SYNC_EVERY": "12", "FL_ACCEL_OUTER_OPTIMIZER": "nesterov"})
    assert parsed.args.seq_len == 128 and parsed.fl.group_sizes == [2, 4] and parsed.fl.sync_every == 6
    assert parsed.fl.outer_optimizer == "nesterov" and parsed.fl.algorithm == "fl_hsdp"
    lines = describe_sources(parsed)
    assert "outer_optimizer='nesterov' (FL_ACCEL_OUTER_OPTIMIZER)  <- environment variable" in lines
    assert "sync_every=6 (flag)" in lines and f"algorithm='fl_hsdp' ({yaml_file})" in lines
    yaml_file.write_text("algorithm: fsdp\n")
    with pytest.raises(RecipeError, match="belongs under 'fl:'"):
        parse_args(["--config", str(yaml_file)], environ={})
