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
from fl_accel.mesh import is_federated
from recipes.run_folder import read_metrics

RECIPE = REPO_ROOT / "recipes" / "pretrain.py"

COMMON = ["--model", "tiny", "--seq_len", "64", "--micro_batch_size", "2", "--max_steps", "4",
          "--log_every", "1", "--eval_every", "3", "--max_eval_blocks", "32", "--checkpoint_every", "2",
          "--sync_every", "3", "--num_groups", "2", "--hsdp_shard_size", "2", "--experiment", "pytest",
          "--peak_tflops", "0.5"]
PEAK_TFLOPS = 0.5
BASELINE_TOKENS_PER_S = 250.0
AXES_KEYS = {"step", "tokens", "time_s", "wall_s", "unix_time", "group_step"}
PREFIXES = ("train/", "eval/", "perf/", "comm/", "fl/")


def launch(args: list[str], launcher: str | None = None):
    """The recipe on 4 gloo processes; W&B offline, as a user gets it by default."""
    return run_torchrun(4, RECIPE, *args, timeout=600, env={"WANDB_MODE": "offline"}, launcher=launcher)


def on(run: str):
    """The xdist group of the tests that read the ``runs(run)`` launch (tests/conftest.py would
    put every test of the shared ``runs`` fixture into one group: one worker launching all
    five runs and the resumes one after the other). Each run's tests share a worker, the runs
    go to different workers; a worker launches (lazily, once) only the runs its tests read."""
    return pytest.mark.xdist_group(f"test_recipe-{run}")


def per_algorithm(algorithms):
    """``algorithm`` parameters, each in its run's xdist group (:func:`on`)."""
    return pytest.mark.parametrize("algorithm", [pytest.param(a, marks=on("fsdp" if a == "fl_fsdp_f1" else a))
                                                 for a in algorithms])


@pytest.fixture(scope="session")
def data_cache(default_corpus_cache):
    """One corpus/tokenizer cache for every launch of the run, filled before them (tests/conftest.py)."""
    return default_corpus_cache


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """Lazily launched runs, one per algorithm, shared by the tests of this module."""
    done: dict[str, tuple] = {}

    def get(algorithm: str):
        """``algorithm``, or "fl_fsdp_f1": FL+FSDP with a single federation group."""
        if algorithm not in done:
            out = str(tmp_path_factory.mktemp(f"run_{algorithm}"))
            extra = ["--algorithm", "fl_fsdp", "--num_groups", "1"] if algorithm == "fl_fsdp_f1" else \
                ["--algorithm", algorithm]
            if algorithm in ("fl_fsdp", "fsdp"):  # W&B and TensorBoard (the other runs: W&B, the default)
                extra += ["--report_to", "all"]
            if algorithm == "fl_fsdp":
                extra += ["--baseline_tokens_per_s", str(BASELINE_TOKENS_PER_S)]
            proc = launch([*COMMON, *extra, "--output_dir", out, "--cache_dir", data_cache])
            done[algorithm] = (out, proc)
        return done[algorithm]

    return get


@per_algorithm(["fl_fsdp", "fsdp", "hsdp", "fl_hsdp"])
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
    federated = is_federated(algorithm)
    assert (comm["fl"]["bytes"] > 0) == federated, comm
    # 4 steps, H=3: one sync at step 3 and the final one at step 4.
    assert comm["fl"]["calls"] == (2 if federated else 0), comm
    assert (comm["dp_replicate"]["bytes"] > 0) == (algorithm == "hsdp"), comm
    assert comm["dp_shard"]["bytes"] > 0
    evals = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "eval/perplexity" in r]
    assert [r["step"] for r in evals] == [3, 4]
    assert {r["eval/scored"] for r in evals} == {"synchronized" if federated else "single group"}
    # wall-clock so far: everything (start-up included) counts, so it is ahead of the training seconds
    assert all(r["wall_s"] > r["time_s"] > 0 for r in evals) and evals[0]["wall_s"] < evals[1]["wall_s"]
    assert "[fl_accel] micro-batch 2 blocks/rank" in proc.stdout
    assert "[fl_accel] step 3: eval perplexity " in proc.stdout
    # traffic covers every rank: the busiest rank, the sum over ranks (equal layouts: all ranks alike)
    for axis in ("fl", "dp_replicate", "dp_shard"):
        assert results["comm_sum"][axis]["bytes"] == 4 * comm[axis]["bytes"], axis
    assert len(results["comm_by_group"]) == (2 if federated else 1)


