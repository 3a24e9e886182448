"""Errors the router returns, in the OpenAI error schema, named after the boundary they crossed.

The root and the errors the engine pool raises live in ``agentrl.engines.errors`` (the pool is below
the router and must not import it); they are named here too, so a route, a dialect or a caller of
the router imports every error it may meet from one module.
"""

from __future__ import annotations

from agentrl.engines.errors import EngineError, InvalidRequest, NoEngineAvailable, RouterError

__all__ = ["EngineError", "InvalidRequest", "NoEngineAvailable", "NotFound", "RouterError", "Unauthorized"]


class Unauthorized(RouterError):
    status = 401
    type = "authentication_error"


class NotFound(RouterError):
    status = 404
    type = "not_found_error"
