"""Function calling for the chat API: the tools a request offers, checked, and the output
constraint its `tool_choice` asks for.

Every model is asked to call functions in one format, Hermes-style blocks, so that one
parser (`app/api/openai/tool_calls.py`) reads every model's calls:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Templates that know tools (Qwen2.5, Qwen3...) teach it themselves; for the others
`app/api/openai/tool_prompt.py` writes it into the system message. `tool_constraint` turns
`tool_choice` into a grammar over that format:

- `none`: no constraint, and the tools are not shown to the model (OpenAI's semantics);
- `auto`: free text, or text followed by calls. NOTE: the free text is "any text that
  does not contain `<tool_call>`" (an llguidance terminal built with its `&` and `~`
  operators), and the text before a call is a lazy lexeme ending at the first
  `<tool_call>`: the model may write anything, `<` included, but once it writes the tag
  the rest of its output is calls, each valid against its function's schema. A rule
  such as "text may not start with `<`" would be looser (a call after some text would
  be unconstrained) and stricter (no reply could start with markup) at once;
- `required`: one or more calls (exactly one with `parallel_tool_calls: false`), nothing
  else;
- a named function: exactly one call of that function.

Each call's JSON is `{"name": <the function's name>, "arguments": <its parameters
schema>}`, one `%json` rule per function (llguidance merges them into one choice at the
call's first `{`), with JSON whitespace bounded per gap as for response formats.
The `<tool_call>` tags are matched as text: a tokenizer that has a plain (not special)
token for a tag, as Qwen's do, and one that spells it out, as SmolLM2's, are both
served; one that made the tags special tokens would need llguidance's `<token>` syntax.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from app.api.errors import APIError, invalid_request
from app.api.openai.protocol import ChatTool, FunctionDefinition, NamedToolChoice, ToolChoice
from engine.structured import OutputKind, StructuredLimits, StructuredOutput
from engine.structured.limits import whitespace_pattern

MAX_TOOLS = 128  # OpenAI's limit
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"

# Error codes of refused tool requests (HTTP 400).
INVALID_TOOLS = "invalid_tools"
INVALID_TOOL_CHOICE = "invalid_tool_choice"
TOO_MANY_TOOLS = "too_many_tools"

# What a function without `parameters` takes: exactly `{}`.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                 "additionalProperties": False}
# Keywords whose values are data, not subschemas.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas"})

Mode = Literal["auto", "required", "named"]


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A request's tools once checked: what the model is shown and may call.

    `functions` is empty when no tool is in play (no tools, or `tool_choice: none`)."""

    functions: tuple[FunctionDefinition, ...]
    mode: Mode = "auto"
    named: str | None = None  # the function a named tool_choice forces
    parallel: bool = True  # more than one call per turn

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.functions)


NO_TOOLS = ToolPlan(functions=())


def tool_plan(tools: Sequence[ChatTool] | None, tool_choice: ToolChoice | None,
              parallel_tool_calls: bool | None = None) -> ToolPlan:
    """The tools checked against what can be served; an APIError (400) names the first
    problem. `tool_choice` defaults to `auto` with tools and `none` without, as OpenAI's."""
    tools = list(tools or ())
    if len(tools) > MAX_TOOLS:
        raise _refuse(f"A request may offer at most {MAX_TOOLS} tools; it sent {len(tools)}.",
                      param="tools", code=TOO_MANY_TOOLS)
    seen: set[str] = set()
    max_depth = StructuredLimits().max_json_depth
    for i, tool in enumerate(tools):
        function = tool.function
        param = f"tools[{i}].function"
        if not FUNCTION_NAME.fullmatch(function.name):
            raise _refuse(f"Invalid function name {function.name!r}: names are 1 to 64 "
                          "letters, digits, underscores and dashes.",
                          param=f"{param}.name", code=INVALID_TOOLS)
        if function.name in seen:
            raise _refuse(f"The function name {function.name!r} is used more than once.",
                          param=f"{param}.name", code=INVALID_TOOLS)
        seen.add(function.name)
        if function.parameters is not None and not _is_object_schema(function.parameters):
            raise _refuse(f"The parameters of {function.name!r} must be a JSON schema of "
                          'type "object".', param=f"{param}.parameters", code=INVALID_TOOLS)
        if _depth(function.parameters) > max_depth:
            raise _refuse(f"The parameters schema of {function.name!r} nests deeper than "
                          f"{max_depth} levels.", param=f"{param}.parameters",
                          code=INVALID_TOOLS)
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if name not in seen:
            message = (f"tool_choice names the function {name!r}, which is not among the "
                       "request's tools." if tools else
                       "tool_choice names a function but the request has no tools.")
            raise _refuse(message, param="tool_choice", code=INVALID_TOOL_CHOICE)
        return ToolPlan(tuple(t.function for t in tools), "named", name, False)
    if tool_choice == "required" and not tools:
        raise _refuse("tool_choice 'required' needs at least one tool.", param="tool_choice",
                      code=INVALID_TOOL_CHOICE)
    if tool_choice == "none" or not tools:
        return NO_TOOLS
    mode: Mode = "required" if tool_choice == "required" else "auto"
    return ToolPlan(tuple(t.function for t in tools), mode, None,
                    parallel_tool_calls is not False)


