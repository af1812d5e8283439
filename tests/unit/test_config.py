"""FLConfig (defaults, validation, YAML / environment loading) and FLLayout arithmetic.

Fast and single-process: no torch.distributed, no launches.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import fields

import pytest
import torch

from fl_accel import AXES, FLConfig, FLLayout
from fl_accel.settings import env_overrides
from workers._scenario import validated


@pytest.fixture(autouse=True)
def _no_fl_env(monkeypatch):
    """A caller's FL_ACCEL_* variables must not change what these tests see."""
    import os

    for key in list(os.environ):
        if key.startswith("FL_ACCEL_"):
            monkeypatch.delenv(key)


# ====================================================================== defaults
def test_defaults():
    """The defaults are the paper's FL+FSDP setting with H=8 and plain FedAvg; the streaming,
    compression and unequal-group fields default to the paper's blocking fp32 sync."""
    c = FLConfig()
    assert c.to_dict() == {
        "algorithm": "fl_fsdp", "num_groups": 2, "group_sizes": None, "group_weighting": "tokens",
        "hsdp_shard_size": None, "sync_every": 8, "sync_trigger": "steps", "sync_window_s": None, "num_fragments": 1, "sync_delay": 0,
        "delayed_local_steps": "discard", "fragment_update_alpha": 0.0, "sync_warmup_steps": 0, "sync_dtype": "fp32", "sync_collectives": "auto", "sync_density": 1 / 64, "sync_value_bits": 2,
        "error_feedback_decay": None, "sparse_aggregation": "senders", "final_sync": "exact",
        "error_feedback": False,
        "outer_optimizer": "avg", "outer_lr": 0.7, "outer_momentum": 0.9, "outer_lr_schedule": "constant",
        "outer_lr_warmup_steps": 0, "outer_lr_decay_steps": None, "average_optimizer_state": False,
        "data_sharding": "global", "on_nonfinite": "abort", "sync_bucket_mb": 256, "outer_state_device": "same",
        "collective_timeout_s": 300.0, "fault_tolerance": "none", "group_index": None, "lighthouse_addr": None,
        "heal_address": None, "rejoin_timeout_s": 300.0,
    }
    assert validated(c, 4) is c
    assert c.is_federated and not c.uses_hsdp and not c.compressed and not c.fault_tolerant


