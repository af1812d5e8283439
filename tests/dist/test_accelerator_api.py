"""FLAccelerator's public behaviour beyond the sync numerics, and the project's own rules.

* fp16 is refused (its per-rank loss scaler can skip a step in one group only);
* a scheduler prepared by FLAccelerator steps as Accelerate's does (also split_batches and
  step_scheduler_with_optimizer=False);
* communication metering is explicit and two meters can count side by side;
* only fl_accel/accelerator.py imports Accelerate; fl_accel/, recipes/, scripts/ and bench/
  do not touch sys.path (import directions: tests/test_layering.py);
* a new FLConfig field becomes a recipe flag, a YAML key and an FL_ACCEL_* variable with
  no other edit.
"""

from __future__ import annotations

import ast
import os
import dataclasses
import json
import re
from pathlib import Path
from unittest import mock

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


@pytest.mark.parametrize("case", ["offload_plugin", "offload_env", "whole_model_compile"])
def test_offload_and_whole_model_compile_are_refused_before_any_collective(monkeypatch, case):
    """CPU offload with a federated algorithm (the sync's collectives need the parameters on the
    accelerator), given by the plugin or by FSDP_OFFLOAD_PARAMS from `accelerate launch`, and a
    whole-model compile (an OptimizedModule bypasses FSDP2's hooks) raise ValueError naming the
    setting, before a process group exists. A baseline may offload; regional compile is accepted."""
    import torch.distributed as dist
    from accelerate.utils import FullyShardedDataParallelPlugin, TorchDynamoPlugin

    from fl_accel import FLAccelerator
    from fl_accel.refusals import refuse_before_start
    from fl_accel.mesh import FLLayout

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("FSDP_OFFLOAD_PARAMS", raising=False)
    kwargs, match = {}, "fsdp_offload_params / FSDP_OFFLOAD_PARAMS"
    if case == "offload_plugin":
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=True)
    elif case == "offload_env":
        monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    else:
        kwargs["dynamo_backend"], match = "inductor", "use_regional_compilation=True"
    with pytest.raises(ValueError, match=match):
        FLAccelerator(FLConfig(algorithm="fl_fsdp", num_groups=2), **kwargs)
    assert not dist.is_initialized()
    baseline = FLConfig(algorithm="fsdp")
    if case != "whole_model_compile":
        refuse_before_start(kwargs, baseline, FLLayout.from_config(baseline, 4))
    regional = {"dynamo_plugin": TorchDynamoPlugin(backend="inductor", use_regional_compilation=True)}
    refuse_before_start(regional, baseline, FLLayout.from_config(baseline, 4))


@pytest.mark.parametrize("how", ["plugin", "launch_env"])
def test_an_fsdp1_plugin_is_refused_not_replaced(monkeypatch, how):
    """A user's FSDP1 plugin, or `accelerate launch` with FSDP version 1, raises ValueError naming
    fsdp_version=2 as the fix, before a process group exists (it used to be replaced silently)."""
    import torch.distributed as dist
    from accelerate.utils import FullyShardedDataParallelPlugin

    from fl_accel import FLAccelerator

    with mock.patch.dict(os.environ):  # Accelerate's plugin writes FSDP_* variables of its own
        monkeypatch.setenv("WORLD_SIZE", "4")
        kwargs = {}
        if how == "plugin":
            kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(fsdp_version=1)
        else:
            monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
            monkeypatch.setenv("FSDP_VERSION", "1")
        with pytest.raises(ValueError, match=r"FSDP2.*fsdp_version=2"):
            FLAccelerator(FLConfig(algorithm="fl_fsdp", num_groups=2), **kwargs)
        assert not dist.is_initialized()


def test_recipe_does_not_offer_fp16(monkeypatch):
    """--mixed_precision fp16 is not a choice, and fp16 requested by the launcher
    (`accelerate launch --mixed_precision fp16` sets ACCELERATE_MIXED_PRECISION) is refused too."""
    from recipes.args import RecipeError, parse_args
    from recipes.run_folder import resolve_mixed_precision

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
def test_prepared_scheduler_steps_as_accelerate_does(tmp_path):
    """2 processes, F=2, accumulation 2, a linear schedule 1 -> 0 through FLAccelerator.prepare,
    sized for Accelerate's stepping: 20 steps by default (num_processes scheduler steps per
    optimizer step), 10 with split_batches (one), 20 with step_scheduler_with_optimizer=False
    (one per call, two calls per optimizer step): after optimizer steps 1, 2, 3 the LR is 0.9,
    0.8, 0.7 of the peak on every rank in all three. (tests/dist/test_drop_in.py compares a
    whole script's LRs with plain Accelerator's.)"""
    for variant in ("default", "split_batches", "step_with_calls"):  # 2 processes: groups of one rank
        res = run_torchrun(2, WORKER, "scheduler", str(tmp_path), variant, timeout=240)
        assert res.returncode == 0, res.tail()
        for rank in range(2):
            rec = json.loads((tmp_path / f"scheduler-{variant}-rank{rank}.json").read_text())
            assert rec["lrs"] == pytest.approx([0.9, 0.8, 0.7]), (variant, rec)
            assert rec["sched_lr"] == pytest.approx(0.7)


