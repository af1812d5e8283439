"""The run-time config has one owner (issue 41, item 4): ``FLConfig.for_launch`` resolves the
layout and the run's length once into a frozen :class:`fl_accel.config.ResolvedFLConfig`;
``FLAccelerator.run_config`` holds it and every reader reads it or its parts.

Fast and single-process: no process group is created (the accelerator's is made to fail the
test if any code reaches it).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import fl_accel.config as config_module
from fl_accel import FLConfig, FLLayout
from fl_accel.config import ResolvedFLConfig, resolve_launch

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_fl_env(monkeypatch):
    """A caller's FL_ACCEL_* variables must not change what these tests see."""
    import os

    for key in list(os.environ):
        if key.startswith("FL_ACCEL_"):
            monkeypatch.delenv(key)


# ====================================================================== resolution
def test_resolution_computes_the_layout_and_the_steps_once(monkeypatch):
    """One call computes the federation's layout (one FLLayout.for_launch), this launch's part
    and the config filled for the run's length; the source config is kept as given."""
    calls = []
    original = FLLayout.for_launch.__func__
    monkeypatch.setattr(FLLayout, "for_launch",
                        classmethod(lambda cls, *a, **k: calls.append(a) or original(cls, *a, **k)))
    cfg = FLConfig(algorithm="fl_hsdp", num_groups=2, outer_optimizer="nesterov", outer_lr_schedule="cosine",
                   outer_lr_warmup_steps=4)
    r = cfg.for_launch(8, ranks_per_node=4, max_steps=40)
    assert len(calls) == 1
    assert r.layout == FLLayout((4, 4), 4, "fl_hsdp") and r.launch_layout is r.layout
    assert (r.world_size, r.ranks_per_node, r.max_steps) == (8, 4, 40)
    assert r.source is cfg and r.config.outer_lr_decay_steps == 40 and cfg.outer_lr_decay_steps is None
    assert r.with_max_steps(40) is r and len(calls) == 1  # the same length: nothing resolved again
    unsized = cfg.for_launch(8, ranks_per_node=4)
    assert unsized.max_steps is None and unsized.config is cfg
    assert unsized.with_max_steps(40) == r
    plain = FLConfig(num_groups=2).for_launch(4, max_steps=10)
    assert plain.config is plain.source  # nothing to fill: the very config given


def test_torchft_resolution_is_the_group_alone():
    """torchft: this launch is one group of F equal ones; the layout spans all of them, the
    launch layout this group's ranks."""
    cfg = FLConfig(num_groups=3, fault_tolerance="torchft", group_index=1)
    r = resolve_launch(cfg, 2)
    assert r.layout.group_sizes == (2, 2, 2) and r.launch_layout.group_sizes == (2,) and r.fault_tolerant


@pytest.mark.parametrize("cfg, world, steps, match", [
    (FLConfig(num_groups=3), 4, None, r"FLConfig\.num_groups=3 does not divide the world size 4"),
    (FLConfig(algorithm="fl_hsdp", group_sizes=[2, 4], hsdp_shard_size=2), 8, None, r"FLConfig\.group_sizes"),
    (FLConfig(algorithm="fl_hsdp", num_groups=2, hsdp_shard_size=3), 8, None, r"FLConfig\.hsdp_shard_size=3"),
    (FLConfig(), 4, 0, r"max_steps must be a positive number"),
    (FLConfig(), 4, True, r"max_steps must be a positive number"),
    (FLConfig(outer_optimizer="nesterov", outer_lr_schedule="cosine", outer_lr_warmup_steps=8), 4, 8,
     r"FLConfig\.outer_lr_warmup_steps=8 must be shorter than the run"),
])
def test_bad_input_raises_naming_the_field_before_any_process_group(monkeypatch, cfg, world, steps, match):
    """Resolution is pure Python: a bad layout or run length raises ValueError naming the field,
    and FLAccelerator raises it before its process group (made to fail here) is touched."""
    import torch.distributed as dist

    import fl_accel.accelerator as accelerator_module

    with pytest.raises(ValueError, match=match):
        cfg.for_launch(world, max_steps=steps)

    def touched(*_a, **_k):
        raise AssertionError("a process group was touched before the config was resolved")

    monkeypatch.setattr(accelerator_module, "init_process_group", touched)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    with pytest.raises(ValueError, match=match):
        accelerator_module.FLAccelerator(cfg, max_steps=steps, cpu=True)
    assert not dist.is_initialized()


