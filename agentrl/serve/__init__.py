"""``agentrl serve``: the inference side (engines, router, agent loops, sandboxes, buffer) as one process.

- :mod:`agentrl.serve.config`: ``ServeConfig``, the command's config tree (the components' own configs);
- :mod:`agentrl.serve.build`: the one builder that makes the components from it;
- :mod:`agentrl.serve.app`: the serve process (HTTP app, status, metrics, start-up and shutdown);
- :mod:`agentrl.serve.collector`: a garbage-collector pacer (the agent-loop benchmark's, not serve's);
- :mod:`agentrl.serve.local`: engines as child processes of this machine;
- :mod:`agentrl.serve.ray`: engines and rollout workers placed as Ray actors (``serve --ray``);
- :mod:`agentrl.serve.teacher_engine`: the teacher engine serve launches for distillation.
"""

from agentrl._lazy import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "agentrl.serve.app": ["GC_THRESHOLD", "Serve", "serve_forever", "settle_gc"],
})
