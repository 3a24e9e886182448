"""The router's HTTP app: the dialects' routes, sessions, health, metrics, admin control.

Model routes come from the dialects (:mod:`agentrl.router.dialects`: ``/v1/chat/completions``,
``/v1/completions``, ``/v1/responses``, ``/v1/messages``), with ``/v1/models`` here, all of them also
under ``/sessions/<id>/v1/...`` (a scaffold's base URL). A session can also be named by the
``X-Agentrl-Session`` header or by an API key of the form ``sess-<id>``. ``stream: true`` answers
with server-sent events. Control routes under ``/admin`` need the admin token.

Access: when API keys are configured, an OpenAI route needs one of them, the admin token, or a
session (path, header or ``sess-`` key) that the admin opened (``POST /admin/sessions``); an
unknown session is refused rather than created. A session's own records
(``GET /sessions/<id>/records``) need that session's key ``sess-<id>`` or the admin token, so
one session cannot read another's. Every error is an OpenAI-style JSON body; nothing a client
sends crashes the router.

A session's samples (``GET /admin/sessions/<id>/samples``, and ``POST /admin/sessions/<id>/close``,
which a rollout worker on another machine calls at an episode's end) travel in the buffer's binary
batch encoding (``application/octet-stream``, :func:`agentrl.buffer.codec.encode_batch`): the
per-token numbers are encoded once, as the buffer stores them; the batch header's ``info`` holds
``session_id``, ``splits`` and ``calls``, its ``learner_version`` the policy version the router
serves.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from aiohttp import web

from agentrl.buffer.codec import Batch, encode_batch
from agentrl.router.core import Router
from agentrl.router.dialects import chat, completions, messages, responses
from agentrl.router.errors import InvalidRequest, NotFound, Unauthorized
from agentrl.router.http import (
    API_KEYS,
    ROUTER_KEY,
    check_client,
    errors_middleware,
    is_admin,
    json_body,
)
from agentrl.router.metrics import CONTENT_TYPE, exposition
from agentrl.router.session_store import SessionLimits
from agentrl.web import ADMIN_TOKEN, bearer, error_middleware, require_admin

log = logging.getLogger(__name__)

# More /metrics series from whoever hosts the router (serve: its rollout, scoring and buffer)
METRICS_EXTRA: web.AppKey[Any] = web.AppKey("metrics_extra")
# Other processes' expositions in this one (serve: its other router processes'), each labelled
METRICS_OTHERS: web.AppKey[Any] = web.AppKey("metrics_others")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


async def own_records(request: web.Request) -> web.Response:
    """A session's own call records: needs ``sess-<id>`` of that very session, or the admin token."""
    sid = request.match_info["session_id"]
    key = bearer(request) or ""
    if not (is_admin(request, key) or (key.startswith("sess-") and hmac.compare_digest(key[5:], sid))):
        raise Unauthorized("a session's records need its own key (Authorization: Bearer sess-<id>)",
                           code="invalid_api_key")
    s = request.app[ROUTER_KEY].sessions.get(sid)
    if s is None:
        raise NotFound(f"unknown session {sid!r}", param="session_id")
    return web.json_response({"session_id": sid, "records": [r.to_dict() for r in s.records]}, dumps=_dumps)


async def models(request: web.Request) -> web.Response:
    check_client(request)
    r = request.app[ROUTER_KEY]
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "agentrl", "max_model_len": r.max_model_len}
        for name in [r.model_name, *r.policies]]})


async def health(request: web.Request) -> web.Response:
    r = request.app[ROUTER_KEY]
    healthy = sum(e.healthy for e in r.pool.engines)
    return web.json_response({"status": "ok" if healthy else "degraded", "engines_healthy": healthy,
                              "version": r.pool.version}, status=200 if healthy else 503)


