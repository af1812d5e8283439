"""Plots of training runs: one place for the recipe's ``curves.png``, ``scripts/compare.py``
and the benchmark's figures.

matplotlib is imported inside the functions (Agg backend, no display needed), so
importing this module costs nothing and needs no matplotlib: a training run without
matplotlib skips its ``curves.png`` (recipes/pretrain.py). Axes with token counts or rates use engineering
notation (``160k``, ``2.5k``). Runs with identical numbers must not hide each other:
every series gets its own colour, marker and line style, hollow markers alternate with
filled ones, and bar charts print their values.

Records are the dicts of a run's ``metrics.jsonl``: training records carry ``step``,
``tokens``, ``time_s`` and ``train/loss``; evaluation records ``eval/perplexity`` (and,
with per-group evaluation, ``eval/perplexity_group{f}``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from recipes.metrics import record_value

__all__ = ["Series", "style", "plot_run_curves", "plot_comparison", "plot_panels", "plot_bars"]

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LINESTYLES = ("-", "--", ":", "-.")
_GROUP_KEY = re.compile(r"^eval/perplexity_group(\d+)$")


@dataclass
class Series:
    """One line of a plot: ``label`` and the points ``x``, ``y`` (same length)."""

    label: str
    x: Sequence[float]
    y: Sequence[float]
    options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for ``Axes.plot`` (they override :func:`style`)."""


def style(i: int) -> dict[str, Any]:
    """Plot options of the i-th series: colour, marker, line style, marker fill and size all
    vary with ``i``, so equal curves stay distinguishable (first 8 all differ in marker)."""
    import matplotlib

    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    return {"color": colors[i % len(colors)], "marker": _MARKERS[i % len(_MARKERS)],
            "linestyle": _LINESTYLES[i % len(_LINESTYLES)], "markersize": 7 - 1.5 * (i % 3),
            "markerfacecolor": "none" if i % 2 else colors[i % len(colors)], "linewidth": 1.8 - 0.3 * (i % 3)}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _eng(axis) -> None:
    from matplotlib.ticker import EngFormatter

    axis.set_major_formatter(EngFormatter(sep=""))


def _save(fig, path: str | os.PathLike) -> str:
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _lines(ax, series: Iterable[Series]) -> int:
    n = 0
    for i, s in enumerate(series):
        if len(s.x) != len(s.y):
            raise ValueError(f"series {s.label!r}: {len(s.x)} x values but {len(s.y)} y values")
        if not len(s.x):
            continue
        ax.plot(list(s.x), list(s.y), label=s.label, **{**style(i), **s.options})
        n += 1
    return n


