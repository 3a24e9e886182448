"""The web view of a run: live charts, an episode browser, and each episode token by token.

- :mod:`agentrl.view.logs`: the run directory's JSONL logs, read incrementally, held bounded;
- :mod:`agentrl.view.episodes`: one episode's calls and samples, rebuilt with the router's own
  :class:`~agentrl.router.sessions.Session` stitching (the trainer's mask and versions);
- :mod:`agentrl.view.tokens`: token ids as text with the run's tokenizer, one token at a time;
- :mod:`agentrl.view.auth`: the token-once, cookie-after access (no token in pages, logs or URLs);
- :mod:`agentrl.view.routes`: the pages, static files and read-only JSON API under ``/view``;
- :mod:`agentrl.view.server`: mounting it on serve's app, and ``agentrl view RUN_DIR`` alone;
- ``static/``: the pages' HTML, CSS and hand-written JS (SVG charts), served from the package:
  the view fetches nothing from anywhere else.
"""

from agentrl._lazy import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "agentrl.view.server": ["mount", "run_view", "serve_view", "standalone_app"],
})