# ====================================================================== the run's length
SET_MAX_STEPS = """
import dataclasses
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from fl_accel import FLAccelerator, FLConfig

cfg = FLConfig(num_groups=1, outer_optimizer="nesterov", outer_lr_schedule="cosine", outer_lr_warmup_steps=4)
acc = FLAccelerator(cfg, cpu=True)
first = acc.run_config
try:
    acc.set_max_steps(4)
except ValueError as exc:
    print("REFUSED", exc)
assert acc.run_config is first and acc.fl_config is cfg and acc.max_steps is None
acc.set_max_steps(10)  # before prepare: resolved into the one owner, which the synchronizer is built from
assert acc.fl_config.outer_lr_decay_steps == 10 and cfg.outer_lr_decay_steps is None and acc.max_steps == 10
assert acc.run_config.source is cfg and acc.layout is acc.run_config.layout
model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2))
model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
sync = acc.synchronizer
assert sync.config is acc.fl_config and all(f.config is acc.fl_config for f in sync.fragments)
assert sync.schedule.final_step == 10
assert acc.federation.config is acc.fl_config
owner = acc.run_config
acc.set_max_steps(10)  # the same length: nothing changes
assert acc.run_config is owner
try:  # another length after prepare would change the synchronizer's config: refused, nothing changed
    acc.set_max_steps(12)
except ValueError as exc:
    print("AFTER PREPARE", exc)
assert acc.run_config is owner and sync.schedule.final_step == 10 and sync.config is acc.fl_config
try:
    acc.run_config.max_steps = 3
except dataclasses.FrozenInstanceError:
    print("FROZEN")
from fl_accel.lr_schedule import outer_lr
print("FILLED", acc.fl_config.outer_lr_decay_steps, outer_lr(sync.fragments[0].config, 11))
acc.end_training()
"""


def test_set_max_steps_resolves_the_run_length_into_the_one_run_config(tmp_path):
    """One process (a world of 1, forked: tests/_forkserver.py): set_max_steps resolves the
    run's length into ``run_config``, the one owner: a decaying outer-LR schedule without
    outer_lr_decay_steps spans the run in the config the synchronizer and its outer state are
    then built from (the same object; the caller's stays as built); a warmup as long as the run
    raises ValueError naming the field, changing nothing; after prepare a length that would
    change the synchronizer's config is refused (no copy is kept in step by hand)."""
    script = tmp_path / "set_max_steps.py"
    script.write_text(SET_MAX_STEPS)
    res = run_torchrun(1, script, timeout=300)
    assert res.returncode == 0, res.tail()
    assert "REFUSED FLConfig.outer_lr_warmup_steps=4 must be shorter than the run" in res.stdout, res.stdout
    assert "AFTER PREPARE set_max_steps(12) after prepare" in res.stdout, res.stdout
    assert "FROZEN" in res.stdout and "FILLED 10 0.0" in res.stdout, res.stdout


# ====================================================================== GPU-path features, on CPU
@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """One 4-process launch of tests/workers/features_worker.py (MODE features)."""
    out = tmp_path_factory.mktemp("features")
    res = run_torchrun(4, WORKERS / "features_worker.py", "features", str(out), timeout=900)
    assert res.returncode == 0, res.tail()
    return lambda name: [torch.load(out / name / f"rank{k}.pt", weights_only=False) for k in range(4)]


def test_bf16_reduces_in_fp32_keeps_the_loss_fp32_and_a_user_policy(features):
    """4 ranks, FL+FSDP, bf16: every FSDP unit has param bf16, reduce fp32 and no output cast;
    the loss is fp32; precision_policy says so. A policy given in the plugin is kept
    (all bf16: the loss comes back bf16)."""
    for rec in features("precision_default"):
        assert rec["unit_policies"] and all(u == ["torch.bfloat16", "torch.float32", "None"]
                                            for u in rec["unit_policies"]), rec["unit_policies"]
        assert rec["loss_dtype"] == "torch.float32"
        assert rec["precision_policy"] == {"param": "bf16", "reduce": "fp32", "output": None}
    for rec in features("precision_user"):
        assert all(u == ["torch.bfloat16"] * 3 for u in rec["unit_policies"]), rec["unit_policies"]
        assert rec["loss_dtype"] == "torch.bfloat16"
        assert rec["precision_policy"] == {"param": "bf16", "reduce": "bf16", "output": "bf16"}


