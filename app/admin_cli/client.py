"""The admin API as `loraplex admin` talks to it: one httpx client, errors as exit codes.

Exit codes (every `loraplex admin` command):
    0  done
    1  the adapter failed validation (`adapters push`)
    2  bad usage or local input (a missing file, an unknown tenant name)
    3  the server could not be reached, or refused the request (its message is printed)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import click
import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
ACT_FOR_TENANT_HEADER = "X-Loraplex-Tenant"


class AdminCliError(click.ClickException):
    """One line on stderr ("Error: ...") and exit status 3."""

    exit_code = 3


class ValidationFailed(AdminCliError):
    exit_code = 1


class BadInput(AdminCliError):
    exit_code = 2


class ServerError(AdminCliError):
    """The server answered with an error body (OpenAI-style, or FastAPI's detail)."""

    def __init__(self, status_code: int, message: str, code: str | None) -> None:
        self.status_code = status_code
        self.code = code
        self.server_message = message
        label = f"{status_code} {code}" if code else str(status_code)
        super().__init__(f"the server refused the request ({label}): {message}")


def error_of(response: httpx.Response) -> ServerError:
    """The error a failed response carries, however the server phrased it."""
    message, code = response.reason_phrase or "error", None
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        text = response.text.strip()
        if text:
            message = text.splitlines()[0][:300]
    else:
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict):
            message = str(error.get("message") or message)
            code = error.get("code") or error.get("type")
        elif isinstance(body, dict) and "detail" in body:
            message = str(body["detail"])
    # One line, whatever the message held.
    return ServerError(response.status_code, " ".join(message.split()), code)


@dataclass(frozen=True, slots=True)
class Tenant:
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class AdminContext:
    """The group's options, handed to every subcommand (click's ctx.obj)."""

    url: str
    admin_key: str | None

    def client(self, *, timeout_s: float = 30.0) -> AdminClient:
        return AdminClient(self.url, self.admin_key, timeout_s=timeout_s)


class AdminClient:
    """Bearer-authenticated requests to one server; every failure an AdminCliError."""

    def __init__(self, url: str, admin_key: str | None, *, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        headers = {} if not admin_key else {"Authorization": f"Bearer {admin_key}"}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def send(
        self,
        method: str,
        path: str,
        *,
        ok: Iterable[int] = (200, 201, 204),
        headers: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        try:
            response = self._http.request(method, path, headers=headers, **kwargs)
        except httpx.TimeoutException as exc:
            raise AdminCliError(f"{method} {self.url}{path} timed out ({exc}).") from exc
        except httpx.TransportError as exc:
            raise AdminCliError(
                f"cannot reach the server at {self.url} ({exc}). Is `loraplex serve` "
                "running there? Set --url or LORAPLEX_URL."
            ) from exc
        if response.status_code not in set(ok):
            raise error_of(response)
        return response

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.send(method, path, **kwargs)
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise AdminCliError(
                f"{method} {path} answered {response.status_code} with something that is not "
                "JSON; is --url a loraplex server?"
            ) from exc

    def tenants(self) -> list[Tenant]:
        body = self.json("GET", "/admin/tenants")
        return [Tenant(id=t["id"], name=t["name"]) for t in body["data"]]

    def resolve_tenant(self, id_or_name: str) -> Tenant:
        """A tenant by its id, or else by its name; exit 2 when neither matches."""
        tenants = self.tenants()
        for tenant in tenants:
            if tenant.id == id_or_name:
                return tenant
        for tenant in tenants:
            if tenant.name == id_or_name:
                return tenant
        raise BadInput(
            f"no tenant has the id or name '{id_or_name}' (see `loraplex admin tenants list`)."
        )
