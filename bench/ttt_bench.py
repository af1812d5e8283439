"""Time to a target loss, measured end to end on an emulated slow link (issue 28 item 6).

The convergence suite (``bench.run_bench --suite convergence``) trains its rows on loopback:
loss does not depend on the link, so it gives tokens to each target. This bench trains
some of those same rows, with the same flags, evaluations and checkpoints, across two
emulated nodes (``scripts/netemu.py``: one federation group per node, the link shaped with
tc at ``--links``), so that the seconds to each target are *measured* on the link. Each link
also gets a short no-sync limit run (FL+FSDP with H = 10^6 and no evaluations) for
``of_limit``, in the same sitting.

Rows that would take too long on a slow link (FSDP at 10 Mbit/s needs hours) stop when their
run's wall clock passes ``--cap_minutes`` (default 90): their checkpoints and evaluations
are every ``--checkpoint_every`` steps, the run is killed at the cap, and the row says
``stopped`` with the reason. Every row says whether it finished.

Outputs in ``bench/results/<name>/``: ``time_to_target.json`` (schema in
:mod:`bench.time_to_target`; the seed band and FSDP's half-budget loss come from the
committed convergence grid ``--grid``; ``machine`` adds the CPUs, versions and each link's
measured TCP rate), ``eval_loss_vs_seconds.png`` (eval loss against the run's wall-clock
seconds, one line per run, a panel per link), ``table.md``, ``command.txt``. Run folders go to ``bench/work/<name>/<link>/<row>``.

Resumable: rerun the same command. A finished or stopped row is not run again; an
interrupted one resumes from its last checkpoint (the recipe sums wall and training
seconds over sessions, without the steps lost since that checkpoint). Needs root::

    sudo python -m bench.ttt_bench --name <date>-ttt --links 10mbit
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
from bench.analysis import read_run
from bench.launch import _read_json, _write_json, measure_link
from bench.report import _md, loadavg, machine_info
from bench.time_to_target import from_convergence, write_time_to_target
from recipes.host_load import HostLoad

DEFAULT_ROWS = ("fl_fsdp-h8-p2-tau2-int8-ef-nesterov", "fl_fsdp-h8-p2-tau2-sparse-ef-senders",
                "fl_fsdp-h8-nesterov", "fsdp")
"""The two fastest settings of the grid that keep FSDP's loss best (int8 + EF and sparse + EF,
both P=2 tau=2), blocking fp32 with nesterov, and FSDP; fastest first, so a short sitting
finishes whole rows."""
CAPPED = ("fsdp", "fsdp-lr1e-3")
"""Rows that stop at ``--cap_minutes`` (FSDP sends every gradient across the link)."""
LIMIT_ID = "fl_fsdp-limit"
LIMIT_STEPS = 64
STOPPED = "stopped.json"


class TTTError(RuntimeError):
    """A bad option or a failed launch (the message says which)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.ttt_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default=None, help="results folder name (default: <today>-ttt)")
    p.add_argument("--links", default="10mbit", help="tc rates, comma-separated, e.g. 10mbit,100mbit")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                   help="convergence-suite row ids, comma-separated, run in this order at every link; "
                        "LINK:ID runs a row at that link only (e.g. 10mbit:fl_fsdp-h8-nesterov)")
    p.add_argument("--cap_minutes", type=float, default=90.0,
                   help=f"wall-clock cap of the rows {', '.join(CAPPED)} (minutes; they stop there)")
    p.add_argument("--grid", default="2026-12-03-grid",
                   help="convergence results folder (a name under bench/results, or a path) for the seed band and FSDP's "
                        "half-budget loss")
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
    if args.cap_minutes <= 0:
        raise TTTError(f"--cap_minutes must be > 0, got {args.cap_minutes}")
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
    plan.update(name=name, links=links, rows=rows, cap_s=60.0 * args.cap_minutes, grid=args.grid,
                work=os.path.join(os.path.abspath(args.work_root), name),
                results=os.path.join(os.path.abspath(args.results_root), name),
                runs=[dataclasses.asdict(s) for s in specs],
                command=" ".join(shlex.quote(a) for a in ["python", "-m", "bench.ttt_bench"] + sys.argv[1:]))
    return plan


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