def test_a_second_prepare_is_refused_on_every_rank(features):
    """prepare(model2, opt2) after the federated pair raises ValueError on every rank (it would
    train unfederated); sync_wait_seconds counted the sync of step 1."""
    for rec in features("precision_default"):
        assert "second model/optimizer pair" in rec.get("second_prepare_error", ""), rec.get("second_prepare_error")
        assert rec["sync_wait_seconds"] > 0


def test_get_state_dict_syncs_first_when_the_groups_differ(features):
    """accelerator.get_state_dict (behind save_model and save_pretrained) after step 5 with H=2,
    when the groups differ: it syncs first, on every rank, without a warning, so a
    sync_if_pending() after it has nothing left to sync, and a second get_state_dict gives rank
    0 the same full state dict (Accelerate gathers it to rank 0). After a sync step (H=1,
    1 step) the groups do not differ and nothing syncs."""
    recs = features("ac_off")
    for rec in recs:
        assert rec["groups_differed"] is True
        assert rec["state_dict_warnings_before"] == [] and rec["state_dict_warnings_after"] == []
        assert rec["synced_before"] is False and rec["synced_after"] is False
    assert recs[0]["state_dict_sum_before"] is not None
    assert recs[0]["state_dict_sum_before"] == recs[0]["state_dict_sum_after"]
    for rec in features("precision_default"):
        assert rec["groups_differed"] is False
        assert rec["state_dict_warnings_before"] == [] and rec["synced_before"] is False


def test_activation_checkpointing_changes_no_loss_and_checkpoints_resume_across_the_switch(features):
    """"nesterov", H=2, 5 steps: the losses with and without activation checkpointing agree
    within 1e-5; the sync's names carry no wrapper prefix; a checkpoint written mid-round
    (step 3) with one setting resumes with the other, and steps 4-5 and the final shards are
    bitwise those of the uninterrupted run of the other setting."""
    on, off = features("ac_on"), features("ac_off")
    for a, b in zip(on, off):
        assert a["activation_checkpointing"] and not b["activation_checkpointing"]
        assert a["names"] == b["names"] and not any("_checkpoint_wrapped_module" in n for n in a["names"])
        assert a["losses"] == pytest.approx(b["losses"], abs=1e-5)
    for resumed, ref in (("off_from_on", off), ("on_from_off", on)):
        for rec, want in zip(features(resumed), ref):
            assert rec["losses"] == {k: want["losses"][k] for k in (4, 5)}
            for k in (4, 5):
                assert all(torch.equal(x, y) for x, y in zip(rec["params"][k], want["params"][k]))
            assert all(torch.equal(x, y) for x, y in zip(rec["final"], want["final"]))
    assert max((x - y).abs().max().item() for x, y in zip(on[0]["params"][3], on[2]["params"][3])) > 1e-4  # groups differ


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_model_families_train_sync_and_checkpoint(features, family):
    """Tiny Qwen2 and Mistral (any causal LM declaring _no_split_modules) through FL+FSDP: the
    groups are equal after the sync at step 2, and a checkpoint loads back exactly."""
    recs = features(family)
    for rec in recs:
        assert all(torch.equal(a, b) for a, b in zip(rec["saved"], rec["after_load"]))
        assert all(torch.isfinite(torch.tensor(v)) for v in rec["losses"].values())
    for f0, f1 in ((recs[0], recs[2]), (recs[1], recs[3])):  # same shard, the two groups
        assert all(torch.equal(a, b) for a, b in zip(f0["params"][2], f1["params"][2]))
        assert f0["losses"][1] != f1["losses"][1]  # they trained on different data


