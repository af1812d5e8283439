"""Side-by-side comparison of recipe runs: a table, notes, a verdict and plots.

    python scripts/compare.py outputs/<experiment> [--baseline fsdp]
    python -m scripts.compare outputs/<experiment>          # from the repository root

Reads every ``<run>/all_results.json`` (and ``<run>/metrics.jsonl``) directly under the
folder, prints a table (world size, F/R/S, H, tokens per step, what ran: precision policy,
activation checkpointing, compile; tokens/s, speedup against the baseline, MFU, peak
memory, eval perplexity, bytes per rank per step on each mesh axis, background CPU load),
notes on anything that makes the runs not comparable, and a short verdict computed from
these figures; writes ``comparison.md`` and ``comparison.png`` (eval perplexity vs tokens
and vs training time, tokens/s bars) into the folder.

Fields read from ``all_results.json`` (written by ``recipes/pretrain.py``): ``algorithm``,
``world_size``, ``num_groups``, ``group_size``, ``replicas``, ``shards``, ``sync_every``,
``steps``, ``train_tokens``, ``tokens_per_s``, ``eval_perplexity``, ``comm`` (``{axis:
{"bytes": ...}}``, the bytes the busiest rank sent over the run), and, when present (runs
written before they existed show "-"), ``precision_policy`` (``{"param", "reduce",
"output"}``), ``activation_checkpointing``, ``compile``, ``mfu``, ``peak_accelerator_mb``,
``peak_host_mb`` and

    results["host"] = {"background_cpu_share": float, "cpus": int}

the share of all CPUs that other processes kept busy during the run, as measured by
``recipes.host_load.HostLoad``. A run above 0.05 is flagged: its tokens/s were shared with
other work, and the throughput comparison is unreliable.

Runs with the same setup get no verdict between them: the same layout (federated or not, the
groups' sizes and the shard size S, so FL+HSDP with one replica per group is FL+FSDP on the
same groups, and HSDP with one replica is FSDP) and the same exchange (the ``fl`` settings
the algorithm reads, by ``FLConfig.ignored_fields``). Instead the verdict says they ran the
same, and either that their recorded flags (``args``) differ only in names, folders and
logging (:data:`NAME_FLAGS`), so their figures differ by run-to-run variation only, or which
flags they differ in.

Exit status: 0, or 2 with one ``error:`` line when the folder is missing or holds no runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from tabulate import tabulate

LABEL = {"fsdp": "FSDP", "hsdp": "HSDP", "fl_fsdp": "FL+FSDP", "fl_hsdp": "FL+HSDP"}
BASELINE_OF = {"fl_fsdp": "fsdp", "fl_hsdp": "hsdp"}
AXES = ("fl", "dp_replicate", "dp_shard")
BACKGROUND_LIMIT = 0.05
"""Runs whose ``host.background_cpu_share`` exceeds this are flagged."""
MIB = 2**20


NAME_FLAGS = ("run_name", "experiment", "output_dir", "overwrite_output_dir", "resume_from_checkpoint", "cache_dir",
              "preprocessing_num_workers", "report_to", "wandb_project", "log_every", "checkpoint_every",
              "checkpoints_total_limit", "save_final_model", "peak_tflops", "memory_check", "baseline_tokens_per_s")
"""Recipe flags (``args`` in all_results.json) that name a run, choose its folders, trackers,
logging and checkpoint cadence or the peak for MFU: they do not change what trains."""
LAYOUT_FIELDS = ("algorithm", "num_groups", "group_sizes", "hsdp_shard_size")
"""FLConfig fields that make the layout (compared as :func:`layout_key`), not the exchange."""
NOT_EXCHANGE_FIELDS = ("collective_timeout_s", "group_index", "lighthouse_addr", "heal_address", "rejoin_timeout_s",
                       "outer_state_device")
"""FLConfig fields that change neither the layout nor the values exchanged."""


class CompareError(Exception):
    """A user mistake (missing folder, no runs, unreadable file); main prints it as one line."""


# ---------------------------------------------------------------------- reading
def load_runs(root: str) -> list[dict]:
    """One dict per sub-folder of ``root`` holding ``all_results.json``: its results, plus
    ``name`` (the folder name) and ``records`` (``metrics.jsonl``, [] if absent), by name.

    Raises:
        CompareError: ``root`` is missing or not a folder, holds no run, or a file is not
            valid JSON (the message names the file).
    """
    if not os.path.exists(root):
        raise CompareError(f"{root}: no such folder (give the experiment folder, e.g. outputs/<experiment>)")
    if not os.path.isdir(root):
        raise CompareError(f"{root}: not a folder (give the experiment folder, e.g. outputs/<experiment>)")
    runs = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, "all_results.json")
        if not os.path.isfile(path):
            continue
        run = _read_json(path)
        if not isinstance(run, dict):
            raise CompareError(f"{path}: expected a JSON object")
        records = []
        mpath = os.path.join(root, name, "metrics.jsonl")
        if os.path.isfile(mpath):
            with open(mpath, encoding="utf-8") as fh:
                for i, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            records.append(json.loads(line))
                        except ValueError as exc:
                            raise CompareError(f"{mpath}:{i}: not JSON ({exc})") from None
        run["name"], run["records"] = name, records
        runs.append(run)
    if not runs:
        raise CompareError(f"{root}: no runs (no <run>/all_results.json below it; a run writes it when it finishes)")
    return runs


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except ValueError as exc:
        raise CompareError(f"{path}: not valid JSON ({exc})") from None


# ---------------------------------------------------------------------- figures per run
def tokens_per_step(run: dict) -> float | None:
    """train_tokens / steps (all processes), or None when unknown."""
    steps, tokens = run.get("steps"), run.get("train_tokens")
    return tokens / steps if steps and tokens is not None else None


def background_share(run: dict) -> float | None:
    """``host.background_cpu_share`` of the run, or None when not recorded."""
    host = run.get("host")
    share = host.get("background_cpu_share") if isinstance(host, dict) else None
    return float(share) if isinstance(share, (int, float)) else None


def label(run: dict, runs: list[dict]) -> str:
    """``FL+FSDP``, or ``FL+FSDP (name)`` when several runs share the algorithm."""
    alg = run.get("algorithm", "?")
    text = LABEL.get(alg, alg)
    return f"{text} ({run['name']})" if sum(r.get("algorithm") == alg for r in runs) > 1 else text


def choose_baseline(runs: list[dict], baseline: str | None) -> dict:
    """The run speedups are relative to: ``baseline`` as a run name or an algorithm, else the
    first FSDP/HSDP run, else the first run.

    Raises:
        CompareError: ``baseline`` names no run and no algorithm of a run.
    """
    if baseline:
        for r in runs:
            if baseline in (r["name"], r.get("algorithm")):
                return r
        raise CompareError(f"--baseline {baseline!r} matches no run name or algorithm "
                           f"(runs: {', '.join(r['name'] for r in runs)})")
    return next((r for r in runs if r.get("algorithm") in ("fsdp", "hsdp")), runs[0])


def _num(x: Any, fmt: str) -> str:
    """``x`` formatted, "-" when unknown; a list (unequal groups: replicas per group) as "1/2"."""
    if isinstance(x, (list, tuple)):
        return "/".join(_num(v, fmt) for v in x)
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def table(runs: list[dict], base: dict) -> str:
    """The comparison table as GitHub markdown (tabulate)."""
    headers = ["run", "algorithm", "world", "F", "R", "S", "H", "steps", "tokens/step", "precision", "AC", "compile",
               "tokens/s", "speedup", "MFU", "peak MiB", "eval ppl"] + [f"{a} MiB/rank/step" for a in AXES] + \
        ["background CPU"]
    rows = []
    base_tps = base.get("tokens_per_s")
    for r in runs:
        tps = r.get("tokens_per_s")
        steps = r.get("steps") or 0
        comm = r.get("comm") or {}
        bg = background_share(r)
        rows.append([
            r["name"], r.get("algorithm", "?"), _num(r.get("world_size"), "d"), _num(r.get("num_groups"), "d"),
            _num(r.get("replicas"), "d"), _num(r.get("shards"), "d"), _num(r.get("sync_every"), "d"),
            _num(r.get("steps"), "d"), _num(tokens_per_step(r), ",.0f"), precision(r), _flag(r, "activation_checkpointing"),
            _flag(r, "compile"), _num(tps, ",.0f"),
            _num(tps / base_tps if tps and base_tps else None, ".2f") + ("x" if tps and base_tps else ""),
            _num(100 * r["mfu"] if r.get("mfu") is not None else None, ".1f") + ("%" if r.get("mfu") is not None else ""),
            peak_memory(r), _num(r.get("eval_perplexity"), ",.2f"),
            *[_num(comm.get(a, {}).get("bytes", 0) / MIB / steps if steps else None, ".2f") for a in AXES],
            (_num(100 * bg, ".0f") + "%" + (" (!)" if bg > BACKGROUND_LIMIT else "")) if bg is not None else "-",
        ])
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True) + \
        (f"\n\nspeedup = tokens/s relative to `{base['name']}`; precision = param/reduce dtype of the FSDP2 policy; "
         f"AC = activation checkpointing; MFU against the peak in all_results.json (- when unknown, e.g. on CPU); "
         f"peak MiB = largest peak accelerator memory of any rank (host RSS, marked 'host', without a GPU); "
         f"MiB/rank/step = 2^20 bytes the busiest rank sent per optimizer step.")


def precision(run: dict) -> str:
    """``param/reduce`` of the run's precision policy ("bf16/fp32"), "-" when not recorded."""
    policy = run.get("precision_policy")
    if not isinstance(policy, dict):
        return "-"
    return f"{policy.get('param', '?')}/{policy.get('reduce', '?')}"


