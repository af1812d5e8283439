"""bench/: plan, layout figures, analysis and report on small fixtures (no emulator, no training).

The fixtures (tests/fixtures/results/, written by tests/fixtures/make_fixtures.py) are results
folders in the compact form: ``baselines-100mbit`` (FSDP, FL+FSDP and the no-sync limit at
100 Mbit/s, calibration, one overhead repetition: real runs trimmed to 16 steps) and
``convergence-grid`` (a synthetic convergence suite of 128 steps, one row unfinished)."""

import json
import re
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from bench import analysis, compact, plan as bp, report as rp, run_bench as rb

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(REPO, "tests", "fixtures", "results")
BASELINES, GRID = "baselines-100mbit", "convergence-grid"
FL_SYNC_BYTES = 5769472
"""Bytes one rank of FL+FSDP F=2 x G=2 sends on "fl" per fp32 sync of the tiny Llama (ring all-reduce
of its half of the 2,884,736 parameters: 2 (F-1)/F x 4 bytes x 1,442,368)."""


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
    assert plan["suites"] == list(bp.EMULATED_SUITES) and plan["sync_every"] == 8 and plan["steps"] == 40
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
                          "fl_fsdp-p2-tau2-sparse-ef", "hsdp-8p", "fl_hsdp-r2-8p"}
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
    assert "--num_fragments 2 --sync_delay 1 --sync_dtype int8 --sync_collectives all_to_all --error_feedback" in out
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


def _fixture_copy(tmp_path, name=BASELINES):
    dst = tmp_path / "results" / name
    shutil.copytree(os.path.join(FIXTURES, name), dst)
    return dst


def _saved(name=BASELINES):
    with open(os.path.join(FIXTURES, name, "bench.json"), encoding="utf-8") as fh:
        return json.load(fh)


def test_analysis_ratios_and_wire_bytes():
    """The fixture's 100 Mbit/s runs (compact form) with launch records carrying veth counters."""
    runs = compact.CompactRuns.load(os.path.join(FIXTURES, BASELINES))
    plan = _saved()["plan"]
    tps = {k: runs.get(f"rate-100mbit/{k}")["tokens_per_s"] for k in ("fsdp", "fl_fsdp", "fl_fsdp-limit")}
    launches = {"rate-100mbit/fl_fsdp": {"wall_s": 100.0, "host": {"background_cpu_share": 0.2},
                                         "wire": {"0": {"tx_bytes": 60 * 2**20, "rx_bytes": 1},
                                                  "1": {"tx_bytes": 62 * 2**20, "rx_bytes": 1}}}}
    out = analysis.analyze(plan, runs, launches)
    rows = out["main"]["100mbit"]["rows"]
    fl, fsdp = rows["fl_fsdp"], rows["fsdp"]
    assert fl["speedup"] == pytest.approx(tps["fl_fsdp"] / tps["fsdp"]) and fl["speedup"] > 4  # FSDP waits on the link
    assert fl["of_limit"] == pytest.approx(tps["fl_fsdp"] / tps["fl_fsdp-limit"]) and 0.5 < fl["of_limit"] < 1
    assert rows["fl_fsdp-limit"]["of_limit"] is None
    assert fsdp["of_limit"] == pytest.approx(tps["fsdp"] / tps["fl_fsdp-limit"])
    assert fl["wire_tx_bytes_per_node"] == 61 * 2**20 and fl["background_cpu_share"] == 0.2
    assert fl["inter_axes"] == ["fl"] and fl["link_share"] == {"fl": 2}
    assert fl["comm"]["train"]["fl"]["bytes"] == 2 * FL_SYNC_BYTES  # 16 steps, H=8: two syncs
    assert fl["recipe_bytes_per_node"] == 2 * 2 * FL_SYNC_BYTES  # x 2 ranks per NIC
    assert fl["eval_loss"] == runs.get("rate-100mbit/fl_fsdp")["eval_loss"]
    assert rows["fl_fsdp-limit"]["time_to_target"] is None and fl["time_to_target"] is not None
    assert set(out["main"]["100mbit"]["ppl_target"]) == {4}
    assert set(out["calibration"]) == {"fsdp", "fl_fsdp"} and len(out["overhead"]["reps"]) == 1


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

    fake = types.SimpleNamespace(estimate=estimate, predict_step_time=predict_step_time)
    import fl_accel.planning

    monkeypatch.setattr(fl_accel.planning, "cost", fake, raising=False)
    monkeypatch.setitem(sys.modules, "fl_accel.planning.cost", fake)
    monkeypatch.setitem(sys.modules, "fl_accel.planning.units", types.SimpleNamespace(units_from_module=lambda m: ["unit"]))
    monkeypatch.setattr(analysis, "_UNITS", {})  # the stand-in units must not stay cached for later tests
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


def test_predict_with_the_real_cost_model():
    """With the real fl_accel.planning.cost, the predicted fl bytes equal the recipe's count."""
    plan = _saved()["plan"]
    spec = _rows(plan, "100mbit")["fl_fsdp"]
    run = compact.CompactRuns.load(os.path.join(FIXTURES, BASELINES)).get(spec.path)
    p = analysis.predict(plan, spec, run, 1.5)
    assert "error" not in p, p
    assert p["bytes_run"]["fl"] == analysis.split_comm(run)["train"]["fl"]["bytes"] == 2 * FL_SYNC_BYTES
    assert p["step_s"] > 1.5 and p["tokens_per_s"] < 4096 / 1.5


# ---------------------------------------------------------------------- report
def test_report_only_rebuilds_from_the_compact_files(tmp_path, capsys):
    """``run_bench --report-only`` of a results folder without its work folder: the report from
    bench.json and curves.csv alone, which it writes back unchanged (in this process; the
    ``python -m bench.run_bench`` entry point is exercised by the dry-run test)."""
    dst = _fixture_copy(tmp_path)
    curves, runs = (dst / "curves.csv").read_text(), _saved()["runs"]
    rc = rb.main(["--report-only", "--name", BASELINES, "--results-root", str(dst.parent),
                  "--work-root", str(tmp_path / "work")])
    assert rc == 0, capsys.readouterr().err[-3000:]
    table = (dst / "table.md").read_text()
    speedup = runs["rate-100mbit/fl_fsdp"]["tokens_per_s"] / runs["rate-100mbit/fsdp"]["tokens_per_s"]
    assert "| 100mbit | FL+FSDP " in table and f"{speedup:.2f}x vs fsdp" in table
    assert "| rep1 " in table and "all (pooled steps)" in table  # the overhead table
    assert "| rate-100mbit/fl_fsdp " in table  # the launches, from bench.json
    assert "`curves.csv`" in table and "raw/" not in table
    assert (dst / "throughput.png").stat().st_size > 1000
    assert sorted(os.listdir(dst)) == ["bench.json", "command.txt", "curves.csv", "machine.json", "table.md",
                                       "throughput.png"]
    assert (dst / "curves.csv").read_text() == curves  # read back and written again bit for bit
    saved = json.loads((dst / "bench.json").read_text())
    assert saved["runs"] == runs and "evals" not in saved["results"]["main"]["100mbit"]["rows"]["fl_fsdp"]
    assert "report rebuilt with" in (dst / "command.txt").read_text()


def test_a_folder_of_the_old_layout_is_rewritten_compact(tmp_path):
    """A results folder written before curves.csv (bench.json without runs, each run's
    all_results.json and metrics.jsonl under raw/) is read from raw/ and rewritten in the
    compact form: no raw/, the same curves.csv and whole-run figures as the fixture."""
    src = compact.CompactRuns.load(os.path.join(FIXTURES, BASELINES))
    saved = _saved()
    runs = saved.pop("runs")
    old = tmp_path / "results" / "old"
    for path in runs:
        run = src.get(path)
        d = old / "raw" / path
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run.pop("records")))
        run.pop("path")
        (d / "all_results.json").write_text(json.dumps(run))
    (old / "bench.json").write_text(json.dumps(saved))
    assert rb.main(["--report-only", "--name", "old", "--results-root", str(old.parent),
                    "--work-root", str(tmp_path / "work")]) == 0
    assert not (old / "raw").exists()
    assert (old / "curves.csv").read_text() == open(os.path.join(FIXTURES, BASELINES, "curves.csv")).read()
    assert json.loads((old / "bench.json").read_text())["runs"] == runs


def test_curves_csv_round_trip(tmp_path):
    """curves.csv keeps the curve metrics of every record, the traffic counters of the last
    training record only, and reads back bit for bit; a step logged twice stays two records."""
    recs = [{"step": 1, "tokens": 10, "time_s": 0.1 + 0.2, "train/loss": 9.5, "lr": 1e-4, "comm/fl/bytes": 5},
            {"step": 2, "tokens": 20, "time_s": 0.6, "train/loss": 9.25, "comm/fl/bytes": 10, "comm/fl/seconds": 0.5},
            {"step": 2, "tokens": 20, "time_s": 0.6, "eval/loss": 9.0, "eval/perplexity": 8103.08},
            {"step": 2, "tokens": 20, "time_s": 0.7, "eval/loss": 8.75, "eval/perplexity": 6310.69}]
    rows = compact.curve_rows("convergence", "fsdp", recs)
    assert {r[5] for r in rows if r[2] == 1} == {"train/loss"}  # no lr, no counters before the last record
    path = compact.write_curves(str(tmp_path / "curves.csv"), rows)
    back = compact.read_curves(path)["fsdp"]
    assert back[0] == {"step": 1, "tokens": 10, "time_s": 0.1 + 0.2, "train/loss": 9.5}
    assert back[1] == {"step": 2, "tokens": 20, "time_s": 0.6, "train/loss": 9.25, "comm/fl/bytes": 10,
                       "comm/fl/seconds": 0.5}
    assert [r["eval/loss"] for r in back[2:]] == [9.0, 8.75] and back[3]["time_s"] == 0.7
    assert open(path).readline().strip() == "suite,run,step,tokens,time_s,metric,value"


def test_report_only_without_results_is_one_error(tmp_path, capsys):
    assert rb.main(["--report-only", "--name", "nothing-here", "--results-root", str(tmp_path),
                    "--work-root", str(tmp_path)]) == 2
    assert "run the benchmark first" in capsys.readouterr().err


# ---------------------------------------------------------------------- launching (root: network namespaces)
_FAKE_RECIPE = r'''
import json, os, sys
args = sys.argv[1:]
out = args[args.index("--output_dir") + 1]
if os.environ.get("FAKE_FAIL"):  # before importing torch: the failing launch costs no imports
    print("fake recipe failing on purpose", flush=True)
    sys.exit(3)
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.full((1 << 18,), float(rank + 1))  # 1 MiB: crosses the emulated link
dist.all_reduce(t)
ok = bool((t == world * (world + 1) / 2).all())
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
    json.dump({"rank": rank, "world": world, "local_rank": int(os.environ["LOCAL_RANK"]),
               "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "ok": ok}, fh)
dist.barrier()
if rank == 0:
    json.dump({"world_size": world, "ok": ok}, open(os.path.join(out, "all_results.json"), "w"))
dist.destroy_process_group()
sys.exit(0 if ok else 3)
'''


def _root_ok():
    from scripts import netemu

    return netemu.check_privileges()[0]


