"""The scoring stage (agentrl.scoring): bounded scorers between an episode's end and the buffer.

A scorer that hangs is cut at its timeout and its episode dropped from its group (failed with kind
``scoring``, counted), while the agent loops keep playing; a judge whose endpoint is down is
retried with back-off and then fails the episode, never rewarding it 0; a judge that answers is
combined with the environment's reward by weight, each component kept by name. The judge here is
a real HTTP server speaking the chat-completions shape (a helper of this unit test); the stage,
its client and its retry policy are the product's.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

import agentrl
from agentrl.buffer.sample import Sample
from agentrl.errors import ConfigError
from agentrl.rollout.episode import EpisodeResult
from agentrl.rollout.orchestrator import Orchestrator
from agentrl.scoring import JudgeConfig, ScoringConfig, ScoringStage
from agentrl.serve.config import ServeConfig
from tests.scoring_helpers import TASK, finished_episode, stand_in_endpoint


def _stage(scorers: dict[str, tuple[Any, float]], **cfg: Any) -> ScoringStage:
    return ScoringStage(ScoringConfig(**cfg), scorers)


def test_a_scorer_that_hangs_is_cut_at_its_timeout_and_its_episode_dropped_and_counted() -> None:
    async def hangs(task: dict[str, Any], episode: Any) -> float:
        await asyncio.Event().wait()
        return 1.0

    stage = _stage({"hangs": (hangs, 1.0)}, timeout_s=0.2)
    ep = finished_episode()
    asyncio.run(stage(TASK, ep))
    assert ep.error_kind == "scoring" and "hangs took longer than 0.2 s" in ep.error, ep.error
    assert all(s.error == ep.error and s.error_kind == "scoring" for s in ep.samples)
    assert ep.reward == 1.0 and ep.samples[0].reward == 1.0  # the failure is not turned into a score
    assert stage.counters["failed"] == 1 and stage.counters["timeouts"] == 1 and stage.counters["scored"] == 0
    assert stage.per_scorer["hangs"]["failures"] == 1


def test_scorers_that_raise_or_return_no_number_fail_the_episode_with_their_reason() -> None:
    async def raises(task: dict[str, Any], episode: Any) -> float:
        raise RuntimeError("grader bug")

    async def nan(task: dict[str, Any], episode: Any) -> float:
        return float("nan")

    for fn, reason in ((raises, "RuntimeError: grader bug"), (nan, "returned nan")):
        ep = finished_episode()
        asyncio.run(_stage({"s": (fn, 1.0)})(TASK, ep))
        assert ep.error_kind == "scoring" and reason in ep.error, ep.error


@agentrl.environment("scoring-unit")
class _Questions(agentrl.ToolEnv):
    def tasks(self, split: str = "train"):
        for i in range(1000):
            yield {"id": f"t{i}", "question": f"{i} + 1?"}

    async def reward(self, task: dict[str, Any], answer: str) -> float:
        return 0.0


class _Producer:
    """Plays an episode instantly (a helper: the orchestrator and the stage are under test)."""

    def __init__(self) -> None:
        self.calls = 0
        self.many = asyncio.Event()

    async def __call__(self, task: dict[str, Any], group_id: str) -> EpisodeResult:
        self.calls += 1
        if self.calls >= 24:
            self.many.set()
        await asyncio.sleep(0)
        return finished_episode(group_id)


class _Sink:
    def __init__(self) -> None:
        self.samples: list[Sample] = []

    async def wait_for_room(self, in_flight: int, timeout_s: float) -> int:
        return 1000 - in_flight

    async def put(self, samples: list[Sample]) -> int:
        self.samples.extend(samples)
        return len(samples)


def test_agent_loops_keep_playing_while_every_scoring_slot_is_held_by_a_hanging_scorer() -> None:
    async def main() -> tuple[int, int, dict[str, Any], int]:
        release = asyncio.Event()
        entered = 0

        async def blocks(task: dict[str, Any], episode: Any) -> float:
            nonlocal entered
            entered += 1
            await release.wait()
            return 0.5

        producer, sink = _Producer(), _Sink()
        stage = _stage({"blocks": (blocks, 1.0)}, concurrency=2, timeout_s=600)
        orch = Orchestrator(
            producer, sink, env_name="scoring-unit", group_size=2, max_concurrency=4, max_episodes=40,
            scoring=stage,
        )
        run = asyncio.create_task(orch.run())
        await asyncio.wait_for(producer.many.wait(), 60)  # 24 episodes played; the 2 slots never freed
        held, status = entered, orch.status()
        release.set()
        await asyncio.wait_for(run, 60)
        return held, producer.calls, status, len(sink.samples)

    held, played, status, stored = asyncio.run(main())
    assert held == 2  # the two scoring slots, blocked throughout
    assert status["in_flight"] <= 4 and status["scoring"]["waiting"] >= 20, status
    assert played == 40 and stored == 40


def test_a_judge_that_is_down_is_retried_with_back_off_and_no_zero_reward_is_injected() -> None:
    async def main() -> tuple[list[float], EpisodeResult, EpisodeResult, dict[str, Any]]:
        import time

        times: list[float] = []

        async def unavailable(request: web.Request) -> web.Response:
            times.append(time.monotonic())
            return web.json_response({"error": {"message": "overloaded"}}, status=503)

        runner, url = await stand_in_endpoint(unavailable)
        stage = ScoringStage(
            ScoringConfig(judge=JudgeConfig(url=url, model="judge"), retries=2, timeout_s=30)
        )
        answered_503 = finished_episode()
        await stage(TASK, answered_503)
        await runner.cleanup()
        refused = finished_episode()  # nothing listens there any more
        await stage(TASK, refused)
        await stage.close()
        return times, answered_503, refused, stage.status()

    times, answered_503, refused, status = asyncio.run(main())
    assert len(times) == 3  # one call and two retries
    assert times[2] - times[1] > times[1] - times[0] > 0.4  # back-off between them, doubling
    for ep, why in ((answered_503, "answered 503: overloaded"), (refused, "ClientConnectorError")):
        assert ep.error_kind == "scoring" and why in ep.error, ep.error
        assert ep.reward == 1.0 and all(s.error is not None and s.reward == 1.0 for s in ep.samples)
    assert status["failed"] == 2 and status["scorers"]["judge"]["failures"] == 2
    assert status["outage"] == 2  # the orchestrator backs off while it lasts (next test)


def test_the_orchestrator_backs_off_while_a_scorers_endpoint_is_down_and_not_for_a_bad_grade() -> None:
    from agentrl.errors import TransportError

    async def down(task: dict[str, Any], episode: Any) -> float:
        raise TransportError("POST judge: ClientConnectorError", status=None)

    async def bad(task: dict[str, Any], episode: Any) -> float:
        raise ValueError("not a grade")

    async def main(fn: Any) -> tuple[bool, int]:
        stage = _stage({"judge": (fn, 1.0)})
        orch = Orchestrator(_Producer(), _Sink(), env_name="scoring-unit", group_size=2, max_concurrency=4,
                            max_episodes=4, scoring=stage)
        await asyncio.wait_for(orch.run(), 60)
        return orch.backing_off, stage.outage

    assert asyncio.run(main(down)) == (True, 4)
    assert asyncio.run(main(bad)) == (False, 0)


def test_a_judge_that_answers_is_combined_with_the_environments_reward_by_weight() -> None:
    async def main() -> tuple[list[dict[str, Any]], EpisodeResult, EpisodeResult]:
        bodies: list[dict[str, Any]] = []

        async def grades(request: web.Request) -> web.Response:
            body = await request.json()
            bodies.append(body)
            grade = "7" if "42" in body["messages"][0]["content"] else "no idea"
            return web.json_response({"choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant", "content": grade}}]})

        runner, url = await stand_in_endpoint(grades)
        stage = ScoringStage(
            ScoringConfig(env_weight=0.5, judge=JudgeConfig(url=url, model="judge-m", weight=0.5))
        )
        good, unparsable = finished_episode(), finished_episode()
        unparsable.answer = "I am not sure"
        await stage(TASK, good)
        await stage(TASK, unparsable)
        await stage.close()
        await runner.cleanup()
        return bodies, good, unparsable

    bodies, good, unparsable = asyncio.run(main())
    assert bodies[0]["model"] == "judge-m" and bodies[0]["temperature"] == 0.0
    prompt = bodies[0]["messages"][0]["content"]
    assert "What is 6 x 7?" in prompt and "42" in prompt
    assert good.error is None and good.reward == pytest.approx(0.5 * 1.0 + 0.5 * 0.7)
    assert good.samples[0].reward == pytest.approx(0.85)
    assert good.samples[0].info["rewards"] == {"env": 1.0, "judge": pytest.approx(0.7)}
    assert unparsable.error_kind == "scoring" and "'no idea' is not a grade from 0 to 10" in unparsable.error


def test_a_registered_scorer_is_named_by_config_and_an_unknown_one_is_refused() -> None:
    @agentrl.scorer("unit-length")
    async def length(task: dict[str, Any], episode: Any) -> float:
        return len(episode.answer) / 10

    stage = ScoringStage(ScoringConfig(scorers={"unit-length": 2.0}, env_weight=0.0))
    ep = finished_episode()
    asyncio.run(stage(TASK, ep))
    assert ep.reward == pytest.approx(2.0 * 0.2) and ep.info["rewards"] == {"env": 1.0, "unit-length": 0.2}
    with pytest.raises(KeyError, match="no scorer named 'nope'"):
        ScoringStage(ScoringConfig(scorers={"nope": 1.0}))


def test_scoring_settings_are_checked_with_serves_config() -> None:
    cfg = ServeConfig()
    cfg.scoring.judge.url = "http://127.0.0.1:1/v1"
    with pytest.raises(ConfigError, match="scoring.judge.model"):
        cfg.check()
    cfg.scoring.judge.model, cfg.scoring.concurrency = "judge", 0
    with pytest.raises(ConfigError, match="scoring.concurrency"):
        cfg.check()
    assert json.dumps(ScoringConfig().enabled) == "false"


def test_a_group_judge_grades_a_groups_finished_members_together_in_one_call() -> None:
    async def main() -> tuple[list[str], list[EpisodeResult], dict[str, Any]]:
        prompts: list[str] = []

        async def ranks(request: web.Request) -> web.Response:
            body = await request.json()
            prompts.append(body["messages"][0]["content"])
            reply = "1: 9\n2: 3\nAnswer 3: 10" if len(prompts) == 1 else "1: 4\n2: x"
            return web.json_response({"choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant", "content": reply}}]})

        runner, url = await stand_in_endpoint(ranks)
        stage = ScoringStage(
            ScoringConfig(env_weight=0.0, judge=JudgeConfig(url=url, model="j", mode="group")), group_size=4
        )
        group = [finished_episode("g1") for _ in range(4)]
        for ep, answer in zip(group, ("fourty-two", "41", "42", "43"), strict=True):
            ep.answer = answer
        group[1].fail("environment", "EnvironmentError: boom")  # not graded, but its group waits for it
        await asyncio.gather(*(stage(TASK, ep, 4) for ep in group))
        unparsable = [finished_episode("g2") for _ in range(2)]
        await asyncio.gather(*(stage(TASK, ep, 2) for ep in unparsable))
        await stage.close()
        await runner.cleanup()
        return prompts, group + unparsable, stage.status()

    prompts, episodes, status = asyncio.run(main())
    assert len(prompts) == 2  # one call per group
    assert "Answer 1:\nfourty-two" in prompts[0] and "Answer 2:\n42" in prompts[0] and "41" not in prompts[0]
    assert [e.reward for e in (episodes[0], episodes[2], episodes[3])] == pytest.approx([0.9, 0.3, 1.0])
    assert episodes[1].error_kind == "environment"  # untouched
    for ep in episodes[4:]:
        assert ep.error_kind == "scoring" and "for each of the 2 answers" in ep.error, ep.error
    assert status["scored"] == 3 and status["failed"] == 2 and status["waiting_for_group"] == 0


def test_a_group_judge_grades_the_members_present_when_the_rest_never_come() -> None:
    async def main() -> list[EpisodeResult]:
        async def ranks(request: web.Request) -> web.Response:
            return web.json_response(
                {
                    "choices": [
                        {
                            "index": 0, "message": {"role": "assistant", "content": "1: 5\n2: 6"},
                            "finish_reason": "stop",
                        }
                    ]
                }
            )

        runner, url = await stand_in_endpoint(ranks)
        stage = ScoringStage(ScoringConfig(env_weight=0.0, group_wait_s=0.3,
                                           judge=JudgeConfig(url=url, model="j", mode="group")), group_size=3)
        present = [finished_episode("g3") for _ in range(2)]
        await asyncio.gather(*(stage(TASK, ep) for ep in present))  # the third member never finishes
        await stage.close()
        await runner.cleanup()
        return present

    assert [e.reward for e in asyncio.run(main())] == pytest.approx([0.5, 0.6])


def test_serves_metrics_carry_each_scorers_calls_failures_seconds_and_rewards() -> None:
    from agentrl.serve.app import prometheus_series

    status = {
        "rollout": {
            "in_flight": 3, "episodes": 10, "failed": 1, "backing_off": False,
            "scoring": {
                "scored": 9, "failed": 1, "timeouts": 1, "waiting": 0, "scoring": 2, "outage": 0,
                "waiting_for_group": 0,
                "scorers": {
                    "judge": {"calls": 10, "failures": 1, "seconds": 20.5, "reward_sum": 6.0},
                    'odd"name': {"calls": 1, "failures": 0, "seconds": 0.1, "reward_sum": 0.5},
                },
            },
        },
        "buffer": {"depth": 4, "identity_holds": True, "dropped_by_reason": {"stale": 2}},
        "teacher": {"version": 3, "lag": 1},
    }
    series = prometheus_series(status)
    assert series["scoring_scored_total"] == 9 and series["scoring_timeouts_total"] == 1
    assert series['scoring_calls_total{scorer="judge"}'] == 10
    assert series['scoring_failures_total{scorer="judge"}'] == 1
    assert series['scoring_seconds_total{scorer="judge"}'] == 20.5
    assert series['scoring_reward_sum{scorer="judge"}'] == 6.0
    # a label value escaped as Prometheus reads it
    assert series['scoring_calls_total{scorer="odd\\"name"}'] == 1
    assert series["rollout_episodes_total"] == 10 and series["rollout_in_flight"] == 3
    assert series["buffer_depth"] == 4 and "buffer_identity_holds" not in series  # numbers only
    assert series["teacher_version"] == 3
    assert not any("backing_off" in k for k in series)


def test_a_judge_on_serves_own_engine_is_asked_there_with_its_key_and_serves_model() -> None:
    async def main() -> tuple[list[tuple[str, dict[str, Any]]], EpisodeResult]:
        seen: list[tuple[str, dict[str, Any]]] = []

        async def grades(request: web.Request) -> web.Response:
            seen.append((request.headers.get("Authorization", ""), await request.json()))
            return web.json_response(
                {
                    "choices": [
                        {
                            "index": 0, "message": {"role": "assistant", "content": "9"},
                            "finish_reason": "stop",
                        }
                    ]
                }
            )

        runner, url = await stand_in_endpoint(grades)
        stage = ScoringStage(
            ScoringConfig(judge=JudgeConfig(engine=True)), judge_endpoint=(url, "engine-key", "tiny")
        )
        ep = finished_episode()
        try:
            await stage(TASK, ep)
        finally:
            await stage.close()
            await runner.cleanup()
        return seen, ep

    seen, ep = asyncio.run(main())
    assert [(auth, body["model"]) for auth, body in seen] == [("Bearer engine-key", "tiny")]
    assert ep.info["rewards"] == {"env": 1.0, "judge": pytest.approx(0.9)}
    with pytest.raises(ConfigError, match="scoring.judge.engine"):
        ScoringStage(ScoringConfig(judge=JudgeConfig(engine=True)))  # outside serve: no engine to name
    cfg = ServeConfig()
    cfg.scoring.judge.engine, cfg.scoring.judge.url, cfg.scoring.judge.model = (
        True, "http://127.0.0.1:1/v1", "j",
    )
    with pytest.raises(ConfigError, match="exclude each other"):
        cfg.check()
    cfg.scoring.judge.url, cfg.ray.address = "", "auto"
    with pytest.raises(ConfigError, match="serve --ray"):
        cfg.check()