def test_every_field_has_an_attribute_docstring():
    """Every FLConfig field carries an attribute docstring (a string right after it); the
    recipe's --help text is derived from them."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(FLConfig)))
    body = tree.body[0].body
    documented = set()
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
                and isinstance(nxt.value.value, str) and nxt.value.value.strip():
            documented.add(node.target.id)
    assert documented == {f.name for f in fields(FLConfig)}
    assert set(FLConfig.field_docs()) == documented


# ====================================================================== sizes
@pytest.mark.parametrize("kwargs,world,shape", [
    ({"algorithm": "fl_fsdp", "num_groups": 2}, 4, (2, 1, 2)),
    ({"algorithm": "fl_fsdp", "num_groups": 4}, 4, (4, 1, 1)),
    ({"algorithm": "fl_fsdp", "num_groups": 1}, 4, (1, 1, 4)),
    ({"algorithm": "fl_hsdp", "num_groups": 2, "hsdp_shard_size": 2}, 8, (2, 2, 2)),
    ({"algorithm": "fl_hsdp", "num_groups": 128, "hsdp_shard_size": 4}, 512, (128, 1, 4)),
    ({"algorithm": "fsdp", "num_groups": 3}, 4, (1, 1, 4)),  # baselines ignore num_groups
    ({"algorithm": "hsdp", "num_groups": 3, "hsdp_shard_size": 2}, 8, (1, 4, 2)),
    ({"algorithm": "fl_fsdp", "num_groups": 2, "hsdp_shard_size": 3}, 4, (2, 1, 2)),  # S ignored without HSDP
])
def test_layout_shape(kwargs, world, shape):
    """(F, R, S) for a world size; F*R*S == world."""
    c = validated(FLConfig(**kwargs), world)
    layout = FLLayout.from_config(c, world)
    assert layout.shape == shape and layout.world_size == world


def test_hsdp_shard_size_defaults_to_ranks_per_node():
    """Unset S under HSDP: the ranks per node that divide every group (shard in a node, replicate across)."""
    assert FLLayout.from_config(FLConfig(algorithm="hsdp"), 8, ranks_per_node=4).shape == (1, 2, 4)
    assert FLLayout.from_config(FLConfig(algorithm="fl_hsdp", num_groups=2), 4, ranks_per_node=4).shape == (2, 1, 2)
    with pytest.raises(ValueError, match="hsdp_shard_size must be set"):
        FLLayout.from_config(FLConfig(algorithm="hsdp"), 8)


def test_describe():
    layout = FLLayout.from_config(FLConfig(algorithm="fl_hsdp", num_groups=2, hsdp_shard_size=2), 8)
    assert layout.describe(3) == "fl_hsdp F=2 G=4 R=2 S=2 H=3"
    unequal = FLLayout.from_config(FLConfig(algorithm="fl_hsdp", group_sizes=[2, 4], hsdp_shard_size=2), 6)
    assert unequal.describe(8) == "fl_hsdp F=2 G=[2, 4] R=[1, 2] S=2 H=8"
    assert unequal.sizes_label() == "G2_4" and layout.sizes_label() == "G4"


# ====================================================================== validation
@pytest.mark.parametrize("kwargs,world,field", [
    ({"num_groups": 3}, 4, "num_groups"),  # world size not divisible by F
    ({"algorithm": "fl_hsdp", "num_groups": 2, "hsdp_shard_size": 3}, 4, "hsdp_shard_size"),  # S does not divide G
    ({"algorithm": "hsdp", "hsdp_shard_size": 3}, 8, "hsdp_shard_size"),
    ({"algorithm": "fl_hsdp", "num_groups": 2}, 8, "hsdp_shard_size"),  # S missing (no ranks per node known)
    ({"sync_every": 0}, None, "sync_every"),
    ({"sync_every": -2}, None, "sync_every"),
    ({"sync_every": 2.0}, None, "sync_every"),
    ({"algorithm": "fedavg"}, None, "algorithm"),
    ({"algorithm": "FSDP"}, None, "algorithm"),
    ({"outer_optimizer": "adam"}, None, "outer_optimizer"),
    ({"num_groups": "4"}, None, "num_groups"),
    ({"num_groups": True}, None, "num_groups"),
    ({"num_groups": 0}, None, "num_groups"),
    ({"hsdp_shard_size": "2"}, None, "hsdp_shard_size"),
    ({"outer_lr": 0.0}, None, "outer_lr"),
    ({"outer_lr": "0.7"}, None, "outer_lr"),
    ({"outer_momentum": 1.0}, None, "outer_momentum"),
    ({"outer_momentum": -0.1}, None, "outer_momentum"),
    ({"average_optimizer_state": 1}, None, "average_optimizer_state"),
    ({"data_sharding": "local"}, None, "data_sharding"),
    ({"on_nonfinite": "ignore"}, None, "on_nonfinite"),
    ({"sync_bucket_mb": 0}, None, "sync_bucket_mb"),
    ({"sync_every": 6, "num_fragments": 4}, None, "num_fragments"),  # H not a multiple of P
    ({"sync_every": 8, "num_fragments": 2, "sync_delay": 9}, None, "sync_delay"),  # tau > H (issue 46: tau <= H)
    ({"sync_delay": -1}, None, "sync_delay"),
    ({"fragment_update_alpha": 1.5}, None, "fragment_update_alpha"),
    ({"fragment_update_alpha": -0.1}, None, "fragment_update_alpha"),
    ({"sync_dtype": "fp8"}, None, "sync_dtype"),
    ({"error_feedback": "yes"}, None, "error_feedback"),
    ({"sync_density": 0.0}, None, r"FLConfig\.sync_density must be in \[1/4096, 1\]"),
    ({"sync_density": -0.01}, None, "sync_density"),
    ({"sync_density": 1.01}, None, "sync_density"),
    ({"sync_density": float("nan")}, None, "sync_density"),
    ({"sync_density": "0.02"}, None, "sync_density"),
    ({"sync_value_bits": 3}, None, "FLConfig.sync_value_bits"),
    ({"sync_dtype": "sparse"}, None, r"FLConfig\.error_feedback must be True with sync_dtype='sparse'"),
    ({"group_sizes": [2, 2], "num_groups": 3}, None, "num_groups"),  # disagrees with an explicit num_groups
    ({"group_sizes": [2, 4]}, None, "fl_hsdp"),  # fl_fsdp with unequal sizes: suggests fl_hsdp
    ({"algorithm": "fl_hsdp", "group_sizes": [2, 4], "hsdp_shard_size": 4}, None, "hsdp_shard_size"),
    ({"algorithm": "fl_hsdp", "group_sizes": [2, 4]}, None, "hsdp_shard_size"),  # S needed for unequal groups
    ({"algorithm": "fl_hsdp", "group_sizes": [2, 4], "hsdp_shard_size": 2}, 8, "group_sizes"),  # sum != world
    ({"group_sizes": [2, 0]}, None, "group_sizes"),
    ({"group_sizes": []}, None, "group_sizes"),
    ({"group_sizes": ["2", 2]}, None, "group_sizes"),
    ({"group_weighting": "steps"}, None, "group_weighting"),
    ({"sync_trigger": "clock"}, None, "sync_trigger"),
    ({"sync_trigger": "time"}, None, "sync_window_s"),
    ({"sync_trigger": "time", "sync_window_s": 0}, None, "sync_window_s"),
    ({"sync_trigger": "time", "sync_window_s": -1.5}, None, "sync_window_s"),
    ({"sync_trigger": "speed", "algorithm": "fsdp"}, None, "sync_trigger"),
    ({"sync_trigger": "speed", "algorithm": "hsdp", "hsdp_shard_size": 1}, None, "sync_trigger"),
    ({"sync_trigger": "speed", "num_fragments": 2}, None, "num_fragments"),
    ({"sync_trigger": "time", "sync_window_s": 1.0, "sync_delay": 1}, None, "sync_delay"),
    ({"sync_trigger": "speed", "fragment_update_alpha": 0.5}, None, "fragment_update_alpha"),
    ({"outer_state_device": "cuda"}, None, r"outer_state_device must be one of \['same', 'cpu'\]"),
    ({"outer_state_device": None}, None, "outer_state_device"),
    ({"collective_timeout_s": 0}, None, "collective_timeout_s"),
    ({"collective_timeout_s": "60"}, None, "collective_timeout_s"),
    ({"outer_lr_schedule": "cosine"}, None, "outer_lr_schedule"),  # a schedule with "avg"
    ({"outer_lr_warmup_steps": 10}, None, "outer_lr_schedule.*outer_lr_warmup_steps=10"),  # warmup with "avg"
    ({"outer_lr_schedule": "step"}, None, "outer_lr_schedule"),
    ({"outer_optimizer": "nesterov", "outer_lr_schedule": "cosine", "outer_lr_warmup_steps": -1}, None,
     "outer_lr_warmup_steps must be >= 0"),
    ({"outer_optimizer": "nesterov", "outer_lr_schedule": "linear", "outer_lr_warmup_steps": 100,
      "outer_lr_decay_steps": 100}, None, "outer_lr_warmup_steps=100 must be shorter than the run"),
])
def test_validate_names_the_field(kwargs, world, field):
    """Each invalid value raises ValueError whose message names the offending field, at
    construction (types, ranges, constraints between fields) or in the layout check for a world size."""
    with pytest.raises(ValueError, match=field):
        validated(FLConfig(**kwargs), world)


def test_config_is_frozen_and_replaced_copies_are_validated():
    """FLConfig is validated once, at construction, and frozen: assigning a field raises
    FrozenInstanceError (the config cannot change behind a check); ``dataclasses.replace``
    makes a changed copy, validated like a new one (ValueError naming the field)."""
    with pytest.raises(ValueError, match="sync_every"):
        FLConfig(sync_every=0)
    c = FLConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.sync_every = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.outer_lr_decay_steps = 10
    assert c.sync_every == 8
    with pytest.raises(ValueError, match=r"FLConfig\.sync_every"):
        dataclasses.replace(c, sync_every=0)
    d = dataclasses.replace(c, sync_every=16)
    assert (d.sync_every, c.sync_every) == (16, 8)
    assert FLConfig(algorithm="fl_hsdp", group_sizes=(2, 4), hsdp_shard_size=2).group_sizes == [2, 4]


def test_with_max_steps_fills_the_outer_lr_decay_in_a_copy():
    """A decaying outer-LR schedule without outer_lr_decay_steps spans the run: a replaced
    copy, the original untouched; a warmup as long as the run raises ValueError naming the
    field; nothing to fill returns the config itself."""
    c = FLConfig(outer_optimizer="nesterov", outer_lr_schedule="cosine", outer_lr_warmup_steps=8)
    filled = c.with_max_steps(40)
    assert (filled.outer_lr_decay_steps, c.outer_lr_decay_steps) == (40, None)
    assert filled.with_max_steps(100) is filled and FLConfig().with_max_steps(5) == FLConfig()
    with pytest.raises(ValueError, match=r"outer_lr_warmup_steps=8 must be shorter than the run"):
        c.with_max_steps(8)
    with pytest.raises(ValueError, match="max_steps"):
        c.with_max_steps(0)


def test_for_launch_is_the_one_launch_rule():
    """FLLayout.for_launch (FLAccelerator's and the recipe's): the launch's world, or with torchft
    this launch is one group of F equal ones (world x F); launch_part is the launch's own world."""
    plain = FLConfig()
    layout = FLLayout.for_launch(plain, 4)
    assert layout == FLLayout.from_config(plain, 4) and layout.launch_part(plain) is layout
    ft = FLConfig(fault_tolerance="torchft", group_index=1, num_groups=3)
    layout = FLLayout.for_launch(ft, 2)
    assert layout.group_sizes == (2, 2, 2) and layout.launch_part(ft) == FLLayout((2,), 2, "fsdp")
    hsdp = FLConfig(algorithm="fl_hsdp", fault_tolerance="torchft", group_index=0, hsdp_shard_size=2)
    assert FLLayout.for_launch(hsdp, 4).launch_part(hsdp) == FLLayout((4,), 2, "hsdp")
    with pytest.raises(ValueError, match="num_groups=2 does not divide the world size 3"):
        FLLayout.for_launch(plain, 3)


