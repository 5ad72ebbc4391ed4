"""Engine outputs as OpenAI responses: whole objects and SSE chunk streams."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from pydantic import BaseModel

from app.api.accounting import usage_of
from app.api.errors import APIError
from app.api.generation import SSE_DONE, ChoiceResult, collect, run_choices, sse_error, sse_event
from app.api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    FinishReason,
    TopLogprob,
    UsageInfo,
)
from app.api.serving import GenerationPlan
from app.api.state import AppState
from engine.client import EngineClient
from engine.request import TokenLogprob


def _finish_reason(reason: str | None) -> FinishReason | None:
    assert reason in (None, "stop", "length"), f"unexpected finish reason {reason!r}"
    return reason  # type: ignore[return-value]


def _token_texts(
    engine: EngineClient, logprobs: Sequence[TokenLogprob], texts: Sequence[str]
) -> list[str]:
    # The engine gives each chosen token's text; fall back to the vocabulary if not.
    return [
        texts[i] if i < len(texts) else engine.token_text(lp.token_id)
        for i, lp in enumerate(logprobs)
    ]


def completion_logprobs(
    engine: EngineClient,
    logprobs: Sequence[TokenLogprob],
    texts: Sequence[str],
    *,
    num_top: int,
    text_offset: int,
) -> CompletionLogprobs:
    """`text_offset` is where the first token starts in the completion's text."""
    out = CompletionLogprobs()
    for lp, text in zip(logprobs, _token_texts(engine, logprobs, texts), strict=True):
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({engine.token_text(t): v for t, v in lp.top[:num_top]})
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out


def chat_logprobs(
    engine: EngineClient, logprobs: Sequence[TokenLogprob], texts: Sequence[str], *, num_top: int
) -> ChatLogprobs:
    content = []
    for lp, text in zip(logprobs, _token_texts(engine, logprobs, texts), strict=True):
        top = []
        for token_id, value in lp.top[:num_top]:
            alt = engine.token_text(token_id)
            top.append(TopLogprob(token=alt, logprob=value, bytes=list(alt.encode())))
        content.append(
            ChatTokenLogprob(
                token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top
            )
        )
    return ChatLogprobs(content=content)


def _num_top(plan: GenerationPlan) -> int | None:
    return plan.sampling[0].logprobs


def _echo(plan: GenerationPlan, index: int) -> str:
    """What choice `index`'s text starts with: its prompt with `echo`, else nothing."""
    return "" if plan.echo_texts is None else plan.echo_texts[plan.prompt_index(index)]


def _chunk(model: BaseModel, plan: GenerationPlan) -> bytes:
    # With include_usage every chunk says `"usage": null` except the last one.
    exclude = None if plan.include_usage else {"usage"}
    return sse_event(model.model_dump_json(exclude=exclude))


# ------------------------------------------------------------------ completions


async def completion_response(state: AppState, plan: GenerationPlan) -> CompletionResponse:
    results = await collect(state, plan)
    num_top = _num_top(plan)
    choices = []
    for index, result in enumerate(results):
        logprobs = None
        if num_top is not None:
            logprobs = completion_logprobs(
                state.engine, result.logprobs, result.token_texts, num_top=num_top, text_offset=0
            )
        choices.append(
            CompletionChoice(
                index=index,
                text=_echo(plan, index) + result.text,
                logprobs=logprobs,
                finish_reason=_finish_reason(result.finish_reason),
            )
        )
    return CompletionResponse(
        id=plan.response_id,
        created=plan.created,
        model=plan.model,
        choices=choices,
        usage=usage_of(plan, results),
    )


