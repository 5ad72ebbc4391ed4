"""Incremental detokenization against the real SmolLM2 tokenizer: deltas, stop strings."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from engine.core.detokenizer import IncrementalDetokenizer, TokenTexts
from engine.models.loader import load_tokenizer, resolve_model_dir

REPO = Path(__file__).resolve().parents[2]
CHAT_PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"

TEXTS = [
    "Hello, world! This is a plain sentence.",
    "Crème brûlée, naïve café, Ångström, São Paulo, Łódź.",
    "Emojis 😀🎉👍🏽 and a family 👨‍👩‍👧 in a row 🚀🚀.",
    "日本語のテキストと中文混合, 한국어 문장도, и немного кириллицы.",
    "Mixed: x² + y² = z², π ≈ 3.14159, → arrows ← and ∑ symbols.\n\tTabs and\nnewlines.",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    # LORAPLEX_TEST_TOKENIZER_DIR points at any converted model directory; otherwise the
    # bundled model is resolved (and converted once) like the server does.
    override = os.environ.get("LORAPLEX_TEST_TOKENIZER_DIR")
    if override:
        return load_tokenizer(Path(override))
    data_dir = Path(os.environ.get("LORAPLEX_DATA_DIR", REPO / "var"))
    return load_tokenizer(resolve_model_dir("default", data_dir))


class _CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.decode_lengths: list[int] = []

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.decode_lengths.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def _prompt(tokenizer: Any) -> list[int]:
    return tokenizer.encode(CHAT_PROMPT)


def _stream(
    tokenizer: Any, token_ids: list[int], stop: list[str] | None = None
) -> tuple[list[str], IncrementalDetokenizer, int | None]:
    """Feeds token_ids; returns the deltas (flush last), the detokenizer and the index
    of the token at which it reported a stop (None if it never did)."""
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), stop=stop)
    deltas: list[str] = []
    for index, token_id in enumerate(token_ids):
        text, stopped = detok.add_token(token_id)
        deltas.append(text)
        if stopped:
            deltas.append(detok.flush())
            return deltas, detok, index
    deltas.append(detok.flush())
    return deltas, detok, None


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_equal_full_decode(tokenizer: Any, text: str) -> None:
    token_ids = tokenizer.encode(text + "<|im_end|>")
    deltas, detok, stopped_at = _stream(tokenizer, token_ids)
    assert stopped_at is None
    assert deltas[-1] == ""  # nothing was held back at the end
    assert "".join(deltas) == tokenizer.decode(token_ids, skip_special_tokens=True) == text
    assert detok.output_text == text
    assert all("\ufffd" not in d for d in deltas)  # never half a character


def test_split_characters_wait_for_their_last_byte(tokenizer: Any) -> None:
    token_ids = tokenizer.encode(" 😀")
    assert len(token_ids) == 2  # the emoji's bytes are split across two tokens
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer))
    assert detok.add_token(token_ids[0]) == ("", False)
    assert detok.add_token(token_ids[1]) == (" 😀", False)


def test_flush_releases_an_incomplete_character(tokenizer: Any) -> None:
    first = tokenizer.encode(" 😀")[0]
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer))
    assert detok.add_token(first) == ("", False)
    assert detok.flush() == tokenizer.decode([first]) == " \ufffd"


def test_decodes_only_a_short_window(tokenizer: Any) -> None:
    counting = _CountingTokenizer(tokenizer)
    token_ids = tokenizer.encode(" ".join(TEXTS) * 3)
    assert len(token_ids) > 300
    detok = IncrementalDetokenizer(counting, _prompt(tokenizer))
    text = "".join(detok.add_token(t).text for t in token_ids) + detok.flush()
    assert text == tokenizer.decode(token_ids)
    assert max(counting.decode_lengths) <= 8


def test_special_tokens_are_not_emitted(tokenizer: Any) -> None:
    token_ids = tokenizer.encode("one<|im_end|>two<|im_start|> three")
    deltas, _, _ = _stream(tokenizer, token_ids)
    assert "".join(deltas) == "onetwo three"


def _cut_case(tokenizer: Any, text: str, stop: str) -> None:
    """Stream text with one stop string; check the cut, the stop token and every delta."""
    token_ids = tokenizer.encode(text)
    cut = text.index(stop)
    deltas, detok, stopped_at = _stream(tokenizer, token_ids, stop=[stop])
    visible = text[:cut]
    assert "".join(deltas) == visible
    assert detok.stopped and detok.stop_string == stop
    # It stops at the very token that completes the stop string.
    decoded = [tokenizer.decode(token_ids[: i + 1]) for i in range(len(token_ids))]
    assert stopped_at == next(i for i, d in enumerate(decoded) if stop in d)
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert visible.startswith(emitted)  # no piece of the stop string ever went out


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("The answer is 42. Anything after that is hidden.", "swer is 4"),
        ("First line\nSecond line\n\nThird paragraph", "\n\n"),
        ("Count: one, two, three, four", "two, thr"),
        ("Un café crème, s'il vous plaît, merci", "é cr"),
        ("Smile 😀🎉 then more text", "😀🎉"),
        ("日本語のテキストです。終わり", "テキス"),
        ("stop at the very start", "stop"),
    ],
)
def test_stop_string_spanning_tokens_is_cut_exactly(tokenizer: Any, text: str, stop: str) -> None:
    _cut_case(tokenizer, text, stop)


def test_stop_string_is_not_emitted_in_part_while_undecided(tokenizer: Any) -> None:
    text = "The answer is 42. Anything after that is hidden."
    token_ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), stop=["answer is 4"])
    emitted = ""
    for token_id in token_ids:
        delta, stopped = detok.add_token(token_id)
        emitted += delta
        if stopped:
            break
        # Whatever has been emitted never ends with the start of the stop string.
        assert not any(emitted.endswith("answer is 4"[:n]) for n in range(1, 11))
    assert emitted == "The "


def test_earliest_stop_string_wins(tokenizer: Any) -> None:
    text = "alpha beta gamma delta"
    token_ids = tokenizer.encode(text)
    deltas, detok, _ = _stream(tokenizer, token_ids, stop=["delta", "beta", "gamma"])
    assert "".join(deltas) == "alpha "
    assert detok.stop_string == "beta"


def test_held_back_text_is_released_when_no_stop_follows(tokenizer: Any) -> None:
    text = "Hello word, hello wor"
    deltas, detok, stopped_at = _stream(tokenizer, tokenizer.encode(text), stop=["world"])
    assert stopped_at is None and not detok.stopped
    # "wor" might still become "world" until the request ends; flush hands it out.
    assert deltas[-1] == "wor"
    assert "".join(deltas) == text


def test_no_output_after_stop(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), stop=["!"])
    deltas = []
    for token_id in tokenizer.encode("Hi! More"):
        text, stopped = detok.add_token(token_id)
        deltas.append(text)
        if stopped:
            break
    assert "".join(deltas) == "Hi"
    assert detok.flush() == ""
    assert detok.output_text == "Hi"


def test_empty_stop_string_is_rejected(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="empty"):
        IncrementalDetokenizer(tokenizer, _prompt(tokenizer), stop=["ok", ""])


def test_token_texts_and_bytes(tokenizer: Any) -> None:
    texts = TokenTexts(tokenizer)
    emoji_ids = tokenizer.encode(" 😀")
    assert b"".join(texts.token_bytes(t) for t in emoji_ids) == " 😀".encode()
    assert texts.token_bytes(emoji_ids[0]) == b" \xf0\x9f\x98"
    assert texts.text(emoji_ids[0]) == " \ufffd"
    (accent,) = tokenizer.encode("é")
    assert texts.text(accent) == "é"
    assert texts.token_bytes(accent) == "é".encode()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert texts.text(im_end) == "<|im_end|>"
    assert texts.token_bytes(im_end) == b"<|im_end|>"
    hello = tokenizer.encode(" Hello")
    assert [texts.text(t) for t in hello] == [" Hello"]
    assert IncrementalDetokenizer.token_text(tokenizer, hello[0]) == " Hello"
