"""Worker of tests/tools/test_memory_measured.py: one process trains a tiny Llama for a few steps
and reports its resident memory before and after, for the memory model's small real check.

    MALLOC_MMAP_THRESHOLD_=131072 python tests/workers/memory_worker.py CONFIG.json SEQ_LEN MICRO_BATCH STEPS

Prints one JSON line: ``{"before_mb": ..., "after_mb": ...}``, the peak resident set ``VmHWM``
of ``/proc/self/status`` in MiB (not ``ru_maxrss``: after ``exec`` it keeps the parent's peak,
which a big pytest process makes larger than this worker's)
right before the first step (the model and the optimizer exist, no state yet) and after the
last. The peak is reset right before the first step (``5 > /proc/self/clear_refs``, Linux),
so a higher peak during the imports cannot hide the training's. The loop is the recipe's: AdamW (the paper's settings), ``zero_grad(set_to_none=True)``,
the model output held until the next forward. With glibc's mmap threshold fixed every tensor
of 128 KiB or more is its own mapping, returned when freed, so the peak resident memory
follows the bytes in use.
"""

import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def _peak_mb() -> float:
    """This process's own peak resident set (``VmHWM``, kB in /proc/self/status) in MiB."""
    with open("/proc/self/status", encoding="ascii") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024


def main(path: str, seq_len: int, micro_batch: int, steps: int) -> None:
    torch.manual_seed(0)
    with open(path, encoding="utf-8") as fh:
        model = LlamaForCausalLM(LlamaConfig(**json.load(fh)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    ids = torch.randint(0, model.config.vocab_size, (micro_batch, seq_len))
    with open("/proc/self/clear_refs", "w") as fh:  # reset the peak resident set (VmHWM, ru_maxrss) to the current
        fh.write("5")
    before = _peak_mb()
    for _ in range(steps):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print(json.dumps({"before_mb": before, "after_mb": _peak_mb(),
                      "loss": out.loss.item()}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
