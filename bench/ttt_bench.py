"""Time to a target loss, measured end to end on emulated slow links (issues 28 and 40).

The convergence suite (``bench.run_bench --suite convergence``) trains its rows on loopback:
loss does not depend on the link, so it gives tokens to each target. This bench trains
some of those same rows, with the same flags, evaluations and checkpoints, across two
emulated nodes (``scripts/netemu.py``: one federation group per node, the link shaped with
tc at ``--links``), so that the seconds to each target are *measured* on the link. Each link
also gets a short no-sync limit run (FL+FSDP with H = 10^6 and no evaluations) for
``of_limit``.

Targets: the half-budget loss of the grid row ``--target_of`` (default ``fsdp-lr1e-3``: its
eval loss at half its tokens in the grid ``--grid``) and the fixed ``--targets`` (5.42).

FSDP rows (FSDP at 10 Mbit/s needs hours) stop when their run's wall clock passes the cap of
their link (``--cap_minutes``: ``90``, or per link ``10mbit:40,100mbit:45``): their
checkpoints and evaluations are every ``--eval_every`` steps, the run is killed at the cap, and
the row says ``stopped``; a target it has not reached is reported as a measured lower bound
(">= the wall clock at the stop"), and, labelled as such, extrapolated at its own rate.

**Sittings.** One invocation (not ``--report-only``) is one sitting: an id, its start and
end, the load average and each link's measured TCP rate. Every session of every run records
its sitting, start, end and the load average (``/proc/loadavg``) at both. The table says
which rows (and which limits) share a sitting, and claims "one sitting" only when every row
and its limit were measured in the same one.

Outputs in ``bench/results/<name>/``: ``time_to_target.json`` (schema in
:mod:`bench.time_to_target`; per row also ``learning_rate``, ``loadavg`` at the start and end
of its run, ``link_rate_bits_per_s``, ``limit`` (the limit's tokens/s and sittings),
``sessions``, ``sittings``, ``status``; ``sittings`` and ``one_sitting`` at the top;
``machine``), ``curves.csv`` (every evaluation: run, link, step, tokens, wall and training
second, eval loss), ``eval_loss_vs_seconds.png``, ``table.md``, ``command.txt``. Run folders go
to ``bench/work/<name>/<link>/<row>``.

Resumable: rerun the same command. A finished or stopped row is not run again; an
interrupted one resumes from its last checkpoint (the recipe sums wall and training
seconds over sessions, without the steps lost since that checkpoint). Needs root::

    sudo python -m bench.ttt_bench --name <date>-ttt --links 10mbit,100mbit --cap_minutes 10mbit:40,100mbit:45
    python -m bench.ttt_bench --name <date>-ttt --report-only     # rebuild the results, no root
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import subprocess
import sys

from scripts import netemu

from bench import plan as bp
from bench.analysis import inner_lr, read_run, tokens_to_loss
from bench.launch import SITTINGS, _read_json, _write_json, measure_link
from bench.launch import save_sitting as _save_sitting
from bench.report import _md, loadavg, machine_info
from bench.time_to_target import FIXED_TARGETS, from_convergence, grid_curve, write_time_to_target
from recipes.host_load import HostLoad

DEFAULT_ROWS = ("fl_fsdp-h16-p2-tau2-int8-ef-lr1e-3", "fl_fsdp-h8-lr1e-3", "fsdp-lr1e-3")
"""Issue 40's equal-footing rows, all at lr 1e-3: the fast int8 + error-feedback fragments at H=16,
blocking fp32 FL+FSDP ``avg`` at H=8, and FSDP; fastest first, so a short sitting finishes whole rows."""
DEFAULT_CAP_MINUTES = 90.0
LIMIT_ID = "fl_fsdp-limit"
LIMIT_STEPS = 64
STOPPED = "stopped.json"
UNRECORDED = "unrecorded"
"""The sitting of a session recorded before sittings were (an older version of this bench)."""


class TTTError(RuntimeError):
    """A bad option or a failed launch (the message says which)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.ttt_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default=None, help="results folder name (default: <today>-ttt)")
    p.add_argument("--links", default="10mbit,100mbit", help="tc rates, comma-separated, e.g. 10mbit,100mbit")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                   help="convergence-suite row ids, comma-separated, run in this order at every link; "
                        "LINK:ID runs a row at that link only (e.g. 10mbit:fl_fsdp-h8-nesterov)")
    p.add_argument("--cap_minutes", default=f"{DEFAULT_CAP_MINUTES:g}",
                   help="wall-clock cap of the FSDP rows, minutes (they stop there): one figure for every link, "
                        "and/or LINK:MINUTES per link, e.g. 10mbit:40,100mbit:45")
    p.add_argument("--grid", default="2026-12-03-grid",
                   help="convergence results folder (a name under bench/results, or a path) for the targets and the "
                        "pooled seed sd")
    p.add_argument("--target_of", default="fsdp-lr1e-3",
                   help="the grid row whose eval loss at half its tokens is the first target")
    p.add_argument("--targets", default=",".join(f"{t:g}" for t in FIXED_TARGETS),
                   help="fixed eval-loss targets besides it, comma-separated")
    p.add_argument("--steps", type=int, default=None, help="steps per row (default: the convergence suite's 832)")
    p.add_argument("--eval_every", type=int, default=None, help="default: the convergence suite's 32")
    p.add_argument("--report-only", dest="report_only", action="store_true", help="rebuild the results, run nothing")
    p.add_argument("--work-root", dest="work_root", default=os.path.join(bp.REPO, "bench", "work"))
    p.add_argument("--results-root", dest="results_root", default=os.path.join(bp.REPO, "bench", "results"))
    return p


