"""Worker of tests/dist/test_accelerator_api.py and tests/gpu/test_cuda.py (torchrun).

    api_worker.py MODE OUT_DIR

MODE ``scheduler``: FL+FSDP, 2 groups, gradient accumulation 2, a linear schedule 1 -> 0 passed
through ``FLAccelerator.prepare`` and sized as Accelerate's stepping needs it, one variant per
launch (``api_worker.py scheduler OUT_DIR VARIANT``):
the default (10 x ``num_processes`` steps: ``num_processes`` scheduler steps per optimizer step),
``split_batches=True`` (10: one per optimizer step) and ``step_scheduler_with_optimizer=False``
(20: one per call, two calls per optimizer step); records the LR of every rank after each
optimizer step. MODE ``collectives``: every collective of the library and the recipe on
this machine's default process group and device (the CUDA test runs it on a 1-process
NCCL group, which rejects CPU tensors as a multi-GPU job would): the recipe's evaluate()
and main_first(), the sync's exchange in fp32/bf16/int8, its non-finite check, the
start-up checksum, a federated checkpoint save and load. MODE ``outer_state_device``: the
synchronizer's outer step with ``outer_state_device`` "same" and "cpu" on this device (a
1-process group, driven through its fragments' exchange and outer step; see :func:`outer_state_device`).
Each rank writes ``OUT_DIR/<mode>-rank<k>.json``.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, get_scheduler

from fl_accel import FLAccelerator, FLConfig

MODEL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)


SCHEDULER_VARIANTS = {"default": ({}, None), "split_batches": ({"dataloader_config": "split_batches"}, 10),
                      "step_with_calls": ({"step_scheduler_with_optimizer": False}, 20)}
"""kwargs and schedule length; None: 10 x num_processes."""


def scheduler(out_dir: str) -> None:
    variant = sys.argv[3]
    kwargs, length = SCHEDULER_VARIANTS[variant]
    if "dataloader_config" in kwargs:
        from accelerate import DataLoaderConfiguration

        kwargs = {"dataloader_config": DataLoaderConfiguration(split_batches=True)}
    acc = FLAccelerator(FLConfig(algorithm="fl_fsdp", num_groups=2, sync_every=2), cpu=True,
                        gradient_accumulation_steps=2, **kwargs)
    length = length or 10 * acc.num_processes
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=length)
    model, opt, sched = acc.prepare(model, opt, sched)
    lrs = []
    for micro in range(6):  # 3 optimizer steps
        with acc.accumulate(model):
            x = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(micro))
            loss = model(input_ids=x, labels=x).loss
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        if acc.sync_gradients:
            lrs.append(opt.param_groups[0]["lr"])
    json.dump({"lrs": lrs, "sched_lr": sched.get_last_lr()[0]},
              open(f"{out_dir}/scheduler-{variant}-rank{acc.process_index}.json", "w"))
    acc.end_training()


def collectives(out_dir: str) -> None:
    import torch.distributed as dist

    from _scenario import exchange_mean as mean
    from fl_accel.exchange import Membership
    from fl_accel.mesh_transport import MeshTransport
    from recipes.inputs import main_first
    from recipes.metrics import evaluate

    acc = FLAccelerator(FLConfig(algorithm="fsdp"), mixed_precision="bf16" if torch.cuda.is_available() else "no")
    rec = {"backend": dist.get_backend(), "device": str(acc.device)}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)  # runs check_groups_identical (a world all-reduce)
    rec["main_first"] = main_first(acc, lambda: "ok")
    blocks = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1)).tolist()
    rec["eval"] = evaluate(model, acc, blocks, 2)[0]
    rec["eval_per_group"] = evaluate(model, acc, blocks, 2, per_group=True)[0]
    world = dist.group.WORLD
    t = MeshTransport(fl_group=world, replicate_group=None, membership=Membership(1, 0, (1.0,)), num_chunks=1, chunk_index=0,
                      replicas=1, chunk_owners=(0,), device=acc.device)
    for dtype in ("fp32", "bf16", "int8"):
        x = torch.linspace(-1, 1, 1000, device=acc.device)
        rec[f"exchange_{dtype}_max_err"] = (mean(t, [x], sync_dtype=dtype)[0] - x).abs().max().item()  # "auto"
    for collectives in ("all_to_all", "all_gather"):  # int8's two wires: uint8 all-to-all / all-gather on NCCL
        x = torch.linspace(-1, 1, 1000, device=acc.device)
        got = mean(t, [x], sync_dtype="int8", collectives=collectives)[0]
        rec[f"exchange_int8_{collectives}"] = [str(got.device), (got - x).abs().max().item()]
    from fl_accel.codecs import Sparse  # "sparse": topk, codes and all-gather on the device, = the CPU's

    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    want = Sparse(1 / 64, 2).encode(torch.nn.functional.pad(x, (0, 4096 - 1000)))[1][:1000]
    got = mean(t, [x.to(acc.device)], sync_dtype="sparse")[0]
    rec["exchange_sparse_device"], rec["exchange_sparse_vs_cpu"] = str(got.device), (got.cpu() - want).abs().max().item()
    t.bad_groups(False, t.begin())  # the sync's world all-reduce of per-group flags
    t.shard_group = world  # sync_trigger's collectives: float64 MAX in the group, then the [F, 4] table
    rec["group_max"] = t.group_max(2.5)
    rec["group_table"] = t.group_table([3.0, 1.5, 0.25, 3.0], t.begin())
    acc.save_state(f"{out_dir}/ckpt")
    acc.load_state(f"{out_dir}/ckpt")
    rec["ok"] = True
    json.dump(rec, open(f"{out_dir}/collectives-rank{acc.process_index}.json", "w"))
    acc.end_training()


def outer_state_device(out_dir: str) -> None:
    """outer_state_device "same" vs "cpu" on this machine's device, one process (F=1 on the
    world group: the "fl" exchange is a real collective over one rank, as in
    ``collectives``). Two settings: fp32 exchange + "nesterov" (alpha 0), and int8 + error
    feedback + "nesterov" with P=2 and alpha 0.5. Four fragment syncs, each launched, then
    the parameters move (training meanwhile), then advanced, moved again, finished and
    applied. Records, per setting and placement: the parameters after every sync, where the
    anchor, momentum and residuals live (device, pinned), the devices of every tensor given
    to a collective and of the exchange's buffers, and the device memory the outer state
    holds afterwards; plus cross-placement state round trips (``state_tensors`` ->
    ``load_state_dict``) and a DCP save/load of a host tensor as the checkpoint keeps the
    sync's tensors (plain tensors keyed by shard), which must not move it to the device."""
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from _scenario import outer_view
    from fl_accel.exchange import Channel
    from fl_accel.fragment import apply, exchange
    from fl_accel.mesh import FLLayout, FLMesh
    from fl_accel.mesh_transport import MeshTransport
    from fl_accel.sync import Synchronizer

    acc = FLAccelerator(FLConfig(algorithm="fsdp"))  # fp32 parameters
    dev = acc.device
    cuda = dev.type == "cuda"
    rec = {"backend": dist.get_backend(), "device": str(dev), "runs": {}}
    seen: list[str] = []

    def spy(fn):
        def wrapped(*args, **kwargs):
            seen.extend(str(a.device) for a in list(args) + list(kwargs.values()) if torch.is_tensor(a))
            return fn(*args, **kwargs)
        return wrapped

    real = {name: getattr(dist, name) for name in ("all_reduce", "all_to_all_single", "all_gather_single")}
    for name, fn in real.items():
        setattr(dist, name, spy(fn))

    shapes = [(1000,), (64, 33), (257,)]
    numel = sum(torch.Size(s).numel() for s in shapes)
    settings = {"fp32": dict(sync_dtype="fp32", num_fragments=1, alpha=0.0),
                "int8_ef": dict(sync_dtype="int8", error_feedback=True, num_fragments=2, alpha=0.5)}

    def make(where: str, setting: dict):
        fields = {k: v for k, v in setting.items() if k != "alpha"}
        cfg = FLConfig(algorithm="fl_fsdp", num_groups=1, sync_every=8, outer_optimizer="nesterov", outer_lr=0.7,
                       outer_momentum=0.9, outer_state_device=where, **fields)
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dev)) for s in shapes]
        base = torch.cuda.memory_allocated(dev) if cuda else 0
        mesh = FLMesh(FLLayout.from_config(cfg, 1), None, {"fl": dist.group.WORLD})  # F=1 on the world group
        transport = MeshTransport.from_mesh(mesh, 0, "size", dev)
        sync = Synchronizer([(f"p{i}", p) for i, p in enumerate(params)], torch.optim.SGD(params, lr=0.1),
                            transport=transport, config=cfg)
        sync.reset_anchors()  # F=1: the constructor takes none
        return sync, params, base, gen

    def where_is(tensors):
        return None if tensors is None else {"devices": sorted({str(t.device) for t in tensors}),
                                             "pinned": [bool(t.is_pinned()) for t in tensors]}

    syncs = {}
    for label, setting in settings.items():
        for where in ("same", "cpu"):
            sync, params, base, gen = make(where, setting)
            seen.clear()
            run = {"params": [], "buffers": [], "means": []}

            def move():
                with torch.no_grad():
                    for p in params:
                        p.add_((0.1 * torch.randn(p.shape, generator=gen)).to(dev))

            for k in range(4):
                move()
                frag = sync.fragments[k % len(sync.fragments)]
                ex = exchange(frag.parts, Channel(sync.transport, sync.transport.begin(), sync.hooks, 2**26)).start()
                if ex.stream is not None:  # in training a forward and backward separate packing from the next write
                    torch.cuda.current_stream().wait_stream(ex.stream)
                run["buffers"] += [str(b.flat.device) for b in ex.buckets]
                move()
                ex.advance()
                move()
                means = ex.finish()
                run["means"] += [str(m.device) for m in means]
                apply(frag.parts, means, setting["alpha"], sync.schedule.global_step)
                del ex, means
                run["params"].append([p.detach().cpu().tolist() for p in params])
            if cuda:  # release the exchange buffers still awaiting their streams' events
                torch.cuda.synchronize(dev)
                torch.cuda.empty_cache()
            run["state_bytes_on_device"] = (torch.cuda.memory_allocated(dev) - base) if cuda else 0
            run["param_devices"] = sorted({str(p.device) for p in params})
            run["collective_devices"] = sorted(set(seen))
            outer = outer_view(sync)
            run["anchor"] = where_is(list(outer.anchor))
            run["momentum"] = where_is([s["momentum_buffer"] for s in outer.optimizer.state.values()])
            run["residual"] = where_is(outer.residuals)
            rec["runs"][f"{label}/{where}"] = run
            syncs[(label, where)] = sync
    rec["numel"] = numel

    # a checkpoint's tensors move between placements unchanged (values only)
    rec["state_round_trip_equal"] = {}
    for src, dst in (("cpu", "same"), ("same", "cpu")):
        a = syncs[("int8_ef", src)]
        b, _, _, _ = make(dst, settings["int8_ef"])
        shared, per_rank = a.state_tensors()
        b.load_state_dict(a.schedule.state_dict(), shared, per_rank)
        got, want = b.state_tensors(), a.state_tensors()
        rec["state_round_trip_equal"][f"{src}->{dst}"] = all(
            torch.equal(got[j][i][kind].cpu(), want[j][i][kind].cpu())
            for j in range(2) for i in want[j] for kind in want[j][i]) and \
            {t.device.type for t in outer_view(b).anchor} == {"cpu" if dst == "cpu" else dev.type}

    # DCP: a host tensor of a sharded parameter's local shape, keyed by shard as the
    # checkpoint keeps the sync's state, is saved and loaded where it is
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    param = next(model.parameters())
    host = torch.randn(param.to_local().shape, pin_memory=cuda)
    ptr, target = host.data_ptr(), torch.zeros_like(host)
    with tempfile.TemporaryDirectory(dir=out_dir) as ckpt:
        dcp.save({"fl": {"anchor/x/shard0": host}}, checkpoint_id=ckpt)
        dcp.load({"fl": {"anchor/x/shard0": target}}, checkpoint_id=ckpt)
    rec["dcp_host"] = {"wrapped_local_device": str(target.device), "same_storage": host.data_ptr() == ptr,
                       "loaded_equal": bool(torch.equal(target, host)), "mesh": param.device_mesh.device_type}
    for name, fn in real.items():
        setattr(dist, name, fn)
    rec["ok"] = True
    json.dump(rec, open(f"{out_dir}/outer_state_device-rank{acc.process_index}.json", "w"))
    acc.end_training()


if __name__ == "__main__":
    {"scheduler": scheduler, "collectives": collectives, "outer_state_device": outer_state_device}[sys.argv[1]](
        sys.argv[2])
