"""The recipe with ``--sync_trigger speed``: 4 gloo processes, 2 groups of unequal speed
(group 1 sleeps after each step twice the step's own time: the recipe's
``FL_ACCEL_TEST_STEP_SLEEP`` hook, 3x slower whatever the machine's load), a token budget,
evaluations and checkpoints at round ends, the ``rounds`` figures, and a resume.
"""

from __future__ import annotations

import json
import os

import pytest

from _launch import REPO_ROOT, run_torchrun
from recipes.run_folder import read_metrics

RECIPE = REPO_ROOT / "recipes" / "pretrain.py"
ARGS = ["--model", "tiny", "--seq_len", "64", "--micro_batch_size", "2", "--max_steps", "12", "--log_every", "2",
        "--eval_every", "6", "--max_eval_blocks", "16", "--checkpoint_every", "2", "--sync_every", "2",
        "--num_groups", "2", "--algorithm", "fl_fsdp", "--sync_trigger", "speed", "--report_to", "none",
        "--save_final_model", "false", "--checkpoints_total_limit", "0"]
# --checkpoint_every 2 = H: the first round is H for every group whatever the machine's load, so its end
# (federation step 2) always makes a mid-run checkpoint for the resume test; later rounds' sizes follow the
# measured speeds, so on a busy machine one round may take the rest of the budget.
SLOW = {"FL_ACCEL_TEST_STEP_SLEEP": "0,x2"}  # per group: group 1 sleeps 2x its own step time (3x slower under any
# load; a fixed 0.25 s was not decisive on a busy machine: the fast group's loaded steps measured as long)


@pytest.fixture(scope="module")
def run(tmp_path_factory, default_corpus_cache):
    out = str(tmp_path_factory.mktemp("rounds"))
    proc = run_torchrun(4, RECIPE, *ARGS, "--output_dir", out, "--cache_dir", default_corpus_cache, timeout=600,
                        env=SLOW)
    assert proc.returncode == 0, proc.tail()
    return out, proc


def test_speed_trigger_run_ends_on_the_budget_with_round_figures(run):
    """The run trains 12 steps' tokens (x 4 ranks): all_results.json counts the federation's
    steps and tokens, ``rounds`` has every group's steps per round (the slowed group does
    fewer after the first round), waiting shares and standalone rates; the closing line says
    so; logged and evaluated steps are the federation's and increase; the checkpoints are
    named by federation steps, the same folder for every group."""
    out, proc = run
    results = json.loads(open(os.path.join(out, "all_results.json")).read())
    rounds = results["rounds"]
    assert results["steps"] == 12 and results["train_tokens"] == 12 * 4 * 2 * 64, results["steps"]
    assert rounds["trigger"] == "speed" and rounds["rank_steps"] == pytest.approx(48, abs=4), rounds
    fast, slow = rounds["steps_per_round"]
    assert fast[0] == slow[0] == 2 and sum(slow) < sum(fast), rounds  # then the slow group does H=2, the fast more
    # the mechanism: in every round between the first and the budget's last, the group measured
    # slowest does H and the other round(H t_max / t_f) >= H; with a 3x slowdown that is group 1
    assert all(min(f, s) == 2 for f, s in zip(fast[1:-1], slow[1:-1])), rounds
    assert all(n == 2 for n in slow[1:-1]) and all(f > 2 for f in fast[1:-1]), rounds
    arrival = results["sync_arrival_share_by_group"]
    assert len(arrival) == 2 and all(0 <= a < 1 for a in arrival), arrival
    assert len(rounds["wait_share"]) == 2 and all(0 <= w < 1 for w in rounds["wait_share"])
    assert all(r > 0 for r in rounds["standalone_tokens_per_s"]) and 0 < rounds["of_standalone_sum"] <= 1.5
    assert "rounds by speed: group 0:" in proc.stdout + proc.stderr
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    steps = [r["step"] for r in records]
    assert steps == sorted(steps) and steps[-1] == 12, steps
    # evaluations and checkpoints: after exactly the rounds whose end crosses a multiple of the interval
    # (federation steps: every group's rank-steps over the world size, 2 + 2 ranks), and the final ones.
    # What the mechanism guarantees whatever the round sizes a busy machine produces.
    ends = round_ends(rounds)
    assert ends[0] == 2 and ends[-1] == 12, (ends, rounds)
    evals = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in evals] == crossings(ends, 6) + [12], (ends, [r["step"] for r in evals])
    assert evals[-1]["tokens"] == 12 * 4 * 2 * 64
    assert all("group_step" in r for r in records if "train/loss" in r)
    names = sorted(n for n in os.listdir(os.path.join(out, "checkpoints")) if not n.endswith(".partial"))
    assert sorted(int(n.split("_")[1]) for n in names) == crossings(ends, 2) + [12], (ends, names)
    assert not [n for n in os.listdir(os.path.join(out, "checkpoints")) if n.endswith(".partial")]


