"""Time to target on emulated links, measured (issue 28 item 6): ``time_to_target.json`` and a plot.

The convergence suite gives tokens to a target; the throughput suites give tokens/s on a
link. When rows of the convergence suite are trained end to end on an emulated link, the
seconds to each target are measured instead of divided out. :func:`write_time_to_target`
writes, into a results folder::

    time_to_target.json
    {"seed_band": <nats>, "fsdp_half_budget_loss": <nats>,
     "clock": "<which seconds>", "targets": {"fsdp_half_budget": <loss>, "5.42": 5.42, ...},
     "rows": [{"run": <row id>, "link": "10mbit", "measured": true,
               "of_limit": <tokens/s over the no-sync limit's at that link>,
               "final_eval_loss": ..., "wall_s_total": <all_results.json wall_seconds>,
               "to_target": {"fsdp_half_budget": <s> | null, "5.42": ..., "5.50": ..., "5.60": ...}}]}
    eval_loss_vs_seconds.png   (eval loss against seconds, one line per run, the targets dotted)

Seconds to a target: the first evaluation at or below it, linear in eval loss between it and
the evaluation before (:func:`bench.analysis.x_to_loss`); null if the run never gets there.

The clock: the recipe's ``metrics.jsonl`` records carry ``time_s``, the run's cumulative
*training* seconds (``train_seconds``: start-up, evaluations and checkpoints excluded;
summed over sessions of a resumed run). No wall-clock timestamp is logged per evaluation
(``unix_time`` only on training records of the torchft mode), so the seconds to target are
training seconds unless the evaluation records carry ``wall_s`` (then that is used, and
``clock`` says so). ``wall_s_total`` is the run's whole wall time (``wall_seconds``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

from bench.analysis import eval_curve, read_run, x_to_loss
from bench.plan import GRID_TARGETS

FILE = "time_to_target.json"
PLOT = "eval_loss_vs_seconds.png"
CLOCKS = {"wall_s": "wall-clock seconds since the run started (metrics.jsonl wall_s)",
          "time_s": "training seconds (metrics.jsonl time_s: start-up, evaluations and checkpoints excluded; no "
                    "wall-clock time is logged per evaluation)"}


def target_losses(fsdp_half_budget_loss: float | None, targets: Sequence[float] = GRID_TARGETS) -> dict[str, float]:
    """``{"fsdp_half_budget": loss, "5.42": 5.42, ...}`` (the first only when known)."""
    out = {"fsdp_half_budget": fsdp_half_budget_loss} if fsdp_half_budget_loss is not None else {}
    out.update({f"{t:.2f}": float(t) for t in targets})
    return out


def _run(entry: Mapping[str, Any], key: str) -> dict | None:
    if entry.get(key) is not None:
        return entry[key] if isinstance(entry[key], dict) else read_run(entry[key])
    return None


def measure_row(entry: Mapping[str, Any], targets: Mapping[str, float]) -> dict:
    """One row of time_to_target.json from ``entry``: ``run`` (row id), ``link``, ``path`` (the
    run folder: all_results.json + metrics.jsonl, or the run dict of :func:`read_run`),
    ``limit_tokens_per_s`` or ``limit_path`` (the no-sync limit at that link), ``measured``
    (default true).

    Raises:
        ValueError: the run folder has no all_results.json.
    """
    run = _run(entry, "path")
    if run is None:
        raise ValueError(f"{entry.get('run')} at {entry.get('link')}: no all_results.json in {entry.get('path')}")
    limit = entry.get("limit_tokens_per_s")
    if limit is None and entry.get("limit_path") is not None:
        limit = (_run(entry, "limit_path") or {}).get("tokens_per_s")
    curve = eval_curve(run)
    clock = "wall_s" if curve and all(r.get("wall_s") is not None for r in _eval_records(run)) else "time_s"
    points = [{"loss": e["loss"], "s": r[clock]} for e, r in zip(curve, _eval_records(run))]
    tps = run.get("tokens_per_s")
    return {"run": entry["run"], "link": entry["link"], "measured": bool(entry.get("measured", True)),
            "of_limit": tps / limit if tps and limit else None, "final_eval_loss": run.get("eval_loss"),
            "wall_s_total": run.get("wall_seconds"),
            "to_target": {k: x_to_loss(points, t, "s") for k, t in targets.items()},
            "clock": clock, "curve": points}


def _eval_records(run: dict) -> list[dict]:
    return sorted((r for r in run["records"] if "eval/perplexity" in r), key=lambda r: r["step"])


def write_time_to_target(out_dir: str, runs: Sequence[Mapping[str, Any]], seed_band: float | None,
                         fsdp_half_budget_loss: float | None, targets: Sequence[float] = GRID_TARGETS,
                         plot: bool = True) -> dict:
    """Write ``out_dir/time_to_target.json`` (and the plot) for ``runs`` measured on emulated
    links (each as :func:`measure_row` takes it). ``seed_band`` and ``fsdp_half_budget_loss``
    come from the convergence suite (:func:`from_convergence`). Returns what was written."""
    losses = target_losses(fsdp_half_budget_loss, targets)
    rows = [measure_row(e, losses) for e in runs]
    clocks = {r["clock"] for r in rows}
    out = {"seed_band": seed_band, "fsdp_half_budget_loss": fsdp_half_budget_loss,
           "clock": "; ".join(CLOCKS[c] for c in sorted(clocks)) if clocks else None, "targets": losses,
           "rows": [{k: v for k, v in r.items() if k not in ("clock", "curve")} for r in rows]}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, FILE), "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
    if plot and rows:
        plot_loss_vs_seconds(rows, losses, os.path.join(out_dir, PLOT),
                             "seconds (" + ("wall clock" if clocks == {"wall_s"} else "training") + ")")
    return out


def plot_loss_vs_seconds(rows: Sequence[dict], targets: Mapping[str, float], path: str, xlabel: str) -> str:
    """Eval loss against seconds, a panel per link with one line per run, FSDP's half-budget
    loss (else the lowest target) dotted."""
    from recipes import plots

    panels: dict[str, list] = {}
    for r in rows:
        panels.setdefault(f"link {r['link']}", []).append(
            plots.Series(r["run"], [p["s"] for p in r["curve"]], [p["loss"] for p in r["curve"]]))
    line = targets.get("fsdp_half_budget", min(targets.values())) if targets else None
    which = "FSDP's half-budget loss" if "fsdp_half_budget" in targets else "the lowest target"
    return plots.plot_panels(panels, path, xlabel=xlabel, ylabel="eval loss (nats/token)", logy=False,
                             hlines={k: line for k in panels} if line is not None else None,
                             title=f"eval loss vs seconds on emulated links (dotted: {which})")


def from_convergence(results_dir: str) -> tuple[float | None, float | None]:
    """(seed band, FSDP's half-budget loss) of a convergence results folder's bench.json."""
    with open(os.path.join(results_dir, "bench.json"), encoding="utf-8") as fh:
        res = json.load(fh)["results"]
    return (res.get("band") or {}).get("loss"), (res.get("target") or {}).get("loss")