@on("fl_fsdp")
def test_results_record_what_ran_time_memory_and_mfu(runs):
    """all_results.json says which precision policy, activation checkpointing, compile and
    fl_accel ran; its time figures add up; memory and MFU are there (MFU against
    --peak_tflops, consistent with tokens/s per process, here and in every logged step);
    model_flops_per_token is torchtitan's formula for this untied Llama within 1%."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from recipes.modeling import PRESETS

    out, proc = runs("fl_fsdp")
    assert proc.returncode == 0, proc.tail()
    r = json.loads(open(os.path.join(out, "all_results.json"), encoding="utf-8").read())
    assert r["precision_policy"] == {"param": "fp32", "reduce": "fp32", "output": None}
    assert r["mixed_precision"] == "no" and r["activation_checkpointing"] is False and r["compile"] is False
    assert r["fl_accel"]["path"] == str(REPO_ROOT / "fl_accel") and r["fl_accel"]["version"]
    parts = ("startup_seconds", "train_seconds", "eval_and_checkpoint_seconds")
    assert r["wall_seconds"] == pytest.approx(sum(r[p] for p in parts), rel=1e-9)
    assert r["session"]["wall_seconds"] == pytest.approx(r["wall_seconds"], rel=1e-9)  # one session
    assert abs(r["host"]["wall_s"] - r["session"]["wall_seconds"]) < 2.0  # the same interval
    assert r["session"]["launch_seconds"] > 0
    assert r["peak_host_mb"] >= r["peak_host_mb_after_prepare"] > 0 and r["peak_accelerator_mb"] is None
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**{**PRESETS["tiny"], "vocab_size": r["vocab_size"]}))
    n, (V, H, L, h, T) = sum(p.numel() for p in model.parameters()), (r["vocab_size"], 128, 4, 4, 64)
    assert r["model_flops_per_token"] == pytest.approx(6 * (n - V * H) + 12 * L * h * (H // h) * T, rel=1e-2)
    assert r["mfu"] == pytest.approx(r["model_flops_per_token"] * r["tokens_per_s_per_process"] / (PEAK_TFLOPS * 1e12),
                                     rel=1e-9)
    assert r["tokens_per_s_per_process"] == pytest.approx(r["tokens_per_s"] / 4)
    for rec in (x for x in read_metrics(os.path.join(out, "metrics.jsonl")) if "train/loss" in x):
        assert rec["perf/mfu"] == pytest.approx(r["model_flops_per_token"] * rec["perf/tokens_per_s_per_process"]
                                                / (PEAK_TFLOPS * 1e12), rel=1e-9)
        assert rec["perf/peak_host_mb"] > 0 and rec["perf/peak_accelerator_mb"] is None
        assert "fl/sync_time_share" in rec


@on("fl_fsdp")
def test_dashboard_keys_follow_one_scheme_in_metrics_wandb_and_tensorboard(runs):
    """Every record key is an axis (step, tokens, ...) or under train/, eval/, perf/, comm/, fl/;
    constants (FLOPs per token) are in the run config only; comm/<axis>/mib_per_step is the
    busiest rank's bytes since the previous record per step; perf/speedup_vs_baseline is the
    window's tokens/s over --baseline_tokens_per_s; TensorBoard (--report_to all) got the same
    scalars, and the run config with the effective num_groups."""
    import glob

    import yaml
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, proc = runs("fl_fsdp")
    assert proc.returncode == 0, proc.tail()
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    stray = {k for r in records for k in r if k not in AXES_KEYS and not k.startswith(PREFIXES)}
    assert not stray, stray
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and all("model_flops_per_token" not in r for r in train)
    for before, now in zip(train, train[1:]):
        for axis in ("fl", "dp_shard"):
            delta = (now[f"comm/{axis}/bytes"] - before[f"comm/{axis}/bytes"]) / (now["step"] - before["step"])
            assert now[f"comm/{axis}/mib_per_step"] == pytest.approx(delta / 2**20, rel=1e-12, abs=1e-12)
        assert now["perf/speedup_vs_baseline"] == pytest.approx(now["perf/tokens_per_s"] / BASELINE_TOKENS_PER_S)
    assert train[2]["comm/fl/mib_per_step"] > 0 == train[1]["comm/fl/mib_per_step"]  # the sync at step 3
    results = json.loads(open(os.path.join(out, "all_results.json"), encoding="utf-8").read())
    assert results["speedup_vs_baseline"] == pytest.approx(results["tokens_per_s"] / BASELINE_TOKENS_PER_S)
    [events] = glob.glob(os.path.join(out, "tensorboard", "fl_accel", "events.out.tfevents.*"))
    tags = set(EventAccumulator(events).Reload().Tags()["scalars"])
    assert {"train/loss", "eval/perplexity", "perf/tokens_per_s", "comm/fl/mib_per_step", "fl/sync_time_share",
            "perf/speedup_vs_baseline"} <= tags, sorted(tags)
    assert all(t in AXES_KEYS or t.startswith(PREFIXES) for t in tags), sorted(tags)
    [hparams] = glob.glob(os.path.join(out, "tensorboard", "fl_accel", "*", "hparams.yml"))
    config = yaml.safe_load(open(hparams, encoding="utf-8"))
    assert config["fl/num_groups"] == 2 and config["fl/sync_every"] == 3 and config["model_flops_per_token"] > 0
    assert "[fl_accel] TensorBoard: tensorboard --logdir" in proc.stdout


@on("fsdp")
def test_the_baseline_records_its_effective_layout_only(runs):
    """The FSDP baseline's run config says fl/num_groups 1 (what ran), not the FLConfig's 2,
    and leaves out the settings FSDP ignores (sync_every): filtering runs on fl/num_groups=2
    picks up the federated runs only."""
    import glob

    import yaml

    out, proc = runs("fsdp")
    assert proc.returncode == 0, proc.tail()
    [hparams] = glob.glob(os.path.join(out, "tensorboard", "fl_accel", "*", "hparams.yml"))
    config = yaml.safe_load(open(hparams, encoding="utf-8"))
    assert config["fl/num_groups"] == 1 and config["num_groups"] == 1 and config["fl/algorithm"] == "fsdp"
    assert "fl/sync_every" not in config and "fl/outer_optimizer" not in config


@on("fl_fsdp")
def test_banner_explains_itself(runs):
    """The banner names the fl_accel it imported, explains the letters once, shows the group
    weights and marks every setting the algorithm ignores (also at its default value); fl_accel's
    own warnings are one line each, not `file:line: UserWarning` plus a source line."""
    out, proc = runs("fl_fsdp")
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("[fl_accel] fl_accel ") and lines[0].endswith(f" from {REPO_ROOT / 'fl_accel'}")
    assert "[fl_accel] fl_fsdp F=2 G=2 R=1 S=2 H=3, outer=avg, group weights 1/2, 1/2 (tokens)" in lines
    assert any(line.startswith("[fl_accel]   (F federation groups of G ranks each") for line in lines)
    assert "hsdp_shard_size=2 (flag; ignored by fl_fsdp)" in proc.stdout
    assert "UserWarning" not in proc.stderr


@on("fsdp")
def test_banner_marks_what_fsdp_ignores(runs):
    """FSDP's banner marks the federation flags it ignores; the warning about sync_every is one
    line of fl_accel's, not `file:line: UserWarning` plus a source line."""
    _, base = runs("fsdp")
    assert "num_groups=2 (flag; ignored by fsdp)" in base.stdout and "sync_every=3 (flag; ignored by fsdp)" in base.stdout
    assert "[fl_accel] sync_every=3 is ignored by algorithm 'fsdp' (one group spans the world)\n" in base.stderr
    assert "UserWarning" not in base.stderr


