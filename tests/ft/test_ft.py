"""Federation groups that fail alone (``FLConfig(fault_tolerance="torchft")``, fl_accel/ft.py).

Real processes over gloo: a torchft Lighthouse, one launch per federation group (FSDP2
over the group's ranks, the tiny Llama of tests/workers/ft_worker.py) with the
environment scripts/ft_launch.py gives a group. Where the launch itself is the subject
(``torchrun --max-restarts``, ``ft_launch.kill_group`` of a torchrun and its workers, the
``python -m scripts.ft_launch`` command line) a group is a real torchrun; elsewhere its
ranks are forked from the tests' fork server (tests/_forkserver.py: no imports per rank),
each group its own world on its own rendezvous port, as under torchrun.

* Without faults the mode changes nothing: 2 groups x 2 ranks equal the single world
  (4 ranks, the same worker) at every optimizer step, bitwise (fp32 "avg").
* A group dies and comes back: every process of group 1 is SIGKILLed mid-round and
  restarted; group 0 keeps stepping alone, group 1 heals from it (parameters, inner
  optimizer state, anchor, momentum, counters, LR equal group 0's, bitwise) and both end
  equal after the final sync.
* Three groups: both ranks of a recovering group heal from one source group (the torchft
  #343 guard), and all groups end equal.
* The recipe runs in the mode (forked groups with scripts/ft_launch.py's environment):
  each group trains, logs and evaluates into its own folder, and the groups' final eval
  losses are equal.
* ``python -m scripts.ft_launch`` (real torchruns and a Lighthouse) gives each group its
  environment and a live Lighthouse, and a failed group does not stop the others.
* Unequal groups are refused on every rank before any collective.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from fl_accel import FLConfig
from fl_accel.checkpoint import find_latest
from tests._launch import (LAUNCHER_VAR, REPO_ROOT, WORKERS, launch_env, run_torchrun, start_forked, write_json,
                           write_whole)

torchft = pytest.importorskip("torchft", reason="torchft is not installed (pip install torchft==0.2.0): "
                                                "the fault-tolerant mode and its tests need it")

from scripts import ft_launch  # noqa: E402
from scripts.launch import terminate, wait  # noqa: E402
from recipes.run_folder import read_metrics  # noqa: E402

WORKER = WORKERS / "ft_worker.py"
SYNC_WORKER = WORKERS / "sync_worker.py"
G = 2  # ranks per federation group


def _group(f, spec, out, lighthouse, env=None, log=None):
    """Group f as a real ``torchrun`` (scripts/ft_launch.py ``start_group``), output to ``log``."""
    return ft_launch.start_group(f, G, WORKER, spec, out, lighthouse=lighthouse, cwd=REPO_ROOT,
                                 stdout=log, stderr=subprocess.STDOUT if log else None,
                                 env={"FL_ACCEL_COLLECTIVE_TIMEOUT_S": "60", **(env or {})},
                                 pythonpath=[str(REPO_ROOT)])


def _forked_group(f, script, *args, lighthouse, log_dir, env=None, collective_timeout_s="60"):
    """Group f as G ranks forked from the tests' server, with ``ft_launch.group_env``'s
    environment (the mode, the group index, the Lighthouse; the collective timeout unless
    None), then ``env``; rank r writes ``log_dir/r.out``/``r.err``. A
    :class:`_forkserver.ForkedLaunch`."""
    timeout = {"FL_ACCEL_COLLECTIVE_TIMEOUT_S": collective_timeout_s} if collective_timeout_s else {}
    hf = {k: v for k, v in launch_env().items() if k.startswith("HF_")}  # as the fork server imported with
    if os.environ.get(LAUNCHER_VAR) == "torchrun":  # every launch through torchrun (tests/_launch.py)
        log_dir.parent.mkdir(parents=True, exist_ok=True)
        return ft_launch.start_group(f, G, script, *args, lighthouse=lighthouse, env={**timeout, **(env or {})},
                                     cwd=REPO_ROOT, stdout=open(log_dir, "w"), stderr=subprocess.STDOUT,
                                     pythonpath=[str(REPO_ROOT)])
    genv = ft_launch.group_env(f, lighthouse, {**timeout, **hf, **(env or {})}, pythonpath=[str(REPO_ROOT)])
    return start_forked(G, script, *args, env=genv, log_dir=log_dir)


def _is_forked(p):
    return not isinstance(p, subprocess.Popen)


def _wait_code(p, timeout):
    """Exit status of a group launch (torchrun Popen or forked), None after ``timeout`` s."""
    return p.wait(timeout) if _is_forked(p) else wait(p, timeout).returncode


def _kill(p):
    """kill -9 every process of a group launch; returns the pids signalled (G ranks, plus
    torchrun's agent for a torchrun)."""
    return p.kill() if _is_forked(p) else ft_launch.kill_group(p)


def _load(path):
    return torch.load(path, weights_only=False)


def _log_tail(path, n=4000):
    """The end of a group's log: a file (torchrun's output) or a folder of forked ranks' logs."""
    if path.is_dir():
        return "".join(f"--- {q.name}\n" + q.read_text(errors="replace")[-n:] for q in sorted(path.iterdir()))
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
PARITY = {  # case -> (FLConfig fields over H=4, optimizer, largest allowed |difference| (0: bitwise))
    "fp32_avg": ({}, "sgd", 0.0),
    "nesterov": ({"outer_optimizer": "nesterov"}, "adamw", 1e-6),
    "int8_ef_fragments": ({"num_fragments": 2, "sync_delay": 1, "sync_dtype": "int8", "error_feedback": True},
                          "adamw", 1e-6),
}


SPEED_PLAN = [[5, 3], [2, 6]]
"""The speed trigger's rounds in the parity test: steps of groups 0 and 1 per round (8 x 4 rank-steps in all)."""


def _assert_steps_match(got, want, tol, what, steps=range(1, 9)) -> float:
    """``got``/``want``: worker records; every recorded step in ``steps`` and the final
    shards agree within ``tol`` (0: bitwise). Returns the largest difference."""
    worst = 0.0
    mine, theirs = dict((s, p) for s, p in got["steps"]), dict(want["steps"])
    assert sorted(mine) == list(steps) and set(steps) <= set(theirs), (what, sorted(mine))
    pairs = [(f"step {s}", mine[s], theirs[s]) for s in steps] + [("final", got["final"]["params"],
                                                                   want["final"]["params"])]
    for when, xs, ys in pairs:
        for i, (x, y) in enumerate(zip(xs, ys)):
            diff = (x - y).abs().max().item()
            worst = max(worst, diff)
            assert diff <= tol and (tol or torch.equal(x, y)), f"{what} {when} param {i}: {diff}"
    return worst


def _ft_launch(tmp_path, name, specs, env=None, max_restarts=(0, 0), timeout=420):
    """A Lighthouse (every quorum waits for both groups) and group f launched on
    ``specs[f]`` into tmp_path/name: under ``torchrun --max-restarts N`` where
    ``max_restarts[f]`` is N > 0, else forked; asserts both exit 0."""
    logs = [tmp_path / f"{name}_group{f}{'.log' if max_restarts[f] else ''}" for f in range(2)]
    lighthouse, addr = ft_launch.start_lighthouse(log=open(tmp_path / f"{name}_lighthouse.log", "w"), min_replicas=2)
    genv = {"FL_ACCEL_COLLECTIVE_TIMEOUT_S": "60", **(env or {})}
    groups = []
    try:
        for f in range(2):
            if max_restarts[f]:
                groups.append(ft_launch.start_group(
                    f, G, WORKER, specs[f], tmp_path / name, lighthouse=addr, cwd=REPO_ROOT,
                    stdout=open(logs[f], "w"), stderr=subprocess.STDOUT, env=genv, pythonpath=[str(REPO_ROOT)],
                    max_restarts=max_restarts[f]))
            else:
                groups.append(_forked_group(f, WORKER, specs[f], tmp_path / name, lighthouse=addr, log_dir=logs[f],
                                            env=genv))
        codes = [_wait_code(g, timeout) for g in groups]
    finally:
        for g in groups:
            _kill(g)
        terminate(lighthouse)
    assert codes == [0, 0], "\n".join(_log_tail(p) for p in logs)
    return logs


def test_torchft_mode_equals_single_world_and_resumes_from_group_checkpoints(tmp_path):
    """2 groups x 2 ranks, H=4, 8 optimizer steps, one launch per mode for the three cases
    (:data:`PARITY`, run one after the other in each launch's processes):

    * the local shards of every rank after every optimizer step and after the final sync
      equal those of the single world (4 ranks, same worker, same data slices): bitwise
      for fp32 "avg" (SGD with momentum and a LambdaLR), within 1e-6 for "nesterov" and
      for fragments (P=2, tau=1) with int8 + error feedback; every quorum had both groups,
      none healed; for fp32 "avg" the groups differ before each sync and are equal after it
      (both runs forked: tests/_forkserver.py);
    * the "speed" trigger with a fixed schedule of unequal rounds (group 0: 5 then 2 steps,
      group 1: 3 then 6; AdamW, "nesterov"): every step of every rank equals the single
      world within 1e-6, each round's mean is weighted by the tokens of the quorum's
      groups, and the run ends on its token budget;
    * per-group checkpoints (fp32 "avg"; each group saves its own state at steps 3 and 6,
      mid-round): everything is stopped, and both groups restart from their own step-3
      checkpoints (a new Lighthouse, no live peer). Group 1 runs under ``torchrun
      --max-restarts 1`` and crashes right after its step-6 checkpoint; torchrun's next
      attempt (the same launcher store: torchft's keys of the first attempt are in
      another store) resumes from that checkpoint while group 0 waits for it at the
      step-8 quorum. Both groups resumed at their checkpoints' step, data position
      (batches) and torchft step, no quorum healed, and every shard at steps 4-8 (group 1:
      7-8, after its second resume) and after the final sync is bitwise the uninterrupted
      run's.
    """
    cases = {name: {"fl": fl, "optimizer": opt, "lr": 0.05 if opt == "sgd" else 1e-3}
             for name, (fl, opt, _) in PARITY.items()}
    cases["fp32_avg"].update(scheduler=True, checkpoint_every=3)
    cases["seeded_apart"] = {"optimizer": "sgd", "lr": 0.05, "seed_by_group": True, "expect_error": True}
    cases["speed_trigger"] = {"optimizer": "adamw", "lr": 1e-3, "plan": SPEED_PLAN,
                              "fl": {"sync_trigger": "speed", "outer_optimizer": "nesterov"}}
    base = {"fl": {"algorithm": "fl_fsdp", "num_groups": 2, "sync_every": 4}, "max_steps": 8, "record_steps": True}
    spec = write_json(tmp_path / "spec.json", {**base, "cases": cases})
    single = run_torchrun(2 * G, WORKER, spec, tmp_path / "single", timeout=420)
    assert single.ok, single.tail()
    _ft_launch(tmp_path, "ft", [spec, spec])

    for case, (fl, _, tol) in PARITY.items():
        parts = fl.get("num_fragments", 1)
        events = 8 // (4 // parts) + (parts > 1)  # fragment syncs leave the groups apart: end_training syncs all
        worst = 0.0
        for f in range(2):
            for k in range(G):
                ft_rec = _load(tmp_path / "ft" / case / f"g{f}_r{k}_a0.pt")
                ref = _load(tmp_path / "single" / case / f"g{f}_r{f * G + k}_a0.pt")
                worst = max(worst, _assert_steps_match(ft_rec, ref, tol, f"[{case}] group {f} rank {k}"))
                assert [q["num_groups"] for q in ft_rec["quorums"]] == [2] * events
                assert not any(q["healed"] for q in ft_rec["quorums"])
                end = ft_rec["end"]  # end_training's wait: both groups at the end, with one final model
                assert end["together"] and end["groups"] == [0, 1] and len(set(end["checksums"].values())) == 1, end
        print(f"\n[{case}] largest |torchft - single world| over every step and shard: {worst:.3g}")
    # unequal rounds (the speed trigger, a fixed schedule): group 0 trains 5 + 2 steps, group 1 3 + 6, each
    # round's mean weighted by tokens; torchft's table of the quorum's groups equals the single world's
    for f, own in enumerate(zip(*SPEED_PLAN)):
        for k in range(G):
            ft_rec = _load(tmp_path / "ft" / "speed_trigger" / f"g{f}_r{k}_a0.pt")
            ref = _load(tmp_path / "single" / "speed_trigger" / f"g{f}_r{f * G + k}_a0.pt")
            worst = _assert_steps_match(ft_rec, ref, 1e-6, f"[speed_trigger] group {f} rank {k}",
                                        steps=range(1, sum(own) + 1))
            assert [q["num_groups"] for q in ft_rec["quorums"]] == [2, 2] and not ft_rec["heals"]
            ends = [sum(own[:r + 1]) for r in range(2)]
            weights = [[a / sum(r) for a in r] for r in SPEED_PLAN]
            for got in (ft_rec, ref):
                assert [s for s, _ in got["weights"]] == ends, got["weights"]
                assert all(w == pytest.approx(want) for (_, w), want in zip(got["weights"], weights))
                assert got["rounds"]["steps_per_round"] == [list(r) for r in zip(*SPEED_PLAN)]
                assert got["rounds"]["rank_steps"] == 8 * 2 * G
        print(f"\n[speed_trigger] group {f}: largest |torchft - single world| {worst:.3g}")
    for f in range(2):  # the start-up identity check: at prepare (single world), at the first quorum (torchft)
        for k in range(G):
            err = json.loads((tmp_path / "single" / "seeded_apart" / f"error_g{f}_r{f * G + k}.json").read_text())
            assert "do not start from identical parameters" in err["message"] and not err["step"], err
            err = json.loads((tmp_path / "ft" / "seeded_apart" / f"error_g{f}_r{k}.json").read_text())
            assert "groups started from different parameters" in err["message"] and err["step"] == 4, err
    for k in range(G):
        g0, g1 = (_load(tmp_path / "ft" / "fp32_avg" / f"g{f}_r{k}_a0.pt")["steps"] for f in range(2))
        for step in range(1, 9):
            same = all(torch.equal(x, y) for x, y in zip(g0[step - 1][1], g1[step - 1][1]))
            assert same == (step % 4 == 0), f"rank {k} step {step}: groups equal={same}"

    # the whole federation stops after step 8 and restarts from each group's step-3 checkpoint
    for f in range(2):
        shutil.copytree(tmp_path / "ft" / "fp32_avg" / "ckpt" / f"g{f}" / "step_3",
                        tmp_path / "ckpt" / f"g{f}" / "step_3")
        meta = json.loads((tmp_path / "ckpt" / f"g{f}" / "step_3" / "fl_accel_checkpoint.json").read_text())
        assert meta["group_index"] == f and meta["fault_tolerance"] == "torchft" and meta["scopes"]["model"] == "group"
    resume = {**base, **cases["fp32_avg"], "fl": base["fl"], "resume": True, "checkpoint_dir": str(tmp_path / "ckpt")}
    specs = [write_json(tmp_path / "resume0.json", resume),
             write_json(tmp_path / "resume1.json", {**resume, "crash": {"group": 1, "step": 6}})]
    logs = _ft_launch(tmp_path, "resumed", specs, env={"FL_ACCEL_COLLECTIVE_TIMEOUT_S": "300"}, max_restarts=(0, 1))
    for f, (step, manager_step, restarts) in enumerate([(3, 0, 0), (6, 1, 1)]):
        for k in range(G):
            rec = _load(tmp_path / "resumed" / f"g{f}_r{k}_a0.pt")
            assert rec["restart_count"] == restarts, _log_tail(logs[f])
            assert rec["resumed"]["step"] == rec["resumed"]["batches"] == step, rec["resumed"]
            assert rec["resumed"]["manager_step"] == manager_step, rec["resumed"]
            assert rec["quorums"] and not any(q["healed"] for q in rec["quorums"]) and rec["heals"] == 0
            want = _load(tmp_path / "ft" / "fp32_avg" / f"g{f}_r{k}_a0.pt")
            _assert_steps_match(rec, want, 0.0, f"resumed group {f} rank {k}", steps=range(step + 1, 9))
            assert rec["final"]["schedule"] == want["final"]["schedule"] and rec["batches"] == 8
    assert "(exitcode: 3)" in (tmp_path / "resumed_group1.log").read_text()  # attempt 0 did crash


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


def test_group_killed_mid_round_heals_from_live_group(tmp_path):
    """2 groups x 2 ranks, H=4, P=2 fragments, tau=1, int8 + error feedback, "nesterov",
    AdamW with a LambdaLR; group 1 saves its own checkpoint every 3 steps. Every process
    of group 1 gets SIGKILL twice (first its torchrun and workers, through
    ``ft_launch.kill_group``; then its forked ranks), and restarts 3 s later each
    time from its own newest checkpoint:

    1. right after an even step (mid-round, no exchange in flight);
    2. after it healed, right after an odd step (a fragment's exchange in flight).

    Group 0 keeps taking steps alone during both outages and never exits. After each
    restart group 1 resumed at its checkpoint's step and data position, was behind group
    0's torchft step, and healed at its first sync from group 0 over torchft's HTTP
    transport; then:

    * on every rank its parameters, AdamW state, anchor/momentum, sync counters (fragment
      phase), LR and LR-scheduler state right after the heal are bitwise group 0's at that
      quorum; its data position stays its own (the checkpoint's batches plus the steps
      it trained);
    * both groups end bitwise equal (parameters, counters) after the final sync.
    """
    out = tmp_path / "out"
    spec = write_json(tmp_path / "spec.json", {
        "fl": {"algorithm": "fl_fsdp", "num_groups": 2, "sync_every": 4, "num_fragments": 2, "sync_delay": 1,
               "sync_dtype": "int8", "error_feedback": True, "outer_optimizer": "nesterov"},
        "optimizer": "adamw", "lr": 1e-3, "scheduler": True, "max_steps": 3000, "stop_file": True, "step_sleep": 0.4,
        "checkpoint_every": 3, "checkpoint_groups": [1], "resume": True})
    lighthouse, addr = ft_launch.start_lighthouse(log=open(tmp_path / "lighthouse.log", "w"), min_replicas=1,
                                                 join_timeout_ms=10000)  # groups arrive seconds apart on a busy machine
    logs = {name: tmp_path / (f"{name}.log" if name == "g1a0" else name) for name in ("g0", "g1a0", "g1a1", "g1a2")}
    procs, started, outages = [], [], []
    try:
        g0 = _forked_group(0, WORKER, spec, out, lighthouse=addr, log_dir=logs["g0"])
        started.append(_group(1, spec, out, addr, env={"FT_TEST_ATTEMPT": "0"}, log=open(logs["g1a0"], "w")))
        procs = [g0, started[-1]]
        for attempt, parity in ((1, 0), (2, 1)):  # a P=2, tau=1 exchange launches at odd steps, applies at even ones
            if attempt == 2:  # attempt 1 logged a step after its heal: a checkpoint of its own comes within 4
                _wait_for(lambda: _progress(out, 1)[2] == "1", 300, "group 1's attempt 1 to step", procs)
            first = 6 if attempt == 1 else _progress(out, 1)[0] + 4
            _wait_for(lambda: _progress(out, 1)[0] >= first and _progress(out, 1)[0] % 2 == parity
                      and find_latest(str(out / "ckpt" / "g1")) is not None, 300,  # it has a checkpoint to resume
                      f"group 1 at step {first} (parity {parity})", procs)
            killed = _kill(started[-1])  # kill -9 every process of group 1 (attempt 0: torchrun and its workers)
            assert len(killed) == G + (not _is_forked(started[-1])), killed
            step_at_kill, t_kill, _ = _progress(out, 0)
            time.sleep(3.0)
            assert g0.poll() is None, _log_tail(logs["g0"])
            started.append(_forked_group(1, WORKER, spec, out, lighthouse=addr, log_dir=logs[f"g1a{attempt}"],
                                         env={"FT_TEST_ATTEMPT": str(attempt)}))
            procs = [g0, started[-1]]
            _wait_for(lambda: all((out / "healed" / f"g1_r{k}_a{attempt}").exists() for k in range(G)), 300,
                      f"group 1 to heal (attempt {attempt})", procs)
            outages.append((step_at_kill, t_kill, time.time()))  # group 1 was out until it healed
        write_whole(out / "stop_at", str(max(_progress(out, f)[0] for f in range(2)) + 8))
        codes = [_wait_code(p, 300) for p in procs]
    finally:
        for p in set(procs + started):
            _kill(p)
        terminate(lighthouse)
    assert codes == [0, 0], "\n".join(f"--- {n}\n{_log_tail(p)}" for n, p in logs.items())

    final_step = int((out / "stop_at").read_text())
    for k in range(G):
        src = _load(out / f"g0_r{k}_a0.pt")
        for attempt, (step_at_kill, t_kill, t_back) in zip((1, 2), outages):
            # group 0 stepped alone during the outage (kill to heal), and never restarted
            alone = [s for s, t in src["times"] if t_kill < t < t_back]
            assert len(alone) >= 3 and min(alone) > step_at_kill - 1, (step_at_kill, alone)
            healed = _load(out / f"g1_r{k}_a{attempt}.heal.pt")  # its records up to the heal
            resumed = healed["resumed"]
            assert resumed is not None and resumed["step"] % 3 == 0 and resumed["step"] > 0, resumed
            # its own data position, behind the step count once it healed (attempt 0 may have healed already when
            # group 0 committed before group 1's first quorum; attempt 1 did)
            assert (resumed["batches"] <= resumed["step"]) if attempt == 1 else (resumed["batches"] < resumed["step"])
            heal = [q for q in healed["quorums"] if q["healed"]]
            assert len(heal) == 1 and healed["heals"] == 1, [(q["manager_step"], q["healed"])
                                                             for q in healed["quorums"]]
            assert resumed["manager_step"] < heal[0]["manager_step"]  # behind group 0's torchft step: it healed
            # group 0's record of that quorum (a round that did not commit repeats the step: match the counters)
            peer = [q for q in src["quorums"] if q["manager_step"] == heal[0]["manager_step"]
                    and q["state"]["schedule"] == heal[0]["state"]["schedule"]]
            assert len(peer) == 1 and peer[0]["num_groups"] == 2, len(peer)
            _assert_state_equal(heal[0]["state"], peer[0]["state"], f"rank {k} after heal {attempt}")
            assert heal[0]["state"]["schedule"]["global_step"] > resumed["step"]  # it took over group 0's count
            assert heal[0]["state"]["optimizer"][0]["exp_avg"].abs().sum() > 0  # AdamW state came along
            assert heal[0]["state"]["outer"][0]["momentum"].abs().sum() > 0  # so did the outer momentum
        last = _load(out / f"g1_r{k}_a2.pt")
        assert last["batches"] == last["resumed"]["batches"] + len(last["times"])  # data: its own, not group 0's
        for name in ("params", "schedule"):
            _assert_state_equal(last["final"][name], src["final"][name], f"rank {k} final {name}")
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
        "scheduler": True, "max_steps": 400, "stop_file": True, "step_sleep": 0.4, "record_steps": True})
    lighthouse, addr = ft_launch.start_lighthouse(log=open(tmp_path / "lighthouse.log", "w"), min_replicas=1,
                                                 join_timeout_ms=10000)  # groups arrive seconds apart on a busy machine
    logs = {name: tmp_path / name for name in ("g0", "g1a0", "g2", "g1a1")}  # forked groups: a folder of logs each
    procs, g1 = [], None
    try:
        g0 = _forked_group(0, WORKER, spec, out, lighthouse=addr, log_dir=logs["g0"])
        g1 = _forked_group(1, WORKER, spec, out, lighthouse=addr, log_dir=logs["g1a0"], env={"FT_TEST_ATTEMPT": "0"})
        g2 = _forked_group(2, WORKER, spec, out, lighthouse=addr, log_dir=logs["g2"])
        procs = [g0, g1, g2]
        _wait_for(lambda: _progress(out, 1)[0] >= 6, 240, "group 1 at step 6", procs)
        assert len(_kill(g1)) == G + (not _is_forked(g1))
        time.sleep(3.0)
        assert g0.poll() is None and g2.poll() is None
        g1b = _forked_group(1, WORKER, spec, out, lighthouse=addr, log_dir=logs["g1a1"], env={"FT_TEST_ATTEMPT": "1"})
        procs = [g0, g1b, g2]
        _wait_for(lambda: all((out / "healed" / f"g1_r{k}_a1").exists() for k in range(G)), 240,
                  "group 1 to heal", procs)
        write_whole(out / "stop_at", str(max(_progress(out, f)[0] for f in range(3)) + 8))
        codes = [_wait_code(p, 240) for p in procs]
    finally:
        for p in {id(p): p for p in procs + [g1] if p is not None}.values():
            _kill(p)
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


