"""Requests that used to stop the engine for every tenant, over real HTTP on a real engine.

The incident: `top_p` 1e-50, `temperature` 1e-50 and `repetition_penalty` 1e-300 each
killed the step loop, and from then on every tenant got 503. Here they are served (or
refused with a 400 naming the bound), and a step that fails on one tenant's request
(a poisoned prompt, injected inside the model's forward) fails only that request with a
500 while another tenant's streams, in the same step, finish with the right tokens.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from app.tables import UsageRecord
from engine.async_engine import AsyncEngine
from engine.core.faults import FAULTS_ENV
from engine.core.state import SchedulerOutput
from tests.utils.real_service import real_service, usage_rows
from tests.utils.saas import bearer, create_key, create_tenant
from tests.utils.tiny_models import random_prompt

POISON = [7, 8, 9]
STREAM_TOKENS = 120


@dataclass
class Service:
    base_url: str
    engine: AsyncEngine
    database_url: str
    model: str
    keys: dict[str, str]
    tenants: dict[str, str]
    # (request ids in the call, whether it raised), for every forward the engine ran
    forwards: list[tuple[list[str], bool]]

    def client(self, who: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.keys[who],
                             max_retries=0, timeout=60)

    def post(self, who: str, body: Any, path: str = "/v1/completions") -> httpx.Response:
        content = body if isinstance(body, str) else None
        return httpx.post(f"{self.base_url}{path}", headers={
            **bearer(self.keys[who]), "Content-Type": "application/json",
        }, json=None if content is not None else body, content=content, timeout=60)


@pytest.fixture(scope="module")
def service(
    tiny_model_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    base = tiny_model_factory("llama_gqa")
    root = tmp_path_factory.mktemp("engine_faults")
    forwards: list[tuple[list[str], bool]] = []
    os.environ[FAULTS_ENV] = "poison=" + ".".join(map(str, POISON))  # read by the engine
    try:
        with real_service(base, root, engine_options={"max_model_len": 256},
                          usage_flush_interval_s=0.05) as live, \
                httpx.Client(base_url=live.base_url, timeout=60) as admin:
            execute = live.engine.core._execute

            def recorded(output: SchedulerOutput, slots: Mapping[str, int] | None = None
                         ) -> Any:
                ids = [c.request.request_id for c in output.chunks]
                try:
                    logits = execute(output, slots)
                except Exception:
                    forwards.append((ids, True))
                    raise
                forwards.append((ids, False))
                return logits

            live.engine.core._execute = recorded
            tenants = {who: create_tenant(admin, f"tenant-{who}", rpm=10_000)["id"]
                       for who in ("a", "b")}
            keys = {who: create_key(admin, tid)["key"] for who, tid in tenants.items()}
            yield Service(live.base_url, live.engine, live.database_url, live.engine.model_id,
                          keys, tenants, forwards)
    finally:
        del os.environ[FAULTS_ENV]


def _usage_rows(service: Service, tenant: str, expected: int) -> list[UsageRecord]:
    return usage_rows(service.database_url, UsageRecord.tenant_id == service.tenants[tenant],
                      at_least=expected)


@pytest.mark.parametrize("field, value", [("top_p", 1e-50), ("temperature", 1e-50),
                                          ("temperature", 5e-324), ("top_p", 5e-324)])
def test_the_values_of_the_incident_are_served(service: Service, field: str, value: float) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    response = service.post("a", {"model": service.model, "messages": messages,
                                  "max_tokens": 4, field: value}, path="/v1/chat/completions")
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(f"{service.base_url}/ready").status_code == 200
    assert httpx.get(f"{service.base_url}/health").json() == {"status": "ok"}


@pytest.mark.parametrize("value", [1e-300, 0.001, 101.0, 1e300])
def test_extreme_repetition_penalties_are_refused_naming_the_bound(
    service: Service, value: float
) -> None:
    response = service.post("a", {"model": service.model, "prompt": "Hi", "max_tokens": 4,
                                  "repetition_penalty": value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "repetition_penalty"
    assert ("0.01" in error["message"]) if value < 1 else ("100" in error["message"])


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "1e400", "-1e400"])
def test_non_finite_numbers_are_refused(service: Service, raw: str) -> None:
    body = f'{{"model": "{service.model}", "prompt": "Hi", "max_tokens": 4, "top_p": {raw}}}'
    response = service.post("a", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def _stream_text(service: Service, prompt: list[int], started: concurrent.futures.Future[None]
                 ) -> str:
    stream = service.client("b").completions.create(
        model=service.model, prompt=prompt, max_tokens=STREAM_TOKENS, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )
    text = []
    for chunk in stream:
        if not started.done():
            started.set_result(None)
        text.append(chunk.choices[0].text if chunk.choices else "")
    return "".join(text)


def test_a_failed_step_fails_only_the_request_it_failed_on(service: Service) -> None:
    prompts = [random_prompt(20 + 7 * i, seed=40 + i) for i in range(3)]
    client = service.client("b")
    reference = [
        client.completions.create(model=service.model, prompt=p, max_tokens=STREAM_TOKENS,
                                  temperature=0, extra_body={"ignore_eos": True}
                                  ).choices[0].text
        for p in prompts
    ]
    failures_before = service.engine.stats().num_step_failures
    service.forwards.clear()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        started = [concurrent.futures.Future[None]() for _ in prompts]
        streams = [pool.submit(_stream_text, service, p, s)
                   for p, s in zip(prompts, started, strict=True)]
        concurrent.futures.wait(started, timeout=30)
        with pytest.raises(openai.InternalServerError) as failed:
            service.client("a").completions.create(
                model=service.model, prompt=[1, *POISON, 2], max_tokens=8, temperature=0
            )
        texts = [s.result(timeout=60) for s in streams]

    error: dict[str, Any] = failed.value.body  # type: ignore[assignment]
    assert error["type"] == "server_error"
    assert texts == reference
    # Tenant b's streams shared the forward that failed, and were run again on their own.
    poisoned = {ids[0] for ids, raised in service.forwards if raised and len(ids) == 1}
    assert len(poisoned) == 1
    assert any(raised and set(ids) - poisoned for ids, raised in service.forwards)
    assert service.engine.stats().num_step_failures > failures_before

    metrics = httpx.get(f"{service.base_url}/metrics").text
    line = next(x for x in metrics.splitlines()
                if x.startswith("loraplex_engine_step_failures_total"))
    assert float(line.split()[-1]) == service.engine.stats().num_step_failures
    assert "loraplex_engine_failed 0.0" in metrics
    assert httpx.get(f"{service.base_url}/health").json() == {"status": "ok"}

    # Every request left its usage row, the failed one included, and nothing is held.
    rows_a = [r for r in _usage_rows(service, "a", 1) if r.status == "error"]
    assert len(rows_a) == 1 and rows_a[0].prompt_tokens == 5
    stats = service.engine.stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_a_huge_prompt_does_not_stall_other_tenants(service: Service) -> None:
    """Tokenizing a prompt of nearly the 4 MiB body limit takes seconds; it runs off the
    event loop, so another tenant's calls are answered meanwhile."""
    prompt = "hello world, this is a long prompt. " * (4 * 1024 * 1024 // 36 - 100)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        huge = pool.submit(service.post, "a", {"model": service.model, "prompt": prompt,
                                               "max_tokens": 4})
        time.sleep(0.2)
        num_answered = 0
        while True:
            models = service.client("b").models.list()
            if huge.done():
                break
            assert models.data
            num_answered += 1
        response = huge.result()
    assert response.status_code == 400, response.text  # far beyond the context
    assert response.json()["error"]["code"] == "context_length_exceeded"
    # On the event loop it would answer none until the prompt's planning ended.
    assert num_answered >= 5, num_answered
