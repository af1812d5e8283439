"""The benchmark's results folder: table.md (tabulate), plots (scripts.plots), raw run files,
machine.json, command.txt, bench.json, and an offline W&B run.

The report states figures only; bench/README.md says how to read them against the goals.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from importlib import metadata
from typing import Any

from tabulate import tabulate

from scripts import plots
from fl_accel.mesh import AXES

from bench.analysis import MIB, analyze
from bench.plan import REPO, runs_of

BACKGROUND_LIMIT = 0.05


def _f(x: Any, fmt: str = "{:.2f}", none: str = "-") -> str:
    return none if x is None else fmt.format(x)


def _pct(x: float | None) -> str:
    return _f(None if x is None else 100 * x, "{:.0f}%")


def _md(rows: list[list], headers: list[str]) -> str:
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def _main_rows(res: dict):
    for link, block in res["main"].items():
        for row in block["rows"].values():
            yield link, row


# ---------------------------------------------------------------------- table.md
def write_table(plan: dict, res: dict, machine: dict, meta: dict, path: str) -> str:
    """All tables as markdown; returns the text (also written to ``path``)."""
    L = [f"# fl_accel benchmark: {', '.join(plan.get('suites', ['baselines']))}"
         + (" — SMOKE RUN" if plan.get("smoke") else ""), ""]
    if plan.get("smoke"):
        L += ["> **SMOKE RUN: not a result.** A few steps only, to exercise every code path; do not read "
              "speedups, perplexities or the overhead figure from it.", ""]
    L += [f"Command: `{plan['command']}`  ",
          f"Date: {meta.get('date', '-')}; machine: {machine.get('cpu_model', '?')}, {machine.get('nproc', '?')} CPUs, "
          f"{machine.get('mem_gib', '?')} GiB, kernel {machine.get('kernel', '?')}, torch "
          f"{machine.get('versions', {}).get('torch', '?')}; load average {machine.get('loadavg_start', '?')} at "
          f"start, {machine.get('loadavg_end', '?')} at end (details: machine.json).", "",
          f"Setup: recipe `recipes/pretrain.py`, model `tiny` (fp32), embedded Shakespeare corpus, seq_len "
          f"{plan['seq_len']}, micro-batch {plan['micro_batch_size']} per rank, {plan['steps']} steps per main run, "
          f"H={plan['sync_every']}, evaluation every H steps on {plan['eval_blocks']} validation blocks, seed "
          f"{plan['seed']}. {plan.get('nodes', 2)} emulated nodes; every node's link shaped with tc tbf at the given "
          f"rate in both directions. The limit of a world size is its federated layout with groups = nodes and "
          f"H = 10^6 (no inter-node traffic during training), run at the same link.", ""]
    links = meta.get("links") or {}
    if links:
        L += ["Measured single TCP stream node 0 -> node 1 per emulator: " + "; ".join(
            f"{k}: {v['achieved_bits_per_s'] / 1e6:.0f} Mbit/s" if "achieved_bits_per_s" in v else
            f"{k}: {v.get('error', '?')}" for k, v in links.items()) + ".", ""]
    if res.get("prediction_error"):
        L += [f"Cost-model predictions unavailable: `{res['prediction_error']}`.", ""]

    L += ["## Throughput, perplexity and the cost model", ""]
    rows = []
    for link, r in _main_rows(res):
        p = r["pred"]
        rows.append([link, r["label"], "×".join(map(str, r["mesh"])), r["world"], _f(r["tokens_per_s"], "{:,.0f}"),
                     _f(r["speedup"], "{:.2f}x") + (f" vs {r['baseline']}" if r["speedup"] else ""),
                     _f(r["of_limit"]), _f(p.get("tokens_per_s"), "{:,.0f}"), _f(r["meas_over_pred"]),
                     _f(r["pred_speedup"], "{:.2f}x"), _f(r["eval_loss"], "{:.4f}"),
                     _f(r["eval_perplexity"], "{:,.1f}"), _f(r["time_to_target"], "{:.0f}"),
                     _pct(r["background_cpu_share"]) + (" (!)" if (r["background_cpu_share"] or 0) > BACKGROUND_LIMIT
                                                        else "")])
    L += [_md(rows, ["link", "run", "F×R×S", "processes", "tokens/s", "speedup", "of limit", "predicted tokens/s",
                     "measured / predicted", "predicted speedup", "eval loss", "eval ppl", "train s to ppl ≤ target",
                     "background CPU"]), "",
          "Eval loss and perplexity are after all steps: at equal tokens for rows of the same world size. "
          "`of limit` = tokens/s over the limit row's at the same link. Target perplexity = the worst final "
          "perplexity at that link and world size, limit rows excluded: " + "; ".join(
              f"{link}: " + ", ".join(f"{w} proc {t:,.1f}" for w, t in sorted(b["ppl_target"].items()))
              for link, b in res["main"].items()) + ". `background CPU`: share of all CPUs other processes kept "
          "busy during the launch (scripts.launch.HostLoad); (!) above 5%: step times are inflated by other work.",
          ""]

    L += ["## Bytes: per axis (rank 0, training) and on the wire (per node, whole launch)", ""]
    rows = []
    for link, r in _main_rows(res):
        c, p = r["comm"], r["pred"]
        cells = []
        for a in AXES:
            cells += [_f(c["train"][a]["bytes"] / MIB, "{:.1f}"),
                      _f(p["bytes_run"][a] / MIB if "bytes_run" in p else None, "{:.1f}")]
        bw = r["inter_bw_measured"]
        rows.append([link, r["label"], *cells, ", ".join(r["inter_axes"]) or "-",
                     ", ".join(f"{a}: {n}" for a, n in r["link_share"].items()) or "-",
                     _f(r["wire_tx_bytes_per_node"] / MIB if r["wire_tx_bytes_per_node"] is not None else None,
                        "{:.1f}"), _f(r["recipe_bytes_per_node"] / MIB, "{:.1f}"),
                     _f(r["model_bytes_per_node"] / MIB if r["model_bytes_per_node"] is not None else None, "{:.1f}"),
                     _f(bw / 1e6 if bw else None)])
    L += [_md(rows, ["link", "run", "fl meas", "fl model", "dp_replicate meas", "dp_replicate model",
                     "dp_shard meas", "dp_shard model", "inter-node axes", "ranks sharing a NIC",
                     "wire tx MiB/node", "recipe-counted MiB/node", "model MiB/node (training)",
                     "inter-node MB/s per rank (gloo)"]), "",
          "MiB = 2^20 bytes. Per axis: bytes rank 0 sent over the training steps (recipe's ring-formula accounting "
          "minus evaluations) and the cost model's `estimate(..., total_steps=T)`. Wire: the node NIC's tx counter "
          "(veth) over the whole launch, mean of the nodes: payload, TCP/IP headers, rendezvous, evaluations. "
          "Recipe-counted: rank 0's bytes on the inter-node axes, evaluations included, times the ranks sharing a "
          "NIC; model: the same for training steps from the cost model. MB/s: bytes of the inter-node axes over the "
          "seconds rank 0 spent in those collectives (includes waiting for peers).", ""]

    L += ["## Compute time per step (calibration, unshaped links)", ""]
    L += [_md([[c["label"], f"{c['compute_s']:.3f}", f"{c['mean_s']:.3f}", c["n_steps"], c["steps"]]
               for c in res["calibration"].values()],
              ["configuration", "compute s/step (median)", "mean", "steps used", "of"]) if res["calibration"]
          else "(not run)", "",
          "Median step time from step 3 on, sync steps excluded; it contains the intra-node collectives, so the "
          "time model adds only the inter-node bytes at the shaped rate.", ""]

    L += ["## Overhead of the federation machinery with sync off", ""]
    ov = res.get("overhead")
    if ov:
        rows = [[r["rep"], f"{r['fl_median']:.3f}", f"{r['fsdp_median']:.3f}", f"{100 * o:+.1f}%"]
                for r, o in zip(ov["reps"], ov["per_rep"])]
        rows.append(["all (pooled steps)", f"{ov['fl_median_s']:.3f}", f"{ov['fsdp_median_s']:.3f}",
                     f"**{100 * ov['overhead']:+.1f}%**"])
        L += [_md(rows, ["rep", "FL+FSDP F=2, H=10^6: median s/step", "2 concurrent 2-process FSDP jobs: median "
                         "s/step", "difference"]), "",
              "Baseline spread between repetitions (a noise floor): "
              + _f(100 * ov["baseline_spread"] if ov.get("baseline_spread") is not None else None, "{:.1f}%") + ".", ""]
    else:
        L += ["(not run)", ""]

    L += ["## Launches", ""]
    launch_rows = [[k, f"{v['wall_s']:.0f}", _pct((v.get("host") or {}).get("background_cpu_share"))]
                   for k, v in (meta.get("launches") or {}).items()]
    if not launch_rows:  # results of the first version: timings and cpu fractions
        cpu = meta.get("cpu") or {}
        launch_rows = [[k, f"{v:.0f}", _pct(cpu.get(k, {}).get("other_cpu_frac"))]
                       for k, v in (meta.get("timings") or {}).items() if k != "total"]
    L += [_md(launch_rows, ["launch", "wall s", "background CPU"]) if launch_rows else "(no launch records)", "",
          "Plots: `ppl_vs_tokens.png`, `time_to_ppl.png`, `throughput.png`; raw per-run files under `raw/`."]
    text = "\n".join(L) + "\n"
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return text


# ---------------------------------------------------------------------- plots
def make_plots(plan: dict, res: dict, out_dir: str) -> list[str]:
    """ppl_vs_tokens.png and time_to_ppl.png (a panel per link and world size) and
    throughput.png (bars per link, the cost model's prediction as a tick)."""
    if not res["main"]:
        return []
    smoke = " (SMOKE RUN)" if plan.get("smoke") else ""
    panels_tok: dict[str, list] = {}
    panels_time: dict[str, list] = {}
    targets: dict[str, float] = {}
    for link, r in _main_rows(res):
        key = f"link {link}, {r['world']} processes"
        ev = r["evals"]
        panels_tok.setdefault(key, []).append(plots.Series(r["label"], [e["tokens"] for e in ev],
                                                           [e["perplexity"] for e in ev]))
        panels_time.setdefault(key, []).append(plots.Series(r["label"], [e["time_s"] for e in ev],
                                                            [e["perplexity"] for e in ev]))
        if r["world"] in res["main"][link]["ppl_target"]:
            targets[key] = res["main"][link]["ppl_target"][r["world"]]
    paths = [plots.plot_panels(panels_tok, os.path.join(out_dir, "ppl_vs_tokens.png"), xlabel="training tokens",
                               ylabel="eval perplexity", title=f"eval perplexity vs training tokens{smoke}"),
             plots.plot_panels(panels_time, os.path.join(out_dir, "time_to_ppl.png"),
                               xlabel="training time (s, evaluation excluded)", ylabel="eval perplexity",
                               title=f"time to perplexity{smoke}", hlines=targets)]
    groups = {f"link {link}": [(r["label"], r["tokens_per_s"] or 0.0, r["pred"].get("tokens_per_s"))
                               for r in block["rows"].values()] for link, block in res["main"].items()}
    paths.append(plots.plot_bars(groups, os.path.join(out_dir, "throughput.png"), ylabel="tokens/s (all processes)",
                                 title=f"throughput{smoke}", reference_label="cost model prediction"))
    return paths


def log_wandb(plan: dict, res: dict, plot_paths: list[str], table_md: str) -> str:
    """An offline W&B run under the work folder: the plots as images, the main table as a
    wandb.Table. Returns the run's folder."""
    os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    os.makedirs(plan["work"], exist_ok=True)
    run = wandb.init(project="fl_accel-bench", name=f"bench-{plan['name']}", group=f"bench-{plan['name']}",
                     job_type="bench", dir=plan["work"], mode="offline",
                     config={k: v for k, v in plan.items() if k not in ("work", "results", "cache_dir", "runs")})
    try:
        payload = {f"plots/{os.path.splitext(os.path.basename(p))[0]}": wandb.Image(p) for p in plot_paths}
        cols = ["link", "run", "world", "tokens_per_s", "speedup", "of_limit", "predicted_tokens_per_s",
                "eval_loss", "eval_perplexity", "background_cpu_share"]
        payload["results"] = wandb.Table(columns=cols, data=[
            [link, r["label"], r["world"], r["tokens_per_s"], r["speedup"], r["of_limit"],
             r["pred"].get("tokens_per_s"), r["eval_loss"], r["eval_perplexity"], r["background_cpu_share"]]
            for link, r in _main_rows(res)])
        run.log(payload)
        if res.get("overhead"):
            run.summary["overhead_sync_off"] = res["overhead"]["overhead"]
        run.summary["table_md"] = table_md
        run_dir = run.dir
    finally:
        run.finish()
    return os.path.dirname(run_dir) if run_dir else plan["work"]


# ---------------------------------------------------------------------- machine, files
def machine_info() -> dict:
    """CPUs, CPU model, memory, kernel, package versions, git commit (machine.json)."""
    import psutil

    info = {"nproc": os.cpu_count(), "kernel": platform.release(), "platform": platform.platform(),
            "python": platform.python_version(), "mem_gib": round(psutil.virtual_memory().total / 2**30, 1)}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            info["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "?")
    except OSError:
        info["cpu_model"] = "?"
    info["versions"] = {}
    for pkg in ("torch", "accelerate", "transformers", "datasets", "tokenizers", "wandb", "matplotlib"):
        try:
            info["versions"][pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info["versions"][pkg] = None
    try:
        git = ["git", "-C", REPO]
        info["git_commit"] = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        info["git_dirty_files"] = subprocess.run(git + ["status", "--porcelain", "--", "fl_accel", "recipes",
                                                        "scripts", "bench"], capture_output=True,
                                                 text=True).stdout.strip().splitlines()
    except OSError:
        pass
    info["tc"] = shutil.which("tc")
    return info


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def copy_raw(plan: dict, root: str, dest: str) -> None:
    """Each planned run's all_results.json and metrics.jsonl into ``dest/raw/<run path>/``."""
    for spec in runs_of(plan):
        src = os.path.join(root, spec.path)
        if not os.path.isfile(os.path.join(src, "all_results.json")):
            continue
        dst = os.path.join(dest, "raw", spec.path)
        os.makedirs(dst, exist_ok=True)
        for fname in ("all_results.json", "metrics.jsonl"):
            if os.path.isfile(os.path.join(src, fname)):
                shutil.copy2(os.path.join(src, fname), os.path.join(dst, fname))


def report(plan: dict, meta: dict, root: str, wandb_log: bool = True) -> dict:
    """Analyse the runs under ``root`` and (re)write ``plan["results"]`` atomically.

    Returns:
        The analysis (as written to bench.json).
    """
    res = analyze(plan, root, meta.get("launches"))
    machine = meta.get("machine") or machine_info()
    machine.setdefault("loadavg_end", loadavg())
    results = plan["results"]
    tmp = results + ".partial"
    if os.path.isdir(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    plot_paths = make_plots(plan, res, tmp)
    table = write_table(plan, res, machine, meta, os.path.join(tmp, "table.md"))
    copy_raw(plan, root, tmp)
    with open(os.path.join(tmp, "machine.json"), "w", encoding="utf-8") as fh:
        json.dump(machine, fh, indent=1)
    with open(os.path.join(tmp, "command.txt"), "w", encoding="utf-8") as fh:
        fh.write(meta.get("command", plan["command"]) + "\n")
        if meta.get("report_command"):
            fh.write(f"# report rebuilt with: {meta['report_command']}\n")
    with open(os.path.join(tmp, "bench.json"), "w", encoding="utf-8") as fh:
        json.dump({"plan": {k: v for k, v in plan.items() if k not in ("work", "results", "cache_dir")},
                   "links": meta.get("links"), "launches": meta.get("launches"), "timings": meta.get("timings"),
                   "cpu": meta.get("cpu"), "date": meta.get("date"), "results": res}, fh, indent=1, default=str)
    if os.path.isdir(results):
        shutil.rmtree(results)
    os.replace(tmp, results)
    print(table)
    note = "W&B: skipped"
    if wandb_log:
        try:
            wdir = log_wandb(plan, res, [os.path.join(results, os.path.basename(p)) for p in plot_paths], table)
            note = f"W&B offline run: {wdir} (upload: wandb sync {wdir})"
        except Exception as exc:  # the results are on disk already; say so and go on
            note = f"W&B logging FAILED: {type(exc).__name__}: {exc}"
    print(f"[bench] results: {results}/ (table.md, *.png, raw/, machine.json, command.txt, bench.json)\n"
          f"[bench] {note}", flush=True)
    return res
