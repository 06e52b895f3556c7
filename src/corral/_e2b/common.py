"""What every route of the E2B control plane's REST API shares (``control``, ``templates``):
the wrapper that answers errors in E2B's shape (``{"code", "message"}``, made by
``corral._http.errors.as_e2b``), and what a request carries (the Manager, the authenticated
tenant, a JSON object body)."""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .._control.plane import Manager, Tenant
from .._http.errors import as_e2b, failure, refused
from ..errors import CorralError
from .target import TENANT_KEY

__all__ = ["E2BHTTPError", "Handler", "endpoint", "json_body", "manager_of", "tenant_of"]


class E2BHTTPError(Exception):
    """An answer with E2B's error shape: ``status`` and a message for the caller."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


Handler = Callable[[Request], Awaitable[Response]]


def endpoint(fn: Handler) -> Handler:
    """``fn`` answering E2BHTTPError and CorralError in E2B's error shape."""

    @functools.wraps(fn)
    async def answer(request: Request) -> Response:
        try:
            return await fn(request)
        except E2BHTTPError as exc:
            status, body = as_e2b(refused(exc.status, exc.message))
        except CorralError as exc:
            status, body = as_e2b(failure(exc))
        return JSONResponse(body, status_code=status)

    return answer


def manager_of(request: Request) -> Manager:
    manager: Manager = request.app.state.manager
    return manager


def tenant_of(request: Request) -> Tenant:
    """The tenant the E2B app's authentication put in the scope (else 401)."""
    tenant = request.scope.get(TENANT_KEY)
    if not isinstance(tenant, Tenant):
        raise E2BHTTPError(401, "this request was not authenticated")
    return tenant


async def json_body(request: Request) -> dict[str, Any]:
    """The body as a JSON object (empty: ``{}``); else 400."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise E2BHTTPError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise E2BHTTPError(400, "the request body must be a JSON object")
    return body
