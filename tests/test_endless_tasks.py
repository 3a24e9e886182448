"""A task source that never ends: serve draws tasks as it needs them, serves episodes and answers.

The environment's ``tasks()`` is a procedural generator with no end (``itertools.count``). serve
must start, produce episodes and answer ``/health`` and ``/admin/status`` throughout, while the
tasks it has drawn stay within what admission control lets run (a list of them would never finish
building).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from agentrl.client import get_json
from tests.conftest import free_port

pytestmark = [pytest.mark.vllm]

ENDLESS = textwrap.dedent('''
    import itertools

    import agentrl

    @agentrl.environment("endless-echo")
    class EndlessEcho(agentrl.ToolEnv):
        system_prompt = "Repeat the number."

        def tasks(self, split="train"):
            for i in itertools.count():
                yield {"id": f"{split}-{i}", "question": f"Say {i}.", "answer": str(i)}

        async def reward(self, task, answer):
            return float(task["answer"] in answer)
''')


def endless_serve_config(tmp_path: Path, engine_url: str, port: int, *, top: str = "",
                         sections: str = "") -> tuple[Path, Path]:
    """The endless echo environment in ``tmp_path`` and a serve config that plays it on the engine
    at ``engine_url``: (config file, run directory). ``top``: more top-level settings;
    ``sections``: more TOML sections (tests/test_scoring_vllm.py adds its scoring)."""
    (tmp_path / "endless.py").write_text(ENDLESS)
    run_dir = tmp_path / "run"
    config = tmp_path / "serve.toml"
    config.write_text(f"""model = "tiny-tools"
run_dir = "{run_dir}"
{top}
[engine]
urls = ["{engine_url}"]
[router]
port = {port}
[env]
name = "endless-echo"
import = ["{tmp_path / 'endless.py'}"]
group_size = 2
max_concurrency = 4
max_turns = 1
max_tokens = 8
[buffer]
batch_size = 8
max_staleness = 1
{sections}""")
    return config, run_dir


def test_an_endless_task_generator_serves_episodes_and_serve_stays_responsive(
    tmp_path: Path, vllm_engine
) -> None:
    port = free_port()
    config, run_dir = endless_serve_config(tmp_path, vllm_engine.url, port)
    env = {k: v for k, v in os.environ.items() if k != "AGENTRL_ADMIN_TOKEN"}
    base = f"http://127.0.0.1:{port}"
    # One thread polls /health back to back from the moment serve first answers, so the start-up
    # page's handover of the port to the real routes is crossed by polls, not missed between them.
    stop, health_codes = threading.Event(), []

    def poll_health() -> None:
        while not stop.is_set():
            code = get_json(f"{base}/health")[0]
            if code or health_codes:
                health_codes.append(code)
            time.sleep(0.005)

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    with open(tmp_path / "serve.out", "wb") as out:
        serve = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "serve", "--config", str(config)],
                                 stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            episodes: list[dict] = []
            answers: list[tuple[int, int]] = []
            deadline = time.monotonic() + 600
            while len(episodes) < 8 and serve.poll() is None and time.monotonic() < deadline:
                if (run_dir / "admin_token").exists():
                    token = (run_dir / "admin_token").read_text().strip()
                    answers.append(
                        (get_json(f"{base}/health")[0], get_json(f"{base}/admin/status", token)[0])
                    )
                path = run_dir / "episodes.jsonl"
                episodes = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
                time.sleep(0.5)
            status_code = get_json(f"{base}/admin/status", token)[0]
            health_code = get_json(f"{base}/health")[0]
        finally:
            stop.set()
            poller.join(60)
            serve.send_signal(signal.SIGTERM)
            code = serve.wait(timeout=120)
    log = (tmp_path / "serve.out").read_text()[-3000:]
    assert len(episodes) >= 8, log
    assert code == 0, log
    assert all(e["error"] is None for e in episodes), log
    assert health_code == 200 and status_code == 200, (health_code, status_code, log)
    # once serve listens, it answers every poll: 503 from /health only while the engines start
    listening = answers[next(i for i, a in enumerate(answers) if a[0]):]
    assert listening and all(h in (200, 503) and s == 200 for h, s in listening), answers
    assert 200 in health_codes and all(c in (200, 503) for c in health_codes), health_codes
    # One task per group, drawn when the group starts. Nobody trains here, so admission control
    # stops new groups once (max_staleness + 1) x batch_size = 16 samples are buffered or in flight:
    # 8 groups, and the episodes in flight (max_concurrency 4) are 2 more.
    drawn = {e["task_id"] for e in episodes}
    assert max(int(t.rsplit("-", 1)[1]) for t in drawn) < 10, sorted(drawn)