def _flag(run: dict, key: str) -> str:
    value = run.get(key)
    return "-" if value is None else ("on" if value else "off")


def peak_memory(run: dict) -> str:
    """Peak accelerator MiB of the busiest rank, else its peak host RSS marked "host"."""
    if run.get("peak_accelerator_mb") is not None:
        return _num(run["peak_accelerator_mb"], ",.0f")
    if run.get("peak_host_mb") is not None:
        return _num(run["peak_host_mb"], ",.0f") + " host"
    return "-"


def notes(runs: list[dict]) -> list[str]:
    """Warnings: runs that differ in world size, tokens per step, precision policy,
    activation checkpointing or compile; runs whose counters cover only their last process
    (``counters.since`` in all_results.json); runs under background load."""
    out = []
    worlds = {r["name"]: r.get("world_size") for r in runs}
    if len(set(worlds.values())) > 1:
        out.append("note: the runs differ in world size (" + ", ".join(f"{n}: {w}" for n, w in worlds.items())
                   + "): tokens/s and perplexity compare different amounts of hardware.")
    tps = {r["name"]: tokens_per_step(r) for r in runs}
    if len({round(t) for t in tps.values() if t is not None}) > 1:
        out.append("note: the runs differ in tokens per step (" + ", ".join(
            f"{n}: {_num(t, ',.0f')}" for n, t in tps.items()) + "): they trained with different global batches, "
                   "so perplexity at equal tokens compares different optimisation settings.")
    for what, value_of in (("precision policy", precision), ("activation checkpointing",
                                                               lambda r: _flag(r, "activation_checkpointing")),
                           ("compile", lambda r: _flag(r, "compile"))):
        values = {r["name"]: value_of(r) for r in runs}
        if len({v for v in values.values() if v != "-"}) > 1:
            out.append(f"note: the runs differ in {what} (" + ", ".join(f"{n}: {v}" for n, v in values.items())
                       + "): tokens/s and memory compare different settings.")
    for r in runs:
        counters = r.get("counters") if isinstance(r.get("counters"), dict) else {}
        if counters.get("since") == "this process's start":
            out.append(f"note: {r['name']}'s tokens, time and bytes count since its last process started "
                       f"({counters.get('steps_counted')} of its {r.get('steps')} steps): an earlier session ended "
                       f"before its first checkpoint, so its figures per step are this session's.")
    for r in runs:
        bg = background_share(r)
        if bg is not None and bg > BACKGROUND_LIMIT:
            out.append(f"warning: other processes kept {100 * bg:.0f}% of the machine's CPUs busy during "
                       f"{r['name']} (limit {100 * BACKGROUND_LIMIT:.0f}%): its tokens/s are not its own.")
    return out


