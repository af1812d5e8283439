"""Run ``torchrun`` or ``accelerate launch`` so that a failed rank's one-line error is the last line printed.

    OMP_NUM_THREADS=1 python -m scripts.launch_guard torchrun --nproc_per_node 4 recipes/pretrain.py ...
    python -m scripts.launch_guard accelerate launch --config_file accelerate_configs/cpu_4proc.yaml \\
        recipes/pretrain.py --config recipes/configs/cpu_fl_fsdp.yaml

The launcher runs in this process, with the arguments it would get on its own command line
(torch's ``torch.distributed.run.main``, accelerate's ``accelerate launch``). When every rank
succeeds nothing changes. When one fails, torchrun raises ``ChildFailedError``, which on its
own ends the launcher with a Python traceback and a boxed failure summary (about 40 lines,
the last one a row of ``=``), so the error that matters scrolls away. Here the exception is
caught and its first failure read from the worker's error file (``TORCHELASTIC_ERROR_FILE``,
which the recipe writes its ``[fl_accel] error ...`` line into; any script decorated with
torch's ``@record`` writes its exception there too): one line says which rank failed with
which status, the worker's traceback follows if it wrote one, and the error's own line comes
last. A failure without an error file (a signal, a script that does not record its errors)
prints torchrun's summary as torchrun would. ``accelerate launch`` of one process (no
torchrun) ends with the script's own status and output.

Exit status: the failed rank's (2 for the recipe's bad input, also when the rank recorded it and
the launcher's SIGTERM then cut its exit short; 128 + N for signal N), 0 when
every rank succeeded, 2 with one ``error:`` line for a command other than ``torchrun ...``
or ``accelerate launch ...``. If this process was itself given a ``TORCHELASTIC_ERROR_FILE``
(a launcher above it), the first failure's file is copied there, as torchrun's ``@record`` does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

from scripts.cli import fail
from scripts.launch import error_file_message, exit_code

PREFIX = "[launch_guard]"


def _launch(argv: list[str]) -> None:
    """Run the launcher of ``argv`` (``torchrun ...`` / ``accelerate launch ...``) in this process."""
    if argv[0] == "torchrun":
        from torch.distributed.run import main as torchrun

        torchrun(argv[1:])
        return
    from accelerate.commands.accelerate_cli import main as accelerate

    saved = sys.argv
    sys.argv = ["accelerate", *argv[1:]]
    try:
        accelerate()
    finally:
        sys.argv = saved


def failure_lines(script: str, rank: int, exitcode: int, error_file: str | None) -> list[str] | None:
    """What to print for a failed rank (``rank`` global, ``exitcode`` its status, negative for
    a signal): the summary line, the worker's traceback if it wrote one, and its one-line error
    last; None when its error file holds no message (then torchrun's own summary is printed)."""
    message, traceback = error_file_message(error_file)
    if message is None:
        return None
    status = f"signal {-exitcode}" if exitcode < 0 else f"status {exitcode}"
    lines = [f"{PREFIX} {script} failed: rank {rank} ended with {status} (the launcher stopped the other ranks); "
             f"its error:"]
    return lines + ([traceback] if traceback else []) + [message]


REFUSED_STATUS = 2
"""The recipe's status for a refused input (``recipes/pretrain.py``'s ``cli``)."""


def status_of(exitcode: int, error_file: str | None) -> int:
    """The failed rank's shell status; :data:`REFUSED_STATUS` when it recorded an ``[fl_accel]
    error`` line and then died by a signal: its error was recorded before the launcher's SIGTERM
    (sent when another rank exited first) reached it during the interpreter's teardown, where
    Python's signal handlers no longer run."""
    message, _ = error_file_message(error_file)
    if exitcode is not None and exitcode < 0 and message and message.startswith("[fl_accel] error"):
        return REFUSED_STATUS
    return exit_code(exitcode) or 1


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not (argv[0] == "torchrun" or argv[:2] == ["accelerate", "launch"]):
        fail("give a launcher command: python -m scripts.launch_guard torchrun ... | accelerate launch ...")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

    try:
        _launch(argv)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        lines = failure_lines(exc.name, rank, failure.exitcode, failure.error_file)
        if os.environ.get("TORCHELASTIC_ERROR_FILE") and lines is not None:
            ErrorHandler().dump_error_file(failure.error_file, failure.exitcode)
        sys.stdout.flush()
        print(f"{PREFIX} {exc}" if lines is None else "\n".join(lines), file=sys.stderr, flush=True)
        return status_of(failure.exitcode, failure.error_file)
    except subprocess.CalledProcessError as exc:  # accelerate launch of one process: it printed its own output
        return exit_code(exc.returncode) or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
