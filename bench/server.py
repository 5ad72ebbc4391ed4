"""Start `loraplex serve` in a subprocess for a benchmark and stop it afterwards."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the server drains), then SIGKILL after a minute."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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
    serve_args: list[str],
    *,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    on_start: Callable[[subprocess.Popen[bytes]], None] | None = None,
) -> Iterator[str]:
    """Yield the base URL of a `loraplex serve --no-auth` started with `serve_args`.
    on_start: handed the server's process as soon as it is started (its pid, for RSS)."""
    port = free_port()
    cmd = [sys.executable, "-m", "app.cli", "serve", "--no-auth", "--port", str(port), *serve_args]
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})})
    if on_start is not None:
        on_start(proc)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, base_url, timeout_s, cmd=cmd)
        yield base_url
    finally:
        stop(proc)


def engine_counters(base_url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """The engine's cumulative counters from /metrics that the figures divide."""
    wanted = (
        "loraplex_engine_steps_total", "loraplex_engine_step_seconds_total",
        "loraplex_prompt_tokens_total", "loraplex_generation_tokens_total",
        "loraplex_prefix_cache_hits_total", "loraplex_prefix_cache_queries_total",
    )
    values = dict.fromkeys(wanted, 0.0)
    text = httpx.get(f"{base_url}/metrics", timeout=10, headers=headers).text
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        base = name.split("{", 1)[0]
        if base in values:
            values[base] += float(value)
    return values


@dataclass(slots=True)
class ProcessMemory:
    """Resident memory of a process, from /proc/PID/status (Linux), in MiB."""

    pid: int

    def read(self) -> dict[str, int]:
        """VmRSS (now) and VmHWM (the peak so far); {} where /proc has no such process."""
        try:
            text = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return {}
        found: dict[str, int] = {}
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) // 1024
        return found

    def rss_mb(self) -> int | None:
        return self.read().get("VmRSS")

    def peak_rss_mb(self) -> int | None:
        return self.read().get("VmHWM")
