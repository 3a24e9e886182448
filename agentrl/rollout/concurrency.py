"""The concurrency controller: how many episodes may be in flight, from what the engines say.

Every ``interval_s`` it reads each engine's vLLM ``/metrics`` (running and waiting requests, KV-cache
usage, preemptions) and moves one limit for the whole rollout (the router spreads the episodes over
the engines, so the most loaded engine decides), AIMD-fashion:

- **back off** (limit x ``decrease``) on new preemptions, on KV usage above ``kv_soft``, or on a
  waiting queue that grew since the last read (a queue: more than one request, and more than
  ``queue_tolerance`` x the running ones, waiting); after a back-off, ``hold_ticks`` reads pass before the
  next one (the episodes in flight take time to drain below a cut);
- **pause** at or above ``kv_hard``: a back-off, and no new group starts until usage drops below it
  (the limit is 0; the orchestrator still starts a group when nothing at all is in flight, so the
  rollout never stalls);
- **grow** while every engine that answered has KV room, no queue and nothing was preempted, and
  the limit is what holds the rollout back (episodes in flight within a quarter of it): by one step, doubling
  instead until the first back-off (slow start);
- otherwise hold.

The limit stays within ``[min, max]``: ``min`` at least one group, ``max`` the static cap
(``env.max_concurrency``). The staleness admission (the buffer's room) bounds the rollout as before:
the orchestrator asks both.

Invariants: it never stalls the rollout. An engine whose ``/metrics`` does not answer, errs, times out
or names none of the series is left out of the decision and said so once (until it answers again);
when no engine gives metrics the limit is the static cap (``fallback``). A value that is not a number,
NaN, infinite, negative, or a KV usage above 1, is ignored (that engine's read is dropped) and counted
with a warning. Metrics that do not change are not a failure. Its inputs and decisions are in
:meth:`ConcurrencyController.status` (serve's ``rollout.concurrency``, its ``/metrics``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agentrl.errors import AgentrlError
from agentrl.rollout.config import ConcurrencyConfig

log = logging.getLogger(__name__)

RUNNING, WAITING, PREEMPTIONS = "vllm:num_requests_running", "vllm:num_requests_waiting", \
    "vllm:num_preemptions_total"
KV_SERIES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # vLLM's name now, and before 0.10
SERIES = frozenset({RUNNING, WAITING, PREEMPTIONS, *KV_SERIES})

# what a reader gives per engine name: the /metrics text, or why there is none
MetricsRead = Callable[[], Awaitable[Mapping[str, "str | Exception"]]]


class Garbage(AgentrlError, ValueError):
    """A /metrics answer with a value that cannot be one (NaN, negative, not a number)."""


@dataclass(frozen=True)
class Reading:
    """One engine's gauges at one read."""

    running: float
    waiting: float
    kv: float  # KV-cache usage, 0..1
    preemptions: float  # the counter (its growth is what counts)

    def as_dict(self) -> dict[str, float]:
        return {"running": self.running, "waiting": self.waiting, "kv": round(self.kv, 4),
                "preemptions": self.preemptions}


