"""Runs the plan's launches inside the network emulator (scripts/netemu.py).

Every launch is metered: wall seconds, CPU with :class:`recipes.host_load.HostLoad`
(this process and everything it started count as ours; the share of the CPUs other
processes used is the background load), and the bytes each node's NIC sent and received
(the emulator's veth counters). The records go to ``meta["launches"][<run path>]``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
from typing import Any

from recipes.host_load import HostLoad
from scripts import launch
from scripts import netemu

from bench.plan import NODES, BenchError, RunSpec, recipe_args, run_env, runs_of


class DryEmulator:
    """Stands in for :class:`netemu.Emulator` in ``--dry-run``: addresses only."""

    def __init__(self, nodes: int, rate: str | None):
        self.nodes, self.rate = nodes, rate

    def __enter__(self) -> "DryEmulator":
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False

    def address(self, k: int) -> str:
        return f"<node{k}>"


def _tail(path: str, n: int = 40) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = [ln for ln in fh.read().replace("\r", "\n").splitlines() if ln.strip()]
        return "\n".join(lines[-n:])
    except OSError:
        return ""


def _wire_delta(before: dict, after: dict) -> dict[str, dict[str, int]]:
    return {str(k): {key: after[k][key] - before[k][key] for key in ("tx_bytes", "rx_bytes")} for k in after}


class Runner:
    """Launches the plan's runs and records how each went (see the module docstring)."""

    def __init__(self, plan: dict, dry: bool = False):
        self.plan, self.dry = plan, dry
        self.port = 29400
        self.launches: dict[str, dict] = {}
        self.commands: list[str] = []

    def _next_port(self) -> int:
        self.port += 1
        return self.port

    def _show(self, label: str, argv: list[str]) -> None:
        line = f"[bench] {label}: {' '.join(shlex.quote(a) for a in argv)}"
        self.commands.append(line)
        print(line, flush=True)

    @staticmethod
    def _fresh(out_dir: str) -> None:
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.makedirs(out_dir)

    def torchrun(self, emu, spec: RunSpec) -> None:
        """One torchrun per emulated node: a ``spec.world``-process job over all nodes."""
        out_dir = os.path.join(self.plan["work"], spec.path)
        args = recipe_args(self.plan, spec, out_dir)
        port = self._next_port()
        node0 = launch.torchrun_argv(spec.nproc_per_node, args[0], *args[1:], port=port, master_addr=emu.address(0),
                                     nnodes=spec.nodes, node_rank=0)
        self._show(f"{spec.path} [{spec.label}; {spec.nodes} nodes x {spec.nproc_per_node}; link "
                   f"{spec.link or 'unshaped'}] node 0 of {spec.nodes}", node0)
        if self.dry:
            return
        self._fresh(out_dir)
        log_path = os.path.join(out_dir, "launch.log")
        before = emu.link_bytes()
        with HostLoad() as load, open(log_path, "w", encoding="utf-8") as log:
            rc = emu.run_torchrun(args, nproc_per_node=spec.nproc_per_node, master_port=port, env=run_env(self.plan),
                                  timeout=self.plan["run_timeout"], stdout=log, stderr=subprocess.STDOUT)
        self._record(spec.path, load, _wire_delta(before, emu.link_bytes()))
        if rc != 0 or not os.path.isfile(os.path.join(out_dir, "all_results.json")):
            raise self._fail(spec.path, rc, log_path)

    def concurrent_single_node_jobs(self, emu, label: str, specs: list[RunSpec]) -> None:
        """Spec k = a standalone torchrun inside node k, all started together (overhead phase)."""
        jobs = []
        for k, spec in enumerate(specs):
            out_dir = os.path.join(self.plan["work"], spec.path)
            args = recipe_args(self.plan, spec, out_dir)
            argv = launch.torchrun_argv(spec.nproc_per_node, args[0], *args[1:], port=self._next_port(),
                                        master_addr=emu.address(k))
            self._show(f"{spec.path} [{spec.label}; standalone job inside node {k}, concurrent]", argv)
            jobs.append((argv, out_dir))
        if self.dry:
            return
        procs, logs = [], []
        before = emu.link_bytes()
        load = HostLoad().start()
        try:
            for k, (argv, out_dir) in enumerate(jobs):
                self._fresh(out_dir)
                logs.append(open(os.path.join(out_dir, "launch.log"), "w", encoding="utf-8"))
                procs.append(emu.popen(k, argv, env=run_env(self.plan), stdout=logs[-1], stderr=subprocess.STDOUT))
            deadline = time.monotonic() + self.plan["run_timeout"]
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                launch.terminate(p)
            for log in logs:
                log.close()
        load.stop()
        self._record(label, load, _wire_delta(before, emu.link_bytes()))
        for k, (p, (_, out_dir)) in enumerate(zip(procs, jobs)):
            rc = 124 if p.returncode is None else launch.exit_code(p.returncode)
            if rc != 0 or not os.path.isfile(os.path.join(out_dir, "all_results.json")):
                raise self._fail(f"{label} (node {k})", rc, os.path.join(out_dir, "launch.log"))

    def _record(self, label: str, load: HostLoad, wire: dict) -> None:
        self.launches[label] = {"wall_s": load.wall_s, "host": load.as_dict(), "wire": wire}
        bg = load.background_cpu_share
        print(f"[bench] {label}: ended after {load.wall_s:.0f} s"
              + (f"; other processes used {100 * bg:.0f}% of the CPUs" if bg is not None else ""), flush=True)

    @staticmethod
    def _fail(label: str, rc: int, log_path: str) -> BenchError:
        why = "timed out" if rc == 124 else f"exit code {rc}"
        return BenchError(f"run {label} failed ({why}); full log: {log_path}\n--- last lines ---\n{_tail(log_path)}")


