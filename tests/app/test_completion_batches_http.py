"""Completions as the `openai` SDK, litellm and lm-eval send them, over real HTTP on a real
engine (a tiny random model): several prompts in one request, `echo`, OpenAI's
context-length error, and `models.retrieve` for every model the caller may use."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import Completion

from app.tables import UsageRecord
from engine.async_engine import AsyncEngine
from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.real_service import real_service, usage_rows
from tests.utils.saas import (
    ADMIN_KEY,
    create_key,
    create_tenant,
    upload_adapter,
)

NEW_TOKENS = 5
TEXTS = ["The capital of France is", "One, two, three,"]
TOKEN_PROMPTS = [[1, 422, 3107, 314, 253], [1, 1379, 30, 28, 9, 77]]
PRELOADED = "org/team:lora-v1"  # '/' and ':' are allowed in `--lora` names
OWN = "a-bot"
SHARED = "shared-bot"


@dataclass
class Service:
    base_url: str
    engine: AsyncEngine
    database_url: str
    keys: dict[str, str]  # "a", "b" -> key

    def client(self, who: str = "a") -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=self.keys[who], max_retries=0
        )

    def complete(self, prompt: Any, **fields: Any) -> Completion:
        fields.setdefault("max_tokens", NEW_TOKENS)
        return self.client().completions.create(
            model=self.engine.model_id, prompt=prompt, temperature=0,
            extra_body={"ignore_eos": True}, **fields,
        )

    def stream(self, prompt: Any, **fields: Any) -> openai.Stream[Completion]:
        return self.client().completions.create(
            model=self.engine.model_id, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"ignore_eos": True}, stream=True, **fields,
        )

    def single(self, prompt: str | list[int]) -> tuple[str, int]:
        """The greedy text of `prompt` alone, and its number of prompt tokens."""
        response = self.complete(prompt)
        assert response.usage is not None
        return response.choices[0].text, response.usage.prompt_tokens

    def usage_row(self, request_id: str) -> UsageRecord:
        """The request's usage row, once the background writer has flushed it."""
        rows = usage_rows(self.database_url, UsageRecord.request_id == request_id)
        assert len(rows) == 1, rows
        return rows[0]


@pytest.fixture(scope="module")
def service(
    tiny_model_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    base = tiny_model_factory("llama_gqa")
    root = tmp_path_factory.mktemp("completion_batches")
    lora = make_peft_adapter(base, root / "lora", r=2, alpha=4, seed=21)
    with real_service(base, root, loras={PRELOADED: lora}, engine_options={"max_loras": 2}
                      ) as live, httpx.Client(base_url=live.base_url, timeout=60) as admin:
        keys = {}
        for who in ("a", "b"):
            tenant = create_tenant(admin, f"tenant-{who}")
            keys[who] = create_key(
                admin, tenant["id"], scopes=["inference", "adapters:write"]
            )["key"]
        for key, name, path in [(keys["a"], OWN, "/v1/adapters"),
                                (ADMIN_KEY, SHARED, "/admin/adapters")]:
            response = upload_adapter(admin, key, name, lora, path=path)
            assert response.status_code == 201, response.text
        yield Service(live.base_url, live.engine, live.database_url, keys)


# ------------------------------------------------------------------- several prompts


@pytest.mark.parametrize("prompts", [TEXTS, TOKEN_PROMPTS], ids=["texts", "token-ids"])
def test_each_prompt_is_its_own_choices(service: Service, prompts: list[Any]) -> None:
    singles = [service.single(p) for p in prompts]
    assert singles[0][0] != singles[1][0]
    response = service.complete(prompts, n=2)
    # Prompt-major, as OpenAI orders them: prompt p's i-th choice is p * n + i.
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.text for c in response.choices] == [text for text, _ in singles for _ in (0, 1)]
    assert {c.finish_reason for c in response.choices} == {"length"}
    usage = response.usage
    assert usage is not None
    # Each prompt counted once, however many choices it has.
    assert usage.prompt_tokens == sum(n for _, n in singles)
    assert usage.completion_tokens == 4 * NEW_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    row = service.usage_row(response.id)
    assert (row.prompt_tokens, row.completion_tokens, row.status) == (
        usage.prompt_tokens, usage.completion_tokens, "ok"
    )


