"""The OpenAI text Completions dialect: ``POST /v1/completions`` and the same under every session's
base URL.

The body goes to :meth:`~agentrl.router.core.Router.complete` as it is (the engine renders a text
prompt itself); ``stream: true`` answers in OpenAI's ``data:`` framing; errors are the OpenAI shape.
"""

from __future__ import annotations

from aiohttp import web

from agentrl.router.http import data_sse, json_body, json_response, model_call
from agentrl.router.streaming import open_stream


async def completions(request: web.Request) -> web.StreamResponse:
    router, sid = model_call(request)
    body = await json_body(request)
    streamed = isinstance(body, dict) and body.get("stream") is True
    return await data_sse(request, await open_stream(router, "completion", body, sid)) if streamed \
        else json_response(await router.complete(body, session_id=sid))


def add_routes(app: web.Application) -> None:
    for prefix in ("", "/sessions/{session_id}"):
        app.router.add_post(f"{prefix}/v1/completions", completions)
