"""The engine pool: which vLLM engine serves a call, and whether it is in the pool.

Balancing is least-outstanding-requests with session affinity (a session's turns go to the engine
that holds its prefix cache while that engine is healthy). An engine that fails a health check or
a connection is taken out; a background checker re-adds it when it answers again, after the
``on_rejoin`` hook (if one is installed) has brought it to the current policy version.

The pool knows the policy version its engines serve (``version``, reported by the router) but not
how a version gets into them: that is the weight updater's (``agentrl.weights.updates``), which
drives the engines' control routes through :meth:`EnginePool.control` and installs ``on_rejoin``.
Both the router and the weight updater import this module; it imports neither of them (the errors
it raises, in the OpenAI error shape the router answers with, are ``agentrl.engines.errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from agentrl.engines.errors import EngineError, InvalidRequest, NoEngineAvailable
from agentrl.engines.upstream import Upstream, UpstreamClosed, UpstreamProtocolError

log = logging.getLogger(__name__)


# vLLM's /metrics series that grow with each engine step that does work (EnginePool.progress)
PROGRESS_SERIES = frozenset({"vllm:iteration_tokens_total_count", "vllm:prompt_tokens_total",
                             "vllm:generation_tokens_total"})
DEFAULT_POLICY = "policy"  # the one policy of a serve without named policies (serve.policies)


@dataclass
class Engine:
    url: str
    name: str
    healthy: bool = True
    outstanding: int = 0
    version: int = 0
    served: int = 0
    failures: int = 0
    failed_checks: int = 0  # consecutive failed health checks
    failed_rejoins: int = 0  # consecutive tries to bring it back to the current version that failed
    last_error: str = ""
    sessions: set[str] = field(default_factory=set)
    # LoRA policies (agentrl.weights.adapters): the adapter versions this engine has loaded, per
    # policy, each under its own name; a call goes to its policy's newest, and all its tokens are
    # that version's
    adapters: dict[str, dict[int, str]] = field(default_factory=dict)  # policy -> version -> its folder

    def status(self) -> dict[str, Any]:
        out = {"url": self.url, "name": self.name, "healthy": self.healthy, "outstanding": self.outstanding,
               "version": self.version, "served": self.served, "failures": self.failures,
               "last_error": self.last_error}
        if self.adapters:
            out["adapters"] = {p: sorted(vs) for p, vs in self.adapters.items()}
        return out

    def adapter(self, policy: str = DEFAULT_POLICY) -> tuple[str, int] | None:
        """The newest adapter of ``policy`` this engine has loaded, as (its name, its version);
        None: the base weights (no version of that policy was published yet).

        ``<policy>:lag<k>`` (a role that plays against the policy k versions back): the version k
        before the newest, the base weights while fewer than k+1 were published. serve keeps k+1 of
        its versions loaded; should that version be gone all the same, the oldest one loaded.

        ``<policy>:v<N>`` (a role that plays against the policy's published version N): exactly that
        version, the base weights until it is published. serve never unloads it once loaded."""
        name, _, lag = policy.partition(":lag")
        name, _, pin = name.partition(":v")
        versions = self.adapters.get(name)
        if not versions:
            return None
        version = int(pin) if pin else max(versions) - int(lag or 0)
        if version <= 0 or version > max(versions):
            return None
        if version not in versions:
            log.warning("engine %s no longer holds %s's version %d (%s): it samples from the oldest it "
                        "holds, %d", self.name, name, version, policy, min(versions))
            version = min(versions)
        return adapter_name(version, name), version


def adapter_name(version: int, policy: str = DEFAULT_POLICY) -> str:
    """The name an engine holds ``policy``'s version ``version`` under (``policy-v<N>`` for the one
    unnamed policy)."""
    return f"{policy}-v{version}"


def parse_version(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


class EnginePool:
    def __init__(self, urls: list[str], *, request_timeout_s: float = 600.0, control_timeout_s: float = 60.0,
                 health_interval_s: float = 2.0, health_failures: int = 3, api_key: str = "",
                 max_connections: int | None = None) -> None:
        """``health_failures``: consecutive failed health checks before an engine is taken out (a
        refused or dropped connection during a call takes it out at once). ``api_key``: the key the
        engines serve launched demand (agentrl.engines.guard); sent with every call.
        ``max_connections``: calls in flight per engine at once (each holds a socket; more wait in
        order); None: no bound."""
        if not urls:
            raise ValueError("the engine pool needs at least one engine URL")
        self.engines = [Engine(url=u.rstrip("/"), name=f"engine-{i}") for i, u in enumerate(urls)]
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.health_interval_s = health_interval_s
        self.health_failures = max(1, health_failures)
        self.version = 0  # the policy version the engines serve; set by whoever updates them
        # named LoRA policies (serve.policies): each one's version; ``version`` is the first's
        self.versions: dict[str, int] = {}
        self._affinity: dict[str, Engine] = {}
        self._http: aiohttp.ClientSession | None = None
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # the hot path (render / generate / derender calls)
        self._upstream = Upstream(api_key, max_connections=max_connections)
        self._health_task: asyncio.Task | None = None
        # Closed (cleared) by the weight-update code around a pause window: new engine calls wait
        # here instead of failing; calls already in flight are kept by vLLM's pause(mode=keep).
        self.gate = asyncio.Event()
        self.gate.set()
        # Awaited by the health checker when an engine that was out answers again, before it takes
        # traffic: True lets it in; False or an error keeps it out until a later check. The weight
        # updater installs one that loads the current version; None: the engine rejoins as it is.
        self.on_rejoin: Callable[[Engine], Awaitable[bool]] | None = None
        # Awaited after ``on_rejoin`` let a returning engine in, before it takes traffic (the router's
        # expert capture binds itself there: a relaunched engine starts without it).
        self.on_ready: list[Callable[[Engine], Awaitable[None]]] = []

    @property
    def headers(self) -> dict[str, str]:
        """What every call to an engine carries (its API key, if the engines demand one)."""
        return dict(self._headers)

    async def start(self) -> None:
        # Keep-alive connections, unbounded in number (a router at 1,024 concurrent calls keeps as
        # many open); ordinary HTTP/1.1, one request per connection at a time.
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                                           skip_auto_headers=("User-Agent",), headers=self._headers)
        self._health_task = asyncio.create_task(self._health_loop(), name="engine-health")

    async def close(self) -> None:
        if self._health_task:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        if self._http:
            await self._http.close()
        await self._upstream.close()

    # -- choosing an engine ----------------------------------------------------------------------
    def pick(self, session_id: str | None) -> Engine:
        if session_id is not None:
            e = self._affinity.get(session_id)
            if e is not None and e.healthy:
                return e
        healthy = [e for e in self.engines if e.healthy]
        if not healthy:
            raise NoEngineAvailable("no healthy inference engine is available; check `agentrl status`")
        e = min(healthy, key=lambda x: x.outstanding)
        if session_id is not None:
            self._affinity[session_id] = e
        return e

    def forget_session(self, session_id: str) -> None:
        self._affinity.pop(session_id, None)

    # -- calls -------------------------------------------------------------------------------------
    async def call(self, engine: Engine, path: str, body: dict[str, Any], timeout_s: float | None = None,
                   count: bool = True) -> dict[str, Any]:
        """POST to one engine. 4xx -> InvalidRequest (never retried); other failures -> EngineError."""
        assert self._http is not None, "EnginePool.start() was not awaited"
        if not self.gate.is_set():
            await self.wait_gate()
        if count:
            engine.outstanding += 1
        try:
            status, raw = await self._upstream.post(
                engine.url, path, dumps(body), timeout_s or self.request_timeout_s
            )
            if status >= 400:
                message = _engine_message(raw.decode(errors="replace"))
                if 400 <= status < 500:
                    code = "context_length_exceeded" if "context length" in message.lower() else None
                    raise InvalidRequest(message, status=status if status != 404 else 400, code=code)
                raise EngineError(f"engine {engine.name} answered {status}: {message}")
            data = loads(raw)
            engine.served += 1
            return data
        except (TimeoutError, UpstreamClosed, UpstreamProtocolError, ValueError) as e:
            engine.failures += 1
            what = "timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            engine.last_error = what
            if isinstance(e, UpstreamClosed):  # refused, reset or dropped: gone until its health check passes
                self.mark_down(engine, engine.last_error)
            raise EngineError(f"engine {engine.name} failed: {what}") from e
        finally:
            if count:
                engine.outstanding -= 1

    async def wait_gate(self) -> None:
        """Hold a new call while a weight update has the gate closed (bounded by the request timeout)."""
        try:
            await asyncio.wait_for(self.gate.wait(), self.request_timeout_s)
        except TimeoutError:
            raise EngineError("timed out waiting for a weight update to finish") from None

    async def stream(self, engine: Engine, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST a streaming request and yield each server-sent event's JSON (stops at ``[DONE]``).

        Same error mapping as :meth:`call`. A connection lost mid-stream takes the engine out.
        """
        assert self._http is not None, "EnginePool.start() was not awaited"
        if not self.gate.is_set():
            await self.wait_gate()
        engine.outstanding += 1
        try:
            async with self._http.post(engine.url + path, data=dumps(body), headers=_JSON,
                                       timeout=aiohttp.ClientTimeout(total=self.request_timeout_s)) as r:
                if r.status >= 400:
                    message = _engine_message(await r.text())
                    if 400 <= r.status < 500:
                        code = "context_length_exceeded" if "context length" in message.lower() else None
                        raise InvalidRequest(message, status=r.status if r.status != 404 else 400, code=code)
                    raise EngineError(f"engine {engine.name} answered {r.status}: {message}")
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    event = json.loads(data)
                    if isinstance(event, dict) and "error" in event and "choices" not in event:
                        raise EngineError(f"engine {engine.name} failed mid-stream: "
                                          f"{_engine_message(data.decode())}")
                    yield event
                engine.served += 1
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            engine.failures += 1
            engine.last_error = f"{type(e).__name__}: {e}"
            if not isinstance(e, TimeoutError):
                self.mark_down(engine, engine.last_error)
            raise EngineError(f"engine {engine.name} failed: {engine.last_error}") from e
        finally:
            engine.outstanding -= 1

    def mark_down(self, engine: Engine, why: str) -> None:
        """Take ``engine`` out of the pool (its sessions lose their affinity) until it rejoins."""
        if engine.healthy:
            log.warning("taking %s (%s) out of the pool: %s", engine.name, engine.url, why)
        engine.healthy = False
        for sid in [s for s, e in self._affinity.items() if e is engine]:
            del self._affinity[sid]

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await asyncio.gather(*(self._check(e) for e in self.engines), return_exceptions=True)

    async def _check(self, engine: Engine) -> None:
        if not await self.answers(engine):
            engine.failed_checks += 1
            if engine.failed_checks >= self.health_failures:
                self.mark_down(engine, f"{engine.failed_checks} health checks failed in a row")
            return
        engine.failed_checks = 0
        if engine.healthy:
            return
        try:
            if self.on_rejoin is not None and not await self.on_rejoin(engine):
                return
            for ready in self.on_ready:
                await ready(engine)
        except Exception as e:  # the hooks log their own failures; this is the backstop
            log.warning("%s answered but could not rejoin: %s", engine.name, e)
            return
        engine.healthy = True
        log.info("%s (%s) is back in the pool at version %d", engine.name, engine.url, self.version)

    # -- control calls (weight updates and other engine administration) --------------------------
    async def control(self, engine: Engine, path: str, body: dict | None = None, params: dict | None = None,
                      timeout_s: float | None = None) -> str:
        """POST to one engine's control route (``/pause``, ``/collective_rpc``, ...); the answer's text.

        Not held by the gate and not counted as outstanding: the update code calls these while
        the gate is closed. A status >= 400 raises :class:`EngineError`; connection errors and
        timeouts propagate as aiohttp / TimeoutError for the caller to name its step.
        """
        assert self._http is not None, "EnginePool.start() was not awaited"
        async with self._http.post(
            engine.url + path,
            json=body,
            params=params,
            timeout=aiohttp.ClientTimeout(total=timeout_s or self.control_timeout_s),
        ) as r:
            text = await r.text()
            if r.status >= 400:
                raise EngineError(f"{engine.name} {path} answered {r.status}: {text[:300]}")
            return text

    async def answers(self, engine: Engine) -> bool:
        """Whether ``engine`` answers ``GET /health`` with 200 now (within 5 s)."""
        return await self.health(engine) == 200

    async def health(self, engine: Engine) -> int | None:
        """The status ``engine`` answers ``GET /health`` with (within 5 s); None when it does not
        answer. vLLM answers 503 once its engine core is dead, never for a passing moment."""
        assert self._http is not None
        try:
            async with self._http.get(engine.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status
        except (TimeoutError, aiohttp.ClientError):
            return None

    async def progress(self, engine: Engine) -> float | None:
        """A number that grows with each engine step that did work: vLLM's ``/metrics`` steps
        (``vllm:iteration_tokens_total`` observations) plus its prompt and generated tokens. None
        when ``/metrics`` does not answer within 5 s or names none of them. It is served by the
        API server, so it stands still while the engine core does."""
        assert self._http is not None
        try:
            async with self._http.get(engine.url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
                text = await r.text() if r.status == 200 else ""
        except (TimeoutError, aiohttp.ClientError):
            return None
        sums = metric_sums(text, PROGRESS_SERIES)
        return sum(sums.values()) if sums else None

    async def paused(self, engine: Engine) -> bool | None:
        """Whether ``engine`` is paused (vLLM's ``/is_paused``: a weight update's pause, or an
        operator's); None when it does not say within 5 s."""
        assert self._http is not None
        try:
            async with self._http.get(engine.url + "/is_paused", timeout=aiohttp.ClientTimeout(total=5)) as r:
                body = await r.json(content_type=None) if r.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None
        value = body.get("is_paused") if isinstance(body, dict) else None
        return value if isinstance(value, bool) else None

    def status(self) -> list[dict[str, Any]]:
        return [e.status() for e in self.engines]

    def follow(self, view: dict[str, Any]) -> None:
        """Take another pool's view of the engines as this one's: serve's ``/admin/engines`` answer
        (``version``, ``versions``, and per engine ``url``, ``healthy``, ``version``, ``adapters``).

        A rollout worker's own router (``serve --ray``) calls the engines directly but leaves
        membership to serve, which brings an engine back to the current weights before it takes
        traffic again: an engine serve has out is out here, one it has in is in (this pool takes
        one out sooner when a connection to it fails), and an engine that moved (a restarted actor
        on another node) is followed to its new URL. Malformed entries are skipped."""
        engines = view.get("engines")
        if not isinstance(engines, list):
            return
        if "version" in view:
            self.version = parse_version(view["version"])
        versions = view.get("versions")
        if isinstance(versions, dict):
            self.versions = {str(p): parse_version(v) for p, v in versions.items()}
        for i, st in enumerate(engines):
            if not isinstance(st, dict) or not isinstance(st.get("url"), str):
                continue
            url = st["url"].rstrip("/")
            if i == len(self.engines):
                self.engines.append(Engine(url=url, name=str(st.get("name") or f"engine-{i}"), healthy=False))
            elif i > len(self.engines):
                continue
            engine = self.engines[i]
            if engine.url != url:
                self.mark_down(engine, f"serve moved it to {url}")
                engine.url = url
            if st.get("healthy") is True:
                engine.healthy = True
            else:
                self.mark_down(engine, "serve has it out of its pool")
            engine.version = parse_version(st.get("version"))
            adapters = st.get("adapters")
            engine.adapters = {
                str(policy): {v: "" for v in map(parse_version, held) if v > 0}
                for policy, held in (adapters.items() if isinstance(adapters, dict) else ())
                if isinstance(held, list)
            }


def metric_sums(text: str, names: Iterable[str]) -> dict[str, float]:
    """Each of ``names`` in a Prometheus text answer, summed over its label sets; a name with no
    readable sample is left out."""
    wanted, out = set(names), {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            with contextlib.suppress(ValueError, IndexError):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


_JSON = {"Content-Type": "application/json"}


try:  # orjson when installed (several times faster on the hot path), else the standard library
    import orjson

    def dumps(body: Any) -> bytes:
        return orjson.dumps(body)

    loads = orjson.loads
except ImportError:
    def dumps(body: Any) -> bytes:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()

    loads = json.loads


def _engine_message(text: str) -> str:
    try:
        data = json.loads(text)
    except ValueError:
        return text[:500]
    err = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or err)[:1000]
    return str(err)[:1000]
