"""The OpenAI wire format: responses, SSE framing, n > 1, logprobs, disconnects, operations."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from app.core.config import Settings
from app.main import begin_drain, create_app
from engine.request import SamplingParams
from tests.utils.fake_engine import (
    FakeEngine,
    asgi_client,
    fake_logprob,
    make_app,
    parse_sse,
    render_chat,
)
from tests.utils.live_server import serve_in_thread

MODEL = "fake-model"


async def post(path: str, body: dict[str, Any], engine: FakeEngine | None = None,
               **settings: Any) -> tuple[httpx.Response, FakeEngine]:
    app, engine = make_app(engine, **settings)
    async with asgi_client(app) as client:
        return await client.post(path, json=body), engine


# ------------------------------------------------------------------ /v1/models


async def test_models_lists_the_base_model() -> None:
    app, _ = make_app()
    async with asgi_client(app) as client:
        response = await client.get("/v1/models")
    assert response.status_code == 200
    body = response.json()
    created = body["data"][0]["created"]
    assert isinstance(created, int) and abs(created - time.time()) < 60
    assert body == {
        "object": "list",
        "data": [
            {
                "id": MODEL,
                "object": "model",
                "created": created,
                "owned_by": "loraplex",
                "parent": None,
                "root": MODEL,
            }
        ],
    }


async def test_models_lists_adapters_after_the_base_model() -> None:
    app, engine = make_app()
    await engine.add_adapter("support-bot", "/adapters/support-bot")
    await engine.add_adapter("alpha", "/adapters/alpha")
    async with asgi_client(app) as client:
        body = (await client.get("/v1/models")).json()
        ok = await client.post(
            "/v1/completions", json={"model": "alpha", "prompt": "hi", "max_tokens": 2}
        )
        await engine.remove_adapter("alpha")
        gone = await client.post(
            "/v1/completions", json={"model": "alpha", "prompt": "hi", "max_tokens": 2}
        )
    assert [m["id"] for m in body["data"]] == [MODEL, "alpha", "support-bot"]
    assert body["data"][1] == {
        "id": "alpha",
        "object": "model",
        "created": 1_700_000_000,
        "owned_by": "loraplex",
        "parent": MODEL,
        "root": MODEL,
    }
    assert ok.status_code == 200 and ok.json()["model"] == "alpha"
    assert engine.submitted[-1].adapter_id == "alpha"
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


# ------------------------------------------------------------------ completions


async def test_completion_response_is_exactly_openai_shaped() -> None:
    response, engine = await post(
        "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 7}
    )
    assert response.status_code == 200
    body = response.json()
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", body["id"])
    assert abs(body["created"] - time.time()) < 60
    assert body == {
        "id": body["id"],
        "object": "text_completion",
        "created": body["created"],
        "model": MODEL,
        "choices": [{"index": 0, "text": "hellohe", "logprobs": None, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 7,
            "total_tokens": 12,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
        "system_fingerprint": None,
    }
    [submitted] = engine.submitted
    assert submitted.request_id == f"{body['id']}-0"
    assert submitted.prompt_token_ids == list(b"hello")
    assert submitted.adapter_id is None
    assert submitted.priority == 0
    assert engine.finished == [submitted.request_id]
    assert engine.aborted == []


async def test_sampling_fields_map_to_sampling_params() -> None:
    response, engine = await post("/v1/completions", {
        "model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9,
        "top_k": 5, "presence_penalty": 0.1, "frequency_penalty": -0.2,
        "repetition_penalty": 1.1, "seed": 7, "stop": ["x", "", "yz"], "logprobs": 3,
        "priority": 4, "user": "u-1", "some_future_field": {"ignored": True},
    })
    assert response.status_code == 200, response.text
    [submitted] = engine.submitted
    assert submitted.sampling == SamplingParams(
        max_tokens=3, temperature=0.5, top_p=0.9, top_k=5, presence_penalty=0.1,
        frequency_penalty=-0.2, repetition_penalty=1.1, seed=7, stop=["x", "yz"], logprobs=3,
    )
    assert submitted.priority == 4


async def test_defaults_and_max_tokens_fill_the_context() -> None:
    response, engine = await post(
        "/v1/completions", {"model": MODEL, "prompt": "hello", "top_k": -1, "stop": "lo"}
    )
    assert response.status_code == 200
    [submitted] = engine.submitted
    # max_model_len 64 - 5 prompt tokens.
    assert submitted.sampling == SamplingParams(max_tokens=59, stop=["lo"])
    assert response.json()["choices"][0]["text"] == "hel"
    assert response.json()["choices"][0]["finish_reason"] == "stop"
    # "l" and "o" were generated (and billed) even though the stop string is not shown.
    assert response.json()["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize(
    "prompt", [[104, 105, 33], ["hi!"], [[104, 105, 33]]], ids=["ids", "one-string", "one-ids"]
)
async def test_prompt_forms(prompt: Any) -> None:
    response, engine = await post(
        "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    )
    assert response.status_code == 200
    assert engine.submitted[0].prompt_token_ids == [104, 105, 33]
    assert response.json()["choices"][0]["text"] == "hi!h"


async def test_eos_finishes_with_stop_and_cached_tokens_are_reported() -> None:
    engine = FakeEngine(eos_after=2, num_cached_tokens=3)
    response, _ = await post(
        "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 10}, engine
    )
    body = response.json()
    assert body["choices"][0]["text"] == "he"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 3}}


async def test_n_choices_run_concurrently_with_consecutive_seeds() -> None:
    response, engine = await post(
        "/v1/completions",
        {"model": MODEL, "prompt": "hello", "max_tokens": 5, "n": 3, "seed": 1},
    )
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    # The fake starts generating at offset seed % len(prompt).
    assert [c["text"] for c in body["choices"]] == ["elloh", "llohe", "lohel"]
    assert body["usage"]["prompt_tokens"] == 5
    assert body["usage"]["completion_tokens"] == 15
    assert body["usage"]["total_tokens"] == 20
    assert [s.request_id for s in engine.submitted] == [f"{body['id']}-{i}" for i in range(3)]
    assert [s.sampling.seed for s in engine.submitted] == [1, 2, 3]


async def test_completion_logprobs_format() -> None:
    response, _ = await post(
        "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3, "logprobs": 2}
    )
    logprobs = response.json()["choices"][0]["logprobs"]
    assert logprobs == {
        "tokens": ["h", "i", "h"],
        "token_logprobs": [-0.25, -0.5, -0.25],
        "top_logprobs": [{"h": -0.25, "i": -1.25}, {"i": -0.5, "j": -1.5},
                         {"h": -0.25, "i": -1.25}],
        "text_offset": [0, 1, 2],
    }
    assert fake_logprob(ord("i")) == -0.5


async def test_completion_stream_with_usage() -> None:
    response, _ = await post("/v1/completions", {
        "model": MODEL, "prompt": "abc", "max_tokens": 3, "stream": True, "logprobs": 0,
        "stream_options": {"include_usage": True},
    })
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    first = chunks[0]
    assert all(c["id"] == first["id"] and c["created"] == first["created"] for c in chunks)
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    assert [c["choices"] for c in chunks[:3]] == [
        [{"index": 0, "text": "a", "finish_reason": None, "logprobs": {
            "tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{}], "text_offset": [0]}}],
        [{"index": 0, "text": "b", "finish_reason": None, "logprobs": {
            "tokens": ["b"], "token_logprobs": [-0.75], "top_logprobs": [{}],
            "text_offset": [1]}}],
        [{"index": 0, "text": "c", "finish_reason": "length", "logprobs": {
            "tokens": ["c"], "token_logprobs": [-1.0], "top_logprobs": [{}],
            "text_offset": [2]}}],
    ]
    assert [c["usage"] for c in chunks[:3]] == [None, None, None]
    assert chunks[3]["choices"] == []
    assert chunks[3]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                  "prompt_tokens_details": {"cached_tokens": 0}}
    assert len(chunks) == 4


async def test_completion_stream_without_usage_has_no_usage_field() -> None:
    response, _ = await post(
        "/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 2, "stream": True}
    )
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    assert [c["choices"][0]["text"] for c in events[:-1]] == ["a", "b"]
    assert all("usage" not in c for c in events[:-1])


# ------------------------------------------------------------------------- chat

CHAT_MESSAGES = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user",
     "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
]
# developer -> system; text parts joined by newlines.
CHAT_PROMPT = render_chat(
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]
)


async def test_chat_response_is_exactly_openai_shaped() -> None:
    response, engine = await post(
        "/v1/chat/completions", {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 4}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", body["id"])
    num_prompt = len(CHAT_PROMPT.encode())
    assert body == {
        "id": body["id"],
        "object": "chat.completion",
        "created": body["created"],
        "model": MODEL,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": CHAT_PROMPT[:4], "refusal": None},
            "logprobs": None,
            "finish_reason": "length",
        }],
        "usage": {"prompt_tokens": num_prompt, "completion_tokens": 4,
                  "total_tokens": num_prompt + 4, "prompt_tokens_details": {"cached_tokens": 0}},
        "system_fingerprint": None,
    }
    assert engine.submitted[0].prompt_token_ids == list(CHAT_PROMPT.encode())


async def test_chat_max_completion_tokens_wins_and_default_fills_context() -> None:
    messages = [{"role": "user", "content": "x"}]
    response, engine = await post("/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": 9, "max_completion_tokens": 2,
    })
    assert response.status_code == 200
    assert engine.submitted[0].sampling.max_tokens == 2
    response, engine = await post("/v1/chat/completions", {"model": MODEL, "messages": messages})
    num_prompt = len(render_chat(messages).encode())
    assert engine.submitted[0].sampling.max_tokens == 64 - num_prompt


async def test_chat_logprobs_format() -> None:
    response, engine = await post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
        "logprobs": True, "top_logprobs": 2,
    })
    assert engine.submitted[0].sampling.logprobs == 2
    # The prompt starts with "<|", so those are the fake's first tokens.
    assert response.json()["choices"][0]["logprobs"] == {"content": [
        {"token": "<", "logprob": -0.25, "bytes": [60], "top_logprobs": [
            {"token": "<", "logprob": -0.25, "bytes": [60]},
            {"token": "=", "logprob": -1.25, "bytes": [61]},
        ]},
        {"token": "|", "logprob": -0.25, "bytes": [124], "top_logprobs": [
            {"token": "|", "logprob": -0.25, "bytes": [124]},
            {"token": "}", "logprob": -1.25, "bytes": [125]},
        ]},
    ]}


async def test_chat_logprobs_without_top_logprobs() -> None:
    response, engine = await post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
        "logprobs": True,
    })
    assert engine.submitted[0].sampling.logprobs == 0
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert content == [{"token": "<", "logprob": -0.25, "bytes": [60], "top_logprobs": []}]


def _chunk_choices(chunks: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any], Any]]:
    return [
        (c["choices"][0]["index"], c["choices"][0]["delta"], c["choices"][0]["finish_reason"])
        for c in chunks
    ]


async def test_chat_stream_framing_with_usage() -> None:
    messages = [{"role": "user", "content": "x"}]
    response, _ = await post("/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True},
    })
    assert response.status_code == 200
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert _chunk_choices(chunks[:-1]) == [
        (0, {"role": "assistant", "content": ""}, None),
        (0, {"content": "<"}, None),
        (0, {"content": "|"}, None),
        (0, {"content": "u"}, None),
        (0, {}, "length"),
    ]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert all(c["choices"][0]["logprobs"] is None for c in chunks[:-1])
    num_prompt = len(render_chat(messages).encode())
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": num_prompt, "completion_tokens": 3, "total_tokens": num_prompt + 3,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_chat_stream_n_choices_carry_their_index() -> None:
    response, _ = await post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
        "n": 2, "seed": 0, "stream": True,
    })
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    choices = _chunk_choices(events[:-1])
    # Every choice opens with its role chunk before any content.
    assert choices[:2] == [(0, {"role": "assistant", "content": ""}, None),
                           (1, {"role": "assistant", "content": ""}, None)]
    for index, expected in [(0, "<|"), (1, "|u")]:
        mine = [c for c in choices[2:] if c[0] == index]
        assert "".join(d.get("content", "") for _, d, _ in mine) == expected
        assert mine[-1] == (index, {}, "length")
        assert [f for _, _, f in mine[:-1]] == [None] * (len(mine) - 1)
    assert all("usage" not in c for c in events[:-1])


async def test_chat_stream_logprobs_and_withheld_stop_text() -> None:
    # The stop string "|u" begins at the fake's 2nd token: "<" is sent, "|" is held back
    # as a possible start of the stop string, then "u" completes it.
    response, _ = await post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
        "stream": True, "stop": "|u", "logprobs": True,
    })
    chunks = parse_sse(response.text)[:-1]
    assert _chunk_choices(chunks) == [
        (0, {"role": "assistant", "content": ""}, None),
        (0, {"content": "<"}, None),
        (0, {"content": ""}, None),  # "|": logprobs but no visible text yet
        (0, {"content": ""}, None),  # "u": logprobs, the stop string is never shown
        (0, {}, "stop"),
    ]
    assert [c["choices"][0]["logprobs"] for c in chunks[1:4]] == [
        {"content": [{"token": "<", "logprob": -0.25, "bytes": [60], "top_logprobs": []}]},
        {"content": [{"token": "|", "logprob": -0.25, "bytes": [124], "top_logprobs": []}]},
        {"content": [{"token": "u", "logprob": -0.5, "bytes": [117], "top_logprobs": []}]},
    ]


# ------------------------------------------------------------------ request ids


async def test_request_id_is_echoed_when_sane_and_generated_otherwise() -> None:
    app, _ = make_app()
    async with asgi_client(app) as client:
        echoed = await client.get("/v1/models", headers={"x-request-id": "trace-42.a:b"})
        bad = await client.get("/v1/models", headers={"x-request-id": "no spaces<allowed>"})
        long = await client.get("/v1/models", headers={"x-request-id": "a" * 129})
        none = await client.get("/health")
        stream = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "a", "max_tokens": 1, "stream": True},
            headers={"x-request-id": "stream-1"},
        )
    assert echoed.headers["x-request-id"] == "trace-42.a:b"
    for response in (bad, long, none):
        assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"])
    assert bad.headers["x-request-id"] != none.headers["x-request-id"]
    assert stream.headers["x-request-id"] == "stream-1"


# ------------------------------------------------------------------ disconnects


async def _call_then_disconnect(
    app: Any, path: str, body: bytes, disconnect_when: Any
) -> list[dict[str, Any]]:
    """Drive the ASGI app directly; hang up once `disconnect_when(sent)` is true."""
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        while not disconnect_when(sent):
            await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    return sent


async def test_stream_disconnect_aborts_before_the_first_token() -> None:
    # The engine would take a minute for the first token; the client leaves after the
    # role chunk, and the engine request must be aborted at once, not at the next write.
    app, engine = make_app(FakeEngine(first_token_delay_s=60))
    body = b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}],' \
           b' "stream": true, "n": 2}'
    started = time.monotonic()
    sent = await _call_then_disconnect(
        app, "/v1/chat/completions", body,
        lambda sent: sum(m["type"] == "http.response.body" for m in sent) >= 2,
    )
    assert time.monotonic() - started < 2
    assert sent[0]["status"] == 200
    assert sorted(engine.aborted) == sorted(s.request_id for s in engine.submitted)
    assert len(engine.aborted) == 2
    assert engine.active == set()


async def test_non_stream_disconnect_aborts() -> None:
    app, engine = make_app(FakeEngine(first_token_delay_s=60))
    body = b'{"model": "fake-model", "prompt": "hello", "max_tokens": 5}'
    sent = await _call_then_disconnect(
        app, "/v1/completions", body, lambda sent: bool(engine.submitted)
    )
    assert engine.aborted == [engine.submitted[0].request_id]
    assert engine.active == set()
    assert sent[0]["status"] == 499


# ------------------------------------------------------------------- operations


async def test_health_and_ready() -> None:
    app, engine = make_app(retry_after_s=7)
    async with asgi_client(app) as client:
        assert (await client.get("/health")).json() == {"status": "ok"}
        ready = await client.get("/ready")
        assert (ready.status_code, ready.json()) == (
            200, {"status": "ready", "checks": {"database": "ok", "quotas": "ok"}}
        )
        engine.ready = False
        starting = await client.get("/ready")
        assert (starting.status_code, starting.json()) == (503, {"status": "starting"})
        engine.ready = True
        begin_drain(app)
        draining = await client.get("/ready")
        assert (draining.status_code, draining.json()) == (503, {"status": "draining"})
        assert draining.headers["retry-after"] == "7"
        assert (await client.get("/health")).status_code == 200


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in metrics"
    return float(match.group(1))


async def test_metrics_exposition() -> None:
    app, engine = make_app()
    engine.num_waiting = 5
    engine.kv_usage = 0.25
    async with asgi_client(app) as client:
        await client.post("/v1/completions",
                          json={"model": MODEL, "prompt": "hello", "max_tokens": 3, "n": 2})
        await client.post("/v1/completions", json={"model": MODEL, "prompt": ""})
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert _metric(text, "loraplex_num_requests_waiting") == 5
    assert _metric(text, "loraplex_num_requests_running") == 0
    assert _metric(text, "loraplex_kv_cache_usage_ratio") == 0.25
    assert _metric(text, "loraplex_num_preemptions_total") == 3
    assert _metric(text, "loraplex_prefix_cache_hits_total") == 40
    assert _metric(text, "loraplex_prompt_tokens_total") == 10
    assert _metric(text, "loraplex_generation_tokens_total") == 6
    assert _metric(text, 'loraplex_requests_finished_total{finish_reason="length"}') == 2
    assert _metric(text, "loraplex_time_to_first_token_seconds_count") == 2
    assert _metric(text, "loraplex_time_per_output_token_seconds_count") == 2
    assert _metric(text, "loraplex_e2e_request_latency_seconds_count") == 2
    assert _metric(text, 'loraplex_http_requests_total{route="/v1/completions",status="200"}') == 1
    assert _metric(text, 'loraplex_http_requests_total{route="/v1/completions",status="400"}') == 1

    # A second app keeps its own registry.
    other, _ = make_app()
    async with asgi_client(other) as client:
        fresh = (await client.get("/metrics")).text
    assert _metric(fresh, "loraplex_generation_tokens_total") == 0


async def test_metrics_count_client_aborts() -> None:
    app, engine = make_app(FakeEngine(first_token_delay_s=60))
    body = b'{"model": "fake-model", "prompt": "hello", "max_tokens": 5}'
    await _call_then_disconnect(app, "/v1/completions", body, lambda sent: bool(engine.submitted))
    async with asgi_client(app) as client:
        text = (await client.get("/metrics")).text
    assert _metric(text, 'loraplex_requests_finished_total{finish_reason="abort"}') == 1
    assert _metric(text, "loraplex_time_to_first_token_seconds_count") == 0


# ------------------------------------------------- real HTTP, the official client


@pytest.fixture
def live_server() -> Iterator[tuple[str, FakeEngine]]:
    engine = FakeEngine(max_model_len=256)
    with serve_in_thread(create_app(engine, Settings(no_auth=True))) as base:
        yield base, engine


def test_openai_client_against_real_http(live_server: tuple[str, FakeEngine]) -> None:
    base, engine = live_server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)

    assert [m.id for m in client.models.list()] == [MODEL]

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hey"}], max_tokens=3
    )
    assert chat.choices[0].message.content == "<|u"
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 3

    completion = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, n=2,
                                           seed=1)
    assert [c.text for c in completion.choices] == ["ello", "lloh"]
    assert completion.usage is not None and completion.usage.total_tokens == 13

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hey"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True},
    ))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "<|u"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 3

    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="a", max_tokens=1, extra_headers={"x-request-id": "req-1"}
    )
    assert raw.headers["x-request-id"] == "req-1"

    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hello", temperature=3)
    assert bad.value.status_code == 400
    assert bad.value.code == "decimal_above_max_value"
    assert bad.value.param == "temperature"
    assert re.fullmatch(r"[0-9a-f]{32}", bad.value.response.headers["x-request-id"])

    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert missing.value.code == "model_not_found"
    assert missing.value.body == {
        "message": "The model `gpt-4o` does not exist or you do not have access to it.",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found",
    }
    # chat, 2 completion choices, the stream, the raw call; errors never reach the engine.
    assert len(engine.submitted) == 5
    assert engine.aborted == []


def test_real_http_stream_disconnect_aborts(live_server: tuple[str, FakeEngine]) -> None:
    base, engine = live_server
    engine.first_token_delay_s = 60
    body = {"model": MODEL, "prompt": "hello", "stream": True}
    with httpx.Client(timeout=5) as client, client.stream(
        "POST", f"{base}/v1/completions", json=body
    ) as response:
        assert response.status_code == 200
        deadline = time.monotonic() + 5
        while not engine.submitted:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    # Leaving the block closed the connection while the engine had produced nothing.
    deadline = time.monotonic() + 3
    while not engine.aborted:
        assert time.monotonic() < deadline, "the engine request was not aborted"
        time.sleep(0.01)
    assert engine.aborted == [engine.submitted[0].request_id]


def test_a_hundred_streams_cut_at_once_are_all_aborted() -> None:
    """Under load the engine hands over an output at the moment the disconnect cancels
    the response: no cancellation may be lost, or that request runs to its end."""
    engine = FakeEngine(max_model_len=4096, token_delay_s=0.01)
    app, _ = make_app(engine)
    num_streams = 100

    async def cut_one(host: str, port: int, i: int) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        body = json.dumps({"model": "fake-model", "max_tokens": 300, "stream": True,
                           "messages": [{"role": "user", "content": f"x{i}"}]}).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % len(body) + body)
        num_chunks = 0
        while num_chunks < 4:
            line = await reader.readline()
            assert line, "the server closed the stream"
            num_chunks += line.startswith(b"data: {")
        writer.close()
        await writer.wait_closed()

    with serve_in_thread(app) as base:
        host, port = base.removeprefix("http://").split(":")

        async def cut_all() -> None:
            await asyncio.gather(*(cut_one(host, int(port), i) for i in range(num_streams)))

        asyncio.run(cut_all())
        deadline = time.monotonic() + 2  # 300 tokens would take 3 s
        while len(engine.aborted) < num_streams:
            assert time.monotonic() < deadline, (len(engine.aborted), len(engine.finished))
            time.sleep(0.05)
    assert not engine.finished


# ----------------------------------------------------- SIGTERM: drain, then stop

_SERVE_FAKE = """
import asyncio, json, sys
from app.server_options import serve_app
from app.core.config import Settings
from app.main import create_app
from tests.utils.fake_engine import FakeEngine