@pytest.mark.skipif(not _root_ok(), reason="needs root/CAP_NET_ADMIN to create network namespaces")
def test_runner_meters_a_launch_over_the_emulator(tmp_path, monkeypatch):
    """bench.launch.Runner with a stand-in recipe (one gloo all-reduce over 2 nodes x 2):
    the launch record has its wall time, HostLoad figures and the veth byte counters.

    It is also the test of gloo across the emulator (scripts/netemu.py ``run_torchrun``, which
    the Runner calls; one launch of 4 torch processes serves both): the all-reduce is right on
    every rank, ranks 0-1 talk through node 0's interface and ranks 2-3 through node 1's
    (``GLOO_SOCKET_IFNAME``), the 1 MiB crossed each node's shaped link both ways, and nothing
    of the emulator is left afterwards."""
    from bench import launch as bl
    from scripts import netemu

    from test_netemu import _gone

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
    _gone(emu)
    log = str(err.value).split("full log: ")[1].split("\n")[0]
    assert log.endswith("launch.log") and "fake recipe failing on purpose" in open(log).read()
    out = tmp_path / "work" / "smoke" / spec.path
    res = json.loads((out / "all_results.json").read_text())
    assert res == {"world_size": 4, "ok": True}
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["ok"] and r["world"] == 4 for r in ranks), ranks
    assert {r["ifname"] for r in ranks[:2]} == {emu.ifname(0)} and {r["ifname"] for r in ranks[2:]} == {emu.ifname(1)}
    rec = runner.launches[spec.path]
    assert rec["wall_s"] > 0 and rec["host"]["own_cpu_s"] > 1.0  # 4 Python processes importing torch
    assert 0.0 <= rec["host"]["background_cpu_share"] <= 1.0
    # the all-reduce of 1 MiB crossed each node's shaped NIC (ring over 4 ranks, 2 hops per node)
    assert set(rec["wire"]) == {"0", "1"}, rec["wire"]
    assert all(v["tx_bytes"] > (1 << 20) // 2 and v["rx_bytes"] > (1 << 20) // 2 for v in rec["wire"].values()), \
        rec["wire"]


def dataclasses_replace(spec, **kw):
    import dataclasses

    return dataclasses.replace(spec, **kw)


# ---------------------------------------------------------------------- quality suites (no training)
FEDERATION_FLAGS = {"--algorithm", "--num_groups", "--sync_every", "--hsdp_shard_size", "--num_fragments",
                    "--sync_delay", "--sync_dtype", "--sync_collectives", "--outer_optimizer", "--outer_lr", "--outer_momentum"}


A2A = ("--sync_collectives", "all_to_all")  # what every int8 row measured before "all_gather" existed ran


def _common_part(args):
    """The command line without the federation flags, the seed and the per-row names."""
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a in FEDERATION_FLAGS | {"--seed", "--run_name", "--output_dir"}:
            skip = True
            continue
        if a == "--error_feedback":
            continue
        out.append(a)
    return out


def _federation_part(args):
    out = []
    for i, a in enumerate(args):
        if a in FEDERATION_FLAGS:
            out += [a, args[i + 1]]
        elif a == "--error_feedback":
            out.append(a)
    return out


def _flag(args, name):
    return args[args.index(name) + 1] if name in args else None


SEED_ROWS = ("fsdp-seed43", "fl_fsdp-h8-seed43", "fl_fsdp-h8-nesterov-seed43", "fsdp-lr1e-3-seed43",
             "fl_fsdp-h8-lr1e-3-seed43", "fl_fsdp-h8-p2-tau2-int8-ef-lr1e-3-seed43",
             "fl_fsdp-h16-p2-tau2-int8-ef-lr1e-3-seed43", *(f"{r}-seed43" for r in (
                 "fl_fsdp-h16-lr1e-3", "fl_fsdp-h16-int8-ef-lr1e-3", "fl_fsdp-h16-p2-lr1e-3", "fl_fsdp-h16-tau2-lr1e-3",
                 "fl_fsdp-h16-tau2-a0.5-lr1e-3", "fl_fsdp-h16-p2-tau2-int8-ef-a0.5-lr1e-3", "fsdp-lr2e-3",
                 "fl_fsdp-h8-lr2e-3", "fsdp-lr4e-3", "fl_fsdp-h8-lr4e-3", "fl_fsdp-h8-lr8e-3")),
             *(f"{r}-seed43" for r in ("fl_fsdp-h16-p2-tau16-keep-int8-ef-lr1e-3", "fl_fsdp-h16-tau16-keep-lr1e-3",
                                       "fl_fsdp-h8-warm32-lr1e-3", "fl_fsdp-h16-p2-tau2-keep-int8-ef-lr1e-3",
                                       "fl_fsdp-h16-p2-tau4-keep-int8-ef-lr1e-3", "fl_fsdp-h16-nesterov-olr0.6-lr1e-3",
                                       "fl_fsdp-h32-p2-tau2-keep-int8-ef-lr1e-3", "fl_fsdp-h16-p2-tau2-keep-int8-gather-ef-lr1e-3")),
             "fsdp-lr1e-3-seed44", "fl_fsdp-h8-lr1e-3-seed44",
             "fl_fsdp-h16-p2-tau2-int8-ef-lr1e-3-seed44", "fl_fsdp-h16-lr1e-3-seed44",
             "fsdp-lr2e-3-seed44", "fl_fsdp-h8-lr2e-3-seed44", "fsdp-lr4e-3-seed44", "fl_fsdp-h8-lr4e-3-seed44",
             "fl_fsdp-h8-lr8e-3-seed44",
             "fl_fsdp-h16-p2-tau2-keep-int8-ef-lr1e-3-seed44", "fl_fsdp-h16-p2-tau4-keep-int8-ef-lr1e-3-seed44",
             "fl_fsdp-h32-p2-tau2-keep-int8-ef-lr1e-3-seed44", "fl_fsdp-h16-p2-tau2-keep-int8-gather-ef-lr1e-3-seed44")
"""The convergence suite's rows with another seed, in plan order: seed 43 of CONVERGENCE_SEEDED and
CONVERGENCE_THIRD_SEEDED (table order), then seed 44 of the latter (issue 40's three seeds)."""


def test_convergence_rows_differ_only_in_federation_flags():
    """Every row of the suite (issue 28's grid included) has the same command line but for
    the federation flags, its seed and the extra flags it names (``extra_flags``)."""
    plan = _plan("--suite", "convergence")
    rows = {r.id: r for r in bp.runs_of(plan)}
    grid = ["fsdp-lr1e-3", "fl_fsdp-h8-nesterov-lr1e-3", "fl_fsdp-h8-nesterov-olr0.6", "fl_fsdp-h8-nesterov-olr0.4",
            "fl_fsdp-h16-nesterov", "fl_fsdp-h32-nesterov", "fl_fsdp-h8-p2-tau2-nesterov", "fl_fsdp-h8-int8-ef-nesterov",
            "fl_fsdp-h8-p2-tau2-int8-ef-nesterov", "fl_fsdp-h8-p2-tau2-sparse-ef-senders",
            "fl_fsdp-h8-p2-tau2-sparse-ef-nesterov", "fl_fsdp-h8-lr1e-3", "fl_fsdp-h8-p2-tau2-int8-ef-nesterov-lr1e-3",
            "fl_fsdp-h8-p2-tau2-sparse-ef-nesterov-lr1e-3", "fl_fsdp-h8-p2-tau2-sparse16-ef-nesterov",
            "fl_fsdp-h8-p2-tau2-int8-ef-lr1e-3", "fl_fsdp-h8-nesterov-olr0.4-lr1e-3",
            "fl_fsdp-h16-p2-tau2-int8-ef-lr1e-3", "fl_fsdp-h16-p2-tau4-int8-ef-lr1e-3",
            "fl_fsdp-h8-p2-tau2-sparse-ef-zero-fill"]
    ablation = ["fl_fsdp-h16-lr1e-3", "fl_fsdp-h16-int8-ef-lr1e-3", "fl_fsdp-h16-p2-lr1e-3", "fl_fsdp-h16-tau2-lr1e-3",
                "fl_fsdp-h16-tau2-a0.5-lr1e-3", "fl_fsdp-h16-p2-tau2-int8-ef-a0.5-lr1e-3", "fsdp-lr2e-3",
                "fl_fsdp-h8-lr2e-3", "fsdp-lr4e-3", "fl_fsdp-h8-lr4e-3", "fsdp-lr8e-3", "fl_fsdp-h8-lr8e-3",
                "fl_fsdp-h1-lr1e-3", "fl_fsdp-h16-p2-tau16-keep-int8-ef-lr1e-3", "fl_fsdp-h16-tau16-keep-lr1e-3",
                "fl_fsdp-h8-warm32-lr1e-3", "fl_fsdp-h16-p2-tau2-keep-int8-ef-lr1e-3",
                "fl_fsdp-h16-p2-tau4-keep-int8-ef-lr1e-3", "fl_fsdp-h16-nesterov-olr0.6-lr1e-3",
                "fl_fsdp-h32-p2-tau2-keep-int8-ef-lr1e-3", "fl_fsdp-h16-p2-tau2-keep-int8-gather-ef-lr1e-3"]
    assert list(rows) == ["fsdp", "fl_fsdp-h8", "fl_fsdp-h8-nesterov", "fl_fsdp-h32", "fl_fsdp-h8-p2-tau1",
                          "fl_fsdp-h8-p2-tau2-int8-ef", "fl_fsdp-h8-nesterov-cosine", "fl_fsdp-h8-p2-tau2-sparse-ef",
                          *grid, *ablation, *SEED_ROWS]
    args = {k: bp.recipe_args(plan, r, f"/o/{k}") for k, r in rows.items()}
    assert rows["fl_fsdp-h8-nesterov-cosine"].extra_flags == ("--outer_lr_schedule", "cosine",
                                                             "--outer_lr_warmup_steps", "64")
    assert rows["fsdp-lr1e-3"].extra_flags == rows["fl_fsdp-h8-nesterov-lr1e-3"].extra_flags == \
        ("--learning_rate", "1e-3")
    common = set()
    for k, r in rows.items():
        c, extra = _common_part(args[k]), list(r.extra_flags)
        if extra:  # the extra flags, together, and nothing else
            at = c.index(extra[0])
            assert c[at:at + len(extra)] == extra, k
            c = c[:at] + c[at + len(extra):]
        common.add(tuple(c))
    assert len(common) == 1  # same tokens, data, model, schedule, evaluations, checkpoints
    c = list(common.pop())
    assert _flag(c, "--max_steps") == "832" and _flag(c, "--micro_batch_size") == "4" and _flag(c, "--seq_len") == "256"
    assert 832 * 4 * 4 * 256 >= 20 * 163_840
    assert _flag(c, "--eval_every") == "32" and _flag(c, "--resume_from_checkpoint") == "latest"
    assert _flag(c, "--checkpoint_every") == "64"
    assert {k: _flag(a, "--seed") for k, a in args.items()} == {k: k[-2:] if "-seed4" in k else "42" for k in rows}
    fed = {k: _federation_part(a) for k, a in args.items()}
    nesterov = ["--outer_optimizer", "nesterov", "--outer_lr", "0.7", "--outer_momentum", "0.9"]
    assert fed["fsdp"] == ["--algorithm", "fsdp"] and fed["fsdp-seed43"] == fed["fsdp-lr1e-3"] == fed["fsdp"]
    assert fed["fl_fsdp-h8"] == ["--algorithm", "fl_fsdp", "--num_groups", "2", "--sync_every", "8"]
    assert fed["fl_fsdp-h8-seed43"] == fed["fl_fsdp-h8"]
    assert fed["fl_fsdp-h8-nesterov"] == fed["fl_fsdp-h8"] + nesterov
    assert fed["fl_fsdp-h8-nesterov-seed43"] == fed["fl_fsdp-h8-nesterov-lr1e-3"] == fed["fl_fsdp-h8-nesterov"]
    assert fed["fl_fsdp-h8-nesterov-cosine"] == fed["fl_fsdp-h8-nesterov"]
    assert fed["fl_fsdp-h8-nesterov-olr0.6"] == fed["fl_fsdp-h8"] + ["--outer_optimizer", "nesterov", "--outer_lr",
                                                                     "0.6", "--outer_momentum", "0.9"]
    assert fed["fl_fsdp-h32"] == ["--algorithm", "fl_fsdp", "--num_groups", "2", "--sync_every", "32"]
    assert fed["fl_fsdp-h16-nesterov"] == ["--algorithm", "fl_fsdp", "--num_groups", "2", "--sync_every", "16"] + \
        nesterov
    assert fed["fl_fsdp-h8-p2-tau1"] == fed["fl_fsdp-h8"] + ["--num_fragments", "2", "--sync_delay", "1"]
    assert fed["fl_fsdp-h8-p2-tau2-int8-ef"] == fed["fl_fsdp-h8"] + ["--num_fragments", "2", "--sync_delay", "2",
                                                                     "--sync_dtype", "int8", *A2A, "--error_feedback"]
    assert fed["fl_fsdp-h8-p2-tau2-sparse-ef"] == fed["fl_fsdp-h8"] + ["--num_fragments", "2", "--sync_delay", "2",
                                                                       "--sync_dtype", "sparse", "--error_feedback"]
    assert fed["fl_fsdp-h8-int8-ef-nesterov"] == fed["fl_fsdp-h8"] + nesterov + ["--sync_dtype", "int8",
                                                                                 *A2A, "--error_feedback"]
    # the ablation (issue 46): one component each over blocking fp32 at H=16; the delay alone without fragments
    h16 = ["--algorithm", "fl_fsdp", "--num_groups", "2", "--sync_every", "16"]
    assert fed["fl_fsdp-h16-lr1e-3"] == h16
    assert fed["fl_fsdp-h16-int8-ef-lr1e-3"] == h16 + ["--sync_dtype", "int8", *A2A, "--error_feedback"]
    assert fed["fl_fsdp-h16-p2-lr1e-3"] == h16 + ["--num_fragments", "2", "--sync_delay", "0"]
    assert fed["fl_fsdp-h16-tau2-lr1e-3"] == fed["fl_fsdp-h16-tau2-a0.5-lr1e-3"] == h16 + ["--sync_delay", "2"]
    assert rows["fl_fsdp-h16-tau2-a0.5-lr1e-3"].extra_flags == ("--learning_rate", "1e-3",
                                                               "--fragment_update_alpha", "0.5")
    assert rows["fl_fsdp-h16-tau2-lr1e-3"].label == "FL+FSDP H=16 P=1 tau=2 learning_rate 1e-3"
    assert bp.ABLATION_BASE in rows and bp.ABLATION_FAST in rows
    assert all(r in rows and f"{r}-seed43" in rows for r in (x["id"] for x in bp.ABLATION_ROWS))
    # issue 46 items 2 and 3: the overlap (tau = H, local steps kept) and the warm-up, seeds 42 and 43
    assert fed["fl_fsdp-h16-p2-tau16-keep-int8-ef-lr1e-3"] == h16 + ["--num_fragments", "2", "--sync_delay", "16",
                                                                     "--sync_dtype", "int8", *A2A, "--error_feedback"]
    assert rows["fl_fsdp-h16-p2-tau16-keep-int8-ef-lr1e-3"].extra_flags == ("--learning_rate", "1e-3",
                                                                           "--delayed_local_steps", "keep")
    assert fed["fl_fsdp-h16-tau16-keep-lr1e-3"] == h16 + ["--sync_delay", "16"]
    assert fed["fl_fsdp-h1-lr1e-3"] == ["--algorithm", "fl_fsdp", "--num_groups", "2", "--sync_every", "1"]
    for tau in ("2", "4"):  # the fast row with its delay's local steps kept
        row = f"fl_fsdp-h16-p2-tau{tau}-keep-int8-ef-lr1e-3"
        assert fed[row] == h16 + ["--num_fragments", "2", "--sync_delay", tau, "--sync_dtype", "int8", *A2A, "--error_feedback"]
        assert rows[row].extra_flags == ("--learning_rate", "1e-3", "--delayed_local_steps", "keep")
    gather = "fl_fsdp-h16-p2-tau2-keep-int8-gather-ef-lr1e-3"  # the same at tau 2, one int8 all-gather
    assert fed[gather] == h16 + ["--num_fragments", "2", "--sync_delay", "2", "--sync_dtype", "int8",
                                 "--sync_collectives", "all_gather", "--error_feedback"]
    assert rows[gather].extra_flags == ("--learning_rate", "1e-3", "--delayed_local_steps", "keep")
    assert rows[gather].label == "FL+FSDP H=16 P=2 tau=2 int8+EF all-gather learning_rate 1e-3 delayed_local_steps keep"
    assert fed["fl_fsdp-h16-nesterov-olr0.6-lr1e-3"] == h16 + ["--outer_optimizer", "nesterov", "--outer_lr", "0.6",
                                                              "--outer_momentum", "0.9"]
    assert rows["fl_fsdp-h8-warm32-lr1e-3"].extra_flags == ("--learning_rate", "1e-3", "--sync_warmup_steps", "32")
    assert rows["fl_fsdp-h16-tau16-keep-lr1e-3"].label == \
        "FL+FSDP H=16 P=1 tau=16 learning_rate 1e-3 delayed_local_steps keep"
    assert rows["fl_fsdp-h8-warm32-lr1e-3-seed43"].label == \
        "FL+FSDP H=8 learning_rate 1e-3 sync_warmup_steps 32 (seed 43)"
    for r in bp.TUNED_ROWS:  # each row's flags make a valid FLConfig (the recipe would refuse it otherwise)
        from recipes.args import parse_args

        parse_args(args[r["id"]][1:], environ={"WORLD_SIZE": "4"})
    assert all(r.world == 4 and r.nodes == 1 and r.path == r.id for r in rows.values())
    assert rows["fl_fsdp-h8-nesterov"].label == "FL+FSDP H=8 nesterov(0.7, 0.9)"
    assert rows["fsdp-seed43"].label == "FSDP (seed 43)"


def test_a_later_row_is_one_line(monkeypatch):
    """Issue 21 items 3/4 add a row as one dict: its flags reach the recipe, the rest is shared."""
    extra = dict(id="fl_fsdp-h8-p2-tau2-sparse", sync_every=8, num_fragments=2, sync_delay=2,
                 extra_flags=("--some_density", "0.02"))
    monkeypatch.setattr(bp, "CONVERGENCE_ROWS", bp.CONVERGENCE_ROWS + (extra,))
    plan = _plan("--suite", "convergence")
    rows = {r.id: r for r in bp.runs_of(plan)}
    a = bp.recipe_args(plan, rows["fl_fsdp-h8-p2-tau2-sparse"], "/o/x")
    assert a[a.index("--some_density") + 1] == "0.02"
    assert _common_part(a)[: _common_part(a).index("--some_density")] == \
        _common_part(bp.recipe_args(plan, rows["fsdp"], "/o/y"))[: _common_part(a).index("--some_density")]
    assert list(rows)[-len(SEED_ROWS):] == list(SEED_ROWS)  # further seeds last


def test_only_selects_throughput_rows_and_their_calibration():
    """``--only`` on a throughput suite keeps those main rows (every rate) and the
    calibration of their configurations; an unknown id is one error naming the rows."""
    plan = _plan("--suite", "streaming", "--rates", "10mbit", "--only", "fl_fsdp-p2-tau2-sparse-ef,fl_fsdp-limit")
    runs = bp.runs_of(plan)
    assert sorted((r.phase, r.id) for r in runs) == [("calibration", "fl_fsdp-p2-tau2-sparse-ef"),
                                                     ("main", "fl_fsdp-limit"), ("main", "fl_fsdp-p2-tau2-sparse-ef")]
    with pytest.raises(bp.BenchError, match="--only: unknown"):
        _plan("--suite", "streaming", "--only", "nope")


def test_paper_regime_rows():
    plan = _plan("--suite", "paper-regime")
    rows = {r.id: r for r in bp.runs_of(plan)}
    assert list(rows) == ["fsdp-8p", "fl_fsdp-f8g1", "fl_fsdp-f4g2", "fsdp-8p-seed43", "fl_fsdp-f8g1-seed43"]
    args = {k: bp.recipe_args(plan, r, f"/o/{k}") for k, r in rows.items()}
    assert len({tuple(_common_part(a)) for a in args.values()}) == 1
    c = _common_part(args["fsdp-8p"])
    assert _flag(c, "--num_epochs") == "1" and "--max_steps" not in c and _flag(c, "--micro_batch_size") == "8"
    assert [(_flag(args[k], "--num_groups"), r.world) for k, r in rows.items()] == \
        [(None, 8), ("8", 8), ("4", 8), (None, 8), ("8", 8)]
    assert analysis.layout_of(rows["fl_fsdp-f8g1"]).shape == (8, 1, 1)
    assert analysis.layout_of(rows["fl_fsdp-f4g2"]).shape == (4, 1, 2)
    assert analysis.layout_of(rows["fsdp-8p"]).shape == (1, 1, 8)
    assert plan["name"].endswith("-paper-regime") and plan["suites"] == ["paper_regime"]


def test_quality_plan_validation():
    with pytest.raises(bp.BenchError, match="multiple of 2 x --eval-every"):
        _plan("--suite", "convergence", "--steps", "800")
    with pytest.raises(bp.BenchError, match="multiple of 32"):
        _plan("--suite", "convergence", "--eval-every", "16")
    with pytest.raises(bp.BenchError, match="loopback"):
        _plan("--suite", "convergence", "--rates", "10mbit")
    with pytest.raises(bp.BenchError, match="runs alone"):
        _plan("--suite", "convergence,baselines")
    with pytest.raises(bp.BenchError, match="unknown row"):
        _plan("--suite", "convergence", "--only", "fsdp,nope")
    with pytest.raises(bp.BenchError, match="quality suites"):
        _plan("--suite", "baselines", "--eval-every", "8")
    with pytest.raises(bp.BenchError, match="does not apply"):
        _plan("--suite", "convergence", "--sync-every", "4")
    assert _plan("--suite", "all")["suites"] == list(bp.EMULATED_SUITES)
    assert _plan("--suite", "convergence", "--only", "fsdp")["only"] == ["fsdp"]


def test_interpolation_seed_stats_and_time_to_target():
    curve = [{"tokens": 100, "loss": 9.0}, {"tokens": 200, "loss": 7.0}, {"tokens": 300, "loss": 6.0},
             {"tokens": 400, "loss": 6.5}]
    assert analysis.loss_at_tokens(curve, 150) == pytest.approx(8.0)
    assert analysis.loss_at_tokens(curve, 300) == 6.0 and analysis.loss_at_tokens(curve, 400) == 6.5
    assert analysis.loss_at_tokens(curve, 50) is None and analysis.loss_at_tokens(curve, 401) is None
    assert analysis.tokens_to_loss(curve, 6.5) == pytest.approx(250.0)  # first crossing, linear in tokens
    assert analysis.tokens_to_loss(curve, 9.5) == 100.0  # already there at the first evaluation
    assert analysis.tokens_to_loss(curve, 5.9) is None
    # mean +- sample sd per configuration; pooled sd = sqrt(sum((n_i - 1) s_i^2) / sum(n_i - 1)) over n_i >= 2
    st = analysis.seed_stats({"a": [5.0, 5.2], "b": [6.0, 5.9, 6.1], "c": [5.5], "d": [5.0, None]})
    assert st["configs"]["a"] == {"n": 2, "mean": pytest.approx(5.1), "sd": pytest.approx(0.2 / 2**0.5)}
    assert st["configs"]["b"]["sd"] == pytest.approx(0.1) and st["configs"]["c"]["sd"] is None
    assert st["configs"]["d"] == {"n": 1, "mean": 5.0, "sd": None}
    assert st["pooled_over"] == ["a", "b"] and st["df"] == 3
    assert st["pooled_sd"] == pytest.approx(((0.02 + 2 * 0.01) / 3) ** 0.5)
    assert analysis.seed_stats({"c": [5.5]})["pooled_sd"] is None
    assert analysis.in_sd(-0.3, 0.2) == pytest.approx(-1.5) and analysis.in_sd(0.1, 0.0) is None
    assert analysis.counts(-0.3, 0.2) is True and analysis.counts(0.1, 0.2) is False
    assert analysis.counts(None, 0.2) is None and analysis.counts(0.1, None) is None
    assert analysis.seed_config("fsdp-seed44", {"fsdp"}) == "fsdp"
    assert analysis.seed_config("x-seed44", {"y"}) == "x-seed44"
    assert analysis.time_to_target(1_000_000, 2_500.0) == 400.0 and analysis.time_to_target(None, 1.0) is None


def test_committed_throughput_and_predictions():
    """Measured tokens/s of the convergence rows come from the throughput results named as
    sources (here the fixture); nesterov and H=32 have none of their own; nesterov sends avg's
    bytes, so avg's measurement stands in for it (measured_same_bytes), H=32 sends other bytes,
    so its figure is the model's; no sources: the model's only."""
    plan = _plan("--suite", "convergence")
    rows = {r.id: r for r in bp.runs_of(plan)}
    committed = analysis.committed_throughput(FIXTURES, [BASELINES, "missing-folder"])
    assert committed["missing"] == ["missing-folder"]
    measured = {k: v["tokens_per_s"] for k, v in _saved()["runs"].items()}
    lt = {k: analysis.link_throughput(plan, rows[k], committed) for k in rows}
    assert lt["fl_fsdp-h8"]["100mbit"]["measured"] == pytest.approx(measured["rate-100mbit/fl_fsdp"])
    assert lt["fl_fsdp-h8"]["100mbit"]["sources"] == [f"{BASELINES}/rate-100mbit/fl_fsdp"]
    assert lt["fsdp"]["100mbit"]["measured"] == pytest.approx(measured["rate-100mbit/fsdp"])
    assert lt["fsdp"]["1gbit"]["measured"] is None and lt["fsdp"]["10mbit"]["predicted"] > 0
    assert lt["fsdp"]["10mbit"]["compute_source"] == f"{BASELINES}/calibration/fsdp"
    assert lt["fsdp-lr1e-3"] == lt["fsdp"]  # the LR does not change FSDP's throughput key
    for k in ("fl_fsdp-h8-nesterov", "fl_fsdp-h32"):
        assert all(v["measured"] is None and v["predicted"] for v in lt[k].values())
    # same bytes: nesterov (and its outer-LR schedule, and the learning rate) take avg's measured rate
    for k in ("fl_fsdp-h8-nesterov", "fl_fsdp-h8-nesterov-cosine", "fl_fsdp-h8-nesterov-lr1e-3", "fl_fsdp-h8-lr1e-3"):
        v = lt[k]["100mbit"]
        assert v["measured_same_bytes"] == pytest.approx(measured["rate-100mbit/fl_fsdp"]), k
        assert v["same_bytes_sources"] == [f"{BASELINES}/rate-100mbit/fl_fsdp"], k
        assert lt[k]["10mbit"]["measured_same_bytes"] is None  # the fixture measured 100 Mbit/s only
    assert lt["fl_fsdp-h8"]["100mbit"]["measured_same_bytes"] is None  # its own measurement comes first
    assert lt["fl_fsdp-h8-nesterov-olr0.6"]["100mbit"]["measured_same_bytes"] is not None  # the outer LR: local
    for k in ("fl_fsdp-h32", "fl_fsdp-h16-nesterov", "fl_fsdp-h8-p2-tau2-nesterov",
              "fl_fsdp-h8-p2-tau2-sparse16-ef-nesterov"):  # another H, fragments or density: other bytes
        assert lt[k]["100mbit"]["measured_same_bytes"] is None, k
    assert all(v["measured"] is None and v["predicted"] is None for v in lt["fl_fsdp-h8-p2-tau1"].values())
    assert lt["fl_fsdp-h8-seed43"] == lt["fl_fsdp-h8"]  # the seed row is the same configuration
    # H=32 sends a quarter of H=8's sync bytes: faster on a slow link, same compute time
    assert lt["fl_fsdp-h32"]["10mbit"]["predicted"] > lt["fl_fsdp-h8"]["10mbit"]["predicted"]
    assert lt["fl_fsdp-h32"]["10mbit"]["compute_source"] == lt["fl_fsdp-h8"]["10mbit"]["compute_source"]
    v = lt["fl_fsdp-h8"]["100mbit"]
    assert 0.85 < v["measured"] / v["predicted"] < 1.15, v  # the model within 15% of the measured FL+FSDP
    none = analysis.committed_throughput(FIXTURES, [])
    assert analysis.link_throughput(plan, rows["fsdp"], none)["100mbit"] == {
        "measured": None, "sources": [], "measured_same_bytes": None, "same_bytes_sources": [], "predicted": None,
        "compute_source": None}


def _write_fake_run(root, spec, losses, tokens_per_step=16384, eval_every=32):
    d = root / spec.path
    d.mkdir(parents=True)
    recs = []
    for i, loss in enumerate(losses, 1):
        step = i * eval_every
        recs.append({"step": step, "tokens": step * tokens_per_step, "time_s": float(step), "train/loss": loss + 0.1})
        recs.append({"step": step, "tokens": step * tokens_per_step, "time_s": float(step),
                     "eval/perplexity": float(__import__("math").exp(loss)), "eval/loss": loss})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    steps = len(losses) * eval_every
    (d / "all_results.json").write_text(json.dumps({
        "steps": steps, "train_tokens": steps * tokens_per_step, "tokens_per_step": tokens_per_step,
        "eval_loss": losses[-1], "eval_perplexity": float(__import__("math").exp(losses[-1])), "tokens_per_s": 1000.0}))


def test_analyze_and_report_a_convergence_suite(tmp_path):
    """Synthetic finished runs (4 evaluations each) through analyze_local and report_local."""
    plan = _plan("--suite", "convergence", "--steps", "128", "--work-root", str(tmp_path / "w"),
                 "--results-root", str(tmp_path / "r"), "--throughput-sources", BASELINES)
    assert plan["throughput_sources"] == [BASELINES]
    rows = {r.id: r for r in bp.runs_of(plan)}
    root = tmp_path / "w" / plan["name"]
    curves = {"fsdp": [8.0, 6.0, 5.5, 5.0], "fsdp-seed43": [8.0, 6.1, 5.6, 5.1],
              "fl_fsdp-h8": [8.2, 6.4, 5.6, 5.2], "fl_fsdp-h8-seed43": [8.2, 6.4, 5.7, 5.25],
              "fl_fsdp-h32": [8.5, 7.0, 6.5, 6.2]}  # the rest has not run yet
    for k, c in curves.items():
        _write_fake_run(root, rows[k], c)
    res = analysis.analyze_local(plan, str(root), FIXTURES)
    # two seeds each: s^2 = d^2 / 2, so pooled sd = sqrt((0.1^2 + 0.05^2) / 4)
    sd = ((0.1**2 + 0.05**2) / 4) ** 0.5
    assert res["seeds"]["pooled_sd"] == pytest.approx(sd) and res["seeds"]["threshold"] == pytest.approx(2 * sd)
    assert res["seeds"]["configs"]["fl_fsdp-h8"]["mean"] == pytest.approx(5.225)
    assert res["seeds"]["configs"]["fl_fsdp-h8-lr1e-3"]["not_finished"] == [
        "fl_fsdp-h8-lr1e-3", "fl_fsdp-h8-lr1e-3-seed43", "fl_fsdp-h8-lr1e-3-seed44"]
    assert res["target"]["tokens"] == 64 * 16384 and res["target"]["loss"] == 6.0
    r = res["rows"]
    assert r["fl_fsdp-h8"]["diff_fsdp"] == pytest.approx(0.2) and r["fl_fsdp-h8"]["diff_fsdp_in_sd"] == \
        pytest.approx(0.2 / sd)
    assert r["fl_fsdp-h8"]["diff_fsdp_counts"] is True and r["fl_fsdp-h8"]["diff_fsdp_counts_fixed"] is True
    assert r["fl_fsdp-h32"]["diff_blocking_in_sd"] == pytest.approx(1.0 / sd)
    assert r["fsdp"]["tokens_to_target"] == 64 * 16384
    # FL H=8 crosses 6.0 between 64 steps (6.4) and 96 steps (5.6): halfway
    assert r["fl_fsdp-h8"]["tokens_to_target"] == pytest.approx(80 * 16384)
    assert r["fl_fsdp-h32"]["tokens_to_target"] is None
    v = r["fl_fsdp-h8"]["links"]["100mbit"]
    assert v["time_to_target_measured_s"] == pytest.approx(80 * 16384 / v["measured"])
    assert res["status"]["fl_fsdp-h8-nesterov"]["state"] == "not started"
    assert res["throughput_sources"] == [BASELINES]
    from bench import report as br

    br.report_local(plan, {"command": plan["command"], "resume_command": "RESUME"}, str(root), FIXTURES)
    out = tmp_path / "r" / plan["name"]
    table = (out / "table.md").read_text()
    assert "Not finished yet" in table and "RESUME" in table and f"= **{sd:.4f}** nats" in table
    assert f"(abs Δ > 2 sd = {2 * sd:.4f})" in table and "## Seeds: mean ± sd per configuration" in table
    assert "| FL+FSDP H=8 " in table and "(model)" in table and f"`bench/results/{BASELINES}`" in table
    guide = {g[0]: g[1:] for g in br.guide_rows(res)}
    # 100 Mbit/s: FL+FSDP (measured in the fixture) needs 80/64 of FSDP's tokens at 5x its speed
    assert guide["100mbit"][0].startswith("FL+FSDP H=8: ") and guide["100mbit"][1].startswith("FSDP: ")
    # seed 43 of FSDP crosses 6.0 at 64 + 32 x 0.1/0.5 = 70.4 steps: +10% tokens
    assert "Fastest to the target" in table and "FSDP: 1,048,576 vs 1,153,434 (seed 43, +10.0%)" in table
    assert "(seed 43, +2.9%)" in table and "the larger of these shares (10.0%)" in table  # FL's: 80 vs 82.3 steps
    for png in ("eval_loss_vs_tokens.png", "time_to_target.png"):
        assert (out / png).stat().st_size > 1000
    assert not (out / "quality_vs_bytes.png").exists()  # these fake runs carry no fl counters
    saved = compact.CompactRuns.load(str(out))
    assert "fsdp" in saved and "fl_fsdp-h8-nesterov" not in saved and len(saved.get("fsdp")["records"]) == 8
    assert not (out / "raw").exists()


def test_grid_report_on_the_synthetic_fixture(tmp_path):
    """The convergence report by the grid's rules, rebuilt from the committed compact fixture
    (tests/fixtures/make_fixtures.py: CURVES, evaluations every 32 steps of 4,096 tokens)."""
    dst = _fixture_copy(tmp_path, GRID)
    shutil.copytree(os.path.join(FIXTURES, BASELINES), dst.parent / BASELINES)
    assert rb.main(["--report-only", "--name", GRID, "--results-root", str(dst.parent),
                    "--work-root", str(tmp_path / "work")]) == 0
    table = (dst / "table.md").read_text()
    lines = table.splitlines()
    assert lines[2] == f"> **Rules.** {bp.GRID_RULES}"  # the rules head the report
    res = json.loads((dst / "bench.json").read_text())["results"]
    assert lines[4].startswith("> **Noise.**")  # issue 40's rule below issue 28's
    # seeds: fsdp 5.30/5.32, fl_fsdp-h8 5.45/5.48, fsdp-lr1e-3 5.25/5.27/5.23, fl_fsdp-h8-lr1e-3 5.40/5.42 (its
    # seed 44 not started), nesterov one seed (its seed 43 not started). Pooled: the configurations planned with
    # three seeds (fsdp and fl_fsdp-h8 keep their own sd, outside the pool)
    seeds = res["seeds"]
    sd = ((2 * 0.0004 + 0.0002) / 3) ** 0.5
    assert seeds["pooled_over"] == ["fsdp-lr1e-3", "fl_fsdp-h8-lr1e-3"] and seeds["df"] == 3
    assert "not pooled; their own sd is in the seeds table: FSDP 0.0141" in table
    assert seeds["pooled_sd"] == pytest.approx(sd) and seeds["threshold"] == pytest.approx(2 * sd)
    three = seeds["configs"]["fsdp-lr1e-3"]
    assert (three["n"], three["seeds"], three["mean"], three["sd"]) == (3, [42, 43, 44], pytest.approx(5.25),
                                                                         pytest.approx(0.02))
    assert seeds["configs"]["fl_fsdp-h8-lr1e-3"]["not_finished"] == ["fl_fsdp-h8-lr1e-3-seed44"]
    assert seeds["configs"]["fl_fsdp-h8-nesterov"]["sd"] is None
    assert res["best_fsdp"] == "fsdp-lr1e-3"  # 5.25 < fsdp's 5.30; fsdp-seed43 is not a configuration
    nes = res["rows"]["fl_fsdp-h8-nesterov"]  # 5.22
    assert nes["diff_fsdp"] == pytest.approx(-0.08) and nes["diff_fsdp_in_sd"] == pytest.approx(-0.08 / sd)
    assert nes["diff_fsdp_counts"] is True
    assert nes["diff_best_fsdp"] == pytest.approx(-0.03) and nes["diff_best_fsdp_counts"] is False
    assert nes["diff_best_fsdp_counts_fixed"] is False  # issue 28's 0.04 rule, kept beside it
    assert f"| vs best FSDP (abs Δ > 2 sd = {2 * sd:.4f}) |" in table.replace("  ", "")
    row = next(ln for ln in lines if ln.startswith("| FL+FSDP H=8 nesterov(0.7, 0.9) ") and "counts" in ln)
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1:10] == ["5.2200", "-0.0800", f"{-0.08 / sd:+.1f}", "counts", "-0.0300", f"{-0.03 / sd:+.1f}",
                           "within noise", "within noise", "4"]
    section = table.split("## Seeds: mean ± sd per configuration", 1)[1].split("\n## ", 1)[0]
    cells = next([c.strip() for c in ln.split("|")[1:-1]] for ln in section.splitlines()
                 if ln.startswith("| FSDP learning_rate 1e-3 "))
    assert cells[1:5] == ["42, 43, 44", "5.2500, 5.2700, 5.2300", "3", "5.2500 ± 0.0200"]
    cells = next([c.strip() for c in ln.split("|")[1:-1]] for ln in section.splitlines()
                 if ln.startswith("| FL+FSDP H=8 learning_rate 1e-3 "))
    assert cells[4:] == ["5.4100 ± 0.0141", "+0.1600", "counts", "fl_fsdp-h8-lr1e-3-seed44"]
    assert f"= **{sd:.4f}** nats" in section and "sqrt(sum((n_i - 1) s_i^2) / sum(n_i - 1))" in section
    # targets: FSDP's loss at 64 steps (5.70), 5.42, 5.50, 5.60; nesterov 5.62 at 64 steps, 5.32 at 96
    assert [t["key"] for t in res["targets"]] == ["fsdp_half_budget", "5.42", "5.50", "5.60"]
    assert res["targets"][0]["loss"] == pytest.approx(5.70)
    to = nes["tokens_to"]
    assert to["5.42"] == pytest.approx((64 + 32 * (5.62 - 5.42) / 0.30) * 4096)
    assert to["5.60"] == pytest.approx((64 + 32 * (5.62 - 5.60) / 0.30) * 4096)
    assert to["fsdp_half_budget"] == pytest.approx((32 + 32 * (7.10 - 5.70) / (7.10 - 5.62)) * 4096)
    assert res["rows"]["fl_fsdp-h8"]["tokens_to"]["5.42"] is None  # 5.45 at the end: never
    section = table.split("## Tokens to each target", 1)[1].split("\n## ", 1)[0].splitlines()
    cells = [c.strip() for c in next(ln for ln in section if ln.startswith("| FL+FSDP H=8 nesterov(0.7, 0.9) "))
             .split("|")[1:-1]]
    assert cells[2] == f"{(64 + 32 * 0.2 / 0.3) * 4096:,.0f}"  # the 5.42 column
    assert any("int8+EF" in ln and "not finished (running or interrupted, logged up to step 64)" in ln
               for ln in section)
    assert res["rows"]["fl_fsdp-h8"]["fl_bytes_per_param"] == {"per_sync": 4.0, "run": 64.0}  # 16 syncs
    assert (dst / "quality_vs_bytes.png").stat().st_size > 1000
    # time to target: nesterov was not measured on a link; avg, which sends the same bytes, was (100 Mbit/s in
    # the fixture): the cell divides nesterov's tokens to target by avg's measured tokens/s, and says so
    link = nes["links"]["100mbit"]
    avg_rate = res["rows"]["fl_fsdp-h8"]["links"]["100mbit"]["measured"]
    assert link["measured"] is None and link["measured_same_bytes"] == pytest.approx(avg_rate)
    section = table.split("## Time to target loss per link", 1)[1]

    def cells_of(text, label, *more):
        for ln in text.splitlines():
            cells = [c.strip() for c in ln.split("|")[1:-1]]
            if cells and cells[0] == label and all(m in cells for m in more):
                return cells
        raise AssertionError(f"no row {label} {more}")

    minutes = nes["tokens_to"]["fsdp_half_budget"] / avg_rate / 60
    assert cells_of(section.split("###", 1)[0], "FL+FSDP H=8 nesterov(0.7, 0.9)")[3] == \
        f"{minutes:.1f} (measured, same bytes)"
    behind = cells_of(section.split("### tokens/s behind it", 1)[1], "FL+FSDP H=8 nesterov(0.7, 0.9)", "100mbit")
    assert behind[2] == f"{avg_rate:,.0f} (measured, same bytes)" and behind[3] == "-"
    assert behind[5] == f"{BASELINES}/rate-100mbit/fl_fsdp"
    assert cells_of(section, "FL+FSDP H=8 nesterov(0.7, 0.9)", "10mbit")[2].endswith(" (model)")


