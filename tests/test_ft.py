"""Federation groups that fail alone (``FLConfig(fault_tolerance="torchft")``, fl_accel/ft.py).

Real processes over gloo: a torchft Lighthouse, one torchrun per federation group (FSDP2
over the group's ranks, the tiny Llama of tests/workers/ft_worker.py), started with
scripts/ft_launch.py's functions, as a user would.

* Without faults the mode changes nothing: 2 groups x 2 ranks equal the single world
  (4 ranks, the same worker) at every optimizer step, bitwise (fp32 "avg").
* A group dies and comes back: every process of group 1 is SIGKILLed mid-round and
  restarted; group 0 keeps stepping alone, group 1 heals from it (parameters, inner
  optimizer state, anchor, momentum, counters, LR equal group 0's, bitwise) and both end
  equal after the final sync.
* Three groups: both ranks of a recovering group heal from one source group (the torchft
  #343 guard), and all groups end equal.
* The recipe runs in the mode (scripts/ft_launch.py): each group trains, logs and
  evaluates into its own folder, and the groups' final eval losses are equal.
* Unequal groups are refused on every rank before any collective.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time

import pytest
import torch

from fl_accel import FLConfig
from tests._launch import REPO_ROOT, WORKERS, launch_env, run_torchrun, write_json

torchft = pytest.importorskip("torchft", reason="torchft is not installed (pip install torchft==0.2.0): "
                                                "the fault-tolerant mode and its tests need it")

from scripts import ft_launch  # noqa: E402
from scripts.launch import terminate, wait  # noqa: E402

WORKER = WORKERS / "ft_worker.py"
SYNC_WORKER = WORKERS / "sync_worker.py"
G = 2  # ranks per federation group


def _group(f, spec, out, lighthouse, env=None, log=None):
    return ft_launch.start_group(f, G, WORKER, spec, out, lighthouse=lighthouse, cwd=REPO_ROOT,
                                 stdout=log, stderr=subprocess.STDOUT if log else None,
                                 env={"FL_ACCEL_COLLECTIVE_TIMEOUT_S": "60", **(env or {})},
                                 pythonpath=[str(REPO_ROOT)])


def _load(path):
    return torch.load(path, weights_only=False)


def _log_tail(path, n=4000):
    return path.read_text()[-n:] if path.exists() else "(no log)"


def _assert_state_equal(a, b, what):
    """Bitwise equality of two ``full_state`` records (tensors in nested dicts/lists)."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(a, b), f"{what}: max |diff| {(a.float() - b.float()).abs().max().item()}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{what}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _assert_state_equal(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{what}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_state_equal(x, y, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


# ---------------------------------------------------------------------- no faults
PARITY = [  # (case, FLConfig fields, optimizer, largest allowed |difference| (0: bitwise))
    ("fp32_avg", {"sync_every": 4}, "sgd", 0.0),
    ("nesterov", {"sync_every": 4, "outer_optimizer": "nesterov"}, "adamw", 1e-6),
    ("int8_ef_fragments", {"sync_every": 4, "num_fragments": 2, "sync_delay": 1, "sync_dtype": "int8",
                           "error_feedback": True}, "adamw", 1e-6),
]


@pytest.mark.parametrize("case,fl,optimizer,tol", PARITY, ids=[c[0] for c in PARITY])
def test_torchft_mode_equals_single_world(tmp_path, case, fl, optimizer, tol):
    """2 groups x 2 ranks, 8 optimizer steps: the local shards of every rank after every
    optimizer step equal those of the single-world run (4 ranks, same worker, same data
    slices): bitwise for fp32 "avg", within 1e-6 for "nesterov" and for fragments (P=2,
    tau=1) with int8 + error feedback. Every quorum had both groups, none healed; for
    fp32 "avg" the groups differ before each sync and are equal after it."""
    spec = write_json(tmp_path / "spec.json", {"fl": {"algorithm": "fl_fsdp", "num_groups": 2, **fl},
                                               "optimizer": optimizer, "lr": 0.05 if optimizer == "sgd" else 1e-3,
                                               "max_steps": 8, "record_steps": True})
    single = run_torchrun(2 * G, WORKER, spec, tmp_path / "single", timeout=240)
    assert single.ok, single.tail()

    lh_log = open(tmp_path / "lighthouse.log", "w")
    lighthouse, addr = ft_launch.start_lighthouse(log=lh_log, min_replicas=2)  # every quorum waits for both
    logs = [tmp_path / f"group{f}.log" for f in range(2)]
    groups = []
    try:
        groups += [_group(f, spec, tmp_path / "ft", addr, log=open(logs[f], "w")) for f in range(2)]
        codes = [wait(g, 240).returncode for g in groups]
    finally:
        for g in groups:
            ft_launch.kill_group(g)
        terminate(lighthouse)
    assert codes == [0, 0], "\n".join(_log_tail(p) for p in logs)

    parts = fl.get("num_fragments", 1)
    events = 8 // (4 // parts) + (parts > 1)  # fragment syncs leave the groups apart: end_training syncs all
    worst = 0.0
    for f in range(2):
        for k in range(G):
            ft_rec = _load(tmp_path / "ft" / f"g{f}_r{k}_a0.pt")
            ref = _load(tmp_path / "single" / f"g{f}_r{f * G + k}_a0.pt")
            assert [s for s, _ in ft_rec["steps"]] == list(range(1, 9)) == [s for s, _ in ref["steps"]]
            for (step, got), (_, want) in zip(ft_rec["steps"], ref["steps"]):
                for i, (x, y) in enumerate(zip(got, want)):
                    diff = (x - y).abs().max().item()
                    worst = max(worst, diff)
                    assert diff <= tol and (tol or torch.equal(x, y)), f"group {f} rank {k} step {step} param {i}: {diff}"
            finals = list(zip(ft_rec["final"]["params"], ref["final"]["params"]))
            for i, (x, y) in enumerate(finals):
                diff = (x - y).abs().max().item()
                worst = max(worst, diff)
                assert diff <= tol and (tol or torch.equal(x, y)), f"group {f} rank {k} final param {i}: {diff}"
            assert [q["num_groups"] for q in ft_rec["quorums"]] == [2] * events
            assert not any(q["healed"] for q in ft_rec["quorums"])
    print(f"\n[{case}] largest |torchft - single world| over every step and shard: {worst:.3g}")
    if case == "fp32_avg":
        for k in range(G):
            g0, g1 = (_load(tmp_path / "ft" / f"g{f}_r{k}_a0.pt")["steps"] for f in range(2))
            for step in range(1, 9):
                same = all(torch.equal(x, y) for x, y in zip(g0[step - 1][1], g1[step - 1][1]))
                assert same == (step % 4 == 0), f"rank {k} step {step}: groups equal={same}"


# ---------------------------------------------------------------------- a group dies
def _progress(out, f, k=0):
    path = out / "progress" / f"g{f}_r{k}"
    try:
        step, t, attempt = path.read_text().split()
        return int(step), float(t), attempt
    except (OSError, ValueError):
        return -1, 0.0, ""


def _wait_for(cond, timeout, what, procs=()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        for p in procs:
            assert p.poll() is None, f"{what}: a launch exited early with status {p.returncode}"
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


KILLS = [  # (case, FLConfig fields, kill at the first step of group 1 >= this with this parity)
    ("blocking", {"sync_every": 4}, 6, 0),
    # P=2, tau=1: a fragment's exchange launches at odd steps and is applied at the next one
    ("exchange_in_flight", {"sync_every": 4, "num_fragments": 2, "sync_delay": 1, "sync_dtype": "int8",
                            "error_feedback": True, "outer_optimizer": "nesterov"}, 5, 1),
]


@pytest.mark.parametrize("case,fl,kill_step,parity", KILLS, ids=[c[0] for c in KILLS])
def test_group_killed_mid_round_heals_from_live_group(tmp_path, case, fl, kill_step, parity):
    """2 groups x 2 ranks, H=4, AdamW with a LambdaLR. Every process of group 1 (its
    torchrun and workers) gets SIGKILL mid-round (blocking sync: at step 6; P=2, tau=1 with
    int8 + error feedback and "nesterov": right after an odd step, while a fragment's
    exchange is in flight); group 0 keeps taking steps alone; group 1 restarts 3 s later,
    heals at its first sync from group 0 over torchft's HTTP transport, and then:

    * on every rank its parameters, AdamW state, anchor/momentum (none for fp32 "avg"),
      sync counters (fragment phase), LR and LR-scheduler state right after the heal are bitwise group 0's
      at that quorum;
    * both groups end bitwise equal (parameters, counters) after the final sync, and
      group 0 never exited.
    """
    out = tmp_path / "out"
    spec = write_json(tmp_path / "spec.json", {
        "fl": {"algorithm": "fl_fsdp", "num_groups": 2, **fl}, "optimizer": "adamw", "lr": 1e-3,
        "scheduler": True, "max_steps": 400, "stop_file": True, "step_sleep": 0.15})
    lighthouse, addr = ft_launch.start_lighthouse(log=open(tmp_path / "lighthouse.log", "w"), min_replicas=1)
    logs = {name: tmp_path / f"{name}.log" for name in ("g0", "g1a0", "g1a1")}
    procs, g1 = [], None
    try:
        g0 = _group(0, spec, out, addr, log=open(logs["g0"], "w"))
        g1 = _group(1, spec, out, addr, env={"FT_TEST_ATTEMPT": "0"}, log=open(logs["g1a0"], "w"))
        procs = [g0, g1]
        _wait_for(lambda: _progress(out, 1)[0] >= kill_step and _progress(out, 1)[0] % 2 == parity, 150,
                  f"group 1 at step {kill_step}", procs)
        killed = ft_launch.kill_group(g1)  # kill -9 every process of group 1: torchrun and its workers
        assert len(killed) == 1 + G, killed
        step_at_kill, t_kill, _ = _progress(out, 0)
        time.sleep(3.0)
        assert g0.poll() is None, _log_tail(logs["g0"])
        g1b = _group(1, spec, out, addr, env={"FT_TEST_ATTEMPT": "1"}, log=open(logs["g1a1"], "w"))
        procs = [g0, g1b]
        t_restart = time.time()
        _wait_for(lambda: all((out / "healed" / f"g1_r{k}_a1").exists() for k in range(G)), 150,
                  "group 1 to heal", procs)
        (out / "stop_at").write_text(str(max(_progress(out, f)[0] for f in range(2)) + 8))
        codes = [wait(p, 150).returncode for p in procs]
    finally:
        for p in {p for p in procs + [g1] if p is not None}:
            ft_launch.kill_group(p)
        terminate(lighthouse)
    assert codes == [0, 0], "\n".join(f"--- {n}\n{_log_tail(p)}" for n, p in logs.items())

    final_step = int((out / "stop_at").read_text())
    for k in range(G):
        src = _load(out / f"g0_r{k}_a0.pt")
        healed = _load(out / f"g1_r{k}_a1.pt")
        # group 0 stepped alone during the outage, and never restarted
        alone = [s for s, t in src["times"] if t_kill < t < t_restart]
        assert len(alone) >= 3 and min(alone) > step_at_kill - 1, (step_at_kill, alone)
        heal = [q for q in healed["quorums"] if q["healed"]]
        assert len(heal) == 1 and healed["heals"] == 1, [(q["manager_step"], q["healed"]) for q in healed["quorums"]]
        peer = [q for q in src["quorums"] if q["manager_step"] == heal[0]["manager_step"]]
        assert len(peer) == 1 and peer[0]["num_groups"] == 2
        _assert_state_equal(heal[0]["state"], peer[0]["state"], f"rank {k} after the heal")
        assert heal[0]["state"]["schedule"]["global_step"] > 8  # it took over group 0's count
        assert heal[0]["state"]["optimizer"][0]["exp_avg"].abs().sum() > 0  # AdamW state came along
        if fl.get("outer_optimizer") == "nesterov":
            assert heal[0]["state"]["outer"][0]["momentum"].abs().sum() > 0  # so did the outer momentum
        for name in ("params", "schedule"):
            _assert_state_equal(healed["final"][name], src["final"][name], f"rank {k} final {name}")
        assert src["final"]["schedule"]["global_step"] == final_step


def test_three_groups_recovering_ranks_heal_from_one_source(tmp_path):
    """torchft #343 guard: 3 groups x 2 ranks, H=4, AdamW. Every process of group 1 gets
    SIGKILL mid-round and restarts 3 s later. With two up-to-date groups torchft 0.2.0
    assigns rank 0 and rank 1 of the recovering group different sources (recorded as
    ``torchft_source``); with the guard both ranks heal from rank 0's source, record the
    same ``source``, and their state right after the heal is bitwise that source group's
    at the same quorum; that sync's mean is over groups 0 and 2 only (the healed copy has
    weight 0, the source does not count twice). Groups 0 and 2 never exit, and all three groups end bitwise equal
    after the final sync."""
    out = tmp_path / "out"
    spec = write_json(tmp_path / "spec.json", {
        "fl": {"algorithm": "fl_fsdp", "num_groups": 3, "sync_every": 4}, "optimizer": "adamw", "lr": 1e-3,
        "scheduler": True, "max_steps": 400, "stop_file": True, "step_sleep": 0.15, "record_steps": True})
    lighthouse, addr = ft_launch.start_lighthouse(log=open(tmp_path / "lighthouse.log", "w"), min_replicas=1)
    logs = {name: tmp_path / f"{name}.log" for name in ("g0", "g1a0", "g2", "g1a1")}
    procs, g1 = [], None
    try:
        g0 = _group(0, spec, out, addr, log=open(logs["g0"], "w"))
        g1 = _group(1, spec, out, addr, env={"FT_TEST_ATTEMPT": "0"}, log=open(logs["g1a0"], "w"))
        g2 = _group(2, spec, out, addr, log=open(logs["g2"], "w"))
        procs = [g0, g1, g2]
        _wait_for(lambda: _progress(out, 1)[0] >= 6, 240, "group 1 at step 6", procs)
        ft_launch.kill_group(g1)
        time.sleep(3.0)
        assert g0.poll() is None and g2.poll() is None
        g1b = _group(1, spec, out, addr, env={"FT_TEST_ATTEMPT": "1"}, log=open(logs["g1a1"], "w"))
        procs = [g0, g1b, g2]
        _wait_for(lambda: all((out / "healed" / f"g1_r{k}_a1").exists() for k in range(G)), 240,
                  "group 1 to heal", procs)
        (out / "stop_at").write_text(str(max(_progress(out, f)[0] for f in range(3)) + 8))
        codes = [wait(p, 240).returncode for p in procs]
    finally:
        for p in {p for p in procs + [g1] if p is not None}:
            ft_launch.kill_group(p)
        terminate(lighthouse)
    assert codes == [0, 0, 0], "\n".join(f"--- {n}\n{_log_tail(p)}" for n, p in logs.items())

    healed = [_load(out / f"g1_r{k}_a1.pt") for k in range(G)]
    sources = [h["heal_sources"] for h in healed]
    print(f"\nheal sources per rank of group 1: {sources}")
    assert all(len(s) == 1 for s in sources), sources
    agreed = {s[0]["source"] for s in sources}
    assert len(agreed) == 1 and agreed <= {"fl_accel_group_0", "fl_accel_group_2"}, sources
    assert len({s[0]["torchft_source"] for s in sources}) == 2, sources  # torchft alone would have split them
    src_group = int(agreed.pop().rsplit("_", 1)[1])
    for k in range(G):
        heal = [q for q in healed[k]["quorums"] if q["healed"]]
        assert len(heal) == 1 and healed[k]["heals"] == 1
        src = _load(out / f"g{src_group}_r{k}_a0.pt")
        peer = [q for q in src["quorums"] if q["manager_step"] == heal[0]["manager_step"]]
        assert len(peer) == 1 and peer[0]["num_groups"] == 3
        _assert_state_equal(heal[0]["state"], peer[0]["state"], f"rank {k} after the heal from group {src_group}")
        # the heal's sync averages the two live groups only: the healed copy of the source has weight 0
        other = _load(out / f"g{2 - src_group}_r{k}_a0.pt")
        mine = [q for q in other["quorums"] if q["manager_step"] == heal[0]["manager_step"]][0]["state"]["params"]
        step = heal[0]["state"]["schedule"]["global_step"]
        after = [p for s_, p in src["steps"] if s_ == step][0]
        for i, (a, b, c) in enumerate(zip(peer[0]["state"]["params"], mine, after)):
            assert torch.allclose(c, (a + b) / 2, rtol=0, atol=1e-6), f"rank {k} param {i} after the heal's sync"
        assert max((c - (2 * a + b) / 3).abs().max().item() for a, b, c in
                   zip(peer[0]["state"]["params"], mine, after)) > 1e-5  # not the source counted twice
        finals = [_load(out / f"g{f}_r{k}_a{1 if f == 1 else 0}.pt")["final"] for f in range(3)]
        for f in (1, 2):
            for name in ("params", "schedule"):
                _assert_state_equal(finals[f][name], finals[0][name], f"rank {k} group {f} final {name}")


# ---------------------------------------------------------------------- the recipe
RECIPE_ARGS = ["--model", "tiny", "--seq_len", "64", "--micro_batch_size", "2", "--max_steps", "4", "--log_every",
               "1", "--eval_every", "2", "--max_eval_blocks", "16", "--sync_every", "2", "--num_groups", "2",
               "--report_to", "none"]


def test_recipe_trains_each_group_in_its_own_folder(tmp_path):
    """``python -m scripts.ft_launch --num_groups 2 --nproc_per_group 2 --min_replicas 2 --
    recipes/pretrain.py --fault_tolerance torchft ...`` (every quorum waits for both groups, so
    a slow start of one group cannot leave the other syncing alone; one launch: a Lighthouse and two torchruns of 2 ranks,
    the tiny Llama, 4 steps, H=2): both groups exit 0 and each writes its own
    ``<output_dir>/group<f>`` (all_results.json, metrics.jsonl), with figures gathered over
    its own 2 ranks only (traffic of one group, tokens of 2 ranks; the exchange over
    torchft's process group counted in "fl"); the eval losses after
    the syncs (steps 2 and 4) are equal in both groups, bitwise (fp32 "avg": the groups
    hold the same parameters); results record the torchft mode, the group and the
    synchronizer's counters (2 syncs, no heal)."""
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "scripts.ft_launch", "--num_groups", "2", "--nproc_per_group", str(G),
            "--min_replicas", "2", "--log_dir", str(tmp_path / "logs"), "--", "recipes/pretrain.py", "--fault_tolerance", "torchft",
            *RECIPE_ARGS, "--output_dir", str(out), "--cache_dir", str(tmp_path / "cache")]
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=480)
    finally:
        if proc.poll() is None:
            ft_launch.kill_group(proc)
    logs = "\n".join(_log_tail(tmp_path / "logs" / f"group{f}.log") for f in range(2))
    assert proc.returncode == 0 and "group exit statuses: [0, 0]" in stdout, stdout + logs
    results = [json.loads((out / f"group{f}" / "all_results.json").read_text()) for f in range(2)]
    for f, r in enumerate(results):
        assert r["fault_tolerance"]["mode"] == "torchft" == r["fl"]["fault_tolerance"], r["fault_tolerance"]
        assert r["fault_tolerance"]["group_index"] == f and r["fault_tolerance"]["group_world_size"] == G
        assert r["fault_tolerance"]["heals"] == 0 and r["fault_tolerance"]["steps_trained"] == 4
        assert r["fault_tolerance"]["sync"]["global_step"] == 4 and r["fault_tolerance"]["sync"]["num_syncs"] == 2
        assert r["steps"] == 4 and r["num_groups"] == 2 and r["world_size"] == 2 * G
        assert r["train_tokens"] == 4 * G * 2 * 64  # this group's tokens only: 2 ranks x 2 blocks x 64 tokens
        assert len(r["comm_by_group"]) == 1 and r["comm"]["world"]["calls"] > 0  # gathered in its own world
        assert r["comm"]["fl"]["bytes"] > 0 and r["comm"]["fl"]["calls"] >= 2, r["comm"]["fl"]  # 2 syncs
        assert math.isfinite(r["eval_loss"]) and r["eval_scored"] == "synchronized"
    assert results[0]["eval_loss"] == results[1]["eval_loss"], [r["eval_loss"] for r in results]
    evals = [{m["step"]: m["eval/loss"] for m in map(json.loads, (out / f"group{f}" / "metrics.jsonl").open())
              if "eval/loss" in m} for f in range(2)]
    assert sorted(evals[0]) == [2, 4] and evals[0] == evals[1], evals
    for f in range(2):  # train records carry the wall clock: the groups are separate launches
        train = [m for m in map(json.loads, (out / f"group{f}" / "metrics.jsonl").open()) if "train/loss" in m]
        assert [m["step"] for m in train] == [1, 2, 3, 4] and all(m["unix_time"] > 0 for m in train)


@pytest.mark.parametrize("flags,text", [(["--checkpoint_every", "2"], "--checkpoint_every is not supported"),
                                        (["--resume_from_checkpoint", "latest"], "--resume_from_checkpoint is not"),
                                        (["--eval_groups"], "--eval_groups is not supported")])
def test_recipe_refuses_unsupported_flags_in_torchft_mode(tmp_path, flags, text):
    """The recipe's planning (pure Python, every rank before any collective) refuses flags
    the torchft mode does not support, naming the flag; without them it plans the
    federation's layout (F groups of this launch's world) and the group's own folder."""
    from recipes.args import RecipeError
    from recipes.run_folder import plan_run

    environ = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "FL_ACCEL_GROUP_INDEX": "1"}
    base = ["--fault_tolerance", "torchft", *RECIPE_ARGS, "--output_dir", str(tmp_path)]
    with pytest.raises(RecipeError, match=text):
        plan_run(base + flags, environ=environ)
    plan = plan_run(base, environ=environ)
    assert plan.layout.world_size == 4 and plan.layout.num_groups == 2
    assert plan.args.output_dir == str(tmp_path / "group1")


