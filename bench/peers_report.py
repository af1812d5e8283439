"""The peers suite's figures and results folder (``bench/peers.py``).

Per launch (:func:`launch_figures`, from its work folder): tokens/s = training tokens / training
seconds (the run's wall clock from its first step to its last, evaluation pauses excluded: the
recipe's ``train_seconds``, the workers' same clock); bytes on the link = the sum over both nodes
of the bytes their veth sent (``tx_bytes`` after - before: everything that crossed the emulated
link, start-up, Lighthouse and evaluation traffic included); the eval curve, token-weighted NLL
on the same validation blocks at the same token counts (torchft: the two replica groups' parts
added, :func:`curve_of`).

Per row and link (:func:`summarize`): the median over the repetitions with its range (min-max)
of each figure (:func:`stats`). **Targets**: for each peer row (torchft, Accelerate), the worst
final eval loss over its repetitions, i.e. a loss every repetition of the peer reached within
its run. **Time to a target**: a repetition's training seconds at its first evaluation at or
below the target, linear in eval loss between that evaluation and the one before
(:func:`bench.analysis.x_to_loss`), read from the measured curve, never extrapolated: a
repetition that never reaches it counts as not reached, and a row's median is given only when
every repetition reached it. **Comparisons** (``plan["comparisons"]``): ratios of medians
(tokens/s, bytes), differences of median losses, and the peer's median time to its own target
over the row's.

Results folder ``bench/results/<name>/``: ``table.md``, ``peers.json`` (the plan, the machine,
the sittings, every launch's figures and record, the summary), ``curves.csv`` (every evaluation
of every launch), ``loss_vs_seconds.png`` (one panel per link, each row's median-throughput
repetition), ``command.txt``.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
from typing import Any, Iterable, Mapping, Sequence

from bench.analysis import x_to_loss
from bench.launch import _read_json
from bench.peers import NODES, RECORD, SITTINGS, Launch, PeerRow, launch_order, rows_by_id
from bench.report import _md

PEERS_JSON, CURVES, PLOT = "peers.json", "curves.csv", "loss_vs_seconds.png"
CURVE_COLUMNS = ("link", "row", "rep", "step", "tokens", "time_s", "wall_s", "eval_loss")
MIN_REPS = 3


class ReportError(RuntimeError):
    """Nothing to report from (the message says where it looked)."""


# ---------------------------------------------------------------------- one launch
def _jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def curve_of(tool: str, out_dir: str) -> list[dict]:
    """The launch's evaluations in step order: ``{"step", "tokens", "time_s", "wall_s", "loss"}``
    (loss in nats per predicted token). torchft: each replica group wrote the NLL and tokens of
    the rows its ranks scored; an evaluation's loss is their sums' ratio, its seconds the later
    group's."""
    if tool != "torchft":
        evals = [r for r in _jsonl(os.path.join(out_dir, "metrics.jsonl")) if "eval/loss" in r]
        last = {r["step"]: r for r in evals}  # one per step
        return [{"step": r["step"], "tokens": r["tokens"], "time_s": r.get("time_s"), "wall_s": r.get("wall_s"),
                 "loss": r["eval/loss"]} for r in sorted(last.values(), key=lambda r: r["step"])]
    parts: dict[int, list[dict]] = {}
    for k in range(NODES):
        for r in _jsonl(os.path.join(out_dir, f"group{k}", "metrics.jsonl")):
            if "eval/nll_sum" in r:
                parts.setdefault(r["step"], []).append(r)
    return [{"step": s, "tokens": ps[0]["tokens"], "time_s": max(p["time_s"] for p in ps),
             "wall_s": max(p["wall_s"] for p in ps),
             "loss": sum(p["eval/nll_sum"] for p in ps) / sum(p["eval/tokens"] for p in ps)}
            for s, ps in sorted(parts.items()) if len(ps) == NODES]


