"""Make the repository root importable (fl_accel, recipes, scripts) however pytest is started,
mark each test with its tier, and, with ``FL_ACCEL_TEST_CPU=N``, report the N tests that used
the most CPU seconds.

Tiers: each test lives in one folder of tests/, which gives it a marker of the same name
(registered in pyproject.toml), so ``pytest -m unit`` runs what ``pytest tests/unit`` runs:

* ``unit``: no process at all (tests/unit/conftest.py fails a test that starts one), the
  fast half: ``python -m pytest -q -p no:cacheprovider tests/unit``;
* ``dist``: gloo multi-process numerics (sync, streaming, unequal groups, checkpoints, FSDP,
  scale, the accelerator's API);
* ``recipe``: launches of recipes/pretrain.py (and of its parts in other processes);
* ``ft``: torchft (fault tolerance);
* ``tools``: scripts/ and bench/ run as commands, the network emulator, fresh interpreters;
* ``gpu``: CUDA-only (skipped without a GPU).

A test file outside these folders is refused at collection, and so is a ``norecursedirs``
that would skip one of them (pytest's default holds ``dist``). The helpers shared by the tiers stay in tests/
(tests/_launch.py, tests/_forkserver.py, tests/workers/, tests/golden/); tests/ is on
``sys.path`` so that every tier imports them, and a tier may import another's test helpers as
``unit.test_data``. Test file names are unique across the folders (pytest imports each by its
base name).

CPU of a test = this process's user+system time, plus that of every child it reaped
(subprocesses, torchrun and its ranks), plus that of the ranks the fork launcher's server
reaped (tests/_forkserver.py), over the test's setup, call and teardown. On a loaded
machine wall seconds (``--durations``) mostly measure the load; CPU seconds do not. Under
pytest-xdist each worker measures its own tests (its own children, its own fork server)
and sends the figure with the test's report.

Parallel runs (``pytest -n N --dist loadgroup``, what scripts/test.sh does): tests that
share an expensive module- or session-scoped fixture (a launch whose records several tests
read) get one ``xdist_group`` mark per set of connected fixtures, so the launch happens
once, on one worker; every other test is scheduled on its own. The work units (a group, or
a test on its own) are handed out in collection order (xdist's reordering of units by
their number of tests is switched off): the units of :data:`LONG_FIRST` first, longest
first, then the tests of :data:`HEAVY_FIRST` files, then the rest, so that the long
launches and the long chains start at once and do not form the tail of the run.
"""

import os
import resource
import sys
import time

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
for _path in (TESTS, ROOT):  # tests/ for _launch, _forkserver and workers; the root for fl_accel, recipes, ...
    if _path not in sys.path:
        sys.path.insert(0, _path)

TIERS = ("unit", "dist", "recipe", "ft", "tools", "gpu")
"""The folders of tests/, each a marker of its tests (registered in pyproject.toml)."""

_CPU: dict[str, tuple[float, float]] = {}
_CPU_START = pytest.StashKey[tuple[float, float]]()


def _cpu_now() -> float:
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    server = sys.modules.get("_forkserver")
    pid = getattr(getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None), "_forkserver_pid", None)
    if server is not None and pid:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
        except OSError:
            pass
    return total


CHEAP_FIXTURES = {"cache", "data_cache", "golden_cache", "out_dir", "group", "default_corpus_cache",
                  "print_measured"}
"""Module/session fixtures that only name a folder, set up in-process state or are shared
by the workers anyway (:func:`default_corpus_cache`): they do not tie tests into one group."""

LONG_FIRST = ("ft/test_ft.py::test_group_killed_mid_round_heals_from_live_group",  # waits on kills and heals
              "recipe/test_recipe_lifecycle.py::",  # the 'full' chain: a run, 2 resumes, 7 refused or short launches
              "dist/test_streaming_sync.py::",  # the 'four' chain: 19 scenarios, the resumes, the 8-rank launch
              "ft/test_ft.py::test_torchft_mode_equals_single_world",
              "ft/test_ft.py::test_recipe_trains_each_group",
              "ft/test_ft_launch.py::test_supervisor_restarts",  # two recipe groups, one killed and restarted
              "dist/test_unequal_groups.py::test_accelerate_launch",  # 3 processes of accelerate launch
              "recipe/test_failures.py::test_max_restarts",
              "dist/test_unequal_groups.py::",  # the 'resumed' chain: 6-, 6- and 4-rank launches
              "recipe/test_recipe.py::")
