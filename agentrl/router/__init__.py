"""The OpenAI-compatible router: engine pool, exact trajectory capture, sessions."""

from agentrl.router.core import Router
from agentrl.router.errors import EngineError, InvalidRequest, RouterError
from agentrl.router.pool import EnginePool
from agentrl.router.server import make_app

__all__ = ["EngineError", "EnginePool", "InvalidRequest", "Router", "RouterError", "make_app"]
