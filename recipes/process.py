"""The recipe's process plumbing: signals, the launcher's death, one-line messages and errors, exit statuses.

What :func:`recipes.pretrain.cli` wraps :func:`recipes.pretrain.main` in, so that a rank ends
the way a user of torchrun or ``accelerate launch`` wants to read it:

* :func:`install`: SIGTERM (the launcher stopping the survivors of a failed rank) and SIGINT
  (Ctrl-C) end the rank at once with one line, no traceback and no atexit handler waiting on
  peers that left (exit 143 and 130); a rank ends with its launcher (prctl(2)
  PR_SET_PDEATHSIG); fl_accel's warnings print as their one line;
* :func:`refused` (exit 2 for a bad input, 1 for a torchft group that lost its state) and
  :func:`collective_failed` (exit 1): one line per node and message, written to torchrun's
  error file too (:func:`fl_accel.errors.record_for_launcher`, the Root Cause box), and the
  process groups released (:func:`fl_accel.errors.release_process_groups`);
* :func:`say`: one line to stderr, on a line of its own past an open progress bar.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import warnings

import torch.distributed as dist

from fl_accel import FLConfig
from fl_accel.errors import record_for_launcher, release_process_groups, say_once
from recipes.compat import progress_bar_open


def classify_failure(exc: BaseException) -> str | None:
    """'collective' when ``exc`` came out of torch.distributed (a peer died or hung: gloo
    raises a plain RuntimeError from inside torch.distributed, NCCL a DistBackendError),
    else None."""
    if isinstance(exc, (dist.DistError,)):
        return "collective"
    tb = exc.__traceback__
    while tb is not None:
        if f"torch{os.sep}distributed{os.sep}" in tb.tb_frame.f_code.co_filename:
            return "collective"
        tb = tb.tb_next
    return None


def say(line: str) -> None:
    """One write per line, so lines of concurrent ranks sharing a pipe do not interleave; on a
    new line when this rank draws a progress bar (tqdm leaves its line open)."""
    lead = "\n" if progress_bar_open() else ""
    sys.stderr.write(lead + line.replace("\n", " ") + "\n")
    sys.stderr.flush()


_STOPPING = []


def _on_sigterm(signum, frame):
    # torchrun sends SIGTERM to the surviving ranks when one rank fails. Exit at once: an
    # interpreter shutdown would run atexit handlers that wait on the dead peers.
    if not _STOPPING:
        say(f"[fl_accel] rank {os.environ.get('RANK', '0')}: stopped by the launcher (another rank failed, "
             f"the job was cancelled or the launcher died)")
    sys.stdout.flush()
    os._exit(143)


def _on_sigint(signum, frame):
    # Ctrl-C (torchrun forwards it to every rank): one line per rank, then exit at once, so no
    # traceback of wherever the rank was and no atexit handler waiting on peers that left.
    _STOPPING.append(signum)
    say(f"[fl_accel] rank {os.environ.get('RANK', '0')}: interrupted; resume with --resume_from_checkpoint latest "
         f"(checkpoints every --checkpoint_every steps)")
    sys.stdout.flush()
    os._exit(130)


def _one_line_warnings() -> None:
    """fl_accel's own warnings ("[fl_accel] ...") print as their message, on one line, not as
    ``file:line: UserWarning`` plus a source line."""
    default = warnings.formatwarning

    def fmt(message, category, filename, lineno, line=None):
        text = str(message)
        return text.replace("\n", " ") + "\n" if text.startswith("[fl_accel]") else \
            default(message, category, filename, lineno, line)

    warnings.formatwarning = fmt


def _timeout_text() -> str:
    """How the collective timeout was set (``FLConfig.collective_timeout_s``)."""
    env = os.environ.get("FL_ACCEL_COLLECTIVE_TIMEOUT_S")
    return (f"FL_ACCEL_COLLECTIVE_TIMEOUT_S={env} s" if env else
            f"FLConfig.collective_timeout_s, {FLConfig.collective_timeout_s:g} s unless the --config YAML sets it")


def _end_with_launcher() -> None:
    """Under torchrun/accelerate launch (LOCAL_RANK set), on Linux: SIGTERM this rank when its
    launcher dies (prctl(2) PR_SET_PDEATHSIG), so a SIGKILLed launcher (OOM killer, kill -9 of
    its process group) leaves no rank training on: torchrun starts each rank in its own session,
    out of reach of a group kill. The signal comes when the *thread* that forked the rank ends:
    torchrun's agent starts its workers from its main thread (elastic SubprocessContext, Popen),
    the tests' fork launcher from the fork server's main thread (tests/_forkserver.py); both live
    as long as the ranks. A launcher that died between the two getppid() calls is caught too
    (the rank was reparented); one gone before cli() ran (interpreter start-up) is not."""
    if not sys.platform.startswith("linux") or "LOCAL_RANK" not in os.environ:
        return
    parent = os.getppid()
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def install() -> None:
    """Before :func:`recipes.pretrain.main`: the SIGTERM and SIGINT handlers, the end with the
    launcher (:func:`_end_with_launcher`) and one-line warnings (:func:`_one_line_warnings`)."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, _on_sigint)
    _end_with_launcher()
    _one_line_warnings()


def refused(exc: BaseException, status: int) -> int:
    """A refused input (``status`` 2: a ValueError such as RecipeError, DataError,
    CheckpointError or an FLConfig error) or a torchft group restarted without a state that no
    group holds (``status`` 1: StateLostError), which every rank raises alike: one line per node
    and message, recorded for the launcher, the process groups released. Returns ``status``."""
    message = f"[fl_accel] error (rank {os.environ.get('RANK', '0')}): {exc}"
    _STOPPING.append("error")  # the launcher's SIGTERM that follows adds no line
    say_once(message, key=str(exc))  # once per node and message (every rank refuses alike)
    record_for_launcher(message)  # torchrun's Root Cause box shows it
    release_process_groups()
    return status


def collective_failed(exc: BaseException) -> int:
    """A collective that failed (:func:`classify_failure`: a peer rank died or hung): one line
    naming the collective timeout and how it was set, recorded for the launcher. Returns 1."""
    message = (f"[fl_accel] error (rank {os.environ.get('RANK', '0')}): a collective failed; a peer rank died or hung "
               f"(collective timeout {_timeout_text()}): {str(exc)[:500]}")
    _STOPPING.append("error")
    say(message)
    record_for_launcher(message)
    return 1
