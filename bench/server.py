"""Start `loraplex serve` in a subprocess for a benchmark and stop it afterwards."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(
    proc: subprocess.Popen[bytes],
    base_url: str,
    timeout_s: float,
    *,
    cmd: list[str] | None = None,
    log: Path | None = None,
) -> None:
    """Poll `base_url`/ready until it answers 200. Raises if `proc` exits first (naming
    `cmd` and quoting the tail of `log`, where given) or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            detail = "" if cmd is None else f": {' '.join(cmd)}"
            if log is not None:
                detail += "\n" + log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"server exited with {proc.returncode}{detail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/ready", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not ready after {timeout_s:.0f}s")
        time.sleep(0.5)


@contextlib.contextmanager
def running_server(
    serve_args: list[str], *, timeout_s: float = 300.0, env: dict[str, str] | None = None
) -> Iterator[str]:
    """Yield the base URL of a `loraplex serve --no-auth` started with `serve_args`."""
    port = free_port()
    cmd = [sys.executable, "-m", "app.cli", "serve", "--no-auth", "--port", str(port), *serve_args]
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})})
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, base_url, timeout_s, cmd=cmd)
        yield base_url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
