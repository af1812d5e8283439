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


def import_closure(module: str, root: Path = REPO_ROOT, every_import: bool = False) -> set[str]:
    """Every module ``import module`` runs, as far as the source says: its packages'
    ``__init__``, their module-level imports (``every_import``: those inside a module's
    functions too, not a package ``__init__``'s lazy ones nor :data:`OPAQUE`'s), recursively
    through first-party modules (a third-party name is kept, not followed)."""
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
                lazy = every_import and path.name != "__init__.py" and sub not in OPAQUE
                todo.extend(imported_modules(path, root, module_level=not lazy))
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


def test_our_code_reads_syncs_done_not_its_deprecated_alias():
    """``federation.rounds_done`` is kept for users' loops as a deprecated alias of
    ``syncs_done``; the library, recipe, examples, scripts and benchmarks use the name
    docs/api.md teaches (fl_accel/federation.py defines the alias)."""
    found = [f"{path.relative_to(REPO_ROOT)}:{number}"
             for folder in ("fl_accel", "recipes", "examples", "scripts", "bench")
             for path in sorted((REPO_ROOT / folder).rglob("*.py")) if path != REPO_ROOT / "fl_accel" / "federation.py"
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if "rounds_done" in line]
    assert found == [], f"use federation.syncs_done: {found}"


SYNCHRONIZER = "fl_accel.sync"
"""The synchronizer (issue 47): the optimizer hook, step counting, the event, the non-finite
detection; it drives fragments (fl_accel.fragment), the exchange and the codecs."""
OUTSIDE_THE_SYNCHRONIZER = ("torchft", "accelerate", "fl_accel.ft", "fl_accel.trigger", "fl_accel.accelerator",
                            "fl_accel.checkpoint", "fl_accel.planning")
"""What the synchronizer's import closure must not hold: torchft and its wiring, the round
planner by time/speed, the Accelerate integration, checkpoints and the analytic predictors.
They plug in (a planner, a transport and its hooks) or sit above it."""
OPAQUE = ("fl_accel.compat",)
"""Modules whose imports inside functions are not followed: compat's functions are its
reaches into each library, one per internal, called by their users only (test_compat.py)."""


def test_the_synchronizer_closure_holds_no_torchft_trigger_accelerator_checkpoint_or_planning_module():
    """Every module ``fl_accel.sync`` imports, at module level or inside a function, followed
    through first-party modules (:func:`import_closure` with ``every_import``; :data:`OPAQUE`
    at module level only)."""
    closure = import_closure(SYNCHRONIZER, every_import=True)
    found = sorted(m for m in closure if _under(m, OUTSIDE_THE_SYNCHRONIZER))
    assert found == [], f"the synchronizer's closure holds {found}"
    assert {"fl_accel.fragment", "fl_accel.exchange", "fl_accel.codecs"} <= closure


def test_the_closure_check_sees_a_planted_import_inside_a_function(tmp_path):
    _write(tmp_path, {
        "fl_accel/__init__.py": "",
        "fl_accel/sync.py": "from .fragment import Fragment\n",
        "fl_accel/fragment.py": "def f():\n    from .trigger import make_planner\n",
        "fl_accel/trigger.py": "import math\n",
    })
    assert "fl_accel.trigger" in import_closure("fl_accel.sync", tmp_path, every_import=True)
    assert "fl_accel.trigger" not in import_closure("fl_accel.sync", tmp_path)


def _plugins():
    """Every function a plug-in offers the synchronizer, and what fragments offer it: the round
    planners, the membership hooks, the transports, the fragment and its functions."""
    import inspect

    from fl_accel import exchange, fragment, ft, mesh_transport, schedule, trigger

    classes = (schedule.FixedPlanner, trigger.TriggerPlanner, exchange.EventHooks, ft.CommitHooks,
               mesh_transport.MeshTransport, ft.ManagedTransport, fragment.Fragment)
    out = [(f"{c.__name__}.{name}", fn) for c in classes for name, fn in inspect.getmembers(c, inspect.isfunction)]
    out += [(f"fragment.{f.__name__}", f) for f in (fragment.exchange, fragment.apply, fragment.reset_to_mean,
                                                    fragment.average_inner_state)]
    return out + [("trigger.make_planner", trigger.make_planner)]


