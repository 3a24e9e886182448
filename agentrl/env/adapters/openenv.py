"""OpenEnv environments as agentrl environments: ``openenv:<env>``.

An OpenEnv environment is a server (FastAPI from ``create_app``: ``/reset``, ``/step``, ``/state``
and the ``/ws`` session socket) with typed ``Action``/``Observation`` models and an ``EnvClient``.
agentrl speaks that protocol with the environment's own client: one server process per environment
per serve process (``uvicorn <package>.server.app:app`` on a free loopback port, started on first
use, stopped at exit or when serve dies), one WebSocket session per episode (OpenEnv gives each
session its own environment instance).

``<env>`` is a folder holding ``openenv.yaml`` (the OpenEnv layout: ``models.py``, ``client.py``,
``server/app.py``), the name of one shipped in ``tasks/openenv/``, or an installed OpenEnv package
found by OpenEnv's own discovery (``openenv.auto``).

The model acts in the action's own type: an action with one text field takes the reply's text; any
other action is a tool, ``act``, whose parameters are the action's JSON schema, and a call's
arguments are validated by the action model (a bad call is explained to the model, not raised).
Observations become text (their fields other than done, reward and metadata); every step's reward
counts, and ``done`` ends the episode.

Not done here: OpenEnv environments that must run inside a container are not started in agentrl's
sandboxes (their servers need openenv-core and its web stack inside the image, which the offline
base image lacks); the server runs as a local process.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.env.adapters import AdapterError
from agentrl.env.base import Environment, Message, Reset, StepResult
from agentrl.errors import EnvironmentFailure
from agentrl.procs import tied_to_this_process

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import ModuleType

    from openenv.core.env_server.types import Action

log = logging.getLogger(__name__)

# the OpenEnv environments shipped with agentrl
REPO_ENVS = Path(__file__).resolve().parents[3] / "tasks" / "openenv"
_SKIP_FIELDS = {"done", "reward", "metadata"}
_servers: dict[str, _Server] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """One OpenEnv server process on loopback, shared by every episode of its environment."""

    def __init__(self, app: str, path: str, start_timeout_s: float = 120.0) -> None:
        self.app, self.path, self.start_timeout_s = app, path, start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self._lock = asyncio.Lock()

    async def ensure(self) -> str:
        async with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                return self.url
            port = _free_port()
            env = dict(
                os.environ,
                PYTHONPATH=os.pathsep.join(p for p in (self.path, os.environ.get("PYTHONPATH")) if p),
            )
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", self.app, "--host", "127.0.0.1", "--port", str(port),
                 "--log-level", "warning"], cwd=self.path, env=env, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, start_new_session=True, preexec_fn=tied_to_this_process())
            self.url = f"http://127.0.0.1:{port}"
            await asyncio.to_thread(self._wait_ready)
            log.info("OpenEnv server %s at %s", self.app, self.url)
            return self.url

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = (self.proc.stderr.read() if self.proc.stderr else b"").decode(errors="replace")[-2000:]
                raise EnvironmentFailure(f"the OpenEnv server {self.app} exited "
                                         f"with {self.proc.returncode}: {err}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            time.sleep(0.25)
        self.stop()
        raise EnvironmentFailure(f"the OpenEnv server {self.app} did not answer "
                                 f"/health within {self.start_timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)


@atexit.register
def _stop_servers() -> None:
    for server in _servers.values():
        server.stop()


def _subclass_in(module: ModuleType, base: type) -> type | None:
    found = [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, base) and v is not base
             and v.__module__ == module.__name__]
    return found[0] if found else None


def load_spec(rest: str) -> dict[str, Any]:
    """Where the environment's server, client and models are: {"app", "path", "client", "action", "name"}."""
    from openenv.core import EnvClient
    from openenv.core.env_server.types import Action

    folder = Path(rest).expanduser()
    if not (folder / "openenv.yaml").is_file() and (REPO_ENVS / rest / "openenv.yaml").is_file():
        folder = REPO_ENVS / rest
    if (folder / "openenv.yaml").is_file():
        import yaml

        manifest = yaml.safe_load((folder / "openenv.yaml").read_text()) or {}
        package, parent = folder.resolve().name, str(folder.resolve().parent)
        if parent not in sys.path:
            sys.path.insert(0, parent)  # the environment is a package: its client imports .models
        client_mod = importlib.import_module(f"{package}.client")
        models_mod = importlib.import_module(f"{package}.models")
        client, action = _subclass_in(client_mod, EnvClient), _subclass_in(models_mod, Action)
        if client is None or action is None:
            raise AdapterError(f"{folder}: no EnvClient subclass in client.py "
                               "or no Action subclass in models.py")
        app = f"{package}.{manifest.get('app', 'server.app:app')}"
        return {
            "app": app,
            "path": parent,
            "client": client,
            "action": action,
            "name": manifest.get("name", package),
        }
    from openenv.auto._discovery import get_discovery

    info = (
        get_discovery().get_environment_by_name(rest)
        if hasattr(get_discovery(), "get_environment_by_name")
        else None
    )
    if info is None:
        raise AdapterError(f"openenv:{rest}: not a folder with openenv.yaml, not shipped "
                           f"in {REPO_ENVS}, and not an installed OpenEnv package")
    package = info.client_module_path.rsplit(".", 1)[0]
    return {"app": f"{package}.server.app:app", "path": "", "client": info.get_client_class(),
            "action": info.get_action_class(), "name": info.name}


