"""The view's HTTP routes: three pages, their static files, a login, and a read-only JSON API.

Pages (HTML; each needs the view's cookie, or ``?token=`` once, see :mod:`agentrl.view.auth`):

- ``GET /view/``: the run: charts that update while the run writes its logs;
- ``GET /view/episodes``: the episode browser (filters in the query: env, reward, version, error
  kind, truncation, role, policy; pages of at most ``MAX_PAGE`` rows);
- ``GET /view/episode/<id>``: one episode's calls, tool outputs and tokens; for a multi-agent
  episode, its graph (roles as lanes, calls as nodes), each node opening its role session's tokens.

Each page is ``static/page.html`` (the head and the nav, the same on every page) around the page's
own ``<main>`` in ``static/<page>.html``, put together once when the routes are mounted.

API (JSON; the cookie or ``Authorization: Bearer <token>``): ``/view/api/run``,
``/view/api/series?rev=L,S,E``, ``/view/api/episodes?...``, ``/view/api/episode/<id>``,
``/view/api/episode/<id>/sample/<k>?offset=&limit=`` (``<id>`` an episode's, or a role session's,
``<episode id>.<role>``). Static files: ``/view/static/<name>``
(no token: they are the package's own files, and the login page needs them).

Invariants: every route but ``POST /view/login`` is a GET, and none writes to the run directory or
calls into serve's parts (aiohttp answers 405 to other methods); disk work runs in a thread, under
one lock, so serve's event loop never waits on a large log; every response says ``no-store``,
``no-referrer`` and a Content-Security-Policy that lets the page load scripts, styles and data from
this origin only (no external asset can load, and model text drawn with ``textContent`` cannot run).
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web

from agentrl.view.auth import PREFIX, ViewAuth, redact_access_log, safe_next, without_token
from agentrl.view.episodes import (
    MAX_TOKENS_PER_PAGE,
    SessionCache,
    TooLarge,
    call_views,
    sample_summary,
    token_page,
)
from agentrl.view.graph import graph_view, roles_and_samplers
from agentrl.view.logs import EpisodeFilter, EpisodeIndex, LogTail, env_label, learner_numbers, serve_numbers
from agentrl.view.tokens import Detokenizer
from agentrl.web import error_response

log = logging.getLogger(__name__)

MAX_PAGE = 200  # episode rows per page at most
MAX_POINTS = 600  # points per chart series at most
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; connect-src 'self'; form-action "
                               "'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
STATIC_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
# each page: its static file (the <main> part) and the scripts it loads after common.js
PAGES = {"run": ("charts.js", "run.js"), "episodes": ("episodes.js",), "episode": ("graph.js", "episode.js")}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _static_files() -> dict[str, bytes]:
    root = resources.files("agentrl.view") / "static"
    return {p.name: p.read_bytes() for p in root.iterdir() if p.name.endswith(tuple(STATIC_TYPES))}


def _page_html(static: dict[str, bytes], name: str, scripts: tuple[str, ...]) -> bytes:
    """One page: ``page.html`` (the head, and the header with the nav every page shares) around
    the page's own ``<main>`` from ``<name>.html``."""
    tags = "\n".join(f'<script src="{PREFIX}/static/{s}" defer></script>' for s in scripts)
    return (static["page.html"].decode().replace("{{name}}", name).replace("{{scripts}}", tags)
            .replace("{{main}}\n", static[f"{name}.html"].decode()).encode())


