"""Bench of a torchft heal across an emulated 2-node link: heal seconds against the wire time.

Two emulated nodes (:class:`scripts.netemu.Emulator`: network namespaces, ``tc`` tbf per node
and direction; root needed), one federation group of 2 ranks per node, the torchft Lighthouse
on node 0. Each group runs ``recipes/pretrain.py --fault_tolerance torchft`` under its own
``torchrun`` with ``FL_ACCEL_HEAL_ADDRESS`` set to its node's NIC (the veth's interface name:
:func:`fl_accel.ft_net.resolve_address` turns it into the node's address). Without it every group
would advertise ``socket.gethostname()``, which resolves to 127.0.0.1 here: inside a namespace
that is the node's own loopback, so no heal could reach the other node (``--default_address``
runs that case once, to show it).

Per link rate and model (the tiny preset, 2.9M parameters, and a 24.2M-parameter Llama of the
same shape family: hidden 512, 5 layers, written to the work folder as a config.json), one run:
every process of group 1 is killed with SIGKILL once it logged ``kill_step``, and started again
(``--resume_from_checkpoint latest``: no checkpoint, so it must heal, ``federation.require_heal``)
after the Lighthouse's heartbeat timeout, as ``scripts/ft_launch.py`` restarts a group. Figures
(``summary.json``, ``table.md`` under ``bench/results/<name>/``; every run's logs and
metrics under ``bench/work/<name>/``):

* **heal seconds**: the restarted group's heal record (all_results.json ``fault_tolerance.heal_log``):
  ``seconds`` from the quorum's answer to the state applied, ``transfer_seconds`` of it the
  download and unpickling (slowest rank);
* **wire time**: the bytes the group's ranks downloaded (``wire_bytes``: the serialized states)
  over the link's rate, both the rate set (tbf) and a single TCP stream's measured rate; the
  ratio heal / wire time (the issue's goal: at most 1.5);
* **survivor stall**: from the kill to group 0's first committed sync of a round group 1 would
  have joined (its step records' ``unix_time``; a sync that did not commit is in its log), and
  group 0's longest gap between two step records around the kill;
* **rejoin seconds**: from the restart to the restarted group's first step after its heal
  (interpreter start-up, data, model, prepare, the wait for the survivor's next sync, the heal);
* the machine's load average (``os.getloadavg``) at each run's start and end, and the other
  processes' CPU share during it (:class:`recipes.host_load.HostLoad`): a low-priority
  benchmark shares this 2-core machine, so seconds of compute are noisy; the wire time is not.

Run it as root, niced, on a machine as quiet as possible::

    nice -n 5 python -m bench.ft_heal [--rates 100mbit 1gbit] [--models tiny 25m] [--name <date>-ft-heal]
    python -m bench.ft_heal --report_only --name <date>-ft-heal      # table.md from summary.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from recipes.host_load import HostLoad  # noqa: E402
from scripts import ft_launch  # noqa: E402
from scripts.launch import terminate, torchrun_argv, wait  # noqa: E402

RECIPE = ROOT / "recipes" / "pretrain.py"
G = 2  # ranks per group (one group per emulated node)
H = 4  # sync_every
MODEL_25M = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=8192, hidden_size=512,
                 intermediate_size=1536, num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=4,
                 max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                 eos_token_id=2)
"""24.2M parameters at the tokenizer's 8192 tokens (the recipe's BPE): embeddings and head 8.4M, 5 blocks of 3.15M."""
MODELS = {"tiny": {"steps": 120, "kill_step": 10}, "25m": {"steps": 60, "kill_step": 6}}
"""Run length and kill step per model: the survivor must still be training when the restarted
group reaches its first sync (about a minute of start-up on this machine)."""


def read_jsonl(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def last_step(path: Path) -> int:
    return max([r.get("step", 0) for r in read_jsonl(path) if "train/loss" in r] or [0])


def model_arg(model: str, work: Path) -> str:
    if model == "tiny":
        return "tiny"
    folder = work / "model_25m"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(MODEL_25M, indent=1))
    return str(folder)


def recipe_args(model: str, steps: int, out: Path, cache: Path) -> list[str]:
    return ["--fault_tolerance", "torchft", "--model", model, "--seq_len", "128", "--micro_batch_size", "2",
            "--max_steps", str(steps), "--num_groups", "2", "--sync_every", str(H), "--log_every", "1",
            "--eval_every", "0", "--max_eval_blocks", "16", "--report_to", "none", "--save_final_model", "false",
            "--mixed_precision", "no", "--output_dir", str(out), "--cache_dir", str(cache)]


def uncommitted_steps(log: Path) -> set[int]:
    """Optimizer steps whose sync did not commit (the recipe's warning in the group's log)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return set()
    return {int(m) for m in re.findall(r"sync \d+ \(optimizer step (\d+)\) not committed", text)}


