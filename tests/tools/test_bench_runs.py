"""bench/ runs that start processes: the runner's dry run as a command, reports (a report
records the machine, asking git for the commit; W&B offline logging starts wandb's service
process), the runner's launch over the network emulator (root only), and run_local with a
stand-in recipe. The plan and the analysis without processes: tests/unit/test_bench.py."""

import json
import os
import subprocess
import sys

import pytest

from bench import analysis, plan as bp, run_bench as rb
from unit.test_bench import _committed_copy, _plan, _rows, _write_fake_run  # helpers of the in-process tests

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


# ---------------------------------------------------------------------- report
def test_report_only_on_committed_results(tmp_path, monkeypatch, capsys):
    """``run_bench --report-only`` in this process (the ``python -m bench.run_bench`` entry point
    is exercised by the dry-run test)."""
    dst = _committed_copy(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rc = rb.main(["--report-only", "--name", "2026-11-30-cpu2", "--results-root", str(dst.parent),
                  "--work-root", str(tmp_path / "work")])
    assert rc == 0, capsys.readouterr().err[-3000:]
    table = (dst / "table.md").read_text()
    assert "| 100mbit | FL+FSDP" in table and "2.55x vs fsdp" in table
    assert "Checks against" not in table and "**+0.8%**" in table
    assert "| rate-100mbit/fsdp " in table  # the launches of the first version, from bench.json
    for png in ("ppl_vs_tokens.png", "time_to_ppl.png", "throughput.png"):
        assert (dst / png).stat().st_size > 1000
    assert (dst / "raw" / "rate-100mbit" / "fl_fsdp" / "all_results.json").is_file()
    assert "report rebuilt with" in (dst / "command.txt").read_text()



def test_analyze_and_report_a_convergence_suite(tmp_path):
    """Synthetic finished runs (4 evaluations each) through analyze_local and report_local."""
    plan = _plan("--suite", "convergence", "--steps", "128", "--work-root", str(tmp_path / "w"),
                 "--results-root", str(tmp_path / "r"))
    rows = {r.id: r for r in bp.runs_of(plan)}
    root = tmp_path / "w" / plan["name"]
    curves = {"fsdp": [8.0, 6.0, 5.5, 5.0], "fsdp-seed43": [8.0, 6.1, 5.6, 5.1],
              "fl_fsdp-h8": [8.2, 6.4, 5.6, 5.2], "fl_fsdp-h8-seed43": [8.2, 6.4, 5.7, 5.25],
              "fl_fsdp-h32": [8.5, 7.0, 6.5, 6.2]}  # the rest has not run yet
    for k, c in curves.items():
        _write_fake_run(root, rows[k], c)
    res = analysis.analyze_local(plan, str(root), os.path.join(REPO, "bench", "results"))
    assert res["band"]["loss"] == pytest.approx(0.1) and res["band"]["pairs"]["fl_fsdp-h8"] == pytest.approx(0.05)
    assert res["target"]["tokens"] == 64 * 16384 and res["target"]["loss"] == 6.0
    r = res["rows"]
    assert r["fl_fsdp-h8"]["diff_fsdp"] == pytest.approx(0.2) and r["fl_fsdp-h8"]["diff_fsdp_in_band"] == \
        pytest.approx(2.0)
    assert r["fl_fsdp-h32"]["diff_blocking_in_band"] == pytest.approx(10.0)
    assert r["fsdp"]["tokens_to_target"] == 64 * 16384
    # FL H=8 crosses 6.0 between 64 steps (6.4) and 96 steps (5.6): halfway
    assert r["fl_fsdp-h8"]["tokens_to_target"] == pytest.approx(80 * 16384)
    assert r["fl_fsdp-h32"]["tokens_to_target"] is None
    v = r["fl_fsdp-h8"]["links"]["100mbit"]
    assert v["time_to_target_measured_s"] == pytest.approx(80 * 16384 / v["measured"])
    assert res["status"]["fl_fsdp-h8-nesterov"]["state"] == "not started"
    from bench import report as br

    br.report_local(plan, {"command": plan["command"], "resume_command": "RESUME"}, str(root),
                    os.path.join(REPO, "bench", "results"))
    out = tmp_path / "r" / plan["name"]
    table = (out / "table.md").read_text()
    assert "Not finished yet" in table and "RESUME" in table and "Seed band = **0.1000**" in table
    assert "| FL+FSDP H=8 " in table and "(model)" in table
    guide = {g[0]: g[1:] for g in br.guide_rows(res)}
    # 100 Mbit/s: FL+FSDP (6,334 tokens/s measured) needs 80/64 of FSDP's tokens at 5.2x its speed
    assert guide["100mbit"][0].startswith("FL+FSDP H=8: ") and guide["100mbit"][1].startswith("FSDP: ")
    # seed 43 of FSDP crosses 6.0 at 64 + 32 x 0.1/0.5 = 70.4 steps: +10% tokens
    assert "Fastest to the target" in table and "FSDP: 1,048,576 vs 1,153,434 (+10.0%)" in table
    assert "(+2.9%)" in table and "the larger of these shares (10.0%)" in table  # FL's seeds: 80 vs 82.3 steps
    for png in ("eval_loss_vs_tokens.png", "ppl_vs_tokens.png", "time_to_target.png"):
        assert (out / png).stat().st_size > 1000
    assert (out / "raw" / "fsdp" / "metrics.jsonl").is_file() and not (out / "raw" / "fl_fsdp-h8-nesterov").exists()


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
    old = {"sessions": [{"started": "2026-01-01T00:00:00", "rc": 0, "wall_s": 10.0, "resumed_from_step": 0}]}
    new = {"sessions": [{"started": "2026-01-02T00:00:00", "rc": 0, "wall_s": 4002.0, "resumed_from_step": 0}]}
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

