"""Bring your own code: an environment in a file outside the project becomes known by ``env.import``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentrl import config as C
from agentrl.env import UnknownEnvironmentError, UserCodeError, import_user_code, lookup, registered

ROOT = Path(__file__).resolve().parents[1]

ENV_FILE = textwrap.dedent('''
    import agentrl

    @agentrl.environment("{name}")
    class Reverse(agentrl.ToolEnv):
        system_prompt = "Use the tool, then answer with the word."

        def tasks(self, split="train"):
            words = ["stressed", "drawer", "lived"] if split == "train" else ["parts"]
            for i, w in enumerate(words):
                yield {{"id": f"{{split}}-{{i}}", "question": f"Reverse {{w}}", "answer": w[::-1]}}

        @agentrl.tool
        async def reverse(self, text: str) -> str:
            """Reverse a text.

            Args:
                text: the text.
            """
            return text[::-1]

        async def reward(self, task, answer):
            return float(answer.strip() == task["answer"])
''')


def _write(tmp_path: Path, name: str) -> Path:
    path = tmp_path / "elsewhere" / f"{name.replace('-', '_')}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(ENV_FILE.format(name=name))
    return path


def test_a_file_outside_the_project_registers_its_environment(tmp_path: Path) -> None:
    with pytest.raises(UnknownEnvironmentError, match=r"--env\.import=my_env\.py"):
        lookup("reverse-file-env")
    import_user_code(str(_write(tmp_path, "reverse-file-env")))
    assert "reverse-file-env" in registered()
    env = lookup("reverse-file-env")()
    assert [t["id"] for t in env.tasks("test")] == ["test-0"]


def test_a_module_name_that_does_not_import_says_what_to_give_instead() -> None:
    with pytest.raises(UserCodeError, match="no module named 'no_such_user_module'.*file path"):
        import_user_code("no_such_user_module")
    with pytest.raises(UserCodeError, match="no such file"):
        import_user_code("./nope/missing_env.py")


def test_env_import_is_a_setting_that_takes_one_file_or_several() -> None:
    one = C.load(C.ServeConfig, None, ["--env.import=./my_env.py"])
    assert one.env.imports == ["./my_env.py"]
    many = C.load(C.RunConfig, None, ['--serve.env.import=["a.py", "pkg.envs"]'])
    assert many.serve.env.imports == ["a.py", "pkg.envs"]
    assert "import = " in C.to_toml(one) and C.build(C.ServeConfig, C.to_dict(one)) == one


def test_agentrl_envs_list_imports_a_file_first(tmp_path: Path) -> None:
    path = _write(tmp_path, "reverse-cli-env")
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "envs", "list", "--import", str(path)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "reverse-cli-env" in out.stdout
    missing = subprocess.run([sys.executable, "-m", "agentrl.cli", "envs", "show", "reverse-cli-env"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert missing.returncode != 0 and "--env.import" in missing.stderr
