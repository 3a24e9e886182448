"""The web view's routes, reader and access, through its aiohttp app on a recorded run directory:
the token opens it once and never shows again, it only reads, its answers stay bounded, and an
episode's tokens carry the mask and versions of the router's own stitching."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from agentrl.router.sessions import CallRecord, Completion, Session
from agentrl.view import standalone_app
from agentrl.view.auth import ViewAuth, safe_next
from agentrl.view.logs import EpisodeFilter, EpisodeIndex, LogTail, learner_numbers
from tests.test_plot import write_recorded_run

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "view-token-for-tests-0123456789"
ADMIN = "admin-token-for-tests-9876543210"


def _completion(
    ids: list[int], versions: list[int], message: dict[str, Any], finish: str = "stop"
) -> Completion:
    return Completion(ids, [-0.1 * (i + 1) for i in range(len(ids))], versions, finish, message)


def multi_turn_records(sid: str) -> list[CallRecord]:
    """Two calls of one episode, the second continuing the first token for token (a tool round trip),
    whose sampled tokens come from versions 0, 1 and 2."""
    system = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "What is 2+3?"}]
    call = {"id": "call_0", "type": "function", "function": {"name": "python", "arguments": '{"code": '
                                                                                            '"print(2+3)"}'}}
    reply0 = {"role": "assistant", "content": "", "tool_calls": [call]}
    p0 = [1, 40, 41, 42, 2, 1, 43, 44, 45, 46]
    c0 = [50, 51, 52, 53, 2]
    tool = {"role": "tool", "content": "5\n", "tool_call_id": "call_0"}
    p1 = p0 + c0 + [201, 1, 60, 61, 62, 2, 1]
    c1 = [70, 71, 72, 2]
    r0 = CallRecord(sid, 0, None, 0, p0, [_completion(c0, [0, 0, 0, 1, 1], reply0)], "engine-0",
                    created=time.time(), latency_s=0.2, messages=system)
    norm_reply = {"role": "assistant", "content": "", "tool_calls": [["python", {"code": "print(2+3)"}]]}
    r1 = CallRecord(sid, 1, 0, 0, p1, [_completion(c1, [1, 2, 2, 2], {"role": "assistant", "content": "5"})],
                    "engine-0", created=time.time(), latency_s=0.1, messages=system + [norm_reply, tool])
    return [r0, r1]


def write_view_run(run_dir: Path, steps: int = 6) -> dict[str, Any]:
    """A recorded run (logs shaped like serve's and learn's) plus the call records of two episodes:
    one multi-turn with three versions, one whose second call did not continue the first (two samples)."""
    write_recorded_run(run_dir, steps=steps)
    (run_dir / "serve_config.json").write_text(json.dumps({"model": "tiny-tools", "admin_token": "<redacted>",
                                                           "env": {"name": "arithmetic", "group_size": 4},
                                                           "buffer": {"batch_size": 16, "max_staleness": 2}}))
    sessions = run_dir / "sessions"
    sessions.mkdir(exist_ok=True)
    multi = multi_turn_records("e1")
    split = [
        CallRecord(
            "e2",
            0,
            None,
            0,
            [1, 40, 41],
            [_completion([80, 81], [3, 3], {"role": "assistant", "content": "hi"})],
            "engine-0",
        ),
        CallRecord(
            "e2",
            1,
            None,
            0,
            [1, 40, 42],
            [_completion([82], [4], {"role": "assistant", "content": "x"})],
            "engine-0",
        ),
    ]
    for sid, recs in (("e1", multi), ("e2", split), ("in-flight", split)):
        (sessions / f"{sid}.jsonl").write_text("".join(r.to_json() + "\n" for r in recs))
    return {"e1": Session("e1", records=multi).samples(), "e2": Session("e2", records=split).samples()}


def run_app(run_dir: Path, body: Callable[[TestClient], Awaitable[None]], model: str = "") -> None:
    async def main() -> None:
        app = standalone_app(run_dir, model=model)
        client = TestClient(TestServer(app))
        await client.start_server()
        try:
            await body(client)
        finally:
            await client.close()
    asyncio.run(main())


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AGENTRL_VIEW_TOKEN", TOKEN)
    monkeypatch.delenv("AGENTRL_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("AGENTRL_ADMIN_TOKEN_FILE", raising=False)
    d = tmp_path / "run"
    write_view_run(d)
    (d / "admin_token").write_text(ADMIN)
    (d / "admin_token").chmod(0o600)
    return d


def test_the_view_refuses_a_missing_or_wrong_token_and_trades_the_right_one_for_a_cookie(
    run_dir: Path,
) -> None:
    async def body(c: TestClient) -> None:
        r = await c.get("/view/", allow_redirects=False)
        assert r.status == 401 and "token" in await r.text()
        r = await c.get("/view/api/series")
        assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
        r = await c.get("/view/?token=wrong-token", allow_redirects=False)
        assert r.status == 401 and "agentrl_view" not in r.headers.get("Set-Cookie", "")
        assert (await c.get("/view/api/run")).status == 401  # a wrong token left no cookie behind

        r = await c.get(f"/view/episodes?env=arithmetic&token={TOKEN}", allow_redirects=False)
        assert r.status == 303
        assert r.headers["Location"] == "/view/episodes?env=arithmetic"  # the token left the address
        cookie = r.headers["Set-Cookie"]
        for flag in ("HttpOnly", "SameSite=Strict", "Path=/view"):
            assert flag in cookie, cookie
        assert TOKEN not in cookie and ADMIN not in cookie
        r = await c.get("/view/")
        assert r.status == 200 and "charts" in await r.text()
        assert (await c.get("/view/api/run")).status == 200

    run_app(run_dir, body)


def test_the_admin_token_and_a_bearer_header_open_the_view_too(run_dir: Path) -> None:
    async def body(c: TestClient) -> None:
        assert (await c.get("/view/api/run", headers={"Authorization": f"Bearer {TOKEN}"})).status == 200
        assert (await c.get("/view/api/run", headers={"Authorization": f"bearer {ADMIN}"})).status == 200
        assert (await c.get("/view/api/run", headers={"Authorization": "Bearer nope"})).status == 401
        r = await c.get(f"/view/?token={ADMIN}", allow_redirects=False)
        assert r.status == 303 and r.headers["Location"] == "/view/"

    run_app(run_dir, body)


def test_the_login_form_sets_the_cookie_and_only_sends_the_browser_within_the_view(run_dir: Path) -> None:
    async def body(c: TestClient) -> None:
        r = await c.post(
            "/view/login", data={"token": "wrong", "next": "/view/episodes"}, allow_redirects=False
        )
        assert r.status == 401
        r = await c.post(
            "/view/login", data={"token": TOKEN, "next": "//evil.example/x"}, allow_redirects=False
        )
        assert r.status == 303 and r.headers["Location"] == "/view/"
        r = await c.post(
            "/view/login", data={"token": TOKEN, "next": "/view/episode/e1"}, allow_redirects=False
        )
        assert r.status == 303 and r.headers["Location"] == "/view/episode/e1"
        assert (await c.get("/view/api/episode/e1")).status == 200

    run_app(run_dir, body)
    for bad in ("https://evil.example/", "/view/../admin", "/view//evil", "/viewx", "javascript:alert(1)"):
        assert safe_next(bad) == "/view/"


def test_no_page_answer_or_log_line_contains_a_token(run_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def body(c: TestClient) -> None:
        r = await c.get(f"/view/?token={TOKEN}")
        texts = [await r.text()]
        for path in ("/view/episodes", "/view/episode/e1", "/view/api/run", "/view/api/series",
                     "/view/api/episodes", "/view/api/episode/e1", "/view/api/episode/e1/sample/0",
                     "/view/static/run.js", "/view/static/view.css", "/view/nowhere"):
            r = await c.get(path)
            texts.append(await r.text())
            texts.extend(f"{k}: {v}" for k, v in r.headers.items())
        r = await c.post("/view/login", data={"token": "wrong-guess"})
        texts.append(await r.text())
        for t in texts:
            assert TOKEN not in t and ADMIN not in t and "wrong-guess" not in t

    caplog.set_level("DEBUG")
    run_app(run_dir, body)
    assert TOKEN not in caplog.text and ADMIN not in caplog.text


def _tree(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def test_the_view_only_reads_the_run(run_dir: Path) -> None:
    before = _tree(run_dir)

    async def body(c: TestClient) -> None:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for path in (
            "/view/",
            "/view/api/run",
            "/view/api/series",
            "/view/api/episodes",
            "/view/api/episode/e1",
            "/view/api/episode/e1/sample/0",
            "/view/static/run.js",
        ):
            for method in ("POST", "PUT", "DELETE", "PATCH"):
                r = await c.request(method, path, headers=auth)
                assert r.status == 405, (method, path, r.status)
            # pages need the cookie, not a header
            assert (await c.get(path, headers=auth)).status in (200, 401)

    run_app(run_dir, body)
    assert _tree(run_dir) == before


def test_an_episode_id_cannot_reach_outside_the_sessions_folder(run_dir: Path) -> None:
    (run_dir / "secret.jsonl").write_text(multi_turn_records("x")[0].to_json() + "\n")

    async def body(c: TestClient) -> None:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for bad in ("..%2Fsecret", "..%2F..%2Frun%2Fsecret", "%2E%2E", "e1%00", "a" * 200):
            r = await c.get(f"/view/api/episode/{bad}", headers=auth)
            assert r.status == 404, bad
        assert (await c.get("/view/api/episode/e1/sample/7", headers=auth)).status == 404

    run_app(run_dir, body)


def test_episode_tokens_carry_the_mask_and_versions_of_the_routers_stitching(run_dir: Path) -> None:
    truth = write_view_run(run_dir)

    async def body(c: TestClient) -> None:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for sid in ("e1", "e2"):
            ep = await (await c.get(f"/view/api/episode/{sid}", headers=auth)).json()
            assert len(ep["samples"]) == len(truth[sid])
            for k, s in enumerate(truth[sid]):
                page = await (await c.get(f"/view/api/episode/{sid}/sample/{k}", headers=auth)).json()
                assert page["ids"] == s.token_ids.tolist() and page["mask"] == s.loss_mask.tolist()
                assert page["version"] == s.versions.tolist()
                assert [lp for lp in page["logprob"] if lp is not None] == [
                    lp for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if m
                ]
                assert ep["samples"][k]["trained"] == sum(s.loss_mask)
                assert ep["samples"][k]["versions"] == sorted(
                    {v for v, m in zip(s.versions, s.loss_mask, strict=True) if m}
                )
        ep = await (await c.get("/view/api/episode/e1", headers=auth)).json()
        assert ep["samples"][0]["versions"] == [0, 1, 2] and ep["samples"][0]["calls"] == [0, 1]
        assert ep["episode"]["episode_id"] == "e1" and ep["episode"]["reward"] in (0.0, 1.0)
        live = await (await c.get("/view/api/episode/in-flight", headers=auth)).json()
        assert live["episode"] is None and len(live["samples"]) == 2  # no line yet: still being played
        second = ep["calls"][1]
        # the tool output, what the sandbox said
        assert [m["role"] for m in second["new_messages"]] == ["tool"]
        assert second["new_messages"][0]["content"] == "5\n"
        assert ep["calls"][0]["choices"][0]["tool_calls"] == [
            {"name": "python", "arguments": '{"code": "print(2+3)"}'}
        ]
        page = await (await c.get("/view/api/episode/e1/sample/0?offset=3&limit=4", headers=auth)).json()
        assert (
            page["offset"] == 3 and len(page["ids"]) == 4 and page["total"] == len(truth["e1"][0].token_ids)
        )
        spans = page["spans"]
        assert spans == [{"call": 0, "start": 10, "end": 15}, {"call": 1, "start": 22, "end": 26}]

    run_app(run_dir, body)


def test_token_text_is_each_id_decoded_alone_with_special_tokens_shown(
    run_dir: Path, tiny_tools_model: str
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tools_model)

    async def body(c: TestClient) -> None:
        page = await (
            await c.get("/view/api/episode/e1/sample/0", headers={"Authorization": f"Bearer {TOKEN}"})
        ).json()
        assert page["text"] == [tok.decode([i], skip_special_tokens=False) for i in page["ids"]]
        marks = {"<|im_start|>", "<|im_end|>", "<|endoftext|>"}
        assert page["special"] == [
            i for i, t in enumerate(page["ids"]) if tok.convert_ids_to_tokens(t) in marks
        ]
        assert page["special"] and page["raw"][0] == "<|im_start|>"

    run_app(run_dir, body, model=tiny_tools_model)


def test_a_session_file_too_large_to_show_is_refused(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("agentrl.view.episodes.MAX_SESSION_BYTES", 100)

    async def body(c: TestClient) -> None:
        r = await c.get("/view/api/episode/e1", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status == 413 and "MiB" in (await r.json())["error"]["message"]

    run_app(run_dir, body)


def test_the_episode_browser_filters_and_pages_newest_first(run_dir: Path) -> None:
    index = EpisodeIndex(run_dir / "episodes.jsonl")
    index.refresh()
    n = len(index)
    assert n == 6 * 16
    total, offsets = index.match(EpisodeFilter(), 0, 10)
    assert total == n and len(offsets) == 10
    rows = index.read_rows(offsets)
    assert [r["episode_id"] for r in rows] == [f"e{i}" for i in range(n - 1, n - 11, -1)]
    assert index.match(EpisodeFilter(error_kind="any"), 0, 100)[0] == 1  # e5: "ToolError: boom"
    assert index.match(EpisodeFilter(error_kind="none"), 0, 100)[0] == n - 1
    wins = index.match(EpisodeFilter(reward_min=1.0), 0, 1000)[0]
    assert 0 < wins < n and wins + index.match(EpisodeFilter(reward_max=0.0), 0, 1000)[0] == n
    assert index.match(EpisodeFilter(version_min=2, version_max=3), 0, 1000)[0] == 32  # e32..e63
    assert index.match(EpisodeFilter(env="nope"), 0, 10) == (0, [])
    assert index.match(EpisodeFilter(truncation="yes"), 0, 10)[0] == 0

    async def body(c: TestClient) -> None:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        got = await (await c.get("/view/api/episodes?limit=100000&offset=10", headers=auth)).json()
        assert got["limit"] == 200 and got["total"] == n and len(got["rows"]) == n - 10
        assert got["facets"]["envs"] == ["arithmetic"]
        got = await (
            await c.get("/view/api/episodes?version_min=2&version_max=3&limit=5", headers=auth)
        ).json()
        assert got["total"] == 32 and [r["version_min"] for r in got["rows"]] == [3] * 5
        assert (await c.get("/view/api/episodes?reward_min=abc", headers=auth)).status == 400

    run_app(run_dir, body)


def test_a_mixs_episodes_are_browsed_and_filtered_by_their_own_environment(tmp_path: Path) -> None:
    path = tmp_path / "episodes.jsonl"
    rows = [{"episode_id": f"e{i}", "env": "mix", "reward": 1.0,
             "info": {"mix_env": ("arithmetic", "guess_number", "arithmetic")[i % 3]}} for i in range(9)]
    rows.append({"episode_id": "plain", "env": "shell", "reward": 0.0, "info": {}})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    index = EpisodeIndex(path)
    index.refresh()
    assert index.facets()["envs"] == ["mix/arithmetic", "mix/guess_number", "shell"]
    total, offsets = index.match(EpisodeFilter(env="mix/guess_number"), 0, 100)
    assert total == 3 and {r["episode_id"] for r in index.read_rows(offsets)} == {"e1", "e4", "e7"}
    assert index.match(EpisodeFilter(env="mix/arithmetic"), 0, 100)[0] == 6
    assert index.match(EpisodeFilter(env="mix"), 0, 100)[0] == 0  # the whole mix is its environments


def test_a_log_is_read_up_to_its_last_complete_line_and_then_followed(tmp_path: Path) -> None:
    path = tmp_path / "learner.jsonl"
    path.write_text('{"step": 1, "reward_mean": 0.5}\n{"step": 2, "rew')
    tail = LogTail(path, learner_numbers)
    tail.refresh()
    assert tail.snapshot(100)["cols"]["step"] == [1.0]
    with open(path, "a") as f:
        f.write('ard_mean": 0.7, "is/mean": 1.01}\n')
    tail.refresh()
    snap = tail.snapshot(100)
    assert snap["rev"] == 2 and snap["cols"]["reward_mean"] == [0.5, 0.7]
    assert snap["cols"]["is/mean"] == [None, 1.01]  # a statistic that appeared later: none before
    path.write_text('{"step": 9}\n')  # replaced by a shorter file: read again from its start
    tail.refresh()
    assert tail.snapshot(100)["cols"]["step"] == [9.0]


def test_a_long_log_is_thinned_evenly_and_a_snapshot_is_capped(tmp_path: Path) -> None:
    path = tmp_path / "learner.jsonl"
    path.write_text("".join(json.dumps({"step": i, "reward_mean": i / 10}) + "\n" for i in range(1000)))
    tail = LogTail(path, learner_numbers, max_rows=64)
    tail.refresh()
    assert tail.seen == 1000 and tail.kept < 64 and tail.stride == 16
    steps = tail.snapshot(1000)["cols"]["step"]
    kept = steps[:-1]
    assert kept[0] == 0 and all(b - a == 16 for a, b in zip(kept, kept[1:], strict=False))
    assert steps[-1] == 999  # the newest row read shows, kept or not
    snap = tail.snapshot(10)
    assert snap["points"] <= 12 and snap["cols"]["step"][-1] == 999 and snap["cols"]["step"][0] == 0


def test_series_answer_unchanged_logs_in_a_few_bytes(run_dir: Path) -> None:
    async def body(c: TestClient) -> None:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        first = await (await c.get("/view/api/series", headers=auth)).json()
        revs = [first[k]["rev"] for k in ("learner", "serve", "episodes")]
        assert revs == [6, 23, 96] and first["t0"] == 1_760_000_000.0
        again = await (await c.get("/view/api/series?rev=" + ",".join(map(str, revs)), headers=auth)).json()
        assert all(again[k].get("unchanged") for k in ("learner", "serve", "episodes"))
        with open(run_dir / "learner.jsonl", "a") as f:
            f.write(json.dumps({"step": 7, "reward_mean": 0.9, "time": 1_760_000_200.0}) + "\n")
        grown = await (await c.get("/view/api/series?rev=" + ",".join(map(str, revs)), headers=auth)).json()
        assert grown["learner"]["rev"] == 7 and grown["learner"]["cols"]["reward_mean"][-1] == 0.9
        assert grown["serve"].get("unchanged")

    run_app(run_dir, body)


def test_a_cookie_is_signed_and_lapses() -> None:
    auth = ViewAuth(["t1", "t2"], max_age_s=60)
    c = auth.cookie(now=1000.0)
    assert auth.cookie_ok(c, now=1030.0) and not auth.cookie_ok(c, now=1061.0)
    version, expiry, sig = c.split(".")
    # a longer life is not signed
    assert not auth.cookie_ok(f"{version}.{int(expiry) + 3600}.{sig}", now=1030.0)
    assert not ViewAuth(["t1"]).cookie_ok(c, now=1030.0)  # another process's key
    assert auth.token_ok("t2") and not auth.token_ok("t3") and not auth.token_ok("")
    with pytest.raises(ValueError):
        ViewAuth(["", ""])


def test_agentrl_view_serves_a_run_directory_and_prints_where_the_token_is_not_the_token(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    write_view_run(run, steps=2)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("AGENTRL_VIEW_TOKEN", "AGENTRL_ADMIN_TOKEN"))
    }
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "view", str(run), "--port", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or []], daemon=True).start()
    seen: list[str] = []
    try:
        url = None
        while url is None or len(seen) < 2:  # the address line, then the token's whereabouts
            try:
                seen.append(lines.get(timeout=120))
            except queue.Empty:
                pytest.fail("agentrl view said nothing for 120 s: " + "".join(seen))
            m = re.search(r"agentrl view: .* at (http://127\.0\.0\.1:\d+/view/)\s", seen[-1])
            url = url or (m.group(1) if m else None)
        token = (run / "view_token").read_text().strip()
        assert oct((run / "view_token").stat().st_mode & 0o777) == "0o600"
        assert token and token not in "".join(seen) and "view_token" in "".join(seen)
        import urllib.error
        import urllib.request

        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url, timeout=10)
        assert e.value.code == 401
        req = urllib.request.Request(
            url.replace("/view/", "/view/api/run"), headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["model"] == "tiny-tools"
    finally:
        proc.terminate()
        proc.wait(30)


def test_serves_start_up_app_already_opens_the_view_with_the_same_cookie(tmp_path: Path) -> None:
    """While serve's engines start, its port answers the view (empty charts) and 503 elsewhere; the
    cookie it gives stays good on the real app, which shares the view's state."""
    import aiohttp
    from yarl import URL

    from agentrl.config import ServeConfig
    from agentrl.serve import Serve
    from agentrl.view import serve_view
    from tests.conftest import free_port

    run = tmp_path / "run"
    write_view_run(run, steps=2)
    cfg = ServeConfig(model="tiny-tools", run_dir=str(run), admin_token=ADMIN)
    cfg.router.port = free_port()
    serve = Serve(cfg)
    serve.admin_token = ADMIN
    serve.view = serve_view(run, ADMIN, lambda: None)

    async def main() -> None:
        await serve._serve_startup_status()
        try:
            async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
                r = await http.get(f"{serve.url}/view/?token={ADMIN}", allow_redirects=False)
                assert r.status == 303 and r.headers["Location"] == "/view/"
                assert (await http.get(f"{serve.url}/view/")).status == 200
                series = await (await http.get(f"{serve.url}/view/api/series")).json()
                assert series["learner"]["rev"] == 2
                assert (await http.get(f"{serve.url}/v1/models")).status == 503  # the rest is still starting
                cookie = http.cookie_jar.filter_cookies(URL(f"{serve.url}/view/"))["agentrl_view"].value
                assert serve.view.auth.cookie_ok(cookie)  # the state the real app mounts too
        finally:
            await serve._starting.cleanup()

    asyncio.run(main())
