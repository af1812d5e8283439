"""``python -m scripts.ft_launch`` supervises its federation groups (issue 31).

* The restart policy with fake launches (no process; control flow only): a group whose
  torchrun is killed restarts, up to ``--max_restarts`` times, with the recipe's command
  plus ``--resume_from_checkpoint latest`` (other scripts: the same command); the exit
  status is 0 when every group finished, restarted ones included, else the first failed
  group's shell-style status; a ``--restart_group`` request kills and restarts a group
  without using ``--max_restarts``; every ``[ft_launch]`` line names the group.
* The recipe's heal line and the bytes of a heal's state, from a record (no process).
* The supervisor with real processes: 2 groups of the recipe (tiny Llama, torchft mode, a
  Lighthouse whose quorums wait for both groups), each one rank forked from the tests' server;
  group 1 is killed with SIGKILL after the first sync. The supervisor restarts it with
  ``--resume_from_checkpoint latest``, the restarted group heals from group 0 and the recipe
  prints the heal line, both groups finish with equal eval losses and the exit status is 0,
  the summary naming group 1's restart. The command line, whose groups are real torchruns,
  runs in tests/dist/test_examples.py (the torchft example) and tests/ft/test_ft.py.
"""

from __future__ import annotations

import json
import re
import signal
import time

import pytest

from _launch import REPO_ROOT, launch_env
from scripts import ft_launch
from scripts.ft_launch import Supervisor, decide, restart_args
from scripts.launch import terminate

# ---------------------------------------------------------------------- the policy, with fake launches


class FakeLaunch:
    """A launch that ends with ``code`` after ``polls`` polls (never, for ``code=None``)."""

    pids = iter(range(1000, 2000))

    def __init__(self, code: int | None, polls: int = 2):
        self.pid, self.code, self.polls, self.returncode = next(self.pids), code, polls, None

    def poll(self):
        if self.returncode is None and self.code is not None:
            self.polls -= 1
            if self.polls <= 0:
                self.returncode = self.code
        return self.returncode

    def wait(self):
        assert self.returncode is not None, "waited on a fake launch that never ends"
        return self.returncode


def _supervise(plan: dict, max_restarts: int, control_dir=None, on_poll=None):
    """Run a Supervisor whose group f's attempt k is ``FakeLaunch(*plan[f][k])``; returns
    (exit status, the starts as (group, attempt), the printed text)."""
    import io

    starts, out = [], io.StringIO()

    def start(f, attempt):
        starts.append((f, attempt))
        return FakeLaunch(*plan[f][attempt]), f"group{f}.log"

    def kill(proc):
        proc.returncode = -signal.SIGKILL

    polls = [0]

    def sleep(_):
        polls[0] += 1
        assert polls[0] < 200, "the supervisor did not end"
        if on_poll:
            on_poll(polls[0])

    sup = Supervisor(len(plan), start, max_restarts=max_restarts, restart_delay_s=0.0, control_dir=control_dir,
                     kill=kill, watch=False, out=out, sleep=sleep)
    return sup.run(poll_s=0), starts, out.getvalue()


