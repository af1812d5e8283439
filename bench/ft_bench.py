"""Bench of the fault-tolerant mode (``--fault_tolerance torchft``): overhead and one failure.

Three runs of ``recipes/pretrain.py`` on this machine, 2 federation groups x 2 ranks, the
tiny Llama, the same steps, H=4, fp32 "avg", every step logged:

1. ``single``: today's single world (``torchrun --nproc_per_node 4``);
2. ``torchft``: the fault-tolerant mode without faults (a Lighthouse and one torchrun per
   group, :mod:`scripts.ft_launch`);
3. ``failure``: the same, but every process of group 1 is killed with SIGKILL once it has
   logged ``--kill_step`` and restarted ``--outage_s`` seconds later (into its own folder:
   the restart is a fresh launch); it heals from group 0 at its first sync.

Figures (``table.md``, ``summary.json``, ``tokens_over_time.png`` under
``bench/results/<name>/``; every launch's logged records in ``curves.csv``: suite ``ft``, run =
the launch's folder, e.g. ``failure/restart/group1``; :mod:`bench.compact`):

* tokens/s of the federation: the sum over groups of each group's training tokens / its
  ``train_seconds`` (all_results.json; the single world's own figure);
* the overhead of the mode: 1 - torchft / single;
* the survivors' tokens/s during the outage: group 0's tokens logged between the kill and
  group 1's first logged step after its restart, over that time (``unix_time`` of the
  records), against group 0's tokens/s in the failure-free torchft run;
* seconds lost: (tokens the federation would have trained at the failure-free torchft
  rate over the failure run's training span - the tokens it trained) / that rate; and
  group 1's down time (kill to its first logged step after the restart);
* final eval loss of the failure run (group 0, after the final sync) against the
  failure-free run's.

The links are the loopback interface (no emulated link: the Lighthouse and the groups'
stores all bind 127.0.0.1). Run it niced on a quiet machine; on a shared 2-core machine the
timings are noisy (the table records the other processes' CPU share per run)::

    nice -n 10 python -m bench.ft_bench [--steps 360] [--kill_step 40] [--outage_s 20] [--report_only]

``--link 100mbit`` measures the overhead alone on the emulated 2-node link of the
baseline bench (:class:`scripts.netemu.Emulator`, root needed; one group per node, the
Lighthouse on node 0; the single world as ``torchrun --nnodes 2``), with the baseline
bench's recipe settings (seq_len 256, micro-batch 4, H=8, fp32 "avg"), the two modes
alternated ``--repeats`` times; it writes ``link_table.md`` and ``link_summary.json`` (which
holds every run's figures)::

    nice -n 15 python -m bench.ft_bench --link 100mbit [--steps 48] [--repeats 3] --name <date>-ft
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from bench import compact  # noqa: E402
from scripts import ft_launch
from recipes.host_load import HostLoad  # noqa: E402
from scripts.launch import child_env, free_port, start, terminate, torchrun_argv, wait  # noqa: E402

RECIPE = ROOT / "recipes" / "pretrain.py"
G = 2  # ranks per group
F = 2  # federation groups
CURVE_METRICS = ("train/loss", "eval/loss", "eval/perplexity", "unix_time")
"""What curves.csv keeps of every record (the plot and the outage figures read ``unix_time``)."""


def recipe_args(steps: int, out: Path, cache: Path) -> list[str]:
    return ["--model", "tiny", "--seq_len", "64", "--micro_batch_size", "2", "--max_steps", str(steps),
            "--log_every", "1", "--eval_every", "0", "--max_eval_blocks", "32", "--sync_every", "4",
            "--num_groups", str(F), "--report_to", "none", "--save_final_model", "false",
            "--output_dir", str(out), "--cache_dir", str(cache)]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_single(work: Path, steps: int, cache: Path, timeout: float) -> dict:
    out = work / "single"
    shutil.rmtree(out, ignore_errors=True)
    log = open(work / "single.log", "w")
    load = HostLoad().start()
    proc = start(torchrun_argv(F * G, RECIPE, *recipe_args(steps, out, cache), port=free_port()),
                 env=child_env(pythonpath=[str(ROOT)]), cwd=ROOT, stdout=log, stderr=log)
    res = wait(proc, timeout)
    host = load.stop()
    if res.returncode != 0:
        raise RuntimeError(f"single-world run failed ({res.returncode}); see {work / 'single.log'}")
    results = json.loads((out / "all_results.json").read_text())
    return {"tokens_per_s": results["tokens_per_s"], "eval_loss": results["eval_loss"],
            "train_seconds": results["train_seconds"], "host": host, "out": str(out)}


def _group(f, steps, out, cache, addr, log):
    return ft_launch.start_group(f, G, RECIPE, "--fault_tolerance", "torchft", *recipe_args(steps, out, cache),
                                 lighthouse=addr, cwd=ROOT, stdout=log, stderr=log, pythonpath=[str(ROOT)])


def run_torchft(work: Path, name: str, steps: int, cache: Path, timeout: float, kill_step: int | None = None,
                outage_s: float = 20.0) -> dict:
    """One torchft run; with ``kill_step`` group 1 is killed once it logged that step and
    restarted ``outage_s`` later into ``<name>/restart``."""
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    lighthouse, addr = ft_launch.start_lighthouse(log=open(out / "lighthouse.log", "w"), min_replicas=1)
    load = HostLoad().start()
    events: dict = {}
    procs = []
    try:
        procs = [_group(f, steps, out, cache, addr, open(out / f"group{f}.log", "w")) for f in range(F)]
        if kill_step is not None:
            metrics1 = out / "group1" / "metrics.jsonl"
            deadline = time.monotonic() + timeout
            while not any(r.get("step", 0) >= kill_step for r in read_jsonl(metrics1)):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"{name}: group 1 never reached step {kill_step}")
                time.sleep(0.2)
            ft_launch.kill_group(procs[1], signal.SIGKILL)
            events["kill"] = time.time()
            time.sleep(outage_s)
            events["restart"] = time.time()
            procs.append(_group(1, steps, out / "restart", cache, addr, open(out / "group1_restart.log", "w")))
            procs[1] = None
        codes = [wait(p, timeout).returncode for p in procs if p is not None]
    finally:
        for p in procs:
            if p is not None and p.poll() is None:
                ft_launch.kill_group(p)
        terminate(lighthouse)
    host = load.stop()
    if any(c != 0 for c in codes):
        raise RuntimeError(f"{name}: group exit statuses {codes}; see {out}/*.log")
    folders = {0: [out / "group0"], 1: [out / "group1"] + ([out / "restart" / "group1"] if kill_step else [])}
    results = {f: [json.loads((d / "all_results.json").read_text()) for d in dirs if (d / "all_results.json").exists()]
               for f, dirs in folders.items()}
    metrics = {f: [read_jsonl(d / "metrics.jsonl") for d in dirs] for f, dirs in folders.items()}
    return {"results": results, "metrics": metrics, "events": events, "host": host, "out": str(out)}


def own_tokens(part: list[dict]) -> list[tuple[float, int]]:
    """(unix time, tokens) of one launch's logged steps; the recipe's ``tokens`` counts the
    steps the launch trained itself (a heal jumps the step count, not the tokens)."""
    return [(r["unix_time"], int(r["tokens"])) for r in part if "unix_time" in r and "train/loss" in r]


def analyse(single: dict, free: dict, fail: dict) -> dict:
    def fed_tps(run):
        return sum(r[-1]["train_tokens"] / r[-1]["train_seconds"] for r in run["results"].values())

    free_tps, single_tps = fed_tps(free), single["tokens_per_s"]
    g0_free = free["results"][0][0]["tokens_per_s"]
    kill, restart = fail["events"]["kill"], fail["events"]["restart"]
    g1_back = own_tokens(fail["metrics"][1][1])
    back = g1_back[0][0] if g1_back else None
    g0 = own_tokens(fail["metrics"][0][0])
    during = [(t, n) for t, n in g0 if kill <= t <= (back or restart)]
    outage_tps = (during[-1][1] - during[0][1]) / (during[-1][0] - during[0][0]) if len(during) > 1 else None
    stamps = [t for parts in fail["metrics"].values() for m in parts for t, _ in own_tokens(m)]
    span = max(stamps) - min(stamps)  # first to last logged step of any launch
    trained = sum(own_tokens(m)[-1][1] for parts in fail["metrics"].values() for m in parts if own_tokens(m))
    first1 = own_tokens(fail["metrics"][1][0])
    pre_kill_tokens1 = first1[-1][1] if first1 else 0
    healed = fail["results"][1][-1]["fault_tolerance"]
    return {
        "single_tokens_per_s": single_tps, "torchft_tokens_per_s": free_tps,
        "overhead": 1 - free_tps / single_tps,
        "group0_tokens_per_s_failure_free": g0_free,
        "group0_tokens_per_s_during_outage": outage_tps,
        "outage_window_s": ((back or restart) - kill),
        "group1_down_s": (back - kill) if back else None,
        "group1_restart_to_first_step_s": (back - restart) if back else None,
        "failure_run_span_s": span, "failure_run_tokens": trained,
        "seconds_lost": span - trained / free_tps,
        "group1_tokens_before_kill": pre_kill_tokens1,
        "group1_heals": healed["heals"], "group1_steps_trained_after_restart": healed["steps_trained"],
        "final_eval_loss_failure_free": free["results"][0][0]["eval_loss"],
        "final_eval_loss_failure": fail["results"][0][0]["eval_loss"],
        "final_eval_loss_failure_group1": fail["results"][1][-1]["eval_loss"],
        "final_eval_loss_single": single["eval_loss"],
        "host_other_cpu_share": {"single": single["host"].get("background_cpu_share"),
                                 "torchft": free["host"].get("background_cpu_share"),
                                 "failure": fail["host"].get("background_cpu_share")},
    }


def plot(fail: dict, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(own_tokens(m)[0][0] for parts in fail["metrics"].values() for m in parts if own_tokens(m))
    fig, ax = plt.subplots(figsize=(7.5, 4))
    g0 = own_tokens(fail["metrics"][0][0])
    ax.plot([t - t0 for t, _ in g0], [n for _, n in g0], label="group 0 (survivor)", color="C0")
    base = 0
    for i, part in enumerate(fail["metrics"][1]):
        pts = own_tokens(part)
        ax.plot([t - t0 for t, _ in pts], [base + n for _, n in pts], color="C1",
                label="group 1" + (f" (restarted; heals: {summary['group1_heals']})" if i else " (killed)"))
        base += pts[-1][1] if pts else 0
    kill, back = fail["events"]["kill"] - t0, fail["events"]["kill"] - t0 + (summary["group1_down_s"] or 0)
    ax.axvspan(kill, back, color="0.85", label="group 1 down (kill to first step after restart)")
    ax.axvline(fail["events"]["restart"] - t0, color="0.4", ls="--", lw=1, label="group 1 restarted")
    ax.set_xlabel("wall time since the first logged step (s)")
    ax.set_ylabel("training tokens (this group's own)")
    ax.set_title("torchft mode, 2 groups x 2 ranks: group 1 killed and restarted (loopback, shared 2-core CPU)",
                 fontsize=8)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_curves(dest: Path, root: Path, runs=("single", "torchft", "failure")) -> Path:
    """Every launch's metrics.jsonl under ``root/<run>/`` (``root``: the work folder) into
    ``dest/curves.csv`` (:data:`CURVE_METRICS`; group 1's killed launch included)."""
    rows = []
    for run in runs:
        for mpath in sorted((root / run).rglob("metrics.jsonl")):
            rel = mpath.parent.relative_to(root).as_posix()
            rows += compact.curve_rows("ft", rel, read_jsonl(mpath), CURVE_METRICS)
    return Path(compact.write_curves(str(dest / compact.CURVES_FILE), rows))


def _date(summary: dict) -> str:
    """The day the runs were measured: the failure's kill time (UTC), else the recorded date, else today."""
    kill = (summary.get("events") or {}).get("kill")
    if kill:
        return time.strftime("%Y-%m-%d", time.gmtime(kill))
    return summary.get("date") or time.strftime("%Y-%m-%d")


def table(summary: dict, args) -> str:
    s = summary
    share = s["host_other_cpu_share"]

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.0f}%"

    def num(x, fmt="{:.0f}"):
        return "n/a" if x is None else fmt.format(x)

    return "\n".join([
        f"# torchft mode: overhead and one failure ({_date(summary)})",
        "",
        f"2 federation groups x 2 ranks, tiny Llama (2.9M parameters), seq_len 64, micro-batch 2, "
        f"{args.steps} steps, H=4, fp32 avg, every step logged. CPU/gloo on one machine, loopback links "
        f"(no emulated link). **Noisy:** a shared 2-core machine (other processes' CPU share per run: "
        f"single {pct(share['single'])}, torchft {pct(share['torchft'])}, failure {pct(share['failure'])}); "
        f"8 processes share 2 cores, so these are relative figures of one sitting, not speeds.",
        "",
        "| run | federation tokens/s | final eval loss |",
        "|---|---|---|",
        f"| single world (torchrun, 4 ranks) | {num(s['single_tokens_per_s'])} | {s['final_eval_loss_single']:.4f} |",
        f"| torchft, no fault | {num(s['torchft_tokens_per_s'])} | {s['final_eval_loss_failure_free']:.4f} |",
        f"| torchft, group 1 killed at step {args.kill_step}, restarted {args.outage_s:.0f} s later | "
        f"{num(s['failure_run_tokens'] / s['failure_run_span_s'])} (tokens / wall span) | "
        f"{s['final_eval_loss_failure']:.4f} (group 1: {s['final_eval_loss_failure_group1']:.4f}) |",
        "",
        f"- Overhead of the mode without faults: {pct(s['overhead'])} of the single world's tokens/s.",
        f"- Survivor (group 0) during the outage: {num(s['group0_tokens_per_s_during_outage'])} tokens/s, "
        f"against {num(s['group0_tokens_per_s_failure_free'])} in the failure-free run (window "
        f"{s['outage_window_s']:.1f} s, kill to group 1's first step after the restart).",
        f"- Group 1 down for {num(s['group1_down_s'], '{:.1f}')} s: {args.outage_s:.0f} s outage + "
        f"{num(s['group1_restart_to_first_step_s'], '{:.1f}')} s from the restart to its first step "
        f"(interpreter start, data, model, prepare); it healed {s['group1_heals']} time(s) at its first sync and "
        f"trained {s['group1_steps_trained_after_restart']} steps itself after the restart.",
        f"- Seconds lost by the federation: {s['seconds_lost']:.1f} s (tokens it would have trained at the "
        f"failure-free torchft rate over the failure run's {s['failure_run_span_s']:.1f} s, minus the "
        f"{s['failure_run_tokens']} it trained, over that rate).",
        f"- Final eval loss after the final sync: {s['final_eval_loss_failure']:.4f} with the failure, "
        f"{s['final_eval_loss_failure_free']:.4f} without (group 1's lost steps are the difference).",
        "",
        "Reading these figures: the 8 processes share 2 cores, so while group 1 is down group 0 gets its CPU "
        "and runs faster (the plot's steeper blue line right after the kill), and slows again while group 1's "
        "restart loads; the federation's seconds lost can therefore come out near zero or negative here. On "
        "machines where each group has its own hardware the survivor's rate would not rise, and the federation "
        "would lose about group 1's down time times its share of the tokens/s.",
        "",
        "Plot: tokens_over_time.png. Curves: curves.csv (every launch's logged records: training loss, tokens, "
        "training seconds, unix time; group 1's killed launch included).",
        "",
    ])


