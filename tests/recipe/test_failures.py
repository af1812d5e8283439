"""Failure behaviour of real multi-process recipe runs: dead and hung ranks, restarts.

Faults are injected with the recipe's ``FL_ACCEL_TEST_FAULT_INJECT=<kill|stop>:<rank>:<step>`` hook
(recipes/testing_hooks.py):
``kill`` is a kill -9 of one rank after that optimizer step, ``stop`` freezes it (a hung
rank). The job must end with a clear message instead of hanging, and
``torchrun --max-restarts`` with ``--resume_from_checkpoint latest`` must finish the run.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from _launch import REPO_ROOT, launch_env, run_torchrun
from fl_accel import FLConfig
from recipes.run_folder import read_metrics
from scripts import launch

RECIPE = REPO_ROOT / "recipes" / "pretrain.py"
FAST = ["--model", "tiny", "--seq_len", "64", "--micro_batch_size", "2", "--log_every", "1",
        "--max_eval_blocks", "16", "--report_to", "none", "--num_groups", "2", "--save_final_model", "false"]


# The collective timeout's variable: an FLConfig field once fl_accel has it (COORD decision 3).
TIMEOUT_VAR = "FL_ACCEL_COLLECTIVE_TIMEOUT_S" if "collective_timeout_s" in FLConfig.field_names() else "FL_TIMEOUT_S"


@pytest.fixture(scope="module")
def cache(default_corpus_cache):
    """The run's corpus/tokenizer cache, filled before the launches (tests/conftest.py)."""
    return default_corpus_cache


def torchrun(args, env, timeout, *torchrun_flags, cache_dir, launcher="torchrun", nproc=4):
    """``nproc`` ranks of the recipe under real torchrun (its messages and restarts are asserted
    on), or with ``launcher="fork"`` the tests' fork launcher (tests/_forkserver.py)."""
    if launcher == "fork":
        res = run_torchrun(nproc, RECIPE, *args, "--cache_dir", cache_dir, timeout=timeout, env=env, launcher="fork")
    else:
        cmd = launch.torchrun_argv(nproc, RECIPE, *args, "--cache_dir", cache_dir, extra_flags=torchrun_flags)
        res = launch.wait(launch.start(cmd, launch_env(env), REPO_ROOT, subprocess.PIPE, subprocess.PIPE), timeout)
    if res.timed_out:
        raise AssertionError(f"job hung: killed after {timeout}s\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")
    return res.returncode, res.stdout, res.stderr, res.seconds


def _survivors(err: str) -> set[str]:
    """The ranks that said why they stopped: the launcher stopped them, or their collective failed."""
    return {line.split("rank ")[1].split(":")[0].split(")")[0] for line in err.splitlines()
            if "stopped by the launcher" in line or "a collective failed" in line}


def test_killed_rank_ends_the_job_with_a_message(tmp_path, cache):
    """kill -9 of rank 1 mid-training (2 ranks, 2 federation groups of one): the launcher stops
    the other rank, which says why, and the job fails with the killed rank's signal. Forked
    ranks (the fork launcher stops the others as torchrun's agent does); real torchrun doing
    the same is asserted in :func:`test_max_restarts_resumes_from_latest_checkpoint`, whose
    first attempt ends this way."""
    rc, out, err, seconds = torchrun([*FAST, "--algorithm", "fl_fsdp", "--max_steps", "8", "--sync_every", "4",
                                      "--output_dir", str(tmp_path)],
                                     {"FL_ACCEL_TEST_FAULT_INJECT": "kill:1:2", TIMEOUT_VAR: "60"}, timeout=240,
                                     cache_dir=cache, nproc=2, launcher="fork")
    assert rc == -9, (rc, out[-2000:], err[-4000:])  # the first failure: rank 1's SIGKILL
    assert "FL_ACCEL_TEST_FAULT_INJECT: kill rank 1 at step 2" in err
    survivors = _survivors(err)
    assert survivors and "1" not in survivors, err[-4000:]
    assert not os.path.exists(tmp_path / "all_results.json")


