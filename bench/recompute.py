"""Recompute every measured figure of the README's results table from the committed results folders.

    python -m bench.recompute                              # README.md against bench/results
    python -m bench.recompute --readme README.md --results bench/results

:data:`FIGURES` lists each figure the table cites: the table row it is in (the row's first
cell), the text printed there, the format that printed it, its source file and how it is
computed from that file (from the runs' whole-run records where the folder has them: tokens/s =
train_tokens / train_seconds of bench.json ``runs``, a final eval loss = the last ``eval/loss``
of curves.csv). Every figure is printed with its recomputed value and source. The exit status
is 1 when a figure does not reproduce to the printed precision, when its text is not in its
README row (the README changed: update the table), or when a row cites a number no entry
covers; 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

from bench.compact import read_curves

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Source:
    """A figure's source file (relative to the results folder) and how it is computed from it."""

    where: str
    compute: Callable[[str], float | None]
    """The value from the results folder (its path)."""


@dataclass(frozen=True)
class Figure:
    row: str
    """The README table row: the text of its first cell."""
    text: str
    """The figure as the README prints it."""
    fmt: Callable[[float | None], str]
    source: Source


@cache
def _json(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


@cache
def _curves(path: str) -> dict:
    return read_curves(path)


# ---------------------------------------------------------------------- sources
def tokens_per_s(folder: str, run: str) -> Source:
    """A run's tokens/s: its training tokens over its training seconds (bench.json ``runs``)."""
    def f(root):
        r = _json(os.path.join(root, folder, "bench.json"))["runs"][run]
        return r["train_tokens"] / r["train_seconds"]
    return Source(f"{folder}/bench.json runs[{run}]: train_tokens / train_seconds", f)


def fl_mib(folder: str, run: str) -> Source:
    """MiB that rank 0 sent on "fl" over the run (bench.json ``runs``, all_results.json's ``comm``)."""
    def f(root):
        return _json(os.path.join(root, folder, "bench.json"))["runs"][run]["comm"]["fl"]["bytes"] / 2**20
    return Source(f"{folder}/bench.json runs[{run}].comm.fl.bytes / 2^20", f)


def final_loss(folder: str, run: str) -> Source:
    """The run's last eval loss in curves.csv."""
    def f(root):
        recs = [r for r in _curves(os.path.join(root, folder, "curves.csv"))[run] if "eval/loss" in r]
        return max(recs, key=lambda r: r["step"])["eval/loss"]
    return Source(f"{folder}/curves.csv: last eval/loss of {run}", f)


def seed_mean(folder: str, *runs: str) -> Source:
    """The mean of the runs' final eval losses (one run per seed; curves.csv)."""
    losses = [final_loss(folder, r) for r in runs]
    return Source(f"mean over seeds of the last eval/loss in {folder}/curves.csv of {', '.join(runs)}",
                  lambda root: statistics.fmean(x.compute(root) for x in losses))


def seed_sd(folder: str, *runs: str) -> Source:
    """The sample standard deviation (n - 1) of the runs' final eval losses (curves.csv)."""
    losses = [final_loss(folder, r) for r in runs]
    return Source(f"sample sd over seeds of the last eval/loss in {folder}/curves.csv of {', '.join(runs)}",
                  lambda root: statistics.stdev(x.compute(root) for x in losses))


def pooled_sd(folder: str, *configs: tuple[str, ...]) -> Source:
    """sqrt(sum((n_i - 1) s_i^2) / sum(n_i - 1)) over the configurations (each a tuple of runs)."""
    def f(root):
        ss = df = 0
        for runs in configs:
            vals = [final_loss(folder, r).compute(root) for r in runs]
            ss += (len(vals) - 1) * statistics.variance(vals)
            df += len(vals) - 1
        return (ss / df) ** 0.5
    return Source(f"pooled sample sd over {len(configs)} configurations in {folder}/curves.csv", f)


def scaled(a: Source, factor: float) -> Source:
    return Source(f"{factor:g} x ({a.where})", lambda root: factor * a.compute(root))


def difference(a: Source, b: Source) -> Source:
    return Source(f"({a.where}) - ({b.where})", lambda root: a.compute(root) - b.compute(root))


def ttt(folder: str, link: str, run: str, *keys: str) -> Source:
    """A field of one row of a time_to_target.json (nested keys)."""
    def f(root):
        row = next(r for r in _json(os.path.join(root, folder, "time_to_target.json"))["rows"]
                   if (r["link"], r["run"]) == (link, run))
        for k in keys:
            row = row[k] if row is not None else None
        return row
    return Source(f"{folder}/time_to_target.json rows[{link}/{run}].{'.'.join(keys)}", f)


def _ttt_curve(root: str, folder: str, link: str, run: str) -> list[dict]:
    """The evaluations of one row of a time-to-target folder's curves.csv, in step order (read here with
    the csv module, not with the benchmark's reader, so the recomputation shares no code with it)."""
    import csv

    with open(os.path.join(root, folder, "curves.csv"), encoding="utf-8", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if (r["run"], r["link"]) == (run, link)]
    return sorted(({"step": int(r["step"]), "wall_s": float(r["wall_s"]), "loss": float(r["eval_loss"])}
                   for r in rows), key=lambda r: r["step"])


def ttt_seconds(folder: str, link: str, run: str, target: Source) -> Source:
    """Wall-clock seconds at which the row's eval loss first reaches ``target`` (curves.csv; linear between
    the evaluation at or below it and the one before; None if never)."""
    def f(root):
        goal, prev = target.compute(root), None
        for e in _ttt_curve(root, folder, link, run):
            if e["loss"] <= goal:
                if prev is None:
                    return e["wall_s"]
                return prev["wall_s"] + (prev["loss"] - goal) / (prev["loss"] - e["loss"]) * (e["wall_s"] - prev["wall_s"])
            prev = e
        return None
    return Source(f"{folder}/curves.csv [{link}/{run}]: first wall_s at eval_loss <= ({target.where}), linear", f)


def ttt_final_loss(folder: str, link: str, run: str) -> Source:
    """The row's last eval loss in a time-to-target folder's curves.csv."""
    return Source(f"{folder}/curves.csv [{link}/{run}]: last eval_loss",
                  lambda root: _ttt_curve(root, folder, link, run)[-1]["loss"])


def loss_at_step(folder: str, run: str, step: int) -> Source:
    """A grid run's eval loss at ``step`` (curves.csv; the half-budget target is FSDP's at half its steps)."""
    def f(root):
        return next(r["eval/loss"] for r in _curves(os.path.join(root, folder, "curves.csv"))[run]
                    if r["step"] == step and "eval/loss" in r)
    return Source(f"{folder}/curves.csv: eval/loss of {run} at step {step}", f)


def json_value(path: str, get: Callable[[dict], float | None], what: str) -> Source:
    return Source(f"{path} {what}", lambda root: get(_json(os.path.join(root, path))))


def ratio(a: Source, b: Source) -> Source:
    return Source(f"({a.where}) / ({b.where})", lambda root: a.compute(root) / b.compute(root))


def diff(a: Source, b: Source) -> Source:
    return Source(f"|({a.where}) - ({b.where})|", lambda root: abs(a.compute(root) - b.compute(root)))


# ---------------------------------------------------------------------- formats
def num(spec: str, suffix: str = "") -> Callable[[float | None], str]:
    return lambda v: "-" if v is None else format(v, spec) + suffix


def minutes(v: float | None) -> str:
    return "not reached" if v is None else f"{v / 60:.1f}"


def whole_minutes(v: float | None) -> str:
    return "-" if v is None else f"{v / 60:.0f}"


def half(v: float | None) -> str:
    return "half" if v is not None and round(v, 2) == 0.5 else num(".2f")(v)


# ---------------------------------------------------------------------- the README's results table
B, S, SP, R2, G = ("2026-12-01-baselines", "2026-12-01-streaming", "2026-12-02-sparse-b", "2026-12-01-hsdp-r2",
                   "2026-12-03-grid")
T5, SQ = "2026-12-05-ttt", "2026-12-03-speed-quality"
ROW_100 = "tokens/s at 100 Mbit/s between nodes"
ROW_1G = "tokens/s at 1 Gbit/s"
ROW_R2 = "FL+HSDP, 2 groups x 2 replicas x 2 shards, 100 Mbit/s"
ROW_LIMIT = "share of the no-sync limit at 10 Mbit/s"
ROW_SPARSE = "sparse exchange at 10 Mbit/s"
ROW_3E4 = "final eval loss after 3.4M tokens, AdamW lr 3e-4, mean ± sd of two seeds"
ROW_1E3 = "the same at lr 1e-3 in every row, then each at its best LR"
ROW_TTT = ("wall-clock minutes to a target loss, trained end to end across 2 emulated nodes, lr 1e-3 in every row, "
           "all rows in one sitting")
ROW_SPEED = "groups at 2:1 speed (CPU quotas), 100 Mbit/s, 832 steps' tokens"
ROW_FT = "torchft mode's cost at 100 Mbit/s"
ROW_MEM = "peak memory model against measurement"
ROW_PEERS = "against torchft's DiLoCo at 10 Mbit/s, 3 interleaved runs per row, each ratio within one sitting"
PE = "2026-12-06-peers"
PE2 = "2026-12-06-peers2"  # the second sitting: the all-gather launched halfway through the window
PE3 = "2026-12-07-peers3"  # the third: int8 over one all-gather (sync_collectives) beside the all-to-all rows
N0, X2, F2, F3 = num(",.0f"), num(".2f", "x"), num(".2f"), num(".3f")
_FSDP_1E3 = ("fsdp-lr1e-3", "fsdp-lr1e-3-seed43", "fsdp-lr1e-3-seed44")
_AVG_1E3 = ("fl_fsdp-h8-lr1e-3", "fl_fsdp-h8-lr1e-3-seed43", "fl_fsdp-h8-lr1e-3-seed44")
_FAST_1E3 = tuple(f"fl_fsdp-h16-p2-tau2-int8-ef-lr1e-3{x}" for x in ("", "-seed43", "-seed44"))
_HALF_1E3 = loss_at_step(G, "fsdp-lr1e-3", 416)
"""FSDP's eval loss at half its budget (832 steps) at lr 1e-3: the time-to-target sitting's target."""
_T542 = Source("the grid's fixed target 5.42", lambda root: 5.42)


def _of_limit(folder: str, link: str, run: str) -> Source:
    return ratio(tokens_per_s(folder, f"rate-{link}/{run}"), tokens_per_s(folder, f"rate-{link}/fl_fsdp-limit"))


def peers_tokens_per_s(row: str, link: str = "10mbit", sitting: str = PE) -> Source:
    """The median over a row's repetitions of each launch's tokens/s (its training tokens over its
    training seconds, as the launch recorded them in peers.json of ``sitting``)."""
    def get(d):
        return statistics.median(r["train_tokens"] / r["train_seconds"] for r in _peer_launches(d, row, link))
    return json_value(f"{sitting}/peers.json", get,
                      f"median over launches[{link}/{row}] of train_tokens / train_seconds")


def peers_bytes(row: str, link: str = "10mbit", sitting: str = PE) -> Source:
    return json_value(f"{sitting}/peers.json", lambda d: statistics.median(r["bytes_on_link"] for r in
                                                                          _peer_launches(d, row, link)),
                      f"median over launches[{link}/{row}] of bytes_on_link (veth tx counters)")


def _peer_launches(d: dict, row: str, link: str) -> list[dict]:
    return [r for r in d["launches"] if r["link"] == link and r["row"] == row and r.get("ok")]


_KEEP = tuple(f"fl_fsdp-h16-p2-tau2-keep-int8-ef-lr1e-3{x}" for x in ("", "-seed43", "-seed44"))
_AVG_4E3 = ("fl_fsdp-h8-lr4e-3", "fl_fsdp-h8-lr4e-3-seed43", "fl_fsdp-h8-lr4e-3-seed44")  # the best LR of both (issue 46 item 4)
_FSDP_4E3 = ("fsdp-lr4e-3", "fsdp-lr4e-3-seed43", "fsdp-lr4e-3-seed44")
_KEEP_GATHER = tuple(f"fl_fsdp-h16-p2-tau2-keep-int8-gather-ef-lr1e-3{x}" for x in ("", "-seed43", "-seed44"))
_H16 = ("fl_fsdp-h16-lr1e-3", "fl_fsdp-h16-lr1e-3-seed43")
_TAU4 = "fl_accel-h16-p2-tau4-keep-int8-ef"
_GATHER = "fl_accel-h16-p2-tau2-keep-int8-gather-ef"


def _speed(run: str, *keys) -> Source:
    def get(d):
        row = next(r for r in d["rows"] if r["run"] == run)
        for k in keys:
            row = row[k]
        return row
    return json_value(f"{SQ}/speed.json", get, f"rows[{run}]" + "".join(f"[{k!r}]" for k in keys))


def _ft_median(mode: str) -> Source:
    return json_value("2026-12-02-ft/link_summary.json",
                      lambda d: statistics.median(r["tokens_per_s"] for r in d["runs"][mode]),
                      f"median of runs.{mode}[].tokens_per_s")


FIGURES: tuple[Figure, ...] = (
    Figure(ROW_100, "1,229", N0, tokens_per_s(B, "rate-100mbit/fsdp")),
    Figure(ROW_100, "6,155", N0, tokens_per_s(B, "rate-100mbit/fl_fsdp")),
    Figure(ROW_100, "5.01x", X2, ratio(tokens_per_s(B, "rate-100mbit/fl_fsdp"), tokens_per_s(B, "rate-100mbit/fsdp"))),
    Figure(ROW_100, "2,671", N0, tokens_per_s(B, "rate-100mbit/hsdp")),
    Figure(ROW_100, "6,389", N0, tokens_per_s(B, "rate-100mbit/fl_hsdp")),
    Figure(ROW_100, "2.39x", X2, ratio(tokens_per_s(B, "rate-100mbit/fl_hsdp"), tokens_per_s(B, "rate-100mbit/hsdp"))),
    Figure(ROW_1G, "5,454", N0, tokens_per_s(B, "rate-1gbit/fsdp")),
    Figure(ROW_1G, "7,554", N0, tokens_per_s(B, "rate-1gbit/fl_fsdp")),
    Figure(ROW_1G, "1.39x", X2, ratio(tokens_per_s(B, "rate-1gbit/fl_fsdp"), tokens_per_s(B, "rate-1gbit/fsdp"))),
    Figure(ROW_R2, "2.14x", X2, ratio(tokens_per_s(R2, "rate-100mbit/fl_hsdp-r2-8p"),
                                      tokens_per_s(R2, "rate-100mbit/hsdp-8p"))),
    Figure(ROW_R2, "half", half, ratio(fl_mib(R2, "rate-100mbit/fl_hsdp-r2-8p"), fl_mib(B, "rate-100mbit/fl_fsdp"))),
    Figure(ROW_LIMIT, "0.30", F2, _of_limit(S, "10mbit", "fl_fsdp")),
    Figure(ROW_LIMIT, "0.86", F2, _of_limit(S, "10mbit", "fl_fsdp-p2-tau2-int8-ef")),
    Figure(ROW_SPARSE, "0.99", F2, _of_limit(SP, "10mbit", "fl_fsdp-p2-tau2-sparse-ef")),
    Figure(ROW_SPARSE, "0.3", num(".1f"), fl_mib(SP, "rate-10mbit/fl_fsdp-p2-tau2-sparse-ef")),
    Figure(ROW_SPARSE, "8.4", num(".1f"), fl_mib(S, "rate-10mbit/fl_fsdp-p2-tau2-int8-ef")),
    Figure(ROW_3E4, "5.248", F3, seed_mean(G, "fsdp", "fsdp-seed43")),
    Figure(ROW_3E4, "0.013", F3, seed_sd(G, "fsdp", "fsdp-seed43")),
    Figure(ROW_3E4, "5.408", F3, seed_mean(G, "fl_fsdp-h8", "fl_fsdp-h8-seed43")),
    Figure(ROW_3E4, "0.006", F3, seed_sd(G, "fl_fsdp-h8", "fl_fsdp-h8-seed43")),
    Figure(ROW_3E4, "5.250", F3, seed_mean(G, "fl_fsdp-h8-nesterov", "fl_fsdp-h8-nesterov-seed43")),
    Figure(ROW_3E4, "0.094", F3, seed_sd(G, "fl_fsdp-h8-nesterov", "fl_fsdp-h8-nesterov-seed43")),
    Figure(ROW_3E4, "0.134", F3, diff(final_loss(G, "fl_fsdp-h8-nesterov"),
                                      final_loss(G, "fl_fsdp-h8-nesterov-seed43"))),
    Figure(ROW_1E3, "0.020", F3, scaled(pooled_sd(G, _FSDP_1E3, _AVG_1E3, _FAST_1E3), 2)),
    Figure(ROW_1E3, "4.737", F3, seed_mean(G, *_FSDP_1E3)),
    Figure(ROW_1E3, "0.014", F3, seed_sd(G, *_FSDP_1E3)),
    Figure(ROW_1E3, "4.904", F3, seed_mean(G, *_AVG_1E3)),
    Figure(ROW_1E3, "0.008", F3, seed_sd(G, *_AVG_1E3)),
    Figure(ROW_1E3, "+0.167", num("+.3f"), difference(seed_mean(G, *_AVG_1E3), seed_mean(G, *_FSDP_1E3))),
    Figure(ROW_1E3, "4.970", F3, seed_mean(G, *_FAST_1E3)),
    Figure(ROW_1E3, "0.007", F3, seed_sd(G, *_FAST_1E3)),
    Figure(ROW_1E3, "+0.233", num("+.3f"), difference(seed_mean(G, *_FAST_1E3), seed_mean(G, *_FSDP_1E3))),
    Figure(ROW_1E3, "5.020", F3, seed_mean(G, "fl_fsdp-h8-p2-tau2-int8-ef-lr1e-3", "fl_fsdp-h8-p2-tau2-int8-ef-lr1e-3-seed43")),
    Figure(ROW_1E3, "0.012", F3, seed_sd(G, "fl_fsdp-h8-p2-tau2-int8-ef-lr1e-3", "fl_fsdp-h8-p2-tau2-int8-ef-lr1e-3-seed43")),
    Figure(ROW_1E3, "5.093", F3, final_loss(G, "fl_fsdp-h8-nesterov-lr1e-3")),
    Figure(ROW_1E3, "4.652", F3, seed_mean(G, *_AVG_4E3)),
    Figure(ROW_1E3, "0.024", F3, seed_sd(G, *_AVG_4E3)),
    Figure(ROW_1E3, "4.593", F3, seed_mean(G, *_FSDP_4E3)),
    Figure(ROW_1E3, "0.011", F3, seed_sd(G, *_FSDP_4E3)),
    Figure(ROW_1E3, "+0.059", num("+.3f"), difference(seed_mean(G, *_AVG_4E3), seed_mean(G, *_FSDP_4E3))),
    Figure(ROW_TTT, "4.967", F3, _HALF_1E3),
    Figure(ROW_TTT, "5.42", F2, json_value(T5 + "/time_to_target.json", lambda d: d["targets"]["5.42"], "targets['5.42'] (the grid's fixed target)")),
    Figure(ROW_TTT, "31.2", minutes, ttt_seconds(T5, "10mbit", "fl_fsdp-h8-lr1e-3", _HALF_1E3)),
    Figure(ROW_TTT, "0.55", F2, ttt(T5, "10mbit", "fl_fsdp-h8-lr1e-3", "of_limit")),
    Figure(ROW_TTT, "0.06", F2, ttt(T5, "10mbit", "fsdp-lr1e-3", "of_limit")),
    Figure(ROW_TTT, "20.1", minutes, ttt(T5, "10mbit", "fsdp-lr1e-3", "to_target_lower_bound_s", "half_budget")),
    Figure(ROW_TTT, "210", whole_minutes, ttt(T5, "10mbit", "fsdp-lr1e-3", "extrapolated_to_target", "half_budget")),
    Figure(ROW_TTT, "0.92", F2, ttt(T5, "10mbit", "fl_fsdp-h16-p2-tau2-int8-ef-lr1e-3", "of_limit")),
    Figure(ROW_TTT, "4.977", F3, ttt_final_loss(T5, "10mbit", "fl_fsdp-h16-p2-tau2-int8-ef-lr1e-3")),
    Figure(ROW_TTT, "4.964", F3, final_loss(G, "fl_fsdp-h16-p2-tau2-int8-ef-lr1e-3-seed43")),
    Figure(ROW_TTT, "9.8", minutes, ttt_seconds(T5, "10mbit", "fl_fsdp-h16-p2-tau2-int8-ef-lr1e-3", _T542)),
    Figure(ROW_TTT, "12.4", minutes, ttt_seconds(T5, "10mbit", "fl_fsdp-h8-lr1e-3", _T542)),
    Figure(ROW_TTT, "98", whole_minutes, ttt(T5, "10mbit", "fsdp-lr1e-3", "extrapolated_to_target", "5.42")),
    Figure(ROW_TTT, "26.8", minutes, ttt_seconds(T5, "100mbit", "fl_fsdp-h8-lr1e-3", _HALF_1E3)),
    Figure(ROW_TTT, "0.75", F2, ttt(T5, "100mbit", "fl_fsdp-h8-lr1e-3", "of_limit")),
    Figure(ROW_TTT, "25.0", minutes, ttt(T5, "100mbit", "fsdp-lr1e-3", "to_target_lower_bound_s", "half_budget")),
    Figure(ROW_TTT, "0.36", F2, ttt(T5, "100mbit", "fsdp-lr1e-3", "of_limit")),
    Figure(ROW_TTT, "38", whole_minutes, ttt(T5, "100mbit", "fsdp-lr1e-3", "extrapolated_to_target", "half_budget")),
    Figure(ROW_TTT, "8.7", minutes, ttt_seconds(T5, "100mbit", "fl_fsdp-h16-p2-tau2-int8-ef-lr1e-3", _T542)),
    Figure(ROW_TTT, "0.89", F2, ttt(T5, "100mbit", "fl_fsdp-h16-p2-tau2-int8-ef-lr1e-3", "of_limit")),
    Figure(ROW_TTT, "11.5", minutes, ttt_seconds(T5, "100mbit", "fl_fsdp-h8-lr1e-3", _T542)),
    Figure(ROW_TTT, "17.7", minutes, ttt_seconds(T5, "100mbit", "fsdp-lr1e-3", _T542)),
    Figure(ROW_SPEED, "1,545", N0, _speed("steps-2to1", "tokens_per_s")),
    Figure(ROW_SPEED, "47%", num(".0%"), _speed("steps-2to1", "arrival_share", 0)),
    Figure(ROW_SPEED, "2,321", N0, _speed("speed-2to1", "tokens_per_s")),
    Figure(ROW_SPEED, "1.50x", X2, ratio(_speed("speed-2to1", "tokens_per_s"), _speed("steps-2to1", "tokens_per_s"))),
    Figure(ROW_SPEED, "92%", num(".0%"), _speed("speed-2to1", "of_standalone_sum")),
    Figure(ROW_SPEED, "2%", num(".0%"), _speed("speed-2to1", "arrival_share", 0)),
    Figure(ROW_SPEED, "5.4225", num(".4f"), loss_at_step(G, "fsdp", 416)),
    Figure(ROW_SPEED, "0.58x", X2, json_value(
        f"{SQ}/speed.json", lambda d: next(r for r in d["quality"]["rows"] if r["run"] == "speed-2to1")["of_barrier"],
        "quality.rows[speed-2to1].of_barrier (its wall seconds to the loss over the barrier's)")),
    Figure(ROW_FT, "2,583", N0, _ft_median("torchft")),
    Figure(ROW_FT, "2,616", N0, _ft_median("single")),
    Figure(ROW_FT, "5.3%", num(".1%"), json_value("2026-12-02-ft/link_summary.json", lambda d: -min(d["pair_overheads"]),
                                                  "-min(pair_overheads) (1 - torchft / single tokens/s, pair by pair)")),
    Figure(ROW_FT, "5.4%", num(".1%"), json_value("2026-12-02-ft/link_summary.json", lambda d: max(d["pair_overheads"]),
                                                  "max(pair_overheads)")),
    Figure(ROW_FT, "1.3%", num(".1%"), Source("1 - " + ratio(_ft_median("torchft"), _ft_median("single")).where,
                                              lambda root: 1 - ratio(_ft_median("torchft"), _ft_median("single"))
                                              .compute(root))),
    Figure(ROW_PEERS, "0.99x", X2, ratio(peers_tokens_per_s("fl_accel-h8"), peers_tokens_per_s("torchft-h8"))),
    Figure(ROW_PEERS, "0.96x", X2, ratio(peers_tokens_per_s("fl_accel-h8-p2-tau2"),
                                         peers_tokens_per_s("torchft-h8-p2-tau2"))),
    Figure(ROW_PEERS, "6,114", N0, peers_tokens_per_s(_TAU4, sitting=PE2)),
    Figure(ROW_PEERS, "0.98", F2, ratio(peers_tokens_per_s(_TAU4, sitting=PE2),
                                        peers_tokens_per_s("fl_accel-limit", sitting=PE2))),
    Figure(ROW_PEERS, "6,251", N0, peers_tokens_per_s("fl_accel-limit", sitting=PE2)),
    Figure(ROW_PEERS, "1.78x", X2, ratio(peers_tokens_per_s(_TAU4, sitting=PE2),
                                         peers_tokens_per_s("torchft-h16-p2-tau2", sitting=PE2))),
    Figure(ROW_PEERS, "3,443", N0, peers_tokens_per_s("torchft-h16-p2-tau2", sitting=PE2)),
    Figure(ROW_PEERS, "5,188", N0, peers_tokens_per_s(_GATHER, sitting=PE3)),
    Figure(ROW_PEERS, "0.98", F2, ratio(peers_tokens_per_s(_GATHER, sitting=PE3),
                                        peers_tokens_per_s("fl_accel-limit", sitting=PE3))),
    Figure(ROW_PEERS, "1.55x", X2, ratio(peers_tokens_per_s(_GATHER, sitting=PE3),
                                         peers_tokens_per_s("torchft-h16-p2-tau2", sitting=PE3))),
    Figure(ROW_PEERS, "3,342", N0, peers_tokens_per_s("torchft-h16-p2-tau2", sitting=PE3)),
    Figure(ROW_PEERS, "0.51x", X2, ratio(peers_bytes(_TAU4, sitting=PE2),
                                          peers_bytes("torchft-h16-p2-tau2", sitting=PE2))),
    Figure(ROW_PEERS, "4.916", F3, seed_mean(G, *_KEEP)),
    Figure(ROW_PEERS, "0.003", F3, seed_sd(G, *_KEEP)),
    Figure(ROW_PEERS, "4.919", F3, seed_mean(G, *_KEEP_GATHER)),
    Figure(ROW_PEERS, "0.005", F3, seed_sd(G, *_KEEP_GATHER)),
    Figure(ROW_PEERS, "4.905", F3, seed_mean(G, *_H16)),
    Figure(ROW_PEERS, "0.003", F3, seed_sd(G, *_H16)),
    Figure(ROW_MEM, "1.2%", num(".1%"), json_value("2026-12-01-memory/memory.json", lambda d: max(
        abs(r["predicted_mb"] / r["live_delta_mb"] - 1) for r in d["rows"]), "max over rows of |predicted_mb / "
        "live_delta_mb - 1|")),
    Figure(ROW_MEM, "8 CPU runs", num("d", " CPU runs"), json_value(
        "2026-12-01-memory/memory.json", lambda d: len(d["rows"]), "number of rows")),
)

IGNORED = re.compile(r"`[^`]*`|\]\([^)]*\)|\b(?:H|P|tau|F|G|R|S)=\d+|\blr \d\S*|\d+ [MG]bit/s|\d+:\d+"
                     r"|\d+(?:\.\d+)?M tokens")
"""Numbers of a README cell that are settings, not measurements: code spans, link targets, H=16,
lr 1e-3, 10 Mbit/s, 2:1, 3.4M tokens."""


# ---------------------------------------------------------------------- checking
def readme_rows(text: str) -> dict[str, str]:
    """The rows of the table under "## Results": ``{first cell: the other cells}``."""
    section = text.split("\n## Results", 1)[1].split("\n## ", 1)[0] if "\n## Results" in text else ""
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) >= 2 and not set(cells[0]) <= set("-: "):
            out[cells[0]] = " | ".join(cells[1:])
    return out


