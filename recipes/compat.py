"""Every reach of the recipe into the internals of transformers, datasets, tqdm and argparse, in one module.

The library's reaches into torch, Accelerate, torchft and transformers are
:mod:`fl_accel.compat`'s; these are the recipe's own. Each is a function here, for the same
reason: ``tests/unit/test_recipe_compat.py`` lists them (``RECIPE_REACHES``: the internal,
what relies on it, and a check it runs on the installed releases, failing with a message
that names the internal if a release moves it), and fails naming the file and line if any
other module of ``recipes/`` reads a private attribute of another package. Each function
says why no public API serves.
"""

from __future__ import annotations

import sys
from typing import Any, Callable


# ======================================================================== transformers
def init_weights(model) -> Callable[[Any], None]:
    """``model``'s per-module initialization (transformers ``PreTrainedModel._init_weights``,
    the method each model class overrides; it takes one module): what
    ``accelerator.materialize`` runs on each module of a meta-device model, and what the final
    export re-runs on rotary modules, whose buffers no state dict holds. transformers' public
    ``init_weights()``/``initialize_weights()`` initialize the whole model, not one module."""
    return model._init_weights


def no_split_modules(model_class) -> list[str] | None:
    """The decoder-block class names a transformers model class declares
    (``PreTrainedModel._no_split_modules``; None when it declares none): FSDP2 shards one unit
    per such block, as Accelerate's own FSDP auto-wrap reads the same attribute. transformers
    has no public accessor for it."""
    return getattr(model_class, "_no_split_modules", None)


# ======================================================================== datasets
def dataset_fingerprint(dataset) -> str | None:
    """``datasets.Dataset._fingerprint`` (None when absent): the library's identity of a table
    (for data files, their paths and modification times: the key by which ``load_dataset``
    reuses its Arrow cache files). The recipe keys its corpus digests by it
    (:func:`recipes.data._digest`); datasets has no public attribute for it."""
    return getattr(dataset, "_fingerprint", None)


# ======================================================================== tqdm
def progress_bar_open() -> bool:
    """Whether this process draws a tqdm progress bar now (``tqdm.std.tqdm._instances``, the
    bars alive; False when tqdm was never imported). tqdm leaves its bar's line open, so a
    one-line message starts a new line first (:func:`recipes.process.say`); tqdm has no public
    registry of its bars."""
    bars = getattr(sys.modules.get("tqdm.std"), "tqdm", None)
    return bool(bars is not None and getattr(bars, "_instances", None))


# ======================================================================== argparse
def parser_actions(parser) -> list:
    """The actions of an ``argparse.ArgumentParser`` (``_actions``: every option, with its
    ``dest`` and ``help``; ``HfArgumentParser`` is one): the recipe fills in FLConfig's field
    docs as help texts and learns which flags were given by parsing with a sentinel default
    for every option (:mod:`recipes.args`). argparse has no public list of its actions."""
    return parser._actions
