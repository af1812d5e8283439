"""bench/ runs that start processes: the runner's dry run as a command, its launch over the
network emulator (root only), and run_local with a stand-in recipe. The plan, analysis and
report without processes: tests/unit/test_bench.py."""

import json
import os
import subprocess
import sys

import pytest

from bench import plan as bp

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _plan(*argv):
    return bp.make_plan(bp.build_parser().parse_args(list(argv)))


def _rows(plan, link=None, phase="main"):
    return {r.id: r for r in bp.runs_of(plan) if r.phase == phase and (link is None or r.link == link)}


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

