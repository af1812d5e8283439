"""The cost model's command line: bytes per GPU per step (and, given link speeds, step
time and tokens/s) of FSDP/HSDP, blocking FL, fragmented fp32 and int8 for a model
and a layout. Defaults: the paper's setting (Llama-3.1-8B, 128 nodes x 4 GPUs, G=4, H=8,
bf16 gathers). The model itself is :mod:`fl_accel.planning.cost`.

    python -m scripts.cost_model
    python -m scripts.cost_model --compute-s 1 --inter-node-gbs 12.5            # intra-node: NVLink 3 (default)
    python -m scripts.cost_model --compute-s 1 --inter-node-gbs 12.5 --intra-node-link pcie
    python -m scripts.cost_model --compute-s 1 --intra-node-gbs 100 --inter-node-gbs 12.5
    python -m scripts.cost_model --params 1.24e9 --world-size 16 --group-size 4 --json

The intra-node link is a preset (:mod:`fl_accel.planning.links`: nvlink, nvlink-h100, pcie,
pcie5, loopback, each with its source) or ``--intra-node-gbs``; by default the paper's
nodes' NVLink 3 (300 GB/s per direction). The output names the one used.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Sequence

from fl_accel.planning.cost import GB, _int, _num, estimate, predict_step_time, units_from_param_count
from fl_accel.mesh import FLLayout
from fl_accel.planning.links import DEFAULT_INTRA_NODE_LINK, INTRA_NODE_LINKS, intra_node_link
from fl_accel.planning.units import LLAMA_3_1_8B, llama_units
from scripts.cli import fail


def main(argv: Sequence[str] | None = None) -> int:
    """Defaults: the paper's setting (Llama-3.1-8B, 512 GPUs in groups of 4). Rows: FSDP (HSDP if S < G), blocking
    FL, fragmented fp32, int8 and sparse. Sparse is an all-gather: its bytes per rank grow with the number of
    groups N/G, so with many groups it can send more than int8 (scripts/link_guide.py compares settings per link)."""
    p = argparse.ArgumentParser(prog="python -m scripts.cost_model", description=main.__doc__)
    p.error = fail
    src = p.add_mutually_exclusive_group()
    src.add_argument("--params", help="a parameter count such as 1.24e9 (P equal resharded units) or a recipe "
                                      "preset (tiny, llama-1b, llama-8b, ...), not Llama-3.1-8B")
    src.add_argument("--llama-config", metavar="JSON", help="a Llama config.json, not Llama-3.1-8B")
    for flag, kind, default, text in [
            ("world-size", int, 512, "N"), ("ranks-per-node", int, 4, ""), ("group-size", int, 4, "G"),
            ("shard-size", int, None, "S (default G)"), ("sync-every", int, 8, "H"), ("num-fragments", int, 4, "P"),
            ("sync-delay", int, 1, "tau"), ("total-steps", int, None, "count a T-step run's syncs"),
            ("param-bytes", float, 2.0, "per gathered element"), ("compute-s", float, None, "seconds per step"),
            ("inter-node-gbs", float, None, "GB/s per NIC"),
            ("ranks-per-nic", int, None, "default: one NIC per node"), ("latency-us", float, 0.0, "per collective"),
            ("tokens-per-rank", float, None, "per step")]:
        p.add_argument("--" + flag, type=kind, default=default, help=f"{text} (default: %(default)s)")
    intra = p.add_mutually_exclusive_group()
    intra.add_argument("--intra-node-link", choices=list(INTRA_NODE_LINKS), default=None,
                       help="a preset for the links inside a node (GB/s per direction per GPU): " + "; ".join(
                           l.describe() for l in INTRA_NODE_LINKS.values())
                       + f". Default: {DEFAULT_INTRA_NODE_LINK} (the paper's A100 nodes)")
    intra.add_argument("--intra-node-gbs", type=float, default=None,
                       help=f"GB/s per direction inside a node, instead of a preset (default: the "
                            f"{INTRA_NODE_LINKS[DEFAULT_INTRA_NODE_LINK].describe()})")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        if a.params is not None:
            try:
                count = float(a.params)
            except ValueError:  # a preset's exact shapes, as the link guide reads them
                from scripts.link_guide import resolve_model  # it imports this module

                units, model = list(resolve_model(a.params).units), a.params
            else:
                if not math.isfinite(count) or count < 1:
                    raise ValueError(f"--params must be a parameter count such as 8e9 or a preset, got {a.params!r}")
                units, model = units_from_param_count(count, max(1, a.num_fragments)), f"{count:.4g} parameters"
        elif a.llama_config:
            with open(a.llama_config, encoding="utf-8") as fh:
                units, model = llama_units(json.load(fh)), a.llama_config
        else:
            units, model = llama_units(LLAMA_3_1_8B), "Llama-3.1-8B"
        N, G = _int("--world-size", a.world_size), _int("--group-size", a.group_size)
        S = G if a.shard_size is None else _int("--shard-size", a.shard_size)
        if N % G or G % S:
            raise ValueError(f"--group-size {G} must divide --world-size {N}, and --shard-size {S} the group size")
        if (a.compute_s is None) != (a.inter_node_gbs is None):
            raise ValueError("--compute-s and --inter-node-gbs go together (the intra-node link has a default)")
        if a.compute_s is None and (a.intra_node_gbs is not None or a.intra_node_link is not None):
            raise ValueError("--intra-node-link/--intra-node-gbs need --compute-s and --inter-node-gbs (step times)")
        if a.intra_node_gbs is not None:
            link = {"name": "--intra-node-gbs", "bytes_per_s": _num("--intra-node-gbs", a.intra_node_gbs) * GB,
                    "source": "given", "default": False}
        else:
            preset = intra_node_link(a.intra_node_link or DEFAULT_INTRA_NODE_LINK)
            link = {"name": preset.name, "bytes_per_s": preset.bytes_per_s, "source": preset.source,
                    "default": a.intra_node_link is None}
        fl, name = FLLayout.equal(N // G, G // S, S), "FL+FSDP" if S == G else "FL+HSDP"
        base = FLLayout.equal(1, 1, N) if S == G else FLLayout.equal(1, N // S, S)
        rows = [(base.algorithm.upper(), base, 1, 0, "fp32"),
                (f"{name} fp32, blocking", fl, 1, 0, "fp32"),
                ("fragmented fp32", fl, a.num_fragments, a.sync_delay, "fp32"),
                ("fragmented int8", fl, a.num_fragments, a.sync_delay, "int8"),
                ("fragmented sparse", fl, a.num_fragments, a.sync_delay, "sparse")]
        out = []
        for label, layout, P, tau, dtype in rows:
            e = estimate(layout, units, sync_every=a.sync_every, num_fragments=P, sync_delay=tau, sync_dtype=dtype,
                         param_bytes=a.param_bytes, ranks_per_node=a.ranks_per_node, total_steps=a.total_steps)
            t = None if a.compute_s is None else predict_step_time(
                e, compute_s=a.compute_s, intra_node_bw=link["bytes_per_s"], inter_node_bw=a.inter_node_gbs * GB,
                ranks_per_nic=a.ranks_per_nic, latency_s=a.latency_us * 1e-6, tokens_per_rank=a.tokens_per_rank)
            out.append((label, e, t))
    except (ValueError, OSError) as exc:
        fail(exc)
    if a.json:
        print(json.dumps([{"setting": lb, **e.as_dict(), "time": t and {**t.__dict__, "intra_node_link": link}}
                          for lb, e, t in out], indent=1))
        return 0
    from tabulate import tabulate

    head = ["setting", "H", "P", "tau", "inter-node GB/step", "intra-node GB/step", "fl GB/sync (peak)"]
    head += ["step s", "comm s", "exposed sync s", "tokens/s"] if a.compute_s is not None else []
    table = []
    for label, e, t in out:
        fed = [e.sync_every, e.num_fragments, e.sync_delay] if e.fragments else ["-"] * 3
        table.append([label, *fed, f"{e.inter_node / GB:.3f}", f"{e.intra_node / GB:.3f}",
                      f"{e.peak_sync_bytes / GB:.3f}" if e.fragments else "-"] + ([] if t is None else [
            f"{t.step_s:.3f}", f"{t.comm_s:.3f}", f"{t.exposed_sync_s:.3f}",
            "-" if t.tokens_per_s is None else f"{t.tokens_per_s:,.0f}"]))
    print(f"{model}: {sum(u.numel for u in units):,} parameters, {len(units)} FSDP units; N={N}, "
          f"{a.ranks_per_node} ranks/node, G={G}, S={S}; bytes per GPU (GB = 1e9 B), syncs amortized")
    print(tabulate(table, headers=head, tablefmt="github", disable_numparse=True))
    if a.compute_s is not None:
        where = "--intra-node-gbs" if link["source"] == "given" else f"preset {link['name']} ({link['source']})"
        default = "; the default: --intra-node-link or --intra-node-gbs sets another" if link["default"] else ""
        print(f"intra-node link: {link['bytes_per_s'] / GB:g} GB/s per direction per GPU, {where}{default}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