def measure_link(emu, seconds: float) -> dict:
    """One TCP stream node 0 -> node 1; a failure is recorded, not raised."""
    try:
        r = emu.measure(0, 1, seconds=seconds)
        return {"achieved_bits_per_s": r["bits_per_s"], "set_bits_per_s": r["set_bits_per_s"], "ratio": r["ratio"]}
    except Exception as exc:  # a failed measurement must not stop the benchmark
        return {"error": str(exc)}


def run_all(plan: dict, dry: bool) -> dict:
    """Every launch of the plan: calibration and overhead on unshaped links, then the main
    rows, one emulator per link rate.

    Returns:
        ``{"launches": {path: record}, "links": {rate: TCP measurement}, "total_s": float,
        "commands": [str]}``.

    Raises:
        BenchError: a launch failed (the message has the end of its log).
    """
    runner = Runner(plan, dry)
    runs = runs_of(plan)
    links: dict[str, dict] = {}
    t0 = time.monotonic()
    secs = 1.0 if plan["smoke"] else 2.0

    def emulator(rate):
        return DryEmulator(NODES, rate) if dry else netemu.Emulator(NODES, rate)

    unshaped = [r for r in runs if r.phase in ("calibration", "overhead")]
    if unshaped:
        with emulator(None) as emu:
            print(f"[bench] unshaped emulator: {NODES} nodes", flush=True)
            if not dry:
                links["unshaped"] = measure_link(emu, secs)
            for spec in (r for r in unshaped if r.phase == "calibration"):
                runner.torchrun(emu, spec)
            over = [r for r in unshaped if r.phase == "overhead"]
            for rep in sorted({r.id.split("-")[0] for r in over}):
                for spec in (r for r in over if r.id == f"{rep}-fl_fsdp"):
                    runner.torchrun(emu, spec)
                jobs = sorted((r for r in over if r.id.startswith(f"{rep}-fsdp-job")), key=lambda r: r.id)
                runner.concurrent_single_node_jobs(emu, f"overhead/{rep}-fsdp-2jobs", jobs)
    for rate in dict.fromkeys(r.link for r in runs if r.phase == "main"):
        with emulator(rate) as emu:
            print(f"[bench] emulator at {rate} per node link and direction", flush=True)
            if not dry:
                links[rate] = measure_link(emu, secs)
            for spec in (r for r in runs if r.phase == "main" and r.link == rate):
                runner.torchrun(emu, spec)
    return {"launches": runner.launches, "links": links, "total_s": time.monotonic() - t0,
            "commands": runner.commands}


# ---------------------------------------------------------------------- quality suites (loopback)
LAUNCHES_FILE = "launches.json"
"""Launch records of a quality suite in its work folder, kept across interrupted sessions."""


def _read_json(path: str, default: Any) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return default


def _write_json(path: str, value: Any) -> None:
    tmp = path + ".partial"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(value, fh, indent=1)
    os.replace(tmp, path)


SITTINGS = "sittings.json"
"""In a timed suite's work folder: every sitting (invocation) by id: start, end, load average, links measured."""


def save_sitting(plan: dict, sitting: str, **fields) -> None:
    """Update sitting ``sitting``'s record in ``plan["work"]``'s :data:`SITTINGS` with ``fields``."""
    path = os.path.join(plan["work"], SITTINGS)
    records = _read_json(path, {})
    records.setdefault(sitting, {}).update(fields)
    _write_json(path, records)