def launch_figures(plan: dict, launch: Launch) -> dict | None:
    """The launch's figures from its work folder (None when it has no record.json yet): the
    bench's record (sitting, times, load, veth bytes, exit code) and the run's own: training
    tokens and seconds, tokens/s, start-up seconds, the eval curve, the final eval loss;
    torchft: ``commits`` (the least of the groups') and ``expected_commits``."""
    row = rows_by_id(plan)[launch.row]
    out_dir = os.path.join(plan["work"], launch.key)
    rec = _read_json(os.path.join(out_dir, RECORD), None)
    if rec is None:
        return None
    fig = {k: rec.get(k) for k in ("link", "row", "rep", "tool", "sitting", "started", "ended", "loadavg_start",
                                   "loadavg_end", "background_cpu_share", "wall_s", "rc", "ok", "veth")}
    fig["bytes_on_link"] = sum(v["tx_bytes"] for v in (rec.get("veth") or {}).values()) if rec.get("veth") else None
    fig["curve"] = curve_of(row.tool, out_dir) if rec.get("ok") else []
    results = [_read_json(os.path.join(out_dir, f"group{k}", "all_results.json"), None) for k in range(NODES)] \
        if row.tool == "torchft" else [_read_json(os.path.join(out_dir, "all_results.json"), None)]
    if rec.get("ok") and all(results):
        fig["train_tokens"] = results[0]["train_tokens"]
        fig["train_seconds"] = max(r["train_seconds"] for r in results)
        fig["startup_seconds"] = max(r.get("startup_seconds") or 0.0 for r in results)
        fig["tokens_per_s"] = fig["train_tokens"] / fig["train_seconds"] if fig["train_seconds"] else None
        if row.tool == "torchft":
            fig["commits"] = min(r["commits"] for r in results)
            fig["expected_commits"] = results[0]["expected_commits"]
    fig["final_eval_loss"] = fig["curve"][-1]["loss"] if fig["curve"] else None
    return fig


