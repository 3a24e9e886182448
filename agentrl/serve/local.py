"""Engines on this machine: serve's vLLM engines as child processes (the one-machine default), and
their supervision (what Ray's actor restarts do for ``serve --ray``).

Each engine runs through :mod:`agentrl.engines.reaper`, so it dies with serve however serve ends.
Launching, and relaunching, happens on the event loop's thread, which is the main thread: the
reaper's parent-death signal follows the thread that spawned it, so a relaunch from a worker
thread would die with that thread.

Supervision (:class:`Supervisor`), once the engines are up and in the pool: a watcher per engine
sees its process exit (``kill -9`` of vLLM's API server), its ``/health`` answer 503 (vLLM 0.32's
answer once its engine core died: within about a second of a ``kill -9`` of the engine core; the
API server would exit by itself about 5 s later) or its ``/health`` fail for
``engine.unhealthy_restart_s`` while the process runs (a server that stopped answering), or a
stall: calls in flight on it and no engine step finished for ``engine.stall_s`` while it is not
paused (a stopped or wedged engine core, which ``/health`` does not see: vLLM's API server answers
200 as long as its core has not died; the steps are read from its ``/metrics``), or, with no call in
flight, an engine out of the pool that answers ``/health`` while every try to bring it to the
current version fails (:data:`REJOIN_FAILURES` in a row; e.g. a core stopped during a weight
update). Then it

1. logs the death and takes the engine out of the pool at once (calls go to the other engines or
   fail as with none; affinities to it are dropped);
2. relaunches it on the same port after a back-off (``engine.restart_backoff_s``, doubled for each
   relaunch in a row, at most :data:`MAX_BACKOFF_S`), at most ``engine.max_restarts`` in a row (an
   engine that stays up :data:`STABLE_S` starts a new row);
3. waits until the pool's health check re-admits it, which runs the pool's ``on_rejoin`` hook (the
   weight updater): the current version's weights are reloaded and the version stamped before the
   engine takes traffic, so every token it generates carries the version that produced it.

When the last relaunch of a row fails, the engine is ``failed``: it stays out of the pool, the log
and serve's status say so, and when every engine has failed :meth:`Supervisor.wait_all_failed`
returns (serve then exits with an error: nothing is left to serve).

Invariants: a relaunch never starts while a process of the same engine lives (the old one's whole
process group is gone first); nothing is relaunched once :meth:`LocalEngines.stop` began.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from agentrl.engines.vllm import EngineSpec, EngineStartError, VLLMEngine, wait_ports_free

if TYPE_CHECKING:
    from agentrl.engines.pool import Engine, EnginePool

log = logging.getLogger(__name__)

STABLE_S = 600.0  # an engine up this long after a relaunch starts a new row of relaunches
MAX_BACKOFF_S = 300.0
POLL_S = 0.5  # how often a watcher looks at its process
PROBE_S = 1.0  # how often it probes /health
REJOIN_FAILURES = 2  # an engine out of the pool that answers but fails this many rejoins in a row: stalled
DEAD_STATUS = 503  # vLLM's /health once its engine core is dead (EngineDeadError), never for a passing moment


class EngineFailed(EngineStartError):
    """Every engine serve launched died and could not be relaunched."""


@dataclass
class RestartPolicy:
    """How a dead engine is relaunched (from the ``engine`` section; see EngineConfig)."""

    max_restarts: int = 3  # relaunches in a row (-1: no limit)
    backoff_s: float = 2.0  # before the first relaunch of a row; doubled for each next one
    unhealthy_s: float = 60.0  # a running process whose /health failed this long is relaunched (0: never)
    stall_s: float = 0.0  # calls in flight and no engine step this long, not paused: relaunched (0: never)
    start_timeout_s: float = 600.0  # a relaunch not healthy and re-admitted by then failed
    stable_s: float = STABLE_S

    def backoff(self, streak: int) -> float:
        """The wait before relaunch number ``streak`` (1, 2, ...) of a row."""
        return min(MAX_BACKOFF_S, self.backoff_s * 2 ** max(0, streak - 1))


@dataclass
class Watch:
    """One engine's supervision state, as serve's status reports it."""

    state: Literal["up", "restarting", "failed"] = "up"
    restarts: int = 0  # relaunches over serve's life
    streak: int = 0  # relaunches in the current row
    up_since: float = 0.0
    last_death: str = ""
    last_recovery_s: float | None = None  # from the death seen to back in the pool
    progress: float | None = None  # the engine's step counter (EnginePool.progress) when it last moved
    progress_at: float = 0.0  # when it last moved, or the engine was last idle or paused
    progress_read_at: float = 0.0

    def status(self) -> dict[str, Any]:
        return {"state": self.state, "restarts": self.restarts, "last_death": self.last_death,
                "last_recovery_s": None if self.last_recovery_s is None else round(self.last_recovery_s, 1)}


def exit_reason(code: int | None) -> str:
    """An engine process's exit as words (the reaper reports a child killed by signal N as 128 + N)."""
    if code is None:
        return "its process is running"
    if code > 128:
        return f"its process was killed by signal {code - 128} (exit code {code})"
    return f"its process exited with code {code}"