def test_group_joining_under_the_speed_trigger_heals_and_the_run_ends_on_its_budget(tmp_path):
    """``sync_trigger="speed"`` in the torchft mode, 2 groups x 2 ranks, AdamW, a fixed
    schedule (group 0: 4 steps per round, group 1: 2; a token budget of 24 steps of the
    whole federation, 96 rank-steps). Group 0 starts alone and trains rounds by itself;
    group 1 starts later (no checkpoint: torchft's step 0, as after a crash) and heals from
    group 0 at its first sync. Then:

    * group 1's parameters, AdamW state, anchor, counters and LR right after the heal are
      bitwise group 0's at that quorum, and it took over group 0's round state (rounds,
      tokens, plan) with no steps of its own in the round: that round's merge weights are
      1 and 0, and the federation's per-round steps record 0 for group 1 in every round
      before it joined and in the heal's round;
    * both groups end with the same round summary, after the round that reaches the token
      budget (the rounds that group 0 trained alone count its tokens only), and bitwise
      equal parameters; group 1's data position is its own (the batches it trained)."""
    out = tmp_path / "out"
    spec = write_json(tmp_path / "spec.json", {
        "fl": {"algorithm": "fl_fsdp", "num_groups": 2, "sync_every": 4, "sync_trigger": "speed",
               "rejoin_timeout_s": 2.0},  # group 0 starts without group 1 after 2 s at its first sync
        "optimizer": "adamw", "lr": 1e-3, "max_steps": 24, "plan": [[4, 2]], "step_sleep": 0.3})
    lighthouse, addr = ft_launch.start_lighthouse(log=open(tmp_path / "lighthouse.log", "w"), min_replicas=1,
                                                 join_timeout_ms=10000)
    logs = {name: tmp_path / name for name in ("g0", "g1")}
    procs = []
    try:
        procs.append(_forked_group(0, WORKER, spec, out, lighthouse=addr, log_dir=logs["g0"]))
        _wait_for(lambda: _progress(out, 0)[0] >= 9, 240, "group 0 alone past two rounds", procs)
        procs.append(_forked_group(1, WORKER, spec, out, lighthouse=addr, log_dir=logs["g1"]))
        codes = [_wait_code(p, 300) for p in procs]
    finally:
        for p in procs:
            _kill(p)
        terminate(lighthouse)
    assert codes == [0, 0], "\n".join(f"--- {n}\n{_log_tail(p)}" for n, p in logs.items())

    for k in range(G):
        src, joined = _load(out / f"g0_r{k}_a0.pt"), _load(out / f"g1_r{k}_a0.pt")
        heal = [q for q in joined["quorums"] if q["healed"]]
        assert len(heal) == 1 and joined["heals"] == 1, [(q["manager_step"], q["healed"]) for q in joined["quorums"]]
        peer = [q for q in src["quorums"] if q["manager_step"] == heal[0]["manager_step"]]
        assert len(peer) == 1 and peer[0]["num_groups"] == 2
        _assert_state_equal(heal[0]["state"], peer[0]["state"], f"rank {k} after the heal")
        mine, theirs = heal[0]["round"], peer[0]["round"]
        own = ("steps", "train_s", "timed")  # this round's own figures: the source's, 0 for the healed group
        assert {k_: v for k_, v in mine.items() if k_ not in own} == {k_: v for k_, v in theirs.items()
                                                                      if k_ not in own}
        assert (mine["steps"], mine["timed"]) == (0, 0) and theirs["steps"] == 4
        alone = len(theirs["rounds"])  # rounds group 0 closed before group 1 came
        assert alone >= 2 and all(r == [4, 0] for r in theirs["rounds"]), theirs["rounds"]
        clocks = ("round_end_s",)  # each rank's own clock (the healed group's starts with its source's)
        assert {k_: v for k_, v in src["rounds"].items() if k_ not in clocks} == \
            {k_: v for k_, v in joined["rounds"].items() if k_ not in clocks}, (src["rounds"], joined["rounds"])
        per_group = src["rounds"]["steps_per_round"]
        assert per_group[1][alone] == 0 and per_group[0][alone] == 4  # the heal's round: group 1 counts nothing
        assert all(n == 2 for n in per_group[1][alone + 1:-1]) and per_group[1][alone + 1:], per_group
        # the injected schedule replaces the budget's last-round plan: the run ends after the round that reaches it
        last = sum(G * per_group[f][-1] for f in range(2))
        assert src["rounds"]["rank_steps"] >= 24 * 2 * G > src["rounds"]["rank_steps"] - last, src["rounds"]
        heal_weights = [w for s_, w in src["weights"]][alone]
        assert sorted(heal_weights) == [0.0, 1.0], src["weights"]
        _assert_state_equal(joined["final"]["params"], src["final"]["params"], f"rank {k} final params")
        assert joined["batches"] == len(joined["times"])  # its own data position: the steps it trained


