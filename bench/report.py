"""The benchmark's results folder: table.md (tabulate), plots (recipes.plots), curves.csv (every
run's curves), machine.json, command.txt, a compact bench.json (:mod:`bench.compact`), and an
offline W&B run.

The report states figures only; bench/README.md says how to read them against the goals.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import shutil
import subprocess
from importlib import metadata
from typing import Any

from tabulate import tabulate

from recipes import plots
from fl_accel.mesh import AXES

from bench import compact
from bench.analysis import MIB, analyze, counts, in_sd
from bench import plan as bp
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
          "busy during the launch (recipes.host_load.HostLoad); (!) above 5%: step times are inflated by other work.",
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
          "Plot: `throughput.png`. Every run's curves (training and evaluation records: loss, perplexity, "
          "training seconds) are in `curves.csv`; its whole-run figures in `bench.json` (`runs`)."]
    text = "\n".join(L) + "\n"
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return text


# ---------------------------------------------------------------------- plots
def make_plots(plan: dict, res: dict, out_dir: str) -> list[str]:
    """throughput.png: bars per link, the cost model's prediction as a tick. (The eval curves
    of these 40-step runs are in curves.csv.)"""
    if not res["main"]:
        return []
    smoke = " (SMOKE RUN)" if plan.get("smoke") else ""
    groups = {f"link {link}": [(r["label"], r["tokens_per_s"] or 0.0, r["pred"].get("tokens_per_s"))
                               for r in block["rows"].values()] for link, block in res["main"].items()}
    return [plots.plot_bars(groups, os.path.join(out_dir, "throughput.png"), ylabel="tokens/s (all processes)",
                            title=f"throughput{smoke}", reference_label="cost model prediction")]


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


def write_compact(plan: dict, root, dest: str) -> dict:
    """Each planned run's curves into ``dest/curves.csv`` (one file for the suite) and its
    whole-run figures, returned for bench.json's ``runs`` (:mod:`bench.compact`). ``root``:
    a work folder or the :class:`~bench.compact.CompactRuns` of a committed results folder."""
    from bench.analysis import load_run

    runs, rows = {}, []
    for spec in runs_of(plan):
        run = load_run(root, spec.path)
        if run is None or spec.path in runs:
            continue
        runs[spec.path] = compact.compact_run(run)
        rows += compact.curve_rows(spec.suite, spec.path, run["records"])
    compact.write_curves(os.path.join(dest, compact.CURVES_FILE), rows)
    return runs


def _write_results_folder(plan: dict, root: str, machine: dict, meta: dict, write, bench: dict) -> str:
    """(Re)write ``plan["results"]`` atomically (built in ``<results>.partial``, then moved):
    ``write(tmp)`` draws the plots and writes table.md (returns the table, printed), then
    curves.csv, machine.json, command.txt (with the continue and rebuild commands when
    ``meta`` has them) and bench.json (``{"plan": ..., **bench, "runs": {path: whole-run
    figures}}``, the analysis without its per-run curves). Returns the table."""
    results = plan["results"]
    tmp = results + ".partial"
    if os.path.isdir(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    table = write(tmp)
    runs = write_compact(plan, root, tmp)
    with open(os.path.join(tmp, "machine.json"), "w", encoding="utf-8") as fh:
        json.dump(machine, fh, indent=1)
    with open(os.path.join(tmp, "command.txt"), "w", encoding="utf-8") as fh:
        fh.write(meta.get("command", plan["command"]) + "\n")
        if meta.get("resume_command"):
            fh.write(f"# continue an interrupted suite with: {meta['resume_command']}\n")
        if meta.get("report_command"):
            fh.write(f"# report rebuilt with: {meta['report_command']}\n")
    with open(os.path.join(tmp, "bench.json"), "w", encoding="utf-8") as fh:
        saved = {k: compact.strip_curves(v) if k == "results" else v for k, v in bench.items()}
        json.dump({"plan": {k: v for k, v in plan.items() if k not in ("work", "results", "cache_dir")}, **saved,
                   "runs": runs}, fh, indent=1, default=str)
    if os.path.isdir(results):
        shutil.rmtree(results)
    os.replace(tmp, results)
    print(table)
    return table


def report(plan: dict, meta: dict, root: str, wandb_log: bool = True) -> dict:
    """Analyse the runs under ``root`` and (re)write ``plan["results"]`` atomically.

    Returns:
        The analysis (as written to bench.json).
    """
    res = analyze(plan, root, meta.get("launches"))
    machine = meta.get("machine") or machine_info()
    machine.setdefault("loadavg_end", loadavg())
    results = plan["results"]
    plot_paths: list[str] = []

    def write(tmp: str) -> str:
        plot_paths.extend(make_plots(plan, res, tmp))
        return write_table(plan, res, machine, meta, os.path.join(tmp, "table.md"))

    table = _write_results_folder(plan, root, machine, meta, write, {
        "links": meta.get("links"), "launches": meta.get("launches"), "timings": meta.get("timings"),
        "cpu": meta.get("cpu"), "date": meta.get("date"), "results": res})
    note = "W&B: skipped"
    if wandb_log:
        try:
            wdir = log_wandb(plan, res, [os.path.join(results, os.path.basename(p)) for p in plot_paths], table)
            note = f"W&B offline run: {wdir} (upload: wandb sync {wdir})"
        except Exception as exc:  # the results are on disk already; say so and go on
            note = f"W&B logging FAILED: {type(exc).__name__}: {exc}"
    print(f"[bench] results: {results}/ (table.md, *.png, curves.csv, machine.json, command.txt, bench.json)\n"
          f"[bench] {note}", flush=True)
    return res


# ---------------------------------------------------------------------- quality suites
def _minutes(s: float | None) -> str:
    return _f(None if s is None else s / 60, "{:.1f}")


def _signed(x: float | None, fmt: str = "{:+.4f}") -> str:
    return _f(x, fmt)


def _local_header(plan: dict, res: dict, machine: dict, meta: dict) -> list[str]:
    suite = res["suite"]
    title = {"convergence": "convergence", "paper_regime": "the paper's regime at small scale"}[suite]
    L = [f"# fl_accel quality suite: {title}" + (" — SMOKE RUN" if plan.get("smoke") else ""), ""]
    if suite == "convergence":
        L += [f"> **Rules.** {bp.GRID_RULES}", "", f"> **Noise.** {bp.SEED_RULE}", ""]
    if plan.get("smoke"):
        L += ["> **SMOKE RUN: not a result.** A few steps only, to exercise every code path.", ""]
    runs = runs_of(plan)
    world = runs[0].world
    steps = f"{plan['steps']} steps" if plan["steps"] else "one epoch"
    lr_rows = [r.id for r in runs if "--learning_rate" in r.extra_flags]
    lr_note = f" (rows whose label names learning_rate: that LR; {', '.join(lr_rows)})" if lr_rows else ""
    flags_note = " and the flags their label names" if lr_rows else ""
    L += [f"Command: `{plan['command']}`  ",
          f"Date: {meta.get('date', '-')}; machine: {machine.get('cpu_model', '?')}, {machine.get('nproc', '?')} CPUs, "
          f"torch {machine.get('versions', {}).get('torch', '?')} (details: machine.json).", "",
          f"Setup: recipe `recipes/pretrain.py`, model `tiny` (2.88M parameters, fp32), embedded Shakespeare corpus "
          f"(BPE vocabulary 8,192: a loss of ln 8192 = 9.01 is a uniform guess), seq_len {plan['seq_len']}, micro-batch "
          f"{plan['micro_batch_size']} per rank, {world} processes (one torchrun on loopback: loss does not depend on "
          f"the link), {steps} per run ({world * plan['micro_batch_size'] * plan['seq_len']:,} tokens per step), AdamW "
          f"lr 3e-4{lr_note}, betas (0.9, 0.95), weight decay 0.1, 10% warmup then cosine (the paper's), evaluation "
          f"every {plan['eval_every']} steps on the first {plan['eval_blocks']} validation blocks "
          f"({plan['eval_blocks'] * plan['seq_len']:,} tokens; token-weighted loss). Every row has the same tokens, "
          f"data order and seed ({plan['seed']}) and differs only in the federation flags{flags_note}; rows marked (seed "
          f"N) repeat a configuration with seed N (model init and data order). Checkpoints every "
          f"{plan['checkpoint_every']} steps; an interrupted run resumes from its last one.", ""]
    pending = {k: v for k, v in res["status"].items() if v["state"] != "finished"}
    if pending:
        L += ["**Not finished yet** (the tables below hold the finished rows only): " + "; ".join(
            f"`{k}` {v['state']}" + (f" (logged up to step {v['step']})" if v["step"] else "")
            for k, v in pending.items()) + f". Continue with `{_resume_command(meta, plan, pending)}`.", ""]
    return L


def _sd_text(res: dict) -> str:
    """The pooled seed standard deviation, its formula, what it pools, and the rule."""
    seeds = res["seeds"]
    if seeds["pooled_sd"] is None:
        return "Pooled seed sd: not available yet (needs a configuration with 2 finished seeds)."
    labels = ", ".join(f"{seeds['configs'][c]['label']} (n={seeds['configs'][c]['n']})" for c in seeds["pooled_over"])
    left = [c for c, v in seeds["configs"].items() if v.get("sd") is not None and c not in seeds["pooled_over"]]
    which = ("the configurations planned with three seeds" if left else
             "the configurations with at least 2 finished seeds")
    out = (f"Pooled seed sd = {seeds['formula']} over {which} ({labels}; {seeds['df']} degrees of freedom) = "
           f"**{seeds['pooled_sd']:.4f}** nats; a difference counts when |Δ| > {seeds['rule_sds']} x pooled sd = "
           f"**{seeds['threshold']:.4f}** nats.")
    if left:
        out += (" The other configurations with two seeds are not pooled; their own sd is in the seeds table: " +
                ", ".join(f"{seeds['configs'][c]['label']} {seeds['configs'][c]['sd']:.4f}" for c in left) +
                " (a row whose own sd is larger than the pooled one is noisier than the rule assumes).")
    return out


def _rule_header(res: dict, what: str) -> str:
    """``vs FSDP (abs Δ > 2 sd = 0.0963)``: a column header that states the figure (no "|":
    it would split a markdown cell)."""
    t = res["seeds"].get("threshold")
    return f"{what} (abs Δ > {res['seeds'].get('rule_sds', bp.SEED_RULE_SDS)} sd" + (f" = {t:.4f})" if t else ")")


def seed_section(res: dict) -> list[str]:
    """Mean +- sd per configuration trained with several seeds, its unfinished seed rows, and
    the difference of its mean from the best FSDP configuration's mean under the rule."""
    seeds = res["seeds"]
    if not seeds["configs"]:
        return []
    best = seeds["configs"].get(res.get("best_fsdp") or "")
    table = []
    for cid, c in seeds["configs"].items():
        diff = c["mean"] - best["mean"] if best and best["mean"] is not None and c["mean"] is not None else None
        table.append([c["label"], ", ".join(map(str, c["seeds"])) or "-",
                      ", ".join(f"{v:.4f}" for v in c["losses"].values()) or "-", c["n"],
                      "-" if c["mean"] is None else f"{c['mean']:.4f}" + (
                          f" ± {c['sd']:.4f}" if c["sd"] is not None else ""),
                      _signed(diff) if cid != res.get("best_fsdp") else "-",
                      _counts(counts(diff, seeds["threshold"])) if cid != res.get("best_fsdp") else "-",
                      ", ".join(c["not_finished"]) or "-"])
    return ["## Seeds: mean ± sd per configuration", "",
            _md(table, ["configuration", "seeds finished", "final eval loss per seed", "n", "mean ± sd (nats)",
                        "Δ mean vs best FSDP's mean", _rule_header(res, "vs best FSDP"), "not finished"]), "",
            "sd: the sample standard deviation (n - 1 in the denominator) of the final eval loss over the finished "
            "seeds (model init and data order change with the seed). " + _sd_text(res) + " Best FSDP: the FSDP "
            "configuration with the lowest first-seed final loss"
            + (f" (`{res['best_fsdp']}`)" if res.get("best_fsdp") else "") + ".", ""]


