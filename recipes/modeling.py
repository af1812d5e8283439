"""Models of the recipe: presets, building on the meta device, exporting the result.

Presets are the exact public shapes (``config.json`` of the Hugging Face repositories
named below); ``tiny`` and ``tiny-tied`` train on 2 CPU cores in minutes.
"""

from __future__ import annotations

import os

from .args import RecipeError

_LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)

PRESETS = {
    # ~3M parameters at an 8k vocabulary. vocab_size follows the tokenizer.
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
                 tie_word_embeddings=False),
    # The same with lm_head tied to the input embedding (as Llama-3.2-1B/3B).
    "tiny-tied": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
                      tie_word_embeddings=True),
    # meta-llama/Llama-3.2-1B config.json (tied embeddings, 1.24B parameters).
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
                        rope_parameters=dict(_LLAMA3_ROPE, factor=32.0)),
    # meta-llama/Llama-3.1-8B config.json (8.03B parameters).
    "llama3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
                        rope_parameters=dict(_LLAMA3_ROPE, factor=8.0)),
}


def check_seq_len(model: str, seq_len: int) -> None:
    """Before any data work: a preset's ``max_position_embeddings`` bounds ``--seq_len``."""
    if model in PRESETS and seq_len > PRESETS[model]["max_position_embeddings"]:
        raise RecipeError(f"--seq_len {seq_len} exceeds the model's max_position_embeddings "
                          f"{PRESETS[model]['max_position_embeddings']}")


def model_config(model: str, seq_len: int, vocab_size: int):
    """LlamaConfig of a preset, or the config of a path/hub id (offline from the cache).

    Raises:
        RecipeError: unknown model (one line naming it), ``seq_len`` above the model's
            max positions, a tokenizer larger than the model's vocabulary.
    """
    from transformers import LlamaConfig

    from .data import DataError, load_model_config

    if model in PRESETS:
        values = dict(PRESETS[model])
        values.setdefault("vocab_size", vocab_size)
        config = LlamaConfig(**values)
    else:
        try:
            config = load_model_config(model)
        except DataError as exc:
            raise RecipeError(f"--model {model!r} is neither a preset {sorted(PRESETS)} nor loadable: {exc}") from exc
    if seq_len > config.max_position_embeddings:
        raise RecipeError(f"--seq_len {seq_len} exceeds the model's max_position_embeddings "
                          f"{config.max_position_embeddings}")
    if vocab_size > config.vocab_size:
        raise RecipeError(f"the tokenizer has {vocab_size} tokens but the model's vocab_size is {config.vocab_size}")
    return config


def build_model(config, init_device: str):
    """``LlamaForCausalLM(config)`` on the meta device (no memory; initialize after
    sharding with ``FLAccelerator.materialize``) or fully initialized on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    if init_device == "meta":
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    return AutoModelForCausalLM.from_config(config)


def peak_host_mb() -> float:
    """This process's peak resident memory so far, in MiB (``ru_maxrss``, KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def export_final_model(model, config, tokenizer, path: str, is_main_process: bool) -> None:
    """Write the (synchronized) model with ``save_pretrained`` (safetensors) plus the
    tokenizer, so ``AutoModelForCausalLM.from_pretrained(path)`` loads it.

    Collective within each federation group (the full state dict is all-gathered over
    the group's FSDP mesh; ``torch.distributed.checkpoint.state_dict`` with
    ``full_state_dict=True, cpu_offload=True`` keeps it on rank 0 only): every rank
    must call it. Rank 0 builds a model on the meta device, moves it to the CPU empty,
    loads the tensors, recomputes the non-persistent RoPE buffers and saves.
    """
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main_process:
        return
    with torch.device("meta"):
        out = AutoModelForCausalLM.from_config(config)
    out.to_empty(device="cpu")
    missing, unexpected = out.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if "rotary" not in k]:
        raise RuntimeError(f"final model export: missing {missing}, unexpected {unexpected}")
    for module in out.modules():
        if "RotaryEmbedding" in type(module).__name__:
            out._init_weights(module)
    out.tie_weights()
    tmp = path + ".partial"
    out.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if os.path.exists(path):
        import shutil

        shutil.rmtree(path)
    os.replace(tmp, path)
