"""Fast checks of bench/run_bench.py's logic (no emulator, no training): ``python -m pytest bench``."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run_bench as rb  # noqa: E402


def test_link_share():
    # FSDP over 4 ranks on 2 nodes: one ring hop leaves each node (1 -> 2, 3 -> 0)
    assert rb.link_share("dp_shard", (1, 1, 4), 2) == 1
    # FL+FSDP F=2 G=2: the "fl" axis has 2 concurrent 2-rank groups, both crossing
    assert rb.link_share("fl", (2, 1, 2), 2) == 2
    assert rb.link_share("dp_shard", (2, 1, 2), 2) == 0
    # HSDP R=2 S=2: replicas on different nodes, 2 concurrent groups
    assert rb.link_share("dp_replicate", (1, 2, 2), 2) == 2
    assert rb.link_share("dp_shard", (1, 2, 2), 2) == 0


def test_plan_validation():
    p = rb.build_parser()
    with pytest.raises(rb.BenchError, match="multiple of --sync-every"):
        rb.make_plan(p.parse_args(["--steps", "10", "--sync-every", "8"]))
    with pytest.raises(rb.BenchError, match="rates"):
        rb.make_plan(p.parse_args(["--rates", "fast"]))
    with pytest.raises(rb.BenchError, match="skip"):
        rb.make_plan(p.parse_args(["--skip", "everything"]))
    plan = rb.make_plan(p.parse_args(["--smoke"]))
    assert plan["name"] == "smoke" and plan["steps"] % plan["sync_every"] == 0
    full = rb.make_plan(p.parse_args([]))
    assert full["rates"] == ["1gbit", "100mbit"] and full["sync_every"] == 8


def test_runs_differ_only_in_algorithm():
    plan = rb.make_plan(rb.build_parser().parse_args(["--smoke"]))
    cmds = [rb.recipe_args(plan, a, "/o", "n", steps=4, sync_every=2, eval_every=2, report_to="none")
            for a in rb.ALGORITHMS]
    diffs = [{(i, x) for i, x in enumerate(c)} ^ {(i, x) for i, x in enumerate(cmds[0])} for c in cmds]
    i = cmds[0].index("--algorithm") + 1
    assert all(all(k == i for k, _ in d) for d in diffs)


def test_without_root_fails_clearly(monkeypatch, capsys):
    monkeypatch.setattr(rb.netemu, "check_privileges", lambda: (False, "netemu needs root/CAP_NET_ADMIN"))
    assert rb.main(["--smoke"]) == 1
    err = capsys.readouterr().err
    assert "needs root" in err and "--dry-run" in err


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
    res = {"comm": {"dp_shard": {"bytes": b, "seconds": 0.0}}, "steps": steps}
    (d / "all_results.json").write_text(json.dumps(res))
    return rb.read_run(str(d))


def test_split_comm_separates_evaluations(tmp_path):
    run = _fake_run(tmp_path, evals_at={2}, steps=4)
    c = rb.split_comm(run)
    assert c["n_evals"] == 2
    assert c["eval"]["dp_shard"]["bytes"] == 100
    assert c["train"]["dp_shard"]["bytes"] == 40


def test_step_times_and_ppl_interpolation(tmp_path):
    run = _fake_run(tmp_path, evals_at={2}, steps=4)
    assert rb.step_times(run) == {1: 1.0, 2: 1.5, 3: 1.0, 4: 1.5}
    assert rb.steady_step_times(run, sync_every=2, skip=2) == [1.0]
    # ppl 50 at t=2.5, 25 at t=5.0; 35.36 is halfway in log space
    assert rb.ppl_at_time(run, 50.0) == 2.5
    assert rb.ppl_at_time(run, (50 * 25) ** 0.5) == pytest.approx(3.75)
    assert rb.ppl_at_time(run, 1.0) is None
