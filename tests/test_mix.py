"""Several environments in one run (``mix``) and a teacher chosen per environment
(``scoring.teachers``): tasks interleaved by weight and tagged, each episode played by its own
environment's rules with its own sandbox or none, and each scored by its environment's teacher.
The teachers here are real HTTP servers speaking vLLM's completions shape (helpers of this unit
test); ``tests/test_mix_vllm.py`` runs serve on a mix with a real vLLM teacher."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import Counter
from typing import Any

import pytest
from aiohttp import web

import agentrl
from agentrl.config import ServeConfig, load
from agentrl.config.loader import build, to_dict, to_toml
from agentrl.env import make
from agentrl.env.base import PlayingEnv
from agentrl.env.registry import sandbox_image_of, unregister
from agentrl.errors import ConfigError
from agentrl.rollout.episode import EnvironmentFailure
from agentrl.sandbox.attach import attached
from agentrl.scoring import ScoringConfig, ScoringStage
from agentrl.scoring.config import TeacherConfig
from environments.mix import interleave
from tests.scoring_helpers import finished_episode, stand_in_endpoint

MIX = {
    "envs": {"arithmetic": {}, "guess_number": {"high": 8}},
    "weights": {"arithmetic": 3, "guess_number": 1},
}


def test_interleaving_gives_each_stream_its_share_in_every_stretch_and_goes_on_when_one_runs_out() -> None:
    drawn = [
        name for name, _ in interleave({"a": iter(range(100)), "b": iter(range(5))}, {"a": 3.0, "b": 1.0})
    ]
    assert Counter(drawn[:20]) == {"a": 15, "b": 5}
    assert all(Counter(drawn[i:i + 4]) == {"a": 3, "b": 1} for i in range(0, 20, 4))
    assert Counter(drawn) == {"a": 100, "b": 5}  # b ran out: a alone to its end


def test_a_mix_tags_each_task_with_its_environment_in_proportion_to_the_weights() -> None:
    mix = make("mix", **MIX)
    train = list(itertools.islice(mix.tasks("train"), 40))
    assert Counter(t["mix_env"] for t in train) == {"arithmetic": 30, "guess_number": 10}
    test = list(itertools.islice(mix.tasks("test"), 8))
    assert Counter(t["mix_env"] for t in test) == {"arithmetic": 6, "guess_number": 2}
    guess = next(t for t in train if t["mix_env"] == "guess_number")
    own = next(iter(make("guess_number", high=8).tasks("train")))
    assert {k: v for k, v in guess.items() if k != "mix_env"} == own  # the environment's own task, tagged


def test_an_episode_of_a_mix_is_played_by_its_tasks_environment_and_says_which() -> None:
    mix = make("mix", **MIX)
    task = next(t for t in mix.tasks("train") if t["mix_env"] == "guess_number")

    async def play() -> tuple[Any, Any]:
        opening = await mix.reset(task)
        wrong = await mix.step({"role": "assistant", "content": str(task["secret"] % 8 + 1)})
        right = await mix.step({"role": "assistant", "content": str(task["secret"])})
        await mix.close()
        return opening, (wrong, right)

    opening, (wrong, right) = asyncio.run(play())
    assert "integer from 1 to 8" in opening.messages[-1]["content"]  # guess_number's opening, with its config
    assert not wrong.terminated and right.terminated and right.reward > 0
    assert right.info["mix_env"] == "guess_number" and wrong.info["mix_env"] == "guess_number"
    with pytest.raises(ValueError, match="names no environment of this mix"):
        asyncio.run(make("mix", **MIX).reset({"id": "x", "mix_env": "shell"}))


def test_a_mix_batchs_reward_is_given_per_environment_from_its_samples() -> None:
    from agentrl.buffer.sample import Sample
    from agentrl.learner.step import reward_by_env

    def sample(env: str | None, reward: float) -> Sample:
        return Sample([1], [0], [0.0], [0], episode_id="e", group_id="g", env="mix", reward=reward,
                      info={"mix_env": env} if env else {})

    batch = [sample("guess_number", 1.0), sample("arithmetic", 0.0), sample("guess_number", 0.0),
             sample("arithmetic", 1.0), sample("arithmetic", 1.0)]
    assert reward_by_env(batch) == {"arithmetic": pytest.approx(2 / 3), "guess_number": 0.5}
    assert reward_by_env([sample(None, 1.0)]) == {}  # one environment: no breakdown


def test_a_mix_episode_gets_a_sandbox_of_its_environments_image_or_none() -> None:
    assert sandbox_image_of("mix", MIX) == "agentrl/base:bookworm"  # arithmetic's: serve keeps that pool
    assert sandbox_image_of("mix", {"envs": {"guess_number": {}, "straggler": {}}}) is None
    mix = make("mix", **MIX)
    tasks = list(itertools.islice(mix.tasks("train"), 4))
    guess = next(t for t in tasks if t["mix_env"] == "guess_number")
    arith = next(t for t in tasks if t["mix_env"] == "arithmetic")

    async def attach(task: dict[str, Any]) -> Any:
        async with attached(mix, None, task) as env:
            return env.sandbox

    assert asyncio.run(attach(guess)) is None  # no pool needed: guess_number takes no sandbox
    with pytest.raises(EnvironmentFailure, match="agentrl/base:bookworm"):
        asyncio.run(attach(arith))  # arithmetic's episode asks the pool for its image


def test_a_mix_refuses_what_it_cannot_play() -> None:
    @agentrl.environment("unit-playing")
    class Playing(PlayingEnv):
        def tasks(self, split: str = "train") -> list[dict[str, Any]]:
            return [{"id": "p"}]

        async def reset(self, task: dict[str, Any]) -> agentrl.Reset:
            return agentrl.Reset(messages=[])

        async def play(self, task: dict[str, Any], model: Any) -> Any:
            raise AssertionError

    try:
        with pytest.raises(ConfigError, match="plays its own episodes"):
            make("mix", envs={"guess_number": {}, "unit-playing": {}})
    finally:
        unregister("unit-playing")
    with pytest.raises(ConfigError, match="names its environments"):
        make("mix")
    with pytest.raises(ConfigError, match="another mix"):
        make("mix", envs={"mix": {}})
    with pytest.raises(ConfigError, match=r"weights name \['shell'\]"):
        make("mix", envs={"guess_number": {}}, weights={"shell": 1})
    with pytest.raises(ConfigError, match="positive"):
        make("mix", envs={"guess_number": {}}, weights={"guess_number": 0})


def _logprob_of(scale: float) -> Any:
    return lambda token: -scale * token


async def _teacher(scale: float) -> tuple[web.AppRunner, str, list[dict[str, Any]]]:
    """vLLM's /v1/completions with prompt logprobs, each prompt token's -scale x token."""
    bodies: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        bodies.append(body)
        rows = [None] + [{str(t): {"logprob": -scale * t, "rank": 1}} for t in body["prompt"][1:]]
        return web.json_response({"choices": [{"text": "x", "prompt_logprobs": rows}]})

    runner, url = await stand_in_endpoint(completions, "/v1/completions")
    return runner, url, bodies


def test_each_environment_of_a_mix_is_scored_by_its_own_teacher_and_the_rest_by_the_runs() -> None:
    async def main() -> tuple[dict[str, Any], list[list[dict[str, Any]]], dict[str, Any]]:
        servers = [await _teacher(scale) for scale in (0.125, 0.25, 0.5)]
        (_, arith_url, _), (_, guess_url, _), (_, default_url, _) = servers
        cfg = ScoringConfig(
            teacher=TeacherConfig(url=default_url, model="d", name="default"),
            timeout_s=30,
            teachers={
                "arithmetic": TeacherConfig(url=arith_url, model="a", name="arith", weight=1.0),
                "guess_number": TeacherConfig(url=guess_url, model="g", name="guess"),
            },
        )
        stage = ScoringStage(cfg, env_name="mix")
        eps = {}
        try:
            for env in ("arithmetic", "guess_number", "straggler"):
                eps[env] = finished_episode(reward=1.0)
                await stage({"id": "t", "mix_env": env}, eps[env])
        finally:
            await stage.close()
            for runner, *_ in servers:
                await runner.cleanup()
        return eps, [bodies for *_, bodies in servers], stage.status()

    eps, bodies, status = asyncio.run(main())
    # one call each, its own
    assert [[b["model"] for b in calls] for calls in bodies] == [["a"], ["g"], ["d"]]
    for env, name, scale in (("arithmetic", "arith", 0.125), ("guess_number", "guess", 0.25),
                             ("straggler", "default", 0.5)):
        (s,) = eps[env].samples  # tokens [1, 2, 3], mask [0, 1, 1], behaviour logprobs [0, -0.5, -0.1]
        assert s.info["teacher"] == {"name": name}
        assert math.isnan(s.teacher_logprobs[0]) and s.teacher_logprobs[1:].tolist() == [
            -scale * 2,
            -scale * 3,
        ]
    kl = ((-0.5 + 0.25) + (-0.1 + 0.375)) / 2
    assert set(eps["arithmetic"].samples[0].info["rewards"]) == {"env", "teacher:arithmetic"}
    assert eps["arithmetic"].reward == pytest.approx(1.0 + kl)  # that teacher's own weight, 1
    assert set(eps["straggler"].samples[0].info["rewards"]) == {"env", "teacher"}
    assert eps["guess_number"].reward == 1.0 and eps["straggler"].reward == 1.0  # weight 0
    assert {n: s["calls"] for n, s in status["scorers"].items()} == {"teacher": 1, "teacher:arithmetic": 1,
                                                                     "teacher:guess_number": 1}


def test_a_run_of_one_environment_uses_the_teacher_named_for_it() -> None:
    async def main() -> dict[str, Any]:
        runner, url, bodies = await _teacher(0.125)
        stage = ScoringStage(
            ScoringConfig(teachers={"guess_number": TeacherConfig(url=url, model="g")}, timeout_s=30),
            env_name="guess_number",
        )
        ep = finished_episode()
        try:
            await stage({"id": "t"}, ep)
        finally:
            await stage.close()
            await runner.cleanup()
        return {"calls": len(bodies), "rewards": ep.samples[0].info["rewards"]}

    out = asyncio.run(main())
    assert out["calls"] == 1 and set(out["rewards"]) == {"env", "teacher:guess_number"}


def test_teachers_per_environment_are_settings_with_their_own_checks() -> None:
    cfg = load(
        ServeConfig,
        overrides=[
            "env.name=mix",
            "scoring.teachers.guess_number.url=http://127.0.0.1:9/v1",
            "scoring.teachers.guess_number.model=g",
            "scoring.teachers.guess_number.weight=0.5",
        ],
    )
    assert cfg.scoring.teachers == {
        "guess_number": TeacherConfig(url="http://127.0.0.1:9/v1", model="g", weight=0.5)
    }
    assert build(ServeConfig, to_dict(cfg)) == cfg  # and back, through files
    assert "[scoring]" in to_toml(cfg) and 'guess_number = {url = "http://127.0.0.1:9/v1"' in to_toml(cfg)
    with pytest.raises(ConfigError, match="scoring.teachers.guess_number needs a url and a model"):
        load(ServeConfig, overrides=["scoring.teachers.guess_number.model=g"])
    with pytest.raises(ConfigError, match="unknown setting scoring.teachers.guess_number.urll"):
        load(ServeConfig, overrides=["scoring.teachers.guess_number.urll=x"])
    with pytest.raises(ConfigError, match="one run's teachers keep the same top-k"):
        load(
            ServeConfig,
            overrides=[
                "scoring.teachers.g.url=http://127.0.0.1:9/v1",
                "scoring.teachers.g.model=g",
                "scoring.teachers.g.top_k=4",
            ],
        )
