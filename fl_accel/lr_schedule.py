"""Learning-rate multipliers in transformers' formulas, and the sync's outer LR over the run.

The outer optimizer ("nesterov", DiLoCo arXiv 2311.08105) may follow a schedule
(``FLConfig.outer_lr_schedule``); a sync after optimizer step s uses ``outer_lr x
lr_multiplier(schedule, s - 1)`` (:func:`outer_lr`), a pure function of the step, so a
resumed run continues it exactly.
"""

from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "linear", "cosine")


def lr_multiplier(schedule: str, index: int, *, warmup_steps: int = 0, total_steps: int | None = None) -> float:
    """The learning-rate multiplier of ``schedule`` at step ``index``, transformers' formulas.

    Equal (bit for bit) to ``transformers.get_scheduler(name, opt, num_warmup_steps=W,
    num_training_steps=T).lr_lambdas[0](index)`` of transformers 5 (``optimization.py``) with
    name "constant_with_warmup" for "constant", "linear", and "cosine" (one half-cycle,
    ``num_cycles=0.5``, ``min_lr_rate=0``), written here so the library needs no transformers::

        index < W:  index / max(1, W)                        (linear warmup from 0; any schedule)
        constant:   1
        linear:     max(0, (T - index) / max(1, T - W))
        cosine:     max(0, (1 + cos(pi p)) / 2),  p = (index - W) / max(1, T - W)

    As transformers', "cosine" rises again past T (p > 1); callers stay at ``index < T``.

    Args:
        schedule: one of :data:`LR_SCHEDULES`.
        index: the scheduler's step count, 0-based (the multiplier of the ``index + 1``-th
            optimizer step).
        warmup_steps: W, steps of linear warmup (0: none).
        total_steps: T, the steps over which "linear" and "cosine" decay to 0 (unused by
            "constant").

    Returns:
        The multiplier (a float; 1 at the end of the warmup).

    Raises:
        ValueError: an unknown schedule, or "linear"/"cosine" without ``total_steps``.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}: one of {list(LR_SCHEDULES)}")
    if schedule != "constant" and total_steps is None:
        raise ValueError(f"the {schedule!r} learning-rate schedule needs total_steps")
    if index < warmup_steps:
        return float(index) / float(max(1, warmup_steps))
    if schedule == "constant":
        return 1.0
    span = float(max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return max(0.0, float(total_steps - index) / span)
    progress = float(index - warmup_steps) / span
    return float(max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress))))


def outer_lr(cfg, step: int) -> float:
    """The outer LR of a sync after optimizer step ``step`` (1-based) under FLConfig ``cfg``:
    ``outer_lr`` x :func:`lr_multiplier` (transformers' "constant_with_warmup", "cosine",
    "linear") at index ``step - 1``, as an inner scheduler of that shape (the last step's sync
    still moves); pure, so a resumed run continues it. ValueError: decay without its steps."""
    if cfg.outer_lr_schedule == "constant" and not cfg.outer_lr_warmup_steps:
        return float(cfg.outer_lr)
    if cfg.outer_lr_schedule != "constant" and cfg.outer_lr_decay_steps is None:
        raise ValueError(f"FLConfig.outer_lr_schedule={cfg.outer_lr_schedule!r} needs "
                         f"FLConfig.outer_lr_decay_steps (the run's optimizer steps)")
    return float(cfg.outer_lr) * lr_multiplier(cfg.outer_lr_schedule, step - 1,
                                               warmup_steps=cfg.outer_lr_warmup_steps,
                                               total_steps=cfg.outer_lr_decay_steps)
