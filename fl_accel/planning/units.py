"""FSDP units of a model as shapes, without torch: the input of the cost and memory models.

The input of :func:`fl_accel.planning.cost.estimate` and of
:func:`fl_accel.planning.memory.estimate`: a Llama from its config (shapes as
transformers' ``modeling_llama.py``), or any module as accelerate 1.15 ``fsdp2_prepare_model``
wraps it. Used by the planning models, the CLIs, the bench's analysis and the tests; the
library's runtime only needs :class:`fl_accel.planning.cost.ShardUnit`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from fl_accel.planning.cost import ShardUnit, _int


def config_value(config: Any, name: str, default: Any = None) -> Any:
    """Field ``name`` of a model config: a mapping's key or an object's attribute (a
    ``transformers`` config); ``default`` when it is absent or None. Never raises."""
    value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
    return default if value is None else value


def llama_units(config: Any, reshard_after_forward: bool = True) -> list[ShardUnit]:
    """:func:`units_from_module` of ``LlamaForCausalLM(config)`` without torch.

    Args:
        config: a LlamaConfig or mapping: ``vocab_size``, ``hidden_size``, ``intermediate_size``,
            ``num_hidden_layers``, ``num_attention_heads``; optional ``num_key_value_heads``,
            ``head_dim``, ``attention_bias``, ``mlp_bias``, ``tie_word_embeddings``.
        reshard_after_forward: of the decoder layers (the tail is never resharded).

    Returns:
        The units in FSDP order: ``embed`` (untied only), ``model.layers.{i}``, ``tail``
        (final norm and output embedding; first when tied), each with its parameter shapes.

    Raises:
        ValueError: naming a missing or non-positive field.
    """
    V, H, I, L, nh = (_int(f"config.{k}", config_value(config, k)) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"))
    nkv = _int("config.num_key_value_heads", config_value(config, "num_key_value_heads", nh))
    hd = _int("config.head_dim", config_value(config, "head_dim", H // nh))
    ab, mb = bool(config_value(config, "attention_bias")), bool(config_value(config, "mlp_bias"))
    q, kv = nh * hd, nkv * hd
    linears = [(q, H, ab), (kv, H, ab), (kv, H, ab), (H, q, ab), (I, H, mb), (I, H, mb), (H, I, mb)]
    layer = [s for o, i, b in linears for s in [(o, i)] + [(o,)] * b] + [(H,), (H,)]  # weight, bias; 2 norms

    def unit(name, shapes, reshard):
        return ShardUnit(name, sum(map(math.prod, shapes)), reshard, tuple(shapes))

    layers = [unit(f"model.layers.{i}", layer, reshard_after_forward) for i in range(L)]
    if config_value(config, "tie_word_embeddings", False):  # tail [norm, embed = lm_head] sits where embed is
        return [unit("tail", [(H,), (V, H)], False)] + layers
    return [unit("embed", [(V, H)], reshard_after_forward)] + layers + [unit("tail", [(H,), (V, H)], False)]


def units_from_module(model: Any, wrap_cls_names: Sequence[str] | None = None,
                      reshard_after_forward: bool = True) -> list[ShardUnit]:
    """FSDP units as accelerate 1.15 ``fsdp2_prepare_model`` wraps: bottom-up each module of a
    class in ``wrap_cls_names`` (default ``_no_split_modules``), the input embedding unless
    tied, the tail [final norm, output embedding] (not resharded), the root; a parameter in
    the first unit taking it; ordered as :func:`fl_accel.fsdp.fsdp_units`. ValueError: a
    name matching no module."""
    names = set(wrap_cls_names if wrap_cls_names is not None else getattr(model, "_no_split_modules", None) or ())
    modules = list(model.named_modules())
    missing = names - {type(m).__name__ for _, m in modules}
    if missing:
        raise ValueError(f"wrap_cls_names {sorted(missing)} match no module of {type(model).__name__}")
    position = {id(m): i for i, (_, m) in enumerate(modules)}
    owned, wrapped, units = set(), set(), []

    def take(name, mods, reshard, key):
        shapes = []
        for m in mods:
            wrapped.add(id(m))
            for p in m.parameters():
                if id(p) not in owned:
                    owned.add(id(p))
                    shapes.append(tuple(p.shape))
        if shapes:
            units.append((key, ShardUnit(name, sum(map(math.prod, shapes)), reshard, tuple(shapes))))

    for path, m in reversed(modules[1:]):  # children before parents
        if type(m).__name__ in names and id(m) not in wrapped:
            take(path, [m], reshard_after_forward, position[id(m)])
    in_e = getattr(model, "get_input_embeddings", lambda: None)()
    out_e = getattr(model, "get_output_embeddings", lambda: None)()
    weight = getattr(in_e, "weight", None)
    tied = weight is not None and weight is getattr(out_e, "weight", None)
    if not tied and in_e is not None and id(in_e) not in wrapped:
        take("embed", [in_e], reshard_after_forward, position[id(in_e)])
    prefix = getattr(model, "base_model_prefix", "")  # accelerate's _find_final_norm
    base = getattr(model, prefix, None) if prefix else model
    norms = [c for _, c in getattr(base, "named_children", tuple)() if "Norm" in type(c).__name__]
    tail = [m for m in (norms[-1:] + ([in_e, out_e] if tied else [out_e])) if m is not None and id(m) not in wrapped]
    take("tail", tail, False, min((position[id(m)] for m in tail), default=0))
    take("root", [model], False, len(modules))
    return [u for _, u in sorted(units, key=lambda ku: ku[0])]


LLAMA_3_1_8B = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False}
"""Llama-3.1-8B's config.json shapes (8,030,261,248 parameters): the paper's model."""
