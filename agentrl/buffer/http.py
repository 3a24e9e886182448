"""The learner's view of the buffer over HTTP: routes on serve's aiohttp app, and the client.

Routes (all need ``Authorization: Bearer <admin_token>`` when a token is set; 401 otherwise):
- ``GET /buffer/batch?learner_version=V&max_staleness=S&batch_size=B&timeout_s=T``: long-polls up to
  T seconds; 200 with an ``application/octet-stream`` batch (see ``codec``), 204 when nothing is
  ready in time, 429 with ``Retry-After`` when too many learners are already polling, 400 on bad
  parameters.
- ``POST /buffer/ack`` ``{"batch_id": ...}``: 200 ``{"acked": true}``, or 409 ``{"acked": false}``
  when the batch is unknown (lease expired or released, or the buffer restarted): its samples will
  be served again, so the learner must not count them as consumed.
- ``POST /buffer/release``: serve every leased batch again (a restarting learner calls it).
- ``GET /buffer/stats``: the buffer's counters as JSON.
- ``POST /buffer/samples`` (a batch frame of samples, see ``codec``): store them, as ``Buffer.put``;
  200 ``{"stored": n}`` (n counts new ones: a retried put stores nothing twice). Rollout workers on
  other machines (``agentrl serve --ray``) push their episodes here.
- ``POST /buffer/room`` ``{"producer": id, "in_flight": n, "timeout_s": t}``: admission control for
  remote producers; waits up to t seconds for room and answers ``{"room": k}``. Every producer's
  last reported in-flight count (kept 60 s) counts against the same bound.

The client retries what a retry can fix (connection errors, 5xx, timeouts; and 429 after its
Retry-After) with a timeout per attempt, never a 4xx. Acks are idempotent, so retrying one is safe.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web

from agentrl.buffer.codec import Batch, CodecError, decode_batch, encode_batch
from agentrl.buffer.core import Buffer

log = logging.getLogger(__name__)

BUFFER_KEY: web.AppKey[Buffer] = web.AppKey("agentrl_buffer", Buffer)


class BufferTransportError(RuntimeError):
    """The buffer's HTTP endpoint could not be reached or answered with an error."""


