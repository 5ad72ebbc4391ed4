"""The limiter a deployment gets: Redis behind a failure mode, or in-process."""

from __future__ import annotations

from collections.abc import Callable

from app.quotas.base import DEFAULT_PREFIX, DEFAULT_WINDOW_S, QuotaLimiter
from app.quotas.failover import FailoverLimiter, FailureMode
from app.quotas.memory import InMemoryLimiter
from app.quotas.redis_limiter import DEFAULT_TIMEOUT_S, RedisLimiter


def make_limiter(
    redis_url: str | None,
    *,
    mode: FailureMode,
    lease_ttl_s: float,
    on_fail_open: Callable[[str], None] | None = None,
    prefix: str = DEFAULT_PREFIX,
    window_s: int = DEFAULT_WINDOW_S,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backoff_s: float = 1.0,
) -> QuotaLimiter:
    """Redis (shared by every replica) when `redis_url` is set, else this process alone
    (`mode` then has nothing to fail over from). `on_fail_open(tenant_id)` is called for
    every request admitted without Redis in mode "open" (for a metric). Connects lazily:
    nothing is sent to Redis before the first limited request or `ping()`."""
    if not redis_url:
        return InMemoryLimiter(lease_ttl_s=lease_ttl_s, window_s=window_s)
    primary = RedisLimiter.from_url(
        redis_url, lease_ttl_s=lease_ttl_s, window_s=window_s, prefix=prefix, timeout_s=timeout_s
    )
    return FailoverLimiter(primary, mode=mode, on_fail_open=on_fail_open, backoff_s=backoff_s)
