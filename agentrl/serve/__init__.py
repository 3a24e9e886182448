"""``agentrl serve``: the inference side (engines, router, agent loops, sandboxes, buffer) as one process.

- :mod:`agentrl.serve.app`: the serve process (HTTP app, status, metrics, start-up and shutdown);
- :mod:`agentrl.serve.ray`: engines and rollout workers placed as Ray actors (``serve --ray``).
"""

from agentrl.serve.app import (
    GC_THRESHOLD,
    Serve,
    admin_token_for,
    drops_seeds,
    eos_token_ids,
    serve_forever,
    settle_gc,
)

__all__ = ["GC_THRESHOLD", "Serve", "admin_token_for", "drops_seeds", "eos_token_ids", "serve_forever", "settle_gc"]
