"""Bench of federation groups of unequal speed (``FLConfig.sync_trigger``): issue 30's ``--suite speed``.

Runs of ``recipes/pretrain.py`` on this machine, 2 federation groups x 2 ranks (FL+FSDP),
the tiny Llama, the same token budget, on loopback (no emulated link: the point is compute
speed, not bytes). For each speed ratio (``1:1``, ``2:1``) and trigger (``steps``, today's
barrier; ``time``; ``speed``) one run. The speeds are set by a real compute limit: each
group's ranks run in a cgroup-v1 cgroup with a CPU quota (``cpu.cfs_quota_us``; group 0
``--fast_cpus`` CPUs, group 1 that over the ratio) and a high ``cpu.shares``, so the ratio
holds while the machine has their sum free (root and the cgroup "cpu" controller needed;
without them the bench says so and stops). The table says which method set each run's speeds.

Figures (from each run's ``all_results.json`` ``rounds``; the barrier run has none, so its
figures come from its own step time and sync wait), written to ``bench/results/<name>/``:

* ``speed.json``: ``rows``, one per run: ``trigger``, ``speed_ratio``, ``link``
  ("loopback"), ``wait_share`` per group, ``tokens_per_s``, ``standalone_tokens_per_s`` per
  group, ``slowdown_method``, steps per round per group, final eval loss;
* ``table.md`` and ``command.txt``; ``tokens_over_time.png``: tokens per group against wall
  seconds with a mark at each sync (the 2:1 runs).

Resumable: a run whose ``all_results.json`` exists is not run again (``--force`` reruns)::

    sudo nice -n 5 python -m bench.speed_bench --name <date>-speed [--max_steps 96] [--ratios 1:1,2:1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
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


def recipe_args(trigger: str, steps: int, window_s: float, out: Path, cache: Path) -> list[str]:
    args = ["--model", "tiny", "--seq_len", "64", "--micro_batch_size", "2", "--max_steps", str(steps),
            "--log_every", "4", "--eval_every", "0", "--max_eval_blocks", "32", "--sync_every", "8",
            "--algorithm", "fl_fsdp", "--num_groups", str(F), "--report_to", "none", "--save_final_model", "false",
            "--output_dir", str(out), "--cache_dir", str(cache), "--sync_trigger", trigger]
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
        return json.loads((out / "all_results.json").read_text()) | {"_name": name}
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = open(work / f"{name}.log", "w")
    proc = start(torchrun_argv(F * G, RECIPE, *recipe_args(trigger, args.max_steps, args.window_s, out, cache),
                               port=free_port()), env=child_env(pythonpath=[str(ROOT)]), cwd=ROOT, stdout=log,
                 stderr=log)
    limits = [GroupLimit(f"{name}_g{f}", cpus) for f, cpus in enumerate(quotas(ratio, args.fast_cpus))]
    try:  # group f = ranks fG..(f+1)G-1, placed as soon as they exist
        deadline, placed = time.monotonic() + 120, set()
        while len(placed) < F * G and time.monotonic() < deadline and proc.poll() is None:
            for rank, pid in rank_pids(proc.pid).items():
                if pid not in placed:
                    limits[rank // G].add(pid)
                    placed.add(pid)
            time.sleep(0.2)
        if len(placed) < F * G:
            raise RuntimeError(f"could not place every rank in its group's cgroup (placed {sorted(placed)})")
        res = wait(proc, args.timeout)
    finally:
        terminate(proc)
        for limit in limits:
            limit.remove()
    if res.returncode != 0:
        raise RuntimeError(f"{name} failed ({res.returncode}); see {work / f'{name}.log'}")
    return json.loads((out / "all_results.json").read_text()) | {"_name": name}


def row_of(results: dict, trigger: str, ratio_text: str) -> dict:
    """speed.json's row of one run."""
    rounds = results.get("rounds")
    tokens_per_s = results["train_tokens"] / results["train_seconds"]  # every row alike: the federation's tokens
    if rounds is None:  # the barrier: every group did every step; its wait is the sync's share
        wait = results.get("sync_time_share")
        return {"run": results["_name"], "trigger": "barrier", "speed_ratio": ratio_text, "link": "loopback",
                "wait_share": [wait, wait] if wait is not None else None, "tokens_per_s": tokens_per_s,
                "standalone_tokens_per_s": None, "slowdown_method": METHOD,
                "steps_per_round": None, "group_steps": [results["steps"]] * F,
                "final_eval_loss": results["eval_loss"]}
    return {"run": results["_name"], "trigger": trigger, "speed_ratio": ratio_text, "link": "loopback",
            "wait_share": rounds["wait_share"], "tokens_per_s": tokens_per_s,
            "standalone_tokens_per_s": rounds["standalone_tokens_per_s"],
            "of_standalone_sum": tokens_per_s / sum(rounds["standalone_tokens_per_s"]),
            "slowdown_method": METHOD,
            "steps_per_round": rounds["steps_per_round"], "group_steps": rounds["group_steps"],
            "round_end_s": rounds["round_end_s"], "final_eval_loss": results["eval_loss"]}


