"""bench/: plan, layout figures, analysis and report on the committed results (no emulator, no training)."""

import json
import os
import shutil
import subprocess
import sys
import types

import pytest

from bench import analysis, plan as bp, run_bench as rb

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMITTED = os.path.join(REPO, "bench", "results", "2026-11-30-cpu2")


def _plan(*argv):
    return bp.make_plan(bp.build_parser().parse_args(list(argv)))


def _rows(plan, link=None, phase="main"):
    return {r.id: r for r in bp.runs_of(plan) if r.phase == phase and (link is None or r.link == link)}


# ---------------------------------------------------------------------- plan
def test_plan_validation():
    with pytest.raises(bp.BenchError, match="multiple of --sync-every"):
        _plan("--steps", "10", "--sync-every", "8")
    with pytest.raises(bp.BenchError, match="rates"):
        _plan("--rates", "fast")
    with pytest.raises(bp.BenchError, match="suite"):
        _plan("--suite", "everything")
    with pytest.raises(bp.BenchError, match="even"):
        _plan("--suite", "streaming", "--sync-every", "3", "--steps", "6")
    with pytest.raises(bp.BenchError, match="eval-blocks"):
        _plan("--suite", "hsdp_r2", "--eval-blocks", "16")


def test_full_plan_suites_links_and_shared_rows():
    plan = _plan()
    assert plan["suites"] == list(bp.SUITES) and plan["sync_every"] == 8 and plan["steps"] == 40
    main = [r for r in bp.runs_of(plan) if r.phase == "main"]
    assert list(dict.fromkeys(r.link for r in main)) == ["1gbit", "100mbit", "10mbit"]
    assert set(_rows(plan, "1gbit")) == {"fsdp", "fl_fsdp", "hsdp", "fl_hsdp", "fl_fsdp-limit"}
    at10 = _rows(plan, "10mbit")
    # the blocking FL+FSDP row and the limit serve both the baselines and the streaming suite: launched once
    assert sum(r.id == "fl_fsdp" for r in main if r.link == "10mbit") == 1
    assert {"fl_fsdp-p2-tau1", "fl_fsdp-p2-tau2-int8-ef", "hsdp-8p", "fl_hsdp-r2-8p", "fl_hsdp-r2-8p-limit"} <= set(at10)
    assert len({r.path for r in bp.runs_of(plan)}) == len(bp.runs_of(plan))
    # one calibration per distinct configuration, none for the limits
    calib = _rows(plan, phase="calibration")
    assert set(calib) == {"fsdp", "fl_fsdp", "hsdp", "fl_hsdp", "fl_fsdp-p2-tau1", "fl_fsdp-p2-tau2-int8-ef",
                          "hsdp-8p", "fl_hsdp-r2-8p"}
    assert all(r.link is None and r.eval_every == 0 for r in calib.values())


def test_rows_and_their_recipe_flags():
    plan = _plan("--suite", "streaming,hsdp_r2", "--rates", "10mbit")
    rows = _rows(plan, "10mbit")
    args = {k: bp.recipe_args(plan, r, "/o") for k, r in rows.items()}

    def flag(k, name):
        a = args[k]
        return a[a.index(name) + 1] if name in a else None

    assert flag("fl_fsdp", "--num_fragments") is None and flag("fl_fsdp", "--sync_every") == "8"
    assert (flag("fl_fsdp-p2-tau1", "--num_fragments"), flag("fl_fsdp-p2-tau1", "--sync_delay")) == ("2", "1")
    assert flag("fl_fsdp-p2-tau1", "--sync_dtype") is None and "--error_feedback" not in args["fl_fsdp-p2-tau1"]
    assert flag("fl_fsdp-p2-tau2-int8-ef", "--sync_dtype") == "int8" and "--error_feedback" in args["fl_fsdp-p2-tau2-int8-ef"]
    assert flag("fl_fsdp-limit", "--sync_every") == str(bp.LIMIT_SYNC_EVERY)
    r2 = rows["fl_hsdp-r2-8p"]
    assert (r2.world, r2.nproc_per_node, r2.replicas, flag("fl_hsdp-r2-8p", "--hsdp_shard_size")) == (8, 4, 2, "2")
    assert analysis.layout_of(r2).shape == (2, 2, 2) and analysis.layout_of(rows["hsdp-8p"]).shape == (1, 4, 2)
    assert r2.label == "FL+HSDP 2x2x2 (8 proc)" and r2.baseline == "hsdp-8p" and r2.limit == "fl_hsdp-r2-8p-limit"
    assert rows["fl_fsdp-p2-tau2-int8-ef"].label == "FL+FSDP P=2 tau=2 int8+EF"


