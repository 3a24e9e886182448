"""The agent loop's seams over HTTP: a plain OpenAI endpoint, and serve's router and buffer from afar.

- :class:`OpenAIChat`: chat calls to any OpenAI-compatible endpoint, no sessions (``agentrl eval``).
- :class:`RemoteRouter`: serve's router as a rollout worker on another machine sees it. ``begin``
  opens the episode's session on serve (``POST /admin/sessions``, with its limits), its calls go
  to ``/sessions/<episode id>/v1`` (the router records exact tokens, logprobs and versions there,
  as in-process), and ``end`` closes it (``POST /admin/sessions/<id>/close``) and brings its
  samples back in the buffer's binary batch encoding, decoded into the same
  :class:`~agentrl.buffer.sample.Sample` objects an in-process session gives.
- :class:`RemoteBuffer`: the orchestrator's buffer seam (``wait_for_room``, ``put``) over serve's
  ``/buffer/room`` and ``/buffer/samples`` routes.
- :class:`EpisodeUploader`: a worker's per-episode summary lines, sent in batches to serve's
  ``POST /admin/episodes``, which appends them to the run's ``episodes.jsonl``.

Everything that talks to serve goes through one :class:`~agentrl.client.ServeClient` (one retry
policy). Chat errors map onto the router's: a 4xx is an :class:`InvalidRequest` (never retried),
a 5xx an :class:`EngineError` (the episode is recorded as a model failure); serve not answering
at all is a :class:`~agentrl.errors.TransportError` (a transport failure).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from agentrl.buffer.codec import CodecError, decode_batch
from agentrl.client import ServeClient
from agentrl.errors import TransportError
from agentrl.router.errors import EngineError, InvalidRequest
from agentrl.router.session_store import SessionLimits
from agentrl.router.sessions import SessionSummary

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from aiohttp import web
    from aiohttp.typedefs import Handler

log = logging.getLogger(__name__)


def _chat_error(url: str, status: int, data: Any) -> Exception:
    err = (data.get("error") if isinstance(data, dict) else None) or {}
    message = err.get("message") if isinstance(err, dict) else str(err)
    cls = InvalidRequest if 400 <= status < 500 else EngineError
    return cls(f"{url} answered {status}: {message or json.dumps(data)[:300]}",
               code=err.get("code") if isinstance(err, dict) else None, status=status)


class OpenAIChat:
    """The agent loop's view of a plain OpenAI-compatible endpoint: chat calls, no sessions."""

    # serve not answering at all: an EngineError for a plain endpoint (the model is not there), a
    # TransportError for serve's own router (the episode is a transport failure)
    no_answer_is_transport = False

    def __init__(
        self, endpoint: str, *, api_key: str = "", model: str = "", timeout_s: float = 600.0
    ) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.model_name = model
        self.http = ServeClient(self.endpoint, api_key, timeout_s=timeout_s, retries=0)

    @property
    def model(self) -> str:
        return self.model_name

    async def __aenter__(self) -> OpenAIChat:
        if not self.model_name:
            self.model_name = await self._first_model()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.close()

    async def _first_model(self) -> str:
        try:
            got = await self.http.request("GET", "/models", timeout_s=30.0)
        except TransportError as e:
            raise EngineError(
                f"cannot list the models of {self.endpoint}: {e}", status=e.status or 502
            ) from None
        return str(got.json()["data"][0]["id"])

    # the session seam of the agent loop: a plain endpoint records nothing
    async def begin(self, session_id: str, *, limits: SessionLimits | None = None, **meta: Any) -> None:
        return None

    async def end(self, session_id: str) -> SessionSummary | None:
        return None

    def chat_path(self, session_id: str | None) -> str:
        return "/chat/completions"

    async def chat(self, body: dict[str, Any], session_id: str | None = None) -> dict[str, Any]:
        body = dict(body, model=body.get("model") or self.model_name)
        path = self.chat_path(session_id)
        try:
            got = await self.http.request("POST", path, json=body, accept=frozenset(range(400, 600)))
            data = got.json()
        except TransportError as e:  # no answer at all
            if self.no_answer_is_transport:
                raise
            raise EngineError(f"chat call to {self.http.base_url}{path} failed: {e.message}") from None
        except ValueError as e:
            raise EngineError(f"chat call to {self.http.base_url}{path} "
                              f"answered something that is not JSON: {e}") \
                from None
        if got.status >= 400 or not isinstance(data, dict) or "choices" not in data:
            raise _chat_error(self.http.base_url + path, got.status, data)
        return data