def make_plan(args) -> dict:
    """The convergence plan of the chosen rows, moved onto 2 emulated nodes x 2 processes.

    Raises:
        TTTError: an unknown row id or link, a cap <= 0.
    """
    argv = ["--suite", "convergence", "--report-to", "none"]
    argv += ["--steps", str(args.steps)] if args.steps else []
    argv += ["--eval-every", str(args.eval_every)] if args.eval_every else []
    name = args.name or f"{datetime.date.today().isoformat()}-ttt"
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise TTTError(f"--name {name!r}: use letters, digits, '.', '_', '-'")
    try:
        plan = bp.make_plan(bp.build_parser().parse_args(argv + ["--name", name, "--work-root", args.work_root,
                                                                  "--results-root", args.results_root]))
    except bp.BenchError as exc:
        raise TTTError(str(exc)) from None
    links = [x.strip() for x in args.links.split(",") if x.strip()]
    for link in links:
        try:
            netemu.parse_rate(link)
        except (ValueError, netemu.NetEmuError) as exc:
            raise TTTError(f"--links: {exc}") from None
    caps = parse_caps(args.cap_minutes, links)
    if os.path.isfile(os.path.join(grid_dir(args.grid), "bench.json")) and not grid_curve(
            grid_dir(args.grid), args.target_of)[0]:
        raise TTTError(f"--target_of {args.target_of}: no finished row of that id in the grid {args.grid}")
    try:
        targets = [float(t) for t in args.targets.split(",") if t.strip()]
    except ValueError:
        raise TTTError(f"--targets: eval losses, comma-separated, got {args.targets!r}") from None
    by_id = {r.id: r for r in bp.runs_of(plan)}
    entries = [x.strip().split(":", 1) if ":" in x else [None, x.strip()] for x in args.rows.split(",") if x.strip()]
    rows = list(dict.fromkeys(r for _, r in entries))
    unknown = [r for r in rows if r not in by_id]
    if unknown:
        raise TTTError(f"--rows: unknown row(s) {unknown}; the convergence rows are {sorted(by_id)}")
    elsewhere = sorted({at for at, _ in entries if at is not None and at not in links})
    if elsewhere:
        raise TTTError(f"--rows: link(s) {elsewhere} are not in --links {links}")
    ckpt = plan["eval_every"]  # a capped row loses at most one evaluation's steps on a resume
    specs = []
    for link in links:
        base = by_id["fl_fsdp-h8"]
        limit = dataclasses.replace(base, id=LIMIT_ID, sync_every=bp.LIMIT_SYNC_EVERY, steps=LIMIT_STEPS, eval_every=0,
                                    checkpoint_every=0, baseline=None)
        for spec in [limit] + [by_id[r] for at, r in entries if at in (None, link)]:
            specs.append(dataclasses.replace(spec, link=link, nodes=2, nproc_per_node=2, checkpoint_every=(
                ckpt if spec.checkpoint_every else 0)))
    plan.update(name=name, links=links, rows=rows, cap_s={link: 60.0 * m for link, m in caps.items()}, grid=args.grid,
                target_of=args.target_of, targets=targets,
                work=os.path.join(os.path.abspath(args.work_root), name),
                results=os.path.join(os.path.abspath(args.results_root), name),
                runs=[dataclasses.asdict(s) for s in specs],
                command=" ".join(shlex.quote(a) for a in ["python", "-m", "bench.ttt_bench"] + sys.argv[1:]))
    return plan


