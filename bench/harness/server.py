"""Start `loraplex serve` in a subprocess for a benchmark and stop it afterwards."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine.config import default_data_dir
from engine.models.loader import resolve_model_dir


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
    ready_path: str = "/ready",
) -> None:
    """Poll `base_url` + `ready_path` until it answers 200. Raises if `proc` exits first (naming
    `cmd` and quoting the tail of `log`, where given) or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            detail = "" if cmd is None else f": {' '.join(cmd)}"
            if log is not None:
                detail += "\n" + log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"server exited with {proc.returncode}{detail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}{ready_path}", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not ready after {timeout_s:.0f}s")
        time.sleep(0.5)


# As the `loraplex` console script starts the CLI (app.cli imported, not run as __main__).
CLI_LAUNCHER = "from app.cli import main; main()"
# What a server started on a data directory of its own must not inherit from the caller.
ENV_DROP = ("DATABASE_URL", "REDIS_URL", "LORAPLEX_NO_AUTH", "LORAPLEX_DATA_DIR")


@dataclass(frozen=True, slots=True)
class LaunchedServer:
    base_url: str
    proc: subprocess.Popen[bytes]
    log_path: Path | None  # its stdout and stderr; None: the caller's

    @property
    def pid(self) -> int:
        return self.proc.pid


def clean_env(**settings: str) -> dict[str, str]:
    """This process's environment without ENV_DROP, plus `settings`."""
    env = {k: v for k, v in os.environ.items() if k.upper() not in ENV_DROP}
    env.update(settings)
    return env


def checkout_model_args(serve_args: Sequence[str]) -> list[str]:
    """`--model default` names the bundled model under the data directory; a server with
    a temporary one gets the checkout's converted directory itself (no second
    conversion per run)."""
    args = list(serve_args)
    for index, arg in enumerate(args[:-1]):
        if arg == "--model" and args[index + 1] == "default":
            args[index + 1] = str(resolve_model_dir("default", default_data_dir()))
    return args


@contextlib.contextmanager
def launched(
    cmd: Sequence[str], base_url: str, *, env: Mapping[str, str] | None = None,
    log_path: Path | None = None, timeout_s: float = 300.0, ready_path: str = "/ready",
    stopper: Callable[[subprocess.Popen[bytes]], None] | None = None, cwd: Path | None = None,
) -> Iterator[LaunchedServer]:
    """`cmd` in a subprocess (in `cwd`, output to `log_path`, quoted if it fails to start),
    ready once `base_url` + `ready_path` answers 200; stopped by `stopper` (default: `stop`)
    when the block ends."""
    with contextlib.ExitStack() as stack:
        log = None if log_path is None else stack.enter_context(log_path.open("wb"))
        proc = subprocess.Popen(
            list(cmd), env=None if env is None else dict(env), stdout=log,
            stderr=None if log is None else subprocess.STDOUT, cwd=cwd,
        )
        try:
            wait_ready(proc, base_url, timeout_s, cmd=list(cmd), log=log_path,
                       ready_path=ready_path)
            yield LaunchedServer(base_url, proc, log_path)
        finally:
            (stopper or stop)(proc)


@contextlib.contextmanager
def loraplex_serve(
    serve_args: Sequence[str], *, env: Mapping[str, str] | None = None,
    log_path: Path | None = None, timeout_s: float = 300.0, no_auth: bool = True,
    stopper: Callable[[subprocess.Popen[bytes]], None] | None = None,
) -> Iterator[LaunchedServer]:
    """`loraplex serve [--no-auth] --port P` + `serve_args`, on a free port."""
    port = free_port()
    cmd = [sys.executable, "-c", CLI_LAUNCHER, "serve", *(["--no-auth"] if no_auth else []),
           "--port", str(port), *serve_args]
    with launched(cmd, f"http://127.0.0.1:{port}", env=env, log_path=log_path,
                  timeout_s=timeout_s, stopper=stopper) as server:
        yield server


