"""Which exchange setting keeps up with a link, for a model size: the cost model's share of
the no-sync limit per setting, and where the measured quality of that setting is.

For each model and inter-group link it predicts, with :mod:`fl_accel.planning.cost`
(:func:`~fl_accel.planning.cost.estimate`, :func:`~fl_accel.planning.cost.predict_step_time`),
tokens/s over the tokens/s of the same layout with no inter-group traffic, for blocking fp32
at H=8/16/32, int8 + error feedback with fragments and sparse 1/64 with fragments, marks the
settings that keep at least ``--threshold`` (0.95) of that limit, and names the rows of the
convergence grid that measured each setting's quality. Every figure is the model's.

The layout: F federation groups of G GPUs, one group per site; a site's link to the others
is shared by its G GPUs (the cost model's one "node" per group); traffic inside a group is
taken to be part of the compute time. The compute time per optimizer step is
``--compute-s`` or, by default, FLOPs per token (:mod:`fl_accel.planning.flops`) x tokens per
GPU per step / (peak x MFU), an assumption the output states.

    python -m scripts.link_guide --params llama-8b --groups 2 --gpus-per-group 64 --link 10mbit
    python -m scripts.link_guide --params tiny llama-1b llama-8b --groups 2 --gpus-per-group 64
    python -m scripts.link_guide --params 3e9 --link 1gbit --compute-s 4 --json
    python -m scripts.link_guide --params llama-1b --link 100mbit --sync-warmup-steps 32   # + the warm-up's cost

A synchronous warm-up (``FLConfig.sync_warmup_steps`` K) averages every gradient across the
groups before each of its K steps (fp32 on the wire, not overlapped): ``--sync-warmup-steps``
adds its bytes per GPU over the link and its seconds against the same K steps without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from typing import Any, Sequence

from fl_accel.mesh import FLLayout
from fl_accel.planning.cost import (_int, _num, estimate, link_for_share, predict_step_time, share_of_limit,
                                    units_from_param_count)
from fl_accel.planning.flops import PEAK_BF16_TFLOPS, model_flops_per_token
from fl_accel.planning.units import llama_units
from recipes.args import RecipeArguments
from recipes.modeling import PRESET_ALIASES, PRESETS, preset_name
from scripts.cli import fail

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUALITY_TABLE = "bench/results/2026-12-03-grid/table.md"
"""The convergence grid whose rows measured each setting's quality (tiny model, 3.4M tokens)."""
QUALITY_JSON = "bench/results/2026-12-03-grid/bench.json"
"""Its figures (``results.seeds.configs``: mean and sd over seeds; ``results.rows``: one run each)."""
IN_GROUP_BW = 1e30
"""Bytes/s given to the cost model for links inside a group: their traffic is in the compute time."""
THRESHOLD = 0.95
DEFAULT_LINKS = ("10mbit", "100mbit", "1gbit", "10gbit")
DEFAULT_TOKENS_PER_GPU = 16384
DEFAULT_SEQ_LEN = 2048
DEFAULT_PEAK_TFLOPS = PEAK_BF16_TFLOPS["H100"]
DEFAULT_MFU = 0.4


@dataclasses.dataclass(frozen=True)
class Setting:
    """One exchange setting and the convergence-grid rows (id, label there) that measured it, each
    with the FSDP row of its learning rate (``fsdp_row``: the per-token reference)."""

    name: str
    short: str
    sync_every: int
    num_fragments: int
    sync_delay: int
    sync_dtype: str
    quality_rows: tuple[tuple[str, str], ...]
    fsdp_row: str = "fsdp-lr1e-3"
    delayed_local_steps: str = "discard"


