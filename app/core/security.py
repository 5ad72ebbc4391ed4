"""API keys: format, checksum, keyed hash.

A key reads `lpx_<kind>_<body>_<check>`: kind `a` (admin) or `t` (tenant), a body of
32 base62 characters (190 bits), and a 6-character base62 checksum of the rest. A
mistyped or made-up key fails the checksum and is refused before any lookup. Only an
HMAC-SHA256 of the whole key (with the server's secret) is stored, plus its first
characters for people to recognise it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string
from dataclasses import dataclass
from typing import Literal

KeyKind = Literal["a", "t"]

_ALPHABET = string.digits + string.ascii_letters
_BODY_CHARS = 32
_CHECK_CHARS = 6
KEY_PREFIX = "lpx_"
# Enough to tell keys apart in a list, far too little to guess the rest.
DISPLAY_PREFIX_CHARS = len("lpx_t_") + 6
KEY_LENGTH = len(KEY_PREFIX) + 2 + _BODY_CHARS + 1 + _CHECK_CHARS


@dataclass(frozen=True, slots=True)
class NewKey:
    key: str  # shown once, never stored
    prefix: str  # stored, displayed
    key_hash: str  # stored, looked up


def _base62(value: int, width: int) -> str:
    chars = []
    for _ in range(width):
        value, digit = divmod(value, 62)
        chars.append(_ALPHABET[digit])
    return "".join(reversed(chars))


def _checksum(head: str) -> str:
    digest = hashlib.sha256(head.encode()).digest()
    return _base62(int.from_bytes(digest[:8], "big"), _CHECK_CHARS)


def well_formed(key: str) -> bool:
    """Format and checksum only; no secret, no lookup."""
    if len(key) != KEY_LENGTH or not key.startswith(KEY_PREFIX):
        return False
    head, sep, check = key.rpartition("_")
    if not sep or len(check) != _CHECK_CHARS:
        return False
    kind = head[len(KEY_PREFIX):len(KEY_PREFIX) + 2]
    if kind not in ("a_", "t_"):
        return False
    body = head[len(KEY_PREFIX) + 2:]
    if len(body) != _BODY_CHARS or any(c not in _ALPHABET for c in body):
        return False
    return hmac.compare_digest(check, _checksum(head))


def key_kind(key: str) -> KeyKind:
    assert well_formed(key)
    return "a" if key.startswith(KEY_PREFIX + "a_") else "t"


def hash_key(key: str, secret: str) -> str:
    return hmac.new(secret.encode(), key.encode(), hashlib.sha256).hexdigest()


def generate_key(kind: KeyKind, secret: str) -> NewKey:
    body = "".join(secrets.choice(_ALPHABET) for _ in range(_BODY_CHARS))
    head = f"{KEY_PREFIX}{kind}_{body}"
    key = f"{head}_{_checksum(head)}"
    return NewKey(key=key, prefix=key[:DISPLAY_PREFIX_CHARS], key_hash=hash_key(key, secret))
