"""What a Redis failure means for admission: fail-open within per-process limits, or
fail-closed (503)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

from redis.exceptions import RedisError

from app.core.principal import Quotas
from app.quotas.base import (
    UNLIMITED_STATE,
    Admission,
    QuotaExceeded,
    QuotaUnavailable,
    is_unlimited,
)
from app.quotas.memory import InMemoryLimiter
from app.quotas.redis_limiter import RedisLimiter

logger = logging.getLogger(__name__)

FailureMode = Literal["open", "closed"]
# Everything a dead, hung or misbehaving Redis raises (timeouts are OSErrors).
_BACKEND_ERRORS = (RedisError, OSError)


class FailoverLimiter:
    """Admits through Redis while it answers. After a failure, Redis is left alone for
    `backoff_s`, then one request probes it again; until it answers, mode "open" admits
    through per-process limits (calling `on_fail_open(tenant_id)` for each such request)
    and mode "closed" raises QuotaUnavailable. Renewals and settles go to the store that
    admitted the request."""

    def __init__(
        self,
        primary: RedisLimiter,
        *,
        mode: FailureMode,
        on_fail_open: Callable[[str], None] | None = None,
        backoff_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.primary = primary
        self.mode: FailureMode = mode
        # The same window and lease ttl as Redis: the same limits, per process.
        self.fallback = InMemoryLimiter(
            lease_ttl_s=primary.lease_ttl_ms / 1000, window_s=primary.window_s
        )
        self.on_fail_open = on_fail_open
        self.backoff_s = backoff_s
        self._clock = clock
        self._down = False
        self._retry_at = 0.0
        # Requests decided without Redis (admitted locally, or refused with 503), and
        # Redis calls that failed (admissions, renewals and settles).
        self.fallbacks = 0
        self.failures = 0

    @property
    def redis_up(self) -> bool:
        """False from a failed Redis call until the next one that succeeds."""
        return not self._down

    async def admit(
        self, tenant_id: str, quotas: Quotas, *, request_id: str, tokens: int
    ) -> Admission:
        if is_unlimited(quotas):
            return Admission(tenant_id, request_id, UNLIMITED_STATE)
        if self._down:
            now = self._clock()
            if now < self._retry_at:
                return await self._fall_back(tenant_id, quotas, request_id, tokens)
            # NOTE: this request probes Redis; the others keep falling back meanwhile, so
            # a hung Redis costs one timeout per backoff period, not one per request.
            self._retry_at = now + self.backoff_s
        try:
            admission = await self.primary.admit(
                tenant_id, quotas, request_id=request_id, tokens=tokens
            )
        except _BACKEND_ERRORS as exc:
            self._failed("admit", exc)
            return await self._fall_back(tenant_id, quotas, request_id, tokens)
        except QuotaExceeded:
            self._up()  # Redis answered
            raise
        self._up()
        return admission

    async def _fall_back(
        self, tenant_id: str, quotas: Quotas, request_id: str, tokens: int
    ) -> Admission:
        self.fallbacks += 1
        if self.mode == "closed":
            raise QuotaUnavailable()
        if self.on_fail_open is not None:
            try:
                self.on_fail_open(tenant_id)
            except Exception:
                logger.exception("on_fail_open callback failed")
        return await self.fallback.admit(tenant_id, quotas, request_id=request_id, tokens=tokens)

    def _failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        if not self._down:
            logger.warning(
                "Redis %s failed (%s: %s); limits are now %s until it answers again",
                what,
                type(exc).__name__,
                exc,
                "per process" if self.mode == "open" else "refused (503)",
            )
        self._down = True
        self._retry_at = self._clock() + self.backoff_s

    def _up(self) -> None:
        if self._down:
            logger.warning("Redis answers again; limits are shared again")
        self._down = False

    async def renew(self, admission: Admission) -> None:
        if admission.backend == "memory":
            await self.fallback.renew(admission)
        elif admission.backend == "redis":
            if self._down and self._clock() < self._retry_at:
                return  # the next renewal (a third of the ttl later) tries again
            try:
                await self.primary.renew(admission)
            except _BACKEND_ERRORS as exc:
                self._failed("renew", exc)

    async def settle(self, admission: Admission, *, used_tokens: int) -> None:
        if admission.backend == "memory":
            await self.fallback.settle(admission, used_tokens=used_tokens)
        elif admission.backend == "redis":
            try:
                await self.primary.settle(admission, used_tokens=used_tokens)
            except _BACKEND_ERRORS as exc:
                # The lease frees itself by expiry; the reservation stays counted until
                # it leaves the window (and this month's counter keeps the reservation).
                self._failed("settle", exc)
        else:
            admission.settled = True

    async def ping(self) -> bool:
        return await self.primary.ping()

    async def close(self) -> None:
        await self.primary.close()
        await self.fallback.close()
