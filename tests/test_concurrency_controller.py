"""The concurrency controller (agentrl.rollout.concurrency, issue #38 item 1): its decisions from a fake
/metrics source read by read, the orchestrator starting groups only within its limit, and the
controller driving a real stand-in engine process under load (the limit rises, then backs off when
the stand-in's KV cache fills and preempts). No timing assertions: the tests wait for events."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from agentrl.buffer import Buffer, BufferConfig
from agentrl.rollout.concurrency import ConcurrencyController, Garbage, http_reader, parse_reading
from agentrl.rollout.config import ConcurrencyConfig
from agentrl.rollout.episode import EpisodeResult
from agentrl.rollout.orchestrator import Orchestrator
from tests.conftest import free_port
from tests.scoring_helpers import finished_episode


def metrics(running: float = 2, waiting: float = 0, kv: float = 0.2, preemptions: float = 0) -> str:
    """A vLLM /metrics answer with the four series the controller reads (labelled, as vLLM's are)."""
    lab = '{engine="0",model_name="m"}'
    return "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{lab} {running}",
        f"vllm:num_requests_waiting{lab} {waiting}",
        f"vllm:kv_cache_usage_perc{lab} {kv}",
        f"vllm:num_preemptions_total{lab} {preemptions}",
        f"vllm:prompt_tokens_total{lab} 1234.0",
    ]) + "\n"


class FakeMetrics:
    """What the controller reads: per engine, the answer set last (a text or an exception)."""

    def __init__(self, **answers: str | Exception) -> None:
        self.answers: dict[str, str | Exception] = answers
        self.reads = 0

    async def __call__(self) -> dict[str, str | Exception]:
        self.reads += 1
        return dict(self.answers)


def controller(source: FakeMetrics, *, cap: int = 64, group: int = 4, in_flight: int | None = None,
               **config: Any) -> ConcurrencyController:
    """A controller whose episodes in flight always press on its limit (unless ``in_flight``)."""
    c = ConcurrencyController(ConcurrencyConfig(controller=True, **config), static_cap=cap, group_size=group,
                              read=source)
    c.in_flight = (lambda: c.limit) if in_flight is None else (lambda: in_flight)
    return c


def ticks(c: ConcurrencyController, n: int) -> list[str]:
    async def go() -> list[str]:
        return [await c.tick() for _ in range(n)]

    return asyncio.run(go())


# -- the decisions -------------------------------------------------------------------------------------
def test_the_limit_grows_while_the_engines_have_room_and_nothing_waits_up_to_the_static_cap() -> None:
    c = controller(FakeMetrics(a=metrics(), b=metrics()), cap=40, group=4)
    assert c.limit == 8  # nothing read yet: the initial limit (two groups)
    first = ticks(c, 1)
    assert first == ["grow"] and c.limit == 16 and not c.fallback  # slow start: 8 doubled
    assert ticks(c, 10) == ["grow", "grow"] + ["hold"] * 8  # 16 -> 32 -> 40 (the cap); then it holds
    assert c.limit == 40
    c.slow_start = False  # after slow start, one group per growth
    c._limit = 20
    ticks(c, 1)
    assert c.limit == 24


def test_the_limit_does_not_grow_while_the_episodes_in_flight_leave_it_room() -> None:
    c = controller(FakeMetrics(a=metrics()), cap=64, group=4, in_flight=0)
    assert set(ticks(c, 5)) == {"hold"}
    assert c.limit == 8


def test_new_preemptions_back_off_and_an_unchanged_counter_does_not() -> None:
    source = FakeMetrics(a=metrics(preemptions=3))
    c = controller(source, cap=64, group=4, initial=32)
    ticks(c, 1)
    assert c.limit == 64
    source.answers["a"] = metrics(preemptions=5)
    assert ticks(c, 1) == ["back_off"] and c.limit == 44  # floor(64 x 0.7)
    assert c.reasons == {"preemptions": 1} and not c.slow_start
    assert ticks(c, 3) == ["grow"] * 3  # the counter stays at 5: room again, one group a step
    assert c.limit == 56


def test_kv_usage_above_the_soft_threshold_backs_off_down_to_one_group_at_least() -> None:
    source = FakeMetrics(a=metrics(kv=0.5), b=metrics(kv=0.9))  # the most loaded engine decides
    c = controller(source, cap=64, group=4, initial=16, hold_ticks=0)
    decisions = ticks(c, 10)
    assert decisions[0] == "back_off" and set(decisions) == {"back_off"}
    assert c.limit == 4 and c.reasons == {"kv_soft": 10}  # floored at one group


def test_a_growing_queue_backs_off_and_a_steady_one_holds() -> None:
    source = FakeMetrics(a=metrics(waiting=0))
    c = controller(source, cap=64, group=2, initial=20)
    ticks(c, 1)  # 40
    source.answers["a"] = metrics(waiting=3)
    assert ticks(c, 1) == ["back_off"] and c.limit == 28
    assert ticks(c, 4) == ["hold"] * 4  # three waiting, not growing: no cut, and no growth either
    assert c.reasons == {"queue": 1}


