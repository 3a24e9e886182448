"""The OpenAI Chat Completions dialect: ``POST /v1/chat/completions`` and the same under every
session's base URL (``/sessions/<id>/v1``).

A chat body is the capture core's own request shape, so this dialect translates nothing: it runs
:meth:`~agentrl.router.core.Router.chat` (or opens a recorded stream for ``stream: true``, answered
in OpenAI's ``data:`` framing) and answers errors in the OpenAI shape (:class:`RouterError`, through
the app's error middleware; mid-stream, in-band). A body longer than any prompt that fits the
context is refused from its Content-Length, before it is read.
"""

from __future__ import annotations

from aiohttp import web

from agentrl.router.errors import InvalidRequest
from agentrl.router.http import data_sse, json_body, json_response, model_call
from agentrl.router.streaming import open_stream


async def chat_completions(request: web.Request) -> web.StreamResponse:
    router, sid = model_call(request)
    limit = router.max_request_bytes
    if limit and request.content_length is not None and request.content_length > limit:
        # so much text cannot fit the context whatever it says: refused before it is read or parsed,
        # and the connection closed (draining the rest of the body would cost the loop as much)
        resp = InvalidRequest(f"the request has {request.content_length} bytes: more than a prompt that fits "
                              f"this model's context can take ({limit})", param="messages",
                              code="context_length_exceeded").response()
        resp.force_close()
        return resp
    body = await json_body(request)
    if isinstance(body, dict) and body.get("stream") is True:
        return await data_sse(request, await open_stream(router, "chat", body, sid))
    return json_response(await router.chat(body, session_id=sid))


def add_routes(app: web.Application) -> None:
    for prefix in ("", "/sessions/{session_id}"):
        app.router.add_post(f"{prefix}/v1/chat/completions", chat_completions)
