"""Load for the chaos tests: plain and streamed requests whose every outcome is kept, and
the usage rows to hold them against."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from sqlalchemy import create_engine, select

from app.tables import UsageRecord
from tests.utils.saas import bearer

# Streams the client cuts ask for this many tokens: far more than it waits for.
CUT_MAX_TOKENS = 60


@dataclass(slots=True)
class Outcome:
    tenant: str
    kind: str  # "plain", "stream", or "cut" (a stream the client left mid-way)
    status: int  # 0: no HTTP answer (connection refused or closed)
    started: float  # time.monotonic()
    response_id: str | None = None
    usage: dict[str, Any] | None = None
    done: bool = False  # a stream that ended with [DONE]
    num_chunks: int = 0
    retry_after: str | None = None
    code: str | None = None

    @property
    def served(self) -> bool:
        return self.status == 200


@dataclass(slots=True)
class Tenant:
    name: str
    key: str
    outcomes: list[Outcome] = field(default_factory=list)


def _error(outcome: Outcome, response: httpx.Response, body: bytes) -> Outcome:
    outcome.retry_after = response.headers.get("retry-after")
    try:
        outcome.code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        outcome.code = None
    return outcome


async def plain(
    client: httpx.AsyncClient, tenant: Tenant, model: str, *, max_tokens: int = 6
) -> Outcome:
    outcome = Outcome(tenant.name, "plain", 0, time.monotonic())
    body = {"model": model, "prompt": "Tell me a story", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}
    try:
        response = await client.post("/v1/completions", json=body, headers=bearer(tenant.key))
    except httpx.TransportError:
        tenant.outcomes.append(outcome)
        return outcome
    outcome.status = response.status_code
    if response.status_code == 200:
        data = response.json()
        outcome.response_id, outcome.usage = data["id"], data["usage"]
    else:
        _error(outcome, response, response.content)
    tenant.outcomes.append(outcome)
    return outcome


async def stream(
    client: httpx.AsyncClient,
    tenant: Tenant,
    model: str,
    *,
    max_tokens: int = 12,
    cut_after: int | None = None,
    on_first_chunk: asyncio.Event | None = None,
    outcome: Outcome | None = None,
) -> Outcome:
    """A chat stream with usage; `cut_after` chunks: the client closes the connection.
    `outcome`: filled in as the stream goes, for a caller that watches it."""
    kind = "stream" if cut_after is None else "cut"
    if outcome is None:
        outcome = Outcome(tenant.name, kind, 0, time.monotonic())
    try:
        await _read_stream(client, tenant, model, outcome, max_tokens, cut_after, on_first_chunk)
    finally:
        tenant.outcomes.append(outcome)  # once over, as the other requests are
    return outcome


async def _read_stream(
    client: httpx.AsyncClient,
    tenant: Tenant,
    model: str,
    outcome: Outcome,
    max_tokens: int,
    cut_after: int | None,
    on_first_chunk: asyncio.Event | None,
) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Go on"}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers=bearer(tenant.key)
        ) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                _error(outcome, response, await response.aread())
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line.removeprefix("data: ")
                if payload == "[DONE]":
                    outcome.done = True
                    break
                chunk = json.loads(payload)
                outcome.response_id = chunk.get("id", outcome.response_id)
                if chunk.get("usage"):
                    outcome.usage = chunk["usage"]
                if chunk.get("choices"):
                    outcome.num_chunks += 1
                    if on_first_chunk is not None:
                        on_first_chunk.set()
                if cut_after is not None and outcome.num_chunks >= cut_after:
                    return  # leaving the block closes the connection
    except httpx.TransportError:
        pass  # kept as it stands: status 200 without [DONE], or 0


async def mixed_loop(
    client: httpx.AsyncClient, tenant: Tenant, model: str, stop: asyncio.Event,
    *, worker: int, max_requests: int = 400,
) -> None:
    """Plain, streamed and cut requests in turn until `stop` (bounded)."""
    for i in range(max_requests):
        if stop.is_set():
            return
        turn = (i + worker) % 4
        if turn == 0:
            await plain(client, tenant, model)
        elif turn == 3:
            await stream(client, tenant, model, max_tokens=CUT_MAX_TOKENS, cut_after=2)
        else:
            await stream(client, tenant, model)
        await asyncio.sleep(0.01)


def usage_rows(database_url: str) -> dict[str, Any]:
    """request_id -> usage row, read straight from the database."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(UsageRecord.__table__)).all()
        return {row.request_id: row for row in rows}
    finally:
        engine.dispose()


def check_usage_matches(outcomes: list[Outcome], rows: dict[str, Any]) -> None:
    """One row per served response, none for the rest; complete ones bill what they
    reported, cut ones are `aborted`."""
    served = {o.response_id or "": o for o in outcomes if o.served}
    assert "" not in served, "a served response without an id"
    assert len(served) == sum(o.served for o in outcomes), "two responses with one id"
    assert set(rows) == set(served), (
        f"{len(set(served) - set(rows))} served responses without a row, "
        f"{len(set(rows) - set(served))} rows for no served response"
    )
    for request_id, outcome in served.items():
        row = rows[request_id]
        if outcome.kind == "cut":
            assert row.status == "aborted", (row.status, outcome)
            assert 0 < row.completion_tokens < CUT_MAX_TOKENS
            continue
        assert row.status == "ok", (row.status, outcome)
        assert outcome.usage is not None, outcome
        assert (row.prompt_tokens, row.completion_tokens) == (
            outcome.usage["prompt_tokens"], outcome.usage["completion_tokens"]
        ), outcome
