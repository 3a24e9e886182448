"""The verifiers side of ``verifiers:<taskset>``: runs in verifiers' own interpreter, not in agentrl's.

verifiers 0.4 pins ``openai<3`` while agentrl's other extras need openai 3, so its code runs in its
own virtual environment (``.venv-verifiers``), in this process, started by
:mod:`agentrl.env.adapters.verifiers`. It imports only the standard library and verifiers (never
agentrl) and speaks JSON lines on stdin/stdout:

- ``{"id", "op": "tasks", "env": {...}}`` -> ``{"id", "tasks": [wire task data, ...], "tool_sets": [[OpenAI
  tool, ...], ...], "tools_of": [index into tool_sets per task], "agents": {name: trainable}}`` (the tools
  each task's agent is offered; the env's agents, its ``AgentConfig`` fields in declaration order, and
  whether its ``setup`` leaves each trainable);
- ``{"id", "op": "rollout", "env": {...}, "idx": n, "base_url", "api_key", "model", "roles"?}`` -> ``{"id",
  "reward", "rewards", "metrics", "errors", "ok", "turns", "agents"}``: verifiers' own
  ``Env.run_episode`` on the task, its agents talking to ``base_url`` (agentrl's relay into the
  episode's router session), scored by the task's own weighted ``@vf.reward`` functions. With
  ``roles`` (``{agent: {"base_url", "api_key", "model"}}``, a multi-agent env) each agent talks to its
  own endpoint instead (its role's relay), and ``agents`` gives each agent's reward (the mean of its
  traces'), trace count and standing (``trainable``, as the env's ``setup`` left it);
- ``{"id", "op": "cancel", "target": id}`` cancels a rollout (the episode's wall clock ran out).

Requests run concurrently. Two changes to verifiers' machinery, and why: harness programs are
normally provisioned by ``uv`` from a package index at run time; here a harness script runs with
this interpreter, which already has the chat program's dependencies (they are verifiers' own), so
nothing is installed while episodes run. And a tool server started on this machine reports its port
in ``/tmp/vf-port-<hex>``, which verifiers never removes (one file per tool episode): it is removed
once read.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import json
import os
import sys
import traceback
import types
from pathlib import Path
from typing import Any

# the episode's per-agent endpoints (agent -> {"base_url", "api_key", "model"}), read by the env's
# wrapped ``setup``, which verifiers calls in the rollout's own task with the episode's agents
_routes: contextvars.ContextVar[dict[str, dict[str, str]] | None] = contextvars.ContextVar(
    "routes", default=None)
# and what that setup left each agent's standing (agent -> trainable), for the reply
_standing: contextvars.ContextVar[dict[str, bool] | None] = contextvars.ContextVar("standing", default=None)


def _offline_scripts() -> None:
    from verifiers.v1.runtimes.base import Runtime

    async def prepare_uv_script(self: Any, script: str | bytes, env: dict[str, str] | None = None, *,
                                activate: bool = True) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        folder = Path(getattr(self, "scripts_dir", "/tmp/agentrl-vf-scripts"))
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{hashlib.sha256(data).hexdigest()}.py"
        if not path.exists():
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        return [sys.executable, str(path)]

    Runtime.prepare_uv_script = prepare_uv_script  # type: ignore[method-assign]


def _port_files_removed() -> None:
    from verifiers.v1.mcp import launch

    read_back = launch._read_back_port

    async def read_back_port(runtime: Any, path: str) -> int:
        try:
            return await read_back(runtime, path)
        finally:  # read, failed or cancelled: the file is no use any more
            if runtime.type == "subprocess":  # a sandbox's files go with the sandbox
                with contextlib.suppress(OSError):
                    os.unlink(path)

    launch._read_back_port = read_back_port  # serve_in_runtime looks it up by name at each call


def resolve(spec: dict[str, Any]) -> Any:
    """The env config: the taskset and its arguments, and every seat's harness (default ``null``,
    verifiers' plain chat loop) and runtime (default ``subprocess``: verifiers' own default is its
    hosted sandboxes, which need an account and the internet) unless ``env_args`` pins them."""
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import agent_config_fields

    raw = {"taskset": {"id": spec["taskset"], **spec.get("taskset_args", {})}, **spec.get("env_args", {})}
    seats = agent_config_fields(vf.resolve_env_config(raw))
    for seat in seats:
        raw.setdefault(seat, {}).setdefault("harness", {"id": spec.get("harness", "null")})
        raw[seat].setdefault("runtime", {"type": spec.get("runtime", "subprocess")})
    return vf.resolve_env_config(raw)


async def tool_schemas(servers: list[Any]) -> list[dict[str, Any]]:
    """The tools an agent is offered for these verifiers tool servers, in the OpenAI shape verifiers'
    harnesses build (``harnesses/utils/mcp.py``, ``connect_mcp``): each server's MCP tools, named
    ``<server>_<tool>`` (bare when its ``TOOL_PREFIX`` is None). Read from the servers' registrations,
    without starting them."""
    from mcp.server.mcpserver import MCPServer

    out: list[dict[str, Any]] = []
    for server in servers:
        mcp = MCPServer(server.server_name or type(server).__name__)
        server.register(mcp)
        for tool in await mcp.list_tools():
            name = f"{server.server_name}_{tool.name}" if server.server_name else tool.name
            out.append({"type": "function", "function": {"name": name, "description": tool.description or "",
                                                         "parameters": tool.input_schema}})
    return out


def agent_names(env: Any) -> list[str]:
    from verifiers.v1.configs.agent import agent_config_fields

    return list(agent_config_fields(env.config))


async def standing(env: Any) -> dict[str, bool]:
    """Each agent of the env and whether its ``setup`` leaves it trainable, read by running ``setup``
    on stand-ins that only carry ``trainable`` (all trainable when setup needs more of them)."""
    import verifiers.v1 as vf

    agents = vf.Agents(env.config, lambda name, spec: types.SimpleNamespace(name=name, trainable=True))
    try:
        await env.setup(agents)
    except Exception:  # a setup that uses more than an agent's standing: no standing known before a run
        return dict.fromkeys(agent_names(env), True)
    return {name: bool(getattr(agents, name).trainable) for name in agent_names(env)}


def route_agents(env: Any) -> None:
    """Wrap the env's ``setup`` so that an episode given ``roles`` points each agent at its own
    endpoint (model and client) before the env's own setup, and records the agents' standing after.
    ``setup`` is the one hook verifiers hands the episode's agents to before they run."""
    from verifiers.v1.clients import EvalClientConfig, ModelContext

    own = env.setup

    async def setup(agents: Any) -> None:
        routes = _routes.get()
        for name in agent_names(env) if routes is not None else ():
            agent, route = getattr(agents, name), routes[name]
            client = EvalClientConfig(base_url=route["base_url"], api_key_var="AGENTRL_RELAY_KEY")
            agent.config = agent.config.model_copy(update={"model": route["model"], "client": client})
            agent.ctx = ModelContext(model=route["model"], client=client, sampling=agent.ctx.sampling)
        await own(agents)
        seen = _standing.get()
        if seen is not None:
            seen.update({name: bool(getattr(agents, name).trainable) for name in agent_names(env)})

    env.setup = setup


