"""The multi-tenant service end to end over real HTTP: keys, isolation, quotas shared by
two app instances through the real Redis, tenant limits, and metrics. The engine is the
FakeEngine (what it is asked to run is recorded); adapters run on a real engine in
test_tenant_adapters_http.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from app.core.config import Settings
from app.main import create_app
from tests.utils.fake_engine import FakeEngine
from tests.utils.live_server import serve_in_thread
from tests.utils.saas import ADMIN_KEY, SECRET_KEY, bearer, create_key, create_tenant

MODEL = "fake-model"
USER = [{"role": "user", "content": "hello"}]


@dataclass
class Instance:
    base_url: str
    engine: FakeEngine

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=30)

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=0)


def _settings(tmp_path: Path, database_url: str, redis_url: str | None, **overrides: Any
              ) -> Settings:
    return Settings(
        data_dir=tmp_path,
        database_url=database_url,
        redis_url=redis_url,
        admin_key=ADMIN_KEY,
        secret_key=SECRET_KEY,
        **overrides,
    )


@contextmanager
def instances(
    tmp_path: Path, database_url: str, redis_url: str | None, count: int = 1, **overrides: Any
) -> Iterator[list[Instance]]:
    """`count` app instances (replicas) sharing one database and one Redis."""
    with ExitStack() as stack:
        running = []
        for i in range(count):
            engine = FakeEngine(model_id=MODEL, max_model_len=4096)
            settings = _settings(tmp_path / f"replica{i}", database_url, redis_url, **overrides)
            base = stack.enter_context(serve_in_thread(create_app(engine, settings)))
            running.append(Instance(base, engine))
        yield running


@pytest.fixture
def one(sqlite_url: str, tmp_path: Path) -> Iterator[Instance]:
    with instances(tmp_path, sqlite_url, None) as (instance,):
        yield instance


def chat(client: openai.OpenAI, **fields: Any) -> Any:
    return client.chat.completions.create(
        model=fields.pop("model", MODEL), messages=USER, max_tokens=fields.pop("max_tokens", 4),
        **fields,
    )


# ------------------------------------------------------------------------- keys


def test_keys_missing_malformed_expired_revoked_and_admin_routes(one: Instance) -> None:
    with one.admin() as admin:
        tenant = create_tenant(admin, "acme")
        good = create_key(admin, tenant["id"])["key"]
        soon = datetime.now(UTC) + timedelta(seconds=1.5)
        expiring = create_key(admin, tenant["id"], expires_at=soon.isoformat())["key"]
        revoked = create_key(admin, tenant["id"])
        assert chat(one.openai(good)).choices[0].finish_reason == "length"
        assert chat(one.openai(expiring)).choices[0].message.content

        response = admin.delete(f"/admin/keys/{revoked['id']}", headers=bearer(ADMIN_KEY))
        assert response.status_code == 204
        # A tenant key on admin routes: 403, whatever the route.
        for method, path in [("GET", "/admin/tenants"), ("POST", "/admin/tenants"),
                             ("GET", "/admin/engine"), ("GET", "/admin/usage")]:
            response = admin.request(method, path, headers=bearer(good), json={})
            assert response.status_code == 403, (path, response.text)

    while datetime.now(UTC) < soon + timedelta(seconds=0.1):
        time.sleep(0.05)
    malformed = good[:-1] + ("A" if good[-1] != "A" else "B")  # checksum no longer matches
    for key in ["sk-not-ours", malformed, expiring, revoked["key"]]:
        with pytest.raises(openai.AuthenticationError) as caught:
            chat(one.openai(key))
        assert caught.value.status_code == 401
        assert caught.value.code == "invalid_api_key"
    response = httpx.post(f"{one.base_url}/v1/chat/completions", json={})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert one.engine.submitted and len(one.engine.submitted) == 2  # refused keys ran nothing


def test_revocation_reaches_a_second_instance_within_a_second(
    sqlite_url: str, tmp_path: Path
) -> None:
    # A revocation reaches a replica within its refresh interval plus one query. The
    # interval is half the default here: on a loaded two-core machine a refresh can start
    # late, and the second is what is checked, not the default's margin under it.
    with instances(tmp_path, sqlite_url, None, count=2, refresh_interval_s=0.25) as (
        first, second
    ):
        with first.admin() as admin:
            tenant = create_tenant(admin, "acme")
            key = create_key(admin, tenant["id"])
        # The key reaches the second instance through its background refresh.
        deadline = time.monotonic() + 2
        while True:
            try:
                chat(second.openai(key["key"]))
                break
            except openai.AuthenticationError:
                assert time.monotonic() < deadline, "the new key never reached replica 2"
                time.sleep(0.05)
        with first.admin() as admin:
            assert admin.delete(
                f"/admin/keys/{key['id']}", headers=bearer(ADMIN_KEY)
            ).status_code == 204
            revoked_at = time.monotonic()  # committed
        with pytest.raises(openai.AuthenticationError):
            chat(first.openai(key["key"]))  # the revoking replica: at once
        while True:
            try:
                chat(second.openai(key["key"]))
            except openai.AuthenticationError:
                break
            time.sleep(0.02)
        assert time.monotonic() - revoked_at < 1.0


# ------------------------------------------------------------- tenant limits


def test_max_tokens_limit_default_and_priority_and_salt(one: Instance) -> None:
    with one.admin() as admin:
        premium = create_tenant(admin, "premium-co", tier="premium", max_tokens=8)
        batch = create_tenant(admin, "batch-co", tier="batch", max_context_tokens=40)
        premium_key = create_key(admin, premium["id"])["key"]
        batch_key = create_key(admin, batch["id"])["key"]

    with pytest.raises(openai.BadRequestError) as caught:
        chat(one.openai(premium_key), max_tokens=9)
    assert caught.value.code == "max_tokens_exceeded"
    assert caught.value.param == "max_tokens"

    one.openai(premium_key).chat.completions.create(model=MODEL, messages=USER)
    one.openai(premium_key).chat.completions.create(model=MODEL, messages=USER, extra_body={
        "priority": 5})
    default, lowered = one.engine.submitted[-2:]
    assert default.sampling.max_tokens == 8  # the tenant's limit is the default
    assert (default.priority, lowered.priority) == (0, 5)
    assert default.salt == premium["id"]
    # The engine gets the tenant for fairness, with its limits to enforce again.
    assert default.tenant is not None
    assert (default.tenant.tenant_id, default.tenant.max_tokens) == (premium["id"], 8)
    assert default.tenant.max_kv_fraction == 0.5

    # The batch tenant's context limit: an omitted max_tokens shrinks to fit, an
    # explicit one that does not fit is refused.
    one.openai(batch_key).chat.completions.create(model=MODEL, messages=USER)
    submitted = one.engine.submitted[-1]
    assert len(submitted.prompt_token_ids) + submitted.sampling.max_tokens == 40
    assert submitted.priority == 2
    with pytest.raises(openai.BadRequestError) as caught:
        chat(one.openai(batch_key), max_tokens=39)
    assert caught.value.code == "context_length_exceeded"


def test_rpm_limit_is_shared_by_two_instances_through_redis(
    sqlite_url: str, redis_url: str, tmp_path: Path
) -> None:
    limit = 12
    # NOTE: a generous Redis timeout: the burst opens new pooled connections, and on a
    # busy machine a connect over the default 0.5 s failed open (per-process limits).
    with instances(tmp_path, sqlite_url, redis_url, count=2,
                   quota_redis_timeout_s=10.0) as replicas:
        with replicas[0].admin() as admin:
            tenant = create_tenant(admin, "acme", rpm=limit)
            key = create_key(admin, tenant["id"])["key"]
        _wait_for_key(replicas[1], key)

        async def one_request(i: int) -> httpx.Response:
            async with httpx.AsyncClient(base_url=replicas[i % 2].base_url, timeout=30) as c:
                return await c.post(
                    "/v1/chat/completions",
                    json={"model": MODEL, "messages": USER, "max_tokens": 2},
                    headers=bearer(key),
                )

        async def burst() -> list[httpx.Response]:
            return await asyncio.gather(*(one_request(i) for i in range(3 * limit)))

        responses = asyncio.run(burst())
    ok = [r for r in responses if r.status_code == 200]
    limited = [r for r in responses if r.status_code == 429]
    assert len(ok) == limit
    # Each replica got 18 requests: with a count per process, both would admit 12.
    assert len(replicas[0].engine.submitted) + len(replicas[1].engine.submitted) == limit
    assert len(ok) + len(limited) == len(responses)
    for response in limited:
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(response.headers["retry-after"]) >= 1
        assert response.headers["x-ratelimit-limit-requests"] == str(limit)
        assert response.headers["x-ratelimit-remaining-requests"] == "0"
    assert all(r.headers["x-ratelimit-limit-requests"] == str(limit) for r in ok)


def _wait_for_key(instance: Instance, key: str) -> None:
    deadline = time.monotonic() + 3
    while True:
        response = httpx.get(f"{instance.base_url}/v1/models", headers=bearer(key))
        if response.status_code == 200:
            return
        assert time.monotonic() < deadline, "the key never reached the instance"
        time.sleep(0.05)


def test_monthly_quota_exhaustion_is_insufficient_quota(
    sqlite_url: str, redis_url: str, tmp_path: Path
) -> None:
    with instances(tmp_path, sqlite_url, redis_url) as (one,):
        with one.admin() as admin:
            tenant = create_tenant(admin, "acme", monthly_tokens=60)
            key = create_key(admin, tenant["id"])["key"]
        client = one.openai(key)
        first = chat(client, max_tokens=10)
        used = first.usage.total_tokens
        assert used < 60
        with pytest.raises(openai.RateLimitError) as caught:
            # Reserving prompt + max_tokens would go past the month's tokens.
            chat(client, max_tokens=60 - used)
        response = caught.value.response
        assert caught.value.code == "insufficient_quota"
        assert response.headers["x-should-retry"] == "false"
        assert int(response.headers["retry-after"]) > 0


# -------------------------------------------------------------------- metrics


def test_metrics_per_tenant_and_model(one: Instance) -> None:
    with one.admin() as admin:
        tenant = create_tenant(admin, "acme", max_tokens=4)
        key = create_key(admin, tenant["id"])["key"]
    chat(one.openai(key), max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        chat(one.openai(key), max_tokens=5)
    with pytest.raises(openai.NotFoundError):
        chat(one.openai(key), model="nobody-s-adapter")
    text = httpx.get(f"{one.base_url}/metrics").text
    tid = tenant["id"]
    assert f'loraplex_tenant_requests_total{{model="{MODEL}",status="ok",tenant="{tid}"}} 1.0' \
        in text
    assert (f'loraplex_tenant_tokens_total{{kind="completion",model="{MODEL}",'
            f'tenant="{tid}"}} 3.0') in text
    assert f'loraplex_rejections_total{{reason="max_tokens_exceeded",tenant="{tid}"}} 1.0' \
        in text
    assert f'loraplex_rejections_total{{reason="model_not_found",tenant="{tid}"}} 1.0' in text
    assert f'loraplex_gateway_overhead_seconds_count{{tenant="{tid}"}} 1.0' in text


def test_monthly_quota_survives_a_restart_without_redis(sqlite_url: str, tmp_path: Path
                                                        ) -> None:
    with instances(tmp_path, sqlite_url, None) as (first,):
        with first.admin() as admin:
            tenant = create_tenant(admin, "acme", monthly_tokens=60)
            key = create_key(admin, tenant["id"])["key"]
        used = chat(first.openai(key), max_tokens=10).usage.total_tokens
    # The first process is gone (its usage flushed on the way out); a new one counts the
    # month from the usage rows.
    with instances(tmp_path, sqlite_url, None) as (second,):
        # Prompt + max_tokens = 50 fits a fresh month of 60, not one with `used` spent.
        with pytest.raises(openai.RateLimitError) as caught:
            chat(second.openai(key), max_tokens=60 - used)
        assert caught.value.code == "insufficient_quota"


def test_ready_reports_database_and_redis(tmp_path: Path, redis_url: str) -> None:
    from app.db import upgrade
    from tests.utils.databases import fresh_postgres_database
    from tests.utils.tcp_proxy import TcpProxy

    with fresh_postgres_database() as url, TcpProxy("127.0.0.1", 5432) as pg, \
            TcpProxy("127.0.0.1", 6379) as redis_proxy:
        upgrade(url)
        proxied_db = url.replace("127.0.0.1:5432", f"127.0.0.1:{pg.port}")
        proxied_redis = redis_url.replace("127.0.0.1:6379", f"127.0.0.1:{redis_proxy.port}")
        with instances(tmp_path, proxied_db, proxied_redis) as (one,):
            ready = httpx.get(f"{one.base_url}/ready")
            assert ready.status_code == 200
            assert ready.json()["checks"] == {"database": "ok", "quotas": "ok"}
            redis_proxy.cut()
            ready = httpx.get(f"{one.base_url}/ready")
            assert ready.status_code == 503
            assert ready.json()["checks"] == {"database": "ok", "quotas": "unavailable"}
            pg.cut()
            ready = httpx.get(f"{one.base_url}/ready")
            assert ready.json()["checks"] == {"database": "unavailable", "quotas": "unavailable"}
            pg.restore()
            redis_proxy.restore()
            deadline = time.monotonic() + 5
            while httpx.get(f"{one.base_url}/ready").status_code != 200:
                assert time.monotonic() < deadline, "never ready again"
                time.sleep(0.1)


def test_the_redis_timeout_setting_bounds_what_a_hung_redis_costs(
    sqlite_url: str, redis_url: str, tmp_path: Path
) -> None:
    from tests.utils.tcp_proxy import TcpProxy

    def after_a_stall(timeout_s: float) -> int | str:
        with TcpProxy("127.0.0.1", 6379) as proxy:
            proxied = redis_url.replace("127.0.0.1:6379", f"127.0.0.1:{proxy.port}")
            with instances(tmp_path / str(timeout_s), sqlite_url, proxied,
                           quota_failure_mode="closed",
                           quota_redis_timeout_s=timeout_s) as (one,):
                with one.admin() as admin:
                    tenant = create_tenant(admin, f"acme-{timeout_s}", rpm=100)
                    key = create_key(admin, tenant["id"])["key"]
                chat(one.openai(key))  # through Redis
                proxy.stall()
                try:
                    return httpx.post(
                        f"{one.base_url}/v1/chat/completions", headers=bearer(key),
                        json={"model": MODEL, "messages": USER, "max_tokens": 2}, timeout=2.0,
                    ).status_code
                except httpx.ReadTimeout:
                    return "still waiting on Redis"
                finally:
                    proxy.restore()

    assert after_a_stall(0.2) == 503
    assert after_a_stall(8.0) == "still waiting on Redis"


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_redis_outage_fails_open_within_process_limits_or_closed(
    sqlite_url: str, redis_url: str, tmp_path: Path, mode: str
) -> None:
    from tests.utils.tcp_proxy import TcpProxy

    with TcpProxy("127.0.0.1", 6379) as proxy:
        proxied = redis_url.replace("127.0.0.1:6379", f"127.0.0.1:{proxy.port}")
        with instances(tmp_path, sqlite_url, proxied, quota_failure_mode=mode) as (one,):
            with one.admin() as admin:
                tenant = create_tenant(admin, "acme", rpm=3)
                key = create_key(admin, tenant["id"])["key"]
            chat(one.openai(key))  # through Redis
            proxy.cut()
            if mode == "closed":
                response = httpx.post(
                    f"{one.base_url}/v1/chat/completions", headers=bearer(key),
                    json={"model": MODEL, "messages": USER, "max_tokens": 2},
                )
                assert response.status_code == 503
                assert response.json()["error"]["code"] == "overloaded"
                assert int(response.headers["retry-after"]) >= 1
                return
            # Open: this process's own limiter admits up to the limit (3), then refuses.
            for _ in range(3):
                chat(one.openai(key))
            with pytest.raises(openai.RateLimitError):
                chat(one.openai(key))
            text = httpx.get(f"{one.base_url}/metrics").text
            assert "loraplex_quota_fail_open_total 4.0" in text
