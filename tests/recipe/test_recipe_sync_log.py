"""Federation groups meet only at syncs, also in the recipe's logging (issue 40 item 1).

4 gloo processes, FL+FSDP 2 groups x 2 ranks, H=4, 12 steps, a log record every step, an
evaluation asked every 3 steps (rounded up to 4, the next sync) and a checkpoint every 6
(step 6 is mid-round). Each rank records how many collectives of the default (world)
process group it has made, from the comm meter (fl_accel/comm.py, "world" bucket), when
each sync event starts and after each optimizer step (the recipe's
``FL_ACCEL_TEST_RECORD_WORLD`` hook). A second launch is killed after step 7 and resumed.
"""

from __future__ import annotations

import json
import os

import pytest

from _launch import REPO_ROOT, run_torchrun, small_corpus
from recipes.run_folder import read_metrics

RECIPE = REPO_ROOT / "recipes" / "pretrain.py"


def _args(data, out, *extra):
    return ["--model", "tiny", "--micro_batch_size", "1", "--max_steps", "12", "--sync_every", "4", "--num_groups",
            "2", "--log_every", "1", "--eval_every", "3", "--checkpoint_every", "6", "--report_to", "none",
            "--save_final_model", "false", "--output_dir", str(out), *data, *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sync_log")
    data = small_corpus(tmp)
    out = tmp / "run"
    proc = run_torchrun(4, RECIPE, *_args(data, out), timeout=600,
                        env={"FL_ACCEL_TEST_RECORD_WORLD": str(tmp / "world")})
    assert proc.returncode == 0, proc.tail()
    world = {k: [json.loads(line) for line in (tmp / "world" / f"rank{k}.jsonl").read_text().splitlines()]
             for k in range(4)}
    return tmp, data, out, proc, world


def _between(records):
    """(after, before, world collectives): each stretch outside the sync events, from the end of
    an optimizer step (its sync included) to the next sync event's start or step's end."""
    return [(a["step"], b["at"], b["world"] - a["world"]) for a, b in zip(records, records[1:]) if a["at"] == "step"]


def test_no_world_collective_between_syncs(run):
    """Between two syncs no rank makes a world collective: the records of steps 1-11 (train
    loss, memory, traffic of every rank) and the evaluation of step 8 are summed inside the
    sync events, and so is nothing else. The one exception is the checkpoint asked for
    mid-round (step 6): a checkpoint holds every group's state at one step, a world event
    by design (docs/recipe.md); it also sums the records waiting for it (steps 4-6 and the
    evaluation of step 4)."""
    _, _, _, _, world = run
    for rank, records in world.items():
        syncs = [r["step"] for r in records if r["at"] == "sync"]
        assert syncs == [4, 8, 12], (rank, syncs)
        outside = [(after, n) for after, _, n in _between(records) if n]
        assert [after for after, _ in outside] == [6], (rank, outside)  # only the mid-round checkpoint
        inside = {r["step"]: b["world"] - r["world"] for r, b in zip(records, records[1:]) if r["at"] == "sync"}
        # sync 12 sums the records of steps 8-11 and the evaluation of step 8 (and runs its own check)
        assert inside[12] >= 5 and inside[4] >= 3, (rank, inside)


def test_records_are_complete_in_order_and_evaluations_wait_for_the_sync(run):
    """metrics.jsonl holds every step's train record once, in step order; the evaluations asked
    every 3 steps ran after the syncs of steps 4 and 8 (eval_every rounded up to a multiple of
    H, the banner says so) and at the end, each written after its step's train record; the
    mid-round checkpoint is where it was asked (step 6)."""
    _, _, out, proc, _ = run
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    kinds = [(r["step"], "eval" if "eval/loss" in r else "train") for r in records]
    assert kinds == [(s, "train") for s in range(1, 5)] + [(4, "eval")] + [(s, "train") for s in range(5, 9)] \
        + [(8, "eval")] + [(s, "train") for s in range(9, 13)] + [(12, "eval")], kinds
    assert {r["eval/scored"] for r in records if "eval/loss" in r} == {"synchronized"}
    assert "eval_every rounded up to 4, a multiple of sync_every" in proc.stdout
    assert "[fl_accel] step 8: eval perplexity " in proc.stdout
    assert sorted(os.listdir(out / "checkpoints")) == ["step_12", "step_6"]
    # the world figures of a record are those of its step: no world collective between syncs
    world_calls = {r["step"]: r["comm/world/calls"] for r in records if "train/loss" in r}
    assert world_calls[1] == world_calls[2] == world_calls[3] and world_calls[9] == world_calls[11]


def test_progress_bar_says_what_the_records_wait_for(run):
    """The bar (stderr) names the steps whose figures wait and the event they wait for."""
    _, _, _, proc, _ = run
    assert "steps 1-3 wait for the sync at step 4" in proc.stderr, proc.stderr[-3000:]
    assert "steps 4-5 wait for the checkpoint at step 6" in proc.stderr
    assert "step 12 waits for the end of the run" in proc.stderr


def test_a_crash_loses_only_the_records_after_the_last_checkpoint(run):
    """Rank 0 killed after step 7: metrics.jsonl holds the records up to the checkpoint of step
    6 (the checkpoint summed and wrote them), none of step 7 (waiting for the sync at 8). The
    resumed run completes the history: every step once, the uninterrupted run's losses."""
    tmp, data, out, _, _ = run
    crashed = tmp / "crashed"
    proc = run_torchrun(4, RECIPE, *_args(data, crashed), timeout=600,
                        env={"FL_ACCEL_TEST_FAULT_INJECT": "kill:0:7", "FL_ACCEL_COLLECTIVE_TIMEOUT_S": "60"})
    assert proc.returncode not in (0, None), proc.tail()
    kept = [(r["step"], "eval/loss" in r) for r in read_metrics(os.path.join(crashed, "metrics.jsonl"))]
    assert kept == [(1, False), (2, False), (3, False), (4, False), (4, True), (5, False), (6, False)], kept
    proc = run_torchrun(4, RECIPE, *_args(data, crashed, "--resume_from_checkpoint", "latest"), timeout=600)
    assert proc.returncode == 0, proc.tail()
    full = {r["step"]: r["train/loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "train/loss" in r}
    again = [(r["step"], r["train/loss"]) for r in read_metrics(os.path.join(crashed, "metrics.jsonl"))
             if "train/loss" in r]
    assert [s for s, _ in again] == list(range(1, 13)), again
    assert all(abs(loss - full[s]) <= 1e-6 for s, loss in again), (again, full)
