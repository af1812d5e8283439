"""Typed settings from YAML and ``FL_ACCEL_*`` variables, for FLConfig and the recipe's parser alike.

Precedence: YAML < ``FL_ACCEL_<FIELD>`` variables < keyword overrides (None: not given);
``FL_ACCEL_TEST_*`` (test hooks) are skipped. FLConfig and ``recipes/args.py`` share the merge
and the type rules, so they accept and refuse the same values with the same words
(``ValueError`` naming the field or variable, in pure Python, on every rank).
"""

from __future__ import annotations

import difflib
import functools
import os
import typing
from typing import Any, Literal, Mapping, get_args

import yaml


def read_yaml_mapping(path: str | os.PathLike, what: str = "config") -> dict:
    """A YAML mapping (empty file: ``{}``). ValueError: unreadable, invalid, not a mapping."""
    try:
        with open(path, encoding="utf-8") as fh:
            loaded = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {what} {path}: {exc}") from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"{what} {path} must be a YAML mapping, got {type(loaded).__name__}")
    return loaded


@functools.lru_cache(maxsize=None)
def type_hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    args = get_args(hint)
    if type(None) in args and typing.get_origin(hint) is not Literal:
        return next(a for a in args if a is not type(None)), True
    return hint, False


CHOICE_HINTS = {
    ("algorithm", "diloco"): ": DiLoCo is a federated algorithm with the Nesterov outer optimizer: algorithm "
                             "'fl_fsdp' (or 'fl_hsdp') with outer_optimizer='nesterov' (recipe: --outer_optimizer "
                             "nesterov)",
    ("algorithm", "fedavg"): ": FedAvg is algorithm 'fl_fsdp' (or 'fl_hsdp') with outer_optimizer='avg', the default",
    ("algorithm", "localsgd"): ": local SGD with periodic averaging is algorithm 'fl_fsdp' with outer_optimizer='avg'",
    ("algorithm", "ddp"): ": for plain data parallelism use 'fsdp' (the baseline; FSDP2 over every rank)",
    ("outer_optimizer", "diloco"): ": DiLoCo's outer optimizer is 'nesterov'",
    ("outer_optimizer", "sgd"): ": 'nesterov' is SGD with Nesterov momentum (outer_momentum=0 gives plain SGD)",
}
"""(field, refused value) -> the hint appended to the "must be one of" error: names users bring
from papers and other libraries, mapped to this library's settings."""


def check_type(label: str, value: Any, hint: Any) -> None:
    """ValueError ``"<label> must be ..."`` unless ``value`` fits ``hint``: Literal, ``X | None``,
    ``list[int]``, bool, int, float (int or float), str (bool is no number)."""
    hint, optional = _unwrap_optional(hint)
    if optional and value is None:
        return
    if typing.get_origin(hint) is Literal:
        if value not in get_args(hint):
            raise ValueError(f"{label} must be one of {list(get_args(hint))}, got {value!r}"
                             + CHOICE_HINTS.get((label.rpartition(".")[2], str(value).lower()), ""))
        return
    if typing.get_origin(hint) is list:
        ok, what = isinstance(value, (list, tuple)) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value), "a list of integers"
    else:
        ok, what = {bool: (isinstance(value, bool), "a boolean"),
                    int: (isinstance(value, int) and not isinstance(value, bool), "an integer"),
                    float: (isinstance(value, (int, float)) and not isinstance(value, bool), "a number"),
                    str: (isinstance(value, str), "a string")}.get(hint, (True, ""))
    if not ok:
        raise ValueError(f"{label} must be {what}, got {value!r} ({type(value).__name__})")


def parse_env_value(var: str, raw: str, hint: Any) -> Any:
    """Parse variable ``var``'s text as ``hint``; ValueError naming ``var``."""
    text = raw.strip()
    hint, optional = _unwrap_optional(hint)
    if optional and text.lower() in ("", "none", "null"):
        return None
    try:
        if typing.get_origin(hint) is list:
            return [int(x) for x in text.replace(",", " ").split()]
        if hint is bool:
            return {"1": True, "true": True, "yes": True, "on": True,
                    "0": False, "false": False, "no": False, "off": False}[text.lower()]
        if hint in (int, float):
            return hint(text)
    except (KeyError, ValueError):
        what = {bool: "a boolean", int: "an integer", float: "a number"}.get(hint, "a list of integers (e.g. '2,4')")
        raise ValueError(f"{var}={raw!r} is not {what}") from None
    return text


ENV_PREFIX = "FL_ACCEL_"
TEST_ENV_PREFIX = "FL_ACCEL_TEST_"  # test hooks (FL_ACCEL_TEST_FAULT_INJECT, ...), skipped


def resolve_sources(cls, yaml_values: Mapping[str, Any] | None = None, yaml_source: str = "yaml",
                    environ: Mapping[str, str] | None = None,
                    overrides: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Merge YAML < ``FL_ACCEL_<FIELD>`` of ``environ`` (default ``os.environ``) < ``overrides``
    (None skipped) for the dataclass ``cls``. Returns ``(values, sources)``, a source being
    ``yaml_source``, the variable or "override". ValueError: a bad ``FL_ACCEL_*`` variable."""
    values, sources = dict(yaml_values or {}), dict.fromkeys(yaml_values or {}, yaml_source)
    env = env_overrides(os.environ if environ is None else environ, cls)
    values.update(env)
    sources.update({k: ENV_PREFIX + k.upper() for k in env})
    for k, v in (overrides or {}).items():
        if v is not None:
            values[k], sources[k] = v, "override"
    return values, sources


def env_overrides(environ: Mapping[str, str], cls) -> dict[str, Any]:
    """The dataclass ``cls``'s typed values from the ``FL_ACCEL_<FIELD>`` variables of
    ``environ``. ValueError: an unknown ``FL_ACCEL_*`` name or an unparsable value."""
    by_env = {ENV_PREFIX + name.upper(): name for name in cls.field_names()}
    hints = type_hints(cls)
    out: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key.startswith(TEST_ENV_PREFIX):
            continue
        if key not in by_env:
            close = difflib.get_close_matches(key[len(ENV_PREFIX):].lower(), cls.field_names(), n=1)
            raise ValueError(f"unknown environment variable {key}"
                             f"{f' (did you mean {ENV_PREFIX}{close[0].upper()}?)' if close else ''}; "
                             f"known: {sorted(by_env)}")
        out[by_env[key]] = parse_env_value(key, raw, hints[by_env[key]])
    return out
