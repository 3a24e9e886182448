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

from typing import TYPE_CHECKING

from agentrl._lazy import lazy

if TYPE_CHECKING:
    from agentrl.view.server import mount, run_view, serve_view, standalone_app

__getattr__, __dir__ = lazy(__name__, {
    "mount": "agentrl.view.server",
    "run_view": "agentrl.view.server",
    "serve_view": "agentrl.view.server",
    "standalone_app": "agentrl.view.server",
})

__all__ = ["mount", "run_view", "serve_view", "standalone_app"]
