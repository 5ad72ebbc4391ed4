"""Wire models of the OpenAI-compatible API: requests, responses, stream chunks, errors.

Range checks live in `app/api/serving.py`, not here, so that every bad value gets
OpenAI's error body with the exact `param` and `code` instead of a generic
validation message. They are written here too, as `documented(...)` JSON-schema
keywords, for the OpenAPI document only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, GetJsonSchemaHandler, field_serializer
from pydantic.json_schema import JsonSchemaValue, WithJsonSchema
from pydantic_core import CoreSchema

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class Documented:
    """JSON-schema keywords for the OpenAPI document, and nowhere else: validation
    ignores them. Use as `Annotated[int, documented(minimum=0)]`.

    NOTE: documentation, not constraints. A pydantic constraint would answer a bad value
    with a generic validation message; serving.py answers it with OpenAI's 400 and the
    exact `param` and `code` (tests/app/test_openapi_document.py holds the document to
    what the server refuses).
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


# What serving.py enforces (MAX_CHOICES, MAX_*_LOGPROBS, the repetition penalty's range,
# seeds that stay within int64 for each of the n choices).
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_MAX_CHOICES = 16
Temperature = Annotated[float, documented(minimum=0, maximum=2)]
TopP = Annotated[float, documented(exclusiveMinimum=0, maximum=1)]
TopK = Annotated[int, documented(minimum=-1)]  # -1 or 0: no top-k
Choices = Annotated[int, documented(minimum=1, maximum=_MAX_CHOICES)]
Penalty = Annotated[float, documented(minimum=-2, maximum=2)]
RepetitionPenalty = Annotated[float, documented(minimum=0.01, maximum=100)]
Seed = Annotated[
    int, documented(minimum=_INT64_MIN, maximum=_INT64_MAX - _MAX_CHOICES, format="int64")
]
Priority = Annotated[int, documented(minimum=0)]
MaxTokens = Annotated[int, documented(minimum=1)]
CompletionLogprobCount = Annotated[int, documented(minimum=0, maximum=5)]
ChatTopLogprobs = Annotated[int, documented(minimum=0, maximum=20)]
# A prompt: one non-empty text or token-id list, or a batch of either (at most
# _MAX_CHOICES prompts times `n`).
TokenIds = Annotated[list[Annotated[int, documented(minimum=0)]], documented(minItems=1)]
PromptText = Annotated[str, documented(minLength=1)]
Prompt = (
    PromptText
    | TokenIds
    | Annotated[list[PromptText], documented(minItems=1, maxItems=_MAX_CHOICES)]
    | Annotated[list[TokenIds], documented(minItems=1, maxItems=_MAX_CHOICES)]
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

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(GenerationFields):
    # A string, a list of token ids, or a batch of either: each prompt its own choices.
    prompt: Prompt
    max_tokens: MaxTokens | None = None
    logprobs: CompletionLogprobCount | None = None
    # Each choice's text starts with its prompt (not with `logprobs`: refused).
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(GenerationFields):
    messages: Annotated[list[ChatMessage], documented(minItems=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = False
    top_logprobs: ChatTopLogprobs | None = None
    tools: Annotated[list[Any], Unsupported] | None = None
    functions: Annotated[list[Any], Unsupported] | None = None
    response_format: dict[str, Any] | None = None


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
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


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


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


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


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
