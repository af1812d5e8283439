"""Time to target on emulated links, measured (issues 28 and 40): ``time_to_target.json``, ``curves.csv``, a plot.

The convergence suite gives tokens to a target; the throughput suites give tokens/s on a
link. When rows of the convergence suite are trained end to end on an emulated link, the
seconds to each target are measured instead of divided out. :func:`write_time_to_target`
writes, into a results folder::

    time_to_target.json
    {"seeds": {"pooled_sd", "threshold", "formula"} (the grid's, bench.analysis.seeds_of),
     "target_of": <grid row>, "half_budget_loss": <its eval loss at half its tokens>,
     "clock": "<which seconds>", "targets": {"half_budget": <loss>, "5.42": 5.42},
     "rows": [{"run": <row id>, "link": "10mbit", "measured": true,
               "of_limit": <tokens/s over the no-sync limit's at that link>,
               "final_eval_loss": ..., "wall_s_total": <all_results.json wall_seconds>,
               "to_target": {"half_budget": <s> | null, "5.42": ...},
               "step_s": {"median", "p10", "p90", "count"} (training seconds per step),
               ... and what the caller adds per row (bench.ttt_bench: learning_rate, loadavg,
               link_rate_bits_per_s, limit, sessions, sittings, status)}]}
    curves.csv                 run,link,step,tokens,wall_s,time_s,eval_loss: every evaluation of every row
    eval_loss_vs_seconds.png   eval loss against seconds, one line per run, the targets dotted

Seconds to a target: the first evaluation at or below it, linear in eval loss between it and
the evaluation before (:func:`bench.analysis.x_to_loss`); null if the run never gets there.

The clock: evaluation records of ``metrics.jsonl`` carry ``wall_s`` (the run's wall clock:
start-up, training, evaluations and checkpoints, summed over the sessions of a resumed run)
and ``time_s`` (its training seconds). Seconds to target are wall-clock seconds when every
evaluation has ``wall_s`` (runs of older recipes: training seconds, and ``clock`` says so).
"""

from __future__ import annotations

import csv
import json
import os
import statistics
from typing import Any, Mapping, Sequence

from bench.analysis import eval_curve, loss_at_tokens, read_run, x_to_loss
from bench.compact import CompactRuns

FILE = "time_to_target.json"
CURVES = "curves.csv"
CURVE_COLUMNS = ("run", "link", "step", "tokens", "wall_s", "time_s", "eval_loss")
PLOT = "eval_loss_vs_seconds.png"
FIXED_TARGETS = (5.42,)
"""Issue 40's fixed target beside the half-budget loss of ``--target_of``."""
PASSED = ("learning_rate", "loadavg", "link_rate_bits_per_s", "limit", "sessions", "sittings", "status")
"""Per-row figures the caller measured that a row of time_to_target.json carries as given."""
CLOCKS = {"wall_s": "wall-clock seconds since the run started (metrics.jsonl wall_s)",
          "time_s": "training seconds (metrics.jsonl time_s: start-up, evaluations and checkpoints excluded; no "
                    "wall-clock time is logged per evaluation)"}


def target_losses(half_budget_loss: float | None, targets: Sequence[float] = FIXED_TARGETS) -> dict[str, float]:
    """``{"half_budget": loss, "5.42": 5.42, ...}`` (the first only when known)."""
    out = {"half_budget": half_budget_loss} if half_budget_loss is not None else {}
    out.update({f"{t:.2f}": float(t) for t in targets})
    return out


def _run(entry: Mapping[str, Any], key: str) -> dict | None:
    if entry.get(key) is not None:
        return entry[key] if isinstance(entry[key], dict) else read_run(entry[key])
    return None


def step_summary(records: Sequence[Mapping[str, Any]]) -> dict:
    """Training seconds per optimizer step between consecutive training records (``time_s``
    difference over the step difference: with logging every k steps, the mean of each k-step
    window): ``{"median", "p10", "p90", "count"}`` over the windows (``count``: windows; None
    figures without two records)."""
    train = sorted((r for r in records if "train/loss" in r and r.get("time_s") is not None), key=lambda r: r["step"])
    per = [(b["time_s"] - a["time_s"]) / (b["step"] - a["step"]) for a, b in zip(train, train[1:])
           if b["step"] > a["step"]]
    if len(per) < 2:
        return {"median": per[0] if per else None, "p10": None, "p90": None, "count": len(per)}
    dec = statistics.quantiles(per, n=10, method="inclusive")
    return {"median": statistics.median(per), "p10": dec[0], "p90": dec[-1], "count": len(per)}


def measure_row(entry: Mapping[str, Any], targets: Mapping[str, float]) -> dict:
    """One row of time_to_target.json from ``entry``: ``run`` (row id), ``link``, ``path`` (the
    run folder: all_results.json + metrics.jsonl, or the run dict of :func:`read_run`),
    ``limit_tokens_per_s`` or ``limit_path`` (the no-sync limit at that link), ``measured``
    (default true), and any of :data:`PASSED`. The row also keeps ``clock`` and ``curve``
    (every evaluation), which :func:`write_time_to_target` writes to curves.csv.

    Raises:
        ValueError: the run folder has no all_results.json.
    """
    run = _run(entry, "path")
    if run is None:
        raise ValueError(f"{entry.get('run')} at {entry.get('link')}: no all_results.json in {entry.get('path')}")
    limit = entry.get("limit_tokens_per_s")
    if limit is None and entry.get("limit_path") is not None:
        limit = (_run(entry, "limit_path") or {}).get("tokens_per_s")
    evals = sorted((r for r in run["records"] if "eval/perplexity" in r), key=lambda r: r["step"])
    clock = "wall_s" if evals and all(r.get("wall_s") is not None for r in evals) else "time_s"
    curve = [dict(e, wall_s=r.get("wall_s"), s=r[clock]) for e, r in zip(eval_curve(run), evals)]
    tps = run.get("tokens_per_s")
    row = {"run": entry["run"], "link": entry["link"], "measured": bool(entry.get("measured", True)),
           "of_limit": tps / limit if tps and limit else None, "final_eval_loss": run.get("eval_loss"),
           "wall_s_total": run.get("wall_seconds"),
           "to_target": {k: x_to_loss(curve, t, "s") for k, t in targets.items()},
           "step_s": step_summary(run["records"])}
    row.update({k: entry[k] for k in PASSED if k in entry})
    return row | {"clock": clock, "curve": curve}


