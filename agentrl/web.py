"""serve's HTTP conventions, shared by every route it serves (router, buffer, weights, admin).

- One bearer parsing: ``Authorization: Bearer <token>``, the scheme case-insensitive (RFC 7235), the
  token compared in constant time.
- One error shape: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's), whatever the route;
  :func:`error_response` builds it, :func:`error_middleware` turns aiohttp's HTTP exceptions and any
  unforeseen exception into it, so no route answers an HTML page or a bare string.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

ADMIN_TOKEN = web.AppKey("agentrl_admin_token", str)

# error "type" by status, when the raiser did not say
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error", 409: "conflict_error", 413: "request_too_large", 429: "rate_limit_error"}


def bearer(request: web.Request) -> str | None:
    """The bearer token of a request, or None (the scheme is matched case-insensitively)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def token_matches(given: str | None, expected: str) -> bool:
    return bool(expected) and given is not None and hmac.compare_digest(given.encode(), expected.encode())


def error_body(message: str, status: int, *, type: str | None = None, code: str | None = None,
               param: str | None = None, **extra: Any) -> dict[str, Any]:
    err = {"message": message, "type": type or _TYPES.get(status, "server_error" if status >= 500 else
                                                         "invalid_request_error"), "param": param, "code": code}
    return {"error": err, **extra}


def error_response(message: str, status: int, *, headers: dict[str, str] | None = None, **kw: Any) -> web.Response:
    return web.json_response(error_body(message, status, **kw), status=status, headers=headers)


class Unauthorized(web.HTTPUnauthorized):
    """A missing or wrong admin token (answered 401 in the one error shape)."""


def require_admin(request: web.Request) -> None:
    """Refuse a request without serve's admin token (no token configured: every request passes)."""
    expected = request.app.get(ADMIN_TOKEN, "")
    if expected and not token_matches(bearer(request), expected):
        raise Unauthorized(reason="this route needs the admin token (Authorization: Bearer <admin token>)")


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's HTTP errors and unforeseen exceptions as the one error shape (routes with their own
    error type, like the router's, answer it themselves and pass through untouched)."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.reason or e.text or "error", e.status,
                              headers={k: v for k, v in e.headers.items() if k.lower() == "retry-after"})
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response("internal server error", 500, type="server_error")
