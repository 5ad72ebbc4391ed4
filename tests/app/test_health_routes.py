"""/health, /ready and /metrics as probes and scrapers see them, the engine failing
for good included, and /metrics behind LORAPLEX_METRICS_TOKEN."""

from __future__ import annotations

import pytest

from tests.utils.fake_engine import asgi_client, make_app

TOKEN = "metrics-token-0123456789abcdef"


async def test_a_failed_engine_turns_health_and_ready_503() -> None:
    app, engine = make_app()
    async with asgi_client(app) as client:
        assert (await client.get("/health")).json() == {"status": "ok"}
        engine.failed = "3 engine steps in a row failed; the last: forward: broken"
        health = await client.get("/health")
        assert health.status_code == 503
        assert health.json() == {"status": "failed", "reason": engine.failed}
        ready = await client.get("/ready")
        assert (ready.status_code, ready.json()["status"]) == (503, "failed")
        refused = await client.post("/v1/completions", json={
            "model": engine.model_id, "prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
        assert "failed" in refused.json()["error"]["message"]
        assert "loraplex_engine_failed 1.0" in (await client.get("/metrics")).text


@pytest.mark.parametrize("header, status", [
    (None, 401), ("Bearer wrong", 401), (f"Basic {TOKEN}", 401), (f"Bearer {TOKEN}x", 401),
    (f"Bearer {TOKEN}", 200),
])
async def test_metrics_behind_a_token(header: str | None, status: int) -> None:
    app, _ = make_app(metrics_token=TOKEN)
    headers = {} if header is None else {"Authorization": header}
    async with asgi_client(app) as client:
        response = await client.get("/metrics", headers=headers)
    assert response.status_code == status, response.text
    if status == 401:
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
    else:
        assert "loraplex_engine_step_failures_total" in response.text
        assert "loraplex_engine_background_steps_cut_total 0.0" in response.text


async def test_metrics_open_without_a_token() -> None:
    app, _ = make_app()
    async with asgi_client(app) as client:
        assert (await client.get("/metrics")).status_code == 200
