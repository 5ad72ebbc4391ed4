"""The import contracts in pyproject.toml hold on the tree, and each one refuses the kind
of import it exists to keep out."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

LAYERS = "Layers: admin_ui above app above engine above loraplex_kernels"
ENGINE_TIERS = "The engine in tiers"
NO_BENCH = "Nothing imports bench"
HTTP_LAYER = "Only the entry points import the HTTP layer (app.api, app.main)"
REMOTE_ENGINE = "The app names neither the remote engine nor the adapter cache"
API_CYCLES = "No import cycles inside app.api"
APP_CYCLES = "No import cycles between the parts of app"


def _config() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def lint_imports(root: Path) -> tuple[int, str]:
    """lint-imports on the tree under `root`; its exit status and report."""
    result = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"],
        cwd=root, capture_output=True, text=True, timeout=120,
    )
    return result.returncode, result.stdout + result.stderr


def verdicts(report: str) -> dict[str, str]:
    """Contract name -> KEPT or BROKEN, from the report's summary lines."""
    names = [c["name"] for c in _config()["contracts"]]
    found: dict[str, str] = {}
    for line in report.splitlines():
        for name in names:
            for verdict in ("KEPT", "BROKEN"):
                if line.startswith(f"{name} {verdict}"):
                    found[name] = verdict
    return found


def _section(report: str, contract: str) -> str:
    """The part of the report that explains why `contract` is broken."""
    details = report.partition("Broken contracts")[2]
    start = details.find(f"{contract}\n")
    assert start >= 0, report
    rest = details[start + len(contract) + 1:]
    ends = [i for i in (rest.find(f"\n{c['name']}\n") for c in _config()["contracts"]) if i >= 0]
    return rest[: min(ends)] if ends else rest


def test_the_contracts_are_the_ones_named_here() -> None:
    names = {c["name"] for c in _config()["contracts"]}
    assert names == {
        LAYERS, ENGINE_TIERS, NO_BENCH, HTTP_LAYER, REMOTE_ENGINE, API_CYCLES, APP_CYCLES
    }


def test_the_tree_keeps_every_contract() -> None:
    status, report = lint_imports(REPO_ROOT)
    assert set(verdicts(report).values()) == {"KEPT"}, report
    assert status == 0, report


def _sources_only(directory: str, names: list[str]) -> list[str]:
    return [
        n for n in names
        if n == "__pycache__" or not (n.endswith(".py") or Path(directory, n).is_dir())
    ]


@pytest.fixture(scope="module")
def baseline() -> str:
    """The report on the tree as it is."""
    return lint_imports(REPO_ROOT)[1]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the root packages' sources and of pyproject.toml."""
    for package in _config()["root_packages"]:
        shutil.copytree(REPO_ROOT / package, tmp_path / package, ignore=_sources_only)
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}\n")


@pytest.mark.parametrize(
    ("contract", "module", "line", "named"),
    [
        # The engine reaching up into a service.
        (LAYERS, "engine/client.py", "import app.tenants", "engine.client -> app.tenants"),
        # The app building the admin UI in again (the UI is a Mount passed in).
        (LAYERS, "app/main.py", "import admin_ui", "app.main -> admin_ui"),
        # A model family reaching up into the step machinery.
        (ENGINE_TIERS, "engine/models/base.py", "import engine.core.scheduler",
         "engine.models.base -> engine.core.scheduler"),
        # The LoRA weights the models apply importing the models back (the old loop).
        (ENGINE_TIERS, "engine/lora/weights.py", "import engine.models.registry",
         "engine.lora.weights -> engine.models.registry"),
        # A public value naming the engine's running state, if only for type checking.
        (ENGINE_TIERS, "engine/request.py",
         "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import engine.core.state",
         "engine.request -> engine.core.state"),
        # A service raising HTTP errors again.
        (HTTP_LAYER, "app/tenants.py", "import app.api.errors", "app.tenants -> app.api.errors"),
        # A service building the app.
        (HTTP_LAYER, "app/billing/service.py", "import app.main",
         "app.billing.service -> app.main"),
        # The app naming the remote engine.
        (REMOTE_ENGINE, "app/registry/service.py", "import engine.remote.client",
         "app.registry.service -> engine.remote.client"),
        # The command line importing the benchmarks.
        (NO_BENCH, "app/cli.py", "import bench.cli", "app.cli -> bench.cli"),
    ],
)
def test_a_forbidden_import_breaks_its_contract(
    baseline: str, tree: Path, contract: str, module: str, line: str, named: str
) -> None:
    assert named not in baseline
    _append(tree / module, line)
    status, report = lint_imports(tree)
    assert status != 0, report
    assert verdicts(report)[contract] == "BROKEN", report
    assert named in _section(report, contract), report


def test_every_engine_module_is_in_a_tier() -> None:
    """A new engine module must be given its place: the layers contract checks only the
    modules its tiers name."""
    import grimp

    contract = next(c for c in _config()["contracts"] if c["name"] == ENGINE_TIERS)
    tiers = [name.strip() for layer in contract["layers"] for name in layer.split("|")]
    graph = grimp.build_graph("engine", cache_dir=None)
    packages = {"engine", "engine.lora"}  # __init__ modules with no code of their own
    outside = [
        m for m in sorted(graph.modules)
        if m not in packages and not any(m == t or m.startswith(f"{t}.") for t in tiers)
    ]
    assert outside == []
    for package in packages:
        source = REPO_ROOT.joinpath(*package.split("."), "__init__.py").read_text()
        assert "import" not in source, package


@pytest.mark.parametrize(("contract", "package"), [(API_CYCLES, "app.api"), (APP_CYCLES, "app")])
def test_a_cycle_breaks_its_contract(tree: Path, contract: str, package: str) -> None:
    directory = tree.joinpath(*package.split("."))
    (directory / "sender.py").write_text(f"import {package}.receiver\n")
    (directory / "receiver.py").write_text(f"import {package}.sender\n")
    status, report = lint_imports(tree)
    assert status != 0, report
    assert verdicts(report)[contract] == "BROKEN", report
    section = _section(report, contract)
    assert f"No cycles are allowed in {package}." in section, report
    assert ".sender -> .receiver" in section or ".receiver -> .sender" in section, report


_LOAD_BENCH_BY_NAME = """
import sys
from click.testing import CliRunner
from app.cli import main
assert not [m for m in sys.modules if m == "bench" or m.startswith("bench.")]
result = CliRunner().invoke(main, ["bench", "lora-scaling", "--help"])
assert result.exit_code == 0, result.output
assert "Usage: main bench lora-scaling" in result.output, result.output
assert "bench.cli" in sys.modules
"""


def test_loraplex_bench_loads_the_benchmarks_only_when_asked() -> None:
    subprocess.run([sys.executable, "-c", _LOAD_BENCH_BY_NAME], cwd=REPO_ROOT, check=True,
                   timeout=120)


def test_loraplex_bench_is_also_its_own_script() -> None:
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["loraplex-bench"] == "bench.cli:bench"
    assert scripts["loraplex"] == "app.cli:main"