def parse_caps(text: str, links: list[str]) -> dict[str, float]:
    """``--cap_minutes``: ``"90"`` (every link), ``"10mbit:40,100mbit:45"`` (per link; the others
    :data:`DEFAULT_CAP_MINUTES`), or both (``"60,10mbit:40"``) -> ``{link: minutes}``.

    Raises:
        TTTError: not a number, a cap <= 0, a link not in ``links``.
    """
    default, per = DEFAULT_CAP_MINUTES, {}
    for part in (x.strip() for x in str(text).split(",") if x.strip()):
        link, _, value = part.rpartition(":")
        try:
            minutes = float(value)
        except ValueError:
            raise TTTError(f"--cap_minutes: {part!r} is not MINUTES or LINK:MINUTES") from None
        if minutes <= 0:
            raise TTTError(f"--cap_minutes must be > 0, got {part!r}")
        if link and link not in links:
            raise TTTError(f"--cap_minutes: link {link!r} is not in --links {links}")
        if link:
            per[link] = minutes
        else:
            default = minutes
    return {link: per.get(link, default) for link in links}


def cap_s(plan: dict, link: str) -> float:
    """The wall-clock cap in seconds of the FSDP rows at ``link`` (plans of older versions: one cap)."""
    cap = plan["cap_s"]
    return cap[link] if isinstance(cap, dict) else float(cap)


def _dir(plan: dict, spec: bp.RunSpec) -> str:
    return os.path.join(plan["work"], spec.link, spec.id)


def _records(out_dir: str) -> list[dict]:
    """metrics.jsonl, the last record of each (kind, step) kept: a resumed run logs the steps
    it redid after its last checkpoint again."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    keep: dict[tuple, dict] = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                r = json.loads(line)
                keep[("eval" if "eval/perplexity" in r else "train", r.get("step"))] = r
    return sorted(keep.values(), key=lambda r: r.get("step") or 0)


def _wall_so_far(out_dir: str) -> float:
    """The run's wall clock at its last evaluation (0 when none): what a resume starts from."""
    walls = [r["wall_s"] for r in _records(out_dir) if "eval/perplexity" in r and r.get("wall_s") is not None]
    return max(walls, default=0.0)