def _masked(line: str) -> str:
    """A banner/log line's kind: its text up to the first digit, '=', ':' or '(' (values differ by run)."""
    import re

    return re.split(r"[0-9=:(]", line, maxsplit=1)[0].strip()


@on("fl_fsdp")
def test_docs_what_a_run_prints_matches_a_run(runs):
    """docs/recipe.md's "What a run prints" block (the quickstart's FL+FSDP run) has the same
    lines, in the same order, as a run prints: compared by each line's kind (numbers, paths and
    sources differ between the quickstart's 48 steps and this 4-step run; the tracker lines, W&B's
    and TensorBoard's, depend on --report_to)."""
    out, proc = runs("fl_fsdp")
    page = (REPO_ROOT / "docs" / "recipe.md").read_text()
    block = page.split("## What a run prints", 1)[1].split("```text", 1)[1].split("```", 1)[0]

    def kinds(text):
        seen = []
        for line in text.splitlines():
            if line.startswith("[fl_accel]") and "W&B" not in line and "TensorBoard:" not in line:
                kind = _masked(line[len("[fl_accel] "):])
                if not seen or seen[-1] != kind:
                    seen.append(kind)
        return seen

    assert proc.returncode == 0, proc.tail()
    assert len(kinds(block)) >= 12 and kinds(block) == kinds(proc.stdout), (kinds(block), kinds(proc.stdout))


