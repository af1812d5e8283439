"""bench/peers.py and bench/peers_report.py: the peers suite's rows, plan, interleaving, commands,
medians and ranges, targets and time to target, and its results folder rebuilt from a synthetic
work folder and from the committed form (no emulator, no training). The workers' fragments
against fl_accel's units, and Accelerate's LocalSGD refusing FSDP, without processes."""

import json
import re
import os
import types

import pytest

from bench import peers
from bench import plan as bp, peers_report as pr

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _plan(tmp_path, *argv):
    args = peers.build_parser().parse_args(["--work-root", str(tmp_path / "work"), "--results-root",
                                            str(tmp_path / "res"), "--cache-dir", str(tmp_path / "cache"), *argv])
    args._argv = list(argv)
    return peers.make_plan(args)


# ---------------------------------------------------------------------- rows and plan
def test_rows_are_one_line_each_and_valid():
    ids = [r.id for r in peers.ROWS]
    assert len(set(ids)) == len(ids)
    for r in peers.ROWS:
        r.check()
    tools = {r.tool for r in peers.ROWS}
    assert tools == set(peers.TOOLS)
    for a, b, _ in peers.COMPARISONS:  # an fl_accel row against a peer
        assert {r.id: r for r in peers.ROWS}[a].tool == "fl_accel" and {r.id: r for r in peers.ROWS}[b].tool != \
            "fl_accel"
    by = {r.id: r for r in peers.ROWS}
    # equal settings: the fl_accel row and its torchft peer differ in the tool only
    for a, b in (("fl_accel-h8", "torchft-h8"), ("fl_accel-h8-p2-tau2", "torchft-h8-p2-tau2")):
        assert {**vars(by[a]), "id": 0, "tool": 0} == {**vars(by[b]), "id": 0, "tool": 0}
    best = by["fl_accel-h16-p2-tau2-int8-ef"]
    assert (best.sync_every, best.num_fragments, best.sync_delay, best.sync_dtype, best.error_feedback) == \
        (16, 2, 2, "int8", True)
    assert by["torchft-h8"].label == "torchft DiLoCo H=8 fp32 nesterov(0.7, 0.9)"
    assert by["torchft-h8-p2-tau2"].label.startswith("torchft Streaming DiLoCo H=8 P=2 tau=2")
    assert by["accelerate-localsgd-h8"].label == "Accelerate LocalSGD (DDP) H=8 fp32 avg"


@pytest.mark.parametrize("row, msg", [
    (peers.PeerRow("x", "torchft", 8, num_fragments=2, sync_delay=4), "tau=4 must be in"),
    (peers.PeerRow("x", "torchft", 8, num_fragments=3), "multiple of P"),
    (peers.PeerRow("x", "torchft", 8, sync_dtype="int8"), "CUDA-only"),
    (peers.PeerRow("x", "accelerate", 8, outer_optimizer="avg", num_fragments=2), "LocalSGD"),
    (peers.PeerRow("x", "accelerate", 8), "LocalSGD"),
    (peers.PeerRow("x", "deepspeed", 8), "tool must be"),
    (peers.PeerRow("x", "fl_accel", 8, num_fragments=2, sync_delay=9), r"tau=9 must be in \[0, H\]"),
])
def test_a_row_its_tool_cannot_run_is_refused(row, msg):
    with pytest.raises(peers.PeersError, match=msg):
        row.check()


