"""Harbor tasks as agentrl environments: ``harbor:<task folder>`` or ``harbor:<folder of tasks>``.

A Harbor task is a folder: ``task.toml`` (timeouts, resources, ``[environment]``), ``instruction.md``
(what the agent is asked), ``environment/`` (a Dockerfile and its build context) and ``tests/``
(``test.sh``, which writes the reward to ``/logs/verifier/reward.txt`` or ``reward.json``). The
Harbor framework itself needs Python 3.12 and a registry; agentrl reads the folder directly:

- the environment is built into a local image by agentrl's sandbox builder
  (:func:`agentrl.sandbox.images.build_context_image`, offline), every ``FROM`` pointed at the
  local base image (``base_image``, default ``agentrl/base:bookworm``). Lines appended to the
  Dockerfile fit Harbor's paths to agentrl's locked-down sandbox (read-only root, writable tmpfs
  ``/work`` and ``/tmp``): the task's working directory's files move to ``/opt/agentrl-workdir`` and
  the directory becomes a link to ``/work``; ``/logs`` and ``/tests`` link into ``/tmp``;
- the agent works in that container through one ``bash`` tool (agentrl's own loop, its tool calls
  run with the sandbox's limits) and ends by answering without a tool call;
- the reward is the task's own tests: ``tests/`` is copied in only then (the agent never sees it),
  ``bash /tests/test.sh`` runs in the working directory, and ``reward.json``'s ``reward`` (else
  ``reward.txt``) is the episode's reward. Tests that write neither fail the episode (environment).

A folder of tasks builds one image per task and picks each task's image per episode. Harbor tasks
have no train/test split: both splits are every task unless ``test_tasks`` names the held-out ones.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

from agentrl.env.adapters import AdapterError
from agentrl.env.base import ToolEnv
from agentrl.env.tools import tool
from agentrl.errors import EnvironmentFailure

log = logging.getLogger(__name__)

REPO_TASKS = Path(__file__).resolve().parents[3] / "tasks" / "harbor"  # the tasks shipped with agentrl
WORKDIR_COPY = "/opt/agentrl-workdir"
SYSTEM_PROMPT = ("You are an agent working in a Linux container. Run shell commands with the bash tool; "
                 "your working directory is {workdir}. When the task is done, reply with a short summary "
                 "and no tool call.")
_OUTPUT_CHARS = 4000  # of a command's output shown to the model


@functools.lru_cache(maxsize=256)
def read_task(folder: str) -> dict[str, Any]:
    """A Harbor task folder's definition as agentrl needs it (raises AdapterError if it is not one)."""
    root = Path(folder)
    toml_path, instruction = root / "task.toml", root / "instruction.md"
    if not toml_path.is_file() or not instruction.is_file():
        raise AdapterError(f"{root} is not a Harbor task (needs task.toml and instruction.md)")
    meta = tomllib.loads(toml_path.read_text())
    env_dir = root / "environment"
    dockerfile = env_dir / "Dockerfile"
    env_meta = meta.get("environment") or {}
    if dockerfile.is_file():
        text = dockerfile.read_text()
    elif env_meta.get("docker_image"):
        text = f"FROM {env_meta['docker_image']}\n"  # a registry image: the local base stands in for it
    else:
        text = "FROM base\n"
    workdirs = re.findall(r"^\s*WORKDIR\s+(\S+)", text, re.MULTILINE | re.IGNORECASE)
    workdir = str(env_meta.get("workdir") or (workdirs[-1] if workdirs else "/app"))
    if not (root / "tests" / "test.sh").is_file():
        raise AdapterError(f"{root} has no tests/test.sh")
    digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:8]
    slug = re.sub(r"[^a-z0-9_.-]+", "-", root.name.lower()).strip("-.") or "task"
    return {"name": root.name, "folder": str(root.resolve()), "instruction": instruction.read_text().strip(),
            "dockerfile": text, "context": str(env_dir if env_dir.is_dir() else root), "workdir": workdir,
            "image": f"agentrl/harbor-{slug}-{digest}:latest",
            "agent_timeout_s": float((meta.get("agent") or {}).get("timeout_sec", 600.0)),
            "verifier_timeout_s": float((meta.get("verifier") or {}).get("timeout_sec", 600.0)),
            "metadata": meta.get("metadata") or {}}


