"""Real processes for fault tests: a private `redis-server` that a test may kill and start
again, and a `loraplex serve` subprocess, each always killed when its context ends."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from tests.utils.saas import ADMIN_KEY, SECRET_KEY

REPO_ROOT = Path(__file__).resolve().parents[2]
# As the `loraplex` console script starts it (app.cli imported, not run as __main__).
CLI_LAUNCHER = "from app.cli import main; main()"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def log_tail(path: Path, num_chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""


class RedisServer:
    """A `redis-server` of this test's own on a free loopback port, persisting to an
    append-only file under `data_dir` (fsync on every write), so that what it held before
    a SIGKILL is there again after `start()`: a restart, not a fresh Redis."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        data_dir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        args = [
            "redis-server", "--bind", "127.0.0.1", "--port", str(self.port),
            "--dir", str(self.data_dir), "--save", "", "--appendonly", "yes",
            "--appendfsync", "always", "--daemonize", "no", "--protected-mode", "yes",
        ]
        with (self.data_dir / "redis.log").open("ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, log_tail(self.data_dir / "redis.log")
            with contextlib.suppress(redis.RedisError), self.client() as client:
                if client.ping():
                    return
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no last save; the append-only file is what survives."""
        assert self.proc is not None and self.proc.poll() is None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def client(self) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=self.port, decode_responses=True,
            socket_timeout=2, socket_connect_timeout=2,
        )


@contextlib.contextmanager
def redis_server(data_dir: Path) -> Iterator[RedisServer]:
    server = RedisServer(data_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@dataclass(slots=True)
class ServeProcess:
    proc: subprocess.Popen[bytes]
    base_url: str
    log: Path

    def tail(self) -> str:
        return log_tail(self.log)


@contextlib.contextmanager
def serve_process(
    serve_args: list[str], env: dict[str, str], log: Path, *, ready_timeout_s: float = 120.0
) -> Iterator[ServeProcess]:
    """`loraplex serve --port <free> *serve_args` with `env` on top of this environment
    (DATABASE_URL, REDIS_URL and LORAPLEX_DATA_DIR are not inherited); ready when /ready
    answers 200. Killed at the end if it still runs."""
    port = free_port()
    inherited = {
        k: v for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "REDIS_URL", "LORAPLEX_DATA_DIR", "LORAPLEX_NO_AUTH")
    }
    with cli_process(["serve", "--port", str(port), *serve_args], {**inherited, **env},
                     log) as proc:
        server = ServeProcess(proc=proc, base_url=f"http://127.0.0.1:{port}", log=log)
        deadline = time.monotonic() + ready_timeout_s
        while True:
            assert proc.poll() is None, f"serve exited with {proc.returncode}\n{server.tail()}"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{server.base_url}/ready", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"serve not ready\n{server.tail()}"
            time.sleep(0.2)
        yield server


@contextlib.contextmanager
def cli_process(args: list[str], env: dict[str, str], log: Path
                ) -> Iterator[subprocess.Popen[bytes]]:
    """`loraplex *args` with exactly `env`, its output in `log`; killed at the end if it
    still runs."""
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", CLI_LAUNCHER, *args], cwd=REPO_ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def wait_until(condition: Callable[[], bool], timeout: float, what: str, logs: list[Path]
               ) -> None:
    """Poll `condition` (a refused connection counts as False) until it holds; fail the
    test naming `what`, with the tails of `logs`, after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.TransportError):
            if condition():
                return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{what} within {timeout} s\n" + "\n".join(log_tail(p) for p in logs)
            )
        time.sleep(0.1)


def scaleout_env(data_dir: Path, redis_url: str, database_url: str, worker_token: str,
                 **extra: str) -> dict[str, str]:
    """This environment plus what workers and gateways of one test share: the adapter
    store, Redis, the database, the worker token, the test's keys, fast heartbeats."""
    return {
        **os.environ,
        "LORAPLEX_DATA_DIR": str(data_dir),
        "REDIS_URL": redis_url,
        "DATABASE_URL": database_url,
        "LORAPLEX_WORKER_TOKEN": worker_token,
        "LORAPLEX_ADMIN_KEY": ADMIN_KEY,
        "LORAPLEX_SECRET_KEY": SECRET_KEY,
        "LORAPLEX_HEARTBEAT_INTERVAL_S": "0.5",
        "LORAPLEX_HEARTBEAT_TTL_S": "2",
        "OMP_NUM_THREADS": "1",
        **extra,
    }
