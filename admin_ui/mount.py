"""Adding the admin UI to the app: its routes, its static files, its state, and how its
refusals are shown (pages for browsers, OpenAI-style JSON for scripts)."""

from __future__ import annotations

import inspect
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.staticfiles import StaticFiles

from admin_ui.routes import adapters, auth, invoices, keys, overview, playground, tenants, usage
from admin_ui.sessions import SessionSigner
from admin_ui.web import (
    PREFIX,
    STATIC_PREFIX,
    AdminUI,
    LoginRequired,
    UIError,
    error_page,
    login_redirect,
    wants_json,
)
from app.api.errors import APIError, service_error
from app.api.state import AppState
from app.core.errors import ServiceError
from app.main import Mount

# Streamed uploads: RequestContextMiddleware must not apply the general body limit.
UPLOAD_PATHS = frozenset({adapters.UPLOAD_PATH})
STATIC_DIR = Path(__file__).parent / "static"


def install(app: FastAPI) -> None:
    """Call after install_exception_handlers(app): API errors raised on the UI's pages
    are shown as pages, and anywhere else go on to the API's handler."""
    state = app.state.loraplex
    assert isinstance(state, AppState), "create_app() sets app.state.loraplex first"
    app.state.admin_ui = AdminUI(signer=SessionSigner(state.directory.secret))
    for module in (auth, overview, tenants, keys, adapters, playground, usage, invoices):
        app.include_router(module.router, include_in_schema=False)
    app.mount(STATIC_PREFIX, StaticFiles(directory=STATIC_DIR), name="admin_ui_static")

    api_error_handler = app.exception_handlers[APIError]

    async def on_login_required(request: Request, exc: Exception) -> Response:
        return login_redirect(request)

    async def on_ui_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, UIError)
        return error_page(request, exc)

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        if request.url.path.startswith(PREFIX + "/") and not wants_json(request):
            title = "Not found" if exc.status_code == 404 else "Request refused"
            return error_page(request, UIError(exc.status_code, exc.message, title=title,
                                               headers=exc.headers))
        response = api_error_handler(request, exc)
        return await response if inspect.isawaitable(response) else response

    async def on_service_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ServiceError)
        return await on_api_error(request, service_error(exc))

    app.add_exception_handler(LoginRequired, on_login_required)
    app.add_exception_handler(UIError, on_ui_error)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(ServiceError, on_service_error)


MOUNT = Mount(name="admin_ui", install=install, upload_paths=UPLOAD_PATHS)