class Supervisor:
    """Watches ``engines`` (each the process behind ``pool.engines[i]``) and relaunches dead ones.

    ``engines`` need ``alive()``, ``launch()``, ``await start(timeout_s)``, ``kill()``, ``proc``,
    ``spec.port`` and ``url`` (:class:`~agentrl.engines.vllm.VLLMEngine`); ``pool`` needs
    ``engines``, ``mark_down``, ``health`` and ``version`` (:class:`~agentrl.engines.pool.EnginePool`).
    """

    def __init__(self, engines: list[VLLMEngine], pool: EnginePool, policy: RestartPolicy) -> None:
        self.engines, self.pool, self.policy = engines, pool, policy
        now = time.monotonic()
        self.watches = [Watch(up_since=now, progress_at=now) for _ in engines]
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._all_failed = asyncio.Event()

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._watch(i), name=f"engine-supervisor-{i}")
                       for i in range(len(self.engines))]

    async def stop(self) -> None:
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def wait_all_failed(self) -> None:
        await self._all_failed.wait()

    def status(self) -> list[dict[str, Any]]:
        return [w.status() for w in self.watches]

    async def _watch(self, i: int) -> None:
        engine, member, watch = self.engines[i], self.pool.engines[i], self.watches[i]
        last_ok = next_probe = time.monotonic()
        while not self._stopping:
            await asyncio.sleep(POLL_S)
            now = time.monotonic()
            if watch.streak and now - watch.up_since >= self.policy.stable_s:
                watch.streak = 0  # it stayed up: the next death starts a new row
            why = ""
            if not engine.alive():
                why = exit_reason(engine.proc.returncode if engine.proc is not None else None)
            elif now >= next_probe:
                next_probe = now + PROBE_S
                status = await self.pool.health(member)
                if status == 200:
                    last_ok = now
                elif status == DEAD_STATUS:  # its engine core is dead: no need to wait for the server to exit
                    why = f"its engine core is dead (/health answers {status})"
                elif self.policy.unhealthy_s and now - last_ok >= self.policy.unhealthy_s:
                    why = f"its /health has failed for {now - last_ok:.0f} s while its process runs"
                if status == 200 and self.policy.stall_s:
                    why = self._unrejoinable(member) or await self._stalled(member, watch, now)
            if not why or self._stopping:
                continue
            await self._recover(i, why)
            if watch.state == "failed":
                if all(w.state == "failed" for w in self.watches):
                    self._all_failed.set()
                return
            last_ok = next_probe = watch.progress_at = time.monotonic()
            watch.progress = None

    def _unrejoinable(self, member: Engine) -> str:
        """Why an engine out of the pool that answers ``/health`` counts as stalled, or "": the
        tries to bring it to the current version (each bounded by the pool's control timeout) failed
        :data:`REJOIN_FAILURES` times in a row, e.g. its engine core was stopped during a weight
        update, with no call in flight for :meth:`_stalled` to see."""
        failed = member.failed_rejoins
        if member.healthy or failed < REJOIN_FAILURES:
            return ""
        return (f"it answers /health but {failed} tries in a row to bring it to the current version failed "
                f"(last: {member.last_error}): a stopped or wedged engine")

    async def _stalled(self, member: Engine, watch: Watch, now: float) -> str:
        """Why the engine counts as stalled, or "": calls in flight on it, its step counter unmoved
        for ``stall_s`` and the engine not paused. The counter is read every quarter of
        ``stall_s`` (``/metrics`` is no small answer), and only while calls are in flight."""
        stall_s = self.policy.stall_s
        if member.outstanding <= 0:  # idle is not stalled
            watch.progress, watch.progress_at = None, now
            return ""
        if now - watch.progress_read_at < stall_s / 4:
            return ""
        watch.progress_read_at = now
        counter = await self.pool.progress(member)
        if counter is not None and counter != watch.progress:
            watch.progress, watch.progress_at = counter, now
            return ""
        if now - watch.progress_at < stall_s:
            return ""
        if await self.pool.paused(member):  # held on purpose (a weight update): not a stall
            watch.progress_at = now
            return ""
        seen = "no step counter in its /metrics" if counter is None else "no engine step"
        return (f"it made no progress for {now - watch.progress_at:.0f} s with {member.outstanding} "
                f"call(s) in flight ({seen}; not paused, /health answers 200): a stopped or wedged engine")

    async def _recover(self, i: int, why: str) -> None:
        engine, member, watch, policy = self.engines[i], self.pool.engines[i], self.watches[i], self.policy
        t_death = time.monotonic()
        watch.last_death = why
        log.error("engine %d (port %d) died: %s; last lines of %s:\n%s", i, engine.spec.port, why,
                  getattr(engine, "log_path", "its log"), _tail(engine))
        self.pool.mark_down(member, f"engine process: {why}")
        member.failed_rejoins = 0  # the relaunched process starts a new count
        while not self._stopping:
            if (
                engine.alive()
            ):  # a dead engine core, a server that answers no more, a relaunch that never rejoined
                await asyncio.to_thread(engine.kill)  # its whole process group, before a new one starts
            if 0 <= policy.max_restarts <= watch.streak:
                watch.state = "failed"
                log.error("engine %d (port %d) FAILED: "
                          "%d relaunch(es) in a row did "
                          "not keep it up (last: %s); "
                          "it stays out of the pool", i, engine.spec.port, watch.streak, watch.last_death)
                return
            watch.streak += 1
            watch.restarts += 1
            watch.state = "restarting"
            delay = policy.backoff(watch.streak)
            limit = "no limit" if policy.max_restarts < 0 else f"{policy.max_restarts}"
            log.warning("relaunching engine %d on port %d in %.1f s (relaunch %d in a row of %s)", i,
                        engine.spec.port, delay, watch.streak, limit)
            await asyncio.sleep(delay)
            if self._stopping:
                return
            try:
                engine.launch()  # on the loop's (main) thread: the reaper dies with serve
                await engine.start(policy.start_timeout_s)
                await self._rejoined(member, policy.start_timeout_s)
            except Exception as e:  # EngineStartError, TimeoutError, or the launch itself (e.g. no fork)
                first = (str(e).splitlines() or [type(e).__name__])[0]
                watch.last_death = f"relaunch {watch.streak} failed: {first}"
                log.error("engine %d (port %d): %s", i, engine.spec.port, watch.last_death)
                continue
            watch.state = "up"
            watch.up_since = time.monotonic()
            watch.last_recovery_s = watch.up_since - t_death
            log.warning("engine %d (port %d) is back in the pool at version %d, %.1f s after it died "
                        "(%d relaunch(es) so far)", i, engine.spec.port, self.pool.version,
                        watch.last_recovery_s, watch.restarts)
            return

    async def _rejoined(self, member: Engine, timeout_s: float) -> None:
        """Until the pool's health check has re-admitted the engine (at the current version)."""
        deadline = time.monotonic() + timeout_s
        while not member.healthy:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{member.name} answered but was not re-admitted within {timeout_s:g} s "
                                   f"(see the weight updater's warnings)")
            await asyncio.sleep(0.1)