def test_world_size_from_env_is_the_one_reader():
    from fl_accel.mesh import ranks_per_node, world_size_from_env

    assert world_size_from_env({}) == 1 and world_size_from_env({"WORLD_SIZE": "8"}) == 8
    assert ranks_per_node(8, {}) == 8 and ranks_per_node(8, {"LOCAL_WORLD_SIZE": "4"}) == 4
    for bad in ("x", "0", "-2"):
        with pytest.raises(ValueError, match=f"WORLD_SIZE={bad!r} must be a positive integer"):
            world_size_from_env({"WORLD_SIZE": bad})


def test_single_process_error_names_the_fix():
    with pytest.raises(ValueError, match="num_groups=2 does not divide the world size 1: .*a single process \\(no "
                                         "launcher\\) is one group: num_groups=1"):
        FLLayout.from_config(FLConfig(num_groups=2), 1)


def test_ignored_settings_are_named():
    """Settings the algorithm ignores are reported, so a leftover flag does not pass silently."""
    notes = FLConfig(algorithm="fsdp", num_groups=3, sync_every=4).ignored_settings()
    assert any("num_groups=3" in n and "'fsdp'" in n for n in notes)
    assert any("sync_every=4" in n for n in notes)
    assert any("hsdp_shard_size=2" in n for n in FLConfig(hsdp_shard_size=2).ignored_settings())
    assert any("error_feedback" in n for n in FLConfig(error_feedback=True).ignored_settings())
    assert FLConfig().ignored_settings() == []
    assert any("outer_state_device='cpu'" in n and "no anchor" in n for n in FLConfig(outer_state_device="cpu").ignored_settings())
    assert any("outer_state_device='cpu'" in n and "'fsdp'" in n
               for n in FLConfig(algorithm="fsdp", outer_state_device="cpu").ignored_settings())
    assert FLConfig(outer_state_device="cpu", sync_dtype="bf16").ignored_settings() == []
    assert FLConfig(outer_state_device="cpu", outer_optimizer="nesterov").ignored_settings() == []
    assert FLConfig(algorithm="fl_hsdp", hsdp_shard_size=2, sync_dtype="int8", error_feedback=True,
                    outer_optimizer="nesterov", outer_lr=0.5).ignored_settings() == []


