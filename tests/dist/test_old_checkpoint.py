"""A checkpoint written by an earlier fl_accel loads into this one and resumes bitwise (2 gloo ranks).

``tests/fixtures/checkpoint_v3/`` was written at main d5796a1, before the sync state moved
into fragments (issue 47), by ``tests/workers/old_ckpt_worker.py write``: FL+FSDP, 2 groups,
"nesterov", "int8" with error feedback, 2 fragments with a delay of 1, saved after step 3
with fragment 1's exchange in flight (the DCP keys ``fl.anchor/``, ``fl.momentum/``,
``fl.inflight/`` and ``group<f>.replica<r>.residual/``), and the losses and final shards of
steps 4-6 of that same run (``expected-rank<k>.pt``). Resumed here, the losses and the final
shards after ``end_training`` are bitwise those, and the counters equal.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from _launch import WORKERS, run_torchrun

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_v3"


def test_a_checkpoint_of_the_previous_layout_resumes_bitwise(tmp_path):
    ckpt = tmp_path / "step_3"
    shutil.copytree(FIXTURE / "step_3", ckpt)
    result = run_torchrun(2, WORKERS / "old_ckpt_worker.py", "resume", str(ckpt), str(tmp_path), timeout=180)
    assert result.returncode == 0, result.tail()
    for rank in range(2):
        want = torch.load(FIXTURE / f"expected-rank{rank}.pt", weights_only=False)
        got = torch.load(tmp_path / f"resumed-rank{rank}.pt", weights_only=False)
        assert got["start"] == 3 and got["losses"] == {s: want["losses"][s] for s in (4, 5, 6)}, (rank, got["losses"])
        assert got["counters"] == want["counters"], (rank, got["counters"], want["counters"])
        assert want["shards"].keys() == got["shards"].keys()
        differ = [n for n in want["shards"] if not torch.equal(want["shards"][n], got["shards"][n])]
        assert not differ, f"rank {rank}: shards differ from the run that wrote the checkpoint: {differ}"
