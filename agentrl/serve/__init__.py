"""``agentrl serve``: the inference side (engines, router, agent loops, sandboxes, buffer) as one process.

- :mod:`agentrl.serve.config`: ``ServeConfig``, the command's config tree (the components' own configs);
- :mod:`agentrl.serve.build`: the one builder that makes the components from it;
- :mod:`agentrl.serve.app`: the serve process (HTTP app, status, metrics, start-up and shutdown);
- :mod:`agentrl.serve.local`: engines as child processes of this machine;
- :mod:`agentrl.serve.ray`: engines and rollout workers placed as Ray actors (``serve --ray``).
"""

from typing import TYPE_CHECKING

from agentrl._lazy import lazy

if TYPE_CHECKING:
    from agentrl.serve.app import GC_THRESHOLD, Serve, serve_forever, settle_gc

__getattr__, __dir__ = lazy(__name__, {
    "GC_THRESHOLD": "agentrl.serve.app",
    "Serve": "agentrl.serve.app",
    "serve_forever": "agentrl.serve.app",
    "settle_gc": "agentrl.serve.app",
})

__all__ = ["GC_THRESHOLD", "Serve", "serve_forever", "settle_gc"]