def add_buffer_routes(app: web.Application, buf: Buffer, admin_token: str | None) -> None:
    app[BUFFER_KEY] = buf
    expected = f"Bearer {admin_token}".encode() if admin_token else None

    def authorised(request: web.Request) -> bool:
        if expected is None:
            return True
        got = request.headers.get("Authorization", "").encode()
        return hmac.compare_digest(got, expected)

    def unauthorised() -> web.Response:
        return web.json_response({"error": "missing or wrong admin token"}, status=401)

    async def get_batch(request: web.Request) -> web.StreamResponse:
        if not authorised(request):
            return unauthorised()
        q = request.query
        try:
            learner_version = int(q["learner_version"])
            max_staleness = int(q["max_staleness"]) if "max_staleness" in q else None
            batch_size = int(q["batch_size"]) if "batch_size" in q else None
            timeout_s = float(q.get("timeout_s", 0.0))
        except (KeyError, ValueError) as e:
            return web.json_response({"error": f"bad query: {e}; need learner_version (int), optional "
                                      "max_staleness (int), batch_size (int), timeout_s (float)"}, status=400)
        if buf.pollers >= buf.cfg.max_pollers:
            return web.json_response({"error": "too many concurrent batch requests"}, status=429,
                                     headers={"Retry-After": "1"})
        try:
            data = await buf.get_batch_encoded(learner_version, max_staleness, batch_size, timeout_s)
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        if data is None:
            return web.Response(status=204)
        return web.Response(body=data, content_type="application/octet-stream")

    async def ack(request: web.Request) -> web.Response:
        if not authorised(request):
            return unauthorised()
        try:
            batch_id = str((await request.json())["batch_id"])
        except (KeyError, ValueError, TypeError) as e:
            return web.json_response({"error": f"bad body, need {{'batch_id': str}}: {e}"}, status=400)
        if buf.ack(batch_id):
            return web.json_response({"acked": True})
        return web.json_response({"acked": False, "error": "unknown batch (lease expired, released, or "
                                  "buffer restarted); its samples will be served again"}, status=409)

    async def release(request: web.Request) -> web.Response:
        if not authorised(request):
            return unauthorised()
        return web.json_response({"released": buf.release_leases()})

    async def stats(request: web.Request) -> web.Response:
        if not authorised(request):
            return unauthorised()
        return web.json_response(buf.stats())

    producers: dict[str, tuple[int, float]] = {}  # producer -> (episodes in flight, when reported)

    async def put_samples(request: web.Request) -> web.Response:
        if not authorised(request):
            return unauthorised()
        try:
            batch = decode_batch(await request.read())
        except (CodecError, ValueError) as e:
            return web.json_response({"error": f"body is not a batch of samples: {e}"}, status=400)
        return web.json_response({"stored": await buf.put(batch.samples)})

    async def room(request: web.Request) -> web.Response:
        if not authorised(request):
            return unauthorised()
        try:
            body = await request.json()
            producer, in_flight = str(body["producer"]), int(body["in_flight"])
            timeout_s = min(30.0, max(0.0, float(body.get("timeout_s", 0.0))))
        except (KeyError, ValueError, TypeError) as e:
            return web.json_response({"error": f"bad body, need producer, in_flight, timeout_s: {e}"}, status=400)
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
                 retries: int = 3) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self._headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self._headers)
        return self._session

    async def _request(self, method: str, path: str, *, extra_s: float = 0.0, **kw: Any) -> tuple[int, bytes]:
        """One call with retries on connection errors, timeouts, 5xx and 429."""
        attempt = 0
        while True:
            retry_after = 0.2 * 2**attempt
            try:
                timeout = aiohttp.ClientTimeout(total=self.timeout_s + extra_s)
                async with self._http().request(method, self.base_url + path, timeout=timeout, **kw) as r:
                    body = await r.read()
                    if r.status < 500 and r.status != 429:
                        return r.status, body
                    if r.status == 429:
                        retry_after = float(r.headers.get("Retry-After", "1"))
                    err: Exception = BufferTransportError(f"{method} {path}: HTTP {r.status}: {body[:200]!r}")
            except (aiohttp.ClientConnectionError, TimeoutError) as e:
                err = BufferTransportError(f"{method} {path}: {type(e).__name__}: {e}")
            if attempt >= self.retries:
                raise err
            attempt += 1
            log.debug("buffer client: %s; retrying in %.1fs", err, retry_after)
            await asyncio.sleep(retry_after)

    @staticmethod
    def _check(status: int, body: bytes, what: str) -> None:
        if status >= 400:
            raise BufferTransportError(f"{what}: HTTP {status}: {body[:300]!r}")

    async def get_batch(self, learner_version: int, max_staleness: int | None = None,
                        batch_size: int | None = None, timeout_s: float = 10.0) -> Batch | None:
        """Long-poll for a batch; None when nothing was ready within ``timeout_s`` (samples as
        ``codec.decode_sample`` gives them: numpy per-token fields)."""
        params: dict[str, str] = {"learner_version": str(learner_version), "timeout_s": str(timeout_s)}
        if max_staleness is not None:
            params["max_staleness"] = str(max_staleness)
        if batch_size is not None:
            params["batch_size"] = str(batch_size)
        status, body = await self._request("GET", "/buffer/batch", params=params, extra_s=timeout_s)
        if status == 204:
            return None
        self._check(status, body, "get_batch")
        return decode_batch(body)

    async def ack(self, batch_id: str) -> bool:
        """True once the buffer has durably recorded the batch consumed; False if it no longer
        knows the batch (its samples will be served again)."""
        status, body = await self._request("POST", "/buffer/ack", json={"batch_id": batch_id})
        if status == 409:
            return False
        self._check(status, body, "ack")
        return True

    async def put(self, samples: list[Any]) -> int:
        """Store samples in serve's buffer (idempotent by sample id, so retries are safe)."""
        body = encode_batch(Batch(batch_id="put", samples=list(samples), learner_version=-1))
        status, data = await self._request("POST", "/buffer/samples", data=body,
                                           headers={"Content-Type": "application/octet-stream"})
        self._check(status, data, "put")
        return int(json.loads(data)["stored"])

    async def wait_for_room(self, producer: str, in_flight: int, timeout_s: float) -> int:
        """Admission control for a remote producer: how many episodes it may start now."""
        status, data = await self._request("POST", "/buffer/room", extra_s=timeout_s,
                                           json={"producer": producer, "in_flight": in_flight, "timeout_s": timeout_s})
        self._check(status, data, "room")
        return int(json.loads(data)["room"])

    async def release_leases(self) -> int:
        status, body = await self._request("POST", "/buffer/release")
        self._check(status, body, "release")
        return int(json.loads(body)["released"])

    async def stats(self) -> dict[str, Any]:
        status, body = await self._request("GET", "/buffer/stats")
        self._check(status, body, "stats")
        return json.loads(body)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
