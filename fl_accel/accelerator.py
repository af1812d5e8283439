"""FLAccelerator: an ``accelerate.Accelerator`` whose FSDP2 mesh is one federation group.

This is the only module that imports ``accelerate`` or touches its internals. What it
relies on (accelerate 1.15, torch 2.13):

* ``Accelerator.prepare`` shards with ``fsdp2_prepare_model`` when
  ``state.distributed_type == FSDP`` and the plugin has ``fsdp_version=2``; that
  function slices ``state.device_mesh[parallelism_config.fsdp_dim_names]``, i.e.
  ``("dp_shard_cp",)`` or ``("dp_replicate", "dp_shard_cp")``. We preset the device
  mesh (:func:`fl_accel.mesh.build_mesh`), so the slice is this rank's own group and
  FSDP2 never communicates across groups.
* Accelerate does not select FSDP on CPU (it silently falls back to MULTI_CPU/DDP),
  so the state is set to FSDP after construction, identically on CPU and GPU: the
  same ``fully_shard`` code path runs on gloo and NCCL.
* ``AcceleratedOptimizer`` has no ``register_step_post_hook``; the wrapped
  ``optimizer.optimizer`` does, and it fires once per real optimizer step (not per
  micro-batch under gradient accumulation).
* ``_prepare_fsdp2`` maps old to new parameters by ``data_ptr()``; parameters on the
  meta device all report 0, so for a meta-built model each gets a distinct stand-in
  ``data_ptr`` for the duration of ``prepare``.
* ``AcceleratedScheduler.step`` steps the wrapped scheduler ``num_processes`` times per
  optimizer step unless ``split_batches``; FLAccelerator sets ``split_batches`` on the
  schedulers it prepares, so a schedule advances once per optimizer step.
* ``Accelerator.save_state``/``load_state`` with ``_models``/``_optimizers`` emptied
  save and restore only RNG, schedulers, samplers and registered objects; the
  federated model/optimizer state goes through :mod:`fl_accel.checkpoint`.
* FSDP2 appends every unit to its post-forward order also in a forward without grad
  (``FSDPParamGroup.post_forward`` -> ``_record_post_forward``) and clears that order only
  at the end of a backward (``FSDPState._root_post_backward_final_callback``). The public
  ``FSDPModule.reset_iter_state()`` (torch 2.13) reshards every unit and clears it; see
  :meth:`FLAccelerator._track_forward_only`.
"""

from __future__ import annotations

import contextlib
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
from .mesh import AXES, DP_REPLICATE, DP_SHARD, FSDP_SHARD_DIM, FLLayout, build_mesh
from .sync import FederatedSynchronizer

logger = logging.getLogger(__name__)


