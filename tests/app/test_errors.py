"""Every bad input gets OpenAI's error body, status code, `param` and `code`."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from app import cli
from app.core.config import Settings
from app.main import begin_drain
from engine.config import EngineConfig
from tests.utils.fake_engine import FakeEngine, asgi_client, make_app, parse_sse

MODEL = "fake-model"
USER = [{"role": "user", "content": "x"}]


def error(message: str, param: str | None = None, code: str | None = None,
          type: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **fields}


# 64-token context; "hello" is 5 tokens.
COMPLETION_CASES = [
    ("empty-prompt", completion(prompt=""), error("'prompt' must not be empty.", "prompt")),
    ("empty-ids", completion(prompt=[]), error("'prompt' must not be empty.", "prompt")),
    ("too-many-prompts", completion(prompt=["a", "b", "c"], n=6), error(
        "Invalid 'prompt': a request may ask for at most 16 completions (prompts times 'n'), "
        "got 3 prompts times 6.", "prompt")),
    ("empty-prompt-in-batch", completion(prompt=["a", ""]), error(
        "'prompt' must not be empty.", "prompt")),
    ("long-prompt-in-batch", completion(prompt=["a", "x" * 64]), error(
        "This model's maximum context length is 64 tokens. However, your prompt resulted in "
        "64 tokens, leaving no room for a completion. Please reduce the length of the prompt.",
        "prompt", "context_length_exceeded")),
    ("negative-id", completion(prompt=[1, -2]), error(
        "Token ids in 'prompt' must be non-negative.", "prompt")),
    ("prompt-fills-context", completion(prompt="x" * 64), error(
        "This model's maximum context length is 64 tokens. However, your prompt resulted in "
        "64 tokens, leaving no room for a completion. Please reduce the length of the prompt.",
        "prompt", "context_length_exceeded")),
    ("prompt-plus-max-tokens", completion(max_tokens=60), error(
        "This model's maximum context length is 64 tokens. However, you requested 65 tokens "
        "(5 in the prompt, 60 in the completion). Please reduce the length of the prompt or "
        "'max_tokens'.", "max_tokens", "context_length_exceeded")),
    ("max-tokens-zero", completion(max_tokens=0), error(
        "'max_tokens' must be at least 1; 0 is only accepted with 'echo' (the prompt alone, "
        "with its logprobs when 'logprobs' is set).", "max_tokens")),
    ("max-tokens-negative", completion(max_tokens=-3), error(
        "Invalid 'max_tokens': must be at least 0, got -3.", "max_tokens",
        "integer_below_min_value")),
    ("temperature-low", completion(temperature=-0.5), error(
        "Invalid 'temperature': must be at least 0, got -0.5.", "temperature",
        "decimal_below_min_value")),
    ("temperature-high", completion(temperature=2.5), error(
        "Invalid 'temperature': must be at most 2, got 2.5.", "temperature",
        "decimal_above_max_value")),
    ("top-p-zero", completion(top_p=0), error(
        "Invalid 'top_p': must be greater than 0, got 0.0.", "top_p",
        "decimal_below_min_value")),
    ("top-p-high", completion(top_p=1.5), error(
        "Invalid 'top_p': must be at most 1, got 1.5.", "top_p", "decimal_above_max_value")),
    ("top-k", completion(top_k=-2), error(
        "Invalid 'top_k': must be at least -1, got -2.", "top_k", "integer_below_min_value")),
    ("n-zero", completion(n=0), error(
        "Invalid 'n': must be at least 1, got 0.", "n", "integer_below_min_value")),
    ("n-high", completion(n=17), error(
        "Invalid 'n': must be at most 16, got 17.", "n", "integer_above_max_value")),
    ("presence", completion(presence_penalty=2.5), error(
        "Invalid 'presence_penalty': must be at most 2, got 2.5.", "presence_penalty",
        "decimal_above_max_value")),
    ("frequency", completion(frequency_penalty=-3), error(
        "Invalid 'frequency_penalty': must be at least -2, got -3.0.", "frequency_penalty",
        "decimal_below_min_value")),
    ("repetition", completion(repetition_penalty=0), error(
        "Invalid 'repetition_penalty': must be at least 0.01, got 0.0.", "repetition_penalty",
        "decimal_below_min_value")),
    ("repetition-huge", completion(repetition_penalty=1e300), error(
        "Invalid 'repetition_penalty': must be at most 100.0, got 1e+300.", "repetition_penalty",
        "decimal_above_max_value")),
    ("priority", completion(priority=-1), error(
        "Invalid 'priority': must be at least 0, got -1.", "priority",
        "integer_below_min_value")),
    ("logprobs", completion(logprobs=6), error(
        "Invalid 'logprobs': must be at most 5, got 6.", "logprobs", "integer_above_max_value")),
    ("too-many-stops", completion(stop=[str(i) for i in range(17)]), error(
        "Invalid 'stop': at most 16 stop sequences are allowed, got 17.", "stop")),
    ("max-tokens-negative-echo", completion(max_tokens=-1, echo=True), error(
        "Invalid 'max_tokens': must be at least 0, got -1.", "max_tokens",
        "integer_below_min_value")),
    ("prompt-logprobs", completion(prompt_logprobs=21), error(
        "Invalid 'prompt_logprobs': must be at most 20, got 21.", "prompt_logprobs",
        "integer_above_max_value")),
    ("logit-bias", completion(logit_bias={"50": 10}), error(
        "'logit_bias' is not supported.", "logit_bias", "unsupported_parameter")),
    ("missing-model", {"prompt": "x"}, error("Missing required parameter: 'model'.", "model")),
    ("missing-prompt", {"model": MODEL}, error("Missing required parameter: 'prompt'.",
                                               "prompt")),
    ("prompt-type", completion(prompt=5), error(
        "Invalid value for 'prompt': Input should be a valid string.", "prompt")),
    ("temperature-type", completion(temperature="hot"), error(
        "Invalid value for 'temperature': Input should be a valid number, unable to parse "
        "string as a number.", "temperature")),
    ("stream-options-type", completion(stream=True, stream_options={"include_usage": "maybe"}),
     error("Invalid value for 'stream_options.include_usage': Input should be a valid "
           "boolean, unable to interpret input.", "stream_options.include_usage")),
]


@pytest.mark.parametrize(("body", "expected"), [c[1:] for c in COMPLETION_CASES],
                         ids=[c[0] for c in COMPLETION_CASES])
async def test_bad_completion_requests(body: dict[str, Any], expected: dict[str, Any]) -> None:
    app, engine = make_app()
    async with asgi_client(app) as client:
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json() == expected
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"])
    assert engine.submitted == []


CHAT_CASES = [
    ("prompt-logprobs-stream", chat(prompt_logprobs=1, stream=True), error(
        "'prompt_logprobs' is not supported with 'stream' on chat completions; send the "
        "request without 'stream'.", "prompt_logprobs")),
    ("no-messages", chat(messages=[]), error(
        "'messages' must contain at least one message.", "messages")),
    ("function-role", chat(messages=[{"role": "function", "content": "x"}]), error(
        "Invalid value for 'messages[0].role': Input should be 'system', 'developer', 'user', "
        "'assistant' or 'tool'.", "messages[0].role")),
    ("image-part", chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), error(
        "Only text content parts are supported, got type 'image_url'.",
        "messages[0].content[1]")),
    ("max-completion-tokens", chat(max_completion_tokens=0), error(
        "Invalid 'max_completion_tokens': must be at least 1, got 0.", "max_completion_tokens",
        "integer_below_min_value")),
    # The fake's template: "<|user|>x\n<|assistant|>" is 23 tokens.
    ("context", chat(max_tokens=64), error(
        "This model's maximum context length is 64 tokens. However, you requested 87 tokens "
        "(23 in the messages, 64 in the completion). Please reduce the length of the messages "
        "or 'max_tokens'.", "max_tokens", "context_length_exceeded")),
    ("long-messages", chat(messages=[{"role": "user", "content": "x" * 60}]), error(
        "This model's maximum context length is 64 tokens. However, your messages resulted in "
        "82 tokens, leaving no room for a completion. Please reduce the length of the "
        "messages.", "messages", "context_length_exceeded")),
    ("top-logprobs-alone", chat(top_logprobs=2), error(
        "'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")),
    ("top-logprobs-high", chat(logprobs=True, top_logprobs=21), error(
        "Invalid 'top_logprobs': must be at most 20, got 21.", "top_logprobs",
        "integer_above_max_value")),
    ("functions", chat(functions=[{"name": "f"}]), error(
        "'functions' (the legacy form of function calling) is not supported; send 'tools'.",
        "functions", "unsupported_parameter")),
    ("tool-choice-unknown", chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                 tool_choice={"type": "function", "function": {"name": "g"}}),
     error("tool_choice names the function 'g', which is not among the request's tools.",
           "tool_choice", "invalid_tool_choice")),
    ("tool-name", chat(tools=[{"type": "function", "function": {"name": "a b"}}]), error(
        "Invalid function name 'a b': names are 1 to 64 letters, digits, underscores and "
        "dashes.", "tools[0].function.name", "invalid_tools")),
    ("schema-missing", chat(response_format={"type": "json_schema",
                                             "json_schema": {"name": "x"}}), error(
        "A 'json_schema' response format needs 'json_schema.schema'.",
        "response_format.json_schema", "invalid_structured_output")),
    ("two-constraints", chat(response_format={"type": "json_object"}, guided_regex="a+"), error(
        "A request may constrain its output one way only; it sent 'response_format', "
        "'guided_regex'.", "guided_regex", "invalid_structured_output")),
    ("tools-and-regex", chat(tools=[{"type": "function", "function": {"name": "f"}}],
                             guided_regex="a+"), error(
        "'guided_regex' cannot be combined with tools the model may call; send "
        "'tool_choice': 'none' to keep the tools out of this turn.", "guided_regex",
        "invalid_structured_output")),
    ("template-refuses", chat(messages=[{"role": "assistant", "content": "RAISE"}]), error(
        "Could not apply the chat template: the template refuses this conversation",
        "messages")),
    ("missing-messages", {"model": MODEL}, error("Missing required parameter: 'messages'.",
                                                 "messages")),
    ("message-type", chat(messages=[{"role": "user", "content": 3}]), error(
        "Invalid value for 'messages[0].content': Input should be a valid string.",
        "messages[0].content")),
]


@pytest.mark.parametrize(("body", "expected"), [c[1:] for c in CHAT_CASES],
                         ids=[c[0] for c in CHAT_CASES])
async def test_bad_chat_requests(body: dict[str, Any], expected: dict[str, Any]) -> None:
    app, engine = make_app()
    async with asgi_client(app) as client:
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json() == expected
    assert engine.submitted == []


def is_context_window_error(status: int, message: str) -> bool:
    """How litellm tells a context-window overflow from other 400s of an OpenAI-compatible
    server (its exception mapping raises ContextWindowExceededError on this phrase, and its
    context-window fallbacks act on that exception)."""
    return status == 400 and "This model's maximum context length is" in message


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", completion(max_tokens=60)),
    ("/v1/completions", completion(prompt="x" * 64)),
    ("/v1/completions", completion(prompt=["hello", "x" * 64])),
    ("/v1/chat/completions", chat(max_tokens=64)),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x" * 60}])),
], ids=["max-tokens", "prompt", "batch", "chat-max-tokens", "chat-messages"])
async def test_context_errors_read_as_openai_s(path: str, body: dict[str, Any]) -> None:
    app, _ = make_app()
    async with asgi_client(app) as client:
        response = await client.post(path, json=body)
    error = response.json()["error"]
    assert is_context_window_error(response.status_code, error["message"]), error
    assert error["message"].startswith("This model's maximum context length is 64 tokens. ")
    assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_unknown_model_is_404(path: str) -> None:
    app, engine = make_app()
    body = completion(model="llama-9000") if "chat" not in path else chat(model="llama-9000")
    async with asgi_client(app) as client:
        response = await client.post(path, json=body, headers={"x-request-id": "r-404"})
    assert response.status_code == 404
    assert response.json() == error(
        "The model `llama-9000` does not exist or you do not have access to it.",
        "model", "model_not_found",
    )
    assert response.headers["x-request-id"] == "r-404"
    assert engine.submitted == []


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b'{"model": "fake-model", ', error(
            "We could not parse the JSON body of your request (Expecting property name "
            "enclosed in double quotes). Send a JSON object with Content-Type: "
            "application/json.")),
        (b'{"model": "\xc3"}', error(
            "We could not parse the JSON body of your request (not UTF-8). Send a JSON object "
            "with Content-Type: application/json.")),
        (b"", error("The request body must be a JSON object.")),
        (b"[1, 2]", error("The request body must be a JSON object.")),
    ],
    ids=["truncated", "not-utf8", "empty", "array"],
)
async def test_malformed_bodies_are_400_not_422(content: bytes, expected: dict[str, Any]) -> None:
    app, _ = make_app()
    async with asgi_client(app) as client:
        response = await client.post(
            "/v1/completions", content=content, headers={"content-type": "application/json"}
        )
    assert response.status_code == 400
    assert response.json() == expected


async def test_json_sent_as_form_data_is_accepted() -> None:
    # What `curl -d '{...}'` sends without -H 'Content-Type: application/json'.
    app, _ = make_app()
    async with asgi_client(app) as client:
        response = await client.post(
            "/v1/completions",
            content=b'{"model": "fake-model", "prompt": "ab", "max_tokens": 2}',
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == "ab"


async def test_unknown_route_and_wrong_method() -> None:
    app, _ = make_app()
    async with asgi_client(app) as client:
        missing = await client.post("/v1/embeddings", json={})
        wrong = await client.get("/v1/completions")
    assert missing.status_code == 404
    assert missing.json() == error("Invalid URL (POST /v1/embeddings).")
    assert wrong.status_code == 405
    assert wrong.json() == error("Method GET is not allowed on /v1/completions.")
    assert "x-request-id" in missing.headers and "x-request-id" in wrong.headers


TOO_LARGE = error("The request body is larger than the limit of 1024 bytes.",
                  code="request_too_large")


async def test_body_over_the_limit_is_413() -> None:
    app, engine = make_app(max_body_bytes=1024)
    async with asgi_client(app) as client:
        response = await client.post(
            "/v1/completions", json=completion(prompt="x" * 1100),
            headers={"x-request-id": "big-1"},
        )
    assert response.status_code == 413
    assert response.json() == TOO_LARGE
    assert response.headers["x-request-id"] == "big-1"
    assert engine.submitted == []


async def _chunks(data: bytes, size: int = 100) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start:start + size]


async def test_chunked_body_is_limited_and_replayed() -> None:
    app, engine = make_app(max_body_bytes=1024)
    big = b'{"model": "fake-model", "prompt": "' + b"x" * 1100 + b'"}'
    small = b'{"model": "fake-model", "prompt": "abc", "max_tokens": 3}'
    async with asgi_client(app) as client:
        too_large = await client.post("/v1/completions", content=_chunks(big))
        fine = await client.post("/v1/completions", content=_chunks(small, 7))
    assert "content-length" not in too_large.request.headers
    assert too_large.status_code == 413
    assert too_large.json() == TOO_LARGE
    assert fine.status_code == 200
    assert fine.json()["choices"][0]["text"] == "abc"
    assert len(engine.submitted) == 1


OVERLOADED = error("The server is overloaded with other requests; retry after a short wait.",
                   code="overloaded", type="server_error")


async def test_overload_is_503_with_retry_after() -> None:
    app, engine = make_app(max_waiting_requests=10, retry_after_s=3)
    async with asgi_client(app) as client:
        engine.num_waiting = 9
        one = await client.post("/v1/completions", json=completion(max_tokens=1))
        two = await client.post("/v1/completions", json=completion(max_tokens=1, n=2))
        engine.num_waiting = 10
        full = await client.post("/v1/chat/completions", json=chat(max_tokens=1))
    assert one.status_code == 200
    for response in (two, full):
        assert response.status_code == 503
        assert response.json() == OVERLOADED
        assert response.headers["retry-after"] == "3"
        assert "x-request-id" in response.headers
    assert len(engine.submitted) == 1


async def test_draining_and_starting_refuse_new_work() -> None:
    app, engine = make_app()
    async with asgi_client(app) as client:
        engine.ready = False
        starting = await client.post("/v1/completions", json=completion(max_tokens=1))
        engine.ready = True
        begin_drain(app)
        draining = await client.post("/v1/chat/completions", json=chat(max_tokens=1))
    assert starting.status_code == 503
    assert starting.json() == error("The engine is still starting; retry shortly.",
                                    code="overloaded", type="server_error")
    assert draining.status_code == 503
    assert draining.json() == error("The server is shutting down; retry on another replica.",
                                    code="overloaded", type="server_error")
    assert draining.headers["retry-after"] == "2"
    assert engine.submitted == []


SERVER_ERROR = error("The server had an error while processing your request.",
                     type="server_error")


async def test_engine_failure_is_500_and_an_error_event_in_streams() -> None:
    app, _ = make_app(FakeEngine(fail_with=RuntimeError("step loop died")))
    async with asgi_client(app) as client:
        plain = await client.post("/v1/completions", json=completion(max_tokens=2))
        stream = await client.post("/v1/chat/completions", json=chat(max_tokens=2, stream=True))
    assert plain.status_code == 500
    assert plain.json() == SERVER_ERROR
    events = parse_sse(stream.text)
    # The role chunk went out before the failure; the stream ends with the error, no [DONE].
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[1:] == [SERVER_ERROR]


async def test_engine_value_error_is_400() -> None:
    app, _ = make_app(FakeEngine(fail_with=ValueError("prompt uses an unknown token id")))
    async with asgi_client(app) as client:
        response = await client.post("/v1/completions", json=completion(max_tokens=2))
    assert response.status_code == 400
    assert response.json() == error("prompt uses an unknown token id")


async def test_engine_abort_is_503() -> None:
    engine = FakeEngine(token_delay_s=0.05)
    app, _ = make_app(engine)

    async def abort_soon() -> None:
        while not engine.submitted:
            await asyncio.sleep(0.005)
        engine.abort(engine.submitted[0].request_id)

    async with asgi_client(app) as client:
        aborter = asyncio.create_task(abort_soon())
        response = await client.post("/v1/completions", json=completion(max_tokens=20))
        await aborter
    assert response.status_code == 503
    assert response.json() == error("The server aborted the request (shutting down); retry it.",
                                    code="overloaded", type="server_error")


async def test_request_timeout_is_504_and_aborts() -> None:
    app, engine = make_app(FakeEngine(first_token_delay_s=30), request_timeout_s=0.2)
    async with asgi_client(app) as client:
        response = await client.post("/v1/completions", json=completion(max_tokens=2))
    assert response.status_code == 504
    assert response.json() == error("The request timed out before generation finished.",
                                    code="timeout", type="server_error")
    assert engine.aborted == [engine.submitted[0].request_id]


async def test_unhandled_exception_is_an_openai_500(monkeypatch: pytest.MonkeyPatch) -> None:
    app, engine = make_app()

    def broken_stats() -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(engine, "stats", broken_stats)
    async with asgi_client(app) as client:
        response = await client.post(
            "/v1/completions", json=completion(max_tokens=1), headers={"x-request-id": "oops"}
        )
    assert response.status_code == 500
    assert response.json() == SERVER_ERROR
    assert response.headers["x-request-id"] == "oops"



# ---------------------------------------------------------------- command line


def _invoke(args: list[str]) -> Any:
    return CliRunner().invoke(cli.main, args)


def test_serve_with_keys_binds_any_host(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Settings] = []

    async def fake_serve_engine(config: EngineConfig, settings: Settings, **_: Any) -> None:
        seen.append(settings)

    monkeypatch.setattr(cli, "serve_engine", fake_serve_engine)
    monkeypatch.setenv("LORAPLEX_ADMIN_KEY", "a-long-enough-admin-key-1234")
    result = _invoke(["serve", "--host", "0.0.0.0"])
    assert result.exit_code == 0, result.output
    [settings] = seen
    assert (settings.host, settings.no_auth) == ("0.0.0.0", False)
    assert settings.admin_key == "a-long-enough-admin-key-1234"


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.4", "example.com", "::"])
def test_no_auth_refuses_non_loopback_hosts(host: str) -> None:
    result = _invoke(["serve", "--no-auth", "--host", host])
    assert result.exit_code == 2
    assert f"only binds a loopback address (127.0.0.1, ::1, localhost), not {host!r}" in (
        result.output
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lora", "nopath"], "expected NAME=PATH, got 'nopath'"),
        (["--lora", "a=/nonexistent"], "'/nonexistent' is not a PEFT adapter directory"),
        (["--block-size", "24"], "block_size must be a positive power of two, got 24"),
        (["--dtype", "int3"], "'int3' is not one of"),
    ],
)
def test_serve_rejects_bad_flags(args: list[str], message: str) -> None:
    result = _invoke(["serve", "--no-auth", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_serve_flags_build_the_engine_config(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[tuple[EngineConfig, Settings]] = []

    async def fake_serve_engine(config: EngineConfig, settings: Settings, **_: Any) -> None:
        seen.append((config, settings))

    monkeypatch.setattr(cli, "serve_engine", fake_serve_engine)
    adapter = tmp_path / "sql"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    result = _invoke([
        "serve", "--no-auth", "--host", "::1", "--port", "9001", "--model", "/models/x",
        "--lora", f"sql={adapter}", "--device", "cpu", "--dtype", "float32",
        "--max-loras", "3", "--max-cpu-loras", "5", "--max-lora-rank", "16",
        "--max-num-seqs", "7", "--max-num-batched-tokens", "512", "--kv-cache-tokens", "4096",
        "--block-size", "32", "--no-enable-prefix-caching",
    ])
    assert result.exit_code == 0, result.output
    [(config, settings)] = seen
    assert config == EngineConfig(
        model="/models/x", device="cpu", dtype="float32", max_loras=3, max_cpu_loras=5,
        max_lora_rank=16, max_num_seqs=7, max_num_batched_tokens=512, kv_cache_tokens=4096,
        block_size=32, enable_prefix_caching=False,
    )
    assert (settings.host, settings.port, settings.no_auth) == ("::1", 9001, True)
    assert settings.preload_loras == {"sql": adapter}


def test_settings_refuse_weak_admin_keys_in_production() -> None:
    with pytest.raises(ValueError, match="LORAPLEX_ADMIN_KEY must be set"):
        Settings(environment="production", admin_key="changeme", secret_key="s" * 32)
    with pytest.raises(ValueError, match="LORAPLEX_SECRET_KEY must be set"):
        Settings(environment="production", admin_key="k" * 32)
    with pytest.raises(ValueError, match="LORAPLEX_SECRET_KEY must be set"):
        Settings(environment="production", admin_key="k" * 32, secret_key="secret")
    settings = Settings(environment="production", admin_key="k" * 32, secret_key="s" * 32)
    assert (settings.admin_key, settings.resolved_secret_key()) == ("k" * 32, "s" * 32)


def test_development_secret_is_generated_once(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    secret = settings.resolved_secret_key()
    assert len(secret) >= 32
    assert Settings(data_dir=tmp_path).resolved_secret_key() == secret
    assert (tmp_path / "secret_key").stat().st_mode & 0o777 == 0o600
