"""bench/gpu_check.sh on a machine without a GPU: its refusal path runs for real (the check
itself needs a CUDA GPU: bench/README.md, "GPU check"; its result writer: tests/unit/test_gpu_check_writer.py)."""

import os
import subprocess

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a CUDA GPU")
def test_refuses_with_one_line_without_a_gpu(tmp_path):
    name = f"test-nogpu-{os.getpid()}"
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_check.sh"), "--name", name,
                           "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA GPU visible"), proc.stderr
    assert not os.path.exists(os.path.join(ROOT, "bench", "results", name)) and not (tmp_path / "work").exists()