SETTINGS = (
    Setting("fp32 H=8", "fp32 H=8", 8, 1, 0, "fp32", (("fl_fsdp-h8-lr1e-3", "FL+FSDP H=8 learning_rate 1e-3"),)),
    Setting("fp32 H=16", "fp32 H=16", 16, 1, 0, "fp32", (("fl_fsdp-h16-lr1e-3", "FL+FSDP H=16 learning_rate 1e-3"),)),
    Setting("fp32 H=32", "fp32 H=32", 32, 1, 0, "fp32", (("fl_fsdp-h32", "FL+FSDP H=32"),), fsdp_row="fsdp"),
    Setting("int8+EF H=16 P=2 tau=2 keep", "int8", 16, 2, 2, "int8",
            (("fl_fsdp-h16-p2-tau2-keep-int8-ef-lr1e-3",
              "FL+FSDP H=16 P=2 tau=2 int8+EF learning_rate 1e-3 delayed_local_steps keep"),
             ("fl_fsdp-h16-p2-tau2-keep-int8-gather-ef-lr1e-3",
              "FL+FSDP H=16 P=2 tau=2 int8+EF all-gather learning_rate 1e-3 delayed_local_steps keep")),
            delayed_local_steps="keep"),
    Setting("int8+EF H=32 P=2 tau=2 keep", "int8 H=32", 32, 2, 2, "int8",
            (("fl_fsdp-h32-p2-tau2-keep-int8-ef-lr1e-3",
              "FL+FSDP H=32 P=2 tau=2 int8+EF learning_rate 1e-3 delayed_local_steps keep"),),
            delayed_local_steps="keep"),
    Setting("sparse 1/64+EF H=8 P=2 tau=2", "sparse", 8, 2, 2, "sparse",
            (("fl_fsdp-h8-p2-tau2-sparse-ef-nesterov-lr1e-3",
              "FL+FSDP H=8 nesterov(0.7, 0.9) P=2 tau=2 sparse+EF learning_rate 1e-3"),)),
)
"""Blocking fp32 at H=8/16/32; int8 + error feedback with P=2 fragments whose exchange runs behind tau
steps (tau=2: at F = 2 int8 crosses in one all-gather, ``sync_collectives`` "auto", which kept 0.98 of the no-sync
limit at 10 Mbit/s in bench/results/2026-12-07-peers3; quality rows: over all-to-all, three seeds, and the
all-gather), the local steps made meanwhile kept (``delayed_local_steps="keep"``: issue 46's
ablation put the older rule's whole quality cost on discarding them); sparse (1/64 of the values,
2 bits, error feedback: the FLConfig defaults). The quality rows train at lr 1e-3, where the grid's
ablation ran (H=32: only at lr 3e-4); both methods do better at 4e-3 (docs/results.md). ``keep`` moves
no byte: the cost model's figures are the discard rule's."""


@dataclasses.dataclass(frozen=True)
class Model:
    """A model for the guide: its FSDP units and FLOPs per token (None: 6 x parameters)."""

    name: str
    units: tuple
    flops_per_token: float
    flops_note: str

    params = property(lambda self: sum(u.numel for u in self.units))


def parse_link(text: str) -> float:
    """Bits per second of ``10mbit``, ``100Mbit/s``, ``2.5gbit``, ``1Gbps``, ``500kbit``.

    Raises:
        ValueError: anything else, or a rate <= 0.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmg])(?:bit(?:/s)?|bps)\s*", str(text), re.I)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--link must be a rate such as 10mbit, 100Mbit/s or 1gbit, got {text!r}")
    return float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]


def link_text(bits_per_s: float) -> str:
    """``10 Mbit/s``, ``1 Gbit/s``, ``2.5 Gbit/s``."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.3g} {unit}"
    return f"{bits_per_s:.3g} bit/s"


