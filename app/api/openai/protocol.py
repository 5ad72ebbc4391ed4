"""Wire models of the OpenAI-compatible API: requests, responses, stream chunks, errors.

A field's range is written once, here, as `documented(...)` JSON-schema keywords: the
OpenAPI document shows them and `app/api/openai/planning.py` enforces them (`bounds_of`), so
that every bad value gets OpenAI's error body with the exact `param` and `code` instead
of a generic validation message.
"""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    SerializerFunctionWrapHandler,
    field_serializer,
    model_serializer,
)
from pydantic.json_schema import JsonSchemaValue, WithJsonSchema
from pydantic_core import CoreSchema

FinishReason = Literal["stop", "length", "tool_calls"]


@dataclass(frozen=True, slots=True)
class Documented:
    """JSON-schema keywords for the OpenAPI document, and nowhere else: validation
    ignores them. Use as `Annotated[int, documented(minimum=0)]`.

    NOTE: not pydantic constraints: those would answer a bad value with a generic
    validation message; planning.py enforces the numeric ones (`bounds_of`) with OpenAI's
    400 and the exact `param` and `code` (tests/app/test_openapi_document.py holds the
    document to what the server refuses).
    """

    keywords: tuple[tuple[str, object], ...]

    def __get_pydantic_json_schema__(
        self, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = handler(core_schema)
        schema.update(self.keywords)
        return schema


def documented(**keywords: object) -> Documented:
    return Documented(tuple(keywords.items()))


@dataclass(frozen=True, slots=True)
class Bounds:
    """A numeric field's accepted range, read from its `documented(...)` keywords."""

    lo: float | None = None
    hi: float | None = None
    lo_exclusive: bool = False


def _numeric_bounds(marks: typing.Iterable[object]) -> Bounds | None:
    for mark in marks:
        if not isinstance(mark, Documented):
            continue
        keywords = dict(mark.keywords)
        lo, hi = keywords.get("minimum"), keywords.get("maximum")
        exclusive = keywords.get("exclusiveMinimum")
        if exclusive is not None:
            lo = exclusive
        if lo is None and hi is None:
            continue
        assert isinstance(lo, int | float | None) and isinstance(hi, int | float | None)
        return Bounds(lo=lo, hi=hi, lo_exclusive=exclusive is not None)
    return None


@functools.cache
def bounds_of(model: type[BaseModel]) -> dict[str, Bounds]:
    """Every top-level numeric field of `model` with a documented range, in field order
    (also when the field is optional: `Annotated[int, documented(...)] | None`)."""
    found: dict[str, Bounds] = {}
    for name, info in model.model_fields.items():
        marks: list[object] = list(info.metadata)
        for member in typing.get_args(info.annotation) or (info.annotation,):
            if typing.get_origin(member) is Annotated:
                marks.extend(member.__metadata__)
        bounds = _numeric_bounds(marks)
        if bounds is not None:
            found[name] = bounds
    return found


# Seeds stay within int64 for each of the n choices (choice i runs with seed + i).
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
MAX_CHOICES = 16  # choices per request: prompts times `n`
Temperature = Annotated[float, documented(minimum=0, maximum=2)]
TopP = Annotated[float, documented(exclusiveMinimum=0, maximum=1)]
TopK = Annotated[int, documented(minimum=-1)]  # -1 or 0: no top-k
Choices = Annotated[int, documented(minimum=1, maximum=MAX_CHOICES)]
Penalty = Annotated[float, documented(minimum=-2, maximum=2)]
# Beyond these a repetition penalty only pushes logits past float32's range.
RepetitionPenalty = Annotated[float, documented(minimum=0.01, maximum=100.0)]
Seed = Annotated[
    int, documented(minimum=_INT64_MIN, maximum=_INT64_MAX - MAX_CHOICES, format="int64")
]
Priority = Annotated[int, documented(minimum=0)]
MaxTokens = Annotated[int, documented(minimum=1)]
CompletionLogprobCount = Annotated[int, documented(minimum=0, maximum=5)]
ChatTopLogprobs = Annotated[int, documented(minimum=0, maximum=20)]
PromptLogprobCount = Annotated[int, documented(minimum=0, maximum=20)]
# A prompt: one non-empty text or token-id list, or a batch of either (at most
# MAX_CHOICES prompts times `n`).
TokenIds = Annotated[list[Annotated[int, documented(minimum=0)]], documented(minItems=1)]
PromptText = Annotated[str, documented(minLength=1)]
Prompt = (
    PromptText
    | TokenIds
    | Annotated[list[PromptText], documented(minItems=1, maxItems=MAX_CHOICES)]
    | Annotated[list[TokenIds], documented(minItems=1, maxItems=MAX_CHOICES)]
)
# Accepted only empty (or false): what the server refuses as not supported.
Unsupported = documented(maxItems=0)


# ---------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationFields(BaseModel):
    """Fields shared by completions and chat completions."""

    # NOTE: unknown fields are ignored: the OpenAI SDKs send some we do not use.
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    n: Choices | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    # Extension (not in OpenAI's API): keep generating past EOS, for benchmarks.
    ignore_eos: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Larger = served later; it can only lower the caller's own priority.
    priority: Priority | None = None
    # Accepted so that an empty map passes; a non-empty one is refused (not supported).
    logit_bias: Annotated[dict[str, float], documented(maxProperties=0)] | None = None
    # Extension (vLLM's): each prompt token's logprob, rank and top-N alternatives.
    prompt_logprobs: PromptLogprobCount | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class StructuredOutputs(BaseModel):
    """Extension (vLLM's name): constrain the output; at most one of these."""

    model_config = ConfigDict(extra="ignore")

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class ConstrainedFields(BaseModel):
    """Output constraints both routes take (extensions; OpenAI's own is response_format)."""

    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names for the same constraints.
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(ConstrainedFields, GenerationFields):
    # A string, a list of token ids, or a batch of either: each prompt its own choices.
    prompt: Prompt
    # 0 only with `echo`: the prompt (and with `logprobs`, its tokens' logprobs) alone.
    max_tokens: Annotated[int, documented(minimum=0)] | None = None
    logprobs: CompletionLogprobCount | None = None
    # Each choice's text starts with its prompt; with `logprobs`, so do its logprobs (the
    # first token's null).
    echo: bool | None = False
    suffix: Annotated[str, documented(maxLength=0)] | None = None
    best_of: int | None = None


def _text_part_schema(schema: dict[str, Any]) -> None:
    # Documented as the one kind served: {"type": "text", "text": "..."}.
    schema["required"] = ["type", "text"]
    schema["properties"]["text"].pop("default", None)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", json_schema_extra=_text_part_schema)

    type: Annotated[str, documented(const="text")]
    text: Annotated[str | None, WithJsonSchema({"type": "string"})] = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant turn that called tools; a tool turn answers one call by its id.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Annotated[str, documented(minLength=1, maxLength=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    # NOTE: an alias: `schema` would shadow a BaseModel attribute.
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`text` (the default), any JSON object, or a document valid against a JSON schema."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(ConstrainedFields, GenerationFields):
    messages: Annotated[list[ChatMessage], documented(minItems=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = False
    top_logprobs: ChatTopLogprobs | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Annotated[list[Any], Unsupported] | None = None
    response_format: ResponseFormat | None = None


# --------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    # null for an echoed prompt's first token (nothing precedes it).
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's shape: one token's logprob, its rank (1: the likeliest), its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# One per prompt token: the token itself and its top-N alternatives by token id (the
# first token: null).
PromptLogprobs = list[dict[str, PromptLogprob] | None]


def _without_absent_prompt_logprobs(data: dict[str, Any]) -> dict[str, Any]:
    if data.get("prompt_logprobs") is None:
        data.pop("prompt_logprobs", None)
    return data


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    # Only with `prompt_logprobs` (vLLM's extension), as vLLM sends it.
    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_absent_prompt_logprobs(handler(self))


class CompletionResponse(BaseModel):
    """A whole completion, and also each stream chunk (OpenAI uses one object for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    # Only present when the model called tools, as OpenAI sends it.
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    # Only with `prompt_logprobs` (vLLM's extension): of the templated prompt's tokens.
    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_absent_prompt_logprobs(handler(self))


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """One piece of a streamed tool call: the first names it, the rest add arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None

    @field_serializer("delta")
    def _delta_without_nulls(self, delta: DeltaMessage) -> dict[str, Any]:
        # A delta carries only what changed: `{}` on the finishing chunk.
        return delta.model_dump(exclude_none=True)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "loraplex"
    # Adapters: the base model they apply to (None for the base model itself).
    parent: str | None = None
    root: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