def run_row(plan: dict, emu, spec: bp.RunSpec, port: int, sitting: str) -> str:
    """Launch (or resume) one row on ``emu`` in ``sitting``; returns "finished", "stopped" or
    "skipped". The session (sitting, start, end, load average at both, exit code, background
    CPU) is appended to the work folder's launches.json.

    Raises:
        TTTError: the launch failed (not a cap).
    """
    out_dir = _dir(plan, spec)
    if os.path.isfile(os.path.join(out_dir, "all_results.json")) or os.path.isfile(os.path.join(out_dir, STOPPED)):
        print(f"[ttt] {spec.link}/{spec.id}: done earlier, skipped", flush=True)
        return "skipped"
    os.makedirs(out_dir, exist_ok=True)
    args = bp.recipe_args(plan, spec, out_dir)
    timeout = plan["run_timeout"]
    capped = spec.algorithm == "fsdp"
    before = _wall_so_far(out_dir)
    if capped:
        timeout = max(60.0, cap_s(plan, spec.link) - before)
    argv = emu.torchrun_argv(0, args, nproc_per_node=spec.nproc_per_node, master_port=port)
    started, load_start = _now(), _loadavg()
    print(f"[ttt] {spec.link}/{spec.id} [{spec.label}]" + (f", stops after {timeout:.0f} s" if capped else "")
          + f": {' '.join(map(shlex.quote, argv))}", flush=True)
    load = HostLoad().start()
    with open(os.path.join(out_dir, "launch.log"), "a", encoding="utf-8") as log:
        log.write(f"=== session {started} (sitting {sitting}) ===\n")
        log.flush()
        rc = emu.run_torchrun(args, nproc_per_node=spec.nproc_per_node, master_port=port, env=bp.run_env(plan),
                              timeout=timeout, stdout=log, stderr=subprocess.STDOUT)
    load.stop()
    records_path = os.path.join(plan["work"], "launches.json")
    records = _read_json(records_path, {})
    records.setdefault(f"{spec.link}/{spec.id}", []).append({
        "sitting": sitting, "started": started, "ended": _now(), "loadavg_start": load_start,
        "loadavg_end": _loadavg(), "rc": rc, "host": load.as_dict()})
    _write_json(records_path, records)
    bg = load.background_cpu_share
    print(f"[ttt] {spec.link}/{spec.id}: exit {rc} after {load.wall_s:.0f} s"
          + (f"; other processes used {100 * bg:.0f}% of the CPUs" if bg is not None else ""), flush=True)
    if rc == 124 and capped:
        _write_json(os.path.join(out_dir, STOPPED), {"reason": f"wall-clock cap of {cap_s(plan, spec.link) / 60:g} min",
                                                     "wall_s": before + load.wall_s})
        return "stopped"
    if rc != 0 or not os.path.isfile(os.path.join(out_dir, "all_results.json")):
        raise TTTError(f"{spec.link}/{spec.id} failed (exit {rc}); log: {os.path.join(out_dir, 'launch.log')}")
    return "finished"


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def _loadavg() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages of /proc/loadavg (None where unavailable)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _run_dict(out_dir: str) -> dict | None:
    """The run for :func:`bench.time_to_target.measure_row`: all_results.json and deduplicated
    records, or, for a stopped row, its figures up to the stop."""
    run = read_run(out_dir)
    records = _records(out_dir)
    if run is not None:
        run["records"] = records
        return run
    stopped = _read_json(os.path.join(out_dir, STOPPED), None)
    if stopped is None or not records:
        return None
    train = [r for r in records if "train/loss" in r and r.get("time_s")]
    evals = [r for r in records if "eval/perplexity" in r]
    last = train[-1] if train else {}
    return {"records": records, "path": out_dir, "stopped": stopped["reason"],
            "tokens_per_s": last["tokens"] / last["time_s"] if last else None,
            "eval_loss": evals[-1]["eval/loss"] if evals else None, "wall_seconds": stopped["wall_s"],
            "train_tokens": last.get("tokens")}


def grid_dir(grid: str) -> str:
    """``--grid``: a path, or a name under bench/results."""
    return grid if os.path.isdir(grid) else os.path.join(bp.REPO, "bench", "results", grid)


def _sittings_of(sessions: list[dict]) -> list[str]:
    return list(dict.fromkeys(x.get("sitting", UNRECORDED) for x in sessions))