def test_above_the_hard_kv_threshold_no_group_starts_until_it_drops() -> None:
    source = FakeMetrics(a=metrics(kv=0.99))
    c = controller(source, cap=64, group=4, initial=20)
    assert ticks(c, 3) == ["pause"] * 3
    assert c.limit == 0 and c.paused and c.status()["paused"]
    assert c.reasons == {"kv_hard": 1} and c._limit == 14  # one cut (then it holds while the cut drains)
    source.answers["a"] = metrics(kv=0.5)
    assert ticks(c, 1) == ["grow"] and not c.paused and c.limit == 18


def test_the_bounds_hold_one_group_at_least_and_the_static_cap_at_most() -> None:
    c = controller(FakeMetrics(a=metrics()), cap=3, group=4, min=1, initial=100)
    assert c.min == c.max == 4  # a cap below one group still lets one group run
    c = controller(FakeMetrics(a=metrics()), cap=64, group=4, min=12, initial=1)
    assert (c.min, c.max, c._limit) == (12, 64, 12)


# -- blind and garbage -----------------------------------------------------------------------------------
def test_without_metrics_it_holds_the_static_cap_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    source = FakeMetrics(a=aiohttp.ClientConnectionError("refused"), b="# other metrics\nup 1\n")
    c = controller(source, cap=48, group=4)
    with caplog.at_level(logging.WARNING, logger="agentrl.rollout.concurrency"):
        assert set(ticks(c, 20)) == {"blind"}
    assert c.limit == 48 and c.fallback and c.status()["fallback"]
    said = [r.getMessage() for r in caplog.records]
    assert sum("engine a gives no metrics" in m for m in said) == 1
    assert sum("engine b gives no metrics (no vLLM series" in m for m in said) == 1
    assert all("using the static cap 48" in m for m in said)
    # an engine that answers again is read; one that still does not is left out of the decision
    source.answers["b"] = metrics()
    assert ticks(c, 1) == ["grow"] and not c.fallback and c.limit == 16
    assert c.status()["engines"]["a"]["error"].startswith("ClientConnectionError")


def test_metrics_that_do_not_change_are_not_a_failure() -> None:
    c = controller(FakeMetrics(a=metrics(running=7, kv=0.3)), cap=64, group=4)
    assert "blind" not in ticks(c, 10) and not c.fallback


def test_a_read_that_hangs_is_blind_and_never_stalls_the_controller() -> None:
    class Hangs:
        async def __call__(self) -> dict[str, str]:
            await asyncio.Event().wait()
            return {}

    c = ConcurrencyController(ConcurrencyConfig(controller=True, interval_s=0.01), static_cap=32,
                              group_size=4, read=Hangs())
    assert ticks(c, 1) == ["blind"] and c.limit == 32


@pytest.mark.parametrize("bad", ["nan", "-1", "abc", "inf", "1.5"])
def test_garbage_values_are_ignored_and_counted(bad: str, caplog: pytest.LogCaptureFixture) -> None:
    text = metrics().replace("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.2",
                             f"vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {bad}")
    with pytest.raises(Garbage):
        parse_reading(text)
    source = FakeMetrics(a=metrics(), b=text)
    c = controller(source, cap=32, group=4)
    with caplog.at_level(logging.WARNING, logger="agentrl.rollout.concurrency"):
        assert ticks(c, 3) == ["grow", "grow", "hold"]  # engine a decides alone
    assert c.garbage == 3 and c.status()["garbage"] == 3
    assert sum("ignoring a /metrics read" in r.getMessage() for r in caplog.records) == 1
    source.answers = {"b": text}  # only garbage: blind, at the static cap
    assert ticks(c, 1) == ["blind"] and c.limit == 32


def test_the_readings_sum_label_sets_and_know_the_old_kv_name() -> None:
    text = metrics(running=2, waiting=1) + 'vllm:num_requests_running{engine="1"} 3\n'
    assert parse_reading(text).running == 5
    old = metrics(kv=0.4).replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert parse_reading(old).kv == 0.4
    assert parse_reading("vllm:num_requests_running 1\n") is None


# -- the orchestrator asks it -----------------------------------------------------------------------------
def test_the_orchestrator_starts_groups_only_within_the_controllers_limit() -> None:
    class Limit:
        def __init__(self) -> None:
            self.limit = 4

        def status(self) -> dict[str, Any]:
            return {"limit": self.limit}

    async def main() -> tuple[int, int, dict[str, Any]]:
        release = asyncio.Event()
        playing = 0

        async def producer(task: dict, group_id: str) -> EpisodeResult:
            nonlocal playing
            playing += 1
            await release.wait()
            return finished_episode(group_id)

        limit = Limit()
        buf = Buffer(BufferConfig(batch_size=1000, max_staleness=4))
        orch = Orchestrator(producer, buf, env_name="guess_number", group_size=2, max_concurrency=64,
                            concurrency=limit)  # type: ignore[arg-type]
        run = asyncio.create_task(orch.run())
        try:
            async with asyncio.timeout(60):
                while playing < 4:
                    await asyncio.sleep(0.01)
                for _ in range(30):  # many turns of the rollout's loop: no group beyond the limit
                    await asyncio.sleep(0.01)
                held = playing
                limit.limit = 10
                while playing < 10:
                    await asyncio.sleep(0.01)
                status = orch.status()
        finally:
            release.set()
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        return held, orch.in_flight, status

    held, _, status = asyncio.run(main())
    assert held == 4
    assert status["concurrency"] == {"limit": 10} and status["in_flight"] == 10