def test_no_plug_in_function_takes_the_synchronizer():
    """Round planners, membership hooks, transports and fragments see a narrow, typed event
    (``SyncEvent``, a schedule, a ``Channel``), never the synchronizer: no parameter of theirs
    is named ``sync``/``synchronizer`` or annotated ``Synchronizer``."""
    import inspect

    found = []
    for label, fn in _plugins():
        for name, param in inspect.signature(fn).parameters.items():
            if name in ("sync", "synchronizer") or "Synchronizer" in str(param.annotation):
                found.append(f"{label}({name})")
    assert not found, found
    assert len(_plugins()) > 40


def test_plug_ins_are_never_handed_the_synchronizer_at_run_time():
    """A fake two-group run (the non-finite reset, average_optimizer_state, 2 fragments with a
    delay, then a full sync): every call into the planner, the hooks, the transport and the
    fragment functions is recorded, and none of them received the synchronizer."""
    import fl_accel.fragment as fragment_module
    from fl_accel import FLConfig
    from fl_accel.sync import Synchronizer
    from unit.test_schedule import FakeTransport

    seen = []

    def spy(label, fn):
        def wrapped(*args, **kwargs):
            seen.append((label, list(args) + list(kwargs.values())))
            return fn(*args, **kwargs)
        return wrapped

    transport = FakeTransport(num_groups=3)
    for name in ("begin", "bad_groups", "all_reduce", "all_to_all", "all_gather", "share_chunks"):
        setattr(transport, name, spy(f"transport.{name}", getattr(transport, name)))
    import torch

    params = [torch.nn.Parameter(torch.randn(n)) for n in (6, 5, 4)]
    cfg = FLConfig(sync_every=4, num_fragments=2, sync_delay=1, on_nonfinite="reset", average_optimizer_state=True,
                   outer_optimizer="nesterov")
    originals = {n: getattr(fragment_module, n) for n in ("exchange", "apply", "reset_to_mean", "average_inner_state")}
    try:
        for n, fn in originals.items():
            setattr(fragment_module, n, spy(f"fragment.{n}", fn))
        sync = Synchronizer([(f"p{i}", p) for i, p in enumerate(params)], torch.optim.Adam(params, lr=0.1),
                            transport=transport, config=cfg, units=[[0], [1], [2]])
        for obj, names in ((sync.planner, ("before_step", "close", "rejoin", "after_sync")),
                           (sync.hooks, ("open", "event", "write"))):
            for name in names:
                setattr(obj, name, spy(f"{type(obj).__name__}.{name}", getattr(obj, name)))
        for f in sync.fragments:
            for name in ("launch", "advance", "finish", "discard", "apply", "set_global", "inner_state"):
                setattr(f, name, spy(f"Fragment.{name}", getattr(f, name)))
        for step in range(6):
            for p in params:
                p.grad = torch.ones_like(p)
            sync.optimizer.step()
            if step == 2:
                with torch.no_grad():
                    params[0][0] = float("nan")
            sync.on_optimizer_step()
        sync.sync()
    finally:
        for n, fn in originals.items():
            setattr(fragment_module, n, fn)
    labels = {label for label, _ in seen}
    assert {"FixedPlanner.before_step", "FixedPlanner.close", "EventHooks.open", "EventHooks.event",
            "fragment.reset_to_mean", "fragment.average_inner_state", "fragment.exchange", "Fragment.launch",
            "Fragment.finish", "transport.bad_groups"} <= labels, labels
    handed = sorted({label for label, args in seen if any(a is sync for a in args)})
    assert handed == [], f"handed the synchronizer: {handed}"


