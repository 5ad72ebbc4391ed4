"""Wire models of OpenAI's Responses API (`POST /v1/responses`): the request, the response
object, and the events of its stream.

Served statelessly: nothing is stored, so `store` is answered false and a
`previous_response_id` is refused. Ranges are documented as in app/api/openai/protocol.py and
enforced by the chat planning the request is translated into.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from app.api.openai.protocol import MaxTokens, Temperature, TopP, documented


class _Lenient(BaseModel):
    # NOTE: unknown fields are ignored: the SDKs send fields we do not use (ids, status).
    model_config = ConfigDict(extra="ignore")


class InputText(_Lenient):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]


class FunctionCallInput(_Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputInput(_Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]


def _item_kind(item: Any) -> str:
    # A message item may leave out its type ({"role": "user", "content": "hi"}).
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return kind if kind in ("message", "function_call", "function_call_output") else "message"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallInput, Tag("function_call")]
    | Annotated[FunctionCallOutputInput, Tag("function_call_output")],
    Discriminator(_item_kind),
]


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: Annotated[str, documented(minLength=1, maxLength=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Lenient):
    type: Literal["function"]
    name: str


class TextFormat(_Lenient):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    # NOTE: an alias: `schema` would shadow a BaseModel attribute.
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Lenient):
    format: TextFormat | None = None


class ResponsesRequest(_Lenient):
    model: str
    input: str | Annotated[list[InputItem], documented(minItems=1)]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = False
    # Accepted and answered false: nothing is stored.
    store: bool | None = None
    # Refused unless None: without stored responses there is nothing to continue.
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


# ---------------------------------------------------------------- responses


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallOutput(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | FunctionCallOutput


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "failed", "in_progress", "incomplete"]
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=lambda: TextConfig(format=TextFormat(type="text")))
    previous_response_id: str | None = None
    store: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None

    @property
    def output_text(self) -> str:
        return "".join(
            part.text for item in self.output if isinstance(item, OutputMessage)
            for part in item.content
        )


class ResponseStreamEvent(BaseModel):
    """One event of a Responses stream (OpenAPI documentation: its `type` says which, and
    the other fields follow OpenAI's event of that type)."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int