def link_args(steps: int, out: str, cache: Path) -> list[str]:
    return ["--model", "tiny", "--seq_len", "256", "--micro_batch_size", "4", "--max_steps", str(steps),
            "--mixed_precision", "no", "--num_groups", str(F), "--sync_every", "8", "--eval_every", "0",
            "--log_every", "8", "--max_eval_blocks", "32", "--report_to", "none", "--save_final_model", "false",
            "--output_dir", out, "--cache_dir", str(cache)]


def run_link(args, work: Path, cache: Path) -> dict:
    """The single world and the torchft mode, alternated ``args.repeats`` times on one
    emulated 2-node link; per run the federation's tokens/s (single: its ``tokens_per_s``;
    torchft: the sum over groups of tokens / ``train_seconds``) and the wire bytes."""
    from scripts.netemu import Emulator

    env = child_env({"FL_ACCEL_COLLECTIVE_TIMEOUT_S": "600"}, pythonpath=[str(ROOT)])
    runs: dict = {"single": [], "torchft": []}
    with Emulator(2, args.link) as emu:
        link = emu.measure(seconds=2.0)
        for i in range(args.repeats):
            for kind in ("single", "torchft") if i % 2 == 0 else ("torchft", "single"):
                out = work / f"link-{kind}-{i}"
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir(parents=True)
                load, wire0, t0 = HostLoad().start(), emu.link_bytes(), time.time()
                if kind == "single":
                    rc = emu.run_torchrun([str(RECIPE), *link_args(args.steps, str(out), cache)], nproc_per_node=G,
                                          master_port=29500, env=env, timeout=args.timeout,
                                          stdout=open(out / "log", "w"), stderr=subprocess.STDOUT)
                    codes = [rc]
                    results = [json.loads((out / "all_results.json").read_text())] if rc == 0 else []
                    tps = results[0]["tokens_per_s"] if results else None
                else:
                    lighthouse = emu.popen(0, ft_launch.lighthouse_argv(29510, emu.address(0), min_replicas=F),
                                           env=env, stdout=open(out / "lighthouse.log", "w"), stderr=subprocess.STDOUT)
                    groups = [emu.popen(f, torchrun_argv(G, RECIPE, "--fault_tolerance", "torchft",
                                                         *link_args(args.steps, str(out), cache), port=29520,
                                                         master_addr=emu.address(f)),
                                        env=ft_launch.group_env(f, f"http://{emu.address(0)}:29510",
                                                                {"FL_ACCEL_COLLECTIVE_TIMEOUT_S": "600"}, [str(ROOT)]),
                                        stdout=open(out / f"group{f}.log", "w"), stderr=subprocess.STDOUT)
                              for f in range(F)]
                    codes = [wait(g, args.timeout).returncode for g in groups]
                    terminate(lighthouse)
                    results = [json.loads((out / f"group{f}" / "all_results.json").read_text())
                               for f in range(F) if codes == [0] * F]
                    tps = sum(r["train_tokens"] / r["train_seconds"] for r in results) if results else None
                wire1 = emu.link_bytes()
                runs[kind].append({"tokens_per_s": tps, "codes": codes, "wall_s": time.time() - t0,
                                   "host": load.stop(), "out": str(out),
                                   "sync_time_share": [r.get("sync_time_share") for r in results],
                                   "train_seconds": [r.get("train_seconds") for r in results],
                                   "torchft_seconds": [r.get("fault_tolerance", {}).get("torchft_seconds")
                                                       for r in results],
                                   "wire_tx_mb": sum(wire1[k]["tx_bytes"] - wire0[k]["tx_bytes"] for k in wire1) / 1e6})
                print(f"[ft_bench] {args.link} {kind} #{i}: {tps} tokens/s (exit {codes})", flush=True)
    return {"link": link, "runs": runs}


