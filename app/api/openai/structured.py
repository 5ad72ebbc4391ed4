"""The output constraint a request asks for, from OpenAI's `response_format` or vLLM's
`structured_outputs` / `guided_*` extension fields, as the engine's `StructuredOutput`."""

from __future__ import annotations

from typing import Any

from app.api.errors import APIError, invalid_request
from app.api.openai.protocol import ConstrainedFields, ResponseFormat, StructuredOutputs
from engine.client import EngineClient
from engine.structured import StructuredOutput, StructuredOutputError


def structured_output_of(
    body: ConstrainedFields, response_format: ResponseFormat | None = None
) -> tuple[str, StructuredOutput] | None:
    """The constraint and the request field that asked for it; None when the output is
    free. A request may name one constraint only: two (say a `response_format` and a
    `guided_regex`) are refused rather than one silently ignored."""
    found: list[tuple[str, StructuredOutput]] = []
    if response_format is not None and response_format.type != "text":
        found.append(("response_format", _of_response_format(response_format)))
    if body.structured_outputs is not None:
        found += _of_structured_outputs(body.structured_outputs)
    legacy: list[tuple[str, Any]] = [
        ("guided_json", body.guided_json), ("guided_regex", body.guided_regex),
        ("guided_choice", body.guided_choice), ("guided_grammar", body.guided_grammar),
    ]
    for param, value in legacy:
        if value is not None:
            found.append((param, _build(param, param.removeprefix("guided_"), value)))
    if len(found) > 1:
        names = ", ".join(f"'{param}'" for param, _ in found)
        raise invalid_request(
            f"A request may constrain its output one way only; it sent {names}.",
            param=found[1][0], code="invalid_structured_output",
        )
    return found[0] if found else None


def _of_response_format(response_format: ResponseFormat) -> StructuredOutput:
    param = "response_format"
    if response_format.type == "json_object":
        return _build(param, "json_object", True)
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise invalid_request(
            "A 'json_schema' response format needs 'json_schema.schema'.",
            param="response_format.json_schema", code="invalid_structured_output",
        )
    return _build(param, "json", spec.json_schema, strict=bool(spec.strict))


def _of_structured_outputs(params: StructuredOutputs) -> list[tuple[str, StructuredOutput]]:
    given: list[tuple[str, Any]] = [
        ("json", params.json_), ("regex", params.regex), ("choice", params.choice),
        ("grammar", params.grammar),
        ("json_object", params.json_object or None),
    ]
    return [
        (f"structured_outputs.{kind}", _build(f"structured_outputs.{kind}", kind, value))
        for kind, value in given if value is not None
    ]


def _build(param: str, kind: str, value: Any, *, strict: bool = False) -> StructuredOutput:
    try:
        if kind == "json_object":
            return StructuredOutput.json_object()
        if kind == "json":
            return StructuredOutput.json_schema(value, strict=strict)
        if kind == "regex":
            return StructuredOutput.regex(value)
        if kind == "choice":
            return StructuredOutput.choice(value)
        assert kind == "grammar", kind
        return StructuredOutput.grammar(value)
    except StructuredOutputError as exc:
        raise structured_output_error(exc, param=param) from exc


def check_structured_output(
    engine: EngineClient, spec: StructuredOutput, *, param: str
) -> None:
    """Compile `spec` now (cached for the engine's own admission), so that a schema the
    engine refuses is a 400 before any stream starts."""
    try:
        engine.check_structured_output(spec)
    except StructuredOutputError as exc:
        raise structured_output_error(exc, param=param) from exc


def structured_output_error(exc: StructuredOutputError, *, param: str) -> APIError:
    message = str(exc)
    if exc.limit is not None and exc.limit not in message:
        message = f"{message} (limit: {exc.limit})"
    return invalid_request(f"Invalid '{param}': {message}", param=param, code=exc.code)
