"""Quota semantics, run alike on the in-process limiter and on the real Redis (two
RedisLimiter instances standing for two replicas that share it)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest

from app.core.principal import Quotas
from app.quotas import (
    Admission,
    InMemoryLimiter,
    LimitState,
    QuotaExceeded,
    QuotaLimiter,
    RedisLimiter,
)
from app.quotas.base import next_month_start

MakeLimiter = Callable[..., QuotaLimiter]


@pytest.fixture(params=["memory", "redis"])
async def make(request: pytest.FixtureRequest) -> AsyncIterator[MakeLimiter]:
    """make(window_s=60, lease_ttl_s=30.0) -> a limiter. On Redis every call is another
    replica (its own client) on the same store; in memory they are one and the same."""
    redis_url: str | None = None
    if request.param == "redis":
        redis_url = request.getfixturevalue("redis_url")
    made: list[QuotaLimiter] = []
    memory: dict[tuple[int, float], InMemoryLimiter] = {}

    def make(*, window_s: int = 60, lease_ttl_s: float = 30.0) -> QuotaLimiter:
        if redis_url is None:
            key = (window_s, lease_ttl_s)
            if key not in memory:
                memory[key] = InMemoryLimiter(lease_ttl_s=lease_ttl_s, window_s=window_s)
            return memory[key]
        # A generous timeout: these tests are about counts, not about a slow Redis.
        limiter = RedisLimiter.from_url(
            redis_url, lease_ttl_s=lease_ttl_s, window_s=window_s, timeout_s=5.0
        )
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        await limiter.close()


async def admit_or_refusal(
    limiter: QuotaLimiter, quotas: Quotas, request_id: str, tokens: int = 0, tenant: str = "ten_a"
) -> Admission | QuotaExceeded:
    try:
        return await limiter.admit(tenant, quotas, request_id=request_id, tokens=tokens)
    except QuotaExceeded as exc:
        return exc


async def refused(
    limiter: QuotaLimiter, quotas: Quotas, tokens: int = 0, tenant: str = "ten_a"
) -> QuotaExceeded:
    with pytest.raises(QuotaExceeded) as info:
        await limiter.admit(tenant, quotas, request_id="refused", tokens=tokens)
    return info.value


# ------------------------------------------------------------------ rpm


async def test_rpm_two_replicas_admit_exactly_the_limit(make: MakeLimiter) -> None:
    quotas = Quotas(rpm=50)
    replicas = [make(), make()]
    results = await asyncio.gather(
        *(admit_or_refusal(replicas[i % 2], quotas, f"req_{i}") for i in range(300))
    )
    admitted = [r for r in results if isinstance(r, Admission)]
    refusals = [r for r in results if isinstance(r, QuotaExceeded)]
    assert len(admitted) == 50
    assert len(refusals) == 250
    # Each admission saw its own place in the count: one script at a time, no lost update.
    assert sorted(a.state.remaining_requests or 0 for a in admitted) == list(range(50))
    for a in admitted:
        assert a.state.limit_requests == 50
        assert a.state.limit_tokens is None and a.state.remaining_tokens is None
        assert 60.0 <= (a.state.reset_requests_s or 0) <= 61.0
    for r in refusals:
        assert (r.reason, r.code, r.should_retry) == ("rpm", "rate_limit_exceeded", True)
        assert r.error_type == "requests"
        assert r.message.startswith(
            "Rate limit reached for requests per min (RPM): Limit 50, Used 50, Requested 1. "
            "Please try again in "
        )
        # The first admitted second leaves the window after 60 s (+ up to one second).
        assert 59 <= r.retry_after_s <= 61
        headers = r.headers()
        assert headers["x-ratelimit-limit-requests"] == "50"
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert headers["x-ratelimit-reset-requests"].startswith(("59.", "1m0", "1m1s"))
        assert headers["retry-after"] == str(r.retry_after_s)
        assert "x-should-retry" not in headers
        assert not any(k.endswith("-tokens") for k in headers)


async def test_rpm_window_slides(make: MakeLimiter) -> None:
    limiter = make(window_s=2)
    quotas = Quotas(rpm=3)
    for i in range(3):
        await limiter.admit("ten_a", quotas, request_id=f"r{i}", tokens=0)
    exc = await refused(limiter, quotas)
    wait_s = exc.state.reset_requests_s
    assert wait_s is not None and 2.0 < wait_s <= 3.0
    assert exc.retry_after_s == 3  # all three were admitted in the same second
    refused_at = time.monotonic()
    await asyncio.sleep(wait_s - 0.5)
    # (Skipped when this machine was too busy to wake up before the reset.)
    if time.monotonic() - refused_at < wait_s - 0.1:
        await refused(limiter, quotas)
    await asyncio.sleep(wait_s - (time.monotonic() - refused_at) + 0.1)
    admitted = [
        await limiter.admit("ten_a", quotas, request_id=f"s{i}", tokens=0) for i in range(3)
    ]
    assert [a.state.remaining_requests for a in admitted] == [2, 1, 0]
    await refused(limiter, quotas)


async def test_tenants_do_not_share_limits(make: MakeLimiter) -> None:
    limiter = make()
    quotas = Quotas(rpm=1)
    await limiter.admit("ten_a", quotas, request_id="a", tokens=0)
    await refused(limiter, quotas, tenant="ten_a")
    b = await limiter.admit("ten_b", quotas, request_id="b", tokens=0)
    assert b.state.remaining_requests == 0


# ------------------------------------------------------------------ tpm


async def test_tpm_reserve_and_settle(make: MakeLimiter) -> None:
    one, other = make(), make()
    quotas = Quotas(tpm=100)
    a = await one.admit("ten_a", quotas, request_id="a", tokens=60)
    assert (a.state.limit_tokens, a.state.remaining_tokens) == (100, 40)
    assert a.state.limit_requests is None
    exc = await refused(other, quotas, tokens=50)
    assert (exc.reason, exc.code, exc.should_retry, exc.error_type) == (
        "tpm",
        "rate_limit_exceeded",
        True,
        "tokens",
    )
    assert "tokens per min (TPM): Limit 100, Used 60, Requested 50." in exc.message
    assert exc.state.remaining_tokens == 40
    assert exc.headers()["x-ratelimit-remaining-tokens"] == "40"

    await one.settle(a, used_tokens=20)  # frees 40
    b = await other.admit("ten_a", quotas, request_id="b", tokens=50)
    assert b.state.remaining_tokens == 30
    await one.settle(a, used_tokens=0)  # a second settle does nothing
    c = await other.admit("ten_a", quotas, request_id="c", tokens=30)
    assert c.state.remaining_tokens == 0
    await refused(one, quotas, tokens=1)


async def test_tpm_settle_above_the_reservation_counts_the_excess(make: MakeLimiter) -> None:
    limiter = make()
    quotas = Quotas(tpm=100)
    a = await limiter.admit("ten_a", quotas, request_id="a", tokens=10)
    await limiter.settle(a, used_tokens=30)
    b = await limiter.admit("ten_a", quotas, request_id="b", tokens=70)
    assert b.state.remaining_tokens == 0


async def test_request_larger_than_tpm_is_not_worth_retrying(make: MakeLimiter) -> None:
    limiter = make()
    exc = await refused(limiter, Quotas(tpm=100), tokens=101)
    assert (exc.reason, exc.code, exc.should_retry) == ("tpm", "rate_limit_exceeded", False)
    assert exc.message.startswith(
        "Request too large for tokens per min (TPM): Limit 100, Requested 101."
    )
    assert exc.headers()["x-should-retry"] == "false"
    assert exc.state.remaining_tokens == 100


# ------------------------------------------------------------------ concurrency


async def test_concurrency_leases(make: MakeLimiter) -> None:
    one, other = make(lease_ttl_s=30), make(lease_ttl_s=30)
    quotas = Quotas(max_concurrency=2)
    a = await one.admit("ten_a", quotas, request_id="a", tokens=0)
    await other.admit("ten_a", quotas, request_id="b", tokens=0)
    exc = await refused(one, quotas)
    assert (exc.reason, exc.code, exc.should_retry, exc.retry_after_s) == (
        "concurrency",
        "rate_limit_exceeded",
        True,
        1,
    )
    assert exc.message == (
        "Too many concurrent requests: Limit 2, Running 2. "
        "Please try again when one of them has finished."
    )
    assert exc.headers() == {"retry-after": "1"}  # no rpm/tpm: no x-ratelimit-* headers
    await one.settle(a, used_tokens=0)
    await other.admit("ten_a", quotas, request_id="c", tokens=0)
    await refused(other, quotas)


async def test_unsettled_lease_expires_and_renewed_lease_lives(make: MakeLimiter) -> None:
    one, other = make(lease_ttl_s=1.0), make(lease_ttl_s=1.0)
    quotas = Quotas(max_concurrency=2)
    # Two requests killed before they could settle: their slots come back by expiry.
    await one.admit("ten_a", quotas, request_id="killed_1", tokens=0)
    await other.admit("ten_a", quotas, request_id="killed_2", tokens=0)
    await refused(one, quotas)
    await asyncio.sleep(1.1)
    running = await one.admit("ten_a", quotas, request_id="running", tokens=0)
    await other.admit("ten_a", quotas, request_id="killed_3", tokens=0)
    await refused(other, quotas)

    async def keep_renewing() -> None:
        while True:
            await asyncio.sleep(0.25)
            await one.renew(running)

    renewer = asyncio.create_task(keep_renewing())
    try:
        await asyncio.sleep(1.5)  # past the ttl of both; only `running` was renewed
        await other.admit("ten_a", quotas, request_id="next", tokens=0)
        await refused(other, quotas)
    finally:
        renewer.cancel()
    # A renewal after the settle does not bring the lease back.
    await one.settle(running, used_tokens=0)
    await one.renew(running)
    await one.admit("ten_a", quotas, request_id="after", tokens=0)


# ------------------------------------------------------------------ monthly


async def test_monthly_quota_exhaustion(make: MakeLimiter) -> None:
    one, other = make(), make()
    quotas = Quotas(monthly_tokens=100)
    a = await one.admit("ten_a", quotas, request_id="a", tokens=60)
    assert a.state == LimitState(None, None, None, None, None, None)
    await one.settle(a, used_tokens=50)
    await other.admit("ten_a", quotas, request_id="b", tokens=50)
    exc = await refused(one, quotas, tokens=1)
    now = time.time()
    assert (exc.reason, exc.code, exc.should_retry, exc.error_type) == (
        "monthly_tokens",
        "insufficient_quota",
        False,
        "insufficient_quota",
    )
    month_end = next_month_start(now)
    assert abs(exc.retry_after_s - (month_end - now)) <= 2
    resets = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(month_end))
    assert exc.message == (
        "You exceeded your current quota: monthly token limit 100, used 100, requested 1. "
        f"The quota resets at {resets}."
    )
    assert exc.headers() == {"retry-after": str(exc.retry_after_s), "x-should-retry": "false"}


# ------------------------------------------------------------------ atomicity


async def test_a_refused_request_takes_nothing(make: MakeLimiter) -> None:
    limiter = make()
    quotas = Quotas(rpm=10, tpm=100, max_concurrency=1, monthly_tokens=1000)
    a = await limiter.admit("ten_a", quotas, request_id="a", tokens=10)
    assert (a.state.remaining_requests, a.state.remaining_tokens) == (9, 90)

    # Refused by concurrency: no request, no tokens, no monthly tokens taken.
    exc = await refused(limiter, quotas, tokens=50)
    assert exc.reason == "concurrency"
    assert (exc.state.remaining_requests, exc.state.remaining_tokens) == (9, 90)
    await limiter.settle(a, used_tokens=10)

    # Refused by tpm: no request counted, no lease taken.
    exc = await refused(limiter, quotas, tokens=91)
    assert exc.reason == "tpm"
    assert (exc.state.remaining_requests, exc.state.remaining_tokens) == (9, 90)
    b = await limiter.admit("ten_a", quotas, request_id="b", tokens=90)
    assert (b.state.remaining_requests, b.state.remaining_tokens) == (8, 0)
    await limiter.settle(b, used_tokens=0)

    # Refused by monthly_tokens: 10 used, 990 left; tpm has room for 90.
    exc = await refused(limiter, Quotas(rpm=10, tpm=2000, monthly_tokens=1000), tokens=991)
    assert exc.reason == "monthly_tokens"
    assert exc.state.remaining_requests == 8
    # Exactly what is left this month still fits: nothing above was counted.
    c = await limiter.admit("ten_a", Quotas(monthly_tokens=1000), request_id="c", tokens=990)
    await limiter.settle(c, used_tokens=0)

    # Refused by rpm: no tokens, no lease, no monthly tokens.
    small = Quotas(rpm=2, tpm=100, max_concurrency=1, monthly_tokens=1000)
    exc = await refused(limiter, small, tokens=5)
    assert exc.reason == "rpm"
    assert (exc.state.remaining_requests, exc.state.remaining_tokens) == (0, 90)
    d = await limiter.admit("ten_a", Quotas(max_concurrency=1), request_id="d", tokens=0)
    await limiter.settle(d, used_tokens=0)
    e = await limiter.admit("ten_a", Quotas(monthly_tokens=1000), request_id="e", tokens=990)
    assert e.month is not None


# ------------------------------------------------------------------ unlimited


async def test_unlimited_tenant_gets_a_free_admission(make: MakeLimiter) -> None:
    limiter = make()
    quotas = Quotas(max_tokens=100, max_context_tokens=1000, max_adapters=3)
    a = await limiter.admit("ten_a", quotas, request_id="a", tokens=10**9)
    assert a.backend == "none"
    assert a.state.headers() == {}
    await limiter.renew(a)
    await limiter.settle(a, used_tokens=5)
    assert a.settled


async def test_concurrent_settles_release_once(make: MakeLimiter) -> None:
    limiter = make()
    quotas = Quotas(tpm=100, max_concurrency=1)
    a = await limiter.admit("ten_a", quotas, request_id="a", tokens=50)
    await asyncio.gather(*(limiter.settle(a, used_tokens=10) for _ in range(5)))
    b = await limiter.admit("ten_a", quotas, request_id="b", tokens=90)
    assert b.state.remaining_tokens == 0
