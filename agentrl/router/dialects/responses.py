"""The OpenAI Responses dialect: ``POST /v1/responses`` (``stream: true``: typed events),
``GET`` / ``DELETE /v1/responses/<id>``, at the top level and under every session's base URL.

A request is translated into a chat call (:mod:`.responses_translate`) that the capture core runs as
any chat call (same validation of what it becomes, same renderers, same session capture), labelled
``responses`` in the latency metric; the answer is translated back, or streamed as the API's typed
events (:mod:`.responses_stream`). Errors are the OpenAI shape, a chat-side ``messages`` parameter
named ``input`` as this API names it. A stored response is scoped to the session that made it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from agentrl.router.dialects import responses_translate as oai
from agentrl.router.dialects.responses_stream import ResponsesEvents
from agentrl.router.errors import RouterError
from agentrl.router.http import ROUTER_KEY, check_client, json_body, json_response, session_of, typed_sse
from agentrl.router.streaming import open_stream

STORE_KEY = web.AppKey("response_store", oai.ResponseStore)


def _as_input_param(e: RouterError) -> RouterError:
    """A chat-side parameter name as the Responses API names it."""
    if e.param == "messages":
        e.param = "input"
    return e


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
            return await typed_sse(request, events(), stream)
        out = await router.chat(turn.chat, session_id=sid, route="responses")
    except RouterError as e:
        raise _as_input_param(e) from None
    resp = oai.from_chat(turn, out, router.model_name)
    oai.remember(store, turn, resp, out["choices"][0]["message"], sid)
    return json_response(resp)


async def get_response(request: web.Request) -> web.Response:
    check_client(request)
    return json_response(oai.retrieve(request.app[STORE_KEY], request.match_info["response_id"],
                                      session_of(request)))


async def delete_response(request: web.Request) -> web.Response:
    check_client(request)
    rid = request.match_info["response_id"]
    oai.retrieve(request.app[STORE_KEY], rid, session_of(request))
    request.app[STORE_KEY].delete(rid, session_of(request))
    return json_response({"id": rid, "object": "response", "deleted": True})


def add_routes(app: web.Application, store: oai.ResponseStore | None = None) -> None:
    app[STORE_KEY] = store or oai.ResponseStore()
    for prefix in ("", "/sessions/{session_id}"):
        app.router.add_post(f"{prefix}/v1/responses", create_response)
        app.router.add_get(f"{prefix}/v1/responses/{{response_id}}", get_response)
        app.router.add_delete(f"{prefix}/v1/responses/{{response_id}}", delete_response)
