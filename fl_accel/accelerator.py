"""FLAccelerator: an ``accelerate.Accelerator`` whose FSDP2 mesh is one federation group.

This is the only module that touches Accelerate internals. What it relies on
(accelerate 1.15, torch 2.13):

* ``Accelerator.prepare`` shards with ``fsdp2_prepare_model`` when
  ``state.distributed_type == FSDP`` and the plugin has ``fsdp_version=2``; that
  function slices ``state.device_mesh[parallelism_config.fsdp_dim_names]``, i.e.
  ``("dp_shard_cp",)`` or ``("dp_replicate", "dp_shard_cp")``. We preset the device
  mesh to the world mesh ``(fl, dp_replicate, dp_shard)``, so the slice is this rank's
  own group, and FSDP2 never communicates across groups.
* Accelerate does not select FSDP on CPU (it silently falls back to MULTI_CPU/DDP),
  so the state is set to FSDP after construction, identically on CPU and GPU: the
  same ``fully_shard`` code path runs on gloo and NCCL.
* ``AcceleratedOptimizer`` has no ``register_step_post_hook``; the wrapped
  ``optimizer.optimizer`` does, and it fires once per real optimizer step (not per
  micro-batch under gradient accumulation).
"""

from __future__ import annotations

import logging
import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs, ParallelismConfig

from .comm import CommMeter, CommStats
from .config import FLConfig
from .mesh import AXES, FLLayout, build_device_mesh
from .sync import FederatedSynchronizer

logger = logging.getLogger(__name__)


def _env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _init_process_group_for_this_attempt(backend: str, timeout: timedelta) -> None:
    """Create the default process group on a store namespace unique to this restart attempt.

    Under ``torchrun --max-restarts`` the workers of attempt n>0 connect to the launcher's
    store with the same keys as attempt 0, and gloo then dials the dead processes'
    addresses ("Gloo connectFullMesh failed ... Connection refused"; seen with torch
    2.13, cf. pytorch/pytorch#167288). Prefixing the store with the attempt number
    (``TORCHELASTIC_RESTART_COUNT``) gives each attempt fresh keys. Accelerate then
    finds the group initialized and uses it. Only acts under torchelastic's agent store.
    """
    world = _env_world_size()
    if world <= 1 or dist.is_initialized() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"/fl_accel/attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=world, timeout=timeout)