"""Node-id prefixes (after ``tests/``) of the units that take longest (wall seconds of the
last full run, tests/conftest.py ``FL_ACCEL_TEST_CPU``), longest first: collected first."""

HEAVY_FIRST = ("ft/test_ft.py", "ft/test_ft_launch.py", "recipe/test_failures.py", "dist/test_examples.py", "dist/test_unequal_groups.py", "recipe/test_recipe.py",
               "recipe/test_recipe_lifecycle.py", "tools/test_bench.py", "dist/test_streaming_sync.py",
               "dist/test_overlap_sync.py", "recipe/test_recipe_overlap.py",
               "dist/test_scale.py", "dist/test_accelerator_api.py", "recipe/test_bad_inputs.py",
               "recipe/test_data_default_corpus.py", "tools/test_netemu.py", "dist/test_sync_gloo.py",
               "dist/test_checkpoint_gloo.py")
"""Files (under tests/) with the longest launches, in the order their tests are collected after
:data:`LONG_FIRST` (then the rest, in collection order: the unit tier last)."""


def _relpath(item) -> str:
    """The item's file under tests/, with ``/`` separators (``dist/test_fsdp.py``)."""
    return os.path.relpath(str(item.path), TESTS).replace(os.sep, "/")


def _shared_fixture_groups(items) -> dict[str, str]:
    """nodeid -> group name for tests that use a non-cheap module/session fixture; tests
    whose fixtures are connected (one uses another, or a test uses both) share a group.

    The pytest internals read here: ``item._fixtureinfo.name2fixturedefs``, the fixture
    definitions pytest resolved for the item, and their ``scope`` and ``baseid`` (where the
    fixture was defined: "" for pytest's and plugins' own); pytest has no public API for a
    fixture's scope or origin (``item.fixturenames``, the names, is public)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    uses: dict[str, list[str]] = {}
    for item in items:
        defs_of = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", None)
        if defs_of is None:
            continue
        keys = []
        for name in getattr(item, "fixturenames", ()):
            defs = defs_of.get(name)
            if (not defs or name in CHEAP_FIXTURES or defs[-1].scope not in ("module", "session")
                    or not defs[-1].baseid):  # pytest's and plugins' own (tmp_path_factory, ...)
                continue
            keys.append(f"{item.path.stem}:{name}")  # test file names are unique across the tiers
        for k in keys[1:]:
            parent[find(k)] = find(keys[0])
        if keys:
            uses[item.nodeid] = keys
    return {nodeid: find(keys[0]).replace(":", "-") for nodeid, keys in uses.items()}


def pytest_configure(config):
    import fnmatch

    skipped = [t for t in TIERS if any(fnmatch.fnmatch(t, pattern) for pattern in config.getini("norecursedirs"))]
    if skipped:  # pytest's default norecursedirs holds "dist": tests/dist would silently not be collected
        raise pytest.UsageError(f"norecursedirs {config.getini('norecursedirs')} would skip the test folders "
                                f"{', '.join('tests/' + t for t in skipped)} (pyproject.toml)")
    if getattr(config.option, "dist", None) == "loadgroup" and not os.environ.get("PYTEST_XDIST_WORKER"):
        import inspect

        from _pytest.nodes import Node

        # pytest-xdist 3.8 groups a test by renaming item._nodeid to "nodeid@group"; pytest 9.2's
        # Node.nodeid no longer reads _nodeid, so the grouping would silently not take and every
        # worker would repeat the shared launches (about 1.6x the CPU time)
        if "_nodeid" not in inspect.getsource(Node.nodeid.fget):
            raise pytest.UsageError(f"pytest {pytest.__version__} ignores pytest-xdist's --dist loadgroup, which "
                                    f"keeps the tests of one shared launch on one worker: install what "
                                    f"requirements.txt pins (pip install 'pytest<9.2'), or run the tests serially "
                                    f"with FL_ACCEL_TEST_WORKERS=0")
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: hand out the units in collection order
        config.option.loadscopereorder = False


def _tier(item) -> str | None:
    top = _relpath(item).split("/", 1)[0]
    return top if top in TIERS else None


def _order(item) -> tuple[int, int]:
    path = _relpath(item)
    nodeid = path + item.nodeid[item.nodeid.index("::"):] if "::" in item.nodeid else path
    first = next((i for i, prefix in enumerate(LONG_FIRST) if nodeid.startswith(prefix)), len(LONG_FIRST))
    return first, HEAVY_FIRST.index(path) if path in HEAVY_FIRST else len(HEAVY_FIRST)


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m deselection, which reads the tier markers
def pytest_collection_modifyitems(config, items):
    outside = sorted({_relpath(item) for item in items if _tier(item) is None})
    if outside:
        raise pytest.UsageError(f"tests outside the tier folders of tests/ ({', '.join(TIERS)}): "
                                f"{', '.join(outside)}: move each into the folder of its kind (tests/conftest.py)")
    for item in items:
        item.add_marker(_tier(item))
    items.sort(key=_order)
    if config.pluginmanager.hasplugin("xdist"):
        groups = _shared_fixture_groups(items)
        for item in items:
            if item.nodeid in groups and not item.get_closest_marker("xdist_group"):
                item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))


DEFAULT_CORPUS_SEQ_LEN = 64
"""The block length the recipe tests launch the default corpus with."""


@pytest.fixture(scope="session")
def default_corpus_cache(tmp_path_factory) -> str:
    """A recipe ``--cache_dir`` holding the default corpus (the embedded Shakespeare), its
    BPE tokenizer (the recipe's default vocabulary) and its blocks of
    :data:`DEFAULT_CORPUS_SEQ_LEN` tokens, filled once per test run by the recipe's own
    function (``recipes.inputs.prepare_corpus``, which ``build_data`` calls), so that
    each launch reads it instead of preparing the corpus again (about 25 CPU-s). Under
    pytest-xdist the workers share it (the run's temporary root; a file lock makes one
    worker fill it while the others wait); a concurrent test run has its own."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-of-<user>/pytest-<n>/: this run's, shared by its workers
    cache = root / "default_corpus_cache"
    with open(root / "default_corpus_cache.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (cache / "filled").exists():
            from recipes.args import parse_args
            from recipes.inputs import prepare_corpus

            args = parse_args(["--seq_len", str(DEFAULT_CORPUS_SEQ_LEN), "--output_dir", str(root / "unused")],
                              environ={"WORLD_SIZE": "1"}).args
            prepare_corpus(args, str(cache))
            (cache / "filled").write_text("")
    return str(cache)


@pytest.fixture(autouse=True)
def _keep_inductor_cache_dir():
    """torch inductor's ``cache_dir()`` writes its default into ``TORCHINDUCTOR_CACHE_DIR``
    the first time an in-process test compiles; the fork launcher then (rightly) refuses
    launches whose import-time variables differ from its server's. Restore it after each test."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    yield
    if before is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not os.environ.get("FL_ACCEL_TEST_CPU"):
        yield
        return
    item.stash[_CPU_START] = (_cpu_now(), time.monotonic())
    yield
    if item.nodeid not in _CPU:  # not filled by the teardown report (a test that was not run)
        c0, t0 = item.stash[_CPU_START]
        _CPU[item.nodeid] = (_cpu_now() - c0, time.monotonic() - t0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    start = item.stash.get(_CPU_START, None)
    if call.when == "teardown" and start is not None:
        outcome.get_result().user_properties.append(("fl_accel_cpu", (_cpu_now() - start[0],
                                                                      time.monotonic() - start[1])))


def pytest_runtest_logreport(report):
    """Collect the figure from the teardown report (in this process, or from an xdist worker)."""
    for key, value in getattr(report, "user_properties", ()):
        if key == "fl_accel_cpu":
            _CPU[report.nodeid] = tuple(value)


def pytest_terminal_summary(terminalreporter):
    n = int(os.environ.get("FL_ACCEL_TEST_CPU") or 0)
    if not n or not _CPU:
        return
    total = sum(c for c, _ in _CPU.values())
    terminalreporter.write_sep("=", f"CPU seconds per test (top {n}; all {len(_CPU)} tests: {total:.0f} CPU-s)")
    for nodeid, (cpu, wall) in sorted(_CPU.items(), key=lambda kv: -kv[1][0])[:n]:
        terminalreporter.write_line(f"{cpu:8.1f} CPU-s {wall:8.1f} s  {nodeid}")
