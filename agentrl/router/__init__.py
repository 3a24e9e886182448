"""The OpenAI-compatible router: engine pool, exact trajectory capture, sessions."""

from agentrl._lazy import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "agentrl.router.core": ["Router"],
    "agentrl.router.errors": ["EngineError", "InvalidRequest", "RouterError"],
    "agentrl.engines.pool": ["EnginePool"],
    "agentrl.router.server": ["make_app"],
})
