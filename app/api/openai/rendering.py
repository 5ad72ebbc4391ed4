"""Engine outputs as OpenAI responses: whole objects and SSE chunk streams.

Rendering is a pure function of the plan and what the engine produced; running the engine
and accounting for the request are app/api/openai/generation.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from pydantic import BaseModel

from app.api.errors import APIError
from app.api.openai.choices import ChoiceResult
from app.api.openai.plan import GenerationPlan
from app.api.openai.protocol import (
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
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
    UsageInfo,
)
from app.api.openai.streaming import SSE_DONE, sse_error, sse_event
from app.api.openai.tool_calls import ToolCallStreamParser, parse_tool_calls
from engine.request import RequestOutput, TokenLogprob

# The text of one vocabulary token on its own (the engine's `token_text`).
TokenText = Callable[[int], str]


class Renderer(Protocol):
    """How one kind of generation request looks on the wire."""

    def response(self, results: Sequence[ChoiceResult], usage: UsageInfo) -> BaseModel:
        """The whole response, once every choice has finished."""
        ...

    def stream_start(self) -> Iterator[bytes]:
        """SSE events sent before the first output."""
        ...

    def stream_output(self, index: int, output: RequestOutput) -> Iterator[bytes]:
        """SSE events for one engine output of choice `index`."""
        ...

    def stream_end(self, usage: UsageInfo) -> Iterator[bytes]:
        """SSE events after every choice has finished, to the stream's last."""
        ...

    def stream_error(self, exc: APIError) -> Iterator[bytes]:
        """SSE events that end a stream which failed after its headers went out."""
        ...


def _finish_reason(reason: str | None) -> FinishReason | None:
    assert reason in (None, "stop", "length"), f"unexpected finish reason {reason!r}"
    return reason  # type: ignore[return-value]


def _token_texts(
    token_text: TokenText, logprobs: Sequence[TokenLogprob], texts: Sequence[str]
) -> list[str]:
    # The engine gives each chosen token's text; fall back to the vocabulary if not.
    return [
        texts[i] if i < len(texts) else token_text(lp.token_id)
        for i, lp in enumerate(logprobs)
    ]


def completion_logprobs(
    token_text: TokenText,
    logprobs: Sequence[TokenLogprob],
    texts: Sequence[str],
    *,
    num_top: int,
    text_offset: int,
) -> CompletionLogprobs:
    """`text_offset` is where the first token starts in the completion's text."""
    out = CompletionLogprobs()
    for lp, text in zip(logprobs, _token_texts(token_text, logprobs, texts), strict=True):
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({token_text(t): v for t, v in lp.top[:num_top]})
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out


def echo_logprobs(
    token_text: TokenText,
    prompt: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    *,
    num_top: int,
    text_offset: int,
) -> CompletionLogprobs:
    """The echoed prompt's part of a completion's `logprobs`: each prompt token, its
    logprob and top alternatives (null for the first token: nothing precedes it)."""
    out = CompletionLogprobs()
    for token_id, entry in zip(prompt, entries, strict=True):
        text = token_text(token_id)
        out.tokens.append(text)
        out.text_offset.append(text_offset)
        text_offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            out.token_logprobs.append(entry.logprob)
            out.top_logprobs.append({token_text(t): v for t, v in entry.top[:num_top]})
    return out


def joined_logprobs(parts: Sequence[CompletionLogprobs]) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for part in parts:
        out.tokens += part.tokens
        out.token_logprobs += part.token_logprobs
        out.top_logprobs += part.top_logprobs
        out.text_offset += part.text_offset
    return out


