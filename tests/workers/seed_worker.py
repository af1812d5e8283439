"""A user's own loop that seeds each rank differently (``set_seed(seed + rank)``): FLAccelerator's
``prepare`` refuses it on every rank (the groups would average different initial models).
Run under real torchrun by tests/dist/test_launch_errors.py to see what the user sees."""

import torch
from accelerate.utils import set_seed
from transformers import LlamaConfig, LlamaForCausalLM

from fl_accel import FLAccelerator, FLConfig

accelerator = FLAccelerator(FLConfig(algorithm="fl_fsdp", num_groups=2, sync_every=4))
set_seed(42 + accelerator.process_index)  # the mistake
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
print("[seed_worker] prepared", flush=True)  # never reached
