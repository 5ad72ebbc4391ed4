"""Limits shared by every replica: one atomic Lua script per admission on Redis."""

from __future__ import annotations

import logging
import secrets
from typing import Any, cast

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from app.core.config import DEFAULT_QUOTA_REDIS_TIMEOUT_S
from app.core.principal import Quotas
from app.quotas import lua
from app.quotas.base import (
    DEFAULT_PREFIX,
    DEFAULT_WINDOW_S,
    UNLIMITED_STATE,
    Admission,
    LimitState,
    Reason,
    Refusal,
    is_unlimited,
    quota_exceeded,
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = DEFAULT_QUOTA_REDIS_TIMEOUT_S
# The pool's cap: a burst of admissions and settles opens up to this many connections,
# which stay open for the next burst.
DEFAULT_MAX_CONNECTIONS = 64


def _limit(value: int | None) -> int:
    return -1 if value is None else value


class RedisLimiter:
    """Raises redis.exceptions.RedisError (or OSError) when Redis fails: wrap it in a
    `FailoverLimiter` to decide what a failure means."""

    def __init__(
        self,
        client: Redis,
        *,
        lease_ttl_s: float,
        window_s: int = DEFAULT_WINDOW_S,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        assert lease_ttl_s > 0 and window_s > 0
        self.client = client
        self.lease_ttl_ms = max(1, round(lease_ttl_s * 1000))
        self.window_s = window_s
        self.prefix = prefix
        # EVALSHA, and SCRIPT LOAD once per server that answers NOSCRIPT (restart, flush).
        self._admit = client.register_script(lua.ADMIT)
        self._renew = client.register_script(lua.RENEW)
        self._settle = client.register_script(lua.SETTLE)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        lease_ttl_s: float,
        window_s: int = DEFAULT_WINDOW_S,
        prefix: str = DEFAULT_PREFIX,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> RedisLimiter:
        # NOTE: short timeouts and no retry after a timeout: a dead or hung Redis must cost
        # a request at most `timeout_s` before the failure mode decides, not seconds. A
        # burst above `max_connections` waits for a free connection (up to `timeout_s`)
        # rather than failing at once, which the failure mode would take for an outage.
        # NOTE: one retry, on a new connection, for a connection error only: after Redis
        # restarts, every pooled connection is dead and fails its next command. Without
        # the retry each of them failed one admission or settle after Redis was back:
        # a settle's lease then stayed until its ttl (a max_concurrency=1 tenant locked
        # out for it) and the failure put limits back in failure mode for a backoff. A
        # dead Redis refuses both attempts at once; a hung one (a timeout) is not retried.
        pool = BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            decode_responses=True,
        )
        client = Redis.from_pool(pool)
        return cls(client, lease_ttl_s=lease_ttl_s, window_s=window_s, prefix=prefix)

    def keys(self, tenant_id: str) -> list[str]:
        """rpm, tpm, leases and monthly keys of a tenant (one cluster slot: `{tenant}`)."""
        assert "{" not in tenant_id and "}" not in tenant_id, tenant_id
        base = f"{self.prefix}{{{tenant_id}}}:"
        return [base + "rpm", base + "tpm", base + "leases", base + "monthly"]

    async def admit(
        self, tenant_id: str, quotas: Quotas, *, request_id: str, tokens: int
    ) -> Admission:
        if is_unlimited(quotas):
            return Admission(tenant_id, request_id, UNLIMITED_STATE)
        assert tokens >= 0
        q = quotas
        lease_id = f"{request_id}:{secrets.token_hex(4)}" if q.max_concurrency is not None else ""
        args: list[str | int] = [
            _limit(q.rpm),
            _limit(q.tpm),
            _limit(q.max_concurrency),
            _limit(q.monthly_tokens),
            tokens,
            lease_id,
            self.lease_ttl_ms,
            self.window_s,
        ]
        out = cast(list[Any], await self._admit(keys=self.keys(tenant_id), args=args))
        (reason, now_s, rpm_used, rpm_reset, tpm_used, tpm_reset, limit, used, need, retry,
         month, month_end) = out  # fmt: skip
        state = LimitState(
            limit_requests=q.rpm,
            remaining_requests=max(0, q.rpm - int(rpm_used)) if q.rpm is not None else None,
            reset_requests_s=int(rpm_reset) / 1000 if q.rpm is not None else None,
            limit_tokens=q.tpm,
            remaining_tokens=max(0, q.tpm - int(tpm_used)) if q.tpm is not None else None,
            reset_tokens_s=int(tpm_reset) / 1000 if q.tpm is not None else None,
        )
        if reason:
            refusal = Refusal(
                cast(Reason, reason),
                limit=int(limit),
                used=int(used),
                requested=int(need),
                retry_after_ms=int(retry),
                month_end_s=int(month_end) / 1000,
            )
            raise quota_exceeded(refusal, state)
        return Admission(
            tenant_id,
            request_id,
            state,
            backend="redis",
            reserved_tokens=tokens,
            tpm_bucket=int(now_s) if q.tpm is not None else None,
            month=month or None,
            lease_id=lease_id or None,
        )

    async def renew(self, admission: Admission) -> None:
        if admission.lease_id is None or admission.settled:
            return
        key = self.keys(admission.tenant_id)[2]
        renewed = await self._renew(keys=[key], args=[admission.lease_id, self.lease_ttl_ms])
        if not renewed:
            logger.warning(
                "concurrency lease of request %s had expired before its renewal "
                "(lease_ttl_s too short for how often it is renewed?)",
                admission.request_id,
            )

    async def settle(self, admission: Admission, *, used_tokens: int) -> None:
        if admission.settled:
            return
        admission.settled = True
        if admission.backend == "none":
            return
        assert admission.backend == "redis", "settle an admission with the limiter that made it"
        _, tpm_key, leases_key, monthly_key = self.keys(admission.tenant_id)
        bucket = "" if admission.tpm_bucket is None else str(admission.tpm_bucket)
        args: list[str | int] = [
            bucket,
            used_tokens - admission.reserved_tokens,
            admission.lease_id or "",
            admission.month or "",
        ]
        await self._settle(keys=[tpm_key, leases_key, monthly_key], args=args)

    async def ping(self) -> bool:
        try:
            return bool(await self.client.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        await self.client.aclose()
