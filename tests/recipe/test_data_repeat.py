"""A run whose --max_steps outlasts its training data: it still trains every step (the
map-style loader starts a new, reshuffled epoch; the stream goes on from the start of the
shard it read to its end), and it says so, with how many epochs that takes (issue 31).

Two ranks of tiny FSDP on a 21-block corpus of 64-token blocks: 10 micro-batches per rank
per epoch, so 24 steps are 2.4 epochs; streamed, each rank's shard holds 26 short documents,
a few blocks, so 24 steps read it to its end more than once. Nothing stops early: the
recipe has no path that ends before --max_steps when the data run out (recipes/inputs.py
``batches``: an endless loop over epochs; ``PackedStream``: an endless stream)."""

from __future__ import annotations

import json
import os

from _launch import small_corpus, REPO_ROOT, run_torchrun
from recipes.run_folder import read_metrics

RECIPE = REPO_ROOT / "recipes" / "pretrain.py"
STEPS = 24


_corpus = small_corpus


def _run(tmp, *extra):
    out = tmp / ("stream" if "--streaming" in extra else "map")
    proc = run_torchrun(2, RECIPE, "--algorithm", "fsdp", "--model", "tiny", "--micro_batch_size", "1",
                        "--max_steps", str(STEPS), "--log_every", "4", "--max_eval_blocks", "4", "--report_to", "none",
                        "--save_final_model", "false", "--output_dir", str(out), *_corpus(tmp), *extra, timeout=420)
    assert proc.returncode == 0, proc.tail()
    with open(out / "all_results.json", encoding="utf-8") as fh:
        results = json.load(fh)
    steps = [r["step"] for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "train/loss" in r]
    return proc, results, steps


def test_map_style_data_repeat_to_max_steps_and_the_banner_says_how_many_epochs(tmp_path):
    proc, results, steps = _run(tmp_path)
    assert "(10 micro-batches per rank per epoch, 10 steps/epoch), 24 steps" in proc.stdout, proc.stdout[-3000:]
    assert results["steps"] == STEPS and steps[-1] == STEPS and results["train_tokens"] == STEPS * 2 * 64
    assert ("[fl_accel] note: --max_steps 24 is 2.40 epochs of the training data (10 steps/epoch): the data "
            "repeat, 3 epochs are needed (--num_epochs 1 applies only without --max_steps)") in proc.stdout
    assert results["data"] == {"source": "map-style", "steps_per_epoch": 10, "epochs": 2.4, "stream_passes": None,
                               "repeated": True}


def test_streamed_data_wrap_to_max_steps_and_the_run_says_so(tmp_path):
    proc, results, steps = _run(tmp_path, "--streaming")
    assert results["steps"] == STEPS and steps[-1] == STEPS and results["train_tokens"] == STEPS * 2 * 64
    data = results["data"]
    assert data["source"] == "stream" and data["repeated"] is True and data["stream_passes"] >= 1, data
    times = "once" if data["stream_passes"] == 1 else f"{data['stream_passes']} times"
    assert (f"[fl_accel] note: the training stream reached the end of a rank's shard {times} and went on from its "
            f"start (the data repeat): --max_steps 24 needs more than") in proc.stdout, proc.stdout[-3000:]