def test_paper_regime_ratios(tmp_path):
    plan = _plan("--suite", "paper-regime", "--work-root", str(tmp_path / "w"))
    rows = {r.id: r for r in bp.runs_of(plan)}
    root = tmp_path / "w" / plan["name"]
    _write_fake_run(root, rows["fsdp-8p"], [7.0, 6.0], eval_every=8)
    _write_fake_run(root, rows["fl_fsdp-f8g1"], [6.5, 5.5], eval_every=8)
    res = analysis.analyze_local(plan, str(root))
    ratio = res["ratios"]["fl_fsdp-f8g1"]
    import math

    assert ratio["vs"] == "fsdp-8p" and ratio["final"] == pytest.approx(math.exp(0.5))
    assert [c["ratio"] for c in ratio["curve"]] == pytest.approx([math.exp(0.5)] * 2)


def test_report_only_of_a_local_suite_lists_the_launches_of_launches_json(tmp_path):
    """--report-only on a quality suite's work folder reads the launch records from
    launches.json (written as each run ends), not from the meta.json of an older complete
    invocation: a row launched by an interrupted invocation still has its Launches row."""
    from bench import launch as bl

    plan = _plan("--suite", "convergence", "--steps", "128", "--work-root", str(tmp_path / "w"),
                 "--results-root", str(tmp_path / "r"), "--name", "conv")
    rows = {r.id: r for r in bp.runs_of(plan)}
    root = tmp_path / "w" / "conv"
    for k, c in {"fsdp": [8.0, 6.0, 5.5, 5.0], "fl_fsdp-h8": [8.2, 6.4, 5.6, 5.2]}.items():
        _write_fake_run(root, rows[k], c)
    (root / "plan.json").write_text(json.dumps(plan))
    old = {"sessions": [{"started": "2030-01-01T00:00:00", "rc": 0, "wall_s": 10.0, "resumed_from_step": 0}]}
    new = {"sessions": [{"started": "2030-01-02T00:00:00", "rc": 0, "wall_s": 4002.0, "resumed_from_step": 0}]}
    (root / "meta.json").write_text(json.dumps({"launches": {"fsdp": old}}))
    (root / bl.LAUNCHES_FILE).write_text(json.dumps({"fsdp": old, "fl_fsdp-h8": new}))
    assert rb.main(["--report-only", "--name", "conv", "--work-root", str(tmp_path / "w"),
                    "--results-root", str(tmp_path / "r")]) == 0
    launches = (tmp_path / "r" / "conv" / "table.md").read_text().split("## Launches", 1)[1]
    assert "| fl_fsdp-h8 " in launches and "4002" in launches and "| fsdp " in launches
    # the continuation names the unfinished rows only
    table_only = (tmp_path / "r" / "conv" / "table.md").read_text().split("Continue with `", 1)[1]
    only = table_only.split("`", 1)[0].split("--only ", 1)[1].split(",")
    assert "fl_fsdp-h8-nesterov" in only and "fsdp" not in only and "fl_fsdp-h8" not in only