def run_row(plan: dict, emu, spec: bp.RunSpec, port: int) -> str:
    """Launch (or resume) one row on ``emu``; returns "finished", "stopped" or "skipped".

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
    capped = spec.id in CAPPED
    before = _wall_so_far(out_dir)
    if capped:
        timeout = max(60.0, plan["cap_s"] - before)
    argv = emu.torchrun_argv(0, args, nproc_per_node=spec.nproc_per_node, master_port=port)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    print(f"[ttt] {spec.link}/{spec.id} [{spec.label}]" + (f", stops after {timeout:.0f} s" if capped else "")
          + f": {' '.join(map(shlex.quote, argv))}", flush=True)
    load = HostLoad().start()
    with open(os.path.join(out_dir, "launch.log"), "a", encoding="utf-8") as log:
        log.write(f"=== session {started} ===\n")
        log.flush()
        rc = emu.run_torchrun(args, nproc_per_node=spec.nproc_per_node, master_port=port, env=bp.run_env(plan),
                              timeout=timeout, stdout=log, stderr=subprocess.STDOUT)
    load.stop()
    records_path = os.path.join(plan["work"], "launches.json")
    records = _read_json(records_path, {})
    records.setdefault(f"{spec.link}/{spec.id}", []).append({"started": started, "rc": rc, "host": load.as_dict()})
    _write_json(records_path, records)
    bg = load.background_cpu_share
    print(f"[ttt] {spec.link}/{spec.id}: exit {rc} after {load.wall_s:.0f} s"
          + (f"; other processes used {100 * bg:.0f}% of the CPUs" if bg is not None else ""), flush=True)
    if rc == 124 and capped:
        _write_json(os.path.join(out_dir, STOPPED), {"reason": f"wall-clock cap of {plan['cap_s'] / 60:g} min",
                                                     "wall_s": before + load.wall_s})
        return "stopped"
    if rc != 0 or not os.path.isfile(os.path.join(out_dir, "all_results.json")):
        raise TTTError(f"{spec.link}/{spec.id} failed (exit {rc}); log: {os.path.join(out_dir, 'launch.log')}")
    return "finished"


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


def report(plan: dict, machine: dict | None = None) -> dict:
    """time_to_target.json, the plot, table.md and command.txt from whatever has run."""
    grid = plan["grid"] if os.path.isdir(plan["grid"]) else os.path.join(bp.REPO, "bench", "results", plan["grid"])
    band, half = from_convergence(grid)
    entries, status, runs = [], {}, {}
    for spec in bp.runs_of(plan):
        if spec.id == LIMIT_ID:
            continue
        run = _run_dict(_dir(plan, spec))
        limit = read_run(os.path.join(plan["work"], spec.link, LIMIT_ID))
        status[(spec.id, spec.link)] = "finished" if run and "stopped" not in run else (
            f"stopped: {run['stopped']}" if run else "not run yet")
        if run is not None:
            runs[(spec.id, spec.link)] = run
            entries.append({"run": spec.id, "link": spec.link, "path": run,
                            "limit_tokens_per_s": (limit or {}).get("tokens_per_s")})
    os.makedirs(plan["results"], exist_ok=True)
    out = write_time_to_target(plan["results"], entries, band, half)
    for row in out["rows"]:
        row["status"] = status[(row["run"], row["link"])]
    _extrapolate_stopped(runs, grid, out)
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
    """For each stopped row, ``extrapolated_to_target`` (seconds, labelled: :data:`EXTRAPOLATION`)
    beside its measured ``to_target`` (null where the stop came first), and ``stopped_at``:
    tokens, step and training tokens/s reached. ``runs``: {(row id, link): :func:`_run_dict`}."""
    try:
        with open(os.path.join(grid, "bench.json"), encoding="utf-8") as fh:
            grid_rows = json.load(fh)["results"]["rows"]
    except (OSError, KeyError, ValueError):
        grid_rows = {}
    for row in out["rows"]:
        if not str(row.get("status", "")).startswith("stopped"):
            continue
        train = [r for r in runs[(row["run"], row["link"])]["records"] if "train/loss" in r and r.get("time_s")]
        if not train:
            continue
        last = train[-1]
        rate = last["tokens"] / last["time_s"]
        row["stopped_at"] = {"step": last["step"], "tokens": last["tokens"], "train_tokens_per_s": rate}
        need = (grid_rows.get(row["run"]) or {}).get("tokens_to") or {}
        row["extrapolated_to_target"] = {
            k: (row["to_target"].get(k) if row["to_target"].get(k) is not None else
                None if need.get(k) is None else row["wall_s_total"] + max(0.0, need[k] - last["tokens"]) / rate)
            for k in row["to_target"]}
        row["extrapolation"] = EXTRAPOLATION


def _min(s: float | None) -> str:
    return "-" if s is None else f"{s / 60:.1f}"


def _write_table(plan: dict, out: dict, status: dict, machine: dict | None) -> None:
    keys = list(out["targets"])
    rows = [[r["link"], r["run"], r["status"], "-" if r["of_limit"] is None else f"{r['of_limit']:.2f}",
             "-" if r["final_eval_loss"] is None else f"{r['final_eval_loss']:.4f}", _min(r["wall_s_total"]),
             *[_min(r["to_target"].get(k)) for k in keys]] for r in out["rows"]]
    missing = [f"{link}/{run}" for (run, link), s in status.items() if s == "not run yet"]
    heads = ["link", "run", "status", "of limit", "final eval loss", "wall min",
             *[f"min to FSDP's half-budget loss ({out['targets'][k]:.4f})" if k == "fsdp_half_budget" else f"min to {k}" for k in keys]]
    lines = ["# Time to target on an emulated slow link, measured", "",
             f"Command: `sudo {plan['command']}`  ",
             f"Machine: {(machine or {}).get('cpu_model', '?')}, {(machine or {}).get('nproc', '?')} CPUs; measured "
             "single TCP stream node 0 -> node 1: " + (", ".join(
                 f"{link}: {m['achieved_bits_per_s'] / 1e6:.1f} Mbit/s" if "achieved_bits_per_s" in m else f"{link}: -"
                 for link, m in ((machine or {}).get("links") or {}).items()) or "-")
             + " (details: time_to_target.json `machine`).", "",
             f"Rows of the convergence grid `{plan['grid']}` (same flags, data, evaluations every "
             f"{plan['eval_every']} steps on {plan['eval_blocks']} blocks, {plan['steps']} steps), trained across 2 "
             "emulated nodes (one federation group per node; FSDP spans both), every node's link shaped with tc tbf. "
             "Minutes are the run's wall clock (start-up, training, evaluations and checkpoints; summed over sessions "
             "of a resumed run) at the first evaluation at or below each target, linear in eval loss between "
             f"evaluations; '-' = not reached. Rows {', '.join(CAPPED)} stop at a wall-clock cap ({plan['cap_s'] / 60:g} "
             "min in this command; the status gives each stopped row's own). `of limit` = training tokens/s over the no-sync limit's (FL+FSDP, H = 10^6, "
             f"{LIMIT_STEPS} steps) on the same link in the same sitting. Seed band {out['seed_band']:.4f} nats and "
             f"FSDP's half-budget loss {out['fsdp_half_budget_loss']:.4f} from the grid.", "",
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
                       *[h for h in heads[6:]]]), ""]
    if missing:
        lines.append(f"Not run yet: {', '.join(missing)}. Continue with `sudo {plan['command']}`.")
    lines.append("Plot: `eval_loss_vs_seconds.png`. Figures for programs: `time_to_target.json`.")
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
    print(f"[ttt] {plan['name']}: rows {', '.join(plan['rows'])} at {', '.join(plan['links'])}\n[ttt] work: "
          f"{plan['work']}\n[ttt] to continue after an interruption: sudo {plan['command']}", flush=True)
    failed = []
    port = 29600
    netemu._install_signal_handlers()  # SIGTERM/SIGHUP unwind the emulator: no namespace or rank left behind
    try:
        for link in plan["links"]:
            with netemu.Emulator(2, link) as emu:
                machine.setdefault("links", {})[link] = measure_link(emu, 2.0)
                for spec in (s for s in bp.runs_of(plan) if s.link == link):
                    port += 1
                    try:
                        run_row(plan, emu, spec, port)
                    except TTTError as exc:
                        failed.append(str(exc))
                        print(f"[ttt] {exc}", flush=True)
                    report(plan, machine)
    except KeyboardInterrupt:
        report(plan, machine)
        print(f"[ttt] interrupted; the emulator is down. Continue with: sudo {plan['command']}", file=sys.stderr)
        return 130
    machine["loadavg_end"] = loadavg()
    report(plan, machine)
    print(f"[ttt] results: {plan['results']}", flush=True)
    for f in failed:
        print(f"error: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