def verdict(runs: list[dict], base: dict) -> list[str]:
    """A few sentences computed from the figures: runs of the same setup said to be so
    (:func:`same_setup_line`, no verdict between them), each other run against its baseline
    (throughput ratio, perplexity, bytes per step), then whether background load makes the
    throughput comparison unreliable."""
    sets = same_setups(runs)
    out = [same_setup_line(group, runs) for group in sets]
    same = {(id(a), id(b)) for group in sets for a in group for b in group}
    others = [r for r in runs if r is not base]
    for r in others:
        ref = next((b for b in runs if b.get("algorithm") == BASELINE_OF.get(r.get("algorithm"))), base)
        if ref is r or (id(r), id(ref)) in same:  # the same setup: said above, no verdict
            continue
        a, b = label(r, runs), label(ref, runs)
        tps, ref_tps = r.get("tokens_per_s"), ref.get("tokens_per_s")
        line = f"{a} ran at {_num(tps, ',.0f')} tokens/s vs {b} {_num(ref_tps, ',.0f')}"
        if tps and ref_tps:
            line += f" ({tps / ref_tps:.2f}x). " + noise_note(r, ref)
        else:
            line += "."
        p, q = r.get("eval_perplexity"), ref.get("eval_perplexity")
        if p is not None and q is not None:
            if r.get("train_tokens") == ref.get("train_tokens"):
                rel = (p / q - 1) * 100
                line += (f" Eval perplexity after {r.get('train_tokens'):,} tokens: {p:,.2f} vs {q:,.2f} "
                         f"({a} {abs(rel):.1f}% {'lower' if rel < 0 else 'higher'}).")
            else:
                line += (f" Eval perplexity {p:,.2f} vs {q:,.2f}, but after different token counts "
                         f"({r.get('train_tokens')} vs {ref.get('train_tokens')}): not comparable.")
        mine, theirs = _bytes_per_step(r), _bytes_per_step(ref)
        if mine is not None and theirs is not None:
            line += f" Per rank and step {a} sent {mine / MIB:.2f} MiB, {b} {theirs / MIB:.2f} MiB."
        out.append(line)
    if not out:
        out.append(f"Only one algorithm here ({label(base, runs)}): nothing to compare against.")
    flagged = [r for r in runs if (background_share(r) or 0.0) > BACKGROUND_LIMIT]
    unknown = [r["name"] for r in runs if background_share(r) is None]
    if flagged:
        worst = max(flagged, key=background_share)
        out.append(f"Background load (other processes used up to {100 * background_share(worst):.0f}% of the CPUs, "
                   f"during {', '.join(r['name'] for r in flagged)}) makes the throughput comparison unreliable: "
                   f"rerun on a quiet machine.")
    elif unknown:
        out.append(f"Background CPU load was not recorded for {', '.join(unknown)}, so the throughput figures "
                   f"cannot be checked for interference from other processes.")
    else:
        out.append(f"Background CPU load stayed under {100 * BACKGROUND_LIMIT:.0f}% in every run.")
    return out


