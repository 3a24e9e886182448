"""The built-in agent loop (run_episode) with a scripted stand-in for the router.

The stand-in answers like Router.chat and records sessions like the real one, so these tests
exercise the loop's control flow: termination, truncation, failures recorded as data.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

import agentrl
from agentrl.rollout import EpisodeLimits, run_episode
from agentrl.router.sessions import CallRecord, Completion, Session


class ScriptedRouter:
    """Replies with the next scripted assistant message; records exact-token calls per session."""

    model_name = "scripted"

    def __init__(self, replies: list[dict[str, Any]]) -> None:
        self.replies = list(replies)
        self.sessions: dict[str, Session] = {}

    def open_session(self, sid: str, **meta: Any) -> Session:
        return self.sessions.setdefault(sid, Session(sid, meta=meta))

    def close_session(self, sid: str) -> Session | None:
        return self.sessions.pop(sid, None)

    async def begin(self, sid: str, *, limits: Any = None, **meta: Any) -> None:
        self.open_session(sid, **meta)

    async def end(self, sid: str) -> Any:
        session = self.close_session(sid)
        return None if session is None else session.summary()

    async def chat(self, body: dict[str, Any], session_id: str) -> dict[str, Any]:
        message = self.replies.pop(0)
        s = self.sessions[session_id]
        ids = [7, 8, 9]
        prompt = (
            [1, 2, 3]
            if not s.records
            else s.records[-1].prompt_ids + s.records[-1].completions[0].token_ids + [4]
        )
        s.record(CallRecord(session_id, len(s.records), len(s.records) - 1 if s.records else None, 0, prompt,
                            [Completion(ids, [-1.0] * 3, [0] * 3, "stop", message)], engine="scripted"))
        return {"choices": [{"message": message, "finish_reason": "stop", "token_ids": ids}],
                "agentrl": {"versions": [[0, 0, 0]]}}


@agentrl.environment("test-echo")
class EchoEnv(agentrl.ToolEnv):
    max_turns = 3

    def tasks(self, split: str = "train"):
        yield {"id": "t0", "question": "say 42", "answer": "42"}

    @agentrl.tool
    async def shout(self, text: str) -> str:
        """Return the text in capitals.

        Args:
            text: what to shout.
        """
        return text.upper()

    async def reward(self, task: dict[str, Any], answer: str) -> float:
        return float(task["answer"] in answer)


@agentrl.environment("test-broken")
class BrokenEnv(EchoEnv):
    async def step(self, message: dict[str, Any]) -> agentrl.StepResult:
        raise RuntimeError("the environment has a bug")


def _call(name: str, args: str) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": name, "arguments": args}}]}


def test_an_episode_with_a_tool_call_and_an_answer_is_one_rewarded_sample():
    router = ScriptedRouter([_call("shout", '{"text": "hi"}'), {"role": "assistant", "content": "42"}])
    ep = asyncio.run(
        run_episode(router, "test-echo", {"id": "t0", "question": "q", "answer": "42"}, group_id="g")
    )
    assert ep.error is None and ep.terminated and not ep.truncated
    assert ep.reward == 1.0 and ep.turns == 2 and ep.info["tool_calls"] == 1
    (sample,) = ep.samples
    assert sample.reward == 1.0 and sample.group_id == "g"
    assert sum(sample.loss_mask) == 6  # two completions of three tokens, nothing else


def test_episode_samples_are_compact_arrays_equal_to_the_session_lists():
    router = ScriptedRouter([_call("shout", '{"text": "hi"}'), {"role": "assistant", "content": "42"}])
    sessions: list[Session] = []
    close = router.close_session
    router.close_session = lambda sid: sessions.append(close(sid)) or sessions[-1]  # type: ignore[method-assign]
    ep = asyncio.run(
        run_episode(router, "test-echo", {"id": "t0", "question": "q", "answer": "42"}, group_id="g")
    )
    (sample,) = ep.samples
    (lists,) = sessions[0].samples()
    assert sample.token_ids.dtype == np.int32 and sample.loss_mask.dtype == np.int32
    assert sample.versions.dtype == np.int32 and sample.logprobs.dtype == np.float32
    assert (
        sample.token_ids.tolist() == lists.token_ids.tolist()
        and sample.loss_mask.tolist() == lists.loss_mask.tolist()
    )
    assert (
        sample.logprobs.tolist() == lists.logprobs.tolist()
        and sample.versions.tolist() == lists.versions.tolist()
    )
    assert lists.loss_mask.tolist() == [0, 0, 0, 1, 1, 1, 0, 1, 1, 1] and sample.min_version == 0


def test_an_environment_that_raises_produces_a_failed_episode_not_an_exception():
    router = ScriptedRouter([{"role": "assistant", "content": "42"}])
    ep = asyncio.run(
        run_episode(router, "test-broken", {"id": "t0", "question": "q", "answer": "42"}, group_id="g")
    )
    assert ep.error is not None and ep.error.startswith("EnvironmentError")
    assert "the environment has a bug" in ep.error
    assert ep.samples and all(s.error == ep.error for s in ep.samples)


def test_bad_tool_calls_become_error_messages_and_are_counted():
    router = ScriptedRouter([_call("shout", "{not json"), _call("nope", "{}"), _call("shout", '{"text": 5}')])
    ep = asyncio.run(
        run_episode(router, "test-echo", {"id": "t0", "question": "q", "answer": "42"}, group_id="g")
    )
    assert ep.error is None
    assert ep.truncated and ep.truncation == "env"
    assert ep.info["tool_errors"] == {"bad_json": 1, "unknown_tool": 1, "bad_arguments": 1}


def test_the_turn_limit_truncates_an_episode_and_keeps_its_data():
    router = ScriptedRouter([_call("shout", '{"text": "a"}')] * 5)
    ep = asyncio.run(
        run_episode(
            router,
            "test-echo",
            {"id": "t0", "question": "q", "answer": "42"},
            group_id="g",
            limits=EpisodeLimits(max_turns=2),
        )
    )
    assert ep.truncated and ep.truncation == "max_turns" and ep.turns == 2
    assert len(ep.samples[0].token_ids) and ep.samples[0].truncated


def test_an_episode_past_its_wall_clock_limit_is_truncated():
    class SlowRouter(ScriptedRouter):
        async def chat(self, body: dict[str, Any], session_id: str) -> dict[str, Any]:
            await asyncio.sleep(10)
            raise AssertionError("unreachable")

    ep = asyncio.run(run_episode(SlowRouter([]), "test-echo", {"id": "t0", "question": "q", "answer": "42"},
                                 group_id="g", limits=EpisodeLimits(episode_timeout_s=0.2)))
    assert ep.truncated and ep.truncation == "timeout" and ep.error is None
    assert ep.samples and ep.samples[0].error == "NoModelCall"
