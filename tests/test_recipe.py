"""The recipe end to end: 4 real gloo processes train a tiny Llama on the embedded corpus.

Each algorithm runs a few optimizer steps through ``torchrun recipes/pretrain.py``; the
tests read the files a user reads (all_results.json, metrics.jsonl, the W&B offline
run, checkpoints). The FL+FSDP run checkpoints mid-round (step 2 with H=3) and a
second launch resumes from it; its losses and final perplexity must equal the
uninterrupted run's.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from _launch import REPO_ROOT, run_torchrun

RECIPE = REPO_ROOT / "recipes" / "pretrain.py"

COMMON = ["--model", "tiny", "--seq_len", "64", "--micro_batch_size", "2", "--max_steps", "4",
          "--log_every", "1", "--eval_every", "3", "--max_eval_blocks", "32", "--checkpoint_every", "2",
          "--sync_every", "3", "--num_groups", "2", "--hsdp_shard_size", "2", "--experiment", "pytest"]


def launch(args: list[str]):
    """The recipe on 4 gloo processes; W&B offline, as a user gets it by default."""
    return run_torchrun(4, RECIPE, *args, timeout=600,
                        env={"WANDB_MODE": "offline", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"})


def read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One corpus/tokenizer cache for every launch of the session."""
    return str(tmp_path_factory.mktemp("fl_accel_cache"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """Lazily launched runs, one per algorithm, shared by the tests of this module."""
    done: dict[str, tuple] = {}

    def get(algorithm: str):
        if algorithm not in done:
            out = str(tmp_path_factory.mktemp(f"run_{algorithm}"))
            proc = launch([*COMMON, "--algorithm", algorithm, "--output_dir", out, "--cache_dir", data_cache])
            done[algorithm] = (out, proc)
        return done[algorithm]

    return get


@pytest.mark.parametrize("algorithm", ["fl_fsdp", "fsdp", "hsdp", "fl_hsdp"])
def test_recipe_trains_each_algorithm(runs, algorithm):
    """A few steps per algorithm: finite perplexity below the vocabulary, W&B offline run, traffic by axis."""
    out, proc = runs(algorithm)
    assert proc.returncode == 0, proc.tail()
    with open(os.path.join(out, "all_results.json"), encoding="utf-8") as fh:
        results = json.load(fh)
    ppl = results["eval_perplexity"]
    assert math.isfinite(ppl) and 1.0 < ppl < results["vocab_size"], results
    assert results["steps"] == 4 and results["algorithm"] == algorithm
    assert results["tokens_per_s"] > 0
    wandb_runs = [d for d in os.listdir(os.path.join(out, "wandb")) if d.startswith("offline-run-")]
    assert wandb_runs, os.listdir(os.path.join(out, "wandb"))
    assert os.path.isfile(os.path.join(out, "curves.png"))
    comm = results["comm"]
    federated = algorithm.startswith("fl_")
    assert (comm["fl"]["bytes"] > 0) == federated, comm
    # 4 steps, H=3: one sync at step 3 and the final one at step 4.
    assert comm["fl"]["calls"] == (2 if federated else 0), comm
    assert (comm["dp_replicate"]["bytes"] > 0) == (algorithm == "hsdp"), comm
    assert comm["dp_shard"]["bytes"] > 0
    evals = [r for r in read_metrics(out) if "eval/perplexity" in r]
    assert [r["step"] for r in evals] == [3, 4]
    assert "[fl_accel] micro-batch 2 blocks/rank" in proc.stdout


def test_recipe_resume_continues_from_mid_round_checkpoint(runs, tmp_path, data_cache):
    """Resume from step_2 (mid-round, H=3): steps 3-4 and the final perplexity match the uninterrupted run."""
    out, proc = runs("fl_fsdp")
    assert proc.returncode == 0, proc.stderr[-4000:]
    ckpt = os.path.join(out, "checkpoints", "step_2")
    assert os.path.isfile(os.path.join(ckpt, "fl_accel_checkpoint.json"))
    resumed_out = str(tmp_path / "resumed")
    proc2 = launch([*COMMON, "--algorithm", "fl_fsdp", "--output_dir", resumed_out, "--cache_dir", data_cache,
                    "--resume_from_checkpoint", ckpt])
    assert proc2.returncode == 0, proc2.tail()
    assert "resumed from" in proc2.stdout and "at step 2" in proc2.stdout
    full = {r["step"]: r for r in read_metrics(out) if "train/loss" in r}
    resumed = {r["step"]: r for r in read_metrics(resumed_out) if "train/loss" in r}
    assert sorted(resumed) == [3, 4], sorted(resumed)
    for step in (3, 4):
        assert abs(resumed[step]["train/loss"] - full[step]["train/loss"]) <= 1e-6, (step, resumed[step], full[step])
        assert resumed[step]["lr"] == pytest.approx(full[step]["lr"], rel=1e-12)
    with open(os.path.join(out, "all_results.json"), encoding="utf-8") as fh:
        a = json.load(fh)
    with open(os.path.join(resumed_out, "all_results.json"), encoding="utf-8") as fh:
        b = json.load(fh)
    assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-6, (a["eval_loss"], b["eval_loss"])


@pytest.mark.parametrize("algorithm", ["fl_fsdp", "fsdp", "hsdp", "fl_hsdp"])
def test_measured_bytes_match_cost_model(runs, algorithm):
    """comm_stats of the real 4-process run vs fl_accel.cost_model, within 5% on every axis.

    The train record of step 3 holds the bytes of 3 training steps and the sync at step
    3 (H=3), logged before the evaluation at step 3 adds forward all-gathers.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fl_accel import FLConfig
    from fl_accel.cost_model import estimate_from_config, units_from_module

    out, proc = runs(algorithm)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(open(os.path.join(out, "all_results.json"), encoding="utf-8").read())
    record = next(r for r in read_metrics(out) if r.get("step") == 3 and "train/loss" in r)
    from recipes.modeling import PRESETS

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**{**PRESETS["tiny"], "vocab_size": results["vocab_size"]}))
    cfg = FLConfig(algorithm=algorithm, num_groups=2, hsdp_shard_size=2, sync_every=3)
    est = estimate_from_config(cfg, 4, units_from_module(model), param_bytes=4, grad_bytes=4, total_steps=3)
    predicted = {axis: 3 * b for axis, b in est.by_axis(amortized=True).items()}
    for axis in ("fl", "dp_replicate", "dp_shard"):
        measured = record[f"comm/{axis}/bytes"]
        if predicted[axis] == 0:
            assert measured == 0, (axis, measured)
        else:
            assert abs(measured - predicted[axis]) <= 0.05 * predicted[axis], (axis, measured, predicted[axis])
