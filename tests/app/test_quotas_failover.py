"""What happens to admission when Redis dies, hangs and comes back (through a TCP proxy
that is cut and restored), and what a tenant without limits costs."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from app.core.principal import Quotas
from app.quotas import (
    FailoverLimiter,
    InMemoryLimiter,
    QuotaExceeded,
    QuotaUnavailable,
    RedisLimiter,
    lua,
    make_limiter,
)
from tests.utils.tcp_proxy import TcpProxy


def _free_port() -> int:
    """A port where nothing listens (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def proxy(redis_url: str) -> Iterator[TcpProxy]:
    parts = urlsplit(redis_url)
    with TcpProxy(parts.hostname or "127.0.0.1", parts.port or 6379) as p:
        yield p


def _via(proxy: TcpProxy, redis_url: str) -> str:
    return urlsplit(redis_url)._replace(netloc=f"127.0.0.1:{proxy.port}").geturl()


def _keys(redis_url: str) -> list[str]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return sorted(client.keys("*"))  # type: ignore[arg-type]
    finally:
        client.close()


class Recorder:
    def __init__(self) -> None:
        self.tenants: list[str] = []

    def __call__(self, tenant_id: str) -> None:
        self.tenants.append(tenant_id)


@pytest.fixture
async def dead_limiters() -> AsyncIterator[dict[str, Any]]:
    """A fail-open and a fail-closed limiter pointed at a port where nothing listens."""
    url = f"redis://127.0.0.1:{_free_port()}/0"
    opened = Recorder()
    made: dict[str, Any] = {
        "open": make_limiter(url, mode="open", lease_ttl_s=30, on_fail_open=opened),
        "closed": make_limiter(url, mode="closed", lease_ttl_s=30),
        "opened": opened,
    }
    yield made
    await made["open"].close()
    await made["closed"].close()


async def test_fail_open_admits_within_per_process_limits(dead_limiters: dict[str, Any]) -> None:
    limiter = dead_limiters["open"]
    assert isinstance(limiter, FailoverLimiter)
    quotas = Quotas(rpm=3, max_concurrency=5)
    started = time.monotonic()
    admissions = [
        await limiter.admit("ten_a", quotas, request_id=f"r{i}", tokens=0) for i in range(3)
    ]
    with pytest.raises(QuotaExceeded) as info:
        await limiter.admit("ten_a", quotas, request_id="r3", tokens=0)
    assert time.monotonic() - started < 1.0  # refused connections, no waiting
    assert info.value.reason == "rpm"
    assert info.value.state.remaining_requests == 0
    assert [a.backend for a in admissions] == ["memory"] * 3
    assert [a.state.remaining_requests for a in admissions] == [2, 1, 0]
    assert dead_limiters["opened"].tenants == ["ten_a"] * 4
    assert limiter.fallbacks == 4
    # Only the first request tried Redis; the others came inside the backoff.
    assert limiter.failures == 1
    assert not limiter.redis_up
    assert await limiter.ping() is False
    for a in admissions:
        await limiter.settle(a, used_tokens=0)
    # The leases went back to the per-process store that lent them.
    assert limiter.fallback._tenants["ten_a"].leases == {}


async def test_fail_closed_refuses_with_unavailable(dead_limiters: dict[str, Any]) -> None:
    limiter = dead_limiters["closed"]
    for _ in range(3):
        with pytest.raises(QuotaUnavailable):
            await limiter.admit("ten_a", Quotas(rpm=100), request_id="r", tokens=0)
    assert (limiter.fallbacks, limiter.failures) == (3, 1)
    # Tenants without limits do not need Redis at all.
    free = await limiter.admit("ten_b", Quotas(), request_id="f", tokens=10)
    assert free.backend == "none"
    assert limiter.fallbacks == 3


async def test_redis_that_comes_back_is_used_again(proxy: TcpProxy, redis_url: str) -> None:
    opened = Recorder()
    limiter = FailoverLimiter(
        RedisLimiter.from_url(_via(proxy, redis_url), lease_ttl_s=30),
        mode="open",
        on_fail_open=opened,
        backoff_s=0.3,
    )
    quotas = Quotas(rpm=100, tpm=1000, max_concurrency=10)
    try:
        before = await limiter.admit("ten_a", quotas, request_id="before", tokens=100)
        assert before.backend == "redis"
        assert before.state.remaining_tokens == 900
        assert _keys(redis_url) == [
            "loraplex:{ten_a}:leases",
            "loraplex:{ten_a}:rpm",
            "loraplex:{ten_a}:tpm",
        ]

        proxy.cut()
        during = await limiter.admit("ten_a", quotas, request_id="during", tokens=100)
        assert during.backend == "memory"
        assert during.state.remaining_tokens == 900  # a fresh per-process count
        assert opened.tenants == ["ten_a"]
        # Settling what Redis admitted fails quietly while it is away.
        await limiter.settle(before, used_tokens=10)
        assert before.settled
        assert limiter.failures == 2
        assert await limiter.ping() is False

        proxy.restore()
        assert await limiter.ping() is True
        # Within the backoff the limiter still keeps away from Redis...
        inside = await limiter.admit("ten_a", quotas, request_id="inside", tokens=0)
        assert inside.backend == "memory"
        await asyncio.sleep(0.35)
        # ...after it, Redis is used again, with the count it kept.
        after = await limiter.admit("ten_a", quotas, request_id="after", tokens=100)
        assert after.backend == "redis"
        assert after.state.remaining_tokens == 800
        assert after.state.remaining_requests == 98
        assert limiter.redis_up
        assert opened.tenants == ["ten_a", "ten_a"]
        # The admission from the outage settles into the per-process store.
        await limiter.settle(during, used_tokens=0)
        await limiter.settle(inside, used_tokens=0)
        assert limiter.fallback._tenants["ten_a"].leases == {}
        await limiter.settle(after, used_tokens=0)
        again = await limiter.admit("ten_a", quotas, request_id="again", tokens=100)
        assert again.state.remaining_tokens == 800
    finally:
        await limiter.close()


async def test_hung_redis_costs_one_timeout_per_backoff(proxy: TcpProxy, redis_url: str) -> None:
    limiter = FailoverLimiter(
        RedisLimiter.from_url(_via(proxy, redis_url), lease_ttl_s=30, timeout_s=0.3),
        mode="open",
        backoff_s=5.0,
    )
    quotas = Quotas(rpm=100)
    try:
        assert (await limiter.admit("ten_a", quotas, request_id="a", tokens=0)).backend == ("redis")
        proxy.stall()
        started = time.monotonic()
        first = await limiter.admit("ten_a", quotas, request_id="b", tokens=0)
        first_s = time.monotonic() - started
        assert first.backend == "memory"
        assert 0.25 <= first_s < 1.5
        started = time.monotonic()
        rest = await asyncio.gather(
            *(limiter.admit("ten_a", quotas, request_id=f"c{i}", tokens=0) for i in range(20))
        )
        # None of them waits on Redis: one failure in all (each probe that timed out would
        # count one), and no timeout's worth of time (bounded loosely: shared machines).
        assert (limiter.failures, limiter.fallbacks) == (1, 21)
        assert time.monotonic() - started < 1.0
        assert {a.backend for a in rest} == {"memory"}
    finally:
        proxy.restore()
        await limiter.close()


async def test_unlimited_tenants_send_no_redis_commands(proxy: TcpProxy, redis_url: str) -> None:
    limiter = make_limiter(_via(proxy, redis_url), mode="closed", lease_ttl_s=30)
    assert isinstance(limiter, FailoverLimiter)
    client = limiter.primary.client
    # Loaded beforehand, so that no NOSCRIPT round trip adds a SCRIPT LOAD to the count.
    for script in (lua.ADMIT, lua.RENEW, lua.SETTLE):
        await client.script_load(script)
    commands: list[tuple[Any, ...]] = []
    original = client.execute_command

    async def counting(*args: Any, **kwargs: Any) -> Any:
        commands.append(args)
        return await original(*args, **kwargs)

    client.execute_command = counting  # type: ignore[method-assign]
    try:
        unlimited = Quotas(max_tokens=10, max_context_tokens=100, max_adapters=1)
        for i in range(50):
            a = await limiter.admit("ten_free", unlimited, request_id=f"r{i}", tokens=99)
            await limiter.renew(a)
            await limiter.settle(a, used_tokens=42)
        assert commands == []
        assert proxy.accepted == 1  # the SCRIPT LOADs above, nothing since
        # The counting itself works: one limited request is one script call, a settle one more.
        a = await limiter.admit("ten_paid", Quotas(rpm=5), request_id="p", tokens=0)
        await limiter.settle(a, used_tokens=0)
        assert [c[0] for c in commands] == ["EVALSHA", "EVALSHA"]
    finally:
        await limiter.close()


async def test_in_memory_without_redis_url() -> None:
    limiter = make_limiter(None, mode="closed", lease_ttl_s=5)
    assert isinstance(limiter, InMemoryLimiter)
    assert await limiter.ping() is True
    await limiter.admit("ten_a", Quotas(rpm=1), request_id="a", tokens=0)
    with pytest.raises(QuotaExceeded):
        await limiter.admit("ten_a", Quotas(rpm=1), request_id="b", tokens=0)
    await limiter.close()


def test_tcp_proxy_cut_stall_restore(proxy: TcpProxy) -> None:
    port = proxy.port
    client = redis.Redis(
        host="127.0.0.1",
        port=port,
        socket_timeout=0.3,
        socket_connect_timeout=0.3,
        retry=Retry(NoBackoff(), 0),
    )
    try:
        assert client.ping() is True
        assert proxy.open_connections == 1
        proxy.cut()
        assert proxy.open_connections == 0
        with pytest.raises(redis.ConnectionError):
            client.ping()  # the pooled connection was closed
        with socket.socket() as s, pytest.raises(ConnectionRefusedError):
            s.connect(("127.0.0.1", port))
        proxy.restore()
        assert proxy.port == port
        assert client.ping() is True
        proxy.stall()
        with pytest.raises(redis.TimeoutError):
            client.ping()
        proxy.restore()
        assert client.ping() is True
    finally:
        client.close()