def _finish(ax, *, xlabel: str, ylabel: str, title: str | None = None, logy: bool = False, legend: bool = True,
            eng_x: bool = True) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if logy:
        ax.set_yscale("log")
    if eng_x:
        _eng(ax.xaxis)
    ax.grid(alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


EVAL_LABELS = {
    "synchronized": "synchronized model",
    "single group": "model",
    "own group per rank": "each rank's own group model",
}
"""Legend text of an overall evaluation by its ``eval/scored`` (see ``recipes/metrics.py``)."""


def _eval_series(records: Sequence[Mapping[str, Any]], x_key: str, name: str | None = None) -> list[Series]:
    """The overall perplexity curve and one per group. Labels say what was scored: the
    ``eval/scored`` of the records (a mid-run value, then "synchronized" after the final
    sync: "each rank's own group model, synchronized at the end"), and for the groups
    "group f, own model before each sync"."""
    evals = [r for r in records if "eval/perplexity" in r]
    if name is None:
        kinds = list(dict.fromkeys(r.get("eval/scored") for r in evals))
        labels = [EVAL_LABELS.get(k, "eval") for k in kinds] or ["eval"]
        name = labels[0] if len(set(labels)) == 1 else f"{labels[0]}, {labels[-1]} at the end"
    out = [Series(name, [r[x_key] for r in evals], [r["eval/perplexity"] for r in evals])]
    groups = sorted({int(m.group(1)) for r in records for k in r for m in [_GROUP_KEY.match(k)] if m})
    for f in groups:
        key = f"eval/perplexity_group{f}"
        pts = [r for r in records if key in r]
        out.append(Series(f"group {f}, own model before each sync", [r[x_key] for r in pts], [r[key] for r in pts],
                          {"alpha": 0.8}))
    return out


def sync_marks(records: Sequence[Mapping[str, Any]], sync_every: int | None, num_fragments: int = 1
               ) -> tuple[list[float], str]:
    """Training-token positions of the syncs a run made, and their legend text: every H
    optimizer steps (one fragment every H/P steps with P fragments), up to the last
    logged step. Empty without ``sync_every`` (a baseline) or records."""
    steps = [r for r in records if r.get("step")]
    if not sync_every or not steps:
        return [], ""
    per_step = steps[-1]["tokens"] / steps[-1]["step"]
    last = max(r["step"] for r in steps)
    period = max(1, sync_every // max(1, num_fragments))
    label = f"sync (every H={sync_every} steps)" if num_fragments <= 1 else \
        f"fragment sync (1 of P={num_fragments} every {period} steps)"
    return [k * per_step for k in range(period, last + 1, period)], label


# ---------------------------------------------------------------------- one run
def plot_run_curves(records: Sequence[Mapping[str, Any]], path: str | os.PathLike, title: str | None = None,
                    sync_every: int | None = None, num_fragments: int = 1) -> str:
    """The recipe's ``curves.png``: train loss, eval perplexity and tokens/s against training tokens.

    Args:
        records: the run's ``metrics.jsonl`` records (see the module docstring); records
            with ``eval/perplexity_group{f}`` add one perplexity curve per federation group;
            ``tokens_per_s`` of the training records draws the throughput panel.
        path: PNG to write (folders are created).
        title: figure title.
        sync_every, num_fragments: H and P of a federated run: every panel marks the syncs
            (vertical lines, :func:`sync_marks`).

    Returns:
        ``path`` as a string.
    """
    plt = _pyplot()
    train = [r for r in records if "train/loss" in r]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 3.8))
    _lines(a, [Series("train loss", [r["tokens"] for r in train], [r["train/loss"] for r in train],
                      {"marker": None})])
    _lines(b, _eval_series(records, "tokens"))
    rate = [r for r in train if record_value(r, "perf/tokens_per_s")]
    _lines(c, [Series("tokens/s", [r["tokens"] for r in rate], [record_value(r, "perf/tokens_per_s") for r in rate])])
    marks, label = sync_marks(records, sync_every, num_fragments)
    for ax in (a, b, c):
        for i, x in enumerate(marks):
            ax.axvline(x, color="grey", lw=0.7, ls=":", label=label if i == 0 else None)
    _finish(a, xlabel="training tokens", ylabel="train loss", legend=bool(marks))
    _finish(b, xlabel="training tokens", ylabel="eval perplexity", logy=True, legend=True)
    _finish(c, xlabel="training tokens", ylabel="tokens/s (all processes)", legend=False)
    _eng(c.yaxis)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


