"""Checks that only a GPU can make: NCCL rejects CPU tensors in collectives, gloo accepts them.

Users run fl_accel on GPUs with NCCL and bf16. A CPU tensor passed to a collective on the
default process group (plain "nccl" in accelerate 1.15, ``accelerate/state.py``) raises
there and passes on gloo, so CPU runs cannot catch it. These tests run every collective of
the library and the recipe on a 1-process NCCL group (which still rejects CPU tensors: none
of the code skips its collectives at world size 1) and the recipe end to end on one GPU.
They run on the device machine when one is lent; elsewhere they are skipped.
"""

from __future__ import annotations

import json

import pytest
import torch

from _launch import REPO_ROOT, WORKERS, run_torchrun

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: NCCL rejects CPU tensors in collectives while gloo accepts them, so only a GPU "
           "run can catch a collective on a tensor left on the CPU")


def test_every_collective_runs_on_a_one_process_nccl_group(tmp_path):
    res = run_torchrun(1, WORKERS / "api_worker.py", "collectives", str(tmp_path), timeout=600)
    assert res.returncode == 0, res.tail()
    rec = json.loads((tmp_path / "collectives-rank0.json").read_text())
    assert rec["backend"] == "nccl" and rec["device"].startswith("cuda") and rec["ok"]
    assert rec["main_first"] == "ok"
    assert rec["eval"][0] > 1 and rec["eval_per_group"] == pytest.approx(rec["eval"])
    assert rec["exchange_fp32_max_err"] == 0.0
    assert rec["exchange_bf16_max_err"] <= 2 ** -8 and rec["exchange_int8_max_err"] <= 1 / 127


def test_recipe_on_one_gpu_in_bf16(tmp_path):
    """The recipe as one plain process on a GPU (NCCL group of one, bf16): it trains, evaluates,
    checkpoints, resumes and exports the final model."""
    import subprocess
    import sys

    out = tmp_path / "run"
    args = [sys.executable, str(REPO_ROOT / "recipes" / "pretrain.py"), "--algorithm", "fsdp", "--max_steps", "4",
            "--seq_len", "128", "--micro_batch_size", "2", "--max_eval_blocks", "16", "--checkpoint_every", "2",
            "--report_to", "none", "--mixed_precision", "bf16", "--output_dir", str(out),
            "--cache_dir", str(tmp_path / "cache")]
    proc = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((out / "all_results.json").read_text())
    assert results["steps"] == 4 and results["eval_loss"] > 0
    assert (out / "final_model" / "model.safetensors").is_file()