def link_table(summary: dict) -> str:
    s, runs = summary, summary["runs"]

    def row(kind):
        return [r["tokens_per_s"] for r in runs[kind]]

    def share(run):
        return run["host"].get("background_cpu_share", 0)

    return "\n".join([
        f"# torchft mode: overhead on the emulated {s['settings']['link']} link ({_date(summary)})",
        "",
        f"2 emulated nodes (network namespaces, tc tbf {s['settings']['link']} per node and direction; measured "
        f"single TCP stream {s['link']['bits_per_s'] / 1e6:.0f} Mbit/s), one federation group of 2 ranks per node. "
        f"Recipe as the baseline bench: tiny Llama, seq_len 256, micro-batch 4, {s['settings']['steps']} steps, "
        f"H=8, fp32 avg, no evaluation during training. single = today's single world (torchrun --nnodes 2); "
        f"torchft = a Lighthouse on node 0 and one torchrun per group (every quorum waits for both groups). The "
        f"two modes alternate, {s['settings']['repeats']} runs each; on a 2-core "
        f"machine (other processes' CPU share per run in link_summary.json).",
        "",
        "| mode | tokens/s per run | median | train s per run | sync s per run | mean sync_time_share | "
        "other processes' CPU share per run |",
        "|---|---|---|---|---|---|---|",
        *[f"| {kind} | {', '.join(f'{x:,.0f}' for x in row(kind) if x)} | {s['median'][kind]:,.0f} | "
          f"{', '.join(f'{x:.0f}' for x in s['train_seconds'][kind])} | "
          f"{', '.join(f'{x:.1f}' for x in s['sync_seconds'][kind])} | {s['sync_share'][kind]:.3f} | "
          f"{', '.join(f'{100 * share(r):.0f}%' for r in runs[kind])} |"
          for kind in ("single", "torchft")],
        "",
        f"- Overhead of the torchft mode: **{100 * s['overhead']:.1f}%** of the single world's tokens/s "
        f"(1 - median torchft / median single; per pair of adjacent runs: "
        f"{', '.join(f'{100 * x:.1f}%' for x in s['pair_overheads'])}).",
        f"- Per CPU the bench got (tokens/s / (1 - other processes' CPU share), medians): single "
        f"{s['per_cpu']['single']:,.0f}, torchft {s['per_cpu']['torchft']:,.0f}: overhead "
        f"**{100 * (1 - s['per_cpu']['torchft'] / s['per_cpu']['single']):.1f}%**.",
        f"- Overhead in sync time alone: **{100 * s['sync_overhead']:.1f}%** (median extra seconds the torchft "
        f"runs spent in sync events, over the single world's median train seconds; torchft: the mean over its "
        f"groups). Train seconds differ between runs by more than this: the machine's other work sets the pace "
        f"of the compute, and it changed from run to run.",
        f"- Where the torchft runs' sync time goes (rank 0 of each group, mean per sync event): "
        f"{s['per_sync']['quorum'] * 1e3:.0f} ms in torchft's quorum (`start_quorum`: the RPCs to the group's "
        f"ManagerServer and the Lighthouse, and the wait for the other group to arrive, which the single world "
        f"spends in its all-reduce instead), {s['per_sync']['commit'] * 1e3:.0f} ms in the commit vote "
        f"(`should_commit`), over {s['per_sync']['quorums']:.0f} quorums per group and run.",
        "",
    ])


