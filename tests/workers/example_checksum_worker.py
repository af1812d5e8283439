"""Worker of tests/dist/test_examples.py: examples/train_loop.py's checksum after a forward
without backward (2 gloo ranks, FSDP2 over both).

FSDP2 leaves the root unit's parameters unsharded after a ``no_grad`` forward (the root's
``reshard_after_forward`` is False), so ``model.parameters()`` then yields full tensors. The
example runs such a forward when a torchft run ends on a heal (it scores the healed state);
its checksum must still be of the shards. Each rank prints one ``[checksum] {...}`` line: the
checksum after a training step, after the forward, and whether the forward left parameters
unsharded.
"""

from __future__ import annotations

import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from examples.train_loop import MODEL, shard_checksum, synthetic_rows
from fl_accel import FLAccelerator, FLConfig


def main() -> None:
    acc = FLAccelerator(FLConfig(algorithm="fsdp"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    rows = synthetic_rows(4, 16, MODEL["vocab_size"], seed=acc.process_index)
    acc.backward(model(input_ids=rows, labels=rows, use_cache=False).loss)
    opt.step()
    opt.zero_grad()
    trained = shard_checksum(model)
    with torch.no_grad():
        model(input_ids=rows, labels=rows, use_cache=False)
    unsharded = sum(not hasattr(p, "to_local") for p in model.parameters())
    print("[checksum] " + json.dumps({"rank": acc.process_index, "trained": trained,
                                      "after_forward": shard_checksum(model), "unsharded_after_forward": unsharded}),
          flush=True)
    acc.end_training()


if __name__ == "__main__":
    main()
