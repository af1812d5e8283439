"""What a launch refuses or warns about, decided on every rank before any process group exists.

FLAccelerator's settings and the recipe's (which refuses from the launcher's variables before
importing torch) go through the same functions here, so a refusal names the same fix wherever
it came from. Each raises ``ValueError`` naming where the setting came from and the fix. This
module imports no torch and no Accelerate at module level.
"""

from __future__ import annotations

import os
from typing import Callable


def start_notes(cfg, layout, device_type: str, mixed_precision: str) -> list[str]:
    """The warnings printed once at start (``cfg``: an FLConfig, ``layout``: its FLLayout):
    ignored settings, a defaulted S, slow bf16 on CPU."""
    notes = cfg.ignored_settings()
    if cfg.uses_hsdp and cfg.hsdp_shard_size is None:
        notes.append(f"hsdp_shard_size not set: using S={layout.shards} (the ranks per node that divide every "
                     f"group)" + (f"; that leaves one replica per group (R=1): set hsdp_shard_size="
                                  f"{layout.shards // 2} (the recipe's --hsdp_shard_size {layout.shards // 2}) "
                                  f"for 2 replicas"
                                  if layout.max_replicas == 1 and layout.shards % 2 == 0 else ""))
    if device_type == "cpu" and mixed_precision != "no":
        notes.append(f"mixed_precision={mixed_precision!r} on CPU runs several times slower than fp32")
    return notes


FP16_REASON = ("fp16 needs a loss scaler, and Accelerate's per-rank GradScaler can skip an optimizer step in one "
               "federation group only: the groups' step counters then diverge and the sync's collectives mismatch "
               "until they time out")


def _said(requested_by: str | Callable[[], str]) -> str:
    return requested_by() if callable(requested_by) else requested_by


def refuse_fp16(precision: str | None, requested_by: str | Callable[[], str]) -> None:
    """The one fp16 refusal (FLAccelerator's and the recipe's; in this module, which imports no
    torch, so that the recipe's planning refuses before importing it). Raises ValueError when
    ``precision`` is "fp16", naming ``requested_by`` (where the setting came from, or a function
    saying it, called only then) and the fix."""
    if str(precision or "no").lower() == "fp16":
        raise ValueError(f"fl_accel does not support fp16, requested by {_said(requested_by)}: use bf16 or 'no' "
                         f"there ({FP16_REASON})")


def refuse_whole_model_compile(compiles: bool, regional: bool, requested_by: str | Callable[[], str]) -> None:
    """The one whole-model-compile refusal (FLAccelerator's and the recipe's). Raises
    ValueError when ``compiles`` without ``regional`` compilation, naming ``requested_by`` (as
    :func:`refuse_fp16`): a whole-model ``torch.compile`` returns an OptimizedModule that
    bypasses FSDP2's hooks."""
    if compiles and not regional:
        raise ValueError(f"{_said(requested_by)} compiles the whole model, but fl_accel compiles regionally only (a "
                         f"whole-model torch.compile returns an OptimizedModule that bypasses FSDP2's hooks): set "
                         f"use_regional_compilation=True (TorchDynamoPlugin; in the Accelerate config "
                         f"dynamo_use_regional_compilation: true, each decoder layer is compiled in place)")


FSDP1_FIX = ("FLAccelerator shards every federation group with FSDP2 (fully_shard). Pass "
             "FullyShardedDataParallelPlugin(fsdp_version=2, ...) (its other options are kept), set "
             "`fsdp_version: 2` in your accelerate config, or pass no plugin (fl_accel then builds one from the "
             "FSDP_* variables)")


def refuse_fsdp1(kwargs: dict) -> None:
    """ValueError naming the fix: a user's FSDP plugin of ``fsdp_version`` 1, or an ``accelerate
    launch`` with FSDP and ``FSDP_VERSION`` not 2 (Accelerate would build an FSDP1 plugin)."""
    plugin = kwargs.get("fsdp_plugin")
    if plugin is not None and getattr(plugin, "fsdp_version", 1) != 2:
        raise ValueError(f"FLAccelerator: fsdp_plugin has fsdp_version={getattr(plugin, 'fsdp_version', None)!r}. "
                         + FSDP1_FIX + ".")
    # `accelerate launch` exports FSDP_VERSION with ACCELERATE_USE_FSDP; Accelerator() itself sets only the
    # latter when given a plugin (a second FLAccelerator in one process must not be refused for it)
    if plugin is None and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" \
            and os.environ.get("FSDP_VERSION") not in (None, "2"):
        raise ValueError(f"FLAccelerator: `accelerate launch` asked for FSDP version "
                         f"{os.environ.get('FSDP_VERSION', '1')} (FSDP_VERSION). " + FSDP1_FIX + ".")


def refuse_before_start(kwargs: dict, config, layout) -> None:
    """ValueError, on every rank before any process group: fp16, a whole-model compile, CPU
    offload with a federated algorithm, FSDP1 (:func:`refuse_fsdp1`)."""
    refuse_fsdp1(kwargs)
    precision = getattr(kwargs.get("mixed_precision"), "value", kwargs.get("mixed_precision"))
    if precision is not None:
        refuse_fp16(precision, f"mixed_precision={str(precision)!r}")
    else:
        refuse_fp16(os.environ.get("ACCELERATE_MIXED_PRECISION"), "mixed_precision='fp16' (ACCELERATE_MIXED_PRECISION,"
                                                                   " set by accelerate launch)")
    backend = kwargs.get("dynamo_backend")
    from accelerate.utils import DynamoBackend, TorchDynamoPlugin

    dynamo = TorchDynamoPlugin(backend=backend) if backend is not None else \
        kwargs.get("dynamo_plugin") or TorchDynamoPlugin()  # as Accelerator.__init__, env included
    refuse_whole_model_compile(dynamo.backend != DynamoBackend.NO, dynamo.use_regional_compilation,
                               lambda: f"the dynamo backend {dynamo.backend.value.lower()!r} (FLAccelerator's "
                                       f"dynamo_backend / dynamo_plugin, or ACCELERATE_DYNAMO_BACKEND)")
    plugin = kwargs.get("fsdp_plugin")
    offload = getattr(plugin, "cpu_offload", None) if plugin is not None else \
        os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() in ("true", "1")
    if layout.num_groups > 1 and (offload is True or type(offload).__name__ == "CPUOffloadPolicy"
                                  or getattr(offload, "offload_params", False)):
        raise ValueError(f"FLAccelerator: CPU offload (fsdp_offload_params / FSDP_OFFLOAD_PARAMS=true) is not "
                         f"supported with algorithm {config.algorithm!r}: the sync's collectives need the parameters "
                         f"on the accelerator. To save accelerator memory, set outer_state_device='cpu' (the sync's "
                         f"outer state in host memory) or activation checkpointing.")