def test_restart_policy_with_fake_launches(tmp_path):
    """Control flow only: ``decide``, the restart command and the exit status (fails on the
    launcher without a supervisor: no ``Supervisor``, exit 247 for a killed group)."""
    assert [decide(0, 0, 0), decide(-9, 0, 1), decide(1, 1, 1), decide(-9, 0, 0)] == \
        ["finished", "restart", "failed", "failed"]
    recipe = ["--fault_tolerance", "torchft", "--max_steps", "8"]
    assert restart_args("recipes/pretrain.py", recipe) == recipe + ["--resume_from_checkpoint", "latest"]
    assert restart_args(REPO_ROOT / "recipes" / "pretrain.py", recipe + ["--resume_from_checkpoint=x"]) == \
        recipe + ["--resume_from_checkpoint=x"]  # the user's checkpoint stays
    assert restart_args("examples/train_loop.py", ["--max_steps", "8"]) == ["--max_steps", "8"]

    # group 1 is killed once (SIGKILL), restarts and finishes: exit 0
    status, starts, text = _supervise({0: [(0, 5)], 1: [(-9, 2), (0, 2)]}, max_restarts=1)
    assert status == 0 and starts == [(0, 0), (1, 0), (1, 1)], (status, starts, text)
    assert re.search(r"group 1: torchrun pid \d+ \(log: group1\.log\)", text), text
    assert re.search(r"group 1: torchrun pid \d+ ended by SIGKILL \(status -9\); restarting it \(1 of 1\)", text), text
    assert re.search(r"group 1: torchrun pid \d+ \(restart 1 of 1\) \(log: group1\.log\)", text), text
    assert re.search(r"group 0: torchrun pid \d+ finished\n", text) and "group 0: finished\n" in text, text
    assert "group 1: finished after 1 restart (ended by SIGKILL (status -9))" in text, text
    assert "group exit statuses: [0, 0]" in text, text

    # no restart allowed (today's default): the killed group fails, the other still finishes
    status, starts, text = _supervise({0: [(0, 5)], 1: [(-9, 2)]}, max_restarts=0)
    assert status == 128 + signal.SIGKILL and starts == [(0, 0), (1, 0)], (status, text)
    assert "group 1: failed with status -9 (no restart)" in text and "group 0: finished" in text, text

    # it fails again after its one restart: the last status, shell style
    status, starts, text = _supervise({0: [(0, 1)], 1: [(1, 1), (3, 1)]}, max_restarts=1)
    assert status == 3 and starts == [(0, 0), (1, 0), (1, 1)], text
    assert "group 1: failed with status 3 after 1 restart (exited with status 1)" in text, text

    # a --restart_group request: the running group is killed and restarted, --max_restarts 0 notwithstanding
    def ask(n):
        if n == 3:
            ft_launch.request_file(tmp_path, 1).write_text("{}")

    status, starts, text = _supervise({0: [(0, 10)], 1: [(None,), (0, 2)]}, max_restarts=0, control_dir=tmp_path,
                                      on_poll=ask)
    assert status == 0 and starts == [(0, 0), (1, 0), (1, 1)], text
    assert re.search(r"group 1: restart requested; killing torchrun pid \d+", text), text
    assert "group 1: finished after 1 restart, 1 on request" in text, text
    state = json.loads((tmp_path / ft_launch.STATE_FILE).read_text())
    assert [g["state"] for g in state["groups"]] == ["finished", "finished"] and state["groups"][1]["requested"] == 1
    assert state["groups"][1]["statuses"] == [-9, 0] and not ft_launch.request_file(tmp_path, 1).exists()


# ---------------------------------------------------------------------- the real thing
RECIPE_ARGS = ["--fault_tolerance", "torchft", "--model", "tiny", "--seq_len", "64", "--micro_batch_size", "2",
               "--max_steps", "8", "--log_every", "1", "--eval_every", "0", "--max_eval_blocks", "16",
               "--sync_every", "2", "--num_groups", "2", "--checkpoint_every", "6", "--report_to", "none",
               "--save_final_model", "false"]  # the export in the torchft mode: tests/ft/test_ft.py's recipe runs


def _lines(path):
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return []


class _Forked:
    """A forked launch (tests/_forkserver.py) as the Supervisor sees a torchrun: ``pid``
    (rank 0's), ``poll()`` and ``wait()``."""

    def __init__(self, launch):
        self.launch, self.pid = launch, launch.pids[0]

    def poll(self):
        return self.launch.poll()

    def wait(self):
        return self.launch.wait()


