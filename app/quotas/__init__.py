"""Tenant rate limits and quotas (rpm, tpm, concurrency leases, monthly tokens), shared
through Redis or kept in-process.

Request path::

    admission = await limiter.admit(tenant.id, tenant.quotas, request_id=rid, tokens=n)
    # raises QuotaExceeded (429: .code, .message, .headers()) or QuotaUnavailable (503)
    ... renew(admission) every lease_ttl_s / 3 while it runs ...
    await limiter.settle(admission, used_tokens=used)   # always, also on errors/aborts
    response headers: admission.state.headers()
"""

from app.quotas.base import (
    Admission,
    LimitState,
    QuotaExceeded,
    QuotaLimiter,
    QuotaUnavailable,
    format_duration,
    is_unlimited,
)
from app.quotas.factory import make_limiter
from app.quotas.failover import FailoverLimiter, FailureMode
from app.quotas.memory import InMemoryLimiter
from app.quotas.redis_limiter import RedisLimiter

__all__ = [
    "Admission",
    "FailoverLimiter",
    "FailureMode",
    "InMemoryLimiter",
    "LimitState",
    "QuotaExceeded",
    "QuotaLimiter",
    "QuotaUnavailable",
    "RedisLimiter",
    "format_duration",
    "is_unlimited",
    "make_limiter",
]