def link_summarize(measured: dict, settings: dict) -> dict:
    """Medians, the overhead (1 - median torchft / median single, and per adjacent pair),
    the sync seconds per run (``sync_time_share`` x ``train_seconds``; torchft: the mean
    over the groups) and the sync-time overhead (the torchft runs' extra sync seconds over
    the single world's train seconds), and torchft's quorum/commit seconds per sync."""
    import statistics

    runs = measured["runs"]
    median = {k: statistics.median(r["tokens_per_s"] for r in rs) for k, rs in runs.items()}
    sync_s = {k: [statistics.mean(a * b for a, b in zip(r["sync_time_share"], r["train_seconds"])) for r in rs]
              for k, rs in runs.items()}
    train_s = {k: [statistics.mean(r["train_seconds"]) for r in rs] for k, rs in runs.items()}
    fts = [x for r in runs["torchft"] for x in r["torchft_seconds"] if x]
    per_sync = {k: statistics.mean(x[k] / max(1, x["quorums"]) for x in fts) for k in ("quorum", "commit")}
    return {**measured, "median": median, "overhead": 1 - median["torchft"] / median["single"],
            "pair_overheads": [1 - t["tokens_per_s"] / s["tokens_per_s"] for s, t in zip(runs["single"],
                                                                                       runs["torchft"])],
            "sync_share": {k: statistics.mean(x for r in rs for x in r["sync_time_share"] if x is not None)
                           for k, rs in runs.items()},
            "sync_seconds": sync_s, "train_seconds": train_s,
            "per_cpu": {k: statistics.median(r["tokens_per_s"] / max(1e-9, 1 - r["host"].get("background_cpu_share",
                                                                                             0)) for r in rs)
                        for k, rs in runs.items()},
            "sync_overhead": (statistics.median(sync_s["torchft"]) - statistics.median(sync_s["single"]))
            / statistics.median(train_s["single"]),
            "per_sync": {**per_sync, "quorums": statistics.mean(x["quorums"] for x in fts)}, "settings": settings}