class RemoteRouter(OpenAIChat):
    """serve's router over HTTP with sessions, authenticated by the admin token."""

    no_answer_is_transport = True

    def __init__(self, serve_url: str, admin_token: str, *, model: str = "", timeout_s: float = 600.0,
                 client: ServeClient | None = None) -> None:
        self.endpoint = serve_url.rstrip("/")
        self.model_name = model
        self.http = client or ServeClient(self.endpoint, admin_token, timeout_s=timeout_s, retries=0)
        self.control = ServeClient(self.endpoint, admin_token, timeout_s=60.0, retries=3)

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(self.http.close(), self.control.close())

    async def _first_model(self) -> str:
        try:
            return str((await self.control.json("GET", "/v1/models"))["data"][0]["id"])
        except TransportError as e:
            raise EngineError(
                f"cannot list the models of {self.endpoint}: {e}", status=e.status or 502
            ) from None

    def chat_path(self, session_id: str | None) -> str:
        return "/v1/chat/completions" if session_id is None else f"/sessions/{session_id}/v1/chat/completions"

    async def begin(self, session_id: str, *, limits: SessionLimits | None = None, **meta: Any) -> None:
        body: dict[str, Any] = {"session_id": session_id, "meta": meta}
        if limits is not None:
            body["limits"] = {k: v for k, v in dataclasses.asdict(limits).items() if k != "refused"}
        await self.control.request("POST", "/admin/sessions", json=body)

    async def end(self, session_id: str) -> SessionSummary | None:
        """Close the session on serve and bring its samples here (None if serve never opened it)."""
        got = await self.control.request("POST", f"/admin/sessions/{session_id}/close", accept={404})
        if got.status == 404:
            return None
        return summary_from_batch(got.body)


def summary_from_batch(raw: bytes) -> SessionSummary:
    """A :class:`SessionSummary` from the close route's answer: a binary batch of the session's
    samples whose header carries the session's figures."""
    try:
        batch = decode_batch(raw)
    except CodecError as e:
        raise TransportError(f"serve's session answer is not a batch of samples: {e}") from None
    info = batch.info
    return SessionSummary(
        session_id=str(info.get("session_id", batch.batch_id)),
        samples=batch.samples,
        splits=int(info.get("splits", 0)),
        calls=int(info.get("calls", 0)),
        completion_tokens=int(info.get("completion_tokens", 0)),
        versions=[int(v) for v in info.get("versions", [])],
        last_reply=str(info.get("last_reply", "")),
        refused=info.get("refused"),
        model_failures=int(info.get("model_failures", 0)),
    )


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
        when, then_in_flight, then_room = self._last
        if time.monotonic() - when < self.MIN_ASK_S:
            return max(0, then_room - max(0, in_flight - then_in_flight))
        try:
            room = await self.client.wait_for_room(self.producer, in_flight, timeout_s)
        except TransportError as e:
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
        self.http = ServeClient(serve_url, admin_token, timeout_s=timeout_s, retries=0)
        self.interval_s, self.max_lines = interval_s, max_lines
        self.pending: list[dict[str, Any]] = []
        self.sent = self.dropped = 0

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
        try:
            await self.http.request("POST", "/admin/episodes", json={"episodes": batch})
        except TransportError as e:
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
            await self.http.close()


def episode_log_route(path: str | Path, require_admin: Callable[[web.Request], None]) -> Handler:
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


