"""The pieces under the quota semantics: header formats, the Lua calendar, Redis key
layout and expiry, script reloading, and the in-process store's clock-driven behaviour."""

from __future__ import annotations

import calendar
from collections.abc import Iterator
from datetime import UTC, date, datetime

import pytest
import redis

from app.core.principal import Quotas
from app.quotas import (
    InMemoryLimiter,
    LimitState,
    QuotaExceeded,
    RedisLimiter,
    format_duration,
    lua,
)
from app.quotas.base import month_of, next_month_start


@pytest.fixture
def sync_redis(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.0004, "1ms"),
        (0.02, "20ms"),
        (0.999, "999ms"),
        (1, "1s"),
        (8.64, "8.64s"),
        (59.5, "59.5s"),
        (60, "1m0s"),
        (86.4, "1m26.4s"),
        (360, "6m0s"),
        (3600, "1h0m0s"),
        (2 * 86400 + 61.25, "48h1m1.25s"),
    ],
)
def test_format_duration_like_openai(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_headers_name_only_the_limits_that_exist() -> None:
    both = LimitState(60, 59, 1.0, 90_000, 89_000, 0.5)
    assert both.headers() == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "90000",
        "x-ratelimit-remaining-tokens": "89000",
        "x-ratelimit-reset-tokens": "500ms",
    }
    assert LimitState(None, None, None, 1000, 0, 61.0).headers() == {
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "1m1s",
    }


def test_month_helpers() -> None:
    dec = datetime(2024, 12, 31, 23, 59, 59, tzinfo=UTC).timestamp()
    assert month_of(dec) == "2024-12"
    assert next_month_start(dec) == datetime(2025, 1, 1, tzinfo=UTC).timestamp()
    feb = datetime(2024, 2, 1, tzinfo=UTC).timestamp()
    assert month_of(feb) == "2024-02"
    assert next_month_start(feb) == datetime(2024, 3, 1, tzinfo=UTC).timestamp()


def test_lua_calendar_matches_python(sync_redis: redis.Redis) -> None:
    """Every first and last day of a month from 1970 to 2200 (leap years and centuries)."""
    days: list[int] = []
    epoch = date(1970, 1, 1)
    for year in range(1970, 2201):
        for month in range(1, 13):
            first = date(year, month, 1)
            last = date(year, month, calendar.monthrange(year, month)[1])
            days += [(first - epoch).days, (last - epoch).days]
    script = (
        lua.CALENDAR
        + """
local out = {}
for i = 1, #ARGV do
  local y, m = civil_month(tonumber(ARGV[i]))
  out[#out + 1] = y * 100 + m
  out[#out + 1] = first_day(y, m)
end
return out
"""
    )
    out = sync_redis.eval(script, 0, *days)
    assert isinstance(out, list)
    for i, day in enumerate(days):
        d = date.fromordinal(epoch.toordinal() + day)
        assert out[2 * i] == d.year * 100 + d.month, d
        assert out[2 * i + 1] == (date(d.year, d.month, 1) - epoch).days, d


async def test_keys_are_namespaced_per_tenant_and_expire(
    redis_url: str, sync_redis: redis.Redis
) -> None:
    limiter = RedisLimiter.from_url(redis_url, lease_ttl_s=2, window_s=5, prefix="acme:")
    quotas = Quotas(rpm=10, tpm=100, max_concurrency=2, monthly_tokens=1000)
    try:
        a = await limiter.admit("ten_x", quotas, request_id="a", tokens=10)
        await limiter.admit("ten_y", quotas, request_id="b", tokens=10)
    finally:
        await limiter.close()
    assert a.month is not None
    assert sorted(sync_redis.keys("*")) == [
        f"acme:{{{t}}}:{name}"
        for t in ("ten_x", "ten_y")
        for name in ("leases", "monthly", "rpm", "tpm")
    ]
    x = "acme:{ten_x}:"
    # A second's count lives window + 1 s; the key a second longer.
    assert 5000 < int(sync_redis.pttl(x + "rpm")) <= 7000
    assert 5000 < int(sync_redis.pttl(x + "tpm")) <= 7000
    assert 2000 < int(sync_redis.pttl(x + "leases")) <= 3000
    # The monthly counter: until a day after the month ends.
    server_now = float(sync_redis.time()[0])
    expected = next_month_start(server_now) + 86400 - server_now
    assert abs(int(sync_redis.pttl(x + "monthly")) / 1000 - expected) < 3
    assert sync_redis.hgetall(x + "monthly") == {month_of(server_now): "10"}
    assert sync_redis.hgetall(x + "rpm") == {str(a.tpm_bucket): "1"}
    assert sync_redis.hgetall(x + "tpm") == {str(a.tpm_bucket): "10"}
    assert sync_redis.zrange(x + "leases", 0, -1) == [a.lease_id]