def tool_constraint(tools: Sequence[ChatTool] | ToolPlan | None,
                    tool_choice: ToolChoice | None = None,
                    parallel_tool_calls: bool | None = None, *,
                    answer: StructuredOutput | None = None) -> StructuredOutput | None:
    """The grammar the output follows (an llguidance Lark grammar), or None when the
    output is free (no tools, or `tool_choice: none`).

    `answer`: the JSON format (`response_format`) a text answer must have. With `auto`
    the model then either calls functions or answers with such a document; with
    `required` or a named function the turn can only be calls, and it does not apply."""
    plan = tools if isinstance(tools, ToolPlan) else tool_plan(tools, tool_choice,
                                                               parallel_tool_calls)
    if not plan.functions:
        return None
    schema = answer_schema(answer) if answer is not None and plan.mode == "auto" else None
    return StructuredOutput.grammar(tool_grammar(plan, answer=schema))


def answer_schema(spec: StructuredOutput) -> dict[str, Any]:
    """The JSON schema (with llguidance's options) of a `json_object` or `json_schema`
    answer format, for `tool_grammar`."""
    if spec.kind is OutputKind.JSON_OBJECT:
        schema: Any = {"type": "object"}
    elif spec.kind is OutputKind.JSON_SCHEMA:
        schema = json.loads(spec.text)
        if spec.strict:
            schema = _closed(schema)
    else:
        raise ValueError(f"a {spec.describe()} is not an answer format")
    if isinstance(schema, bool):  # JSON Schema's `true` (anything) and `false` (nothing)
        schema = {} if schema else {"not": {}}
    options = {"lenient": not spec.strict,
               "whitespace_pattern": whitespace_pattern(StructuredLimits())}
    return {"x-guidance": options, **schema}


def tool_grammar(plan: ToolPlan, *, answer: dict[str, Any] | None = None) -> str:
    """The Lark text of `plan`'s constraint (see the module's docstring); `answer` (auto
    only): the schema a text answer follows instead of free text."""
    assert plan.functions, "a plan without functions has no grammar"
    functions = [f for f in plan.functions if plan.named in (None, f.name)]
    rules = [f"fn{i}: %json {json.dumps(call_schema(f), ensure_ascii=False)}"
             for i, f in enumerate(functions)]
    call = " | ".join(f"fn{i}" for i in range(len(functions)))
    open_, close = json.dumps(CALL_OPEN + "\n"), json.dumps("\n" + CALL_CLOSE)
    between = json.dumps("\n")
    lines = ["%llguidance {}"]
    if plan.mode == "auto" and answer is not None:
        lines += ["start: answer | calls",
                  f"answer: %json {json.dumps(answer, ensure_ascii=False)}"]
        first = "call"
    elif plan.mode == "auto":
        # Lark string literals take JSON's escapes; in regexes `<`, `>`, `_` are literal.
        lines += ["start: TEXT | lead calls",
                  "TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/",
                  "lead[lazy]: /(?s:.*)<tool_call>\\n/"]
        first = "call_body"
    else:
        lines.append("start: calls")
        first = "call"
    repeat = f" ({between} call)*" if plan.parallel else ""
    lines += [f"calls: {first}{repeat}",
              f"call: {open_} call_body",
              f"call_body: ({call}) {close}",
              *rules]
    return "\n".join(lines) + "\n"


def call_schema(function: FunctionDefinition) -> dict[str, Any]:
    """The JSON schema of one call's document: its name, then its arguments."""
    arguments = arguments_schema(function)
    if function.strict:
        arguments = _closed(arguments)
    return {
        # NOTE: strict functions are held to the keywords the grammar can enforce (an
        # unsupported one is an error, as for strict response formats); the others'
        # unsupported keywords are ignored, and their output checked against the rest.
        # NOTE: a call is written as json.dumps writes it (", " and ": ", no newlines):
        # nobody reads its layout, and a weak model given room for indentation spends
        # its max_tokens on it.
        "x-guidance": {"lenient": not function.strict, "whitespace_flexible": False,
                       "item_separator": ", ", "key_separator": ": "},
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def arguments_schema(function: FunctionDefinition) -> dict[str, Any]:
    """The function's parameters schema, re-rooted under the call document's
    `properties.arguments`: its local `$ref`s are rewritten to point there."""
    parameters = function.parameters
    if not parameters:
        return dict(NO_PARAMETERS)
    schema = copy.deepcopy(parameters)
    for key in ("$schema", "$id"):
        schema.pop(key, None)
    _reroot_refs(schema, "#/properties/arguments")
    return schema


def _reroot_refs(schema: Any, root: str) -> None:
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            node["$ref"] = root + ref[1:]
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                stack.extend(value.values())
            elif key not in _DATA_KEYWORDS:
                stack.append(value)


def _closed(schema: Any) -> Any:
    """`schema` as OpenAI's strict mode reads it: an object schema that does not say
    otherwise allows no properties beyond those it lists."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _closed(sub) for name, sub in value.items()}
        else:
            out[key] = _closed(value)
    if _is_object_schema(out):
        out.setdefault("additionalProperties", False)
    return out


def _is_object_schema(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if kind is None:
        return "properties" in schema or not schema
    return kind == "object"


def _depth(value: Any) -> int:
    """How deeply the objects and arrays of `value` nest (no recursion: the schema comes
    from the request)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _refuse(message: str, *, param: str, code: str) -> APIError:
    return invalid_request(message, param=param, code=code)
