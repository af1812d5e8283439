"""Checkpoint/resume of the full federated state, and the divergence guard (4 gloo ranks).

Three launches: the checkpointed run; the resumes and the truncated checkpoint (one launch of
tests/workers/ckpt_worker.py's ``batch`` mode); the non-finite and optimizer-state cases (one
more ``batch``, the aborting case last). Each test reads its own case's records and, for
messages, its own case's section of the ranks' stderr.

The checkpointed run uses FL+FSDP with 2 groups x 2 ranks, H=3, the DiLoCo-style
"nesterov" outer optimizer (so the anchor and the outer momentum must survive too),
AdamW and a cosine schedule, in fp32 on CPU. A resume from step 3 (right after a
sync) and from step 4 (mid-round, groups diverged) must reproduce the uninterrupted
run's losses at every later step and its final parameters bitwise.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from _launch import WORKERS, run_torchrun

WORKER = WORKERS / "ckpt_worker.py"
BEGIN = "[ckpt_worker] begin "  # ckpt_worker.BEGIN: printed on stderr before each case of a batch


def load(out, name, world=4):
    return [torch.load(out / f"{name}-rank{r}.pt", weights_only=False) for r in range(world)]


def section(stderr: str, case: str) -> str:
    """What the ranks printed while running ``case`` ("mode:extra") of a batch launch."""
    parts = stderr.split(BEGIN)
    return "".join(p.split("\n", 1)[1] for p in parts[1:] if p.split("\n", 1)[0] == case and "\n" in p)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    result = run_torchrun(4, WORKER, "full", str(out), timeout=240)
    assert result.returncode == 0, result.tail()
    return out, load(out, "full-")


@pytest.fixture(scope="module")
def after_full(full_run, tmp_path_factory):
    """One launch: resume from step 3 and from step 4, then load a truncated copy of step_4, then
    step_4 with another sync_every and another sync_delay."""
    out, _ = full_run
    bad = tmp_path_factory.mktemp("truncated") / "step_4"
    shutil.copytree(out / "step_4", bad)
    shard = sorted(bad.glob("*.distcp"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    result = run_torchrun(4, WORKER, "batch", str(out), "resume:3", "resume:4", f"load_corrupt:{bad}",
                          "load_other:sync_every=6", "load_other:sync_delay=1", timeout=300)
    assert not result.timed_out, result.tail()
    return result


NONFINITE = ["nan:reset", "nan_loss:", "nan_loss:avg_state", "opt_state:on", "opt_state:off", "nan:abort"]


@pytest.fixture(scope="module")
def nonfinite(tmp_path_factory):
    """One launch of the divergence-guard and optimizer-state cases (the aborting one last)."""
    out = tmp_path_factory.mktemp("nonfinite")
    result = run_torchrun(4, WORKER, "batch", str(out), *NONFINITE, timeout=400)
    assert not result.timed_out, result.tail()
    return out, result


@pytest.mark.parametrize("k", [3, 4], ids=["at_sync_boundary", "mid_round"])
def test_resume_is_the_same_run(full_run, after_full, k):
    out, full = full_run
    assert after_full.returncode == 0, after_full.tail()
    resumed = load(out, f"resume-{k}")
    for rank in range(4):
        for step in range(k + 1, 9):
            assert resumed[rank]["losses"][step] == full[rank]["losses"][step], (rank, step)
            lr_used, lr_sched = resumed[rank]["lr"][step]
            assert lr_used == lr_sched == full[rank]["lr"][step][1], (rank, step)
        for a, b in zip(resumed[rank]["params"], full[rank]["params"]):
            assert torch.equal(a, b), rank
        assert resumed[rank]["outer_lr"] == {6: full[rank]["outer_lr"][6]}, rank  # the schedule continues
    # groups differed at the mid-round checkpoint; each must have been restored to its own state
    assert full[0]["losses"][4] != full[2]["losses"][4]


def test_outer_lr_at_each_sync_follows_its_schedule(full_run):
    """Cosine outer-LR schedule, warmup 4, decay over 8 steps, outer_lr 0.7: the sync after
    optimizer step s uses 0.7 x the multiplier at index s - 1 (the formula written out here,
    independent of the transformers schedule the library uses)."""
    def expected(step, warmup=4, total=8):
        i = step - 1
        if i < warmup:
            return 0.7 * i / warmup
        return 0.7 * 0.5 * (1 + math.cos(math.pi * (i - warmup) / (total - warmup)))

    _, full = full_run
    for rank in range(4):
        assert set(full[rank]["outer_lr"]) == {3, 6}
        for step, lr in full[rank]["outer_lr"].items():
            assert lr == pytest.approx(expected(step), rel=1e-12), (rank, step)
    assert full[0]["outer_lr"][3] == pytest.approx(0.35) and full[0]["outer_lr"][6] < 0.7


def test_mid_round_checkpoint_keeps_each_groups_state(full_run):
    """Before the resume above could pass, the groups' diverged shards must be stored separately."""
    import torch.distributed.checkpoint as dcp

    out, _ = full_run
    reader = dcp.FileSystemReader(str(out / "step_4"))
    keys = set(reader.read_metadata().state_dict_metadata)
    g0 = {k[len("group0."):] for k in keys if k.startswith("group0.")}
    g1 = {k[len("group1."):] for k in keys if k.startswith("group1.")}
    assert g0 and g0 == g1
    assert any(k.startswith("fl.anchor/") for k in keys) and any(k.startswith("fl.momentum/") for k in keys)


