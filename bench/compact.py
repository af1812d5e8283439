"""The compact form of a results folder: what the report needs of every run, and nothing more.

A results folder (``bench/results/<name>/``) does not keep the runs' ``all_results.json``
and ``metrics.jsonl``. Instead:

* ``bench.json`` ``"runs"``: per run (keyed by its path, e.g. ``rate-100mbit/fl_fsdp`` or
  ``fl_fsdp-h8``) the whole-run figures of its ``all_results.json`` that the analysis reads
  (:data:`RUN_KEYS`);
* ``curves.csv``: one file for the whole suite, one line per (run, record, metric):
  ``suite,run,step,tokens,time_s,metric,value``. A record's kind follows from the metric:
  ``eval/...`` metrics belong to the evaluation record of that step, the others to the
  training record. Kept: :data:`CURVE_METRICS` of every record, and the traffic counters
  (``comm/<axis>/bytes`` and ``seconds``, ``comm/all_ranks/fl/bytes``) of the last training record
  only (what :func:`bench.analysis.split_comm` and :func:`bench.analysis.fl_bytes` read).
  Values are written with ``repr``, so they read back bit for bit.

:class:`CompactRuns` turns both back into run dicts of the shape
:func:`read_run` returns, so the analysis and the report run unchanged on a
work folder or on a committed results folder.
"""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Any, Iterable, Mapping, Sequence

CURVES_FILE = "curves.csv"
CURVE_COLUMNS = ("suite", "run", "step", "tokens", "time_s", "metric", "value")
CURVE_METRICS = ("train/loss", "eval/loss", "eval/perplexity")
"""Metrics kept for every record."""
LAST_TRAIN_METRICS = tuple(f"comm/{axis}/{fig}" for axis in ("fl", "dp_replicate", "dp_shard", "world")
                           for fig in ("bytes", "seconds")) + ("comm/all_ranks/fl/bytes", "comm_sum/fl/bytes")
"""Metrics kept for the last training record only: the traffic counters at the end of training
(``comm``: the largest rank's; ``comm/all_ranks``, before the key scheme ``comm_sum``: over all
ranks; recipes.metrics.RENAMED_KEYS)."""
RUN_KEYS = ("algorithm", "world_size", "num_groups", "group_sizes", "replicas", "shards", "sync_every", "fl",
            "eval_perplexity", "eval_loss", "eval_tokens", "eval_scored", "train_tokens", "steps", "tokens_per_step",
            "tokens_per_s", "tokens_per_s_per_process", "startup_seconds", "train_seconds",
            "eval_and_checkpoint_seconds", "wall_seconds", "sync_wait_seconds", "sync_time_share", "comm", "comm_sum",
            "n_params", "vocab_size", "model", "mixed_precision", "host", "fault_tolerance")
"""The whole-run figures of ``all_results.json`` kept per run (absent keys are skipped)."""


def compact_run(run: Mapping[str, Any]) -> dict:
    """The :data:`RUN_KEYS` of a run's ``all_results.json`` (``host`` without its per-CPU detail)."""
    out = {k: run[k] for k in RUN_KEYS if k in run}
    if isinstance(out.get("host"), dict):
        out["host"] = {k: v for k, v in out["host"].items() if k in ("background_cpu_share", "cpus", "wall_s")}
    return out


def curve_rows(suite: str, path: str, records: Iterable[Mapping[str, Any]],
               metrics: Sequence[str] = CURVE_METRICS) -> list[list]:
    """The curves.csv lines of one run (see the module docstring): ``metrics`` of every
    record, the traffic counters of the last training record."""
    records = list(records)
    train = [r for r in records if "train/loss" in r]
    last = max(train, key=lambda r: r["step"]) if train else None
    rows = []
    for r in records:
        keys = tuple(metrics) + (LAST_TRAIN_METRICS if r is last else ())
        for key in keys:
            value = r.get(key)
            if key.startswith("eval/") != ("eval/perplexity" in r) or value is None:
                continue  # a training record's eval keys and the converse do not exist
            rows.append([suite, path, r["step"], r.get("tokens"), r.get("time_s"), key, value])
    return rows


def _cell(x: Any) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        return repr(x)
    return str(x)


