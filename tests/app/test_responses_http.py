"""POST /v1/responses with the real `openai` SDK, over real HTTP on a real engine (a tiny
random model): the same answer as the chat completion it amounts to, the typed event
stream, usage rows, and what a stateless server refuses."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from app.tables import UsageRecord
from engine.async_engine import AsyncEngine
from tests.utils.real_service import real_service, usage_rows
from tests.utils.saas import create_key, create_tenant

NEW_TOKENS = 6
QUESTION = "Name three colours."
INSTRUCTIONS = "Answer in one word."


@dataclass
class Service:
    base_url: str
    engine: AsyncEngine
    database_url: str
    key: str
    limited_key: str  # a tenant whose max_tokens is 4

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=key or self.key, max_retries=0
        )

    def chat_text(self, messages: list[dict[str, str]]) -> tuple[str, int]:
        response = self.client().chat.completions.create(
            model=self.engine.model_id, messages=messages,  # type: ignore[arg-type]
            max_completion_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        )
        assert response.usage is not None
        return response.choices[0].message.content or "", response.usage.prompt_tokens


@pytest.fixture(scope="module")
def service(
    tiny_model_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    base = tiny_model_factory("llama_gqa")
    root = tmp_path_factory.mktemp("responses_api")
    with real_service(base, root) as live, \
            httpx.Client(base_url=live.base_url, timeout=60) as admin:
        tenant = create_tenant(admin, "responses-tenant")
        key = create_key(admin, tenant["id"], scopes=["inference"])["key"]
        limited = create_tenant(admin, "responses-limited", max_tokens=4)
        limited_key = create_key(admin, limited["id"], scopes=["inference"])["key"]
        yield Service(live.base_url, live.engine, live.database_url, key, limited_key)


def test_a_response_is_the_chat_completion_it_amounts_to(service: Service) -> None:
    expected, prompt_tokens = service.chat_text(
        [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    )
    response = service.client().responses.create(
        model=service.engine.model_id, instructions=INSTRUCTIONS, input=QUESTION,
        max_output_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True},
    )
    assert response.id.startswith("resp_")
    assert response.object == "response"
    assert response.output_text == expected
    # Cut short by max_output_tokens, as OpenAI reports it.
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant"
    assert response.usage is not None
    assert response.usage.input_tokens == prompt_tokens
    assert response.usage.output_tokens == NEW_TOKENS
    assert response.usage.total_tokens == prompt_tokens + NEW_TOKENS
    assert response.instructions == INSTRUCTIONS
    assert response.store is False
    rows = usage_rows(service.database_url, UsageRecord.request_id == response.id)
    assert [(r.prompt_tokens, r.completion_tokens, r.status) for r in rows] == [
        (prompt_tokens, NEW_TOKENS, "ok")
    ]


def test_input_items_render_as_the_chat_history(service: Service) -> None:
    history = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there"},
        {"role": "user", "content": QUESTION},
    ]
    expected, _ = service.chat_text(history)
    items = [
        {"type": "message", "role": "user", "content": "Hello"},
        # What the SDK sends back from an earlier response: output_text parts, an id.
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Hi there", "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    response = service.client().responses.create(
        model=service.engine.model_id, input=items,  # type: ignore[arg-type]
        max_output_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True},
    )
    assert response.output_text == expected


def test_the_stream_sends_openai_typed_events(service: Service) -> None:
    client = service.client()
    whole = client.responses.create(
        model=service.engine.model_id, input=QUESTION, max_output_tokens=NEW_TOKENS,
        temperature=0, extra_body={"ignore_eos": True},
    )
    events = list(client.responses.create(
        model=service.engine.model_id, input=QUESTION, max_output_tokens=NEW_TOKENS,
        temperature=0, extra_body={"ignore_eos": True}, stream=True,
    ))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == whole.output_text
    assert final.usage is not None and final.usage.output_tokens == NEW_TOKENS
    assert final.id == events[0].response.id  # type: ignore[union-attr]
    rows = usage_rows(service.database_url, UsageRecord.request_id == final.id)
    assert [(r.completion_tokens, r.status) for r in rows] == [(NEW_TOKENS, "ok")]


def test_previous_response_id_is_refused_by_a_stateless_server(service: Service) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        service.client().responses.create(
            model=service.engine.model_id, input=QUESTION, previous_response_id="resp_123",
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == "previous_response_id"
    assert error["code"] == "unsupported_parameter"


def test_refusals_name_the_responses_fields(service: Service) -> None:
    client = service.client(service.limited_key)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=service.engine.model_id, input=QUESTION,
                                max_output_tokens=10)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == "max_output_tokens"
    assert error["code"] == "max_tokens_exceeded"
    assert "'max_output_tokens' is 10" in error["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=service.engine.model_id, input=[])
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["param"] == "input"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input=QUESTION)
