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

import warnings
from datetime import timedelta
from types import SimpleNamespace

import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import DynamoBackend, InitProcessGroupKwargs

from . import compat, fsdp, fsdp_model, trigger
from .checkpoint import (CheckpointIO, automatic_checkpoint_dir, automatic_naming_off, folder_iteration,
                         load_federated_state, save_federated_state)
from .comm import CommMeter, CommStats
from .config import FLConfig, ResolvedFLConfig, resolve_for_world
from .federation import Federation
from .mesh import AXES, build_mesh, init_process_group, world_size_from_env
from .mesh_transport import MeshTransport
from .refusals import refuse_before_start, start_notes
from .sync import Synchronizer


class FLAccelerator(Accelerator):
    """Accelerator for FSDP / HSDP / FL+FSDP / FL+HSDP (paper Sec. 3).

    ``fl_config`` (default ``FLConfig.from_env()``; a resolved one of this world is taken as it
    is) is resolved once, here, into :attr:`run_config` (:func:`fl_accel.config.resolve_for_world`),
    the one owner every reader reads. ``accelerate_kwargs`` go to ``Accelerator`` (``cpu``
    defaults to True without CUDA); ``mixed_precision="bf16"``: param bf16, reduce fp32, the
    loss fp32, unless the ``fsdp_plugin`` has a policy. ValueError on every rank before any
    collective: an invalid ``fl_config`` or a refused setting (:mod:`fl_accel.refusals`).
    Everything else is Accelerate's behaviour (docs/api.md)."""

    def __init__(self, fl_config: FLConfig | ResolvedFLConfig | None = None, *, max_steps: int | None = None,
                 **accelerate_kwargs):
        fl_config = FLConfig.from_env() if fl_config is None else fl_config
        if not isinstance(fl_config, (FLConfig, ResolvedFLConfig)):
            raise ValueError(f"fl_config must be an FLConfig, got {type(fl_config).__name__}")
        world = world_size_from_env()
        source = fl_config.source if isinstance(fl_config, ResolvedFLConfig) else fl_config
        self._heal_address = None  # torchft: FLConfig.heal_address as this node advertises it (fl_accel.ft_net)
        if source.fault_tolerant:  # torchft, its Lighthouse, heal_address of this host: every rank, no group yet
            from .ft_net import lighthouse_addr, resolve_address
            lighthouse_addr(source)
            self._heal_address = resolve_address(source.heal_address)
        self.run_config = resolve_for_world(fl_config, world, max_steps)  # the one owner; every rank, no process group
        fl_config = self.fl_config
        refuse_before_start(accelerate_kwargs, fl_config, self.layout)
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
        offset = fl_config.group_index * world if self.run_config.fault_tolerant else 0
        self._fl_rank = offset + self.process_index  # this rank in the federation's layout
        self.group_index, self.replica_index, self.shard_index = self.layout.coords(self._fl_rank)
        fsdp_model.use_fsdp2(self.state, plugin, user_policy, self.mixed_precision,
                             self.layout.replicas_of(self.group_index), self.layout.shards, self.device_mesh)
        self.comm_stats = CommStats()
        groups = {pg: axis for axis, pg in self.mesh.groups.items()}
        ranks = {tuple(sorted(self.launch_layout.axis_ranks(a, self.process_index))): a for a in AXES}
        self._comm_meter = CommMeter(self.comm_stats, groups, {r: a for r, a in ranks.items() if len(r) > 1})
        self.synchronizer: Synchronizer | None = None
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
            fsdp_model.export_through(model, lambda m: self.get_state_dict(m), lambda m: self.no_sync(m))
        if model is not None and optimizer is not None and self.synchronizer is None:
            named = list(model.named_parameters())
            transport = MeshTransport.from_mesh(self.mesh, self.process_index, self.fl_config.group_weighting,
                                                self.device)
            if self.run_config.fault_tolerant:
                from .ft import managed_transport
                transport = managed_transport(self, transport, [p for _, p in named])
            self.synchronizer = Synchronizer(
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
            self.synchronizer.reset_anchors()

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
        """The run's length in optimizer steps, resolved into :attr:`run_config`: the sync after
        step ``max_steps`` is the final one (exact with a lossy ``sync_dtype`` and
        ``final_sync="exact"``); with ``sync_trigger`` "time"/"speed" a budget of ``max_steps`` x
        N rank-steps; a decaying outer-LR schedule without ``outer_lr_decay_steps`` spans the run.
        Call it before ``prepare`` (or pass ``FLAccelerator(..., max_steps=...)``); after, only a
        length that leaves the config as it is. ValueError on every rank, changing nothing: not a
        positive integer; the outer-LR warmup not shorter than the run (naming
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
        sync.planner.set_run_length(sync.schedule, steps)

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
        """Call ``hook(event, full)`` before every sync event (``event``: a
        :class:`fl_accel.sync.SyncEvent`; the hook may run forwards, e.g. an evaluation);
        returns a handle with ``remove()``. The hook's time counts as sync wait; its first world
        collective, made by every rank, goes inside ``federation.arriving()`` to count as the
        wait for the other groups (``federation.sync_arrival_seconds``). ``first``: before the
        hooks registered earlier. RuntimeError before ``prepare``."""
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
        output_dir = self._automatic_dir("save_state") if output_dir is None else output_dir
        iteration = self.project_configuration.iteration
        with automatic_naming_off(self.project_configuration):
            out = save_federated_state(_checkpoint_io(self), output_dir, extra_meta=kwargs.get("extra_meta"),
                                       rank_state=kwargs.get("rank_state"))
        # one save, one iteration, as Accelerator.save_state counts (it also counts its own call inside)
        self.project_configuration.iteration = iteration + 1
        return out

    def load_state(self, input_dir: str | None = None, **kwargs):
        """:func:`fl_accel.checkpoint.load_federated_state`; returns the metadata. ``input_dir``
        None: the latest ``checkpoint_<i>`` of Accelerate's automatic naming, else ValueError."""
        if input_dir is None:
            input_dir = self._automatic_dir("load_state")
        with automatic_naming_off(self.project_configuration):
            meta = load_federated_state(_checkpoint_io(self), input_dir)
        iteration = folder_iteration(input_dir)
        if self.project_configuration.automatic_checkpoint_naming and iteration is not None:
            self.project_configuration.iteration = iteration + 1
        return meta

    def _automatic_dir(self, method: str) -> str:
        return automatic_checkpoint_dir(self.project_configuration, self.project_dir, method, self.is_main_process,
                                        self.wait_for_everyone)

    def end_training(self):
        """The final sync (exact with a lossy ``sync_dtype`` and ``final_sync="exact"``: it also
        sends the error-feedback residuals), then Accelerate's end_training (it destroys the
        process groups: save before); "torchft" first waits for the other groups to reach the end
        (``federation.wait_for_groups()``), then shuts the Manager down."""
        self.sync_if_pending(final=True)
        if self.synchronizer is not None:
            self.synchronizer.detach()
            self.federation.wait_for_groups()  # torchft: the other groups reach the end (else None at once)
            self.synchronizer.transport.shutdown()
        self._comm_meter.stop()
        super().end_training()


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
