"""The router: the capture core (exact trajectory capture, sessions; ``core``), its wire protocols
(``dialects``) and the HTTP app (``server``). ``EnginePool`` is exported here for the router's
callers; it lives in ``agentrl.engines.pool``, below the router."""

from agentrl._lazy import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "agentrl.router.core": ["Router"],
    "agentrl.router.errors": ["EngineError", "InvalidRequest", "RouterError"],
    "agentrl.engines.pool": ["EnginePool"],
    "agentrl.router.server": ["make_app"],
})
