"""Streaming token -> text conversion with stop strings, and per-token texts for logprobs."""

from __future__ import annotations

import re
from typing import Any, NamedTuple

# Prompt tokens decoded in front of the first output token, so that tokenizers whose
# pieces render differently at the start of a text (a leading-space marker) give the
# first token the text it has in context.
_NUM_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class TextDelta(NamedTuple):
    text: str  # newly safe to emit; may be empty
    stopped: bool  # a stop string appeared: the text is complete, stop generating


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas, one token at a time.

    Each step decodes only a short window of trailing tokens (prefix/read offsets): the
    window starts with the tokens of the last emitted piece, whose text is known, and the
    new text is what decoding the whole window adds to it. While that decode ends in
    U+FFFD the last token stopped inside a multi-byte character, so the window keeps
    growing and the text waits for the next token. Once a piece is emitted, its tokens
    become the context of the next window and older ones are dropped.

    Stop strings: the first occurrence of any of them ends the text; the stop string and
    everything after it are never emitted (`stopped` turns True). Text that could be the
    start of a stop string is held back until the next tokens rule that out, so a
    streaming client never sees part of a stop string; `flush()` releases it when the
    request ends for another reason.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
    ) -> None:
        stop = list(stop or [])
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = stop
        self._max_stop_len = max((len(s) for s in stop), default=0)
        # The window: ids[:read_offset] is context whose text (prefix_text) is already
        # accounted for; ids[read_offset:] are tokens whose text is not emitted yet.
        self._ids: list[int] = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._held = ""  # decoded, not emitted: may be the start of a stop string
        self._emitted: list[str] = []
        self.stop_string: str | None = None  # the stop string that ended the text
        self._finished = False

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    @property
    def output_text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    def add_token(self, token_id: int) -> TextDelta:
        """Appends one output token; returns the text that became safe to emit."""
        assert not self._finished and not self.stopped, "token added to a finished text"
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            # Nothing visible yet (a skipped special token) or a character still incomplete.
            return TextDelta("", False)
        delta = text[len(self._prefix_text) :]
        self._advance()
        released = self._release(delta, final=False)
        return TextDelta(released, self.stopped)

    def flush(self) -> str:
        """Ends the text: returns what was held back, incomplete characters included."""
        assert not self._finished, "flush called twice"
        self._finished = True
        if self.stopped:
            return ""
        delta = ""
        if len(self._ids) > self._read_offset:
            delta = self._decode(self._ids)[len(self._prefix_text) :]
        return self._release(delta, final=True)

    @staticmethod
    def token_text(tokenizer: Any, token_id: int) -> str:
        """One token decoded alone (uncached; `TokenTexts` caches and also gives bytes)."""
        return tokenizer.decode(
            [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _advance(self) -> None:
        # The tokens just emitted become the context; the old context is dropped.
        del self._ids[: self._read_offset]
        self._prefix_text = self._decode(self._ids)
        self._read_offset = len(self._ids)

    def _release(self, delta: str, final: bool) -> str:
        text = self._held + delta
        cut = self._find_stop(text)
        if cut is not None:
            self._held = ""
            return self._emit(text[:cut])
        hold = 0 if final else self._stop_prefix_len(text)
        self._held = text[len(text) - hold :] if hold else ""
        return self._emit(text[: len(text) - hold])

    def _emit(self, text: str) -> str:
        if text:
            self._emitted.append(text)
        return text

    def _find_stop(self, text: str) -> int | None:
        """Position of the earliest stop string in text, recording which one it was."""
        best: int | None = None
        for s in self._stop:
            pos = text.find(s)
            if pos >= 0 and (best is None or pos < best):
                best, self.stop_string = pos, s
        return best

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string.

        NOTE: only `held + delta` is searched; that suffices because whatever was held
        back is itself the longest such suffix of all the text so far, so any later match
        has to start inside it.
        """
        for n in range(min(len(text), self._max_stop_len - 1), 0, -1):
            tail = text[-n:]
            if any(len(s) > n and s.startswith(tail) for s in self._stop):
                return n
        return 0


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """Inverse of the byte -> printable character map of byte-level BPE vocabularies.

    Bytes that are printable Latin-1 stand for themselves; the others (controls, space,
    a few Latin-1 gaps) take the code points from 256 upwards in byte order.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class TokenTexts:
    """Text and bytes of single tokens, as logprobs responses show them; cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._alphabet = _byte_level_alphabet() if self._byte_level else {}

    def text(self, token_id: int) -> str:
        """The token decoded alone; special tokens keep their name (e.g. `<|im_end|>`)."""
        text = self._texts.get(token_id)
        if text is None:
            text = IncrementalDetokenizer.token_text(self._tokenizer, token_id)
            self._texts[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The token's raw UTF-8 bytes, which may be part of a character."""
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._raw_bytes(token_id)
            self._bytes[token_id] = raw
        return raw

    def _raw_bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level and all(c in self._alphabet for c in piece):
                return bytes(self._alphabet[c] for c in piece)
            match = _BYTE_TOKEN.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
        return self.text(token_id).encode("utf-8")
