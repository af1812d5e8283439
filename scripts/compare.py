"""Side-by-side comparison of recipe runs: a markdown table and plots.

    python scripts/compare.py outputs/<experiment> [--baseline fsdp]

Reads every ``<run>/all_results.json`` and ``<run>/metrics.jsonl`` under the folder,
prints the table (tokens/s, speedup against the baseline, eval perplexity at equal
tokens, bytes per mesh axis per rank) and writes ``comparison.md`` and
``comparison.png`` (eval perplexity vs tokens, perplexity vs training time, tokens/s
bars) into the folder. Used by the quickstart and by bench/run_bench.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def load_runs(root: str) -> list[dict]:
    """One dict per run folder holding all_results.json: results + its metrics records."""
    runs = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, "all_results.json")
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as fh:
            run = json.load(fh)
        records = []
        mpath = os.path.join(root, name, "metrics.jsonl")
        if os.path.isfile(mpath):
            with open(mpath, encoding="utf-8") as fh:
                records = [json.loads(line) for line in fh if line.strip()]
        run["name"], run["records"] = name, records
        runs.append(run)
    if not runs:
        raise SystemExit(f"no runs with all_results.json under {root}")
    return runs


def table(runs: list[dict], baseline: str | None) -> str:
    base = next((r for r in runs if r["algorithm"] == baseline), None) if baseline else None
    if base is None:
        base = next((r for r in runs if r["algorithm"] in ("fsdp", "hsdp")), runs[0])
    mb = 2**20
    rows = ["| run | algorithm | F | G | S | H | steps | tokens | tokens/s | speedup | eval ppl | "
            "fl MiB/rank | dp_replicate MiB/rank | dp_shard MiB/rank |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        tps = r.get("tokens_per_s") or 0.0
        speed = tps / base["tokens_per_s"] if base.get("tokens_per_s") else float("nan")
        c = r.get("comm", {})
        rows.append(
            f"| {r['name']} | {r['algorithm']} | {r['num_groups']} | {r['group_size']} | {r['shards']} | "
            f"{r.get('sync_every') or '-'} | {r['steps']} | {r['train_tokens']} | {tps:.0f} | {speed:.2f}x | "
            f"{r['eval_perplexity']:.2f} | {c.get('fl', {}).get('bytes', 0) / mb:.1f} | "
            f"{c.get('dp_replicate', {}).get('bytes', 0) / mb:.1f} | {c.get('dp_shard', {}).get('bytes', 0) / mb:.1f} |"
        )
    return "\n".join(rows) + f"\n\nspeedup = tokens/s relative to `{base['name']}`.\n"


def plot(runs: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import EngFormatter

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for a in axes:
        a.xaxis.set_major_formatter(EngFormatter(sep=""))
    for r in runs:
        ev = [x for x in r["records"] if "eval/perplexity" in x]
        if ev:
            axes[0].plot([x["tokens"] for x in ev], [x["eval/perplexity"] for x in ev], marker="o", label=r["name"])
            axes[1].plot([x.get("time_s", 0) for x in ev], [x["eval/perplexity"] for x in ev], marker="o",
                         label=r["name"])
    axes[0].set(xlabel="training tokens", ylabel="eval perplexity", yscale="log", title="perplexity vs tokens")
    axes[1].set(xlabel="training time (s)", ylabel="eval perplexity", yscale="log",
                title="time to perplexity")
    names = [r["name"] for r in runs]
    axes[2].barh(names, [r.get("tokens_per_s") or 0 for r in runs], color="tab:green")
    axes[2].set(xlabel="tokens/s (all ranks)", title="throughput")
    for a in axes[:2]:
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="folder holding one sub-folder per run (outputs/<experiment>)")
    ap.add_argument("--baseline", default=None, help="algorithm used as the speedup reference")
    args = ap.parse_args(argv)
    runs = load_runs(args.root)
    md = table(runs, args.baseline)
    with open(os.path.join(args.root, "comparison.md"), "w", encoding="utf-8") as fh:
        fh.write(md)
    plot(runs, os.path.join(args.root, "comparison.png"), os.path.basename(os.path.normpath(args.root)))
    print(md)
    print(f"table: {os.path.join(args.root, 'comparison.md')}\nplots: {os.path.join(args.root, 'comparison.png')}")
    for r in runs:
        wandb_dir = os.path.join(args.root, r["name"], "wandb")
        if os.path.isdir(wandb_dir):
            print(f"W&B ({r['name']}): {wandb_dir}  (offline; upload with `wandb sync {wandb_dir}/offline-run-*`)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
