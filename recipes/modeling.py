"""Models of the recipe: presets, building on the meta device, exporting the result.

Presets are the exact public shapes (``config.json`` of the Hugging Face repositories
named below); ``tiny`` and ``tiny-tied`` train on 2 CPU cores in minutes.
"""

from __future__ import annotations

import os

from . import compat
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


PRESET_ALIASES = {"llama-1b": "llama3.2-1b", "llama-8b": "llama3.1-8b"}
"""Short names of :data:`PRESETS`, taken wherever a preset is (scripts.memory_model,
scripts.link_guide, scripts.cost_model)."""


def preset_name(name: str) -> str | None:
    """The :data:`PRESETS` key of ``name`` (a key or a :data:`PRESET_ALIASES` short name), else None."""
    name = PRESET_ALIASES.get(name, name)
    return name if name in PRESETS else None


VOCAB_PADDING = 0.01
"""A model vocabulary at most this share larger than the tokenizer's is padding (e.g.
Qwen2: 151,936 rows for 151,665 tokens), accepted and reported; a larger gap is an error
unless ``--resize_vocab``."""


def check_model(model: str, seq_len: int) -> None:
    """Before any data work, on every rank: the model is a preset or the config of a causal
    LM whose model class declares ``_no_split_modules`` (the decoder block FSDP2 shards as
    one unit; Accelerate's TRANSFORMER_BASED_WRAP reads it), and ``seq_len`` fits its
    ``max_position_embeddings``.

    Raises:
        RecipeError: one line naming the model and what is missing.
    """
    if model in PRESETS:
        limit = PRESETS[model]["max_position_embeddings"]
    else:
        config = _load_config(model)
        model_class(config, model)
        limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise RecipeError(f"--seq_len {seq_len} exceeds the model's max_position_embeddings {limit}")


def _load_config(model: str):
    from .data import DataError, load_model_config

    try:
        return load_model_config(model)
    except DataError as exc:
        raise RecipeError(f"--model {model!r} is neither a preset {sorted(PRESETS)} nor loadable: {exc}") from exc


def model_class(config, name: str):
    """The ``AutoModelForCausalLM`` class of ``config``.

    Raises:
        RecipeError: the config is not a causal LM's, or its class declares no
            ``_no_split_modules`` (FSDP2 would have no decoder block to shard per unit).
    """
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise RecipeError(f"--model {name!r} is a {type(config).__name__} ({config.model_type}), not a causal "
                          f"language model: the recipe trains AutoModelForCausalLM configs (Llama, Qwen2, "
                          f"Mistral, ...)") from None
    if not compat.no_split_modules(cls):
        raise RecipeError(f"--model {name!r}: {cls.__name__} declares no _no_split_modules, so FSDP2 has no decoder "
                          f"block to shard per unit; fl_accel trains causal LMs that declare it (Llama, Qwen2, "
                          f"Mistral, ...)")
    return cls


def model_config(model: str, seq_len: int, vocab_size: int, resize_vocab: bool = False):
    """The checked config of :func:`resolve_config`, without its note."""
    return resolve_config(model, seq_len, vocab_size, resize_vocab)[0]


def resolve_config(model: str, seq_len: int, vocab_size: int, resize_vocab: bool = False):
    """The config of a preset (its ``vocab_size`` follows the tokenizer unless the preset
    fixes one) or of a path/hub id (offline from the cache), checked against the tokenizer.

    Args:
        vocab_size: the tokenizer's size (``len(tokenizer)``).
        resize_vocab: set the config's ``vocab_size`` to the tokenizer's when they differ.

    Returns:
        ``(config, vocab_note)``: ``vocab_note`` is "" when the vocabulary equals the
        tokenizer's, else what the banner reports (a resize, or padding rows).

    Raises:
        RecipeError: unknown model, ``seq_len`` above the model's max positions, a model
            vocabulary that differs from the tokenizer's (naming both sizes and the fix).
    """
    from transformers import LlamaConfig

    if model in PRESETS:
        values = dict(PRESETS[model])
        values.setdefault("vocab_size", vocab_size)
        config = LlamaConfig(**values)
    else:
        config = _load_config(model)
        model_class(config, model)
    if seq_len > config.max_position_embeddings:
        raise RecipeError(f"--seq_len {seq_len} exceeds the model's max_position_embeddings "
                          f"{config.max_position_embeddings}")
    theirs = config.vocab_size
    if theirs == vocab_size:
        return config, ""
    if resize_vocab:
        config.vocab_size = vocab_size
        return config, f"resized from the model config's {theirs} to the tokenizer's {vocab_size} (--resize_vocab)"
    if vocab_size < theirs <= vocab_size * (1 + VOCAB_PADDING):
        return config, f"{theirs} rows for the tokenizer's {vocab_size} tokens ({theirs - vocab_size} padding rows)"
    raise RecipeError(f"the model's vocab_size is {theirs} but the tokenizer has {vocab_size} tokens (--model "
                      f"{model}, --tokenizer ...): pass the model's own tokenizer with --tokenizer, or --resize_vocab "
                      f"to train a {vocab_size}-token vocabulary")


def build_model(config, init_device: str):
    """``AutoModelForCausalLM.from_config(config)`` on the meta device (no memory; initialize after
    sharding with ``FLAccelerator.materialize``) or fully initialized on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    if init_device == "meta":
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    return AutoModelForCausalLM.from_config(config)


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
            compat.init_weights(out)(module)
    out.tie_weights()
    tmp = path + ".partial"
    out.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if os.path.exists(path):
        import shutil

        shutil.rmtree(path)
    os.replace(tmp, path)


def build_optimizer(model, args, device_type: str):
    """AdamW with the recipe's hyperparameters: the fused kernel on CUDA (one launch per
    step instead of one per tensor group; torchtitan's default), the default
    implementation (foreach where supported) elsewhere. Built before ``prepare`` (the
    parameters may still be on the meta device); Accelerate swaps in the sharded ones."""
    import torch

    fused = {"fused": True} if device_type == "cuda" else {}
    return torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             weight_decay=args.weight_decay, **fused)


def embedding_params(model) -> int:
    """Parameters of the input embedding (a lookup, not a matmul: left out of MFU's FLOPs)."""
    return model.get_input_embeddings().weight.numel()
