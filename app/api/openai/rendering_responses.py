"""Engine outputs as Responses API objects and the typed events of its stream.

A response has one output message (or, with tools, the calls the model made); its stream
is `response.created`, `response.in_progress`, the item and content-part events around
`response.output_text.delta`s, and `response.completed` (`response.incomplete` when
`max_output_tokens` cut it short) with the whole response, including usage.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.api.errors import APIError
from app.api.openai.choices import ChoiceResult
from app.api.openai.plan import GenerationPlan
from app.api.openai.protocol import DeltaMessage, ToolCall, UsageInfo
from app.api.openai.protocol_responses import (
    FunctionCallOutput,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
    TextFormat,
)
from app.api.openai.tool_calls import ToolCallStreamParser, parse_tool_calls
from engine.request import RequestOutput


def responses_usage(usage: UsageInfo) -> ResponseUsage:
    cached = usage.prompt_tokens_details.cached_tokens
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
    )


def _event(payload: dict[str, Any]) -> bytes:
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n".encode()


@dataclass(slots=True)
class _StreamedCall:
    output_index: int
    item_id: str
    call_id: str
    name: str
    arguments: list[str] = field(default_factory=list)

    def item(self, status: str) -> FunctionCallOutput:
        return FunctionCallOutput(
            id=self.item_id, call_id=self.call_id, name=self.name,
            arguments="".join(self.arguments), status=status,  # type: ignore[arg-type]
        )


class ResponsesRenderer:
    """POST /v1/responses (one choice: the Responses API has no `n`); with function
    tools, the calls are parsed out of the text into `function_call` items."""

    def __init__(self, plan: GenerationPlan, body: ResponsesRequest) -> None:
        assert plan.num_choices == 1
        self.plan = plan
        self.body = body
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self._sequence = 0
        self._text_parts: list[str] = []
        self._finish_reason: str | None = None
        self._message_index: int | None = None  # the message's output_index, once open
        self._num_items = 0
        self._parser = ToolCallStreamParser(plan.tools) if plan.tools.functions else None
        self._calls: dict[int, _StreamedCall] = {}  # by the call's index in the turn

    # ------------------------------------------------------------ whole objects

    def _object(
        self, *, status: str, output: list[Any], usage: UsageInfo | None = None,
        finish_reason: str | None = None,
    ) -> ResponseObject:
        body = self.body
        incomplete = None
        if finish_reason == "length":
            status = "incomplete"
            incomplete = IncompleteDetails(reason="max_output_tokens")
        text_format = body.text.format if body.text is not None else None
        return ResponseObject(
            id=self.plan.response_id,
            created_at=self.plan.created,
            status=status,  # type: ignore[arg-type]
            model=self.plan.model,
            output=output,
            usage=None if usage is None else responses_usage(usage),
            incomplete_details=incomplete,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            tools=list(body.tools or []),
            tool_choice=body.tool_choice or "auto",
            parallel_tool_calls=body.parallel_tool_calls is not False,
            text=TextConfig(format=text_format or TextFormat(type="text")),
            metadata=dict(body.metadata or {}),
            user=body.user,
        )

    def _message(self, text: str, status: str) -> OutputMessage:
        return OutputMessage(
            id=self.message_id, status=status,  # type: ignore[arg-type]
            content=[OutputText(text=text)],
        )

    def _done_status(self, finish_reason: str | None) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def response(self, results: Sequence[ChoiceResult], usage: UsageInfo) -> ResponseObject:
        (result,) = results
        status = self._done_status(result.finish_reason)
        content: str | None = result.text
        calls: list[ToolCall] = []
        if self._parser is not None:
            content, calls = parse_tool_calls(result.text, self.plan.tools)
        output: list[Any] = []
        if content or not calls:
            output.append(self._message(content or "", status))
        output += [
            FunctionCallOutput(id=f"fc_{uuid.uuid4().hex}", call_id=call.id,
                               name=call.function.name, arguments=call.function.arguments)
            for call in calls
        ]
        return self._object(
            status=status, output=output, usage=usage, finish_reason=result.finish_reason
        )

    # ------------------------------------------------------------------ streams

    def _emit(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return _event(payload)

    def _dump(self, model: Any) -> Any:
        return model.model_dump(mode="json")

    def stream_start(self) -> Iterator[bytes]:
        started = self._dump(self._object(status="in_progress", output=[]))
        yield self._emit("response.created", response=started)
        yield self._emit("response.in_progress", response=started)

    def _open_message(self) -> Iterator[bytes]:
        if self._message_index is not None:
            return
        self._message_index = self._num_items
        self._num_items += 1
        item = OutputMessage(id=self.message_id, status="in_progress", content=[])
        yield self._emit(
            "response.output_item.added", output_index=self._message_index, item=self._dump(item)
        )
        yield self._emit(
            "response.content_part.added", item_id=self.message_id,
            output_index=self._message_index, content_index=0, part=self._dump(OutputText(text="")),
        )

    def _text_delta(self, text: str) -> Iterator[bytes]:
        yield from self._open_message()
        self._text_parts.append(text)
        yield self._emit(
            "response.output_text.delta", item_id=self.message_id,
            output_index=self._message_index, content_index=0, delta=text, logprobs=[],
        )

    def _deltas(self, deltas: list[DeltaMessage]) -> Iterator[bytes]:
        for delta in deltas:
            if delta.content:
                yield from self._text_delta(delta.content)
            for piece in delta.tool_calls or ():
                call = self._calls.get(piece.index)
                if call is None:
                    assert piece.id is not None and piece.function.name is not None
                    call = _StreamedCall(self._num_items, f"fc_{uuid.uuid4().hex}", piece.id,
                                         piece.function.name)
                    self._num_items += 1
                    self._calls[piece.index] = call
                    yield self._emit("response.output_item.added",
                                     output_index=call.output_index,
                                     item=self._dump(call.item("in_progress")))
                if piece.function.arguments:
                    call.arguments.append(piece.function.arguments)
                    yield self._emit(
                        "response.function_call_arguments.delta", item_id=call.item_id,
                        output_index=call.output_index, delta=piece.function.arguments,
                    )

    def stream_output(self, index: int, output: RequestOutput) -> Iterator[bytes]:
        if output.finished:
            self._finish_reason = output.finish_reason
        if not output.new_text:
            return
        if self._parser is None:
            yield from self._text_delta(output.new_text)
        else:
            yield from self._deltas(self._parser.feed(output.new_text))

    def stream_end(self, usage: UsageInfo) -> Iterator[bytes]:
        if self._parser is not None:
            yield from self._deltas(self._parser.finish())
        status = self._done_status(self._finish_reason)
        items: list[tuple[int, Any]] = []
        if self._message_index is not None or not self._calls:
            yield from self._open_message()
            assert self._message_index is not None
            text = "".join(self._text_parts)
            yield self._emit(
                "response.output_text.done", item_id=self.message_id,
                output_index=self._message_index, content_index=0, text=text, logprobs=[],
            )
            yield self._emit(
                "response.content_part.done", item_id=self.message_id,
                output_index=self._message_index, content_index=0,
                part=self._dump(OutputText(text=text)),
            )
            message = self._message(text, status)
            yield self._emit("response.output_item.done", output_index=self._message_index,
                             item=self._dump(message))
            items.append((self._message_index, message))
        for call in self._calls.values():
            arguments = "".join(call.arguments)
            yield self._emit("response.function_call_arguments.done", item_id=call.item_id,
                             output_index=call.output_index, arguments=arguments)
            done = call.item("completed")
            yield self._emit("response.output_item.done", output_index=call.output_index,
                             item=self._dump(done))
            items.append((call.output_index, done))
        output = [item for _, item in sorted(items, key=lambda pair: pair[0])]
        final = self._object(
            status=status, output=output, usage=usage, finish_reason=self._finish_reason
        )
        kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
        yield self._emit(kind, response=self._dump(final))

    def stream_error(self, exc: APIError) -> Iterator[bytes]:
        code = exc.code or exc.type
        yield self._emit("error", code=code, message=exc.message, param=exc.param)
        failed = self._object(status="failed", output=[])
        failed.error = ResponseError(code=code, message=exc.message)
        yield self._emit("response.failed", response=self._dump(failed))