def ablation_section(res: dict) -> list[str]:
    """Issue 46's ablation (:func:`bench.analysis.ablation_of`) under its pre-registered rules."""
    ab = res.get("ablation")
    if not ab:
        return []

    def verdict(c):
        if c["counts"] is None:
            return "-"
        return ("gain" if c["cost"] < 0 else "costs") if c["counts"] else "within noise"

    table = [[c["what"], f"`{c['ref']}`", f"`{c['id']}`", c["n"],
              "-" if c["mean"] is None else f"{c['mean']:.4f}" + (f" ± {c['sd']:.4f}" if c["sd"] is not None else ""),
              _signed(c["cost"]), _signed(c["cost_in_sd"], "{:+.1f}"), verdict(c)] for c in ab["components"]]
    L = ["## Ablation of the fast exchange (issue 46)", "", f"> **Rules.** {bp.ABLATION_RULES}", "",
         _md(table, ["component", "reference", "configuration", "seeds", "mean ± sd (nats)", "cost (nats)",
                     "cost (pooled sd)", _rule_header(res, "verdict")]), ""]
    for s in ab["sums"]:
        if s["gap"] is None:
            L.append(f"- `{s['id']}`: not all of its rows have finished yet.")
            continue
        L.append(f"- `{s['id']}`: its cost {s['cost']:+.4f} nats; the sum of its components' costs "
                 f"({', '.join(f'`{p}`' for p in s['parts'])}) {s['sum']:+.4f}; the difference {s['gap']:+.4f} is "
                 + ("within 2 pooled sd: the components explain it." if s["explained"] else
                    "beyond 2 pooled sd: the components interact."))
    rec = ab["alpha_recovers"]
    L += ["- Alpha 0.5 and the delay: " + ("not decided yet." if rec is None else
                                            "alpha 0.5 recovers the delay's cost." if rec else
                                            "alpha 0.5 does not recover a counted cost of the delay (or the delay "
                                            "costs nothing at alpha 0)."), ""]
    return L


