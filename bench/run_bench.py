"""Side-by-side benchmark of FSDP, FL+FSDP, HSDP and FL+HSDP under emulated inter-node links.

    python bench/run_bench.py                  # as root; full: 1gbit and 100mbit (see bench/README.md)
    python bench/run_bench.py --smoke          # as root; every code path in a few minutes
    python bench/run_bench.py --dry-run        # print the plan, run nothing (no root needed)
    python bench/run_bench.py --report-only --name NAME   # redo tables/plots from bench/work/NAME

Every training run is ``recipes/pretrain.py`` (model ``tiny``, embedded Shakespeare corpus,
fp32) on 4 processes = 2 emulated nodes x 2 processes (``scripts/netemu.py``: one network
namespace per node, each node's link shaped with tc in both directions). The four runs at
one link rate differ in ``--algorithm`` only; F=2, S=2, H are passed to all and ignored
where they do not apply. With 2 processes per node a federation group (G=2) is one node,
and an HSDP replica (S=2) is one node.

Phases, in order (bench/README.md explains how to read the results):

1. calibration: each algorithm, unshaped links (same namespaces, no tc), a few steps. The
   median non-sync step time (from step 3 on) is the "compute time" of the time model; it
   contains the intra-node communication, which stays the same under shaping.
2. main: each algorithm at each link rate, ``--steps`` optimizer steps, eval every H.
3. overhead (issue item 5): FL+FSDP with sync off (H = 10^6, 4 processes, groups = nodes)
   against the same 4 processes as two concurrent, independent 2-process FSDP jobs, one
   per node. Per-group work is identical; only the federation machinery differs.

Results go to ``bench/results/<name>/`` (table.md, PNG plots, raw per-run files,
machine.json, command.txt, bench.json); run folders, logs and the offline W&B runs to
``bench/work/<name>/`` (gitignored). The emulator is removed on exit, also on Ctrl-C or
SIGTERM. Needs root (network namespaces); fails with a clear message otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from scripts import netemu  # noqa: E402  (standard library only)

RECIPE = os.path.join(REPO, "recipes", "pretrain.py")
ALGORITHMS = ("fsdp", "fl_fsdp", "hsdp", "fl_hsdp")
BASELINE = {"fsdp": "fsdp", "fl_fsdp": "fsdp", "hsdp": "hsdp", "fl_hsdp": "hsdp"}
LABEL = {"fsdp": "FSDP", "fl_fsdp": "FL+FSDP", "hsdp": "HSDP", "fl_hsdp": "FL+HSDP"}
COLOR = {"fsdp": "tab:blue", "fl_fsdp": "tab:orange", "hsdp": "tab:green", "fl_hsdp": "tab:red"}
AXES = ("fl", "dp_replicate", "dp_shard")
NODES, NPROC = 2, 2  # emulated nodes x processes per node
WORLD = NODES * NPROC
NUM_GROUPS, SHARD_SIZE = 2, 2  # F (FL runs) and S (HSDP runs); ignored where they do not apply
OVERHEAD_SYNC_EVERY = 10**6
MIB = 2**20

FULL = dict(rates="1gbit,100mbit", steps=40, sync_every=8, eval_blocks=64, calib_steps=12,
            overhead_steps=24, overhead_reps=2)
SMOKE = dict(rates="100mbit", steps=4, sync_every=2, eval_blocks=16, calib_steps=4,
             overhead_steps=4, overhead_reps=1)


class BenchError(RuntimeError):
    """A run failed or the inputs are inconsistent; the message says which and where to look."""


# =========================================================================== plan
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/run_bench.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Defaults (full / --smoke): " + ", ".join(
                                    f"{k}={FULL[k]}/{SMOKE[k]}" for k in FULL))
    p.add_argument("--smoke", action="store_true", help="tiny settings: every code path, a few minutes")
    p.add_argument("--rates", default=None, help="inter-node link rates, comma-separated, tc units (1gbit,100mbit)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per main run (multiple of --sync-every)")
    p.add_argument("--sync-every", type=int, default=None, help="H for the FL runs; evaluation every H steps too")
    p.add_argument("--eval-blocks", type=int, default=None, help="validation blocks per evaluation (--max_eval_blocks)")
    p.add_argument("--calib-steps", type=int, default=None, help="steps of each unshaped calibration run")
    p.add_argument("--overhead-steps", type=int, default=None, help="steps of each overhead run")
    p.add_argument("--overhead-reps", type=int, default=None, help="repetitions of the overhead pair (interleaved)")
    p.add_argument("--micro-batch-size", type=int, default=4, help="blocks per rank per step")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--report-to", default="wandb", choices=["wandb", "none"],
                   help="trackers of the calibration and main runs (overhead runs: none)")
    p.add_argument("--name", default=None, help="results/work folder name (default: smoke, or the date)")
    p.add_argument("--results-root", default=os.path.join(REPO, "bench", "results"))
    p.add_argument("--work-root", default=os.path.join(REPO, "bench", "work"))
    p.add_argument("--cache-dir", default=None, help="corpus/tokenizer/datasets cache shared by all runs "
                                                      "(default bench/work/cache)")
    p.add_argument("--run-timeout", type=float, default=None, help="seconds before one run is killed")
    p.add_argument("--skip", default="", help="comma list of phases to skip: calibration,main,overhead")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the commands, run nothing")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing; rebuild tables/plots/W&B from bench/work/<name>")
    return p


def make_plan(args: argparse.Namespace) -> dict:
    base = SMOKE if args.smoke else FULL
    plan = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in base.items()}
    rates = [r.strip() for r in str(plan["rates"]).split(",") if r.strip()]
    if not rates:
        raise BenchError("--rates is empty")
    for r in rates:
        try:
            netemu.parse_rate(r)
        except ValueError as exc:
            raise BenchError(f"--rates: {exc}") from None
        if not re.fullmatch(r"[A-Za-z0-9.]+", r):
            raise BenchError(f"--rates: {r!r} must be like 100mbit")
    H, T = plan["sync_every"], plan["steps"]
    for key in ("steps", "sync_every", "eval_blocks", "calib_steps", "overhead_steps", "overhead_reps"):
        if plan[key] < 1:
            raise BenchError(f"--{key.replace('_', '-')} must be >= 1, got {plan[key]}")
    if T % H:
        raise BenchError(f"--steps {T} must be a multiple of --sync-every {H}: the last step is then a sync step, "
                         f"evaluations fall on the same steps for every run, and an evaluation's bytes can be "
                         f"told apart from the training bytes")
    if plan["eval_blocks"] < WORLD * args.micro_batch_size:
        raise BenchError(f"--eval-blocks must be >= {WORLD * args.micro_batch_size} (one micro-batch per rank)")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - {"calibration", "main", "overhead"}:
        raise BenchError(f"--skip: unknown phase(s) {sorted(skip - {'calibration', 'main', 'overhead'})}")
    name = args.name or ("smoke" if args.smoke else datetime.datetime.now().strftime("%Y%m%d-%H%M"))
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise BenchError(f"--name {name!r}: use letters, digits, '.', '_', '-'")
    work = os.path.join(os.path.abspath(args.work_root), name)
    plan.update(
        rates=rates, smoke=bool(args.smoke), name=name, work=work,
        results=os.path.join(os.path.abspath(args.results_root), name),
        cache_dir=os.path.abspath(args.cache_dir or os.path.join(args.work_root, "cache")),
        micro_batch_size=args.micro_batch_size, seq_len=args.seq_len, seed=args.seed,
        report_to=args.report_to, skip=sorted(skip),
        tokens_per_step=WORLD * args.micro_batch_size * args.seq_len,
        run_timeout=args.run_timeout or (600.0 + 60.0 * max(plan["steps"], plan["calib_steps"],
                                                              plan["overhead_steps"])),
        nodes=NODES, nproc_per_node=NPROC, num_groups=NUM_GROUPS, hsdp_shard_size=SHARD_SIZE,
        overhead_sync_every=OVERHEAD_SYNC_EVERY,
        command=" ".join(shlex.quote(a) for a in ["python", os.path.relpath(os.path.abspath(sys.argv[0]), REPO)]
                         + sys.argv[1:]),
    )
    return plan


def recipe_args(plan: dict, algorithm: str, out_dir: str, run_name: str, *, steps: int, sync_every: int,
                eval_every: int, report_to: str) -> list[str]:
    """Recipe command line. The runs of one phase differ in --algorithm (and names) only."""
    return [
        RECIPE, "--model", "tiny", "--seq_len", str(plan["seq_len"]),
        "--micro_batch_size", str(plan["micro_batch_size"]), "--max_steps", str(steps),
        "--mixed_precision", "no", "--seed", str(plan["seed"]),
        "--algorithm", algorithm, "--num_groups", str(NUM_GROUPS), "--hsdp_shard_size", str(SHARD_SIZE),
        "--sync_every", str(sync_every), "--eval_every", str(eval_every), "--log_every", "1",
        "--max_eval_blocks", str(plan["eval_blocks"]), "--cache_dir", plan["cache_dir"],
        "--output_dir", out_dir, "--experiment", f"bench-{plan['name']}", "--run_name", run_name,
        "--report_to", report_to,
    ]


def run_env(plan: dict) -> dict:
    """Environment added to every launched process (on top of ours, FL_ACCEL_* removed in main)."""
    return {
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_CACHE": os.path.join(plan["cache_dir"], "hf_datasets"),
        "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1",
        "FL_TIMEOUT_S": "600", "PYTHONPATH": REPO + (os.pathsep + os.environ["PYTHONPATH"]
                                                    if os.environ.get("PYTHONPATH") else ""),
    }


# =========================================================================== running
class CpuMeter:
    """CPU used by other processes while one of our runs goes on (a background-load indicator).

    Machine busy time comes from /proc/stat; our runs' CPU time from os.times() children
    fields (torchrun and its workers, reaped by us). other = (machine busy - ours) /
    (wall x CPUs). Softirq time of the emulated links counts as "other" too (small).
    """

    def __init__(self):
        self.t0, self.busy0, self.ours0 = time.monotonic(), _machine_busy_s(), _children_cpu_s()

    def stop(self) -> dict:
        wall = time.monotonic() - self.t0
        busy, ours = _machine_busy_s() - self.busy0, _children_cpu_s() - self.ours0
        ncpu = os.cpu_count() or 1
        other = max(0.0, busy - ours) / (wall * ncpu) if wall > 0 and busy >= 0 else None
        return {"wall_s": wall, "run_cpu_s": ours, "machine_busy_s": busy, "other_cpu_frac": other}


def _machine_busy_s() -> float:
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            f = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return -1.0
    idle = f[3] + (f[4] if len(f) > 4 else 0)
    busy = sum(f[:8]) - idle  # user nice system idle iowait irq softirq steal (guest is inside user)
    return busy / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    t = os.times()
    return t.children_user + t.children_system


class Runner:
    """Launches recipe runs inside an :class:`netemu.Emulator` and records their wall times."""

    def __init__(self, plan: dict, dry: bool = False):
        self.plan = plan
        self.dry = dry
        self.port = 29400
        self.timings: dict[str, float] = {}
        self.cpu: dict[str, dict] = {}

    def _next_port(self) -> int:
        self.port += 1
        return self.port

    def _fail(self, label: str, rc: int, log_path: str) -> BenchError:
        tail = ""
        try:
            with open(log_path, encoding="utf-8", errors="replace") as fh:
                lines = [ln for ln in fh.read().replace("\r", "\n").splitlines() if ln.strip()]
            tail = "\n".join(lines[-40:])
        except OSError:
            pass
        why = "timed out" if rc == 124 else f"exit code {rc}"
        return BenchError(f"run {label} failed ({why}); full log: {log_path}\n--- last lines ---\n{tail}")

    def torchrun(self, emu, label: str, args: list[str], out_dir: str) -> None:
        """One torchrun per emulated node (a 4-process job over both nodes)."""
        print(f"[bench] {label}: {' '.join(shlex.quote(a) for a in args[1:])}", flush=True)
        if self.dry:
            return
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.makedirs(out_dir)
        log_path = os.path.join(out_dir, "launch.log")
        t0, meter = time.monotonic(), CpuMeter()
        with open(log_path, "w", encoding="utf-8") as log:
            rc = emu.run_torchrun(args, nproc_per_node=NPROC, master_port=self._next_port(), env=run_env(self.plan),
                                  timeout=self.plan["run_timeout"], stdout=log, stderr=subprocess.STDOUT)
        self.timings[label] = time.monotonic() - t0
        self.cpu[label] = meter.stop()
        if rc != 0 or not os.path.isfile(os.path.join(out_dir, "all_results.json")):
            raise self._fail(label, rc, log_path)
        print(f"[bench] {label}: done in {self.timings[label]:.0f} s", flush=True)

    def concurrent_single_node_jobs(self, emu, label: str, jobs: list[tuple[list[str], str]]) -> None:
        """Job k = a standalone 2-process torchrun inside node k, all started together."""
        for k, (args, _) in enumerate(jobs):
            print(f"[bench] {label} (node {k}): {' '.join(shlex.quote(a) for a in args[1:])}", flush=True)
        if self.dry:
            return
        procs, logs = [], []
        t0, meter = time.monotonic(), CpuMeter()
        try:
            for k, (args, out_dir) in enumerate(jobs):
                if os.path.isdir(out_dir):
                    shutil.rmtree(out_dir)
                os.makedirs(out_dir)
                log = open(os.path.join(out_dir, "launch.log"), "w", encoding="utf-8")
                logs.append(log)
                argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
                        str(NPROC), "--master_addr", emu.address(k), "--master_port", str(self._next_port()),
                        *args]
                procs.append(emu.popen(k, argv, env=run_env(self.plan), stdout=log, stderr=subprocess.STDOUT))
            deadline = t0 + self.plan["run_timeout"]
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                netemu.terminate(p)
            for log in logs:
                log.close()
        self.timings[label] = time.monotonic() - t0
        self.cpu[label] = meter.stop()
        for k, (p, (_, out_dir)) in enumerate(zip(procs, jobs)):
            rc = 124 if p.returncode is None else (128 - p.returncode if p.returncode < 0 else p.returncode)
            if rc != 0 or not os.path.isfile(os.path.join(out_dir, "all_results.json")):
                raise self._fail(f"{label} (node {k})", rc, os.path.join(out_dir, "launch.log"))
        print(f"[bench] {label}: done in {self.timings[label]:.0f} s", flush=True)


def measure_link(emu, seconds: float) -> dict:
    try:
        r = emu.measure(0, 1, seconds=seconds)
        return {"achieved_bits_per_s": r["bits_per_s"], "set_bits_per_s": r["set_bits_per_s"], "ratio": r["ratio"]}
    except Exception as exc:  # a failed measurement must not stop the benchmark
        return {"error": str(exc)}


def run_all(plan: dict, dry: bool) -> dict:
    """All phases. Returns {"timings": {label: s}, "links": {rate: measurement}}."""
    runner = Runner(plan, dry)
    work = plan["work"]
    H, T = plan["sync_every"], plan["steps"]
    links = {}
    t_start = time.monotonic()
    emulator = (lambda rate: _DryEmu()) if dry else (lambda rate: netemu.Emulator(NODES, rate))
    with emulator(None) as emu:
        print(f"[bench] unshaped emulator: {NODES} nodes x {NPROC} processes", flush=True)
        if not dry:
            links["unshaped"] = measure_link(emu, 1.0 if plan["smoke"] else 2.0)
        if "calibration" not in plan["skip"]:
            for alg in ALGORITHMS:
                out = os.path.join(work, "calibration", alg)
                runner.torchrun(emu, f"calibration/{alg}", recipe_args(
                    plan, alg, out, f"calib-{alg}", steps=plan["calib_steps"], sync_every=H, eval_every=0,
                    report_to=plan["report_to"]), out)
        if "overhead" not in plan["skip"]:
            for rep in range(1, plan["overhead_reps"] + 1):
                out = os.path.join(work, "overhead", f"rep{rep}-fl_fsdp")
                runner.torchrun(emu, f"overhead/rep{rep}-fl_fsdp", recipe_args(
                    plan, "fl_fsdp", out, f"overhead-rep{rep}-fl_fsdp", steps=plan["overhead_steps"],
                    sync_every=OVERHEAD_SYNC_EVERY, eval_every=0, report_to="none"), out)
                jobs = []
                for k in range(NODES):
                    out = os.path.join(work, "overhead", f"rep{rep}-fsdp-job{k}")
                    jobs.append((recipe_args(plan, "fsdp", out, f"overhead-rep{rep}-fsdp-job{k}",
                                             steps=plan["overhead_steps"], sync_every=OVERHEAD_SYNC_EVERY,
                                             eval_every=0, report_to="none"), out))
                runner.concurrent_single_node_jobs(emu, f"overhead/rep{rep}-fsdp-2jobs", jobs)
    if "main" not in plan["skip"]:
        for rate in plan["rates"]:
            with emulator(rate) as emu:
                print(f"[bench] emulator at {rate} per node link and direction", flush=True)
                if not dry:
                    links[rate] = measure_link(emu, 1.0 if plan["smoke"] else 2.0)
                    ach = links[rate].get("achieved_bits_per_s")
                    if ach:
                        print(f"[bench] measured TCP stream node0->node1: {ach / 1e6:.1f} Mbit/s", flush=True)
                for alg in ALGORITHMS:
                    out = os.path.join(work, f"rate-{rate}", alg)
                    runner.torchrun(emu, f"rate-{rate}/{alg}", recipe_args(
                        plan, alg, out, f"{alg}-{rate}", steps=T, sync_every=H, eval_every=H,
                        report_to=plan["report_to"]), out)
    runner.timings["total"] = time.monotonic() - t_start
    return {"timings": runner.timings, "cpu": runner.cpu, "links": links}


class _DryEmu:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def address(self, k):
        return f"<node{k}>"


# =========================================================================== reading runs
def read_run(path: str) -> dict | None:
    res_path = os.path.join(path, "all_results.json")
    if not os.path.isfile(res_path):
        return None
    with open(res_path, encoding="utf-8") as fh:
        run = json.load(fh)
    records = []
    mpath = os.path.join(path, "metrics.jsonl")
    if os.path.isfile(mpath):
        with open(mpath, encoding="utf-8") as fh:
            records = [json.loads(line) for line in fh if line.strip()]
    run["records"], run["path"] = records, path
    return run


def train_records(run: dict) -> list[dict]:
    return sorted((r for r in run["records"] if "train/loss" in r), key=lambda r: r["step"])


def eval_records(run: dict) -> list[dict]:
    return sorted((r for r in run["records"] if "eval/perplexity" in r), key=lambda r: r["step"])


def step_times(run: dict) -> dict[int, float]:
    """Seconds of each optimizer step (rank 0's training time; logging/eval excluded by the recipe)."""
    out, prev_step, prev_t = {}, 0, 0.0
    for r in train_records(run):
        if r["step"] == prev_step + 1:
            out[r["step"]] = r["time_s"] - prev_t
        prev_step, prev_t = r["step"], r["time_s"]
    return out


def steady_step_times(run: dict, sync_every: int | None, skip: int = 2) -> list[float]:
    """Step times from step skip+1 on, without sync steps (every sync_every-th) when given."""
    st = step_times(run)
    vals = [t for s, t in st.items() if s > skip and not (sync_every and s % sync_every == 0)]
    if not vals:  # very short runs (smoke): fall back to everything after step 1
        vals = [t for s, t in st.items() if s > 1] or list(st.values())
    return vals


def split_comm(run: dict) -> dict:
    """Training-only and per-evaluation comm (bytes, seconds) by axis for one run.

    all_results.json's comm counts everything rank 0 sent, including evaluations (FSDP
    all-gathers in each eval forward). The last metrics record (step T, logged before the
    final evaluation; with T a multiple of H the last sync is already in it) subtracted
    from all_results gives one evaluation's traffic; every evaluation is identical (same
    blocks, same forwards), so training = total - n_evals x one evaluation.
    """
    tr, ev = train_records(run), eval_records(run)
    last = tr[-1]
    n_evals = len(ev)
    out = {"n_evals": n_evals, "train": {}, "eval": {}, "total": {}}
    for a in AXES:
        tot = run["comm"].get(a, {"bytes": 0, "seconds": 0.0})
        e_b = tot["bytes"] - last.get(f"comm/{a}/bytes", 0)
        e_s = tot["seconds"] - last.get(f"comm/{a}/seconds", 0.0)
        out["total"][a] = {"bytes": tot["bytes"], "seconds": tot["seconds"]}
        out["eval"][a] = {"bytes": e_b, "seconds": e_s}
        out["train"][a] = {"bytes": tot["bytes"] - n_evals * e_b, "seconds": max(0.0, tot["seconds"] - n_evals * e_s)}
    return out


# =========================================================================== model side
_UNITS_CACHE: dict[int, list] = {}


def model_units(vocab_size: int):
    """FSDP units of the recipe's tiny Llama exactly as Accelerate wraps it (meta device)."""
    if vocab_size not in _UNITS_CACHE:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from fl_accel import cost_model as cm
        from recipes.pretrain import PRESETS

        cfg = LlamaConfig(**dict(PRESETS["tiny"], vocab_size=vocab_size))
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        units = cm.units_from_module(model)
        by_cfg = cm.llama_units(cfg)
        if [(u.numel, u.reshard_after_forward, u.shapes) for u in units] != \
                [(u.numel, u.reshard_after_forward, u.shapes) for u in by_cfg]:
            print("[bench] note: units_from_module and llama_units disagree; using units_from_module", file=sys.stderr)
        _UNITS_CACHE[vocab_size] = units
    return _UNITS_CACHE[vocab_size]


def link_share(axis: str, shape: tuple[int, int, int], ranks_per_node: int) -> int:
    """How many ring hops of ``axis`` leave one node in the same direction at the same time.

    The process groups of an axis run concurrently, each as a ring in rank order; every
    rank sends all its bytes to its ring successor. A node's NIC per direction is then
    shared by the ranks of that node whose successor is on another node: FSDP over 4 ranks
    on 2 nodes has one such rank per node (1 -> 2, 3 -> 0); the "fl" axis of FL+FSDP and
    the "dp_replicate" axis of HSDP (2 concurrent 2-rank groups) have two. Returns the max
    over nodes (0 when the axis stays inside nodes).
    """
    F, R, S = shape
    G = R * S
    groups = []
    if axis == "dp_shard":
        groups = [[f * G + r * S + s for s in range(S)] for f in range(F) for r in range(R)]
    elif axis == "dp_replicate":
        groups = [[f * G + r * S + s for r in range(R)] for f in range(F) for s in range(S)]
    elif axis == "fl":
        groups = [[f * G + r * S + s for f in range(F)] for r in range(R) for s in range(S)]
    out = {}
    for ranks in groups:
        if len(ranks) < 2:
            continue
        for i, a in enumerate(ranks):
            b = ranks[(i + 1) % len(ranks)]
            if a // ranks_per_node != b // ranks_per_node:
                out[a // ranks_per_node] = out.get(a // ranks_per_node, 0) + 1
    return max(out.values(), default=0)


def predict(plan: dict, run: dict, compute_s: float | None, rate: str) -> dict:
    """The cost model for this run's sizes and steps, and its time prediction at ``rate``."""
    from fl_accel import cost_model as cm

    alg, T, H = run["algorithm"], run["steps"], plan["sync_every"]
    units = model_units(run["vocab_size"])
    est = cm.estimate(alg, WORLD, units, group_size=WORLD // NUM_GROUPS, shard_size=SHARD_SIZE, sync_every=H,
                      param_bytes=4, grad_bytes=4, sync_bytes=4, ranks_per_node=NPROC, total_steps=T)
    shape = (est.num_groups, est.replicas, est.shards)
    if shape != (run["num_groups"], run["replicas"], run["shards"]):
        raise BenchError(f"{run['path']}: run mesh {run['num_groups'], run['replicas'], run['shards']} differs "
                         f"from the cost model's {shape}")
    inter_axes = [a for a in AXES if est.spans_nodes[a] and est.by_axis()[a] > 0]
    share = max((link_share(a, shape, NPROC) for a in inter_axes), default=1) or 1
    link_bytes_per_s = netemu.parse_rate(rate) / 8
    out = {"estimate": est.as_dict(), "inter_axes": inter_axes, "link_share": share,
           "per_rank_inter_bw": link_bytes_per_s / share, "bytes_run": {a: est.by_axis()[a] * T for a in AXES},
           "sync_bytes": est.sync_by_axis()}
    if compute_s is not None:
        # Intra-node traffic is already inside compute_s (the calibration runs had the same
        # intra-node loopback), so intra_node_bw is effectively infinite here.
        st = cm.predict_step_time(est, compute_s=compute_s, intra_node_bw=1e18,
                                  inter_node_bw=link_bytes_per_s / share,
                                  tokens_per_rank=plan["micro_batch_size"] * plan["seq_len"])
        out.update(compute_s=compute_s, step_s=st.step_s, comm_s=st.comm_s, comm_s_by_axis=st.comm_s_by_axis,
                   tokens_per_s=st.tokens_per_s)
    return out


# =========================================================================== analysis
def ppl_at_time(run: dict, target: float) -> float | None:
    """Training seconds at which eval perplexity first reaches ``target`` (log-linear interpolation)."""
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


def analyze(plan: dict) -> dict:
    work, H = plan["work"], plan["sync_every"]
    out = {"calibration": {}, "main": {}, "overhead": None}
    # ---- calibration: compute time per step
    for alg in ALGORITHMS:
        run = read_run(os.path.join(work, "calibration", alg))
        if run is None:
            continue
        vals = steady_step_times(run, H if alg.startswith("fl_") else None)
        out["calibration"][alg] = {"compute_s": statistics.median(vals), "mean_s": statistics.fmean(vals),
                                   "n_steps": len(vals), "steps": run["steps"],
                                   "tokens_per_s": run["tokens_per_s"]}
    # ---- main runs
    for rate in plan["rates"]:
        rows = {}
        for alg in ALGORITHMS:
            run = read_run(os.path.join(work, f"rate-{rate}", alg))
            if run is None:
                continue
            cal = out["calibration"].get(alg)
            comm = split_comm(run)
            pred = predict(plan, run, cal["compute_s"] if cal else None, rate)
            st = step_times(run)
            nonsync = steady_step_times(run, H if alg.startswith("fl_") else None)
            n_syncs = math.ceil(run["steps"] / H) if alg.startswith("fl_") else 0
            inter = pred["inter_axes"]
            inter_b = sum(comm["train"][a]["bytes"] for a in inter)
            inter_s = sum(comm["train"][a]["seconds"] for a in inter)
            ev = eval_records(run)
            rows[alg] = {
                "run": run["run_name"], "path": run["path"], "algorithm": alg,
                "mesh": [run["num_groups"], run["replicas"], run["shards"]],
                "steps": run["steps"], "tokens": run["train_tokens"], "tokens_per_s": run["tokens_per_s"],
                "train_seconds": run["train_seconds"], "wall_seconds": run["wall_seconds"],
                "step_s_mean": run["train_seconds"] / run["steps"],
                "step_s_median_nonsync": statistics.median(nonsync) if nonsync else None,
                "sync_steps_s": [st[s] for s in sorted(st) if alg.startswith("fl_") and s % H == 0],
                "eval_perplexity": run["eval_perplexity"], "eval_tokens": run["eval_tokens"],
                "evals": [{"step": r["step"], "tokens": r["tokens"], "time_s": r["time_s"],
                           "perplexity": r["eval/perplexity"]} for r in ev],
                "comm": comm, "pred": pred, "n_syncs": n_syncs,
                "inter_axes": inter, "inter_bytes": inter_b, "inter_seconds": inter_s,
                "inter_bw_measured": inter_b / inter_s if inter_s > 0 else None,
            }
        for alg, row in rows.items():
            base = rows.get(BASELINE[alg])
            row["speedup"] = (row["tokens_per_s"] / base["tokens_per_s"]) if base and base["tokens_per_s"] else None
            p = row["pred"].get("tokens_per_s")
            row["meas_over_pred"] = row["tokens_per_s"] / p if p else None
            bp = base["pred"].get("tokens_per_s") if base else None
            row["pred_speedup"] = p / bp if p and bp else None
        if rows:
            target = max(r["eval_perplexity"] for r in rows.values())
            for row in rows.values():
                row["time_to_target"] = ppl_at_time(read_run(row["path"]), target)
            out["main"][rate] = {"rows": rows, "ppl_target": target}
    # ---- overhead
    reps = []
    for rep in range(1, plan["overhead_reps"] + 1):
        fl = read_run(os.path.join(work, "overhead", f"rep{rep}-fl_fsdp"))
        jobs = [read_run(os.path.join(work, "overhead", f"rep{rep}-fsdp-job{k}")) for k in range(NODES)]
        if fl is None or any(j is None for j in jobs):
            continue
        fl_t = steady_step_times(fl, None)
        job_t = [steady_step_times(j, None) for j in jobs]
        reps.append({"rep": rep, "fl_fsdp": fl_t, "fsdp_jobs": job_t,
                     "fl_median": statistics.median(fl_t),
                     "fsdp_median": statistics.fmean(statistics.median(t) for t in job_t),
                     "fl_syncs": fl["comm"]["fl"]["calls"],
                     "fl_group_size": fl["group_size"], "fsdp_world": jobs[0]["world_size"]})
    if reps:
        fl_all = [t for r in reps for t in r["fl_fsdp"]]
        fsdp_all = [t for r in reps for ts in r["fsdp_jobs"] for t in ts]
        fl_med, fsdp_med = statistics.median(fl_all), statistics.median(fsdp_all)
        per_rep = [r["fl_median"] / r["fsdp_median"] - 1 for r in reps]
        base_meds = [r["fsdp_median"] for r in reps]
        noise = (max(base_meds) - min(base_meds)) / statistics.fmean(base_meds) if len(base_meds) > 1 else None
        out["overhead"] = {"reps": reps, "fl_median_s": fl_med, "fsdp_median_s": fsdp_med,
                           "overhead": fl_med / fsdp_med - 1, "per_rep": per_rep, "baseline_spread": noise}
    return out


# =========================================================================== reporting
def _f(x, fmt="{:.2f}", none="-"):
    return none if x is None else fmt.format(x)


def _mib(b):
    return f"{b / MIB:.1f}"


def write_table(plan: dict, res: dict, machine: dict, meta: dict, path: str) -> str:
    H, T = plan["sync_every"], plan["steps"]
    L = []
    title = "fl_accel benchmark: FSDP, FL+FSDP, HSDP, FL+HSDP on 2 emulated nodes x 2 processes"
    L.append(f"# {title}" + (" — SMOKE RUN" if plan["smoke"] else ""))
    L.append("")
    if plan["smoke"]:
        L += ["> **SMOKE RUN: not a result.** A few steps only, to exercise every code path (runs, tables, "
              "plots, W&B). Step times include start-up effects and the machine was shared; do not read "
              "speedups, perplexities or the overhead figure from it.", ""]
    L.append(f"Command: `{plan['command']}`  ")
    L.append(f"Date: {meta.get('date', '-')}; machine: {machine.get('cpu_model', '?')}, "
             f"{machine.get('nproc', '?')} CPUs, {machine.get('mem_gib', '?')} GiB, kernel "
             f"{machine.get('kernel', '?')}, torch {machine.get('versions', {}).get('torch', '?')}; "
             f"load average {machine.get('loadavg_start', '?')} at start, {machine.get('loadavg_end', '?')} at end "
             f"(details: machine.json).")
    L.append("")
    first_rows = next(iter(res["main"].values()), {}).get("rows", {}) if res["main"] else {}
    any_run = next(iter(first_rows.values()), None)
    L.append(f"Setup: recipe `recipes/pretrain.py`, model `tiny` (2.88M parameters, fp32), embedded Shakespeare "
             f"corpus, seq_len {plan['seq_len']}, micro-batch {plan['micro_batch_size']} per rank, "
             f"{plan['tokens_per_step']} tokens per optimizer step for every algorithm, {T} steps = "
             f"{T * plan['tokens_per_step']:,} training tokens, seed {plan['seed']}, AdamW 3e-4 with 10% warmup + "
             f"cosine (recipe defaults). FL runs: F={NUM_GROUPS} groups of G={WORLD // NUM_GROUPS} ranks (one group "
             f"= one node), H={H}; HSDP: S={SHARD_SIZE} (one replica = one node); FL+HSDP: {NUM_GROUPS} groups x "
             f"(1 replica x {SHARD_SIZE} shards). Evaluation every {H} steps on {plan['eval_blocks']} validation "
             f"blocks ({any_run['eval_tokens'] if any_run else '?'} tokens). Links: each node's veth shaped "
             f"with tc tbf at the given rate in both directions.")
    L.append("")
    links = meta.get("links", {})
    if links:
        parts = []
        for k, v in links.items():
            if "achieved_bits_per_s" in v:
                parts.append(f"{k}: {v['achieved_bits_per_s'] / 1e6:.0f} Mbit/s")
            else:
                parts.append(f"{k}: {v.get('error', '?')}")
        L.append("Measured single TCP stream node 0 -> node 1 per emulator: " + "; ".join(parts) + ".")
        L.append("")

    # ---- main table
    L.append("## Throughput, perplexity and the cost model")
    L.append("")
    L.append("| link | algorithm | F×R×S | tokens/s | speedup vs baseline | predicted tokens/s | "
             "measured / predicted | predicted speedup | eval ppl at equal tokens | train s to ppl ≤ target |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    for rate, block in res["main"].items():
        for alg in ALGORITHMS:
            r = block["rows"].get(alg)
            if r is None:
                continue
            base = "" if BASELINE[alg] == alg else f" (vs {LABEL[BASELINE[alg]]})"
            L.append(f"| {rate} | {LABEL[alg]} | {'×'.join(map(str, r['mesh']))} | {r['tokens_per_s']:.0f} | "
                     f"{_f(r['speedup'], '{:.2f}x')}{base if r['speedup'] else ''} | "
                     f"{_f(r['pred'].get('tokens_per_s'), '{:.0f}')} | {_f(r['meas_over_pred'])} | "
                     f"{_f(r['pred_speedup'], '{:.2f}x')} | {r['eval_perplexity']:.1f} | "
                     f"{_f(r['time_to_target'], '{:.0f}')} |")
    targets = "; ".join(f"{rate}: {b['ppl_target']:.1f}" for rate, b in res["main"].items())
    L.append("")
    L.append(f"Eval perplexity is after all {T} steps ({T * plan['tokens_per_step']:,} tokens), the same for every "
             f"run. Target perplexity per link = the worst final perplexity at that link ({targets}); the time is "
             f"training seconds (evaluation excluded), log-linearly interpolated between evaluations.")
    L.append("")

    # ---- communication table
    L.append("## Communication per rank (rank 0), whole run, training steps only")
    L.append("")
    L.append("MiB = 2^20 bytes sent by one rank over all training steps (ring formulas of `fl_accel.comm`). "
             "Measured = `all_results.json` comm minus the evaluations (see below); predicted = "
             "`fl_accel.cost_model.estimate(..., total_steps=T)` with the units of `units_from_module` on the "
             "same model (fp32: 4 bytes per parameter, gradient and sync element).")
    L.append("")
    L.append("| link | algorithm | fl meas | fl pred | dp_replicate meas | dp_replicate pred | dp_shard meas | "
             "dp_shard pred | per eval (dp_shard) | inter-node axis | ranks sharing a NIC | "
             "inter-node s (meas) | inter-node MB/s per rank (meas / model) |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rate, block in res["main"].items():
        for alg in ALGORITHMS:
            r = block["rows"].get(alg)
            if r is None:
                continue
            c, p = r["comm"], r["pred"]
            cells = []
            for a in AXES:
                cells += [_mib(c["train"][a]["bytes"]), _mib(p["bytes_run"][a])]
            bw = r["inter_bw_measured"]
            L.append(f"| {rate} | {LABEL[alg]} | " + " | ".join(cells) +
                     f" | {_mib(c['eval']['dp_shard']['bytes'])} | {', '.join(r['inter_axes']) or '-'} | "
                     f"{p['link_share']} | {r['inter_seconds']:.1f} | "
                     f"{_f(bw / 1e6 if bw else None, '{:.2f}')} / {p['per_rank_inter_bw'] / 1e6:.2f} |")
    L.append("")
    L.append("Measured bytes include the recipe's 8-byte loss all-reduce per logged step on axes whose rank set "
             "is the whole world (12 B/step for FSDP). Inter-node seconds are host seconds inside the collectives "
             "of the inter-node axis during training (they include waiting for slower peers).")
    L.append("")

    # ---- calibration
    L.append("## Compute time per step (calibration, unshaped links)")
    L.append("")
    L.append("| algorithm | compute s/step (median) | mean | steps used | of |")
    L.append("|---|---|---|---|---|")
    for alg in ALGORITHMS:
        c = res["calibration"].get(alg)
        if c:
            L.append(f"| {LABEL[alg]} | {c['compute_s']:.3f} | {c['mean_s']:.3f} | {c['n_steps']} | {c['steps']} |")
    L.append("")
    L.append(f"Each algorithm ran {plan['calib_steps']} steps in the same two namespaces without tc shaping. "
             "Compute time = median step time from step 3 on, sync steps excluded for the FL runs. It contains "
             "forward, backward, optimizer and the intra-node collectives (loopback inside a node), which do "
             "not change under shaping; the model then adds only the inter-node bytes at the shaped rate: "
             "`predict_step_time(est, compute_s, intra_node_bw=inf, inter_node_bw=rate/8/ranks_sharing_NIC)`, "
             "tokens/s = 4 x 1024 tokens / step_s. The unshaped veth time of the axis that becomes inter-node "
             "is counted in both compute_s and the model's link time (small next to the shaped link).")
    L.append("")

    # ---- overhead
    L.append("## Overhead of the federation machinery with sync off (issue item 5)")
    L.append("")
    ov = res.get("overhead")
    if ov:
        L.append("| rep | FL+FSDP F=2, H=10^6, 4 processes: median s/step | 2 concurrent 2-process FSDP jobs: "
                 "median s/step | overhead |")
        L.append("|---|---|---|---|")
        for r, o in zip(ov["reps"], ov["per_rep"]):
            L.append(f"| {r['rep']} | {r['fl_median']:.3f} | {r['fsdp_median']:.3f} | {100 * o:+.1f}% |")
        L.append(f"| all (pooled steps) | {ov['fl_median_s']:.3f} | {ov['fsdp_median_s']:.3f} | "
                 f"**{100 * ov['overhead']:+.1f}%** |")
        L.append("")
        L.append(f"{plan['overhead_steps']} steps per run, unshaped links, no tracker, no evaluation during training. "
                 "\"Plain FSDP on the same group\": one federation group of FL+FSDP (G=2 ranks on one node) does "
                 "exactly the work of a 2-rank FSDP job, so the comparator is two such jobs running at the same "
                 "time, one per node, i.e. the same 4 processes on the same 2 cores with the same per-rank batch, "
                 "model and intra-node collectives. What remains different is the federation machinery: the 3-D "
                 "mesh, the optimizer step hook, the group-aware data sharding. Step times are rank 0's "
                 "(group 0 / job 0 and job 1 averaged), from step 3 on, medians. "
                 + (f"Spread of the baseline between repetitions: {100 * ov['baseline_spread']:.1f}% "
                    "(a noise floor for this figure)." if ov.get("baseline_spread") is not None else ""))
    else:
        L.append("(not run)")
    L.append("")

    # ---- verdicts
    L.append("## Checks against the issue's targets")
    L.append("")
    L += verdicts(plan, res, meta)
    L.append("")
    L.append("## Wall time of each launch")
    L.append("")
    L.append("| launch | wall s (start-up to exit) | CPU used by other processes |")
    L.append("|---|---|---|")
    cpu = meta.get("cpu", {})
    for k, v in meta.get("timings", {}).items():
        other = cpu.get(k, {}).get("other_cpu_frac")
        L.append(f"| {k} | {v:.0f} | {_f(100 * other if other is not None else None, '{:.0f}%')} |")
    L.append("")
    L.append("\"CPU used by other processes\": machine busy time (/proc/stat) minus the CPU time of this launch's "
             "processes, over wall time x CPUs. Anything above a few % means other work shared the 2 cores and "
             "the step times above are inflated by it (unevenly between runs).")
    L.append("")
    L.append("Plots: `ppl_vs_tokens.png`, `time_to_ppl.png`, `throughput.png`; raw per-run files under `raw/`.")
    text = "\n".join(L) + "\n"
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return text


def verdicts(plan: dict, res: dict, meta: dict) -> list[str]:
    out = []
    H = plan["sync_every"]
    slow = None
    if res["main"]:
        slow = min(res["main"], key=lambda r: netemu.parse_rate(r))
    if slow is not None:
        rows = res["main"][slow]["rows"]
        fl, base = rows.get("fl_fsdp"), rows.get("fsdp")
        if fl and base:
            sp = fl["speedup"]
            out.append(f"- FL+FSDP vs FSDP throughput at {slow}: **{sp:.2f}x** (target >= 2x): "
                       f"{'met' if sp >= 2 else 'NOT met'}. FSDP moved {base['inter_bytes'] / MIB:.0f} MiB per rank "
                       f"over the inter-node link in {base['inter_seconds']:.0f} s of its {base['train_seconds']:.0f} s "
                       f"of training; FL+FSDP {fl['inter_bytes'] / MIB:.0f} MiB in {fl['inter_seconds']:.0f} s of "
                       f"{fl['train_seconds']:.0f} s."
                       + (f" The speedup is bounded by (compute + FSDP link time) / (compute + FL sync time): with "
                          f"compute {fl['pred']['compute_s']:.2f} s/step (calibration) the cost model predicts "
                          f"{_f(fl['pred_speedup'], '{:.2f}x')}." if fl["pred"].get("compute_s") is not None else
                          " (No calibration: no prediction.)"))
        for alg in ("fl_fsdp", "fl_hsdp", "fsdp", "hsdp"):
            r = rows.get(alg)
            if not r or r["meas_over_pred"] is None:
                continue
            q = r["meas_over_pred"]
            ok = abs(q - 1) <= 0.15
            line = (f"- {LABEL[alg]} measured vs predicted tokens/s at {slow}: {r['tokens_per_s']:.0f} vs "
                    f"{r['pred']['tokens_per_s']:.0f} = **{q:.2f}** (target within 15%"
                    f"{', stated for FL+FSDP' if alg != 'fl_fsdp' else ''}): {'met' if ok else 'NOT met'}.")
            if not ok or alg == "fl_fsdp":
                line += " " + explain(r, H)
            out.append(line)
    ov = res.get("overhead")
    if ov:
        o = ov["overhead"]
        out.append(f"- Overhead of FL+FSDP with sync off vs plain FSDP on the same group: **{100 * o:+.1f}%** "
                   f"(target within 3%): {'met' if abs(o) <= 0.03 else 'NOT met'}"
                   + (f"; baseline spread between repetitions {100 * ov['baseline_spread']:.1f}%"
                      if ov.get("baseline_spread") is not None else "") + ".")
    busy = {k: v["other_cpu_frac"] for k, v in meta.get("cpu", {}).items()
            if v.get("other_cpu_frac") is not None and v["other_cpu_frac"] > 0.05}
    if busy:
        worst = max(busy, key=busy.get)
        out.append(f"- Background load: other processes used more than 5% of the CPUs during {len(busy)} of "
                   f"{len(meta.get('cpu', {}))} launches (worst {worst}: {100 * busy[worst]:.0f}%). Step times, "
                   f"speedups, the prediction ratio and the overhead figure are then unreliable; rerun on a quiet "
                   f"machine.")
    if plan["smoke"]:
        out.append("- SMOKE RUN: these lines only show that the checks are computed; the numbers mean nothing.")
    return out


def explain(r: dict, H: int) -> str:
    """Decompose a prediction miss: compute drift vs link time vs the model's bandwidth."""
    p = r["pred"]
    parts = []
    comp_cal, comp_run = p.get("compute_s"), r["step_s_median_nonsync"]
    steps = r["steps"]
    meas_step = r["train_seconds"] / steps
    parts.append(f"Per step: measured {meas_step:.3f} s vs predicted {p['step_s']:.3f} s "
                 f"(= compute {comp_cal:.3f} + link {p['comm_s']:.3f}).")
    if r["algorithm"].startswith("fl_"):
        if comp_run is not None:
            step_alt = comp_run + p["comm_s"]
            tps_alt = p["tokens_per_s"] * p["step_s"] / step_alt
            parts.append(f"The run's own median non-sync step took {comp_run:.3f} s "
                         f"({100 * (comp_run / comp_cal - 1):+.0f}% vs calibration); with that as compute time "
                         f"the model predicts {tps_alt:.0f} tokens/s (measured / predicted "
                         f"{r['tokens_per_s'] / tps_alt:.2f}).")
        if r["sync_steps_s"] and comp_run is not None:
            extra = statistics.fmean(r["sync_steps_s"]) - comp_run
            pred_sync = p["comm_s"] * steps / max(1, math.ceil(steps / H))
            parts.append(f"A sync step took {extra:.2f} s more than a non-sync step; the model's sync time is "
                         f"{pred_sync:.2f} s.")
    else:
        link_meas = meas_step - (comp_cal or 0)
        parts.append(f"Time above calibration compute: {link_meas:.3f} s/step vs the model's link time "
                     f"{p['comm_s']:.3f} s/step.")
    bw = r["inter_bw_measured"]
    if bw:
        parts.append(f"Inside the inter-node collectives gloo moved {bw / 1e6:.2f} MB/s per rank vs the model's "
                     f"{p['per_rank_inter_bw'] / 1e6:.2f} MB/s ({100 * bw / p['per_rank_inter_bw']:.0f}%).")
    return " ".join(parts)


def make_plots(plan: dict, res: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(res["main"])
    paths = []
    if not rates:
        return paths
    smoke = " (SMOKE RUN)" if plan["smoke"] else ""
    for kind, xkey, xlabel, fname in (
            ("tokens", "tokens", "training tokens", "ppl_vs_tokens.png"),
            ("time", "time_s", "training time (s, evaluation excluded)", "time_to_ppl.png")):
        fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4.2), squeeze=False)
        for ax, rate in zip(axes[0], rates):
            block = res["main"][rate]
            for alg in ALGORITHMS:
                r = block["rows"].get(alg)
                if not r:
                    continue
                xs = [e[xkey] for e in r["evals"]]
                ys = [e["perplexity"] for e in r["evals"]]
                ax.plot(xs, ys, marker="o", color=COLOR[alg], ls="--" if alg in ("hsdp", "fl_hsdp") else "-",
                        label=LABEL[alg])
            if kind == "time":
                ax.axhline(block["ppl_target"], color="grey", lw=0.8, ls=":", label="target")
            ax.set(xlabel=xlabel, ylabel="eval perplexity", yscale="log", title=f"link {rate}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(("eval perplexity vs training tokens" if kind == "tokens" else
                      "time to perplexity") + f", 2 nodes x 2 processes, H={plan['sync_every']}{smoke}")
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    # throughput bars
    fig, ax = plt.subplots(figsize=(3 + 3 * len(rates), 4.2))
    width = 0.2
    for i, alg in enumerate(ALGORITHMS):
        xs, meas, pred = [], [], []
        for j, rate in enumerate(rates):
            r = res["main"][rate]["rows"].get(alg)
            if r:
                xs.append(j + (i - 1.5) * width)
                meas.append(r["tokens_per_s"])
                pred.append(r["pred"].get("tokens_per_s"))
        bars = ax.bar(xs, meas, width, color=COLOR[alg], label=LABEL[alg])
        for b, m, p in zip(bars, meas, pred):
            ax.text(b.get_x() + b.get_width() / 2, m, f"{m:.0f}", ha="center", va="bottom", fontsize=7)
            if p:
                ax.plot([b.get_x(), b.get_x() + b.get_width()], [p, p], color="black", lw=2)
    ax.plot([], [], color="black", lw=2, label="cost model prediction")
    ax.set_xticks(range(len(rates)), [f"link {r}" for r in rates])
    ax.set(ylabel="tokens/s (all 4 processes)", title=f"throughput{smoke}")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, "throughput.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


def log_wandb(plan: dict, res: dict, plots: list[str], table_md: str) -> str:
    """An offline W&B run under bench/work/<name>/ with the plots as wandb.Image and the main table."""
    os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    wdir = plan["work"]
    run = wandb.init(project="fl_accel-bench", name=f"bench-{plan['name']}", group=f"bench-{plan['name']}",
                     job_type="bench", dir=wdir, mode="offline",
                     config={k: v for k, v in plan.items() if k not in ("work", "results", "cache_dir")})
    try:
        payload = {f"plots/{os.path.splitext(os.path.basename(p))[0]}": wandb.Image(p) for p in plots}
        cols = ["link", "algorithm", "tokens_per_s", "speedup", "predicted_tokens_per_s", "measured_over_predicted",
                "eval_perplexity", "time_to_target_s"]
        data = []
        for rate, block in res["main"].items():
            for alg, r in block["rows"].items():
                data.append([rate, LABEL[alg], r["tokens_per_s"], r["speedup"], r["pred"].get("tokens_per_s"),
                             r["meas_over_pred"], r["eval_perplexity"], r["time_to_target"]])
        payload["results"] = wandb.Table(columns=cols, data=data)
        run.log(payload)
        if res.get("overhead"):
            run.summary["overhead_sync_off"] = res["overhead"]["overhead"]
        run.summary["table_md"] = table_md
        run_dir = run.dir
    finally:
        run.finish()
    return os.path.dirname(run_dir) if run_dir else wdir


# =========================================================================== machine, results
def machine_info() -> dict:
    info = {"nproc": os.cpu_count(), "kernel": platform.release(), "kernel_version": platform.version(),
            "platform": platform.platform(), "python": platform.python_version()}
    try:
        info["affinity_cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            models = [ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")]
        info["cpu_model"] = models[0] if models else "?"
    except OSError:
        info["cpu_model"] = "?"
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for ln in fh:
                if ln.startswith("MemTotal:"):
                    info["mem_gib"] = round(int(ln.split()[1]) / 2**20, 1)
    except OSError:
        pass
    from importlib import metadata

    info["versions"] = {}
    for pkg in ("torch", "accelerate", "transformers", "datasets", "tokenizers", "wandb", "matplotlib"):
        try:
            info["versions"][pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info["versions"][pkg] = None
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                            text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "fl_accel", "recipes", "scripts", "bench"],
                               cwd=REPO, capture_output=True, text=True).stdout.strip()
        info["git_dirty_files"] = dirty.splitlines()
    except OSError:
        pass
    info["tc"] = shutil.which("tc")
    return info


