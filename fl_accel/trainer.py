"""FLTrainer: ``transformers.Trainer`` (and trainers built on it, e.g. TRL's ``SFTTrainer``) on FLAccelerator.

The swap is one line; everything else is the user's ``Trainer`` script::

    from fl_accel import FLConfig, FLTrainer
    trainer = FLTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=val,
                        fl_config=FLConfig(algorithm="fl_fsdp", num_groups=2, sync_every=8))

``federated(SFTTrainer)`` gives the same for another ``Trainer`` subclass (TRL's trainers).

What changes under the hood (``Trainer`` builds its ``Accelerator`` inside
``create_accelerator_and_postprocess``; :func:`fl_accel.compat.trainer_accelerator` makes that
call build an :class:`~fl_accel.FLAccelerator` with the same arguments):

* **FSDP2 per federation group.** ``TrainingArguments(fsdp=..., fsdp_config={"version": 2, ...})``
  give the FSDP2 plugin (wrap policy, activation checkpointing, resharding) as they do for
  ``Trainer``; without them fl_accel builds its own (``FSDP_*`` variables). FSDP version 1 is
  refused (FLAccelerator). Each group shards over its own ranks; every ``sync_every`` (H)
  optimizer steps the groups sync (paper Sec. 3). The run's length (``max_steps``, or the epochs'
  steps) is resolved into the accelerator before ``prepare`` (``set_max_steps``); the last
  optimizer step ends with the final sync (exact with a lossy ``sync_dtype``), before that
  step's logging, evaluation and checkpoint, so ``train()`` ends with identical groups.
* **LR schedule, gradient accumulation, clipping, logging**: Trainer's own; the scheduler is
  not prepared by Accelerate, so it steps once per optimizer step, exactly as under ``Trainer``.
* **Loss normalization** (``average_tokens_across_devices``, Trainer's default): ``Trainer``
  counts the tokens of a step over the world (an all-gather every optimizer step). Here the
  count is summed over this federation group's ranks only, scaled by N / G_f so that
  Trainer's loss scale (times N) gives the group's token mean: no collective between groups
  between syncs, and each group's gradient is its own tokens' mean (on packed data, without
  padding, the same value as Trainer's).
* **Checkpoints** (``save_steps``/``save_strategy``, ``resume_from_checkpoint``): each
  ``checkpoint-N`` holds Trainer's files (trainer state, scheduler, RNG) and ``fl_state/``,
  :meth:`FLAccelerator.save_state`'s federated checkpoint (every group's model and optimizer,
  the sync's state): a resumed run continues exactly, also from a checkpoint taken mid-round.
  Saving never syncs: the model files (``model.safetensors``, loadable by ``from_pretrained``)
  are written when the groups hold the same parameters (a checkpoint step that is a multiple
  of H); a checkpoint taken mid-round holds ``fl_state/`` only.
* **Export**: ``save_model()`` (and ``push_to_hub``) writes the federated model: the groups
  sync first when they differ, so it is their weighted mean.
* **Evaluation**: ``evaluate()`` runs Trainer's loop; at the end of ``train()`` and at
  evaluation steps that are multiples of H the groups are identical, so it scores the federated
  model. An evaluation mid-round scores each rank's rows with its own group's model.
* **Logs**: ``fl/syncs`` (sync events so far) and ``fl/sync_wait_s`` (this rank's seconds in
  syncs) are added to Trainer's logs (every ``report_to`` integration receives them).

Refused with ValueError on every rank before any collective: ``sync_trigger`` "time"/"speed"
(Trainer's loop counts optimizer steps, not a token budget), ``fault_tolerance="torchft"``
(a heal would not carry Trainer's own state), ``load_best_model_at_end`` (it would load one
checkpoint's groups in place of the trained federation); besides what FLAccelerator refuses.
"""

from __future__ import annotations

import functools
import os
import warnings

from transformers import Trainer, TrainerCallback

from . import FLAccelerator, compat  # FLAccelerator through the package, as a user's script takes it
from .config import FLConfig, ResolvedFLConfig

FL_STATE = "fl_state"
"""The folder of a Trainer checkpoint that holds the federated state (:meth:`FLAccelerator.save_state`)."""
SCHEDULER_FILE = "scheduler.pt"
"""Trainer's scheduler file in a checkpoint (``transformers.trainer.SCHEDULER_NAME``)."""


