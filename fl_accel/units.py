"""FSDP units as shapes, without torch: what one ``fully_shard`` call holds, for the cost
model (:mod:`fl_accel.cost_model`) and the memory model. Shapes follow transformers'
``modeling_llama.py``; units follow accelerate 1.15 ``fsdp2_prepare_model``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence


def _int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _num(name: str, value: Any, zero_ok: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{name} must be a {'non-negative' if zero_ok else 'positive'} finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ShardUnit:
    """One ``fully_shard`` call of ``numel`` parameters, gathered twice per micro-batch if
    ``reshard_after_forward``; ``shapes`` give FSDP2's dim-0 padding (ValueError: not numel)."""

    name: str
    numel: int
    reshard_after_forward: bool = True
    shapes: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        _int("ShardUnit.numel", self.numel, minimum=0)
        if self.shapes is not None and sum(map(math.prod, self.shapes)) != self.numel:
            raise ValueError(f"ShardUnit.shapes of {self.name!r} do not hold numel={self.numel} elements")

    gathers = property(lambda self: 2 if self.reshard_after_forward else 1)

    def local_sizes(self, shards: int) -> list[int]:
        """Elements per parameter on shard 0, the largest: ceil(dim0 / S) rows."""
        if self.shapes is None:
            return [math.ceil(self.numel / shards)]
        return [math.ceil((s or (1,))[0] / shards) * math.prod(s[1:]) for s in self.shapes]

    def padded_numel(self, shards: int) -> int:
        """Elements of FSDP2's all-gather output (``numel`` without shapes)."""
        return self.numel if self.shapes is None else shards * sum(self.local_sizes(shards))


def units_from_param_count(params: float, num_units: int = 1) -> list[ShardUnit]:
    """``num_units`` equal resharded units of ``params`` elements in all (ValueError unless
    params >= num_units >= 1)."""
    n, k = round(_num("params", params)), _int("num_units", num_units)
    if n < k:
        raise ValueError(f"params must be a number of parameters >= num_units={k}, got {params!r}")
    return [ShardUnit(f"unit{i}", n // k + (i < n % k)) for i in range(k)]


def _cfg(config: Any, name: str, default: Any = None) -> Any:
    value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
    return default if value is None else value


def llama_units(config: Any, reshard_after_forward: bool = True) -> list[ShardUnit]:
    """:func:`units_from_module` of ``LlamaForCausalLM(config)`` (a LlamaConfig or mapping)
    without torch; ValueError naming a missing or non-positive field."""
    V, H, I, L, nh = (_int(f"config.{k}", _cfg(config, k)) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"))
    nkv = _int("config.num_key_value_heads", _cfg(config, "num_key_value_heads", nh))
    hd = _int("config.head_dim", _cfg(config, "head_dim", H // nh))
    q, kv, ab, mb = nh * hd, nkv * hd, bool(_cfg(config, "attention_bias")), bool(_cfg(config, "mlp_bias"))
    linears = [(q, H, ab), (kv, H, ab), (kv, H, ab), (H, q, ab), (I, H, mb), (I, H, mb), (H, I, mb)]
    layer = [s for o, i, b in linears for s in [(o, i)] + [(o,)] * b] + [(H,), (H,)]  # weight, bias; 2 norms

    def unit(name, shapes, reshard):
        return ShardUnit(name, sum(map(math.prod, shapes)), reshard, tuple(shapes))

    layers = [unit(f"model.layers.{i}", layer, reshard_after_forward) for i in range(L)]
    if _cfg(config, "tie_word_embeddings", False):  # tail [norm, embed = lm_head] sits where embed is
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


# Llama-3.1-8B's config.json: 8,030,261,248 parameters
LLAMA_3_1_8B = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False}