def prompt_logprobs_of(
    token_text: TokenText,
    prompt: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    *,
    num_top: int,
) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: per prompt token (the first null), its top `num_top`
    alternatives by token id, and the token itself with its rank."""
    out: PromptLogprobs = []
    for token_id, entry in zip(prompt, entries, strict=True):
        if entry is None:
            out.append(None)
            continue
        by_id = {
            str(t): PromptLogprob(logprob=v, rank=rank, decoded_token=token_text(t))
            for rank, (t, v) in enumerate(entry.top[:num_top], start=1)
        }
        by_id[str(token_id)] = PromptLogprob(
            logprob=entry.logprob, rank=entry.rank, decoded_token=token_text(token_id))
        out.append(by_id)
    return out


def chat_logprobs(
    token_text: TokenText, logprobs: Sequence[TokenLogprob], texts: Sequence[str], *, num_top: int
) -> ChatLogprobs:
    content = []
    for lp, text in zip(logprobs, _token_texts(token_text, logprobs, texts), strict=True):
        top = []
        for token_id, value in lp.top[:num_top]:
            alt = token_text(token_id)
            top.append(TopLogprob(token=alt, logprob=value, bytes=list(alt.encode())))
        content.append(
            ChatTokenLogprob(
                token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top
            )
        )
    return ChatLogprobs(content=content)


def _num_top(plan: GenerationPlan) -> int | None:
    return plan.sampling[0].logprobs


def _chunk(model: BaseModel, plan: GenerationPlan) -> bytes:
    # With include_usage every chunk says `"usage": null` except the last one.
    exclude = None if plan.include_usage else {"usage"}
    return sse_event(model.model_dump_json(exclude=exclude))


class CompletionRenderer:
    """POST /v1/completions."""

    def __init__(self, plan: GenerationPlan, token_text: TokenText) -> None:
        self.plan = plan
        self.token_text = token_text
        self.num_top = _num_top(plan)
        # Streaming: where each choice's next token starts in its text, and, with
        # `echo`, the prompt its first chunk still has to carry.
        self._offsets = [0] * plan.num_choices
        self._unechoed = [self._echo(index) for index in range(plan.num_choices)]

    def _echo(self, index: int) -> str:
        """What choice `index`'s text starts with: its prompt with `echo`, else nothing."""
        plan = self.plan
        return "" if plan.echo_texts is None else plan.echo_texts[plan.prompt_index(index)]

    def _logprobs(
        self, index: int, prompt_entries: Sequence[TokenLogprob | None] | None,
        logprobs: Sequence[TokenLogprob], texts: Sequence[str], *, text_offset: int,
        echoed: str,
    ) -> CompletionLogprobs | None:
        """The choice's `logprobs` from `text_offset` on: with `echo`, the prompt's part
        first (in the output that carries the prompt's logprobs), then the tokens'."""
        if self.num_top is None:
            return None
        plan = self.plan
        parts = []
        if plan.echo_texts is not None and prompt_entries is not None:
            parts.append(echo_logprobs(
                self.token_text, plan.prompt_of(index), prompt_entries, num_top=self.num_top,
                text_offset=text_offset,
            ))
        if not plan.echo_only:
            parts.append(completion_logprobs(
                self.token_text, logprobs, texts, num_top=self.num_top,
                text_offset=text_offset + len(echoed),
            ))
        return joined_logprobs(parts)

    def _prompt_logprobs(
        self, index: int, entries: Sequence[TokenLogprob | None] | None
    ) -> PromptLogprobs | None:
        num_top = self.plan.prompt_logprobs
        if num_top is None or entries is None:
            return None
        return prompt_logprobs_of(self.token_text, self.plan.prompt_of(index), entries,
                                  num_top=num_top)

    def response(self, results: Sequence[ChoiceResult], usage: UsageInfo) -> CompletionResponse:
        echo_only = self.plan.echo_only
        choices = []
        for index, result in enumerate(results):
            echoed = self._echo(index)
            choices.append(CompletionChoice(
                index=index,
                text=echoed + ("" if echo_only else result.text),
                logprobs=self._logprobs(index, result.prompt_logprobs, result.logprobs,
                                        result.token_texts, text_offset=0, echoed=echoed),
                finish_reason=_finish_reason(result.finish_reason),
                prompt_logprobs=self._prompt_logprobs(index, result.prompt_logprobs),
            ))
        return self._object(choices, usage)

    def stream_start(self) -> Iterator[bytes]:
        return iter(())

    def stream_output(self, index: int, output: RequestOutput) -> Iterator[bytes]:
        if not (output.new_text or output.new_logprobs or output.finished
                or output.prompt_logprobs is not None):
            return
        echoed, self._unechoed[index] = self._unechoed[index], ""
        text = echoed + ("" if self.plan.echo_only else output.new_text)
        logprobs = self._logprobs(
            index, output.prompt_logprobs, output.new_logprobs, output.new_token_texts,
            text_offset=self._offsets[index], echoed=echoed,
        )
        self._offsets[index] += len(text)
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=_finish_reason(output.finish_reason) if output.finished else None,
            prompt_logprobs=self._prompt_logprobs(index, output.prompt_logprobs),
        )
        yield _chunk(self._object([choice]), self.plan)

    def stream_end(self, usage: UsageInfo) -> Iterator[bytes]:
        if self.plan.include_usage:
            yield _chunk(self._object([], usage), self.plan)
        yield SSE_DONE

    def stream_error(self, exc: APIError) -> Iterator[bytes]:
        yield sse_error(exc)

    def _object(
        self, choices: list[CompletionChoice], usage: UsageInfo | None = None
    ) -> CompletionResponse:
        plan = self.plan
        return CompletionResponse(
            id=plan.response_id, created=plan.created, model=plan.model, choices=choices,
            usage=usage,
        )


