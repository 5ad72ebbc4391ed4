"""The README's two commands: `make demo` installs what the server and the demo need and
nothing of the dev toolchain; `make test` installs that toolchain on top."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).parents[1]


def _planned_installs(target: str, tmp_path: Path) -> list[str]:
    """The pip commands `make TARGET` would run for a virtual environment not yet made."""
    result = subprocess.run(
        ["make", "-n", target, f"VENV={tmp_path / 'venv'}"],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
    )
    return [line for line in result.stdout.splitlines() if "pip install" in line]


def test_demo_installs_only_what_the_demo_needs(tmp_path: Path) -> None:
    installs = _planned_installs("demo", tmp_path)
    assert any("-e '.[demo]'" in line for line in installs), installs
    assert not any(".[dev]" in line for line in installs), installs
    # The torch build from this disk first, so that nothing pulls a CUDA build.
    assert "torch==2.13.0" in installs[1] and "-e '.[demo]'" in installs[2], installs


def test_test_installs_the_dev_toolchain(tmp_path: Path) -> None:
    installs = _planned_installs("test", tmp_path)
    assert installs.index(next(i for i in installs if "torch==2.13.0" in i)) < installs.index(
        next(i for i in installs if ".[dev]" in i)), installs


def test_the_demo_extra_is_in_the_dev_extra() -> None:
    # `make test` after `make demo` adds to the demo's environment, never takes from it.
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert set(extras["demo"]) <= set(extras["dev"])
