"""What `loraplex bench soak` measures of a server process before and after its load, and
the checks that call a difference a leak."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from app.quotas.redis_limiter import DEFAULT_MAX_CONNECTIONS as REDIS_POOL_SIZE
from bench.harness.server import proc_status, tree_rss_bytes

# app.db.make_engine's pool: connections past it are closed when they are checked in, so
# more than this many open at rest are checked out and never returned.
DB_POOL_SIZE = 10
# Per-tenant keys of the Redis limiter (app/quotas/lua.py): rpm, tpm, leases, monthly.
REDIS_KEYS_PER_TENANT = 4


@dataclass(slots=True)
class Snapshot:
    rss_bytes: int
    open_fds: int  # less the Redis connections
    redis_connections: int  # the limiter's pooled connections: 0 without Redis
    threads: int
    kv_blocks_used: int
    engine_requests: int  # running + waiting in the engine
    pinned_adapters: int  # adapters that running or waiting requests hold
    db_connections: int  # SQLite: the process's handles on the file; PostgreSQL: sessions
    redis_keys: int | None  # None: no Redis
    redis_live_leases: int | None


@dataclass(slots=True)
class Check:
    name: str
    baseline: int
    after: int
    limit: int
    exact: bool = False  # after must equal limit (else: at most limit)

    @property
    def ok(self) -> bool:
        return self.after == self.limit if self.exact else self.after <= self.limit

    def row(self) -> str:
        rule = "==" if self.exact else "<="
        verdict = "ok" if self.ok else "LEAK"
        return (f"{self.name:>22}: baseline {self.baseline:>12,}  after {self.after:>12,}  "
                f"(must be {rule} {self.limit:,})  {verdict}")


def rss_bytes(pid: int) -> int:
    return tree_rss_bytes(pid)  # the engine's process too, where it has one


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _fd_targets(pid: int) -> list[str]:
    targets = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{name}"))
        except OSError:
            continue  # closed meanwhile
    return targets


def _tcp_remote_ports(pid: int) -> dict[str, int]:
    """Socket inode -> remote port, for the TCP sockets of the process's network namespace."""
    ports: dict[str, int] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            ports[fields[9]] = int(fields[2].rsplit(":", 1)[1], 16)
    return ports


def connections_to_port(pid: int, port: int) -> int:
    """The process's open sockets whose peer listens on `port`."""
    remote = _tcp_remote_ports(pid)
    return sum(
        remote.get(target[len("socket:["):-1]) == port
        for target in _fd_targets(pid) if target.startswith("socket:[")
    )


def db_connections(pid: int, database_url: str) -> int:
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite":
        path = str(Path(url.database or "").resolve())
        return sum(target == path for target in _fd_targets(pid))
    [(count,)] = query(database_url, "SELECT count(*) FROM pg_stat_activity "
                       "WHERE datname = current_database() AND pid <> pg_backend_pid()")
    return int(count)


def query(database_url: str, sql: str) -> list[tuple[Any, ...]]:
    """The rows `sql` selects, on a connection of its own (none left open)."""
    engine = create_engine(database_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(text(sql))]
    finally:
        engine.dispose()


def redis_state(redis_url: str) -> tuple[int, int]:
    """(keys, leases not yet expired) in the limiter's database."""
    client = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=5)
    try:
        seconds, micros = client.time()
        now_ms = seconds * 1000 + micros // 1000
        keys = list(client.scan_iter(count=1000))
        leases = sum(
            int(client.zcount(key, now_ms, "+inf")) for key in keys if key.endswith(":leases")
        )
        return len(keys), leases
    finally:
        client.close()


def snapshot(
    pid: int, base_url: str, admin_key: str, database_url: str, redis_url: str | None
) -> Snapshot:
    status = proc_status(pid)
    view = httpx.get(
        f"{base_url}/admin/engine", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30
    )
    view.raise_for_status()
    workers = view.json()["workers"]
    keys, leases = redis_state(redis_url) if redis_url else (None, None)
    redis_address = urlsplit(redis_url) if redis_url else None
    to_redis = 0
    if redis_address is not None and redis_address.scheme in ("redis", "rediss"):
        to_redis = connections_to_port(pid, redis_address.port or 6379)
    return Snapshot(
        rss_bytes=rss_bytes(pid),
        open_fds=open_fds(pid) - to_redis,
        redis_connections=to_redis,
        threads=int(status["Threads"]),
        kv_blocks_used=sum(w["num_total_blocks"] - w["num_free_blocks"] for w in workers),
        engine_requests=sum(w["num_running"] + w["num_waiting"] for w in workers),
        pinned_adapters=sum(
            1 for w in workers for a in w["adapters"] if a["running"] or a["waiting"]
        ),
        db_connections=db_connections(pid, database_url),
        redis_keys=keys,
        redis_live_leases=leases,
    )


def leak_checks(
    before: Snapshot, after: Snapshot, *, num_tenants: int, rss_slack_mib: int,
    rss_samples: list[tuple[float, int]],
) -> list[Check]:
    """NOTE: the slack covers what a healthy process grows into once and then keeps
    (the engine keeps its peak step footprint in the heap, the thread pool, uploaded
    adapters in the host cache, a full DB pool); a leak grows with the load, so RSS
    must also grow less in the second half of the load than in the first."""
    slack = rss_slack_mib * 1024 * 1024
    checks = [
        Check("rss_bytes", before.rss_bytes, after.rss_bytes, before.rss_bytes + slack),
        Check("open_fds", before.open_fds, after.open_fds,
              before.open_fds + DB_POOL_SIZE + 8),
        # NOTE: a burst grows the limiter's Redis pool, which keeps its connections for the
        # next one: a slow step under the open loop left 22 open. Up to the pool's cap is
        # the pool working; past it, connections are opened outside the pool.
        Check("redis_connections", before.redis_connections, after.redis_connections,
              max(before.redis_connections, REDIS_POOL_SIZE)),
        Check("threads", before.threads, after.threads, before.threads + 8),
        Check("kv_blocks_used", before.kv_blocks_used, after.kv_blocks_used,
              before.kv_blocks_used),
        Check("engine_requests", before.engine_requests, after.engine_requests, 0, exact=True),
        Check("pinned_adapters", before.pinned_adapters, after.pinned_adapters, 0, exact=True),
        Check("db_connections", before.db_connections, after.db_connections,
              max(before.db_connections, DB_POOL_SIZE)),
    ]
    if len(rss_samples) >= 3:
        rss = [bytes_ for _, bytes_ in rss_samples]
        early = max(0, rss[len(rss) // 2] - rss[0])
        late = rss[-1] - rss[len(rss) // 2]
        checks.append(Check("rss_growth_late_half", early, late, early // 2 + slack // 4))
    if before.redis_keys is not None and after.redis_keys is not None:
        checks.append(Check("redis_keys", before.redis_keys, after.redis_keys,
                            max(before.redis_keys, REDIS_KEYS_PER_TENANT * num_tenants)))
        checks.append(Check("redis_live_leases", before.redis_live_leases or 0,
                            after.redis_live_leases or 0, 0, exact=True))
    return checks