def test_supervisor_restarts_a_killed_recipe_group_which_heals(tmp_path, default_corpus_cache):
    """The launcher's :class:`Supervisor` (``--max_restarts 1``, the CLI's restart delay and
    its command for a restart, :func:`restart_args`) over 2 groups of the recipe (tiny
    Llama, torchft mode, a Lighthouse whose quorums wait for both groups; 8 steps, H=2, a
    checkpoint every 6 steps), each group one rank forked from the tests' server with
    ``ft_launch.group_env``'s environment (the command line itself, a Lighthouse and a real
    torchrun per group, runs in tests/dist/test_examples.py and
    :func:`test_ft.test_ft_launch_cli_starts_a_lighthouse_and_one_torchrun_per_group`).

    Once group 1 logged step 2 (its first sync committed, no checkpoint yet) every process of
    group 1 gets SIGKILL. The supervisor says so and restarts group 1 with
    ``--resume_from_checkpoint latest`` (no checkpoint yet: it starts from step 0, behind
    group 0's torchft step), which heals from group 0 at its first sync: the recipe prints
    ``[fl_accel] group 1 healed from group 0 at step N: X MB in Y s (transfer T s, load L s)``
    in group 1's own log and records the heal in all_results.json. Both groups finish with equal final eval losses, and the exit status
    is 0 with ``group 1: finished after 1 restart``."""
    import io

    pytest.importorskip("torchft", reason="torchft is not installed (pip install torchft==0.2.0)")
    from _launch import start_forked

    out, logs = tmp_path / "out", tmp_path / "logs"
    recipe = REPO_ROOT / "recipes" / "pretrain.py"
    args = [*RECIPE_ARGS, "--output_dir", str(out), "--cache_dir", default_corpus_cache]
    lighthouse, addr = ft_launch.start_lighthouse(log=open(tmp_path / "lighthouse.log", "w"), min_replicas=2)
    hf = {k: v for k, v in launch_env().items() if k.startswith("HF_")}  # as the fork server imported with
    argvs, launches = {}, {}

    def start(f, attempt):
        argv = args if attempt == 0 else restart_args(recipe, args)
        argvs[f, attempt] = argv
        env = ft_launch.group_env(f, addr, {"FL_ACCEL_COLLECTIVE_TIMEOUT_S": "60", **hf}, pythonpath=[str(REPO_ROOT)])
        launch = start_forked(1, recipe, *argv, env=env, log_dir=logs / f"group{f}_a{attempt}")
        launches[f, attempt] = launch
        return _Forked(launch), str(logs / f"group{f}_a{attempt}")

    killed, deadline = [], time.monotonic() + 420

    def sleep(seconds):  # between the supervisor's polls: kill group 1 once it is past its first sync
        assert time.monotonic() < deadline, "the run did not end in 420 s"
        group1 = sup.groups[1]
        if not killed and group1.proc is not None and \
                any(r.get("step", 0) >= 2 and "train/loss" in r for r in _lines(out / "group1" / "metrics.jsonl")):
            assert not (out / "group1" / "checkpoints" / "step_6").exists(), "too late: group 1 has a checkpoint"
            killed.append(group1.proc.pid)
            group1.proc.launch.kill()  # SIGKILL to every process of group 1
        time.sleep(seconds)

    text = io.StringIO()
    delay = ft_launch.LIGHTHOUSE_DEFAULTS["heartbeat_timeout_ms"] / 1000  # the CLI's default --restart_delay_s
    sup = Supervisor(2, start, max_restarts=1, restart_delay_s=delay,
                     kill=lambda p: p.launch.kill(), watch=False, out=text, sleep=sleep)
    try:
        status = sup.run(poll_s=0.1)
    finally:
        for launch in launches.values():
            launch.kill()
        terminate(lighthouse)
    text = text.getvalue()
    group_logs = {f: "".join("".join(launches[g, a].output()) for g, a in sorted(launches) if g == f) for f in range(2)}
    tails = "\n".join(f"--- group{f}\n{t[-4000:]}" for f, t in group_logs.items())
    assert status == 0 and killed, text + tails
    pid = killed[0]
    assert f"[ft_launch] group 1: torchrun pid {pid} ended by SIGKILL (status -9); restarting it (1 of 1)" in text, text
    assert re.search(r"\[ft_launch\] group 1: torchrun pid \d+ \(restart 1 of 1\) \(log: .*group1_a1\)", text), text
    assert "[ft_launch] group 0: finished\n" in text, text
    assert "[ft_launch] group 1: finished after 1 restart (ended by SIGKILL (status -9))" in text, text
    assert "group exit statuses: [0, 0]" in text, text
    assert argvs[1, 1][-2:] == ["--resume_from_checkpoint", "latest"] and (0, 1) not in argvs, argvs
    assert "no complete checkpoint in" in group_logs[1], tails  # killed before its first checkpoint
    heal = re.findall(r"\[fl_accel\] group 1 healed from group 0 at step (\d+): ([0-9.]+) (MB|kB) in ([0-9.]+) s "
                      r"\(transfer ([0-9.]+) s, load ([0-9.]+) s\)", group_logs[1])
    assert len(heal) == 1, tails
    print("heal line:", next(x for x in group_logs[1].splitlines() if "healed from group" in x))
    results = [json.loads((out / f"group{f}" / "all_results.json").read_text()) for f in range(2)]
    ft1 = results[1]["fault_tolerance"]
    assert ft1["heals"] == 1 and results[0]["fault_tolerance"]["heals"] == 0, ft1
    [record] = ft1["heal_log"]
    assert record["source_group"] == 0 and record["step"] == int(heal[0][0]) and record["bytes"] > 0, record
    # the slowest rank's transfer and load (one rank here: they add up to its total)
    assert record["transfer_seconds"] > 0 and record["load_seconds"] > 0, record
    assert record["transfer_seconds"] + record["load_seconds"] == pytest.approx(record["seconds"], rel=1e-6), record
    assert abs(record["bytes"] / (1e6 if heal[0][2] == "MB" else 1e3) - float(heal[0][1])) < 0.06, (record, heal)
    assert results[0]["steps"] == results[1]["steps"] == 8
    # issue 42: group 1's counters cover its restarted process only (its first session left no checkpoint), and
    # say so in all_results.json and its closing lines; group 0's cover the run
    c0, c1 = results[0]["counters"], results[1]["counters"]
    assert c0 == {"since": "the run's start", "carried_over_from": None, "steps_counted": 8}, c0
    assert c1["since"] == "this process's start" and c1["steps_counted"] == ft1["steps_trained"] < 8, c1
    assert "[fl_accel] note: tokens, time and traffic count since this process started" in group_logs[1], tails
    assert results[0]["eval_loss"] == results[1]["eval_loss"], [r["eval_loss"] for r in results]