def test_ignored_fields_and_ignored_settings_are_one_rule():
    """ignored_fields (the banner's marks, whatever the value) and ignored_settings (the start
    warnings, non-default values only) come from one rule: every warned setting is a marked field."""
    marks = FLConfig(algorithm="fsdp").ignored_fields()
    assert marks["num_groups"] == "by fsdp" and marks["group_index"] == "by fsdp"
    assert "algorithm" not in marks and "collective_timeout_s" not in marks
    marks = FLConfig().ignored_fields()
    assert marks["group_index"] == "outside torchft mode" and marks["outer_lr"] == "by outer_optimizer 'avg'"
    assert marks["hsdp_shard_size"] == "by fl_fsdp" and "num_groups" not in marks
    cfg = FLConfig(algorithm="fsdp", num_groups=3, sync_density=0.5, outer_state_device="cpu")
    notes = cfg.ignored_settings()
    assert len(notes) == 3 and all(n.split("=")[0] in cfg.ignored_fields() for n in notes)


# ====================================================================== YAML and environment
def _yaml(tmp_path, text):
    path = tmp_path / "fl.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_yaml_top_level(tmp_path):
    path = _yaml(tmp_path, """
        algorithm: fl_hsdp
        num_groups: 4
        hsdp_shard_size: 2
        sync_every: 16
        outer_optimizer: nesterov
        average_optimizer_state: true
    """)
    c = FLConfig.resolve(yaml_path=path)
    assert (c.algorithm, c.num_groups, c.hsdp_shard_size, c.sync_every) == ("fl_hsdp", 4, 2, 16)
    assert c.outer_optimizer == "nesterov" and c.average_optimizer_state is True
    assert c.outer_lr == 0.7  # untouched fields keep their defaults