def sandbox_lines(workdir: str) -> str:
    """What the built image adds to the task's Dockerfile so Harbor's paths work in agentrl's sandbox."""
    w = shlex.quote(workdir.rstrip("/") or "/")
    move = "" if workdir.rstrip("/") == "/work" else (
        f'if [ -d {w} ] && [ ! -L {w} ]; then cp -a {w}/. {WORKDIR_COPY}/ && rm -rf {w}; fi; '
        f'mkdir -p "$(dirname {w})"; ln -sfn /work {w}; ')
    return ("\n# agentrl: the sandbox's root is read-only; /work and /tmp are its writable tmpfs mounts\n"
            "USER root\n"
            f"RUN mkdir -p {WORKDIR_COPY} && {move}ln -sfn "
            "/tmp/harbor-logs /logs && ln -sfn /tmp/harbor-tests /tests\n"
            # a working directory in the image makes Docker re-create /work as root 0755 over the tmpfs
            "WORKDIR /\n")


def build_task_image(task: dict[str, Any], base: str) -> str:
    from agentrl.sandbox.images import build_context_image

    return build_context_image(
        task["context"], task["image"], task["dockerfile"] + sandbox_lines(task["workdir"]), base=base
    )


class HarborEnv(ToolEnv):
    """Harbor tasks: the agent works in the task's container with a bash tool; the task's tests reward it.

    Args:
        test_tasks: names of tasks held out as the test split (default: every task is in both).
        command_timeout_s: limit of one bash command (capped by the sandbox's exec limit).
        max_turns: assistant messages before the episode is cut (then still scored by the tests).
    """

    tasks_found: tuple[dict[str, Any], ...] = ()  # set on the class registered for each name
    max_turns = 8

    def __init__(self, test_tasks: list[str] | None = None, command_timeout_s: float = 30.0,
                 max_turns: int = 8) -> None:
        super().__init__()
        self.test_tasks = set(test_tasks or [])
        self.command_timeout_s = command_timeout_s
        self.max_turns = max_turns

    def sandbox_image_for(self, task: dict[str, Any]) -> str:
        return str(task["image"])

    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        out = []
        for t in self.tasks_found:
            held_out = t["name"] in self.test_tasks
            if not self.test_tasks or (split == "test") == held_out:
                out.append(
                    {
                        "id": t["name"],
                        "image": t["image"],
                        "folder": t["folder"],
                        "question": t["instruction"],
                    }
                )
        return out

    def _definition(self, task: dict[str, Any]) -> dict[str, Any]:
        return read_task(task["folder"])

    async def reset(self, task: dict[str, Any]):
        opening = await super().reset(task)
        if self.sandbox is None:
            raise EnvironmentFailure("a Harbor task runs in a sandbox, and none is attached")
        d = self._definition(task)
        prep = await self.sandbox.exec(["sh", "-c", f"cp -r {WORKDIR_COPY}/. /work/ 2>/dev/null; "
                                                    "mkdir -p /tmp/harbor-logs/verifier "
                                                    "/tmp/harbor-logs/agent /tmp/harbor-tests"])
        if prep.exit_code != 0:
            raise EnvironmentFailure(f"preparing the task's working directory failed: {prep.stderr[-500:]}")
        opening.messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT.format(workdir=d["workdir"])})
        return opening

    @tool
    async def bash(self, command: str) -> str:
        """Run a shell command in the task's container and return its exit code and output.

        Args:
            command: the command line, run by bash in the working directory.
        """
        assert self.sandbox is not None
        r = await self.sandbox.exec(["bash", "-c", command], timeout=self.command_timeout_s)
        out = (r.stdout + (("\n" + r.stderr) if r.stderr else "")).strip()
        if len(out) > _OUTPUT_CHARS:
            out = out[:_OUTPUT_CHARS // 2] + "\n...[output cut]...\n" + out[-_OUTPUT_CHARS // 2:]
        status = "timed out" if r.timed_out else f"exit code {r.exit_code}"
        return f"[{status}]\n{out}"

    async def reward(self, task: dict[str, Any], answer: str) -> float:
        return await self.run_tests(task)

    async def run_tests(self, task: dict[str, Any]) -> float:
        """Copy the task's tests in, run ``test.sh`` and read the reward it wrote."""
        assert self.sandbox is not None
        d = self._definition(task)
        tests = Path(d["folder"]) / "tests"
        await self.sandbox.exec(["sh", "-c", "rm -rf /tmp/harbor-tests/* /tmp/harbor-logs/verifier/reward.*; "
                                 "mkdir -p /tmp/harbor-tests /tmp/harbor-logs/verifier"])
        for f in sorted(tests.rglob("*")):
            if f.is_file():
                rel = f.relative_to(tests).as_posix()
                await self.sandbox.exec(["mkdir", "-p", str(Path("/tmp/harbor-tests", rel).parent)])
                await self.sandbox.write_file(f"/tmp/harbor-tests/{rel}", f.read_bytes(), mode=0o755)
        r = await self.sandbox.exec(["bash", "/tests/test.sh"], timeout=d["verifier_timeout_s"])
        as_json = await self.sandbox.exec(["cat", "/logs/verifier/reward.json"])
        if as_json.exit_code == 0:  # Harbor: reward.json wins whenever it is there
            try:
                scores = json.loads(as_json.stdout)
                return float(scores["reward"])
            except (ValueError, KeyError, TypeError) as e:
                raise EnvironmentFailure(
                    f"reward.json has no numeric 'reward': {as_json.stdout[:300]!r}"
                ) from e
        as_text = await self.sandbox.exec(["cat", "/logs/verifier/reward.txt"])
        try:
            return float(as_text.stdout.strip())
        except ValueError:
            raise EnvironmentFailure(f"the task's tests wrote no reward (test.sh exit {r.exit_code}): "
                                     f"{(r.stderr or r.stdout)[-500:]}") from None


def find_tasks(folder: Path) -> list[dict[str, Any]]:
    if (folder / "task.toml").is_file():
        return [read_task(str(folder))]
    return [read_task(str(p.parent)) for p in sorted(folder.glob("*/task.toml"))]


def environment_class(rest: str, base: str | None = None) -> type[HarborEnv]:
    from agentrl.sandbox.images import BASE_TAG

    folder = REPO_TASKS if rest in ("", "shipped") else Path(rest).expanduser()
    if not folder.exists() and (REPO_TASKS / rest).exists():
        folder = REPO_TASKS / rest  # a shipped task by its name
    if not folder.is_dir():
        raise AdapterError(f"harbor:{rest}: no such folder; give a Harbor task "
                           "folder (task.toml, instruction.md, environment/, "
                           f"tests/) or a folder of them, e.g. harbor:{REPO_TASKS}")
    found = find_tasks(folder)
    if not found:
        raise AdapterError(f"{folder} holds no Harbor task (no task.toml in it or its subfolders)")
    for t in found:
        build_task_image(t, base or BASE_TAG)
    images = ",".join(dict.fromkeys(t["image"] for t in found))
    return type(f"Harbor_{re.sub(r'[^0-9A-Za-z_]', '_', folder.name)}", (HarborEnv,),
                {"tasks_found": tuple(found), "sandbox_image": images, "__module__": __name__,
                 "__doc__": f"Harbor task{'s' if len(found) > 1 else ''} in {folder}"})


def offered() -> list[tuple[str, str]]:
    out = [("harbor:shipped", f"the {len(find_tasks(REPO_TASKS))} Harbor tasks shipped in {REPO_TASKS}")]
    for t in find_tasks(REPO_TASKS):
        out.append((f"harbor:{t['name']}", t["instruction"].splitlines()[0][:70]))
    return out