# ---------------------------------------------------------------------- the recipe
RECIPE_ARGS = ["--model", "tiny", "--seq_len", "64", "--micro_batch_size", "2", "--max_steps", "4", "--log_every",
               "1", "--eval_every", "2", "--max_eval_blocks", "16", "--sync_every", "2", "--num_groups", "2",
               "--report_to", "none"]


def _recipe_launch(tmp_path, cache, out, name, *flags, started=2):
    """The recipe in the torchft mode, 2 groups: a Lighthouse from ``ft_launch.start_lighthouse``
    (every quorum waits for both groups) and the groups' ranks forked with
    ``ft_launch.group_env``'s environment, as ``python -m scripts.ft_launch`` starts them
    (that command line's own launch: :func:`test_ft_launch_cli_starts_a_lighthouse_and_one_torchrun_per_group`).
    ``started=1``: only group 0 of the 2 starts (the Lighthouse then waits for one).
    Returns each started group's all_results and its eval losses by step."""
    recipe = ["recipes/pretrain.py", "--fault_tolerance", "torchft", *RECIPE_ARGS, "--output_dir", str(out),
              "--cache_dir", cache, *flags]
    (tmp_path / name).mkdir()
    lighthouse, addr = ft_launch.start_lighthouse(log=open(tmp_path / name / "lighthouse.log", "w"),
                                                  min_replicas=started)
    groups = []
    try:
        for f in range(started):
            groups.append(_forked_group(f, REPO_ROOT / recipe[0], *recipe[1:], lighthouse=addr,
                                        log_dir=tmp_path / name / f"group{f}",
                                        collective_timeout_s=None))  # as scripts.ft_launch's groups
        codes = [_wait_code(g, 1200) for g in groups]
    finally:
        for g in groups:
            _kill(g)
        terminate(lighthouse)
    assert codes == [0] * started, "\n".join(_log_tail(tmp_path / name / f"group{f}") for f in range(started))
    results = [json.loads((out / f"group{f}" / "all_results.json").read_text()) for f in range(started)]
    evals = [{m["step"]: m["eval/loss"] for m in read_metrics(out / f"group{f}" / "metrics.jsonl") if "eval/loss" in m}
             for f in range(started)]
    return results, evals


