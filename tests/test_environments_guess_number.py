"""guess_number: feedback, per-turn and per-episode rewards, truncation, with a scripted player."""

from __future__ import annotations

import asyncio

import agentrl


def play(replies: list[str], task: dict | None = None, **config) -> list[agentrl.StepResult]:
    async def body() -> list[agentrl.StepResult]:
        env = agentrl.make("guess_number", **config)
        t = task or next(iter(env.tasks("test")))
        await env.reset(t)
        out = []
        for text in replies:
            r = await env.step({"role": "assistant", "content": text})
            out.append(r)
            if r.terminated or r.truncated:
                break
        return out
    return asyncio.run(body())


def test_tasks_are_reproducible_and_test_secrets_come_from_other_seeds_than_training() -> None:
    env = agentrl.make("guess_number")
    train = [t["seed"] for t in env.tasks("train")]
    test = [t["seed"] for t in env.tasks("test")]
    assert len(train) == 10_000 and len(test) == 100 and not set(train) & set(test)
    assert list(env.tasks("test")) == list(env.tasks("test"))
    assert all(1 <= t["secret"] <= 100 for t in env.tasks("test"))


def test_binary_search_wins_with_full_reward_and_the_feedback_points_the_way() -> None:
    results = play(["50", "25", "12"], task={"id": "x", "secret": 12})
    assert [r.messages[0]["content"] for r in results] == ["Lower.", "Lower.", "Correct!"]
    assert results[-1].terminated and results[-1].reward == 1.0


def test_a_reply_without_a_number_costs_that_turn_and_wasted_guesses_cost_the_episode() -> None:
    replies = ["I think... hmm"] + [str(g) for g in range(1, 10)]
    results = play(replies, task={"id": "x", "secret": 9}, max_turns=20)
    assert results[0].reward == -0.1 and "integer" in results[0].messages[0]["content"]
    assert results[-1].terminated and results[-1].info["guesses"] == 9
    assert abs(results[-1].reward - 0.8) < 1e-9  # nine guesses where seven suffice


def test_running_out_of_turns_truncates_without_reward() -> None:
    results = play(["1", "2", "3"], task={"id": "x", "secret": 99}, max_turns=3)
    assert [r.truncated for r in results] == [False, False, True]
    assert sum(r.reward for r in results) == 0.0 and not results[-1].terminated
