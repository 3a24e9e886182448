"""The engine's door: an ASGI middleware that vLLM's API server loads (``--middleware``) so that only
serve can talk to an engine serve launched.

vLLM's own ``--api-key`` guards only ``/v1``, ``/inference`` and a few more prefixes; the control
routes (``/pause``, ``/resume``, ``/collective_rpc``, ``/update_weight_version``, ...) stay open to
any local process, which could then pause the engine, load other weights or chat past the router's
capture. This guard refuses every request (``/health`` aside, which says nothing) that does not
carry ``Authorization: Bearer <key>``, the key being a secret serve generates per run and hands the
engine through its environment (``AGENTRL_ENGINE_KEY``), never its command line.

Pure ASGI, standard library only: it is imported inside vLLM's process.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

KEY_VARIABLE = "AGENTRL_ENGINE_KEY"
OPEN_PATHS = frozenset({"/health"})

Scope = dict[str, Any]
App = Callable[[Scope, Callable[..., Awaitable[Any]], Callable[..., Awaitable[Any]]], Awaitable[None]]


class EngineGuard:
    def __init__(self, app: App) -> None:
        self.app = app
        key = os.environ.get(KEY_VARIABLE, "")
        self.digest = hashlib.sha256(key.encode()).digest() if key else None

    def _allowed(self, scope: Scope) -> bool:
        if self.digest is None or scope.get("path") in OPEN_PATHS:
            return True
        for name, value in scope.get("headers") or []:
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return hmac.compare_digest(hashlib.sha256(token.strip().encode()).digest(), self.digest)
        return False

    async def __call__(self, scope: Scope, receive: Callable[..., Awaitable[Any]],
                       send: Callable[..., Awaitable[Any]]) -> None:
        if scope.get("type") not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": {"message": "this engine answers only the serve that launched it",
                                     "type": "authentication_error", "param": None, "code": None}}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