# ---------------------------------------------------------------------- refusals
def test_unequal_groups_refused_in_config():
    """FLConfig refuses unequal group_sizes with torchft at construction (pure Python), naming the field."""
    with pytest.raises(ValueError, match=r"fault_tolerance='torchft' does not support unequal groups"):
        FLConfig(algorithm="fl_hsdp", group_sizes=[2, 4], hsdp_shard_size=2, fault_tolerance="torchft",
                 group_index=0)
    with pytest.raises(ValueError, match="group_index must be set"):
        FLConfig(fault_tolerance="torchft")
    with pytest.raises(ValueError, match=r"group_index must be in \[0, num_groups=2\)"):
        FLConfig(fault_tolerance="torchft", group_index=2)
    with pytest.raises(ValueError, match="needs a federated algorithm"):
        FLConfig(algorithm="fsdp", fault_tolerance="torchft", group_index=0)
    assert FLConfig(group_sizes=[2, 2], fault_tolerance="torchft", group_index=1).federation_size == 2


REFUSED = [  # (case, fl or None for the environment below, text of the ValueError)
    ("unequal_dict", {"algorithm": "fl_hsdp", "group_sizes": [2, 4], "hsdp_shard_size": 2,
                      "fault_tolerance": "torchft", "group_index": 0}, "does not support unequal groups"),
    ("no_lighthouse", {"fault_tolerance": "torchft", "group_index": 0}, "needs the Lighthouse's address"),
    ("unequal_env", None, "does not support unequal groups"),
]


