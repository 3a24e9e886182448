"""The agent loop's seams over HTTP: a plain OpenAI endpoint, and serve's router and buffer from afar.

- :class:`OpenAIChat`: chat calls to any OpenAI-compatible endpoint, no sessions (``agentrl eval``).
- :class:`RemoteRouter`: serve's router as a rollout worker on another machine sees it. Each
  episode's calls go to ``/sessions/<episode id>/v1`` (the router records exact tokens, logprobs
  and versions there, as in-process); at the episode's end ``fetch_session`` closes the session
  with ``POST /admin/sessions/<id>/close`` and brings its samples back in the buffer's binary
  batch encoding, decoded into the same :class:`~agentrl.buffer.sample.Sample` objects an
  in-process session gives.
- :class:`RemoteBuffer`: the orchestrator's buffer seam (``wait_for_room``, ``put``) over serve's
  ``/buffer/room`` and ``/buffer/samples`` routes.
- :class:`EpisodeUploader`: a worker's per-episode summary lines, sent in batches to serve's
  ``POST /admin/episodes``, which appends them to the run's ``episodes.jsonl``.

Errors map onto the router's: a 4xx is an :class:`InvalidRequest` (never retried), a 5xx or a
connection failure an :class:`EngineError` (the episode is recorded as a model failure).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp

from agentrl.buffer.codec import CodecError, decode_batch
from agentrl.buffer.sample import Sample
from agentrl.router.errors import EngineError, InvalidRequest

log = logging.getLogger(__name__)


class OpenAIChat:
    """The agent loop's view of a plain OpenAI-compatible endpoint: chat calls, no sessions."""

    def __init__(self, endpoint: str, *, api_key: str = "", model: str = "", timeout_s: float = 600.0) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.model = model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> OpenAIChat:
        self._http = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout,
                                           connector=aiohttp.TCPConnector(limit=0))
        if not self.model:
            self.model = await self._first_model()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.close()

    async def _first_model(self) -> str:
        assert self._http is not None
        try:
            async with self._http.get(f"{self.endpoint}/models") as r:
                data = await r.json(content_type=None)
                if r.status != 200:
                    raise EngineError(f"GET {self.endpoint}/models answered {r.status}: {json.dumps(data)[:300]}",
                                      status=r.status)
                return str(data["data"][0]["id"])
        except (aiohttp.ClientError, TimeoutError) as e:
            raise EngineError(f"cannot reach {self.endpoint}: {type(e).__name__}: {e}") from None

    # the session hooks of the agent loop: a plain endpoint records nothing
    def open_session(self, session_id: str | None = None, **meta: Any) -> None:
        return None

    def close_session(self, session_id: str) -> Any:
        return None

    def chat_url(self, session_id: str | None) -> str:
        return f"{self.endpoint}/chat/completions"

    async def chat(self, body: dict[str, Any], session_id: str | None = None) -> dict[str, Any]:
        assert self._http is not None, "use it as an async context manager"
        body = dict(body, model=body.get("model") or self.model)
        url = self.chat_url(session_id)
        try:
            async with self._http.post(url, json=body) as r:
                data = await r.json(content_type=None)
                status = r.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise EngineError(f"chat call to {url} failed: {type(e).__name__}: {e}") from None
        if status >= 400 or not isinstance(data, dict) or "choices" not in data:
            err = (data.get("error") if isinstance(data, dict) else None) or {}
            message = err.get("message") if isinstance(err, dict) else str(err)
            cls = InvalidRequest if 400 <= status < 500 else EngineError
            raise cls(f"{self.endpoint} answered {status}: {message or json.dumps(data)[:300]}",
                      code=err.get("code") if isinstance(err, dict) else None, status=status)
        return data


class RemoteRouter(OpenAIChat):
    """serve's router over HTTP with sessions, authenticated by the admin token."""

    def __init__(self, serve_url: str, admin_token: str, *, timeout_s: float = 600.0) -> None:
        self.serve_url = serve_url.rstrip("/")
        super().__init__(self.serve_url + "/v1", api_key=admin_token, timeout_s=timeout_s)
        self._closed: dict[str, Any] = {}

    def chat_url(self, session_id: str | None) -> str:
        if session_id is None:
            return super().chat_url(None)
        return f"{self.serve_url}/sessions/{session_id}/v1/chat/completions"  # opened by the first call

    async def fetch_session(self, session_id: str) -> None:
        """Close the session on serve and keep its samples for :meth:`close_session` (None if it had no call)."""
        assert self._http is not None
        url = f"{self.serve_url}/admin/sessions/{session_id}/close"
        for attempt in range(3):
            try:
                async with self._http.post(url, timeout=aiohttp.ClientTimeout(total=60)) as r:
                    if r.status == 404:  # no model call was made: the router never opened it
                        return
                    raw = await r.read()
                    if r.status != 200:
                        raise EngineError(f"POST {url} answered {r.status}: {raw[:300]!r}")
                batch = decode_batch(raw)
                self._closed[session_id] = FetchedSession(int(batch.info.get("splits", 0)), batch.samples)
                return
            except (aiohttp.ClientError, TimeoutError, EngineError, CodecError) as e:
                if attempt == 2:
                    log.warning("could not fetch session %s from serve: %s", session_id, e)
                    return

    def close_session(self, session_id: str) -> Any:
        return self._closed.pop(session_id, None)


