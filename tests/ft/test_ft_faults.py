"""The ends of a fault-tolerant run and faults that overlap (issue 49).

Real processes, the recipe (tiny Llama, CPU/gloo, one rank per federation group to keep the
CPU cost low) or the tests' worker, a real torchft Lighthouse:

* The issue's trial with the docs' command: ``python -m scripts.ft_launch`` (real torchruns)
  with the default Lighthouse settings and ``--checkpoint_every``, ``--restart_group 1``
  mid-run. Group 0 reaches the end before group 1 is back and waits there, serving its heal:
  both end with one final model (the launcher's summary repeats equal checksums; exit 0).
* Double faults: group 1 killed and restarted, then group 0 killed before group 1 healed and
  restarted; F=2 and F=3, with and without ``--checkpoint_every``. The run continues from the
  newest committed state anyone holds (a checkpoint, or the live group 2), and the eval loss
  after the recovery is no worse than the last one before the faults; or, with F=2 and no
  checkpoint, both groups stop with the one-line ``StateLostError`` and the launcher exits
  non-zero. ``metrics.jsonl``'s pre-fault records are never deleted
  (``metrics.superseded.jsonl``).
* The heal source dies in the middle of a heal (3 groups of the worker): the healing group
  gives up that round at once and heals from the other live group, within the documented
  bound.
* Control flow without processes: the launcher's comparison of the groups' end reports, its
  ``--help``, and ``read_metrics`` of a file whose last line was cut.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from tests._launch import REPO_ROOT, WORKERS, launch_env, start_forked, write_json, write_whole

torchft = pytest.importorskip("torchft", reason="torchft is not installed (pip install torchft==0.2.0): "
                                                "the fault-tolerant mode and its tests need it")

from recipes.run_folder import SUPERSEDED, read_metrics  # noqa: E402
from scripts import ft_launch  # noqa: E402
from scripts.launch import terminate  # noqa: E402

RECIPE = REPO_ROOT / "recipes" / "pretrain.py"
BAND = 0.05
"""Eval-loss slack of "no worse than before the faults": the tiny model's eval loss falls by
about 0.1 per 4 steps here; training on from fresh weights would lose about 0.4."""


def _steps(path) -> int:
    return max([r.get("step", 0) for r in read_metrics(str(path)) if "train/loss" in r] or [0])


# ---------------------------------------------------------------------- control flow
def test_the_launcher_compares_the_groups_final_models():
    """Equal checksums: summary lines only. Different ones: a one-line error naming the final
    model most groups share (then the lowest eval loss), and the exit status it sets. The
    recipe and the launcher agree on the report's variable; ``--help`` lists ``--restart_group``."""
    from recipes.results import END_REPORT_VAR

    assert END_REPORT_VAR == ft_launch.REPORT_VAR
    same = {f: {"checksum": 1.5, "eval_perplexity": 10.0, "eval_loss": 2.3, "final_model": f"o/group{f}/final_model"}
            for f in range(2)}
    lines, error = ft_launch.compare_models(same)
    assert error is None and len(lines) == 2 and "checksum 1.500000e+00" in lines[0], lines
    apart = {0: {**same[0], "checksum": 1.0, "eval_loss": 2.4, "eval_perplexity": 11.0}, 1: same[1],
             2: {**same[1], "final_model": "o/group2/final_model"}}
    _, error = ft_launch.compare_models(apart)
    assert error.startswith("[ft_launch] error: the groups ended with different final models (group 0: perplexity "
                            "11.00; group 1: perplexity 10.00; group 2: perplexity 10.00); use o/group1/final_model "
                            "(groups 1, 2, eval perplexity 10.00)"), error
    _, error = ft_launch.compare_models({0: apart[0], 1: {**same[1], "eval_loss": 2.5}})
    assert "use o/group0/final_model (group 0," in error  # a tie in sharing: the lower eval loss
    assert ft_launch.DIFFERENT_MODELS_STATUS not in (0, 1)
    out = subprocess.run([sys.executable, "-m", "scripts.ft_launch", "--help"], cwd=REPO_ROOT, capture_output=True,
                         text=True, env=launch_env(), timeout=60).stdout
    assert re.search(r"--restart_group F\s+with --log_dir D only", out), out


