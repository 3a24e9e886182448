"""What every HTTP route of the router shares: the app's keys, who the client is (API key, admin token,
session), the request's JSON body, JSON answers, the OpenAI-shaped error middleware, and the two
server-sent-event framings the dialects stream in (OpenAI's ``data:`` lines ending in ``[DONE]``;
typed ``event:`` + ``data:`` pairs, which the Responses and Messages APIs share).

The app (``server``) and every dialect's routes import this module; it imports neither, so the routes
of a wire protocol never reach into the app's module. Invariant: a session id is checked
(:func:`valid_session_id`) before any work, because it names a file of the session log.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from aiohttp import web

from agentrl.engines.pool import dumps, loads
from agentrl.router.core import Router
from agentrl.router.errors import InvalidRequest, RouterError, Unauthorized
from agentrl.router.sessions import valid_session_id
from agentrl.router.streaming import Stream
from agentrl.web import ADMIN_TOKEN, bearer, token_matches

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler

log = logging.getLogger(__name__)

ROUTER_KEY = web.AppKey("router", Router)
API_KEYS = web.AppKey("api_keys", frozenset)


def client_key(request: web.Request) -> str | None:
    """The client's key: ``Authorization: Bearer``, or Anthropic's ``x-api-key`` header."""
    return bearer(request) or request.headers.get("x-api-key")


def session_of(request: web.Request) -> str | None:
    """The session a call names: its base URL, ``X-Agentrl-Session``, or a ``sess-<id>`` key."""
    sid = request.match_info.get("session_id") or request.headers.get("X-Agentrl-Session")
    key = client_key(request)
    if sid is None and key and key.startswith("sess-"):
        sid = key[5:]
    if sid is not None and not valid_session_id(sid):  # before any work: it would name a file
        raise InvalidRequest("a session id has 1-128 letters, digits, '_', '-' or inner '.' (no path), "
                             f"not {sid[:60]!r}", param="session_id", code="invalid_session_id")
    return sid


def is_admin(request: web.Request, key: str) -> bool:
    return token_matches(key, request.app[ADMIN_TOKEN])


def check_client(request: web.Request) -> None:
    """Let a model call through when no API keys are configured, or it holds one of them, the admin
    token, or a session the admin opened; else :class:`Unauthorized`."""
    keys = request.app[API_KEYS]
    if not keys:
        return
    key = client_key(request) or ""
    if key in keys or is_admin(request, key):
        return
    sid = session_of(request)
    if sid is not None and sid in request.app[ROUTER_KEY].sessions:
        return  # a session the admin opened: its base URL / key is the credential
    raise Unauthorized("invalid API key", code="invalid_api_key")


def model_call(request: web.Request) -> tuple[Router, str | None]:
    """What a model route reads first: the client may call (:func:`check_client`), the router, and the
    session the call names."""
    check_client(request)
    return request.app[ROUTER_KEY], session_of(request)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The router's own errors in their OpenAI shape; anything else falls to
    :func:`agentrl.web.error_middleware`."""
    try:
        return await handler(request)
    except RouterError as e:
        return e.response()


async def json_body(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


async def data_sse(request: web.Request, stream: Stream) -> web.StreamResponse:
    """OpenAI's framing: ``data: <chunk>`` per chunk, then ``data: [DONE]``; an error after the stream
    started goes in-band in the OpenAI error shape. The call is recorded however the stream ends."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    events = stream.events()
    try:
        await resp.prepare(request)
        try:
            async for chunk in events:
                await resp.write(b"data: " + _dumps(chunk).encode() + b"\n\n")
        except RouterError as e:  # the engine failed mid-stream: tell the client in-band
            log.warning("stream failed after it started: %s", e.message)
            await resp.write(b"data: " + _dumps(e.body()).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError):
        log.info("a streaming client went away; recorded what was produced")
    finally:
        await events.aclose()
        await stream.close()  # records the call whatever happened
    return resp


async def typed_sse(request: web.Request, events: AsyncIterator[dict[str, Any]],
                    stream: Stream) -> web.StreamResponse:
    """Typed events, ``event: <type>`` + ``data: <json>`` (the Responses and Messages framing); the
    dialect's ``events`` put any error in its own shape. The call is recorded however it ends."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await resp.prepare(request)
        async for ev in events:
            await resp.write(b"event: " + ev["type"].encode() + b"\ndata: " + dumps(ev) + b"\n\n")
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError):
        log.info("a streaming client went away; recorded what was produced")
    finally:
        await stream.close()
    return resp
