"""gymnasium both ways: agentrl environments as gymnasium.Env, text gymnasium envs as agentrl environments."""

from __future__ import annotations

import asyncio
import string
import uuid
from typing import Any

import gymnasium
import pytest
from gymnasium import spaces
from gymnasium.utils.env_checker import check_env

import agentrl
from agentrl.env.gym import GymAdapter, GymEnv, TextSpace, register_gym
from agentrl.env.registry import unregister

WORDS = ["agent", "token", "reward", "policy", "sandbox"]


class ReverseWord(gymnasium.Env):
    """A text gymnasium env: type the shown word backwards; three tries."""

    def __init__(self) -> None:
        self.observation_space = spaces.Text(64, charset=string.printable)
        self.action_space = spaces.Text(64, charset=string.printable)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.word = WORDS[int(self.np_random.integers(len(WORDS)))]
        self.tries = 0
        return f"Reverse: {self.word}", {"length": len(self.word)}

    def step(self, action: str):
        self.tries += 1
        if action.strip() == self.word[::-1]:
            return "yes", 1.0, True, False, {"tries": self.tries}
        return "no, try again", 0.0, False, self.tries >= 3, {"tries": self.tries, "not_json": object()}


def test_an_agentrl_environment_is_a_valid_gymnasium_env_with_text_spaces() -> None:
    env = GymEnv("guess_number")
    assert isinstance(env.observation_space, TextSpace) and isinstance(env.action_space, TextSpace)
    check_env(env, skip_render_check=True)  # gymnasium's own checker: spaces, seeding, determinism
    env.close()


def test_the_gymnasium_wrapper_plays_guess_the_number_to_the_end() -> None:
    env = GymEnv("guess_number", render_mode="ansi")
    obs, info = env.reset(seed=3)
    assert "Guess the secret number" in obs and info["task"]["id"] == "train-3"
    assert obs == env.reset(seed=3)[0]  # a seed names a task
    low, high, total, steps = 1, 100, 0.0, 0
    while True:
        guess = (low + high) // 2
        obs, reward, terminated, truncated, info = env.step(str(guess))
        total, steps = total + reward, steps + 1
        if terminated or truncated:
            break
        low, high = (guess + 1, high) if "Higher" in obs else (low, guess - 1)
    assert terminated and not truncated and total == 1.0 and guess == info["secret"] and steps <= 7
    assert "[assistant]\n50" in env.render()
    env.close()


class Lookup(agentrl.ToolEnv):
    def tasks(self, split: str = "train"):
        return [{"id": "t0", "question": "What is the code word?", "answer": "swordfish"}]

    @agentrl.tool
    def secret(self, n: int) -> str:
        """Reveal the n-th code word."""
        return ["swordfish", "marlin"][n]

    async def reward(self, task: dict[str, Any], answer: str) -> float:
        return float(task["answer"] in answer)


def test_the_wrapper_turns_text_tool_calls_into_tool_results_and_exposes_tools() -> None:
    env = GymEnv(Lookup())
    obs, info = env.reset()
    assert obs == "[user]\nWhat is the code word?"
    assert info["tools"][0]["function"]["name"] == "secret"
    obs, reward, terminated, truncated, info = env.step('<tool_call>\n'
                                                        '{"name": "secret", "arguments": {"n": 0}}\n'
                                                        '</tool_call>')
    assert obs == "[tool]\nswordfish" and not terminated and info["tool_calls"] == 1
    obs, reward, terminated, truncated, info = env.step('<tool_call>{"name": "secret", '
                                                        '"arguments": {"n": "zero"}}</tool_call>')
    assert "wrong type" in obs and info["tool_errors"] == {"bad_arguments": 1}
    obs, reward, terminated, truncated, info = env.step("It is swordfish.")
    assert (reward, terminated, truncated) == (1.0, True, False)
    env.close()


def test_a_text_gymnasium_env_runs_as_an_agentrl_environment() -> None:
    async def body() -> None:
        env = GymAdapter(ReverseWord(), system_prompt="Play.")
        task = next(iter(env.tasks("train")))
        opening = await env.reset(task)
        assert opening.messages[0] == {"role": "system", "content": "Play."}
        word = opening.messages[1]["content"].removeprefix("Reverse: ")
        miss = await env.step({"role": "assistant", "content": "nope"})
        assert miss.messages == [{"role": "user", "content": "no, try again"}] and miss.reward == 0.0
        assert miss.info == {"tries": 1}  # what cannot become JSON is dropped from info
        hit = await env.step({"role": "assistant", "content": word[::-1]})
        assert (hit.reward, hit.terminated, hit.messages) == (1.0, True, [])
        await env.close()
    asyncio.run(body())


def test_a_registered_gymnasium_id_becomes_an_agentrl_name_and_truncation_passes_through() -> None:
    gym_id = f"agentrl-test/Reverse-{uuid.uuid4().hex[:6]}-v0"
    gymnasium.register(id=gym_id, entry_point=ReverseWord)
    name = f"reverse_{uuid.uuid4().hex[:6]}"
    register_gym(name, gym_id, system_prompt="Reverse the word.", num_test=3, in_thread=True)

    async def body() -> None:
        env = agentrl.make(name)
        assert [t["seed"] for t in env.tasks("test")] == [1 << 30, (1 << 30) + 1, (1 << 30) + 2]
        await env.reset({"id": "x", "seed": 7})
        results = [await env.step({"role": "assistant", "content": "wrong"}) for _ in range(3)]
        assert [r.truncated for r in results] == [False, False, True]
        await env.close()
    asyncio.run(body())
    unregister(name)


def test_both_directions_compose_back_to_the_original_game() -> None:
    direct = ReverseWord()
    obs_direct, _ = direct.reset(seed=11)
    wrapped = GymEnv(GymAdapter(ReverseWord()), tasks=[{"id": "a", "seed": 11}])
    obs, _ = wrapped.reset()
    assert obs == f"[user]\n{obs_direct}"
    word = obs_direct.removeprefix("Reverse: ")
    _, reward, terminated, truncated, _ = wrapped.step(word[::-1])
    assert (reward, terminated, truncated) == (1.0, True, False)
    wrapped.close()


def test_a_gymnasium_env_without_text_actions_needs_a_conversion() -> None:
    class Discrete(ReverseWord):
        def __init__(self) -> None:
            super().__init__()
            self.action_space = spaces.Discrete(3)

    with pytest.raises(TypeError, match="text_to_action"):
        GymAdapter(Discrete())
    assert GymAdapter(Discrete(), text_to_action=int).text_to_action("2") == 2


def test_a_sandboxed_environment_in_the_wrapper_asks_for_a_sandbox_config() -> None:
    env = GymEnv("arithmetic")
    with pytest.raises(ValueError, match="sandbox_config"):
        env.reset()
    env.close()