_CLI_RANK = r'''
import json, os, sys, time, urllib.request
out = sys.argv[1]
rec = {k: os.environ.get(k) for k in ("FL_ACCEL_FAULT_TOLERANCE", "FL_ACCEL_GROUP_INDEX", "TORCHFT_LIGHTHOUSE", "RANK",
                                      "WORLD_SIZE", "MASTER_PORT", "OMP_NUM_THREADS", "PYTHONPATH")}
with urllib.request.urlopen(rec["TORCHFT_LIGHTHOUSE"] + "/status", timeout=60) as page:  # the Lighthouse is up
    rec["lighthouse_status"] = page.read().decode(errors="replace")
with open(os.path.join(out, f"g{rec['FL_ACCEL_GROUP_INDEX']}_r{rec['RANK']}.json"), "w") as fh:
    json.dump(rec, fh)
for _ in range(600):  # both ranks of the group wrote theirs (torchrun stops the other rank of a failed one)
    if all(os.path.exists(os.path.join(out, f"g{rec['FL_ACCEL_GROUP_INDEX']}_r{k}.json")) for k in range(2)):
        break
    time.sleep(0.1)
sys.exit(3 if rec["FL_ACCEL_GROUP_INDEX"] == "1" else 0)  # group 1 fails, group 0 does not
'''


