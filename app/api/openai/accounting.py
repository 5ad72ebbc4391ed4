"""A generation request's account: its quota admission, the lease it renews while it
runs, and, exactly once at the end, its settlement, usage record and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from app.api.errors import SERVER_ERROR, APIError
from app.api.openai.choices import ChoiceResult, usage_of
from app.api.openai.plan import GenerationPlan
from app.api.openai.protocol import UsageInfo
from app.api.state import AppState
from app.metering.recorder import UsageEvent
from app.quotas import Admission, QuotaExceeded, QuotaUnavailable
from app.tables import UsageStatus

logger = logging.getLogger(__name__)

# Settlements still talking to Redis; kept so that they are not garbage-collected.
_background: set[asyncio.Task[None]] = set()


def quota_error(exc: QuotaExceeded) -> APIError:
    return APIError(
        429, exc.message, type=exc.error_type, code=exc.code, headers=exc.headers(),
        reason=exc.reason,
    )


@dataclass(slots=True)
class RequestAccount:
    state: AppState
    plan: GenerationPlan
    admission: Admission | None
    renewal: asyncio.Task[None] | None = None
    # When the engine got the request and when its last choice finished (monotonic).
    engine_started: float | None = None
    engine_finished: float | None = None
    closed: bool = field(default=False)

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.admission is None else self.admission.state.headers()

    def close(self, status: UsageStatus, results: Sequence[ChoiceResult]) -> None:
        """Settle the quota, record usage and metrics; only the first call counts.

        Never raises and never awaits: it runs in `finally` blocks of requests whose
        client has gone, while their tasks are being cancelled.
        """
        if self.closed:
            return
        self.closed = True
        if self.renewal is not None:
            self.renewal.cancel()
        try:
            self._record(status, results)
        except Exception:
            logger.exception("could not account for request %s", self.plan.response_id)

    def _record(self, status: UsageStatus, results: Sequence[ChoiceResult]) -> None:
        state, plan = self.state, self.plan
        now = time.monotonic()
        usage = usage_of(plan, results)
        if self.engine_started is None:
            usage = UsageInfo(prompt_tokens=0, completion_tokens=0, total_tokens=0)
        if self.admission is not None:
            task = asyncio.get_running_loop().create_task(
                _settle(state, self.admission, usage.total_tokens)
            )
            _background.add(task)
            task.add_done_callback(_background.discard)
        first_tokens = [r.first_token_time for r in results if r.first_token_time is not None]
        ttft_ms = (min(first_tokens) - plan.arrival) * 1000 if first_tokens else None
        latency_s = now - plan.arrival
        ref = plan.adapter
        principal = plan.principal
        # NOTE: an admin acting for a tenant (X-Loraplex-Tenant) records its own row:
        # tenant_id stays None and key_id is the admin's, so the tenant is not billed.
        state.usage.record(
            UsageEvent(
                request_id=plan.response_id,
                tenant_id=principal.tenant_id,
                key_id=principal.key_id,
                model=plan.model,
                adapter_id=None if ref is None else ref.adapter_id,
                adapter_version=None if ref is None else ref.version,
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                cached_tokens=(
                    0 if usage.prompt_tokens_details is None
                    else usage.prompt_tokens_details.cached_tokens
                ),
                ttft_ms=ttft_ms,
                latency_ms=latency_s * 1000,
                status=status,
                created_at=datetime.now(UTC) - timedelta(seconds=latency_s),
            )
        )
        engine_s = 0.0
        if self.engine_started is not None:
            engine_s = (self.engine_finished or now) - self.engine_started
        state.metrics.observe_tenant_request(
            tenant=principal.tenant_id,
            model=plan.metrics_model,
            status=status.value,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            gateway_overhead_s=max(0.0, latency_s - engine_s),
        )


async def _settle(state: AppState, admission: Admission, used_tokens: int) -> None:
    try:
        await state.limiter.settle(admission, used_tokens=used_tokens)
    except Exception:
        # The reservation then runs out with its window; the lease with its ttl.
        logger.warning("could not settle quota of %s", admission, exc_info=True)


async def _renew_lease(state: AppState, admission: Admission) -> None:
    interval = state.settings.lease_ttl_s / 3
    while True:
        await asyncio.sleep(interval)
        with contextlib.suppress(Exception):
            await state.limiter.renew(admission)


async def open_account(state: AppState, plan: GenerationPlan) -> RequestAccount:
    """Admit the request against its tenant's quotas (429 / 503 when it may not run)."""
    tenant = plan.principal.tenant
    if tenant is None:
        return RequestAccount(state, plan, admission=None)
    try:
        admission = await state.limiter.admit(
            tenant.id, tenant.quotas, request_id=plan.response_id, tokens=plan.reserved_tokens
        )
    except QuotaExceeded as exc:
        raise quota_error(exc) from exc
    except QuotaUnavailable as exc:
        raise APIError(
            503,
            "Rate limits cannot be checked right now; retry shortly.",
            type=SERVER_ERROR,
            code="overloaded",
            headers={"Retry-After": str(exc.retry_after_s)},
            reason="quota_backend_unavailable",
        ) from exc
    account = RequestAccount(state, plan, admission=admission)
    if tenant.quotas.max_concurrency is not None:
        account.renewal = asyncio.get_running_loop().create_task(
            _renew_lease(state, admission)
        )
    return account