async def test_script_reloads_after_noscript(redis_url: str) -> None:
    limiter = RedisLimiter.from_url(redis_url, lease_ttl_s=2)
    try:
        # As after a Redis restart: the server does not know the script's hash.
        limiter._admit.sha = "0" * 40
        a = await limiter.admit("ten_a", Quotas(rpm=3), request_id="a", tokens=0)
        assert a.state.remaining_requests == 2
        assert limiter._admit.sha != "0" * 40
    finally:
        await limiter.close()


# ------------------------------------------------------------------ in-process, fake clock


class Clock:
    def __init__(self, start: datetime) -> None:
        self.now = start.timestamp()

    def __call__(self) -> float:
        return self.now


async def test_memory_month_rolls_over_and_late_settles_stay_in_their_month() -> None:
    clock = Clock(datetime(2025, 1, 31, 23, 59, 0, tzinfo=UTC))
    limiter = InMemoryLimiter(lease_ttl_s=600, clock=clock)
    quotas = Quotas(monthly_tokens=100)
    straddling = await limiter.admit("ten_a", quotas, request_id="a", tokens=100)
    assert straddling.month == "2025-01"
    with pytest.raises(QuotaExceeded) as info:
        await limiter.admit("ten_a", quotas, request_id="b", tokens=1)
    assert info.value.retry_after_s == 60
    assert "resets at 2025-02-01T00:00:00Z" in info.value.message
    clock.now += 61  # February
    feb = await limiter.admit("ten_a", quotas, request_id="c", tokens=90)
    assert feb.month == "2025-02"
    await limiter.settle(straddling, used_tokens=0)  # January's: does not free February's
    with pytest.raises(QuotaExceeded):
        await limiter.admit("ten_a", quotas, request_id="d", tokens=11)
    await limiter.admit("ten_a", quotas, request_id="e", tokens=10)


async def test_memory_sliding_window_by_the_second() -> None:
    clock = Clock(datetime(2025, 3, 1, 12, 0, 0, 500_000, tzinfo=UTC))
    start = clock.now
    limiter = InMemoryLimiter(lease_ttl_s=30, clock=clock)
    quotas = Quotas(rpm=2)
    await limiter.admit("ten_a", quotas, request_id="a", tokens=0)  # second 0
    clock.now = start + 30
    second = await limiter.admit("ten_a", quotas, request_id="b", tokens=0)  # second 30
    assert second.state.reset_requests_s == 60.5
    with pytest.raises(QuotaExceeded) as info:
        await limiter.admit("ten_a", quotas, request_id="c", tokens=0)
    # The first request leaves the window at second 61 (60 s + the rest of its second).
    assert info.value.retry_after_s == 31
    assert info.value.state.reset_requests_s == 60.5
    assert "Please try again in 30.5s." in info.value.message
    clock.now = start + 60.4  # second 60.9: still inside
    with pytest.raises(QuotaExceeded):
        await limiter.admit("ten_a", quotas, request_id="d", tokens=0)
    clock.now = start + 60.5  # second 61.0
    await limiter.admit("ten_a", quotas, request_id="e", tokens=0)


async def test_memory_forgets_idle_tenants_but_not_their_month() -> None:
    clock = Clock(datetime(2025, 3, 10, tzinfo=UTC))
    limiter = InMemoryLimiter(lease_ttl_s=5, clock=clock)
    for i in range(100):
        a = await limiter.admit(f"ten_{i}", Quotas(rpm=5, tpm=10), request_id="r", tokens=1)
        await limiter.settle(a, used_tokens=1)
    await limiter.admit("ten_m", Quotas(monthly_tokens=10), request_id="m", tokens=4)
    assert len(limiter._tenants) == 101
    clock.now += 62
    await limiter.admit("ten_new", Quotas(rpm=1), request_id="n", tokens=0)
    assert sorted(limiter._tenants) == ["ten_m", "ten_new"]
    with pytest.raises(QuotaExceeded):
        await limiter.admit("ten_m", Quotas(monthly_tokens=10), request_id="m2", tokens=7)


async def test_memory_seed_monthly() -> None:
    limiter = InMemoryLimiter(lease_ttl_s=5)
    limiter.seed_monthly("ten_a", 95)
    await limiter.admit("ten_a", Quotas(monthly_tokens=100), request_id="a", tokens=5)
    with pytest.raises(QuotaExceeded) as info:
        await limiter.admit("ten_a", Quotas(monthly_tokens=100), request_id="b", tokens=1)
    assert info.value.code == "insufficient_quota"