# -- against a stand-in engine process --------------------------------------------------------------------
@pytest.fixture
def small_standin(tiny_tools_model: str) -> Iterator[SimpleNamespace]:
    """``python -m agentrl.engines.standin`` with a small KV cache (3,000 tokens: about ten requests of
    100 prompt and 200 output tokens), on a free port."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.engines.standin", "--port", str(port), "--model",
                             tiny_tools_model, "--served-model-name", "tiny-tools", "--tokens-per-s", "2000",
                             "--kv-tokens", "3000"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("standin engine ready on http://127.0.0.1:"), line
        yield SimpleNamespace(name="standin", url=f"http://127.0.0.1:{port}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_controller_grows_on_a_standin_engine_then_backs_off_when_its_kv_fills_and_it_preempts(
        small_standin) -> None:
    body = {"token_ids": [300 + i % 50 for i in range(100)], "model": "tiny-tools",
            "sampling_params": {"max_tokens": 200, "ignore_eos": True}}

    async def main() -> tuple[list[tuple[str, int]], dict[str, Any]]:
        read, close = http_reader([small_standin])
        c = ConcurrencyController(ConcurrencyConfig(controller=True, initial=2), static_cap=64, group_size=1,
                                  read=read, close=close)
        running: set[asyncio.Task] = set()
        c.in_flight = lambda: len(running)
        async with aiohttp.ClientSession() as http:

            async def one() -> None:
                async with http.post(small_standin.url + "/inference/v1/generate", json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()

            async def feed() -> None:  # as the orchestrator does: requests in flight up to the limit
                while True:
                    while len(running) < c.limit:
                        t = asyncio.create_task(one())
                        running.add(t)
                        t.add_done_callback(running.discard)
                    await asyncio.sleep(0.01)

            history: list[tuple[str, int]] = []
            feeder = asyncio.create_task(feed())
            try:
                async with asyncio.timeout(120):
                    while not (any(d == "grow" for d, _ in history)
                               and any(d in ("back_off", "pause") for d, _ in history)
                               and c.inputs["standin"].get("preemptions", 0) > 0):
                        await asyncio.sleep(0.05)
                        history.append((await c.tick(), c.limit))
            finally:
                feeder.cancel()
                await asyncio.gather(feeder, return_exceptions=True)
                for t in list(running):
                    t.cancel()
                await asyncio.gather(*running, return_exceptions=True)
                await c.stop()
        return history, c.status()

    history, status = asyncio.run(main())
    grew = next(i for i, (d, _) in enumerate(history) if d == "grow")
    cut = next(i for i, (d, _) in enumerate(history) if d in ("back_off", "pause"))
    assert grew < cut  # it rose first, then backed off
    peak = max(limit for _, limit in history[:cut])
    assert peak > 2 and status["controlled_limit"] < peak
    assert {"kv_soft", "kv_hard"} & set(status["back_off_reasons"])  # its KV cache filled
    seen = status["engines"]["standin"]
    assert set(seen) == {"running", "waiting", "kv", "preemptions"} and seen["preemptions"] > 0
    assert not status["fallback"] and status["garbage"] == 0


def test_serve_exposes_the_controllers_limit_inputs_and_decisions_on_its_metrics() -> None:
    from agentrl.serve.app import prometheus_series

    source = FakeMetrics(a=metrics(running=3, waiting=0, kv=0.5, preemptions=2), b=ValueError("down"))
    c = controller(source, cap=64, group=4)
    ticks(c, 2)
    series = prometheus_series({"rollout": {"in_flight": 5, "concurrency": c.status()}})
    assert series["concurrency_limit"] == 32 and series["concurrency_fallback"] == 0
    assert series['concurrency_decisions_total{decision="grow"}'] == 2
    assert series['concurrency_engine_kv{engine="a"}'] == 0.5
    assert series['concurrency_engine_preemptions{engine="a"}'] == 2
    assert not any('engine="b"' in k for k in series)  # an engine without metrics has no readings


def test_serve_builds_the_controller_only_when_it_is_on_and_has_engines_to_read() -> None:
    from agentrl.engines.pool import EnginePool
    from agentrl.serve.build import build_concurrency
    from agentrl.serve.config import ServeConfig

    cfg = ServeConfig()
    pool = EnginePool(["http://127.0.0.1:9"])
    assert build_concurrency(cfg, pool) is None  # off by default: the static cap
    cfg.env.concurrency.controller = True
    cfg.env.max_concurrency = 96
    assert build_concurrency(cfg, None) is None  # a Ray rollout worker: nothing to read
    c = build_concurrency(cfg, pool)
    assert c is not None and c.max == 96 and c.min == cfg.env.group_size