def test_run_local_skips_finished_rows_and_resumes_the_rest(tmp_path, monkeypatch):
    """run_local with a stand-in for the launch (plain python, no training): a finished row is
    not launched again; the others get --resume_from_checkpoint latest and a launch record."""
    from bench import launch as bl

    script = tmp_path / "fake.py"
    script.write_text("import json, os, sys\nargs = sys.argv[1:]\nout = args[args.index('--output_dir') + 1]\n"
                      "json.dump({'args': args}, open(os.path.join(out, 'all_results.json'), 'w'))\n")
    monkeypatch.setattr(bl.launch, "torchrun_argv", lambda nproc, s, *a, **kw: [sys.executable, str(script), *a])
    plan = _plan("--suite", "convergence", "--smoke", "--only", "fsdp,fl_fsdp-h8", "--work-root", str(tmp_path))
    done = tmp_path / plan["name"] / "fsdp"
    done.mkdir(parents=True)
    (done / "all_results.json").write_text("{}")
    out = bl.run_local(plan, dry=False)
    assert out["failed"] == [] and list(out["launches"]) == ["fl_fsdp-h8"]
    assert (done / "all_results.json").read_text() == "{}"
    args = json.loads((tmp_path / plan["name"] / "fl_fsdp-h8" / "all_results.json").read_text())["args"]
    assert args[args.index("--resume_from_checkpoint") + 1] == "latest"
    rec = json.loads((tmp_path / plan["name"] / bl.LAUNCHES_FILE).read_text())
    assert rec["fl_fsdp-h8"]["sessions"][0]["rc"] == 0
    # a second pass launches nothing and keeps the records
    assert list(bl.run_local(plan, dry=False)["launches"]) == ["fl_fsdp-h8"]
    # a failing row is recorded with its exit code and the suite goes on
    script.write_text("import sys\nprint('failing on purpose')\nsys.exit(3)\n")
    plan = _plan("--suite", "convergence", "--smoke", "--only", "fl_fsdp-h32,fl_fsdp-h8-p2-tau1",
                 "--work-root", str(tmp_path))
    out = bl.run_local(plan, dry=False)
    assert out["failed"] == ["fl_fsdp-h32", "fl_fsdp-h8-p2-tau1"]
    assert out["launches"]["fl_fsdp-h32"]["sessions"][-1]["rc"] == 3
    assert "failing on purpose" in (tmp_path / plan["name"] / "fl_fsdp-h32" / "launch.log").read_text()