class ViewState:
    """What the routes read: the run directory's logs, its sessions, and the tokenizer."""

    def __init__(self, run_dir: str | Path, auth: ViewAuth, model_path: str | Callable[[], str | None] | None,
                 max_points: int = MAX_POINTS) -> None:
        self.run_dir = Path(run_dir)
        self.auth = auth
        self.max_points = max_points
        self.lock = threading.Lock()  # the logs' readers are shared by every request
        self.learner = LogTail(self.run_dir / "learner.jsonl", learner_numbers)
        self.serve = LogTail(self.run_dir / "serve_metrics.jsonl", serve_numbers)
        self.episodes = EpisodeIndex(self.run_dir / "episodes.jsonl")
        self.sessions = SessionCache(self.run_dir / "sessions")
        self.detok = Detokenizer(model_path)
        self.static = _static_files()

    # -- what the API routes answer (called in a thread) -----------------------------------------------

    def run_info(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {}
        p = self.run_dir / "serve_config.json"
        try:
            if p.stat().st_size < 1 << 20:
                cfg = json.loads(p.read_text())
        except (OSError, ValueError):
            pass
        env = cfg.get("env") if isinstance(cfg.get("env"), dict) else {}
        buf = cfg.get("buffer") if isinstance(cfg.get("buffer"), dict) else {}
        files = {}
        for name in ("learner.jsonl", "episodes.jsonl", "serve_metrics.jsonl"):
            try:
                files[name] = (self.run_dir / name).stat().st_size
            except OSError:
                files[name] = None
        # only named, harmless fields of the config: nothing secret can pass through
        return {"name": self.run_dir.resolve().name, "model": str(cfg.get("model") or ""),
                "env": str(env.get("name") or ""), "group_size": env.get("group_size"),
                "batch_size": buf.get("batch_size"), "max_staleness": buf.get("max_staleness"),
                "files": files, "now": time.time()}

    def series(self, revs: list[int]) -> dict[str, Any]:
        with self.lock:
            out: dict[str, Any] = {}
            for (name, src), rev in zip((("learner", self.learner), ("serve", self.serve),
                                         ("episodes", self.episodes)), revs, strict=True):
                src.refresh()
                seen = src.seen if isinstance(src, LogTail) else len(src)
                if rev == seen and seen > 0:
                    out[name] = {"rev": seen, "unchanged": True}
                else:
                    out[name] = (src.snapshot(self.max_points) if isinstance(src, LogTail)
                                 else src.series(self.max_points))
            firsts = [c[0] for c in (self.learner.cols.get("time"), self.serve.cols.get("time")) if c]
            if len(self.episodes):
                firsts.append(self.episodes.times[0])
            firsts = [t for t in firsts if t == t]  # not NaN
            out["t0"] = min(firsts) if firsts else None
            return out

    def episode_page(self, f: EpisodeFilter, offset: int, limit: int) -> dict[str, Any]:
        with self.lock:
            self.episodes.refresh()
            total, offsets = self.episodes.match(f, offset, limit)
            rows = self.episodes.read_rows(offsets)
            return {"total": total, "offset": offset, "limit": limit, "indexed": len(self.episodes),
                    "facets": self.episodes.facets(), "rows": [_episode_row(r) for r in rows]}

    def episode(self, episode_id: str) -> dict[str, Any] | None:
        """The episode's line, its calls and samples (its own session), and its graph (a multi-agent
        episode, whose calls are in its roles' sessions instead); None when there is none of these."""
        with self.lock:
            got = self.sessions.get(episode_id)
            self.episodes.refresh()
            line = self.episodes.find(episode_id)  # None while the episode is still being played
        graph = graph_view(line)
        if got is None and graph is None:
            return None
        session, samples = got if got is not None else (None, [])
        if graph is not None:  # which role sessions the view can open
            graph["sessions"] = {sid: self.sessions.path(sid) is not None
                                 for sid in sorted({n["session"] for n in graph["nodes"] if n["session"]})}
        return {"episode": line, "calls": call_views(session) if session is not None else [],
                "samples": [sample_summary(k, s) for k, s in enumerate(samples)], "graph": graph}

    def sample(self, episode_id: str, k: int, offset: int, limit: int) -> dict[str, Any] | None:
        with self.lock:
            got = self.sessions.get(episode_id)
            if got is None or not 0 <= k < len(got[1]):
                return None
            session, samples = got
        # the tokenizer outside the lock
        page = token_page(session, samples[k], self.detok.pieces, offset, limit)
        page["tokenizer_error"] = self.detok.error
        return page


def _episode_row(r: dict[str, Any]) -> dict[str, Any]:
    """The browser's columns of one episode line (the error message cut short)."""
    versions = [v for v in r.get("versions") or [] if isinstance(v, int)]
    err = r.get("error")
    return {
        "episode_id": r.get("episode_id"),
        "time": r.get("time"),
        "env": env_label(r),
        "task_id": r.get("task_id"),
        "reward": r.get("reward"),
        "turns": r.get("turns"),
        "truncated": r.get("truncated"),
        "truncation": r.get("truncation"),
        "error_kind": r.get("error_kind"),
        "error": err[:200] if isinstance(err, str) else None,
        "completion_tokens": r.get("completion_tokens"),
        "version_min": min(versions, default=None),
        "version_max": max(versions, default=None),
        "seconds": r.get("seconds"),
        "num_samples": r.get("num_samples"),
        "tool_calls": (r.get("info") or {}).get("tool_calls") if isinstance(r.get("info"), dict) else None,
        "roles": roles_and_samplers(r)[0],
    }


def _secured(resp: web.StreamResponse) -> web.StreamResponse:
    resp.headers.update(SECURITY_HEADERS)
    return resp


def _json(data: Any, status: int = 200) -> web.StreamResponse:
    return _secured(web.json_response(data, status=status))


def _error(message: str, status: int) -> web.StreamResponse:
    return _secured(error_response(message, status))


def _num(request: web.Request, key: str, kind: type, default: Any = None) -> Any:
    raw = request.query.get(key, "").strip()
    if not raw:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise web.HTTPBadRequest(reason=f"{key}={raw!r} is not a {kind.__name__}") from None


def add_view_routes(app: web.Application, state: ViewState) -> None:
    """Mount the view under ``/view`` on ``app`` (before the app starts)."""
    redact_access_log()
    login_page = state.static["login.html"].decode()

    def login(target: str, message: str) -> web.StreamResponse:
        body = (login_page.replace("{{next}}", html.escape(safe_next(target), quote=True))
                .replace("{{message}}", html.escape(message)))
        return _secured(web.Response(text=body, status=401, content_type="text/html"))

    def page(name: str) -> Handler:
        body = _page_html(state.static, name, PAGES[name])

        async def handler(request: web.Request) -> web.StreamResponse:
            if "token" in request.query:  # the link with the token: exchange it for the cookie, once
                if not state.auth.token_ok(request.query["token"]):
                    return login(without_token(request), "That token does not open this view.")
                resp = _secured(web.Response(status=303, headers={"Location": without_token(request)}))
                state.auth.set_cookie(resp, request)
                return resp
            if not state.auth.authorized(request):
                return login(str(request.rel_url), "This view needs the run's view "
                                                   "token or serve's admin token.")
            return _secured(web.Response(body=body, content_type="text/html"))
        return handler

    async def post_login(request: web.Request) -> web.StreamResponse:
        form = await request.post()
        target = safe_next(str(form.get("next") or ""))
        if not state.auth.token_ok(str(form.get("token") or "")):
            return login(target, "That token does not open this view.")
        resp = _secured(web.Response(status=303, headers={"Location": target}))
        state.auth.set_cookie(resp, request)
        return resp

    async def static(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        body = state.static.get(name)
        if body is None or name.endswith(".html"):
            return _error(f"no static file {name!r}", 404)
        ctype = STATIC_TYPES[name[name.rindex("."):]]
        return _secured(web.Response(body=body, content_type=ctype, charset="utf-8"))

    def api(fn: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            if not state.auth.authorized(request):
                return _error("the view's API needs the view's cookie or Authorization: Bearer <token>", 401)
            try:
                return await fn(request)
            except web.HTTPBadRequest as e:
                return _error(e.reason, 400)
            except TooLarge as e:
                return _error(str(e), 413)
            except ValueError as e:  # records that do not stitch (Session.samples says why)
                log.warning("view: %s", e)
                return _error(f"the records do not make samples: {e}", 422)
        return handler

    async def run_info(request: web.Request) -> web.StreamResponse:
        return _json(await asyncio.to_thread(state.run_info))

    async def series(request: web.Request) -> web.StreamResponse:
        parts = request.query.get("rev", "").split(",")
        revs = [int(p) if p.strip().isdigit() else -1 for p in (parts + ["", "", ""])[:3]]
        return _json(await asyncio.to_thread(state.series, revs))

    async def episodes(request: web.Request) -> web.StreamResponse:
        f = EpisodeFilter(
            env=request.query.get("env", ""),
            reward_min=_num(request, "reward_min", float),
            reward_max=_num(request, "reward_max", float),
            version_min=_num(request, "version_min", int),
            version_max=_num(request, "version_max", int),
            error_kind=request.query.get("error_kind", ""),
            truncation=request.query.get("truncation", ""),
            role=request.query.get("role", ""),
            policy=request.query.get("policy", ""),
        )
        offset = max(0, _num(request, "offset", int, 0))
        limit = min(MAX_PAGE, max(1, _num(request, "limit", int, 50)))
        return _json(await asyncio.to_thread(state.episode_page, f, offset, limit))

    async def episode(request: web.Request) -> web.StreamResponse:
        got = await asyncio.to_thread(state.episode, request.match_info["episode_id"])
        if got is None:
            return _error("no recorded calls for this episode (sessions/<id>.jsonl) and no graph "
                          "in its line of episodes.jsonl", 404)
        return _json(got)

    async def sample(request: web.Request) -> web.StreamResponse:
        k = int(request.match_info["k"])
        offset = max(0, _num(request, "offset", int, 0))
        limit = min(MAX_TOKENS_PER_PAGE, max(1, _num(request, "limit", int, MAX_TOKENS_PER_PAGE)))
        got = await asyncio.to_thread(state.sample, request.match_info["episode_id"], k, offset, limit)
        if got is None:
            return _error("no such episode or sample", 404)
        return _json(got)

    async def to_front(request: web.Request) -> web.StreamResponse:
        return _secured(web.Response(status=308, headers={"Location": PREFIX + "/"}))

    r = app.router
    r.add_get(PREFIX, to_front)
    r.add_get(PREFIX + "/", page("run"))
    r.add_get(PREFIX + "/episodes", page("episodes"))
    r.add_get(PREFIX + "/episode/{episode_id}", page("episode"))
    r.add_post(PREFIX + "/login", post_login)
    r.add_get(PREFIX + "/static/{name}", static)
    r.add_get(PREFIX + "/api/run", api(run_info))
    r.add_get(PREFIX + "/api/series", api(series))
    r.add_get(PREFIX + "/api/episodes", api(episodes))
    r.add_get(PREFIX + "/api/episode/{episode_id}", api(episode))
    r.add_get(PREFIX + "/api/episode/{episode_id}/sample/{k:\\d+}", api(sample))