def test_hung_rank_makes_peers_time_out(tmp_path, cache):
    """A frozen rank (SIGSTOP after step 2): its peers' collectives time out after the collective timeout
    and the job ends. Every process group carries the timeout, also the mesh sub-groups: fl_hsdp
    has all three ("dp_shard", "dp_replicate", "fl"; every mesh is built the same way, by
    new_group(timeout=) + DeviceMesh.from_group), so one launch covers the other algorithms'
    groups; with the backend's 30-minute default on a sub-group it would hang."""
    args = [*FAST, "--algorithm", "fl_hsdp", "--hsdp_shard_size", "2", "--max_steps", "8", "--sync_every", "4",
            "--output_dir", str(tmp_path)]
    # the subject is the recipe's collective timeout, not the launcher: forked ranks
    rc, out, err, seconds = torchrun(args, {"FL_ACCEL_TEST_FAULT_INJECT": "stop:3:2", TIMEOUT_VAR: "10"}, timeout=300,
                                     cache_dir=cache, launcher="fork")
    assert rc != 0
    assert "FL_ACCEL_TEST_FAULT_INJECT: stop rank 3 at step 2" in err
    assert "a collective failed; a peer rank died or hung (collective timeout " in err, err[-5000:]
    assert "=10" in err.split("collective timeout ", 1)[1].split(")")[0], err[-5000:]
    failed = {line.split("(rank ")[1].split(")")[0] for line in err.splitlines() if "a collective failed" in line}
    assert failed and "3" not in failed, err[-5000:]


def test_max_restarts_resumes_from_latest_checkpoint(tmp_path, cache):
    """kill -9 of rank 1 at step 3 with --max-restarts 1 (2 ranks, 2 federation groups of one):
    torchrun sees the failure and stops the other rank (or that rank's collective fails first),
    which says why; the restarted job resumes from step_2 and finishes."""
    out_dir = tmp_path / "run"
    args = [*FAST, "--algorithm", "fl_fsdp", "--max_steps", "4", "--sync_every", "6", "--checkpoint_every", "2",
            "--output_dir", str(out_dir),
            "--resume_from_checkpoint", "latest"]
    rc, out, err, seconds = torchrun(args, {"FL_ACCEL_TEST_FAULT_INJECT": "kill:1:3"}, 420, "--max-restarts", "1",
                                     cache_dir=cache, nproc=2)
    assert rc == 0, out[-3000:] + err[-6000:]
    assert "FL_ACCEL_TEST_FAULT_INJECT: kill rank 1 at step 3" in err
    attempt0 = err.split("FL_ACCEL_TEST_FAULT_INJECT: kill rank 1 at step 3", 1)[1]
    # torchrun saw the first attempt fail. Which rank its summary names is a race: it takes the
    # failure with the smallest timestamp, in whole seconds; the killed rank's is taken when the
    # agent polls, the survivor's from the error file it writes when its collective fails
    # (recipes/process.py: fl_accel.errors.record_for_launcher), so a second boundary between
    # the two names rank 0. Rank 0
    # ends with 143 (torchrun's SIGTERM, its handler), 1 (its failed collective), or -15 when the
    # SIGTERM arrives after it reported that failure, during interpreter shutdown, where Python has
    # restored the default signal handlers.
    first = attempt0.split("failed (exitcode: ", 1)
    assert len(first) == 2, err[-6000:]
    assert first[1].startswith(("-9) local_rank: 1", "143) local_rank: 0", "1) local_rank: 0", "-15) local_rank: 0")), \
        err[-6000:]
    assert _survivors(attempt0) == {"0"}, err[-6000:]  # the other rank, stopped, said why
    assert f"resumed from {out_dir / 'checkpoints' / 'step_2'} at step 2" in out, out[-3000:]
    # H larger than the run is allowed, with a warning; the groups then sync once, at the end.
    assert "sync_every=6 exceeds the 4 training steps" in out
    results = json.loads((out_dir / "all_results.json").read_text())
    assert results["steps"] == 4 and results["comm"]["fl"]["calls"] == 1
    steps = [r["step"] for r in read_metrics(out_dir / "metrics.jsonl") if "train/loss" in r]
    assert steps == [1, 2, 3, 4], steps  # the first attempt's step 3 was dropped on resume
    assert not any(p.name.endswith(".partial") for p in (out_dir / "checkpoints").iterdir())