def _lr(lr: float) -> str:
    """A learning rate as the grid's labels write it: 3e-4, 1e-3."""
    return f"{lr:.0e}".replace("e-0", "e-")


def per_token_section(res: dict) -> list[str]:
    """Issue 46 item 4 (:func:`bench.analysis.per_token_gap`): each method's best, per inner LR and
    overall, the gap against the target, and the H=1 floor."""
    pt = res.get("per_token")
    if not pt:
        return []
    cfg, sd = pt["configs"], res["seeds"].get("pooled_sd")

    def cell(cid):
        if cid is None:
            return "-"
        c = cfg[cid]
        return (f"`{cid}`: {c['mean']:.4f}" + (f" ± {c['sd']:.4f}" if c["sd"] is not None else "")
                + f" (n={c['n']})")

    table = [[_lr(r["lr"]), cell(r["FSDP"]), cell(r["FL+FSDP"]), _signed(r["gap"]),
              _signed(in_sd(r["gap"], sd), "{:+.1f}")] for r in pt["by_lr"]]
    b = pt["best"]
    L = ["## Per-token gap at each one's best (issue 46)", "", f"> **Rules.** {bp.PER_TOKEN_RULES}", "",
         _md(table, ["inner LR", "FSDP's best (mean ± sd)", "FL+FSDP's best, H >= 2 (mean ± sd)", "gap (nats)",
                     "gap (pooled sd)"]), "",
         f"- **Best against best: {pt['gap']:+.4f} nats** ({_signed(pt['gap_in_sd'], '{:+.1f}')} pooled sd), "
         f"FL+FSDP's {cell(b['FL+FSDP'])} against FSDP's {cell(b['FSDP'])}: "
         + (f"within the {pt['target']:g}-nat target" if pt["met"] else f"above the {pt['target']:g}-nat target")
         + ("; provisional (a best with fewer than 3 seeds)." if pt["provisional"] else ".")]
    fl = pt.get("floor")
    if fl is None:
        L.append(f"- The floor (`{bp.PER_TOKEN_FLOOR[0]}`) has not finished yet.")
    else:
        L.append(f"- The floor, H=1 at lr {_lr(fl['lr'])}: {fl['gap']:+.4f} nats over `{fl['fsdp']}`"
                 + (f"; blocking `avg` H=8 at the same LR {fl['h8_gap']:+.4f}: H=1 keeps "
                    f"{100 * fl['share']:.0f}% of H=8's gap, the part the local steps do not explain."
                    if fl["share"] is not None else "."))
    return L + [""]


