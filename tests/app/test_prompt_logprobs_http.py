"""Prompt logprobs over HTTP with the OpenAI SDK, a real engine on a tiny random model and
a PEFT adapter: `echo` with `logprobs` (and `max_tokens: 0`, lm-eval's log-likelihood
call) and vLLM's `prompt_logprobs`, against Hugging Face's log-softmax on the same
weights; and what the API refuses."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.utils.hf_oracle import hf_model, peft_model
from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.tiny_models import random_prompt
from tests.utils.tiny_server import Served, serve_with_adapter

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def served(tiny_model_factory: Callable[[str], Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    base = tiny_model_factory("llama_gqa")
    adapter = make_peft_adapter(base, tmp_path_factory.mktemp("plp") / "tuned", r=8, alpha=16,
                                targets=("q_proj", "v_proj", "o_proj"), seed=31)
    with serve_with_adapter(base, adapter) as served:
        yield served


@pytest.fixture
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0)


@torch.inference_mode()
def oracle(served: Served, prompt: list[int], adapter: bool) -> torch.Tensor:
    if adapter:
        model = peft_model(str(served.model_dir), (("tuned", str(served.adapter)),))
        model.set_adapter("tuned")  # type: ignore[operator]
    else:
        model = hf_model(str(served.model_dir))
    logits = model(torch.tensor([prompt])).logits[0].float()  # type: ignore[operator]
    return torch.log_softmax(logits, dim=-1)


def assert_echoed(logprobs: Any, want: torch.Tensor, prompt: list[int], num_top: int) -> None:
    values = logprobs.token_logprobs[:len(prompt)]
    assert values[0] is None and logprobs.top_logprobs[0] is None
    for position in range(1, len(prompt)):
        row = want[position - 1]
        assert abs(values[position] - row[prompt[position]].item()) < TOLERANCE, position
        assert len(logprobs.top_logprobs[position]) <= num_top
        best = max(logprobs.top_logprobs[position].values())
        assert abs(best - row.max().item()) < TOLERANCE


@pytest.mark.parametrize("model", ["base", "tuned"])
def test_echo_with_logprobs_and_no_new_tokens(
    client: openai.OpenAI, served: Served, model: str
) -> None:
    """lm-eval's log-likelihood request: the prompt's logprobs and nothing generated."""
    prompt = random_prompt(29, seed=3)
    name = served.model_id if model == "base" else model
    done = client.completions.create(model=name, prompt=prompt, max_tokens=0, echo=True,
                                     logprobs=2, temperature=0)
    choice = done.choices[0]
    assert choice.logprobs is not None
    assert len(choice.logprobs.tokens) == len(prompt)
    assert_echoed(choice.logprobs, oracle(served, prompt, model == "tuned"), prompt, 2)
    assert "".join(choice.logprobs.tokens) == choice.text  # the prompt, nothing after it
    offsets = choice.logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(prompt), 0)


def test_echo_with_logprobs_then_the_completion(client: openai.OpenAI, served: Served) -> None:
    prompt = random_prompt(17, seed=4)
    done = client.completions.create(model=served.model_id, prompt=prompt, max_tokens=3,
                                     echo=True, logprobs=1, temperature=0)
    choice = done.choices[0]
    assert choice.logprobs is not None
    assert len(choice.logprobs.tokens) == len(prompt) + 3
    assert all(v is not None for v in choice.logprobs.token_logprobs[len(prompt):])
    assert_echoed(choice.logprobs, oracle(served, prompt, False), prompt, 1)
    echo = "".join(choice.logprobs.tokens[:len(prompt)])
    assert choice.text.startswith(echo)
    assert choice.logprobs.text_offset[len(prompt)] == len(echo)
    # Streamed, the same: the prompt's part in the first chunk.
    chunks = list(client.completions.create(model=served.model_id, prompt=prompt,
                                            max_tokens=3, echo=True, logprobs=1,
                                            temperature=0, stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs
                for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == choice.logprobs.token_logprobs
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text


def test_prompt_logprobs_on_completions_and_chat(client: openai.OpenAI, served: Served) -> None:
    prompt = random_prompt(21, seed=8)
    done = client.completions.create(model="tuned", prompt=prompt, max_tokens=2,
                                     temperature=0, extra_body={"prompt_logprobs": 3})
    entries = done.choices[0].model_dump()["prompt_logprobs"]
    want = oracle(served, prompt, True)
    assert len(entries) == len(prompt) and entries[0] is None
    for position in range(1, len(prompt)):
        by_id = entries[position]
        token = by_id[str(prompt[position])]
        assert abs(token["logprob"] - want[position - 1][prompt[position]].item()) < TOLERANCE
        assert token["rank"] >= 1 and isinstance(token["decoded_token"], str)
        best = want[position - 1].topk(3)
        for rank, token_id in enumerate(best.indices.tolist(), start=1):
            if token_id != prompt[position]:
                assert by_id[str(token_id)]["rank"] == rank
    assert done.choices[0].logprobs is None  # not asked for
    # Chat: the templated prompt's tokens, at the response's top level (as vLLM has them).
    chat = client.chat.completions.create(
        model=served.model_id, messages=[{"role": "user", "content": "Name a color."}],
        max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0},
    )
    listed = chat.model_dump()["prompt_logprobs"]
    assert listed[0] is None and all(len(e) == 1 for e in listed[1:])
    # Without the field, responses carry no prompt_logprobs key at all.
    plain = client.completions.create(model=served.model_id, prompt=prompt, max_tokens=1)
    assert "prompt_logprobs" not in plain.choices[0].model_dump(exclude_unset=True)


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ({"max_tokens": 1, "extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    ({"max_tokens": 1, "extra_body": {"prompt_logprobs": -1}}, "prompt_logprobs"),
    ({"max_tokens": 1, "echo": True, "logprobs": 6}, "logprobs"),
])
def test_what_is_refused(client: openai.OpenAI, served: Served, kwargs: dict[str, Any],
                         param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=served.model_id, prompt=[5, 6, 7], **kwargs)
    assert info.value.body["param"] == param  # type: ignore[index]


def test_chat_prompt_logprobs_are_not_streamed(client: openai.OpenAI, served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=served.model_id, messages=[{"role": "user", "content": "hi"}],
            max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1},
        )
    assert info.value.body["param"] == "prompt_logprobs"  # type: ignore[index]