class FetchedSession:
    """A session's samples as serve's router returned them (what ``finish_samples`` reads)."""

    def __init__(self, splits: int, samples: list[Sample]) -> None:
        self.splits = splits
        self._samples = samples

    def samples(self) -> list[Sample]:
        return self._samples


class RemoteBuffer:
    """The orchestrator's buffer, on serve: admission control and durable puts over HTTP."""

    MIN_ASK_S = 0.5

    def __init__(self, serve_url: str, admin_token: str, producer: str, timeout_s: float = 60.0) -> None:
        from agentrl.buffer.http import BufferClient

        self.producer = producer
        self.client = BufferClient(serve_url, admin_token, timeout_s=timeout_s, retries=5)
        self._last: tuple[float, int, int] = (0.0, 0, 0)  # (when, in_flight then, room then)

    async def wait_for_room(self, in_flight: int, timeout_s: float) -> int:
        """serve's answer, asked at most every ``MIN_ASK_S``: the orchestrator polls this in a tight loop."""
        from agentrl.buffer.http import BufferTransportError

        when, then_in_flight, then_room = self._last
        if time.monotonic() - when < self.MIN_ASK_S:
            return max(0, then_room - max(0, in_flight - then_in_flight))
        try:
            room = await self.client.wait_for_room(self.producer, in_flight, timeout_s)
        except BufferTransportError as e:
            log.warning("buffer admission failed: %s", e)
            room = 0
        self._last = (time.monotonic(), in_flight, room)
        return room

    async def put(self, samples: list[Any]) -> int:
        return await self.client.put(samples)

    async def close(self) -> None:
        await self.client.close()


class EpisodeUploader:
    """Batches of episode summary lines to serve (``POST /admin/episodes``), every ``interval_s``.

    Lines that could not be sent are kept and sent with the next batch, up to ``max_lines`` (the
    oldest are dropped beyond that, with a warning), so serve being briefly away loses nothing.
    """

    def __init__(self, serve_url: str, admin_token: str, *, interval_s: float = 2.0, max_lines: int = 20_000,
                 timeout_s: float = 30.0) -> None:
        self.url = serve_url.rstrip("/") + "/admin/episodes"
        self.headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.interval_s, self.max_lines, self.timeout_s = interval_s, max_lines, timeout_s
        self.pending: list[dict[str, Any]] = []
        self.sent = self.dropped = 0
        self._http: aiohttp.ClientSession | None = None

    def add(self, line: dict[str, Any]) -> None:
        self.pending.append(line)
        if len(self.pending) > self.max_lines:
            over = len(self.pending) - self.max_lines
            del self.pending[:over]
            self.dropped += over
            log.warning("serve has not taken episode lines for a while: dropped the %d oldest", over)

    async def flush(self) -> bool:
        """Send what is pending; False (and keep it) if serve did not take it."""
        if not self.pending:
            return True
        batch = self.pending[:]
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(headers=self.headers)
        try:
            async with self._http.post(self.url, json={"episodes": batch},
                                       timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                if r.status != 200:
                    log.warning("serve refused %d episode lines: %s %s", len(batch), r.status, (await r.text())[:200])
                    return False
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("could not send %d episode lines to serve: %s", len(batch), e)
            return False
        del self.pending[: len(batch)]  # lines added meanwhile stay for the next batch
        self.sent += len(batch)
        return True

    async def run(self) -> None:
        """Flush every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.flush()

    async def close(self) -> None:
        """One last flush, then the client goes."""
        try:
            await self.flush()
        finally:
            if self._http is not None:
                await self._http.close()


def episode_log_route(path: Any, require_admin: Any) -> Any:
    """serve's ``POST /admin/episodes`` handler: ``{"episodes": [line, ...]}`` appended to ``path``."""
    from aiohttp import web

    async def handler(request: web.Request) -> web.Response:
        require_admin(request)
        try:
            lines = (await request.json())["episodes"]
            if not isinstance(lines, list) or not all(isinstance(x, dict) for x in lines):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise web.HTTPBadRequest(reason='the body must be {"episodes": [object, ...]}') from None
        text = "".join(json.dumps(x) + "\n" for x in lines)

        def append() -> None:
            with open(path, "a") as f:
                f.write(text)

        await asyncio.to_thread(append)
        return web.json_response({"appended": len(lines)})

    return handler