def _latest_checkpoint_step(out_dir: str) -> int:
    from fl_accel.checkpoint import list_checkpoints

    steps = list_checkpoints(os.path.join(out_dir, "checkpoints"))
    return steps[-1][0] if steps else 0


def run_local(plan: dict, dry: bool) -> dict:
    """Every row of a quality suite, one after the other: a single-node torchrun on
    loopback (no emulator, no root), in the order of the plan.

    A row whose ``all_results.json`` exists is skipped, and so is a row the committed results
    folder (``plan["results"]``, compact) holds: a suite continues on a fresh checkout. Every
    other row is launched with
    ``--resume_from_checkpoint latest``, so an interrupted suite continues each run from its
    last checkpoint (or from step 0 when it has none); its ``launch.log`` is appended to,
    one header per session. A failed row is recorded and the suite goes on with the next
    (the error is raised at the end). Each session's wall time, exit code, the step it
    resumed from and :class:`recipes.host_load.HostLoad` figures go to
    ``<work>/launches.json`` (``{run path: {"sessions": [...]}}``) as soon as it ends.

    Returns:
        ``{"launches": records, "failed": [run path], "total_s": float, "commands": [str]}``.

    Raises:
        KeyboardInterrupt: passed on after the running launch's process group is ended.
    """
    import datetime

    from bench.compact import CompactRuns, has_compact

    runner = Runner(plan, dry)
    only = set(plan.get("only") or ())
    committed = CompactRuns.load(plan["results"]) if has_compact(plan["results"]) else None
    records_path = os.path.join(plan["work"], LAUNCHES_FILE)
    records = {} if dry else _read_json(records_path, {})
    failed: list[str] = []
    t0 = time.monotonic()
    for spec in runs_of(plan):
        if only and spec.id not in only:
            continue
        out_dir = os.path.join(plan["work"], spec.path)
        args = recipe_args(plan, spec, out_dir)
        argv = launch.torchrun_argv(spec.nproc_per_node, args[0], *args[1:])
        runner._show(f"{spec.path} [{spec.label}; {spec.world} processes, loopback]", argv)
        if dry:
            continue
        if os.path.isfile(os.path.join(out_dir, "all_results.json")):
            print(f"[bench] {spec.path}: finished earlier (all_results.json), skipped", flush=True)
            continue
        if committed is not None and spec.path in committed.runs:
            print(f"[bench] {spec.path}: finished in the committed {plan['results']}, skipped", flush=True)
            continue
        os.makedirs(out_dir, exist_ok=True)
        log_path = os.path.join(out_dir, "launch.log")
        resumed = _latest_checkpoint_step(out_dir)
        started = datetime.datetime.now().isoformat(timespec="seconds")
        print(f"[bench] {spec.path}: starting" + (f", resuming from step {resumed}" if resumed else ""), flush=True)
        rc: int | str = "interrupted"
        load = HostLoad().start()
        try:
            with open(log_path, "a", encoding="utf-8") as log:
                log.write(f"=== session {started} (resume from step {resumed}) ===\n"
                          f"{' '.join(map(shlex.quote, argv))}\n")
                log.flush()
                proc = launch.start(argv, env=run_env(plan), stdout=log, stderr=subprocess.STDOUT)
                try:
                    rc = launch.exit_code(proc.wait(timeout=plan["run_timeout"]))
                except subprocess.TimeoutExpired:
                    rc = 124
                finally:
                    launch.terminate(proc)  # also on Ctrl-C / SIGTERM: no orphaned ranks
        finally:  # an interrupted session is recorded too
            load.stop()
            session = {"started": started, "wall_s": load.wall_s, "host": load.as_dict(), "rc": rc,
                       "resumed_from_step": resumed, "ended_at_step": _latest_checkpoint_step(out_dir)}
            records.setdefault(spec.path, {"sessions": []})["sessions"].append(session)
            _write_json(records_path, records)
        bg = load.background_cpu_share
        print(f"[bench] {spec.path}: ended after {load.wall_s:.0f} s (exit code {rc})"
              + (f"; other processes used {100 * bg:.0f}% of the CPUs" if bg is not None else ""), flush=True)
        if rc != 0 or not os.path.isfile(os.path.join(out_dir, "all_results.json")):
            failed.append(spec.path)
            print(str(Runner._fail(spec.path, rc, log_path)), flush=True)
    return {"launches": records, "failed": failed, "total_s": time.monotonic() - t0, "commands": runner.commands}