# ---------------------------------------------------------------------- several runs
def plot_comparison(runs: Sequence[Mapping[str, Any]], path: str | os.PathLike, title: str | None = None) -> str:
    """``scripts/compare.py``'s figure: eval perplexity vs tokens, vs training time, and tokens/s bars.

    Args:
        runs: one mapping per run with ``name``, ``records`` (metrics.jsonl records) and
            ``tokens_per_s`` (all processes; None or missing counts as 0).
        path: PNG to write.
        title: figure title.

    Returns:
        ``path`` as a string.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    by_tokens, by_time = [], []
    for r in runs:
        evals = [x for x in r.get("records", []) if "eval/perplexity" in x]
        by_tokens.append(Series(r["name"], [x["tokens"] for x in evals], [x["eval/perplexity"] for x in evals]))
        by_time.append(Series(r["name"], [x.get("time_s", 0.0) for x in evals],
                              [x["eval/perplexity"] for x in evals]))
    _lines(axes[0], by_tokens)
    _finish(axes[0], xlabel="training tokens", ylabel="eval perplexity", title="perplexity vs tokens", logy=True)
    _lines(axes[1], by_time)
    _finish(axes[1], xlabel="training time (s)", ylabel="eval perplexity", title="time to perplexity", logy=True)
    _hbars(axes[2], [r["name"] for r in runs], [r.get("tokens_per_s") or 0.0 for r in runs])
    axes[2].set_xlabel("tokens/s (all processes)")
    axes[2].set_title("throughput")
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def _hbars(ax, names: Sequence[str], values: Sequence[float]) -> None:
    colors = [style(i)["color"] for i in range(len(names))]
    ypos = list(range(len(names)))[::-1]  # first run on top
    bars = ax.barh(ypos, values, color=colors)
    ax.set_yticks(ypos, names)
    top = max(values, default=0.0) or 1.0
    for b, v in zip(bars, values):
        ax.text(b.get_width() + 0.01 * top, b.get_y() + b.get_height() / 2, f"{v:,.0f}", va="center", fontsize=8)
    ax.set_xlim(0, top * 1.18)
    _eng(ax.xaxis)
    ax.grid(alpha=0.3, axis="x")


def plot_panels(panels: Mapping[str, Sequence[Series]], path: str | os.PathLike, *, xlabel: str, ylabel: str,
                title: str | None = None, logy: bool = True, hlines: Mapping[str, float] | None = None) -> str:
    """One panel per key of ``panels`` (e.g. per link rate), each with its series.

    Args:
        panels: panel title -> series; the i-th series of every panel has the same
            :func:`style`, so one run looks the same in every panel.
        xlabel, ylabel: axis labels (x in engineering notation).
        logy: logarithmic y axis.
        hlines: panel title -> y of a dotted reference line (e.g. a target perplexity).

    Raises:
        ValueError: ``panels`` is empty, or a series has unequal x and y lengths.
    """
    if not panels:
        raise ValueError("plot_panels needs at least one panel")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.4), squeeze=False)
    for ax, (name, series) in zip(axes[0], panels.items()):
        _lines(ax, series)
        if hlines and name in hlines:
            ax.axhline(hlines[name], color="grey", lw=0.8, ls=":", label="target")
        _finish(ax, xlabel=xlabel, ylabel=ylabel, title=name, logy=logy)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_bars(groups: Mapping[str, Sequence[tuple[str, float, float | None]]], path: str | os.PathLike, *,
              ylabel: str, title: str | None = None, reference_label: str = "prediction") -> str:
    """Grouped vertical bars with their values printed on them.

    Args:
        groups: group name (x tick, e.g. a link rate) -> ``(label, value, reference)``
            per bar; bars with the same label share a colour across groups. ``reference``
            (or None) is drawn as a black tick across the bar (e.g. a prediction).
        ylabel: y axis label (engineering notation).
        reference_label: legend text of the ticks.

    Raises:
        ValueError: ``groups`` is empty.
    """
    if not groups:
        raise ValueError("plot_bars needs at least one group")
    plt = _pyplot()
    labels = list(dict.fromkeys(lbl for bars in groups.values() for lbl, _, _ in bars))
    width = 0.8 / max(1, max(len(b) for b in groups.values()))
    fig, ax = plt.subplots(figsize=(3 + 0.9 * sum(len(b) for b in groups.values()), 4.6))
    seen, ref_drawn = set(), False
    for j, bars in enumerate(groups.values()):
        for i, (lbl, value, ref) in enumerate(bars):
            x = j + (i - (len(bars) - 1) / 2) * width
            k = labels.index(lbl)
            b = ax.bar([x], [value], width * 0.95, color=style(k)["color"], hatch=("", "//", "..", "xx")[k // 10 % 4],
                       label=None if lbl in seen else lbl)[0]
            seen.add(lbl)
            ax.text(x, value, f"{value:,.0f}", ha="center", va="bottom", fontsize=7, rotation=90 if width < 0.12 else 0)
            if ref:
                ax.plot([b.get_x(), b.get_x() + b.get_width()], [ref, ref], color="black", lw=2)
                ref_drawn = True
    if ref_drawn:
        ax.plot([], [], color="black", lw=2, label=reference_label)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel(ylabel)
    _eng(ax.yaxis)
    ax.margins(y=0.15)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=2)
    if title:
        ax.set_title(title)
    return _save(fig, path)