NOISE = 0.05
"""Throughput differences between repeats of one setup on the project's shared CPU machines
reach about this share (docs/results.md, e.g. the torchft pairs: -5.4% to +5.3%)."""


def noise_note(run: dict, ref: dict) -> str:
    """The caveat after a throughput ratio of single runs: run-to-run variation, and, when both
    ran on one machine (``nodes`` 1 in all_results.json), that every link was loopback."""
    variation = f"one run each, and repeats of one setup differ by up to about {NOISE:.0%} in tokens/s"
    if run.get("nodes") == 1 and ref.get("nodes") == 1:
        return (f"On one machine every link is loopback: the ratio shows the mechanics' cost, not the speedup across "
                f"slow links between nodes (bench/README.md measures that); {variation}.")
    return f"Caveat: {variation}."


def layout_key(run: dict) -> tuple | None:
    """``(federated, group sizes, shard size S)`` of a run, or None when not recorded. The
    algorithm's name is not part of it: HSDP with one replica (R = G / S = 1) is FSDP, and
    FL+HSDP with one replica per group is FL+FSDP on the same groups."""
    alg, world, shards = run.get("algorithm"), run.get("world_size"), run.get("shards")
    sizes = run.get("group_sizes")
    if sizes is None and isinstance(run.get("group_size"), int) and isinstance(run.get("num_groups"), int):
        sizes = [run["group_size"]] * run["num_groups"]
    if alg not in LABEL or not isinstance(world, int) or not isinstance(shards, int) or not sizes:
        return None
    return alg.startswith("fl_"), tuple(sizes), shards


