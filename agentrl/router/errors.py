"""Errors the router returns, in the OpenAI error schema, named after the boundary they crossed."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from agentrl.errors import AgentrlError


class RouterError(AgentrlError):
    """An error with an HTTP status and an OpenAI-style body."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status is not None:
            self.status = status

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


class InvalidRequest(RouterError):
    status = 400


class Unauthorized(RouterError):
    status = 401
    type = "authentication_error"


class NotFound(RouterError):
    status = 404
    type = "not_found_error"


class EngineError(RouterError):
    """The engine failed or answered with a server error: a 5xx for the client."""

    status = 502
    type = "engine_error"


class NoEngineAvailable(EngineError):
    status = 503