def run_one(emu, rate: str, model: str, work: Path, cache: Path, default_address: bool = False,
            timeout: float = 1500.0) -> dict:
    """One run on the emulator ``emu``: both groups, the kill and restart of group 1, the figures."""
    name = f"{rate}-{model}" + ("-default-address" if default_address else "")
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    plan = MODELS[model]
    args = recipe_args(model_arg(model, work), plan["steps"], out / "out", cache)
    lighthouse_addr = f"http://{emu.address(0)}:29510"
    lighthouse = emu.popen(0, ft_launch.lighthouse_argv(29510, emu.address(0)), env={},
                           stdout=open(out / "lighthouse.log", "w"), stderr=subprocess.STDOUT)

    def start(f: int, attempt: int):
        extra = {"FL_ACCEL_COLLECTIVE_TIMEOUT_S": "300", "FL_ACCEL_REJOIN_TIMEOUT_S": "180"}
        if not default_address:
            extra["FL_ACCEL_HEAL_ADDRESS"] = emu.ifname(f)  # the node's NIC, by interface name
        argv = torchrun_argv(G, RECIPE, *args, *(["--resume_from_checkpoint", "latest"] if attempt else []),
                             port=29520 + attempt, master_addr=emu.address(f))
        env = ft_launch.group_env(f, lighthouse_addr, extra, pythonpath=[str(ROOT)])
        return emu.popen(f, argv, env=env, stdout=open(out / f"group{f}_a{attempt}.log", "w"),
                         stderr=subprocess.STDOUT)

    load, load_avg, events = HostLoad().start(), [os.getloadavg()], {}
    procs = {}
    try:
        procs[0], procs[1] = start(0, 0), start(1, 0)
        metrics1 = out / "out" / "group1" / "metrics.jsonl"
        deadline = time.monotonic() + timeout
        while last_step(metrics1) < plan["kill_step"]:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                raise RuntimeError(f"{name}: group 1 never reached step {plan['kill_step']} (see {out})")
            time.sleep(0.2)
        ft_launch.kill_group(procs[1], signal.SIGKILL)
        events["kill"] = time.time()
        events["killed_at_step"] = last_step(metrics1)
        time.sleep(ft_launch.LIGHTHOUSE_DEFAULTS["heartbeat_timeout_ms"] / 1000)  # as ft_launch's restart delay
        events["restart"] = time.time()
        procs[2] = start(1, 1)
        codes = {k: wait(p, max(1.0, deadline - time.monotonic())).returncode for k, p in procs.items() if k != 1}
    finally:
        for p in procs.values():
            if p.poll() is None:
                ft_launch.kill_group(p)
        terminate(lighthouse)
    load_avg.append(os.getloadavg())
    record = {"name": name, "rate": rate, "model": model, "codes": codes, "events": events, "host": load.stop(),
              "load_avg": load_avg, "default_address": default_address}
    return analyse(record, out)


