"""Bench of federation groups of unequal speed (``FLConfig.sync_trigger``): issue 30's ``--suite speed``.

Runs of ``recipes/pretrain.py`` on this machine, 2 federation groups x 2 ranks (FL+FSDP),
the tiny Llama, the same token budget, on loopback or, with ``--link RATE``, across 2
emulated nodes (``scripts/netemu.py``; group f on node f, every node's link shaped to RATE).
For each speed ratio (``1:1``, ``2:1``) and trigger (``steps``, today's barrier; ``time``;
``speed``) one run. The speeds are set by a real compute limit: each group's ranks run in a
cgroup-v1 cgroup with a CPU quota (``cpu.cfs_quota_us``; group 0 ``--fast_cpus`` CPUs, group
1 that over the ratio) and a high ``cpu.shares``, so the ratio holds while the machine has
their sum free (root and the cgroup "cpu" controller needed; without them the bench says so
and stops). The table says which method set each run's speeds.

Two settings (``--setting``): ``quick`` measures throughput and waiting (short sequences, no
evaluations); ``convergence`` repeats the convergence grid's ``fl_fsdp-h8-nesterov`` row
(832 steps' tokens, evaluations every 32 federation steps, checkpoints) at unequal speed and
checks its quality against the grid (``--grid``): the final eval loss against the 1:1 run in
pooled seed standard deviations of the grid, and the wall clock to FSDP's half-budget loss
against the barrier run's.

Figures (from each run's ``all_results.json`` ``rounds``; the barrier run has none, so its
figures come from its own step time and sync wait), written to ``bench/results/<name>/``:

* ``speed.json``: ``rows``, one per run: ``trigger``, ``speed_ratio``, ``link``
  ("loopback" or the rate), ``wait_share`` per group, ``tokens_per_s``,
  ``standalone_tokens_per_s`` per group, ``slowdown_method``, steps per round per group,
  final eval loss, wall seconds, and the raw data behind them: ``evals`` (every evaluation:
  step, tokens, the run's wall-clock second, eval loss), ``step_s`` (training seconds per
  step between logged records: median, p10, p90, count), ``sessions`` (start, end and
  /proc/loadavg at both, per session of the run), ``link_rate_bits_per_s`` (a TCP stream
  across the emulated link, measured when the emulator starts); with ``convergence`` also
  ``quality`` (:func:`quality`);
* ``table.md`` and ``command.txt``; ``tokens_over_time.png``: tokens per group against wall
  seconds with a mark at each sync (the 2:1 runs).

Resumable: a run whose ``all_results.json`` exists is not run again (``--force`` reruns); a
``convergence`` run resumes from its last checkpoint::

    sudo nice -n 5 python -m bench.speed_bench --name <date>-speed [--max_steps 96] [--ratios 1:1,2:1] [--link 100mbit]
    sudo python -m bench.speed_bench --name <date>-speed-quality --setting convergence --ratios 2:1 --triggers steps,speed
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from scripts.launch import child_env, free_port, start, terminate, torchrun_argv, wait  # noqa: E402

RECIPE = ROOT / "recipes" / "pretrain.py"
G, F = 2, 2  # ranks per group, federation groups
TRIGGERS = ("steps", "time", "speed")
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
METHOD = "cgroup-v1 cpu.cfs_quota_us per group (group 0: --fast_cpus CPUs, group 1: that / ratio)"


def parse_ratio(text: str) -> float:
    """"2:1" -> 2.0 (group 0's speed over group 1's); ValueError otherwise."""
    try:
        a, b = (float(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"a speed ratio is written fast:slow, e.g. 2:1, got {text!r}") from None
    if a <= 0 or b <= 0 or a < b:
        raise ValueError(f"a speed ratio fast:slow needs fast >= slow > 0, got {text!r}")
    return a / b


def quotas(ratio: float, fast_cpus: float) -> list[float]:
    """CPUs of each group's cgroup: ``fast_cpus`` for group 0, ``fast_cpus / ratio`` for group 1.
    Both groups are capped (and weighted above other processes, ``cpu.shares``), so the ratio
    holds while the machine has their sum free, whatever else runs."""
    return [fast_cpus, fast_cpus / ratio]


SETTINGS = {
    "quick": {"seq_len": 64, "micro_batch_size": 2, "steps": 96, "eval_every": 0, "eval_blocks": 32, "log_every": 4,
              "flags": []},
    # the convergence grid's row fl_fsdp-h8-nesterov (bench/plan.py), checkpointed so a run resumes
    "convergence": {"seq_len": 256, "micro_batch_size": 4, "steps": 832, "eval_every": 32, "eval_blocks": 128,
                    "log_every": 8, "flags": ["--mixed_precision", "no", "--seed", "42", "--outer_optimizer", "nesterov",
                                              "--outer_lr", "0.7", "--outer_momentum", "0.9", "--checkpoint_every",
                                              "64", "--checkpoints_total_limit", "2", "--resume_from_checkpoint",
                                              "latest"]},
}
"""Run settings: ``quick`` (throughput: short sequences, no evaluations) and ``convergence``
(issue 30's quality check: the convergence grid's ``fl_fsdp-h8-nesterov`` row, 832 steps' tokens,
evaluations every 32 federation steps)."""
REFERENCE_ROW = "fl_fsdp-h8-nesterov"
"""The grid row a ``convergence`` run repeats at unequal speed (at 1:1 with H=8 the barrier run is
that row: same flags, same data, same steps)."""


def recipe_args(trigger: str, setting: dict, steps: int, window_s: float, out: Path, cache: Path) -> list[str]:
    args = ["--model", "tiny", "--seq_len", str(setting["seq_len"]), "--micro_batch_size",
            str(setting["micro_batch_size"]), "--max_steps", str(steps), "--log_every", str(setting["log_every"]),
            "--eval_every", str(setting["eval_every"]), "--max_eval_blocks", str(setting["eval_blocks"]),
            "--sync_every", "8", "--algorithm", "fl_fsdp", "--num_groups", str(F), "--report_to", "none",
            "--save_final_model", "false", "--output_dir", str(out), "--cache_dir", str(cache), "--sync_trigger",
            trigger, *setting["flags"]]
    return args + (["--sync_window_s", str(window_s)] if trigger == "time" else [])


def rank_pids(root_pid: int) -> dict[int, int]:
    """RANK -> pid of the recipe processes below ``root_pid`` (torchrun's workers)."""
    out: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"pretrain.py" not in cmd or b"torch.distributed.run" in cmd:
            continue
        values = dict(v.split(b"=", 1) for v in env if b"=" in v)
        if values.get(b"TORCHELASTIC_RUN_ID") and b"RANK" in values and _descends(int(entry.name), root_pid):
            out[int(values[b"RANK"])] = int(entry.name)
    return out


def _descends(pid: int, root: int) -> bool:
    for _ in range(8):
        if pid == root:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


class GroupLimit:
    """A cgroup with a CPU quota of ``cpus`` CPUs and a high ``cpu.shares``, holding one group's ranks."""

    def __init__(self, name: str, cpus: float):
        self.path = CGROUP_CPU / f"fl_accel_{name}"
        self.path.mkdir(exist_ok=True)
        period = int((self.path / "cpu.cfs_period_us").read_text())
        (self.path / "cpu.cfs_quota_us").write_text(str(max(1000, int(cpus * period))))
        (self.path / "cpu.shares").write_text("8192")

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        try:
            for pid in (self.path / "cgroup.procs").read_text().split():
                (CGROUP_CPU / "cgroup.procs").write_text(pid)
            self.path.rmdir()
        except OSError:
            pass


def run_one(work: Path, trigger: str, ratio_text: str, args, cache: Path) -> dict:
    ratio = parse_ratio(ratio_text)
    name = f"{trigger}-{ratio_text.replace(':', 'to')}"
    out = work / name
    if (out / "all_results.json").exists() and not args.force:
        return _finished(out, name)
    resumable = "--resume_from_checkpoint" in args.setting["flags"]
    if args.force or not resumable:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    log = open(work / f"{name}.log", "a")
    rargs = [str(RECIPE), *recipe_args(trigger, args.setting, args.max_steps, args.window_s, out, cache)]
    env = child_env(pythonpath=[str(ROOT)])
    if args.emulator is None:  # one torchrun of F x G ranks on loopback
        procs = [start(torchrun_argv(F * G, *rargs, port=free_port()), env=env, cwd=ROOT, stdout=log, stderr=log)]
    else:  # one torchrun per emulated node, group f on node f
        port = free_port()
        procs = [args.emulator.popen(k, args.emulator.torchrun_argv(k, rargs, nproc_per_node=G, master_port=port),
                                     env=env, cwd=ROOT, stdout=log, stderr=log) for k in range(F)]
    limits = [GroupLimit(f"{name}_g{f}", cpus) for f, cpus in enumerate(quotas(ratio, args.fast_cpus))]
    session = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "loadavg_start": _loadavg()}
    try:  # group f = ranks fG..(f+1)G-1, placed as soon as they exist
        deadline, placed = time.monotonic() + 120, set()
        while len(placed) < F * G and time.monotonic() < deadline and all(p.poll() is None for p in procs):
            for proc in procs:
                for rank, pid in rank_pids(proc.pid).items():
                    if pid not in placed:
                        limits[rank // G].add(pid)
                        placed.add(pid)
            time.sleep(0.2)
        if len(placed) < F * G:
            raise RuntimeError(f"could not place every rank in its group's cgroup (placed {sorted(placed)})")
        codes = [wait(proc, args.timeout).returncode for proc in procs]
    finally:
        for proc in procs:
            terminate(proc)
        for limit in limits:
            limit.remove()
        session.update(ended=time.strftime("%Y-%m-%dT%H:%M:%S"), loadavg_end=_loadavg())
        sessions = out / SESSIONS
        sessions.write_text(json.dumps((json.loads(sessions.read_text()) if sessions.exists() else []) + [session]))
    res = types.SimpleNamespace(returncode=max((c if c is not None else 124) for c in codes))
    if res.returncode != 0:
        raise RuntimeError(f"{name} failed ({res.returncode}); see {work / f'{name}.log'}")
    return _finished(out, name)


SESSIONS = "sessions.json"
"""In each run folder: every session of the run (start, end, /proc/loadavg at both)."""


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _finished(out: Path, name: str) -> dict:
    """all_results.json plus ``_evals`` (the evaluations of metrics.jsonl: step, tokens, the run's
    wall-clock second ``wall_s``, ``eval_loss``; the last of each step, a resume logs redone steps
    again), ``_step_s`` (:func:`bench.time_to_target.step_summary`) and ``_sessions`` (sessions.json)."""
    from bench.time_to_target import step_summary

    evals, train = {}, {}
    metrics = out / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        r = json.loads(line) if line.strip() else {}
        if "eval/loss" in r:
            evals[r["step"]] = {"step": r["step"], "tokens": r.get("tokens"), "wall_s": r.get("wall_s"),
                                "eval_loss": r["eval/loss"]}
        elif "train/loss" in r:
            train[r["step"]] = r
    sessions = out / SESSIONS
    return json.loads((out / "all_results.json").read_text()) | {
        "_name": name, "_evals": [evals[k] for k in sorted(evals)], "_step_s": step_summary(list(train.values())),
        "_sessions": json.loads(sessions.read_text()) if sessions.exists() else []}


def wall_to_loss(evals: list[dict], target: float) -> float | None:
    """The run's wall-clock seconds at which the eval loss first reaches ``target``, linear
    between evaluations (:func:`bench.analysis.x_to_loss`); None if it never does (or the
    records carry no wall clock)."""
    from bench.analysis import x_to_loss

    if any(e["wall_s"] is None for e in evals):
        return None
    return x_to_loss([{"loss": e["eval_loss"], "wall_s": e["wall_s"]} for e in evals], target, "wall_s")


def standalone_rates(rounds: dict) -> list[float]:
    """Each group's standalone tokens/s (all_results.json ``rounds``). Results written before
    ``timed_steps`` existed divided the timed seconds by every step although each round's first
    step was not timed (the round clock restarted unset at every round end): their rates are
    scaled by (steps - rounds) / steps, the steps those seconds timed."""
    rates = rounds["standalone_tokens_per_s"]
    if "timed_steps" in rounds:
        return list(rates)
    n = rounds["num_rounds"]
    return [r * (s - n) / s if s > n else r for r, s in zip(rates, rounds["group_steps"])]


def row_of(results: dict, trigger: str, ratio_text: str, link: str = "loopback",
           link_rate: float | None = None) -> dict:
    """speed.json's row of one run (``link_rate``: the emulated link's measured bits/s)."""
    rounds = results.get("rounds")
    tokens_per_s = results["train_tokens"] / results["train_seconds"]  # every row alike: the federation's tokens
    if rounds is None:  # the barrier: every group did every step; its wait is the sync's share
        wait = results.get("sync_time_share")
        return {"run": results["_name"], "trigger": "barrier", "speed_ratio": ratio_text, "link": link,
                "wait_share": [wait, wait] if wait is not None else None, "tokens_per_s": tokens_per_s,
                "standalone_tokens_per_s": None, "slowdown_method": METHOD,
                "steps_per_round": None, "group_steps": [results["steps"]] * F,
                "final_eval_loss": results["eval_loss"], "wall_s": results["wall_seconds"],
                "arrival_share": results.get("sync_arrival_share_by_group"), **_raw(results, link_rate)}
    standalone = standalone_rates(rounds)
    return {"run": results["_name"], "trigger": trigger, "speed_ratio": ratio_text, "link": link,
            "wait_share": rounds["wait_share"], "tokens_per_s": tokens_per_s,
            "standalone_tokens_per_s": standalone, "of_standalone_sum": tokens_per_s / sum(standalone),
            "slowdown_method": METHOD,
            "steps_per_round": rounds["steps_per_round"], "group_steps": rounds["group_steps"],
            "round_end_s": rounds["round_end_s"], "final_eval_loss": results["eval_loss"],
            "wall_s": results["wall_seconds"], "arrival_share": results.get("sync_arrival_share_by_group"),
            **_raw(results, link_rate)}


def _raw(results: dict, link_rate: float | None) -> dict:
    """A row's raw data: its evaluations, step-time summary, sessions (load average) and link rate."""
    return {"evals": results.get("_evals", []), "step_s": results.get("_step_s"),
            "sessions": results.get("_sessions", []), "link_rate_bits_per_s": link_rate}


def table(rows: list[dict], args) -> str:
    def pct(x):
        return "-" if x is None else f"{100 * x:.0f}%"

    lines = [f"# Federation groups of unequal speed ({args.name})", "",
             f"2 groups x 2 ranks (FL+FSDP), tiny Llama, seq_len {args.setting['seq_len']}, micro-batch "
             f"{args.setting['micro_batch_size']}, {args.max_steps} steps' tokens, H=8 (\"steps\", and the first round "
             f"of \"speed\"), \"time\" windows of {args.window_s} s, fp32 "
             + ("nesterov(0.7, 0.9) (the convergence grid's fl_fsdp-h8-nesterov row)"
                if "--outer_optimizer" in args.setting["flags"] else "avg")
             + (f", loopback" if args.link is None else f", 2 emulated nodes (group f on node f) with links shaped to "
                f"{args.link} (scripts/netemu.py)") + f". Slow group: {METHOD}, group 0 {args.fast_cpus:g} CPUs.", "",
             "| ratio | trigger | tokens/s | of the groups' standalone sum | at syncs (group 0, 1) | "
             "of which waiting for the other group (group 0, 1) | steps (group 0, 1) | mean steps per round "
             "(group 0, 1) | final eval loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        spr = r.get("steps_per_round")
        mean = "-" if not spr else ", ".join(f"{sum(s) / len(s):.1f}" for s in spr)
        wait = "-" if r["wait_share"] is None else ", ".join(pct(w) for w in r["wait_share"])
        arrival = "-" if not r.get("arrival_share") else ", ".join(pct(a) for a in r["arrival_share"])
        lines.append(f"| {r['speed_ratio']} | {r['trigger']} | {r['tokens_per_s']:.0f} | "
                     f"{pct(r.get('of_standalone_sum'))} | {wait} | {arrival} | "
                     f"{', '.join(str(n) for n in r['group_steps'])} | "
                     f"{mean} | {r['final_eval_loss']:.4f} |")
    if args.quality:
        lines += quality_lines(rows, args.quality)
    lines += ["", "tokens/s: every group's tokens over the training seconds of the main process (group 0's rank 0), "
              "syncs included, for every row. Standalone: each group's tokens per second of its own timed training "
              "steps (no waiting; runs from before all_results.json had `timed_steps` are corrected for the "
              "untimed first step of each round, `standalone_rates`). At syncs: each group's seconds in sync events over its wall time; of which waiting: "
              "the seconds in each sync's first world collective, where a group waits for the other to arrive "
              "(`sync_arrival_share_by_group` of all_results.json: the exchange itself excluded).", "", "Barrier rows: waiting = the run's `sync_time_share` (every group's sync wait, the slow group's "
              "compute included for the fast one); standalone rates are not measured there.", "",
              "Command: see `command.txt`. Plot: `tokens_over_time.png`."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, tokens_per_rank_step: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.get("round_end_s") and r["speed_ratio"] != "1:1"]
    if not shown:
        return
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 3.6), squeeze=False)
    for ax, r in zip(axes[0], shown):
        for f, steps in enumerate(r["steps_per_round"]):
            tokens, total = [0], 0
            for n in steps:
                total += n * G * tokens_per_rank_step
                tokens.append(total)
            ax.plot(r["round_end_s"], tokens[1:], marker=".", label=f"group {f}")
        for t in r["round_end_s"]:
            ax.axvline(t, color="grey", lw=0.4, alpha=0.5)
        ax.set_title(f"{r['trigger']} trigger, {r['speed_ratio']}")
        ax.set_xlabel("seconds since the start (start-up included; grey: syncs)")
        ax.set_ylabel("tokens trained by the group")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reference(grid: Path) -> dict:
    """From a convergence grid's bench.json: its pooled seed sd and the rule's threshold
    (``bench.analysis.seeds_of``), FSDP's half-budget loss and the final eval loss of
    :data:`REFERENCE_ROW` (the 1:1 run)."""
    bench = json.loads((grid / "bench.json").read_text())
    seeds = bench["results"]["seeds"]
    return {"grid": grid.name, "pooled_sd": seeds["pooled_sd"], "threshold": seeds["threshold"],
            "fsdp_half_budget_loss": bench["results"]["target"]["loss"],
            "reference_final_eval_loss": bench["runs"][REFERENCE_ROW]["eval_loss"]}


