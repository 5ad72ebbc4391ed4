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
from typing import Any

from app.api.choices import ChoiceResult
from app.api.errors import APIError
from app.api.plan import GenerationPlan
from app.api.protocol import UsageInfo
from app.api.protocol_responses import (
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


class ResponsesRenderer:
    """POST /v1/responses (one choice: the Responses API has no `n`)."""

    def __init__(self, plan: GenerationPlan, body: ResponsesRequest) -> None:
        assert plan.num_choices == 1
        self.plan = plan
        self.body = body
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self._sequence = 0
        self._text_parts: list[str] = []
        self._finish_reason: str | None = None
        self._message_open = False

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
        return self._object(
            status=status, output=[self._message(result.text, status)], usage=usage,
            finish_reason=result.finish_reason,
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
        if self._message_open:
            return
        self._message_open = True
        item = OutputMessage(id=self.message_id, status="in_progress", content=[])
        yield self._emit("response.output_item.added", output_index=0, item=self._dump(item))
        yield self._emit(
            "response.content_part.added", item_id=self.message_id, output_index=0,
            content_index=0, part=self._dump(OutputText(text="")),
        )

    def stream_output(self, index: int, output: RequestOutput) -> Iterator[bytes]:
        if output.finished:
            self._finish_reason = output.finish_reason
        if not output.new_text:
            return
        yield from self._open_message()
        self._text_parts.append(output.new_text)
        yield self._emit(
            "response.output_text.delta", item_id=self.message_id, output_index=0,
            content_index=0, delta=output.new_text, logprobs=[],
        )

    def stream_end(self, usage: UsageInfo) -> Iterator[bytes]:
        yield from self._open_message()
        text = "".join(self._text_parts)
        status = self._done_status(self._finish_reason)
        yield self._emit(
            "response.output_text.done", item_id=self.message_id, output_index=0,
            content_index=0, text=text, logprobs=[],
        )
        yield self._emit(
            "response.content_part.done", item_id=self.message_id, output_index=0,
            content_index=0, part=self._dump(OutputText(text=text)),
        )
        message = self._message(text, status)
        yield self._emit("response.output_item.done", output_index=0, item=self._dump(message))
        final = self._object(
            status=status, output=[message], usage=usage, finish_reason=self._finish_reason
        )
        kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
        yield self._emit(kind, response=self._dump(final))

    def stream_error(self, exc: APIError) -> Iterator[bytes]:
        code = exc.code or exc.type
        yield self._emit("error", code=code, message=exc.message, param=exc.param)
        failed = self._object(status="failed", output=[])
        failed.error = ResponseError(code=code, message=exc.message)
        yield self._emit("response.failed", response=self._dump(failed))
