"""CPU validation of the memory model (fl_accel.planning.memory) against real recipe runs.

Each case trains ``recipes/pretrain.py`` (through ``bench/memory_probe.py``) on 4 gloo
processes, FL+FSDP F=2 x G=2, H=2, fp32, a Llama of hidden 256 (intermediate 768, 4 heads,
2 KV heads, vocab 8192) at ``--layers`` layers, seq_len 512, micro-batch 8, 3 steps, with
activation checkpointing off and on (Accelerate's own, ``FSDP_ACTIVATION_CHECKPOINTING=true``),
and glibc malloc as it is ("default") or with ``MALLOC_MMAP_THRESHOLD_=131072`` ("mmap": every
allocation of 128 KiB or more is its own mapping, returned to the OS when freed, so resident
memory follows the bytes in use, as an accelerator's ``memory_allocated`` does). Measured:
``peak_host_mb - peak_host_mb_after_prepare`` of the largest rank (MiB) and, where glibc has
``mallinfo2``, the bytes in use in malloc. Predicted: the model's peak minus the parameters
(which exist right after prepare), for the CPU (fp32 compute, no CUDA context, the for-loop
AdamW). The report lists both and the error.

    python -m bench.memory_validation                       # measure (about 6 min a case on 2 cores) and report
    python -m bench.memory_validation --report-only --name <date>-memory   # re-predict from the measurements

Output: bench/results/<name>/measurements.json (the raw records), memory.json (the
measurements with the model's prediction and error), table.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=8192, hidden_size=256,
             intermediate_size=768, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
             rms_norm_eps=1e-5, tie_word_embeddings=False, use_cache=False)
RUN = dict(nproc=4, num_groups=2, sync_every=2, seq_len=512, micro_batch_size=8, steps=3)
MALLOC = {"default": {}, "mmap": {"MALLOC_MMAP_THRESHOLD_": "131072"}}
TOLERANCE = 0.25
"""Issue 17: the model matches the CPU measurements within 25%."""
LIVE_TOLERANCE = 0.02
"""The README's claim (issue 46 item 7): within 2% of the bytes in use (malloc, sampled) in every run, and of
the resident-memory growth where malloc returns freed tensors (mmap threshold fixed); measured within 1.2%."""
RSS_KEPT_HEAP = (-0.5, 0.0)
"""With glibc's default malloc the resident memory keeps freed heap, so it is larger than the bytes in use:
the model's error against it lies in this interval (measured -0.34 to -0.47), never above 0."""


def case_name(layers: int, ac: str, malloc: str) -> str:
    return f"L{layers}-ac_{ac}-malloc_{malloc}"


def recipe_argv(config_dir: str, out: str, cache: str) -> list[str]:
    return ["--model", config_dir, "--seq_len", str(RUN["seq_len"]), "--micro_batch_size", str(RUN["micro_batch_size"]),
            "--max_steps", str(RUN["steps"]), "--algorithm", "fl_fsdp", "--num_groups", str(RUN["num_groups"]),
            "--sync_every", str(RUN["sync_every"]), "--max_eval_blocks", "32", "--mixed_precision", "no",
            "--report_to", "none", "--save_final_model", "false", "--output_dir", out, "--cache_dir", cache]


def measure(layers: int, ac: str, malloc: str, work: str, cache: str, timeout: float) -> dict:
    """One case: launch, then read the probe's per-rank records and all_results.json."""
    from scripts import launch

    name = case_name(layers, ac, malloc)
    cfg_dir = os.path.join(work, name, "model")
    out = os.path.join(work, name, "run")
    os.makedirs(cfg_dir, exist_ok=True)
    with open(os.path.join(cfg_dir, "config.json"), "w", encoding="utf-8") as fh:
        json.dump({**MODEL, "num_hidden_layers": layers}, fh, indent=1)
    env = launch.child_env({"FSDP_ACTIVATION_CHECKPOINTING": "true" if ac == "full" else "false",
                            **MALLOC[malloc]}, pythonpath=[ROOT])
    argv = launch.torchrun_argv(RUN["nproc"], os.path.join(ROOT, "bench", "memory_probe.py"),
                                *recipe_argv(cfg_dir, out, cache))
    argv = ["nice", "-n", "15"] + argv
    print(f"[memory_validation] {name}: {' '.join(argv)}", flush=True)
    result = launch.run(argv, timeout=timeout, env=env, cwd=ROOT)
    if not result.ok:
        raise SystemExit(f"[memory_validation] {name} failed:\n{result.tail()}")
    ranks = []
    for r in range(RUN["nproc"]):
        with open(os.path.join(out, "memory_probe", f"rank{r}.json"), encoding="utf-8") as fh:
            ranks.append(json.load(fh))
    with open(os.path.join(out, "all_results.json"), encoding="utf-8") as fh:
        results = json.load(fh)
    return {"name": name, "layers": layers, "activation_checkpointing": ac, "malloc": malloc,
            "malloc_env": MALLOC[malloc], "model": {**MODEL, "num_hidden_layers": layers}, "run": RUN,
            "n_params": results["n_params"], "recipe_peak_host_mb_after_prepare": results["peak_host_mb_after_prepare"],
            "recipe_peak_host_mb": results.get("peak_host_mb"), "ranks": ranks,
            "seconds": result.seconds, "command": " ".join(argv)}


