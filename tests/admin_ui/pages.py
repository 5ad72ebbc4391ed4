"""Driving the admin UI over plain HTTP, as a browser's form posts would: reading the
CSRF tokens out of its pages and logging in."""

from __future__ import annotations

import re

import httpx

UI = "/admin/ui"
_CSRF_META = re.compile(r'<meta name="csrf-token" content="([^"]+)">')
_CSRF_INPUT = re.compile(r'name="csrf_token" value="([^"]+)"')


def page_csrf(html: str) -> str:
    """The session's CSRF token, as a page of the UI carries it."""
    found = _CSRF_META.search(html)
    assert found is not None, "no CSRF token on the page"
    return found.group(1)


def form_csrf(html: str) -> str:
    found = _CSRF_INPUT.search(html)
    assert found is not None, "no csrf_token field in the form"
    return found.group(1)


async def login(client: httpx.AsyncClient, key: str, *, next_path: str = "") -> httpx.Response:
    """Load the login form (for its token cookie) and post `key`; the response is not
    followed (303 on success)."""
    form = await client.get(f"{UI}/login")
    assert form.status_code == 200, form.text
    return await client.post(
        f"{UI}/login",
        data={"key": key, "csrf_token": form_csrf(form.text), "next": next_path},
    )


async def csrf_of(client: httpx.AsyncClient) -> str:
    """The CSRF token of the client's current session (from the overview page)."""
    page = await client.get(f"{UI}/")
    assert page.status_code == 200, page.text
    return page_csrf(page.text)


def set_cookie_headers(response: httpx.Response, name: str) -> list[str]:
    return [h for h in response.headers.get_list("set-cookie") if h.startswith(f"{name}=")]