def resolve_model(text: str, seq_len: int = DEFAULT_SEQ_LEN, num_units: int = 32) -> Model:
    """A preset of the recipe (``tiny``, ``llama3.2-1b`` or ``llama-1b``, ``llama3.1-8b`` or
    ``llama-8b``: its exact shapes, torchtitan's FLOPs per token at ``seq_len``) or a
    parameter count such as ``8e9`` (``num_units`` equal FSDP units, 6 FLOPs per parameter
    per token). The tiny preset takes the recipe's default BPE vocabulary.

    Raises:
        ValueError: neither a preset nor a positive number.
    """
    name = preset_name(text)
    if name is not None:
        config = dict(PRESETS[name])
        config.setdefault("vocab_size", RecipeArguments.__dataclass_fields__["vocab_size"].default)
        units = tuple(llama_units(config))
        return Model(text, units, model_flops_per_token(config, seq_len),
                     f"{model_flops_per_token(config, seq_len) / 1e9:.4g} GFLOP/token at seq_len {seq_len}")
    try:
        params = float(text)
    except ValueError:
        params = math.nan
    if not math.isfinite(params) or params < 1:
        raise ValueError(f"--params must be a parameter count such as 8e9 or one of "
                         f"{sorted([*PRESETS, *PRESET_ALIASES])}, got {text!r}")
    units = tuple(units_from_param_count(params, min(num_units, round(params))))
    return Model(f"{text.strip()} params", units, 6.0 * params, f"6 x {params:.3g} FLOP/token (6 per parameter)")


def compute_seconds(flops_per_token: float, tokens_per_gpu: float, peak_tflops: float, mfu: float) -> float:
    """Seconds of one optimizer step: FLOPs per token x tokens per GPU / (peak x MFU).

    Raises:
        ValueError: a non-positive input, or ``mfu`` > 1.
    """
    tokens, peak = _num("--tokens-per-gpu", tokens_per_gpu), _num("--peak-tflops", peak_tflops)
    if not 0 < _num("--mfu", mfu) <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {mfu!r}")
    return _num("flops per token", flops_per_token) * tokens / (peak * 1e12 * mfu)


def evaluate(model: Model, setting: Setting, *, groups: int, gpus_per_group: int, link_bits_per_s: float,
             compute_s: float, threshold: float = THRESHOLD) -> dict[str, Any]:
    """The cost model's figures of ``setting`` for ``model`` on F=``groups`` groups of
    G=``gpus_per_group`` GPUs whose group links carry ``link_bits_per_s``: ``share`` of the
    no-sync limit, ``keeps`` (share >= threshold), ``step_s``, ``limit_step_s``,
    ``exposed_sync_s`` and ``exchange_s`` per step (link-busy seconds on "fl"), and
    ``link_for_threshold_bits_per_s``: the slowest link that keeps ``threshold`` (None: none).

    Raises:
        ValueError: bad sizes (from the cost model, naming the argument).
    """
    F, G = _int("--groups", groups), _int("--gpus-per-group", gpus_per_group)
    if F < 2:
        raise ValueError(f"--groups must be >= 2 (one group has no inter-group link), got {F}")
    bw = _num("--link", link_bits_per_s) / 8
    est = estimate(FLLayout.equal(F, 1, G), list(model.units), sync_every=setting.sync_every,
                   num_fragments=setting.num_fragments, sync_delay=setting.sync_delay, sync_dtype=setting.sync_dtype,
                   ranks_per_node=G)
    t = predict_step_time(est, compute_s=compute_s, intra_node_bw=IN_GROUP_BW, inter_node_bw=bw)
    share = share_of_limit(t)
    need = link_for_share(est, threshold, compute_s=compute_s, intra_node_bw=IN_GROUP_BW)
    return {"setting": setting.name, "short": setting.short, "share": share, "keeps": share >= threshold,
            "step_s": t.step_s, "limit_step_s": t.step_s - t.exposed_sync_s, "exposed_sync_s": t.exposed_sync_s,
            "exchange_s": t.comm_s_by_axis["fl"], "link_for_threshold_bits_per_s": None if need is None else 8 * need}


def warmup_cost(model: Model, steps: int, *, groups: int, gpus_per_group: int, link_bits_per_s: float,
                compute_s: float) -> dict[str, Any]:
    """The cost model's figures of a synchronous warm-up of ``steps`` optimizer steps (each: a
    weighted fp32 mean of every gradient shard across the groups, blocking): ``bytes_per_gpu``
    over the link in all, ``seconds`` of those steps and ``extra_seconds`` over the same steps
    without the mean (compute and in-group traffic only).

    Raises:
        ValueError: bad sizes (naming the argument).
    """
    K, F, G = _int("--sync-warmup-steps", steps), _int("--groups", groups), _int("--gpus-per-group", gpus_per_group)
    est = estimate(FLLayout.equal(F, 1, G), list(model.units), sync_every=1, total_steps=K, sync_warmup_steps=K,
                   ranks_per_node=G)
    t = predict_step_time(est, compute_s=compute_s, intra_node_bw=IN_GROUP_BW,
                          inter_node_bw=_num("--link", link_bits_per_s) / 8)
    return {"steps": K, "bytes_per_gpu": K * est.by_axis()["fl"], "seconds": K * t.step_s,
            "extra_seconds": K * t.exposed_sync_s}


