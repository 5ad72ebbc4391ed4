"""One real server for the client libraries' tests: the tiny random model with a tenant's
uploaded PEFT adapter, served over real HTTP, and no network beyond the loopback.

NOTE: litellm fetches its model price map at import unless told to read the copy it
ships (set below, before any test module imports it), and libraries that count tokens
may download tokenizer files: `loopback_only` makes any such attempt fail at once
instead of hanging, and each test module carries a timeout.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.real_service import real_service
from tests.utils.saas import create_key, create_tenant, upload_adapter

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"

ADAPTER = "client-bot"  # the tenant's uploaded adapter, the `model` every test names


@dataclass(frozen=True)
class ClientService:
    base_url: str
    key: str
    model: str  # the adapter's name

    @property
    def api_base(self) -> str:
        return f"{self.base_url}/v1"

    def openai(self) -> OpenAI:
        return OpenAI(base_url=self.api_base, api_key=self.key, max_retries=0)

    def async_openai(self) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=self.api_base, api_key=self.key, max_retries=0)


@pytest.fixture(scope="session")
def service(
    tiny_model_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClientService]:
    # llama_long: room for the tool definitions rendered into the prompt.
    base = tiny_model_factory("llama_long")
    root = tmp_path_factory.mktemp("clients")
    lora = make_peft_adapter(base, root / "lora", r=4, alpha=8, seed=3)
    with real_service(base, root) as live, \
            httpx.Client(base_url=live.base_url, timeout=60) as admin:
        tenant = create_tenant(admin, "clients-tenant")
        key = create_key(admin, tenant["id"], scopes=["inference", "adapters:write"])["key"]
        uploaded = upload_adapter(admin, key, ADAPTER, lora)
        assert uploaded.status_code == 201, uploaded.text
        yield ClientService(live.base_url, key, ADAPTER)


def _is_loopback(host: Any) -> bool:
    if isinstance(host, bytes):
        host = host.decode()
    if not isinstance(host, str):
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


class NetworkBlocked(OSError):
    """A client library tried to reach beyond the loopback."""


@pytest.fixture(autouse=True, scope="module")
def loopback_only() -> Iterator[None]:
    """Name lookups and connections to anything but the loopback fail at once."""
    real_getaddrinfo = socket.getaddrinfo
    real_connect = socket.socket.connect
    real_connect_ex = socket.socket.connect_ex

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host is not None and not _is_loopback(host):
            raise NetworkBlocked(f"no network in these tests: lookup of {host!r}")
        return real_getaddrinfo(host, *args, **kwargs)

    def check(address: Any) -> None:
        if isinstance(address, tuple) and not _is_loopback(address[0]):
            raise NetworkBlocked(f"no network in these tests: connection to {address!r}")

    def connect(self: socket.socket, address: Any) -> None:
        check(address)
        real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        check(address)
        return real_connect_ex(self, address)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket, "getaddrinfo", getaddrinfo)
        patch.setattr(socket.socket, "connect", connect)
        patch.setattr(socket.socket, "connect_ex", connect_ex)
        yield