def test_unequal_groups_refused_on_every_rank_before_any_collective(tmp_path):
    """A group launch (2 ranks) whose config asks for unequal groups in the torchft mode,
    by FLConfig fields or by FL_ACCEL_* variables, and one without a Lighthouse address:
    every rank raises ValueError in the FLAccelerator constructor, before
    torch.distributed is initialized, and the launch fails on its own."""
    cases = [{"name": n} | ({"fl": fl} if fl is not None else {}) for n, fl, _ in REFUSED]
    spec = write_json(tmp_path / "spec.json", {"mode": "bad_configs", "cases": cases})
    env = {"FL_ACCEL_FAULT_TOLERANCE": "torchft", "FL_ACCEL_ALGORITHM": "fl_hsdp", "FL_ACCEL_GROUP_SIZES": "2,4",
           "FL_ACCEL_HSDP_SHARD_SIZE": "2", "FL_ACCEL_GROUP_INDEX": "0", "TORCHFT_LIGHTHOUSE": ""}
    res = run_torchrun(G, SYNC_WORKER, spec, tmp_path, timeout=180, env=env)
    assert not res.timed_out and res.returncode not in (0, None), res.tail()
    for name, _, text in REFUSED:
        for rank in range(G):
            rec = json.loads((tmp_path / name / f"rank{rank}.json").read_text())
            assert rec["type"] == "ValueError" and text in rec["message"], rec
            assert rec["dist_initialized"] is False, rec
            assert re.search(rf"\[rank {rank}\] {name}: ValueError: ", res.stderr), res.tail()
