"""A loopback OpenAI endpoint in front of an episode's :class:`~agentrl.env.base.Model`.

Ecosystem code that only takes a base URL (verifiers' rollout, run in its own interpreter) is given
``http://127.0.0.1:<port>/m/<token>/v1``: each chat completion posted there is the episode's
``model.chat(body)``, so it is recorded in the episode's router session token for token, under the
episode's limits. A ``stream: true`` request is answered as server-sent events carrying the one
completion (a single chunk with the whole message, then usage, then ``[DONE]``): the engine call
itself is not streamed, which keeps one recorded call per request.

Invariants: one server per process (per event loop), started on first use on a free loopback port; a token
names
one episode and is forgotten when its block exits; a call beyond the episode's limits is a 400 in
OpenAI's error shape (the ecosystem sees a refused request, the episode records the truncation).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import weakref
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from aiohttp import web

from agentrl.env.base import Model

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator

log = logging.getLogger(__name__)

_models: dict[str, Model] = {}
_sites: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[web.AppRunner, int]] = (
    weakref.WeakKeyDictionary()
)
_keepers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncGenerator[None, None]] = (
    weakref.WeakKeyDictionary()
)
_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": kind}}, status=status)


async def _chat(request: web.Request) -> web.StreamResponse:
    model = _models.get(request.match_info["token"])
    if model is None:
        return _error(404, "no such episode (it has ended)", "not_found")
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "the body is not JSON", "invalid_request_error")
    stream = bool(body.get("stream"))
    try:
        out = await model.chat(body)
    except Exception as e:  # the episode records what happened; the client sees a refused call
        status = 400 if type(e).__name__ in ("LimitReached", "InvalidRequest") else 502
        return _error(
            status, f"{type(e).__name__}: {e}", "invalid_request_error" if status == 400 else "api_error"
        )
    out = {k: v for k, v in out.items() if k != "agentrl"}
    if not stream:
        return web.json_response(out)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for chunk in _chunks(out):
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _chunks(out: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat completion as the chunks a stream of it would have had: the whole message at once."""
    base = {"id": out.get("id", "chatcmpl-agentrl"), "object": "chat.completion.chunk",
            "created": out.get("created", int(time.time())), "model": out.get("model", "")}
    chunks = []
    for choice in out.get("choices") or []:
        msg = choice.get("message") or {}
        delta: dict[str, Any] = {"role": "assistant", "content": msg.get("content") or ""}
        if msg.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(msg["tool_calls"])]
        chunks.append({**base, "choices": [{"index": choice.get("index", 0), "delta": delta,
                                            "finish_reason": choice.get("finish_reason"), "logprobs": None}]})
    if out.get("usage"):
        chunks.append({**base, "choices": [], "usage": out["usage"]})
    return chunks


async def _models_route(request: web.Request) -> web.Response:
    model = _models.get(request.match_info["token"])
    name = model.name if model is not None else "agentrl"
    return web.json_response(
        {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "agentrl"}]}
    )


async def _port() -> int:
    """The relay's port in this event loop (one server per loop: tests run several loops in turn)."""
    loop = asyncio.get_running_loop()
    lock = _locks.setdefault(loop, asyncio.Lock())
    async with lock:
        if loop not in _sites:
            app = web.Application(client_max_size=64 << 20)
            app.router.add_post("/m/{token}/v1/chat/completions", _chat)
            app.router.add_get("/m/{token}/v1/models", _models_route)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            _sites[loop] = (runner, site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
            keeper = _until_loop_ends(runner)
            await keeper.__anext__()
            _keepers[loop] = keeper
        return _sites[loop][1]


async def _until_loop_ends(runner: web.AppRunner) -> AsyncGenerator[None, None]:
    """Parked in the loop: asyncio.run finalises it at shutdown, which closes the server first."""
    try:
        yield
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def serve_model(model: Model) -> AsyncIterator[tuple[str, str]]:
    """``(base_url, api_key)`` of a loopback endpoint whose chat completions are ``model.chat``."""
    token = secrets.token_hex(16)
    port = await _port()
    _models[token] = model
    try:
        yield f"http://127.0.0.1:{port}/m/{token}/v1", f"relay-{token}"
    finally:
        _models.pop(token, None)