@pytest.fixture(scope="module")
def resumed_ac(runs, tmp_path_factory, data_cache):
    """The FL+FSDP run resumed from its step_2 checkpoint (mid-round, H=3, saved without
    activation checkpointing) with ``--activation_checkpointing full``: one launch read by the
    resume test and the activation-checkpointing test."""
    out, proc = runs("fl_fsdp")
    assert proc.returncode == 0, proc.tail()
    ckpt = os.path.join(out, "checkpoints", "step_2")
    assert os.path.isfile(os.path.join(ckpt, "fl_accel_checkpoint.json"))
    resumed = str(tmp_path_factory.mktemp("resumed_ac"))
    proc2 = launch([*COMMON, "--algorithm", "fl_fsdp", "--output_dir", resumed, "--cache_dir", data_cache,
                    "--resume_from_checkpoint", ckpt, "--activation_checkpointing", "full",
                    "--save_final_model", "false"])  # torchrun + resume: tests/recipe/test_failures.py
    assert proc2.returncode == 0, proc2.tail()
    return resumed, proc2


@on("fl_fsdp")
def test_activation_checkpointing_resumes_across_the_switch(runs, resumed_ac):
    """A checkpoint saved without activation checkpointing (step_2, mid-round) resumes with
    --activation_checkpointing full: the recomputed activations give the uninterrupted run's
    losses within 1e-5, and the results record that checkpointing ran. (The checkpoint keys
    carry no ``_checkpoint_wrapped_module.``: torch's checkpoint_wrapper strips it from state
    dicts and adds it back on load.)"""
    out, _ = runs("fl_fsdp")
    resumed, proc2 = resumed_ac
    assert "activation checkpointing full (--activation_checkpointing)" in proc2.stdout
    full = {r["step"]: r["train/loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "train/loss" in r}
    again = {r["step"]: r["train/loss"] for r in read_metrics(os.path.join(resumed, "metrics.jsonl"))
             if "train/loss" in r}
    assert sorted(again) == [3, 4] and all(abs(again[k] - full[k]) <= 1e-5 for k in again), (again, full)
    results = json.loads(open(os.path.join(resumed, "all_results.json"), encoding="utf-8").read())
    assert results["activation_checkpointing"] is True


@pytest.mark.parametrize("family", ["qwen2"])  # Mistral: tests/dist/test_accelerator_api.py (features worker)
def test_other_model_families_train_sync_checkpoint_and_export(family, tmp_path, data_cache):
    """A tiny Qwen2 config (any causal LM whose class declares _no_split_modules; Mistral trains,
    syncs and checkpoints in tests/dist/test_accelerator_api.py):
    FL+FSDP on 4 ranks with a sync, a checkpoint and final_model/, which transformers loads
    back as the same family."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    cls = {"qwen2": Qwen2Config, "mistral": MistralConfig}[family]
    cls(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256).save_pretrained(tmp_path / "model")
    out = tmp_path / "run"
    bf16 = family == "qwen2"  # one family in bf16: parameters bf16, gradients reduced in fp32 (the default)
    proc = launch(["--model", str(tmp_path / "model"), "--seq_len", "64", "--micro_batch_size", "2", "--max_steps",
                   "2", "--sync_every", "1", "--num_groups", "2", "--checkpoint_every", "2", "--log_every", "1",
                   "--max_eval_blocks", "16", "--report_to", "none", "--output_dir", str(out), "--cache_dir",
                   data_cache, "--mixed_precision", "bf16" if bf16 else "no"])
    assert proc.returncode == 0, proc.tail()
    assert f"({family}): " in proc.stdout
    results = json.loads((out / "all_results.json").read_text())
    assert results["model_type"] == family and results["comm"]["fl"]["calls"] == 2
    policy = {"param": "bf16", "reduce": "fp32", "output": None} if bf16 else \
        {"param": "fp32", "reduce": "fp32", "output": None}
    assert results["precision_policy"] == policy and results["mixed_precision"] == ("bf16" if bf16 else "no")
    if bf16:
        assert "precision: param bf16, reduce fp32, output as computed (mixed_precision bf16)" in proc.stdout
    assert (out / "checkpoints" / "step_2" / "fl_accel_checkpoint.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out / "final_model")
    assert model.config.model_type == family and model.config.vocab_size == 8192
    import torch

    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.arange(64).view(1, 64), use_cache=False).logits).all()


@on("fl_fsdp")
def test_recipe_resume_continues_from_mid_round_checkpoint(runs, resumed_ac):
    """Resume from step_2 (mid-round, H=3; the resumed launch recomputes activations,
    :func:`resumed_ac`, which changes no value): steps 3-4 (loss, LR) and the final
    perplexity match the uninterrupted run."""
    out, _ = runs("fl_fsdp")
    resumed_out, proc2 = resumed_ac
    assert "resumed from" in proc2.stdout and "at step 2" in proc2.stdout
    full = {r["step"]: r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "train/loss" in r}
    resumed = {r["step"]: r for r in read_metrics(os.path.join(resumed_out, "metrics.jsonl")) if "train/loss" in r}
    assert sorted(resumed) == [3, 4], sorted(resumed)
    for step in (3, 4):
        assert abs(resumed[step]["train/loss"] - full[step]["train/loss"]) <= 1e-6, (step, resumed[step], full[step])
        assert resumed[step]["train/lr"] == pytest.approx(full[step]["train/lr"], rel=1e-12)
    with open(os.path.join(out, "all_results.json"), encoding="utf-8") as fh:
        a = json.load(fh)
    with open(os.path.join(resumed_out, "all_results.json"), encoding="utf-8") as fh:
        b = json.load(fh)
    print(f"\n|resumed - full| eval loss {abs(a['eval_loss'] - b['eval_loss']):.3g}, train losses "
          f"{[abs(resumed[k]['train/loss'] - full[k]['train/loss']) for k in (3, 4)]}")
    assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-6, (a["eval_loss"], b["eval_loss"])


@per_algorithm(["fl_fsdp", "fsdp", "hsdp", "fl_hsdp"])
def test_measured_bytes_match_cost_model(runs, algorithm):
    """comm_stats of the real 4-process run vs fl_accel.planning.cost, within 5% on every axis.

    The train record of step 3 holds the bytes of 3 training steps and the sync at step
    3 (H=3), logged before the evaluation at step 3 adds forward all-gathers.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fl_accel import FLConfig
    from unit.test_cost_model import estimate_from_config
    from fl_accel.planning.units import units_from_module

    out, proc = runs(algorithm)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(open(os.path.join(out, "all_results.json"), encoding="utf-8").read())
    record = next(r for r in read_metrics(os.path.join(out, "metrics.jsonl"))
                  if r.get("step") == 3 and "train/loss" in r)
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


GOLDEN = REPO_ROOT / "tests" / "golden" / "fl_fsdp_tiny_losses.json"


def _train_losses(out: str) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "train/loss" in r}


@on("fl_fsdp")
def test_golden_losses_of_fl_fsdp(runs):
    """Regression guard (torchtitan style): the train losses of every step and the final eval
    loss of the tiny FL+FSDP run (4 ranks, F=2, H=3, seed 42, the embedded corpus) equal the
    committed values within 1e-5. A change that moves the numerics on purpose regenerates
    the file: ``FL_ACCEL_TEST_REGEN_GOLDEN=1 python -m pytest tests/recipe/test_recipe.py -k golden``."""
    out, proc = runs("fl_fsdp")
    assert proc.returncode == 0, proc.tail()
    got = {"train_loss": {str(k): v for k, v in sorted(_train_losses(out).items())},
           "eval_loss": json.loads(open(os.path.join(out, "all_results.json"), encoding="utf-8").read())["eval_loss"],
           "command": " ".join([*COMMON, "--algorithm", "fl_fsdp"])}
    if os.environ.get("FL_ACCEL_TEST_REGEN_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert want["command"] == got["command"], "the golden run's flags changed: regenerate the file"
    assert list(got["train_loss"]) == list(want["train_loss"]) == ["1", "2", "3", "4"]
    for step, loss in want["train_loss"].items():
        assert abs(got["train_loss"][step] - loss) <= 1e-5, (step, got["train_loss"][step], loss)
    assert abs(got["eval_loss"] - want["eval_loss"]) <= 1e-5, (got["eval_loss"], want["eval_loss"])


@on("fsdp")
def test_one_federation_group_is_fsdp_bitwise(runs):
    """FL+FSDP with F=1 is FSDP: the same train loss at every step and the same eval loss,
    bitwise (one group's mean of itself changes nothing; H=3 syncs at steps 3 and 4)."""
    (f1, p1), (fsdp, p0) = runs("fl_fsdp_f1"), runs("fsdp")
    assert p1.returncode == 0 and p0.returncode == 0, p1.tail() + p0.tail()
    a, b = _train_losses(f1), _train_losses(fsdp)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4] and a == b, (a, b)
    ra, rb = (json.loads(open(os.path.join(d, "all_results.json"), encoding="utf-8").read()) for d in (f1, fsdp))
    assert ra["eval_loss"] == rb["eval_loss"] and ra["num_groups"] == 1
