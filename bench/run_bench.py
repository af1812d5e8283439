"""Side-by-side benchmark of FSDP, FL+FSDP, HSDP, FL+HSDP, streaming and compressed sync
under emulated inter-node links (2 nodes; scripts/netemu.py).

    python -m bench.run_bench                       # as root: every suite (bench/README.md)
    python -m bench.run_bench --suite streaming     # one suite (baselines, streaming, hsdp_r2, overhead)
    python -m bench.run_bench --suite convergence   # quality: no root, hours, resumable (rerun to continue)
    python -m bench.run_bench --suite paper-regime  # quality: the paper's regime on 8 processes
    python -m bench.run_bench --smoke               # as root: every code path, a few steps, one rate
    python -m bench.run_bench --dry-run             # the plan and every command; needs no root
    python -m bench.run_bench --report-only --name NAME   # rebuild the report, run nothing

Run from the repository root (or after ``pip install -e .``). Every training run is
``recipes/pretrain.py`` (model ``tiny``, embedded Shakespeare corpus, fp32) with one
torchrun per emulated node; bench/plan.py lists the suites and rows, bench/launch.py
runs them, bench/analysis.py computes the figures, bench/report.py writes them.

Results go to ``bench/results/<name>/`` (table.md, plots, curves.csv with every run's
curves, machine.json, command.txt, a compact bench.json with every run's whole-run figures:
:mod:`bench.compact`); run folders, logs and offline W&B runs to ``bench/work/<name>/``
(gitignored). ``--report-only`` reads ``bench/work/<name>`` if it exists, else the committed
``bench/results/<name>/`` (bench.json and curves.csv; a folder of an older version with a
``raw/`` folder of run files is read from there and rewritten in the compact form). The
emulator is removed on exit, also on Ctrl-C or SIGTERM. Needs root (network namespaces)
unless ``--dry-run``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shlex
import signal
import sys

from scripts import netemu

from bench.analysis import seed_config
from bench.compact import CompactRuns, has_compact
from bench.launch import LAUNCHES_FILE, run_all, run_local
from bench.plan import LOCAL_SUITES, BenchError, build_parser, local_runs, make_plan, parse_sources, runs_of
from bench.report import loadavg, machine_info, report, report_local


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.report_only:
            return report_only(args, argv)
        plan = make_plan(args)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if plan["suites"][0] in LOCAL_SUITES:
        return main_local(plan, args.dry_run)
    if not args.dry_run:
        ok, reason = netemu.check_privileges()
        if not ok:
            print(f"error: the benchmark runs every job inside emulated nodes (network namespaces + tc) and "
                  f"{reason}. Run it as root, e.g. `sudo {sys.executable} -m bench.run_bench ...`; `--dry-run` "
                  f"shows the plan without root.", file=sys.stderr)
            return 1
    for key in [k for k in os.environ if k.startswith("FL_ACCEL_")]:
        print(f"[bench] ignoring {key} from the environment: every setting is on the command line", file=sys.stderr)
        del os.environ[key]  # the emulator starts jobs with os.environ underneath their own environment
    runs = runs_of(plan)
    count = {ph: sum(r.phase == ph for r in runs) for ph in ("calibration", "overhead", "main")}
    print(f"[bench] {plan['name']}{' (SMOKE)' if plan['smoke'] else ''}: suites {', '.join(plan['suites'])}; "
          f"{len(runs)} runs ({count['calibration']} calibration, {count['overhead']} overhead, {count['main']} main "
          f"at {', '.join(dict.fromkeys(r.link for r in runs if r.phase == 'main')) or '-'}); {plan['steps']} steps, "
          f"H={plan['sync_every']}\n[bench] work: {plan['work']}\n[bench] results: {plan['results']}", flush=True)
    if not args.dry_run:
        os.makedirs(plan["work"], exist_ok=True)
        os.makedirs(plan["cache_dir"], exist_ok=True)
        with open(os.path.join(plan["work"], "plan.json"), "w", encoding="utf-8") as fh:
            json.dump(plan, fh, indent=1)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": plan["command"]}
    machine = machine_info()
    machine["loadavg_start"] = loadavg()
    _install_signal_handlers()
    try:
        meta.update(run_all(plan, args.dry_run))
    except KeyboardInterrupt:
        print("[bench] interrupted; emulator torn down", file=sys.stderr)
        return 130
    except (BenchError, netemu.NetEmuError, PermissionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.dry_run:
        return 0
    machine["loadavg_end"] = loadavg()
    meta["machine"] = machine
    with open(os.path.join(plan["work"], "meta.json"), "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=1)
    report(plan, meta, plan["work"])
    return 0


def main_local(plan: dict, dry: bool) -> int:
    """A quality suite (convergence, paper_regime): loopback launches, no root. Rerunning the
    same command (same ``--name``) continues it: finished rows are skipped, the others
    resume from their last checkpoint. The report is (re)written from whatever has
    finished, also when a row failed."""
    runs = runs_of(plan)
    resume = plan["command"] if "--name" in plan["command"] else f"{plan['command']} --name {plan['name']}"
    print(f"[bench] {plan['name']}{' (SMOKE)' if plan['smoke'] else ''}: suite {plan['suites'][0]}; {len(runs)} runs "
          f"of {plan['steps'] or 'one epoch of'} steps on {runs[0].world} processes (loopback)"
          + (f"; only {', '.join(plan['only'])}" if plan.get("only") else "")
          + f"\n[bench] work: {plan['work']}\n[bench] results: {plan['results']}\n[bench] to continue after an "
          f"interruption: {resume}", flush=True)
    if not dry:
        os.makedirs(plan["work"], exist_ok=True)
        os.makedirs(plan["cache_dir"], exist_ok=True)
        with open(os.path.join(plan["work"], "plan.json"), "w", encoding="utf-8") as fh:
            json.dump(plan, fh, indent=1)
    for key in [k for k in os.environ if k.startswith("FL_ACCEL_")]:
        print(f"[bench] ignoring {key} from the environment: every setting is on the command line", file=sys.stderr)
        del os.environ[key]
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": plan["command"],
            "resume_command": resume}
    machine = machine_info()
    machine["loadavg_start"] = loadavg()
    _install_signal_handlers()
    try:
        meta.update(run_local(plan, dry))
    except KeyboardInterrupt:
        print(f"[bench] interrupted; continue with: {resume}", file=sys.stderr)
        return 130
    if dry:
        return 0
    machine["loadavg_end"] = loadavg()
    meta["machine"] = machine
    with open(os.path.join(plan["work"], "meta.json"), "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=1)
    report_local(plan, meta, _local_root(plan, meta, plan["work"]))
    if meta["failed"]:
        print(f"error: {len(meta['failed'])} run(s) failed: {', '.join(meta['failed'])} (their launch.log under "
              f"{plan['work']}); rerun to continue them: {resume}", file=sys.stderr)
        return 1
    return 0


def _local_root(plan: dict, meta: dict, work: str):
    """What a quality suite's report reads: the work folder, laid over the committed results
    folder's runs when it has them (:class:`CompactRuns` ``work``), so rows finished on
    another checkout stay in the report; their launch records join ``meta["launches"]``."""
    if not has_compact(plan["results"]):
        return work
    root = CompactRuns.load(plan["results"], work=work)
    with open(os.path.join(plan["results"], "bench.json"), encoding="utf-8") as fh:
        saved = json.load(fh).get("launches") or {}
    meta["launches"] = {**saved, **(meta.get("launches") or {})}
    return root


def report_only(args, argv: list[str] | None) -> int:
    """Rebuild the results folder from bench/work/<name>, or from the committed
    bench/results/<name>/ (compact: bench.json + curves.csv; or an older folder's raw/).

    Raises:
        BenchError: no --name, or neither folder holds a plan.
    """
    name = args.name or ("smoke" if args.smoke else None)
    if not name:
        raise BenchError("--report-only needs --name (or --smoke)")
    work = os.path.join(os.path.abspath(args.work_root), name)
    results = os.path.join(os.path.abspath(args.results_root), name)
    meta: dict = {}
    saved_sources = None
    if os.path.isfile(os.path.join(work, "plan.json")):
        root = work
        with open(os.path.join(work, "plan.json"), encoding="utf-8") as fh:
            plan = json.load(fh)
        if os.path.isfile(os.path.join(work, "meta.json")):
            with open(os.path.join(work, "meta.json"), encoding="utf-8") as fh:
                meta = json.load(fh)
    elif os.path.isfile(os.path.join(results, "bench.json")):
        with open(os.path.join(results, "bench.json"), encoding="utf-8") as fh:
            saved = json.load(fh)
        if saved.get("runs"):
            root = CompactRuns.load(results)
        elif os.path.isdir(os.path.join(results, "raw")):
            root = os.path.join(results, "raw")
        else:
            raise BenchError(f"--report-only: {results}/bench.json has no runs (and there is no raw/ folder)")
        plan = saved["plan"]
        saved_sources = (saved.get("results") or {}).get("throughput_sources")
        meta = {k: saved[k] for k in ("links", "launches", "timings", "cpu", "date") if saved.get(k) is not None}
        meta["resume_command"] = None
        if os.path.isfile(os.path.join(results, "machine.json")):
            with open(os.path.join(results, "machine.json"), encoding="utf-8") as fh:
                meta["machine"] = json.load(fh)
        meta["command"] = plan.get("command", "-")
    else:
        raise BenchError(f"--report-only: neither {work}/plan.json nor {results}/bench.json exists; "
                         f"run the benchmark first")
    plan.update(name=name, work=work, results=results)
    plan.setdefault("cache_dir", os.path.join(os.path.abspath(args.work_root), "cache"))
    if plan.get("suites", [None])[0] in LOCAL_SUITES:
        _add_rows_planned_since(plan)
        if args.throughput_sources is not None:
            plan["throughput_sources"] = parse_sources(args.throughput_sources)
        elif plan.get("throughput_sources") is None and saved_sources is not None:
            plan["throughput_sources"] = saved_sources  # a results folder written before the option existed
        if isinstance(root, str) and os.path.isfile(os.path.join(work, LAUNCHES_FILE)):
            with open(os.path.join(work, LAUNCHES_FILE), encoding="utf-8") as fh:  # newer than meta.json
                meta["launches"] = json.load(fh)
        if isinstance(root, str):  # a work folder: with the committed rows it does not hold
            root = _local_root(plan, meta, root)
        meta.setdefault("command", plan.get("command", "-"))
        meta.setdefault("resume_command", plan["command"] if "--name" in plan.get("command", "")
                        else f"{plan.get('command')} --name {name}")
        meta["report_command"] = " ".join(shlex.quote(a) for a in ["python", "-m", "bench.run_bench"]
                                          + list(sys.argv[1:] if argv is None else argv))
        report_local(plan, meta, root, results_root=os.path.abspath(args.results_root))
        return 0
    if args.throughput_sources is not None:
        raise BenchError("--throughput-sources applies to the convergence suite")
    plan.setdefault("suites", ["baselines", "overhead"])
    meta["report_command"] = " ".join(shlex.quote(a) for a in ["python", "-m", "bench.run_bench"]
                                      + list(sys.argv[1:] if argv is None else argv))
    report(plan, meta, root, wandb_log=plan.get("report_to", "wandb") == "wandb")
    return 0


def _add_rows_planned_since(plan: dict) -> None:
    """Append to a saved quality-suite plan the further seeds of its configurations that
    bench/plan.py has planned since it was written (rows ``<id>-seed<k>``), so that the rebuilt
    report lists them as not finished and counts them in each configuration's seeds."""
    have = {r["id"] for r in plan.get("runs", [])}
    plan["runs"] = plan.get("runs", []) + [dataclasses.asdict(r) for r in local_runs(plan)
                                           if r.id not in have and seed_config(r.id, have) != r.id]


def _install_signal_handlers() -> None:
    def handler(signum, frame):  # unwinds the `with Emulator` blocks, which tear everything down
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
