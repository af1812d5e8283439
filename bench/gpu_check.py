"""The GPU check (issue 17 item 9): what only a CUDA machine can show, in one command.

    bash bench/gpu_check.sh                 # = python -m bench.gpu_check; under 8 minutes on one H100/H200
    python -m bench.gpu_check --steps 30 --skip-tests --name my-check

On a machine with at least one CUDA GPU it

1. runs the CUDA-gated tests (``pytest tests/gpu/test_cuda.py``);
2. trains ``--model`` (default the Llama-3.2-1B preset, 1.24B parameters, which fits one
   80 GB GPU with room for both settings) with ``recipes/pretrain.py`` as one process on
   GPU 0 (``--algorithm fsdp``: NCCL refuses two ranks on one GPU), bf16, micro-batch 2 x
   2048 tokens, ``--steps`` optimizer steps, with activation checkpointing none/full x
   compile off/on (recipe flags ``--activation_checkpointing`` and ``--compile``);
3. records per run tokens/s (the last logged window, after compilation), MFU,
   ``peak_accelerator_mb`` (all_results.json) and the memory model's prediction
   (:func:`fl_accel.planning.memory.estimate` without the CUDA context, which
   ``max_memory_allocated`` does not count; AdamW foreach and fused), in
   ``bench/results/<name>/``: gpu_check.json and table.md.

Without a CUDA GPU it stops at once with one line on stderr and exit status 2. The exit
status is 1 when a test or a run failed (the results of the others are still written).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from typing import Any

from recipes.metrics import record_value

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = [("none", False), ("full", False), ("none", True), ("full", True)]
"""(activation checkpointing, compile) of the four runs."""
MiB = 2**20


class NoGPU(SystemExit):
    pass


def require_gpu() -> str:
    """The name of CUDA device 0; raises :class:`NoGPU` (exit status 2) with one line otherwise."""
    import torch

    if not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(f"gpu_check: no CUDA GPU visible (torch {torch.__version__}, {built}); run it on a machine with at "
              f"least one CUDA GPU", file=sys.stderr)
        raise NoGPU(2)
    return torch.cuda.get_device_name(0)


def recipe_argv(model: str, ac: str, compile_: bool, out: str, cache: str, steps: int, seq_len: int,
                micro_batch: int) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "recipes", "pretrain.py"), "--model", model, "--algorithm", "fsdp",
            "--mixed_precision", "bf16", "--seq_len", str(seq_len), "--micro_batch_size", str(micro_batch),
            "--max_steps", str(steps), "--log_every", str(max(1, steps // 3)), "--max_eval_blocks", "8",
            "--activation_checkpointing", ac, *(["--compile"] if compile_ else []), "--report_to", "none",
            "--save_final_model", "false", "--output_dir", out, "--cache_dir", cache, "--overwrite_output_dir"]


def predict(model: str, ac: str, seq_len: int, micro_batch: int) -> dict[str, float]:
    """The memory model's peak for one run, in MiB, without the CUDA context, for AdamW foreach and fused."""
    from fl_accel.planning.memory import estimate
    from fl_accel.mesh import FLLayout
    from recipes.modeling import PRESETS

    out = {}
    for impl in ("foreach", "fused"):
        est = estimate(PRESETS[model], seq_len=seq_len, micro_batch=micro_batch, layout=FLLayout((1,), 1, "fsdp"),
                       activation_checkpointing=ac, optimizer=impl)
        out[impl] = (est.total - est.components["cuda_context"]) / MiB
    return out


