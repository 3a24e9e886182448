"""Errors in the OpenAI error schema, named after the boundary they crossed.

The engines speak the OpenAI API and the router answers in it, so the error shape lives here, below
both: the engine pool raises :class:`InvalidRequest` (an engine's 4xx, never retried) and
:class:`EngineError` / :class:`NoEngineAvailable` (the engine failed or none is in the pool); the
router adds its own (``agentrl.router.errors``) on the same root, :class:`RouterError`, which every
route renders with :meth:`RouterError.response`.
"""

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


class EngineError(RouterError):
    """The engine failed or answered with a server error: a 5xx for the client."""

    status = 502
    type = "engine_error"


class NoEngineAvailable(EngineError):
    status = 503
