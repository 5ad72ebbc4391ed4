"""The admin UI's pure parts: session tokens and CSRF tokens, the login throttle, the
bar charts' geometry."""

from __future__ import annotations

import pytest

from admin_ui.charts import bar_chart
from admin_ui.sessions import BOOTSTRAP, SessionSigner
from admin_ui.throttle import LoginThrottle

SECRET = "s" * 40
NOW = 1_800_000_000


def test_a_session_token_round_trips_and_expires() -> None:
    signer = SessionSigner(SECRET)
    session, token = signer.issue("key_123", now=NOW, ttl_s=600)
    assert signer.read(token, now=NOW) == session
    assert signer.read(token, now=NOW + 599) == session
    assert signer.read(token, now=NOW + 600) is None
    assert session.actor == "key_123" and session.expires_at == NOW + 600


def test_tokens_cannot_be_forged_or_moved_between_secrets() -> None:
    signer = SessionSigner(SECRET)
    _, token = signer.issue(BOOTSTRAP, now=NOW, key_fingerprint="fp")
    body, mac = token.split(".")
    assert SessionSigner("t" * 40).read(token, now=NOW) is None
    assert signer.read(f"{body}x.{mac}", now=NOW) is None
    assert signer.read(f"{body}.{mac[:-1]}A" if mac[-1] != "A" else f"{body}.{mac[:-1]}B",
                       now=NOW) is None
    for junk in (None, "", "a.b.c", "no-dot", ".", "é.ü", f"{body}.{mac}é"):
        assert signer.read(junk, now=NOW) is None
    # Another actor's payload under this token's MAC.
    _, other = signer.issue("key_other", now=NOW)
    assert signer.read(f"{other.split('.')[0]}.{mac}", now=NOW) is None


def test_csrf_tokens_belong_to_one_session() -> None:
    signer = SessionSigner(SECRET)
    first, _ = signer.issue(BOOTSTRAP, now=NOW)
    second, _ = signer.issue(BOOTSTRAP, now=NOW)
    assert signer.csrf_token(first) != signer.csrf_token(second)
    assert signer.check_csrf(first, signer.csrf_token(first))
    assert not signer.check_csrf(first, signer.csrf_token(second))
    assert not signer.check_csrf(first, None)
    assert not signer.check_csrf(first, "")
    assert not signer.check_csrf(first, "tökén")


def test_the_bootstrap_fingerprint_names_the_key_without_holding_it() -> None:
    signer = SessionSigner(SECRET)
    key = "my-bootstrap-admin-key-0123456789"
    fingerprint = signer.bootstrap_fingerprint(key)
    assert fingerprint == signer.bootstrap_fingerprint(key)
    assert fingerprint != signer.bootstrap_fingerprint(key + "x")
    assert fingerprint != SessionSigner("t" * 40).bootstrap_fingerprint(key)
    assert key not in fingerprint and key[:8] not in fingerprint


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_throttle_blocks_after_failures_until_the_window_passes() -> None:
    clock = Clock()
    throttle = LoginThrottle(max_failures=3, window_s=60, clock=clock)
    for _ in range(3):
        assert throttle.retry_after("1.2.3.4") is None
        throttle.failed("1.2.3.4")
        clock.now += 10
    # Failures at 1000, 1010, 1020; now 1030: the first leaves the window at 1060.
    assert throttle.retry_after("1.2.3.4") == pytest.approx(30)
    assert throttle.retry_after("5.6.7.8") is None
    clock.now = 1060.0
    assert throttle.retry_after("1.2.3.4") is None
    throttle.failed("1.2.3.4")
    assert throttle.retry_after("1.2.3.4") == pytest.approx(10)  # 1010 leaves at 1070
    throttle.succeeded("1.2.3.4")
    assert throttle.retry_after("1.2.3.4") is None


def test_the_throttle_forgets_the_oldest_clients_beyond_its_bound() -> None:
    clock = Clock()
    throttle = LoginThrottle(max_failures=1, window_s=60, max_clients=2, clock=clock)
    for client in ("a", "b", "c"):
        throttle.failed(client)
    assert throttle.retry_after("a") is None
    assert throttle.retry_after("b") is not None and throttle.retry_after("c") is not None


def test_bar_chart_geometry() -> None:
    chart = bar_chart("Requests", "requests", [("a", 0), ("b", 7), ("c", 3)])
    heights = [bar.height for bar in chart.bars]
    # The scale tops at 10 (the next 1-2-5 step above 7): heights are proportional.
    assert [t.value for t in chart.ticks] == [0, 5, 10]
    assert heights[0] == 0 and heights[1] == pytest.approx(heights[2] * 7 / 3, rel=1e-3)
    assert all(bar.y + bar.height == pytest.approx(chart.baseline) for bar in chart.bars)
    xs = [bar.x for bar in chart.bars]
    assert xs == sorted(xs) and all(bar.width > 0 for bar in chart.bars)
    assert chart.total == 10 and "the most, 7, at b" in chart.summary
    empty = bar_chart("Requests", "requests", [])
    assert empty.bars == () and empty.summary == "No requests in this range."
    many = bar_chart("Requests", "requests", [(str(i), 1) for i in range(60)])
    assert 10 <= sum(bar.show_label for bar in many.bars) <= 12