def test_plan_defaults_smoke_and_validation(tmp_path):
    p = _plan(tmp_path)
    assert (p["links"], p["reps"], p["steps"], p["eval_every"]) == (["10mbit", "100mbit"], 3, 64, 8)
    assert p["learning_rate"] == 3e-4 and [r["id"] for r in p["rows"]] == [r.id for r in peers.ROWS]
    assert len(p["comparisons"]) == len(peers.COMPARISONS) and p["lighthouse"]["min_replicas"] == 2
    s = _plan(tmp_path, "--smoke")
    assert (s["links"], s["reps"], s["steps"], s["name"]) == (["100mbit"], 1, 32, "smoke-peers")
    assert s["command"] == "python -m bench.peers --smoke"
    only = _plan(tmp_path, "--rows", "torchft-h8,fl_accel-h8", "--steps", "8")
    assert [c[:2] for c in only["comparisons"]] == [["fl_accel-h8", "torchft-h8"]]
    for argv, msg in ((["--steps", "24"], "multiple of every row's H"), (["--rows", "torchft-h8,nope"], "unknown"),
                      (["--links", "fast"], "--links"), (["--reps", "0"], "--reps"), (["--eval-blocks", "8"],
                                                                                       "eval-blocks"),
                      (["--name", "a b"], "--name"), (["--learning-rate", "0"], "learning-rate")):
        with pytest.raises(peers.PeersError, match=msg):
            _plan(tmp_path, *argv)
    assert _plan(tmp_path, "--rows", "torchft-h8", "--steps", "24")["steps"] == 24  # H=8 rows only


def test_launch_order_is_interleaved_per_link(tmp_path):
    p = _plan(tmp_path, "--rows", "torchft-h8,fl_accel-h8,accelerate-localsgd-h8", "--links", "10mbit,100mbit",
              "--reps", "3")
    keys = [x.key for x in peers.launch_order(p)]
    assert len(keys) == 18 and keys[:7] == [
        "10mbit/torchft-h8/rep1", "10mbit/fl_accel-h8/rep1", "10mbit/accelerate-localsgd-h8/rep1",
        "10mbit/torchft-h8/rep2", "10mbit/fl_accel-h8/rep2", "10mbit/accelerate-localsgd-h8/rep2",
        "10mbit/torchft-h8/rep3"]
    assert all(k.startswith("100mbit/") for k in keys[9:])


def test_commands_of_each_tool(tmp_path):
    p = _plan(tmp_path)
    rows = peers.rows_by_id(p)
    emu = peers.DryEmulator(2, None)
    ft = peers.commands(p, rows["torchft-h8-p2-tau2"], "/w/x", emu, 29600, "10mbit")
    assert set(ft) == {"lighthouse", "node0", "node1"}
    assert "--bind <node0>:29601" in " ".join(ft["lighthouse"]) and "--min_replicas 2" in " ".join(ft["lighthouse"])
    for k in (0, 1):  # one torchrun world per replica group, on its own node, advertising its own address
        line = " ".join(ft[f"node{k}"])
        assert f"--nnodes 1 --node_rank 0 --master_addr <node{k}>" in line and f"--hostname <node{k}>" in line
        assert f"--replica_group {k} --num_replica_groups 2" in line and f"/w/x/group{k}" in line
        assert "--num_fragments 2 --sync_delay 2" in line and "torchft_diloco.py" in line
    overlap = " ".join(peers.commands(p, rows["fl_accel-h16-p2-tau16-keep-int8-ef"], "/w/o", emu, 29600,
                                      "10mbit")["node0"])
    assert "--num_fragments 2 --sync_delay 16 --sync_dtype int8 --sync_collectives all_to_all --error_feedback" in overlap
    gather = " ".join(peers.commands(p, rows["fl_accel-h16-p2-tau2-keep-int8-gather-ef"], "/w/g", emu, 29600,
                                     "10mbit")["node1"])
    assert "--sync_delay 2 --sync_dtype int8 --sync_collectives all_gather --error_feedback" in gather
    assert "--delayed_local_steps keep" in overlap  # issue 46: the exchange behind a whole round, steps kept
    fl = peers.commands(p, rows["fl_accel-h16-p2-tau2-int8-ef"], "/w/y", emu, 29600, "10mbit")
    line = " ".join(fl["node1"])
    assert "--nnodes 2 --node_rank 1 --master_addr <node0>" in line and "recipes/pretrain.py" in line
    for flag in ("--algorithm fl_fsdp --num_groups 2 --hsdp_shard_size 2 --sync_every 16",
                 "--num_fragments 2 --sync_delay 2 --sync_dtype int8 --sync_collectives all_to_all --error_feedback",
                 "--init_device cpu",
                 "--learning_rate 0.0003", "--output_dir /w/y"):
        assert flag in line
    assert "--outer_optimizer" not in line  # the plain average: the recipe's default
    eq = " ".join(peers.commands(p, rows["fl_accel-h8"], "/w/z", emu, 29600, "10mbit")["node0"])
    assert "--outer_optimizer nesterov --outer_lr 0.7 --outer_momentum 0.9" in eq
    ls = " ".join(peers.commands(p, rows["accelerate-localsgd-h8"], "/w/l", emu, 29600, "10mbit")["node0"])
    assert "accelerate_localsgd.py" in ls and "--nnodes 2" in ls and "--outer_optimizer avg" in ls
    # every row of a link trains the same data, steps, evaluations and LR
    for argv in (ft["node0"], fl["node0"], ls.split()):
        text = " ".join(argv)
        assert "--seed 42" in text and "--max_steps 64" in text and "--eval_every 8" in text
        assert "--max_eval_blocks 64" in text and "--micro_batch_size 4" in text and "--seq_len 256" in text


