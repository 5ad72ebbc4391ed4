"""Reading the model's tool calls out of its text, whole or as it streams.

The model writes calls as Hermes-style blocks (see `app/api/openai/tools.py`):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`parse_tool_calls` turns a finished text into OpenAI's `content` and `tool_calls`;
`ToolCallStreamParser`, fed the text as it is generated, gives the same as OpenAI's stream
deltas. Both run the same scanner, so they agree on every well-formed output, however the
text is cut into deltas. The rules:

- a block is a call when it starts `<tool_call>`, then (JSON whitespace allowed between
  the tokens) `{"name": "<one of the request's functions>", "arguments": {...}}`, and
  ends `</tool_call>` (or the output ends right after the object's `}`). Its arguments
  are the object's JSON text with the whitespace between tokens removed (strings and
  numbers as the model wrote them), so a stream's argument pieces add up to exactly the
  whole parse's arguments;
- the text around the calls is the content: whitespace next to a call is dropped, and
  the pieces of text on both sides of a call are joined with a newline; without any call
  the text is the content as it is;
- a block that does not read as a call (only possible when the output was not
  constrained) stays in the content, tags and all. NOTE: the stream announces a call
  as soon as its name is read and sends its arguments as they come; a block that goes
  wrong after that (its JSON broken, the output cut short) cannot be taken back there:
  the stream keeps the call with the arguments sent so far and drops the rest of the
  block, while `parse_tool_calls` keeps the whole block as content.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from app.api.openai.protocol import (
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    ToolCall,
    ToolCallFunction,
)
from app.api.openai.tools import CALL_CLOSE, CALL_OPEN, ToolPlan

_WHITESPACE = " \t\n\r"  # JSON's
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_MAX_NAME_CHARS = 64
# A block whose opening is not read as a call within this many characters is content.
_MAX_HEADER_CHARS = 4096


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True, slots=True)
class _Content:
    text: str


@dataclass(frozen=True, slots=True)
class _CallStart:
    index: int
    name: str


@dataclass(frozen=True, slots=True)
class _Arguments:
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class _CallEnd:
    index: int
    valid: bool  # a complete block with a JSON object for arguments
    raw: str  # the block as written, with the whitespace before it


_Event = _Content | _CallStart | _Arguments | _CallEnd


@dataclass(slots=True)
class _Call:
    index: int
    name: str
    raw: str  # the block so far, as written
    raw_arguments: str = ""
    depth: int = 0
    in_string: bool = False
    escape: bool = False
    tail: str = ""


class _Scanner:
    """Text in, events out; see the module's docstring for the rules."""

    def __init__(self, names: Iterable[str] | ToolPlan) -> None:
        self.names = names.names if isinstance(names, ToolPlan) else frozenset(names)
        self.events: list[_Event] = []
        self._state = self._scan_text
        self._buffer = ""  # text not yet consumed
        self._header = ""  # a block's text after <tool_call>, until it reads as a call
        self._space = ""  # whitespace before the block being read
        self._after_call = False  # no content since the last call: leading space dropped
        self._has_content = False
        self._call: _Call | None = None
        self._num_calls = 0

    def feed(self, text: str) -> None:
        self._buffer += text
        self._run(final=False)

    def finish(self) -> None:
        self._run(final=True)

    def _run(self, *, final: bool) -> None:
        if not self.names:
            self._content(self._buffer)
            self._buffer = ""
            return
        while self._state(final):
            pass

    # ---------------------------------------------------------------- states

    def _scan_text(self, final: bool) -> bool:
        buffer = self._buffer
        at = buffer.find(CALL_OPEN)
        if at >= 0:
            before = buffer[:at]
            body = before.rstrip(_WHITESPACE)
            self._content(body)
            self._space = before[len(body):]
            self._buffer = buffer[at + len(CALL_OPEN):]
            self._header = ""
            self._state = self._scan_header
            return True
        if final:
            self._content(buffer)
            self._buffer = ""
            return False
        held = _partial_suffix(buffer, CALL_OPEN)
        body = buffer[:len(buffer) - held].rstrip(_WHITESPACE)
        self._content(body)
        self._buffer = buffer[len(body):]  # trailing space and a possible tag start
        return False

    def _scan_header(self, final: bool) -> bool:
        self._header += self._buffer
        self._buffer = ""
        status, name, end = _read_header(self._header)
        if status == "partial" and not final:
            return False
        if status == "ok" and name in self.names:
            self._call = _Call(self._num_calls, name, self._space + CALL_OPEN
                               + self._header[:end])
            self._num_calls += 1
            self.events.append(_CallStart(self._call.index, name))
            self._buffer = self._header[end:]
            self._state = self._scan_arguments
            return True
        # Not a call: the tag is content, and what follows it is read again as text.
        self._content(self._space + CALL_OPEN)
        self._buffer = self._header
        self._state = self._scan_text
        return True

    def _scan_arguments(self, final: bool) -> bool:
        call = self._call
        assert call is not None
        out: list[str] = []
        done = -1
        for i, char in enumerate(self._buffer):
            if call.in_string:
                out.append(char)
                if call.escape:
                    call.escape = False
                elif char == "\\":
                    call.escape = True
                elif char == '"':
                    call.in_string = False
            elif char in _WHITESPACE:
                continue
            else:
                out.append(char)
                if char == '"':
                    call.in_string = True
                elif char in "{[":
                    call.depth += 1
                elif char in "}]":
                    call.depth -= 1
                    if call.depth <= 0:
                        done = i + 1
                        break
        consumed = self._buffer if done < 0 else self._buffer[:done]
        call.raw_arguments += consumed
        call.raw += consumed
        self._buffer = self._buffer[len(consumed):]
        if out:
            self.events.append(_Arguments(call.index, "".join(out)))
        if done >= 0:
            self._state = self._scan_tail
            return True
        if final:
            self._end(valid=False)
        return False

    def _scan_tail(self, final: bool) -> bool:
        call = self._call
        assert call is not None
        call.tail += self._buffer
        self._buffer = ""
        rest = call.tail.lstrip(_WHITESPACE)
        if not rest:
            if final:
                self._end(valid=False)
            return False
        if rest[0] == "}":
            after = rest[1:].lstrip(_WHITESPACE)
            if after.startswith(CALL_CLOSE):
                end = len(call.tail) - len(after) + len(CALL_CLOSE)
                call.raw += call.tail[:end]
                self._buffer = call.tail[end:]
                self._end(valid=_is_object(call.raw_arguments))
                return True
            if CALL_CLOSE.startswith(after):
                if final:  # the output ended after the call's object: the tag is implied
                    call.raw += call.tail
                    self._end(valid=_is_object(call.raw_arguments))
                return False
        # The block goes on after its arguments: not a call; its rest is skipped.
        self._buffer = call.tail
        call.tail = ""
        self._state = self._scan_skip
        return True

    def _scan_skip(self, final: bool) -> bool:
        call = self._call
        assert call is not None
        at = self._buffer.find(CALL_CLOSE)
        if at >= 0:
            end = at + len(CALL_CLOSE)
            call.raw += self._buffer[:end]
            self._buffer = self._buffer[end:]
            self._end(valid=False)
            return True
        keep = 0 if final else _partial_suffix(self._buffer, CALL_CLOSE)
        call.raw += self._buffer[:len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep:]
        if final:
            self._end(valid=False)
        return False

    # ---------------------------------------------------------------- events

    def _end(self, *, valid: bool) -> None:
        call = self._call
        assert call is not None
        self.events.append(_CallEnd(call.index, valid, call.raw))
        self._call = None
        self._after_call = True
        self._state = self._scan_text

    def _content(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip(_WHITESPACE)
            if not text:
                return
            if self._has_content:
                text = "\n" + text
            self._after_call = False
        if text:
            self._has_content = True
            self.events.append(_Content(text))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that a following text could complete
    into `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def _read_header(text: str) -> tuple[str, str, int]:
    """Whether `text` (what follows `<tool_call>`) opens a call: `{"name": "...",
    "arguments": ` then `{`. Returns ("ok", name, where the arguments start), or
    ("partial", "", 0) while more text may still make it one, or ("bad", "", 0)."""
    text = text[:_MAX_HEADER_CHARS]
    partial = ("partial", "", 0) if len(text) < _MAX_HEADER_CHARS else ("bad", "", 0)
    i = 0
    name = ""
    for step in ("", "{", "", '"name"', "", ":", "", '"', "NAME", "", ",", "", '"arguments"',
                 "", ":", ""):
        if step == "":
            while i < len(text) and text[i] in _WHITESPACE:
                i += 1
        elif step == "NAME":
            start = i
            while i < len(text) and text[i] in _NAME_CHARS:
                i += 1
            name = text[start:i]
            if len(name) > _MAX_NAME_CHARS:
                return "bad", "", 0
            if i == len(text):
                return partial
            if text[i] != '"' or not name:
                return "bad", "", 0
            i += 1
        else:
            piece = text[i:i + len(step)]
            if piece != step:
                return partial if step.startswith(piece) and i + len(piece) == len(text) \
                    else ("bad", "", 0)
            i += len(step)
    if i == len(text):
        return partial
    return ("ok", name, i) if text[i] == "{" else ("bad", "", 0)


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


# ------------------------------------------------------------------ the interface


def parse_tool_calls(text: str, names: Iterable[str] | ToolPlan, *,
                     new_id: Callable[[], str] = new_call_id) -> tuple[str | None, list[ToolCall]]:
    """The finished output `text` as OpenAI's message: its content (None when empty) and
    its calls of the functions `names` (the request's plan, or its function names; none:
    no calls)."""
    scanner = _Scanner(names)
    scanner.feed(text)
    scanner.finish()
    content: list[str] = []
    calls: list[ToolCall] = []
    arguments: dict[int, list[str]] = {}
    started: dict[int, str] = {}
    for event in scanner.events:
        if isinstance(event, _Content):
            content.append(event.text)
        elif isinstance(event, _CallStart):
            started[event.index] = event.name
            arguments[event.index] = []
        elif isinstance(event, _Arguments):
            arguments[event.index].append(event.text)
        elif event.valid:
            calls.append(ToolCall(id=new_id(), function=ToolCallFunction(
                name=started[event.index], arguments="".join(arguments[event.index]))))
        else:
            content.append(event.raw)
    joined = "".join(content)
    return joined or None, calls


class ToolCallStreamParser:
    """Fed the output's text deltas, gives OpenAI's stream deltas: content, and tool
    call pieces (the first of call i: index i, its id, type "function", its name and
    empty arguments; then pieces of its arguments). Text that may be the start of a
    `<tool_call>` tag is held back until the next delta or `finish`."""

    def __init__(self, names: Iterable[str] | ToolPlan, *,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self._scanner = _Scanner(names)
        self._new_id = new_id
        self.num_calls = 0  # calls announced so far

    def feed(self, text: str) -> list[DeltaMessage]:
        self._scanner.feed(text)
        return self._deltas()

    def finish(self) -> list[DeltaMessage]:
        """The rest, once the output has ended."""
        self._scanner.finish()
        return self._deltas()

    def _deltas(self) -> list[DeltaMessage]:
        out: list[DeltaMessage] = []
        for event in self._scanner.events:
            last = out[-1] if out else None
            if isinstance(event, _Content):
                if last is not None and last.content is not None:
                    last.content += event.text
                else:
                    out.append(DeltaMessage(content=event.text))
            elif isinstance(event, _CallStart):
                self.num_calls += 1
                out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                    index=event.index, id=self._new_id(), type="function",
                    function=DeltaFunction(name=event.name, arguments=""))]))
            elif isinstance(event, _Arguments):
                piece = last.tool_calls[0] if last is not None and last.tool_calls else None
                if piece is not None and piece.index == event.index and piece.id is None:
                    piece.function.arguments = (piece.function.arguments or "") + event.text
                else:
                    out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                        index=event.index, function=DeltaFunction(arguments=event.text))]))
        self._scanner.events.clear()
        return out
