"""The recipe over a run's whole life: epochs under gradient accumulation, interrupted and
resumed runs, stale output folders, whole-run results, and a plain single process.

One uninterrupted 4-process run (FL+FSDP 2x2, H=2, micro-batch 1, accumulation 2, two
epochs of a 20-block training file: 5 micro-batches per rank per epoch, so Accelerate
steps after micro-batches 2, 4 and 5 of each epoch) evaluates after the syncs of steps 2
and 4 (also each group's model, before the sync) and checkpoints after every step. Each
checkpoint k = 1..5 is then resumed in a copy of the run's folder that ends at step k, as
a crashed run would leave it, and must reproduce the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from _launch import small_corpus, REPO_ROOT, launch_env, run_torchrun
from recipes.run_folder import read_metrics

RECIPE = REPO_ROOT / "recipes" / "pretrain.py"


_corpus = small_corpus


def _args(data, out, *extra):
    return ["--model", "tiny", "--micro_batch_size", "1", "--gradient_accumulation_steps", "2", "--num_epochs", "2",
            "--sync_every", "2", "--num_groups", "2", "--log_every", "1", "--checkpoint_every", "1",
            "--checkpoints_total_limit", "0",  # every checkpoint kept: each one is resumed below
            "--eval_every", "2", "--eval_groups", "--save_final_model", "false", "--output_dir", str(out),
            *data, *extra]


def _launch(args, timeout=420):
    return run_torchrun(4, RECIPE, *args, timeout=timeout, env={"WANDB_MODE": "offline"})


def _results(out):
    with open(os.path.join(out, "all_results.json"), encoding="utf-8") as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lifecycle")
    data = _corpus(tmp)
    out = tmp / "full"
    proc = _launch(_args(data, out))
    assert proc.returncode == 0, proc.tail()
    return tmp, data, out, proc


def test_epochs_count_the_forced_step_at_the_end_of_the_loader(full):
    """5 micro-batches per rank and accumulation 2: Accelerate forces a step at the end of the
    loader, so an epoch has ceil(5/2) = 3 optimizer steps and --num_epochs 2 gives 6."""
    _, _, out, proc = full
    assert "5 micro-batches per rank per epoch, 3 steps/epoch), 6 steps" in proc.stdout, proc.stdout[-3000:]
    results = _results(out)
    assert results["steps"] == 6
    steps = [r["step"] for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "train/loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert sorted(os.listdir(out / "checkpoints")) == [f"step_{k}" for k in range(1, 7)]


def _bytes(folder) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_banner_says_where_checkpoints_go_and_their_size_and_the_tokenizer(full):
    """Issue 42: the banner's estimate of a checkpoint (recipes.run_folder.checkpoint_bytes)
    is within 10% of the real ones, at a sync (step 2, H=2: the model once) and mid-round
    (step 1: every group's model); it names the folder and how many are kept (0: all), and
    says that the tokenizer was trained on the run's text and where it is cached."""
    _, _, out, proc = full
    line = next(x for x in proc.stdout.splitlines() if x.startswith("[fl_accel] checkpoints: "))
    assert line.startswith(f"[fl_accel] checkpoints: every step to {out / 'checkpoints' / 'step_<step>'}, about "), line
    assert "every one kept (--checkpoints_total_limit 0)" in line and "final model: not exported" in line, line
    sync_mb, mid_mb = (float(x) for x in re.search(r"about ([0-9.]+) MB each \(([0-9.]+) MB mid-round\)",
                                                    line).groups())
    sync_real, mid_real = (_bytes(out / "checkpoints" / f"step_{k}") / 1e6 for k in (2, 1))
    # measured 1.057 and 1.054 (DCP's per-tensor overhead, RNG and metadata files on this 0.86M-parameter
    # model; 1.01 on the 2.88M default)
    assert abs(sync_real / sync_mb - 1) < 0.1 and abs(mid_real / mid_mb - 1) < 0.1, (line, sync_real, mid_real)
    tok = next(x for x in proc.stdout.splitlines() if x.startswith("[fl_accel] tokenizer: "))
    assert tok.startswith("[fl_accel] tokenizer: a byte-level BPE of ") and "trained on this run's training text" in tok
    cached = tok.split("cached in ")[1]
    assert os.path.isfile(os.path.join(cached, "tokenizer.json")), tok


@pytest.mark.parametrize("k", [2, 3])  # H=2: a sync boundary right after an evaluation, and mid-round
def test_resume_in_the_same_folder_is_the_same_run(full, tmp_path, k):
    """Resume from step_k in a copy of the folder cut at step k (later checkpoints and the final
    results removed, metrics.jsonl still holding later records, as after a crash): the later
    steps train on the same data (losses within 1e-6), the run ends at the same step with the
    same eval loss, and the whole-run figures of all_results.json equal the uninterrupted
    run's: bytes per axis, tokens, steps; tokens/s = tokens / training seconds. metrics.jsonl
    holds every step once and curves.png is drawn from it (the whole history).

    The bytes are equal at every step, also at the first step after an evaluation (k = 2:
    the checkpoint follows the evaluation of step k). FSDP2 keeps an evaluation's
    post-forward order until the next backward, whose backward prefetch then all-gathered the
    tail unit once more for nothing; a resumed run has no such leftovers, so it counted one
    tail all-gather less (fixed by FLAccelerator._track_forward_only)."""
    _, data, out, _ = full
    cut = tmp_path / "run"
    shutil.copytree(out, cut)
    for name in os.listdir(cut / "checkpoints"):
        if int(name.split("_")[1]) > k:
            shutil.rmtree(cut / "checkpoints" / name)
    for name in ("all_results.json", "curves.png"):
        os.remove(cut / name)
    proc = _launch(_args(data, cut, "--resume_from_checkpoint", "latest"))
    assert proc.returncode == 0, proc.tail()
    assert f"resumed from {cut / 'checkpoints' / f'step_{k}'} at step {k}" in proc.stdout
    a, b = _results(out), _results(cut)
    assert b["steps"] == a["steps"] == 6 and b["train_tokens"] == a["train_tokens"]
    assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-6, (a["eval_loss"], b["eval_loss"])
    for axis in ("fl", "dp_shard", "dp_replicate"):
        assert b["comm"][axis]["bytes"] == a["comm"][axis]["bytes"], axis
        assert b["comm"][axis]["calls"] == a["comm"][axis]["calls"], axis
    assert b["tokens_per_s"] == pytest.approx(b["train_tokens"] / b["train_seconds"])
    assert b["session"]["resumed_from_step"] == k
    # issue 42: the counters say they cover the whole run, carried over from the checkpoint
    assert a["counters"] == {"since": "the run's start", "carried_over_from": None, "steps_counted": 6}
    ckpt = str(cut / "checkpoints" / f"step_{k}")
    assert b["counters"] == {"since": "the run's start", "carried_over_from": ckpt, "steps_counted": 6}, b["counters"]
    assert f"[fl_accel] tokens, time and traffic cover the whole run: the sessions before {ckpt} carried over" \
        in proc.stdout, proc.stdout[-2000:]
    # the time figures: both sessions' parts add up to the run's wall time; this session's to its own
    parts = ("startup_seconds", "train_seconds", "eval_and_checkpoint_seconds")
    assert b["wall_seconds"] == pytest.approx(sum(b[p] for p in parts), rel=1e-9)
    assert b["session"]["wall_seconds"] == pytest.approx(sum(b["session"][p] for p in parts), rel=1e-9)
    # the first session's time is kept (its evaluations: none before the checkpoint of step 1)
    assert b["startup_seconds"] > b["session"]["startup_seconds"] and b["train_seconds"] > b["session"]["train_seconds"]
    assert b["eval_and_checkpoint_seconds"] >= b["session"]["eval_and_checkpoint_seconds"]
    assert b["peak_host_mb"] >= b["peak_host_mb_after_prepare"] > 0
    assert b["wandb_id"] == a["wandb_id"]  # the resumed session logs to the same W&B run id
    full_loss = {r["step"]: r["train/loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))
                 if "train/loss" in r}
    records = read_metrics(os.path.join(cut, "metrics.jsonl"))
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    for r in train:
        assert abs(r["train/loss"] - full_loss[r["step"]]) <= 1e-6, (r["step"], r["train/loss"])
    full_comm = {r["step"]: r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "train/loss" in r}
    for r in train:
        for key in ("comm/dp_shard/bytes", "comm/dp_shard/calls", "comm/fl/bytes"):
            assert r[key] == full_comm[r["step"]][key], (r["step"], key, r[key], full_comm[r["step"]][key])
    evals = [r["step"] for r in records if "eval/loss_group0" in r]
    assert evals == [2, 4, 6], evals  # the evaluations the resumed steps follow (6: the final one)
    # what each evaluation scored: the synchronized model after the sync (one fragment), each
    # group's own model before it; the final per-group scores follow the final sync
    scored = [(r["step"], r["eval/scored"], r["eval/scored_groups"]) for r in records if "eval/loss_group0" in r]
    assert scored == [(2, "synchronized", "before the sync"), (4, "synchronized", "before the sync"),
                      (6, "synchronized", "after the final sync")], scored

    from recipes.plots import plot_run_curves

    redrawn = tmp_path / "redrawn.png"
    plot_run_curves(records, redrawn, f"{b['run_name']} (tiny)", sync_every=2, num_fragments=1)
    assert redrawn.read_bytes() == (cut / "curves.png").read_bytes()


def test_wandb_offline_resume_keeps_the_run_id(full):
    """Offline, W&B ignores resume (wandb/wandb#2423): a resumed session writes a second
    offline-run folder, under the same run id (stored in the checkpoint)."""
    _, _, out, _ = full
    run_id = _results(out)["wandb_id"]
    runs = [d for d in os.listdir(out / "wandb") if d.startswith("offline-run-")]
    assert runs and all(d.endswith(run_id) for d in runs), (runs, run_id)


@pytest.mark.parametrize("extra,message", [
    ([], "holds a finished run (its checkpoint step_6 is step 6 of 6)"),
    (["--resume_from_checkpoint", "latest", "--seed", "7"], "written by another run: ['seed'] differ"),
    (["--resume_from_checkpoint", "latest", "--max_steps", "3"], "is at step 6, past --max_steps 3"),
    (["--resume_from_checkpoint", "CKPT2", "--max_steps", "8"], "belongs to a run of 6 steps"),
    (["--resume_from_checkpoint", "latest"], "is the end of a finished run (6 of 6 steps)"),
], ids=["fresh_run_into_old_folder", "other_seed", "past_max_steps", "other_schedule_length", "finished_run"])
def test_stale_or_foreign_checkpoints_are_refused(full, extra, message):
    """A new run into a folder holding a finished run's checkpoints (an unfinished run's:
    tests/unit/test_recipe_units.py), a checkpoint of another run
    (run identity: seed, data, model, optimizer, FLConfig), one past --max_steps, or a resume
    that would rebuild the LR schedule for another length: refused on every rank before any
    collective, with a message naming the fix; nothing is written."""
    _, data, out, _ = full
    extra = [str(out / "checkpoints" / "step_2") if e == "CKPT2" else e for e in extra]
    before = sorted(os.listdir(out / "checkpoints"))
    proc = _launch(_args(data, out, *extra), timeout=180)
    assert proc.returncode != 0 and not proc.timed_out, proc.tail()
    assert message in proc.stderr, proc.tail()
    assert sorted(os.listdir(out / "checkpoints")) == before


def test_finished_run_without_checkpoints_says_to_start_over(full, tmp_path):
    """A folder holding only a finished run's results (no checkpoint to continue from): a new run
    into it is refused with advice that works (--overwrite_output_dir, another folder), not
    "--resume_from_checkpoint latest"."""
    _, data, out, _ = full
    copy = tmp_path / "done"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "checkpoints")
    proc = _launch(_args(data, copy), timeout=180)
    assert proc.returncode != 0 and not proc.timed_out, proc.tail()
    assert "holds the results of a finished run (and no checkpoint to continue from)" in proc.stderr, proc.tail()
    assert "--overwrite_output_dir" in proc.stderr and "--resume_from_checkpoint latest" not in proc.stderr


def test_overwrite_output_dir_starts_over(full, tmp_path):
    """--overwrite_output_dir deletes the old checkpoints and results and trains from step 0;
    with the default --checkpoints_total_limit (2) it keeps its newest two checkpoints (issue 42)."""
    _, data, out, _ = full
    copy = tmp_path / "over"
    shutil.copytree(out, copy)
    args = _args(data, copy, "--overwrite_output_dir", "--max_steps", "3")
    i = args.index("--checkpoints_total_limit")
    del args[i:i + 2]  # the default
    proc = _launch(args)
    assert proc.returncode == 0, proc.tail()
    assert sorted(os.listdir(copy / "checkpoints")) == ["step_2", "step_3"]  # step_1 pruned; the old 4-6 deleted
    assert "the newest 2 kept (--checkpoints_total_limit; 0 keeps all)" in proc.stdout, proc.stdout[-3000:]
    assert _results(copy)["steps"] == 3
    assert [r["step"] for r in read_metrics(os.path.join(copy, "metrics.jsonl")) if "train/loss" in r] == [1, 2, 3]


def _plain_python(args, tmp):
    """``python recipes/pretrain.py ...`` with no launcher variables at all."""
    env = {k: v for k, v in launch_env().items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, str(RECIPE), *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=900)  # bf16 on CPU: 300 s ran out beside 3 other test workers


def test_single_plain_process_runs_and_fl_on_one_process_names_the_fix(tmp_path):
    """One plain process (no torchrun, no RANK) trains with --algorithm fsdp; FL with two groups on
    one process fails at once with a message that suggests --num_groups 1 or --algorithm fsdp.
    (Its own corpus, not the ``full`` run's: no launch to wait for, so xdist runs it on any worker.)"""
    data = _corpus(tmp_path)
    common = ["--model", "tiny", "--micro_batch_size", "2", "--max_steps", "2", "--report_to", "none",
              "--save_final_model", "false", "--max_eval_blocks", "4", *data]  # bf16 matmuls are slow on CPU
    bad = _plain_python([*common, "--output_dir", str(tmp_path / "fl")], tmp_path)
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert "--num_groups 1 or --algorithm fsdp" in bad.stderr
    ok = _plain_python([*common, "--algorithm", "fsdp", "--output_dir", str(tmp_path / "one"), "--mixed_precision",
                        "bf16", "--reduce_dtype", "bf16"], tmp_path)
    assert ok.returncode == 0, ok.stderr[-3000:]
    results = _results(tmp_path / "one")
    assert results["world_size"] == 1 and results["steps"] == 2 and results["eval_loss"] > 0
    # --reduce_dtype bf16 reduces as plain Accelerate does; the loss stays fp32 (no output cast)
    assert results["precision_policy"] == {"param": "bf16", "reduce": "bf16", "output": None}
    assert "precision: param bf16, reduce bf16, output as computed (mixed_precision bf16)" in ok.stdout