def test_ctrl_c_ends_each_rank_with_one_line(tmp_path, cache):
    """Ctrl-C (SIGINT to the launcher, which forwards it to every rank): each rank prints one
    line with the resume advice and exits, with no traceback of its own and no second line
    (no "stopped by the launcher", no "a collective failed"). torchrun's own
    SignalException traceback is the launcher's and stays."""
    import signal
    import time

    out_dir = tmp_path / "run"
    cmd = launch.torchrun_argv(2, RECIPE, *FAST, "--algorithm", "fsdp", "--max_steps", "1000",
                               "--output_dir", str(out_dir), "--cache_dir", cache)
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err_file:
        proc = launch.start(cmd, launch_env(), REPO_ROOT, subprocess.PIPE, err_file)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and "step/s" not in log.read_text() and "s/step" not in log.read_text():
            if proc.poll() is not None:
                break
            time.sleep(1)
        assert proc.poll() is None, log.read_text()[-3000:]  # training (the progress bar moves)
        os.kill(proc.pid, signal.SIGINT)  # what the terminal sends the launcher on Ctrl-C
        res = launch.wait(proc, 120)
    err = log.read_text()
    assert not res.timed_out and res.returncode != 0, err[-3000:]
    ours = [line for line in err.splitlines() if line.startswith("[fl_accel] ")]
    assert sorted(ours) == sorted(f"[fl_accel] rank {r}: interrupted; resume with --resume_from_checkpoint latest "
                                  f"(checkpoints every --checkpoint_every steps)" for r in (0, 1)), err[-3000:]
    assert "KeyboardInterrupt" not in err and "pretrain.py\", line" not in err, err[-3000:]


def test_ranks_end_when_the_launcher_is_killed(tmp_path, cache):
    """kill -9 of torchrun alone (as by the OOM killer; its ranks run in sessions of their
    own, so a kill of its process group misses them too): every rank gets SIGTERM from the
    kernel (recipes/process.py ``_end_with_launcher``, PR_SET_PDEATHSIG), says "stopped by
    the launcher" and exits, instead of training on and writing checkpoints beside a
    ``--resume_from_checkpoint latest`` run."""
    import signal
    import time

    import psutil

    cmd = launch.torchrun_argv(2, RECIPE, *FAST, "--algorithm", "fsdp", "--max_steps", "100000",
                               "--output_dir", str(tmp_path / "run"), "--cache_dir", cache)
    log = tmp_path / "stderr.txt"
    ranks: list = []
    with open(log, "w") as err_file:
        proc = launch.start(cmd, launch_env(), REPO_ROOT, subprocess.DEVNULL, err_file)
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and proc.poll() is None and not any(
                    s in log.read_text() for s in ("step/s", "s/step")):
                time.sleep(1)
            assert proc.poll() is None, log.read_text()[-3000:]  # training (the progress bar moves)
            ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                     if any("pretrain.py" in a for a in p.cmdline())]
            assert len(ranks) == 2, ranks
            os.kill(proc.pid, signal.SIGKILL)  # torchrun only, not its group
            proc.wait()

            def alive():
                out = []
                for p in ranks:
                    try:
                        if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                            out.append(p.pid)
                    except psutil.NoSuchProcess:
                        pass
                return out

            deadline = time.monotonic() + 30
            while alive() and time.monotonic() < deadline:
                time.sleep(0.5)
            assert not alive(), (alive(), log.read_text()[-3000:])
        finally:
            for p in ranks:  # a failing test leaves no rank training
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            launch.terminate(proc, 0)
    err = log.read_text()
    assert all(f"rank {r}: stopped by the launcher" in err for r in (0, 1)), err[-3000:]