def _entry(plan: dict, spec: bp.RunSpec, run: dict, status: str, launches: dict, sittings: dict,
           machine: dict | None) -> dict:
    """What :func:`bench.time_to_target.measure_row` takes for one row, with its sessions,
    sittings, load average, link rate, learning rate and the limit it is divided by."""
    sessions = launches.get(f"{spec.link}/{spec.id}", [])
    limit_sessions = launches.get(f"{spec.link}/{LIMIT_ID}", [])
    limit = read_run(os.path.join(plan["work"], spec.link, LIMIT_ID)) or {}
    own = _sittings_of(sessions)
    links = (sittings.get(own[-1]) or {}).get("links") if own else None
    if links is None and own in ([], [UNRECORDED]):
        links = (machine or {}).get("links")  # sessions of an older version: the links of this report's machine
    rate = ((links or {}).get(spec.link) or {}).get("achieved_bits_per_s")
    return {"run": spec.id, "link": spec.link, "path": run, "limit_tokens_per_s": limit.get("tokens_per_s"),
            "learning_rate": inner_lr(spec), "status": status,
            "loadavg": {"start": sessions[0].get("loadavg_start"), "end": sessions[-1].get("loadavg_end")}
            if sessions else None,
            "link_rate_bits_per_s": rate,
            "limit": {"run": LIMIT_ID, "tokens_per_s": limit.get("tokens_per_s"),
                      "sittings": _sittings_of(limit_sessions)},
            "sessions": [{k: x.get(k, UNRECORDED if k == "sitting" else None) for k in ("sitting", "started", "ended")}
                         for x in sessions],
            "sittings": own}


