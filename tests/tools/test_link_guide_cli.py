"""scripts/link_guide.py run as a command (``python -m scripts.link_guide``): the table, its
stated assumptions, ``--json``, and one-line errors with exit status 2. The pure functions:
tests/unit/test_link_guide.py."""

import json
import os
import subprocess
import sys

import pytest

from _launch import REPO_ROOT, assert_one_line_error, launch_env


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "scripts.link_guide", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO_ROOT, env=launch_env())


def _rows(stdout):
    """{(model, link): {column: cell}} of the markdown table."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("| ")]
    head = [c.strip() for c in lines[0].split("|")[1:-1]]
    out = {}
    for ln in lines[1:]:
        cells = dict(zip(head, (c.strip() for c in ln.split("|")[1:-1])))
        out[(cells["model"], cells["link"])] = cells
    return out


def test_8b_at_10mbit_only_sparse_keeps_the_limit_and_the_output_says_it_is_the_model():
    proc = _cli("--params", "8e9", "--groups", "2", "--gpus-per-group", "64", "--link", "10mbit", "1gbit",
                "--compute-s", "60")
    assert proc.returncode == 0, proc.stderr
    rows = _rows(proc.stdout)
    slow, fast = rows[("8e9 params (8B)", "10 Mbit/s")], rows[("8e9 params (8B)", "1 Gbit/s")]
    assert slow["keeps >= 0.95"] == "sparse"
    assert slow["sparse 1/64+EF H=8 P=2 tau=2"].startswith("**") and not slow["fp32 H=32"].startswith("**")
    assert "int8" in fast["keeps >= 0.95"]
    assert "every figure is the cost model's" in proc.stdout and "depends on the model size" in proc.stdout
    assert "60 s per optimizer step (--compute-s)" in proc.stdout
    # each setting points at the grid's table and its rows
    assert "bench/results/2026-12-03-grid/table.md" in proc.stdout
    assert "[fl_fsdp-h8-p2-tau2-sparse-ef-nesterov-lr1e-3]" in proc.stdout and "[fl_fsdp-h32]" in proc.stdout
    assert "fp32 H=8: 4.904 \u00b1 0.008 (3 seeds), +0.167 nats against FSDP's 4.737 (fsdp-lr1e-3)" in proc.stdout
    assert os.path.isfile(REPO_ROOT / "bench/results/2026-12-03-grid/table.md")


def test_default_compute_is_stated_and_tiny_blocking_h32_is_near_the_limit_at_1gbit():
    proc = _cli("--params", "llama-8b", "tiny", "--gpus-per-group", "64", "--link", "10mbit")
    assert proc.returncode == 0, proc.stderr
    assert "assumed: llama-8b: 48.25 GFLOP/token at seq_len 2048 x 16,384 tokens per GPU / (989 TFLOPS x MFU " \
           "0.4) = 2 s" in proc.stdout
    assert _rows(proc.stdout)[("llama-8b (8.03B)", "10 Mbit/s")]["keeps >= 0.95"].startswith("none (best here: sparse ")
    # the tiny model as the benchmark ran it: 2 groups x 2 processes, 0.514 s per step without sync
    proc = _cli("--params", "tiny", "--gpus-per-group", "2", "--compute-s", "0.514", "--link", "1gbit", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["figures"] == "model" and out["quality_table"] == "bench/results/2026-12-03-grid/table.md"
    [row] = out["rows"]
    h32 = next(r for r in row["results"] if r["setting"] == "fp32 H=32")
    assert h32["share"] > 0.99 and h32["keeps"]
    assert [s["quality_rows"][0]["id"] for s in out["settings"]][-1] == "fl_fsdp-h8-p2-tau2-sparse-ef-nesterov-lr1e-3"
    assert out["measured_quality"]["fl_fsdp-h8-lr1e-3"]["n"] == 3


BAD = [[], ["--params", "llama-70b"], ["--params", "8e9", "--link", "fast"], ["--params", "8e9", "--groups", "1"],
       ["--params", "8e9", "--compute-s", "0"], ["--params", "8e9", "--mfu", "2"],
       ["--params", "8e9", "--gpus-per-group", "x"]]


def test_bad_input_as_a_command_is_one_line_and_exit_2():
    proc = _cli(*BAD[2])
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: "), proc.stderr


@pytest.mark.parametrize("args", BAD)
def test_bad_input_one_line_exit_2(args, capsys):
    """The command's ``main`` in this process (the command line itself: the test above)."""
    from scripts import link_guide

    assert_one_line_error(link_guide.main, args, capsys)