def quality(rows: list[dict], ref: dict) -> dict:
    """Issue 30's quality check on the ``convergence`` rows: per 2:1 row the final eval loss
    against the 1:1 run (nats, pooled seed sd, and whether it counts: |Δ| > the grid's
    threshold) and the wall-clock seconds to FSDP's half-budget loss; per non-barrier row that
    time over the barrier row's at the same ratio."""
    from bench.analysis import counts, in_sd

    out = dict(ref)
    barrier = {r["speed_ratio"]: wall_to_loss(r["evals"], ref["fsdp_half_budget_loss"]) for r in rows
               if r["trigger"] == "barrier"}
    out["rows"] = []
    for r in rows:
        d = r["final_eval_loss"] - ref["reference_final_eval_loss"]
        t = wall_to_loss(r["evals"], ref["fsdp_half_budget_loss"])
        b = barrier.get(r["speed_ratio"])
        out["rows"].append({"run": r["run"], "trigger": r["trigger"], "speed_ratio": r["speed_ratio"],
                            "final_eval_loss": r["final_eval_loss"], "delta_vs_1to1": d,
                            "delta_in_sd": in_sd(d, ref["pooled_sd"]), "counts": counts(d, ref["threshold"]),
                            "wall_s_to_fsdp_half_budget": t, "of_barrier": t / b if t is not None and b else None})
    return out