def test_yaml_under_fl_key(tmp_path):
    """A recipe YAML may hold the FL settings under ``fl:`` next to other sections."""
    path = _yaml(tmp_path, """
        training:
          lr: 3.0e-4
        fl:
          num_groups: 8
          sync_every: 4
    """)
    c = FLConfig.resolve(yaml_path=path)
    assert (c.num_groups, c.sync_every, c.algorithm) == (8, 4, "fl_fsdp")


@pytest.mark.parametrize("text,match", [
    ("num_groups: 2\nsync_evry: 4\n", "sync_evry"),  # unknown key, named
    ("fl:\n  bogus: 1\n", "bogus"),
    ("sync_every: 0\n", "sync_every"),  # loaded values are validated
    ("num_groups: four\n", "num_groups"),
    ("- 1\n- 2\n", "mapping"),
    ("fl: 3\n", "mapping"),
    ("fl: [num_groups]\n", "mapping"),
    ("num_groups: [1,\n", "cannot read"),
])
def test_yaml_errors(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        FLConfig.resolve(yaml_path=_yaml(tmp_path, text))


def test_empty_yaml_or_fl_section_gives_defaults(tmp_path):
    assert FLConfig.resolve(yaml_path=_yaml(tmp_path, "")) == FLConfig()
    assert FLConfig.resolve(yaml_path=_yaml(tmp_path, "training:\n  lr: 1.0\nfl:\n")) == FLConfig()


def test_missing_yaml_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        FLConfig.resolve(yaml_path=tmp_path / "nope.yaml")


def test_env_values_are_typed():
    env = {"FL_ACCEL_NUM_GROUPS": "4", "FL_ACCEL_HSDP_SHARD_SIZE": "none", "FL_ACCEL_OUTER_LR": "0.5",
           "FL_ACCEL_AVERAGE_OPTIMIZER_STATE": "true", "FL_ACCEL_ALGORITHM": "fl_hsdp", "PATH": "/bin",
           "FL_ACCEL_GROUP_SIZES": "2,4", "FL_ACCEL_SYNC_DTYPE": "int8", "FL_ACCEL_FRAGMENT_UPDATE_ALPHA": "0.5"}
    assert env_overrides(env, FLConfig) == {"num_groups": 4, "hsdp_shard_size": None, "outer_lr": 0.5,
                                  "average_optimizer_state": True, "algorithm": "fl_hsdp", "group_sizes": [2, 4],
                                  "sync_dtype": "int8", "fragment_update_alpha": 0.5}
    assert env_overrides({"FL_ACCEL_HSDP_SHARD_SIZE": "2", "FL_ACCEL_AVERAGE_OPTIMIZER_STATE": "0"}, FLConfig) == \
        {"hsdp_shard_size": 2, "average_optimizer_state": False}
    assert FLConfig.from_env(environ={"FL_ACCEL_OUTER_STATE_DEVICE": "cpu"}).outer_state_device == "cpu"
    with pytest.raises(ValueError, match="outer_state_device must be one of"):
        FLConfig.from_env(environ={"FL_ACCEL_OUTER_STATE_DEVICE": "gpu"})


def test_sparse_fields_from_env_yaml_and_flags(tmp_path):
    """The sparse exchange's fields travel like every field: FL_ACCEL_<FIELD> variables,
    YAML under ``fl:``, the recipe's flags; a bad density raises naming the field; a
    density with another sync_dtype is named as ignored."""
    from recipes.args import parse_args

    c = FLConfig.from_env({"FL_ACCEL_SYNC_DTYPE": "sparse", "FL_ACCEL_ERROR_FEEDBACK": "1",
                           "FL_ACCEL_SYNC_DENSITY": "0.02", "FL_ACCEL_SYNC_VALUE_BITS": "4"})
    assert (c.sync_dtype, c.sync_density, c.sync_value_bits, c.compressed) == ("sparse", 0.02, 4, True)
    with pytest.raises(ValueError, match="FLConfig.sync_density"):
        FLConfig.from_env({"FL_ACCEL_SYNC_DENSITY": "0"})
    path = tmp_path / "fl.yaml"
    path.write_text("fl:\n  sync_dtype: sparse\n  error_feedback: true\n  sync_density: 0.03\n")
    assert FLConfig.resolve(yaml_path=path).sync_density == 0.03
    parsed = parse_args(["--sync_dtype", "sparse", "--error_feedback", "--sync_density", "0.01"], environ={})
    assert (parsed.fl.sync_dtype, parsed.fl.sync_density) == ("sparse", 0.01)
    with pytest.raises((ValueError, SystemExit)):
        parse_args(["--sync_dtype", "sparse", "--error_feedback", "--sync_density", "2"], environ={})
    assert any("sync_density" in n for n in FLConfig(sync_density=0.5).ignored_settings())


def test_env_parser_skips_test_hooks_and_reads_the_timeout():
    """FL_ACCEL_TEST_* variables are test hooks, not settings; the collective timeout is a field."""
    env = {"FL_ACCEL_TEST_FAULT_INJECT": "kill:1:2", "FL_ACCEL_TEST_RECORD_BLOCKS": "/tmp/x",
           "FL_ACCEL_COLLECTIVE_TIMEOUT_S": "60"}
    assert env_overrides(env, FLConfig) == {"collective_timeout_s": 60.0}
    assert FLConfig.from_env(environ=env).collective_timeout_s == 60.0
    assert not FLConfig(num_fragments=2, sync_every=4).compressed and FLConfig(sync_dtype="int8").compressed


def test_from_env_reads_os_environ(monkeypatch):
    monkeypatch.setenv("FL_ACCEL_SYNC_EVERY", "3")
    monkeypatch.setenv("FL_ACCEL_OUTER_OPTIMIZER", "nesterov")
    c = FLConfig.from_env()
    assert (c.sync_every, c.outer_optimizer) == (3, "nesterov")


@pytest.mark.parametrize("env,match", [
    ({"FL_ACCEL_NUM_GROUP": "2"}, "FL_ACCEL_NUM_GROUP"),  # unknown variable, named
    ({"FL_ACCEL_NUM_GROUPS": "two"}, "FL_ACCEL_NUM_GROUPS"),
    ({"FL_ACCEL_OUTER_LR": "fast"}, "FL_ACCEL_OUTER_LR"),
    ({"FL_ACCEL_AVERAGE_OPTIMIZER_STATE": "maybe"}, "FL_ACCEL_AVERAGE_OPTIMIZER_STATE"),
    ({"FL_ACCEL_SYNC_EVERY": "0"}, "sync_every"),
    ({"FL_ACCEL_ALGORITHM": "fedprox"}, "algorithm"),
    ({"FL_ACCEL_GROUP_SIZES": "2,x"}, "FL_ACCEL_GROUP_SIZES"),
])
def test_env_errors(env, match):
    with pytest.raises(ValueError, match=match):
        FLConfig.from_env(environ=env)


def test_precedence_defaults_yaml_env_overrides(tmp_path):
    """defaults < YAML < FL_ACCEL_* < keyword overrides, field by field."""
    path = _yaml(tmp_path, """
        fl:
          num_groups: 4
          sync_every: 4
          outer_lr: 0.5
          outer_optimizer: nesterov
    """)
    env = {"FL_ACCEL_NUM_GROUPS": "8", "FL_ACCEL_OUTER_LR": "0.25"}
    c = FLConfig.resolve(yaml_path=path, environ=env, overrides={"outer_lr": 0.1})
    assert c.outer_momentum == 0.9  # default
    assert c.sync_every == 4 and c.outer_optimizer == "nesterov"  # YAML over defaults
    assert c.num_groups == 8  # env over YAML
    assert c.outer_lr == 0.1  # override over env
    assert FLConfig.resolve(yaml_path=path, environ=env).outer_lr == 0.25


def test_a_yaml_file_applies_env_then_overrides(tmp_path, monkeypatch):
    path = _yaml(tmp_path, "sync_every: 4\nnum_groups: 4\n")
    monkeypatch.setenv("FL_ACCEL_SYNC_EVERY", "6")
    c = FLConfig.resolve(yaml_path=path, overrides={"num_groups": 2})
    assert (c.sync_every, c.num_groups) == (6, 2)


def test_unknown_keys_rejected():
    with pytest.raises(ValueError, match="sync_evrey"):
        FLConfig.resolve(environ={}, overrides={"sync_evrey": 3})
    with pytest.raises(ValueError, match="nope"):
        FLConfig.resolve(environ={}, overrides={"nope": 1})


# ====================================================================== FLLayout
# Expected process groups per axis (each a partition of the world), written out by hand.
LAYOUTS = {
    (2, 1, 2): {"fl": [(0, 2), (1, 3)], "dp_replicate": [(0,), (1,), (2,), (3,)],
                "dp_shard": [(0, 1), (2, 3)]},
    (2, 2, 2): {"fl": [(0, 4), (1, 5), (2, 6), (3, 7)], "dp_replicate": [(0, 2), (1, 3), (4, 6), (5, 7)],
                "dp_shard": [(0, 1), (2, 3), (4, 5), (6, 7)]},
    (1, 2, 2): {"fl": [(0,), (1,), (2,), (3,)], "dp_replicate": [(0, 2), (1, 3)], "dp_shard": [(0, 1), (2, 3)]},
    (1, 1, 4): {"fl": [(0,), (1,), (2,), (3,)], "dp_replicate": [(0,), (1,), (2,), (3,)],
                "dp_shard": [(0, 1, 2, 3)]},
}


@pytest.mark.parametrize("shape", list(LAYOUTS))
def test_layout_axis_ranks(shape):
    """axis_ranks(axis, k) is the hand-written block containing k, for every rank and axis;
    axis_groups(axis) lists exactly those blocks."""
    layout = FLLayout.equal(*shape)
    for axis, blocks in LAYOUTS[shape].items():
        assert sorted(x for b in blocks for x in b) == list(range(layout.world_size))
        assert sorted(layout.axis_groups(axis)) == sorted(blocks)
        for block in blocks:
            for k in block:
                assert layout.axis_ranks(axis, k) == block, (axis, k)


@pytest.mark.parametrize("shape", [(2, 1, 2), (2, 2, 2), (3, 2, 1), (1, 4, 2), (4, 1, 3)])
def test_layout_coords_round_trip_and_device_mesh_order(shape):
    """coords/rank invert each other and follow DeviceMesh's row-major order of
    ``torch.arange(N).view(F, R, S)`` (what init_device_mesh builds)."""
    F, R, S = shape
    layout = FLLayout.equal(F, R, S)
    assert (layout.world_size, layout.group_size) == (F * R * S, R * S)
    grid = torch.arange(F * R * S).view(F, R, S)
    seen = set()
    for k in range(layout.world_size):
        f, r, s = layout.coords(k)
        seen.add((f, r, s))
        assert layout.rank(f, r, s) == k and grid[f, r, s].item() == k
        assert layout.axis_ranks("fl", k) == tuple(grid[:, r, s].tolist())
        assert layout.axis_ranks("dp_replicate", k) == tuple(grid[f, :, s].tolist())
        assert layout.axis_ranks("dp_shard", k) == tuple(grid[f, r, :].tolist())
        assert k in layout.group_ranks(f) and layout.group_local_rank(k) == k - f * R * S
    assert len(seen) == layout.world_size


def test_layout_errors():
    layout = FLLayout.equal(2, 1, 2)
    assert AXES == ("fl", "dp_replicate", "dp_shard")
    with pytest.raises(ValueError):
        layout.coords(4)
    with pytest.raises(ValueError):
        layout.coords(-1)
    with pytest.raises(ValueError):
        layout.axis_ranks("tp", 0)
    with pytest.raises(ValueError, match="shards=3 must divide"):
        FLLayout((2, 4), 3, "fl_hsdp")


def test_unequal_layout_by_hand():
    """group_sizes (2, 4), S=2: group 0 = ranks 0-1 (1 replica), group 1 = ranks 2-5 (2 replicas).
    The shard is exchanged in R_min = 1 chunk by replica 0 of each group; ranks 4, 5 take no
    part in the "fl" exchange and receive the result inside their group."""
    layout = FLLayout.from_config(FLConfig(algorithm="fl_hsdp", group_sizes=[2, 4], hsdp_shard_size=2), 6)
    assert [layout.coords(k) for k in range(6)] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0),
                                                     (1, 1, 1)]
    assert (layout.min_replicas, layout.replicas_of(0), layout.replicas_of(1)) == (1, 1, 2)
    assert layout.axis_groups("fl") == [(0, 2), (1, 3)]
    assert layout.axis_groups("dp_replicate") == [(0,), (1,), (2, 4), (3, 5)]
    assert layout.axis_groups("dp_shard") == [(0, 1), (2, 3), (4, 5)]
    assert layout.axis_ranks("fl", 4) == () and layout.axis_ranks("fl", 3) == (1, 3)
    assert layout.group_local_rank(5) == 3 and layout.group_ranks(1) == (2, 3, 4, 5)
    assert layout.weights("size") == (2 / 6, 4 / 6) and layout.weights("uniform") == (0.5, 0.5)
    assert FLLayout.equal(2, 1, 2).weights("size") == (0.5, 0.5)
    with pytest.raises(ValueError, match="group_size is not defined for unequal groups"):
        layout.group_size