def test_a_resolved_config_of_another_world_is_refused_before_any_process_group(monkeypatch):
    """The recipe hands its plan's resolved config to FLAccelerator: it must be this world's."""
    import fl_accel.accelerator as accelerator_module

    monkeypatch.setattr(accelerator_module, "init_process_group",
                        lambda *a, **k: pytest.fail("process group touched"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="resolved for a world of 4 ranks, but WORLD_SIZE is 2"):
        accelerator_module.FLAccelerator(FLConfig().for_launch(4), cpu=True)


# ====================================================================== one owner, read by every reader
def _bare_accelerator(run_config: ResolvedFLConfig):
    """An FLAccelerator's attributes without its constructor (no process group): enough for the
    readers that only read ``run_config``."""
    from fl_accel.accelerator import FLAccelerator

    acc = FLAccelerator.__new__(FLAccelerator)
    acc.run_config, acc.synchronizer = run_config, None
    return acc


def test_readers_see_the_one_resolved_object():
    """fl_config, layout, launch_layout, max_steps and federation.config are the run config's
    parts (the same objects); a resolved config passed in is taken as it is (the recipe's)."""
    from fl_accel.config import resolve_for_world
    from fl_accel.federation import Federation

    r = FLConfig(num_groups=2, outer_optimizer="nesterov", outer_lr_schedule="linear").for_launch(4, max_steps=20)
    assert resolve_for_world(r, 4, None) is r and resolve_for_world(r, 4, 20) is r
    acc = _bare_accelerator(r)
    assert acc.fl_config is r.config and acc.layout is r.layout and acc.launch_layout is r.launch_layout
    assert acc.max_steps == 20 and acc.num_groups == 2
    assert Federation(acc).config is r.config


def test_set_max_steps_before_prepare_resolves_into_the_owner():
    """Before prepare the run's length replaces the owner (nobody holds a copy yet); a refused
    length changes nothing."""
    cfg = FLConfig(num_groups=2, outer_optimizer="nesterov", outer_lr_schedule="cosine", outer_lr_warmup_steps=4)
    acc = _bare_accelerator(cfg.for_launch(4))
    first = acc.run_config
    with pytest.raises(ValueError, match="outer_lr_warmup_steps=4 must be shorter"):
        acc.set_max_steps(4)
    assert acc.run_config is first
    acc.set_max_steps(30)
    assert acc.run_config.max_steps == 30 and acc.fl_config.outer_lr_decay_steps == 30 and acc.run_config.source is cfg


def test_the_recipe_plan_reads_the_resolved_config(tmp_path):
    """plan_run resolves once (layout and --max_steps): plan.fl and plan.layout are its parts, the
    parsed config stays as given (the run's identity)."""
    from recipes.run_folder import plan_run

    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}
    plan = plan_run(["--num_groups", "2", "--outer_optimizer", "nesterov", "--outer_lr_schedule", "cosine",
                     "--max_steps", "12", "--output_dir", str(tmp_path / "o")], environ=env)
    try:
        assert isinstance(plan.resolved, ResolvedFLConfig) and plan.resolved.max_steps == 12
        assert plan.fl is plan.resolved.config and plan.layout is plan.resolved.layout
        assert plan.parsed.fl is plan.resolved.source and plan.parsed.fl.outer_lr_decay_steps is None
        assert plan.fl.outer_lr_decay_steps == 12
    finally:
        plan.lock.release()


# ====================================================================== nothing mutates it afterwards
def test_the_resolved_config_is_frozen():
    """Every field of the resolved config (and of its FLConfig) refuses assignment; the
    accelerator's views of it have no setter."""
    r = FLConfig().for_launch(4, max_steps=8)
    for f in dataclasses.fields(r):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(r, f.name, getattr(r, f.name))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.config.sync_every = 4
    acc = _bare_accelerator(r)
    for name in ("fl_config", "layout", "launch_layout", "max_steps"):
        with pytest.raises(AttributeError):
            setattr(acc, name, None)


def test_no_hand_synced_copies_in_the_library_or_the_recipe():
    """Nobody re-sets a config or layout after construction: the only assignments of
    ``run_config`` are FLAccelerator's resolution and set_max_steps; no ``.fl_config``,
    ``.layout`` or ``.config`` is assigned outside the classes that take them at construction;
    the recipe never fills the run's length itself (``with_max_steps`` of an FLConfig) nor
    copies the accelerator's config back into its plan."""
    assign = re.compile(r"\.(fl_config|layout|launch_layout|config|run_config)\s*=[^=]")
    allowed = {("fl_accel/sync.py", "self.optimizer, self.transport, self.config = optimizer, transport, config"),
               ("fl_accel/fragment.py", "self.index, self.indices, self.names, self.params, self.config = index, "
                                        "list(indices), list(names), \\")}
    found = []
    for folder in ("fl_accel", "recipes", "examples"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            rel = path.relative_to(REPO_ROOT).as_posix()
            for line in path.read_text(encoding="utf-8").splitlines():
                if assign.search(line) and (rel, line.strip()) not in allowed \
                        and not line.strip().startswith("self.run_config = "):
                    found.append(f"{rel}: {line.strip()}")
    assert not found, found
    accelerator = (REPO_ROOT / "fl_accel" / "accelerator.py").read_text(encoding="utf-8")
    assert accelerator.count("self.run_config = ") == 2  # the constructor's resolution and set_max_steps
    for name in ("pretrain.py", "run_folder.py"):
        text = (REPO_ROOT / "recipes" / name).read_text(encoding="utf-8")
        assert "fl.with_max_steps" not in text and "fl=accelerator.fl_config" not in text, name
    assert "check_max_steps" in dir(config_module)


def test_the_recipe_hands_its_resolved_plan_to_the_accelerator(tmp_path, monkeypatch):
    """build_accelerator passes plan.resolved itself (no second resolution, no copy): with
    --max_steps the accelerator's later set_max_steps of the same length keeps that object."""
    import fl_accel
    from recipes.pretrain import build_accelerator
    from recipes.run_folder import plan_run

    seen = []
    monkeypatch.setattr(fl_accel, "FLAccelerator", lambda fl_config, **kwargs: seen.append(fl_config))
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}
    plan = plan_run(["--num_groups", "2", "--max_steps", "6", "--report_to", "none",
                     "--output_dir", str(tmp_path / "o")], environ=env)
    try:
        build_accelerator(plan)
        assert seen == [plan.resolved] and seen[0] is plan.resolved
        acc = _bare_accelerator(plan.resolved)
        acc.set_max_steps(6)  # the recipe's call: the same length, the same object
        assert acc.run_config is plan.resolved
    finally:
        plan.lock.release()