async def create_session(request: web.Request) -> web.Response:
    """Open a session (a rollout worker elsewhere, or a scaffold host): ``{"session_id", "meta",
    "limits"}``."""
    require_admin(request)
    body = await json_body(request) if request.can_read_body else {}
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be an object")
    try:
        limits = SessionLimits(**body["limits"]) if body.get("limits") is not None else None
    except TypeError as e:
        raise InvalidRequest(f"'limits' must hold max_calls, max_tokens, max_session_tokens: {e}",
                             param="limits") from None
    s = request.app[ROUTER_KEY].open_session(
        body.get("session_id"), limits=limits, **(body.get("meta") or {})
    )
    base = f"{request.scheme}://{request.host}/sessions/{s.session_id}/v1"
    return web.json_response({"session_id": s.session_id, "base_url": base})


def _samples_response(
    router: Router, session_id: str, samples: list[Any], info: dict[str, Any]
) -> web.Response:
    """A session's samples as one binary batch whose header carries the session's figures (see the
    module docstring): the per-token numbers are encoded once, as the buffer stores them."""
    batch = Batch(batch_id=session_id, samples=samples, learner_version=router.pool.version,
                  info={"session_id": session_id, **info})
    return web.Response(body=encode_batch(batch), content_type="application/octet-stream")


async def session_samples(request: web.Request) -> web.Response:
    require_admin(request)
    router = request.app[ROUTER_KEY]
    s = router.get_session(request.match_info["sid"])
    return _samples_response(router, s.session_id, s.samples(), {"splits": s.splits, "calls": len(s.records)})


async def close_session(request: web.Request) -> web.Response:
    """Close a session and return its summary and samples: how a rollout worker on another machine
    ends an episode."""
    require_admin(request)
    sid = request.match_info["sid"]
    router = request.app[ROUTER_KEY]
    summary = await router.end(sid)
    if summary is None:
        raise NotFound(f"unknown session {sid!r}", param="session_id")
    # the call log (an external multi-agent program's graph) is for serve's own scaffolds only
    header = {k: v for k, v in vars(summary).items() if k not in ("samples", "session_id", "call_log")}
    return _samples_response(router, sid, summary.samples, header)


async def engines_status(request: web.Request) -> web.Response:
    require_admin(request)
    r = request.app[ROUTER_KEY]
    return web.json_response({"version": r.pool.version, "versions": r.pool.versions,
                              "engines": r.pool.status(), "counters": r.counters})


async def metrics(request: web.Request) -> web.Response:
    extra, others = request.app.get(METRICS_EXTRA), request.app.get(METRICS_OTHERS)
    body = exposition(request.app[ROUTER_KEY], extra() if extra else None, others() if others else ())
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def add_router_routes(app: web.Application, router: Router, *, admin_token: str = "",
                      api_keys: frozenset[str] = frozenset()) -> None:
    app[ROUTER_KEY] = router
    app[ADMIN_TOKEN] = admin_token
    app[API_KEYS] = api_keys
    app.router.add_get("/v1/models", models)
    app.router.add_get("/sessions/{session_id}/records", own_records)
    app.router.add_get("/sessions/{session_id}/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/admin/sessions", create_session)
    app.router.add_get("/admin/sessions/{sid}/samples", session_samples)
    app.router.add_post("/admin/sessions/{sid}/close", close_session)
    app.router.add_get("/admin/engines", engines_status)
    for dialect in (chat, completions, responses, messages):
        dialect.add_routes(app)
    app.on_cleanup.append(_flush_session_log)


async def _flush_session_log(app: web.Application) -> None:
    """An app that stops has its calls' records on disk (they are written off the loop, a little later)."""
    await app[ROUTER_KEY].flush_log()


def make_app(router: Router, *, admin_token: str = "", api_keys: frozenset[str] = frozenset(),
             client_max_size: int = 64 * 2**20) -> web.Application:
    app = web.Application(middlewares=[error_middleware, errors_middleware], client_max_size=client_max_size)
    add_router_routes(app, router, admin_token=admin_token, api_keys=api_keys)
    app.router.add_get("/metrics", metrics)
    return app
