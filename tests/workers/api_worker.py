"""Worker of tests/test_accelerator_api.py and tests/test_cuda.py (torchrun).

    api_worker.py MODE OUT_DIR

MODE ``scheduler``: FL+FSDP 2x2, gradient accumulation 2, a linear schedule 1 -> 0 over 10
steps passed through ``FLAccelerator.prepare``; records the LR of every rank after each
optimizer step. MODE ``collectives``: every collective of the library and the recipe on
this machine's default process group and device (the CUDA test runs it on a 1-process
NCCL group, which rejects CPU tensors as a multi-GPU job would): the recipe's evaluate()
and main_first(), the sync's exchange in fp32/bf16/int8, its non-finite check, the
start-up checksum, a federated checkpoint save and load. Each rank writes
``OUT_DIR/<mode>-rank<k>.json``.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, get_scheduler

from fl_accel import FLAccelerator, FLConfig

MODEL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)


def scheduler(out_dir: str) -> None:
    acc = FLAccelerator(FLConfig(algorithm="fl_fsdp", num_groups=2, sync_every=2), cpu=True,
                        gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=10)
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
              open(f"{out_dir}/scheduler-rank{acc.process_index}.json", "w"))
    acc.end_training()


def collectives(out_dir: str) -> None:
    import torch.distributed as dist

    from fl_accel.exchange import Transport
    from recipes.pretrain import evaluate, main_first

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
    for dtype in ("fp32", "bf16", "int8"):
        t = Transport(fl_group=world, replicate_group=None, num_groups=1, group_index=0, weights=(1.0,),
                      num_chunks=1, chunk_index=0, replicas=1, chunk_owners=(0,), sync_dtype=dtype)
        x = torch.linspace(-1, 1, 1000, device=acc.device)
        mean = t.start([x]).finish()[0]
        rec[f"exchange_{dtype}_max_err"] = (mean - x).abs().max().item()
    acc.synchronizer._check_finite()  # the sync's world all-reduce of per-group flags
    acc.save_state(f"{out_dir}/ckpt")
    acc.load_state(f"{out_dir}/ckpt")
    rec["ok"] = True
    json.dump(rec, open(f"{out_dir}/collectives-rank{acc.process_index}.json", "w"))
    acc.end_training()


if __name__ == "__main__":
    {"scheduler": scheduler, "collectives": collectives}[sys.argv[1]](sys.argv[2])