def test_a_suite_continued_on_a_fresh_checkout_keeps_the_committed_rows(tmp_path, monkeypatch):
    """The committed results folder of a quality suite (compact: the grid fixture, with
    ``fl_fsdp-h8-int8-ef-nesterov`` unfinished and two seed rows not started) and an empty work
    folder, as on a fresh checkout: run_local launches only the rows the committed folder lacks,
    and the report (after the run, and with --report-only) holds the committed rows and the new ones."""
    from bench import launch as bl

    dst = _fixture_copy(tmp_path, GRID)
    shutil.copytree(os.path.join(FIXTURES, BASELINES), dst.parent / BASELINES)
    bench = json.loads((dst / "bench.json").read_text())
    committed, saved_plan = set(bench["runs"]), bench["plan"]
    bench["launches"] = {"fsdp": {"sessions": [{"started": "2030-01-01T00:00:00", "rc": 0, "wall_s": 10.0,
                                                "resumed_from_step": 0}]}}  # a launch of the earlier checkout
    (dst / "bench.json").write_text(json.dumps(bench))
    work = tmp_path / "work" / GRID
    launched = []

    def fake_start(argv, **kw):  # the unfinished row trains (a finished fake run), nothing else may start
        out = argv[argv.index("--output_dir") + 1]
        launched.append(os.path.basename(out))
        spec = {r.id: r for r in bp.runs_of(saved_plan)}[os.path.basename(out)]
        _write_fake_run(tmp_path / "fake", spec, [7.0, 6.2, 5.6, 5.25], tokens_per_step=4096)
        for name in ("metrics.jsonl", "all_results.json"):
            shutil.copy(tmp_path / "fake" / spec.path / name, out)
        return subprocess.Popen([sys.executable, "-c", "pass"])

    monkeypatch.setattr(bl.launch, "start", fake_start)
    plan = {**saved_plan, "name": GRID, "work": str(work), "results": str(dst),
            "cache_dir": str(tmp_path / "cache"), "only": None}
    out = bl.run_local(plan, dry=False)
    new = {"fl_fsdp-h8-int8-ef-nesterov", "fl_fsdp-h8-nesterov-seed43", "fl_fsdp-h8-lr1e-3-seed44"}
    assert sorted(launched) == sorted(new) and out["failed"] == []
    (work / "plan.json").write_text(json.dumps(plan))
    assert rb.main(["--report-only", "--name", GRID, "--results-root", str(dst.parent),
                    "--work-root", str(tmp_path / "work")]) == 0
    saved = json.loads((dst / "bench.json").read_text())
    assert set(saved["runs"]) == committed | new
    assert saved["runs"]["fl_fsdp-h8-int8-ef-nesterov"]["eval_loss"] == 5.25
    assert saved["results"]["status"]["fl_fsdp-h8-int8-ef-nesterov"]["state"] == "finished"
    assert "fl_fsdp-h8-int8-ef-nesterov" in saved["launches"] and "fsdp" in saved["launches"]
    assert "Not finished yet" not in (dst / "table.md").read_text()