def guide(models: Sequence[Model], links: Sequence[float], *, groups: int, gpus_per_group: int,
          compute_s: float | None = None, tokens_per_gpu: float = DEFAULT_TOKENS_PER_GPU,
          peak_tflops: float = DEFAULT_PEAK_TFLOPS, mfu: float = DEFAULT_MFU,
          threshold: float = THRESHOLD, warmup_steps: int = 0) -> list[dict[str, Any]]:
    """One row per (model, link): its compute time (``compute_s``, else :func:`compute_seconds`),
    :func:`evaluate` of every :data:`SETTINGS` entry and, with ``warmup_steps`` > 0, the
    warm-up's cost (:func:`warmup_cost`; else None)."""
    if not 0 < _num("--threshold", threshold) <= 1:
        raise ValueError(f"--threshold must be in (0, 1], got {threshold!r}")
    rows = []
    for model in models:
        c = _num("--compute-s", compute_s) if compute_s is not None else compute_seconds(
            model.flops_per_token, tokens_per_gpu, peak_tflops, mfu)
        for link in links:
            results = [evaluate(model, s, groups=groups, gpus_per_group=gpus_per_group, link_bits_per_s=link,
                                compute_s=c, threshold=threshold) for s in SETTINGS]
            warm = warmup_cost(model, warmup_steps, groups=groups, gpus_per_group=gpus_per_group,
                               link_bits_per_s=link, compute_s=c) if warmup_steps else None
            rows.append({"model": model.name, "params": model.params, "groups": groups,
                         "gpus_per_group": gpus_per_group, "link_bits_per_s": link, "compute_s": c,
                         "results": results, "warmup": warm})
    return rows


def keeps_text(row: dict, threshold: float = THRESHOLD) -> str:
    """The settings of ``row`` that keep ``threshold``, or "none" and the slowest link any would need."""
    kept = [r["short"] for r in row["results"] if r["keeps"]]
    if kept:
        return ", ".join(kept)
    needs = [(r["link_for_threshold_bits_per_s"], r["short"]) for r in row["results"]
             if r["link_for_threshold_bits_per_s"] is not None]
    best = max(row["results"], key=lambda r: r["share"])
    if not needs:
        return f"none at any link speed (best: {best['short']} {best['share']:.3f})"
    bits, name = min(needs)
    return f"none (best here: {best['short']} {best['share']:.3f}; {name} needs {link_text(bits)})"


def share_text(share: float, keeps: bool) -> str:
    text = "<0.001" if share < 0.001 else f"{share:.3f}"
    return f"**{text}**" if keeps else text


def table(rows: Sequence[dict], threshold: float = THRESHOLD) -> str:
    """The rows as a GitHub-flavoured markdown table (shares >= threshold in bold)."""
    from tabulate import tabulate

    head = ["model", "link", "compute s/step"] + [s.name for s in SETTINGS] + [f"keeps >= {threshold:g}"]
    body = [[f"{r['model']} ({r['params'] / 1e9:.3g}B)" if r["params"] >= 1e8 else
             f"{r['model']} ({r['params'] / 1e6:.3g}M)", link_text(r["link_bits_per_s"]), f"{r['compute_s']:.3g}"]
            + [share_text(x["share"], x["keeps"]) for x in r["results"]] + [keeps_text(r, threshold)] for r in rows]
    return tabulate(body, headers=head, tablefmt="github", disable_numparse=True)