def _refuse(config: FLConfig, args) -> None:
    """ValueError for what FLTrainer does not support (module docstring), before any process group."""
    if config.sync_trigger != "steps":
        raise ValueError(f"FLTrainer: FLConfig.sync_trigger={config.sync_trigger!r} is not supported: Trainer's loop "
                         f"runs a fixed number of optimizer steps per rank, not a token budget. Use "
                         f"sync_trigger='steps', or the recipe (recipes/pretrain.py) for 'time'/'speed' rounds")
    if config.fault_tolerant:
        raise ValueError(f"FLTrainer: FLConfig.fault_tolerance={config.fault_tolerance!r} is not supported: a heal "
                         f"would not carry Trainer's scheduler and state. Use the recipe or your own Accelerate loop "
                         f"(docs/fault_tolerance.md)")
    if getattr(args, "load_best_model_at_end", False) and config.is_federated:
        raise ValueError("FLTrainer: load_best_model_at_end=True is not supported with a federated algorithm: it would "
                         "replace the trained federation by one checkpoint's groups. Keep the checkpoints "
                         "(save_total_limit) and load the one you want with from_pretrained")


class _FinalSyncAtLastStep(TrainerCallback):
    """At the end of the last optimizer step (before Trainer's logging, evaluation and
    checkpoint of that step) the final sync, if the groups differ: the last step's evaluation
    and checkpoint see the federated model. The same sync would come at the end of ``train()``."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def on_step_end(self, args, state, control, **kwargs):
        if state.max_steps and state.global_step >= state.max_steps:
            self.accelerator.sync_if_pending(final=True)


class FederatedTrainerMixin:
    """The overrides that make a ``transformers.Trainer`` subclass federated (module docstring).

    Put it first in the bases: ``class MyTrainer(FederatedTrainerMixin, SFTTrainer)``, or use
    :func:`federated`. ``fl_config``: an :class:`FLConfig` (None: ``FLConfig.from_env()``, the
    ``FL_ACCEL_*`` variables) or a resolved one of this launch's world; every other argument
    is the trainer's own. ValueError on every rank before any collective: an invalid config
    (naming the field), what :func:`_refuse` lists, and what FLAccelerator refuses."""

    def __init__(self, *args, fl_config: FLConfig | ResolvedFLConfig | None = None, **kwargs):
        config = FLConfig.from_env() if fl_config is None else fl_config
        if not isinstance(config, (FLConfig, ResolvedFLConfig)):
            raise ValueError(f"fl_config must be an FLConfig, got {type(config).__name__}")
        source = config.source if isinstance(config, ResolvedFLConfig) else config
        _refuse(source, kwargs.get("args", args[1] if len(args) > 1 else None))
        self._fl_config = config
        self._fl_mid_round_warned = False
        super().__init__(*args, **kwargs)
        self.add_callback(_FinalSyncAtLastStep(self.accelerator))
        self._warn_off_sync_steps()

    # ------------------------------------------------------------------ the accelerator
    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's own, with :class:`FLAccelerator` built from the same arguments."""
        with compat.trainer_accelerator(functools.partial(FLAccelerator, self._fl_config)):
            super().create_accelerator_and_postprocess()

    def _warn_off_sync_steps(self) -> None:
        """A warning (main process) when evaluations or checkpoints fall between syncs."""
        H, acc = self.accelerator.fl_config.sync_every, self.accelerator
        if acc.num_groups < 2 or not acc.is_main_process:
            return
        for what, strategy, steps, effect in (
                ("eval", self.args.eval_strategy, self.args.eval_steps,
                 "those evaluations score each rank's rows with its own group's model"),
                ("save", self.args.save_strategy, self.args.save_steps,
                 "those checkpoints hold every group's state (fl_state/) but no model.safetensors")):
            if str(getattr(strategy, "value", strategy)) == "steps" and steps and float(steps) >= 1 \
                    and int(steps) % H:
                warnings.warn(f"[fl_accel] {what}_steps={int(steps)} is not a multiple of sync_every={H}: {effect}. "
                              f"Use a multiple of {H} to {what} the federated model.", UserWarning, stacklevel=3)

    # ------------------------------------------------------------------ training
    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """Trainer's, after resolving the run's length into the accelerator (the last step's
        sync is the final one)."""
        acc = self.accelerator
        if acc.synchronizer is None and acc.max_steps != max_steps:
            acc.set_max_steps(max_steps)
        return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    def _finalize_training(self, *args, **kwargs):
        """The final sync, if the groups still differ (the last step was not a multiple of H, or
        training stopped early), then Trainer's end of training: ``train()`` ends with identical
        groups, and its metrics and ``on_train_end`` callbacks see the federated model."""
        self.accelerator.sync_if_pending(final=True)
        return super()._finalize_training(*args, **kwargs)

    def _get_num_items_in_batch(self, batch_samples, device):
        """The tokens of this optimizer step as Trainer counts them, summed over this
        federation group (not the world) and scaled by N / G_f (Trainer multiplies the loss by
        N): the loss is the group's token mean (module docstring)."""
        acc = self.accelerator
        if acc.num_groups < 2 or not self.args.average_tokens_across_devices:
            return super()._get_num_items_in_batch(batch_samples, device)
        self.args.average_tokens_across_devices = False
        try:
            count = super()._get_num_items_in_batch(batch_samples, device)
        finally:
            self.args.average_tokens_across_devices = True
        if count is None:
            return None
        import torch
        import torch.distributed as dist

        count = torch.as_tensor(count, device=acc.device, dtype=torch.float64)
        for axis in ("dp_shard", "dp_replicate"):  # the group's ranks: shards x replicas
            group = acc.mesh.groups.get(axis)
            if group is not None:
                dist.all_reduce(count, group=group)
        return (count * acc.num_processes / acc.layout.group_size_of(acc.group_index)).float()

    # ------------------------------------------------------------------ checkpoints and export
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer's ``save_model``: the federated model (the groups sync first when they
        differ), loadable with ``from_pretrained``, whatever the FSDP ``state_dict_type``
        (the full state dict is gathered; collective: every rank calls it, rank 0 writes).
        Inside a checkpoint (``_internal_call``) nothing syncs: the model files are written
        only when the groups hold the same parameters; mid-round the checkpoint's
        ``fl_state/`` holds every group's."""
        acc = self.accelerator
        if _internal_call and acc.federation.sync_pending:
            if not self._fl_mid_round_warned and acc.is_main_process:
                warnings.warn(f"[fl_accel] checkpoint at step {self.state.global_step} is mid-round (the groups differ): "
                              f"it holds every group's state ({FL_STATE}/) but no model files; save at multiples of "
                              f"sync_every={acc.fl_config.sync_every} to also get the federated model there",
                              UserWarning, stacklevel=2)
                self._fl_mid_round_warned = True
            return None
        # a checkpoint with the groups identical: their model, without the final sync that get_state_dict would
        # add for compression residuals (saving never changes the training)
        gather = super(FLAccelerator, acc).get_state_dict if _internal_call else acc.get_state_dict
        self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=gather(self.model))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        return None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The federated state (:meth:`FLAccelerator.save_state` into ``<checkpoint>/fl_state``:
        every group's model and optimizer, the sync's state) and Trainer's scheduler file."""
        import torch

        self.accelerator.save_state(os.path.join(output_dir, FL_STATE))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Resume the federation from ``<checkpoint>/fl_state`` (:meth:`FLAccelerator.load_state`:
        every group's model and optimizer, the sync's state; it checks the layout and settings
        first). ValueError: the checkpoint has no ``fl_state`` (not written by a federated trainer)."""
        path = os.path.join(resume_from_checkpoint, FL_STATE)
        if not os.path.isdir(path):
            raise ValueError(f"FLTrainer: {resume_from_checkpoint} has no {FL_STATE}/ folder (a checkpoint written by "
                             f"FLTrainer has one). To start from a model's weights, load them with from_pretrained "
                             f"and train without resume_from_checkpoint")
        self.accelerator.load_state(path)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The optimizer came back with ``fl_state`` (:meth:`_load_from_checkpoint`); the
        scheduler from Trainer's file."""
        if checkpoint is None:
            return
        import torch

        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_FILE), weights_only=True))

    # ------------------------------------------------------------------ logs
    def log(self, logs: dict, *args, **kwargs) -> None:
        """Trainer's ``log`` with ``fl/syncs`` and ``fl/sync_wait_s`` added while the federation is active."""
        fed = self.accelerator.federation
        if fed.active:
            logs = {**logs, "fl/syncs": fed.syncs_done, "fl/sync_wait_s": round(fed.sync_wait_seconds, 4)}
        return super().log(logs, *args, **kwargs)


def federated(trainer_cls: type) -> type:
    """``trainer_cls`` (a ``transformers.Trainer`` subclass, e.g. TRL's ``SFTTrainer``) with
    :class:`FederatedTrainerMixin` first: ``FLSFTTrainer = federated(SFTTrainer)``, then
    ``FLSFTTrainer(..., fl_config=FLConfig(...))``. TypeError: not a Trainer subclass."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise TypeError(f"federated() needs a transformers.Trainer subclass, got {trainer_cls!r}")
    if issubclass(trainer_cls, FederatedTrainerMixin):
        return trainer_cls
    return type(f"FL{trainer_cls.__name__}", (FederatedTrainerMixin, trainer_cls),
                {"__doc__": f"{trainer_cls.__name__} on FLAccelerator (fl_accel.trainer.federated)."})


class FLTrainer(FederatedTrainerMixin, Trainer):
    """``transformers.Trainer`` on FLAccelerator: FL+FSDP / FL+HSDP with Trainer's own settings (the module
    docstring). ``FLTrainer(model=..., args=..., ..., fl_config=FLConfig(...))``."""
