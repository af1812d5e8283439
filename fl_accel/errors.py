"""One error, once, at the end: how a failed rank reports under ``torchrun`` / ``accelerate launch``.

A bad input is refused on every rank (each raises the same ``ValueError`` before any
collective). Left alone, every rank prints the same traceback and torchrun's failure summary
(its "Root Cause" box) says "To enable traceback see: ..." for a script without torch's
``@record``; a rank whose interpreter tears down live gloo process groups may also die with
``terminate called without an active exception`` (SIGABRT), which the box then reports.

Under a torchelastic launcher (``TORCHELASTIC_ERROR_FILE`` set: torchrun, ``accelerate launch``
of several processes) ``import fl_accel`` installs :func:`excepthook` (chained to the one
before) that, for an exception this rank does not catch:

* a ``ValueError`` raised inside fl_accel (a refused input: the message names the field and
  the fix) prints one line, ``[fl_accel] error (rank r): <message>``, once per node and
  message (:func:`say_once`), without the traceback; any other exception prints as Python
  prints it;
* writes the error file torchrun reads (:func:`record_for_launcher`; for a refusal its one
  line, else the traceback, as ``@record`` does), so the Root Cause box shows it, stamped
  with the time of the error: a rank that dies later of another cause is not the root cause;
* destroys this rank's gloo process groups before the interpreter exits, so no gloo thread is
  torn down mid-flight (no SIGABRT).

Nothing changes without a launcher, or for exceptions a script catches. The recipe
(``recipes/pretrain.py``) catches its errors itself and uses :func:`say_once` and
:func:`record_for_launcher` the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def is_under_launcher() -> bool:
    """torchelastic gave this process an error file (torchrun, ``accelerate launch``)."""
    return bool(os.environ.get("TORCHELASTIC_ERROR_FILE"))


def refusal_line(exc: BaseException) -> str | None:
    """``[fl_accel] error (rank r): <message>`` when ``exc`` is a ``ValueError`` raised inside
    fl_accel (the innermost frame of its traceback is in this package), else None."""
    if not isinstance(exc, ValueError):
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames or not os.path.abspath(frames[-1].filename).startswith(PACKAGE_DIR + os.sep):
        return None
    return f"[fl_accel] error (rank {os.environ.get('RANK', '0')}): {exc}"


def say_once(line: str, key: str | None = None) -> bool:
    """Print ``line`` (one line, stderr) unless another rank of this node already printed the
    same ``key`` (default: ``line``) in this launch attempt; True if printed. The ranks of a
    node share torchelastic's attempt folder (the parent of their error files' folders): the
    first to create a marker file there prints. Without a launcher, always prints."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        digest = hashlib.sha1((key if key is not None else line).encode()).hexdigest()[:16]
        marker = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), f"fl_accel_said_{digest}")
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        except OSError:
            pass  # no shared folder: print
    bars = getattr(sys.modules.get("tqdm.std"), "tqdm", None)  # a progress bar leaves its line open
    lead = "\n" if bars is not None and getattr(bars, "_instances", None) else ""
    sys.stderr.write(lead + line.replace("\n", " ") + "\n")
    sys.stderr.flush()
    return True


def record_for_launcher(message: str, callstack: str | None = None) -> None:
    """Write torchelastic's error file (``TORCHELASTIC_ERROR_FILE``; the format of
    ``torch.distributed.elastic.multiprocessing.errors.ErrorHandler``): the Root Cause box of
    torchrun's failure summary shows ``callstack`` (default: ``message``). No file: nothing."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"message": {"message": message, "extraInfo": {
                "py_callstack": callstack if callstack is not None else message,
                "timestamp": str(int(time.time()))}}}, fh)
    except OSError:
        pass


def release_process_groups() -> None:
    """Destroy this rank's process groups when they are gloo's (CPU): a local call, no
    collective, so it returns when a peer is gone, and no gloo thread is left to the
    interpreter's teardown. NCCL groups are left to torch's own exit path (destroying a
    communicator whose peer died may block)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
    except Exception:
        pass


_previous_hook = None


def excepthook(kind, value, tb) -> None:
    """The hook :func:`install` sets (module docstring)."""
    line = refusal_line(value)
    if line is not None:
        say_once(line, key=str(value))
        record_for_launcher(line)
    else:
        (_previous_hook or sys.__excepthook__)(kind, value, tb)
        if not os.path.exists(os.environ.get("TORCHELASTIC_ERROR_FILE", "")):  # torch's @record wrote it already
            record_for_launcher(f"{kind.__name__}: {value}", "".join(traceback.format_exception(kind, value, tb)))
    release_process_groups()


def install() -> None:
    """Set :func:`excepthook` as ``sys.excepthook`` under a torchelastic launcher (chained to the
    hook before; once)."""
    global _previous_hook
    if not is_under_launcher() or sys.excepthook is excepthook:
        return
    _previous_hook = sys.excepthook
    sys.excepthook = excepthook
