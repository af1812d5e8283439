"""The README and docs/ stay a product page and a set of readable pages (single process, no launches).

* every relative link in README.md and docs/*.md points to an existing file, and every
  ``#anchor`` to a heading of that file;
* every docs/ page is linked from the README's "Where to read more";
* README.md has at most 250 lines and a docs/ page at most about 400;
* docs/api.md's "FLConfig, in full" table lists every FLConfig field with its default;
* no session history: no dates except in result-folder names (``bench/results/<date>-...``),
  no "fresh clone" timings, no "CPU-s";
* a cited result is a ``table.md`` (or the torchft link table) of an existing result folder;
* the README's test command is what scripts/test.sh is and what .ci/run runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from _launch import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HISTORY = re.compile(r"20[0-9]{2}-[0-9]{2}-[0-9]{2}|fresh clone|CPU-s")
RESULT_FOLDER = re.compile(r"bench/results/20[0-9]{2}-[0-9]{2}-[0-9]{2}[A-Za-z0-9_-]*")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+\s+(.*)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


def test_every_docs_page_is_linked_from_the_readme():
    readme = (REPO_ROOT / "README.md").read_text()
    missing = [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in readme]
    assert not missing, missing


def test_page_lengths():
    assert len((REPO_ROOT / "README.md").read_text().splitlines()) <= 250
    long = {p.name: n for p in PAGES[1:] if (n := len(p.read_text().splitlines())) > 420}
    assert not long, long


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_no_session_history(page):
    hits = [line for line in page.read_text().splitlines() if HISTORY.search(RESULT_FOLDER.sub("", line))]
    assert not hits, hits


def test_cited_results_are_tables_of_existing_folders():
    for page in PAGES:
        for folder in set(RESULT_FOLDER.findall(page.read_text())):
            assert (REPO_ROOT / folder).is_dir(), (page.name, folder)
        for target in LINK.findall(page.read_text()):
            if "bench/results/" in target:
                assert target.endswith(("/table.md", "/link_table.md")), (page.name, target)


def test_readme_test_command_is_what_ci_runs():
    readme = (REPO_ROOT / "README.md").read_text()
    assert "bash scripts/test.sh" in readme and "bash scripts/quickstart.sh" in readme
    assert "bash scripts/test.sh" in (REPO_ROOT / ".ci" / "run").read_text()


def test_readme_states_the_tested_versions():
    """The README's Versions paragraph, pyproject.toml's range and fl_accel.compat.TESTED agree."""
    from fl_accel.compat import TESTED

    readme = (REPO_ROOT / "README.md").read_text()
    (tl, th), (al, ah) = TESTED["torch"], TESTED["accelerate"]
    assert f"**Versions.** fl_accel is tested on torch {tl[0]}.{tl[1]} to {th[0]}.{th[1]} and accelerate " \
           f"{al[0]}.{al[1]} to {ah[0]}.{ah[1]}" in readme




def test_api_flconfig_table_lists_every_field_with_its_default():
    """docs/api.md's "FLConfig, in full" names every FLConfig field once (a row may name
    several: ``outer_lr``, ``outer_momentum``), no field that does not exist, and a row of one
    field shows its default (``none`` for None, booleans in lower case)."""
    import dataclasses

    from fl_accel import FLConfig

    text = (REPO_ROOT / "docs" / "api.md").read_text()
    section = text.split("## FLConfig, in full", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")]
    named = [n for row in rows for n in re.findall(r"`(\w+)`", row[0])]
    fields = {f.name: f.default for f in dataclasses.fields(FLConfig)}
    assert sorted(named) == sorted(fields), {"missing": sorted(set(fields) - set(named)),
                                             "not fields": sorted(set(named) - set(fields)),
                                             "twice": sorted({n for n in named if named.count(n) > 1})}

    def shown(value) -> str:
        if value is None:
            return "none"
        if isinstance(value, bool):
            return str(value).lower()
        return f"`{value}`" if isinstance(value, str) else f"{value:g}"

    wrong = {}
    for row in rows:
        names = re.findall(r"`(\w+)`", row[0])
        if len(names) == 1 and row[1].strip() != shown(fields[names[0]]) \
                and (names[0], row[1].strip()) != ("sync_density", "1/64"):  # 1/64 = 0.015625
            wrong[names[0]] = (row[1].strip(), shown(fields[names[0]]))
    assert not wrong, f"(docs, FLConfig) defaults: {wrong}"
