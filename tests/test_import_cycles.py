"""No module of the tree imports itself through others, imports under `TYPE_CHECKING`
included (they are cycles a reader follows all the same, and break as soon as one is
needed at run time)."""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import grimp
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def _root_packages() -> list[str]:
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    return list(config["tool"]["importlinter"]["root_packages"])


def import_cycles(*packages: str) -> list[list[str]]:
    """The strongly connected sets of modules (two or more) of the import graph of
    `packages`: each set's modules all reach one another by imports."""
    graph = grimp.build_graph(*packages, exclude_type_checking_imports=False, cache_dir=None)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    # Tarjan's algorithm, iterative: a deep import chain must not hit the recursion limit.
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append(
                        (target, iter(sorted(graph.find_modules_directly_imported_by(target))))
                    )
                    break
                if target in on_stack:
                    low[module] = min(low[module], index[target])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[module])
                if low[module] == index[module]:
                    members = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.append(member)
                        if member == module:
                            break
                    if len(members) > 1:
                        cycles.append(sorted(members))
    return cycles


def test_the_tree_has_no_import_cycle() -> None:
    assert import_cycles(*_root_packages()) == []


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A package `planted_pkg`: a -> b at run time, b -> a under TYPE_CHECKING only, and
    c -> a with nothing back."""
    pkg = tmp_path / "planted_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from planted_pkg import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from planted_pkg import a\n"
    )
    (pkg / "c.py").write_text("import planted_pkg.a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "planted_pkg"
    for name in [m for m in sys.modules if m.startswith("planted_pkg")]:
        del sys.modules[name]


def test_a_cycle_through_type_checking_is_found(planted: str) -> None:
    assert import_cycles(planted) == [["planted_pkg.a", "planted_pkg.b"]]


def test_a_run_time_cycle_through_three_modules_is_found(planted: str, tmp_path: Path) -> None:
    (tmp_path / planted / "b.py").write_text("import planted_pkg.c\n")
    assert import_cycles(planted) == [["planted_pkg.a", "planted_pkg.b", "planted_pkg.c"]]
