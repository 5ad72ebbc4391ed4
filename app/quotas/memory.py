"""The limits of one process: the only store without REDIS_URL, and the per-process bound
when Redis fails in fail-open mode. Same semantics as the Lua scripts in `lua.py`."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from app.core.principal import Quotas
from app.quotas.base import (
    DEFAULT_WINDOW_S,
    UNLIMITED_STATE,
    Admission,
    LimitState,
    Refusal,
    is_unlimited,
    month_of,
    next_month_start,
    quota_exceeded,
)


class _Window:
    """Counts per second over a sliding window. NOTE: a count made in second b counts
    until b + window + 1, so any `window` seconds contain at most the limit (the window is
    up to one second longer than nominal, never shorter)."""

    __slots__ = ("buckets",)

    def __init__(self) -> None:
        self.buckets: dict[int, int] = {}

    def prune(self, now_s: int, window_s: int) -> int:
        """Drop the seconds that slid out; the total of the rest."""
        oldest = now_s - window_s
        for sec in [b for b in self.buckets if b < oldest]:
            del self.buckets[sec]
        return sum(self.buckets.values())

    def add(self, sec: int, amount: int) -> None:
        self.buckets[sec] = self.buckets.get(sec, 0) + amount

    def adjust(self, sec: int, delta: int) -> None:
        """Correct a past count, if its second is still in the window."""
        if sec in self.buckets:
            self.buckets[sec] = max(0, self.buckets[sec] + delta)

    def reset_ms(self, now_ms: int, window_s: int) -> int:
        """Milliseconds until every count has slid out."""
        live = [b for b, n in self.buckets.items() if n > 0]
        return max(0, (max(live) + window_s + 1) * 1000 - now_ms) if live else 0

    def retry_ms(self, now_ms: int, window_s: int, total: int, need: int, limit: int) -> int:
        """Milliseconds until `need` more fits under `limit` (0: now; -1: never)."""
        if total + need <= limit:
            return 0
        if need > limit:
            return -1
        freed = 0
        for sec in sorted(self.buckets):
            freed += self.buckets[sec]
            if total - freed + need <= limit:
                return max(0, (sec + window_s + 1) * 1000 - now_ms)
        raise AssertionError("unreachable: need <= limit frees up once every count is out")


@dataclass(slots=True)
class _Tenant:
    rpm: _Window = field(default_factory=_Window)
    tpm: _Window = field(default_factory=_Window)
    leases: dict[str, int] = field(default_factory=dict)  # lease id -> expiry (unix ms)
    monthly: dict[str, int] = field(default_factory=dict)  # "YYYY-MM" -> tokens

    def idle(self) -> bool:
        return not (self.rpm.buckets or self.tpm.buckets or self.leases or self.monthly)


class InMemoryLimiter:
    """Per-process limits, safe from any task or thread (decisions are made under a lock
    and never await)."""

    def __init__(
        self,
        *,
        lease_ttl_s: float,
        window_s: int = DEFAULT_WINDOW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        assert lease_ttl_s > 0 and window_s > 0
        self.lease_ttl_ms = max(1, round(lease_ttl_s * 1000))
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._tenants: dict[str, _Tenant] = {}
        self._next_sweep_ms = 0

    async def admit(
        self, tenant_id: str, quotas: Quotas, *, request_id: str, tokens: int
    ) -> Admission:
        if is_unlimited(quotas):
            return Admission(tenant_id, request_id, UNLIMITED_STATE)
        assert tokens >= 0
        with self._lock:
            return self._admit(tenant_id, quotas, request_id, tokens)

    def _admit(self, tenant_id: str, q: Quotas, request_id: str, tokens: int) -> Admission:
        now = self._clock()
        now_ms = int(now * 1000)
        now_s, w = now_ms // 1000, self.window_s
        self._sweep(now_ms)
        t = self._tenants.setdefault(tenant_id, _Tenant())
        rpm_used = t.rpm.prune(now_s, w)
        tpm_used = t.tpm.prune(now_s, w)
        for lease in [k for k, exp in t.leases.items() if exp <= now_ms]:
            del t.leases[lease]
        month = month_of(now)
        for old in [m for m in t.monthly if m != month]:
            del t.monthly[old]
        month_used = t.monthly.get(month, 0)

        refusal: Refusal | None = None
        if q.monthly_tokens is not None and month_used + tokens > q.monthly_tokens:
            end = next_month_start(now)
            retry = max(0, int(end * 1000) - now_ms)
            refusal = Refusal("monthly_tokens", q.monthly_tokens, month_used, tokens, retry, end)
        elif q.tpm is not None and tokens > q.tpm:
            refusal = Refusal("tpm", q.tpm, tpm_used, tokens, -1)
        elif q.rpm is not None and rpm_used + 1 > q.rpm:
            retry = t.rpm.retry_ms(now_ms, w, rpm_used, 1, q.rpm)
            refusal = Refusal("rpm", q.rpm, rpm_used, 1, retry)
        elif q.tpm is not None and tpm_used + tokens > q.tpm:
            retry = t.tpm.retry_ms(now_ms, w, tpm_used, tokens, q.tpm)
            refusal = Refusal("tpm", q.tpm, tpm_used, tokens, retry)
        elif q.max_concurrency is not None and len(t.leases) >= q.max_concurrency:
            refusal = Refusal("concurrency", q.max_concurrency, len(t.leases), 1, 1000)
        if refusal is not None:
            raise quota_exceeded(refusal, self._state(t, q, now_ms, rpm_used, tpm_used))

        admission = Admission(tenant_id, request_id, UNLIMITED_STATE, backend="memory")
        admission.reserved_tokens = tokens
        if q.rpm is not None:
            t.rpm.add(now_s, 1)
            rpm_used += 1
        if q.tpm is not None:
            t.tpm.add(now_s, tokens)
            tpm_used += tokens
            admission.tpm_bucket = now_s
        if q.max_concurrency is not None:
            admission.lease_id = f"{request_id}:{secrets.token_hex(4)}"
            t.leases[admission.lease_id] = now_ms + self.lease_ttl_ms
        if q.monthly_tokens is not None:
            t.monthly[month] = month_used + tokens
            admission.month = month
        admission.state = self._state(t, q, now_ms, rpm_used, tpm_used)
        return admission

    def _state(
        self, t: _Tenant, q: Quotas, now_ms: int, rpm_used: int, tpm_used: int
    ) -> LimitState:
        w = self.window_s
        rpm_on, tpm_on = q.rpm is not None, q.tpm is not None
        return LimitState(
            limit_requests=q.rpm,
            remaining_requests=max(0, q.rpm - rpm_used) if q.rpm is not None else None,
            reset_requests_s=t.rpm.reset_ms(now_ms, w) / 1000 if rpm_on else None,
            limit_tokens=q.tpm,
            remaining_tokens=max(0, q.tpm - tpm_used) if q.tpm is not None else None,
            reset_tokens_s=t.tpm.reset_ms(now_ms, w) / 1000 if tpm_on else None,
        )

    def _sweep(self, now_ms: int) -> None:
        """Forget tenants that left nothing in any window (bounded memory over time)."""
        if now_ms < self._next_sweep_ms:
            return
        self._next_sweep_ms = now_ms + self.window_s * 1000
        now_s, month = now_ms // 1000, month_of(now_ms / 1000)
        for tenant_id, t in list(self._tenants.items()):
            t.rpm.prune(now_s, self.window_s)
            t.tpm.prune(now_s, self.window_s)
            t.leases = {k: exp for k, exp in t.leases.items() if exp > now_ms}
            t.monthly = {m: n for m, n in t.monthly.items() if m == month}
            if t.idle():
                del self._tenants[tenant_id]

    async def renew(self, admission: Admission) -> None:
        if admission.lease_id is None or admission.settled:
            return
        with self._lock:
            t = self._tenants.get(admission.tenant_id)
            # NOTE: a lease that is already gone stays gone: renewing it could race with
            # its settle and leave a slot taken until the lease expires.
            if t is not None and admission.lease_id in t.leases:
                t.leases[admission.lease_id] = int(self._clock() * 1000) + self.lease_ttl_ms

    async def settle(self, admission: Admission, *, used_tokens: int) -> None:
        if admission.settled:
            return
        admission.settled = True
        with self._lock:
            t = self._tenants.get(admission.tenant_id)
            if t is None:
                return
            delta = used_tokens - admission.reserved_tokens
            if admission.tpm_bucket is not None and delta:
                t.tpm.adjust(admission.tpm_bucket, delta)
            if admission.lease_id is not None:
                t.leases.pop(admission.lease_id, None)
            if admission.month is not None and delta and admission.month in t.monthly:
                t.monthly[admission.month] = max(0, t.monthly[admission.month] + delta)

    def seed_monthly(self, tenant_id: str, used_tokens: int, *, month: str | None = None) -> None:
        """Start a tenant's monthly counter at what it already used (e.g. from the usage
        records after a restart: this store forgets everything when the process ends)."""
        month = month or month_of(self._clock())
        with self._lock:
            t = self._tenants.setdefault(tenant_id, _Tenant())
            t.monthly[month] = max(0, used_tokens)

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None
