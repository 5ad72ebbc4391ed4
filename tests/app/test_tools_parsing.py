"""Tool calls read out of the model's text: whole (`parse_tool_calls`) and streamed
(`ToolCallStreamParser`), which must agree however the text is cut into deltas."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from app.api.openai.protocol import DeltaMessage
from app.api.openai.tool_calls import ToolCallStreamParser, new_call_id, parse_tool_calls

NAMES = frozenset({"get_weather", "add", "search-web", "noargs"})


def block(name: str, arguments: Any, *, indent: int | None = None,
          ensure_ascii: bool = False, space: str = "") -> str:
    args = json.dumps(arguments, indent=indent, ensure_ascii=ensure_ascii)
    return (f'<tool_call>\n{{"name":{space}"{name}",{space}"arguments":{space}{args}}}'
            "\n</tool_call>")


def parsed(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text, NAMES)
    for call in calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        assert call.type == "function"
    return content, [(c.function.name, c.function.arguments) for c in calls]


def streamed(chunks: list[str]) -> tuple[str | None, list[tuple[str, str]], list[DeltaMessage]]:
    """Content and calls put together from the stream's deltas, checked against OpenAI's
    shape of a streamed call."""
    parser = ToolCallStreamParser(NAMES)
    deltas: list[DeltaMessage] = []
    for chunk in chunks:
        deltas += parser.feed(chunk)
    deltas += parser.finish()
    content = ""
    calls: list[list[str]] = []
    for delta in deltas:
        assert (delta.content is None) != (delta.tool_calls is None)
        if delta.content is not None:
            assert delta.content
            content += delta.content
            continue
        assert delta.tool_calls is not None and len(delta.tool_calls) == 1
        piece = delta.tool_calls[0]
        if piece.id is not None:  # the first piece of a call
            assert piece.index == len(calls) and piece.type == "function"
            assert re.fullmatch(r"call_[0-9a-f]{24}", piece.id)
            assert piece.function.name and piece.function.arguments == ""
            calls.append([piece.function.name, ""])
        else:
            assert piece.index == len(calls) - 1 and piece.type is None
            assert piece.function.name is None and piece.function.arguments
            calls[-1][1] += piece.function.arguments
    assert parser.num_calls == len(calls)
    return content or None, [(name, args) for name, args in calls], deltas


# ------------------------------------------------------------------ examples

CASES: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    ("Just text.", "Just text.", []),
    ("  spaced out \n", "  spaced out \n", []),
    ("", None, []),
    ("<b>bold</b> and <tool_callx> and </tool_call>", "<b>bold</b> and <tool_callx> and "
     "</tool_call>", []),
    (block("get_weather", {"city": "Paris"}), None, [("get_weather", '{"city":"Paris"}')]),
    # whitespace around calls is dropped; text on both sides is joined with a newline
    ("Let me check.\n\n" + block("add", {"x": 1, "y": 2.5}) + "\n\n  Done.  ",
     "Let me check.\nDone.  ", [("add", '{"x":1,"y":2.5}')]),
    # parallel calls, pretty-printed and on one line
    (block("add", {"x": [1, 2, {"z": None}]}, indent=2) + "\n"
     + block("search-web", {"q": "a b", "n": True}, space="  "),
     None, [("add", '{"x":[1,2,{"z":null}]}'), ("search-web", '{"q":"a b","n":true}')]),
    # strings as written: inner whitespace, escapes, unicode, braces and tags inside
    (block("add", {"s": "  a\tb \"q\" \\ } ] <tool_call> </tool_call>"}),
     None, [("add", json.dumps({"s": "  a\tb \"q\" \\ } ] <tool_call> </tool_call>"},
                               separators=(",", ":")))]),
    (block("get_weather", {"city": "Zürich 🌧", "日本": "東京"}), None,
     [("get_weather", '{"city":"Zürich 🌧","日本":"東京"}')]),
    (block("get_weather", {"city": "Zürich"}, ensure_ascii=True), None,
     [("get_weather", '{"city":"Z\\u00fcrich"}')]),
    (block("noargs", {}), None, [("noargs", "{}")]),
    # the closing tag may be missing at the very end (a stop string took it)
    ('Sure <tool_call>\n{"name": "add", "arguments": {"x": 1}}', "Sure",
     [("add", '{"x":1}')]),
    # malformed blocks stay content, tags and all
    ('<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>', []),
    ('a <tool_call>\n{"arguments": {}, "name": "add"}\n</tool_call>',
     'a <tool_call>\n{"arguments": {}, "name": "add"}\n</tool_call>', []),
    ("<tool_call>\nnot json\n</tool_call> ok", "<tool_call>\nnot json\n</tool_call> ok", []),
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "add", "arguments": [1]}</tool_call>', []),
    ("Text then <tool_ca", "Text then <tool_ca", []),
    # a malformed block before a good one
    ("<tool_call>\n{oops}\n</tool_call>\n" + block("add", {}),
     "<tool_call>\n{oops}\n</tool_call>", [("add", "{}")]),
    ("<tool_call><tool_call>\n" + block("add", {})[len("<tool_call>\n"):], "<tool_call>",
     [("add", "{}")]),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_parse(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    assert parsed(text) == (content, calls)
    for name, arguments in calls:
        assert name in NAMES and isinstance(json.loads(arguments), dict)


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_stream_equals_parse(text: str, content: str | None, calls: list[tuple[str, str]],
                             size: int) -> None:
    chunks = [text[i:i + size] for i in range(0, len(text), size)]
    got_content, got_calls, _ = streamed(chunks)
    assert (got_content, got_calls) == (content, calls)


def test_without_tools_everything_is_content() -> None:
    text = block("add", {"x": 1})
    assert parse_tool_calls(text, ()) == (text, [])
    parser = ToolCallStreamParser(())
    assert [d.content for d in parser.feed(text[:5]) + parser.feed(text[5:])] == \
        [text[:5], text[5:]]
    assert parser.finish() == [] and parser.num_calls == 0


def test_held_back_text_never_leaks_a_partial_tag() -> None:
    parser = ToolCallStreamParser(NAMES)
    assert [d.content for d in parser.feed("Checking <tool")] == ["Checking"]
    first = parser.feed('_call>\n{"name": "get_weather", ')
    assert first == []  # the name is read, the arguments key not yet
    start, arguments = parser.feed('"arguments": {"city"')
    assert start.tool_calls is not None and arguments.tool_calls is not None
    assert start.tool_calls[0].function.name == "get_weather"
    assert arguments.tool_calls[0].function.arguments == '{"city"'
    more = parser.feed(': "Oslo"}}\n</tool_call>')
    assert "".join(d.tool_calls[0].function.arguments or "" for d in more
                   if d.tool_calls) == ':"Oslo"}'
    assert parser.finish() == []


def test_stream_of_a_broken_call_keeps_what_it_sent() -> None:
    text = 'x <tool_call>\n{"name": "add", "arguments": {"a": 1}, "extra": 2}\n</tool_call> y'
    content, calls, _ = streamed([text])
    assert (content, calls) == ("x\ny", [("add", '{"a":1}')])
    # The whole parse keeps it as content, in place of the call the stream sent.
    assert parsed(text) == (text.removesuffix(" y") + "\ny", [])


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>',  # not JSON
    '<tool_call>\n{"name": "add", "arguments": {"a": [1, 2',  # cut short
    '<tool_call>\n{"name": "add", "arguments": {"a": "unclosed}}\n</tool_call>',
])
def test_calls_broken_after_their_name_stay_content(text: str) -> None:
    assert parsed(text) == (text, [])
    _, calls, _ = streamed([text])
    assert [name for name, _ in calls] == ["add"]  # the stream had announced it


def test_a_plan_names_the_functions() -> None:
    from app.api.openai.protocol import ChatTool
    from app.api.openai.tools import tool_plan

    plan = tool_plan([ChatTool.model_validate({"type": "function",
                                               "function": {"name": "add"}})], "auto")
    text = block("add", {}) + block("now", {})
    content, calls = parse_tool_calls(text, plan)
    assert content == block("now", {}) and [c.function.name for c in calls] == ["add"]


def test_ids_are_fresh() -> None:
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
    _, calls = parse_tool_calls(block("add", {}) + "\n" + block("add", {}), NAMES)
    assert calls[0].id != calls[1].id


# ------------------------------------------------------------------ properties

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)
_space = st.text(alphabet=" \n\t\r", max_size=3)
_free_text = st.lists(
    st.sampled_from(["a", "Z", " ", "\n", "<", ">", "/", "{", "}", '"', "é", "🚀",
                     "<tool", "_call", "<tool_call", "</tool_call>", "tool_call>"]),
    max_size=10,
).map("".join)


@st.composite
def _call_blocks(draw: st.DrawFn) -> tuple[str, str, str, dict[str, Any]]:
    """(block text, name, expected arguments text, the arguments)."""
    name = draw(st.sampled_from(sorted(NAMES)))
    arguments = draw(st.dictionaries(st.text(max_size=6), _json, max_size=4))
    ensure_ascii = draw(st.booleans())
    indent = draw(st.sampled_from([None, 0, 2]))
    s = [draw(_space) for _ in range(12)]
    body = json.dumps(arguments, indent=indent, ensure_ascii=ensure_ascii)
    text = (f'<tool_call>{s[0]}{{{s[1]}"name"{s[2]}:{s[3]}"{name}"{s[4]},{s[5]}"arguments"'
            f'{s[6]}:{s[7]}{body}{s[8]}}}{s[9]}</tool_call>')
    expected = json.dumps(arguments, separators=(",", ":"), ensure_ascii=ensure_ascii)
    return text, name, expected, arguments


def _expected_content(texts: list[str], num_calls: int) -> str | None:
    if num_calls == 0:
        return texts[0] or None
    pieces = []
    for i, text in enumerate(texts):
        if i > 0:
            text = text.lstrip(" \t\n\r")
        if i < len(texts) - 1:
            text = text.rstrip(" \t\n\r")
        if text:
            pieces.append(text)
    return "\n".join(pieces) or None


def _splits(data: st.DataObject, text: str) -> list[str]:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    return [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_stream_over_any_split_equals_the_parse(data: st.DataObject) -> None:
    num_calls = data.draw(st.integers(0, 3))
    texts = [data.draw(_free_text) for _ in range(num_calls + 1)]
    for text in texts:
        assume("<tool_call>" not in text)
    blocks = [data.draw(_call_blocks()) for _ in range(num_calls)]
    whole = texts[0] + "".join(b[0] + t for b, t in zip(blocks, texts[1:], strict=True))
    expected_calls = [(name, expected) for _, name, expected, _ in blocks]

    content, calls = parsed(whole)
    assert calls == expected_calls
    assert content == _expected_content(texts, num_calls)
    for (*_, arguments), (_, got_arguments) in zip(blocks, calls, strict=True):
        assert json.loads(got_arguments) == arguments

    chunks = _splits(data, whole)
    got_content, got_calls, _ = streamed(chunks)
    assert (got_content, got_calls) == (content, calls)


@settings(max_examples=200, deadline=None)
@given(text=st.lists(st.sampled_from([*'<>/tool_cal{}":, \n', "<tool_call>", "</tool_call>",
                                      '"name"', "add", '"arguments"']),
                    max_size=40).map("".join),
       data=st.data())
def test_any_text_streams_the_same_however_it_is_split(text: str, data: st.DataObject) -> None:
    whole = streamed([text])
    content, calls, _ = streamed(_splits(data, text))
    assert (content, calls) == whole[:2]
    # The whole parse differs only where the stream announced a call that then broke.
    whole_content, whole_calls = parsed(text)
    if whole_calls == calls:
        assert whole_content == content