def _counts(flag: bool | None) -> str:
    return "-" if flag is None else ("counts" if flag else "within noise")


def _pending_cells(res: dict, plan: dict, width: int) -> list[list[str]]:
    """One line per row that has not finished: its label, its state, '-' in the other cells."""
    labels = {r.id: r.label for r in runs_of(plan)}
    out = []
    for rid, st in res["status"].items():
        if st["state"] == "not started":
            out.append([labels.get(rid, rid), "not started"] + ["-"] * (width - 2))
        elif st["state"] != "finished":
            state = f"not finished ({st['state']}" + (f", logged up to step {st['step']}" if st.get("step") else "") + ")"
            out.append([labels.get(rid, rid), state] + ["-"] * (width - 2))
    return out


def grid_sections(plan: dict, res: dict) -> list[str]:
    """The convergence report by the grid's rules (bench.plan.GRID_RULES): every row against
    FSDP and the best FSDP configuration, in nats and pooled seed sd, with the 2-sd decision (and
    issue 28's 0.04-nats one),
    its "fl" bytes; then its tokens to each target. Rows not finished are listed as such."""
    rows = list(res["rows"].values())
    sig = res.get("significant_nats", bp.GRID_SIGNIFICANT_NATS)
    best = res["rows"].get(res.get("best_fsdp") or "")
    L = ["## By the grid's rules: against FSDP and the best FSDP", ""]
    table = []
    for r in rows:
        b = r.get("fl_bytes_per_param") or {}
        table.append([r["label"], _f(r["eval_loss"], "{:.4f}"), _signed(r["diff_fsdp"]),
                      _signed(r["diff_fsdp_in_sd"], "{:+.1f}"), _counts(r.get("diff_fsdp_counts")),
                      _signed(r.get("diff_best_fsdp")), _signed(r.get("diff_best_fsdp_in_sd"), "{:+.1f}"),
                      _counts(r.get("diff_best_fsdp_counts")), _counts(r.get("diff_best_fsdp_counts_fixed")),
                      _f(b.get("per_sync"), "{:.3g}")])
    table += _pending_cells(res, plan, 10)
    L += [_md(table, ["run", "final eval loss", "Δ vs FSDP (nats)", "Δ vs FSDP (pooled sd)",
                      _rule_header(res, "vs FSDP"),
                      "Δ vs best FSDP (nats)", "Δ vs best FSDP (pooled sd)", _rule_header(res, "vs best FSDP"),
                      f"vs best FSDP, issue 28's rule (abs Δ > {sig:g})", "fl bytes / parameter / sync"]), "",
          f"FSDP = `{bp.CONVERGENCE_FSDP}`; best FSDP = "
          + (f"{best['label']} (`{best['id']}`, final eval loss {best['eval_loss']:.4f})" if best else "none yet")
          + ": the FSDP configuration with the lowest final eval loss (first-seed rows: another seed repeats a "
          f"configuration). A difference **counts** when |Δ| > {bp.SEED_RULE_SDS} pooled seed sd; otherwise it is "
          f"**within noise**. " + _sd_text(res) + f" Issue 28's rule, fixed before the grid's runs, counted |Δ| > "
          f"{sig:g} nats (then about 2 seed bands of the first seed pairs, a band being the largest two-seed "
          "difference); its column is kept for what it was. fl bytes / parameter / sync: the bytes each federation "
          "group "
          "sent between groups during training per model parameter per sync of the whole model (every H steps; "
          "fp32 with 2 groups: 4; FSDP: 0); plot `quality_vs_bytes.png`.", ""]
    targets = res.get("targets") or []
    if targets:
        L += ["## Tokens to each target", ""]
        table = [[r["label"]] + [_f((r.get("tokens_to") or {}).get(t["key"]), "{:,.0f}") for t in targets]
                 for r in rows]
        table += _pending_cells(res, plan, len(targets) + 1)
        L += [_md(table, ["run"] + [t["label"] for t in targets]), "",
              "Training tokens at which the eval loss first reaches each target: the first evaluation at or below "
              "it, linear between it and the evaluation before; '-' = never reached in the budget. FSDP's "
              "half-budget loss is FSDP's eval loss at half its steps" + (" (not finished yet)" if not any(
                  t["key"] == "fsdp_half_budget" for t in targets) else "") + ".", ""]
    return L