@pytest.mark.parametrize("shape,rpn,spans,share", [
    ((2, 1, 2), 2, {"fl": True, "dp_replicate": False, "dp_shard": False}, {"fl": 2, "dp_shard": 0}),
    ((1, 1, 4), 2, {"fl": False, "dp_replicate": False, "dp_shard": True}, {"fl": 0, "dp_shard": 1}),
    ((1, 2, 2), 2, {"fl": False, "dp_replicate": True, "dp_shard": False}, {"dp_replicate": 2, "dp_shard": 0}),
    ((2, 2, 2), 4, {"fl": True, "dp_replicate": False, "dp_shard": False}, {"fl": 4, "dp_replicate": 0}),
])
def test_node_spans_and_link_share(shape, rpn, spans, share):
    """Which axes leave a node (ranks numbered node by node) and how many ring hops of an axis
    share one node's link per direction (FSDP over 2 nodes x 2: 1; the fl axis of 2x2: 2)."""
    layout = FLLayout.equal(*shape)
    assert {a: layout.spans_nodes(a, rpn) for a in AXES} == spans
    for axis, n in share.items():
        assert layout.link_share(axis, rpn) == n, axis


def test_outer_lr_schedule_values_and_its_missing_length():
    """fl_accel.lr_schedule.outer_lr (what a fragment's outer step uses): constant without
    warmup is outer_lr at every step; linear decay with warmup follows the formula at index
    step - 1; a decaying schedule without outer_lr_decay_steps raises ValueError naming the field."""
    from fl_accel.lr_schedule import outer_lr

    assert outer_lr(FLConfig(outer_optimizer="nesterov"), 17) == 0.7
    cfg = FLConfig(outer_optimizer="nesterov", outer_lr=0.5, outer_lr_schedule="linear", outer_lr_warmup_steps=2,
                   outer_lr_decay_steps=10)
    lrs = [outer_lr(cfg, s) for s in range(1, 12)]
    want = [0.5 * (i / 2 if i < 2 else max(0.0, (10 - i) / 8)) for i in range(11)]
    assert lrs == pytest.approx(want, abs=1e-15)
    warm = FLConfig(outer_optimizer="nesterov", outer_lr_warmup_steps=4)  # constant after a warmup
    assert [outer_lr(warm, s) for s in (1, 3, 5, 50)] == pytest.approx([0, 0.35, 0.7, 0.7])
    with pytest.raises(ValueError, match="outer_lr_decay_steps"):
        outer_lr(FLConfig(outer_optimizer="nesterov", outer_lr_schedule="cosine"), 8)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_multiplier_equals_transformers_schedules(schedule):
    """fl_accel.lr_schedule.lr_multiplier is transformers' get_scheduler multiplier, bit for bit
    ("constant" is its "constant_with_warmup"), at every index of several lengths and warmups,
    past the end too; unknown names and a decay without its length raise ValueError."""
    transformers = pytest.importorskip("transformers")
    from fl_accel.lr_schedule import lr_multiplier

    name = "constant_with_warmup" if schedule == "constant" else schedule
    for warmup, total in ((0, 1), (0, 10), (1, 10), (3, 10), (7, 8), (10, 1000), (0, 97)):
        probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        theirs = transformers.get_scheduler(name, probe, num_warmup_steps=warmup,
                                            num_training_steps=total).lr_lambdas[0]
        for index in range(total + 5):
            ours = lr_multiplier(schedule, index, warmup_steps=warmup, total_steps=total)
            assert isinstance(ours, float) and ours == float(theirs(index)), (warmup, total, index)
    with pytest.raises(ValueError, match="unknown"):
        lr_multiplier("cosine_with_restarts", 0, total_steps=4)
    if schedule != "constant":
        with pytest.raises(ValueError, match="total_steps"):
            lr_multiplier(schedule, 0, warmup_steps=1)
    else:
        assert lr_multiplier("constant", 5, warmup_steps=2) == 1.0  # needs no length


def test_a_defaulted_hsdp_shard_size_leaving_one_replica_names_the_field_and_the_flag():
    """fl_hsdp on one 4-rank node without hsdp_shard_size: S=2 per group of 2 leaves R=1; the
    note says so and names both the FLConfig field and the recipe's flag that give 2 replicas."""
    from fl_accel.refusals import start_notes

    cfg = FLConfig(algorithm="fl_hsdp", num_groups=2)
    notes = start_notes(cfg, FLLayout.from_config(cfg, 4, ranks_per_node=4), "cpu", "no")
    assert any("one replica per group (R=1): set hsdp_shard_size=1 (the recipe's --hsdp_shard_size 1) for 2 "
               "replicas" in n for n in notes), notes
    assert not start_notes(FLConfig(algorithm="fl_hsdp", num_groups=2, hsdp_shard_size=1),
                           FLLayout((2, 2), 1, "fl_hsdp"), "cpu", "no")