def table(rows: list[dict], args) -> str:
    def pct(x):
        return "-" if x is None else f"{100 * x:.0f}%"

    lines = [f"# Federation groups of unequal speed ({args.name})", "",
             f"2 groups x 2 ranks (FL+FSDP), tiny Llama, seq_len 64, micro-batch 2, {args.max_steps} steps' tokens, "
             f"H=8 (\"steps\", and the first round of \"speed\"), \"time\" windows of {args.window_s} s, fp32 avg, "
             f"loopback. Slow group: {METHOD}.", "",
             "| ratio | trigger | tokens/s | of the groups' standalone sum | waiting at syncs (group 0, 1) | "
             "steps (group 0, 1) | mean steps per round (group 0, 1) | final eval loss |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        spr = r.get("steps_per_round")
        mean = "-" if not spr else ", ".join(f"{sum(s) / len(s):.1f}" for s in spr)
        wait = "-" if r["wait_share"] is None else ", ".join(pct(w) for w in r["wait_share"])
        lines.append(f"| {r['speed_ratio']} | {r['trigger']} | {r['tokens_per_s']:.0f} | "
                     f"{pct(r.get('of_standalone_sum'))} | {wait} | {', '.join(str(n) for n in r['group_steps'])} | "
                     f"{mean} | {r['final_eval_loss']:.4f} |")
    lines += ["", "tokens/s: every group's tokens over the training seconds of the main process (group 0's rank 0), "
              "syncs included, for every row. Standalone: each group's tokens over its own timed training seconds "
              "(no waiting).", "", "Barrier rows: waiting = the run's `sync_time_share` (every group's sync wait, the slow group's "
              "compute included for the fast one); standalone rates are not measured there.", "",
              "Command: see `command.txt`. Plot: `tokens_over_time.png`."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
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
                total += n * G * 2 * 64  # ranks x micro-batch 2 x seq_len 64 (recipe_args)
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speed_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default=time.strftime("%Y-%m-%d") + "-speed")
    p.add_argument("--max_steps", type=int, default=96)
    p.add_argument("--window_s", type=float, default=4.0)
    p.add_argument("--ratios", default="1:1,2:1")
    p.add_argument("--fast_cpus", type=float, default=0.8, help="CPUs of group 0's cgroup (group 1: that / ratio)")
    p.add_argument("--triggers", default=",".join(TRIGGERS))
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
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
    rows = []
    for ratio in ratios:
        for trigger in [t.strip() for t in args.triggers.split(",")]:
            print(f"[speed] {ratio} {trigger} ...", flush=True)
            rows.append(row_of(run_one(work, trigger, ratio, args, cache), trigger, ratio))
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "speed.json").write_text(json.dumps({"rows": rows}, indent=1))
    (dest / "table.md").write_text(table(rows, args))
    (dest / "command.txt").write_text("sudo nice -n 5 python -m bench.speed_bench " + " ".join(
        argv if argv is not None else sys.argv[1:]) + "\n")
    plot(rows, dest / "tokens_over_time.png")
    print((dest / "table.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
