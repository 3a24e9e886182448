"""The view on serve's app (``/view``, beside the router) and on its own (``agentrl view RUN_DIR``).

On serve the admin token and the run's view token (``RUN_DIR/view_token``, made on first use,
mode 0600) open it, from the moment serve's port answers (the start-up app mounts it too, with the
same state, so a cookie stays good), and the tokenizer is serve's model folder once it is known. Alone, the
view reads a run
directory, live or finished: the view token and, when the directory has one, the admin token open
it; the model named in ``serve_config.json`` gives the tokenizer, unless that model is a built-in
one not built on this machine (the view does not build models: its token pages then show ids).

What the standalone command prints names the token's file, never the token.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from agentrl.credentials import find_admin_token
from agentrl.view.auth import PREFIX, ViewAuth, view_token, view_token_source
from agentrl.view.routes import ViewState, add_view_routes
from agentrl.web import error_middleware

log = logging.getLogger(__name__)
_progress = logging.getLogger("agentrl.progress")

# built-in model names and the folder under $AGENTRL_HOME/models that resolve_model builds for them
_BUILT_IN = {
    "tiny": "tiny",
    "tiny-tools": "tiny-tools",
    "tiny-arith": "tiny-arith",
    "tiny-agent": "tiny-agent",
    "smollm2": "smollm2-135m",
    "smollm2-135m": "smollm2-135m",
}


def serve_view(run_dir: str | Path, admin_token: str, model_path: Callable[[], str | None]) -> ViewState:
    """serve's view of its run: opened by the admin token or the run's view token. One state for
    serve's start-up app and its real one, so a cookie given during start-up stays good."""
    return ViewState(run_dir, ViewAuth([admin_token, view_token(Path(run_dir))]), model_path)


def mount(app: web.Application, state: ViewState) -> None:
    """Add the view's routes to one of serve's apps (before it starts, and before any catch-all route)."""
    add_view_routes(app, state)


def model_locator(run_dir: Path, model: str = "") -> Callable[[], str | None]:
    """A function that finds the run's model folder when the first token page asks for it (once:
    its answer, a folder or None, is kept)."""
    found: list[str | None] = []

    def locate() -> str | None:
        if not found:
            found.append(_locate())
        return found[0]

    def _locate() -> str | None:
        name = model
        if not name:
            try:
                name = str(json.loads((run_dir / "serve_config.json").read_text()).get("model") or "")
            except (OSError, ValueError):
                return None
        if not name:
            return None
        from agentrl.models import home, resolve_model

        if name in _BUILT_IN and not (home() / "models" / _BUILT_IN[name] / "config.json").is_file():
            log.warning("the run's model %s is not built here (agentrl model build %s); tokens show as ids",
                        name, name)
            return None
        return resolve_model(name)
    return locate


def standalone_app(run_dir: str | Path, token_file: str = "", model: str = "") -> web.Application:
    """An app serving only the view of ``run_dir`` (``/`` leads to ``/view/``)."""
    d = Path(run_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"{d} is not a directory")
    tokens = [view_token(d, token_file), find_admin_token(run_dir=d)]
    if not any(tokens):
        raise PermissionError(f"no token opens a view of {d}: it has no view_token or "
                              "admin_token and cannot be written; pass --token-file FILE")
    app = web.Application(middlewares=[error_middleware])
    add_view_routes(app, ViewState(d, ViewAuth(tokens), model_locator(d, model)))

    async def front(request: web.Request) -> web.StreamResponse:
        return web.Response(status=308, headers={"Location": PREFIX + "/"})

    app.router.add_get("/", front)
    return app


async def run_view(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8800, token_file: str = "",
                   model: str = "") -> None:
    """Serve the view of ``run_dir`` until cancelled; says where (port 0: a free one) and which file
    holds the token."""
    app = standalone_app(run_dir, token_file, model)
    runner = web.AppRunner(app, access_log=None)  # no access log: a first ?token= would be in it
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        url = f"http://{host}:{bound}{PREFIX}/"
        where = view_token_source(Path(run_dir), token_file)
        _progress.info("agentrl view: %s at %s", run_dir, url)
        if where.startswith("$"):
            _progress.info("open it with the token in %s: %s?token=%s", where, url, where)
        else:
            _progress.info("open it with the token in %s: %s?token=$(cat %s)", where, url, where)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