def needs_table(rows: Sequence[dict], threshold: float = THRESHOLD) -> str:
    """Per model (and compute time), the slowest link at which each setting keeps ``threshold``."""
    from tabulate import tabulate

    seen, body = set(), []
    for r in rows:
        if (r["model"], r["compute_s"]) in seen:
            continue
        seen.add((r["model"], r["compute_s"]))
        body.append([r["model"], f"{r['compute_s']:.3g}"] + [
            "-" if x["link_for_threshold_bits_per_s"] is None else link_text(x["link_for_threshold_bits_per_s"])
            for x in r["results"]])
    return tabulate(body, headers=["model", "compute s/step"] + [f"{s.name}: link for {threshold:g}"
                                                                 for s in SETTINGS],
                    tablefmt="github", disable_numparse=True)


def warmup_lines(rows: Sequence[dict]) -> list[str]:
    """One line per row with a warm-up: its bytes per GPU over the link and its seconds."""
    out = []
    for r in rows:
        w = r.get("warmup")
        if w:
            out.append(f"  {r['model']} at {link_text(r['link_bits_per_s'])}: {w['steps']} warm-up steps send "
                       f"{w['bytes_per_gpu'] / 1e9:.3g} GB per GPU over the link and take {w['seconds']:.3g} s, "
                       f"{w['extra_seconds']:.3g} s more than {w['steps']} local steps")
    return out


def measured_quality(root: str | None = None) -> dict[str, dict]:
    """Per grid row id: ``mean`` final eval loss, ``sd`` and ``n`` (seeds), from :data:`QUALITY_JSON`
    (mean over the seeds where the grid trained several, else the one run); {} when the file is
    absent (an installed copy without bench/)."""
    path = os.path.join(root or REPO_ROOT, QUALITY_JSON)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        results = json.load(fh).get("results") or {}
    out = {rid: {"mean": r["eval_loss"], "sd": None, "n": 1} for rid, r in (results.get("rows") or {}).items()
           if r.get("eval_loss") is not None}
    for rid, c in ((results.get("seeds") or {}).get("configs") or {}).items():
        if c.get("n"):
            out[rid] = {"mean": c["mean"], "sd": c.get("sd"), "n": c["n"]}
    return out


def quality_text(loss: dict | None) -> str:
    if loss is None:
        return "not finished"
    sd = f" \u00b1 {loss['sd']:.3f}" if loss["sd"] is not None and loss["n"] > 1 else ""
    return f"{loss['mean']:.3f}{sd} ({loss['n']} seed{'s' if loss['n'] > 1 else ''})"