def measured_mb(m: dict) -> dict:
    """The figures compared with the model (MiB): the largest rank's peak RSS minus the
    recipe's after-prepare figure (max over ranks), as issue 17 defines it; and the
    largest rank's growth of malloc's bytes in use after prepare (None without mallinfo2)."""
    peak = m["recipe_peak_host_mb"] or max(r["peak_host_mb"] for r in m["ranks"])
    live = [r["peak_live_mb"] - r["live_mb_after_prepare"] for r in m["ranks"] if r.get("peak_live_mb") is not None]
    return {"rss_delta_mb": peak - m["recipe_peak_host_mb_after_prepare"], "live_delta_mb": max(live) if live else None}


def predict(m: dict):
    """The model's estimate for a case, on the CPU as the recipe runs there."""
    from fl_accel.planning.memory import estimate
    from fl_accel.mesh import FLLayout

    layout = FLLayout.equal(RUN["num_groups"], 1, RUN["nproc"] // RUN["num_groups"])
    return estimate(m["model"], seq_len=RUN["seq_len"], micro_batch=RUN["micro_batch_size"], layout=layout,
                    param_dtype="fp32", reduce_dtype="fp32", activation_checkpointing=m["activation_checkpointing"],
                    optimizer="for-loop", accelerator="cpu")


def report(measurements: list[dict]) -> tuple[list[dict], str]:
    rows = []
    for m in measurements:
        est = predict(m)
        predicted = (est.total - est.components["parameters"]) / 2**20
        got = measured_mb(m)
        rows.append({"name": m["name"], "layers": m["layers"],
                     "activation_checkpointing": m["activation_checkpointing"],
                     "malloc": m["malloc"], "predicted_mb": predicted, **got,
                     "error_vs_rss": predicted / got["rss_delta_mb"] - 1,
                     "error_vs_live": None if got["live_delta_mb"] is None else predicted / got["live_delta_mb"] - 1,
                     "peak_phase": est.peak_phase,
                     "components_mb": {k: v / 2**20 for k, v in est.components.items()}})
    lines = ["| layers | checkpointing | malloc | measured RSS delta (MiB) | malloc in use delta (MiB) | "
             "predicted (MiB) | error vs RSS | error vs in use |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        live = "-" if r["live_delta_mb"] is None else f"{r['live_delta_mb']:,.0f}"
        ev = "-" if r["error_vs_live"] is None else f"{r['error_vs_live']:+.1%}"
        lines.append(f"| {r['layers']} | {r['activation_checkpointing']} | {r['malloc']} | {r['rss_delta_mb']:,.0f} | "
                     f"{live} | {r['predicted_mb']:,.0f} | {r['error_vs_rss']:+.1%} | {ev} |")
    return rows, "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="8,16")
    p.add_argument("--ac", default="none,full")
    p.add_argument("--malloc", default="mmap,default")
    p.add_argument("--name", default=f"{datetime.date.today().isoformat()}-memory")
    p.add_argument("--work", default=None, help="run folders (default: a temporary folder)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    p.add_argument("--report-only", action="store_true", help="re-predict from measurements.json")
    a = p.parse_args(argv)
    out = os.path.join(ROOT, "bench", "results", a.name)
    path = os.path.join(out, "measurements.json")
    if a.report_only:
        with open(path, encoding="utf-8") as fh:
            measurements = json.load(fh)["cases"]
    else:
        work = a.work or tempfile.mkdtemp(prefix="fl_accel_memval_")
        cache = os.path.join(work, "cache")
        os.makedirs(out, exist_ok=True)
        measurements = []
        old = {}
        if os.path.isfile(path):  # keep cases measured before (a rerun adds or replaces)
            with open(path, encoding="utf-8") as fh:
                old = {c["name"]: c for c in json.load(fh)["cases"]}
        for layers in map(int, a.layers.split(",")):
            for ac in a.ac.split(","):
                for malloc in a.malloc.split(","):
                    m = measure(layers, ac, malloc, work, cache, a.timeout)
                    old[m["name"]] = m
                    measurements = sorted(old.values(), key=lambda c: (c["layers"], c["activation_checkpointing"],
                                                                       c["malloc"]))
                    import torch

                    machine = {"python": platform.python_version(), "torch": torch.__version__,
                               "cpus": os.cpu_count(), "platform": platform.platform(),
                               "commit": subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                                                        text=True).stdout.strip()}
                    with open(path, "w", encoding="utf-8") as fh:  # after every case: a stop keeps what was measured
                        json.dump({"machine": machine, "cases": measurements}, fh, indent=1)
    rows, table = report(measurements)
    with open(os.path.join(out, "memory.json"), "w", encoding="utf-8") as fh:
        json.dump({"tolerance": TOLERANCE, "rows": rows}, fh, indent=1)
    with open(os.path.join(out, "table.md"), "w", encoding="utf-8") as fh:
        fh.write(f"CPU validation of fl_accel.planning.memory (bench/memory_validation.py): 4 gloo ranks, FL+FSDP "
                 f"F=2 x G=2, fp32, hidden 256, vocab 8192, seq_len {RUN['seq_len']}, micro-batch "
                 f"{RUN['micro_batch_size']}, {RUN['steps']} steps. MiB; measured = the largest rank's growth after "
                 f"prepare; predicted = the model's peak minus the parameters. malloc 'mmap' = "
                 f"MALLOC_MMAP_THRESHOLD_=131072 (freed tensors go back to the OS).\n\n" + table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
