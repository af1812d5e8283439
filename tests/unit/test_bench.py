"""bench/: plan, layout figures, analysis and report on the committed results (no emulator, no training)."""

import json
import os
import shutil
import sys
import types

import pytest

from bench import analysis, plan as bp, run_bench as rb

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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

    fake = types.SimpleNamespace(estimate=estimate, predict_step_time=predict_step_time)
    import fl_accel.planning

    monkeypatch.setattr(fl_accel.planning, "cost", fake, raising=False)
    monkeypatch.setitem(sys.modules, "fl_accel.planning.cost", fake)
    monkeypatch.setitem(sys.modules, "scripts.model_units", types.SimpleNamespace(units_from_module=lambda m: ["unit"]))
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


def test_predict_with_the_real_cost_model(tmp_path):
    """With the real fl_accel.planning.cost, the predicted fl bytes equal the recipe's count."""
    raw = _committed_copy(tmp_path) / "raw"
    plan = _plan("--suite", "baselines", "--rates", "100mbit")
    spec = _rows(plan, "100mbit")["fl_fsdp"]
    run = analysis.read_run(str(raw / spec.path))
    p = analysis.predict(plan, spec, run, 1.5)
    assert "error" not in p, p
    assert p["bytes_run"]["fl"] == analysis.split_comm(run)["train"]["fl"]["bytes"]
    assert p["step_s"] > 1.5 and p["tokens_per_s"] < 4096 / 1.5


# ---------------------------------------------------------------------- report
def test_report_only_without_results_is_one_error(tmp_path, capsys):
    assert rb.main(["--report-only", "--name", "nothing-here", "--results-root", str(tmp_path),
                    "--work-root", str(tmp_path)]) == 2
    assert "run the benchmark first" in capsys.readouterr().err


# ---------------------------------------------------------------------- quality suites (no training)
FEDERATION_FLAGS = {"--algorithm", "--num_groups", "--sync_every", "--hsdp_shard_size", "--num_fragments",
                    "--sync_delay", "--sync_dtype", "--outer_optimizer", "--outer_lr", "--outer_momentum"}


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


def test_convergence_rows_differ_only_in_federation_flags():
    plan = _plan("--suite", "convergence")
    rows = {r.id: r for r in bp.runs_of(plan)}
    assert list(rows) == ["fsdp", "fl_fsdp-h8", "fl_fsdp-h8-nesterov", "fl_fsdp-h32", "fl_fsdp-h8-p2-tau1",
                          "fl_fsdp-h8-p2-tau2-int8-ef", "fl_fsdp-h8-nesterov-cosine", "fl_fsdp-h8-p2-tau2-sparse-ef",
                          "fsdp-seed43",
                          "fl_fsdp-h8-seed43"]
    args = {k: bp.recipe_args(plan, r, f"/o/{k}") for k, r in rows.items()}
    cosine = args.pop("fl_fsdp-h8-nesterov-cosine")
    assert _federation_part(cosine) == _federation_part(args["fl_fsdp-h8-nesterov"])
    extra = ["--outer_lr_schedule", "cosine", "--outer_lr_warmup_steps", "64"]
    at = _common_part(cosine).index(extra[0])
    assert _common_part(cosine)[at:at + 4] == extra
    assert _common_part(cosine)[:at] + _common_part(cosine)[at + 4:] == _common_part(args["fl_fsdp-h8-nesterov"])
    rows.pop("fl_fsdp-h8-nesterov-cosine")
    common = {tuple(_common_part(a)) for a in args.values()}
    assert len(common) == 1  # same tokens, data, model, schedule, evaluations, checkpoints
    c = list(common.pop())
    assert _flag(c, "--max_steps") == "832" and _flag(c, "--micro_batch_size") == "4" and _flag(c, "--seq_len") == "256"
    assert 832 * 4 * 4 * 256 >= 20 * 163_840
    assert _flag(c, "--eval_every") == "32" and _flag(c, "--resume_from_checkpoint") == "latest"
    assert _flag(c, "--checkpoint_every") == "64"
    assert {k: _flag(a, "--seed") for k, a in args.items()} == {k: "43" if k.endswith("seed43") else "42" for k in rows}
    fed = {k: _federation_part(a) for k, a in args.items()}
    assert fed["fsdp"] == ["--algorithm", "fsdp"] and fed["fsdp-seed43"] == fed["fsdp"]
    assert fed["fl_fsdp-h8"] == ["--algorithm", "fl_fsdp", "--num_groups", "2", "--sync_every", "8"]
    assert fed["fl_fsdp-h8-seed43"] == fed["fl_fsdp-h8"]
    assert fed["fl_fsdp-h8-nesterov"] == fed["fl_fsdp-h8"] + ["--outer_optimizer", "nesterov", "--outer_lr", "0.7",
                                                              "--outer_momentum", "0.9"]
    assert fed["fl_fsdp-h32"] == ["--algorithm", "fl_fsdp", "--num_groups", "2", "--sync_every", "32"]
    assert fed["fl_fsdp-h8-p2-tau1"] == fed["fl_fsdp-h8"] + ["--num_fragments", "2", "--sync_delay", "1"]
    assert fed["fl_fsdp-h8-p2-tau2-int8-ef"] == fed["fl_fsdp-h8"] + ["--num_fragments", "2", "--sync_delay", "2",
                                                                     "--sync_dtype", "int8", "--error_feedback"]
    assert fed["fl_fsdp-h8-p2-tau2-sparse-ef"] == fed["fl_fsdp-h8"] + ["--num_fragments", "2", "--sync_delay", "2",
                                                                       "--sync_dtype", "sparse", "--error_feedback"]
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
    assert list(rows)[-2:] == ["fsdp-seed43", "fl_fsdp-h8-seed43"]  # second seeds stay last


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