def test_truncated_checkpoint_fails_on_every_rank(full_run, after_full):
    out, _ = full_run
    errors = [r["error"] for r in load(out, "load_corrupt")]
    assert all(e and "CheckpointError" in e and "cannot load checkpoint" in e for e in errors), errors


def test_nan_in_one_group_aborts_naming_it(nonfinite):
    out, _ = nonfinite
    recs = load(out, "nan-abort")
    for rec in recs:
        assert rec["error"] and "NonFiniteError" in rec["error"], rec["error"]
        assert "federation group(s) [1]" in rec["error"] and "optimizer step 3" in rec["error"]


def test_nan_in_one_group_reset_to_healthy_mean(nonfinite):
    out, result = nonfinite
    assert result.returncode == 0, result.tail()
    recs = load(out, "nan-reset")
    for r in range(4):
        assert recs[r]["error"] is None and recs[r]["num_syncs"] == 1
        assert all(torch.isfinite(p).all() for p in recs[r]["params"])
    # same shard coordinate in both groups: group 1 was reset to the healthy (group 0) value
    for a, b in zip(recs[0]["params"], recs[2]["params"]):
        assert torch.equal(a, b)
    assert "dropped federation group(s) [1]" in section(result.stderr, "nan:reset"), result.tail()
    assert not math.isnan(recs[2]["losses"][3])


@pytest.mark.parametrize("state", ["own", "avg"], ids=["own_optimizer_state", "averaged_optimizer_state"])
def test_nan_through_the_loss_is_recovered_by_reset(nonfinite, state):
    """A NaN loss in group 1 at step 2 poisons its gradients and AdamW moments. With
    on_nonfinite="reset" the sync at step 2 resets group 1's parameters AND moments to the
    healthy group's; every rank then stays finite through steps 3-4 and the groups are
    equal after the sync at step 4. With average_optimizer_state the NaN moments are kept
    out of the average (else every group would be NaN at step 3)."""
    out, result = nonfinite
    assert result.returncode == 0, result.tail()
    recs = load(out, f"nan_loss-{state}")
    case = "nan_loss:avg_state" if state == "avg" else "nan_loss:"
    assert "dropped federation group(s) [1]" in section(result.stderr, case), result.tail()
    for r in range(4):
        assert recs[r]["finite"][1], r
        assert recs[r]["finite"][2] and recs[r]["finite"][3] and recs[r]["finite"][4], (r, recs[r]["finite"])
        assert recs[r]["num_syncs"][4] == 2
    for a, b in ((0, 2), (1, 3)):  # same shard coordinate, different groups
        for step in (2, 4):
            assert all(torch.equal(x, y) for x, y in zip(recs[a]["params"][step], recs[b]["params"][step])), step
        # after the reset at step 2 group 1 took group 0's moments (the healthy mean of one group)
        assert all(torch.equal(x, y) for x, y in zip(recs[a]["moments"][2], recs[b]["moments"][2]))
        assert not all(torch.equal(x, y) for x, y in zip(recs[a]["params"][3], recs[b]["params"][3]))


def test_average_optimizer_state_makes_adamw_moments_equal_across_groups(nonfinite):
    """With average_optimizer_state the AdamW moments are averaged at the sync too; without, they differ."""
    out, result = nonfinite
    assert result.returncode == 0, result.tail()
    on, off = load(out, "opt_state-on"), load(out, "opt_state-off")
    for a, b in ((0, 2), (1, 3)):  # same shard coordinate, different groups
        assert on[a]["num_syncs"] == 1
        assert all(torch.equal(x, y) for x, y in zip(on[a]["opt_state"], on[b]["opt_state"]))
        assert not all(torch.equal(x, y) for x, y in zip(off[a]["opt_state"], off[b]["opt_state"]))
        # the averaged moments are the mean of the two groups' own moments
        for x_on, x_a, x_b in zip(on[a]["opt_state"], off[a]["opt_state"], off[b]["opt_state"]):
            torch.testing.assert_close(x_on, (x_a + x_b) / 2, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("setting, written, here", [("sync_every", 3, 6), ("sync_delay", 0, 1)])
def test_another_sync_schedule_is_refused_on_every_rank(full_run, after_full, setting, written, here):
    """``load_state`` in one's own loop refuses a checkpoint written with another sync_every
    (or sync_delay), as the recipe does, on every rank before any collective (the next
    cases of the same launch ran, so nothing hung), naming both values."""
    out, _ = full_run
    assert after_full.returncode == 0, after_full.tail()
    errors = [r["error"] for r in load(out, f"load_other-{setting}")]
    assert all(e and e.startswith("CheckpointError") and "different setup" in e
               and f"{setting}={written} vs {here}" in e for e in errors), errors