def link_main(args) -> int:
    dest = ROOT / "bench" / "results" / args.name
    if args.report_only:  # recompute the figures and the table from the recorded runs
        summary = link_summarize(json.loads((dest / "link_summary.json").read_text()),
                                 json.loads((dest / "link_summary.json").read_text())["settings"])
    else:
        work = ROOT / "bench" / "work" / args.name
        work.mkdir(parents=True, exist_ok=True)
        measured = run_link(args, work, work / "cache")
        runs = measured["runs"]
        if any(r["tokens_per_s"] is None for rs in runs.values() for r in rs):
            raise RuntimeError(f"a run failed: {[(k, r['codes'], r['out']) for k, rs in runs.items() for r in rs]}")
        summary = link_summarize(measured, {k: v for k, v in vars(args).items() if k != "report_only"})
        summary["date"] = time.strftime("%Y-%m-%d", time.gmtime())
        dest.mkdir(parents=True, exist_ok=True)
    (dest / "link_summary.json").write_text(json.dumps(summary, indent=1))
    (dest / "link_table.md").write_text(link_table(summary))
    print((dest / "link_table.md").read_text())
    return 0


def report_only(name: str) -> None:
    """Rewrite ``results/<name>/table.md`` from its ``summary.json`` (after a change of the text)."""
    dest = ROOT / "bench" / "results" / name
    summary = json.loads((dest / "summary.json").read_text())
    (dest / "table.md").write_text(table(summary, argparse.Namespace(**summary["settings"])))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=360)
    parser.add_argument("--kill_step", type=int, default=40)
    parser.add_argument("--outage_s", type=float, default=20.0)
    parser.add_argument("--name", default=f"{time.strftime('%Y-%m-%d')}-ft",
                        help="results folder bench/results/<name> (default: <today>-ft)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    parser.add_argument("--report_only", action="store_true", help="rewrite table.md from summary.json")
    parser.add_argument("--link", default=None, help="e.g. 100mbit: the overhead alone on an emulated 2-node link")
    parser.add_argument("--repeats", type=int, default=3, help="--link: runs of each mode, alternated")
    args = parser.parse_args(argv)
    if args.link:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        return link_main(args)
    if args.report_only:
        report_only(args.name)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = ROOT / "bench" / "work" / args.name
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    t0 = time.monotonic()
    print(f"[ft_bench] single world ({args.steps} steps)", flush=True)
    single = run_single(work, args.steps, cache, args.timeout)
    print(f"[ft_bench] torchft, no fault ({time.monotonic() - t0:.0f} s so far)", flush=True)
    free = run_torchft(work, "torchft", args.steps, cache, args.timeout)
    print(f"[ft_bench] torchft, group 1 killed at step {args.kill_step} ({time.monotonic() - t0:.0f} s so far)",
          flush=True)
    fail = run_torchft(work, "failure", args.steps, cache, args.timeout, args.kill_step, args.outage_s)
    summary = analyse(single, free, fail)
    summary["events"] = fail["events"]
    summary["settings"] = vars(args)
    summary["bench_seconds"] = time.monotonic() - t0
    dest = ROOT / "bench" / "results" / args.name
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    write_curves(dest, work)  # group 1's killed first launch has metrics.jsonl only: it is included
    (dest / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(fail, summary, dest / "tokens_over_time.png")
    (dest / "table.md").write_text(table(summary, args))
    print((dest / "table.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