def test_interpolation_seed_band_and_time_to_target():
    curve = [{"tokens": 100, "loss": 9.0}, {"tokens": 200, "loss": 7.0}, {"tokens": 300, "loss": 6.0},
             {"tokens": 400, "loss": 6.5}]
    assert analysis.loss_at_tokens(curve, 150) == pytest.approx(8.0)
    assert analysis.loss_at_tokens(curve, 300) == 6.0 and analysis.loss_at_tokens(curve, 400) == 6.5
    assert analysis.loss_at_tokens(curve, 50) is None and analysis.loss_at_tokens(curve, 401) is None
    assert analysis.tokens_to_loss(curve, 6.5) == pytest.approx(250.0)  # first crossing, linear in tokens
    assert analysis.tokens_to_loss(curve, 9.5) == 100.0  # already there at the first evaluation
    assert analysis.tokens_to_loss(curve, 5.9) is None
    assert analysis.seed_band({"a": (5.0, 5.2), "b": (6.0, 5.95)}) == pytest.approx(0.2)
    assert analysis.seed_band({"a": (5.0, None)}) is None
    assert analysis.in_band(-0.3, 0.2) == pytest.approx(-1.5) and analysis.in_band(0.1, 0.0) is None
    assert analysis.time_to_target(1_000_000, 2_500.0) == 400.0 and analysis.time_to_target(None, 1.0) is None


def test_committed_throughput_and_predictions():
    """Measured tokens/s of the convergence rows come from the committed throughput suites;
    nesterov and H=32 have none (not the same exchange), so their figure is the model's."""
    plan = _plan("--suite", "convergence")
    rows = {r.id: r for r in bp.runs_of(plan)}
    committed = analysis.committed_throughput(os.path.join(REPO, "bench", "results"))
    assert committed["missing"] == []
    lt = {k: analysis.link_throughput(plan, rows[k], committed) for k in rows}
    assert lt["fl_fsdp-h8"]["100mbit"]["measured"] == pytest.approx((6155.1296 + 6513.0758) / 2, rel=1e-6)
    assert len(lt["fl_fsdp-h8"]["100mbit"]["sources"]) == 2
    assert lt["fsdp"]["1gbit"]["measured"] == pytest.approx(5453.795, rel=1e-6)
    assert lt["fsdp"]["10mbit"]["measured"] is None and lt["fsdp"]["10mbit"]["predicted"] > 0
    assert lt["fl_fsdp-h8-p2-tau2-int8-ef"]["10mbit"]["measured"] == pytest.approx(6692.491, rel=1e-6)
    assert lt["fl_fsdp-h8-p2-tau2-int8-ef"]["1gbit"]["measured"] is None
    for k in ("fl_fsdp-h8-nesterov", "fl_fsdp-h32"):
        assert all(v["measured"] is None and v["predicted"] for v in lt[k].values())
    # the seed row is the same configuration: same figures
    assert lt["fl_fsdp-h8-seed43"] == lt["fl_fsdp-h8"]
    # H=32 sends a quarter of H=8's sync bytes: faster on a slow link, same compute time
    assert lt["fl_fsdp-h32"]["10mbit"]["predicted"] > lt["fl_fsdp-h8"]["10mbit"]["predicted"]
    assert lt["fl_fsdp-h32"]["10mbit"]["compute_source"] == lt["fl_fsdp-h8"]["10mbit"]["compute_source"]
    # the model within 15% of the committed FL+FSDP measurements
    for link in ("1gbit", "100mbit", "10mbit"):
        v = lt["fl_fsdp-h8"][link]
        assert 0.85 < v["measured"] / v["predicted"] < 1.15, (link, v)


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