def _tail(engine: VLLMEngine, n: int = 15) -> str:
    tail = getattr(engine, "log_tail", None)
    return tail(n) if tail is not None else ""


async def _start(engine: VLLMEngine, timeout_s: float, relaunches: int) -> None:
    tries = 0
    while True:
        try:
            return await engine.start(timeout_s)
        except EngineStartError:
            code = engine.proc.returncode if engine.proc is not None else None
            killed = code is not None and (code < 0 or code > 128)  # the reaper exits 128 + signal
            if not killed or 0 <= relaunches <= tries:
                raise
            tries += 1
            log.warning("engine on port %d was killed while it started (exit code %d); launching it "
                        "again (%d of %s)", engine.spec.port, code, tries,
                        "no limit" if relaunches < 0 else relaunches)
            await asyncio.sleep(1.0)
            engine.launch()


class LocalEngines:
    """The engines serve launches itself: ``launch()``, ``await start()``, then ``urls``;
    ``supervise(pool, policy)`` once they are in the pool; ``await stop()``."""

    def __init__(self, specs: list[EngineSpec], log_dir: Path) -> None:
        self.engines = [VLLMEngine(spec, log_dir) for spec in specs]
        self.supervisor: Supervisor | None = None

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    async def wait_ports_free(self, timeout_s: float = 120.0) -> None:
        """Until the engines' ports are free (see :func:`agentrl.engines.vllm.wait_ports_free`)."""
        await wait_ports_free([e.spec for e in self.engines], timeout_s)

    def launch(self) -> None:
        for engine in self.engines:
            engine.launch()

    async def start(self, timeout_s: float, relaunches: int = 3) -> list[str]:
        """Wait until every engine answers ``/health``; their URLs. An engine killed by a signal
        while it starts (the OOM killer, an operator) is launched again, at most ``relaunches``
        times (-1: no limit); one that exits by itself (a bad model or option) fails the start."""
        await asyncio.gather(*(_start(e, timeout_s, relaunches) for e in self.engines))
        return self.urls

    def supervise(self, pool: EnginePool, policy: RestartPolicy) -> None:
        """Relaunch an engine that dies (see the module's docstring); ``pool.engines[i]`` is engine i."""
        self.supervisor = Supervisor(self.engines, pool, policy)
        self.supervisor.start()

    async def wait_all_failed(self) -> None:
        """Until every engine has failed for good (forever if none is supervised)."""
        if self.supervisor is None:
            await asyncio.Event().wait()
        else:
            await self.supervisor.wait_all_failed()

    def status(self) -> list[dict[str, Any]]:
        """Per engine: its supervision state and restarts, the process id, and while it restarts its
        start-up phase."""
        watches = self.supervisor.status() if self.supervisor is not None else [{} for _ in self.engines]
        return [{"pid": e.pid, **w, **({"phase": e.phase} if w.get("state") == "restarting" else {})}
                for e, w in zip(self.engines, watches, strict=True)]

    async def stop(self) -> None:
        if self.supervisor is not None:  # no relaunch from here on
            await self.supervisor.stop()
        for engine in self.engines:
            await asyncio.to_thread(engine.stop)