def analyse(record: dict, out: Path) -> dict:
    """The run's figures from its folder ``out`` (the groups' all_results.json, metrics.jsonl
    and logs) and ``record["events"]`` (kill and restart times): the heal record, survivor
    stall and longest gap, rejoin seconds, the final checksums and eval losses; ``failed``
    when a launch did not end 0 or group 1 never healed."""
    events, codes = record["events"], record["codes"]
    results = {}
    for f in range(2):
        path = out / "out" / f"group{f}" / "all_results.json"
        results[f] = json.loads(path.read_text()) if path.exists() else None
    heal_log = (results[1] or {}).get("fault_tolerance", {}).get("heal_log") or []
    if codes.get(0, codes.get("0")) != 0 or codes.get(2, codes.get("2")) != 0 or not heal_log:
        record["failed"] = True
        return record
    heal = heal_log[-1]
    m0 = read_jsonl(out / "out" / "group0" / "metrics.jsonl")
    skipped = uncommitted_steps(out / "group0_a0.log")
    next_sync = (events["killed_at_step"] // H + 1) * H  # the first sync group 1 would have joined
    after_kill = [r for r in m0 if "train/loss" in r and r["unix_time"] > events["kill"]]
    committed = [r for r in after_kill if r["step"] % H == 0 and r["step"] >= next_sync and r["step"] not in skipped]
    steps0 = [r["unix_time"] for r in m0 if "train/loss" in r]
    gaps = [b - a for a, b in zip(steps0, steps0[1:]) if b > events["kill"] - 5]
    m1 = read_jsonl(out / "out" / "group1" / "metrics.jsonl")
    back = [r for r in m1 if "train/loss" in r and r["unix_time"] > events["restart"] and r["step"] >= heal["step"]]
    record.update(
        heal=heal, n_params=results[0]["n_params"], steps=results[0]["steps"],
        survivor_stall_s=committed[0]["unix_time"] - events["kill"] if committed else None,
        survivor_longest_gap_s=max(gaps) if gaps else None,
        rejoin_s=back[0]["unix_time"] - events["restart"] if back else None,
        healed_at_the_end=heal["step"] >= results[0]["steps"],
        final_checksums=[(r or {}).get("fault_tolerance", {}).get("end", {}).get("checksum") for r in results.values()],
        final_eval_loss=[(r or {}).get("eval_loss") for r in results.values()])
    return record


def figures(record: dict, link: dict) -> dict:
    """Wire time of the heal's bytes at the set and the measured rate, and the ratios."""
    heal = record["heal"]
    wire = heal.get("wire_bytes") or heal["bytes"]
    set_s = 8 * wire / link["set_bits_per_s"]
    measured_s = 8 * wire / link["bits_per_s"]
    return {"wire_bytes": wire, "wire_time_set_s": set_s, "wire_time_measured_s": measured_s,
            "heal_over_wire": heal["seconds"] / set_s, "transfer_over_wire": heal["transfer_seconds"] / set_s}


def table(summary: dict) -> str:
    rows = []
    for r in summary["runs"]:
        if r.get("failed"):
            rows.append(f"| {r['rate']} | {r['model']} | failed (exit codes {r['codes']}) |  |  |  |  |  |  |")
            continue
        h, f = r["heal"], r["figures"]
        rows.append(f"| {r['rate']} | {r['model']} ({r['n_params'] / 1e6:.1f}M), healed at step {h['step']} of "
                    f"{r['steps']}{' (the end)' if h['step'] >= r['steps'] else ''} | {f['wire_bytes'] / 1e6:.1f} | "
                    f"{f['wire_time_set_s']:.2f} | {h['seconds']:.2f} ({h['transfer_seconds']:.2f} + "
                    f"{h['load_seconds']:.2f}) | **{f['heal_over_wire']:.2f}** | "
                    f"{r['survivor_stall_s']:.1f} (longest gap {r['survivor_longest_gap_s']:.1f}) | "
                    f"{r['rejoin_s']:.1f} | {r['load_avg'][0][0]:.1f} / {r['load_avg'][1][0]:.1f}, "
                    f"{100 * (r['host'].get('background_cpu_share') or 0):.0f}% |")
    links = "; ".join(f"{k}: a TCP stream measured {v['bits_per_s'] / 1e6:.0f} Mbit/s" for k, v in
                      summary["links"].items())
    return "\n".join([
        f"# torchft heal across an emulated 2-node link ({summary['date']})",
        "",
        "2 emulated nodes (network namespaces, tc tbf per node and direction), one federation group of 2 ranks per "
        "node (recipes/pretrain.py --fault_tolerance torchft, fp32 avg, H=4, AdamW, seq_len 128, micro-batch 2), "
        "FL_ACCEL_HEAL_ADDRESS=<the node's veth> (an interface name). Group 1's processes are killed with SIGKILL "
        "and restarted 3 s later without a checkpoint: it heals from group 0 at its first sync (parameters and "
        f"AdamW moments of its 2 shards). {links}. Command: `{summary['command']}`.",
        "",
        "| link | model | heal MB on the wire | wire time at the link rate (s) | heal s (transfer + load) | heal / "
        "wire time | survivor stall s | rejoin s | load average start / end, other processes' CPU |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "- heal s: from torchft's quorum answer to the state applied on the slowest rank (transfer: HTTP download "
        "and unpickling; load: applying it). Wire time: the bytes the group's ranks downloaded over the rate set on "
        "the link.",
        "- survivor stall: from the kill to group 0's first committed sync of a round group 1 would have joined "
        "(longest gap: group 0's longest time between two step records around the kill). The Lighthouse leaves the "
        "dead group out after its heartbeat timeout (3 s, scripts/ft_launch.py's setting).",
        "- rejoin: from the restart of group 1 to its first step after the heal: interpreter start-up, data, "
        "model, prepare, the wait for group 0's next sync, the heal. Where group 0 had trained to the end before "
        "group 1 was back, it waited there and served the heal (the end). torchft's published CPU figure for a 51M "
        "model (ft-diloco README): survivor 5.0 s, rejoin 54 s.",
        "- The longest gap includes the heal itself where it fell mid-run: the survivor's sync waits while the "
        "restarted group downloads its state (torchft heals inside the quorum).",
        "- The machine is shared (2 cores; a low-priority convergence benchmark runs beside): compute seconds are "
        "noisy, the link is not.",
        *(["", "Without FL_ACCEL_HEAL_ADDRESS (torchft advertises socket.gethostname(), 127.0.0.1 inside a "
           "namespace): " + summary["default_address"]] if summary.get("default_address") else []),
        "",
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"])
    parser.add_argument("--models", nargs="+", default=["tiny", "25m"], choices=sorted(MODELS))
    parser.add_argument("--default_address", action="store_true",
                        help="also run the tiny model once at the first rate without FL_ACCEL_HEAL_ADDRESS")
    parser.add_argument("--name", default=f"{time.strftime('%Y-%m-%d')}-ft-heal")
    parser.add_argument("--report_only", action="store_true", help="rewrite table.md from summary.json")
    args = parser.parse_args(argv)
    dest = ROOT / "bench" / "results" / args.name
    if args.report_only:  # figures recomputed from the work folder's raw data where it is still there
        summary = json.loads((dest / "summary.json").read_text())
        work = ROOT / "bench" / "work" / args.name
        for record in summary["runs"]:
            if (work / record["name"]).is_dir():
                record.pop("failed", None)
                analyse(record, work / record["name"])
                if not record.get("failed"):
                    record["figures"] = figures(record, summary["links"][record["rate"]])
        (dest / "summary.json").write_text(json.dumps(summary, indent=1))
        (dest / "table.md").write_text(table(summary))
        if work.is_dir():
            copy_raw(work, dest / "runs")
        print((dest / "table.md").read_text())
        return 0
    from scripts.netemu import Emulator

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = ROOT / "bench" / "work" / args.name
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    summary = {"date": time.strftime("%Y-%m-%d"), "command": "python -m bench.ft_heal " + " ".join(argv or sys.argv[1:]),
               "links": {}, "runs": []}
    for rate in args.rates:
        with Emulator(2, rate, subnet="10.213.49.0/24") as emu:
            link = emu.measure(seconds=2.0)
            summary["links"][rate] = link
            for model in args.models:
                print(f"[ft_heal] {rate} {model} (load average {os.getloadavg()[0]:.1f})", flush=True)
                record = run_one(emu, rate, model, work, cache)
                if not record.get("failed"):
                    record["figures"] = figures(record, link)
                summary["runs"].append(record)
                print(f"[ft_heal] {json.dumps({k: record.get(k) for k in ('name', 'heal', 'figures', 'survivor_stall_s', 'rejoin_s')})}",
                      flush=True)
            if args.default_address and rate == args.rates[0]:
                record = run_one(emu, rate, "tiny", work, cache, default_address=True, timeout=600)
                summary["default_address_run"] = record
                summary["default_address"] = (
                    "the restarted group never healed (exit codes " + json.dumps(record["codes"]) + "; see "
                    f"bench/work/{args.name}/{record['name']}/group1_a1.log)") if record.get("failed") else \
                    f"healed in {record['heal']['seconds']:.2f} s (unexpected)"
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "summary.json").write_text(json.dumps(summary, indent=1))
    (dest / "table.md").write_text(table(summary))
    (dest / "command.txt").write_text(summary["command"] + "\n")
    copy_raw(work, dest / "runs")
    print((dest / "table.md").read_text())
    return 0


def copy_raw(work: Path, dest: Path) -> None:
    """Each run's raw data into the results folder: per group ``metrics.jsonl`` (every step's
    record, with ``unix_time``), ``metrics.superseded.jsonl`` (group 1's killed session) and
    ``all_results.json`` (the heal record), and the Lighthouse's log."""
    for run in sorted(p for p in work.iterdir() if (p / "out").is_dir()):
        for f in range(2):
            for name in ("metrics.jsonl", "metrics.superseded.jsonl", "all_results.json"):
                src = run / "out" / f"group{f}" / name
                if src.exists():
                    (dest / run.name / f"group{f}").mkdir(parents=True, exist_ok=True)
                    shutil.copy(src, dest / run.name / f"group{f}" / name)
        if (run / "lighthouse.log").exists():
            (dest / run.name).mkdir(parents=True, exist_ok=True)
            shutil.copy(run / "lighthouse.log", dest / run.name / "lighthouse.log")


if __name__ == "__main__":
    sys.exit(main())
