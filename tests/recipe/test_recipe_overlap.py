"""The recipe with the overlap mode and the synchronous warm-up (issue 46 items 2 and 3): 4 gloo
processes, FL+FSDP 2 groups x 2 ranks, ``--sync_warmup_steps 2 --sync_every 3 --sync_delay 3
--delayed_local_steps keep``: the first 2 steps train as one data-parallel job, the event at
step 5 (= K + H) applies nothing and launches round 1's exchange, which runs during round 2 and
is applied at step 8 with the local steps kept, then round 2's launches; the run ends with the
final sync. The numerics are tests/dist/test_overlap_sync.py's; this checks the recipe's flags,
banner, checkpoints and end.
"""

from __future__ import annotations

import json
import os

from _launch import REPO_ROOT, run_torchrun
from recipes.run_folder import read_metrics

RECIPE = REPO_ROOT / "recipes" / "pretrain.py"
ARGS = ["--model", "tiny", "--seq_len", "64", "--micro_batch_size", "2", "--max_steps", "8", "--log_every", "1",
        "--eval_every", "3", "--max_eval_blocks", "16", "--checkpoint_every", "6", "--num_groups", "2",
        "--algorithm", "fl_fsdp", "--sync_every", "3", "--sync_delay", "3", "--delayed_local_steps", "keep",
        "--sync_warmup_steps", "2", "--report_to", "none", "--save_final_model", "false"]


def test_overlap_and_warmup_run_ends_with_identical_groups(tmp_path, default_corpus_cache):
    """The run trains 8 steps and ends synchronized: the last checkpoint (after the final sync)
    stores one model for every group (scope "shared": the groups are identical), with nothing
    in flight; the checkpoint of step 6 holds round 1's exchange in flight (launched at step 5)
    and each group's own model; the banner names the warm-up and the kept local steps; the
    final evaluation scores the synchronized model; the mid-run ones each group's own."""
    out = tmp_path / "run"
    proc = run_torchrun(4, RECIPE, *ARGS, "--output_dir", str(out), "--cache_dir", default_corpus_cache,
                        timeout=600)
    assert proc.returncode == 0, proc.tail()
    text = proc.stdout + proc.stderr
    assert "synchronous warm-up of 2 steps" in text and "(delayed local steps kept)" in text
    assert "final synchronization: the federation groups synchronized at step 8" in text
    results = json.loads((out / "all_results.json").read_text())
    assert results["fl"]["delayed_local_steps"] == "keep" and results["fl"]["sync_warmup_steps"] == 2
    assert results["eval_scored"] == "synchronized" and results["steps"] == 8
    mid = json.loads((out / "checkpoints" / "step_6" / "fl_accel_checkpoint.json").read_text())
    assert mid["sync"]["inflight_fragment"] == 0 and mid["scopes"]["model"] == "group"
    assert mid["sync"]["global_step"] == 6 and mid["sync"]["num_syncs"] == 1 and mid["delayed_local_steps"] == "keep"
    end = json.loads((out / "checkpoints" / "step_8" / "fl_accel_checkpoint.json").read_text())
    assert end["sync"]["in_sync"] is True and end["sync"]["inflight_fragment"] is None
    assert end["scopes"]["model"] == "shared" and end["sync"]["num_syncs"] == 3  # events at 5, 8; the final sync
    evals = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "eval/loss" in r]
    assert [r["step"] for r in evals] == [3, 6, 8]
    assert [r["eval/scored"] for r in evals] == ["own group per rank"] * 2 + ["synchronized"]
