"""What a user sees under plain ``torchrun`` when FLAccelerator refuses an input in their own
loop (issue 48 item 2; fl_accel/errors.py): a per-rank seed (``set_seed(seed + rank)``,
tests/workers/seed_worker.py) on 2 ranks as 2 federation groups of one.

* the ``ValueError``'s one line, ``[fl_accel] error (rank r): ...``, printed once (not once per
  rank, and without the ranks' tracebacks);
* torchrun's failure summary names it as the root cause (the error file fl_accel wrote), not
  "To enable traceback see ..." nor a signal: no rank died of SIGABRT (``terminate called
  without an active exception``), since each rank released its process groups before exiting.

Real torchrun (``launcher="torchrun"``): the subject is torchrun's summary, which the fork
launcher does not produce.
"""

from __future__ import annotations

import re

from _launch import WORKERS, run_torchrun

EXPECTED = "the federation groups do not start from identical parameters"


def test_a_refusal_in_ones_own_loop_is_one_line_and_torchruns_root_cause():
    res = run_torchrun(2, WORKERS / "seed_worker.py", timeout=240, launcher="torchrun")
    assert not res.timed_out and res.returncode != 0, res.tail()
    text = res.stdout + res.stderr
    lines = [line for line in text.splitlines() if re.search(r"\[fl_accel\] error \(rank \d\): " + EXPECTED, line)
             and "traceback :" not in line and not line.startswith("  ")]
    assert len(lines) == 1, res.tail()  # once, not once per rank
    assert text.count("Traceback (most recent call last)") <= 1, res.tail()  # torchrun's own, none of the ranks'
    root = text.rsplit("Root Cause", 1)[-1]
    assert re.search(r"traceback : \[fl_accel\] error \(rank \d\): " + EXPECTED, root), root
    assert "SIGABRT" not in text and "terminate called" not in text and "Signal 6" not in text, res.tail()
    assert "[seed_worker] prepared" not in text
