"""The checks of an FLConfig's fields, run once at its construction: types, ranges, constraints between fields.

Each raises ``ValueError`` naming the field, in pure Python, so every rank raises it before
any collective. What needs the world size (F dividing it, S dividing a group) is checked
when the config is resolved for a launch (:meth:`fl_accel.mesh.FLLayout.from_config`).
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from .mesh import is_federated, uses_hsdp
from .settings import check_type, type_hints


def check_fields(cfg) -> None:
    """Types, ranges and constraints between the fields of ``cfg`` (an FLConfig), without a
    world size (run once, by ``FLConfig.__post_init__``). Raises ValueError naming the field."""
    hints = type_hints(type(cfg))
    for f in fields(cfg):
        check_type(f"FLConfig.{f.name}", getattr(cfg, f.name), hints[f.name])
    for name, ok, what in (*((n, getattr(cfg, n) >= 1, ">= 1") for n in ("num_groups", "sync_every", "num_fragments",
                                                                          "sync_bucket_mb")),
                           ("outer_lr", cfg.outer_lr > 0, "> 0"),
                           ("outer_momentum", 0 <= cfg.outer_momentum < 1, "in [0, 1)"),
                           ("fragment_update_alpha", 0 <= cfg.fragment_update_alpha <= 1, "in [0, 1]"),
                           ("sync_density", 1 / 4096 <= cfg.sync_density <= 1,
                            "in [1/4096, 1] (at least one value of every 4096 is sent)"),
                           ("error_feedback_decay", cfg.error_feedback_decay is None
                            or 0 < cfg.error_feedback_decay <= 1, "None or in (0, 1]"),
                           ("sync_value_bits", cfg.sync_value_bits in (2, 4, 8), "2, 4 or 8"),
                           ("collective_timeout_s", cfg.collective_timeout_s > 0, "> 0 seconds"),
                           ("rejoin_timeout_s", cfg.rejoin_timeout_s >= 0, ">= 0 seconds"),
                           ("sync_warmup_steps", cfg.sync_warmup_steps >= 0, ">= 0 optimizer steps")):
        if not ok:
            raise ValueError(f"FLConfig.{name} must be {what}, got {getattr(cfg, name)}")
    warmup, decay = cfg.outer_lr_warmup_steps, cfg.outer_lr_decay_steps
    if cfg.outer_lr_schedule != "constant" or warmup:
        if cfg.outer_optimizer != "nesterov":
            raise ValueError(f"FLConfig.outer_lr_schedule={cfg.outer_lr_schedule!r} with outer_lr_warmup_steps="
                             f"{warmup} needs outer_optimizer='nesterov' ('avg' has no outer LR)")
        if warmup < 0:
            raise ValueError(f"FLConfig.outer_lr_warmup_steps must be >= 0, got {warmup}")
        if decay is not None and not warmup < decay:
            raise ValueError(f"FLConfig.outer_lr_warmup_steps={warmup} must be shorter than the run "
                             f"(FLConfig.outer_lr_decay_steps={decay} optimizer steps)")
    window = cfg.sync_window_s
    if cfg.sync_trigger == "time" and (window is None or not math.isfinite(window) or window <= 0):
        raise ValueError(f"FLConfig.sync_window_s must be a positive number of seconds with sync_trigger='time' "
                         f"(each round's training time), got {window!r}")
    if cfg.sync_trigger != "steps":
        if not cfg.is_federated:
            raise ValueError(f"FLConfig.sync_trigger={cfg.sync_trigger!r} needs federation groups: algorithm "
                             f"{cfg.algorithm!r} has one group spanning the world (use 'fl_fsdp' or 'fl_hsdp')")
        for name, value, plain in (("num_fragments", cfg.num_fragments, 1), ("fragment_update_alpha",
                                                                             cfg.fragment_update_alpha, 0.0),
                                   ("sync_warmup_steps", cfg.sync_warmup_steps, 0)):
            if value != plain:
                raise ValueError(f"FLConfig.{name}={value} is not supported with sync_trigger={cfg.sync_trigger!r}: "
                                 f"rounds of unequal length take num_fragments=1, fragment_update_alpha=0 and no "
                                 f"warm-up (sync_warmup_steps=0: the round budget counts every step)")
        if cfg.sync_delay not in (0, cfg.sync_every):
            raise ValueError(f"FLConfig.sync_delay={cfg.sync_delay} is not supported with sync_trigger="
                             f"{cfg.sync_trigger!r}: rounds of unequal length take sync_delay=0 (blocking) or "
                             f"sync_delay=sync_every={cfg.sync_every} (round k's exchange runs during round k+1)")
    if cfg.sync_dtype == "sparse" and not cfg.error_feedback:
        raise ValueError("FLConfig.error_feedback must be True with sync_dtype='sparse' (--error_feedback, "
                         "FL_ACCEL_ERROR_FEEDBACK=1): top-k leaves most of each pseudo-gradient for later syncs")
    if cfg.sync_every % cfg.num_fragments:
        raise ValueError(f"FLConfig.sync_every={cfg.sync_every} must be a multiple of "
                         f"FLConfig.num_fragments={cfg.num_fragments} (one fragment syncs every H/P steps)")
    check_delay(cfg)
    if cfg.fault_tolerant:
        if not cfg.is_federated:
            raise ValueError(f"FLConfig.fault_tolerance='torchft' needs a federated algorithm ('fl_fsdp' or "
                             f"'fl_hsdp'), got algorithm={cfg.algorithm!r}")
        if cfg.group_sizes is not None and len(set(cfg.group_sizes)) > 1:
            raise ValueError(f"FLConfig.fault_tolerance='torchft' does not support unequal groups (group_sizes="
                             f"{cfg.group_sizes}): torchft pairs the ranks of the live groups by their rank inside "
                             f"the group, and a group heals rank by rank from a peer of the same size. Use equal "
                             f"groups (num_groups) or fault_tolerance='none'.")
        if cfg.group_index is None:
            raise ValueError("FLConfig.group_index must be set with fault_tolerance='torchft' (each federation "
                             "group is its own launch): FL_ACCEL_GROUP_INDEX=f or --group_index f")
        if not 0 <= cfg.group_index < cfg.federation_size:
            raise ValueError(f"FLConfig.group_index must be in [0, num_groups={cfg.federation_size}), got "
                             f"{cfg.group_index}")
    check_group_fields(cfg, explicit_num_groups="num_groups" in cfg._explicit)


def check_delay(cfg) -> None:
    """``sync_delay`` (0 <= tau <= H), ``delayed_local_steps`` and what a torchft run supports.
    ValueError naming the fields."""
    H, tau, keep = cfg.sync_every, cfg.sync_delay, cfg.delayed_local_steps == "keep"
    if not 0 <= tau <= H:
        raise ValueError(f"FLConfig.sync_delay must satisfy 0 <= sync_delay <= sync_every = {H}, got {tau}")
    if keep and cfg.fragment_update_alpha:
        raise ValueError(f"FLConfig.fragment_update_alpha={cfg.fragment_update_alpha} must be 0 with "
                         f"FLConfig.delayed_local_steps='keep' (the local steps are kept whole, not mixed)")
    if tau == H and not keep and not cfg.fragment_update_alpha:
        raise ValueError(f"FLConfig.sync_delay={tau} = sync_every with delayed_local_steps='discard' and "
                         f"fragment_update_alpha=0 sends zero pseudo-gradients (each apply resets the parameters at "
                         f"the step the next exchange launches): use delayed_local_steps='keep'")
    if cfg.fault_tolerant:
        for name, bad in (("delayed_local_steps", keep), ("sync_delay", tau >= H // cfg.num_fragments),
                          ("sync_warmup_steps", cfg.sync_warmup_steps > 0)):
            if bad:
                raise ValueError(f"FLConfig.{name}={getattr(cfg, name)!r} is not supported with fault_tolerance="
                                 f"'torchft' (a heal takes over a live group with nothing in flight; tested: "
                                 f"sync_delay < sync_every/num_fragments, delayed_local_steps='discard', no warm-up)")


def check_group_fields(config: Any, explicit_num_groups: bool = True) -> None:
    """The layout checks of an FLConfig that need no world size. Raises ValueError naming the
    field: bad ``group_sizes``, S < 1 or not dividing a size, ``num_groups`` (given) not
    ``len(group_sizes)``, unequal sizes with "fl_fsdp" or without S."""
    sizes, shards = config.group_sizes, config.hsdp_shard_size
    if shards is not None and shards < 1:
        raise ValueError(f"FLConfig.hsdp_shard_size must be >= 1, got {shards}")
    if sizes is None:
        return
    if not sizes or min(sizes) < 1:
        raise ValueError(f"FLConfig.group_sizes must list positive group sizes, got {sizes}")
    if not is_federated(config.algorithm):
        return
    if explicit_num_groups and config.num_groups != len(sizes):
        raise ValueError(f"FLConfig.num_groups={config.num_groups} disagrees with FLConfig.group_sizes="
                         f"{sizes} ({len(sizes)} groups)")
    if len(set(sizes)) > 1:
        if config.algorithm == "fl_fsdp":
            raise ValueError(f"FLConfig.group_sizes={sizes} are unequal: algorithm 'fl_fsdp' needs equal groups; "
                             f"use algorithm='fl_hsdp' with an hsdp_shard_size S dividing every size "
                             f"(e.g. S={math.gcd(*sizes)})")
        if shards is None:
            raise ValueError(f"FLConfig.hsdp_shard_size must be set for unequal group_sizes={sizes} "
                             f"(a shard size dividing every group size, e.g. {math.gcd(*sizes)})")
    if shards is not None and uses_hsdp(config.algorithm) and any(g % shards for g in sizes):
        raise ValueError(f"FLConfig.hsdp_shard_size={shards} must divide every group size; it does not divide "
                         f"{[g for g in sizes if g % shards]} of group_sizes={sizes}")
