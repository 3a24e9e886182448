"""The learner's view of the buffer over HTTP: routes on serve's aiohttp app, and the client.

Routes (all need ``Authorization: Bearer <admin_token>`` when a token is set; 401 otherwise):
- ``GET /buffer/batch?learner_version=V&max_staleness=S&batch_size=B&timeout_s=T[&policy=P]``:
  long-polls up to T seconds; 200 with an ``application/octet-stream`` batch (see ``codec``), 204
  when nothing is ready in time, 429 with ``Retry-After`` when too many learners are already
  polling, 400 on bad parameters. ``policy`` picks a named policy's stream
  (:mod:`agentrl.buffer.streams`); without it, the default policy's.
- ``POST /buffer/ack`` ``{"batch_id": ...}``: 200 ``{"acked": true}``, or 409 ``{"acked": false}``
  when the batch is unknown (lease expired or released, or the buffer restarted): its samples will
  be served again, so the learner must not count them as consumed. 507 while the disk is full:
  not acked yet (nothing logged), to be tried again.
- ``POST /buffer/release``: serve every leased batch again (a restarting learner calls it).
- ``GET /buffer/stats``: the buffer's counters as JSON.
- ``POST /buffer/samples`` (a batch frame of samples, see ``codec``): store them, as ``Buffer.put``;
  200 ``{"stored": n}`` (n counts new ones: a retried put stores nothing twice). Rollout workers on
  other machines (``agentrl serve --ray``) push their episodes here.
- ``POST /buffer/room`` ``{"producer": id, "in_flight": n, "timeout_s": t}``: admission control for
  remote producers; waits up to t seconds for room and answers ``{"room": k}``. Every producer's
  last reported in-flight count (kept 60 s) counts against the same bound.

Errors are answered in serve's one error shape (:mod:`agentrl.web`); the admin token is checked by
the same ``require_admin`` as every admin route. The client is a thin layer over
:class:`~agentrl.client.ServeClient` (its retry policy: connection errors, 5xx, timeouts and 429
after its Retry-After, each attempt bounded, never a 4xx). Acks are idempotent, so retrying one is safe.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from aiohttp import web

from agentrl.buffer.codec import Batch, CodecError, decode_batch, encode_batch
from agentrl.buffer.core import Buffer
from agentrl.buffer.disk import DiskFull
from agentrl.buffer.streams import PolicyBuffers
from agentrl.client import ServeClient
from agentrl.errors import TransportError
from agentrl.web import ADMIN_TOKEN, error_middleware, error_response, require_admin

log = logging.getLogger(__name__)

BUFFER_KEY: web.AppKey[Any] = web.AppKey("agentrl_buffer", object)

# The buffer's transport failures are serve's (one error type for serve's HTTP surface).
BufferTransportError = TransportError


def add_buffer_routes(app: web.Application, buf: Buffer | PolicyBuffers, admin_token: str | None) -> None:
    app[BUFFER_KEY] = buf
    if ADMIN_TOKEN not in app:
        app[ADMIN_TOKEN] = admin_token or ""
    if error_middleware not in app.middlewares:  # a bare app (tests, tools): the one error shape too
        app.middlewares.append(error_middleware)

    def bad(message: str) -> web.Response:
        return error_response(message, 400)

    async def get_batch(request: web.Request) -> web.StreamResponse:
        require_admin(request)
        q = request.query
        try:
            learner_version = int(q["learner_version"])
            max_staleness = int(q["max_staleness"]) if "max_staleness" in q else None
            batch_size = int(q["batch_size"]) if "batch_size" in q else None
            timeout_s = float(q.get("timeout_s", 0.0))
        except (KeyError, ValueError) as e:
            return bad(f"bad query: {e}; need learner_version (int), optional max_staleness (int), "
                       "batch_size (int), timeout_s (float), policy")
        try:
            stream = buf.stream(q.get("policy"))
        except ValueError as e:
            return bad(str(e))
        if buf.pollers >= buf.cfg.max_pollers:
            return error_response("too many concurrent batch requests", 429, headers={"Retry-After": "1"})
        try:
            data = await stream.get_batch_encoded(learner_version, max_staleness, batch_size, timeout_s)
        except ValueError as e:
            return bad(str(e))
        if data is None:
            return web.Response(status=204)
        return web.Response(body=data, content_type="application/octet-stream")

    async def ack(request: web.Request) -> web.Response:
        require_admin(request)
        try:
            batch_id = str((await request.json())["batch_id"])
        except (KeyError, ValueError, TypeError) as e:
            return bad(f"bad body, need {{'batch_id': str}}: {e}")
        try:
            acked = buf.ack(batch_id)
        except DiskFull as e:  # not acked, the log whole: the learner's client retries a 5xx
            return error_response(f"no space left on serve's run directory to log the ack: {e.strerror}",
                                  507, code="disk_full")
        if acked:
            return web.json_response({"acked": True})
        return error_response("unknown batch (lease expired, "
                              "released, or buffer restarted); "
                              "its samples will be served again", 409, code="unknown_batch", acked=False)

    async def release(request: web.Request) -> web.Response:
        require_admin(request)
        return web.json_response({"released": buf.release_leases()})

    async def stats(request: web.Request) -> web.Response:
        require_admin(request)
        return web.json_response(buf.stats())

    producers: dict[str, tuple[int, float]] = {}  # producer -> (episodes in flight, when reported)

    async def put_samples(request: web.Request) -> web.Response:
        require_admin(request)
        try:
            batch = decode_batch(await request.read())
        except (CodecError, ValueError) as e:
            return bad(f"body is not a batch of samples: {e}")
        return web.json_response({"stored": await buf.put(batch.samples)})

    async def room(request: web.Request) -> web.Response:
        require_admin(request)
        try:
            body = await request.json()
            producer, in_flight = str(body["producer"]), int(body["in_flight"])
            timeout_s = min(30.0, max(0.0, float(body.get("timeout_s", 0.0))))
        except (KeyError, ValueError, TypeError) as e:
            return bad(f"bad body, need producer, in_flight, timeout_s: {e}")
        now = time.monotonic()
        producers[producer] = (in_flight, now)
        for k in [k for k, (_, t) in producers.items() if now - t > 60.0]:
            del producers[k]
        others = sum(n for k, (n, _) in producers.items() if k != producer)
        return web.json_response({"room": await buf.wait_for_room(others + in_flight, timeout_s)})

    app.router.add_post("/buffer/samples", put_samples)
    app.router.add_post("/buffer/room", room)
    app.router.add_get("/buffer/batch", get_batch)
    app.router.add_post("/buffer/ack", ack)
    app.router.add_post("/buffer/release", release)
    app.router.add_get("/buffer/stats", stats)


class BufferClient:
    """Async client of the buffer routes, for the learner (and, with ``put``, remote rollout workers)."""

    def __init__(self, base_url: str, admin_token: str | None = None, timeout_s: float = 30.0,
                 retries: int = 3, client: ServeClient | None = None) -> None:
        self.http = client or ServeClient(base_url, admin_token or "", timeout_s=timeout_s, retries=retries)
        self._owned = client is None

    @property
    def base_url(self) -> str:
        return self.http.base_url

    async def get_batch(self, learner_version: int, max_staleness: int | None = None,
                        batch_size: int | None = None, timeout_s: float = 10.0,
                        policy: str | None = None) -> Batch | None:
        """Long-poll for a batch (of ``policy``'s stream when serve runs named policies); None when
        nothing was ready within ``timeout_s`` (samples as ``codec.decode_sample`` gives them:
        numpy per-token fields)."""
        params: dict[str, str] = {"learner_version": str(learner_version), "timeout_s": str(timeout_s)}
        if policy:
            params["policy"] = policy
        if max_staleness is not None:
            params["max_staleness"] = str(max_staleness)
        if batch_size is not None:
            params["batch_size"] = str(batch_size)
        got = await self.http.request("GET", "/buffer/batch", params=params, accept={204},
                                      timeout_s=self.http.timeout_s + timeout_s)
        if got.status == 204:
            return None
        return decode_batch(got.body)

    async def ack(self, batch_id: str) -> bool:
        """True once the buffer has durably recorded the batch consumed; False if it no longer
        knows the batch (its samples will be served again)."""
        got = await self.http.request("POST", "/buffer/ack", json={"batch_id": batch_id}, accept={409})
        return got.status != 409

    async def put(self, samples: list[Any]) -> int:
        """Store samples in serve's buffer (idempotent by sample id, so retries are safe)."""
        body = encode_batch(Batch(batch_id="put", samples=list(samples), learner_version=-1))
        got = await self.http.request("POST", "/buffer/samples", data=body,
                                      headers={"Content-Type": "application/octet-stream"})
        return int(got.json()["stored"])

    async def wait_for_room(self, producer: str, in_flight: int, timeout_s: float) -> int:
        """Admission control for a remote producer: the room left, in samples, beside its ``in_flight``."""
        got = await self.http.json(
            "POST",
            "/buffer/room",
            timeout_s=self.http.timeout_s + timeout_s,
            json={"producer": producer, "in_flight": in_flight, "timeout_s": timeout_s},
        )
        return int(got["room"])

    async def release_leases(self) -> int:
        return int((await self.http.json("POST", "/buffer/release"))["released"])

    async def stats(self) -> dict[str, Any]:
        return await self.http.json("GET", "/buffer/stats")

    async def close(self) -> None:
        if self._owned:
            await self.http.close()