# ---------------------------------------------------------------------- time to target on emulated links
def _timed_run(root, name, evals, tokens_per_s, wall_s, wall_clock=False):
    """A finished run folder whose evaluations (training seconds, loss) are ``evals``."""
    import math

    d = root / name
    d.mkdir(parents=True)
    recs = []
    for i, (t, loss) in enumerate(evals, 1):
        ev = {"step": 32 * i, "tokens": 32 * i * 4096, "time_s": t, "eval/perplexity": math.exp(loss),
              "eval/loss": loss}
        if wall_clock:
            ev["wall_s"] = 2 * t
        recs += [{"step": 32 * i, "tokens": 32 * i * 4096, "time_s": t, "train/loss": loss + 0.1}, ev]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / "all_results.json").write_text(json.dumps({"steps": 32 * len(evals), "tokens_per_s": tokens_per_s,
                                                    "eval_loss": evals[-1][1], "wall_seconds": wall_s}))
    return str(d)


def test_time_to_target_json_on_emulated_links(tmp_path):
    """bench.time_to_target: seconds to each target (linear in eval loss between evaluations),
    of_limit against the limit's tokens/s, the schema of time_to_target.json (the earlier
    contract, the step-time summary and the caller's per-row figures), curves.csv, the plot."""
    from bench import time_to_target as ttt

    runs = tmp_path / "runs"
    nes = _timed_run(runs, "nesterov", [(100.0, 6.00), (200.0, 5.55), (300.0, 5.40)], 5000.0, 400.0)
    fsdp = _timed_run(runs, "fsdp", [(1000.0, 6.20), (2000.0, 5.80), (3000.0, 5.52)], 200.0, 3500.0)
    limit = _timed_run(runs, "limit", [(50.0, 6.0)], 6000.0, 60.0)
    res = tmp_path / "results" / "links"
    seeds = {"pooled_sd": 0.02, "threshold": 0.04, "formula": "f"}
    out = ttt.write_time_to_target(str(res), [
        {"run": "fl_fsdp-h8-nesterov", "link": "10mbit", "path": nes, "limit_path": limit, "learning_rate": 3e-4,
         "loadavg": {"start": [0.5, 0.4, 0.3], "end": [1.5, 1.0, 0.5]}, "link_rate_bits_per_s": 9.6e6},
        {"run": "fsdp", "link": "100mbit", "path": fsdp, "limit_tokens_per_s": 1000.0}],
        seeds, 5.70, "fsdp-lr1e-3", targets=(5.42, 5.50, 5.60))
    saved = json.loads((res / ttt.FILE).read_text())
    assert saved == out and saved["seeds"] == seeds and saved["half_budget_loss"] == 5.70
    assert saved["target_of"] == "fsdp-lr1e-3"
    assert "training seconds" in saved["clock"]  # no wall-clock time per evaluation in these records
    a, b = saved["rows"]
    contract = {"run", "link", "measured", "of_limit", "final_eval_loss", "wall_s_total", "to_target"}
    assert set(b) == contract | {"step_s"}
    assert set(a) == contract | {"step_s", "learning_rate", "loadavg", "link_rate_bits_per_s"}
    assert (a["run"], a["link"], a["measured"], a["final_eval_loss"], a["wall_s_total"], a["learning_rate"]) == \
        ("fl_fsdp-h8-nesterov", "10mbit", True, 5.40, 400.0, 3e-4)
    assert a["loadavg"] == {"start": [0.5, 0.4, 0.3], "end": [1.5, 1.0, 0.5]}
    assert a["step_s"] == {"median": pytest.approx(100 / 32), "p10": pytest.approx(100 / 32),
                           "p90": pytest.approx(100 / 32), "count": 2}  # training records at steps 32, 64, 96
    assert a["of_limit"] == pytest.approx(5000 / 6000) and b["of_limit"] == pytest.approx(0.2)
    assert list(a["to_target"]) == ["half_budget", "5.42", "5.50", "5.60"]
    assert a["to_target"]["half_budget"] == pytest.approx(100 + 100 * 0.30 / 0.45)
    assert a["to_target"]["5.60"] == pytest.approx(100 + 100 * 0.40 / 0.45)
    assert a["to_target"]["5.42"] == pytest.approx(200 + 100 * 0.13 / 0.15)
    assert b["to_target"]["5.60"] == pytest.approx(2000 + 1000 * 0.20 / 0.28)
    assert b["to_target"]["5.50"] is None and b["to_target"]["5.42"] is None  # 5.52 at the end
    assert (res / ttt.PLOT).stat().st_size > 1000
    # curves.csv: every evaluation of every row, read back exactly
    curves = ttt.read_curves(str(res / ttt.CURVES))
    assert (res / ttt.CURVES).read_text().splitlines()[0] == ",".join(ttt.CURVE_COLUMNS)
    assert [e["loss"] for e in curves[("fl_fsdp-h8-nesterov", "10mbit")]] == [6.00, 5.55, 5.40]
    assert curves[("fsdp", "100mbit")][1] == {"step": 64, "tokens": 64 * 4096, "loss": 5.80, "wall_s": None,
                                               "time_s": 2000.0}
    # evaluations that carry a wall-clock time are measured on it; the default targets: the half budget and 5.42
    wall = _timed_run(runs, "wall", [(100.0, 6.00), (200.0, 5.40)], 5000.0, 500.0, wall_clock=True)
    out = ttt.write_time_to_target(str(tmp_path / "w"), [{"run": "x", "link": "10mbit", "path": wall}], None, None,
                                   plot=False)
    assert out["rows"][0]["to_target"] == {"5.42": pytest.approx(2 * (100 + 100 * 0.58 / 0.60))}
    assert out["rows"][0]["of_limit"] is None and "wall-clock" in out["clock"]
    assert ttt.read_curves(str(tmp_path / "w" / ttt.CURVES))[("x", "10mbit")][1]["wall_s"] == 400.0
    with pytest.raises(ValueError, match="no all_results.json"):
        ttt.write_time_to_target(str(tmp_path / "w"), [{"run": "y", "link": "10mbit", "path": str(tmp_path)}],
                                 None, None)
    # the pooled seed sd and a row's half-budget loss of a convergence results folder (fsdp-lr1e-3: 5.60 at 64 steps)
    conv = ttt.from_convergence(os.path.join(FIXTURES, GRID), "fsdp-lr1e-3")
    assert conv["half_budget_loss"] == pytest.approx(5.60)
    assert conv["seeds"]["pooled_sd"] == pytest.approx(((0.0002 + 0.00045 + 2 * 0.0004 + 0.0002) / 5) ** 0.5)
    assert ttt.from_convergence(os.path.join(FIXTURES, GRID), "fsdp")["half_budget_loss"] == pytest.approx(5.70)
    assert ttt.from_convergence(os.path.join(FIXTURES, GRID), "nope")["half_budget_loss"] is None
    assert ttt.step_summary([{"step": 8, "time_s": 1.0, "train/loss": 1.0}]) == {
        "median": None, "p10": None, "p90": None, "count": 0}


