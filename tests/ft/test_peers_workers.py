"""The peers suite's workers end to end on loopback (no emulator, no root): torchft's Streaming
DiLoCo (a Lighthouse, one launch per replica group, a Manager per rank) trains what fl_accel's
recipe trains with the same flags (2 groups of 1 rank, H=4, 2 fragments, delay 1, outer Nesterov):
their eval losses agree before the recipe's final full sync; Accelerate's LocalSGD runs and
writes its records. The emulated links, the bytes and the report are bench/peers.py's smoke run
(``sudo python -m bench.peers --smoke``), which needs root."""

import json

import pytest

from tests._launch import REPO_ROOT, launch_env, run_torchrun, start_forked

pytest.importorskip("torchft", reason="torchft is not installed (pip install torchft==0.2.0): the torchft peer needs it")

from scripts import ft_launch  # noqa: E402
from scripts.launch import terminate  # noqa: E402

WORKERS = REPO_ROOT / "bench" / "peers_workers"
COMMON = ["--seed", "42", "--seq_len", "64", "--micro_batch_size", "2", "--max_steps", "8", "--sync_every", "4",
          "--eval_every", "4", "--max_eval_blocks", "8", "--log_every", "4", "--timeout_s", "120"]


def _jsonl(path):
    return [json.loads(line) for line in open(path) if line.strip()]


def test_torchft_streaming_diloco_equals_the_recipe_and_localsgd_runs(tmp_path, default_corpus_cache):
    from bench.peers_report import curve_of

    cache = ["--cache_dir", default_corpus_cache]
    lighthouse, addr = ft_launch.start_lighthouse(min_replicas=2, heartbeat_timeout_ms=60000)
    try:
        env = {**{k: v for k, v in launch_env().items() if k.startswith("HF_")}, "TORCHFT_LIGHTHOUSE": addr}
        groups = [start_forked(1, WORKERS / "torchft_diloco.py", *COMMON, *cache, "--output_dir",
                               str(tmp_path / "ft" / f"group{g}"), "--replica_group", str(g), "--num_replica_groups",
                               "2", "--hostname", "127.0.0.1", "--num_fragments", "2", "--sync_delay", "1",
                               env=launch_env(env), log_dir=tmp_path / f"log{g}") for g in range(2)]
        codes = [g.wait(300) for g in groups]
    finally:
        for g in locals().get("groups", []):
            g.kill()
        terminate(lighthouse)
    assert codes == [0, 0], [(tmp_path / f"log{g}" / "0.err").read_text()[-3000:] for g in range(2)]
    results = [json.load(open(tmp_path / "ft" / f"group{g}" / "all_results.json")) for g in range(2)]
    assert [r["commits"] for r in results] == [4, 4] == [r["expected_commits"] for r in results]
    assert results[0]["first_quorum_participants"] == 2 and results[0]["algorithm"] == "streaming_diloco"
    ft = curve_of("torchft", str(tmp_path / "ft"))
    assert [e["step"] for e in ft] == [4, 8] and all(e["tokens"] == e["step"] * 2 * 2 * 64 for e in ft)

    fl = run_torchrun(2, REPO_ROOT / "recipes" / "pretrain.py", "--model", "tiny", "--seq_len", "64",
                      "--micro_batch_size", "2", "--max_steps", "8", "--mixed_precision", "no", "--seed", "42",
                      "--algorithm", "fl_fsdp", "--num_groups", "2", "--sync_every", "4", "--num_fragments", "2",
                      "--sync_delay", "1", "--outer_optimizer", "nesterov", "--outer_lr", "0.7", "--outer_momentum",
                      "0.9", "--init_device", "cpu", "--eval_every", "4", "--max_eval_blocks", "8", "--log_every", "4",
                      *cache, "--output_dir", str(tmp_path / "fl"), "--report_to", "none", "--save_final_model",
                      "false", timeout=300)
    assert fl.returncode == 0, fl.tail()
    recipe = curve_of("fl_accel", str(tmp_path / "fl"))
    assert [e["step"] for e in recipe] == [4, 8]
    # the same model, data, optimizer, schedule and fragments: equal before the recipe's final full sync
    assert ft[0]["loss"] == pytest.approx(recipe[0]["loss"], abs=1e-5)
    assert ft[1]["loss"] != pytest.approx(recipe[1]["loss"], abs=1e-5)  # torchft ends on its last fragment sync

    ls = run_torchrun(2, WORKERS / "accelerate_localsgd.py", *COMMON, "--outer_optimizer", "avg", *cache,
                      "--output_dir", str(tmp_path / "ls"), timeout=300)
    assert ls.returncode == 0, ls.tail()
    done = json.load(open(tmp_path / "ls" / "all_results.json"))
    assert (done["distributed_type"], done["syncs"], done["train_tokens"]) == ("DistributedType.MULTI_CPU", 3, 8 * 256)
    evals = [r for r in _jsonl(tmp_path / "ls" / "metrics.jsonl") if "eval/loss" in r]
    assert [r["step"] for r in evals] == [4, 8] and all(r["eval/scored"] == "synchronized" for r in evals)
