"""recipes/compat.py: every reach of the recipe into another library's internals, checked.

* Each entry of :data:`RECIPE_REACHES` (a private attribute of transformers, datasets, tqdm or
  argparse that one function of recipes/compat.py reads) is checked on the installed
  releases; a release that moves it fails here naming it and what in the recipe relies on it.
* Every function of recipes/compat.py has its entry, and every entry its function.
* No other module of recipes/ reads a private attribute of another package
  (:func:`private_reaches`, an :mod:`ast` scan naming file and line): ``x._name`` on anything
  but a method's own ``self``/``cls`` or a first-party module, ``getattr``/``hasattr``/
  ``setattr``/``delattr`` with a literal ``"_name"``, and ``from pkg import _name`` or
  ``import pkg._mod`` of a package outside recipes/ and fl_accel/. Names with a leading
  underscore that their library documents as public are :data:`PUBLIC_UNDERSCORE`.

The library's own reaches (fl_accel/compat.py) are tests/unit/test_compat.py's.
"""

from __future__ import annotations

import ast
import inspect
import io
from pathlib import Path

import pytest

from recipes import compat
from unit.test_compat import Reach

ROOT = Path(__file__).resolve().parents[2]


# ======================================================================== the reaches and their checks
def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))


def _init_weights() -> str | None:
    """One module at a time, as materialize (a linear layer) and the export (the rotary
    buffers) call it: zeroed weights and buffers come back initialized."""
    import torch
    from transformers import LlamaForCausalLM

    params = list(inspect.signature(LlamaForCausalLM._init_weights).parameters)
    if params[:2] != ["self", "module"]:
        return f"LlamaForCausalLM._init_weights takes {params}, the recipe passes one module"
    model = _tiny_llama()
    rotary = next(m for m in model.modules() if "RotaryEmbedding" in type(m).__name__)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        rotary.inv_freq.zero_()
    init = compat.init_weights(model)
    init(model.lm_head)
    init(rotary)
    if not model.lm_head.weight.abs().sum() > 0:
        return "PreTrainedModel._init_weights(linear) left a zeroed weight as it was"
    if not rotary.inv_freq.abs().sum() > 0:
        return "PreTrainedModel._init_weights(rotary embedding) no longer recomputes inv_freq"
    return None


def _no_split_modules() -> str | None:
    from transformers import LlamaForCausalLM

    names = compat.no_split_modules(LlamaForCausalLM)
    if not names or not all(isinstance(n, str) for n in names):
        return f"LlamaForCausalLM._no_split_modules is {names!r}, not a list of class names"
    present = {type(m).__name__ for m in _tiny_llama().modules()}
    missing = [n for n in names if n not in present]
    return f"LlamaForCausalLM._no_split_modules names {missing}, no module of the model" if missing else None


def _fingerprint() -> str | None:
    from datasets import Dataset

    a, b = (compat.dataset_fingerprint(Dataset.from_dict({"text": [t]})) for t in ("to be", "or not"))
    if not (isinstance(a, str) and a and isinstance(b, str) and b):
        return f"datasets.Dataset._fingerprint is {a!r}, not a string"
    return "datasets.Dataset._fingerprint is the same for two different tables" if a == b else None


def _tqdm_instances() -> str | None:
    from weakref import WeakSet

    import tqdm.std
    from tqdm.auto import tqdm as auto

    if not isinstance(getattr(tqdm.std.tqdm, "_instances", None), WeakSet):
        return "tqdm.std.tqdm._instances is not a WeakSet of the open bars"
    bar = auto(total=2, file=io.StringIO())
    try:
        if bar not in tqdm.std.tqdm._instances or not compat.progress_bar_open():
            return "an open tqdm.auto bar is not in tqdm.std.tqdm._instances"
    finally:
        bar.close()
    return "a closed tqdm bar stays in tqdm.std.tqdm._instances" if bar in tqdm.std.tqdm._instances else None


def _parser_actions() -> str | None:
    import argparse

    from transformers import HfArgumentParser

    if not issubclass(HfArgumentParser, argparse.ArgumentParser):
        return "transformers.HfArgumentParser is not an argparse.ArgumentParser"
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--steps", type=int, default=3)
    actions = compat.parser_actions(parser)
    if [a.dest for a in actions] != ["steps"]:
        return f"ArgumentParser._actions holds {[a.dest for a in actions]}, not the options added"
    actions[0].help = "optimizer steps"
    sentinel = object()
    parser.set_defaults(**{a.dest: sentinel for a in actions})
    if "optimizer steps" not in parser.format_help() or parser.parse_args([]).steps is not sentinel:
        return "changing an action of ArgumentParser._actions does not change the parser"
    return None


RECIPE_REACHES: tuple[Reach, ...] = (
    Reach("transformers PreTrainedModel._init_weights(module)",
          "init_weights: materialize of a meta-device model (recipes/pretrain.py prepare_parts) and the rotary "
          "buffers of the final export (recipes/modeling.py export_final_model)", _init_weights, package="transformers"),
    Reach("transformers PreTrainedModel._no_split_modules",
          "no_split_modules: --model refuses a class without decoder blocks to shard (recipes/modeling.py)",
          _no_split_modules, package="transformers"),
    Reach("datasets Dataset._fingerprint",
          "dataset_fingerprint: the corpus digest is kept per table (recipes/data.py _digest)", _fingerprint,
          package="datasets"),
    Reach("tqdm tqdm.std.tqdm._instances",
          "progress_bar_open: a one-line message starts past an open bar (recipes/process.py say)", _tqdm_instances,
          package="tqdm"),
    Reach("argparse ArgumentParser._actions",
          "parser_actions: FLConfig's field docs as help texts, the flags given (recipes/args.py)", _parser_actions,
          package="transformers"),
)


