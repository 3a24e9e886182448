"""The OpenAI-compatible router: engine pool, exact trajectory capture, sessions."""

from typing import TYPE_CHECKING

from agentrl._lazy import lazy

if TYPE_CHECKING:
    from agentrl.router.core import Router
    from agentrl.router.errors import EngineError, InvalidRequest, RouterError
    from agentrl.router.pool import EnginePool
    from agentrl.router.server import make_app

__getattr__, __dir__ = lazy(__name__, {
    "Router": "agentrl.router.core",
    "EngineError": "agentrl.router.errors",
    "InvalidRequest": "agentrl.router.errors",
    "RouterError": "agentrl.router.errors",
    "EnginePool": "agentrl.router.pool",
    "make_app": "agentrl.router.server",
})

__all__ = ["EngineError", "EnginePool", "InvalidRequest", "Router", "RouterError", "make_app"]