def quality_lines(rows: list[dict], q: dict) -> list[str]:
    def m(s):
        return "-" if s is None else f"{s / 60:.1f}"

    lines = ["", f"## Quality at unequal speed (against the grid `{q['grid']}`)", "",
             f"1:1 = the grid's `{REFERENCE_ROW}` row (final eval loss {q['reference_final_eval_loss']:.4f}; at 1:1 the "
             f"barrier run is that row). The grid's pooled seed sd {q['pooled_sd']:.4f} nats: a difference counts "
             f"above 2 sd = {q['threshold']:.4f}; FSDP's half-budget loss "
             f"{q['fsdp_half_budget_loss']:.4f}. Minutes: the run's wall clock (start-up, training, evaluations, "
             "checkpoints) at the first evaluation at or below it, linear between evaluations.", "",
             "| ratio | trigger | final eval loss | Δ vs 1:1 (nats) | Δ (pooled sd) | "
             f"abs Δ > {q['threshold']:.4f} | "
             "min to FSDP's half-budget loss | of the barrier's |", "|---|---|---|---|---|---|---|---|"]
    for r in q["rows"]:
        lines.append(f"| {r['speed_ratio']} | {r['trigger']} | {r['final_eval_loss']:.4f} | {r['delta_vs_1to1']:+.4f} | "
                     f"{r['delta_in_sd']:+.1f} | {'counts' if r['counts'] else 'within noise'} | "
                     f"{m(r['wall_s_to_fsdp_half_budget'])} | "
                     + ("-" if r["of_barrier"] is None else f"{r['of_barrier']:.2f}") + " |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speed_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default=time.strftime("%Y-%m-%d") + "-speed")
    p.add_argument("--setting", default="quick", choices=sorted(SETTINGS),
                   help="quick: throughput (seq_len 64, no evaluations); convergence: the grid's nesterov row, 832 "
                        "steps, evaluations, checkpoints (resumable), and, at its 832 steps, the quality check against "
                        "--grid")
    p.add_argument("--grid", default="2026-12-03-grid", help="convergence results folder under bench/results "
                   "(--setting convergence: the pooled seed sd, FSDP's half-budget loss and the 1:1 row)")
    p.add_argument("--max_steps", type=int, default=None, help="steps' tokens of each run (default: the setting's)")
    p.add_argument("--log_every", type=int, default=None, help="the recipe's --log_every (default: the setting's)")
    p.add_argument("--window_s", type=float, default=4.0)
    p.add_argument("--ratios", default="1:1,2:1")
    p.add_argument("--fast_cpus", type=float, default=0.8, help="CPUs of group 0's cgroup (group 1: that / ratio)")
    p.add_argument("--triggers", default=",".join(TRIGGERS))
    p.add_argument("--link", default=None, help="tc rate of an emulated 2-node network (scripts/netemu.py; group f on "
                   "node f), e.g. 100mbit; default: loopback")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run (default 1800; convergence 4 h)")
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    name = args.setting
    args.setting = SETTINGS[name] if args.log_every is None else {**SETTINGS[name], "log_every": args.log_every}
    args.max_steps = args.max_steps or args.setting["steps"]
    args.timeout = args.timeout or (14400.0 if name == "convergence" else 1800.0)
    args.quality = None
    if name == "convergence" and args.max_steps == args.setting["steps"]:  # the grid's budget: comparable losses
        try:
            args.quality = reference(ROOT / "bench" / "results" / args.grid)
        except (OSError, KeyError, ValueError) as exc:
            print(f"error: --grid {args.grid}: no convergence bench.json with the row {REFERENCE_ROW} ({exc})",
                  file=sys.stderr)
            return 2
    ratios = [r.strip() for r in args.ratios.split(",") if r.strip()]
    try:
        for r in ratios:
            parse_ratio(r)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not (os.geteuid() == 0 and (CGROUP_CPU / "cgroup.procs").exists()):
        print(f"error: limiting the groups' CPU needs root and the cgroup-v1 cpu controller at {CGROUP_CPU}",
              file=sys.stderr)
        return 2
    work, dest = ROOT / "bench" / "work" / args.name, ROOT / "bench" / "results" / args.name
    cache = ROOT / "bench" / "work" / "cache"
    rows, link_rate = [], None
    with contextlib.ExitStack() as stack:
        args.emulator = None
        if args.link is not None:
            from scripts import netemu

            from bench.launch import measure_link

            args.emulator = stack.enter_context(netemu.Emulator(F, args.link))
            link_rate = measure_link(args.emulator, 2.0).get("achieved_bits_per_s")
        for ratio in ratios:
            for trigger in [t.strip() for t in args.triggers.split(",")]:
                print(f"[speed] {ratio} {trigger}" + (f" at {args.link}" if args.link else "") + " ...", flush=True)
                rows.append(row_of(run_one(work, trigger, ratio, args, cache), trigger, ratio, args.link or "loopback",
                                   link_rate))
    dest.mkdir(parents=True, exist_ok=True)
    out = {"rows": rows}
    if args.quality:
        args.quality = out["quality"] = quality(rows, args.quality)
    (dest / "speed.json").write_text(json.dumps(out, indent=1))
    (dest / "table.md").write_text(table(rows, args))
    (dest / "command.txt").write_text("sudo nice -n 5 python -m bench.speed_bench " + " ".join(
        argv if argv is not None else sys.argv[1:]) + "\n")
    plot(rows, dest / "tokens_over_time.png", args.setting["seq_len"] * args.setting["micro_batch_size"])
    print((dest / "table.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