def _cited(text: str, cell: str) -> re.Match | None:
    return re.search(r"(?<![\w.,])" + re.escape(text) + r"(?![\w%]|[.,]\d)", cell)


def check(figures: Sequence[Figure], readme: str, results: str) -> tuple[list[list[str]], list[str]]:
    """Recompute ``figures`` from the results folder ``results`` and find them in the README
    text ``readme``. Returns (one ``[status, row, printed, recomputed, source]`` per figure,
    the problems: mismatches, figures not in their row, numbers of a row no figure covers)."""
    rows, lines, problems = readme_rows(readme), [], []
    for f in figures:
        try:
            got = f.fmt(f.source.compute(results))
        except (OSError, KeyError, StopIteration, TypeError, ValueError, ZeroDivisionError) as exc:
            got = f"error: {type(exc).__name__}: {exc}"
        cell = rows.get(f.row)
        status = "ok" if got == f.text and cell is not None and _cited(f.text, cell) else (
            "MISMATCH" if got != f.text else "NOT IN README")
        if status != "ok":
            problems.append(f"{status}: {f.row!r}: {f.text!r} (FIGURES), recomputed {got!r} ({f.source.where})")
        lines.append([status, f.row, f.text, got, f.source.where])
    for row, cell in rows.items():
        if row in ("what",):  # the header
            continue
        rest = IGNORED.sub(" ", cell)
        for f in (f for f in figures if f.row == row):
            rest = re.sub(r"(?<![\w.,])" + re.escape(f.text) + r"(?![\w%]|[.,]\d)", " ", rest)
        left = re.findall(r"(?<![\w.])\d[\d,]*(?:\.\d+)?", rest)
        if left:
            problems.append(f"NOT COVERED: {row!r} cites {', '.join(left)}, which no entry of FIGURES recomputes")
    return lines, problems


def main(argv: Sequence[str] | None = None, figures: Sequence[Figure] = FIGURES) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.recompute", description=__doc__.split("\n\n")[0])
    p.add_argument("--readme", default=os.path.join(REPO, "README.md"))
    p.add_argument("--results", default=os.path.join(REPO, "bench", "results"), help="the results folders' root")
    args = p.parse_args(argv)
    with open(args.readme, encoding="utf-8") as fh:
        readme = fh.read()
    lines, problems = check(figures, readme, args.results)
    width = max((len(x[2]) for x in lines), default=0)
    for status, row, text, got, where in lines:
        print(f"{status:13} {text:>{width}}  recomputed {got:>{width}}  [{row}]  from {where}")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    print(f"{len(lines) - sum(x[0] != 'ok' for x in lines)} of {len(lines)} figures reproduce"
          + (f"; {len(problems)} problem(s)" if problems else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
