"""The guard of this directory: a library that reaches beyond the loopback fails at once
instead of waiting on a network that is not there."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.clients.conftest import NetworkBlocked

pytestmark = pytest.mark.timeout(30)


def test_a_lookup_beyond_the_loopback_fails_at_once() -> None:
    start = time.monotonic()
    with pytest.raises(httpx.ConnectError, match="no network"):
        httpx.get("https://raw.githubusercontent.com/", timeout=20)
    with pytest.raises(NetworkBlocked):
        import socket

        socket.create_connection(("93.184.215.14", 443), timeout=20)
    assert time.monotonic() - start < 2


def test_the_openai_client_sees_a_connection_error() -> None:
    client = openai.OpenAI(api_key="sk-none", max_retries=0, timeout=20)
    start = time.monotonic()
    with pytest.raises(openai.APIConnectionError):
        client.models.list()
    assert time.monotonic() - start < 2
