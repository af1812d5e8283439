"""scripts/compare.py on run folders written here (the recipe's all_results.json / metrics.jsonl format)."""

import json

import pytest

from scripts import compare


def _run(root, name, algorithm, tps, ppl, *, world=4, F=1, R=1, S=4, steps=40, tokens_per_step=4096, host=None,
         comm_bytes=None, **extra):
    d = root / name
    d.mkdir(parents=True)
    res = {"algorithm": algorithm, "world_size": world, "num_groups": F, "group_size": world // F, "replicas": R,
           "shards": S, "sync_every": 8 if algorithm.startswith("fl_") else None, "eval_perplexity": ppl,
           "train_tokens": steps * tokens_per_step, "steps": steps, "tokens_per_s": tps,
           "comm": {a: {"bytes": b} for a, b in (comm_bytes or {"dp_shard": 40 * 2**20}).items()}}
    if host is not None:
        res["host"] = {"background_cpu_share": host, "cpus": 2}
    res.update(extra)
    (d / "all_results.json").write_text(json.dumps(res))
    recs = [{"step": s, "tokens": s * tokens_per_step, "time_s": s * 1.0, "eval/perplexity": ppl * 40 / s}
            for s in (8, 16, 40)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_quickstart_pair_table_and_verdict(tmp_path, capsys):
    _run(tmp_path, "fl_fsdp-F2", "fl_fsdp", 2790.0, 3400.0, F=2, S=2, host=0.01,
         comm_bytes={"fl": 40 * 2**20, "dp_shard": 400 * 2**20})
    _run(tmp_path, "fsdp", "fsdp", 996.4, 3307.0, host=0.02, comm_bytes={"dp_shard": 800 * 2**20})
    assert compare.main([str(tmp_path), "--no-plot"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert "| world " in header and "| R " in header and "| tokens/step " in header
    assert "FL+FSDP ran at 2,790 tokens/s vs FSDP 996 (2.80x)" in out
    assert "Caveat: one run each, and repeats of one setup differ by up to about 5% in tokens/s." in out
    assert "3,400.00 vs 3,307.00 (FL+FSDP 2.8% higher)" in out
    assert "Per rank and step FL+FSDP sent 11.00 MiB, FSDP 20.00 MiB" in out
    assert "under 5% in every run" in out and "note:" not in out and "warning:" not in out
    assert (tmp_path / "comparison.md").read_text().startswith("| run ")


def test_one_machine_says_loopback_and_the_baseline_tokens_per_s_is_printable(tmp_path, capsys):
    """The quickstart's pair (nodes 1 in both all_results.json): the ratio comes with the
    loopback caveat; ``--tokens-per-s fsdp`` prints the baseline's tokens/s alone (what the
    quickstart passes to the FL+FSDP run), and fails with one line for a run that is not there."""
    from _launch import assert_one_line_error

    _run(tmp_path, "fl_fsdp-F2", "fl_fsdp", 1060.0, 3400.0, F=2, S=2, host=0.01, nodes=1)
    _run(tmp_path, "fsdp", "fsdp", 1000.0, 3307.0, host=0.02, nodes=1)
    assert compare.main([str(tmp_path), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "FL+FSDP ran at 1,060 tokens/s vs FSDP 1,000 (1.06x). On one machine every link is loopback: the ratio " \
           "shows the mechanics' cost, not the speedup across slow links between nodes" in out
    assert compare.main([str(tmp_path), "--tokens-per-s", "fsdp"]) == 0
    assert capsys.readouterr().out == "1000\n"
    assert_one_line_error(compare.main, [str(tmp_path), "--tokens-per-s", "hsdp"], capsys)


def test_background_load_and_mismatched_runs_are_flagged(tmp_path, capsys):
    _run(tmp_path, "a", "fl_fsdp", 2800.0, 3400.0, F=2, S=2, host=0.35)
    _run(tmp_path, "b", "fsdp", 1000.0, 3300.0, world=8, S=8, tokens_per_step=8192, host=0.0)
    assert compare.main([str(tmp_path), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "note: the runs differ in world size (a: 4, b: 8)" in out
    assert "note: the runs differ in tokens per step (a: 4,096, b: 8,192)" in out
    assert "warning: other processes kept 35% of the machine's CPUs busy during a" in out
    assert "35% (!)" in out
    assert "makes the throughput comparison unreliable" in out
    assert "after different token counts" in out


def test_old_results_without_host_field(tmp_path, capsys):
    _run(tmp_path, "fl_hsdp", "fl_hsdp", 2500.0, 3400.0, F=2, S=2)
    _run(tmp_path, "hsdp", "hsdp", 1600.0, 3307.0, R=2, S=2)
    assert compare.main([str(tmp_path), "--no-plot", "--baseline", "hsdp"]) == 0
    out = capsys.readouterr().out
    assert "FL+HSDP ran at 2,500 tokens/s vs HSDP 1,600 (1.56x)" in out
    assert "not recorded for fl_hsdp, hsdp" in out


def test_plot_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _run(tmp_path, "fl_fsdp", "fl_fsdp", 2800.0, 3400.0, F=2, S=2)
    _run(tmp_path, "fsdp", "fsdp", 1000.0, 3300.0)
    assert compare.main([str(tmp_path)]) == 0
    assert (tmp_path / "comparison.png").stat().st_size > 1000


def test_bad_json_and_bad_baseline(tmp_path, capsys):
    _run(tmp_path, "fsdp", "fsdp", 1000.0, 3300.0)
    assert compare.main([str(tmp_path), "--no-plot", "--baseline", "nope"]) == 2
    assert "matches no run" in capsys.readouterr().err
    (tmp_path / "fsdp" / "all_results.json").write_text("{not json")
    assert compare.main([str(tmp_path), "--no-plot"]) == 2
    assert "all_results.json: not valid JSON" in capsys.readouterr().err


def test_unequal_groups_run_is_tabled(tmp_path, capsys):
    """A run of unequal federation groups lists its replicas per group (a list in all_results.json)."""
    _run(tmp_path, "fl_hsdp-F2-G2_4", "fl_hsdp", 3000.0, 3300.0, world=6, F=2, R=[1, 2], S=2)
    _run(tmp_path, "hsdp", "hsdp", 2000.0, 3200.0, world=6, R=3, S=2)
    assert compare.main([str(tmp_path), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "| 1/2 " in out and "1.50x" in out


def test_what_ran_mfu_and_memory_are_shown_and_differences_noted(tmp_path, capsys):
    """The table shows each run's precision policy (param/reduce), activation checkpointing,
    compile, MFU and peak memory; runs that differ in them get a note."""
    bf16 = {"param": "bf16", "reduce": "fp32", "output": None}
    _run(tmp_path, "fl", "fl_fsdp", 2800.0, 3400.0, F=2, S=2, precision_policy=bf16, activation_checkpointing=True,
         compile=True, mfu=0.412, peak_accelerator_mb=40960.0, peak_host_mb=9000.0)
    _run(tmp_path, "base", "fsdp", 1000.0, 3300.0, precision_policy={"param": "fp32", "reduce": "fp32", "output": None},
         activation_checkpointing=False, compile=False, mfu=None, peak_accelerator_mb=None, peak_host_mb=1234.0)
    assert compare.main([str(tmp_path), "--no-plot"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    for column in ("| precision ", "| AC ", "| compile ", "| MFU ", "| peak MiB "):
        assert column in header, column
    row_fl = next(line for line in out.splitlines() if line.startswith("| fl "))
    row_base = next(line for line in out.splitlines() if line.startswith("| base "))
    assert "| bf16/fp32 " in row_fl and "| on " in row_fl and "| 41.2% " in row_fl and "| 40,960 " in row_fl
    assert "| fp32/fp32 " in row_base and "| off " in row_base and "| 1,234 host " in row_base
    assert "note: the runs differ in precision policy (base: fp32/fp32, fl: bf16/fp32)" in out
    assert "note: the runs differ in activation checkpointing (base: off, fl: on)" in out
    assert "note: the runs differ in compile (base: off, fl: on)" in out


def _setup(algorithm, *, F=2, S=2, run_name="r", lr=3e-4, **fl):
    """The ``fl``, ``group_sizes`` and ``args`` entries the recipe writes (real FLConfig and
    RecipeArguments), for :func:`_run`."""
    import dataclasses

    from fl_accel.config import FLConfig
    from recipes.args import RecipeArguments

    hsdp = {"hsdp_shard_size": S} if "hsdp" in algorithm else {}
    config = FLConfig(algorithm=algorithm, num_groups=F, **hsdp, **fl)
    args = dataclasses.asdict(RecipeArguments(run_name=run_name, output_dir=f"outputs/x/{run_name}",
                                              learning_rate=lr))
    return {"fl": config.to_dict(), "args": args}


def test_the_same_layout_and_exchange_gets_no_verdict(tmp_path, capsys):
    """Issue 42: FL+HSDP with one replica per group is FL+FSDP on the same groups, and HSDP
    with one replica is FSDP. Runs of one setup whose flags differ only in names get no
    verdict between them but a line saying they ran the same; the method verdict against the
    FSDP baseline stays."""
    _run(tmp_path, "fl_fsdp", "fl_fsdp", 2790.0, 3400.0, F=2, S=2, group_sizes=[2, 2],
         **_setup("fl_fsdp", run_name="fl_fsdp"))
    _run(tmp_path, "fl_hsdp", "fl_hsdp", 2755.0, 3400.0, F=2, R=1, S=2, group_sizes=[2, 2],
         **_setup("fl_hsdp", run_name="fl_hsdp"))
    _run(tmp_path, "fsdp", "fsdp", 996.0, 3307.0, S=4, group_sizes=[4], **_setup("fsdp", F=1, run_name="fsdp"))
    _run(tmp_path, "hsdp-r1", "hsdp", 990.0, 3307.0, R=1, S=4, group_sizes=[4],
         **_setup("hsdp", F=1, S=4, run_name="hsdp-r1"))
    assert compare.main([str(tmp_path), "--no-plot"]) == 0
    out = capsys.readouterr().out
    verdict = out.split("Verdict:\n")[1]
    assert ("- FL+FSDP and FL+HSDP ran the same layout and exchange (FL+FSDP, 2 groups of 2 ranks (FL+HSDP with one "
            "replica per group is FL+FSDP)): no verdict between them. Their flags differ only in names, folders and "
            "logging: the same run, so differences in their figures are run-to-run variation. (fl_fsdp: 2,790 "
            "tokens/s, eval perplexity 3,400.00, fl_hsdp: 2,755 tokens/s, eval perplexity 3,400.00)") in verdict, out
    assert "- FSDP and HSDP ran the same layout and exchange (FSDP over 4 ranks (HSDP with one replica is FSDP))" \
        in verdict, out
    assert "vs FL+FSDP" not in verdict and "HSDP ran at 990" not in verdict, out  # no verdict within a setup
    assert "FL+FSDP ran at 2,790 tokens/s vs FSDP 996 (2.80x)" in verdict, out  # the methods still compared
    assert "FL+HSDP ran at 2,755 tokens/s vs HSDP 990 (2.78x)" in verdict, out


def test_same_layout_with_other_settings_names_them_and_other_exchanges_get_a_verdict(tmp_path, capsys):
    """Two FL+FSDP runs of one layout and exchange that differ in the learning rate: no method
    verdict, the differing flag named. A different H is a different exchange: a verdict."""
    _run(tmp_path, "a", "fl_fsdp", 2790.0, 3400.0, F=2, S=2, group_sizes=[2, 2], **_setup("fl_fsdp", run_name="a"))
    _run(tmp_path, "b", "fl_fsdp", 2790.0, 3100.0, F=2, S=2, group_sizes=[2, 2],
         **_setup("fl_fsdp", run_name="b", lr=1e-3))
    _run(tmp_path, "c", "fl_fsdp", 2900.0, 3500.0, F=2, S=2, group_sizes=[2, 2],
         **_setup("fl_fsdp", run_name="c", sync_every=16))
    assert compare.main([str(tmp_path), "--no-plot", "--baseline", "c"]) == 0
    verdict = capsys.readouterr().out.split("Verdict:\n")[1]
    assert ("- FL+FSDP (a) and FL+FSDP (b) ran the same layout and exchange (FL+FSDP, 2 groups of 2 ranks): no verdict "
            "between them. They differ in learning_rate (0.0003 vs 0.001): a comparison of those settings, not of "
            "methods.") in verdict, verdict
    assert "FL+FSDP (a) ran at 2,790 tokens/s vs FL+FSDP (c) 2,900" in verdict, verdict
    assert "FL+FSDP (b) ran at 2,790 tokens/s vs FL+FSDP (c) 2,900" in verdict, verdict


def test_counters_of_one_process_only_get_a_note(tmp_path, capsys):
    """Issue 42: a run whose counters cover only its last process (``counters.since``, e.g. a
    torchft group restarted without a checkpoint) is noted; a resumed run's are whole-run."""
    _run(tmp_path, "g1", "fl_fsdp", 2790.0, 3400.0, F=2, S=2,
         counters={"since": "this process's start", "carried_over_from": None, "steps_counted": 30})
    _run(tmp_path, "g0", "fl_fsdp", 2790.0, 3400.0, F=2, S=2,
         counters={"since": "the run's start", "carried_over_from": "g0/checkpoints/step_8", "steps_counted": 40})
    assert compare.main([str(tmp_path), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert ("note: g1's tokens, time and bytes count since its last process started (30 of its 40 steps): an earlier "
            "session ended before its first checkpoint, so its figures per step are this session's.") in out, out
    assert "note: g0's" not in out