def quality_lines(measured: dict[str, dict] | None = None) -> list[str]:
    """Each setting's measured final eval loss and its gap to FSDP at the same learning rate, from
    the committed grid (:func:`measured_quality`)."""
    measured = measured_quality() if measured is None else measured
    out = [f"Measured quality (tiny model, 3.4M tokens, 2 groups x 2 ranks; final eval loss, mean \u00b1 sd over "
           f"seeds; {QUALITY_TABLE}):"]
    for s in SETTINGS:
        ref = measured.get(s.fsdp_row)
        for rid, _ in s.quality_rows:
            row = measured.get(rid)
            gap = f", {row['mean'] - ref['mean']:+.3f} nats against FSDP's {ref['mean']:.3f} ({s.fsdp_row})" \
                if row and ref else ""
            out.append(f"  {s.name}: {quality_text(row)}{gap} [{rid}]")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Share of the no-sync limit per exchange setting, for a model size, F groups of G GPUs and a link."""
    p = argparse.ArgumentParser(prog="python -m scripts.link_guide", description=main.__doc__)
    p.error = fail
    p.add_argument("--params", nargs="+", required=True, metavar="MODEL",
                   help=f"parameter counts (8e9) or presets {sorted([*PRESETS, *PRESET_ALIASES])}")
    p.add_argument("--groups", type=int, default=2, help="F, federation groups (sites) (default: %(default)s)")
    p.add_argument("--gpus-per-group", type=int, default=8, help="G, GPUs sharing a group's link (default: "
                   "%(default)s)")
    p.add_argument("--link", nargs="+", default=list(DEFAULT_LINKS), help="inter-group link rates, e.g. 10mbit "
                   "100Mbit/s 1gbit (default: %(default)s)")
    p.add_argument("--compute-s", type=float, help="seconds of compute (and in-group traffic) per optimizer step; "
                   "default: FLOPs per token x --tokens-per-gpu / (--peak-tflops x --mfu)")
    p.add_argument("--tokens-per-gpu", type=float, default=DEFAULT_TOKENS_PER_GPU,
                   help="tokens per GPU per optimizer step (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help="for the attention FLOPs of a preset "
                   "(default: %(default)s)")
    p.add_argument("--peak-tflops", type=float, default=DEFAULT_PEAK_TFLOPS, help="dense bf16 peak per GPU "
                   "(default: %(default)s, H100/H200)")
    p.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="model FLOPs utilization (default: %(default)s)")
    p.add_argument("--threshold", type=float, default=THRESHOLD, help="share of the limit to keep "
                   "(default: %(default)s)")
    p.add_argument("--sync-warmup-steps", type=int, default=0, help="K: also the cost of a synchronous warm-up of "
                   "K steps (FLConfig.sync_warmup_steps; default: %(default)s)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        seq_len = _int("--seq-len", a.seq_len)
        models = [resolve_model(m, seq_len) for m in a.params]
        links = [parse_link(x) for x in a.link]
        rows = guide(models, links, groups=a.groups, gpus_per_group=a.gpus_per_group, compute_s=a.compute_s,
                     tokens_per_gpu=a.tokens_per_gpu, peak_tflops=a.peak_tflops, mfu=a.mfu, threshold=a.threshold,
                     warmup_steps=_int("--sync-warmup-steps", a.sync_warmup_steps, 0))
    except ValueError as exc:
        fail(exc)
    if a.compute_s is not None:
        compute = f"{a.compute_s:g} s per optimizer step (--compute-s) for every model"
    else:
        compute = "; ".join(f"{m.name}: {m.flops_note} x {a.tokens_per_gpu:,.0f} tokens per GPU / ({a.peak_tflops:g} "
                            f"TFLOPS x MFU {a.mfu:g}) = {r['compute_s']:.3g} s"
                            for m, r in zip(models, rows[::len(links)]))
        compute = f"assumed: {compute} per optimizer step (--tokens-per-gpu, --peak-tflops, --mfu or --compute-s)"
    assumptions = {
        "layout": f"F={a.groups} federation groups x G={a.gpus_per_group} GPUs; each group's link to the others is "
                  f"shared by its {a.gpus_per_group} GPUs; traffic inside a group counts as compute",
        "compute": compute,
        "share": "tokens/s over the tokens/s of the same layout with no inter-group traffic (the no-sync limit), "
                 "syncs amortized per step, the final sync not counted (fl_accel.planning.cost)",
    }
    if a.json:
        settings = [{**dataclasses.asdict(s), "quality_rows": [{"id": i, "label": lb} for i, lb in s.quality_rows]}
                    for s in SETTINGS]
        print(json.dumps({"figures": "model", "threshold": a.threshold, "assumptions": assumptions,
                          "quality_table": QUALITY_TABLE, "settings": settings, "rows": rows,
                          "measured_quality": measured_quality()}, indent=1))
        return 0
    print(f"Share of the no-sync limit per exchange setting (model: every figure is the cost model's, not a "
          f"measurement); >= {a.threshold:g} in bold. The answer depends on the model size, the GPUs per link and "
          f"the compute per step.")
    for key in ("layout", "compute", "share"):
        print(f"{key}: {assumptions[key]}")
    print()
    print(table(rows, a.threshold))
    print()
    print(f"The slowest link that keeps {a.threshold:g} of the limit (it scales with 1 / compute per step):")
    print()
    print(needs_table(rows, a.threshold))
    print()
    if a.sync_warmup_steps:
        print("The synchronous warm-up (a blocking fp32 mean of every gradient per step; model figures):")
        print("\n".join(warmup_lines(rows)))
        print()
    print("\n".join(quality_lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
