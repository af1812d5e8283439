"""Imports go one way: bench/, tests/ -> scripts/ -> recipes/ -> fl_accel/ (no processes, no torch).

Every ``.py`` under fl_accel/, recipes/, scripts/ and bench/ is parsed with :mod:`ast`; every
``import`` / ``from ... import`` in it (at any depth: inside functions too, relative ones
resolved against the file's package) is checked against:

* the layers: fl_accel imports nothing of recipes/scripts/bench/tests; recipes only fl_accel
  and recipes; scripts only fl_accel, recipes and scripts; bench anything but tests;
* the planning package: no runtime module of the library (everything outside
  :data:`PLANNING`) imports a planning module. The analytic predictors describe the runtime;
  the runtime does not run on them. :data:`KNOWN_RUNTIME_TO_PLANNING` lists the offenders
  of today, which must shrink to empty;
* the library's third-party imports: only its declared dependencies (pyproject.toml), and an
  optional extra's package only in the modules of :data:`OPTIONAL_THIRD_PARTY`.

The checker is :func:`violations`; ``test_the_checker_reports_planted_wrong_imports`` shows
it catches what it should on a package tree written for the purpose.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("fl_accel", "recipes", "scripts", "bench")
"""The folders checked (``tests`` is a layer too, one nothing else may import)."""
ALLOWED = {
    "fl_accel": {"fl_accel"},
    "recipes": {"fl_accel", "recipes"},
    "scripts": {"fl_accel", "recipes", "scripts"},
    "bench": {"fl_accel", "recipes", "scripts", "bench"},
}
"""Layer -> the first-party top-level packages its modules may import."""
PLANNING = ("fl_accel.planning",)
"""The library's analytic predictors (cost, memory and FLOPs models): no runtime module imports them."""
KNOWN_RUNTIME_TO_PLANNING: set[str] = set()
"""Runtime modules allowed to import a planning module: none. (The wire constants and helpers
the cost model shares with the codecs, the exchange and the comm meter live in the torch-free
fl_accel.wire, which both sides import.) An entry that no longer offends fails the test."""
TORCH_FREE = ("fl_accel.planning.memory", "fl_accel.planning.cost", "fl_accel.planning.flops",
              "fl_accel.planning.units", "fl_accel.planning.links", "fl_accel.wire")
"""Modules whose import loads no torch (issue 41 item 5): :func:`import_closure` of each holds
no torch and no Accelerate. In a fresh interpreter: tests/tools/test_fresh_imports.py."""
LIBRARY_THIRD_PARTY = {"torch", "accelerate", "yaml", "torchft"}
"""What fl_accel may import besides the standard library: pyproject.toml's dependencies
(torch, accelerate, PyYAML) and the ``ft`` extra (torchft, imported only in fault-tolerant
mode). Not transformers: the recipe's dependency, not the library's, but for :data:`OPTIONAL_THIRD_PARTY`."""
OPTIONAL_THIRD_PARTY = {"transformers": ("fl_accel.trainer", "fl_accel.compat")}
"""Optional extras of the library and the only modules that import them: transformers (the
``trainer`` extra) by FLTrainer (``fl_accel.trainer``) and its reach checks (``fl_accel.compat``,
inside functions); ``import fl_accel`` never imports it."""


def module_name(path: Path, root: Path) -> str:
    """Dotted name of the module at ``path`` (a package's ``__init__.py``: the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path, module_level: bool = False) -> set[str]:
    """Absolute names of everything ``path`` imports: ``import a.b`` gives "a.b"; ``from a
    import b`` gives "a" and "a.b" (b may be a submodule); relative imports are resolved.
    ``module_level``: only what importing ``path`` runs (not the imports in function bodies)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    if module_level:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                node.body = []
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                base_parts = parts[:len(parts) - (node.level - 1)] if node.level > 1 else parts
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return {m for m in out if m}


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(root: Path, known_runtime_to_planning=frozenset()) -> list[str]:
    """Every import under ``root``'s layer folders that breaks a rule, one line each
    ("<module> imports <module>: <rule>"), sorted; [] when the tree is clean.

    Args:
        root: a repository root holding (some of) fl_accel/, recipes/, scripts/, bench/.
        known_runtime_to_planning: runtime modules excused from the planning rule; each
            must still offend, else "... is no offender any more" is reported.
    """
    found, offenders = set(), set()
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            importer = module_name(path, root)
            runtime = layer == "fl_accel" and not _under(importer, PLANNING)
            for target in imported_modules(path, root):
                top = target.split(".")[0]
                if top in ALLOWED or top == "tests":
                    if top not in ALLOWED[layer]:
                        found.add(f"{importer} imports {target}: {layer} may import only {sorted(ALLOWED[layer])}")
                elif layer == "fl_accel" and top not in LIBRARY_THIRD_PARTY and top not in sys.stdlib_module_names \
                        and importer not in OPTIONAL_THIRD_PARTY.get(top, ()):
                    found.add(f"{importer} imports {target}: not a dependency of the library")
                if runtime and _under(target, PLANNING):
                    offenders.add(importer)
                    if importer not in known_runtime_to_planning:
                        found.add(f"{importer} imports {target}: a runtime module imports the planning package")
    found.update(f"{m} is no offender any more: remove it from KNOWN_RUNTIME_TO_PLANNING"
                 for m in set(known_runtime_to_planning) - offenders)
    return sorted(found)


