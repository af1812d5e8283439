"""The tests' launch names, as thin wrappers over :mod:`scripts.launch` and the fork
launcher (tests/_forkserver.py).

:func:`run_torchrun` starts ``nproc`` ranks of a script in one of two ways:

* ``launcher="fork"`` (the default): ranks forked from one server that imported torch,
  accelerate, transformers, datasets and fl_accel once per pytest session
  (tests/_forkserver.py: why, what a rank sees, what it does not cover);
* ``launcher="torchrun"``: ``sys.executable -m torch.distributed.run``, for tests whose
  subject is the launch itself (torchrun's failure summary, ``--max-restarts``, Ctrl-C,
  ``accelerate launch``), per-exec process state (peak memory), the CUDA tests, and a
  few recipe runs kept on the user's launch path.

:func:`start_forked` starts forked ranks without waiting (tests/ft/test_ft.py runs one
launch per federation group side by side).

Both use a fresh free ``--master_port`` (retried once if another suite took it),
``OMP_NUM_THREADS=1``, the repository root on ``PYTHONPATH`` and a wall-clock timeout,
after which every process is killed, so a hang fails the test instead of blocking the
suite.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from scripts import launch as _launch
from scripts.launch import free_port  # noqa: F401  (re-exported for the tests)

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"

Launch = _launch.Result
"""Outcome of a launch: ``returncode`` (None on timeout), ``stdout``, ``stderr``,
``seconds``, ``timed_out`` and ``tail()`` for assertion messages."""

LAUNCHER_VAR = "FL_ACCEL_TEST_LAUNCHER"
"""``FL_ACCEL_TEST_LAUNCHER=torchrun`` sends every default launch through real torchrun
(to compare the two, or to rule the fork launcher out when a test fails)."""

def launch_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a launch: ours, minus FL_ACCEL_* (a caller's settings must
    not leak into the tests), plus single-threaded BLAS/OpenMP, the repo on
    PYTHONPATH, offline Hugging Face libraries without datasets' progress bars and a
    short collective timeout."""
    return _launch.child_env({"FL_ACCEL_COLLECTIVE_TIMEOUT_S": "120", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
                              **(extra or {})}, pythonpath=[str(REPO_ROOT)])


def torchrun_cmd(nproc: int, script: Path | str, *args: str, port: int | None = None) -> list[str]:
    """``python -m torch.distributed.run --nproc_per_node N --master_port P script args``."""
    return _launch.torchrun_argv(nproc, script, *args, port=port)


def run_torchrun(nproc: int, script: Path | str, *args: str, timeout: float,
                 env: dict[str, str] | None = None, launcher: str | None = None) -> Launch:
    """Run ``nproc`` ranks of ``script args`` to completion or ``timeout`` seconds.

    Args:
        launcher: "fork" or "torchrun" (see the module docstring); None is
            ``$FL_ACCEL_TEST_LAUNCHER`` or "fork".

    Raises:
        ValueError: an unknown ``launcher``; with "fork", ``env`` changes a variable read
            at import time (tests/_forkserver.py ``IMPORT_TIME_VARS``).
    """
    if launcher is None:
        launcher = os.environ.get(LAUNCHER_VAR, "fork")
    if launcher == "torchrun":
        return _launch.run_torchrun(nproc, script, *args, timeout=timeout, env=launch_env(env), cwd=REPO_ROOT)
    if launcher != "fork":
        raise ValueError(f"launcher must be 'fork' or 'torchrun', got {launcher!r}")
    import _forkserver

    for attempt in range(2):
        rc, out, err, seconds, timed_out = _forkserver.run_forked(
            nproc, script, *args, timeout=timeout, env=launch_env(env), static_env=launch_env(), cwd=REPO_ROOT,
            port=free_port())
        res = Launch(rc, out, err, seconds, timed_out)
        if not (rc not in (0, None) and any(s in err for s in _launch.ADDRESS_IN_USE)):
            break
    return res


def start_forked(nproc: int, script: Path | str, *args: str, env: dict[str, str], log_dir: Path):
    """Start ``nproc`` forked ranks of ``script args`` and return at once (a
    :class:`_forkserver.ForkedLaunch`: ``poll``, ``wait``, ``kill``, ``output``), for tests
    that run several launches side by side (tests/ft/test_ft.py: one per federation group).
    ``env`` is the ranks' whole environment (e.g. :func:`launch_env` or
    ``scripts.ft_launch.group_env``); rank r writes ``log_dir/r.out`` and ``log_dir/r.err``.
    The caller waits for or kills the launch."""
    import _forkserver

    log_dir.mkdir(parents=True, exist_ok=True)
    return _forkserver.start_forked(nproc, script, *args, env=env, static_env=launch_env(), cwd=REPO_ROOT,
                                    port=free_port(), log_dir=log_dir)


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj, indent=1))
    return path


def write_whole(path: Path, text: str) -> None:
    """``path`` <- ``text`` as one rename: a process reading it meanwhile never sees it empty or
    half-written (``write_text`` truncates first)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


SMALL_CORPUS_WORDS = "to be or not that is the question whether tis nobler in mind suffer slings arrows outrageous fortune".split()


def small_corpus(tmp) -> list[str]:
    """A tiny text corpus under ``tmp`` and the recipe flags that read it: 52 training lines pack
    into 21 blocks of 64 tokens with the recipe's 300-token BPE (5 per rank on 4 ranks)."""
    import random

    random.seed(0)
    lines = [" ".join(random.choice(SMALL_CORPUS_WORDS) for _ in range(12)) for _ in range(152)]
    (tmp / "train.txt").write_text("\n".join(lines[:52]))
    (tmp / "val.txt").write_text("\n".join(lines[52:]))
    return ["--train_file", str(tmp / "train.txt"), "--validation_file", str(tmp / "val.txt"), "--vocab_size", "300",
            "--seq_len", "64", "--cache_dir", str(tmp / "cache")]


def assert_one_line_error(main, args, capsys) -> None:
    """A command's ``main(args)`` in this process (``capsys``: pytest's) exits with status 2,
    prints nothing on stdout and one ``error: ...`` line on stderr: how every CLI of scripts/
    answers bad input."""
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