def write_local_table(plan: dict, res: dict, machine: dict, meta: dict, path: str) -> str:
    """table.md of a quality suite (see bench/README.md); returns the text."""
    L = _local_header(plan, res, machine, meta)
    rows = list(res["rows"].values())
    tgt = res.get("target")
    if res["suite"] == "convergence":
        L += seed_section(res)
        L += ablation_section(res)
        L += per_token_section(res)
        L += ["## Final eval loss, differences in pooled seed sd, tokens to target", ""]
        fsdp_ttt = res["rows"].get("fsdp", {}).get("tokens_to_target")
        table = []
        for r in rows:
            table.append([r["label"], _f(r["eval_loss"], "{:.4f}"), _f(r["eval_perplexity"], "{:,.1f}"),
                          _signed(r["diff_fsdp"]), _signed(r["diff_fsdp_in_sd"], "{:+.1f}"),
                          _signed(r["diff_blocking"]), _signed(r["diff_blocking_in_sd"], "{:+.1f}"),
                          _f(r["tokens_to_target"], "{:,.0f}"),
                          _f(r["tokens_to_target"] / fsdp_ttt if r["tokens_to_target"] and fsdp_ttt else None,
                             "{:.2f}")])
        L += [_md(table, ["run", "final eval loss", "eval ppl", "Δ vs FSDP (nats)", "Δ vs FSDP (pooled sd)",
                          "Δ vs blocking fp32 (nats)", "Δ vs blocking fp32 (pooled sd)", "tokens to target",
                          "tokens to target / FSDP's"]), "",
              _sd_text(res) + " Blocking fp32 = FL+FSDP H=8 avg (P=1, fp32 exchange). Δ (pooled sd) = Δ in nats / "
              f"the pooled sd: within ±{bp.SEED_RULE_SDS} it is within seed-to-seed noise.",
              "",
              ("Target = FSDP's eval loss at half its budget: " + f"**{tgt['loss']:.4f}** after {tgt['tokens']:,.0f} "
               "tokens. Tokens to target: the first crossing, linear between evaluations (every "
               f"{plan['eval_every']} steps = {plan['eval_every'] * rows[0]['tokens_per_step']:,} tokens); '-' = "
               "never reached in the budget.") if tgt and tgt["loss"] is not None and rows else
              "Target: FSDP has not finished yet.", "",
              "With fragments (P > 1) the groups are never fully synchronized mid-run: a mid-run evaluation scores "
              "each rank's rows with its own group's model; the final one follows the final full sync.", ""]
        L += grid_sections(plan, res)
        L += ["## Time to target loss per link", ""]
        table, detail = [], []
        for r in rows:
            cells = [r["label"], _f(r["tokens_to_target"], "{:,.0f}")]
            for link in LINKS_ORDER:
                minutes, marker = link_minutes(r, link)
                cells.append("-" if minutes is None else f"{minutes:.1f}" + (f" ({marker})" if marker else ""))
                v = (r.get("links") or {}).get(link, {})
                used, how = link_tokens_per_s(v)
                sources = v.get("sources") or (v.get("same_bytes_sources") if how == SAME_BYTES else None) or []
                detail.append([r["label"], link, _f(used, "{:,.0f}") + (f" ({how})" if used is not None else ""),
                               _f(v.get("measured"), "{:,.0f}"), _f(v.get("predicted"), "{:,.0f}"),
                               ", ".join(sources) or "-", v.get("compute_source") or "-"])
            table.append(cells)
        L += [_md(table, ["run", "tokens to target"] + [f"{x} (min)" for x in LINKS_ORDER]), "",
              "Minutes of training (evaluation excluded) to reach the target on 2 emulated nodes x 2 processes "
              "joined by the link: tokens to target (above) / tokens/s on that link / 60, the tokens/s of each cell "
              "in the column \"tokens/s used\" of the table \"tokens/s behind it\" below. Without a mark the "
              "tokens/s is the committed throughput measurement of the same configuration (" + ", ".join(
                  f"`bench/results/{s}`" for s in res.get("throughput_sources", [])) + "; the mean where measured "
              f"twice); **({SAME_BYTES})** = this configuration was not measured at this link, but one that sends "
              "the same bytes from the same layout with the same compute was, and its measured tokens/s is used "
              "(the rows differ only in the outer optimizer, its schedule or the learning rate: `nesterov`'s outer "
              "step is local arithmetic on the same averaged pseudo-gradient; `bench.analysis.same_bytes_key`); "
              f"**({MODEL})** = neither was measured, the cost model's prediction (`fl_accel.planning.cost`, compute "
              "time per step from the committed calibration of the same configuration) instead. The cost model was "
              "within 2% of the measured FL+FSDP rows at 100 Mbit/s and 1 Gbit/s and 4% at 10 Mbit/s; for FSDP at "
              "100 Mbit/s the measurement was 0.73x the prediction (gloo's 4-rank ring used 63% of the link), so "
              "FSDP's predicted 10 Mbit/s time is optimistic. '-' = never reached the target.", "",
              "### Fastest to the target, per link", "",
              _md(guide_rows(res), ["link", "fastest", "then", "then", "slowest"]), "",
              f"Rows of the first seed only; each cell is the row and its minutes to target (marks as above: "
              f"({SAME_BYTES}), ({MODEL})). " + _ttt_spread_text(res), "",
              "### tokens/s behind it", "",
              _md(detail, ["run", "link", "tokens/s used", "measured tokens/s (this configuration)",
                           "predicted tokens/s", "measured in", "compute time from"]), "",
              "tokens/s used: the figure each time-to-target cell divides by (measured; measured, same bytes: the "
              "configuration named under \"measured in\"; model: predicted).", ""]
    else:
        ratios = res.get("ratios", {})
        L += ["## Final eval loss and the FSDP/FL perplexity ratio at equal tokens", ""]
        table = []
        for r in rows:
            groups = r["num_groups"]
            per_group = r["tokens_per_step"] // groups if r["tokens_per_step"] else None
            ratio = ratios.get(r["id"], {}).get("final")
            table.append([r["label"], f"{groups} x {r['world'] // groups}", _f(r["tokens_per_step"], "{:,}"),
                          _f(per_group, "{:,}"), r["steps"], _f(r["tokens"], "{:,}"), _f(r["eval_loss"], "{:.4f}"),
                          _f(r["eval_perplexity"], "{:,.1f}"), _signed(r["diff_fsdp"]),
                          _signed(r["diff_fsdp_in_sd"], "{:+.1f}"), _f(ratio, "{:.3f}")])
        L += [_md(table, ["run", "groups x ranks", "tokens per step (all groups)", "tokens per step per group "
                          "(one optimizer step's batch)", "optimizer steps", "training tokens", "final eval loss",
                          "eval ppl", "Δ loss vs FSDP (nats)", "Δ vs FSDP (pooled sd)",
                          "FSDP ppl / FL ppl (> 1: FL lower)"]), "",
              _sd_text(res) + " The paper (Llama-3.1-8B, 512 GPUs, F=128 groups of G=4, 64 steps) reports "
              "FSDP/FL = 4.48.", ""]
        if ratios:
            toks = sorted({c["tokens"] for v in ratios.values() for c in v["curve"]})
            table = [[f"{t:,}"] + [_f(next((c["ratio"] for c in v["curve"] if c["tokens"] == t), None), "{:.3f}")
                                   for v in ratios.values()] for t in toks]
            L += ["### FSDP/FL perplexity ratio at every evaluation", "",
                  _md(table, ["training tokens"] + [f"{res['rows'][k]['label']} vs {res['rows'][v['vs']]['label']}"
                                                    for k, v in ratios.items()]), ""]
    L += ["## Launches", ""]
    lrows = []
    for run_path, rec in (meta.get("launches") or {}).items():
        for s in rec.get("sessions", []):
            lrows.append([run_path, s.get("started", "-"), s.get("resumed_from_step", 0), s.get("rc"),
                          f"{s.get('wall_s', 0):.0f}", _pct((s.get("host") or {}).get("background_cpu_share"))])
    L += [_md(lrows, ["run", "session started", "resumed from step", "exit code", "wall s", "background CPU"])
          if lrows else "(no launch records)", "",
          "Wall time includes start-up, evaluations and checkpoints; background CPU = share of all CPUs other "
          "processes used meanwhile (a shared machine: quality figures do not depend on it, times do).", "",
          "Plots: `eval_loss_vs_tokens.png`"
          + (", `time_to_target.png`, `quality_vs_bytes.png`" if res["suite"] == "convergence" else "")
          + ". Every run's curves (training and evaluation records) are in `curves.csv`; its whole-run figures in "
          "`bench.json` (`runs`)."]
    text = "\n".join(L) + "\n"
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return text