def test_ft_launch_cli_starts_a_lighthouse_and_one_torchrun_per_group(tmp_path):
    """``python -m scripts.ft_launch --num_groups 2 --nproc_per_group 2 --min_replicas 2
    --log_dir D -- script out`` (a Lighthouse and two real torchruns of 2 ranks; the script
    stands in for the recipe, which runs in the mode in
    :func:`test_recipe_trains_each_group_in_its_own_folder_and_resumes`, with the same
    ``ft_launch.group_env``): every rank of group f sees ``FL_ACCEL_FAULT_TOLERANCE=torchft``,
    ``FL_ACCEL_GROUP_INDEX=f``, the address of a live Lighthouse that wants 2 replicas,
    ``OMP_NUM_THREADS=1`` and the repository on ``PYTHONPATH``, in a world of its own (2
    ranks, its own master port); each group logs to ``D/group<f>.log``. Group 1's ranks
    exit 3: group 0 still ends on its own (a failed group does not stop the others) and the
    command exits with the first non-zero group status (torchrun's 1)."""
    script = tmp_path / "rank.py"
    script.write_text(_CLI_RANK)
    out = tmp_path / "out"
    out.mkdir()
    argv = [sys.executable, "-m", "scripts.ft_launch", "--num_groups", "2", "--nproc_per_group", str(G),
            "--min_replicas", "2", "--log_dir", str(tmp_path / "logs"), "--", str(script), str(out)]
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            ft_launch.kill_group(proc)
    logs = "\n".join(_log_tail(tmp_path / "logs" / f"group{f}.log") for f in range(2))
    assert proc.returncode == 1 and "group exit statuses: [0, 1]" in stdout, stdout + logs
    assert "exitcode  : 3" in (tmp_path / "logs" / "group1.log").read_text(), logs  # torchrun's summary of group 1
    recs = {(f, k): json.loads((out / f"g{f}_r{k}.json").read_text()) for f in range(2) for k in range(G)}
    addresses = {r["TORCHFT_LIGHTHOUSE"] for r in recs.values()}
    assert len(addresses) == 1 and addresses.pop().startswith("http://"), recs
    for (f, k), r in recs.items():
        assert (r["FL_ACCEL_FAULT_TOLERANCE"], r["FL_ACCEL_GROUP_INDEX"], r["RANK"], r["WORLD_SIZE"]) == \
            ("torchft", str(f), str(k), str(G)), r
        assert r["OMP_NUM_THREADS"] == "1" and str(REPO_ROOT) in r["PYTHONPATH"].split(os.pathsep), r
        assert "need min_replicas 2" in r["lighthouse_status"] or "min_replicas: 2" in r["lighthouse_status"], r
    assert recs[0, 0]["MASTER_PORT"] == recs[0, 1]["MASTER_PORT"] != recs[1, 0]["MASTER_PORT"]  # a world per group
    assert (tmp_path / "logs" / "lighthouse.log").exists()