class ChatRenderer:
    """POST /v1/chat/completions; with tools, the calls are parsed out of the text."""

    def __init__(self, plan: GenerationPlan, token_text: TokenText) -> None:
        self.plan = plan
        self.token_text = token_text
        self.num_top = _num_top(plan)
        self._parsers = (
            [ToolCallStreamParser(plan.tools) for _ in range(plan.num_choices)]
            if plan.tools.functions else None
        )

    def _logprobs(
        self, logprobs: Sequence[TokenLogprob], texts: Sequence[str]
    ) -> ChatLogprobs | None:
        if self.num_top is None:
            return None
        return chat_logprobs(self.token_text, logprobs, texts, num_top=self.num_top)

    def _message(self, text: str) -> ChatResponseMessage:
        if self._parsers is None:
            return ChatResponseMessage(content=text)
        content, calls = parse_tool_calls(text, self.plan.tools)
        return ChatResponseMessage(content=content, tool_calls=calls or None)

    def response(
        self, results: Sequence[ChoiceResult], usage: UsageInfo
    ) -> ChatCompletionResponse:
        plan = self.plan
        choices = []
        for index, result in enumerate(results):
            message = self._message(result.text)
            choices.append(ChatChoice(
                index=index,
                message=message,
                logprobs=self._logprobs(result.logprobs, result.token_texts),
                finish_reason=_chat_finish_reason(result.finish_reason, bool(message.tool_calls)),
            ))
        prompt_logprobs = None
        if plan.prompt_logprobs is not None and results and results[0].prompt_logprobs:
            prompt_logprobs = prompt_logprobs_of(
                self.token_text, plan.prompt_of(0), results[0].prompt_logprobs,
                num_top=plan.prompt_logprobs,
            )
        return ChatCompletionResponse(
            id=plan.response_id, created=plan.created, model=plan.model, choices=choices,
            usage=usage, prompt_logprobs=prompt_logprobs,
        )

    def stream_start(self) -> Iterator[bytes]:
        for index in range(self.plan.num_choices):
            delta = DeltaMessage(role="assistant", content="")
            yield self._chunk([ChatChunkChoice(index=index, delta=delta)])

    def stream_output(self, index: int, output: RequestOutput) -> Iterator[bytes]:
        if output.new_text or output.new_logprobs:
            logprobs = self._logprobs(output.new_logprobs, output.new_token_texts)
            if self._parsers is None:
                deltas = [DeltaMessage(content=output.new_text)]
            else:
                # Text that may open a call is held back: then the logprobs go alone.
                deltas = self._parsers[index].feed(output.new_text) or (
                    [DeltaMessage()] if logprobs is not None else []
                )
            for i, delta in enumerate(deltas):
                choice = ChatChunkChoice(
                    index=index, delta=delta, logprobs=logprobs if i == 0 else None
                )
                yield self._chunk([choice])
        if output.finished:
            has_calls = False
            if self._parsers is not None:
                parser = self._parsers[index]
                for delta in parser.finish():
                    yield self._chunk([ChatChunkChoice(index=index, delta=delta)])
                has_calls = parser.num_calls > 0
            choice = ChatChunkChoice(
                index=index, delta=DeltaMessage(),
                finish_reason=_chat_finish_reason(output.finish_reason, has_calls),
            )
            yield self._chunk([choice])

    def stream_end(self, usage: UsageInfo) -> Iterator[bytes]:
        if self.plan.include_usage:
            yield self._chunk([], usage)
        yield SSE_DONE

    def stream_error(self, exc: APIError) -> Iterator[bytes]:
        yield sse_error(exc)

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> bytes:
        plan = self.plan
        chunk = ChatCompletionChunk(
            id=plan.response_id, created=plan.created, model=plan.model, choices=choices,
            usage=usage,
        )
        return _chunk(chunk, plan)


def _chat_finish_reason(reason: str | None, has_calls: bool) -> FinishReason | None:
    """OpenAI's "tool_calls" for a turn that ended with calls (not one cut short)."""
    if has_calls and reason == "stop":
        return "tool_calls"
    return _finish_reason(reason)
