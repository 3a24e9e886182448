"""HTTP routes of the Responses and Messages APIs, beside the chat routes, under ``/v1`` and under
every session's base URL (``/sessions/<id>/v1``).

- ``POST /v1/responses`` (``stream: true``: typed events), ``GET`` / ``DELETE /v1/responses/<id>``;
  errors in the OpenAI shape, like the chat routes.
- ``POST /v1/messages`` (``stream: true``: Anthropic's events), ``POST /v1/messages/count_tokens``;
  every answer that is not a message, from bad JSON to an engine outage, is Anthropic's error
  shape, ``{"type": "error", "error": {"type", "message"}}``. Clients authenticate with
  ``x-api-key`` (the Anthropic SDK's header) or ``Authorization: Bearer``; a session is named by
  its base URL, ``X-Agentrl-Session`` or a ``sess-<id>`` key, as on the chat routes.

Both run as chat calls of :class:`~agentrl.router.core.Router` (same validation of what they
become, same renderers, same session capture), labelled ``responses`` / ``messages`` in the
latency metric. Nothing a client sends escapes as an unhandled exception: it is a 4xx in the
route's own shape, and the router keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from agentrl.engines.pool import dumps
from agentrl.router import messages as anthropic
from agentrl.router import responses as oai
from agentrl.router.errors import RouterError
from agentrl.router.http import ROUTER_KEY, check_client, json_body, json_response, session_of
from agentrl.router.responses_stream import ResponsesEvents
from agentrl.router.streaming import open_stream

log = logging.getLogger(__name__)

STORE_KEY = web.AppKey("response_store", oai.ResponseStore)


async def _sse(request: web.Request, events: AsyncIterator[dict[str, Any]], stream: Any) -> web.StreamResponse:
    """Server-sent events ``event: <type>`` + ``data: <json>``; the call is recorded however it ends."""
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


def _as_input_param(e: RouterError) -> RouterError:
    """A chat-side parameter name as the Responses API names it."""
    if e.param == "messages":
        e.param = "input"
    return e


# -- Responses ------------------------------------------------------------------------------------
async def create_response(request: web.Request) -> web.StreamResponse:
    check_client(request)
    router = request.app[ROUTER_KEY]
    store = request.app[STORE_KEY]
    sid = session_of(request)
    body, policy = router.named_policy(await json_body(request))
    turn = oai.parse_request(body, router.model_name, store, sid, router.max_model_len)
    if policy:  # a named LoRA policy: the chat call names it (Router.policy_of)
        turn.chat["model"] = policy
    try:
        if body.get("stream") is True:
            stream = await open_stream(router, "chat", dict(turn.chat, stream=True), sid, route="responses")
            tr = ResponsesEvents(turn, stream, router.model_name)

            async def events() -> AsyncIterator[dict[str, Any]]:
                async for ev in tr.events():
                    yield ev
                if tr.response is not None:
                    oai.remember(store, turn, tr.response, tr.reply(), sid)
            return await _sse(request, events(), stream)
        out = await router.chat(turn.chat, session_id=sid, route="responses")
    except RouterError as e:
        raise _as_input_param(e) from None
    resp = oai.from_chat(turn, out, router.model_name)
    oai.remember(store, turn, resp, out["choices"][0]["message"], sid)
    return json_response(resp)


async def get_response(request: web.Request) -> web.Response:
    check_client(request)
    return json_response(oai.retrieve(request.app[STORE_KEY], request.match_info["response_id"], session_of(request)))


async def delete_response(request: web.Request) -> web.Response:
    check_client(request)
    rid = request.match_info["response_id"]
    oai.retrieve(request.app[STORE_KEY], rid, session_of(request))
    request.app[STORE_KEY].delete(rid, session_of(request))
    return json_response({"id": rid, "object": "response", "deleted": True})


# -- Messages -------------------------------------------------------------------------------------
@web.middleware
async def anthropic_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error on the Messages routes in Anthropic's shape (the app's own middlewares give the
    OpenAI shape to the other routes)."""
    if not request.path.rstrip("/").endswith(("/v1/messages", "/v1/messages/count_tokens")):
        return await handler(request)
    try:
        return await handler(request)
    except RouterError as e:
        return json_response(anthropic.error_body(e), status=e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        return json_response({"type": "error", "error": {"type": kind, "message": e.reason or "error"}}, status=e.status)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_response({"type": "error", "error": {"type": "api_error", "message": "internal server error"}}, status=500)


async def create_message(request: web.Request) -> web.StreamResponse:
    check_client(request)
    router = request.app[ROUTER_KEY]
    sid = session_of(request)
    body, policy = router.named_policy(await json_body(request))
    chat = anthropic.parse_request(body, router.model_name, router.max_model_len)
    if policy:  # a named LoRA policy: the chat call names it (Router.policy_of)
        chat["model"] = policy
    if body.get("stream") is True:
        stream = await open_stream(router, "chat", dict(chat, stream=True), sid, route="messages")
        return await _sse(request, anthropic.MessageEvents(stream, router.model_name).events(), stream)
    out = await router.chat(chat, session_id=sid, route="messages")
    return json_response(anthropic.message_object(out, router.model_name))


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's length as the model sees it (rendered as a message call would be, nothing generated)."""
    check_client(request)
    router = request.app[ROUTER_KEY]
    chat = anthropic.parse_request(await json_body(request), router.model_name, router.max_model_len,
                                   count_only=True)
    body = router.validate(chat)
    engine = router.pool.pick(session_of(request))
    renderer = await router.renderer_for(engine, body)
    ids = (await renderer.render(engine, body)).ids
    return json_response({"input_tokens": len(ids)})


def add_protocol_routes(app: web.Application, store: oai.ResponseStore | None = None) -> None:
    """The Responses and Messages routes, at the top level and under every session's base URL."""
    app[STORE_KEY] = store or oai.ResponseStore()
    app.middlewares.append(anthropic_errors)
    for prefix in ("", "/sessions/{session_id}"):
        app.router.add_post(f"{prefix}/v1/responses", create_response)
        app.router.add_get(f"{prefix}/v1/responses/{{response_id}}", get_response)
        app.router.add_delete(f"{prefix}/v1/responses/{{response_id}}", delete_response)
        app.router.add_post(f"{prefix}/v1/messages", create_message)
        app.router.add_post(f"{prefix}/v1/messages/count_tokens", count_tokens)