def test_heal_line_and_heal_bytes():
    """The recipe's heal line (recipes/pretrain.py ``heal_line``) from a heal record, and the
    bytes of a heal's state (fl_accel/heal.py ``state_nbytes``: tensors in nested dicts,
    lists and tuples, other values 0)."""
    import torch

    from fl_accel.heal import state_nbytes
    from recipes.pretrain import heal_line

    state = {"params": [torch.zeros(10), torch.zeros(2, 3, dtype=torch.float64)],
             "optimizer": {"state": {0: {"exp_avg": (torch.zeros(10), True), "step": 3}}, "groups": [{"lr": 0.1}]},
             "schedule": {"global_step": 4}}
    assert state_nbytes(state) == 40 + 48 + 40
    record = {"source": "fl_accel_group_0", "source_group": 0, "bytes": 1_234_567, "seconds": 0.83,
              "transfer_seconds": 0.61, "load_seconds": 0.22}
    assert heal_line(1, record, 12) == ("[fl_accel] group 1 healed from group 0 at step 12: 1.2 MB in 0.83 s "
                                        "(transfer 0.61 s, load 0.22 s)")  # hundredths below a second
    slow = {**record, "bytes": 34_600, "seconds": 2.34, "transfer_seconds": 2.04, "load_seconds": 0.3}
    assert heal_line(2, slow, 6).endswith("at step 6: 34.6 kB in 2.3 s (transfer 2.0 s, load 0.30 s)")


def test_bad_input_through_the_launcher_ends_with_the_one_line_error(tmp_path):
    """Issue 42: ``python -m scripts.ft_launch`` (a Lighthouse and one real torchrun per group,
    2 groups of 1 rank) with a bad recipe flag: every group fails before any collective, and the
    launcher's last line is the recipe's one-line error (read from the error file each group's
    torchrun copied its failure into: TORCHELASTIC_ERROR_FILE), after its per-group summary,
    not torchrun's ChildFailedError summary; the exit status is the groups' (torchrun's 1)."""
    import subprocess
    import sys

    pytest.importorskip("torchft", reason="torchft is not installed (pip install torchft==0.2.0)")
    from _launch import launch_env

    cmd = [sys.executable, "-m", "scripts.ft_launch", "--num_groups", "2", "--nproc_per_group", "1", "--",
           "recipes/pretrain.py", "--fault_tolerance", "torchft", "--num_groups", "2", "--report_to", "none",
           "--output_dir", str(tmp_path / "out"), "--max_steps", "-3"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    out = proc.stdout
    lines = [line for line in out.splitlines() if line.strip()]
    assert proc.returncode == 1, out[-4000:]
    assert re.fullmatch(r"\[fl_accel\] error \(rank 0\): --max_steps must be >= 1, got -3", lines[-1]), out[-4000:]
    assert lines[-2].startswith("[ft_launch] group exit statuses: [1, 1]"), out[-4000:]
    assert "ChildFailedError" in out  # the groups' own torchrun summaries, above (no --log_dir: this terminal)
