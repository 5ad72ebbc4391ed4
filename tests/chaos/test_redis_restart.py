"""Redis SIGKILLed and started again while a real `loraplex serve` (tiny model, SQLite)
serves a steady mix of plain, streamed and cut requests.

Fail-open: every request is still served, limited tenants within per-process limits, and
the fail-open metric counts them; fail-closed: limited tenants get 503 with Retry-After,
unlimited ones are served. Once Redis is back its shared counters decide again (a tenant
over its rpm is refused), no concurrency lease is left behind, a max_concurrency=1 tenant
still gets in, and the database holds exactly one usage row per served response.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from app.core.principal import Quotas
from app.quotas import RedisLimiter
from tests.chaos.load import Outcome, Tenant, check_usage_matches, mixed_loop, plain, usage_rows
from tests.utils.processes import RedisServer, ServeProcess, redis_server, serve_process
from tests.utils.saas import ADMIN_KEY, SECRET_KEY, create_key, create_tenant

LEASE_TTL_S = 2.0
CAPPED_RPM = 3
NUM_LOAD_WORKERS = 3


@dataclass(slots=True)
class Observed:
    during: dict[str, list[Outcome]]  # tenant -> its requests while Redis was down
    after: dict[str, list[Outcome]]  # once admissions went through Redis again
    fail_open: float  # what the fail-open counter rose by during the outage


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


async def _until(condition: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        await asyncio.sleep(0.05)


async def _fail_open_count(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    match = re.search(r"^loraplex_quota_fail_open_total ([0-9.e+]+)$", text, re.MULTILINE)
    assert match, "no fail-open metric"
    return float(match.group(1))


def _rpm_count(rds: RedisServer, tenant_id: str) -> int:
    with rds.client() as client:
        return sum(int(v) for v in client.hvals(f"loraplex:{{{tenant_id}}}:rpm"))


def _live_leases(rds: RedisServer, tenant_id: str) -> list[str]:
    with rds.client() as client:
        seconds, micros = client.time()
        now_ms = seconds * 1000 + micros // 1000
        return list(client.zrangebyscore(f"loraplex:{{{tenant_id}}}:leases", now_ms, "+inf"))


async def test_pooled_connections_outlive_a_restart(tmp_path: Path) -> None:
    """Every connection in the pool predates the restart; each still settles first time."""
    with redis_server(tmp_path / "redis") as rds:
        limiter = RedisLimiter.from_url(rds.url, lease_ttl_s=30)
        quotas = Quotas(rpm=100, max_concurrency=8)
        try:
            admissions = await asyncio.gather(*(
                limiter.admit("ten_a", quotas, request_id=f"r{i}", tokens=0) for i in range(6)
            ))
            assert len(_live_leases(rds, "ten_a")) == 6
            rds.kill()
            await asyncio.to_thread(rds.start)
            await asyncio.gather(*(limiter.settle(a, used_tokens=0) for a in admissions))
            assert _live_leases(rds, "ten_a") == []
        finally:
            await limiter.close()


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_redis_killed_and_restarted_under_load(
    mode: str, tiny_model_factory: Callable[[str], Path], sqlite_url: str, tmp_path: Path,
    stack: ExitStack,
) -> None:
    model_dir = tiny_model_factory("llama_gqa")
    rds = stack.enter_context(redis_server(tmp_path / "redis"))
    env = {
        "LORAPLEX_DATA_DIR": str(tmp_path / "data"),
        "DATABASE_URL": sqlite_url,
        "REDIS_URL": rds.url,
        "LORAPLEX_ADMIN_KEY": ADMIN_KEY,
        "LORAPLEX_SECRET_KEY": SECRET_KEY,
        "LORAPLEX_QUOTA_FAILURE_MODE": mode,
        "LORAPLEX_LEASE_TTL_S": str(LEASE_TTL_S),
        "OMP_NUM_THREADS": "1",
    }
    server = stack.enter_context(serve_process(
        ["--model", str(model_dir), "--device", "cpu", "--kv-cache-tokens", "4096",
         "--max-num-seqs", "16"],
        env, tmp_path / "serve.log",
    ))
    admin = stack.enter_context(httpx.Client(base_url=server.base_url, timeout=30))
    ids = {
        "load": create_tenant(admin, "load", rpm=100_000, max_concurrency=8)["id"],
        "capped": create_tenant(admin, "capped", rpm=CAPPED_RPM)["id"],
        "solo": create_tenant(admin, "solo", max_concurrency=1)["id"],
        "free": create_tenant(admin, "free")["id"],  # no limits
    }
    tenants = {name: Tenant(name, create_key(admin, ids[name])["key"]) for name in ids}

    observed = asyncio.run(_scenario(server, rds, mode, model_dir.name, tenants, ids))
    during, after = observed.during, observed.after

    load = tenants["load"].outcomes
    assert len(load) > 20
    if mode == "open":
        # Nothing refused: the load, then the capped tenant within its per-process rpm.
        assert [o.status for o in load if not o.served] == []
        assert [o.status for o in during["capped"]] == [200] * CAPPED_RPM + [429, 429]
        assert observed.fail_open >= CAPPED_RPM + 2
    else:
        refused = [o for o in load if not o.served]
        assert refused, "no request came while Redis was down"
        assert {(o.status, o.code, o.retry_after) for o in refused} == {(503, "overloaded", "1")}
        assert {(o.status, o.retry_after) for o in during["capped"]} == {(503, "1")}
        assert observed.fail_open == 0
    assert [o.status for o in during["free"]] == [200]  # no limits: no Redis needed
    assert [o.status for o in during["solo"]] == (
        [200] if mode == "open" else [503]
    )
    for outcome in load:
        if outcome.served and outcome.kind == "stream":
            assert outcome.done, outcome

    # Back on Redis: its counter, not a fresh per-process one, refuses the capped tenant.
    assert [o.status for o in after["capped"]] == [200] * CAPPED_RPM + [429]
    assert after["capped"][-1].code == "rate_limit_exceeded"
    assert _rpm_count(rds, ids["capped"]) == CAPPED_RPM
    # No lease left behind, in Redis or in the process.
    for name in ("load", "solo"):
        assert _live_leases(rds, ids[name]) == [], name
    assert [o.status for o in after["solo"]] == [200, 200, 200]

    # SIGTERM flushes the usage rows; then they must match the responses one to one.
    server.proc.terminate()
    assert server.proc.wait(60) == 0, server.tail()
    everything = [o for t in tenants.values() for o in t.outcomes]
    check_usage_matches(everything, usage_rows(sqlite_url))


async def _scenario(
    server: ServeProcess, rds: RedisServer, mode: str, model: str,
    tenants: dict[str, Tenant], ids: dict[str, str],
) -> Observed:
    limits = httpx.Limits(max_connections=NUM_LOAD_WORKERS + 4)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30, limits=limits) as client:

        async def ready_is(code: int) -> bool:
            return (await client.get("/ready")).status_code == code

        stop = asyncio.Event()
        workers = [
            asyncio.create_task(mixed_loop(client, tenants["load"], model, stop, worker=w))
            for w in range(NUM_LOAD_WORKERS)
        ]
        await asyncio.sleep(1.5)
        assert all(o.served for o in tenants["load"].outcomes), [
            o for o in tenants["load"].outcomes if not o.served]
        fail_open_before = await _fail_open_count(client)

        rds.kill()
        killed_at = time.monotonic()
        await _until(lambda: ready_is(503), 10, "/ready 503 without Redis")
        during = {
            "capped": [await plain(client, tenants["capped"], model)
                       for _ in range(CAPPED_RPM + 2 if mode == "open" else 2)],
            "free": [await plain(client, tenants["free"], model)],
            "solo": [await plain(client, tenants["solo"], model)],
        }
        # The outage outlives every lease Redis held when it died.
        await asyncio.sleep(max(0.0, killed_at + LEASE_TTL_S + 0.5 - time.monotonic()))
        fail_open = await _fail_open_count(client) - fail_open_before

        await asyncio.to_thread(rds.start)
        await _until(lambda: ready_is(200), 10, "/ready 200 with Redis back")
        served_via_redis = _rpm_count(rds, ids["load"])

        async def load_on_redis() -> bool:
            return _rpm_count(rds, ids["load"]) > served_via_redis

        await _until(load_on_redis, 10, "admissions through Redis again")
        after = {
            "capped": [await plain(client, tenants["capped"], model)
                       for _ in range(CAPPED_RPM + 1)],
        }
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*workers), 60)
        after["solo"] = [await plain(client, tenants["solo"], model) for _ in range(3)]
    return Observed(during=during, after=after, fail_open=fail_open)
