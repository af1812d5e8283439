"""FLAccelerator: an ``accelerate.Accelerator`` whose FSDP2 mesh is one federation group.

A drop-in: a script written for ``Accelerator`` gets the same behaviour (docs/api.md has the
table of Accelerator calls, what each does here and the test that shows it), the federation
on top. Every reach into Accelerate's or torch's internals is in :mod:`fl_accel.compat`.

* Accelerate does not pick FSDP on CPU, so the state is set to FSDP2 over this group's mesh
  after construction (:func:`fl_accel.compat.set_fsdp_state`): the same ``fully_shard`` path on
  gloo and NCCL, and Accelerate's FSDP2 branch in every later call of the user's script.
* ``AcceleratorState`` calls ``fsdp_plugin.set_mixed_precision`` only when the plugin has no
  policy; a user's FSDP2 plugin is kept as given, an FSDP1 one refused (FSDP2 only).
* A prepared scheduler steps as Accelerate's does (``num_processes`` times per optimizer step
  unless ``split_batches``), so scripts that size it the Accelerate way get the same LR.
* The model's full state (``get_state_dict``, ``save_model``, ``save_pretrained`` of the
  unwrapped model) is the federated one: the groups sync first when they differ.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import warnings
from datetime import timedelta
from types import SimpleNamespace

import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import (DynamoBackend, FullyShardedDataParallelPlugin, InitProcessGroupKwargs, ParallelismConfig,
                              TorchDynamoPlugin)
from torch.distributed.fsdp import MixedPrecisionPolicy

from . import compat, fsdp, fsdp_model, trigger
from .checkpoint import CheckpointIO, load_federated_state, save_federated_state
from .comm import CommMeter, CommStats
from .config import FLConfig, ResolvedFLConfig, lighthouse_addr, refuse_fp16, refuse_whole_model_compile, start_notes
from .federation import Federation
from .mesh import AXES, FLLayout, build_mesh, init_process_group, ranks_per_node, world_size_from_env
from .mesh_transport import MeshTransport
from .sync import FederatedSynchronizer


def mixed_precision_policy(mixed_precision: str, reduce_dtype: str = "fp32") -> MixedPrecisionPolicy | None:
    """The FSDP2 policy of a ``mixed_precision``: "bf16" gives bf16 parameters and compute with
    gradients reduced in ``reduce_dtype`` ("fp32" or "bf16") and no output cast (the loss stays
    fp32); anything else None (fp32). ValueError: another ``reduce_dtype``."""
    if reduce_dtype not in ("fp32", "bf16"):
        raise ValueError(f"reduce_dtype must be 'fp32' or 'bf16', got {reduce_dtype!r}")
    if mixed_precision != "bf16":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                reduce_dtype=torch.float32 if reduce_dtype == "fp32" else torch.bfloat16)


def fsdp2_plugin(mixed_precision: str | None = None, reduce_dtype: str = "fp32",
                 activation_checkpointing: bool | None = None) -> FullyShardedDataParallelPlugin:
    """The one FSDP2 plugin fl_accel builds: ``fsdp_version=2``, the auto-wrap policy of
    ``FSDP_AUTO_WRAP_POLICY`` (default "transformer_based_wrap"), the precision policy of
    ``mixed_precision`` (:func:`mixed_precision_policy`; None: left for FLAccelerator to set
    from its own ``mixed_precision``) and ``activation_checkpointing`` (None: the
    ``FSDP_ACTIVATION_CHECKPOINTING`` that ``accelerate launch`` exports; the other
    ``FSDP_*`` variables too). ValueError: a bad ``reduce_dtype``."""
    policy = mixed_precision_policy(mixed_precision, reduce_dtype) if mixed_precision is not None else None
    return FullyShardedDataParallelPlugin(
        fsdp_version=2, activation_checkpointing=activation_checkpointing, mixed_precision_policy=policy,
        auto_wrap_policy=os.environ.get("FSDP_AUTO_WRAP_POLICY", "transformer_based_wrap"))


FSDP1_FIX = ("FLAccelerator shards every federation group with FSDP2 (fully_shard). Pass "
             "FullyShardedDataParallelPlugin(fsdp_version=2, ...) (its other options are kept), set "
             "`fsdp_version: 2` in your accelerate config, or pass no plugin (fl_accel then builds one from the "
             "FSDP_* variables)")


def _refuse_fsdp1(kwargs: dict) -> None:
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


def _refuse_before_start(kwargs: dict, config: FLConfig, layout: FLLayout) -> None:
    """ValueError, on every rank before any process group: fp16, a whole-model compile, CPU
    offload with a federated algorithm, FSDP1 (:func:`_refuse_fsdp1`)."""
    _refuse_fsdp1(kwargs)
    precision = getattr(kwargs.get("mixed_precision"), "value", kwargs.get("mixed_precision"))
    if precision is not None:
        refuse_fp16(precision, f"mixed_precision={str(precision)!r}")
    else:
        refuse_fp16(os.environ.get("ACCELERATE_MIXED_PRECISION"), "mixed_precision='fp16' (ACCELERATE_MIXED_PRECISION,"
                                                                   " set by accelerate launch)")
    backend = kwargs.get("dynamo_backend")
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


def _use_fsdp2(acc: "FLAccelerator", plugin, user_policy) -> None:
    """Point Accelerate's FSDP2 path at this rank's group, with the precision policy: the
    user's FSDP2 plugin as given (its own policy kept), else Accelerate's from ``accelerate
    launch`` (FSDP2: :func:`_refuse_fsdp1` ran), else :func:`fsdp2_plugin`."""
    state = acc.state
    plugin = plugin or getattr(state, "fsdp_plugin", None)
    if plugin is None:
        plugin = fsdp2_plugin()  # reads the FSDP_* environment variables `accelerate launch` sets
    if getattr(plugin, "fsdp_version", 1) != 2:  # refused before start; a state that changed since
        raise ValueError("FLAccelerator: Accelerate's state holds an FSDP1 plugin. " + FSDP1_FIX + ".")
    if user_policy is None:
        plugin.mixed_precision_policy = mixed_precision_policy(acc.mixed_precision)
    layout = acc.layout
    compat.set_fsdp_state(state, plugin, ParallelismConfig(dp_replicate_size=layout.replicas_of(acc.group_index),
                                                           dp_shard_size=layout.shards), acc.device_mesh)


def _resolve(fl_config: FLConfig | ResolvedFLConfig, world: int, max_steps: int | None) -> ResolvedFLConfig:
    """The run-time config of a launch of ``world`` ranks: ``fl_config`` resolved
    (:meth:`FLConfig.for_launch`), or a resolved one of this world taken as it is (with
    ``max_steps``, resolved for it). ValueError, before any process group: a resolved config
    of another world, a bad layout or run length (naming the field)."""
    if isinstance(fl_config, ResolvedFLConfig):
        if fl_config.world_size != world:
            raise ValueError(f"fl_config was resolved for a world of {fl_config.world_size} ranks, but WORLD_SIZE is "
                             f"{world}")
        return fl_config if max_steps is None else fl_config.with_max_steps(max_steps)
    return fl_config.for_launch(world, ranks_per_node=ranks_per_node(world), max_steps=max_steps)


class FLAccelerator(Accelerator):
    """Accelerator for FSDP / HSDP / FL+FSDP / FL+HSDP (paper Sec. 3).

    ``fl_config`` defaults to ``FLConfig.from_env()``; it is resolved once, here, for this
    launch (:func:`fl_accel.config.resolve_launch`: the layouts and, with ``max_steps`` or
    :meth:`set_max_steps` before ``prepare``, the run's length) into :attr:`run_config`, the
    one owner every reader reads (``fl_config``, ``layout`` and ``launch_layout`` are its
    parts). A :class:`~fl_accel.config.ResolvedFLConfig` of this launch's world (e.g. the
    recipe's plan) is taken as it is. ``accelerate_kwargs`` go to
    ``Accelerator`` (``cpu`` defaults to True without CUDA). ``mixed_precision="bf16"`` gives
    every unit ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (the loss stays
    fp32) unless the ``fsdp_plugin`` has a policy, which is kept. ValueError on every rank
    before any collective: an invalid ``fl_config`` (naming the field) or a refused setting
    (fp16, a whole-model compile, CPU offload with a federated algorithm, an FSDP1 plugin).
    Everything else is Accelerate's behaviour (docs/api.md, "Accelerate's API under
    FLAccelerator")."""

    def __init__(self, fl_config: FLConfig | ResolvedFLConfig | None = None, *, max_steps: int | None = None,
                 **accelerate_kwargs):
        fl_config = FLConfig.from_env() if fl_config is None else fl_config
        if not isinstance(fl_config, (FLConfig, ResolvedFLConfig)):
            raise ValueError(f"fl_config must be an FLConfig, got {type(fl_config).__name__}")
        world = world_size_from_env()
        source = fl_config.source if isinstance(fl_config, ResolvedFLConfig) else fl_config
        self.fault_tolerant = source.fault_tolerance == "torchft"
        if self.fault_tolerant:
            compat.check_torchft_version()  # every rank, before any process group
            self._lighthouse = lighthouse_addr(source)
            from .ft import resolve_address

            self._heal_address = resolve_address(source.heal_address)  # an interface name: this node's address
        self.run_config = _resolve(fl_config, world, max_steps)  # the one owner; every rank, no process group yet
        fl_config = self.fl_config
        _refuse_before_start(accelerate_kwargs, fl_config, self.layout)
        accelerate_kwargs.setdefault("cpu", not torch.cuda.is_available())
        timeout = timedelta(seconds=fl_config.collective_timeout_s)
        handlers = list(accelerate_kwargs.pop("kwargs_handlers", None) or [])
        if not any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
            handlers.append(InitProcessGroupKwargs(timeout=timeout))
        plugin = accelerate_kwargs.get("fsdp_plugin")
        user_policy = getattr(plugin, "mixed_precision_policy", None)
        init_process_group("gloo" if accelerate_kwargs["cpu"] else "nccl", timeout)
        super().__init__(kwargs_handlers=handlers, **accelerate_kwargs)
        if self.num_processes != self.launch_layout.world_size:
            raise ValueError(f"launched world size {self.num_processes} != WORLD_SIZE {world}")
        self.mesh = build_mesh(self.launch_layout, self.device.type, timeout, self.process_index)
        self.device_mesh = self.mesh.device_mesh
        offset = fl_config.group_index * world if self.fault_tolerant else 0
        self._fl_rank = offset + self.process_index  # this rank in the federation's layout
        self.group_index, self.replica_index, self.shard_index = self.layout.coords(self._fl_rank)
        _use_fsdp2(self, plugin, user_policy)
        self.comm_stats = CommStats()
        groups = {pg: axis for axis, pg in self.mesh.groups.items()}
        ranks = {tuple(sorted(self.launch_layout.axis_ranks(a, self.process_index))): a for a in AXES}
        self._comm_meter = CommMeter(self.comm_stats, groups, {r: a for r, a in ranks.items() if len(r) > 1})
        self.synchronizer: FederatedSynchronizer | None = None
        self.federation = Federation(self)
        """The federation's public status (:class:`fl_accel.federation.Federation`): what loops read."""
        self._last_loss: torch.Tensor | None = None
        self._grads_accumulating = False  # micro-batch gradients wait for their optimizer step
        if self.is_main_process:
            for note in start_notes(fl_config, self.layout, self.device.type, self.mixed_precision):
                warnings.warn(f"[fl_accel] {note}", UserWarning, stacklevel=2)

    run_config: ResolvedFLConfig
    """The run-time config (:class:`fl_accel.config.ResolvedFLConfig`), resolved once: the one owner."""
    fl_config = property(lambda self: self.run_config.config,
                         doc="The run's :class:`FLConfig` (``run_config.config``: filled for the run's length).")
    layout = property(lambda self: self.run_config.layout, doc="The federation's layout (``run_config.layout``).")
    launch_layout = property(lambda self: self.run_config.launch_layout,
                             doc='The layout of this launch\'s world: ``layout``, or the group\'s alone ("torchft").')
    max_steps = property(lambda self: self.run_config.max_steps,
                         doc="The run's length in optimizer steps (:meth:`set_max_steps`; None: not set).")
    num_groups = property(lambda self: self.layout.num_groups, doc="F (1 for the baselines).")

    @property
    def precision_policy(self) -> dict:
        """Every unit's FSDP2 policy as ``{"param", "reduce", "output"}`` names ("bf16", "fp32", None)."""
        policy = self.state.fsdp_plugin.mixed_precision_policy
        param = getattr(policy, "param_dtype", None)
        reduce, output = getattr(policy, "reduce_dtype", None) or param, getattr(policy, "output_dtype", None)
        name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get
        return {"param": name(param, "fp32"), "reduce": name(reduce, "fp32"), "output": name(output, output and "fp32")}

    activation_checkpointing = property(lambda self: bool(self.state.fsdp_plugin.activation_checkpointing))
    compiled = property(lambda self: self.state.dynamo_plugin.backend != DynamoBackend.NO)  # regional compilation

    def meter_comm(self) -> CommMeter:
        """``with accelerator.meter_comm():`` counts collectives into ``comm_stats`` (:mod:`fl_accel.comm`)."""
        return self._comm_meter

    def prepare(self, *args, device_placement=None):
        """Accelerate's prepare over this rank's group; attaches the synchronizer. ValueError
        on every rank: the groups' initial parameters differ, or a second model/optimizer
        pair on a federated run (it would train unfederated)."""
        pairs = [a for a in args if isinstance(a, (torch.nn.Module, torch.optim.Optimizer))]
        if self.synchronizer is not None and pairs and self.num_groups > 1:
            raise ValueError("FLAccelerator.prepare: this accelerator already federates one model and optimizer; a "
                             "second model/optimizer pair (e.g. an EMA or teacher model) would train unfederated. "
                             "Keep the second model out of prepare (e.g. an EMA updated from the federated model's "
                             "parameters).")
        with compat.meta_parameter_keys([a for a in args if isinstance(a, torch.nn.Module)]):
            result = super().prepare(*args, device_placement=device_placement)
        items = result if isinstance(result, (list, tuple)) else [result]
        model = next((o for o in items if isinstance(o, torch.nn.Module)), None)
        optimizer = next((o for o in items if isinstance(o, torch.optim.Optimizer)), None)
        if model is not None:
            fsdp_model.track_forward_only(model, lambda: self._grads_accumulating)
            _export_through_accelerator(self, model)
        if model is not None and optimizer is not None and self.synchronizer is None:
            named = list(model.named_parameters())
            transport = MeshTransport.from_mesh(self.mesh, self.process_index, self.fl_config.group_weighting,
                                                self.device)
            if self.fault_tolerant:
                transport = _managed_transport(self, transport, [p for _, p in named])
            self.synchronizer = FederatedSynchronizer(
                named, getattr(optimizer, "optimizer", optimizer), transport=transport, config=self.fl_config,
                units=fsdp.fsdp_units(model, [p for _, p in named]),
                planner=trigger.make_planner(self.fl_config, transport, self.layout.group_sizes))
            models = compat.prepared(self, "models")
            self.synchronizer.pre_sync_hooks.append(lambda *_: fsdp_model.reshard(models))  # always the last
            self.synchronizer.attach(loss_fn=lambda: self._last_loss)
            if not any(p.is_meta for p in model.parameters()):
                fsdp_model.check_replicas_identical(model, self.launch_layout, self.process_index, self.device)
            self._apply_run_length()
        return result

    def backward(self, loss, **kwargs):
        self._last_loss = loss.detach()
        self._grads_accumulating = not self.sync_gradients
        return super().backward(loss, **kwargs)

    def materialize(self, model, init_fn, *, seed: int = 0) -> None:
        """:func:`fl_accel.fsdp_model.materialize` a meta-prepared model, check that the groups agree
        (ValueError: a non-deterministic ``init_fn``), take the sync's anchor."""
        fsdp_model.materialize(model, init_fn, self.device, seed)
        fsdp_model.check_replicas_identical(model, self.launch_layout, self.process_index, self.device)
        if self.synchronizer is not None and self.synchronizer.schedule.active:
            self.synchronizer.outer.reset()

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """Shard the data by ``data_sharding`` (:meth:`data_shard`); "group" always uses the
        seedable sampler (else the generator is re-synchronized from rank 0)."""
        if getattr(data_loader, "_is_accelerate_prepared", False):
            if data_loader not in compat.prepared(self, "dataloaders"):
                compat.prepared(self, "dataloaders").append(data_loader)
            return data_loader
        num, index, seed = self.data_shard()
        per_group = self.fl_config.data_sharding == "group" and self.fl_config.is_federated
        prepared = prepare_data_loader(
            data_loader, self.device, num_processes=num, process_index=index, split_batches=self.split_batches,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            rng_types=self.rng_types.copy(), dispatch_batches=self.dispatch_batches, even_batches=self.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch, data_seed=seed,
            use_seedable_sampler=self.use_seedable_sampler or per_group,
            non_blocking=self.non_blocking, use_stateful_dataloader=self.use_stateful_dataloader)
        compat.prepared(self, "dataloaders").append(prepared)
        return prepared

    def data_shard(self) -> tuple[int, int, int | None]:
        """``(num_shards, shard_index, seed)``: "group" shuffles with ``data_seed + group_index``."""
        seed = self.dataloader_config.data_seed
        if self.fl_config.data_sharding == "group" and self.fl_config.is_federated:
            return (self.layout.group_size_of(self.group_index), self.layout.group_local_rank(self._fl_rank),
                    (seed or 0) + self.group_index)
        return self.layout.world_size, self._fl_rank, seed

    def _groups_differ(self) -> bool:
        sync = self.synchronizer
        return sync is not None and sync.schedule.active and not sync.schedule.in_sync

    def sync_if_pending(self, final: bool = False) -> bool:
        """Sync if the groups may differ; True if it synced. ``final``: the end of training (no
        more steps follow): with a lossy ``sync_dtype`` and ``final_sync="exact"`` the sync is
        exact and also runs when only error-feedback residuals are left to send."""
        sync = self.synchronizer
        if (final and sync is not None and sync.needs_final_sync()) or self._groups_differ():
            sync.sync(final=final)
            return True
        return False

    def set_max_steps(self, max_steps: int) -> None:
        """The run's length in optimizer steps, resolved into :attr:`run_config` (the one
        owner; :meth:`fl_accel.config.ResolvedFLConfig.with_max_steps`): the sync after step
        ``max_steps`` is the final one, so with a lossy ``sync_dtype`` and ``final_sync="exact"``
        it is the exact fp32 sync (else :meth:`end_training` adds it); with ``sync_trigger``
        "time"/"speed" a budget of ``max_steps`` x N rank-steps; a decaying outer-LR schedule
        without ``outer_lr_decay_steps`` spans the run (:meth:`FLConfig.with_max_steps`). Call it
        before ``prepare(model, optimizer)`` (or pass ``FLAccelerator(..., max_steps=...)``): the
        synchronizer is built from the resolved config. After ``prepare`` it may only set a
        length that leaves the config as it is. Raises ValueError, on every rank alike, changing
        nothing: not a positive integer; the outer-LR warmup not shorter than the run (naming
        ``FLConfig.outer_lr_warmup_steps``); after ``prepare``, a length that would change the
        synchronizer's config (naming ``FLConfig.outer_lr_decay_steps``)."""
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"set_max_steps needs a positive number of optimizer steps, got {max_steps!r}")
        resolved = self.run_config.with_max_steps(max_steps)
        if self.synchronizer is not None and resolved.config is not self.fl_config:
            raise ValueError(f"set_max_steps({max_steps}) after prepare would make FLConfig.outer_lr_decay_steps "
                             f"{resolved.config.outer_lr_decay_steps} (the outer-LR "
                             f"{self.fl_config.outer_lr_schedule!r} "
                             f"schedule spans the run), but the synchronizer was built with "
                             f"{self.fl_config.outer_lr_decay_steps}: set the run's length before prepare(model, "
                             f"optimizer) (set_max_steps, or FLAccelerator(..., max_steps=...)), or set "
                             f"FLConfig.outer_lr_decay_steps")
        self.run_config = resolved
        self._apply_run_length()

    def _apply_run_length(self) -> None:
        """The synchronizer's end of the run, from :attr:`run_config` ``.max_steps`` (if known)."""
        steps, sync = self.run_config.max_steps, self.synchronizer
        if steps is None or sync is None:
            return
        sync.planner.set_run_length(sync, steps)

    def get_state_dict(self, model, unwrap: bool = True):
        """The federated model's full state dict: Accelerate's for FSDP2 (the full tensors on the
        main process, an empty dict elsewhere), after :meth:`sync_if_pending` with ``final=True``
        when the groups may differ (steps since their last sync, or compression residuals left),
        so it is the exact weighted mean of the groups, never one group's. Also behind
        ``save_model`` and the prepared model's ``save_pretrained``. Collective: call it on every
        rank, as Accelerate's FSDP2 gather needs anyway."""
        self.sync_if_pending(final=True)
        return super().get_state_dict(model, unwrap=unwrap)

    def register_pre_sync_hook(self, hook, first: bool = False):
        """Call ``hook(synchronizer, full)`` before every sync event (it may run forwards, e.g.
        an evaluation); returns a handle with ``remove()``. The hook runs inside the event (its
        time counts as sync wait); a world collective of the hook that every rank makes
        first in the event goes inside ``synchronizer.arriving()`` to be counted as the wait
        for the other groups (``federation.sync_arrival_seconds``; ``federation.arriving()`` is the
        same). ``first``: before the hooks registered earlier (else after them). RuntimeError
        before ``prepare``."""
        if self.synchronizer is None:
            raise RuntimeError("register_pre_sync_hook needs prepare(model, optimizer) first")
        hooks = self.synchronizer.pre_sync_hooks
        hooks.insert(0 if first else len(hooks) - 1, hook)  # before the reshard, always the last
        return SimpleNamespace(remove=lambda: hooks.remove(hook) if hook in hooks else None)

    def save_state(self, output_dir: str | None = None, **kwargs):
        """:func:`fl_accel.checkpoint.save_federated_state` (``extra_meta``, ``rank_state``): each
        group's model and optimizer, the sync's state and Accelerate's own (RNG, schedulers,
        samplers, ``register_for_checkpointing`` objects). ``output_dir`` None: Accelerate's
        ``ProjectConfiguration(automatic_checkpoint_naming=True)`` naming
        (``<project_dir>/checkpoints/checkpoint_<i>``, ``total_limit`` kept), else ValueError.
        Returns the folder. Collective."""
        output_dir = self._automatic_checkpoint_dir("save_state") if output_dir is None else output_dir
        iteration = self.project_configuration.iteration
        with _accelerate_naming_off(self):
            out = save_federated_state(_checkpoint_io(self), output_dir, extra_meta=kwargs.get("extra_meta"),
                                       rank_state=kwargs.get("rank_state"))
        # one save, one iteration, as Accelerator.save_state counts (it also counts its own call inside)
        self.project_configuration.iteration = iteration + 1
        return out

    def load_state(self, input_dir: str | None = None, **kwargs):
        """:func:`fl_accel.checkpoint.load_federated_state`; returns the metadata. ``input_dir``
        None: the latest ``checkpoint_<i>`` of Accelerate's automatic naming, else ValueError."""
        if input_dir is None:
            input_dir = self._automatic_checkpoint_dir("load_state")
        with _accelerate_naming_off(self):
            meta = load_federated_state(_checkpoint_io(self), input_dir)
        if self.project_configuration.automatic_checkpoint_naming:
            digits = re.findall(r"(\d+)$", os.path.normpath(input_dir))
            if digits:
                self.project_configuration.iteration = int(digits[0]) + 1
        return meta

    def _automatic_checkpoint_dir(self, method: str) -> str:
        """Accelerate's automatic checkpoint folder: the next ``checkpoint_<iteration>`` (save,
        the oldest beyond ``total_limit`` removed by the main process) or the latest (load)."""
        config = self.project_configuration
        if not config.automatic_checkpoint_naming:
            raise ValueError(f"FLAccelerator.{method} needs a folder, or Accelerator(project_config="
                             f"ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True))")
        root = os.path.join(self.project_dir, "checkpoints")
        numbered = sorted((int(m.group(1)), name) for name in (os.listdir(root) if os.path.isdir(root) else [])
                          if (m := re.fullmatch(r"checkpoint_(\d+)", name)))
        if method == "load_state":
            if not numbered:
                raise ValueError(f"FLAccelerator.load_state: no checkpoint_<i> folder in {root}")
            return os.path.join(root, numbered[-1][1])
        if self.is_main_process:
            os.makedirs(root, exist_ok=True)
            extra = len(numbered) + 1 - config.total_limit if config.total_limit is not None else 0
            for _, name in numbered[:max(0, extra)]:
                shutil.rmtree(os.path.join(root, name))
        self.wait_for_everyone()
        return os.path.join(root, f"checkpoint_{config.iteration}")

    def end_training(self):
        """The final sync (exact with a lossy ``sync_dtype`` and ``final_sync="exact"``: it also
        sends the error-feedback residuals), then Accelerate's end_training (it destroys the
        process groups: save before); "torchft" first waits for the other groups to reach the end
        (``federation.wait_for_groups()``), then shuts the Manager down."""
        self.sync_if_pending(final=True)
        if self.synchronizer is not None:
            self.synchronizer.detach()
            if self.fault_tolerant:
                self.federation.wait_for_groups()
                self.synchronizer.transport.shutdown()
        self._comm_meter.stop()
        super().end_training()


