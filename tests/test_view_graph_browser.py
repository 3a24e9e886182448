"""A multi-agent episode in the web view, in a real headless browser (Debian's chromium, driven by
playwright's Python package) against ``agentrl view`` on a recorded run directory
(:func:`tests.test_view_graph.write_multi_agent_run`): the graph draws its lanes, nodes and fork and
compaction edges, a node opens its call's tokens from its role's session, the episode list filters by
role and policy, and the run page charts each role's reward, with no console error.

The test takes a screenshot of the episode page; with ``AGENTRL_UPDATE_SCREENSHOTS=1`` it writes it
to ``docs/images/view_episode_graph.png`` (the image docs/multi_agent.md shows)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.test_view_graph import write_multi_agent_run
from tests.view_browser import POINTS, Console, agentrl_view, chromium, need_browser, wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "docs" / "images" / "view_episode_graph.png"
MATCHING = "(document.getElementById('match-count') || {}).textContent === "
VERSIONS = "ts => ts.map(t => t.dataset.v)"


def _count(page, selector: str) -> int:
    return page.locator(selector).count()


def _open(page, node: int) -> None:
    page.locator(f"svg.graph .node[data-node='{node}']").click()
    detail = "(document.getElementById('node-detail') || {dataset: {}}).dataset"
    wait_for(page, f"{detail}.node === '{node}' && {detail}.loaded === '1'")


def test_a_multi_agent_episode_draws_its_graph_and_a_node_opens_its_calls_tokens(
        tmp_path: Path, tiny_tools_model: str) -> None:
    need_browser()
    run = tmp_path / "run"
    write_multi_agent_run(run)
    with agentrl_view(run, model=tiny_tools_model) as base, chromium() as browser:
        token = (run / "view_token").read_text().strip()  # written by agentrl view as it starts
        page = browser.new_page(viewport={"width": 1400, "height": 1000}, device_scale_factor=1)
        console = Console(page)
        page.goto(f"{base}/view/?token={token}")
        wait_for(page, POINTS + " > 0")
        wait_for(page, "Number(document.querySelector('#chart-role-reward')?.dataset.points) > 0")
        assert page.locator("#chart-role-reward .legend .key").all_inner_texts() == [
            "critic", "helper", "judge", "lead"]

        page.goto(f"{base}/view/episodes?role=helper")
        wait_for(page, MATCHING + "'1–4 of 4 matching'")
        assert "lead, helper, judge, critic" in page.inner_text("#rows")
        page.select_option("#role", "")
        page.select_option("#policy", label="frozen")
        page.click("button[type=submit]")
        wait_for(page, MATCHING + "'1–4 of 4 matching'")
        assert "policy=frozen" in page.url
        page.goto(f"{base}/view/episodes?policy=policy%3Anobody")
        wait_for(page, MATCHING + "'no matching episodes'")

        page.goto(f"{base}/view/episode/m1")
        wait_for(page, "document.body.dataset.ready === '1'")
        lanes = page.locator("svg.graph .lane-label").all_text_contents()
        assert lanes == ["lead", "helper", "judge", "critic"]
        assert _count(page, "svg.graph .node") == 8 and _count(page, "svg.graph .node.trained") == 5
        assert _count(page, "svg.graph path.edge") == 5 and _count(page, "svg.graph path.edge.fork") == 3
        assert _count(page, "svg.graph path.edge.compaction") == 1
        assert _count(page, "svg.graph path.edge.turn") == 1
        assert page.locator("svg.graph path.edge.compaction").get_attribute("data-edge") == "0-4"

        _open(page, 1)  # a helper sub-agent: its one call, sampled by version 3
        assert _count(page, "#node-sample .tok.t") == 3 and _count(page, "#node-sample .tok") == 6
        assert set(page.eval_on_selector_all("#node-sample .tok.t", VERSIONS)) == {"3"}
        assert "Part 0." in page.inner_text("#node-detail .call")
        _open(page, 6)  # the critic's call went to an external endpoint: nothing recorded
        assert "external endpoint" in page.inner_text("#node-detail") and _count(page, "#node-sample") == 0
        _open(page, 7)  # the judge's second turn: the sample of both its calls, this call marked
        assert _count(page, "#node-sample .callmark") == 2
        assert page.locator("#node-sample .callmark.here").get_attribute("data-call") == "1"
        _open(page, 4)  # the lead after its compaction: a new context, version 4
        assert _count(page, "#node-sample .tok.t") == 3 and _count(page, "#node-sample .tok") == 7
        assert set(page.eval_on_selector_all("#node-sample .tok.t", VERSIONS)) == {"4"}
        assert _count(page, "svg.graph .node.picked") == 1
        page.locator("#node-sample .tok.t").first.hover()
        assert "trained · version 4" in page.inner_text("#tooltip")

        shot = tmp_path / "graph.png"
        page.locator("main").screenshot(path=str(shot))
        assert shot.stat().st_size > 10_000
        if os.environ.get("AGENTRL_UPDATE_SCREENSHOTS"):
            shutil.copyfile(shot, SCREENSHOT)
        assert console.errors == []
        page.close()