def _env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _ranks_per_node(world: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def _init_process_group(backend: str, timeout: timedelta) -> None:
    """Create the default process group where Accelerate's own start would fail or hang.

    * Under ``torchrun --max-restarts`` the workers of attempt n>0 connect to the
      launcher's store with the same keys as attempt 0, and gloo then dials the dead
      processes' addresses ("Gloo connectFullMesh failed ... Connection refused"; seen
      with torch 2.13, cf. pytorch/pytorch#167288). Prefixing the store with the attempt
      number (``TORCHELASTIC_RESTART_COUNT``) gives each attempt fresh keys.
    * A plain ``python script.py`` (no launcher, no ``RANK``) gets a one-process group
      on an in-memory store, so the same FSDP2 code runs without a launcher.

    Accelerate then finds the group initialized and uses it.
    """
    if dist.is_initialized():
        return
    world = _env_world_size()
    if "RANK" not in os.environ and world == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    if world <= 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"/fl_accel/attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=world, timeout=timeout)


def _check_mixed_precision(kwargs: dict) -> None:
    """Reject fp16 on every rank before any collective (Raises ValueError)."""
    value = kwargs.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    value = getattr(value, "value", value)
    if str(value).lower() == "fp16":
        raise ValueError(
            "FLAccelerator does not support mixed_precision='fp16'; use mixed_precision='bf16' (or 'no'). fp16 needs "
            "a loss scaler, and Accelerate's per-rank GradScaler can skip an optimizer step in one federation group "
            "only: the groups' step counters then diverge and the sync's collectives mismatch until they time out "
            "(on CPU fp16 even trains without any loss scaling). bf16 has fp32's range and needs no scaler.")


class FLAccelerator(Accelerator):
    """Accelerator for FSDP / HSDP / FL+FSDP / FL+HSDP (paper Sec. 3).

    Args:
        fl_config: the federation settings; default ``FLConfig.from_env()``.
        collective_timeout_s: seconds a collective may wait for a peer before it fails
            (default 300, env ``FL_TIMEOUT_S``), on the default process group and on
            every mesh sub-group: a dead or hung rank makes the others exit with an
            error instead of hanging.
        **accelerate_kwargs: passed to ``accelerate.Accelerator``. ``cpu`` defaults to
            True when no CUDA device is present.

    Raises:
        ValueError: on every rank, before any collective, when ``fl_config`` is invalid
            or does not fit the launched world size (the message names the field), or
            for ``mixed_precision="fp16"``.

    Differences from ``Accelerator`` (everything else keeps its meaning):

    * ``prepare(model, optimizer, ...)`` shards the model over this rank's federation
      group only, checks that every group starts from identical parameters, and hooks
      the sync onto the inner optimizer; a model built on the meta device is sharded
      there and initialized by :meth:`materialize`.
    * A scheduler passed to ``prepare`` steps once per optimizer step (Accelerate steps
      it ``num_processes`` times, for its data-parallel batch scaling).
    * ``prepare_data_loader`` shards by ``FLConfig.data_sharding`` (world or group).
    * ``save_state``/``load_state`` keep every group's state (safe mid-round).
    * ``end_training`` runs the final sync first.

    Public attributes: ``fl_config``, ``layout`` (:class:`~fl_accel.mesh.FLLayout`),
    ``mesh`` (:class:`~fl_accel.mesh.FLMesh`), ``device_mesh``, ``num_groups``,
    ``group_index``, ``replica_index``, ``shard_index``, ``comm_stats``; after
    ``prepare(model, optimizer)``: ``synchronizer``.
    """

    def __init__(self, fl_config: FLConfig | None = None, *, collective_timeout_s: float | None = None,
                 **accelerate_kwargs):
        fl_config = FLConfig.from_env() if fl_config is None else fl_config
        if not isinstance(fl_config, FLConfig):
            raise ValueError(f"fl_config must be an FLConfig, got {type(fl_config).__name__}")
        world_size = _env_world_size()
        # Validate before Accelerator.__init__ creates the process group: the error is
        # raised on every rank and no rank is left waiting in a collective.
        fl_config.validate()
        self.layout = FLLayout.from_config(fl_config, world_size, ranks_per_node=_ranks_per_node(world_size))
        self.fl_config = fl_config
        _check_mixed_precision(accelerate_kwargs)
        if "cpu" not in accelerate_kwargs and not torch.cuda.is_available():
            accelerate_kwargs["cpu"] = True
        if collective_timeout_s is None:
            collective_timeout_s = float(os.environ.get("FL_TIMEOUT_S", "300"))
        self.collective_timeout = timedelta(seconds=collective_timeout_s)
        handlers = list(accelerate_kwargs.pop("kwargs_handlers", None) or [])
        if not any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
            handlers.append(InitProcessGroupKwargs(timeout=self.collective_timeout))
        _init_process_group("gloo" if accelerate_kwargs.get("cpu") else "nccl", self.collective_timeout)
        super().__init__(kwargs_handlers=handlers, **accelerate_kwargs)
        if self.num_processes != self.layout.world_size:
            raise ValueError(f"launched world size {self.num_processes} != WORLD_SIZE {world_size}")

        self.mesh = build_mesh(self.layout, self.device.type, self.collective_timeout, self.process_index)
        self.device_mesh = self.mesh.device_mesh
        self.group_index, self.replica_index, self.shard_index = self.layout.coords(self.process_index)
        self._use_fsdp2()
        self.comm_stats = CommStats()
        self._comm_meter = self._make_meter()
        self.synchronizer: FederatedSynchronizer | None = None
        self._step_hook = None
        self._last_loss: torch.Tensor | None = None
        self._grads_accumulating = False  # micro-batch gradients wait for their optimizer step
        self._forward_only_hooks: dict[int, object] = {}
        if self.is_main_process:
            for note in self._start_notes(fl_config):
                warnings.warn(f"[fl_accel] {note}", UserWarning, stacklevel=2)

    def _start_notes(self, cfg: FLConfig) -> list[str]:
        notes = list(cfg.ignored_settings())
        if cfg.uses_hsdp and cfg.hsdp_shard_size is None:
            notes.append(f"hsdp_shard_size not set: using S={self.layout.shards} (the ranks per node, "
                         f"LOCAL_WORLD_SIZE={_ranks_per_node(self.layout.world_size)}, that divide every group)"
                         + (f"; that leaves one replica per group (R=1), i.e. plain {'FL+' if cfg.is_federated else ''}"
                            f"FSDP: pass hsdp_shard_size={self.layout.shards // 2} for 2 replicas"
                            if self.layout.max_replicas == 1 and self.layout.shards % 2 == 0 else ""))
        if self.device.type == "cpu" and self.mixed_precision != "no":
            notes.append(f"mixed_precision={self.mixed_precision!r} on CPU runs several times slower than fp32 "
                         f"(no bf16 matrix units); use it on GPUs")
        return notes

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
        f = self.layout.group_of(self.process_index)
        state.parallelism_config = ParallelismConfig(dp_replicate_size=self.layout.replicas_of(f),
                                                     dp_shard_size=self.layout.shards)
        state.device_mesh = self.device_mesh

    def _make_meter(self) -> CommMeter:
        groups = {}
        for axis in AXES:
            pg = self.mesh.group(axis)
            if pg is not None:
                groups[pg] = axis
        for name, axis in ((FSDP_SHARD_DIM, DP_SHARD), (DP_SHARD, DP_SHARD), (DP_REPLICATE, DP_REPLICATE)):
            with contextlib.suppress(KeyError, RuntimeError, ValueError), warnings.catch_warnings():
                # the same slice Accelerate takes (see prepare); torch 2.13 warns about it
                warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
                sub = self.device_mesh[name]
                if sub.size() > 1:
                    groups[sub.get_group()] = axis
        ranks = {}
        for axis in AXES:
            members = tuple(sorted(self.layout.axis_ranks(axis, self.process_index)))
            if len(members) > 1:
                ranks[members] = axis
        return CommMeter(self.comm_stats, groups, ranks)

    def meter_comm(self) -> CommMeter:
        """Count collectives into ``comm_stats`` while entered::

            with accelerator.meter_comm():
                train()

        Buckets: the mesh axes "fl", "dp_replicate", "dp_shard" and "world" (the default
        process group: the non-finite check of each sync, a loss all-reduce, ...). The
        counts are per rank; see :mod:`fl_accel.comm` for the byte formulas.
        """
        return self._comm_meter

    @property
    def num_groups(self) -> int:
        """F, the number of federation groups (1 for the "fsdp"/"hsdp" baselines)."""
        return self.layout.num_groups

    def group_process_group(self, axis: str):
        """The torch ProcessGroup of mesh ``axis`` that contains this rank (None if it has one rank)."""
        return self.mesh.group(axis)

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args, device_placement=None):
        """Accelerate's prepare, with the model sharded over this rank's group only.

        Also attaches the federated synchronizer (once a model and its optimizer were
        prepared) and, unless the model is still on the meta device, checks that every
        group starts from the same parameters.

        Raises:
            ValueError: on every rank, when the groups' initial parameters differ
                (a per-rank seed, or a forgotten ``set_seed``), naming the groups.
        """
        stand_ins = self._meta_stand_ins(args)
        try:
            with warnings.catch_warnings():
                # Accelerate slices the flattened "dp_shard_cp" alias from the root mesh (the
                # name its fsdp2_prepare_model looks up); torch 2.13 warns that this will change.
                warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
                result = super().prepare(*args, device_placement=device_placement)
        finally:
            for p in stand_ins:
                del p.data_ptr
        items = result if isinstance(result, (list, tuple)) else [result]
        for obj in items:
            if isinstance(obj, torch.nn.Module):
                self._track_forward_only(obj)
        model = next((o for o in items if isinstance(o, torch.nn.Module)), None)
        optimizer = next((o for o in items if isinstance(o, torch.optim.Optimizer)), None)
        if model is not None and optimizer is not None and self.synchronizer is None:
            self._attach_synchronizer(model, optimizer)
            if not self._is_meta(model):
                self.check_groups_identical(model)
        return result

    @staticmethod
    def _is_meta(model) -> bool:
        return any(p.is_meta for p in model.parameters())

    @staticmethod
    def _meta_stand_ins(args) -> list:
        """Give each meta parameter a distinct ``data_ptr`` for Accelerate's old->new map."""
        out = []
        for obj in args:
            if isinstance(obj, torch.nn.Module):
                for i, p in enumerate(dict.fromkeys(obj.parameters())):
                    if p.is_meta:
                        p.data_ptr = (lambda v: (lambda: v))(-(i + 1))
                        out.append(p)
        return out

    def prepare_scheduler(self, scheduler):
        """Accelerate's prepare_scheduler, stepping once per optimizer step (see class docstring)."""
        prepared = super().prepare_scheduler(scheduler)
        prepared.split_batches = True
        return prepared

    def _attach_synchronizer(self, model, optimizer) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        named = list(model.named_parameters())
        self.synchronizer = FederatedSynchronizer(
            named, inner, layout=self.layout, mesh=self.mesh, rank=self.process_index, config=self.fl_config,
            units=_fsdp_units(model, [p for _, p in named]))
        self.synchronizer.pre_sync_hooks.append(self._reshard_models)  # always the last pre-sync hook
        if self.num_groups > 1:  # num_groups == 1: no hook at all, a strict no-op
            self._step_hook = inner.register_step_post_hook(self._after_optimizer_step)

    def _reshard_models(self, *_) -> None:
        """Free every FSDP2 unit's unsharded parameters before the sync writes the shards.

        A forward without a backward (an evaluation, e.g. in a pre-sync hook) leaves the
        tail unit (final norm + lm_head, which Accelerate shards with
        ``reshard_after_forward=False``) unsharded: it is resharded after backward only.
        The sync writes the local shards only, and the next forward's ``unshard()`` is a
        no-op on an unsharded unit, so it would compute with the pre-sync lm_head/final
        norm (seen: a different loss at the step after an ``--eval_groups`` evaluation).
        ``FSDPModule.reshard()`` is a no-op on a sharded unit.
        """
        from torch.distributed.fsdp import FSDPModule

        for model in self._models:
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def _track_forward_only(self, model) -> None:
        """Reset FSDP2's per-iteration state before the first forward with grad that follows
        forwards without grad (an evaluation), so that the next backward does no wasted
        all-gather.

        FSDP2 records the post-forward order of the units also under ``no_grad``
        (``FSDPParamGroup.post_forward`` -> ``_record_post_forward``) and clears it only at
        the end of a backward (``FSDPState._root_post_backward_final_callback``: the
        order, and ``finalize_backward`` for each unit's indices). An evaluation's entries
        therefore survive into the next training step, where the first unit of the forward
        order (the embedding) finds a non-zero index and ``FSDPParamGroup._backward_prefetch``
        all-gathers ``post_forward_order[index - 1]``: the evaluation's last unit, the tail,
        already resharded by its own post-backward. ``finalize_backward`` discards that
        result unused: one wasted tail all-gather per evaluation. (Without a checkpoint in
        between it was hidden: the tail, still unsharded from the evaluation, skipped its
        forward all-gather instead; a checkpoint's ``state_dict`` reshards it, and a
        resumed run has no stale entries, so a resumed run counted one tail all-gather
        less per evaluation before its checkpoint.)

        ``FSDPModule.reset_iter_state()`` (public, torch 2.13) reshards every unit and
        clears these trackers; it is called on the root in a forward pre-hook (ahead of
        FSDP2's own) when grad is enabled and forwards without grad ran since. It
        discards no-sync gradient-accumulation state, so it is skipped while micro-batch
        gradients wait for their optimizer step (``backward`` with ``sync_gradients``
        False); the waste then stays. Values are unchanged: the next forward gathers the
        same shards.
        """
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule) or id(model) in self._forward_only_hooks:
            return
        forward_only = [False]

        def before_forward(module, args):
            if not torch.is_grad_enabled():
                forward_only[0] = True
            elif forward_only[0]:
                forward_only[0] = False
                if not self._grads_accumulating:
                    module.reset_iter_state()

        self._forward_only_hooks[id(model)] = model.register_forward_pre_hook(before_forward, prepend=True)

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        sync = self.synchronizer
        if sync._suspended:
            return
        if sync.needs_anchor and sync.anchor is None:
            raise RuntimeError("the model was prepared on the meta device: call accelerator.materialize(model, "
                               "init_fn) before training")
        if self._last_loss is not None and sync.sync_due():
            sync.last_loss = float(self._last_loss)
        sync.on_optimizer_step()

    def backward(self, loss, **kwargs):
        """Accelerate's backward; also remembers the loss for the sync's non-finite check."""
        self._last_loss = loss.detach()
        self._grads_accumulating = not self.sync_gradients
        return super().backward(loss, **kwargs)

    # ------------------------------------------------------------------ initial weights
    @torch.no_grad()
    def materialize(self, model, init_fn, *, seed: int = 0) -> None:
        """Allocate a model prepared on the meta device and initialize it, shard by shard.

        Each module's parameters are created at their full shape one module at a time
        on ``self.device``, ``init_fn(module)`` initializes them (e.g. a transformers
        model's ``_init_weights``, which also recomputes RoPE buffers), and every rank
        keeps only its own shard. Peak memory is the sharded model plus the largest
        module; the values are those a full initialization with ``seed`` gives, so all
        groups and replicas start identical (checked afterwards). Modules are visited
        children first (transformers' order); a tied parameter is initialized once.
        Then the sync's anchor is taken.

        Raises:
            ValueError: the groups' parameters differ afterwards (a non-deterministic
                ``init_fn``).
        """
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        model.to_empty(device=self.device)
        torch.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        done: set[int] = set()

        def visit(module):
            for child in module.children():
                visit(child)
            swapped = {}
            for name, p in list(module._parameters.items()):
                if p is None:
                    continue
                full = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device),
                                          requires_grad=p.requires_grad)
                swapped[name] = (p, full)
                module._parameters[name] = full
            try:
                init_fn(module)
            finally:
                for name, (p, full) in swapped.items():
                    module._parameters[name] = p
            for name, (p, full) in swapped.items():
                if id(p) in done:
                    continue
                done.add(id(p))
                if isinstance(p, DTensor):
                    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
                    p.to_local().copy_(full.data[index])
                else:
                    p.data.copy_(full.data)

        visit(model)
        self.check_groups_identical(model)
        if self.synchronizer is not None:
            self.synchronizer.reset_anchor()

    @torch.no_grad()
    def check_groups_identical(self, model) -> None:
        """Raise ValueError on every rank unless all groups (and replicas) hold identical
        parameters: fp64 checksums of each rank's shards, all-reduced over the world
        (3 values per rank), compared between ranks with the same shard coordinate.

        The shards are summed in chunks of 2**20 values, so the fp64 temporaries take a
        few MiB whatever the model (whole-shard fp64 copies of a 162M-parameter model's
        embedding shard added ~150 MiB to the peak host memory of ``materialize``)."""
        world = self.num_processes
        sums = torch.zeros(world, 3, dtype=torch.float64, device=self.device)
        chunk = 1 << 20
        for p in model.parameters():
            t = (p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1)
            for start in range(0, t.numel(), chunk):
                c = t[start:start + chunk].to(torch.float64)
                w = torch.arange(start + 1, start + c.numel() + 1, dtype=torch.float64, device=c.device)
                w.remainder_(97)
                sums[self.process_index] += torch.stack([c.sum(), (c * c).sum(), (c * w).sum()])
        dist.all_reduce(sums)
        by_shard: dict[int, list[int]] = {}
        for k in range(world):
            by_shard.setdefault(self.layout.coords(k)[2], []).append(k)
        differ = set()
        for ranks in by_shard.values():
            ref = sums[ranks[0]]
            for k in ranks[1:]:
                if not torch.equal(sums[k], ref):
                    differ.add(self.layout.coords(k)[:2])
        if differ:
            groups = sorted({f for f, _ in differ})
            where = f"group(s) {groups}" + (f" (group, HSDP replica): {sorted(differ)}" if self.layout.uses_hsdp else "")
            raise ValueError(
                f"the federation groups do not start from identical parameters: {where} differ from group 0's "
                f"first replica. Seed identically on every rank before building the model "
                f"(accelerate.utils.set_seed(seed), not seed + rank); averaging differently initialized models "
                f"destroys training at the first sync.")

    # ------------------------------------------------------------------ data
    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """Shard the data ourselves: Accelerate, given our mesh, would mix sizes and ranks.

        ``data_sharding="global"``: a disjoint slice per rank of the world (paper setting).
        ``"group"``: the group's G ranks split the whole dataset, and each group
        shuffles with its own seed (``data_seed + group_index``). "group" always uses
        Accelerate's seedable sampler: without it Accelerate re-synchronizes the
        sampler's generator from rank 0 over the whole world at every epoch, so every
        group would get rank 0's order and the group seed would be ignored.
        """
        if getattr(data_loader, "_is_accelerate_prepared", False):
            if data_loader not in self._dataloaders:
                self._dataloaders.append(data_loader)
            return data_loader
        if device_placement is None:
            device_placement = self.device_placement
        num, index, seed = self.data_shard()
        per_group = self.fl_config.data_sharding == "group" and self.fl_config.is_federated
        prepared = prepare_data_loader(
            data_loader, self.device, num_processes=num, process_index=index,
            split_batches=self.split_batches, put_on_device=device_placement,
            rng_types=self.rng_types.copy(), dispatch_batches=self.dispatch_batches,
            even_batches=self.even_batches, slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=self.use_seedable_sampler or per_group, data_seed=seed,
            non_blocking=self.non_blocking, use_stateful_dataloader=self.use_stateful_dataloader,
        )
        self._dataloaders.append(prepared)
        return prepared

    def data_shard(self) -> tuple[int, int, int | None]:
        """``(num_shards, shard_index, seed)`` of this rank's data under ``data_sharding``."""
        seed = self.dataloader_config.data_seed
        if self.fl_config.data_sharding == "group" and self.fl_config.is_federated:
            return (self.layout.group_size_of(self.group_index), self.layout.group_local_rank(self.process_index),
                    (seed or 0) + self.group_index)
        return self.num_processes, self.process_index, seed

    # ------------------------------------------------------------------ sync API
    def sync(self) -> None:
        """Force a federated sync now (collective: call on every rank at the same step)."""
        if self.synchronizer is None:
            raise RuntimeError("FLAccelerator.sync() needs prepare(model, optimizer) first")
        self.synchronizer.sync()

    def sync_if_pending(self) -> bool:
        """Sync if the groups may differ (the end-of-training sync). Returns True if it synced."""
        if self.synchronizer is not None and self.num_groups > 1 and self.synchronizer.pending:
            self.synchronizer.sync()
            return True
        return False

    def register_pre_sync_hook(self, hook):
        """Call ``hook(synchronizer, full)`` right before every sync event (``full`` is
        True for a sync of every fragment), e.g. to evaluate each group's own model
        before the groups are averaged. Needs ``prepare(model, optimizer)`` first.
        Returns a handle whose ``remove()`` unregisters it. The hook may run forwards: the
        model is resharded after the hooks, before the shards are written."""
        if self.synchronizer is None:
            raise RuntimeError("register_pre_sync_hook needs prepare(model, optimizer) first")
        hooks = self.synchronizer.pre_sync_hooks
        last = self._reshard_models
        hooks.insert(hooks.index(last) if last in hooks else len(hooks), hook)  # before the reshard

        class _Handle:
            def remove(self):
                if hook in hooks:
                    hooks.remove(hook)

        return _Handle()

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_io(self):
        from .checkpoint import CheckpointIO

        def accelerate_call(method, path):
            # Accelerate saves/restores RNG (per rank), schedulers, samplers and registered
            # objects; our own module writes the models and optimizers.
            models, optimizers = self._models, self._optimizers
            try:
                self._models, self._optimizers = [], []
                getattr(Accelerator, method)(self, path)
            finally:
                self._models, self._optimizers = models, optimizers

        return CheckpointIO(
            models=list(self._models), optimizers=[getattr(o, "optimizer", o) for o in self._optimizers],
            synchronizer=self.synchronizer, layout=self.layout, config=self.fl_config,
            group_index=self.group_index, replica_index=self.replica_index, rank=self.process_index,
            is_main_process=self.is_main_process,
            barrier=self.wait_for_everyone,
            save_extras=lambda path: accelerate_call("save_state", path),
            load_extras=lambda path: accelerate_call("load_state", path))

    def save_state(self, output_dir: str | None = None, **kwargs):
        """Save every group's model/optimizer shards, the FL state, RNG, scheduler, samplers.

        Safe mid-round (see :mod:`fl_accel.checkpoint`); atomic (``.partial`` + rename).
        Collective: call on every rank. ``output_dir`` is required; ``extra_meta`` (a
        JSON-able dict) is stored in the checkpoint's metadata, ``rank_state`` (JSON-able)
        per rank; ``load_state`` returns them as its metadata and ``meta["rank_state"]``.
        """
        if output_dir is None:
            raise ValueError("FLAccelerator.save_state needs an output_dir")
        from .checkpoint import save_federated_state

        return save_federated_state(self._checkpoint_io(), output_dir, extra_meta=kwargs.get("extra_meta"),
                                    rank_state=kwargs.get("rank_state"))

    def load_state(self, input_dir: str | None = None, **kwargs):
        """Restore a checkpoint written by :meth:`save_state`; returns its metadata dict.

        Raises:
            fl_accel.checkpoint.CheckpointError (a ValueError): incomplete, corrupt, or
                written by another algorithm / world size / layout; raised on every rank.
        """
        if input_dir is None:
            raise ValueError("FLAccelerator.load_state needs an input_dir")
        from .checkpoint import load_federated_state

        return load_federated_state(self._checkpoint_io(), input_dir)

    def end_training(self):
        """The paper's final sync (groups end identical), then Accelerate's end_training
        (which destroys the process groups: save or gather the model before)."""
        self.sync_if_pending()
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self._comm_meter.stop()
        super().end_training()


def _fsdp_units(model, params: list) -> list[list[int]]:
    """Parameter indices per FSDP unit (one ``fully_shard`` call), in forward order.

    Uses FSDP2's own assignment (``FSDPModule._get_fsdp_state()._fsdp_param_group``).
    Order: units in module-registration order (embedding, layer 0, ..., tail), the root
    unit (leftover parameters) last. Parameters no unit manages form one unit each.
    """
    from torch.distributed.fsdp import FSDPModule

    index = {id(p): i for i, p in enumerate(params)}
    units, seen, root = [], set(), None
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        if id(state) in seen:
            continue
        seen.add(id(state))
        group = state._fsdp_param_group
        members = sorted(index[id(fp.sharded_param)] for fp in (group.fsdp_params if group else [])
                         if id(fp.sharded_param) in index)
        if name == "":
            root = members
        elif members:
            units.append(members)
    if root:
        units.append(root)
    covered = {i for u in units for i in u}
    units.extend([i] for i in range(len(params)) if i not in covered)
    return units
