"""The teacher scorer (on-policy distillation): a teacher's logprobs of the student's sampled
tokens land on the samples, on the generated positions only; a teacher that answers badly or not
at all fails the episode (kind ``scoring``) instead of training it without the teacher. The
teacher here is a real HTTP server speaking vLLM's completions shape (a helper of this unit test);
``tests/test_scoring_vllm.py`` holds the real vLLM teacher."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from agentrl.errors import ConfigError
from agentrl.scoring import ScoringConfig, ScoringStage
from agentrl.scoring.config import TeacherConfig
from tests.conftest import free_port
from tests.scoring_helpers import TASK, finished_episode, stand_in_endpoint


def _logprob(token: int) -> float:
    return -0.125 * token


async def _teacher_server(drop: int | None = None,
                          short: int | None = None) -> tuple[web.AppRunner, str, list[dict[str, Any]]]:
    """vLLM's /v1/completions with prompt_logprobs: the logprob of each prompt token (-token/8);
    ``drop``: a position whose entry is missing (a broken teacher); ``short``: a position with the
    token there alone, at rank 1 (short of a top-k above 1)."""
    bodies: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        bodies.append(body)
        ids = body["prompt"]
        k = body["prompt_logprobs"]
        rows: list[Any] = [None] + [{str(t): {"logprob": _logprob(t), "rank": 1 if not k else k + 5,
                                              "decoded_token": "x"}} for t in ids[1:]]
        for row in rows[1:]:  # top-k: tokens 100, 101, ... ranked first, the token there below them
            row.update({str(100 + j): {"logprob": -0.5 * (j + 1), "rank": j + 1} for j in range(k)})
        if drop is not None:
            rows[drop] = {"7": {"logprob": -1.0, "rank": 1}}
        if short is not None:
            rows[short] = {str(ids[short]): {"logprob": -1.0, "rank": 1}}
        return web.json_response({"choices": [{"text": "x", "prompt_logprobs": rows}]})

    runner, url = await stand_in_endpoint(completions, "/v1/completions")
    return runner, url, bodies


def _scored(
    drop: int | None = None, short: int | None = None, **cfg: Any
) -> tuple[Any, list[dict[str, Any]], dict[str, Any]]:
    async def main() -> tuple[Any, list[dict[str, Any]], dict[str, Any]]:
        runner, url, bodies = await _teacher_server(drop, short)
        stage = ScoringStage(
            ScoringConfig(teacher=TeacherConfig(url=url, model="teacher-m", **cfg), timeout_s=30)
        )
        ep = finished_episode(reward=1.0)
        try:
            await stage(TASK, ep)
        finally:
            await stage.close()
            await runner.cleanup()
        return ep, bodies, stage.status()

    return asyncio.run(main())


def test_the_teachers_logprobs_of_the_generated_tokens_land_on_the_sample() -> None:
    ep, bodies, status = _scored(name="tiny-agent")
    (s,) = ep.samples  # tokens [1, 2, 3], mask [0, 1, 1], behaviour logprobs [0, -0.5, -0.1]
    assert bodies == [{"model": "teacher-m", "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0.0,
                       "prompt_logprobs": 0}]  # the sample's exact ids, one forward pass
    assert math.isnan(s.teacher_logprobs[0])
    assert s.teacher_logprobs[1:].tolist() == [_logprob(2), _logprob(3)]
    assert s.info["teacher"] == {"name": "tiny-agent"}
    kl = np.mean([-0.5 - _logprob(2), -0.1 - _logprob(3)])
    assert s.info["rewards"]["teacher"] == pytest.approx(kl)  # the episode's reverse-KL estimate, by name
    assert ep.reward == 1.0 and s.reward == 1.0  # weight 0: the reward is the environment's
    assert status["scored"] == 1 and status["scorers"]["teacher"]["calls"] == 1


def test_the_teachers_top_k_land_on_the_generated_positions_in_rank_order() -> None:
    ep, bodies, _ = _scored(top_k=2)
    (s,) = ep.samples  # tokens [1, 2, 3], mask [0, 1, 1]
    assert bodies[0]["prompt_logprobs"] == 2
    assert s.teacher_topk_ids.tolist() == [[-1, -1], [100, 101], [100, 101]]
    assert (
        np.isnan(s.teacher_topk_logprobs[0]).all()
        and s.teacher_topk_logprobs[1:].tolist() == [[-0.5, -1.0]] * 2
    )
    assert s.teacher_logprobs[1:].tolist() == [_logprob(2), _logprob(3)]  # the sampled tokens' as before
    assert ep.error is None


def test_a_teacher_reply_short_of_its_top_k_fails_the_episode() -> None:
    ep, _, status = _scored(short=2, top_k=2)  # position 2 holds its own token alone, of rank 1
    assert ep.error_kind == "scoring" and "1 of the top 2 prompt logprobs at position 2" in ep.error, ep.error
    assert ep.samples[0].teacher_topk_ids is None
    assert status["failed"] == 1
    with pytest.raises(ConfigError, match="top_k"):
        ScoringConfig(teacher=TeacherConfig(url="http://127.0.0.1:1/v1", model="m", top_k=21)).check()


def test_a_teacher_reply_without_a_tokens_logprob_fails_the_episode() -> None:
    ep, _, status = _scored(drop=2)
    assert ep.error_kind == "scoring" and "no logprob of token 3 at position 2" in ep.error, ep.error
    assert status["failed"] == 1


def test_a_teacher_that_is_down_fails_the_episode_as_an_outage() -> None:
    async def main() -> tuple[Any, ScoringStage]:
        stage = ScoringStage(ScoringConfig(teacher=TeacherConfig(url=f"http://127.0.0.1:{free_port()}/v1",
                                                                 model="t"), retries=1, timeout_s=30))
        ep = finished_episode()
        await stage(TASK, ep)
        await stage.close()
        return ep, stage

    ep, stage = asyncio.run(main())
    assert ep.error_kind == "scoring" and "teacher" in ep.error and stage.outage == 1


def test_a_teacher_needs_its_model_named() -> None:
    with pytest.raises(ConfigError, match="scoring.teacher.model"):
        ScoringConfig(teacher=TeacherConfig(url="http://127.0.0.1:1/v1")).check()
