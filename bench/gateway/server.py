"""The gateway benchmark's servers: an instant engine behind the real app, in subprocesses.

`python -m bench.gateway.server` is one such server, configured by the environment
(LORAPLEX_*, DATABASE_URL, REDIS_URL) exactly as `loraplex serve` reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.server import free_port, launched
from bench.harness.tenants import create_tenant

REPO_ROOT = Path(__file__).resolve().parents[2]
# A limit no run reaches: every request still runs the whole Lua admission and settle.
_UNREACHED = {"rpm": 10**9, "tpm": 10**12, "max_concurrency": 10**6, "monthly_tokens": 10**15}
# Set here for each server; never inherited from the caller's environment.
_ENV_OWNED = ("DATABASE_URL", "REDIS_URL", "database_url", "redis_url")


@dataclass(slots=True)
class UsageCheck:
    server: str
    responses_ok: int  # 200 responses to generation requests (warm-ups included)
    rows: int  # usage rows of this server's tenant (NULL tenant: no-auth)
    rows_matching: int  # rows whose request id is one of the responses' ids
    completion_tokens: int  # summed over the rows
    expected_completion_tokens: int
    exit_code: int | None  # of the server after SIGTERM (0: drained and flushed cleanly)

    @property
    def ok(self) -> bool:
        return (
            self.exit_code == 0
            and self.rows == self.rows_matching == self.responses_ok
            and self.completion_tokens == self.expected_completion_tokens
        )


@dataclass(slots=True)
class Server:
    name: str
    base_url: str
    proc: subprocess.Popen[bytes]
    database_url: str
    tenant_id: str | None = None  # None: no-auth
    headers: dict[str, str] = field(default_factory=dict)
    ok_ids: set[str] = field(default_factory=set)  # ids of 200 generation responses

    def cpu_seconds(self) -> float | None:
        """CPU time of the server process's threads so far (Linux /proc).

        NOTE: the scheduler's nanosecond run times of the live threads, not utime + stime
        from /proc/PID/stat: those count in clock ticks (10 ms), more than a short run of
        cheap requests takes in all. The server's threads live as long as it does."""
        total_ns = 0
        try:
            for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
                with contextlib.suppress(OSError):  # a thread that just ended
                    total_ns += int((task / "schedstat").read_text().split()[0])
        except OSError:
            return None
        return total_ns / 1e9


@contextlib.contextmanager
def started_server(name: str, data_dir: Path, *, no_auth: bool, admin_key: str,
                   database_url: str | None, redis_url: str) -> Iterator[Server]:
    """`create_app(FakeEngine.instant_engine(), Settings())` served like `loraplex serve`,
    in its own interpreter; database_url None: a fresh SQLite file under data_dir. Stopped
    with SIGTERM, as an orchestrator stops a replica: in-flight requests finish, usage
    flushes."""
    data_dir.mkdir(parents=True)
    port = free_port()
    database_url = database_url or f"sqlite:///{data_dir / 'loraplex.db'}"
    env = {k: v for k, v in os.environ.items()
           if not k.upper().startswith("LORAPLEX_") and k not in _ENV_OWNED}
    env |= {
        "LORAPLEX_PORT": str(port),
        "LORAPLEX_DATA_DIR": str(data_dir),
        "LORAPLEX_NO_AUTH": "true" if no_auth else "false",
        "LORAPLEX_ADMIN_KEY": admin_key,
        "LORAPLEX_SECRET_KEY": secrets.token_urlsafe(32),
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
    }
    base_url = f"http://127.0.0.1:{port}"
    with launched([sys.executable, "-m", "bench.gateway.server"], base_url, env=env,
                  cwd=REPO_ROOT, log_path=data_dir / "server.log", timeout_s=120.0,
                  ready_path="/health") as server:
        yield Server(name, base_url, server.proc, database_url)


def serve_main() -> None:
    """The server subprocess: Settings from the environment, an instant engine, uvicorn."""
    from app.core.config import Settings
    from app.main import create_app
    from app.server_options import serve_app
    from engine.testing import FakeEngine

    engine = FakeEngine.instant_engine()
    settings = Settings()
    asyncio.run(serve_app(create_app(engine, settings), engine, settings))


def check_usage(server: Server, max_tokens: int) -> UsageCheck:
    """Count the usage rows the server wrote (call after it has stopped and flushed)."""
    from sqlalchemy import func, select

    from app.db import make_engine
    from app.tables import UsageRecord

    scope = (UsageRecord.tenant_id.is_(None) if server.tenant_id is None
             else UsageRecord.tenant_id == server.tenant_id)
    ids = sorted(server.ok_ids)
    engine = make_engine(server.database_url)
    try:
        with engine.connect() as conn:
            rows, tokens = conn.execute(
                select(func.count(), func.coalesce(func.sum(UsageRecord.completion_tokens), 0))
                .where(scope)
            ).one()
            matching = 0
            for i in range(0, len(ids), 500):
                matching += conn.scalar(
                    select(func.count()).select_from(UsageRecord)
                    .where(scope, UsageRecord.request_id.in_(ids[i:i + 500]))
                ) or 0
    finally:
        engine.dispose()
    return UsageCheck(
        server=server.name, responses_ok=len(ids), rows=rows, rows_matching=matching,
        completion_tokens=int(tokens), expected_completion_tokens=len(ids) * max_tokens,
        exit_code=server.proc.returncode,
    )


@contextlib.contextmanager
def running_servers(
    root: Path, *, database_url: str | None, redis_url: str
) -> Iterator[tuple[Server, Server]]:
    """A server with keys (its tenant with limits never reached and an inference key set
    up) and a no-auth one; stopped on exit, so that both have flushed their usage when
    this returns."""
    admin_key = secrets.token_urlsafe(24)
    start = functools.partial(started_server, admin_key=admin_key, database_url=database_url,
                              redis_url=redis_url)
    with start("keys", root / "keys", no_auth=False) as keys, \
            start("no-auth", root / "no-auth", no_auth=True) as no_auth:
        made = create_tenant(keys.base_url, admin_key, "bench", quotas=_UNREACHED)
        keys.tenant_id, keys.headers = made.tenant_id, made.headers
        yield keys, no_auth


if __name__ == "__main__":
    serve_main()
