"""The web view in a real headless browser (Debian's chromium, driven by playwright's Python
package) against ``agentrl view`` on a recorded run directory: the pages load with no console
error, the token is needed, the episode page shows the stitched sample's mask and versions, and
the charts grow while the run's logs grow, without a reload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_view import write_view_run
from tests.view_browser import POINTS, Console, agentrl_view, chromium, need_browser, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser():
    need_browser()
    with chromium() as b:
        yield b


def _token(run: Path) -> str:
    return (run / "view_token").read_text().strip()


def test_every_page_loads_without_console_errors_and_the_episode_shows_its_stitched_tokens(
        tmp_path: Path, browser, tiny_tools_model: str) -> None:
    run = tmp_path / "run"
    truth = write_view_run(run)
    with agentrl_view(run, model=tiny_tools_model) as base:
        page = browser.new_page()
        console = Console(page)
        page.goto(f"{base}/view/?token={_token(run)}")
        assert page.url == f"{base}/view/"
        wait_for(page, POINTS + " > 0")
        assert page.locator("#chart-reward").get_attribute("data-points") == "6"  # six learner steps

        page.goto(f"{base}/view/episodes")
        wait_for(page, "document.querySelectorAll('#rows tr').length === 50")
        page.select_option("#error_kind", label="any error")
        page.click("button[type=submit]")
        wait_for(page, "document.querySelectorAll('#rows tr').length === 1")
        assert "e5" in page.inner_text("#rows") and "1 of 1" in page.inner_text("#match-count")
        page.goto(f"{base}/view/episodes?version_min=2&version_max=3")
        wait_for(page, "(document.getElementById('match-count') || {}).textContent === '1–32 of 32 matching'")

        for sid in ("e1", "e2"):
            page.goto(f"{base}/view/episode/{sid}")
            wait_for(page, "document.body.dataset.ready === '1'")
            for k, s in enumerate(truth[sid]):
                trained = page.locator(f"#sample-{k} .tok.t").count()
                assert trained == sum(s.loss_mask)
                assert page.locator(f"#sample-{k} .tok").count() == len(s.token_ids)
                versions = {v for v, m in zip(s.versions, s.loss_mask, strict=True) if m}
                assert page.locator(f"#sample-{k} .legend .ver").count() == len(versions)
                shown = page.eval_on_selector_all(f"#sample-{k} .tok.t", "ts => [...new Set(ts.map(t "
                                                                         "=> t.dataset.v))]")
                assert sorted(int(v) for v in shown) == sorted(versions)
        page.goto(f"{base}/view/episode/e1")
        wait_for(page, "document.body.dataset.ready === '1'")
        assert (
            page.locator("#sample-0 .tok.t").count() == 9
            and page.locator("#sample-0 .legend .ver").count() == 3
        )
        page.locator("#sample-0 .tok.t").nth(4).hover()
        tip = page.inner_text("#tooltip")
        assert "trained · version 1 · logprob -0.5000" in tip, tip
        assert "<|im_start|>" in page.inner_text("#sample-0 .tokens")  # special tokens are shown
        assert page.locator("#sample-0 .tok.sp").count() > 0
        assert (
            "5" in page.inner_text("#call-1 .msg.tool")
            and "tool output" in page.inner_text("#call-1 .msg.tool").lower()
        )
        assert "python" in page.inner_text("#call-0 .toolcall")
        assert console.errors == []
        page.close()


def test_the_browser_is_refused_without_the_token_and_the_token_leaves_the_address(
    tmp_path: Path, browser
) -> None:
    run = tmp_path / "run"
    write_view_run(run, steps=2)
    with agentrl_view(run) as base:
        ctx = browser.new_context()
        page = ctx.new_page()
        console = Console(page)
        resp = page.goto(f"{base}/view/")
        assert resp.status == 401 and page.locator("#charts").count() == 0
        assert page.locator("input[name=token]").count() == 1
        resp = page.goto(f"{base}/view/?token=not-the-token")
        assert resp.status == 401 and page.locator("#charts").count() == 0
        page.fill("input[name=token]", "still-not-the-token")
        page.click("button[type=submit]")
        assert page.locator("#charts").count() == 0 and "does not open" in page.inner_text(".message")
        assert ctx.cookies() == []

        resp = page.goto(f"{base}/view/episodes?token={_token(run)}")
        assert resp.status == 200 and page.url == f"{base}/view/episodes"
        # the episode list has loaded before the page is left: leaving it earlier aborts its fetch
        # (net::ERR_ABORTED, a failed request CI's browser reported once)
        wait_for(page, "document.getElementById('match-count') !== null")
        assert page.evaluate("document.cookie") == ""  # HttpOnly: page scripts cannot read it
        (cookie,) = ctx.cookies()
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/view"
        assert _token(run) not in cookie["value"]
        page.goto(f"{base}/view/")
        wait_for(page, POINTS + " > 0")
        console.stop()
        ctx.close()

        ctx = browser.new_context()  # the login form, for a token typed in
        page = ctx.new_page()
        page.goto(f"{base}/view/episode/e1")
        page.fill("input[name=token]", _token(run))
        # the form posts to /view/login, which answers 303 back to this same address: wait for that
        # navigation itself (wait_for_url would return at once, the login page having the same URL)
        with page.expect_navigation(url=f"{base}/view/episode/e1"):
            page.click("button[type=submit]")
        wait_for(page, "document.body.dataset.ready === '1'")
        ctx.close()
        # the 401s of the refused loads are the browser's only complaints
        assert all("401" in e for e in console.errors), console.errors


def _append(path: Path, rows: list[dict]) -> None:
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_the_run_page_plots_new_rows_as_the_logs_grow_without_a_reload(tmp_path: Path, browser) -> None:
    run = tmp_path / "run"
    write_view_run(run, steps=3)
    t0 = 1_760_000_000.0
    with agentrl_view(run) as base:
        page = browser.new_page()
        console = Console(page)
        page.goto(f"{base}/view/?token={_token(run)}")
        wait_for(page, "Number(document.querySelector('#chart-reward')?.dataset.points) === 3")
        page.evaluate("window.__sameDocument = 'yes'")
        counts = [page.evaluate(POINTS)]
        for step in (4, 5):  # a learner step, four episodes and a serve row arrive, twice
            _append(
                run / "learner.jsonl",
                [
                    {
                        "step": step,
                        "version": step,
                        "time": t0 + 20 * step,
                        "reward_mean": 0.5,
                        "staleness_mean": 0.5,
                        "staleness_max": 1,
                        "is/mean": 1.0,
                        "mismatch/kl_k3": 1e-4,
                        "tokens_per_s": 120.0,
                        "idle_fraction": 0.1,
                    }
                ],
            )
            _append(
                run / "episodes.jsonl",
                [
                    {
                        "time": t0 + 20 * step,
                        "episode_id": f"n{step}-{i}",
                        "env": "arithmetic",
                        "reward": 1.0,
                        "versions": [step],
                        "truncated": False,
                    }
                    for i in range(4)
                ],
            )
            _append(run / "serve_metrics.jsonl", [{"time": t0 + 600 + step, "version": step,
                                                   "router": {"completion_tokens": 10_000 * step},
                                                   "rollout": {"episodes": 500 + step, "in_flight": 3}}])
            wait_for(page, f"Number(document.querySelector('#chart-reward')?.dataset.points) === {step}")
            counts.append(page.evaluate(POINTS))
        assert counts[0] < counts[1] < counts[2], counts
        assert page.evaluate("window.__sameDocument") == "yes"  # the same page, never reloaded
        assert page.evaluate("performance.getEntriesByType('navigation').length") == 1
        assert console.errors == []
