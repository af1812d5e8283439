"""From run folders to figures: step times, bytes, perplexity, and the cost model's predictions.

Input: the recipe's ``all_results.json`` and ``metrics.jsonl`` of every run, under
``<root>/<run path>/`` (``root`` = ``bench/work/<name>``), or the same runs in the compact
form of a committed results folder (``root`` = a :class:`bench.compact.CompactRuns`: its
bench.json and curves.csv), plus the launch records of :mod:`bench.launch` (wall time,
background CPU, bytes on the wire). Missing runs and fields are skipped, so results written
by older versions still read.

Every call into :mod:`fl_accel.planning.cost` is in :func:`predict`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import statistics
from typing import Any, Sequence

from fl_accel.mesh import AXES, FLLayout

from bench.compact import CompactRuns, read_run  # noqa: F401  (read_run: re-exported for bench/ and tests)
from bench.plan import LIMIT_SYNC_EVERY, NODES, RunSpec, runs_of, tokens_per_step
from recipes.metrics import record_value

MIB = 2**20


# ---------------------------------------------------------------------- one run
def load_run(root, path: str) -> dict | None:
    """The run at ``path`` (relative, e.g. ``rate-100mbit/fsdp``) of ``root``: a work folder
    (:func:`read_run`) or a :class:`~bench.compact.CompactRuns`; None if absent."""
    if isinstance(root, CompactRuns):
        return root.get(path)
    return read_run(os.path.join(root, path))


def train_records(run: dict) -> list[dict]:
    return sorted((r for r in run["records"] if "train/loss" in r), key=lambda r: r["step"])


def eval_records(run: dict) -> list[dict]:
    return sorted((r for r in run["records"] if "eval/perplexity" in r), key=lambda r: r["step"])


def step_times(run: dict) -> dict[int, float]:
    """Seconds of each optimizer step (rank 0's training time; the recipe excludes logging
    and evaluation), from consecutive per-step records."""
    out, prev_step, prev_t = {}, 0, 0.0
    for r in train_records(run):
        if r["step"] == prev_step + 1:
            out[r["step"]] = r["time_s"] - prev_t
        prev_step, prev_t = r["step"], r["time_s"]
    return out


def steady_step_times(run: dict, exclude: set[int] = frozenset(), skip: int = 2) -> list[float]:
    """Step times from step ``skip + 1`` on, without the steps in ``exclude`` (sync steps).
    Very short runs fall back to every step after the first."""
    st = step_times(run)
    vals = [t for s, t in st.items() if s > skip and s not in exclude]
    return vals or [t for s, t in st.items() if s > 1] or list(st.values())


def split_comm(run: dict) -> dict:
    """Training-only and per-evaluation bytes/seconds by axis for one run (rank 0).

    ``all_results.json``'s comm counts everything rank 0 sent, evaluations included. An
    evaluation's collectives are FSDP's forward all-gathers ("dp_shard") and its totals
    (the "world" bucket); it sends nothing on "fl" or "dp_replicate", whose bytes are all
    training's (including ``end_training``'s final sync, which follows the last metrics
    record when the groups still differ, e.g. with streaming fragments). For "dp_shard":
    the last metrics record (step T, logged before the final evaluation) subtracted from
    the total is one evaluation; every evaluation is the same, so training = total -
    n_evals x one evaluation.
    """
    tr, n_evals = train_records(run), len(eval_records(run))
    last = tr[-1] if tr else {}
    out = {"n_evals": n_evals, "train": {}, "eval": {}, "total": {}}
    for a in AXES:
        tot = run.get("comm", {}).get(a, {"bytes": 0, "seconds": 0.0})
        e_b = tot["bytes"] - last.get(f"comm/{a}/bytes", 0) if a == "dp_shard" else 0
        e_s = tot["seconds"] - last.get(f"comm/{a}/seconds", 0.0) if a == "dp_shard" else 0.0
        out["total"][a] = {"bytes": tot["bytes"], "seconds": tot["seconds"]}
        out["eval"][a] = {"bytes": e_b, "seconds": e_s}
        out["train"][a] = {"bytes": tot["bytes"] - n_evals * e_b, "seconds": max(0.0, tot["seconds"] - n_evals * e_s)}
    return out


def ppl_at_time(run: dict, target: float) -> float | None:
    """Training seconds at which eval perplexity first reaches ``target`` (log-linear
    interpolation between evaluations); None if it never does."""
    prev = None
    for r in eval_records(run):
        if r["eval/perplexity"] <= target:
            if prev is None:
                return r["time_s"]
            (t0, p0), (t1, p1) = prev, (r["time_s"], r["eval/perplexity"])
            if p0 == p1:
                return t1
            f = (math.log(p0) - math.log(target)) / (math.log(p0) - math.log(p1))
            return t0 + f * (t1 - t0)
        prev = (r["time_s"], r["eval/perplexity"])
    return None


# ---------------------------------------------------------------------- layout and cost model
def layout_of(spec: RunSpec) -> FLLayout:
    """The run's FLLayout: F groups (1 for the baselines) of R x S ranks."""
    groups = spec.num_groups if spec.algorithm.startswith("fl_") else 1
    shards = spec.shard_size if spec.algorithm in ("hsdp", "fl_hsdp") else spec.world // groups
    return FLLayout.equal(groups, spec.world // groups // shards, shards, spec.algorithm)


def link_figures(spec: RunSpec) -> dict:
    """Which axes cross nodes and how many ring hops of each share a node's NIC (FLLayout)."""
    layout, rpn = layout_of(spec), spec.nproc_per_node
    inter = [a for a in AXES if layout.spans_nodes(a, rpn)]
    return {"inter_axes": inter, "link_share": {a: layout.link_share(a, rpn) for a in inter}}


_UNITS: dict[int, Any] = {}


def predict(plan: dict, spec: RunSpec, run: dict, compute_s: float | None) -> dict:
    """The cost model for this run: bytes per axis and, given the calibrated compute time,
    its step time at the run's link. The only function that calls fl_accel.planning.cost.

    Uses ``estimate(layout, units, sync_every=, num_fragments=, sync_dtype=, param_bytes=4,
    grad_bytes=4, ranks_per_node=, total_steps=)`` and ``predict_step_time(est,
    compute_s=, intra_node_bw=inf, inter_node_bw=link bytes/s, ranks_per_nic=None,
    sync_delay=)``: intra-node traffic is already inside ``compute_s`` (the calibration
    ran with the same loopback), and NIC sharing comes from the layout.

    Returns:
        ``{"bytes_per_step": {axis: bytes}, "bytes_run": {axis: bytes}, "sync_bytes": {axis:
        bytes per sync}, "spans_nodes": {axis: bool}}`` plus, with ``compute_s`` and a
        link, ``step_s``, ``comm_s``, ``comm_s_by_axis``, ``exposed_sync_s`` (seconds) and
        ``tokens_per_s``; or ``{"error": "..."}`` when the model is unavailable or
        disagrees with the run's mesh.
    """
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from fl_accel.planning import cost as cm
        from fl_accel.planning.units import units_from_module
        from scripts.netemu import parse_rate

        vocab = run.get("vocab_size", 8192)
        if vocab not in _UNITS:
            from recipes.modeling import PRESETS

            with torch.device("meta"):
                model = LlamaForCausalLM(LlamaConfig(**dict(PRESETS["tiny"], vocab_size=vocab)))
            _UNITS[vocab] = units_from_module(model)
        layout = layout_of(spec)
        mesh = (run.get("num_groups"), run.get("replicas"), run.get("shards"))
        if None not in mesh and tuple(mesh) != layout.shape:
            return {"error": f"run mesh {mesh} differs from the planned layout {layout.shape}"}
        est = cm.estimate(layout, _UNITS[vocab], sync_every=spec.sync_every, num_fragments=spec.num_fragments,
                          sync_dtype=spec.sync_dtype, param_bytes=4, grad_bytes=4, micro_batches=1,
                          ranks_per_node=spec.nproc_per_node, total_steps=spec.steps)
        per_step = dict(est.by_axis(amortized=True))
        out = {"bytes_per_step": per_step, "bytes_run": {a: per_step.get(a, 0) * spec.steps for a in AXES},
               "sync_bytes": dict(est.sync_by_axis()), "spans_nodes": dict(est.spans_nodes)}
        if compute_s is not None and spec.link:
            st = cm.predict_step_time(est, compute_s=compute_s, intra_node_bw=1e18,
                                      inter_node_bw=parse_rate(spec.link) / 8, ranks_per_nic=None,
                                      sync_delay=spec.sync_delay)
            out.update(compute_s=compute_s, step_s=st.step_s, comm_s=st.comm_s,
                       comm_s_by_axis=dict(st.comm_s_by_axis), exposed_sync_s=st.exposed_sync_s,
                       tokens_per_s=tokens_per_step(plan, spec) / st.step_s)
        return out
    except Exception as exc:  # the report says why the predictions are missing
        return {"error": f"{type(exc).__name__}: {exc}"}


# ---------------------------------------------------------------------- the whole plan
def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def main_row(plan: dict, spec: RunSpec, run: dict, compute_s: float | None, launch: dict) -> dict:
    """Every figure of one main run (see bench/README.md for each)."""
    comm = split_comm(run)
    lf = link_figures(spec)
    pred = predict(plan, spec, run, compute_s)
    inter = [a for a in lf["inter_axes"] if comm["total"][a]["bytes"] > 0]
    inter_b = sum(comm["train"][a]["bytes"] for a in inter)
    inter_s = sum(comm["train"][a]["seconds"] for a in inter)
    wire = launch.get("wire") or {}
    tx = [v["tx_bytes"] for v in wire.values()]
    nonsync = steady_step_times(run, spec.sync_steps())
    st = step_times(run)
    return {
        "id": spec.id, "path": spec.path, "suite": spec.suite, "label": spec.label, "algorithm": spec.algorithm, "world": spec.world,
        "mesh": list(layout_of(spec).shape), "steps": run.get("steps"), "tokens": run.get("train_tokens"),
        "tokens_per_s": run.get("tokens_per_s"), "train_seconds": run.get("train_seconds"),
        "step_s_median_nonsync": statistics.median(nonsync) if nonsync else None,
        "sync_steps_s": [st[s] for s in sorted(spec.sync_steps()) if s in st],
        "eval_loss": run.get("eval_loss"), "eval_perplexity": run.get("eval_perplexity"),
        "evals": [{"step": r["step"], "tokens": r["tokens"], "time_s": r["time_s"],
                   "perplexity": r["eval/perplexity"], "loss": r.get("eval/loss")} for r in eval_records(run)],
        "comm": comm, "pred": pred, "inter_axes": inter, "link_share": lf["link_share"],
        "inter_bytes": inter_b, "inter_seconds": inter_s, "inter_bw_measured": inter_b / inter_s if inter_s else None,
        "wire_tx_bytes_per_node": statistics.fmean(tx) if tx else None,
        "recipe_bytes_per_node": sum(comm["total"][a]["bytes"] * lf["link_share"][a] for a in inter),
        "model_bytes_per_node": (sum(pred["bytes_run"][a] * lf["link_share"][a] for a in lf["inter_axes"])
                                 if "bytes_run" in pred else None),
        "background_cpu_share": (launch.get("host") or {}).get("background_cpu_share"),
        "limit_row": spec.sync_every >= LIMIT_SYNC_EVERY, "baseline": spec.baseline, "limit": spec.limit,
    }


def analyze(plan: dict, root, launches: dict | None = None) -> dict:
    """All figures of the plan's runs found under ``root``.

    Returns:
        ``{"calibration": {id: {...}}, "main": {link: {"rows": {id: row}, "ppl_target":
        {world: ppl}}}, "overhead": {...} | None, "prediction_error": str | None}``.
    """
    launches = launches or {}
    runs = runs_of(plan)
    out: dict[str, Any] = {"calibration": {}, "main": {}, "overhead": None, "prediction_error": None}
    compute: dict[tuple, float] = {}
    for spec in (r for r in runs if r.phase == "calibration"):
        run = load_run(root, spec.path)
        if run is None:
            continue
        vals = steady_step_times(run, spec.sync_steps())
        compute[spec.config_key()] = statistics.median(vals)
        out["calibration"][spec.id] = {"label": spec.label, "compute_s": statistics.median(vals),
                                       "mean_s": statistics.fmean(vals), "n_steps": len(vals), "steps": run["steps"],
                                       "tokens_per_s": run.get("tokens_per_s")}
    for spec in (r for r in runs if r.phase == "main"):
        run = load_run(root, spec.path)
        if run is None:
            continue
        row = main_row(plan, spec, run, compute.get(spec.config_key()), launches.get(spec.path, {}))
        out["prediction_error"] = out["prediction_error"] or row["pred"].get("error")
        out["main"].setdefault(spec.link, {"rows": {}, "ppl_target": {}})["rows"][spec.id] = row
    for block in out["main"].values():
        rows = block["rows"]
        for row in rows.values():
            base, lim = rows.get(row["baseline"] or ""), rows.get(row["limit"] or "")
            row["speedup"] = _ratio(row["tokens_per_s"], base["tokens_per_s"]) if base else None
            row["of_limit"] = _ratio(row["tokens_per_s"], lim["tokens_per_s"]) if lim else None
            row["meas_over_pred"] = _ratio(row["tokens_per_s"], row["pred"].get("tokens_per_s"))
            row["pred_speedup"] = _ratio(row["pred"].get("tokens_per_s"),
                                         base["pred"].get("tokens_per_s")) if base else None
        for world in {r["world"] for r in rows.values()}:
            ppls = [r["eval_perplexity"] for r in rows.values() if r["world"] == world and not r["limit_row"]
                    and r["eval_perplexity"] is not None]
            if ppls:
                block["ppl_target"][world] = max(ppls)
        for row in rows.values():
            target = block["ppl_target"].get(row["world"])
            ok = target is not None and not row["limit_row"]
            row["time_to_target"] = ppl_at_time(load_run(root, row["path"]), target) if ok else None
    out["overhead"] = overhead(runs, root)
    return out


def overhead(runs: list[RunSpec], root) -> dict | None:
    """FL+FSDP with sync off against two concurrent FSDP jobs: median step times per
    repetition, pooled, and the spread of the baseline between repetitions."""
    reps = []
    for rep in sorted({r.id.split("-")[0] for r in runs if r.phase == "overhead"}):
        fl = load_run(root, f"overhead/{rep}-fl_fsdp")
        jobs = [load_run(root, r.path) for r in runs
                if r.phase == "overhead" and r.id.startswith(f"{rep}-fsdp-job")]
        if fl is None or not jobs or any(j is None for j in jobs):
            continue
        fl_t, job_t = steady_step_times(fl), [steady_step_times(j) for j in jobs]
        reps.append({"rep": rep, "fl_fsdp": fl_t, "fsdp_jobs": job_t, "fl_median": statistics.median(fl_t),
                     "fsdp_median": statistics.fmean(statistics.median(t) for t in job_t)})
    if not reps:
        return None
    fl_med = statistics.median([t for r in reps for t in r["fl_fsdp"]])
    fsdp_med = statistics.median([t for r in reps for ts in r["fsdp_jobs"] for t in ts])
    meds = [r["fsdp_median"] for r in reps]
    return {"reps": reps, "fl_median_s": fl_med, "fsdp_median_s": fsdp_med, "overhead": fl_med / fsdp_med - 1,
            "per_rep": [r["fl_median"] / r["fsdp_median"] - 1 for r in reps],
            "baseline_spread": (max(meds) - min(meds)) / statistics.fmean(meds) if len(meds) > 1 else None}


# ---------------------------------------------------------------------- quality suites
LINKS = ("1gbit", "100mbit", "10mbit")


def eval_curve(run: dict) -> list[dict]:
    """The run's evaluations in step order: ``{"step", "tokens", "loss", "perplexity",
    "time_s"}`` (loss in nats per token; the final evaluation included)."""
    return [{"step": r["step"], "tokens": r["tokens"], "loss": r.get("eval/loss", math.log(r["eval/perplexity"])),
             "perplexity": r["eval/perplexity"], "time_s": r.get("time_s")} for r in eval_records(run)]


def loss_at_tokens(curve: list[dict], tokens: float) -> float | None:
    """Eval loss at ``tokens`` training tokens, linear between evaluations (= log-linear in
    perplexity); None outside the evaluated range."""
    for a, b in zip(curve, curve[1:]):
        if a["tokens"] <= tokens <= b["tokens"]:
            if b["tokens"] == a["tokens"]:
                return b["loss"]
            f = (tokens - a["tokens"]) / (b["tokens"] - a["tokens"])
            return a["loss"] + f * (b["loss"] - a["loss"])
    if curve and curve[-1]["tokens"] == tokens:
        return curve[-1]["loss"]
    return None


def tokens_to_loss(curve: list[dict], target: float) -> float | None:
    """Training tokens at which the eval loss first reaches ``target`` (<=), linear between
    the evaluation before and the first one at or below it; the first evaluation's tokens
    when it is already there; None if the run never gets there."""
    return x_to_loss(curve, target, "tokens")


def x_to_loss(curve: list[dict], target: float, key: str) -> float | None:
    """:func:`tokens_to_loss` on another axis: the value of ``key`` (``tokens``, ``time_s``)
    at which the eval loss first reaches ``target``, linear between evaluations."""
    prev = None
    for e in curve:
        if e["loss"] <= target:
            if prev is None or prev["loss"] == e["loss"]:
                return float(e[key])
            f = (prev["loss"] - target) / (prev["loss"] - e["loss"])
            return prev[key] + f * (e[key] - prev[key])
        prev = e
    return None


POOLED_SD_FORMULA = "sqrt(sum((n_i - 1) s_i^2) / sum(n_i - 1))"
"""The pooled standard deviation over configurations i with n_i >= 2 seeds and sample sd s_i."""


def seed_config(rid: str, ids) -> str:
    """The configuration a row repeats with another seed: ``fsdp`` for ``fsdp-seed43`` when
    ``fsdp`` is in ``ids``; otherwise the row's own id."""
    m = re.fullmatch(r"(.+)-seed\d+", rid)
    return m[1] if m and m[1] in ids else rid


def seed_stats(losses: dict[str, list[float]], pool=None) -> dict:
    """Mean and sample standard deviation of each configuration's final eval losses over its
    seeds (``{configuration: [loss per finished seed]}``), and the pooled standard deviation
    :data:`POOLED_SD_FORMULA` over the configurations with at least 2 seeds (s_i with n_i - 1
    in its denominator); ``pool``: only these configurations enter the pooled sd (None: all).

    Returns:
        ``{"configs": {id: {"n", "mean", "sd"}}, "pooled_sd", "df", "pooled_over": [ids]}``;
        ``sd`` None below 2 seeds, ``pooled_sd`` None without any such configuration.
    """
    configs, ss, df, over = {}, 0.0, 0, []
    for cid, vals in losses.items():
        vals = [v for v in vals if v is not None]
        sd = statistics.stdev(vals) if len(vals) >= 2 else None
        configs[cid] = {"n": len(vals), "mean": statistics.fmean(vals) if vals else None, "sd": sd}
        if sd is not None and (pool is None or cid in pool):
            ss, df = ss + (len(vals) - 1) * sd**2, df + len(vals) - 1
            over.append(cid)
    return {"configs": configs, "pooled_sd": math.sqrt(ss / df) if df else None, "df": df, "pooled_over": over}


def in_sd(diff: float | None, sd: float | None) -> float | None:
    """``diff`` in units of the pooled seed standard deviation (None when either is missing or sd is 0)."""
    return diff / sd if diff is not None and sd else None


def time_to_target(tokens: float | None, tokens_per_s: float | None) -> float | None:
    """Seconds of training to reach the target: tokens to target / tokens per second."""
    return tokens / tokens_per_s if tokens is not None and tokens_per_s else None


def throughput_key(spec: RunSpec, exact: bool = True) -> tuple:
    """What throughput on a link depends on: the layout and the sync settings. Two rows with
    equal keys send the same bytes per step from the same layout. ``exact=False`` drops H,
    the outer optimizer and extra flags: the key of the compute time per step (the
    calibration runs exclude the sync steps)."""
    fl = spec.algorithm.startswith("fl_")
    base = (spec.algorithm, spec.world, spec.num_groups if fl else 1, spec.num_fragments, spec.sync_delay,
            spec.sync_dtype, spec.error_feedback)
    if not exact:
        return base
    return base + ((spec.sync_every, spec.outer_optimizer, tuple(spec.extra_flags)) if fl else (0, "avg", ()))


SAME_BYTES_FLAGS = frozenset({"--outer_lr_schedule", "--outer_lr_warmup_steps", "--learning_rate"})
"""Recipe flags (each with its value) that change neither the bytes a row sends nor its compute."""


def same_bytes_key(spec: RunSpec) -> tuple:
    """:func:`throughput_key` without what only changes local arithmetic: the outer optimizer
    (``nesterov`` applies its outer step to the averaged pseudo-gradient, which goes over "fl"
    exactly as ``avg``'s average does: equal "fl" bytes in the convergence suite's runs) and the
    flags of :data:`SAME_BYTES_FLAGS`. Rows with equal keys send the same bytes per step from
    the same layout with the same compute, so a measured tokens/s of one applies to the other."""
    base = throughput_key(spec, exact=False)
    if not spec.algorithm.startswith("fl_"):
        return base + (0, ())
    flags, kept, i = list(spec.extra_flags), [], 0
    while i < len(flags):
        if flags[i] in SAME_BYTES_FLAGS:
            i += 2
            continue
        kept.append(flags[i])
        i += 1
    return base + (spec.sync_every, tuple(kept))


def committed_throughput(results_root: str, sources: Sequence[str]) -> dict:
    """Measured tokens/s and calibrated compute time per configuration from the committed
    throughput results ``results_root/<source>/bench.json`` of every name in ``sources``
    (``--throughput-sources``; in that order: the first calibration of a configuration wins).

    Returns:
        ``{"measured": {key: {link: [{"tokens_per_s", "source", "background_cpu_share"}]}},
        "same_bytes": {same-bytes key: {link: [...]}}, "compute": {key(exact=False): {"compute_s",
        "source"}}, "missing": [source]}``; keys from :func:`throughput_key` and
        :func:`same_bytes_key`; limit rows left out.
    """
    out: dict[str, Any] = {"measured": {}, "same_bytes": {}, "compute": {}, "missing": []}
    for name in sources:
        path = os.path.join(results_root, name, "bench.json")
        if not os.path.isfile(path):
            out["missing"].append(name)
            continue
        with open(path, encoding="utf-8") as fh:
            saved = json.load(fh)
        specs = {(r.phase, r.link, r.id): r for r in runs_of(saved["plan"])}
        for link, block in saved["results"]["main"].items():
            for rid, row in block["rows"].items():
                spec = specs.get(("main", link, rid))
                if spec is None or row.get("limit_row") or not row.get("tokens_per_s"):
                    continue
                entry = {"tokens_per_s": row["tokens_per_s"], "source": f"{name}/{spec.path}",
                         "background_cpu_share": row.get("background_cpu_share")}
                out["measured"].setdefault(throughput_key(spec), {}).setdefault(link, []).append(entry)
                out["same_bytes"].setdefault(same_bytes_key(spec), {}).setdefault(link, []).append(entry)
        for rid, cal in saved["results"].get("calibration", {}).items():
            spec = specs.get(("calibration", None, rid))
            if spec is not None:
                out["compute"].setdefault(throughput_key(spec, exact=False),
                                          {"compute_s": cal["compute_s"], "source": f"{name}/{spec.path}"})
    return out


def as_emulated(spec: RunSpec, link: str, steps: int) -> RunSpec:
    """The 2-node x 2-process throughput row (at ``link``) of a 4-process quality row: the
    same layout and sync, so the cost model and the committed measurements apply."""
    return dataclasses.replace(spec, phase="main", suite="convergence", link=link, nodes=NODES,
                               nproc_per_node=spec.world // NODES, shard_size=spec.world // spec.num_groups,
                               sync_every=spec.sync_every or 1, steps=steps, checkpoint_every=0)


def link_throughput(plan: dict, spec: RunSpec, committed: dict, links=LINKS) -> dict:
    """Tokens/s of ``spec``'s configuration on each emulated link: measured (the mean of the
    committed measurements, with their sources); where it was not measured, the measured
    tokens/s of a configuration that sends the same bytes (:func:`same_bytes_key`, e.g.
    ``avg`` for ``nesterov``: ``measured_same_bytes``, ``same_bytes_sources``); and the cost
    model's prediction (compute time from the committed calibration of the same
    configuration, H and outer optimizer aside). ``{link: {"measured", "sources",
    "measured_same_bytes", "same_bytes_sources", "predicted", "compute_source"}}``."""
    key = throughput_key(spec)
    cal = committed["compute"].get(throughput_key(spec, exact=False))
    out = {}
    for link in links:
        meas = committed["measured"].get(key, {}).get(link, [])
        same = [] if meas else committed.get("same_bytes", {}).get(same_bytes_key(spec), {}).get(link, [])
        pred = None
        if cal is not None:
            p = predict(plan, as_emulated(spec, link, spec.steps or 40), {}, cal["compute_s"])
            pred = p.get("tokens_per_s")
        out[link] = {"measured": statistics.fmean(m["tokens_per_s"] for m in meas) if meas else None,
                     "sources": [m["source"] for m in meas],
                     "measured_same_bytes": statistics.fmean(m["tokens_per_s"] for m in same) if same else None,
                     "same_bytes_sources": [m["source"] for m in same], "predicted": pred,
                     "compute_source": cal["source"] if cal else None}
    return out


def run_status(root, spec: RunSpec) -> dict:
    """``{"state": "finished" | "running or interrupted" | "not started", "step": last
    logged step}`` of a quality row's folder (compact runs: finished if kept, else the state
    saved with them)."""
    if isinstance(root, CompactRuns):
        if spec.path in root:
            return {"state": "finished", "step": root.get(spec.path).get("steps")}
        if root.work and os.path.isdir(os.path.join(root.work, spec.path)):  # continued in the work folder
            return run_status(root.work, spec)
        return dict(root.status.get(spec.id) or {"state": "not started", "step": 0})
    path = os.path.join(root, spec.path)
    if os.path.isfile(os.path.join(path, "all_results.json")):
        run = read_run(path)
        return {"state": "finished", "step": run.get("steps")}
    recs = []
    mpath = os.path.join(path, "metrics.jsonl")
    if os.path.isfile(mpath):
        with open(mpath, encoding="utf-8") as fh:
            recs = [json.loads(line) for line in fh if line.strip()]
    if recs:
        return {"state": "running or interrupted", "step": max(r.get("step", 0) for r in recs)}
    return {"state": "not started", "step": 0}


def fl_bytes(run: dict, spec: RunSpec) -> dict:
    """Inter-group ("fl") bytes of a quality row, per model parameter.

    ``per_sync``: the bytes one federation group's ranks sent on "fl" during training (the
    ``comm_sum`` counter of the last training record, over all ranks, / F; the final sync at
    ``end_training`` comes after it and is left out), per parameter (``n_params``), per sync
    of the whole model (steps / H: with P fragments a sync is the P fragment exchanges of one
    H-step round). fp32 with F=2 is 4.0 (a ring all-reduce moves 2 (F-1)/F x 4 bytes per
    value). ``run``: the same for the whole run (all_results.json's ``comm_sum``, the final
    sync included). ``None`` where the run lacks the counters; 0 for FSDP rows.
    """
    if not spec.algorithm.startswith("fl_"):
        return {"per_sync": 0.0, "run": 0.0}
    n, steps, groups = run.get("n_params"), run.get("steps"), spec.num_groups
    train = train_records(run)
    last = train[-1] if train else {}
    per_sync = None
    fl_sum = record_value(last, "comm/all_ranks/fl/bytes")  # "comm_sum/fl/bytes" in runs before the key scheme
    if n and steps and spec.sync_every and fl_sum is not None:
        per_sync = fl_sum / groups / n / (last["step"] / spec.sync_every)
    total = ((run.get("comm_sum") or {}).get("fl") or {}).get("bytes")
    return {"per_sync": per_sync, "run": total / groups / n if total is not None and n else None}


def best_fsdp(rows: dict[str, dict]) -> str | None:
    """The id of the FSDP configuration with the lowest final eval loss (first-seed rows: a
    second seed repeats a configuration, it is not another one); None without FSDP rows."""
    fsdp = [r for r in rows.values() if r["algorithm"] == "fsdp" and not r["second_seed"]
            and r["eval_loss"] is not None]
    return min(fsdp, key=lambda r: r["eval_loss"])["id"] if fsdp else None


def seeds_of(rows: dict[str, dict], status: dict[str, dict]) -> dict:
    """The seed statistics of a quality suite (:func:`seed_stats`) over its finished rows, per
    configuration planned with more than one seed (rows ``<id>-seed<k>`` beside ``<id>``), with
    ``seeds`` (the finished seeds), ``losses`` (``{row id: final eval loss}``) and ``not_finished``
    (its planned rows that have not finished) per configuration, and ``threshold``: a difference
    counts when it exceeds :data:`bench.plan.SEED_RULE_SDS` pooled standard deviations."""
    from bench import plan as bp

    planned: dict[str, list[str]] = {}
    for rid in status:
        planned.setdefault(seed_config(rid, status), []).append(rid)
    planned = {c: ids for c, ids in planned.items() if len(ids) > 1}
    done = {c: [r for r in ids if r in rows and rows[r]["eval_loss"] is not None] for c, ids in planned.items()}
    # the pooled sd: over issue 40's equal-footing rows (three seeds each, bp.SEED_POOL), when
    # any has two finished; each configuration's own sd stays in the table (nesterov's pair is far wider)
    pool = [c for c in bp.SEED_POOL if len(done.get(c, [])) >= 2] or None
    out = seed_stats({c: [rows[r]["eval_loss"] for r in ids] for c, ids in done.items()}, pool=pool)
    for c, ids in planned.items():
        out["configs"][c].update(seeds=[rows[r]["seed"] for r in done[c]],
                                 losses={r: rows[r]["eval_loss"] for r in done[c]},
                                 not_finished=[r for r in ids if r not in done[c]],
                                 label=(rows.get(c) or {}).get("label", c))
    sd = out["pooled_sd"]
    out.update(rule_sds=bp.SEED_RULE_SDS, threshold=bp.SEED_RULE_SDS * sd if sd is not None else None,
               formula=POOLED_SD_FORMULA)
    return out


def ablation_of(seeds: dict) -> dict | None:
    """Issue 46's ablation by its pre-registered rules (:data:`bench.plan.ABLATION_RULES`) from the
    seed statistics (:func:`seeds_of`): per component (:data:`bench.plan.ABLATION_COMPONENTS`) the cost
    = the configuration's mean final eval loss minus its reference's, in nats and pooled sd, and whether
    it counts; per combined row (:data:`bench.plan.ABLATION_SUMS`) the sum of its components' costs
    against its own cost. None before the base configuration has a finished seed.

    Returns:
        ``{"components": [{"what", "ref", "id", "n", "mean", "sd", "cost", "cost_in_sd", "counts"}],
        "sums": [{"id", "parts", "sum", "cost", "gap", "explained"}], "alpha_recovers": bool | None,
        "threshold", "pooled_sd"}``; a cost is None while either mean is missing.
    """
    from bench import plan as bp

    cfg, sd, thr = seeds["configs"], seeds["pooled_sd"], seeds["threshold"]
    if (cfg.get(bp.ABLATION_BASE) or {}).get("mean") is None:
        return None

    def mean(cid):
        return (cfg.get(cid) or {}).get("mean")

    def cost(ref, cid):
        return mean(cid) - mean(ref) if mean(cid) is not None and mean(ref) is not None else None

    comps = []
    for what, ref, cid in bp.ABLATION_COMPONENTS:
        c = cost(ref, cid)
        comps.append({"what": what, "ref": ref, "id": cid, "n": (cfg.get(cid) or {}).get("n", 0), "mean": mean(cid),
                      "sd": (cfg.get(cid) or {}).get("sd"), "cost": c, "cost_in_sd": in_sd(c, sd),
                      "counts": counts(c, thr)})
    sums = []
    for cid, parts in bp.ABLATION_SUMS:
        costs = [cost(bp.ABLATION_BASE, p) for p in parts]
        total = sum(costs) if all(c is not None for c in costs) else None
        own = cost(bp.ABLATION_BASE, cid)
        gap = own - total if own is not None and total is not None else None
        sums.append({"id": cid, "parts": list(parts), "sum": total, "cost": own, "gap": gap,
                     "explained": None if gap is None or thr is None else abs(gap) <= thr})
    delay = {c["id"]: c for c in comps}
    a0, a5 = delay.get("fl_fsdp-h16-tau2-lr1e-3"), delay.get("fl_fsdp-h16-tau2-a0.5-lr1e-3")
    recovers = None
    if a0 and a5 and a0["counts"] is not None and a5["counts"] is not None:
        recovers = bool(a0["counts"] and a0["cost"] > 0 and not a5["counts"])
    return {"components": comps, "sums": sums, "alpha_recovers": recovers, "threshold": thr, "pooled_sd": sd}


def inner_lr(spec: RunSpec) -> float:
    """The inner (AdamW) peak learning rate a row trains at: its ``--learning_rate`` flag, else the
    recipe's default (``recipes.args``)."""
    flags = list(spec.extra_flags)
    if "--learning_rate" in flags:
        return float(flags[flags.index("--learning_rate") + 1])
    from recipes.args import RecipeArguments

    return RecipeArguments.learning_rate


def per_token_gap(rows: dict[str, dict], seeds: dict) -> dict | None:
    """Issue 46 item 4 by :data:`bench.plan.PER_TOKEN_RULES`: FSDP's and FL+FSDP's best configurations
    (lowest mean final eval loss over finished seeds, any inner LR), the gap between them in nats and
    pooled sd against :data:`bench.plan.PER_TOKEN_TARGET_NATS`; per inner LR the best of each; and the
    floor (H=1) against FSDP and H=8 at its LR. None before any FSDP and FL+FSDP row has finished.

    Returns:
        ``{"configs": {id: {"id", "label", "method", "lr", "sync_every", "n", "mean", "sd"}},
        "best": {"FSDP": id, "FL+FSDP": id}, "gap", "gap_in_sd", "target", "met", "provisional",
        "by_lr": [{"lr", "FSDP": id | None, "FL+FSDP": id | None, "gap"}],
        "floor": {"id", "lr", "gap", "fsdp", "h8", "h8_gap", "share"} | None}``: the floor
        (:data:`bench.plan.PER_TOKEN_FLOOR`) once it and its FSDP row have finished; ``share`` = its gap
        over H=8's.
    """
    from bench import plan as bp

    cfg = seeds.get("configs") or {}
    configs = {}
    for rid, row in rows.items():
        if row["second_seed"] or row["eval_loss"] is None:
            continue
        c = cfg.get(rid) or {}
        n, mean = (c["n"], c["mean"]) if c.get("mean") is not None else (1, row["eval_loss"])
        method = "FSDP" if row["algorithm"] == "fsdp" else "FL+FSDP" if row["algorithm"] == "fl_fsdp" else None
        if method is None:
            continue
        configs[rid] = {"id": rid, "label": row["label"], "method": method, "lr": row.get("lr"),
                        "sync_every": row.get("sync_every"), "n": n, "mean": mean, "sd": c.get("sd")}

    def best(pred):
        cands = [c for c in configs.values() if pred(c)]
        return min(cands, key=lambda c: c["mean"])["id"] if cands else None

    def compared(c):
        return c["method"] == "FSDP" or (c["sync_every"] or 0) >= 2

    b = {m: best(lambda c, m=m: c["method"] == m and compared(c)) for m in ("FSDP", "FL+FSDP")}
    if None in b.values():
        return None
    gap = configs[b["FL+FSDP"]]["mean"] - configs[b["FSDP"]]["mean"]
    by_lr = []
    for lr in sorted({c["lr"] for c in configs.values() if c["lr"] is not None}):
        ids = {m: best(lambda c, m=m: c["method"] == m and c["lr"] == lr and compared(c)) for m in b}
        g = (configs[ids["FL+FSDP"]]["mean"] - configs[ids["FSDP"]]["mean"]
             if None not in ids.values() else None)
        by_lr.append({"lr": lr, **ids, "gap": g})
    floor = None
    f, fsdp, h8 = bp.PER_TOKEN_FLOOR
    if f in configs and fsdp in configs:
        fg = configs[f]["mean"] - configs[fsdp]["mean"]
        hg = configs[h8]["mean"] - configs[fsdp]["mean"] if h8 in configs else None
        floor = {"id": f, "lr": configs[f]["lr"], "gap": fg, "fsdp": fsdp, "h8": h8, "h8_gap": hg,
                 "share": fg / hg if hg else None}
    sd = seeds.get("pooled_sd")
    return {"configs": configs, "best": b, "gap": gap, "gap_in_sd": in_sd(gap, sd),
            "target": bp.PER_TOKEN_TARGET_NATS, "met": gap <= bp.PER_TOKEN_TARGET_NATS,
            "provisional": any(configs[i]["n"] < 3 for i in b.values()), "by_lr": by_lr, "floor": floor}


def counts(diff: float | None, threshold: float | None) -> bool | None:
    """Whether ``|diff|`` exceeds ``threshold`` (None when either is missing)."""
    return abs(diff) > threshold if diff is not None and threshold is not None else None


def grid_targets(target: dict | None) -> list[dict]:
    """The eval-loss targets of the convergence report: FSDP's half-budget loss (when FSDP has
    finished) and :data:`bench.plan.GRID_TARGETS`. ``[{"key", "label", "loss"}]``; key
    ``fsdp_half_budget`` or the loss as text ("5.42")."""
    from bench import plan as bp

    out = []
    if target and target.get("loss") is not None:
        out.append({"key": "fsdp_half_budget", "label": f"FSDP's half-budget loss ({target['loss']:.4f})",
                    "loss": target["loss"]})
    out += [{"key": f"{t:.2f}", "label": f"{t:.2f}", "loss": t} for t in bp.GRID_TARGETS]
    return out


def analyze_local(plan: dict, root, results_root: str | None = None,
                  throughput_sources: Sequence[str] | None = None) -> dict:
    """The figures of a quality suite from the finished runs under ``root`` (a work folder or
    a results folder's :class:`~bench.compact.CompactRuns`).

    Convergence: per row the final eval loss and perplexity, the differences from FSDP,
    from the best FSDP configuration (:func:`best_fsdp`) and from blocking fp32 FL+FSDP (H=8
    avg) in nats and in pooled seed standard deviations (:func:`seeds_of`: mean +- sd of every
    configuration trained with several seeds, and their pooled sd), whether each difference
    counts (``_counts``: |Δ| > SEED_RULE_SDS pooled sd; ``_counts_fixed``: issue 28's fixed
    |Δ| > GRID_SIGNIFICANT_NATS), the tokens to reach each target
    (:func:`grid_targets`: FSDP's eval loss at half its steps and the fixed losses), the
    "fl" bytes per parameter (:func:`fl_bytes`), and the time to FSDP's half-budget loss on
    each emulated link (tokens to target / tokens/s, measured in the committed throughput
    results named by ``throughput_sources`` (default: ``plan["throughput_sources"]``,
    none if unset), else that of a measured configuration sending the same bytes, else
    predicted; :func:`link_throughput`). Paper regime: the same per
    row plus FSDP/FL perplexity ratios at equal tokens (final, and at every evaluation).

    Returns:
        ``{"suite", "rows": {id: row}, "status": {id: status}, "seeds": {...}, "target": {...},
        "targets": [...], "best_fsdp", "significant_nats", "throughput_sources": [...],
        "ratios": {...} (paper regime)}``.
    """
    from bench import plan as bp

    suite = plan["suites"][0]
    runs = runs_of(plan)
    results_root = results_root or os.path.join(bp.REPO, "bench", "results")
    if throughput_sources is None:
        throughput_sources = plan.get("throughput_sources") or []
    committed = committed_throughput(results_root, throughput_sources) if suite == "convergence" else None
    rows: dict[str, dict] = {}
    status = {r.id: run_status(root, r) for r in runs}
    specs = {r.id: r for r in runs}
    for spec in runs:
        run = load_run(root, spec.path)
        if run is None:
            continue
        curve = eval_curve(run)
        train = train_records(run)
        rows[spec.id] = {"id": spec.id, "path": spec.path, "label": spec.label, "algorithm": spec.algorithm,
                         "world": spec.world, "num_groups": spec.num_groups if spec.algorithm.startswith("fl_") else 1,
                         "sync_every": spec.sync_every or None, "lr": inner_lr(spec), "seed": plan["seed"] if spec.seed is None else spec.seed,
                         "second_seed": spec.seed is not None, "steps": run.get("steps"),
                         "tokens": run.get("train_tokens"), "tokens_per_step": run.get("tokens_per_step"),
                         "eval_loss": run.get("eval_loss"), "eval_perplexity": run.get("eval_perplexity"),
                         "evals": curve, "train": [{"step": r["step"], "tokens": r["tokens"], "loss": r["train/loss"],
                                                    "lr": record_value(r, "train/lr")} for r in train],
                         "train_seconds": run.get("train_seconds"), "tokens_per_s_loopback": run.get("tokens_per_s"),
                         "wall_seconds": run.get("wall_seconds"),
                         "background_cpu_share": (run.get("host") or {}).get("background_cpu_share"),
                         "fl_bytes_per_param": fl_bytes(run, spec), "n_params": run.get("n_params")}
    seeds = seeds_of(rows, status)
    out: dict[str, Any] = {"suite": suite, "rows": rows, "status": status, "seeds": seeds,
                           "ablation": ablation_of(seeds) if suite == "convergence" else None,
                           "per_token": per_token_gap(rows, seeds) if suite == "convergence" else None}
    fsdp_id = bp.CONVERGENCE_FSDP if suite == "convergence" else bp.PAPER_REGIME_FSDP
    fsdp = rows.get(fsdp_id)
    target = None
    if fsdp is not None and fsdp["tokens"]:
        half = fsdp["tokens"] / 2
        target = {"tokens": half, "loss": loss_at_tokens(fsdp["evals"], half), "of": fsdp_id}
    out["target"] = target
    blocking = rows.get(bp.CONVERGENCE_BLOCKING) if suite == "convergence" else None
    best_id = best_fsdp(rows) if suite == "convergence" else None
    best = rows.get(best_id) if best_id else None
    out["best_fsdp"], out["significant_nats"] = best_id, bp.GRID_SIGNIFICANT_NATS
    out["targets"] = grid_targets(target) if suite == "convergence" else []
    for row in rows.values():
        for ref, name in ((fsdp, "fsdp"), (blocking, "blocking"), (best, "best_fsdp")):
            diff = row["eval_loss"] - ref["eval_loss"] if ref is not None else None
            row[f"diff_{name}"] = diff
            row[f"diff_{name}_in_sd"] = in_sd(diff, seeds["pooled_sd"])
            row[f"diff_{name}_counts"] = counts(diff, seeds["threshold"])
            row[f"diff_{name}_counts_fixed"] = counts(diff, bp.GRID_SIGNIFICANT_NATS)
        row["tokens_to_target"] = tokens_to_loss(row["evals"], target["loss"]) if target and target["loss"] else None
        row["tokens_to"] = {t["key"]: tokens_to_loss(row["evals"], t["loss"]) for t in out["targets"]}
        if committed is not None:
            lt = link_throughput(plan, specs[row["id"]], committed)
            for link, v in lt.items():
                v["time_to_target_measured_s"] = time_to_target(row["tokens_to_target"], v["measured"])
                v["time_to_target_same_bytes_s"] = time_to_target(row["tokens_to_target"], v["measured_same_bytes"])
                v["time_to_target_predicted_s"] = time_to_target(row["tokens_to_target"], v["predicted"])
            row["links"] = lt
    if committed is not None:
        out["throughput_sources"] = [s for s in throughput_sources if s not in committed["missing"]]
    if suite == "paper_regime":
        out["ratios"] = paper_ratios(rows, fsdp_id)
    return out


def paper_ratios(rows: dict[str, dict], fsdp_id: str) -> dict:
    """FSDP/FL eval-perplexity ratios of the paper-regime rows at equal tokens: the final
    one per FL row (same seed as the FSDP run), and at every common evaluation.
    > 1: FL reaches a lower perplexity (the paper's direction; it reports 4.48)."""
    out = {}
    for rid, row in rows.items():
        if row["algorithm"] == "fsdp":
            continue
        ref = rows.get(fsdp_id if not row["second_seed"] else f"{fsdp_id}-seed{row['seed']}")
        if ref is None:
            continue
        by_tokens = {e["tokens"]: e["perplexity"] for e in ref["evals"]}
        out[rid] = {"vs": ref["id"], "final": ref["eval_perplexity"] / row["eval_perplexity"],
                    "curve": [{"tokens": e["tokens"], "ratio": by_tokens[e["tokens"]] / e["perplexity"]}
                              for e in row["evals"] if e["tokens"] in by_tokens]}
    return out