def report(plan: dict, machine: dict | None = None) -> dict:
    """time_to_target.json, curves.csv, the plot, table.md and command.txt from whatever has run."""
    grid = grid_dir(plan["grid"])
    target_of = plan.get("target_of", "fsdp")  # plans of older versions: FSDP at lr 3e-4
    conv = from_convergence(grid, target_of)
    launches = _read_json(os.path.join(plan["work"], "launches.json"), {})
    sittings = _read_json(os.path.join(plan["work"], SITTINGS), {})
    entries, status, runs = [], {}, {}
    for spec in bp.runs_of(plan):
        if spec.id == LIMIT_ID:
            continue
        run = _run_dict(_dir(plan, spec))
        status[(spec.id, spec.link)] = "finished" if run and "stopped" not in run else (
            f"stopped: {run['stopped']}" if run else "not run yet")
        if run is not None:
            runs[(spec.id, spec.link)] = run
            entries.append(_entry(plan, spec, run, status[(spec.id, spec.link)], launches, sittings, machine))
    os.makedirs(plan["results"], exist_ok=True)
    out = write_time_to_target(plan["results"], entries, conv["seeds"], conv["half_budget_loss"], target_of,
                               plan.get("targets", FIXED_TARGETS))
    _extrapolate_stopped(runs, grid, out)
    used = sorted({x for r in out["rows"] for x in r["sittings"] + r["limit"]["sittings"]})
    out["sittings"] = {x: sittings.get(x, {}) for x in used}
    out["one_sitting"] = len(used) == 1 and used[0] != UNRECORDED
    out["machine"] = machine  # CPUs, versions, the TCP rate measured on each emulated link
    with open(os.path.join(plan["results"], "time_to_target.json"), "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
    _write_table(plan, out, status, machine)
    with open(os.path.join(plan["results"], "command.txt"), "w", encoding="utf-8") as fh:
        fh.write(f"sudo {plan['command']}\n")
    return out


EXTRAPOLATION = (
    "not measured: the wall clock at the stop plus the tokens the grid's loopback run of the same row still "
    "needed to the target, at this row's own measured training tokens/s (evaluations and checkpoints after the "
    "stop not counted, so it errs short); a row's losses on the link equal its loopback losses (same flags, data "
    "and seed)")


def _extrapolate_stopped(runs: dict, grid: str, out: dict) -> None:
    """For each stopped row: ``to_target_lower_bound_s`` (the wall clock at the stop, for each
    target not reached by then: a measured lower bound), ``extrapolated_to_target`` (seconds,
    labelled: :data:`EXTRAPOLATION`; the measured figure where the stop came later), and
    ``stopped_at``: tokens, step and training tokens/s reached. ``runs``: {(row id, link):
    :func:`_run_dict`}."""
    for row in out["rows"]:
        if not str(row.get("status", "")).startswith("stopped"):
            continue
        row["to_target_lower_bound_s"] = {k: row["wall_s_total"] if v is None else None
                                          for k, v in row["to_target"].items()}
        train = [r for r in runs[(row["run"], row["link"])]["records"] if "train/loss" in r and r.get("time_s")]
        if not train:
            continue
        last = train[-1]
        rate = last["tokens"] / last["time_s"]
        row["stopped_at"] = {"step": last["step"], "tokens": last["tokens"], "train_tokens_per_s": rate}
        curve, _ = grid_curve(grid, row["run"])
        need = {k: tokens_to_loss(curve, t) for k, t in out["targets"].items()}
        row["extrapolated_to_target"] = {
            k: (row["to_target"].get(k) if row["to_target"].get(k) is not None else
                None if need.get(k) is None else row["wall_s_total"] + max(0.0, need[k] - last["tokens"]) / rate)
            for k in row["to_target"]}
        row["extrapolation"] = EXTRAPOLATION


def _min(s: float | None) -> str:
    return "-" if s is None else f"{s / 60:.1f}"


def _load(x: list | None) -> str:
    return "-" if not x else f"{x[0]:.2f}"


def _target_cell(r: dict, k: str) -> str:
    """Measured minutes; a stopped row's unreached target as ">= minutes at the stop (stopped)"."""
    if r["to_target"].get(k) is None and (r.get("to_target_lower_bound_s") or {}).get(k) is not None:
        return f">= {_min(r['to_target_lower_bound_s'][k])} (stopped)"
    return _min(r["to_target"].get(k))


def sitting_text(out: dict, labels: dict[str, str]) -> str:
    """Whether every row and its limit were measured in one sitting; else which rows share which."""
    if out["one_sitting"]:
        (sid, info), = out["sittings"].items()
        return (f"**One sitting**: every row below and its limit were measured in sitting {labels[sid]} (`{sid}`, "
                f"{info.get('started', '?')} to {info.get('ended', 'running')}).")
    members: dict[str, list[str]] = {}
    for r in out["rows"]:
        for sid in r["sittings"]:
            members.setdefault(sid, []).append(f"{r['link']}/{r['run']}")
        for sid in r["limit"]["sittings"]:
            members.setdefault(sid, []).append(f"{r['link']}/{LIMIT_ID}")
    return ("**Not one sitting**: rows measured in different sittings (invocations) are not on an equal footing; "
            "rows that share a sitting: " + "; ".join(
                f"{labels[sid]}: {', '.join(dict.fromkeys(m))}" for sid, m in sorted(members.items())) + ".")


def _write_table(plan: dict, out: dict, status: dict, machine: dict | None) -> None:
    keys = list(out["targets"])
    labels = {sid: (UNRECORDED if sid == UNRECORDED else f"S{i}") for i, sid in enumerate(sorted(out["sittings"]), 1)}
    rows = []
    for r in out["rows"]:
        lim = r["limit"]["sittings"]
        of_limit = "-" if r["of_limit"] is None else f"{r['of_limit']:.2f}" + (
            "" if lim == r["sittings"] and len(lim) == 1 and lim[0] != UNRECORDED
            else f" (limit: {', '.join(labels[x] for x in lim) or '-'})")
        load = r.get("loadavg") or {}
        st = r.get("step_s") or {}
        rate = r.get("link_rate_bits_per_s")
        rows.append([r["link"], r["run"], f"{r['learning_rate']:.0e}".replace("e-0", "e-"), r["status"],
                     ", ".join(labels[x] for x in r["sittings"]) or "-",
                     f"{_load(load.get('start'))} / {_load(load.get('end'))}",
                     "-" if rate is None else f"{rate / 1e6:.2f}", of_limit,
                     "-" if r["final_eval_loss"] is None else f"{r['final_eval_loss']:.4f}", _min(r["wall_s_total"]),
                     "-" if st.get("median") is None else f"{st['median']:.3f}" + (
                         f" ({st['p10']:.3f}-{st['p90']:.3f})" if st.get("p10") is not None else ""),
                     *[_target_cell(r, k) for k in keys]])
    missing = [f"{link}/{run}" for (run, link), s in status.items() if s == "not run yet"]
    half = out["targets"].get("half_budget")
    heads = ["link", "run", "lr", "status", "sitting", "load avg 1 min (start / end)", "link Mbit/s (measured)",
             "of limit", "final eval loss", "wall min", "s/step median (p10-p90)",
             *[f"min to {out['target_of']}'s half-budget loss ({half:.4f})" if k == "half_budget" else f"min to {k}"
               for k in keys]]
    caps = ", ".join(f"{link} {cap_s(plan, link) / 60:g}" for link in plan["links"])
    seeds = out.get("seeds") or {}
    lines = ["# Time to target on emulated slow links, measured", "",
             f"Command: `sudo {plan['command']}`  ",
             f"Machine: {(machine or {}).get('cpu_model', '?')}, {(machine or {}).get('nproc', '?')} CPUs (details: "
             "time_to_target.json `machine`).", "",
             sitting_text(out, labels), "",
             f"Rows of the convergence grid `{plan['grid']}` (same flags, data, evaluations every "
             f"{plan['eval_every']} steps on {plan['eval_blocks']} blocks, {plan['steps']} steps), trained across 2 "
             "emulated nodes (one federation group per node; FSDP spans both), every node's link shaped with tc tbf. "
             "Minutes are the run's wall clock (start-up, training, evaluations and checkpoints; summed over sessions "
             "of a resumed run) at the first evaluation at or below each target, linear in eval loss between "
             f"evaluations; '-' = not reached. FSDP rows stop at a wall-clock cap (minutes: {caps}); a target a "
             "stopped row had not reached is given as **>= its wall clock at the stop**, a measured lower bound. "
             f"`of limit` = training tokens/s over the no-sync limit's (FL+FSDP, H = 10^6, {LIMIT_STEPS} steps) on "
             "the same link, marked with the limit's sitting where it is not the row's own. Sitting: the invocation "
             "that measured the row (table below); load average at the start of the row's first session and the end "
             "of its last; link: a single TCP stream node 0 -> node 1 at the start of that sitting. s/step: training "
             "seconds per optimizer step between logged records. Half-budget loss: the grid row "
             f"`{out['target_of']}`'s eval loss at half its tokens"
             + (f"; the grid's pooled seed sd {seeds['pooled_sd']:.4f} nats (a difference of final losses counts "
                f"above {seeds['threshold']:.4f})" if seeds.get("pooled_sd") else "") + ".", "",
             _md(rows, heads), ""]
    stopped = [r for r in out["rows"] if "extrapolated_to_target" in r]
    if stopped:
        lines += ["Stopped rows: where they stood at the stop, and the minutes to each target **extrapolated** ("
                  + EXTRAPOLATION + ").", "",
                  _md([[r["link"], r["run"], f"{r['stopped_at']['step']}", f"{r['stopped_at']['tokens']:,}",
                        f"{r['stopped_at']['train_tokens_per_s']:.0f}",
                        *[_min(r["extrapolated_to_target"].get(k)) + " (extrapolated)"
                          if r["to_target"].get(k) is None and r["extrapolated_to_target"].get(k) is not None
                          else _min(r["extrapolated_to_target"].get(k)) for k in keys]] for r in stopped],
                      ["link", "run", "step at stop", "tokens at stop", "training tokens/s",
                       *[h for h in heads[11:]]]), ""]
    srows = [[labels[sid], f"`{sid}`", info.get("started", "-"), info.get("ended", "-"),
              f"{_load(info.get('loadavg_start'))} / {_load(info.get('loadavg_end'))}",
              ", ".join(f"{link} {m['achieved_bits_per_s'] / 1e6:.2f}" for link, m in (info.get("links") or {}).items()
                        if "achieved_bits_per_s" in m) or "-"] for sid, info in sorted(out["sittings"].items())]
    if srows:
        lines += ["Sittings:", "", _md(srows, ["sitting", "id", "started", "ended", "load avg 1 min (start / end)",
                                               "links measured (Mbit/s)"]), ""]
    if missing:
        lines.append(f"Not run yet: {', '.join(missing)}. Continue with `sudo {plan['command']}`.")
    lines.append("Plot: `eval_loss_vs_seconds.png`. Every evaluation of every row: `curves.csv`. Figures for programs: "
                 "`time_to_target.json`.")
    with open(os.path.join(plan["results"], "table.md"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")


def check_committed(plan: dict) -> None:
    """TTTError naming them when ``plan["results"]``'s time_to_target.json holds rows this
    work folder has no run of (a fresh checkout, another machine): the report is rebuilt from
    the work folder alone and would drop them. Nothing is run or written before."""
    saved = _read_json(os.path.join(plan["results"], "time_to_target.json"), None) or {}
    lost = [f"{r['link']}/{r['run']}" for r in saved.get("rows") or []
            if not os.path.isdir(os.path.join(plan["work"], r["link"], r["run"]))]
    if lost:
        raise TTTError(f"{plan['results']} holds rows with no run under {plan['work']} ({', '.join(lost)}); its "
                       f"report would lose them: give this measurement another --name")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan = make_plan(args)
        check_committed(plan)
    except TTTError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.report_only:
        saved = _read_json(os.path.join(plan["work"], "plan.json"), None)
        report(saved or plan, (_read_json(os.path.join(plan["results"], "time_to_target.json"), {}) or {}).get("machine"))
        print(f"[ttt] results: {plan['results']}")
        return 0
    ok, reason = netemu.check_privileges()
    if not ok:
        print(f"error: the runs train across emulated nodes (network namespaces + tc) and {reason}; run as root "
              f"(sudo {sys.executable} -m bench.ttt_bench ...)", file=sys.stderr)
        return 1
    for key in [k for k in os.environ if k.startswith("FL_ACCEL_")]:
        del os.environ[key]
    os.makedirs(plan["work"], exist_ok=True)
    os.makedirs(plan["cache_dir"], exist_ok=True)
    _write_json(os.path.join(plan["work"], "plan.json"), plan)
    machine = machine_info()
    machine["loadavg_start"] = loadavg()
    sitting = _now()
    _save_sitting(plan, sitting, started=sitting, command=plan["command"], loadavg_start=_loadavg(), links={})
    print(f"[ttt] {plan['name']}: rows {', '.join(plan['rows'])} at {', '.join(plan['links'])}\n[ttt] work: "
          f"{plan['work']}\n[ttt] to continue after an interruption: sudo {plan['command']}", flush=True)
    failed = []
    port = 29600
    netemu._install_signal_handlers()  # SIGTERM/SIGHUP unwind the emulator: no namespace or rank left behind
    try:
        for link in plan["links"]:
            with netemu.Emulator(2, link) as emu:
                machine.setdefault("links", {})[link] = measure_link(emu, 2.0)
                _save_sitting(plan, sitting, links=dict(machine["links"]))
                for spec in (s for s in bp.runs_of(plan) if s.link == link):
                    port += 1
                    try:
                        run_row(plan, emu, spec, port, sitting)
                    except TTTError as exc:
                        failed.append(str(exc))
                        print(f"[ttt] {exc}", flush=True)
                    report(plan, machine)
    except KeyboardInterrupt:
        _save_sitting(plan, sitting, ended=_now(), loadavg_end=_loadavg(), interrupted=True)
        report(plan, machine)
        print(f"[ttt] interrupted; the emulator is down. Continue with: sudo {plan['command']}", file=sys.stderr)
        return 130
    machine["loadavg_end"] = loadavg()
    _save_sitting(plan, sitting, ended=_now(), loadavg_end=_loadavg())
    report(plan, machine)
    print(f"[ttt] results: {plan['results']}", flush=True)
    for f in failed:
        print(f"error: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