def test_the_repository_keeps_the_import_directions():
    assert violations(REPO_ROOT, KNOWN_RUNTIME_TO_PLANNING) == []


def test_the_known_runtime_to_planning_imports_are_exactly_those_offenders():
    """Without the allow-list, exactly its modules are reported (so it lists today's
    offenders and nothing else)."""
    reported = {line.split(" ")[0] for line in violations(REPO_ROOT) if "planning package" in line}
    assert reported == KNOWN_RUNTIME_TO_PLANNING


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_checker_reports_planted_wrong_imports(tmp_path):
    """A package tree with one wrong import of each kind (absolute, relative, inside a
    function, a submodule named in ``from``), next to allowed ones: exactly the wrong ones
    are reported; an excused runtime module that no longer offends is reported too."""
    _write(tmp_path, {
        "fl_accel/__init__.py": "from .mesh import FLLayout\n",
        "fl_accel/mesh.py": "import math\nimport torch\nFLLayout = None\n",
        "fl_accel/bad_layer.py": "def f():\n    from recipes.modeling import PRESETS\n",
        "fl_accel/bad_third_party.py": "from transformers import get_scheduler\n",
        "fl_accel/runtime.py": "from .planning import memory\n",
        "fl_accel/runtime_ok.py": "from . import mesh\n",
        "fl_accel/planning/__init__.py": '"""Analytic predictors."""\n',
        "fl_accel/planning/memory.py": "from ..mesh import FLLayout\nfrom fl_accel.planning.units import x\n",
        "fl_accel/planning/units.py": "x = 1\n",
        "recipes/__init__.py": "",
        "recipes/pretrain.py": "import fl_accel\nfrom recipes import modeling\nfrom scripts.launch import run\n",
        "recipes/modeling.py": "from . import pretrain\nimport matplotlib\n",
        "scripts/__init__.py": "",
        "scripts/cli.py": "from recipes import modeling\nfrom bench import plan\n",
        "bench/__init__.py": "",
        "bench/plan.py": "import scripts.cli\nfrom tests import _launch\n",
    })
    assert violations(tmp_path, {"fl_accel.runtime_ok"}) == sorted([
        "bench.plan imports tests._launch: bench may import only ['bench', 'fl_accel', 'recipes', 'scripts']",
        "bench.plan imports tests: bench may import only ['bench', 'fl_accel', 'recipes', 'scripts']",
        "fl_accel.bad_layer imports recipes.modeling.PRESETS: fl_accel may import only ['fl_accel']",
        "fl_accel.bad_layer imports recipes.modeling: fl_accel may import only ['fl_accel']",
        "fl_accel.bad_third_party imports transformers.get_scheduler: not a dependency of the library",
        "fl_accel.bad_third_party imports transformers: not a dependency of the library",
        "fl_accel.runtime imports fl_accel.planning.memory: a runtime module imports the planning package",
        "fl_accel.runtime imports fl_accel.planning: a runtime module imports the planning package",
        "fl_accel.runtime_ok is no offender any more: remove it from KNOWN_RUNTIME_TO_PLANNING",
        "recipes.pretrain imports scripts.launch.run: recipes may import only ['fl_accel', 'recipes']",
        "recipes.pretrain imports scripts.launch: recipes may import only ['fl_accel', 'recipes']",
        "scripts.cli imports bench.plan: scripts may import only ['fl_accel', 'recipes', 'scripts']",
        "scripts.cli imports bench: scripts may import only ['fl_accel', 'recipes', 'scripts']",
    ])
    assert violations(tmp_path, {"fl_accel.runtime"}) == [
        line for line in violations(tmp_path) if not line.startswith("fl_accel.runtime ")]