def collect_run(run_dir: str, ac: str, compile_: bool, prediction: dict[str, float] | None) -> dict[str, Any]:
    """One row from a run folder: all_results.json and the last record of metrics.jsonl with
    ``tokens_per_s``; figures the recipe does not write are None. Raises FileNotFoundError
    without all_results.json."""
    with open(os.path.join(run_dir, "all_results.json"), encoding="utf-8") as fh:
        res = json.load(fh)
    last = {}
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            records = [json.loads(line) for line in fh if line.strip()]
        last = next((r for r in reversed(records) if record_value(r, "perf/tokens_per_s") is not None), {})
    peak = res.get("peak_accelerator_mb")
    row = {"activation_checkpointing": ac, "compile": compile_, "steps": res.get("steps"),
           "tokens_per_s": record_value(last, "perf/tokens_per_s", res.get("tokens_per_s")),
           "tokens_per_s_run": res.get("tokens_per_s"), "mfu": record_value(last, "perf/mfu", res.get("mfu")),
           "model_flops_per_token": res.get("model_flops_per_token"), "peak_accelerator_mb": peak,
           "predicted_mb": prediction, "train_loss": last.get("train/loss"), "eval_loss": res.get("eval_loss")}
    if peak and prediction:
        row["prediction_error"] = {k: v / peak - 1 for k, v in prediction.items()}
    return row


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def write_results(out_dir: str, rows: list[dict], tests: dict | None, machine: dict) -> str:
    """Write gpu_check.json and table.md into ``out_dir``; returns the markdown."""
    os.makedirs(out_dir, exist_ok=True)
    lines = [f"GPU check on {machine.get('device', '?')}: {machine.get('model', '?')}, bf16, micro-batch "
             f"{machine.get('micro_batch', '?')} x {machine.get('seq_len', '?')}, {machine.get('steps', '?')} steps, "
             f"one process (FSDP on one GPU).", ""]
    if tests is not None:
        lines += [f"CUDA tests (`pytest tests/gpu/test_cuda.py`): {tests.get('summary', '?')} (exit {tests.get('rc')})", ""]
    lines += ["| checkpointing | compile | tokens/s | MFU | peak_accelerator_mb | predicted MiB (foreach / fused) | "
              "error (foreach / fused) | status |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pred, err = r.get("predicted_mb") or {}, r.get("prediction_error") or {}
        lines.append(
            f"| {r['activation_checkpointing']} | {'on' if r['compile'] else 'off'} | "
            f"{_fmt(r.get('tokens_per_s'), ',.0f')} "
            f"| {_fmt(r.get('mfu'), '.1%')} | {_fmt(r.get('peak_accelerator_mb'), ',.0f')} | "
            f"{_fmt(pred.get('foreach'), ',.0f')} / {_fmt(pred.get('fused'), ',.0f')} | "
            f"{_fmt(err.get('foreach'), '+.1%')} / {_fmt(err.get('fused'), '+.1%')} | {r.get('status', 'ok')} |")
    table = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "gpu_check.json"), "w", encoding="utf-8") as fh:
        json.dump({"machine": machine, "tests": tests, "runs": rows}, fh, indent=1)
    with open(os.path.join(out_dir, "table.md"), "w", encoding="utf-8") as fh:
        fh.write(table)
    return table


def run_tests(timeout: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu/test_cuda.py"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, text = None, f"timed out after {timeout:.0f} s\n{exc.stdout or ''}"
    found = re.findall(r"\d+ (?:passed|failed|skipped|error|errors)\b[^\n]*", text)
    return {"rc": rc, "summary": found[-1] if found else "no summary", "tail": text[-3000:]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--name", default=f"{datetime.date.today().isoformat()}-gpu")
    p.add_argument("--work", default=os.path.join(ROOT, "bench", "work", "gpu_check"))
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--tests-timeout", type=float, default=200.0)
    p.add_argument("--run-timeout", type=float, default=150.0, help="seconds per training run")
    a = p.parse_args(argv)
    device = require_gpu()
    import torch

    from scripts.launch import child_env

    machine = {"device": device, "gpus": torch.cuda.device_count(), "torch": torch.__version__,
               "cuda": torch.version.cuda, "python": platform.python_version(), "model": a.model, "steps": a.steps,
               "seq_len": a.seq_len, "micro_batch": a.micro_batch,
               "commit": subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()}
    out_dir = os.path.join(ROOT, "bench", "results", a.name)
    tests = None if a.skip_tests else run_tests(a.tests_timeout)
    failed = tests is not None and tests["rc"] != 0
    env = child_env({"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
                     "PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    rows = []
    for ac, compile_ in RUNS:
        run_dir = os.path.join(a.work, f"ac_{ac}-compile_{'on' if compile_ else 'off'}")
        argv_ = recipe_argv(a.model, ac, compile_, run_dir, os.path.join(a.work, "cache"), a.steps, a.seq_len,
                            a.micro_batch)
        print(f"[gpu_check] {' '.join(argv_)}", flush=True)
        status = "ok"
        try:
            proc = subprocess.run(argv_, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.run_timeout)
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or [""])[-1]
                status = f"failed (exit {proc.returncode}): {last[:300]}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {a.run_timeout:.0f} s"
        try:
            row = collect_run(run_dir, ac, compile_, predict(a.model, ac, a.seq_len, a.micro_batch))
        except FileNotFoundError:
            row = {"activation_checkpointing": ac, "compile": compile_}
        row["status"] = status
        failed |= status != "ok"
        rows.append(row)
        write_results(out_dir, rows, tests, machine)  # after every run: a stop keeps what was measured
    print(write_results(out_dir, rows, tests, machine))
    print(f"[gpu_check] results: {out_dir}/gpu_check.json, table.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