def write_curves(path: str, rows: Sequence[Mapping[str, Any]]) -> str:
    """curves.csv: one line per evaluation of every row (:data:`CURVE_COLUMNS`; floats as repr)."""
    with open(path, "w", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(CURVE_COLUMNS)
        for r in rows:
            for e in r["curve"]:
                w.writerow([r["run"], r["link"], e["step"], e["tokens"], *(
                    "" if x is None else repr(float(x)) for x in (e.get("wall_s"), e.get("time_s"), e["loss"]))])
    return path


def read_curves(path: str) -> dict[tuple[str, str], list[dict]]:
    """curves.csv back: ``{(run, link): [{"step", "tokens", "wall_s", "time_s", "loss"}]}`` in step order."""
    out: dict[tuple[str, str], list[dict]] = {}
    with open(path, encoding="utf-8", newline="") as fh:
        for line in csv.DictReader(fh):
            out.setdefault((line["run"], line["link"]), []).append(
                {"step": int(line["step"]), "tokens": int(line["tokens"]), "loss": float(line["eval_loss"]),
                 **{k: float(line[k]) if line[k] else None for k in ("wall_s", "time_s")}})
    return out


def write_time_to_target(out_dir: str, runs: Sequence[Mapping[str, Any]], seeds: Mapping[str, Any] | None,
                         half_budget_loss: float | None, target_of: str | None = None,
                         targets: Sequence[float] = FIXED_TARGETS, plot: bool = True) -> dict:
    """Write ``out_dir/time_to_target.json``, ``curves.csv`` (and the plot) for ``runs``
    measured on emulated links (each as :func:`measure_row` takes it). ``seeds`` (the grid's
    pooled seed sd) and ``half_budget_loss`` (of the grid row ``target_of``) come from the
    convergence suite (:func:`from_convergence`). Returns what was written to the JSON."""
    losses = target_losses(half_budget_loss, targets)
    rows = [measure_row(e, losses) for e in runs]
    clocks = {r["clock"] for r in rows}
    out = {"seeds": dict(seeds) if seeds else None, "target_of": target_of, "half_budget_loss": half_budget_loss,
           "clock": "; ".join(CLOCKS[c] for c in sorted(clocks)) if clocks else None, "targets": losses,
           "rows": [{k: v for k, v in r.items() if k not in ("clock", "curve")} for r in rows]}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, FILE), "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
    write_curves(os.path.join(out_dir, CURVES), rows)
    if plot and rows:
        plot_loss_vs_seconds(rows, losses, os.path.join(out_dir, PLOT),
                             "seconds (" + ("wall clock" if clocks == {"wall_s"} else "training") + ")")
    return out


def plot_loss_vs_seconds(rows: Sequence[dict], targets: Mapping[str, float], path: str, xlabel: str) -> str:
    """Eval loss against seconds, a panel per link with one line per run, the half-budget
    loss (else the lowest target) dotted."""
    from recipes import plots

    panels: dict[str, list] = {}
    for r in rows:
        panels.setdefault(f"link {r['link']}", []).append(
            plots.Series(r["run"], [p["s"] for p in r["curve"]], [p["loss"] for p in r["curve"]]))
    line = targets.get("half_budget", min(targets.values())) if targets else None
    which = "the half-budget loss" if "half_budget" in targets else "the lowest target"
    return plots.plot_panels(panels, path, xlabel=xlabel, ylabel="eval loss (nats/token)", logy=False,
                             hlines={k: line for k in panels} if line is not None else None,
                             title=f"eval loss vs seconds on emulated links (dotted: {which})")


def grid_curve(results_dir: str, row: str) -> tuple[list[dict], int | None]:
    """(eval curve, training tokens) of a grid row from its committed bench.json and curves.csv;
    ``([], None)`` when the row is not there."""
    run = CompactRuns.load(results_dir).get(row)
    return (eval_curve(run), run.get("train_tokens")) if run else ([], None)


def from_convergence(results_dir: str, target_of: str) -> dict:
    """From a convergence results folder: ``{"seeds": {"pooled_sd", "threshold", "formula"},
    "half_budget_loss"}``, the latter the row ``target_of``'s eval loss at half its training
    tokens (linear between evaluations; None when the row is not there)."""
    with open(os.path.join(results_dir, "bench.json"), encoding="utf-8") as fh:
        seeds = json.load(fh)["results"].get("seeds") or {}
    curve, tokens = grid_curve(results_dir, target_of)
    return {"seeds": {k: seeds.get(k) for k in ("pooled_sd", "threshold", "formula")},
            "half_budget_loss": loss_at_tokens(curve, tokens / 2) if tokens else None}