def test_baseline_runs_differ_only_in_algorithm():
    plan = _plan("--smoke", "--suite", "baselines")
    rows = [r for r in _rows(plan, "100mbit").values() if r.sync_every != bp.LIMIT_SYNC_EVERY]
    cmds = [bp.recipe_args(plan, r, "/o") for r in rows]
    i = cmds[0].index("--algorithm") + 1
    for c in cmds:
        diff = {k for k, (x, y) in enumerate(zip(c, cmds[0])) if x != y}
        assert len(c) == len(cmds[0]) and diff <= {i, c.index("--run_name") + 1}, (c, cmds[0])


def test_sync_steps():
    plan = _plan("--suite", "streaming", "--steps", "16", "--rates", "100mbit")
    rows = _rows(plan, "100mbit")
    assert rows["fl_fsdp"].sync_steps() == {8, 16}
    assert rows["fl_fsdp-p2-tau1"].sync_steps() == {3, 4, 7, 8, 11, 12, 15, 16}  # launch at k - tau, apply at k
    assert rows["fl_fsdp-limit"].sync_steps() == set()


def test_link_figures_come_from_fllayout():
    plan = _plan("--rates", "100mbit")
    rows = _rows(plan, "100mbit")
    lf = {k: analysis.link_figures(r) for k, r in rows.items()}
    assert lf["fsdp"] == {"inter_axes": ["dp_shard"], "link_share": {"dp_shard": 1}}
    assert lf["fl_fsdp"] == {"inter_axes": ["fl"], "link_share": {"fl": 2}}
    assert lf["hsdp"] == {"inter_axes": ["dp_replicate"], "link_share": {"dp_replicate": 2}}
    assert lf["fl_hsdp-r2-8p"] == {"inter_axes": ["fl"], "link_share": {"fl": 4}}
    assert lf["hsdp-8p"] == {"inter_axes": ["dp_replicate"], "link_share": {"dp_replicate": 2}}


def test_without_root_fails_clearly(monkeypatch, capsys):
    monkeypatch.setattr(rb.netemu, "check_privileges", lambda: (False, "netemu needs root/CAP_NET_ADMIN"))
    assert rb.main(["--smoke"]) == 1
    err = capsys.readouterr().err
    assert "needs root" in err and "--dry-run" in err


