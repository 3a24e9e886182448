"""Chat completions through the router against vLLM's own chat server, on the same requests.

The ``vllm_engine`` fixture's URL is vLLM's OpenAI server itself, so each test sends one request
to both and compares what a client sees. Greedy (temperature 0) or ``ignore_eos`` + ``max_tokens``
where the lengths matter; a test that needs a sampled behaviour (a leak that only some samples
showed) asserts a property that must hold on every sample.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests

from tests.conftest import PYTHON_TOOL
from tests.router_harness import serve_router

pytestmark = pytest.mark.vllm

TOOLS = [PYTHON_TOOL]
HI = [{"role": "user", "content": "hi"}]
# greedy, the tiny-tools model answers with a python call
ASK = [{"role": "user", "content": "What is 12*7?"}]


@pytest.fixture(scope="module")
def both(vllm_engine, tiny_tools_model):
    with serve_router([vllm_engine.url], tiny_tools_model) as srv:
        yield {"vllm": vllm_engine.url, "router": srv.url}


def _post(url: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> requests.Response:
    return requests.post(url + path, json={"model": "tiny-tools", **body}, timeout=120)


def _stream(url: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> list[dict[str, Any]]:
    out = []
    with requests.post(
        url + path, json={"model": "tiny-tools", **body, "stream": True}, stream=True, timeout=120
    ) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line[6:] != b"[DONE]":
                out.append(json.loads(line[6:]))
    return out


def _streamed(chunks: list[dict[str, Any]], index: int = 0) -> dict[str, Any]:
    """What a client assembles from a stream for one choice."""
    content, calls, lps, finish = "", {}, [], None
    for c in chunks:
        for ch in c.get("choices") or []:
            if ch["index"] != index:
                continue
            d = ch.get("delta") or {}
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                cur = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                cur["name"] += (tc.get("function") or {}).get("name") or ""
                cur["arguments"] += (tc.get("function") or {}).get("arguments") or ""
            lps += (ch.get("logprobs") or {}).get("content") or []
            finish = ch.get("finish_reason") or finish
    return {"content": content, "calls": [calls[k] for k in sorted(calls)], "logprobs": lps, "finish": finish}


def _lp(entries: list[dict[str, Any]]) -> list[tuple[str, float, list[str]]]:
    return [
        (e["token"], round(e["logprob"], 3), [t["token"] for t in e.get("top_logprobs") or []])
        for e in entries
    ]


def test_parsed_tool_calls_finish_with_tool_calls_as_on_vllm(both):
    got = {
        k: _post(u, {"messages": ASK, "tools": TOOLS, "max_tokens": 80, "temperature": 0}).json()["choices"][
            0
        ]
        for k, u in both.items()
    }
    assert got["vllm"]["finish_reason"] == got["router"]["finish_reason"] == "tool_calls"
    fn = [c["function"] for c in got["router"]["message"]["tool_calls"]]
    assert fn == [c["function"] for c in got["vllm"]["message"]["tool_calls"]]
    streamed = {
        k: _streamed(_stream(u, {"messages": ASK, "tools": TOOLS, "max_tokens": 80, "temperature": 0}))
        for k, u in both.items()
    }
    assert streamed["router"]["finish"] == streamed["vllm"]["finish"] == "tool_calls"
    assert streamed["router"]["calls"] == fn


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_a_sampled_eos_is_in_the_logprobs_as_on_vllm(both, max_tokens):
    body = {"messages": HI, "max_tokens": max_tokens, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    got = {k: _post(u, body).json() for k, u in both.items()}
    for out in got.values():  # greedy "hi" ends at once: the eos is the one sampled token
        assert len(out["choices"][0]["logprobs"]["content"]) == out["usage"]["completion_tokens"] == 1
    assert _lp(got["router"]["choices"][0]["logprobs"]["content"]) == _lp(
        got["vllm"]["choices"][0]["logprobs"]["content"]
    )
    assert (
        got["router"]["choices"][0]["message"]["content"] == got["vllm"]["choices"][0]["message"]["content"]
    )


def test_text_completions_show_the_eos_logprob_as_on_vllm(both):
    prompt = _post(both["vllm"], {"messages": HI}, "/v1/chat/completions/render").json()["token_ids"]
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 1}
    got = {k: _post(u, body, "/v1/completions").json() for k, u in both.items()}
    for out in got.values():
        assert len(out["choices"][0]["logprobs"]["tokens"]) == out["usage"]["completion_tokens"]
    assert (
        got["router"]["choices"][0]["logprobs"]["tokens"] == got["vllm"]["choices"][0]["logprobs"]["tokens"]
    )
    assert got["router"]["choices"][0]["text"] == got["vllm"]["choices"][0]["text"]


def test_streamed_chunks_carry_the_logprobs_vllm_sends(both):
    body = {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 6, "ignore_eos": True,
            "temperature": 0, "logprobs": True, "top_logprobs": 1}
    r, v = (_streamed(_stream(u, body)) for u in (both["router"], both["vllm"]))
    whole = _post(both["router"], body).json()["choices"][0]
    assert len(r["logprobs"]) == 6
    assert _lp(r["logprobs"]) == _lp(v["logprobs"]) == _lp(whole["logprobs"]["content"])
    assert r["content"] == v["content"] == whole["message"]["content"]


def test_streamed_chunks_of_two_choices_carry_every_tokens_logprob_as_on_vllm(both):
    # vLLM refuses n > 1 at temperature 0 (the router too): sampled, so each server's own tokens
    body = {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 6, "ignore_eos": True,
            "temperature": 1.0, "logprobs": True, "top_logprobs": 1, "n": 2}
    for url in both.values():
        chunks = _stream(url, body)
        for i in range(2):
            lps = _streamed(chunks, i)["logprobs"]
            assert len(lps) == 6
            assert all(set(e) >= {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 1
                       for e in lps)


def test_streams_open_with_a_role_chunk_per_choice_and_send_no_empty_chunks(both):
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 80, "temperature": 1.0, "n": 2}
    for url in both.values():
        chunks = _stream(url, body)
        firsts = [c["choices"][0] for c in chunks[:2]]
        assert [(f["index"], f["delta"]) for f in firsts] == [(0, {"role": "assistant", "content": ""}),
                                                             (1, {"role": "assistant", "content": ""})]
        for c in chunks[2:]:
            for ch in c["choices"]:  # a chunk carries text, a tool call or the finish, never nothing
                assert ch.get("finish_reason") or {k: v for k, v in ch["delta"].items() if v}, c
    chunks = _stream(both["router"] + "/sessions/roles", body)
    (rec,) = requests.get(both["router"] + "/sessions/roles/records",
                          headers={"Authorization": "Bearer sess-roles"}).json()["records"]
    for i in range(2):  # the skipped chunks' ids ride on the next one sent: together, the completion
        ids = [
            t for c in chunks for ch in c["choices"] if ch["index"] == i for t in ch.get("token_ids") or []
        ]
        assert ids == rec["completions"][i]["token_ids"]


def test_special_tokens_do_not_leak_into_text(both):
    body = {"messages": HI, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    got = {k: _post(u, body).json()["choices"][0]["message"]["content"] for k, u in both.items()}
    assert got["router"] == got["vllm"]
    assert "<|im_end|>" not in got["router"]
    assert _streamed(_stream(both["router"], body))["content"] == got["vllm"]


def test_sampled_tool_streams_never_carry_the_eos_text(both):
    # Sampled: some streams end inside a call, some after it; on every one the eos that ended
    # generation stays out of the content and the arguments, streamed or not.
    for i in range(12):
        body = {
            "messages": [{"role": "user", "content": f"What is {i}*7?"}],
            "tools": TOOLS,
            "max_tokens": 60,
            "temperature": 1.0,
        }
        s = _streamed(_stream(both["router"], body))
        assert "<|im_end|>" not in s["content"]
        for c in s["calls"]:
            assert "<|im_end|>" not in c["arguments"]
            json.loads(c["arguments"])  # a streamed call is always a whole, parsed call


def test_a_call_cut_off_by_max_tokens_streams_as_the_text_it_is(both):
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 10, "temperature": 0}
    vllm = _post(both["vllm"], body).json()["choices"][0]
    router = _post(both["router"], body).json()["choices"][0]
    assert (
        router["message"]["content"] == vllm["message"]["content"]
        and "<tool_call>" in vllm["message"]["content"]
    )
    assert not router["message"].get("tool_calls") and not vllm["message"].get("tool_calls")
    s = _streamed(_stream(both["router"], body))
    assert s["calls"] == [] and s["content"] == vllm["message"]["content"] and s["finish"] == "length"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_max_tokens_beyond_the_context_is_a_400_as_on_vllm(both, path):
    body = {"messages": HI} if "chat" in path else {"prompt": "hi"}
    for url in both.values():
        r = _post(url, {**body, "max_tokens": 5000}, path)
        assert r.status_code == 400 and "max_model_len" in r.text
    # a budget that only overflows with the prompt is capped, on both
    for url in both.values():
        assert _post(url, {**body, "max_tokens": 2045, "temperature": 0}, path).status_code == 200


@pytest.mark.parametrize("tool", [
    {"type": "function", "function": {"name": "f", "parameters": "x"}},
    {"type": "function", "function": {"name": "f", "parameters": [1]}},
    {"type": "function", "function": {"name": 3}},
])
def test_invalid_tool_schemas_are_a_400_as_on_vllm(both, tool):
    for url in both.values():
        r = _post(url, {"messages": HI, "max_tokens": 3, "tools": [tool]})
        assert r.status_code == 400, (url, r.text)
    err = _post(both["router"], {"messages": HI, "max_tokens": 3, "tools": [tool]}).json()["error"]
    assert err["param"].startswith("tools[0].function")