def test_dry_run_writes_nothing(tmp_path, capsys):
    assert peers.main(["--dry-run", "--smoke", "--work-root", str(tmp_path / "w"), "--results-root",
                       str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert out.count("[peers] ") == len(peers.ROWS) and "lighthouse:" in out
    assert not (tmp_path / "w").exists() and not (tmp_path / "r").exists()


def test_without_root_fails_clearly(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(peers.netemu, "check_privileges", lambda: (False, "netemu needs root/CAP_NET_ADMIN"))
    assert peers.main(["--smoke", "--work-root", str(tmp_path / "w")]) == 1
    assert "needs root" in capsys.readouterr().err


# ---------------------------------------------------------------------- statistics
def test_stats_overlap_ratio():
    assert pr.stats([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert pr.stats([4.0, 1.0, None, 2.0, 3.0])["median"] == 2.5  # an even count: the mean of the middle two
    assert pr.stats([None]) is None and pr.stats([]) is None
    a, b = pr.stats([1.0, 2.0, 3.0]), pr.stats([2.5, 4.0, 5.0])
    assert pr.overlap(a, b) is True and pr.overlap(a, pr.stats([3.5, 4.0])) is False and pr.overlap(a, None) is None
    assert pr.ratio(6.0, 3.0) == 2.0 and pr.ratio(1.0, 0) is None and pr.ratio(None, 1.0) is None


def _curve(losses, dt=10.0, tokens=1000):
    return [{"step": i, "tokens": i * tokens, "time_s": i * dt, "wall_s": i * dt + 5, "loss": x}
            for i, x in enumerate(losses, 1)]


def test_peer_target_and_time_to_target_are_measured_not_extrapolated():
    finals = [5.10, 5.20, 5.15]
    assert pr.peer_target(finals) == 5.20 and pr.peer_target([5.1, None]) is None and pr.peer_target([]) is None
    curves = [_curve([6.0, 5.5, 5.0]), _curve([6.0, 5.2, 5.1], dt=20.0), _curve([5.0, 4.0, 3.0])]
    t = pr.time_to_target(curves, 5.25)
    # linear between the evaluation before and the first at or below: 10 + (5.5-5.25)/(5.5-5.0) x 10 = 25;
    # 20 + (6.0-5.25)/(6.0-5.2) x 20 = 38.75; already below at the first evaluation: its seconds, 10
    assert t["per_rep"] == pytest.approx([25.0, 38.75, 10.0]) and t["reached"] == 3
    assert t["stats"]["median"] == pytest.approx(25.0) and t["stats"]["max"] == pytest.approx(38.75)
    missed = pr.time_to_target([_curve([6.0, 5.5, 5.3]), _curve([6.0, 5.0])], 5.25)
    assert missed["per_rep"][0] is None and missed["reached"] == 1 and missed["stats"] is None  # no extrapolation
    assert pr.common_tokens([_curve([1, 2, 3]), _curve([1, 2], tokens=1500)]) == [3000]


# ---------------------------------------------------------------------- a synthetic sitting
def _write_launch(plan, key, tool, losses, tokens_per_s, tx, dt=10.0, ok=True):
    d = os.path.join(plan["work"], key)
    os.makedirs(d, exist_ok=True)
    link, row, rep = key.split("/")
    steps = plan["steps"]
    tps = steps * 4096
    train_s = tps / tokens_per_s
    points = [(s, x) for s, x in zip(range(8, steps + 1, 8), losses)]
    if tool == "torchft":
        for g in range(2):
            os.makedirs(os.path.join(d, f"group{g}"))
            with open(os.path.join(d, f"group{g}", "metrics.jsonl"), "w") as fh:
                for s, x in points:  # each group scored half the rows; group 1's NLL a bit higher
                    tok = 1000
                    nll = (x + (0.01 if g else -0.01)) * tok
                    fh.write(json.dumps({"step": s, "tokens": s * 4096, "time_s": s * dt + g, "wall_s": s * dt + 9,
                                         "eval/loss": nll / tok, "eval/nll_sum": nll, "eval/tokens": tok}) + "\n")
            json.dump({"train_tokens": tps, "train_seconds": train_s + g, "startup_seconds": 20.0, "commits": 8,
                       "expected_commits": 8}, open(os.path.join(d, f"group{g}", "all_results.json"), "w"))
    else:
        with open(os.path.join(d, "metrics.jsonl"), "w") as fh:
            for s, x in points:
                fh.write(json.dumps({"step": s, "tokens": s * 4096, "time_s": 1.0, "train/loss": 9.0}) + "\n")
                fh.write(json.dumps({"step": s, "tokens": s * 4096, "time_s": s * dt, "wall_s": s * dt + 9,
                                     "eval/loss": x}) + "\n")
        json.dump({"train_tokens": tps, "train_seconds": train_s, "startup_seconds": 12.0},
                  open(os.path.join(d, "all_results.json"), "w"))
    json.dump({"link": link, "row": row, "rep": int(rep[3:]), "tool": tool, "sitting": "S1", "started": "t0",
               "ended": "t1", "loadavg_start": [1.5, 1.0, 1.0], "loadavg_end": [2.0, 1.0, 1.0],
               "background_cpu_share": 0.02, "wall_s": train_s + 30, "rc": 0 if ok else 1, "ok": ok,
               "veth": {"0": {"tx_bytes": tx, "rx_bytes": tx}, "1": {"tx_bytes": tx, "rx_bytes": tx}}},
              open(os.path.join(d, peers.RECORD), "w"))


def test_report_from_a_work_folder_and_from_the_committed_files(tmp_path, monkeypatch):
    monkeypatch.setattr(pr, "_machine", lambda: {"cpu_model": "test cpu", "nproc": 2, "versions": {"torchft": "0.2.0"}})
    p = _plan(tmp_path, "--name", "t-peers", "--rows", "torchft-h8,fl_accel-h8", "--links", "10mbit", "--reps", "3",
              "--steps", "32")
    os.makedirs(p["work"])
    json.dump(p, open(os.path.join(p["work"], "plan.json"), "w"))
    losses = {"torchft-h8": [7.0, 6.5, 6.2, 6.0], "fl_accel-h8": [7.0, 6.5, 6.2, 6.0]}
    for rep, (ft_tps, fl_tps) in enumerate(((1000, 1500), (1100, 1400), (900, 1600)), 1):
        _write_launch(p, f"10mbit/torchft-h8/rep{rep}", "torchft", losses["torchft-h8"], ft_tps, 30_000_000,
                      dt=10.0 * rep)
        _write_launch(p, f"10mbit/fl_accel-h8/rep{rep}", "fl_accel", losses["fl_accel-h8"], fl_tps, 29_000_000, dt=5.0)
    assert all(peers.finished(p, x) for x in peers.launch_order(p))
    json.dump({"S1": {"ended": "t9", "links": {"10mbit": {"achieved_bits_per_s": 9.5e6}}}},
              open(os.path.join(p["work"], peers.SITTINGS), "w"))
    pr.report(p)
    doc = json.load(open(os.path.join(p["results"], pr.PEERS_JSON)))
    s = doc["summary"]["10mbit"]
    ft, fl = s["rows"]["torchft-h8"], s["rows"]["fl_accel-h8"]
    # train_seconds of torchft is the later group's (+1 s): tokens/s 131072 / (131072/1000 + 1) etc.
    assert ft["tokens_per_s"]["n"] == 3 and ft["tokens_per_s"]["median"] == pytest.approx(131072 / (131072 / 1000 + 1))
    assert fl["tokens_per_s"] == {"median": 1500.0, "min": 1400.0, "max": 1600.0, "n": 3}
    assert ft["bytes_on_link"]["median"] == 60_000_000 and fl["bytes_on_link"]["median"] == 58_000_000
    # torchft's groups' parts add up: (x - 0.01 + x + 0.01) / 2 = x
    assert ft["final_eval_loss"]["median"] == pytest.approx(6.0) and s["targets"] == {"torchft-h8": pytest.approx(6.0)}
    assert s["common_tokens"] == [8 * 4096, 16 * 4096, 24 * 4096, 32 * 4096]
    # time to torchft's final loss: fl_accel reaches it at its last evaluation, 32 x 5 s; torchft at 32 x 10 x rep (+1)
    assert fl["to_target"]["torchft-h8"]["stats"]["median"] == pytest.approx(160.0)
    assert ft["to_target"]["torchft-h8"]["stats"]["median"] == pytest.approx(641.0)
    (c,) = s["comparisons"]
    assert c["tokens_per_s_ratio"] == pytest.approx(1500 / ft["tokens_per_s"]["median"])
    assert c["tokens_per_s_ranges_overlap"] is False and c["bytes_ratio"] == pytest.approx(58 / 60)
    assert c["loss_diff_before_end_max_abs"] == pytest.approx(0.0, abs=1e-12)
    assert c["equal_tokens_before_end"] == [8 * 4096, 16 * 4096, 24 * 4096]
    assert c["time_to_peer_target_speedup"] == pytest.approx(641.0 / 160.0)
    table = open(os.path.join(p["results"], "table.md")).read()
    assert "**One sitting**" in table and "(ended t9)" in table and "10mbit 9.50 Mbit/s" in table and "sudo python -m bench.peers" in table and "## 10mbit" in table
    assert "1,500 [1,400-1,600]" in table and "60.0" in table and "## Launches" in table
    assert len(open(os.path.join(p["results"], pr.CURVES)).read().splitlines()) == 1 + 6 * 4
    assert os.path.isfile(os.path.join(p["results"], pr.PLOT))
    # the committed form alone (no work folder) rebuilds the same summary
    import shutil

    shutil.rmtree(p["work"])
    pr.report_only(p)
    again = json.load(open(os.path.join(p["results"], pr.PEERS_JSON)))
    assert again["summary"] == doc["summary"] and again["launches"] == doc["launches"]
    shutil.rmtree(p["results"])
    with pytest.raises(pr.ReportError, match="nothing to report"):
        pr.report_only(p)


def test_the_no_sync_limit_row_gives_each_fl_accel_rows_share(tmp_path, monkeypatch):
    """Issue 46's done-when asks for a share of the no-sync limit measured in the same sitting: the
    limit row (fl_accel, H = 10^6) is exempt from the steps-multiple-of-H rule, runs the recipe with
    that H, and each fl_accel row's median tokens/s over its median is the table's column."""
    monkeypatch.setattr(pr, "_machine", lambda: {})
    limit = {r.id: r for r in peers.ROWS}["fl_accel-limit"]
    assert limit.is_limit and limit.label.startswith("fl_accel no sync (the limit")
    with pytest.raises(peers.PeersError, match="the no-sync limit is an fl_accel row"):
        peers.PeerRow("x", "torchft", bp.LIMIT_SYNC_EVERY).check()
    p = _plan(tmp_path, "--name", "t-limit", "--rows", "torchft-h8,fl_accel-h8,fl_accel-limit", "--links", "10mbit",
              "--reps", "3", "--steps", "16")
    line = " ".join(peers.commands(p, peers.rows_by_id(p)["fl_accel-limit"], "/w/l", peers.DryEmulator(2, None),
                                   29600, "10mbit")["node0"])
    assert f"--sync_every {bp.LIMIT_SYNC_EVERY}" in line and "--num_fragments" not in line
    for rep, (ft, fl, lim) in enumerate(((1000, 1500, 3000), (1100, 1400, 2900), (900, 1600, 3100)), 1):
        _write_launch(p, f"10mbit/torchft-h8/rep{rep}", "torchft", [6.5, 6.0], ft, 30_000_000)
        _write_launch(p, f"10mbit/fl_accel-h8/rep{rep}", "fl_accel", [6.5, 6.0], fl, 29_000_000)
        _write_launch(p, f"10mbit/fl_accel-limit/rep{rep}", "fl_accel", [6.4, 5.9], lim, 12_000_000)
    pr.report(p)
    rows = json.load(open(os.path.join(p["results"], pr.PEERS_JSON)))["summary"]["10mbit"]["rows"]
    assert rows["fl_accel-h8"]["of_limit"] == pytest.approx(1500 / 3000)
    assert rows["fl_accel-limit"]["of_limit"] is None and rows["torchft-h8"]["of_limit"] is None
    table = open(os.path.join(p["results"], "table.md")).read()
    assert "of the no-sync limit" in table and re.search(r"\| fl_accel-h8 .*\| 0\.50 +\|", table)


def test_an_unreached_target_a_failed_launch_and_missing_launches_are_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(pr, "_machine", lambda: {})
    p = _plan(tmp_path, "--name", "t2", "--rows", "torchft-h8,fl_accel-h8", "--links", "100mbit", "--reps", "2",
              "--steps", "16")
    _write_launch(p, "100mbit/torchft-h8/rep1", "torchft", [6.5, 6.0], 1000, 10)
    _write_launch(p, "100mbit/torchft-h8/rep2", "torchft", [6.5, 6.1], 1000, 10)
    _write_launch(p, "100mbit/fl_accel-h8/rep1", "fl_accel", [6.6, 6.05], 2000, 10)
    _write_launch(p, "100mbit/fl_accel-h8/rep2", "fl_accel", [6.6, 6.3], 2000, 10, ok=False)
    assert not peers.finished(p, peers.Launch("100mbit", "fl_accel-h8", 2))  # a failed launch runs again
    pr.report(p)
    s = json.load(open(os.path.join(p["results"], pr.PEERS_JSON)))["summary"]["100mbit"]
    assert s["targets"]["torchft-h8"] == pytest.approx(6.1)
    fl = s["rows"]["fl_accel-h8"]
    assert (fl["finished"], fl["failed"]) == (1, 1) and fl["to_target"]["torchft-h8"]["reached"] == 1
    table = open(os.path.join(p["results"], "table.md")).read()
    assert "1/2 (1 failed)" in table and "not a result" in table and "Not finished: 1 launch" in table


def test_a_continued_sitting_must_keep_its_settings(tmp_path):
    p = _plan(tmp_path, "--name", "t3", "--rows", "torchft-h8", "--steps", "8")
    assert peers.check_resumable(p) is None
    os.makedirs(p["work"])
    json.dump(p, open(os.path.join(p["work"], "plan.json"), "w"))
    assert peers.check_resumable(p)["steps"] == 8
    with pytest.raises(peers.PeersError, match="steps"):
        peers.check_resumable(_plan(tmp_path, "--name", "t3", "--rows", "torchft-h8", "--steps", "16"))


def test_veth_bytes_reads_sysfs_inside_each_namespace(monkeypatch):
    calls = []

    def fake_run(argv, **kw):
        calls.append(argv)
        return types.SimpleNamespace(returncode=0, stdout="123\n456\n", stderr="")

    monkeypatch.setattr(peers.subprocess, "run", fake_run)
    emu = types.SimpleNamespace(nodes=2, ifname=lambda k: f"veth{k}", namespace=lambda k: f"ns{k}")
    assert peers.veth_bytes(emu) == {"0": {"tx_bytes": 123, "rx_bytes": 456}, "1": {"tx_bytes": 123, "rx_bytes": 456}}
    assert calls[1][:4] == ["ip", "netns", "exec", "ns1"] and calls[1][-2:] == [
        "/sys/class/net/veth1/statistics/tx_bytes", "/sys/class/net/veth1/statistics/rx_bytes"]


def test_wait_all_returns_the_worst_own_exit_code_and_times_out():
    import subprocess
    import sys

    from scripts.launch import start

    ok = [start([sys.executable, "-c", "pass"]) for _ in range(2)]
    assert peers.wait_all(ok, timeout=60) == 0
    bad = [start([sys.executable, "-c", "import sys; sys.exit(3)"]), start([sys.executable, "-c",
                                                                          "import time; time.sleep(60)"])]
    assert peers.wait_all(bad, timeout=60, grace=0.5) == 3
    slow = [start([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.DEVNULL)]
    assert peers.wait_all(slow, timeout=0.5) == 124 and slow[0].poll() is not None


# ---------------------------------------------------------------------- the workers' pieces
def test_fragments_are_fl_accels_units_dealt_round_robin():
    """fl_accel's fragment_plan of the tiny preset at P=2 (FLAccelerator.federation.fragment_plan, read on 4 gloo
    ranks): [embedding, layers 1, 3] and [layers 0, 2, final norm, LM head]; the peers deal the same."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from bench.peers_workers.common import deal, fsdp_units
    from recipes.modeling import PRESETS

    model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, **PRESETS["tiny"]))
    units = fsdp_units(model)
    assert len(units) == 6
    names = {id(p): n for n, p in model.named_parameters()}
    frags = [sorted({".".join(names[id(p)].split(".")[:3]) if ".layers." in names[id(p)] else names[id(p)]
                     for p in f.parameters()}) for f in deal(units, 2)]
    assert frags == [["model.embed_tokens.weight", "model.layers.1", "model.layers.3"],
                     ["lm_head.weight", "model.layers.0", "model.layers.2", "model.norm.weight"]]
    assert len(deal(units, 1)) == 1 and sum(1 for _ in deal(units, 1)[0].parameters()) == \
        sum(1 for _ in model.parameters())
    with pytest.raises(ValueError, match="num_fragments"):
        deal(units, 7)


def test_accelerate_localsgd_refuses_fsdp():
    """The reason the Accelerate row runs DDP: LocalSGD's constructor raises for FSDP."""
    import torch
    from accelerate import DistributedType
    from accelerate.local_sgd import LocalSGD

    with pytest.raises(NotImplementedError):
        LocalSGD(types.SimpleNamespace(distributed_type=DistributedType.FSDP), torch.nn.Linear(2, 2), 8)
    LocalSGD(types.SimpleNamespace(distributed_type=DistributedType.MULTI_CPU), torch.nn.Linear(2, 2), 8)


def test_workers_refuse_bad_flags_before_any_collective():
    from bench.peers_workers import accelerate_localsgd, common, torchft_diloco

    base = ["--max_steps", "16", "--sync_every", "8", "--cache_dir", "/c", "--output_dir", "/o"]
    ft = ["--replica_group", "0", "--num_replica_groups", "2", "--hostname", "h", "--lighthouse", "http://h:1"]
    with pytest.raises(ValueError, match="sync_delay"):
        torchft_diloco.check(torchft_diloco.build_parser().parse_args(base + ft + ["--num_fragments", "2",
                                                                                   "--sync_delay", "4"]))
    with pytest.raises(ValueError, match="multiple of --sync_every"):
        common.check_common(torchft_diloco.build_parser().parse_args(
            ["--max_steps", "12", "--sync_every", "8", "--cache_dir", "/c", "--output_dir", "/o"] + ft))
    with pytest.raises(ValueError, match="replica_group"):
        torchft_diloco.check(torchft_diloco.build_parser().parse_args(base + ft[:1] + ["2"] + ft[2:]))
    with pytest.raises(ValueError, match="averages the parameters"):
        accelerate_localsgd.main(base)  # nesterov (the default) is not LocalSGD's
    assert common.eval_interval(8, 16) == 16 and common.eval_interval(8, 8) == 8