def test_dry_run_prints_every_command(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.run_bench", "--dry-run", "--smoke", "--suite",
                           "streaming,overhead", "--work-root", str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "--num_fragments 2 --sync_delay 1 --sync_dtype int8 --error_feedback" in out
    assert "rate-100mbit/fl_fsdp-limit" in out and "overhead/rep1-fsdp-job1" in out
    assert "-m torch.distributed.run --nnodes 2" in out
    assert not (tmp_path / "smoke").exists()  # a dry run writes nothing


# ---------------------------------------------------------------------- analysis
def _fake_run(tmp_path, evals_at, steps, eval_bytes=100, step_bytes=10):
    d = tmp_path / "run"
    d.mkdir()
    recs, b, t = [], 0, 0.0
    for s in range(1, steps + 1):
        b += step_bytes
        t += 1.0 + (0.5 if s % 2 == 0 else 0)
        recs.append({"step": s, "tokens": s * 4096, "time_s": t, "train/loss": 1.0, "comm/dp_shard/bytes": b,
                     "comm/dp_shard/seconds": 0.0})
        if s in evals_at or s == steps:
            b += eval_bytes
            recs.append({"step": s, "tokens": s * 4096, "time_s": t, "eval/perplexity": 100.0 / s})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    (d / "all_results.json").write_text(json.dumps({"comm": {"dp_shard": {"bytes": b, "seconds": 0.0}},
                                                    "steps": steps}))
    return analysis.read_run(str(d))


def test_split_comm_separates_evaluations(tmp_path):
    c = analysis.split_comm(_fake_run(tmp_path, evals_at={2}, steps=4))
    assert c["n_evals"] == 2 and c["eval"]["dp_shard"]["bytes"] == 100 and c["train"]["dp_shard"]["bytes"] == 40


def test_step_times_and_ppl_interpolation(tmp_path):
    run = _fake_run(tmp_path, evals_at={2}, steps=4)
    assert analysis.step_times(run) == {1: 1.0, 2: 1.5, 3: 1.0, 4: 1.5}
    assert analysis.steady_step_times(run, {2, 4}, skip=2) == [1.0]
    assert analysis.ppl_at_time(run, 50.0) == 2.5  # ppl 50 at t=2.5, 25 at t=5.0
    assert analysis.ppl_at_time(run, (50 * 25) ** 0.5) == pytest.approx(3.75)  # halfway in log space
    assert analysis.ppl_at_time(run, 1.0) is None


def _committed_copy(tmp_path):
    assert os.path.isdir(COMMITTED), "the committed bench/results/2026-11-30-cpu2 is missing"
    dst = tmp_path / "results" / "2026-11-30-cpu2"
    shutil.copytree(COMMITTED, dst)
    return dst


def test_analysis_ratios_and_wire_bytes(tmp_path):
    """The committed 100 Mbit/s runs, plus a limit row made from the FL+FSDP run at 1.25x its
    throughput and launch records with veth counters."""
    raw = _committed_copy(tmp_path) / "raw"
    plan = _plan("--suite", "baselines", "--rates", "100mbit", "--work-root", str(tmp_path / "w"))
    limit = raw / "rate-100mbit" / "fl_fsdp-limit"
    shutil.copytree(raw / "rate-100mbit" / "fl_fsdp", limit)
    res = json.loads((limit / "all_results.json").read_text())
    res["tokens_per_s"] *= 1.25
    (limit / "all_results.json").write_text(json.dumps(res))
    launches = {"rate-100mbit/fl_fsdp": {"wall_s": 100.0, "host": {"background_cpu_share": 0.2},
                                         "wire": {"0": {"tx_bytes": 60 * 2**20, "rx_bytes": 1},
                                                  "1": {"tx_bytes": 62 * 2**20, "rx_bytes": 1}}}}
    out = analysis.analyze(plan, str(raw), launches)
    rows = out["main"]["100mbit"]["rows"]
    fl, fsdp = rows["fl_fsdp"], rows["fsdp"]
    assert fl["speedup"] == pytest.approx(2477.0 / 973.0, rel=1e-3)
    assert fl["of_limit"] == pytest.approx(0.8) and rows["fl_fsdp-limit"]["of_limit"] is None
    assert fsdp["of_limit"] == pytest.approx(973.0 / (1.25 * 2477.0), rel=1e-3)
    assert fl["wire_tx_bytes_per_node"] == 61 * 2**20 and fl["background_cpu_share"] == 0.2
    assert fl["inter_axes"] == ["fl"] and fl["link_share"] == {"fl": 2}
    assert fl["recipe_bytes_per_node"] == 2 * 28847360  # rank 0's fl bytes x 2 ranks per NIC
    assert fl["comm"]["train"]["fl"]["bytes"] == 28847360 and fl["eval_loss"] == pytest.approx(8.1318, abs=1e-4)
    assert rows["fl_fsdp-limit"]["time_to_target"] is None and fl["time_to_target"] is not None
    assert set(out["main"]["100mbit"]["ppl_target"]) == {4}


def test_predict_wires_the_cost_model_api(monkeypatch):
    """Control flow of predict() against a stand-in module with the specified API."""
    seen = {}

    class Est:
        spans_nodes = {"fl": True, "dp_replicate": False, "dp_shard": False}

        def by_axis(self, amortized=True):
            return {"fl": 100.0, "dp_replicate": 0.0, "dp_shard": 1000.0}

        def sync_by_axis(self):
            return {"fl": 800.0, "dp_replicate": 0.0, "dp_shard": 0.0}

    def estimate(layout, units, **kw):
        seen["layout"], seen["estimate"] = layout, kw
        return Est()

    def predict_step_time(est, **kw):
        seen["time"] = kw
        return types.SimpleNamespace(step_s=2.0, comm_s=0.5, comm_s_by_axis={"fl": 0.5}, exposed_sync_s=0.1,
                                     tokens_per_s=None)

    fake = types.SimpleNamespace(estimate=estimate, predict_step_time=predict_step_time,
                                 units_from_module=lambda model: ["unit"])
    import fl_accel

    monkeypatch.setattr(fl_accel, "cost_model", fake, raising=False)
    monkeypatch.setitem(sys.modules, "fl_accel.cost_model", fake)
    plan = _plan("--suite", "streaming", "--rates", "10mbit")
    spec = _rows(plan, "10mbit")["fl_fsdp-p2-tau2-int8-ef"]
    p = analysis.predict(plan, spec, {"vocab_size": 8192, "num_groups": 2, "replicas": 1, "shards": 2}, 1.5)
    assert "error" not in p, p
    assert seen["layout"].shape == (2, 1, 2)
    assert seen["estimate"] == {"sync_every": 8, "num_fragments": 2, "sync_dtype": "int8", "param_bytes": 4,
                                "grad_bytes": 4, "micro_batches": 1, "ranks_per_node": 2, "total_steps": 40}
    assert seen["time"] == {"compute_s": 1.5, "intra_node_bw": 1e18, "inter_node_bw": 10e6 / 8,
                            "ranks_per_nic": None, "sync_delay": 2}
    assert p["tokens_per_s"] == 4096 / 2.0 and p["bytes_run"]["fl"] == 4000.0
    bad = analysis.predict(plan, spec, {"vocab_size": 8192, "num_groups": 1, "replicas": 1, "shards": 4}, 1.5)
    assert "differs from the planned layout" in bad["error"]


def test_predict_with_the_real_cost_model(tmp_path):
    """With the real fl_accel.cost_model, the predicted fl bytes equal the recipe's count."""
    raw = _committed_copy(tmp_path) / "raw"
    plan = _plan("--suite", "baselines", "--rates", "100mbit")
    spec = _rows(plan, "100mbit")["fl_fsdp"]
    run = analysis.read_run(str(raw / spec.path))
    p = analysis.predict(plan, spec, run, 1.5)
    assert "error" not in p, p
    assert p["bytes_run"]["fl"] == analysis.split_comm(run)["train"]["fl"]["bytes"]
    assert p["step_s"] > 1.5 and p["tokens_per_s"] < 4096 / 1.5


# ---------------------------------------------------------------------- report
def test_report_only_on_committed_results(tmp_path):
    dst = _committed_copy(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "bench.run_bench", "--report-only", "--name", "2026-11-30-cpu2",
                           "--results-root", str(dst.parent), "--work-root", str(tmp_path / "work")],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env=dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (dst / "table.md").read_text()
    assert "| 100mbit | FL+FSDP" in table and "2.55x vs fsdp" in table
    assert "Checks against" not in table and "**+0.8%**" in table
    assert "| rate-100mbit/fsdp " in table  # the launches of the first version, from bench.json
    for png in ("ppl_vs_tokens.png", "time_to_ppl.png", "throughput.png"):
        assert (dst / png).stat().st_size > 1000
    assert (dst / "raw" / "rate-100mbit" / "fl_fsdp" / "all_results.json").is_file()
    assert "report rebuilt with" in (dst / "command.txt").read_text()


def test_report_only_without_results_is_one_error(tmp_path, capsys):
    assert rb.main(["--report-only", "--name", "nothing-here", "--results-root", str(tmp_path),
                    "--work-root", str(tmp_path)]) == 2
    assert "run the benchmark first" in capsys.readouterr().err


# ---------------------------------------------------------------------- launching (root: network namespaces)
_FAKE_RECIPE = r'''
import json, os, sys, torch, torch.distributed as dist
args = sys.argv[1:]
out = args[args.index("--output_dir") + 1]
if os.environ.get("FAKE_FAIL"):
    print("fake recipe failing on purpose", flush=True)
    sys.exit(3)
dist.init_process_group("gloo")
t = torch.ones(1 << 18)  # 1 MiB: crosses the emulated link
dist.all_reduce(t)
if dist.get_rank() == 0:
    os.makedirs(out, exist_ok=True)
    json.dump({"world_size": dist.get_world_size(), "ok": bool((t == dist.get_world_size()).all())},
              open(os.path.join(out, "all_results.json"), "w"))
dist.destroy_process_group()
'''


def _root_ok():
    from scripts import netemu

    return netemu.check_privileges()[0]


@pytest.mark.skipif(not _root_ok(), reason="needs root/CAP_NET_ADMIN to create network namespaces")
def test_runner_meters_a_launch_over_the_emulator(tmp_path, monkeypatch):
    """bench.launch.Runner with a stand-in recipe (one gloo all-reduce over 2 nodes x 2):
    the launch record has its wall time, HostLoad figures and the veth byte counters."""
    from bench import launch as bl
    from scripts import netemu

    script = tmp_path / "fake_recipe.py"
    script.write_text(_FAKE_RECIPE)
    monkeypatch.setattr(bp, "RECIPE", str(script))
    plan = _plan("--smoke", "--suite", "baselines", "--work-root", str(tmp_path / "work"), "--run-timeout", "120")
    spec = _rows(plan, "100mbit")["fl_fsdp"]
    runner = bl.Runner(plan)
    with netemu.Emulator(2, "100mbit") as emu:
        runner.torchrun(emu, spec)
        monkeypatch.setenv("FAKE_FAIL", "1")
        with pytest.raises(bp.BenchError, match="exit code 1") as err:
            runner.torchrun(emu, dataclasses_replace(spec, id="failing"))
    log = str(err.value).split("full log: ")[1].split("\n")[0]
    assert log.endswith("launch.log") and "fake recipe failing on purpose" in open(log).read()
    res = json.loads((tmp_path / "work" / "smoke" / spec.path / "all_results.json").read_text())
    assert res == {"world_size": 4, "ok": True}
    rec = runner.launches[spec.path]
    assert rec["wall_s"] > 0 and rec["host"]["own_cpu_s"] > 1.0  # 4 Python processes importing torch
    assert 0.0 <= rec["host"]["background_cpu_share"] <= 1.0
    assert set(rec["wire"]) == {"0", "1"} and all(v["tx_bytes"] > (1 << 20) // 2 for v in rec["wire"].values())


def dataclasses_replace(spec, **kw):
    import dataclasses

    return dataclasses.replace(spec, **kw)