def _export_through_accelerator(acc: "FLAccelerator", model) -> None:
    """Give the prepared model the two calls Accelerate's users make on it directly (instance
    attributes; the class is untouched):

    * ``save_pretrained(dir, ...)`` without ``state_dict`` passes
      :meth:`FLAccelerator.get_state_dict`'s (the federated model, synced first): transformers
      would read the model's own state dict, FSDP2's DTensor shards, and fail writing them
      ("Attempted to access the data pointer on an invalid python storage"). Collective, like
      Accelerate's FSDP2 gather: every rank calls it (the canonical scripts do, with
      ``is_main_process``); transformers writes on rank 0.
    * ``no_sync()`` (DDP's, which FSDP2 modules lack; Accelerate's autoregressive
      gradient-accumulation example calls it) is ``accelerator.no_sync(model)``."""
    original = getattr(model, "save_pretrained", None)
    if callable(original):
        @functools.wraps(original)
        def save_pretrained(save_directory, *args, state_dict=None, **kwargs):
            if state_dict is None:
                state_dict = acc.get_state_dict(model)
            return original(save_directory, *args, state_dict=state_dict, **kwargs)

        model.save_pretrained = save_pretrained
    if not hasattr(model, "no_sync"):
        model.no_sync = lambda: acc.no_sync(model)