@contextlib.contextmanager
def serve_with_keys(
    serve_args: Sequence[str], data_dir: Path, *, timeout_s: float = 300.0,
    stopper: Callable[[subprocess.Popen[bytes]], None] | None = None, **settings: str,
) -> Iterator[tuple[LaunchedServer, str]]:
    """`loraplex serve` with API keys on the data directory `data_dir` (its log there,
    `--model default` the checkout's), `settings` added to its environment; yields it and
    its admin key."""
    admin_key = f"bench-admin-{secrets.token_hex(16)}"
    env = clean_env(LORAPLEX_ADMIN_KEY=admin_key, LORAPLEX_SECRET_KEY=secrets.token_hex(32),
                    LORAPLEX_DATA_DIR=str(data_dir), **settings)
    with loraplex_serve(checkout_model_args(serve_args), env=env, no_auth=False,
                        log_path=data_dir / "serve.log", timeout_s=timeout_s,
                        stopper=stopper) as server:
        yield server, admin_key


def prepare_stores(database_url: str | None, redis_url: str | None) -> None:
    """Migrate the database at `database_url` to the head revision (as an operator does
    before starting servers) and FLUSH the Redis database at `redis_url`, each if given."""
    if database_url:
        from app.db import upgrade

        upgrade(database_url)
    if redis_url:
        import redis

        with redis.Redis.from_url(redis_url, socket_connect_timeout=3) as client:
            client.flushdb()


@contextlib.contextmanager
def running_server(
    serve_args: list[str],
    *,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    on_start: Callable[[subprocess.Popen[bytes]], None] | None = None,
) -> Iterator[str]:
    """Yield the base URL of a `loraplex serve --no-auth` started with `serve_args`.
    on_start: handed the server's process once it is ready (its pid, for RSS)."""
    with loraplex_serve(serve_args, env={**os.environ, **(env or {})},
                        timeout_s=timeout_s) as server:
        if on_start is not None:
            on_start(server.proc)
        yield server.base_url


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


def proc_status(pid: int) -> dict[str, str]:
    """/proc/PID/status (Linux) as a dict; OSError where there is no such process."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def process_tree(pid: int) -> list[int]:
    """`pid` and every live process below it (Linux: /proc/PID/task/*/children); a server
    whose engine runs in a process of its own is both."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                children = Path(f"/proc/{current}/task/{task}/children").read_text().split()
            except OSError:
                continue
            todo.extend(int(child) for child in children)
    return found


def tree_memory_bytes(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (the peak since each process started) of `pid` and the
    processes below it, each summed, in bytes (a field /proc does not show is left out);
    OSError if `pid` is gone. Summed peaks are an upper bound of the tree's peak: each
    process's may come at another moment."""
    status = proc_status(pid)
    statuses = [status]
    for child in process_tree(pid)[1:]:
        with contextlib.suppress(OSError):
            statuses.append(proc_status(child))
    return {k: sum(int(st[k].split()[0]) for st in statuses if k in st) * 1024  # kB
            for k in ("VmRSS", "VmHWM") if k in status}


def tree_rss_bytes(pid: int) -> int:
    """VmRSS of `pid` and the processes below it, summed; OSError if `pid` is gone."""
    return tree_memory_bytes(pid)["VmRSS"]


@dataclass(slots=True)
class ProcessMemory:
    """Resident memory of a process and those below it (an engine process), from
    /proc/PID/status (Linux), in MiB."""

    pid: int

    def read(self) -> dict[str, int]:
        """VmRSS (now) and VmHWM (the peaks so far), each summed over the process tree;
        {} where /proc has no such process."""
        try:
            return {k: v // 2**20 for k, v in tree_memory_bytes(self.pid).items()}
        except OSError:
            return {}

    def rss_mb(self) -> int | None:
        return self.read().get("VmRSS")

    def peak_rss_mb(self) -> int | None:
        return self.read().get("VmHWM")


def model_name(base_url: str, headers: dict[str, str] | None = None) -> str:
    """The first model the server at `base_url` lists (its base model)."""
    response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])
