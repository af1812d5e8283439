"""A checkpoint written by an earlier fl_accel, resumed by this one (tests/dist/test_old_checkpoint.py).

2 gloo ranks, FL+FSDP with 2 groups of 1 rank, a tiny Llama (2 FSDP units), SGD, and every
piece of sync state a checkpoint holds: "nesterov" (anchor, outer momentum), "int8" with
error feedback (residuals), 2 fragments with a delay of 1 (at step 3 fragment 1's exchange
is in flight, so its means are stored). Public API only, so the same script ran on the code
that wrote the fixture.

``write OUT``: train 6 steps, save ``OUT/step_3`` after step 3, record every later loss and
the final local shards (``OUT/expected-rank<k>.pt``). ``resume CKPT OUT``: load ``CKPT`` and
train steps 4..6 the same way, recording the same (``OUT/resumed-rank<k>.pt``).
``tests/fixtures/checkpoint_v3/`` holds what ``write`` wrote at main d5796a1 (issue 47).
"""

from __future__ import annotations

import os
import sys

MODEL = dict(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False)
FL = dict(algorithm="fl_fsdp", num_groups=2, sync_every=4, num_fragments=2, sync_delay=1, sync_dtype="int8",
          sync_collectives="all_to_all",  # what the fixture ran: the only path before the field existed
          error_feedback=True, outer_optimizer="nesterov")
STEPS, SAVE_AT = 6, 3


def batch(step: int, rank: int):
    import torch

    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, MODEL["vocab_size"], (2, 8), generator=gen)


def main() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fl_accel import FLAccelerator, FLConfig

    mode, rank = sys.argv[1], int(os.environ["RANK"])
    acc = FLAccelerator(FLConfig(**FL), cpu=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = acc.prepare(model, opt)
    start = 0
    if mode == "resume":
        start = int(acc.load_state(sys.argv[2])["completed_steps"])
    out = sys.argv[-1]
    rec = {"losses": {}, "start": start}
    for step in range(start, STEPS):
        x = batch(step, rank)
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        rec["losses"][step + 1] = loss.item()
        if mode == "write" and step + 1 == SAVE_AT:
            acc.save_state(os.path.join(out, f"step_{SAVE_AT}"), extra_meta={"completed_steps": SAVE_AT})
    rec["counters"] = acc.federation.counters()
    rec["shards"] = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    acc.end_training()
    torch.save(rec, os.path.join(out, f"{'expected' if mode == 'write' else 'resumed'}-rank{rank}.pt"))


if __name__ == "__main__":
    main()