def test_transports_declare_what_they_are():
    """No probing of a transport in the library (``hasattr``/``getattr`` on it): each
    transport declares every member of :class:`fl_accel.exchange.Transport`, ``elastic``
    included."""
    from fl_accel.exchange import Transport
    from fl_accel.ft import ManagedTransport
    from fl_accel.mesh_transport import MeshTransport

    members = {n for n in vars(Transport) if not n.startswith("_")} | set(Transport.__annotations__)
    for cls in (MeshTransport, ManagedTransport):
        missing = sorted(n for n in members if not hasattr(cls, n) and n not in getattr(cls, "__dataclass_fields__", {}))
        assert not missing, (cls.__name__, missing)
    import re

    probe = re.compile(r"(hasattr|getattr)\(\s*[\w.]*transport\b")
    probes = [f"{path.relative_to(REPO_ROOT)}:{n}: {line.strip()}" for path in sorted((REPO_ROOT / "fl_accel").rglob("*.py"))
              for n, line in enumerate(path.read_text().splitlines(), 1) if probe.search(line)]
    assert not probes, probes


MAX_MODULE_LINES = 360
"""Issue 47's "about 350": a library module holds one job, readable in one sitting."""


def test_every_library_module_is_small_and_says_its_purpose_in_one_line():
    """Each module of fl_accel/ has at most :data:`MAX_MODULE_LINES` lines and a docstring
    whose first line is one sentence saying what it is for."""
    found = []
    for path in sorted((REPO_ROOT / "fl_accel").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        doc = ast.get_docstring(ast.parse(text)) or ""
        first = doc.splitlines()[0] if doc else ""
        rel = path.relative_to(REPO_ROOT).as_posix()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found.append(f"{rel}: {len(text.splitlines())} lines")
        if not first.strip() or len(first) > 120 or not first.rstrip().endswith("."):
            found.append(f"{rel}: no one-line purpose ({first!r})")
    assert not found, found


def import_layers(root: Path = REPO_ROOT) -> dict[str, int]:
    """Module -> its layer in fl_accel's import graph (every import, inside functions too):
    1 for a module importing no other first-party module, else 1 + the highest layer it
    imports. A package's own ``__init__`` counts as a module importing what it names."""
    modules = {module_name(p, root): p for p in (root / "fl_accel").rglob("*.py")}
    deps = {m: {d for d in imported_modules(p, root) if d in modules and d != m and not
                (m != "fl_accel" and d in ("fl_accel", "fl_accel.planning"))} for m, p in modules.items()}
    layers: dict[str, int] = {}

    def layer(m, stack=()):
        if m in stack:
            raise AssertionError(f"import cycle: {' -> '.join(stack + (m,))}")
        if m not in layers:
            layers[m] = 1 + max((layer(d, stack + (m,)) for d in deps[m]), default=0)
        return layers[m]

    for m in modules:
        layer(m)
    return layers


def test_the_library_has_fewer_import_layers_than_before_issue_47():
    """Issue 47 found 9 layers (wire -> codecs -> compress -> mesh_transport/state_mean ->
    nonfinite -> sync -> ft -> accelerator -> fl_accel); fragments that own their state and
    plug-ins that do not import the synchronizer leave 7."""
    layers = import_layers()
    assert max(layers.values()) <= 7, sorted(layers.items(), key=lambda kv: kv[1])


def test_the_code_layout_in_the_docs_names_every_module():
    """docs/api.md's "Code layout" lists every module of fl_accel/ (planning's as one folder)."""
    text = (REPO_ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    layout = text[text.index("## Code layout"):]
    missing = [p.name for p in sorted((REPO_ROOT / "fl_accel").glob("*.py"))
               if p.name != "__init__.py" and f"  {p.name}" not in layout]
    assert not missing, missing


def test_the_torchft_mode_has_one_spelling():
    """``FLConfig.fault_tolerant`` (also ``ResolvedFLConfig.fault_tolerant``) is the one test of
    the torchft mode: no other comparison of ``fault_tolerance`` with "torchft", no probing of
    an accelerator for it, in the library, the recipe, the scripts or the examples."""
    import re

    spelled = re.compile(r"""fault_tolerance\s*[!=]=|[!=]=\s*["']torchft["']|getattr\([^)]*["']fault_tolerant["']""")
    found = [f"{path.relative_to(REPO_ROOT)}: {line.strip()}"
             for folder in ("fl_accel", "recipes", "scripts", "examples")
             for path in sorted((REPO_ROOT / folder).rglob("*.py"))
             for line in path.read_text(encoding="utf-8").splitlines() if spelled.search(line)]
    assert found == ['fl_accel/config.py: fault_tolerant = property(lambda self: self.fault_tolerance == "torchft",'], found