class FLAccelerator(Accelerator):
    """Accelerator for FSDP / HSDP / FL+FSDP / FL+HSDP (paper Sec. 3).

    Args:
        fl_config: the federation settings; default ``FLConfig.from_env()``.
        collective_timeout_s: seconds a collective may wait for a peer before the
            process group aborts (default 300, env ``FL_TIMEOUT_S``): a dead rank
            makes the others exit with an error instead of hanging.
        **accelerate_kwargs: passed to ``accelerate.Accelerator``. ``cpu`` defaults to
            True when no CUDA device is present.

    Raises:
        ValueError: on every rank, before any collective, when ``fl_config`` is invalid
            or does not fit the launched world size (the message names the field).

    Public attributes after construction: ``fl_config``, ``layout`` (F, R, S),
    ``num_groups``, ``group_index``, ``device_mesh`` (axes "fl", "dp_replicate",
    "dp_shard"), ``comm_stats``. After ``prepare(model, optimizer)``: ``synchronizer``.
    """

    def __init__(self, fl_config: FLConfig | None = None, *, collective_timeout_s: float | None = None,
                 **accelerate_kwargs):
        fl_config = FLConfig.from_env() if fl_config is None else fl_config
        if not isinstance(fl_config, FLConfig):
            raise ValueError(f"fl_config must be an FLConfig, got {type(fl_config).__name__}")
        world_size = _env_world_size()
        # Validate before Accelerator.__init__ creates the process group: the error is
        # raised on every rank and no rank is left waiting in a collective.
        self.layout = FLLayout.from_config(fl_config, world_size)
        self.fl_config = fl_config
        if "cpu" not in accelerate_kwargs and not torch.cuda.is_available():
            accelerate_kwargs["cpu"] = True
        if collective_timeout_s is None:
            collective_timeout_s = float(os.environ.get("FL_TIMEOUT_S", "300"))
        timeout = timedelta(seconds=collective_timeout_s)
        handlers = list(accelerate_kwargs.pop("kwargs_handlers", None) or [])
        if not any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
            handlers.append(InitProcessGroupKwargs(timeout=timeout))
        _init_process_group_for_this_attempt("gloo" if accelerate_kwargs.get("cpu") else "nccl", timeout)
        super().__init__(kwargs_handlers=handlers, **accelerate_kwargs)
        if self.num_processes != self.layout.world_size:
            raise ValueError(f"launched world size {self.num_processes} != WORLD_SIZE {world_size}")

        self.device_mesh = build_device_mesh(self.layout, self.device.type)
        self.group_index, self.replica_index, self.shard_index = self.layout.coords(self.process_index)
        self._use_fsdp2()

        self.comm_stats = CommStats(AXES)
        axis_of_ranks = {}
        for axis in AXES:
            ranks = tuple(sorted(self.layout.axis_ranks(axis, self.process_index)))
            if len(ranks) > 1:
                axis_of_ranks[ranks] = axis
        self._comm_meter = CommMeter(self.comm_stats, axis_of_ranks).install()
        self.synchronizer: FederatedSynchronizer | None = None
        self._step_hook = None
        self._last_loss: torch.Tensor | None = None

    # ------------------------------------------------------------------ setup
    def _use_fsdp2(self) -> None:
        """Point Accelerate's FSDP2 path at this rank's group (see module docstring)."""
        state = self.state
        plugin = state.fsdp_plugin if getattr(state, "fsdp_plugin", None) is not None else None
        if plugin is None or getattr(plugin, "fsdp_version", 1) != 2:
            # Reads the FSDP_* environment variables `accelerate launch` sets for the rest.
            plugin = FullyShardedDataParallelPlugin(
                fsdp_version=2,
                auto_wrap_policy=os.environ.get("FSDP_AUTO_WRAP_POLICY", "transformer_based_wrap"),
            )
        if self.mixed_precision != "no":
            plugin.set_mixed_precision(self.mixed_precision, override=True)
        state.fsdp_plugin = plugin
        state.distributed_type = DistributedType.FSDP
        # As AcceleratorState.__init__ does for FSDP: every later AcceleratorState() (e.g.
        # in AcceleratedOptimizer) copies PartialState's distributed_type back over ours.
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        pc = ParallelismConfig(dp_replicate_size=self.layout.replicas, dp_shard_size=self.layout.shards)
        state.parallelism_config = pc
        state.device_mesh = self.device_mesh

    @property
    def num_groups(self) -> int:
        """F, the number of federation groups (1 for the "fsdp"/"hsdp" baselines)."""
        return self.layout.num_groups

    def group_process_group(self, axis: str):
        """The torch ProcessGroup of mesh ``axis`` that contains this rank."""
        return self.device_mesh.get_group(axis)

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args, device_placement=None):
        with warnings.catch_warnings():
            # Accelerate slices the flattened "dp_shard_cp" alias from the root mesh (the
            # name its fsdp2_prepare_model looks up); torch 2.13 warns that this will change.
            warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
            result = super().prepare(*args, device_placement=device_placement)
        items = result if isinstance(result, (list, tuple)) else [result]
        model = next((o for o in items if isinstance(o, torch.nn.Module)), None)
        optimizer = next((o for o in items if isinstance(o, torch.optim.Optimizer)), None)
        if model is not None and optimizer is not None and self.synchronizer is None:
            self._attach_synchronizer(model, optimizer)
        return result

    def _attach_synchronizer(self, model, optimizer) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        F, R = self.layout.num_groups, self.layout.replicas
        self.synchronizer = FederatedSynchronizer(
            list(model.parameters()), inner,
            fl_group=self.device_mesh.get_group("fl") if F > 1 else None,
            replicate_group=self.device_mesh.get_group("dp_replicate") if R > 1 else None,
            num_groups=F, replicas=R, replica_index=self.replica_index, group_index=self.group_index,
            config=self.fl_config,
        )
        if F > 1:  # num_groups == 1: no hook at all, a strict no-op
            self._step_hook = inner.register_step_post_hook(self._after_optimizer_step)

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._last_loss is not None and self.synchronizer.local_step + 1 >= self.fl_config.sync_every:
            self.synchronizer.last_loss = float(self._last_loss)
        self.synchronizer.on_optimizer_step()

    def backward(self, loss, **kwargs):
        self._last_loss = loss.detach()
        return super().backward(loss, **kwargs)

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """Shard the data ourselves: Accelerate, given our mesh, would mix sizes and ranks.

        ``data_sharding="global"``: a disjoint slice per rank of the world (paper setting).
        ``"group"``: the group's G ranks split the whole dataset, and each group
        shuffles with its own seed (``data_seed + group_index``).
        """
        if getattr(data_loader, "_is_accelerate_prepared", False):
            if data_loader not in self._dataloaders:
                self._dataloaders.append(data_loader)
            return data_loader
        if device_placement is None:
            device_placement = self.device_placement
        if self.fl_config.data_sharding == "group":
            num, index = self.layout.group_size, self.process_index - self.group_index * self.layout.group_size
            seed = (self.dataloader_config.data_seed or 0) + self.group_index
        else:
            num, index, seed = self.num_processes, self.process_index, self.dataloader_config.data_seed
        prepared = prepare_data_loader(
            data_loader, self.device, num_processes=num, process_index=index,
            split_batches=self.split_batches, put_on_device=device_placement,
            rng_types=self.rng_types.copy(), dispatch_batches=self.dispatch_batches,
            even_batches=self.even_batches, slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=self.use_seedable_sampler, data_seed=seed,
            non_blocking=self.non_blocking, use_stateful_dataloader=self.use_stateful_dataloader,
        )
        self._dataloaders.append(prepared)
        return prepared

    # ------------------------------------------------------------------ sync API
    def sync(self) -> None:
        """Force a federated sync now (collective: call on every rank at the same step)."""
        if self.synchronizer is None:
            raise RuntimeError("FLAccelerator.sync() needs prepare(model, optimizer) first")
        self.synchronizer.sync()

    def sync_if_pending(self) -> bool:
        """Sync if optimizer steps were taken since the last sync (the end-of-training sync)."""
        if self.synchronizer is not None and self.num_groups > 1 and self.synchronizer.pending:
            self.synchronizer.sync()
            return True
        return False

    # ------------------------------------------------------------------ checkpoints
    def save_state(self, output_dir: str | None = None, **kwargs):
        """Save every group's model/optimizer shards, the FL state, RNG, scheduler, samplers.

        Safe mid-round (see :mod:`fl_accel.checkpoint`); atomic (``.partial`` + rename).
        Collective: call on every rank. ``output_dir`` is required.
        """
        if output_dir is None:
            raise ValueError("FLAccelerator.save_state needs an output_dir")
        from .checkpoint import save_federated_state

        return save_federated_state(self, output_dir, extra_meta=kwargs.get("extra_meta"))

    def load_state(self, input_dir: str | None = None, **kwargs):
        """Restore a checkpoint written by :meth:`save_state`; returns its metadata dict.

        Raises:
            fl_accel.checkpoint.CheckpointError (a ValueError): incomplete, corrupt, or
                written by another algorithm / world size / mesh; raised on every rank.
        """
        if input_dir is None:
            raise ValueError("FLAccelerator.load_state needs an input_dir")
        from .checkpoint import load_federated_state

        return load_federated_state(self, input_dir)

    def end_training(self):
        """The paper's final sync (groups end identical), then Accelerate's end_training."""
        self.sync_if_pending()
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self._comm_meter.uninstall()
        super().end_training()