LINKS_ORDER = ("1gbit", "100mbit", "10mbit")


MEASURED, SAME_BYTES, MODEL = "measured", "measured, same bytes", "model"
"""Where a time to target's tokens/s comes from (:func:`link_tokens_per_s`); the report marks
the last two after the minutes."""


def link_tokens_per_s(v: dict) -> tuple[float | None, str | None]:
    """(tokens/s, where from) of one row's link entry (``analysis.link_throughput``): this
    configuration's measurement, else the measurement of one sending the same bytes, else the
    cost model's prediction; (None, None) when none."""
    for key, how in (("measured", MEASURED), ("measured_same_bytes", SAME_BYTES), ("predicted", MODEL)):
        if v.get(key):
            return v[key], how
    return None, None


def link_minutes(row: dict, link: str) -> tuple[float | None, str]:
    """(minutes to target on ``link``, the mark of its tokens/s: "" for this configuration's
    measurement, :data:`SAME_BYTES` or :data:`MODEL`), as :func:`link_tokens_per_s` chooses."""
    v = (row.get("links") or {}).get(link, {})
    for key, mark in (("time_to_target_measured_s", ""), ("time_to_target_same_bytes_s", SAME_BYTES),
                      ("time_to_target_predicted_s", MODEL)):
        if v.get(key) is not None:
            return v[key] / 60, mark
    return None, ""