def round_ends(rounds: dict) -> list[int]:
    """The federation step at each round's end: cumulative rank-steps over the world (2 groups of 2)."""
    fast, slow = rounds["steps_per_round"]
    ends, rank_steps = [], 0
    for f, s in zip(fast, slow):
        rank_steps += 2 * f + 2 * s
        ends.append(int(rank_steps / 4))
    return ends


def crossings(ends: list[int], every: int) -> list[int]:
    """The round ends before the last at which a multiple of ``every`` lies in (previous end, end]."""
    return [e for last, e in zip([0] + ends[:-1], ends[:-1]) if e // every > last // every]


def test_speed_trigger_run_resumes_from_a_round_end(run, tmp_path, default_corpus_cache):
    """A copy of the run without its final checkpoint resumes from the mid-run one (a round
    end, named by its federation step) and trains to the same budget: the rounds before the
    checkpoint are the first run's, and the run ends on the budget again. Its intervals count
    from the resumed step: a checkpoint after each later round that crosses a multiple of
    --checkpoint_every, and the final one."""
    import shutil

    out, _ = run
    first = json.loads(open(os.path.join(out, "all_results.json")).read())["rounds"]
    copy = str(tmp_path / "resumed")
    shutil.copytree(out, copy)
    ckpts = sorted((int(n.split("_")[1]), n) for n in os.listdir(os.path.join(copy, "checkpoints")))
    assert len(ckpts) >= 2, ckpts
    shutil.rmtree(os.path.join(copy, "checkpoints", ckpts[-1][1]))
    meta = json.loads(open(os.path.join(copy, "checkpoints", ckpts[-2][1], "fl_accel_checkpoint.json")).read())
    done_rounds = len(meta["sync"]["round"]["rounds"])
    proc = run_torchrun(4, RECIPE, *ARGS, "--output_dir", copy, "--cache_dir", default_corpus_cache,
                        "--resume_from_checkpoint", "latest", timeout=600, env=SLOW)
    assert proc.returncode == 0, proc.tail()
    results = json.loads(open(os.path.join(copy, "all_results.json")).read())
    assert results["steps"] == 12 and results["rounds"]["num_rounds"] > done_rounds, results["rounds"]
    for f in range(2):
        assert results["rounds"]["steps_per_round"][f][:done_rounds] == first["steps_per_round"][f][:done_rounds]
    assert results["rounds"]["group_steps"] != [0, 0]
    resumed_at = ckpts[-2][0]
    new = sorted(int(n.split("_")[1]) for n in os.listdir(os.path.join(copy, "checkpoints")) if n.startswith("step_"))
    ends = round_ends(results["rounds"])
    assert resumed_at in ends, (resumed_at, ends)
    after = [e for e in crossings(ends, 2) if e > resumed_at]
    assert [s for s in new if s > resumed_at] == after + [12], (resumed_at, ends, new)