def exchange_key(run: dict) -> tuple | None:
    """The exchange of a run: its ``fl`` settings that the algorithm reads (``FLConfig.
    ignored_fields``, the library's rule) apart from the layout's and those that change no
    value (:data:`LAYOUT_FIELDS`, :data:`NOT_EXCHANGE_FIELDS`), sorted; () for FSDP and HSDP
    (nothing is exchanged between groups); None when not recorded or not readable."""
    if not str(run.get("algorithm", "")).startswith("fl_"):
        return ()
    fl = run.get("fl")
    if not isinstance(fl, dict):
        return None
    from fl_accel.config import FLConfig

    names = set(FLConfig.field_names())
    try:
        ignored = FLConfig(**{k: v for k, v in fl.items() if k in names}).ignored_fields()
    except (TypeError, ValueError):
        return None
    skip = set(ignored) | set(LAYOUT_FIELDS) | set(NOT_EXCHANGE_FIELDS)
    return tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in fl.items() if k in names and k not in skip))


def describe_layout(key: tuple) -> str:
    """``FL+FSDP, 2 groups of 2 ranks``, ``HSDP, 2 replicas x 2 shards``, ``FSDP over 4 ranks``
    from a :func:`layout_key`."""
    federated, sizes, shards = key
    uniform = len(set(sizes)) == 1
    replicas = str(sizes[0] // shards) if uniform else "/".join(str(g // shards) for g in sizes)
    ranks = str(sizes[0]) if uniform else "/".join(map(str, sizes))
    hsdp = any(g != shards for g in sizes)
    within = f"{replicas} replicas x {shards} shards" if hsdp else f"{ranks} ranks"
    if federated:
        return f"{'FL+HSDP' if hsdp else 'FL+FSDP'}, {len(sizes)} groups of {within}"
    return f"HSDP, {within}" if hsdp else f"FSDP over {sizes[0]} ranks"


def flag_differences(a: dict, b: dict) -> list[str] | None:
    """The recipe flags (``args``) in which two runs differ, :data:`NAME_FLAGS` left out, as
    ``"learning_rate (0.001 vs 0.0003)"``; None when either run did not record its flags."""
    fa, fb = a.get("args"), b.get("args")
    if not isinstance(fa, dict) or not isinstance(fb, dict):
        return None
    return [f"{k} ({fa.get(k)!r} vs {fb.get(k)!r})" for k in sorted(set(fa) | set(fb))
            if k not in NAME_FLAGS and fa.get(k) != fb.get(k)]


def same_setups(runs: list[dict]) -> list[list[dict]]:
    """The sets of two or more runs with the same layout and exchange (:func:`layout_key`,
    :func:`exchange_key`), in the runs' order; runs whose setup is not recorded are in none."""
    sets: dict[tuple, list[dict]] = {}
    for r in runs:
        layout, exchange = layout_key(r), exchange_key(r)
        if layout is not None and exchange is not None:
            sets.setdefault((layout, exchange), []).append(r)
    return [s for s in sets.values() if len(s) > 1]


def same_setup_line(group: list[dict], runs: list[dict]) -> str:
    """The verdict line for runs of one setup (:func:`same_setups`): what they share, and
    whether their flags differ only in names or in what."""
    names = [label(r, runs) for r in group]
    layout = layout_key(group[0])
    algs = {r.get("algorithm") for r in group}
    why = describe_layout(layout)
    if len(algs) > 1:
        why += " (" + "; ".join(f"{LABEL[a]} with one replica per group is FL+FSDP" if a == "fl_hsdp" else
                                 f"{LABEL[a]} with one replica is FSDP" for a in sorted(algs)
                                 if a in ("fl_hsdp", "hsdp")) + ")"
    who = " and ".join(names) if len(names) == 2 else ", ".join(names)
    line = f"{who} ran the same layout and exchange ({why}): no verdict between them."
    diffs = [flag_differences(group[0], r) for r in group[1:]]
    if any(d is None for d in diffs):
        line += " Their other settings are not recorded (results written before all_results.json held `args`)."
    elif any(diffs):
        line += " They differ in " + "; ".join(sorted({x for d in diffs for x in d})) + \
            ": a comparison of those settings, not of methods."
    else:
        line += " Their flags differ only in names, folders and logging: the same run, so differences in their " \
                "figures are run-to-run variation."
    figures = ", ".join(f"{r['name']}: {_num(r.get('tokens_per_s'), ',.0f')} tokens/s, eval perplexity "
                        f"{_num(r.get('eval_perplexity'), ',.2f')}" for r in group)
    return line + f" ({figures})"


def _bytes_per_step(run: dict) -> float | None:
    steps, comm = run.get("steps"), run.get("comm")
    if not steps or not isinstance(comm, dict):
        return None
    return sum(comm.get(a, {}).get("bytes", 0) for a in AXES) / steps


# ---------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/compare.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="folder holding one sub-folder per run (outputs/<experiment>)")
    ap.add_argument("--baseline", default=None, help="run name or algorithm used as the speedup reference")
    ap.add_argument("--no-plot", action="store_true", help="skip comparison.png")
    ap.add_argument("--tokens-per-s", metavar="RUN", default=None,
                    help="print only the tokens/s of RUN (a run name or algorithm, e.g. fsdp) and exit: what the "
                         "quickstart passes as the next run's --baseline_tokens_per_s")
    args = ap.parse_args(argv)
    try:
        runs = load_runs(args.root)
        if args.tokens_per_s is not None:
            tps = choose_baseline(runs, args.tokens_per_s).get("tokens_per_s")
            if not tps:
                raise CompareError(f"{args.tokens_per_s}: no tokens_per_s in its all_results.json")
            print(f"{tps:.6g}")
            return 0
        base = choose_baseline(runs, args.baseline)
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    md = table(runs, base)
    lines = notes(runs)
    summary = verdict(runs, base)
    text = md + "\n\n" + "".join(f"{n}\n" for n in lines) + ("\n" if lines else "") + \
        "Verdict:\n" + "".join(f"- {v}\n" for v in summary)
    md_path = os.path.join(args.root, "comparison.md")
    with open(md_path, "w", encoding="utf-8") as fh:
        fh.write(text)
    print(text)
    if not args.no_plot:
        from recipes.plots import plot_comparison

        png = plot_comparison(runs, os.path.join(args.root, "comparison.png"),
                              os.path.basename(os.path.normpath(args.root)))
        print(f"table: {md_path}\nplots: {png}")
    for r in runs:
        wandb_dir = os.path.join(args.root, r["name"], "wandb")
        if os.path.isdir(wandb_dir):
            print(f"W&B ({r['name']}): {wandb_dir}  (offline; upload with `wandb sync {wandb_dir}/offline-run-*`)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