def guide_rows(res: dict) -> list[list[str]]:
    """Per link, the first-seed rows that reach the target, fastest first: the fastest three
    and the slowest, as "label: N min" (marked as :func:`link_minutes` marks its tokens/s)."""
    out = []
    for link in LINKS_ORDER:
        ranked = []
        for r in res["rows"].values():
            minutes, mark = link_minutes(r, link)
            if minutes is not None and not r["second_seed"]:
                ranked.append((minutes, f"{r['label']}: {minutes:.1f} min" + (f" ({mark})" if mark else "")))
        ranked.sort()
        cells = [c for _, c in ranked]
        out.append([link] + (cells[:3] + ["-"] * 3)[:3] + [cells[-1] if len(cells) > 3 else "-"])
    return out


def _ttt_spread_text(res: dict) -> str:
    """How much tokens to target moved between seeds (the noise of the ranking)."""
    parts, shares = [], []
    for r in res["rows"].values():
        first = res["rows"].get(r["id"].rsplit("-seed", 1)[0]) if r["second_seed"] else None
        if first and first.get("tokens_to_target") and r.get("tokens_to_target"):
            shares.append(100 * (r["tokens_to_target"] / first["tokens_to_target"] - 1))
            parts.append(f"{first['label']}: {first['tokens_to_target']:,.0f} vs {r['tokens_to_target']:,.0f} "
                         f"(seed {r['seed']}, {shares[-1]:+.1f}%)")
    if not parts:
        return ""
    return ("Seed-to-seed change of tokens to target (a configuration's first seed vs another): " + "; ".join(parts)
            + f". Rows whose minutes differ by less than the larger of these shares ({max(map(abs, shares)):.1f}%)"
            " are not ranked apart by this suite.")


def make_local_plots(plan: dict, res: dict, out_dir: str) -> list[str]:
    """eval_loss_vs_tokens.png (all tokens, and the second half zoomed, with the target), and
    for convergence time_to_target.png (bars per link) and quality_vs_bytes.png
    (:func:`plot_quality_vs_bytes`)."""
    rows = list(res["rows"].values())
    if not rows:
        return []
    smoke = " (SMOKE RUN)" if plan.get("smoke") else ""
    full = [plots.Series(r["label"], [e["tokens"] for e in r["evals"]], [e["loss"] for e in r["evals"]]) for r in rows]
    half = max(r["tokens"] or 0 for r in rows) / 2
    zoom = [plots.Series(s.label, [x for x in s.x if x >= half], [y for x, y in zip(s.x, s.y) if x >= half])
            for s in full]
    tgt = res.get("target") or {}
    hl = {"second half": tgt["loss"]} if tgt.get("loss") is not None else None
    paths = [plots.plot_panels({"all tokens": full, "second half": zoom}, os.path.join(out_dir, "eval_loss_vs_tokens.png"),
                               xlabel="training tokens", ylabel="eval loss (nats/token)", logy=False, hlines=hl,
                               title=f"eval loss vs training tokens{smoke}")]
    if res["suite"] == "convergence" and any(r.get("tokens_to_target") for r in rows):
        groups = {}
        for link in LINKS_ORDER:
            bars = []
            for r in rows:
                v = (r.get("links") or {}).get(link, {})
                minutes, _ = link_minutes(r, link)
                pred = v.get("time_to_target_predicted_s")
                if minutes is None:
                    continue
                bars.append((r["label"], minutes, pred / 60 if pred is not None else None))
            if bars:
                groups[f"link {link}"] = bars
        if groups:
            paths.append(plots.plot_bars(groups, os.path.join(out_dir, "time_to_target.png"),
                                         ylabel="minutes of training to target loss",
                                         title=f"time to target loss (bar: measured tokens/s, of the same bytes "
                                               f"where this row was not measured, or the model's){smoke}",
                                         reference_label="cost model"))
    if res["suite"] == "convergence":
        path = plot_quality_vs_bytes(res, os.path.join(out_dir, "quality_vs_bytes.png"), smoke)
        if path:
            paths.append(path)
    return paths