def parse_reading(text: str) -> Reading | None:
    """The gauges in a Prometheus text answer, summed over label sets; None when it names neither the
    running, waiting nor KV series (no vLLM metrics). Raises :class:`Garbage` on an unreadable value."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in SERIES:
            continue
        raw = line.rsplit(" ", 1)[-1]
        try:
            value = float(raw)
        except ValueError:
            raise Garbage(f"{name} = {raw!r}") from None
        if not math.isfinite(value) or value < 0:
            raise Garbage(f"{name} = {raw}")
        sums[name] = sums.get(name, 0.0) + value
    kv = next((sums[k] for k in KV_SERIES if k in sums), None)
    if RUNNING not in sums or WAITING not in sums or kv is None:
        return None
    if kv > 1.0:  # vLLM reports a fraction, whatever the name says
        raise Garbage(f"KV-cache usage {kv} > 1")
    return Reading(sums[RUNNING], sums[WAITING], kv, sums.get(PREEMPTIONS, 0.0))


class _Endpoint(Protocol):
    name: str
    url: str


def http_reader(engines: Sequence[_Endpoint], headers: Mapping[str, str] | None = None,
                timeout_s: float = 2.0) -> tuple[MetricsRead, Callable[[], Awaitable[None]]]:
    """A reader of ``engines``' ``/metrics`` over one aiohttp session (opened at the first read), and
    the call that closes it."""
    import aiohttp

    session: list[aiohttp.ClientSession] = []

    async def one(engine: _Endpoint) -> str | Exception:
        try:
            async with session[0].get(engine.url + "/metrics",
                                      timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                if r.status != 200:
                    return RuntimeError(f"/metrics answered {r.status}")
                return await r.text()
        except (TimeoutError, aiohttp.ClientError) as e:
            return e

    async def read() -> dict[str, str | Exception]:
        if not session:
            session.append(aiohttp.ClientSession(headers=dict(headers or {})))
        texts = await asyncio.gather(*(one(e) for e in engines))
        return {e.name: t for e, t in zip(engines, texts, strict=True)}

    async def close() -> None:
        if session:
            await session.pop().close()

    return read, close


class ConcurrencyController:
    """Moves :attr:`limit` from the engines' metrics (the module docstring says how)."""

    def __init__(self, config: ConcurrencyConfig, *, static_cap: int, group_size: int, read: MetricsRead,
                 in_flight: Callable[[], int] | None = None,
                 close: Callable[[], Awaitable[None]] | None = None) -> None:
        """``static_cap``: ``env.max_concurrency`` (the upper bound, and the limit when blind).
        ``read``: each engine's ``/metrics`` text (or the error that stood in its way), by name.
        ``in_flight``: the episodes running now (the orchestrator's); the limit grows only while they
        press on it. ``close``: awaited by :meth:`stop` (the reader's session)."""
        self.config = config
        self.group_size = max(1, group_size)
        self.max = max(static_cap, self.group_size)
        self.min = min(self.max, max(config.min, self.group_size))
        self.read, self._close = read, close
        self.in_flight = in_flight
        initial = config.initial or self.group_size * 2
        self._limit = min(self.max, max(self.min, initial))
        self.paused = False
        self.fallback = False  # True while no engine gives metrics: the static cap
        self.slow_start = config.slow_start
        self.decisions = {"grow": 0, "hold": 0, "back_off": 0, "pause": 0, "blind": 0}
        self.reasons: dict[str, int] = {}  # why it backed off: preemptions, kv_soft, queue
        self.garbage = 0  # reads ignored for a value that cannot be
        self.last_decision = "start"
        self.inputs: dict[str, dict[str, Any]] = {}  # engine -> its last reading, or its error
        self._previous: dict[str, Reading] = {}
        self._blind: set[str] = set()  # engines said to give no metrics (said once until they do)
        self._hold = 0
        self._task: asyncio.Task | None = None

    # -- what the orchestrator asks ----------------------------------------------------------------
    @property
    def limit(self) -> int:
        """Episodes in flight allowed now: the static cap when blind, 0 while paused."""
        if self.fallback:
            return self.max
        return 0 if self.paused else self._limit

    # -- the loop ------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="concurrency-controller")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._close is not None:
            await self._close()

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # a bug here must not take the rollout down: blind, at the static cap
                log.warning("concurrency controller: a read failed; using the static cap %d", self.max,
                            exc_info=True)
                self.fallback = True
            await asyncio.sleep(self.config.interval_s)

    async def tick(self) -> str:
        """One read of every engine and the decision it leads to (returned, and counted)."""
        try:
            texts = await asyncio.wait_for(self.read(), timeout=max(1.0, 2 * self.config.interval_s))
        except TimeoutError as e:
            texts = {"engines": e}
        return self.decide(texts)

    def decide(self, texts: Mapping[str, str | Exception]) -> str:
        """The decision for one read (``texts``: per engine, its ``/metrics`` text or an error)."""
        readings: dict[str, Reading] = {}
        for name, text in texts.items():
            reading = self._reading(name, text)
            if reading is not None:
                readings[name] = reading
        if not readings:
            if not self.fallback:
                log.warning("concurrency controller: no engine gives metrics; using the static cap %d",
                            self.max)
            self.fallback = True
            return self._decided("blind")
        if self.fallback and self.decisions["blind"]:
            log.info("concurrency controller: metrics again from %s; limit %d", sorted(readings), self._limit)
        self.fallback = False
        decision = self._step(readings)
        self._previous.update(readings)
        return self._decided(decision)

    def _reading(self, name: str, text: str | Exception) -> Reading | None:
        if isinstance(text, Exception):
            why = f"{type(text).__name__}: {text}" if str(text) else type(text).__name__
            self.inputs[name] = {"error": why[:200]}
            self._said_blind(name, why)
            return None
        try:
            reading = parse_reading(text)
        except Garbage as e:
            self.garbage += 1
            self.inputs[name] = {"error": f"garbage: {e}"[:200]}
            if self.garbage == 1 or self.garbage % 100 == 0:
                log.warning("concurrency controller: engine %s: ignoring a /metrics read with %s (%d such "
                            "read(s) so far)", name, e, self.garbage)
            return None
        if reading is None:
            self.inputs[name] = {"error": "no vLLM series in /metrics"}
            self._said_blind(name, "no vLLM series in /metrics")
            return None
        if name in self._blind:
            self._blind.discard(name)
            log.info("concurrency controller: engine %s gives metrics again", name)
        self.inputs[name] = reading.as_dict()
        return reading

    def _said_blind(self, name: str, why: str) -> None:
        if name not in self._blind:
            self._blind.add(name)
            log.warning("concurrency controller: engine %s gives no metrics (%s); using the static cap %d "
                        "while no engine does", name, why, self.max)

    def _step(self, readings: Mapping[str, Reading]) -> str:
        c = self.config
        kv = max(r.kv for r in readings.values())
        preempted = waiting_grew = False
        for name, r in readings.items():
            before = self._previous.get(name)
            if before is None:
                continue
            preempted |= r.preemptions > before.preemptions  # a counter that went back: a restart
            waiting_grew |= r.waiting > before.waiting and self._queued(r)
        self.paused = kv >= c.kv_hard
        reasons = [why for why, hit in (("preemptions", preempted), ("kv_soft", c.kv_soft <= kv < c.kv_hard),
                                        ("kv_hard", self.paused), ("queue", waiting_grew)) if hit]
        if reasons:
            if self._hold > 0:  # the last cut has not drained yet
                self._hold -= 1
                return "pause" if self.paused else "hold"
            for why in reasons:
                self.reasons[why] = self.reasons.get(why, 0) + 1
            self._limit = max(self.min, min(self._limit - 1, math.floor(self._limit * c.decrease)))
            self._hold = c.hold_ticks
            self.slow_start = False
            return "pause" if self.paused else "back_off"
        self._hold = max(0, self._hold - 1)
        waiting = any(self._queued(r) for r in readings.values())
        # a snapshot: episodes end and the next start a moment later, so within a quarter is pressing
        pressing = self.in_flight is None or self.in_flight() + self.group_size > 0.75 * self._limit
        if waiting or not pressing or self._limit >= self.max:
            return "hold"
        step = self._limit if self.slow_start else (c.step or self.group_size)
        self._limit = min(self.max, self._limit + step)
        return "grow"

    def _queued(self, r: Reading) -> bool:
        """Whether requests wait beyond the scheduler's lag (a request admitted at the next step waits
        a moment on an engine with room)."""
        return r.waiting > max(1.0, self.config.queue_tolerance * r.running)

    def _decided(self, decision: str) -> str:
        self.decisions[decision] += 1
        self.last_decision = decision
        return decision

    def status(self) -> dict[str, Any]:
        """Its limit, inputs per engine and decision counts (serve_metrics.jsonl's
        ``rollout.concurrency``)."""
        return {"limit": self.limit, "controlled_limit": self._limit, "min": self.min, "max": self.max,
                "paused": self.paused, "fallback": self.fallback, "slow_start": self.slow_start,
                "last_decision": self.last_decision, "decisions": dict(self.decisions),
                "back_off_reasons": dict(self.reasons), "garbage": self.garbage,
                "engines": {k: dict(v) for k, v in self.inputs.items()}, "time": round(time.time(), 3)}
