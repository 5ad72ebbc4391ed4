"""Tenant rate limits and quotas: the limiter interface and the values it hands out.

Limits per tenant (each optional, see `Quotas`): `rpm` and `tpm` over a sliding window,
`max_concurrency` as expiring leases, `monthly_tokens` per UTC calendar month.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal, Protocol

from app.core.principal import Quotas

Reason = Literal["rpm", "tpm", "concurrency", "monthly_tokens"]
Backend = Literal["none", "memory", "redis"]

DEFAULT_WINDOW_S = 60
DEFAULT_PREFIX = "loraplex:"


def is_unlimited(quotas: Quotas) -> bool:
    """True when none of the limits a limiter enforces is set (the request costs nothing)."""
    return (
        quotas.rpm is None
        and quotas.tpm is None
        and quotas.max_concurrency is None
        and quotas.monthly_tokens is None
    )


def format_duration(seconds: float) -> str:
    """A duration as OpenAI's x-ratelimit-reset-* headers write it: "20ms", "1s", "6m0s",
    "1m26.4s", "1h0m0s" (Go's time.Duration format at millisecond precision)."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs, frac = divmod(rest, 1000)
    sec_text = f"{secs}.{frac:03d}".rstrip("0") if frac else str(secs)
    if hours:
        return f"{hours}h{minutes}m{sec_text}s"
    if minutes:
        return f"{minutes}m{sec_text}s"
    return f"{sec_text}s"


def month_of(unix_s: float) -> str:
    """The UTC calendar month ("YYYY-MM") a moment falls in."""
    return datetime.fromtimestamp(unix_s, UTC).strftime("%Y-%m")


def next_month_start(unix_s: float) -> float:
    """Unix time of the first instant of the UTC month after the one `unix_s` falls in."""
    now = datetime.fromtimestamp(unix_s, UTC)
    year, month = (now.year + 1, 1) if now.month == 12 else (now.year, now.month + 1)
    return datetime(year, month, 1, tzinfo=UTC).timestamp()


@dataclass(frozen=True, slots=True)
class LimitState:
    """What the x-ratelimit-* headers say; None fields: no such limit."""

    limit_requests: int | None
    remaining_requests: int | None
    reset_requests_s: float | None  # until every request in the window has slid out
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_tokens_s: float | None

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.limit_requests is not None:
            out["x-ratelimit-limit-requests"] = str(self.limit_requests)
            out["x-ratelimit-remaining-requests"] = str(max(0, self.remaining_requests or 0))
            out["x-ratelimit-reset-requests"] = format_duration(self.reset_requests_s or 0.0)
        if self.limit_tokens is not None:
            out["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            out["x-ratelimit-remaining-tokens"] = str(max(0, self.remaining_tokens or 0))
            out["x-ratelimit-reset-tokens"] = format_duration(self.reset_tokens_s or 0.0)
        return out


UNLIMITED_STATE = LimitState(None, None, None, None, None, None)


class QuotaExceeded(Exception):
    """A request refused by one of the tenant's limits (HTTP 429)."""

    def __init__(
        self,
        reason: Reason,
        message: str,
        *,
        retry_after_s: int,
        state: LimitState,
        should_retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.reason: Reason = reason
        self.message = message
        self.code = "insufficient_quota" if reason == "monthly_tokens" else "rate_limit_exceeded"
        self.retry_after_s = max(1, retry_after_s)
        self.should_retry = reason != "monthly_tokens" if should_retry is None else should_retry
        self.state = state

    @property
    def error_type(self) -> str:
        """OpenAI's `type` for this refusal ("requests", "tokens" or "insufficient_quota")."""
        if self.reason == "monthly_tokens":
            return "insufficient_quota"
        return "tokens" if self.reason == "tpm" else "requests"

    def headers(self) -> dict[str, str]:
        """Every header a 429 for this refusal carries."""
        out = self.state.headers()
        out["retry-after"] = str(self.retry_after_s)
        if not self.should_retry:
            out["x-should-retry"] = "false"
        return out


class QuotaUnavailable(Exception):
    """The limits cannot be checked (the shared backend is down, fail-closed mode): 503."""

    def __init__(self, message: str = "Rate limiting is temporarily unavailable.") -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = 1


@dataclass(slots=True)
class Admission:
    """An admitted request; the caller renews and settles it with the limiter that made it."""

    tenant_id: str
    request_id: str
    state: LimitState  # for the response headers
    backend: Backend = "none"  # which store holds the reservation
    # Tokens reserved against `tpm` (in second `tpm_bucket`) and `monthly_tokens`
    # (in `month`); None where that limit does not apply.
    reserved_tokens: int = 0
    tpm_bucket: int | None = None
    month: str | None = None
    lease_id: str | None = None  # the concurrency lease
    settled: bool = field(default=False)


class QuotaLimiter(Protocol):
    async def admit(
        self, tenant_id: str, quotas: Quotas, *, request_id: str, tokens: int
    ) -> Admission:
        """Check every limit and take from all of them, or from none: raises QuotaExceeded
        (or QuotaUnavailable). `tokens` is what the request may use (prompt + max_tokens)."""
        ...

    async def renew(self, admission: Admission) -> None:
        """Keep the concurrency lease of a running request (call every lease_ttl_s / 3)."""
        ...

    async def settle(self, admission: Admission, *, used_tokens: int) -> None:
        """The request ended: replace the reservation with the real use, free the lease.
        A second call does nothing."""
        ...

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...


# ------------------------------------------------------------------ refusal messages


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a limiter refused a request, in the terms its message needs."""

    reason: Reason
    limit: int
    used: int  # in the window / running / this month, before this request
    requested: int
    retry_after_ms: int  # -1: the request can never fit this limit
    month_end_s: float = 0.0  # monthly_tokens: when the next month starts (unix s)


def quota_exceeded(refusal: Refusal, state: LimitState) -> QuotaExceeded:
    r = refusal
    retry_s = max(1, math.ceil(r.retry_after_ms / 1000))
    if r.reason == "monthly_tokens":
        resets = datetime.fromtimestamp(r.month_end_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        message = (
            f"You exceeded your current quota: monthly token limit {r.limit}, used {r.used}, "
            f"requested {r.requested}. The quota resets at {resets}."
        )
        return QuotaExceeded(r.reason, message, retry_after_s=retry_s, state=state)
    if r.reason == "concurrency":
        message = (
            f"Too many concurrent requests: Limit {r.limit}, Running {r.used}. "
            "Please try again when one of them has finished."
        )
        return QuotaExceeded(r.reason, message, retry_after_s=retry_s, state=state)
    if r.retry_after_ms < 0:
        # NOTE: larger than the whole per-minute budget: retrying cannot help, so the
        # client is told not to (x-should-retry: false) rather than to wait a minute.
        message = (
            f"Request too large for tokens per min (TPM): Limit {r.limit}, Requested "
            f"{r.requested}. The input or output tokens must be reduced in order to run "
            "successfully."
        )
        return QuotaExceeded(
            r.reason, message, retry_after_s=DEFAULT_WINDOW_S, state=state, should_retry=False
        )
    unit = "requests per min (RPM)" if r.reason == "rpm" else "tokens per min (TPM)"
    message = (
        f"Rate limit reached for {unit}: Limit {r.limit}, Used {r.used}, Requested "
        f"{r.requested}. Please try again in {format_duration(r.retry_after_ms / 1000)}."
    )
    return QuotaExceeded(r.reason, message, retry_after_s=retry_s, state=state)
