"""Signed admin-UI session tokens and their CSRF tokens.

A session token names the admin key that logged in (its id, "bootstrap" or "local"),
never the key itself, and carries its own expiry; an HMAC over the service's secret
key makes it unforgeable. Whether that key may still act is checked on every request
(see deps.py): a token only says who logged in, and until when at the latest.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass

SESSION_COOKIE = "lpx_admin_session"
# A login form's double-submit token, before any session exists.
LOGIN_CSRF_COOKIE = "lpx_admin_login_csrf"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "X-CSRF-Token"
DEFAULT_TTL_S = 8 * 3600

# Actors that are not key ids.
BOOTSTRAP = "bootstrap"
LOCAL = "local"

_VERSION = 1


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def same_token(given: str, expected: str) -> bool:
    """Constant-time; as bytes, since compare_digest refuses non-ASCII text."""
    return hmac.compare_digest(given.encode(), expected.encode())


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class UISession:
    actor: str  # the admin key's id, BOOTSTRAP or LOCAL
    nonce: str  # random per login: the CSRF token derives from it
    issued_at: int  # unix seconds
    expires_at: int  # unix seconds
    # BOOTSTRAP only: which bootstrap key it was (a keyed digest, not the key), so that
    # changing LORAPLEX_ADMIN_KEY ends the sessions of the old one.
    key_fingerprint: str | None = None


class SessionSigner:
    """Issues and reads session tokens; derives CSRF tokens. One per app."""

    def __init__(self, secret: str) -> None:
        # NOTE: a key of its own, derived from the service's secret: a session token is
        # never a valid key hash, nor the other way round.
        self._key = hmac.new(secret.encode(), b"loraplex/admin-ui/session", "sha256").digest()

    def _mac(self, purpose: str, data: str) -> str:
        return _b64(hmac.new(self._key, f"{purpose}\n{data}".encode(), "sha256").digest())

    def bootstrap_fingerprint(self, admin_key: str) -> str:
        return self._mac("bootstrap-key", hashlib.sha256(admin_key.encode()).hexdigest())[:22]

    def issue(
        self, actor: str, *, now: int, ttl_s: int = DEFAULT_TTL_S,
        key_fingerprint: str | None = None,
    ) -> tuple[UISession, str]:
        """A new session and its cookie value."""
        session = UISession(
            actor=actor,
            nonce=secrets.token_urlsafe(16),
            issued_at=now,
            expires_at=now + ttl_s,
            key_fingerprint=key_fingerprint,
        )
        return session, self.encode(session)

    def encode(self, session: UISession) -> str:
        payload = json.dumps(
            {
                "v": _VERSION,
                "a": session.actor,
                "n": session.nonce,
                "i": session.issued_at,
                "e": session.expires_at,
                "f": session.key_fingerprint,
            },
            separators=(",", ":"),
        )
        body = _b64(payload.encode())
        return f"{body}.{self._mac('session', body)}"

    def read(self, token: str | None, *, now: int) -> UISession | None:
        """The session of a cookie value; None if absent, forged, malformed or expired."""
        if not token or token.count(".") != 1:
            return None
        body, mac = token.split(".")
        if not same_token(mac, self._mac("session", body)):
            return None
        try:
            data = json.loads(_unb64(body))
            session = UISession(
                actor=str(data["a"]),
                nonce=str(data["n"]),
                issued_at=int(data["i"]),
                expires_at=int(data["e"]),
                key_fingerprint=None if data["f"] is None else str(data["f"]),
            )
        except (ValueError, KeyError, TypeError, binascii.Error):
            return None  # signed by us but not understood: an older format
        if data.get("v") != _VERSION or session.expires_at <= now:
            return None
        return session

    def csrf_token(self, session: UISession) -> str:
        return self._mac("csrf", session.nonce)

    def check_csrf(self, session: UISession, token: str | None) -> bool:
        return bool(token) and same_token(str(token), self.csrf_token(session))