def import_closure(module: str, root: Path = REPO_ROOT) -> set[str]:
    """Every module ``import module`` runs, as far as the source says: its packages'
    ``__init__``, their module-level imports, recursively through first-party modules (a
    third-party name is kept, not followed)."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # a.b.c runs a, a.b, then a.b.c
            sub = ".".join(parts[:i])
            if sub in seen:
                continue
            seen.add(sub)
            base = root.joinpath(*sub.split("."))
            path = base / "__init__.py" if (base / "__init__.py").exists() else base.with_suffix(".py")
            if path.exists():
                todo.extend(imported_modules(path, root, module_level=True))
    return seen


@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_planning_package_imports_no_torch(module):
    """Importing a planning model (or the wire constants) runs no ``import torch`` nor
    ``import accelerate`` at module level anywhere in its first-party closure."""
    heavy = sorted(m for m in import_closure(module) if m.split(".")[0] in ("torch", "accelerate"))
    assert heavy == [], f"import {module} loads {heavy}"


def test_the_import_closure_sees_a_planted_torch_import(tmp_path):
    """The closure follows package ``__init__``s and module-level imports, not imports inside
    functions."""
    _write(tmp_path, {
        "fl_accel/__init__.py": "from .mesh import FLLayout\n",
        "fl_accel/mesh.py": "import math\ndef f():\n    import accelerate\n",
        "fl_accel/planning/__init__.py": "",
        "fl_accel/planning/memory.py": "from ..wire import BLOCK\n",
        "fl_accel/wire.py": "import torch\nBLOCK = 1\n",
    })
    closure = import_closure("fl_accel.planning.memory", tmp_path)
    assert "torch" in closure and "accelerate" not in closure and "fl_accel.mesh" in closure


@pytest.mark.parametrize("rel, level, module, want", [
    ("fl_accel/sync.py", 1, "cost_model", "fl_accel.cost_model"),
    ("fl_accel/__init__.py", 1, "config", "fl_accel.config"),
    ("fl_accel/planning/memory.py", 2, "mesh", "fl_accel.mesh"),
    ("fl_accel/planning/__init__.py", 2, None, "fl_accel"),
])
def test_relative_imports_resolve_against_the_package(tmp_path, rel, level, module, want):
    """``from .x`` in a module is a sibling, in an ``__init__.py`` a child; ``..`` goes up."""
    _write(tmp_path, {rel: f"from {'.' * level}{module or ''} import name\n"})
    assert want in imported_modules(tmp_path / rel, tmp_path)


STATUS_API_FOLDERS = ("recipes", "examples", "scripts")
"""Folders that read the sync only through ``accelerator.federation`` (docs/api.md), never
through ``accelerator.synchronizer``, an internal of fl_accel (issue 41 item 3)."""


def synchronizer_reaches(root: Path, folders=STATUS_API_FOLDERS) -> list[str]:
    """``"<file>:<line>: <text>"`` for every line under ``folders`` of ``root`` that reaches
    into the synchronizer (``synchronizer.`` or an attribute ``.synchronizer``), in order."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if "synchronizer." in line or ".synchronizer" in line or '"synchronizer"' in line:
                    found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def test_recipes_examples_and_scripts_read_only_the_federation_status():
    """``grep -rn "synchronizer\\." recipes examples scripts`` is empty, and no ``getattr(acc,
    "synchronizer")`` either: what they need is on ``accelerator.federation``."""
    reaches = synchronizer_reaches(REPO_ROOT)
    assert reaches == [], "use accelerator.federation (docs/api.md) instead of the synchronizer:\n" + "\n".join(reaches)


def test_the_status_check_names_file_and_line(tmp_path):
    _write(tmp_path, {
        "recipes/ok.py": "def hook(_synchronizer, full):\n    return accelerator.federation.step\n",
        "examples/bad.py": "x = 1\nsteps = accelerator.synchronizer.schedule.global_step\n",
        "scripts/bad.py": 'sync = getattr(acc, "synchronizer", None)\n',
    })
    assert synchronizer_reaches(tmp_path) == [
        "examples/bad.py:2: steps = accelerator.synchronizer.schedule.global_step",
        'scripts/bad.py:1: sync = getattr(acc, "synchronizer", None)',
    ]


CORE = ("schedule", "outer", "exchange", "codecs", "sync", "fsdp")
"""The synchronizer's core (issue 41 item 1): fl_accel/<name>.py. Optional features plug in:
round planning (fl_accel.trigger's TriggerPlanner), membership (fl_accel.ft's CommitHooks on
its transport), the lossy codecs (fl_accel.compress), the non-finite guard (fl_accel.nonfinite),
the mean of the inner optimizer's state (fl_accel.state_mean)."""
CORE_MAX_LINES = 1000
"""Issue 41's size for the core: a developer can hold it in their head."""
CORE_BRANCH_WORDS = ("elastic", "healed", "should_commit", "sync_trigger", "self.rounds")
"""Words of a branch on torchft or on the trigger kind, which the core must not hold."""


def test_the_synchronizer_core_holds_no_torchft_or_trigger_branch():
    found = [f"fl_accel/{name}.py:{n}: {line.strip()}" for name in CORE
             for n, line in enumerate((REPO_ROOT / "fl_accel" / f"{name}.py").read_text().splitlines(), 1)
             if any(word in line for word in CORE_BRANCH_WORDS)]
    assert not found, "\n".join(found)


def test_the_synchronizer_core_stays_within_its_size():
    """``wc -l`` of the core modules: a feature that grows it belongs behind an extension point."""
    lines = {name: len((REPO_ROOT / "fl_accel" / f"{name}.py").read_text().splitlines()) for name in CORE}
    assert sum(lines.values()) <= CORE_MAX_LINES, f"the core holds {sum(lines.values())} lines: {lines}"
