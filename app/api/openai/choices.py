"""What the engine produced for each choice of a request, and the usage it adds up to."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from app.api.openai.plan import GenerationPlan
from app.api.openai.protocol import PromptTokensDetails, UsageInfo
from engine.request import RequestOutput, TokenLogprob


@dataclass(slots=True)
class ChoiceResult:
    """Everything one choice produced so far."""

    text_parts: list[str] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    # With prompt logprobs: one per prompt token (the first None), from the first output.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add(self, output: RequestOutput) -> None:
        if output.new_token_ids and self.first_token_time is None:
            self.first_token_time = time.monotonic()
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.text_parts.append(output.new_text)
        self.token_texts.extend(output.new_token_texts)
        self.logprobs.extend(output.new_logprobs)
        self.num_prompt_tokens = output.num_prompt_tokens
        self.num_output_tokens = output.num_output_tokens
        self.num_cached_tokens = output.num_cached_tokens
        if output.finished:
            self.finish_reason = output.finish_reason


def new_results(plan: GenerationPlan) -> list[ChoiceResult]:
    return [ChoiceResult() for _ in range(plan.num_choices)]


def usage_of(plan: GenerationPlan, results: Sequence[ChoiceResult]) -> UsageInfo:
    # Each prompt is counted once however many choices share it, as OpenAI does;
    # it counts as cached only as far as every one of its choices found it cached.
    num_prompt = plan.num_prompt_tokens
    # echo_only: the one token sampled with the prompt's logprobs is neither shown nor billed.
    num_completion = 0 if plan.echo_only else sum(r.num_output_tokens for r in results)
    n = plan.choices_per_prompt
    num_cached = sum(
        min((r.num_cached_tokens for r in results[p * n:(p + 1) * n]), default=0)
        for p in range(len(plan.prompts))
    )
    return UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
    )