def test_read_metrics_leaves_out_a_last_line_cut_short(tmp_path):
    """A process killed while writing leaves a cut last line: skipped (the restart race of
    issue 49 read it while another rank rewrote the file); a bad line elsewhere still raises."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "train/lo')
    assert read_metrics(str(path)) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(json.JSONDecodeError):
        read_metrics(str(path))


def test_heal_address_by_interface_name_and_the_checkpoint_server_bound_to_it():
    """``FLConfig.heal_address`` (:func:`fl_accel.ft_net.resolve_address`): an interface name gives
    its IPv4 address, an address of another host is refused before any process group; the
    heal's checkpoint server (:class:`fl_accel.heal.HealTransport`) then advertises and binds it
    only, and a state it serves comes back over HTTP into writable tensors without torch's
    "buffer is not writable" warning, with the bytes on the wire counted."""
    import warnings
    from datetime import timedelta

    import torch

    from fl_accel import ft_net, heal

    assert ft_net.resolve_address("lo") == "127.0.0.1" and ft_net.resolve_address(None) is None
    with pytest.raises(ValueError, match=r"heal_address='192\.0\.2\.7': this host cannot serve heals on it"):
        ft_net.resolve_address("192.0.2.7")  # TEST-NET-1: never this host's
    server = heal.HealTransport(timedelta(seconds=30), "127.0.0.1")
    client = heal.HealTransport(timedelta(seconds=30))
    try:
        address = server.metadata()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/checkpoint/", address), address
        state = {"params": [torch.arange(1000, dtype=torch.float32)], "lr": 0.1}
        server.send_checkpoint(dst_ranks=[1], step=7, state_dict=state, timeout=timedelta(seconds=30))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "The given buffer is not writable" would raise here
            got = client.recv_checkpoint(src_rank=0, metadata=address, step=7, timeout=timedelta(seconds=30))
        assert torch.equal(got["params"][0], state["params"][0]) and got["lr"] == 0.1
        got["params"][0].add_(1)  # writable memory
        assert client.received_bytes > 4000, client.received_bytes
    finally:
        server.shutdown()
        client.shutdown()


# ---------------------------------------------------------------------- the trial
def test_restart_group_with_the_docs_flags_ends_with_one_final_model(tmp_path, default_corpus_cache):
    """The docs' recipe command (``python -m scripts.ft_launch ... --max_restarts 1 --log_dir D --
    recipes/pretrain.py --fault_tolerance torchft ... --checkpoint_every 4``: real torchruns,
    default Lighthouse settings, one rank per group) and ``python -m scripts.ft_launch
    --restart_group 1 --log_dir D`` once group 1 logged step 6. Group 1 resumes from its newest
    checkpoint and comes back after group 0 has trained to the end (16 steps); group 0 waits
    there and serves its heal (before issue 49 it ended alone, and both groups ended with
    different models, exit 0). Both groups print that all 2 hold the same final model, the
    launcher's summary repeats equal checksums and perplexities and it exits 0; group 1's
    records past its checkpoint are in metrics.superseded.jsonl."""
    logs, out = tmp_path / "logs", tmp_path / "out"
    cmd = [sys.executable, "-m", "scripts.ft_launch", "--num_groups", "2", "--nproc_per_group", "1", "--max_restarts",
           "1", "--log_dir", str(logs), "--", "recipes/pretrain.py", "--fault_tolerance", "torchft", "--num_groups",
           "2", "--sync_every", "2", "--model", "tiny", "--seq_len", "64", "--micro_batch_size", "2", "--max_steps",
           "16", "--checkpoint_every", "4", "--eval_every", "4", "--log_every", "1", "--max_eval_blocks", "16",
           "--report_to", "none",
           "--output_dir", str(out), "--cache_dir", default_corpus_cache, "--rejoin_timeout_s", "120"]
    launcher = subprocess.Popen(cmd, cwd=REPO_ROOT, env=launch_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while _steps(out / "group1" / "metrics.jsonl") < 6:
            assert launcher.poll() is None and time.monotonic() < deadline, "the run ended before step 6"
            time.sleep(0.2)
        ask = subprocess.run([sys.executable, "-m", "scripts.ft_launch", "--restart_group", "1", "--log_dir",
                              str(logs)], cwd=REPO_ROOT, env=launch_env(), capture_output=True, text=True, timeout=120)
        assert ask.returncode == 0, ask.stdout + ask.stderr
        text, _ = launcher.communicate(timeout=400)
    finally:
        if launcher.poll() is None:
            ft_launch.kill_group(launcher)
    group_logs = [(logs / f"group{f}.log").read_text(errors="replace") for f in range(2)]
    tails = text + "".join(f"\n--- group {f}\n{t[-3000:]}" for f, t in enumerate(group_logs))
    assert launcher.returncode == 0, tails
    assert "[ft_launch] group 1: finished after 1 restart, 1 on request" in text, text
    summary = re.findall(r"\[ft_launch\] group (\d): eval perplexity ([0-9.]+), final model checksum (\S+), (\S+)",
                         text)
    assert [s[0] for s in summary] == ["0", "1"] and summary[0][1:3] == summary[1][1:3], text
    for f in range(2):
        assert "the run's end: all 2 federation groups hold the same final model" in group_logs[f], tails
    assert re.search(r"group 1 healed from group 0 at step \d+", group_logs[1]), tails
    results = [json.loads((out / f"group{f}" / "all_results.json").read_text()) for f in range(2)]
    assert results[0]["eval_loss"] == results[1]["eval_loss"] and results[1]["fault_tolerance"]["heals"] >= 1
    assert all(r["fault_tolerance"]["end"]["together"] and r["eval_scored"] == "synchronized" for r in results)
    resumed = results[1]["session"]["resumed_from_step"]
    assert resumed >= 4 and resumed % 4 == 0, results[1]["session"]  # its newest checkpoint
    # the records past the checkpoint: moved, not deleted. Group 1 had logged step 6 when the restart was asked, so
    # from a checkpoint at 4 steps 5 and 6 were moved; from one at 8 (a busy machine: group 1 went on until the
    # signal came) the moved records, if any, start at 9
    superseded = [r["step"] for r in read_metrics(str(out / "group1" / SUPERSEDED)) if "train/loss" in r]
    assert superseded == list(range(resumed + 1, resumed + 1 + len(superseded))), (resumed, superseded)
    assert resumed >= 6 or superseded[:6 - resumed] == list(range(resumed + 1, 7)), (resumed, superseded)
    kept = [r["step"] for r in read_metrics(str(out / "group1" / "metrics.jsonl")) if "train/loss" in r]
    assert kept[:resumed] == list(range(1, resumed + 1)), kept  # the history up to the checkpoint stays


# ---------------------------------------------------------------------- double faults
class _Forked:
    """A forked group launch as :class:`scripts.ft_launch.Supervisor` sees a torchrun."""

    def __init__(self, launch):
        self.launch, self.pid = launch, launch.pids[0]

    def poll(self):
        return self.launch.poll()

    def wait(self):
        return self.launch.wait()


def _double_fault(tmp_path, cache, num_groups: int, checkpoints: bool):
    """``num_groups`` groups of the recipe (one forked rank each, 16 steps, H=2, evals every
    4 steps, ``--checkpoint_every 4`` if ``checkpoints``; heals over ``--heal_address lo``, an
    interface name) under a Supervisor (no restarts of
    its own): once group 1 logged step 9 it is restarted on request, and group 0 as soon as
    group 1's new launch has started (before it can have healed). Returns (exit status,
    kill times by group, the supervisor's text, each group's output)."""
    import io

    out, logs = tmp_path / "out", tmp_path / "logs"
    logs.mkdir()
    args = ["--fault_tolerance", "torchft", "--model", "tiny", "--seq_len", "64", "--micro_batch_size", "2",
            "--max_steps", "16", "--log_every", "1", "--eval_every", "4", "--max_eval_blocks", "16", "--sync_every",
            "2", "--num_groups", str(num_groups), "--report_to", "none", "--save_final_model", "false",
            "--rejoin_timeout_s", "10", "--heal_address", "lo", "--output_dir", str(out), "--cache_dir", cache]
    if checkpoints:
        args += ["--checkpoint_every", "4"]
    lighthouse, addr = ft_launch.start_lighthouse(log=open(tmp_path / "lighthouse.log", "w"))
    hf = {k: v for k, v in launch_env().items() if k.startswith("HF_")}
    launches = {}

    def start(f, attempt):
        env = ft_launch.group_env(f, addr, {"FL_ACCEL_COLLECTIVE_TIMEOUT_S": "60", **hf}, pythonpath=[str(REPO_ROOT)])
        launch = start_forked(1, RECIPE, *(args if attempt == 0 else ft_launch.restart_args(RECIPE, args)), env=env,
                              log_dir=logs / f"group{f}_a{attempt}")
        launches[f, attempt] = launch
        return _Forked(launch), str(logs / f"group{f}_a{attempt}")

    killed, deadline = {}, time.monotonic() + 600

    def sleep(seconds):
        assert time.monotonic() < deadline, "the run did not end in 600 s"
        g0, g1 = sup.groups[0], sup.groups[1]
        if 1 not in killed and _steps(out / "group1" / "metrics.jsonl") >= 9:
            killed[1] = time.time()
            ft_launch.request_file(logs, 1).write_text("{}")
        elif 1 in killed and 0 not in killed and g1.attempts == 1 and g1.state == "running" and g0.state == "running":
            killed[0] = time.time()
            ft_launch.request_file(logs, 0).write_text("{}")
        time.sleep(seconds)

    text = io.StringIO()
    sup = ft_launch.Supervisor(num_groups, start, max_restarts=0, restart_delay_s=3.0, control_dir=logs,
                               kill=lambda p: p.launch.kill(), watch=False, out=text, sleep=sleep)
    try:
        status = sup.run(poll_s=0.1)
    finally:
        for launch in launches.values():
            launch.kill()
        terminate(lighthouse)
    outputs = {f: "".join("".join(launches[g, a].output()) for g, a in sorted(launches) if g == f)
               for f in range(num_groups)}
    return status, killed, text.getvalue(), outputs, out


def _evals(out, f) -> list[dict]:
    """Group f's eval records, the superseded ones (an earlier session's) included."""
    folder = out / f"group{f}"
    return [r for r in read_metrics(str(folder / SUPERSEDED)) + read_metrics(str(folder / "metrics.jsonl"))
            if "eval/loss" in r]


def _assert_recovered(out, num_groups, killed):
    """Every group ends with one final model; for the restarted groups, the first eval after
    their restart is no worse than the last one before the faults (within :data:`BAND`), and
    their pre-fault records are kept (in metrics.jsonl or metrics.superseded.jsonl)."""
    results = [json.loads((out / f"group{f}" / "all_results.json").read_text()) for f in range(num_groups)]
    assert len({r["fault_tolerance"]["end"]["checksum"] for r in results}) == 1, [r["fault_tolerance"]["end"]
                                                                                   for r in results]
    assert all(r["fault_tolerance"]["end"]["together"] for r in results), [r["fault_tolerance"]["end"] for r in results]
    first_kill = min(killed.values())
    for f in killed:
        evals = _evals(out, f)
        before = [r for r in evals if r["unix_time"] < first_kill]
        after = [r for r in evals if r["unix_time"] > killed[f] + 3]
        assert before and after, (f, evals)
        print(f"group {f}: eval loss {before[-1]['eval/loss']:.4f} at step {before[-1]['step']} before the faults, "
              f"{after[0]['eval/loss']:.4f} at step {after[0]['step']} after the recovery")
        assert after[0]["eval/loss"] <= before[-1]["eval/loss"] + BAND, (before[-1], after[0])
        assert after[0]["step"] >= before[-1]["step"], (before[-1], after[0])  # never back to fresh weights
        history = read_metrics(str(out / f"group{f}" / SUPERSEDED)) + read_metrics(
            str(out / f"group{f}" / "metrics.jsonl"))
        trained = {r["step"] for r in history if "train/loss" in r and r["unix_time"] < killed[f]}
        assert set(range(1, 9)) <= trained, sorted(trained)  # the pre-fault history is on disk
    return results


@pytest.mark.parametrize("checkpoints", [False, True], ids=["no_checkpoints", "checkpoint_every_4"])
def test_double_fault_of_two_groups(tmp_path, default_corpus_cache, checkpoints):
    """F=2. With checkpoints both groups resume from their newest (group 0's may be newer: group 1
    then heals from it) and the eval after the recovery is no worse than before the faults.
    Without, no group holds a committed state: both stop with the one-line StateLostError
    after ``--rejoin_timeout_s`` (never retrain from fresh weights), and the status is not 0."""
    status, killed, text, outputs, out = _double_fault(tmp_path, default_corpus_cache, 2, checkpoints)
    tails = text + "".join(f"\n--- group {f}\n{o[-3000:]}" for f, o in outputs.items())
    assert set(killed) == {0, 1}, tails
    if checkpoints:
        assert status == 0, tails
        _assert_recovered(out, 2, killed)
        return
    assert status != 0, tails
    for f in range(2):
        assert re.search(rf"\[fl_accel\] error \(rank 0\): federation group {f} restarted without its state \(its "
                         r"earlier session reached step \d+ and left no checkpoint\), and no group holding a committed "
                         r"state joined its quorum within 10 s .*the federation's trained state is lost", outputs[f]), \
            tails
        assert _evals(out, f) and min(r["step"] for r in read_metrics(str(out / f"group{f}" / SUPERSEDED))) == 1
    assert "group 0: failed with status 1" in text and "group 1: failed with status 1" in text, text


@pytest.mark.parametrize("checkpoints", [False, True], ids=["no_checkpoints", "checkpoint_every_4"])
def test_double_fault_of_three_groups(tmp_path, default_corpus_cache, checkpoints):
    """F=3: group 2 lives through both faults and holds the newest committed state; groups 1
    and 0 (restarted from their checkpoints, or without one) heal from it, the evals after the
    recovery are no worse than before the faults, and all three end with one final model."""
    status, killed, text, outputs, out = _double_fault(tmp_path, default_corpus_cache, 3, checkpoints)
    tails = text + "".join(f"\n--- group {f}\n{o[-3000:]}" for f, o in outputs.items())
    assert status == 0 and set(killed) == {0, 1}, tails
    results = _assert_recovered(out, 3, killed)
    assert all(results[f]["fault_tolerance"]["heals"] >= 1 for f in (0, 1)) or checkpoints, \
        [r["fault_tolerance"]["heal_log"] for r in results]


# ---------------------------------------------------------------------- the heal source dies
HEAL_SOURCE_BOUND_S = 60.0
"""What docs/fault_tolerance.md promises for a heal whose source dies: the failed round is
dropped at once (the transfer breaks), the next quorum leaves the dead group out after the
Lighthouse's heartbeat timeout (3 s here), and the healing group heals from another live group
at its next sync; a (re)configuration towards the dead group's store, or a request to its
ManagerServer, gives up after fl_accel.ft_net.CONNECT_TIMEOUT_S (30 s). Here: 3 s + (at most) 30 s +
a round of 4 steps, with slack for a loaded 2-core machine."""


def test_heal_source_killed_mid_heal(tmp_path):
    """3 groups of the worker (one rank each, H=4, AdamW; groups 0 and 2 die half-way through
    serving a heal, whichever serves first: ``die_serving_heal``). Group 1 starts late, with no
    state: at its first sync it heals, its source sends half the state and dies (SIGKILL). The
    heal fails, the round is dropped in every group (no 300 s wait on the dead group's store
    or collective), and group 1 heals from the other live group within
    :data:`HEAL_SOURCE_BOUND_S`; groups 1 and the live source end with equal parameters (the
    dead group is waited for ``rejoin_timeout_s`` at the end, then left out)."""
    from fl_accel import ft_net

    out = tmp_path / "out"
    spec = write_json(tmp_path / "spec.json", {
        "fl": {"algorithm": "fl_fsdp", "num_groups": 3, "sync_every": 4, "rejoin_timeout_s": 3.0},
        "optimizer": "adamw", "lr": 1e-3, "max_steps": 400, "stop_file": True, "step_sleep": 0.3,
        "die_serving_heal": [0, 2]})
    lighthouse, addr = ft_launch.start_lighthouse(log=open(tmp_path / "lighthouse.log", "w"), join_timeout_ms=10000)
    hf = {k: v for k, v in launch_env().items() if k.startswith("HF_")}

    def group(f):
        env = ft_launch.group_env(f, addr, {"FL_ACCEL_COLLECTIVE_TIMEOUT_S": "120", **hf}, pythonpath=[str(REPO_ROOT)])
        return start_forked(1, WORKERS / "ft_worker.py", str(spec), str(out), env=env, log_dir=tmp_path / f"g{f}")

    def progress(f):
        try:
            return int((out / "progress" / f"g{f}_r0").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return -1

    procs = {}
    try:
        procs[0], procs[2] = group(0), group(2)
        deadline = time.monotonic() + 240
        while min(progress(0), progress(2)) < 6:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values()), "no start"
            time.sleep(0.2)
        procs[1] = group(1)
        died = out / "heal_source_died"
        while not (out / "healed" / "g1_r0_a0").exists():
            assert time.monotonic() < deadline + 240, "group 1 never healed"
            assert procs[1].poll() is None, "group 1 exited"
            time.sleep(0.1)
        healed_at = time.time()
        assert died.exists(), "no heal source died"
        recovery = healed_at - float(died.read_text())
        dead = next(f for f in (0, 2) if procs[f].poll() is not None)
        live = 2 - dead
        write_whole(out / "stop_at", str(max(progress(f) for f in (1, live)) + 8))
        codes = {f: procs[f].wait(240) for f in (1, live)}
    finally:
        for p in procs.values():
            p.kill()
        terminate(lighthouse)
    logs = "".join(f"--- g{f}\n" + "".join(p.output())[-3000:] for f, p in procs.items())
    print(f"\nheal source (group {dead}) died mid-heal; group 1 healed from group {live} {recovery:.1f} s later "
          f"(bound {HEAL_SOURCE_BOUND_S:g} s; connect timeout {ft_net.CONNECT_TIMEOUT_S:g} s)")
    assert codes == {1: 0, live: 0}, logs
    assert recovery < HEAL_SOURCE_BOUND_S, logs
    import torch

    rec1, src = (torch.load(out / f"g{f}_r0_a0.pt", weights_only=False) for f in (1, live))
    assert [s["source"] for s in rec1["heal_sources"]][-1] == f"fl_accel_group_{live}", rec1["heal_sources"]
    assert rec1["heals"] == 1, rec1["heal_sources"]  # the failed heal is not counted as one
    assert all(torch.equal(a, b) for a, b in zip(rec1["final"]["params"], src["final"]["params"]))
    assert rec1["end"]["together"] is False and sorted(rec1["end"]["groups"]) == sorted([1, live]), rec1["end"]