def write_curves(path: str, rows: Iterable[list]) -> str:
    """Write curves.csv (header :data:`CURVE_COLUMNS`); returns ``path``."""
    with open(path, "w", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(CURVE_COLUMNS)
        for row in rows:
            w.writerow([_cell(x) for x in row])
    return path


def _num(text: str) -> int | float | None:
    if text == "":
        return None
    try:
        return int(text)
    except ValueError:
        return float(text)


def read_curves(path: str) -> dict[str, list[dict]]:
    """curves.csv back into records per run path, in file order (training record before the
    evaluation record of the same step, as the recipe logs them). A metric met again for the
    same (run, kind, step) starts a new record: a step logged twice stays two records."""
    out: dict[str, list[dict]] = {}
    current: dict[tuple[str, str, int], dict] = {}
    with open(path, encoding="utf-8", newline="") as fh:
        for line in csv.DictReader(fh):
            kind = "eval" if line["metric"].startswith("eval/") else "train"
            key = (line["run"], kind, int(line["step"]))
            rec = current.get(key)
            if rec is None or line["metric"] in rec:
                rec = current[key] = {"step": key[2], "tokens": _num(line["tokens"]), "time_s": _num(line["time_s"])}
                out.setdefault(line["run"], []).append(rec)
            rec[line["metric"]] = _num(line["value"])
    return out


def read_run(path: str) -> dict | None:
    """``all_results.json`` of a run folder (under bench/work/) plus ``records`` (its
    metrics.jsonl) and ``path``; None if absent."""
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


class CompactRuns:
    """The runs of a committed results folder (bench.json ``runs`` + curves.csv), read like run
    folders: :meth:`get` returns what :func:`read_run` returns for a folder
    (``all_results.json``'s kept keys, ``records``, ``path``), None for a run not kept.
    ``status`` holds the saved state of the rows that had not finished (quality suites)."""

    def __init__(self, runs: Mapping[str, dict], curves: Mapping[str, list[dict]], where: str = "",
                 status: Mapping[str, dict] | None = None, work: str | None = None):
        self.runs, self.curves, self.where, self.status = dict(runs), dict(curves), where, dict(status or {})
        self.work = work
        """A work folder laid over the committed runs: a run finished there (its
        ``all_results.json``) replaces the committed one, and its unfinished runs' state
        replaces the saved one (a suite continued on another machine or checkout)."""

    @classmethod
    def load(cls, results_dir: str, work: str | None = None) -> "CompactRuns":
        """From ``results_dir``/bench.json and curves.csv (a missing curves.csv: no records),
        with ``work`` laid over them (see :attr:`work`)."""
        with open(os.path.join(results_dir, "bench.json"), encoding="utf-8") as fh:
            saved = json.load(fh)
        curves_path = os.path.join(results_dir, CURVES_FILE)
        curves = read_curves(curves_path) if os.path.isfile(curves_path) else {}
        status = (saved.get("results") or {}).get("status") or {}
        return cls(saved.get("runs") or {}, curves, results_dir, status, work=work)

    def in_work(self, path: str) -> bool:
        """The run finished in the work folder laid over these runs."""
        return bool(self.work) and os.path.isfile(os.path.join(self.work, path, "all_results.json"))

    def get(self, path: str) -> dict | None:
        if self.in_work(path):
            return read_run(os.path.join(self.work, path))
        if path not in self.runs:
            return None
        run = dict(self.runs[path])
        run["records"] = [dict(r) for r in self.curves.get(path, [])]
        run["path"] = os.path.join(self.where, path)
        return run

    def __contains__(self, path: str) -> bool:
        return path in self.runs or self.in_work(path)


def has_compact(results_dir: str) -> bool:
    """Whether ``results_dir`` holds a compact bench.json (with ``runs``)."""
    path = os.path.join(results_dir, "bench.json")
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as fh:
        return bool(json.load(fh).get("runs"))


def strip_curves(results: Any) -> Any:
    """The analysis without the per-run curves (``evals``, ``train``: they are in curves.csv),
    for bench.json. Non-finite floats become None (JSON has no NaN)."""
    if isinstance(results, dict):
        return {k: strip_curves(v) for k, v in results.items() if k not in ("evals", "train")}
    if isinstance(results, list):
        return [strip_curves(v) for v in results]
    if isinstance(results, float) and not math.isfinite(results):
        return None
    return results
