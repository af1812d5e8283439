"""Whether a memory estimate fits a GPU, and the smallest setting changes that make it fit.

:func:`verdict` reads one peak from :func:`fl_accel.planning.memory.estimate` against the
device's usable memory; :func:`smallest_fixes` tries single changes, then pairs (activation
checkpointing, the outer state on the host, a smaller micro-batch with more accumulation,
larger groups or shards) and returns the ones that fit. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fl_accel.planning.memory import ALLOCATOR_HEADROOM, estimate

TIGHT_MARGIN = 0.05
"""Share of the device below the usable memory (device x (1 - headroom)) under which a
configuration that fits is called "tight": the model's own uncertainty (activations +-30% at
8B, FACTS "Memory at the paper's setting") makes such a margin a risk."""


def verdict(total: float, gpu_memory_bytes: float, headroom: float = ALLOCATOR_HEADROOM) -> str:
    """"fits" (``total`` bytes leave at least :data:`TIGHT_MARGIN` of the device below the
    usable memory, ``gpu_memory_bytes`` x (1 - ``headroom``)), "tight" (at most the usable
    memory, with a smaller margin) or "does not fit" (above the usable memory: the caching
    allocator's headroom is needed too). ValueError: a non-positive memory or a headroom
    outside [0, 1)."""
    if not gpu_memory_bytes > 0 or not 0 <= headroom < 1:
        raise ValueError(f"need gpu_memory_bytes > 0 and 0 <= headroom < 1, got {gpu_memory_bytes}, {headroom}")
    margin = gpu_memory_bytes * (1 - headroom) - total
    if margin < 0:
        return "does not fit"
    return "tight" if margin < TIGHT_MARGIN * gpu_memory_bytes else "fits"


@dataclass(frozen=True)
class MemoryFix:
    """A change of settings that makes a configuration fit: ``changes`` maps setting names
    ("activation_checkpointing", "outer_state_device", "micro_batch" with
    "gradient_accumulation_steps" (tokens per step kept), "group_size" (FL+FSDP: fewer, larger
    groups), "shards" (HSDP: S larger)) to new values; ``total`` its peak in bytes;
    ``verdict`` "fits" or "tight"; ``changes_kinds`` the kinds of change combined (indices in
    the order :func:`smallest_fixes` tries them); ``note`` what else the change means
    (:data:`NO_FEDERATION` when a larger group leaves one group of the whole world), else ""."""

    changes: dict
    total: float
    verdict: str
    changes_kinds: tuple = ()
    note: str = ""


NO_FEDERATION = "one group: no federation"
"""The note of a fix whose group spans the world (F = 1: plain FSDP, nothing is federated)."""


def _candidates(kw: dict, layout: Any) -> list[list[dict]]:
    """The single changes to try, by kind, each kind's smallest change first."""
    kinds = []
    if kw.get("activation_checkpointing", "none") == "none":
        kinds.append([{"activation_checkpointing": "full"}])
    has_outer = layout is not None and layout.num_groups > 1 and (
        kw.get("outer_optimizer") == "nesterov" or kw.get("sync_dtype", "fp32") != "fp32")
    if has_outer and kw.get("outer_state_device", "same") == "same":
        kinds.append([{"outer_state_device": "cpu"}])
    b, acc = kw["micro_batch"], kw.get("gradient_accumulation_steps", 1)
    halvings, m = [], b
    while m > 1 and m % 2 == 0:
        m //= 2
        halvings.append({"micro_batch": m, "gradient_accumulation_steps": acc * (b // m)})
    if halvings:
        kinds.append(halvings)
    if layout is not None:
        N, G, S = layout.world_size, layout.group_size, layout.shards
        if layout.is_uniform and S == G and layout.num_groups > 1:  # FL+FSDP: larger groups shard further
            kinds.append([{"group_size": g} for g in range(2 * G, N + 1) if N % g == 0 and g % G == 0])
        elif layout.is_uniform and S < G:  # HSDP inside the group: shard over more ranks
            kinds.append([{"shards": s} for s in range(2 * S, G + 1) if G % s == 0 and s % S == 0])
    return [k for k in kinds if k]


def smallest_fixes(config: Any, gpu_memory_bytes: float, headroom: float = ALLOCATOR_HEADROOM, *, layout: Any,
                   **kw: Any) -> list[MemoryFix]:
    """The smallest changes that make :func:`estimate` (``config``, ``layout``, ``kw``) fit the
    device, fewest kinds first: for each kind of change (activation checkpointing, the outer
    state on the host, a smaller micro-batch with more accumulation, larger groups or shards,
    in that order) its smallest value that fits on its own; then the smallest values of each
    pair of kinds, a kind that fits alone only with a smaller value than alone (so a large
    change of one kind comes with the smaller combination that also works), and so on up to
    one kind more than the fewest that fit. [] when nothing tried fits. ValueError: as :func:`estimate`."""
    from itertools import combinations

    from fl_accel.mesh import FLLayout

    def run(change: dict) -> MemoryFix | None:
        args, lay = {**kw, **{k: v for k, v in change.items() if k not in ("group_size", "shards")}}, layout
        if "group_size" in change:
            g = change["group_size"]
            lay = FLLayout.equal(layout.world_size // g, 1, g)
        if "shards" in change:
            s = change["shards"]
            lay = FLLayout.equal(layout.num_groups, layout.group_size // s, s)
        total = estimate(config, layout=lay, **args).total
        answer = verdict(total, gpu_memory_bytes, headroom)
        note = NO_FEDERATION if lay.num_groups == 1 < layout.num_groups else ""
        return None if answer == "does not fit" else MemoryFix(change, total, answer, note=note)

    kinds = _candidates(kw, layout)
    found: list[MemoryFix] = []
    alone: dict[int, int] = {}  # kind -> the index of its smallest option that fits on its own
    for size in range(1, len(kinds) + 1):
        if found and size > min(len(f.changes_kinds) for f in found) + 1:
            break
        for group in combinations(range(len(kinds)), size):
            options = tuple(kinds[i][:alone.get(i, len(kinds[i]))] if size > 1 else kinds[i] for i in group)
            for choice in _product(options) if all(options) else ():
                fix = run({k: v for option in choice for k, v in option.items()})
                if fix is not None:
                    found.append(MemoryFix(fix.changes, fix.total, fix.verdict, tuple(group), fix.note))
                    if size == 1:
                        alone[group[0]] = kinds[group[0]].index(choice[0])
                    break  # this combination's smallest values
    return found


def _product(kinds: tuple[list[dict], ...]):
    """Every choice of one option per kind, the smallest options first."""
    from itertools import product

    return sorted(product(*kinds), key=lambda options: sum(kind.index(o) for kind, o in zip(kinds, options)))