def test_ttt_bench_plan_resume_and_stopped_rows(tmp_path, monkeypatch, capsys):
    """bench.ttt_bench: the chosen convergence rows move onto 2 nodes x 2 processes at each link
    with a no-sync limit first; bad options name themselves; caps per link; a resumed run's
    repeated records count once (the later session's); a row stopped at the wall-clock cap is
    reported from its evaluations with status "stopped", its unreached targets as measured
    lower bounds and, labelled, extrapolated; each row carries its learning rate, load average,
    link rate, limit and sittings, and "one sitting" is claimed only when true; rows not run
    yet are listed with the command to go on."""
    from bench import analysis, ttt_bench as tb

    def plan(*argv):
        return tb.make_plan(tb.build_parser().parse_args(
            ["--name", "t-ttt", "--work-root", str(tmp_path / "work"), "--results-root", str(tmp_path / "res"),
             "--grid", os.path.join(FIXTURES, GRID), *argv]))

    for argv, msg in ((["--rows", "fsdp,nope"], "unknown row"), (["--links", "fast"], "--links"),
                      (["--cap_minutes", "0"], "must be > 0"), (["--cap_minutes", "1gbit:5"], "not in --links"),
                      (["--cap_minutes", "10mbit:x"], "LINK:MINUTES"), (["--name", "a b"], "--name"),
                      (["--target_of", "nope"], "--target_of nope"), (["--targets", "5.4,x"], "--targets")):
        with pytest.raises(tb.TTTError, match=msg):
            plan(*argv)
    assert tb.build_parser().parse_args([]).rows == ",".join(tb.DEFAULT_ROWS)  # issue 40's rows, all at lr 1e-3
    assert all("--learning_rate" in {r["id"]: r for r in bp.CONVERGENCE_ROWS}[k].get("extra_flags", ())
               for k in tb.DEFAULT_ROWS)
    p = plan("--links", "10mbit,100mbit", "--rows", "fl_fsdp-h8-nesterov,fsdp", "--cap_minutes", "1.5")
    specs = bp.runs_of(p)
    assert [(s.link, s.id) for s in specs] == [(l, r) for l in ("10mbit", "100mbit")
                                               for r in (tb.LIMIT_ID, "fl_fsdp-h8-nesterov", "fsdp")]
    assert all((s.nodes, s.nproc_per_node, s.world) == (2, 2, 4) for s in specs)
    assert p["cap_s"] == {"10mbit": 90.0, "100mbit": 90.0} and (p["target_of"], p["targets"]) == ("fsdp-lr1e-3", [5.42])
    assert plan("--links", "10mbit,100mbit", "--cap_minutes", "10mbit:40,100mbit:45")["cap_s"] == {
        "10mbit": 2400.0, "100mbit": 2700.0}
    assert tb.parse_caps("60,10mbit:40", ["10mbit", "100mbit", "1gbit"]) == {"10mbit": 40.0, "100mbit": 60.0,
                                                                            "1gbit": 60.0}
    assert tb.parse_caps("10mbit:40", ["10mbit", "100mbit"])["100mbit"] == tb.DEFAULT_CAP_MINUTES
    assert tb.cap_s({"cap_s": 5400.0}, "10mbit") == 5400.0  # a plan of an older version: one cap
    p2 = plan("--links", "10mbit,100mbit", "--rows", "fsdp,10mbit:fl_fsdp-h8-nesterov")  # a row at one link only
    assert [(s.link, s.id) for s in bp.runs_of(p2)] == [("10mbit", tb.LIMIT_ID), ("10mbit", "fsdp"),
                                                        ("10mbit", "fl_fsdp-h8-nesterov"),
                                                        ("100mbit", tb.LIMIT_ID), ("100mbit", "fsdp")]
    with pytest.raises(tb.TTTError, match="not in --links"):
        plan("--rows", "1gbit:fsdp")
    limit, nes = specs[0], specs[1]
    assert (limit.sync_every, limit.eval_every, limit.checkpoint_every) == (bp.LIMIT_SYNC_EVERY, 0, 0)
    assert nes.checkpoint_every == p["eval_every"] == 32 and nes.steps == 832
    args = bp.recipe_args(p, nes, "/out")
    assert args[args.index("--outer_optimizer") + 1] == "nesterov" and "--resume_from_checkpoint" in args

    p = plan("--links", "10mbit", "--rows", "fl_fsdp-h8-nesterov,fsdp,fsdp-lr1e-3")
    assert tb.inner_lr({s.id: s for s in bp.runs_of(p)}["fsdp-lr1e-3"]) == 1e-3
    link = tmp_path / "work" / "t-ttt" / "10mbit"
    _timed_run(link, tb.LIMIT_ID, [(10.0, 8.0)], 8000.0, 60.0)
    nes_dir = _timed_run(link, "fl_fsdp-h8-nesterov", [(100.0, 6.0), (200.0, 5.45), (300.0, 5.30)], 6000.0, 400.0,
                         wall_clock=True)
    metrics = os.path.join(nes_dir, "metrics.jsonl")
    lost = {"step": 32, "tokens": 131072, "eval/perplexity": 1e4, "eval/loss": 9.2, "wall_s": 5.0}
    with open(metrics, encoding="utf-8") as fh:  # a first session's part that its resume redid
        text = fh.read()
    with open(metrics, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(lost) + "\n" + text)
    recs = tb._records(nes_dir)
    assert [r["eval/loss"] for r in recs if "eval/perplexity" in r and r["step"] == 32] == [6.0]
    fsdp = link / "fsdp"
    fsdp.mkdir()
    (fsdp / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 32, "tokens": 131072, "time_s": 900.0, "train/loss": 7.0},
        {"step": 32, "tokens": 131072, "eval/perplexity": 900.0, "eval/loss": 6.8, "wall_s": 1000.0})))
    assert tb._wall_so_far(str(fsdp)) == 1000.0
    (fsdp / tb.STOPPED).write_text(json.dumps({"reason": "wall-clock cap of 90 min", "wall_s": 5400.0}))
    # two sittings: the limit and nesterov in A, FSDP resumed in B after a first session in A
    a, b = "2030-01-01T10:00:00", "2030-01-02T10:00:00"
    work = tmp_path / "work" / "t-ttt"

    def session(sitting, start, end):
        return {"sitting": sitting, "started": f"{sitting[:11]}{start}", "ended": f"{sitting[:11]}{end}",
                "loadavg_start": [float(start[:2]) / 10, 0.0, 0.0], "loadavg_end": [float(end[:2]) / 10, 0.0, 0.0],
                "rc": 0}

    launches = {f"10mbit/{tb.LIMIT_ID}": [session(a, "10:01:00", "10:02:00")],
                "10mbit/fl_fsdp-h8-nesterov": [session(a, "10:02:00", "10:09:00")],
                "10mbit/fsdp": [session(a, "10:09:00", "11:00:00"), session(b, "10:00:00", "11:30:00")]}
    (work / "launches.json").write_text(json.dumps(launches))
    (work / tb.SITTINGS).write_text(json.dumps({
        a: {"started": a, "ended": "2030-01-01T11:00:00", "links": {"10mbit": {"achieved_bits_per_s": 9.5e6}},
            "loadavg_start": [1.0, 0, 0], "loadavg_end": [2.0, 0, 0]},
        b: {"started": b, "ended": "2030-01-02T11:30:00", "links": {"10mbit": {"achieved_bits_per_s": 8.5e6}}}}))
    out = tb.report(p)
    saved = json.loads((tmp_path / "res" / "t-ttt" / "time_to_target.json").read_text())
    assert saved == out and saved["half_budget_loss"] == pytest.approx(5.60) and saved["target_of"] == "fsdp-lr1e-3"
    assert list(saved["targets"]) == ["half_budget", "5.42"]
    rows = {r["run"]: r for r in saved["rows"]}
    r = rows["fl_fsdp-h8-nesterov"]
    assert r["status"] == "finished" and r["of_limit"] == pytest.approx(0.75) and r["learning_rate"] == 3e-4
    assert r["to_target"]["half_budget"] == pytest.approx(2 * (100 + 100 * 0.40 / 0.55))
    assert (r["sittings"], r["limit"]["sittings"], r["link_rate_bits_per_s"]) == ([a], [a], 9.5e6)
    assert r["limit"]["tokens_per_s"] == 8000.0 and r["loadavg"] == {"start": [1.0, 0.0, 0.0], "end": [1.0, 0.0, 0.0]}
    assert r["sessions"] == [{"sitting": a, "started": "2030-01-01T10:02:00", "ended": "2030-01-01T10:09:00"}]
    assert r["step_s"]["count"] == 2
    f = rows["fsdp"]
    assert f["status"].startswith("stopped: wall-clock cap")
    assert (f["final_eval_loss"], f["wall_s_total"]) == (6.8, 5400.0)
    assert f["of_limit"] == pytest.approx(131072 / 900 / 8000)
    assert set(f["to_target"].values()) == {None}
    assert f["to_target_lower_bound_s"] == {"half_budget": 5400.0, "5.42": 5400.0}  # measured: not reached by then
    assert f["sittings"] == [a, b] and f["link_rate_bits_per_s"] == 8.5e6
    assert f["loadavg"] == {"start": [1.0, 0.0, 0.0], "end": [1.1, 0.0, 0.0]}
    # a stopped row's extrapolation: the stop's wall clock + the grid's remaining tokens at its own rate
    assert f["stopped_at"] == {"step": 32, "tokens": 131072, "train_tokens_per_s": 131072 / 900.0}
    curve = analysis.eval_curve(compact.CompactRuns.load(os.path.join(FIXTURES, GRID)).get("fsdp"))
    need = analysis.tokens_to_loss(curve, 5.60)
    assert f["extrapolated_to_target"]["half_budget"] == pytest.approx(5400.0 + (need - 131072) * 900.0 / 131072)
    need = analysis.tokens_to_loss(curve, 5.42)  # the grid's FSDP: 5.45 at 96 steps, 5.30 at 128
    assert f["extrapolated_to_target"]["5.42"] == pytest.approx(5400.0 + (need - 131072) * 900.0 / 131072)
    assert "not measured" in f["extrapolation"]
    assert saved["one_sitting"] is False and list(saved["sittings"]) == [a, b]
    table = (tmp_path / "res" / "t-ttt" / "table.md").read_text()
    assert "stopped: wall-clock cap of 90 min" in table and ">= 90.0 (stopped)" in table
    assert f"{(5400.0 + (need - 131072) * 900.0 / 131072) / 60:.1f} (extrapolated)" in table  # the 5.42 column
    assert "**Not one sitting**" in table and "same sitting" not in table and "**One sitting**" not in table
    assert f"S1: 10mbit/fl_fsdp-h8-nesterov, 10mbit/{tb.LIMIT_ID}, 10mbit/fsdp; S2: 10mbit/fsdp" in table
    assert "min to fsdp-lr1e-3's half-budget loss (5.6000)" in table
    assert "Not run yet: 10mbit/fsdp-lr1e-3" in table
    assert "fl_fsdp-h8-nesterov,10mbit,96," in (tmp_path / "res" / "t-ttt" / "curves.csv").read_text()
    # every row and its limit in one sitting: the table says so
    launches["10mbit/fsdp"] = [session(a, "10:09:00", "11:00:00")]
    (work / "launches.json").write_text(json.dumps(launches))
    out = tb.report(p)
    assert out["one_sitting"] is True and "**One sitting**" in (tmp_path / "res" / "t-ttt" / "table.md").read_text()
    shutil.rmtree(fsdp)
    tb.report(p)
    assert "Not run yet: 10mbit/fsdp, 10mbit/fsdp-lr1e-3" in (tmp_path / "res" / "t-ttt" / "table.md").read_text()
    # the same --name from a fresh work folder would rebuild the results from nothing: refused, nothing written
    before = (tmp_path / "res" / "t-ttt" / "time_to_target.json").read_text()
    assert tb.main(["--name", "t-ttt", "--work-root", str(tmp_path / "w3"), "--results-root",
                    str(tmp_path / "res"), "--report-only", "--grid", os.path.join(FIXTURES, GRID)]) == 2
    assert "10mbit/fl_fsdp-h8-nesterov" in capsys.readouterr().err
    assert (tmp_path / "res" / "t-ttt" / "time_to_target.json").read_text() == before
    # without root the bench says how to run it and starts nothing
    monkeypatch.setattr(tb.netemu, "check_privileges", lambda: (False, "this process is not root"))
    assert tb.main(["--name", "t-ttt", "--work-root", str(tmp_path / "w2"), "--grid",
                    os.path.join(FIXTURES, GRID)]) == 1
    assert not (tmp_path / "w2").exists()