engine = FakeEngine(max_model_len=100_000, token_delay_s=0.02)
settings = Settings(no_auth=True, port=int(sys.argv[1]), drain_timeout_s=float(sys.argv[2]))
asyncio.run(serve_app(create_app(engine, settings), engine, settings))
print(json.dumps({"finished": engine.finished, "aborted": engine.aborted,
                  "shut_down": engine.shut_down}))
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _fake_server_process(drain_timeout_s: float) -> Iterator[tuple[subprocess.Popen[str], str]]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE_FAKE, str(port), str(drain_timeout_s)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.1)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _final_state(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """What the fake engine saw, printed by the server process after a clean exit."""
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    return dict(json.loads(stdout.strip().splitlines()[-1]))


def _sigterm_during_stream(drain_timeout_s: float, max_tokens: int) -> tuple[str, dict[str, Any]]:
    """Start a stream, SIGTERM the server after its first chunk; (body read, final state)."""
    with _fake_server_process(drain_timeout_s) as (proc, base):
        body = {"model": MODEL, "prompt": "abc", "max_tokens": max_tokens, "stream": True}
        text = ""
        with httpx.Client(timeout=30) as client, client.stream(
            "POST", f"{base}/v1/completions", json=body
        ) as response:
            chunks = response.iter_text()
            text += next(chunks)
            proc.send_signal(signal.SIGTERM)
            try:
                for chunk in chunks:
                    text += chunk
            except httpx.TransportError:
                pass  # cut off at the end of the drain
        return text, _final_state(proc)


def test_sigterm_lets_in_flight_requests_finish() -> None:
    text, state = _sigterm_during_stream(drain_timeout_s=20, max_tokens=30)
    assert text.endswith("data: [DONE]\n\n")
    assert "".join(e["choices"][0]["text"] for e in parse_sse(text)[:-1]) == "abc" * 10
    assert len(state["finished"]) == 1 and state["aborted"] == []
    assert state["shut_down"] is True


def test_sigterm_aborts_what_outlives_the_drain_timeout() -> None:
    started = time.monotonic()
    text, state = _sigterm_during_stream(drain_timeout_s=0.5, max_tokens=5000)
    assert time.monotonic() - started < 20  # 5000 tokens would take 100 s
    assert "[DONE]" not in text
    assert state["finished"] == [] and len(state["aborted"]) == 1
    assert state["shut_down"] is True


def test_sigterm_turns_an_unfinished_plain_request_into_a_503() -> None:
    with _fake_server_process(drain_timeout_s=0.5) as (proc, base):
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 5000}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(httpx.post, f"{base}/v1/completions", json=body, timeout=30)
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            response = future.result()
        state = _final_state(proc)
    assert response.status_code == 503
    assert response.json() == {"error": {
        "message": "The server is shutting down; retry the request.", "type": "server_error",
        "param": None, "code": "overloaded"}}
    assert len(state["aborted"]) == 1 and state["finished"] == []
