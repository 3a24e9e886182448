"""A new user's first hour: the README's environment, in a file outside the project, trains.

The test follows the README: the example environment is written to a file in a folder of its own
(not on ``sys.path``, not a package), and ``agentrl run`` is given it with ``--serve.env.import``
and the model the README names for an environment of one's own, at the README's defaults (groups of
4, batches of 32). The model cache starts without ``smollm2-tools``: the run installs the project's
shipped warm-start (merged into SmolLM2) and trains nothing before its first step. By the end of
its learner step (a full batch of 32 samples, SmolLM2 fully fine-tuned: minutes on two cores, the
test's cost) the environment's tool has been called and groups' rewards differ (a non-zero
advantage spread), i.e. the run had something to learn from.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from agentrl.models import recipe_stamp, resolve_model, shipped
from tests.conftest import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_environment() -> tuple[str, list[str]]:
    """The README's example environment file and the options of the command that runs it."""
    text = README.read_text()
    section = text[text.index("## Writing an environment"):]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    command = re.search(r"```bash\n(agentrl run .*?)\n```", section, re.DOTALL).group(1)
    return code, command.split()[2:]


def test_the_readme_environment_trains_from_a_file_outside_the_project(tmp_path: Path) -> None:
    code, options = _readme_environment()
    assert "--serve.env.import=reverse_word.py" in options and "--serve.model=smollm2-tools" in options
    user_dir = tmp_path / "my_project"
    user_dir.mkdir()
    (user_dir / "reverse_word.py").write_text(code)
    run_dir = tmp_path / "run"
    # a model cache holding SmolLM2 (converted from its wheel once per machine) but not smollm2-tools
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "smollm2-135m").symlink_to(resolve_model("smollm2"))
    env = {k: v for k, v in os.environ.items() if k != "AGENTRL_ADMIN_TOKEN"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])  # agentrl itself, not the user's folder
    env["AGENTRL_HOME"] = str(home)
    cmd = [sys.executable, "-m", "agentrl.cli", "run", *options, f"--serve.run_dir={run_dir}",
           f"--serve.router.port={free_port()}", f"--serve.engine.base_port={free_port()}",
           "--learn.steps=1", "--eval.tasks=0"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=user_dir, timeout=1500)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    summary = json.loads(out.stdout.splitlines()[-1])
    assert summary["steps"] == 1 and summary["final_version"] == 1
    serve_log = (run_dir / "serve.log").read_text()
    assert "installed the shipped smollm2-tools" in serve_log and "warm-start step" not in serve_log
    assert shipped.is_current(home / "models" / "smollm2-tools", recipe_stamp("smollm2-tools"))

    episodes = [json.loads(line) for line in (run_dir / "episodes.jsonl").read_text().splitlines()]
    assert episodes and all(e["error"] is None for e in episodes), [
        e["error"] for e in episodes if e["error"]
    ]
    assert sum(e["info"].get("tool_calls", 0) for e in episodes) > 0, ("the environment's "
                                                                       "tool was never called")
    groups: dict[str, list[float]] = defaultdict(list)
    for e in episodes:
        groups[e["group_id"]].append(e["reward"])
    size = json.loads((run_dir / "serve_config.json").read_text())["env"]["group_size"]
    assert size == 4  # the README's
    spread = [g for g in groups.values() if len(g) == size and max(g) > min(g)]
    assert spread, f"no group had rewards that differ: {dict(groups)}"
    steps = [json.loads(line) for line in (run_dir / "learner.jsonl").read_text().splitlines()]
    assert [s["samples"] for s in steps] == [32], steps  # the README's batch, trained whole