def test_speed_bench_settings_and_quality_check(tmp_path):
    """bench.speed_bench: the convergence setting repeats the grid's nesterov row (its flags,
    checkpoints to resume), the wall clock to a loss is linear between evaluations, and the
    quality check states each run against the 1:1 row in pooled seed sd and against the barrier's
    wall clock; a grid without the row is refused with exit 2 before anything runs."""
    from bench import speed_bench as sb

    conv = sb.recipe_args("speed", sb.SETTINGS["convergence"], 832, 4.0, tmp_path / "o", tmp_path / "c")
    rows = {r["id"]: r for r in bp.CONVERGENCE_ROWS}
    ref = rows[sb.REFERENCE_ROW]
    for flag, value in (("--outer_optimizer", ref["outer_optimizer"]), ("--outer_lr", f"{ref['outer_lr']:g}"),
                        ("--outer_momentum", f"{ref['outer_momentum']:g}"), ("--sync_every", str(ref["sync_every"])),
                        ("--seq_len", "256"), ("--micro_batch_size", "4"), ("--eval_every", "32"),
                        ("--max_eval_blocks", "128"), ("--sync_trigger", "speed"),
                        ("--resume_from_checkpoint", "latest")):
        assert conv[conv.index(flag) + 1] == value, flag
    quick = sb.recipe_args("time", sb.SETTINGS["quick"], 96, 4.0, tmp_path / "o", tmp_path / "c")
    assert quick[quick.index("--sync_window_s") + 1] == "4.0" and "--outer_optimizer" not in quick
    assert sb.quotas(sb.parse_ratio("2:1"), 0.8) == [0.8, 0.4]
    def ev(*points):
        return [{"step": s, "tokens": 4096 * s, "eval_loss": loss, "wall_s": wall} for s, loss, wall in points]

    evals = ev((32, 6.0, 100.0), (64, 5.5, 200.0), (96, 5.3, 300.0))
    assert sb.wall_to_loss(evals, 5.6) == pytest.approx(100 + 100 * 0.4 / 0.5)
    assert sb.wall_to_loss(evals, 6.5) == 100.0 and sb.wall_to_loss(evals, 5.0) is None
    assert sb.wall_to_loss(ev((32, 5.0, None)), 5.6) is None
    q = sb.reference(Path(FIXTURES) / GRID)
    sd = ((0.0002 + 0.00045 + 2 * 0.0004 + 0.0002) / 5) ** 0.5
    assert (q["pooled_sd"], q["threshold"], q["fsdp_half_budget_loss"]) == (
        pytest.approx(sd), pytest.approx(2 * sd), pytest.approx(5.7))
    runs = [{"run": "steps-2to1", "trigger": "barrier", "speed_ratio": "2:1", "final_eval_loss": q[
                "reference_final_eval_loss"] + 0.03, "evals": ev((32, 6.0, 400.0), (64, 5.6, 800.0))},
            {"run": "speed-2to1", "trigger": "speed", "speed_ratio": "2:1", "final_eval_loss": q[
                "reference_final_eval_loss"] - 0.06, "evals": ev((32, 6.0, 200.0), (64, 5.6, 400.0))}]
    out = sb.quality(runs, q)
    barrier, speed = out["rows"]
    assert barrier["delta_in_sd"] == pytest.approx(0.03 / sd) and barrier["counts"] is False
    assert barrier["of_barrier"] == pytest.approx(1.0)
    assert speed["delta_vs_1to1"] == pytest.approx(-0.06) and speed["of_barrier"] == pytest.approx(0.5)
    assert speed["counts"] is True and speed["wall_s_to_fsdp_half_budget"] == pytest.approx(200 + 200 * 0.3 / 0.4)
    lines = "\n".join(sb.quality_lines([], out))
    assert "| 2:1 | speed |" in lines and "counts |" in lines and f"abs Δ > {2 * sd:.4f}" in lines
    # a finished run's raw data: evaluations with their wall seconds, the step-time summary, the sessions' load
    run = tmp_path / "run"
    run.mkdir()
    recs = [{"step": 8 * i, "tokens": 8 * i * 512, "time_s": 2.0 * i, "train/loss": 6.0} for i in (1, 2, 3)]
    recs += [{"step": 16, "tokens": 8192, "time_s": 4.0, "wall_s": 9.0, "eval/loss": 5.9, "eval/perplexity": 365.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "all_results.json").write_text(json.dumps({
        "train_tokens": 12288, "train_seconds": 6.0, "steps": 24, "eval_loss": 5.9, "wall_seconds": 12.0}))
    (run / sb.SESSIONS).write_text(json.dumps([{"started": "s", "ended": "e", "loadavg_start": [1.0, 1.0, 1.0],
                                                "loadavg_end": [2.0, 1.0, 1.0]}]))
    row = sb.row_of(sb._finished(run, "steps-1to1"), "steps", "1:1", "100mbit", 9.4e7)
    assert row["evals"] == [{"step": 16, "tokens": 8192, "wall_s": 9.0, "eval_loss": 5.9}]
    assert row["step_s"] == {"median": 0.25, "p10": 0.25, "p90": 0.25, "count": 2}
    assert row["sessions"][0]["loadavg_end"] == [2.0, 1.0, 1.0] and row["link_rate_bits_per_s"] == 9.4e7
    (tmp_path / "grid").mkdir()
    (tmp_path / "grid" / "bench.json").write_text(json.dumps({"results": {}, "runs": {}}))
    with pytest.raises(KeyError):
        sb.reference(tmp_path / "grid")
    assert sb.main(["--setting", "convergence", "--grid", "no-such-grid", "--name", "t"]) == 2
    assert not (Path(sb.ROOT) / "bench" / "work" / "t").exists()
    # standalone rates: as written, or, for results from before `timed_steps`, over the timed steps only
    new = {"standalone_tokens_per_s": [1000.0, 500.0], "timed_steps": [99, 49], "num_rounds": 10,
           "group_steps": [100, 50]}
    assert sb.standalone_rates(new) == [1000.0, 500.0]
    old = {k: v for k, v in new.items() if k != "timed_steps"}
    assert sb.standalone_rates(old) == pytest.approx([1000.0 * 90 / 100, 500.0 * 40 / 50])


def test_ablation_by_its_preregistered_rules():
    """Issue 46's ablation: each component's cost over its reference, in pooled sd, counted by the 2-sd rule;
    the sum of the components against the combined row; whether alpha 0.5 recovers the delay's cost."""
    from bench.analysis import ablation_of, seed_stats

    means = {"fl_fsdp-h8-lr1e-3": [4.90, 4.91], bp.ABLATION_BASE: [4.93, 4.94],
             "fl_fsdp-h16-int8-ef-lr1e-3": [4.96, 4.97], "fl_fsdp-h16-p2-lr1e-3": [4.935, 4.935],
             "fl_fsdp-h16-tau2-lr1e-3": [4.975, 4.985], "fl_fsdp-h16-tau2-a0.5-lr1e-3": [4.94, 4.94],
             bp.ABLATION_FAST: [5.03, 5.04]}
    seeds = seed_stats(means)
    seeds.update(threshold=2 * seeds["pooled_sd"])
    assert ablation_of({**seeds, "configs": {}}) is None  # nothing before the base has finished
    ab = ablation_of(seeds)
    comp = {c["id"]: c for c in ab["components"]}
    thr = seeds["threshold"]
    assert comp[bp.ABLATION_BASE]["cost"] == pytest.approx(0.03) and comp[bp.ABLATION_BASE]["ref"] == \
        "fl_fsdp-h8-lr1e-3"
    assert comp["fl_fsdp-h16-int8-ef-lr1e-3"]["cost"] == pytest.approx(0.03)
    assert comp["fl_fsdp-h16-int8-ef-lr1e-3"]["counts"] is (0.03 > thr)
    assert comp["fl_fsdp-h16-p2-lr1e-3"]["cost"] == pytest.approx(0.0) and not comp["fl_fsdp-h16-p2-lr1e-3"]["counts"]
    assert comp["fl_fsdp-h16-tau2-lr1e-3"]["cost_in_sd"] == pytest.approx(0.045 / seeds["pooled_sd"])
    assert comp["fl_fsdp-h16-p2-tau2-int8-ef-a0.5-lr1e-3"]["cost"] is None  # not run: no cost, no verdict
    assert ab["alpha_recovers"] is True  # the delay at alpha 0 counts (+0.045), at alpha 0.5 not (+0.005)
    fast = next(s for s in ab["sums"] if s["id"] == bp.ABLATION_FAST)
    assert fast["sum"] == pytest.approx(0.03 + 0.0 + 0.045) and fast["cost"] == pytest.approx(0.10)
    assert fast["gap"] == pytest.approx(0.025) and fast["explained"] is (0.025 <= thr)
    assert next(s for s in ab["sums"] if s["id"] != bp.ABLATION_FAST)["gap"] is None
    text = "\n".join(rp.ablation_section({"ablation": ab, "seeds": seeds}))
    assert bp.ABLATION_RULES in text and re.search(r"\| int8 \+ error feedback +\|", text)
    assert "alpha 0.5 recovers the delay's cost." in text and "not all of its rows have finished yet" in text


def test_per_token_gap_by_its_rules():
    """Issue 46 item 4: each method's best over any inner LR (FL+FSDP from H >= 2), the gap against the
    0.08-nat target, provisional below 3 seeds, the best per LR, and the H=1 floor's share of H=8's gap."""
    from bench.analysis import per_token_gap, seed_stats

    def row(rid, algorithm, lr, sync_every, loss, seed=None):
        return {"id": rid, "label": rid, "algorithm": algorithm, "lr": lr, "sync_every": sync_every,
                "eval_loss": loss, "second_seed": seed is not None, "seed": seed or 42}

    rows = {r["id"]: r for r in (
        row("fsdp", "fsdp", 3e-4, None, 5.25), row("fsdp-lr1e-3", "fsdp", 1e-3, None, 4.74),
        row("fsdp-lr1e-3-seed43", "fsdp", 1e-3, None, 4.72, 43),
        row("fl_fsdp-h8-lr1e-3", "fl_fsdp", 1e-3, 8, 4.90), row("fl_fsdp-h8-lr1e-3-seed43", "fl_fsdp", 1e-3, 8, 4.92, 43),
        row("fl_fsdp-h8-nesterov-olr0.6", "fl_fsdp", 3e-4, 8, 5.15),
        row("fl_fsdp-h1-lr1e-3", "fl_fsdp", 1e-3, 1, 4.76))}
    seeds = seed_stats({"fsdp-lr1e-3": [4.74, 4.72], "fl_fsdp-h8-lr1e-3": [4.90, 4.92]})
    assert per_token_gap({k: v for k, v in rows.items() if v["algorithm"] == "fsdp"}, seeds) is None
    pt = per_token_gap(rows, seeds)
    assert pt["best"] == {"FSDP": "fsdp-lr1e-3", "FL+FSDP": "fl_fsdp-h8-lr1e-3"}  # H=1 is the floor, not a best
    assert pt["gap"] == pytest.approx(4.91 - 4.73) and pt["met"] is False and pt["provisional"] is True
    assert pt["gap_in_sd"] == pytest.approx(0.18 / seeds["pooled_sd"])
    by_lr = {r["lr"]: r for r in pt["by_lr"]}
    assert by_lr[3e-4]["gap"] == pytest.approx(5.15 - 5.25) and by_lr[3e-4]["FL+FSDP"] == "fl_fsdp-h8-nesterov-olr0.6"
    assert pt["floor"]["gap"] == pytest.approx(0.03) and pt["floor"]["share"] == pytest.approx(0.03 / 0.18)
    text = "\n".join(rp.per_token_section({"per_token": pt, "seeds": {**seeds}}))
    assert bp.PER_TOKEN_RULES in text and "| 3e-4 " in text and "above the 0.08-nat target; provisional" in text
    assert "H=1 keeps 17% of H=8's gap" in text
    # within the target, three seeds each: met and not provisional
    seeds3 = seed_stats({"fsdp-lr1e-3": [4.74, 4.72, 4.73], "fl_fsdp-h8-lr1e-3": [4.78, 4.79, 4.80]})
    pt3 = per_token_gap(rows, seeds3)
    assert pt3["gap"] == pytest.approx(0.06) and pt3["met"] is True and pt3["provisional"] is False
