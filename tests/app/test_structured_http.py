"""Structured outputs and tool calls over real HTTP with the real `openai` SDK, on a real
engine (a tiny random model, whose free text is noise: whatever parses here parses
because the grammar made it), through a tenant's adapter and the base model."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from app.tables import UsageRecord
from engine.async_engine import AsyncEngine
from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.real_service import real_service, usage_rows
from tests.utils.saas import create_key, create_tenant, upload_adapter

ADAPTER = "extractor"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string",
                                                              "maxLength": 10}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "address"],
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10},
                   "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    # Strict: no properties beyond those listed, so even random arguments end.
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                      "strict": True}},
    {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
        "required": ["zone"]}}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TOOLS[1]["function"]["parameters"]}
ASK = [{"role": "user", "content": "Tell me about someone."}]


@dataclass
class Service:
    base_url: str
    engine: AsyncEngine
    database_url: str
    key: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.key, max_retries=0)


@pytest.fixture(scope="module")
def service(
    tiny_model_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    base = tiny_model_factory("llama_long")
    root = tmp_path_factory.mktemp("structured_http")
    lora = make_peft_adapter(base, root / "lora", r=4, alpha=8, seed=5)
    with real_service(base, root, engine_options={"max_loras": 2}) as live, \
            httpx.Client(base_url=live.base_url, timeout=60) as admin:
        tenant = create_tenant(admin, "structured-tenant")
        key = create_key(admin, tenant["id"], scopes=["inference", "adapters:write"])["key"]
        uploaded = upload_adapter(admin, key, ADAPTER, lora, path="/v1/adapters")
        assert uploaded.status_code == 201, uploaded.text
        yield Service(live.base_url, live.engine, live.database_url, key)


def _schema_format(schema: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    return {"type": "json_schema",
            "json_schema": {"name": "person", "schema": schema, "strict": strict}}


@pytest.mark.parametrize("model", [ADAPTER, "base"])
@pytest.mark.parametrize("seed", [None, 3])
def test_json_schema_answers_validate(service: Service, model: str, seed: int | None) -> None:
    name = service.engine.model_id if model == "base" else model
    reply = service.client().chat.completions.create(
        model=name, messages=ASK, max_tokens=200, n=2, seed=seed,  # type: ignore[arg-type]
        temperature=0 if seed is None else 1.0,
        response_format=_schema_format(PERSON),  # type: ignore[arg-type]
    )
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


def test_a_streamed_json_schema_answer_validates(service: Service) -> None:
    stream = service.client().chat.completions.create(
        model=ADAPTER, messages=ASK, max_tokens=200, stream=True,  # type: ignore[arg-type]
        response_format=_schema_format(PERSON), logprobs=True, top_logprobs=2,  # type: ignore[arg-type]
    )
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_json_mode_and_the_vllm_fields(service: Service) -> None:
    client = service.client()
    # Any JSON object: a random model may write one string for ever, so only the answers
    # that ended by themselves are whole documents (cut ones end with "length").
    reply = client.chat.completions.create(
        model=ADAPTER, messages=ASK, max_tokens=200, n=8, seed=1,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
    )
    for choice in reply.choices:
        text = choice.message.content or ""
        assert text.lstrip().startswith("{"), text
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert choice.finish_reason == "length"
    completion = client.completions.create(
        model=ADAPTER, prompt="Date:", max_tokens=30,
        extra_body={"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"},
    )
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]", completion.choices[0].text)
    choice = client.completions.create(
        model=ADAPTER, prompt="Pick:", max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert choice.choices[0].text in {"red", "green", "blue"}


def _check_calls(calls: Any, *, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_parse(service: Service, choice: str) -> None:
    tool_choice: Any = "required" if choice == "required" else {
        "type": "function", "function": {"name": "get_time"}}
    reply = service.client().chat.completions.create(
        model=ADAPTER, messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS, tool_choice=tool_choice, temperature=0,  # type: ignore[arg-type]
        # A random model would go on calling for ever: one call per turn.
        parallel_tool_calls=False,
    )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    _check_calls(message.tool_calls, names={"get_time"} if choice == "named"
                 else set(SCHEMAS))


def test_a_tool_round_trip_streamed_and_not(service: Service) -> None:
    client = service.client()
    messages: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.chat.completions.create(
        model=ADAPTER, messages=messages, tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required", parallel_tool_calls=False, temperature=0,
    )
    calls = first.choices[0].message.tool_calls
    _check_calls(calls, names=set(SCHEMAS))
    assert calls is not None and len(calls) == 1
    # The same request streamed: the deltas add up to the same call.
    stream = client.chat.completions.create(
        model=ADAPTER, messages=messages, tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required", parallel_tool_calls=False, temperature=0, stream=True,
    )
    pieces: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                piece = pieces.setdefault(delta.index, {"name": "", "arguments": ""})
                if delta.function and delta.function.name:
                    piece["name"] = delta.function.name
                if delta.function and delta.function.arguments:
                    piece["arguments"] += delta.function.arguments
    assert finish == "tool_calls"
    assert pieces == {0: {"name": calls[0].function.name,
                          "arguments": calls[0].function.arguments}}
    # The call and its result go back into the history, and the model answers.
    alone = client.chat.completions.create(
        model=ADAPTER, messages=messages, max_tokens=1, tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
    )
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump() for call in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temperature": 21}'},
    ]
    answer = client.chat.completions.create(
        model=ADAPTER, messages=messages, max_tokens=8, tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none", temperature=0,
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.usage is not None
    # The history was rendered, not dropped: the prompt grew by the call and its result.
    assert alone.usage is not None
    assert answer.usage.prompt_tokens > alone.usage.prompt_tokens + 20
    rows = usage_rows(service.database_url, UsageRecord.request_id == answer.id)
    assert [r.status for r in rows] == ["ok"]


def test_auto_tool_choice_gives_text_or_valid_calls(service: Service) -> None:
    for seed in range(4):
        reply = service.client().chat.completions.create(
            model=ADAPTER, messages=[{"role": "user", "content": "Hi"}], max_tokens=150,
            tools=TOOLS, tool_choice="auto", temperature=1.0, seed=seed,  # type: ignore[arg-type]
        )
        message = reply.choices[0].message
        if message.tool_calls:
            _check_calls(message.tool_calls, names=set(SCHEMAS))
        else:
            assert "<tool_call>" not in (message.content or "")


def test_responses_function_calls(service: Service) -> None:
    client = service.client()
    response = client.responses.create(
        model=ADAPTER, input="Weather in Oslo?",
        tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER,  # type: ignore[list-item]
                "strict": True}],
        tool_choice="required", parallel_tool_calls=False, temperature=0,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) >= 1
    for call in calls:
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    follow_up = client.responses.create(
        model=ADAPTER, max_output_tokens=5, temperature=0,
        input=[{"role": "user", "content": "Weather in Oslo?"},
               *[{"type": "function_call", "call_id": c.call_id, "name": c.name,
                  "arguments": c.arguments} for c in calls],  # type: ignore[attr-defined]
               *[{"type": "function_call_output", "call_id": c.call_id,  # type: ignore[attr-defined]
                  "output": "sunny"} for c in calls]],
    )
    assert follow_up.usage is not None and follow_up.usage.input_tokens > 0
    schema = client.responses.create(
        model=ADAPTER, input="Someone?", max_output_tokens=200, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,  # type: ignore[typeddict-item]
                         "strict": True}},
    )
    jsonschema.validate(json.loads(schema.output_text), PERSON)


HOSTILE = [
    ("deep", {"response_format": _schema_format(
        json.loads('{"type":"object","properties":{"a":' * 80 + '{"type":"string"}'
                   + "}}" * 80), strict=False)}),
    ("huge-enum", {"response_format": _schema_format(
        {"enum": [f"value-{i}" for i in range(5000)]}, strict=False)}),
    ("long-regex", {"extra_body": {"guided_regex": "(a|b)*" * 2000}}),
]


@pytest.mark.parametrize(("case", "fields"), HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_constraints_are_refused_and_others_stream_on(
    service: Service, case: str, fields: dict[str, Any]
) -> None:
    client = service.client()
    gaps: list[float] = []

    def stream_free() -> None:
        stream = client.chat.completions.create(
            model=ADAPTER, messages=ASK, max_tokens=40, stream=True,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True},
        )
        last = None
        for chunk in stream:
            now = time.monotonic()
            if chunk.choices and chunk.choices[0].delta.content and last is not None:
                gaps.append(now - last)
            last = now

    # The bound comes from the same test: this stream alone first.
    stream_free()
    alone = sorted(gaps)[len(gaps) // 2]
    gaps.clear()
    worker = threading.Thread(target=stream_free)
    worker.start()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=ADAPTER, messages=ASK, max_tokens=20, **fields,  # type: ignore[arg-type]
        )
    worker.join(timeout=120)
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["code"] in {"grammar_too_complex", "grammar_compile_timeout", "invalid_grammar"}
    assert gaps, "the free stream produced nothing"
    # Its median time per token is within a generous multiple of the alone run's.
    median = sorted(gaps)[len(gaps) // 2]
    assert median < 5 * alone + 0.05, (median, alone)


def test_metrics_count_constrained_requests(service: Service) -> None:
    service.client().chat.completions.create(
        model=ADAPTER, messages=ASK, max_tokens=60,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
    )
    text = httpx.get(f"{service.base_url}/metrics").text
    found = re.search(r"^loraplex_structured_requests_total (\d+(\.\d+)?)", text, re.M)
    assert found is not None, text[:2000]
    assert float(found.group(1)) >= 1
    assert "loraplex_grammar_compile_seconds_total" in text


def test_tools_beside_a_json_answer_format(service: Service) -> None:
    """As the OpenAI Agents SDK sends an agent with tools and an output type: `auto`
    gives calls or an answer in the format; `required` can only be calls."""
    client = service.client()
    answer_format = _schema_format({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False})
    seen = set()
    for seed in range(6):
        reply = client.chat.completions.create(
            model=ADAPTER, messages=[{"role": "user", "content": "Where?"}], max_tokens=150,
            tools=TOOLS, tool_choice="auto", parallel_tool_calls=False, seed=seed,  # type: ignore[arg-type]
            temperature=1.0, response_format=answer_format,  # type: ignore[arg-type]
        )
        choice = reply.choices[0]
        if choice.message.tool_calls:
            _check_calls(choice.message.tool_calls, names=set(SCHEMAS))
            seen.add("calls")
        elif choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content or ""),
                                answer_format["json_schema"]["schema"])
            seen.add("answer")
    assert seen, "every answer was cut short"
    forced = client.chat.completions.create(
        model=ADAPTER, messages=[{"role": "user", "content": "Where?"}],
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False,  # type: ignore[arg-type]
        response_format=answer_format,  # type: ignore[arg-type]
    )
    _check_calls(forced.choices[0].message.tool_calls, names=set(SCHEMAS))