def test_recipe_trains_each_group_in_its_own_folder_and_resumes(tmp_path, default_corpus_cache):
    """``recipes/pretrain.py --fault_tolerance torchft --checkpoint_every 1 ...`` in two
    groups of 2 forked ranks with the environment ``python -m scripts.ft_launch
    --num_groups 2 --nproc_per_group 2 --min_replicas 2`` gives them (every quorum waits for
    both groups, so a slow start of one group cannot leave the other syncing alone; the
    tiny Llama, 4 steps, H=2; that command line's own launch is tested above): both
    groups exit 0 and each writes its own ``<output_dir>/group<f>`` (all_results.json,
    metrics.jsonl, checkpoints/step_N with its group index and torchft step), with
    figures gathered over its own 2 ranks only (traffic of one group, tokens of 2 ranks;
    the exchange over torchft's process group counted in "fl"); the eval losses after the
    syncs (steps 2 and 4) are equal in both groups, bitwise (fp32 "avg": the groups hold
    the same parameters); results record the torchft mode, the group and the
    synchronizer's counters (2 syncs, no heal).

    Then the whole federation restarts with ``--resume_from_checkpoint latest`` after the
    checkpoints past step 1 are deleted (as if it had stopped there): each group resumes
    from its own step-1 checkpoint (data position included) and its evals at steps 2 and 4
    are bitwise the uninterrupted run's. Group 1's planning refuses group 0's checkpoint."""
    from recipes.args import RecipeError
    from recipes.run_folder import plan_run

    out = tmp_path / "out"
    results, evals = _recipe_launch(tmp_path, default_corpus_cache, out, "logs", "--checkpoint_every", "1",
                                    "--checkpoints_total_limit", "0")  # every checkpoint kept: read below
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
    assert sorted(evals[0]) == [2, 4] and evals[0] == evals[1], evals
    for f in range(2):  # train records carry the wall clock: the groups are separate launches
        train = [m for m in read_metrics(out / f"group{f}" / "metrics.jsonl") if "train/loss" in m]
        assert [m["step"] for m in train] == [1, 2, 3, 4] and all(m["unix_time"] > 0 for m in train)
        ckpts = out / f"group{f}" / "checkpoints"
        assert sorted(p.name for p in ckpts.iterdir()) == ["step_1", "step_2", "step_3", "step_4"]
        for step, synced in ((1, 0), (4, 2)):
            meta = json.loads((ckpts / f"step_{step}" / "fl_accel_checkpoint.json").read_text())
            assert meta["group_index"] == f and meta["transport"]["manager"]["step"] == synced, meta
        for step in (2, 3, 4):
            shutil.rmtree(ckpts / f"step_{step}")

    environ = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "FL_ACCEL_GROUP_INDEX": "1"}
    with pytest.raises(RecipeError, match=r"group_index=0 vs 1"):
        plan_run(["--fault_tolerance", "torchft", *RECIPE_ARGS, "--output_dir", str(tmp_path / "other"),
                  "--resume_from_checkpoint", str(out / "group0" / "checkpoints" / "step_1")], environ=environ)

    resumed, resumed_evals = _recipe_launch(tmp_path, default_corpus_cache, out, "logs_resumed",
                                            "--checkpoint_every", "1", "--resume_from_checkpoint", "latest")
    for f, r in enumerate(resumed):
        assert r["session"]["resumed_from_step"] == 1 and r["session"]["steps"] == 3, r["session"]
        assert r["fault_tolerance"]["sync"] == results[f]["fault_tolerance"]["sync"]
        assert r["eval_loss"] == results[f]["eval_loss"] and r["train_tokens"] == results[f]["train_tokens"]
    assert resumed_evals == evals, (resumed_evals, evals)