# ---------------------------------------------------------------------- statistics
def stats(values: Iterable[float | None]) -> dict | None:
    """``{"median", "min", "max", "n"}`` of the values that are not None (None when there are none)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def overlap(a: dict | None, b: dict | None) -> bool | None:
    """Whether the ranges of two :func:`stats` overlap (None if either is missing)."""
    if not a or not b:
        return None
    return a["min"] <= b["max"] and b["min"] <= a["max"]


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _median(s: dict | None) -> float | None:
    return None if s is None else s["median"]


def peer_target(finals: Sequence[float | None]) -> float | None:
    """A peer's target: the worst (largest) final eval loss over its repetitions, so that every
    repetition reached it within its run; None unless every repetition has a final loss."""
    return None if not finals or any(f is None for f in finals) else max(finals)


def time_to_target(curves: Sequence[list[dict]], target: float) -> dict:
    """Training seconds to ``target`` per repetition (None: not reached within the run, never
    extrapolated), and their :func:`stats` when every repetition reached it: ``{"per_rep",
    "reached", "n", "stats"}``."""
    per = [x_to_loss(c, target, "time_s") if c else None for c in curves]
    reached = sum(x is not None for x in per)
    return {"per_rep": per, "reached": reached, "n": len(per),
            "stats": stats(per) if reached == len(per) and per else None}


def common_tokens(curves: Iterable[list[dict]]) -> list[int]:
    """The token counts at which every given curve has an evaluation, ascending."""
    sets = [{e["tokens"] for e in c} for c in curves if c]
    return sorted(set.intersection(*sets)) if sets else []


def summarize(plan: dict, launches: Mapping[str, dict]) -> dict:
    """Per link: every row's medians and ranges, the peers' targets, each row's time to each
    target, losses at equal tokens and the comparisons (module docstring). ``launches``: by
    :attr:`Launch.key`, :func:`launch_figures` dicts."""
    rows = rows_by_id(plan)
    out: dict[str, Any] = {}
    for link in plan["links"]:
        per_row: dict[str, dict] = {}
        for rid in rows:
            runs = [launches.get(Launch(link, rid, rep).key) for rep in range(1, plan["reps"] + 1)]
            done = [r for r in runs if r and r.get("ok")]
            per_row[rid] = {
                "planned": plan["reps"], "finished": len(done),
                "failed": sum(1 for r in runs if r and not r.get("ok")),
                "tokens_per_s": stats(r.get("tokens_per_s") for r in done),
                "bytes_on_link": stats(r.get("bytes_on_link") for r in done),
                "final_eval_loss": stats(r.get("final_eval_loss") for r in done),
                "startup_seconds": stats(r.get("startup_seconds") for r in done),
                "train_seconds": stats(r.get("train_seconds") for r in done),
                "background_cpu_share": stats(r.get("background_cpu_share") for r in done),
                "commits_short": sum(1 for r in done if r.get("commits") is not None
                                     and r["commits"] < r["expected_commits"]),
                "_curves": [r["curve"] for r in done]}
        limits = [rid for rid in rows if rows[rid].is_limit]
        limit = _median(per_row[limits[0]]["tokens_per_s"]) if limits else None
        for rid, s in per_row.items():  # the share of the no-sync limit (issue 46's done-when)
            s["of_limit"] = None if rows[rid].is_limit or rows[rid].tool != "fl_accel" else \
                ratio(_median(s["tokens_per_s"]), limit)
        targets = {}
        for rid, s in per_row.items():
            if rows[rid].tool != "fl_accel" and s["finished"] == plan["reps"]:
                t = peer_target([c[-1]["loss"] if c else None for c in s["_curves"]])
                if t is not None:
                    targets[rid] = t
        for rid, s in per_row.items():
            s["to_target"] = {peer: time_to_target(s["_curves"], t) for peer, t in targets.items()} \
                if s["finished"] else {}
        points = common_tokens(c[0] for c in (s["_curves"] for s in per_row.values()) if c)
        for s in per_row.values():  # at each of the row's own evaluations
            own = common_tokens(s["_curves"])
            s["loss_at_tokens"] = {str(t): stats(next((e["loss"] for e in c if e["tokens"] == t), None)
                                               for c in s["_curves"]) for t in own}
        comps = []
        for a, b, what in plan.get("comparisons", []):
            ra, rb = per_row.get(a), per_row.get(b)
            if not ra or not rb:
                continue
            pair = sorted(set(map(int, ra["loss_at_tokens"])) & set(map(int, rb["loss_at_tokens"])))
            deltas = [_median(ra["loss_at_tokens"][str(t)]) - _median(rb["loss_at_tokens"][str(t)])
                      for t in pair[:-1]]  # before the last evaluation (fl_accel's final sync acts there)
            tt_a, tt_b = ra["to_target"].get(b), rb["to_target"].get(b)
            comps.append({
                "row": a, "peer": b, "what": what,
                "tokens_per_s_ratio": ratio(_median(ra["tokens_per_s"]), _median(rb["tokens_per_s"])),
                "tokens_per_s_ranges_overlap": overlap(ra["tokens_per_s"], rb["tokens_per_s"]),
                "bytes_ratio": ratio(_median(ra["bytes_on_link"]), _median(rb["bytes_on_link"])),
                "final_loss_diff": None if not ra["final_eval_loss"] or not rb["final_eval_loss"] else
                _median(ra["final_eval_loss"]) - _median(rb["final_eval_loss"]),
                "loss_diff_before_end_max_abs": max((abs(d) for d in deltas), default=None),
                "equal_tokens_before_end": pair[:-1],
                "target": targets.get(b),
                "time_to_peer_target_speedup": ratio(_median((tt_b or {}).get("stats")),
                                                     _median((tt_a or {}).get("stats"))),
                "row_reached": (tt_a or {}).get("reached"), "row_reps": (tt_a or {}).get("n")})
        out[link] = {"rows": per_row, "targets": targets, "common_tokens": points, "comparisons": comps}
    return out


def _public(summary: dict) -> dict:
    """The summary without the curves (they go to curves.csv)."""
    return {link: {**s, "rows": {rid: {k: v for k, v in r.items() if not k.startswith("_")}
                                 for rid, r in s["rows"].items()}} for link, s in summary.items()}


# ---------------------------------------------------------------------- writing
def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def _cell(s: dict | None, fmt: str, scale: float = 1.0) -> str:
    """``median [min-max]`` (the median alone for one value)."""
    if not s:
        return "-"
    med = fmt.format(s["median"] * scale)
    return med if s["n"] == 1 else f"{med} [{fmt.format(s['min'] * scale)}-{fmt.format(s['max'] * scale)}]"


def _target_cell(t: dict | None) -> str:
    if not t or not t["n"]:
        return "-"
    if t["stats"] is None:
        return f"not reached ({t['reached']} of {t['n']})" if t["reached"] < t["n"] else "-"
    return _cell(t["stats"], "{:.0f}")


def _speedup_cell(c: dict) -> str:
    if c["time_to_peer_target_speedup"] is not None:
        return f"{c['time_to_peer_target_speedup']:.2f}x"
    if c["target"] is not None and c.get("row_reached") is not None and c["row_reached"] < c["row_reps"]:
        return f"not reached ({c['row_reached']} of {c['row_reps']})"
    return "-"


def _load(x: Sequence[float] | None) -> str:
    return "-" if not x else f"{x[0]:.2f}"


def sitting_text(launches: Mapping[str, dict], sittings: Mapping[str, dict]) -> str:
    used = sorted({r["sitting"] for r in launches.values() if r.get("sitting")})
    links = "; ".join(f"{link} {m['achieved_bits_per_s'] / 1e6:.2f} Mbit/s" for sid in used
                      for link, m in (sittings.get(sid, {}).get("links") or {}).items() if "achieved_bits_per_s" in m)
    measured = f" Links measured when their emulator came up (one TCP stream, node 0 to node 1): {links}." \
        if links else ""
    if len(used) == 1:
        info = sittings.get(used[0], {})
        return (f"**One sitting**: every launch below ran in the invocation started {used[0]} (ended "
                f"{info.get('ended', 'running')}).{measured}")
    return (f"**Not one sitting**: the launches come from {len(used)} invocations ({', '.join(used)}): a resumed "
            f"sitting; compare figures within one invocation (launches table, column sitting).{measured}")


def write_table(plan: dict, summary: dict, launches: Mapping[str, dict], sittings: Mapping[str, dict],
                machine: Mapping | None, path: str) -> str:
    rows = rows_by_id(plan)
    versions = (machine or {}).get("versions", {})
    lines = [f"# fl_accel beside torchft and Accelerate on emulated slow links ({plan['name']})", "",
             f"Command: `sudo {plan['command']}`  ",
             f"Machine: {(machine or {}).get('cpu_model', '?')}, {(machine or {}).get('nproc', '?')} CPUs; "
             + ", ".join(f"{k} {v}" for k, v in versions.items() if v) + ".", "",
             sitting_text(launches, sittings), ""]
    if plan["reps"] < MIN_REPS:
        lines += [f"**{plan['reps']} repetition(s) per row: not a result** (medians need at least {MIN_REPS}; a smoke "
                  "run shows that every row runs, that the bytes are counted and that the report is written).", ""]
    tokens_per_step = plan["nodes"] * plan["nproc_per_node"] * plan["micro_batch_size"] * plan["seq_len"]
    lines += [
        f"Every row: the recipe's `tiny` Llama, its tokenized Shakespeare blocks in the recipe's order, AdamW lr "
        f"{plan['learning_rate']:g} (the recipe's defaults otherwise: cosine, 10% warmup, clipping 1.0), seed "
        f"{plan['seed']}, {plan['steps']} steps of {tokens_per_step:,} tokens ({plan['nodes']} emulated nodes x "
        f"{plan['nproc_per_node']} processes, micro-batch {plan['micro_batch_size']} x {plan['seq_len']} tokens), "
        f"one federation group (torchft: replica group) per node, FSDP2 inside it (Accelerate's LocalSGD: DDP, it "
        f"refuses FSDP). Evaluations every {plan['eval_every']} steps (rows with a larger H: every H) and at the end "
        f"on "
        f"the first {plan['eval_blocks']} validation blocks, token-weighted NLL. Each link's rows ran "
        f"{plan['reps']} time(s), interleaved (rep 1 of every row, then rep 2, ...). Cells: median [min-max] over the "
        f"repetitions. tokens/s: training tokens / training seconds (evaluations excluded). MB: bytes both nodes' veth "
        f"sent (/sys/class/net/<veth>/statistics/tx_bytes, after - before; start-up and evaluation traffic included), "
        f"10^6 bytes. Targets: each peer's worst final eval loss over its repetitions (reached within every one of its "
        f"runs); seconds to a target: training seconds at the first evaluation at or below it, linear between "
        f"evaluations, measured, never extrapolated.", ""]
    for link in plan["links"]:
        s = summary[link]
        targets = s["targets"]
        heads = ["row", "setting", "reps", "tokens/s", "of the no-sync limit", "MB on the link", "final eval loss",
                 "start-up s", *[f"s to {peer}'s {t:.4f}" for peer, t in targets.items()]]
        body = []
        for rid, r in s["rows"].items():
            reps = f"{r['finished']}/{r['planned']}" + (f" ({r['failed']} failed)" if r["failed"] else "") + (
                f" ({r['commits_short']} short of commits)" if r["commits_short"] else "")
            body.append([rid, rows[rid].label, reps, _cell(r["tokens_per_s"], "{:,.0f}"),
                         _f(r.get("of_limit"), "{:.2f}"), _cell(r["bytes_on_link"], "{:.1f}", 1e-6), _cell(r["final_eval_loss"], "{:.4f}"),
                         _cell(r["startup_seconds"], "{:.0f}"),
                         *[_target_cell(r["to_target"].get(peer)) for peer in targets]])
        lines += [f"## {link}", "", _md(body, heads), ""]
        if s["comparisons"]:
            cbody = [[f"{c['row']} / {c['peer']}", c["what"], _f(c["tokens_per_s_ratio"], "{:.2f}x")
                      + ("" if c["tokens_per_s_ranges_overlap"] in (None, False) else " (ranges overlap)"),
                      _f(c["bytes_ratio"], "{:.2f}"), _f(c["final_loss_diff"], "{:+.4f}"),
                      _f(c["loss_diff_before_end_max_abs"], "{:.4f}"), _speedup_cell(c)]
                     for c in s["comparisons"]]
            lines += ["Comparisons (ratios of medians; loss differences of medians, row minus peer; the largest one at "
                      "the evaluations both made before the last):", "",
                      _md(cbody, ["row / peer", "what", "tokens/s ratio", "bytes ratio", "final loss diff",
                                  "max abs loss diff at equal tokens before the end",
                                  "speedup to the peer's target"]), ""]
        if s["common_tokens"]:
            pts = s["common_tokens"]
            lbody = [[rid] + [_f(_median(r["loss_at_tokens"].get(str(t))), "{:.4f}") for t in pts]
                     for rid, r in s["rows"].items()]
            lines += ["Eval loss at equal tokens (median over the repetitions):", "",
                      _md(lbody, ["row"] + [f"{t:,}" for t in pts]), ""]
    order = launch_order(plan)
    lbody = []
    for i, x in enumerate(order, 1):
        r = launches.get(x.key)
        if r is None:
            lbody.append([str(i), x.key, "not run yet"] + ["-"] * 7)
            continue
        tx = r.get("veth") or {}
        lbody.append([str(i), x.key, r.get("sitting") or "-", r.get("started") or "-",
                      f"{_load(r.get('loadavg_start'))} / {_load(r.get('loadavg_end'))}",
                      _f(None if r.get("background_cpu_share") is None else 100 * r["background_cpu_share"], "{:.0f}%"),
                      _f(r.get("wall_s"), "{:.0f}"), _f(r.get("tokens_per_s"), "{:,.0f}"),
                      " / ".join(f"{tx[k]['tx_bytes'] / 1e6:.1f}" for k in sorted(tx)) or "-",
                      "ok" if r.get("ok") else f"exit {r.get('rc')}"])
    lines += ["## Launches", "", "In launch order. Load average: 1 minute, at the launch's start / end; other CPU: the "
              "share of all CPUs used by processes the bench did not start (recipes.host_load).", "",
              _md(lbody, ["#", "launch", "sitting", "started", "load avg", "other CPU", "wall s", "tokens/s",
                          "MB sent node0 / node1", "status"]), ""]
    missing = [x.key for x in order if not (launches.get(x.key) or {}).get("ok")]
    if missing:
        lines.append(f"Not finished: {len(missing)} launch(es). Continue with `sudo {plan['command']}`.")
        lines.append("")
    lines += ["Notes: Accelerate's LocalSGD refuses FSDP (`NotImplementedError` for any distributed type but DDP's, "
              "accelerate/local_sgd.py), so its row is DDP: four whole replicas, the parameters averaged over the "
              "world every H steps and once more when its context exits, rank 0's weights broadcast at prepare. "
              "torchft's quantized exchange is CUDA-only (Triton fp8), so its rows exchange fp32. fl_accel ends with a "
              "full sync (exact); torchft's fragment rows end with their last fragment sync. Files: `peers.json` "
              "(every launch's record and figures), `curves.csv` (every evaluation), `loss_vs_seconds.png`."]
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


def write_curves(path: str, launches: Mapping[str, dict]) -> str:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(CURVE_COLUMNS)
        for r in launches.values():
            for e in r.get("curve") or []:
                w.writerow([r["link"], r["row"], r["rep"], e["step"], e["tokens"], _num(e.get("time_s")),
                            _num(e.get("wall_s")), _num(e["loss"])])
    return path


def _num(x) -> str:
    return "" if x is None else repr(float(x))


def read_curves(path: str) -> dict[str, list[dict]]:
    """curves.csv back into ``{launch key: curve}``."""
    out: dict[str, list[dict]] = {}
    with open(path, encoding="utf-8") as fh:
        for r in csv.DictReader(fh):
            key = Launch(r["link"], r["row"], int(r["rep"])).key
            out.setdefault(key, []).append({"step": int(r["step"]), "tokens": int(r["tokens"]),
                                            "time_s": float(r["time_s"]) if r["time_s"] else None,
                                            "wall_s": float(r["wall_s"]) if r["wall_s"] else None,
                                            "loss": float(r["eval_loss"])})
    return out


def plot(plan: dict, summary: dict, launches: Mapping[str, dict], path: str) -> str | None:
    """Eval loss against training seconds, one panel per link, each row's repetition with the
    median tokens/s; the first comparison's peer target dotted."""
    from recipes import plots

    panels, hlines = {}, {}
    for link in plan["links"]:
        series = []
        for rid, r in summary[link]["rows"].items():
            runs = [launches.get(Launch(link, rid, k).key) for k in range(1, plan["reps"] + 1)]
            runs = [x for x in runs if x and x.get("ok") and x.get("curve") and x.get("tokens_per_s")]
            if not runs:
                continue
            mid = sorted(runs, key=lambda x: x["tokens_per_s"])[(len(runs) - 1) // 2]
            series.append(plots.Series(rid, [e["time_s"] for e in mid["curve"]], [e["loss"] for e in mid["curve"]]))
        if series:
            panels[f"link {link}"] = series
            peer = next((c["peer"] for c in summary[link]["comparisons"] if c["target"] is not None), None)
            if peer is not None:
                hlines[f"link {link}"] = summary[link]["targets"][peer]
    if not panels:
        return None
    return plots.plot_panels(panels, path, xlabel="training seconds (evaluations excluded)",
                             ylabel="eval loss (nats/token)", logy=False, hlines=hlines or None,
                             title="eval loss vs wall clock (dotted: the first comparison's peer target)")


def write_results(plan: dict, launches: Mapping[str, dict], sittings: Mapping[str, dict],
                  machine: Mapping | None) -> str:
    """Every file of the results folder from the launches' figures; returns the folder."""
    out = plan["results"]
    os.makedirs(out, exist_ok=True)
    summary = summarize(plan, launches)
    write_table(plan, summary, launches, sittings, machine, os.path.join(out, "table.md"))
    write_curves(os.path.join(out, CURVES), launches)
    plot(plan, summary, launches, os.path.join(out, PLOT))
    doc = {"plan": {k: v for k, v in plan.items() if k not in ("work", "results", "cache_dir")},
           "machine": machine, "sittings": dict(sittings),
           "launches": [{k: v for k, v in r.items() if k != "curve"} for r in launches.values()],
           "summary": _public(summary)}
    tmp = os.path.join(out, PEERS_JSON + ".partial")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, separators=(",", ":"))
    os.replace(tmp, os.path.join(out, PEERS_JSON))
    with open(os.path.join(out, "command.txt"), "w", encoding="utf-8") as fh:
        fh.write(f"sudo {plan['command']}\n")
    return out


