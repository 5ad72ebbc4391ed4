"""Request factories for engine tests: no tokenizer, no model, deterministic token ids."""

from __future__ import annotations

from typing import Any

from engine.core.state import Request
from engine.request import SamplingParams


def make_request(
    request_id: str,
    prompt: int | list[int],
    *,
    max_tokens: int = 16,
    priority: int = 0,
    adapter_id: str | None = None,
    salt: str | None = None,
    arrival_time: float | None = None,
    first_token: int = 0,
    eos_token_id: int | None = None,
    **sampling: Any,
) -> Request:
    """A request whose prompt is `prompt` (token ids) or, for an int n, the ids
    first_token .. first_token + n - 1. Extra keywords go to SamplingParams."""
    if isinstance(prompt, int):
        token_ids = list(range(first_token, first_token + prompt))
    else:
        token_ids = list(prompt)
    extra: dict[str, Any] = {} if arrival_time is None else {"arrival_time": arrival_time}
    return Request(
        request_id=request_id,
        prompt_token_ids=token_ids,
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),
        eos_token_id=eos_token_id,
        adapter_id=adapter_id,
        salt=salt,
        priority=priority,
        **extra,
    )