async def listing(env: Any, tasks: list[Any]) -> dict[str, Any]:
    """The tasks' wire data and the tools each one's agent is offered (its task's tool servers, then the
    taskset's shared ones), each distinct tool list once."""
    shared = env.taskset.toolsets(env.taskset.config)
    sets: dict[str, int] = {}
    tool_sets: list[list[dict[str, Any]]] = []
    tools_of: list[int] = []
    for t in tasks:
        key = f"{type(t).__module__}.{type(t).__qualname__}:{t.config.model_dump_json()}"
        if key not in sets:
            sets[key] = len(tool_sets)
            tool_sets.append(await tool_schemas([*t.toolsets(t.config), *shared]))
        tools_of.append(sets[key])
    return {"tasks": [t.data.model_dump(mode="json", exclude_none=True) for t in tasks],
            "tool_sets": tool_sets, "tools_of": tools_of, "agents": await standing(env)}


def list_tasks(spec: dict[str, Any]) -> dict[str, Any]:
    import verifiers.v1 as vf

    env = vf.load_environment(resolve(spec))
    return asyncio.run(listing(env, list(env.taskset.take(int(spec.get("max_tasks", 100_000))))))


class Worker:
    def __init__(self) -> None:
        self.envs: dict[str, Any] = {}  # env config (json) -> (env, tasks)
        self.stack = contextlib.AsyncExitStack()
        self.running: dict[Any, asyncio.Task[Any]] = {}
        self.lock = asyncio.Lock()

    async def env(self, spec: dict[str, Any]) -> tuple[Any, list[Any]]:
        import verifiers.v1 as vf

        key = json.dumps(spec, sort_keys=True)
        async with self.lock:
            if key not in self.envs:
                env = vf.load_environment(resolve(spec))
                route_agents(env)
                await self.stack.enter_async_context(env.serving())
                tasks = list(env.taskset.take(int(spec.get("max_tasks", 100_000))))
                self.envs[key] = (env, tasks)
            return self.envs[key]

    async def tasks(self, req: dict[str, Any]) -> dict[str, Any]:
        env, tasks = await self.env(req["env"])
        return await listing(env, tasks)

    async def rollout(self, req: dict[str, Any]) -> dict[str, Any]:
        import verifiers.v1 as vf

        env, tasks = await self.env(req["env"])
        task = tasks[int(req["idx"])]
        # the relay reads its episode from the URL, not the key: one variable serves every episode
        os.environ["AGENTRL_RELAY_KEY"] = req["api_key"]
        ctx = vf.ModelContext(model=req["model"], client=vf.EvalClientConfig(base_url=req["base_url"],
                                                                             api_key_var="AGENTRL_RELAY_KEY"))
        roles = req.get("roles")
        if roles is not None and set(roles) != set(agent_names(env)):
            raise ValueError(f"roles {sorted(roles)} are not the env's agents {agent_names(env)}")
        _routes.set(roles)  # this request's task only: concurrent episodes each have their own
        seen: dict[str, bool] = {}
        _standing.set(seen)
        episode = await env.run_episode(task, ctx)
        traces = list(episode.traces)
        agents: dict[str, dict[str, Any]] = {}
        for t in traces:
            name = t.agent.name if t.agent is not None else "agent"
            a = agents.setdefault(name, {"rewards": [], "trainable": seen.get(name, True)})
            a["rewards"].append(t.reward)
            a["trainable"] = a["trainable"] and (t.agent is None or bool(t.agent.trainable))
        for name, trainable in seen.items():
            agents.setdefault(name, {"rewards": [], "trainable": trainable})
        agents = {name: {"reward": sum(a["rewards"]) / len(a["rewards"]) if a["rewards"] else None,
                         "traces": len(a["rewards"]), "trainable": a["trainable"]}
                  for name, a in agents.items()}
        # a multi-agent episode's reward is its trainable agents' (verifiers': the traces that train the
        # policy); a simulated user's or a judge's trace has a reward of its own task, or none
        scored = [t for t in traces if roles is None or t.agent is None or t.agent.trainable] or traces
        rewards = {
            name: (r.score, r.weight) for t in traces for name, r in t.rewards.items() if r is not None
        }
        metrics = {name: v for t in traces for name, v in t.metrics.items() if v is not None}
        errors = [f"{e.type}: {e.message}" for e in episode.errors] + [
            f"{e.type}: {e.message}" for t in traces for e in getattr(t, "errors", [])]
        return {
            "reward": sum(t.reward for t in scored) / max(1, len(scored)),
            "rewards": rewards,
            "metrics": metrics,
            "errors": errors,
            "ok": bool(episode.ok),
            "timeout": bool(episode.is_timeout),
            "agents": agents,
        }

    async def handle(self, req: dict[str, Any], out: asyncio.Queue[dict[str, Any]]) -> None:
        try:
            fn = {"tasks": self.tasks, "rollout": self.rollout}[req["op"]]
            reply = await fn(req)
        except asyncio.CancelledError:
            reply = {"cancelled": True}
        except Exception as e:  # reported to agentrl, which fails the episode as an environment error
            reply = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        finally:
            self.running.pop(req.get("id"), None)
        await out.put({"id": req.get("id"), **reply})

    async def main(self) -> None:
        _offline_scripts()
        _port_files_removed()
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=64 << 20)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        out: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        async def write() -> None:
            while True:
                msg = await out.get()
                sys.stdout.write(json.dumps(msg, default=str) + "\n")
                sys.stdout.flush()

        writer = asyncio.create_task(write())
        await out.put({"id": None, "ready": True})
        try:
            while line := await reader.readline():
                req = json.loads(line)
                if req.get("op") == "cancel":
                    task = self.running.get(req.get("target"))
                    if task is not None:
                        task.cancel()
                    continue
                self.running[req.get("id")] = asyncio.create_task(self.handle(req, out))
        finally:
            for task in list(self.running.values()):
                task.cancel()
            await self.stack.aclose()
            while not out.empty():
                await asyncio.sleep(0.01)
            writer.cancel()


if __name__ == "__main__":
    # verifiers logs to stderr; stdout carries only the protocol
    if sys.argv[1:2] == ["tasks"]:  # one-shot: the task list of the env in argv[2] (JSON), as JSON
        print(json.dumps(list_tasks(json.loads(sys.argv[2])), default=str))
    else:
        asyncio.run(Worker().main())