def test_several_prompts_stream_with_their_choice_indices(service: Service) -> None:
    singles = [service.single(p) for p in TEXTS]
    stream = service.stream(TEXTS, stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    finished: dict[int, str | None] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert texts == {0: singles[0][0], 1: singles[1][0]}
    assert finished == {0: "length", 1: "length"}
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        singles[0][1] + singles[1][1], 2 * NEW_TOKENS
    )


def test_prompts_times_n_is_bounded(service: Service) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        service.complete(["a"] * 5, n=4)
    assert info.value.param == "prompt"
    assert "at most 16 completions (prompts times 'n'), got 5 prompts times 4" in str(
        info.value.message
    )


# ----------------------------------------------------------------------------- echo


def test_echo_prepends_each_prompt(service: Service) -> None:
    singles = [service.single(p) for p in TEXTS]
    response = service.complete(TEXTS, echo=True)
    assert [c.text for c in response.choices] == [p + t for p, (t, _) in zip(
        TEXTS, singles, strict=True
    )]
    stream = service.stream(TEXTS, echo=True)
    chunks: dict[int, list[str]] = {}
    for chunk in stream:
        for choice in chunk.choices:
            chunks.setdefault(choice.index, []).append(choice.text)
    for index, prompt in enumerate(TEXTS):
        first, *rest = chunks[index]
        assert first.startswith(prompt) and first != prompt  # the prompt and the first token
        assert first + "".join(rest) == prompt + singles[index][0]


def test_echo_with_logprobs_starts_with_each_prompts(service: Service) -> None:
    """Each choice's logprobs start with its own prompt's tokens (the first null), then
    its completion's (tests/app/test_prompt_logprobs_http.py checks the values)."""
    response = service.complete(TEXTS, echo=True, logprobs=1, max_tokens=2)
    for prompt, choice in zip(TEXTS, response.choices, strict=True):
        assert choice.logprobs is not None and choice.text.startswith(prompt)
        values = choice.logprobs.token_logprobs
        assert values[0] is None and all(v is not None for v in values[1:])
        echoed = len(values) - 2  # the prompt's tokens, then the two generated
        assert "".join(choice.logprobs.tokens[:echoed]) == prompt


# ---------------------------------------------------------------- context length


def test_context_length_error_is_openai_s(service: Service) -> None:
    context = service.engine.max_model_len
    with pytest.raises(openai.BadRequestError) as info:
        service.complete([5] * (context - 2), max_tokens=10)
    # What litellm's exception mapping matches to raise ContextWindowExceededError (which
    # its context-window fallbacks act on): this phrase in a 400 from an OpenAI-compatible
    # server; OpenAI's code along with it.
    assert f"This model's maximum context length is {context} tokens." in info.value.message
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "max_tokens")
    assert f"However, you requested {context + 8} tokens" in info.value.message


# --------------------------------------------------------------------------- models


def test_models_retrieve_returns_the_listed_objects(service: Service) -> None:
    client = service.client("a")
    listed = {m.id: m.model_dump() for m in client.models.list().data}
    assert set(listed) == {service.engine.model_id, OWN, SHARED, PRELOADED}
    for model_id, card in listed.items():
        assert client.models.retrieve(model_id).model_dump() == card, model_id
    versioned = client.models.retrieve(f"{OWN}@1").model_dump()
    assert versioned == {**listed[OWN], "id": f"{OWN}@1"}


def test_models_retrieve_hides_what_the_caller_may_not_use(service: Service) -> None:
    client = service.client("b")
    assert client.models.retrieve(SHARED).id == SHARED
    bodies = []
    for model_id in (OWN, f"{OWN}@1", "no-such-model", "av/some-version"):
        with pytest.raises(openai.NotFoundError) as info:
            client.models.retrieve(model_id)
        assert info.value.code == "model_not_found"
        bodies.append(info.value.response.text.replace(model_id, "<id>"))
    assert len(set(bodies)) == 1, bodies