def _machine() -> dict:
    from importlib import metadata

    from bench.report import machine_info

    info = machine_info()
    try:
        info["versions"]["torchft"] = metadata.version("torchft")
    except metadata.PackageNotFoundError:
        info["versions"]["torchft"] = None
    return info


def report(plan: dict) -> str:
    """The results folder from the work folder (every launch with a record.json)."""
    launches = {x.key: f for x in launch_order(plan) if (f := launch_figures(plan, x)) is not None}
    sittings = _read_json(os.path.join(plan["work"], SITTINGS), {})
    return write_results(plan, launches, sittings, _machine())


def report_only(plan: dict) -> str:
    """Rebuild the results: from the work folder (its plan.json) when it exists, else from the
    committed results folder's peers.json and curves.csv.

    Raises:
        ReportError: neither exists.
    """
    saved = _read_json(os.path.join(plan["work"], "plan.json"), None)
    if saved is not None:
        return report(saved)
    doc = _read_json(os.path.join(plan["results"], PEERS_JSON), None)
    if doc is None:
        raise ReportError(f"nothing to report: no {os.path.join(plan['work'], 'plan.json')} and no "
                          f"{os.path.join(plan['results'], PEERS_JSON)}")
    saved = {**doc["plan"], "work": plan["work"], "results": plan["results"], "cache_dir": plan["cache_dir"]}
    curves = read_curves(os.path.join(plan["results"], CURVES))
    launches = {Launch(r["link"], r["row"], r["rep"]).key: {**r, "curve": curves.get(
        Launch(r["link"], r["row"], r["rep"]).key, [])} for r in doc["launches"]}
    return write_results(saved, launches, doc.get("sittings") or {}, doc.get("machine"))


__all__ = ["PeerRow", "ReportError", "common_tokens", "curve_of", "launch_figures", "overlap", "peer_target", "report",
           "report_only", "stats", "summarize", "time_to_target"]
