"""The one client for serve's HTTP surface: the learner, rollout workers on other machines, and the
CLI (``agentrl status``, ``agentrl run``) all talk to serve through :class:`ServeClient`.

One retry policy: a call is retried only when a retry can fix it (no answer: connection refused,
reset or timed out; a 5xx; a 429 after its ``Retry-After``), with a timeout per attempt and an
exponential back-off between attempts; a 4xx is never retried. The last failure is raised as one
error type, :class:`~agentrl.errors.TransportError`, carrying the status and serve's message (serve
answers every error in one shape, see :mod:`agentrl.web`). A caller that expects a status
(204 "nothing yet", 409 "unknown batch") lists it in ``accept`` and gets the answer instead.
The bearer header is built here and nowhere else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from agentrl.errors import TransportError

log = logging.getLogger(__name__)
SLOW_TRY_S = 5.0  # a failed try that took this long is retried with a warning, not silently


@dataclass
class Answer:
    status: int
    body: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


def get_json(url: str, token: str = "", timeout_s: float = 30.0) -> tuple[int, dict[str, Any]]:
    """One blocking GET of a JSON route, for scripts and tests that poll serve: (status, body);
    status 0 while nothing listens there (refused, or reset while the listener comes up)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}
    except OSError:
        return 0, {}


def error_message(body: bytes) -> str:
    """serve's error message from its one error shape (or the raw text)."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body[:500].decode(errors="replace")
    if isinstance(err, dict):
        return str(err.get("message") or err)[:2000]
    return str(err)[:2000]


class ServeClient:
    """Async client of one serve (``base_url``), authenticated with its admin token when given."""

    def __init__(self, base_url: str, token: str = "", *, timeout_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 0.2, max_backoff_s: float = 10.0, unix_socket: str = "") -> None:
        """``unix_socket``: reach serve over this unix socket (``base_url`` then names no host)."""
        self.base_url = base_url.rstrip("/")
        self.unix_socket = unix_socket
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        """The keep-alive HTTP session (made on first use, inside the running loop)."""
        if self._http is None or self._http.closed:
            connector = (aiohttp.UnixConnector(path=self.unix_socket, limit=0) if self.unix_socket
                         else aiohttp.TCPConnector(limit=0))
            self._http = aiohttp.ClientSession(headers=self.headers, connector=connector)
        return self._http

    async def request(
        self,
        method: str,
        path: str,
        *,
        timeout_s: float | None = None,
        retries: int | None = None,
        accept: frozenset[int] | set[int] = frozenset(),
        **kw: Any,
    ) -> Answer:
        """One call with the retry policy; ``kw`` goes to aiohttp (``json``, ``data``, ``params``,
        ``headers``).

        Returns 2xx answers and those whose status is in ``accept``; raises :class:`TransportError` otherwise.
        """
        attempts = 1 + (self.retries if retries is None else retries)
        limit = self.timeout_s if timeout_s is None else timeout_s
        url = self.base_url + path
        for attempt in range(attempts):
            wait = min(self.max_backoff_s, self.backoff_s * 2**attempt)
            started = time.monotonic()
            try:
                async with self.session().request(
                    method, url, timeout=aiohttp.ClientTimeout(total=limit), **kw
                ) as r:
                    body = await r.read()
                    status, headers = r.status, dict(r.headers)
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                if (task := asyncio.current_task()) is not None and task.cancelling():
                    # the caller was cancelled (Ctrl-C, shutdown) and the HTTP stack turned it into an
                    # error (aiohttp's timeout context can, when its own timeout fires in the same step): stop
                    raise asyncio.CancelledError from e
                what = "timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
                err = TransportError(f"{method} {url}: {what}")
            else:
                if status < 300 or status in accept:
                    return Answer(status, body, headers)
                err = TransportError(
                    f"{method} {url} answered {status}: {error_message(body)}", status=status, body=body
                )
                if status == 429:
                    try:
                        wait = max(wait, float(headers.get("Retry-After", wait)))
                    except ValueError:
                        pass
            if not err.retryable or attempt + 1 >= attempts:
                raise err
            # a try that took a while (a timeout: a partition) is a wait someone should see
            log.log(logging.WARNING if time.monotonic() - started >= SLOW_TRY_S else logging.DEBUG,
                    "%s; retrying in %.1f s", err, wait)
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    async def json(self, method: str, path: str, **kw: Any) -> Any:
        """:meth:`request`, then the answer's JSON."""
        return (await self.request(method, path, **kw)).json()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> ServeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