def test_recipe_says_when_its_last_sync_left_groups_out(tmp_path, default_corpus_cache):
    """Group 0 of 2 trains alone (the other never starts; the Lighthouse waits for one): its
    syncs are quorums of one group, so its final model is its own. The run ends 0 but
    does not call it synchronized: ``eval_scored`` is "own group" in all_results.json and in
    the eval records, and rank 0 prints the warning naming 1 of the 2 groups (a newcomer
    found the two groups' different final models reported as "synchronized")."""
    out = tmp_path / "out"
    (result,), _ = _recipe_launch(tmp_path, default_corpus_cache, out, "alone", "--rejoin_timeout_s", "3",
                                  started=1)  # it waits 3 s for group 1 at its first sync and at the end
    assert result["steps"] == 4 and result["fault_tolerance"]["sync"]["num_syncs"] == 2, result["fault_tolerance"]
    assert result["eval_scored"] == "own group", result["eval_scored"]
    records = [m for m in read_metrics(out / "group0" / "metrics.jsonl") if "eval/scored" in m]
    assert [m["eval/scored"] for m in records] == ["own group"] * len(records) and records
    log = _log_tail(tmp_path / "alone" / "group0", 20000)
    assert "the last sync (step 4) covered 1 of the run's 2 federation groups" in log, log[-3000:]
    assert "after waiting 3 s for them (FLConfig.rejoin_timeout_s)" in log, log[-3000:]  # the end's wait
    end = result["fault_tolerance"]["end"]
    assert end["together"] is False and end["groups"] == [0] and end["waited_s"] >= 3, end
    assert "final synchronization: none needed" not in log


def test_recipe_refuses_unsupported_flags_in_torchft_mode(tmp_path):
    """The recipe's planning (pure Python, every rank before any collective) refuses
    ``--eval_groups`` in the torchft mode, naming the flag; without it (checkpoint flags
    included) it plans the federation's layout (F groups of this launch's world) and the
    group's own folder."""
    from recipes.args import RecipeError
    from recipes.run_folder import plan_run

    environ = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "FL_ACCEL_GROUP_INDEX": "1"}
    base = ["--fault_tolerance", "torchft", *RECIPE_ARGS, "--output_dir", str(tmp_path)]
    with pytest.raises(RecipeError, match="--eval_groups is not supported"):
        plan_run(base + ["--eval_groups"], environ=environ)
    plan = plan_run(base + ["--checkpoint_every", "2", "--resume_from_checkpoint", "latest"], environ=environ)
    assert plan.layout.world_size == 4 and plan.layout.num_groups == 2
    assert plan.args.output_dir == str(tmp_path / "group1") and plan.resume_path is None


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