def observation_text(observation: Any) -> str:
    data = observation.model_dump() if hasattr(observation, "model_dump") else dict(observation)
    parts = [f"{k}: {v if isinstance(v, str) else json.dumps(v, default=str)}" for k, v in data.items()
             if k not in _SKIP_FIELDS]
    return "\n".join(parts)


class OpenEnvEnv(Environment):
    """An OpenEnv environment over its own client; the model's replies become typed actions.

    Args:
        num_train / num_test: tasks (reset seeds) per split; test seeds are disjoint from train seeds.
        system_prompt: the opening system message (default: says how to act).
        reset_kwargs: more keyword arguments for the environment's reset.
    """

    spec: dict[str, Any] = {}  # set on the class registered for each name

    def __init__(self, num_train: int = 10_000, num_test: int = 100, system_prompt: str = "",
                 reset_kwargs: dict[str, Any] | None = None, message_timeout_s: float = 60.0) -> None:
        self.num_train, self.num_test = num_train, num_test
        self.reset_kwargs = dict(reset_kwargs or {})
        self.message_timeout_s = message_timeout_s
        action = self.spec["action"]
        fields = {k: f for k, f in action.model_fields.items() if k not in _SKIP_FIELDS}
        self.text_field = (
            next(iter(fields)) if len(fields) == 1 and next(iter(fields.values())).annotation is str else None
        )
        self.system_prompt = system_prompt or (
            f"You are playing the {self.spec['name']} environment. "
            + ("Reply with your action as plain text." if self.text_field else "Act by calling the act tool.")
        )
        self.client: Any = None
        self.errors = 0

    def tool_schemas(self) -> list[dict[str, Any]]:
        if self.text_field:
            return []
        schema = self.spec["action"].model_json_schema()
        props = {k: v for k, v in schema.get("properties", {}).items() if k not in _SKIP_FIELDS}
        params = {"type": "object", "properties": props,
                  "required": [k for k in schema.get("required", []) if k in props]}
        return [
            {
                "type": "function",
                "function": {
                    "name": "act",
                    "description": schema.get("description") or f"Take one action in {self.spec['name']}",
                    "parameters": params,
                },
            }
        ]

    def tasks(self, split: str = "train") -> Iterator[dict[str, Any]]:
        offset, n = (0, self.num_train) if split == "train" else (1 << 30, self.num_test)
        for i in range(n):
            yield {"id": f"{split}-{i}", "seed": offset + i}

    async def reset(self, task: dict[str, Any]) -> Reset:
        server = _servers.setdefault(self.spec["app"], _Server(self.spec["app"], self.spec["path"]))
        url = await server.ensure()
        self.client = self.spec["client"](base_url=url, message_timeout_s=self.message_timeout_s)
        await self.client.connect()
        result = await self.client.reset(seed=task.get("seed"), **self.reset_kwargs)
        return Reset(messages=[{"role": "system", "content": self.system_prompt},
                               {"role": "user", "content": observation_text(result.observation)}],
                     tools=self.tool_schemas())

    async def _act(self, action: Action) -> tuple[str, float, bool]:
        result = await self.client.step(action)
        return observation_text(result.observation), float(result.reward or 0.0), bool(result.done)

    async def step(self, message: Message) -> StepResult:
        action_cls = self.spec["action"]
        if self.text_field:
            text, reward, done = await self._act(
                action_cls(**{self.text_field: message.get("content") or ""})
            )
            return StepResult(messages=[] if done else [{"role": "user", "content": text}], reward=reward,
                              terminated=done)
        calls = message.get("tool_calls") or []
        if not calls:
            self.errors += 1
            return StepResult(messages=[{"role": "user", "content": "Error: act by calling the act tool."}],
                              info={"action_errors": self.errors})
        out: list[Message] = []
        total = 0.0
        for call in calls:
            raw = (call.get("function") or {}).get("arguments") or "{}"
            try:
                action = action_cls.model_validate(json.loads(raw) if isinstance(raw, str) else raw)
            except Exception as e:  # the model's malformed action: explained to it, not raised
                self.errors += 1
                out.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": "Error: invalid "
                                                                                           f"action: {e}"})
                continue
            text, reward, done = await self._act(action)
            total += reward
            out.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": text})
            if done:
                return StepResult(
                    messages=[], reward=total, terminated=True, info={"action_errors": self.errors}
                )
        return StepResult(messages=out, reward=total, info={"action_errors": self.errors})

    async def close(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()


def environment_class(rest: str) -> type[OpenEnvEnv]:
    try:
        spec = load_spec(rest)
    except AdapterError:
        raise
    except Exception as e:
        raise AdapterError(f"openenv:{rest} could not be loaded: {type(e).__name__}: {e}") from e
    return type(f"OpenEnv_{spec['name']}", (OpenEnvEnv,), {"spec": spec, "__module__": __name__,
                                                          "__doc__": f"OpenEnv environment {spec['name']}"})


def offered() -> list[tuple[str, str]]:
    out = [(f"openenv:{p.parent.name}", f"OpenEnv environment shipped in tasks/{REPO_ENVS.name}/")
           for p in sorted(REPO_ENVS.glob("*/openenv.yaml"))]
    with contextlib.suppress(Exception):
        from openenv.auto._discovery import get_discovery

        for key, info in sorted(get_discovery().discover().items()):
            out.append((f"openenv:{key}", f"installed OpenEnv package {info.package_name}"))
    return out