def loadavg() -> str:
    try:
        with open("/proc/loadavg", encoding="ascii") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "?"


def copy_raw(plan: dict, dest: str) -> None:
    work = plan["work"]
    for phase in sorted(os.listdir(work)):
        pdir = os.path.join(work, phase)
        if not os.path.isdir(pdir) or not (phase in ("calibration", "overhead") or phase.startswith("rate-")):
            continue
        for run in sorted(os.listdir(pdir)):
            src = os.path.join(pdir, run)
            if not os.path.isfile(os.path.join(src, "all_results.json")):
                continue
            dst = os.path.join(dest, "raw", phase, run)
            os.makedirs(dst, exist_ok=True)
            for fname in ("all_results.json", "metrics.jsonl"):
                if os.path.isfile(os.path.join(src, fname)):
                    shutil.copy2(os.path.join(src, fname), os.path.join(dst, fname))


def report(plan: dict, meta: dict) -> None:
    res = analyze(plan)
    machine = meta.get("machine") or machine_info()
    machine.setdefault("loadavg_end", loadavg())
    results = plan["results"]
    tmp = results + ".partial"
    if os.path.isdir(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    plots = make_plots(plan, res, tmp)
    table = write_table(plan, res, machine, meta, os.path.join(tmp, "table.md"))
    copy_raw(plan, tmp)
    with open(os.path.join(tmp, "machine.json"), "w", encoding="utf-8") as fh:
        json.dump(machine, fh, indent=1)
    with open(os.path.join(tmp, "command.txt"), "w", encoding="utf-8") as fh:
        fh.write(meta.get("command", plan["command"]) + "\n")
        if meta.get("report_command"):
            fh.write(f"# tables/plots rebuilt with: {meta['report_command']}\n")
    with open(os.path.join(tmp, "bench.json"), "w", encoding="utf-8") as fh:
        json.dump({"plan": {k: v for k, v in plan.items() if k not in ("work", "results", "cache_dir")},
                   "links": meta.get("links"), "timings": meta.get("timings"), "results": res}, fh, indent=1,
                  default=str)
    if os.path.isdir(results):
        shutil.rmtree(results)
    os.replace(tmp, results)
    print(table)
    try:
        wdir = log_wandb(plan, res, [os.path.join(results, os.path.basename(p)) for p in plots], table)
        wandb_note = (f"W&B offline run: {wdir} (upload: wandb sync {wdir})")
    except Exception as exc:  # results are already on disk; say so and go on
        wandb_note = f"W&B logging FAILED: {type(exc).__name__}: {exc}"
    print(f"[bench] results: {results}/ (table.md, *.png, raw/, machine.json, command.txt, bench.json)\n"
          f"[bench] runs and logs: {plan['work']}/\n[bench] {wandb_note}", flush=True)


# =========================================================================== main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.report_only:
            return report_only(args)
        plan = make_plan(args)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.dry_run:
        ok, reason = netemu.check_privileges()
        if not ok:
            print(f"error: bench/run_bench.py runs every job inside emulated nodes (network namespaces + tc) and "
                  f"{reason}. Run it as root, e.g. `sudo {sys.executable} bench/run_bench.py ...`; "
                  f"`--dry-run` shows the plan without root.", file=sys.stderr)
            return 1
    for key in [k for k in os.environ if k.startswith("FL_ACCEL_")]:
        print(f"[bench] ignoring {key} from the environment: every setting is on the command line", file=sys.stderr)
        del os.environ[key]
    os.environ["WANDB_MODE"] = "offline"
    n_runs = (0 if "calibration" in plan["skip"] else len(ALGORITHMS)) + \
             (0 if "overhead" in plan["skip"] else 2 * plan["overhead_reps"]) + \
             (0 if "main" in plan["skip"] else len(ALGORITHMS) * len(plan["rates"]))
    print(f"[bench] {plan['name']}{' (SMOKE)' if plan['smoke'] else ''}: {n_runs} launches; main runs "
          f"{plan['steps']} steps x {plan['tokens_per_step']} tokens at {', '.join(plan['rates'])}; H={plan['sync_every']}; "
          f"calibration {plan['calib_steps']} steps; overhead {plan['overhead_reps']} x 2 runs of "
          f"{plan['overhead_steps']} steps\n[bench] work: {plan['work']}\n[bench] results: {plan['results']}",
          flush=True)
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
    report(plan, meta)
    return 0


def report_only(args) -> int:
    name = args.name or ("smoke" if args.smoke else None)
    if not name:
        raise BenchError("--report-only needs --name (or --smoke)")
    work = os.path.join(os.path.abspath(args.work_root), name)
    ppath = os.path.join(work, "plan.json")
    if not os.path.isfile(ppath):
        raise BenchError(f"--report-only: no {ppath}; run the benchmark first")
    with open(ppath, encoding="utf-8") as fh:
        plan = json.load(fh)
    plan["results"] = os.path.join(os.path.abspath(args.results_root), name)
    meta = {}
    mpath = os.path.join(work, "meta.json")
    if os.path.isfile(mpath):
        with open(mpath, encoding="utf-8") as fh:
            meta = json.load(fh)
    meta["report_command"] = " ".join(shlex.quote(a) for a in ["python", "bench/run_bench.py"] + sys.argv[1:])
    report(plan, meta)
    return 0


def _install_signal_handlers() -> None:
    def handler(signum, frame):  # unwinds the `with Emulator` blocks, which tear everything down
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