def plot_quality_vs_bytes(res: dict, path: str, suffix: str = "") -> str | None:
    """Final eval loss (y) against the "fl" bytes per parameter per sync (x, log), one labelled
    point per federated row; FSDP rows as horizontal lines, the best FSDP with its band of
    ± SEED_RULE_SDS pooled seed sd (within noise; ± GRID_SIGNIFICANT_NATS before a pooled sd
    exists). None when no row has both figures."""
    rows = list(res["rows"].values())
    points = [r for r in rows if r["algorithm"] != "fsdp" and r["eval_loss"] is not None
              and ((r.get("fl_bytes_per_param") or {}).get("per_sync") or 0) > 0]
    refs = [r for r in rows if r["algorithm"] == "fsdp" and r["eval_loss"] is not None]
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    best = res["rows"].get(res.get("best_fsdp") or "")
    sig = (res.get("seeds") or {}).get("threshold")
    what = f"{bp.SEED_RULE_SDS} pooled seed sd = {sig:.3f} nats" if sig else ""
    if not sig:
        sig = res.get("significant_nats", bp.GRID_SIGNIFICANT_NATS)
        what = f"{sig:g} nats"
    if best is not None:
        ax.axhspan(best["eval_loss"] - sig, best["eval_loss"] + sig, color="0.9", zorder=0,
                   label=f"best FSDP ± {what} (within noise)")
    for i, r in enumerate(refs):
        ax.axhline(r["eval_loss"], color="0.3" if r is best else "0.6", lw=1.6 if r is best else 1.0,
                   ls=("-", "--", ":", "-.")[i % 4], label=f"{r['id']}: {r['eval_loss']:.4f}", zorder=1)
    xs = [r["fl_bytes_per_param"]["per_sync"] for r in points]
    ys = [r["eval_loss"] for r in points]
    for i, r in enumerate(points):
        st = plots.style(i)
        ax.plot([xs[i]], [ys[i]], linestyle="none", marker=st["marker"], color=st["color"], markersize=7,
                label=f"{r['id']}: {r['eval_loss']:.4f}", zorder=3)
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    lo, hi = min(ys + [r["eval_loss"] for r in refs]), max(ys + [r["eval_loss"] for r in refs])
    pad = max(0.02, 0.08 * (hi - lo))
    ax.set_ylim(lo - pad, hi + pad)
    ax.set_xlim(min(0.01, min(xs) / 3), max(60.0, max(xs) * 15))  # fp32 (4), int8 (~1), sparse (~0.04); labels
    gap = 0.035 * (hi - lo + 2 * pad)
    placed: dict[int, float] = {}
    for i in sorted(range(len(points)), key=lambda k: ys[k]):  # labels of points at one x never overlap
        bucket = round(math.log10(xs[i]) * 5)
        y = max(ys[i], placed.get(bucket, -math.inf) + gap)
        placed[bucket] = y
        ax.annotate(points[i]["id"], (xs[i], ys[i]), xytext=(xs[i] * 1.25, y), fontsize=7, va="center",
                    arrowprops={"arrowstyle": "-", "color": "0.6", "lw": 0.5} if y != ys[i] else None)
    ax.set_xlabel("inter-group (fl) bytes per parameter per sync (log)")
    ax.set_ylabel("final eval loss (nats/token)")
    ax.set_title(f"quality vs bytes: final eval loss against fl bytes per parameter per sync{suffix}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path




def _resume_command(meta: dict, plan: dict, pending: dict) -> str:
    """The invocation that continues the unfinished rows ``pending``: the recorded command
    with its ``--only`` replaced by those rows (finished rows are skipped in any case)."""
    argv = shlex.split(meta.get("resume_command") or plan["command"])
    if "--only" in argv:
        i = argv.index("--only")
        del argv[i:i + 2]
    if "--name" not in argv:
        argv += ["--name", plan["name"]]
    return " ".join(shlex.quote(a) for a in argv + ["--only", ",".join(pending)])


def report_local(plan: dict, meta: dict, root, results_root: str | None = None,
                 throughput_sources: list[str] | None = None) -> dict:
    """Analyse a quality suite's runs under ``root`` (a work folder, or the
    :class:`~bench.compact.CompactRuns` of a committed results folder) and (re)write
    ``plan["results"]`` atomically: table.md, the plots, curves.csv (every finished run's
    curves), machine.json, command.txt, bench.json (with each finished run's whole-run
    figures). Works on a partial suite. ``throughput_sources``: the committed throughput
    results that time to target reads (default: the plan's)."""
    from bench.analysis import analyze_local

    res = analyze_local(plan, root, results_root, throughput_sources)
    machine = meta.get("machine") or machine_info()
    results = plan["results"]

    def write(tmp: str) -> str:
        make_local_plots(plan, res, tmp)
        return write_local_table(plan, res, machine, meta, os.path.join(tmp, "table.md"))

    _write_results_folder(plan, root, machine, meta, write,
                          {"launches": meta.get("launches"), "date": meta.get("date"), "results": res})
    print(f"[bench] results: {results}/ (table.md, *.png, curves.csv, machine.json, command.txt, bench.json)",
          flush=True)
    return res