async def completion_stream(state: AppState, plan: GenerationPlan) -> AsyncIterator[bytes]:
    results = [ChoiceResult() for _ in range(plan.num_choices)]
    offsets = [0] * plan.num_choices
    # With `echo`, each choice's first chunk carries its prompt.
    unechoed = [_echo(plan, index) for index in range(plan.num_choices)]
    num_top = _num_top(plan)
    outputs = run_choices(state, plan, results)
    try:
        async for index, output in outputs:
            if not (output.new_text or output.new_logprobs or output.finished):
                continue
            text, unechoed[index] = unechoed[index] + output.new_text, ""
            logprobs = None
            if num_top is not None:
                logprobs = completion_logprobs(
                    state.engine, output.new_logprobs, output.new_token_texts,
                    num_top=num_top, text_offset=offsets[index],
                )
            offsets[index] += len(text)
            choice = CompletionChoice(
                index=index,
                text=text,
                logprobs=logprobs,
                finish_reason=_finish_reason(output.finish_reason) if output.finished else None,
            )
            yield _chunk(_completion_chunk(plan, [choice]), plan)
        if plan.include_usage:
            yield _chunk(_completion_chunk(plan, [], usage_of(plan, results)), plan)
        yield SSE_DONE
    except APIError as exc:
        yield sse_error(exc)
    finally:
        await outputs.aclose()


def _completion_chunk(
    plan: GenerationPlan, choices: list[CompletionChoice], usage: UsageInfo | None = None
) -> CompletionResponse:
    return CompletionResponse(
        id=plan.response_id, created=plan.created, model=plan.model, choices=choices, usage=usage
    )


# ------------------------------------------------------------------------- chat


async def chat_response(state: AppState, plan: GenerationPlan) -> ChatCompletionResponse:
    results = await collect(state, plan)
    num_top = _num_top(plan)
    choices = []
    for index, result in enumerate(results):
        logprobs = None
        if num_top is not None:
            logprobs = chat_logprobs(
                state.engine, result.logprobs, result.token_texts, num_top=num_top
            )
        choices.append(
            ChatChoice(
                index=index,
                message=ChatResponseMessage(content=result.text),
                logprobs=logprobs,
                finish_reason=_finish_reason(result.finish_reason),
            )
        )
    return ChatCompletionResponse(
        id=plan.response_id,
        created=plan.created,
        model=plan.model,
        choices=choices,
        usage=usage_of(plan, results),
    )


async def chat_stream(state: AppState, plan: GenerationPlan) -> AsyncIterator[bytes]:
    results = [ChoiceResult() for _ in range(plan.num_choices)]
    num_top = _num_top(plan)
    outputs = run_choices(state, plan, results)
    try:
        for index in range(plan.num_choices):
            delta = DeltaMessage(role="assistant", content="")
            yield _chunk(_chat_chunk(plan, [ChatChunkChoice(index=index, delta=delta)]), plan)
        async for index, output in outputs:
            if output.new_text or output.new_logprobs:
                logprobs = None
                if num_top is not None:
                    logprobs = chat_logprobs(
                        state.engine, output.new_logprobs, output.new_token_texts,
                        num_top=num_top,
                    )
                choice = ChatChunkChoice(
                    index=index, delta=DeltaMessage(content=output.new_text), logprobs=logprobs
                )
                yield _chunk(_chat_chunk(plan, [choice]), plan)
            if output.finished:
                choice = ChatChunkChoice(
                    index=index,
                    delta=DeltaMessage(),
                    finish_reason=_finish_reason(output.finish_reason),
                )
                yield _chunk(_chat_chunk(plan, [choice]), plan)
        if plan.include_usage:
            yield _chunk(_chat_chunk(plan, [], usage_of(plan, results)), plan)
        yield SSE_DONE
    except APIError as exc:
        yield sse_error(exc)
    finally:
        await outputs.aclose()


def _chat_chunk(
    plan: GenerationPlan, choices: list[ChatChunkChoice], usage: UsageInfo | None = None
) -> ChatCompletionChunk:
    return ChatCompletionChunk(
        id=plan.response_id, created=plan.created, model=plan.model, choices=choices, usage=usage
    )