@pytest.mark.parametrize("reach", RECIPE_REACHES, ids=lambda r: r.internal)
def test_every_internal_the_recipe_relies_on_is_still_there(reach):
    import importlib.util

    # the recipe needs every package it reaches into (requirements.txt installs them): a missing one fails
    assert reach.package is None or importlib.util.find_spec(reach.package) is not None, \
        f"{reach.package} is not installed; the recipe needs it (pip install -r requirements.txt)"
    problem = reach.check()
    assert problem is None, f"{reach.internal} moved ({problem}); the recipe relies on it in recipes/compat.{reach.used_by}"


def test_every_function_of_the_recipes_compat_has_its_check():
    functions = {name for name, fn in inspect.getmembers(compat, inspect.isfunction) if fn.__module__ == compat.__name__}
    listed = {r.used_by.split(":")[0] for r in RECIPE_REACHES}
    assert functions == listed, (sorted(functions - listed), sorted(listed - functions))


# ======================================================================== the scan
PUBLIC_UNDERSCORE = {("os", "_exit"): "os._exit: documented in the Python library reference (exit without cleanup)"}
"""``(module name, attribute)`` with a leading underscore that the library documents as public."""
FIRST_PARTY = ("recipes", "fl_accel")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class _Scanner(ast.NodeVisitor):
    """Private attributes of foreign objects read in one module (see the module docstring)."""

    def __init__(self, rel: str, lines: list[str]):
        self.rel, self.lines, self.found, self.own, self.modules = rel, lines, [], [], set()

    def _add(self, node) -> None:
        self.found.append(f"{self.rel}:{node.lineno}: {self.lines[node.lineno - 1].strip()}")

    def _is_own(self, value) -> bool:
        return isinstance(value, ast.Name) and (value.id in self.own[-1:] or value.id in self.modules)

    def visit_ClassDef(self, node):
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.args.args:
                self.own.append(item.args.args[0].arg)  # self / cls, also in the method's closures
                self.visit(item)
                self.own.pop()
            else:
                self.visit(item)

    def visit_Import(self, node):
        for alias in node.names:
            if alias.name.split(".")[0] in FIRST_PARTY:
                self.modules.add((alias.asname or alias.name).split(".")[0])
            elif any(_private(part) for part in alias.name.split(".")):
                self._add(node)

    def visit_ImportFrom(self, node):
        if node.level or (node.module or "").split(".")[0] in FIRST_PARTY:
            self.modules.update(alias.asname or alias.name for alias in node.names)
        elif any(_private(part) for part in (node.module or "").split(".")) or \
                any(_private(alias.name) for alias in node.names):
            self._add(node)

    def visit_Attribute(self, node):
        if _private(node.attr) and not self._is_own(node.value):
            module = node.value.id if isinstance(node.value, ast.Name) else None
            if (module, node.attr) not in PUBLIC_UNDERSCORE:
                self._add(node)
        self.generic_visit(node)

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr", "delattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _private(node.args[1].value) \
                and not self._is_own(node.args[0]):
            self._add(node)
        self.generic_visit(node)


def private_reaches(root: Path, folder: str = "recipes") -> list[str]:
    """``"<file>:<line>: <text>"`` for every read of another package's private attribute in
    ``root/folder`` outside its compat.py, in order."""
    found = []
    for path in sorted((root / folder).rglob("*.py")):
        if path.name == "compat.py":
            continue
        text = path.read_text(encoding="utf-8")
        scanner = _Scanner(path.relative_to(root).as_posix(), text.splitlines())
        scanner.visit(ast.parse(text))
        found += scanner.found
    return found


def test_no_module_of_the_recipe_but_its_compat_reaches_into_internals():
    found = private_reaches(ROOT)
    assert found == [], "a private attribute of another package read outside recipes/compat.py (add a function " \
                        "there and its check to RECIPE_REACHES):\n" + "\n".join(found)


def test_the_scan_finds_planted_reaches_and_passes_own_names(tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "compat.py").write_text("x = model._init_weights\n")
    (tmp_path / "recipes" / "m.py").write_text(
        '"""model._init_weights in a docstring"""\n'
        "import os\n"
        "from recipes import data as data_lib\n"
        "from . import sync_log\n"
        "from tqdm.std import _supports_unicode\n"
        "import torch._dynamo\n"
        "class Bar:\n"
        "    def __init__(self, other):\n"
        "        self._n = other._n\n"
        "        def later():\n"
        "            return self._n + len(self.__dict__)\n"
        "def f(parser, ds, cls):\n"
        "    data_lib._Column, sync_log._show\n"
        "    actions = parser._actions  # comment ._x\n"
        "    fp = getattr(ds, '_fingerprint', None)\n"
        "    ok = getattr(ds, 'column_names'), hasattr(cls, '__name__')\n"
        "    os._exit(1)\n")
    assert private_reaches(tmp_path) == [
        "recipes/m.py:5: from tqdm.std import _supports_unicode",
        "recipes/m.py:6: import torch._dynamo",
        "recipes/m.py:9: self._n = other._n",
        "recipes/m.py:14: actions = parser._actions  # comment ._x",
        "recipes/m.py:15: fp = getattr(ds, '_fingerprint', None)",
    ]