def test_regional_compile_matches_eager(tmp_path):
    """Accelerate's regional compilation (inductor) on CPU, FL+FSDP 2x2, H=3: three compiled steps
    match eager within 1e-4 (losses and shards), the groups are equal after the sync, and a
    checkpoint round trip restores the shards."""
    res = run_torchrun(4, WORKERS / "features_worker.py", "compile", str(tmp_path), timeout=1500)
    assert res.returncode == 0, res.tail()
    for k in range(4):
        eager, comp = (torch.load(tmp_path / n / f"rank{k}.pt", weights_only=False) for n in ("eager", "compiled"))
        assert comp["compiled"] and not eager["compiled"]
        assert comp["losses"] == pytest.approx(eager["losses"], abs=1e-4)
        assert all(torch.allclose(a, b, atol=1e-4, rtol=0) for a, b in zip(comp["params"][3], eager["params"][3]))
        assert all(torch.equal(a, b) for a, b in zip(comp["saved"], comp["after_load"]))
    recs = [torch.load(tmp_path / "compiled" / f"rank{k}.pt", weights_only=False) for k in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(recs[0]["params"][3], recs[2]["params"][3]))


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
def _imports(path: Path, module_level: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in (tree.body if module_level else ast.walk(tree)):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_only_accelerator_module_imports_accelerate():
    """Accelerate is imported at module level by the Accelerator subclass only; inside functions
    by the compatibility module, the FSDP2 plugin's builder (fsdp_model.py) and the launch
    refusals reading its dynamo settings (refusals.py, which the torch-free recipe planning
    imports: no Accelerate at its import)."""
    files = sorted((REPO_ROOT / "fl_accel").glob("*.py"))
    assert [p.name for p in files if "accelerate" in _imports(p, module_level=True)] == ["accelerator.py"]
    users = sorted(p.name for p in files if "accelerate" in _imports(p))
    assert users == ["accelerator.py", "compat.py", "fsdp_model.py", "refusals.py"], users


def test_no_sys_path_manipulation_outside_tests():
    """fl_accel and recipes are installed (pyproject.toml), scripts/ and bench/ run from the
    repository root (``python -m ...``): none of them edits sys.path, not even the recipe's
    entry point run as a file (``accelerate launch recipes/pretrain.py``: Python puts recipes/
    first on the path; ``recipes.x`` then comes from the installed package)."""
    offenders = [str(p.relative_to(REPO_ROOT)) for d in ("recipes", "scripts", "bench", "fl_accel")
                 for p in (REPO_ROOT / d).rglob("*.py") if "sys.path" in p.read_text()]
    assert offenders == []


def test_a_new_flconfig_field_is_a_flag_a_yaml_key_and_an_env_variable(tmp_path):
    """Adding a field to FLConfig needs no other edit: the recipe parses it from a flag, from
    the YAML's 'fl:' section and from FL_ACCEL_<FIELD>, with the usual precedence."""
    from recipes.args import parse_args

    @dataclasses.dataclass(frozen=True)  # FLConfig is frozen, and so is a dataclass extending it
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


def test_outer_state_device_is_a_flag_a_yaml_key_and_an_env_variable_but_not_run_identity(tmp_path, capsys):
    """outer_state_device comes through the derived flag (with its choices in --help), the YAML's 'fl:'
    section and FL_ACCEL_OUTER_STATE_DEVICE; a bad value is refused naming the allowed ones; and it
    is left out of the run identity a resume compares (it places state, the values are equal)."""
    from recipes.args import RecipeError, parse_args, run_identity

    assert parse_args([], environ={}).fl.outer_state_device == "same"
    assert parse_args(["--outer_state_device", "cpu"], environ={}).fl.outer_state_device == "cpu"
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("fl:\n  outer_state_device: cpu\n")
    assert parse_args(["--config", str(yaml_file)], environ={}).fl.outer_state_device == "cpu"
    parsed = parse_args([], environ={"FL_ACCEL_OUTER_STATE_DEVICE": "cpu"})
    assert parsed.fl.outer_state_device == "cpu" and parsed.sources["outer_state_device"] == "FL_ACCEL_OUTER_STATE_DEVICE"
    with pytest.raises(RecipeError, match="invalid choice: 'gpu'"):
        parse_args(["--outer_state_device", "gpu"], environ={})
    with pytest.raises((RecipeError, ValueError), match="outer_state_device must be one of"):
        parse_args([], environ={"FL_ACCEL_OUTER_STATE_DEVICE": "gpu"})
    with pytest.raises(SystemExit):
        parse_args(["--help"], environ={})
    assert re.search(r"--outer_state_device \{same,cpu\}.*?\(default: same\)", capsys.readouterr().out, re.S)
    same, cpu = parse_args([], environ={}), parse_args(["--outer_state_device", "cpu"], environ={})
    assert run_identity(same.args, same.fl) == run_identity(cpu.args, cpu.fl)
    assert "outer_state_device" not in run_identity(cpu.args, cpu.fl)["fl"]
    assert "collective_timeout_s" not in run_identity(cpu.args, cpu.fl)["fl"]  # bounds waits, changes no value
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
                        environ={"FL_ACCEL_SYNC_EVERY": "12", "FL_ACCEL_OUTER_OPTIMIZER": "nesterov", "WORLD_SIZE": "6"})
    assert parsed.args.seq_len == 128 and parsed.fl.group_sizes == [2, 4] and parsed.fl.sync_every == 6
    assert parsed.fl.outer_optimizer == "nesterov" and parsed.fl.algorithm == "fl_hsdp"
    lines = describe_sources(parsed)
    assert "outer_optimizer='nesterov' (FL_ACCEL_OUTER_OPTIMIZER)  <- environment variable" in lines
    assert "sync_every=6 (flag)" in lines and f"algorithm='fl_hsdp' ({yaml_file})" in lines
    yaml_file.write_text("algorithm: fsdp\n")
    with pytest.raises(RecipeError, match="belongs under 'fl:'"):
        parse_args(["--config", str(yaml_file)], environ={})
