"""bench/gpu_check.py's result writer, fed fabricated all_results.json / metrics.jsonl files,
and the recipe flags of its runs (no GPU, no process). The refusal of bench/gpu_check.sh on a
machine without a GPU: tests/tools/test_gpu_check.py."""

import json

import pytest

from bench import gpu_check as gc


def _fake_run(path, peak_mb, tokens_per_s, mfu=None, metrics=True):
    path.mkdir(parents=True)
    res = {"steps": 15, "tokens_per_s": tokens_per_s / 2, "eval_loss": 7.5, "model_flops_per_token": 8.2e9,
           "peak_accelerator_mb": peak_mb}
    if mfu is not None:
        res["mfu"] = mfu / 2
    (path / "all_results.json").write_text(json.dumps(res))
    if metrics:
        recs = [{"step": 5, "tokens_per_s": 1.0, "train/loss": 9.0},
                {"step": 10, "eval/loss": 8.0},
                {"step": 15, "tokens_per_s": tokens_per_s, "train/loss": 7.9, **({"mfu": mfu} if mfu else {})}]
        (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def test_writer_records_throughput_memory_and_the_models_prediction(tmp_path):
    pred = gc.predict("llama3.2-1b", "none", 2048, 2)
    assert pred["foreach"] >= pred["fused"] > 0  # foreach adds an fp32 copy of every shard at the step
    assert gc.predict("llama3.2-1b", "full", 2048, 2)["fused"] < pred["fused"]
    _fake_run(tmp_path / "a", peak_mb=pred["fused"] * 1.1, tokens_per_s=40000.0, mfu=0.35)
    _fake_run(tmp_path / "b", peak_mb=None, tokens_per_s=30000.0, metrics=False)
    rows = [gc.collect_run(str(tmp_path / "a"), "none", False, pred),
            gc.collect_run(str(tmp_path / "b"), "full", True, None)]
    rows[1]["status"] = "failed (exit 1): out of memory"
    assert rows[0]["tokens_per_s"] == 40000.0 and rows[0]["tokens_per_s_run"] == 20000.0  # last window, not the run
    assert rows[0]["mfu"] == 0.35 and rows[0]["train_loss"] == 7.9
    assert rows[0]["prediction_error"]["fused"] == pytest.approx(1 / 1.1 - 1)
    assert rows[1]["tokens_per_s"] == 15000.0 and "prediction_error" not in rows[1]  # no metrics: the run's figure
    machine = {"device": "NVIDIA H100 80GB HBM3", "model": "llama3.2-1b", "steps": 15, "seq_len": 2048,
               "micro_batch": 2}
    table = gc.write_results(str(tmp_path / "out"), rows, {"rc": 0, "summary": "3 passed in 60s"}, machine)
    saved = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert saved["runs"] == json.loads(json.dumps(rows)) and saved["machine"]["device"] == machine["device"]
    assert (tmp_path / "out" / "table.md").read_text() == table
    assert "NVIDIA H100 80GB HBM3" in table and "3 passed in 60s" in table
    assert "| none | off | 40,000 | 35.0% |" in table and f"{-1 / 11:+.1%}" in table
    assert "| full | on | 15,000 | - | - |" in table and "out of memory" in table
    with pytest.raises(FileNotFoundError):
        gc.collect_run(str(tmp_path / "missing"), "none", False, None)


def test_runs_use_the_recipe_flags():
    argv = gc.recipe_argv("llama3.2-1b", "full", True, "/tmp/o", "/tmp/c", 15, 2048, 2)
    assert argv[argv.index("--activation_checkpointing") + 1] == "full" and "--compile" in argv
    assert argv[argv.index("--mixed_precision") + 1] == "bf16" and argv[argv.index("--algorithm") + 1] == "fsdp"
    assert "--compile" not in gc.recipe_argv("llama3.2-1b", "none", False, "/tmp/o", "/tmp/c", 15, 2048, 2)
    assert sorted(gc.RUNS) == sorted({(ac, c) for ac in ("none", "full") for c in (False, True)})