@contextlib.contextmanager
def _accelerate_naming_off(acc: "FLAccelerator"):
    """Accelerate's own save/load inside FLAccelerator's use the folder fl_accel chose, not its
    automatic naming (which would pick another folder and count the iteration twice)."""
    config = acc.project_configuration
    automatic = config.automatic_checkpoint_naming
    config.automatic_checkpoint_naming = False
    try:
        yield
    finally:
        config.automatic_checkpoint_naming = automatic


def _managed_transport(acc: "FLAccelerator", inside: MeshTransport, params: list):
    """The torchft transport (:mod:`fl_accel.ft`); a heal carries the synchronizer's, the
    schedulers' and Accelerate's step state."""
    from . import ft

    def save():
        return ft.capture(acc.synchronizer, compat.prepared(acc, "schedulers"),
                          {"accelerate_step": compat.accumulation_counter(acc)})

    def load(state):
        fsdp_model.reshard(compat.prepared(acc, "models"))
        ft.restore(acc.synchronizer, compat.prepared(acc, "schedulers"), state)
        compat.set_accumulation_counter(acc, state["extra"].get("accelerate_step", compat.accumulation_counter(acc)))

    transport = ft.ManagedTransport.create(
        group_index=acc.group_index, group_rank=acc.process_index, group_size=acc.num_processes,
        lighthouse_addr=acc._lighthouse, timeout=timedelta(seconds=acc.fl_config.collective_timeout_s),
        inside=inside, save=save, load=load, init_sum=None if any(
            p.is_meta for p in params) else sum(float(fsdp.local(p).double().sum()) for p in params),
        num_groups=acc.layout.num_groups, heal_address=acc._heal_address,
        rejoin_timeout_s=acc.fl_config.rejoin_timeout_s)
    transport.meter = acc._comm_meter  # the exchange's traffic in the "fl" bucket
    return transport


def _checkpoint_io(acc: "FLAccelerator") -> CheckpointIO:
    """Accelerate saves what is not models and optimizers (:func:`compat.without_models_and_optimizers`)."""
    def accelerate_call(method, path):
        with compat.without_models_and_optimizers(acc):
            getattr(Accelerator, method)(acc, path)

    return CheckpointIO(
        models=list(compat.prepared(acc, "models")),
        optimizers=[getattr(o, "optimizer", o) for o in compat.prepared(acc, "optimizers")],
        synchronizer=acc.synchronizer, layout=acc.layout, config=acc.fl_config, rank=acc._fl_rank,
        barrier=acc.wait_for_everyone, extras=accelerate_call, is_main_process=acc.is_main_process)
