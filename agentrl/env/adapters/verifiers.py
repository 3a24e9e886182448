"""verifiers environments as agentrl environments: ``verifiers:<taskset module>``.

A verifiers 0.4 environment is a taskset package (tasks, their weighted ``@vf.reward`` rubric,
tools) and optionally its own ``Env`` (how agents play a task: one turn, several, several agents).
agentrl runs verifiers' own rollout, ``Env.run_episode``, unchanged, and gives it an endpoint whose
every call is a call of the episode's policy: the relay (:mod:`agentrl.env.adapters.relay`) turns
each request verifiers' agent sends into the episode's ``Model.chat``, which the router renders,
generates and records token for token. verifiers never renders or tokenises anything itself (its
``eval`` client forwards the agent's requests as they are), so the samples are the engine's exact
ids; the reward is the episode's traces' weighted rubric score, as verifiers computes it.

Why verifiers runs in another process: verifiers 0.4 pins ``openai<3`` and agentrl's scaffolds
extra needs openai 3, so it lives in its own virtual environment (``.venv-verifiers``; see
docs/environments.md). :mod:`agentrl.env.adapters._verifiers_worker` runs there, one process per
serve process, and plays the episodes it is asked for concurrently. Its interpreter is, in order:
``python=`` in the environment's config, ``$AGENTRL_VERIFIERS_PYTHON``, this interpreter when it has
verifiers, ``.venv-verifiers/bin/python`` in the project.

Names: ``verifiers:<module>`` is found where the worker imports it from (verifiers' built-in
tasksets, ``tasks/verifiers/``, the working directory, ``$AGENTRL_VERIFIERS_PATH``, the installed
packages of its interpreter); a name found nowhere is refused when it is looked up, saying where it
looked. A task's opening carries the tools verifiers' agent will offer on it (its task's and
taskset's tool servers', listed with the tasks by the worker without starting them).

Multi-agent environments: a verifiers ``Env`` that declares two or more agents (``AgentConfig``
fields on its config, e.g. the built-in ``user-sim``'s ``assistant`` and ``user``; picked with
``env_args: {id: ...}`` or by the taskset's own ``Env``) is an agentrl multi-agent environment whose
roles are its agents, by their field names. Each agent's calls go to its own relay, in front of its
role's agent (:class:`~agentrl.env.roles.Agent`), so ``env.roles`` binds each to the default policy,
a named LoRA policy, the frozen base, a lagged policy or an endpoint, and its calls are recorded in
its role's session (the agent's own ``model``/``client`` in verifiers' config give way to the
binding). Each role's reward is the mean of its agent's traces' rewards (``Played.role_rewards``);
the episode's reward is the mean over the traces verifiers trains. An agent the env's ``setup``
marks untrainable (``agents.user.trainable = False``) is reported in ``info["untrainable"]``, and a
binding that trains it is warned about. An env with one agent plays as before: that agent is the
episode's policy.

Splits: verifiers tasksets have none; the last ``num_test`` tasks are held out (never trained on),
or ``eval_taskset_args`` names the taskset arguments of a separate evaluation set.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import functools
import importlib.util
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from agentrl.env.adapters import AdapterError
from agentrl.env.base import Model, Played, Reset
from agentrl.env.roles import ROLE_NAME, Agent, MultiAgentEnv
from agentrl.procs import tied_to_this_process

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Mapping

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[3]
REPO_TASKSETS = ROOT / "tasks" / "verifiers"  # the verifiers environments shipped with agentrl
WORKER = Path(__file__).with_name("_verifiers_worker.py")


def interpreter(python: str = "") -> str | None:
    """The Python that has verifiers (see the module docstring), or None."""
    for candidate in (python, os.environ.get("AGENTRL_VERIFIERS_PYTHON", "")):
        if candidate:
            return candidate
    if importlib.util.find_spec("verifiers") is not None:
        return sys.executable
    for root in (Path.cwd(), ROOT):
        venv = root / ".venv-verifiers" / "bin" / "python"
        if venv.exists():
            return str(venv)
    return None


def available() -> bool:
    return interpreter() is not None


def _search_path() -> list[tuple[str, list[Path]]]:
    """Where the worker finds a taskset module besides verifiers' own and its installed packages, as
    (what, folders), in the order of its ``PYTHONPATH``."""
    extra = [Path(p) for p in os.environ.get("AGENTRL_VERIFIERS_PATH", "").split(os.pathsep) if p]
    return [(f"tasks/{REPO_TASKSETS.name}/", [REPO_TASKSETS]), ("the working directory", [Path.cwd()]),
            ("$AGENTRL_VERIFIERS_PATH", extra)]


def _worker_env() -> dict[str, str]:
    paths = [str(folder) for _, folders in _search_path() for folder in folders]
    # verifiers' environment must not see agentrl's packages (another openai); its own venv has its own
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


class Listing(NamedTuple):
    """A taskset's tasks (wire data), the OpenAI tools each one's agent is offered, and the env's agents
    (name -> whether its ``setup`` leaves it trainable)."""

    tasks: tuple[dict[str, Any], ...]
    tools: tuple[list[dict[str, Any]], ...]
    agents: tuple[tuple[str, bool], ...] = ()


@functools.lru_cache(maxsize=32)
def list_tasks(python: str, spec_json: str) -> Listing:
    """The taskset's tasks and their tools, listed once per process by a one-shot worker."""
    r = subprocess.run([python, "-P", str(WORKER), "tasks", spec_json], capture_output=True, text=True,
                       env=_worker_env(), timeout=600)
    if r.returncode != 0:
        raise AdapterError(f"verifiers could not load {json.loads(spec_json)['taskset']!r}: "
                           f"{r.stderr.strip()[-1500:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return Listing(tuple(out["tasks"]), tuple(out["tool_sets"][i] for i in out["tools_of"]),
                   tuple((str(k), bool(v)) for k, v in (out.get("agents") or {}).items()))


class _Worker:
    """The long-lived worker process and its requests in flight (futures by request id)."""

    def __init__(self, python: str) -> None:
        self.python = python
        self.proc: asyncio.subprocess.Process | None = None
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.ids = itertools.count(1)
        self.lock = asyncio.Lock()
        self.ready: asyncio.Future[None] | None = None
        self.reader: asyncio.Task[None] | None = None
        self.keeper: AsyncGenerator[None, None] | None = None

    async def start(self) -> None:
        async with self.lock:
            if self.proc is not None and self.proc.returncode is None:
                return
            loop = asyncio.get_running_loop()
            self.ready = loop.create_future()
            self.proc = await asyncio.create_subprocess_exec(
                self.python,
                "-P",
                str(WORKER),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=None,
                env=_worker_env(),
                limit=64 << 20,
                start_new_session=True,
                preexec_fn=tied_to_this_process(),
            )
            self.reader = asyncio.create_task(self._read())
            self.keeper = _until_loop_ends(self)
            await self.keeper.__anext__()
            await asyncio.wait_for(asyncio.shield(self.ready), timeout=600)

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            with contextlib.suppress(ValueError):
                msg = json.loads(line)
                if msg.get("ready") and self.ready is not None and not self.ready.done():
                    self.ready.set_result(None)
                future = self.pending.pop(msg.get("id"), None)
                if future is not None and not future.done():
                    future.set_result(msg)
        why = RuntimeError(f"the verifiers worker exited (code {self.proc.returncode})")
        if self.ready is not None and not self.ready.done():
            self.ready.set_exception(why)
        for future in self.pending.values():
            if not future.done():
                future.set_exception(why)
        self.pending.clear()

    async def stop(self) -> None:
        """End the worker and its pipes (when the event loop that owns them shuts down)."""
        if self.proc is None:
            return
        with contextlib.suppress(Exception):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            if self.proc.returncode is None:
                self.proc.terminate()
            await asyncio.wait_for(self.proc.wait(), timeout=10)
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(BaseException):
                await self.reader

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        await self.start()
        assert self.proc is not None and self.proc.stdin is not None
        rid = next(self.ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[rid] = future
        self.proc.stdin.write((json.dumps({"id": rid, "op": op, **fields}) + "\n").encode())
        await self.proc.stdin.drain()
        try:
            return await future
        except asyncio.CancelledError:  # the episode's wall clock: stop verifiers' rollout too
            self.pending.pop(rid, None)
            with contextlib.suppress(Exception):
                self.proc.stdin.write((json.dumps({"op": "cancel", "target": rid}) + "\n").encode())
            raise


_workers: dict[str, tuple[asyncio.AbstractEventLoop, _Worker]] = {}


def _worker(python: str) -> _Worker:
    """The worker of this event loop (its pipes belong to the loop that started it; a test that runs
    several loops one after another gets a fresh worker in each, the old one is stopped)."""
    loop = asyncio.get_running_loop()
    held = _workers.get(python)
    if held is None or held[0] is not loop:
        if held is not None and held[1].proc is not None and held[1].proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(held[1].proc.pid, signal.SIGTERM)
        held = _workers[python] = (loop, _Worker(python))
    return held[1]


async def _until_loop_ends(worker: _Worker) -> AsyncGenerator[None, None]:
    """An async generator parked in the loop: asyncio.run finalises it at shutdown, which stops the
    worker before its pipes' loop closes (else their transports are torn down by the GC)."""
    try:
        yield
    finally:
        await worker.stop()
# -P: the worker's folder (this package, whose verifiers.py would shadow the real verifiers) is not
# put on its sys.path


def _spec(taskset_id: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """What the worker loads for an environment built with ``config`` (its keyword arguments)."""
    return {"taskset": taskset_id, "taskset_args": dict(config.get("taskset_args") or {}),
            "env_args": dict(config.get("env_args") or {}), "harness": config.get("harness", "null"),
            "max_tasks": int(config.get("max_tasks", 100_000))}


def _roles_of(taskset_id: str, listing: Listing) -> tuple[str, ...]:
    """The env's agents as roles (none for an env of one agent, which plays as the episode's policy)."""
    names = tuple(name for name, _ in listing.agents)
    if len(names) < 2:
        return ()
    bad = [n for n in names if not ROLE_NAME.fullmatch(n)]
    if bad:
        raise AdapterError(f"verifiers:{taskset_id}'s agents {bad} cannot be agentrl roles: a role is a "
                           "lowercase letter then up to 39 lowercase letters, digits or '_'")
    return names


_warned: set[tuple[str, str]] = set()  # (taskset, role) trained though verifiers does not train it


class VerifiersEnv(MultiAgentEnv):
    """A verifiers environment: its own rollout and rubric, its model calls through the episode's session
    (with several agents, each agent's through its role's; see the module's docstring).

    Args:
        taskset_args: the taskset's config fields (``--env.taskset.*`` in verifiers' CLI).
        env_args: the env config's other fields (e.g. a seat's ``harness`` or ``max_turns``).
        harness: the harness of every seat that pins none (default ``null``: verifiers' chat loop).
        num_test: tasks held out at the end of the taskset (the test split); eval_taskset_args:
            a separate evaluation taskset instead.
        python: the interpreter that has verifiers (default: see the module docstring).
    """

    taskset_id: str = ""  # set on the class registered for each name

    def __init__(
        self,
        taskset_args: dict[str, Any] | None = None,
        env_args: dict[str, Any] | None = None,
        harness: str = "null",
        num_test: int | None = None,
        eval_taskset_args: dict[str, Any] | None = None,
        python: str = "",
        max_tasks: int = 100_000,
    ) -> None:
        found = interpreter(python)
        if found is None:
            raise AdapterError("no Python with verifiers: see docs/environments.md (a .venv-verifiers)")
        self.python = found
        self.spec = _spec(self.taskset_id, {"taskset_args": taskset_args, "env_args": env_args,
                                            "harness": harness, "max_tasks": max_tasks})
        self.eval_spec = {**self.spec, "taskset_args": dict(eval_taskset_args)} if eval_taskset_args else None
        self.num_test = num_test
        self.task: dict[str, Any] = {}
        try:
            listing = list_tasks(self.python, json.dumps(self.spec, sort_keys=True))
        except AdapterError:  # a taskset that does not load says so where its tasks are asked for
            listing = Listing((), ())
        self.roles = _roles_of(self.taskset_id, listing)
        #: the agents verifiers does not train (its env's ``setup`` marks them ``trainable = False``)
        self.untrainable = tuple(name for name, trainable in listing.agents if not trainable and self.roles)

    @classmethod
    def declared_roles(cls, config: Mapping[str, Any]) -> tuple[str, ...]:
        python = interpreter(str(config.get("python") or ""))
        if python is None:
            raise AdapterError("no Python with verifiers: see docs/environments.md (a .venv-verifiers)")
        spec = _spec(cls.taskset_id, config)
        return _roles_of(cls.taskset_id, list_tasks(python, json.dumps(spec, sort_keys=True)))

    def _listed(self, spec: dict[str, Any]) -> tuple[dict[str, Any], ...]:
        return list_tasks(self.python, json.dumps(spec, sort_keys=True)).tasks

    def _spec_of(self, task: dict[str, Any]) -> dict[str, Any]:
        return self.eval_spec if (self.eval_spec is not None and task.get("split") == "test") else self.spec

    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        if self.eval_spec is not None:
            spec = self.eval_spec if split == "test" else self.spec
            return [self._record(split, spec, i, d) for i, d in enumerate(self._listed(spec))]
        rows = self._listed(self.spec)
        held = self.num_test if self.num_test is not None else min(50, len(rows) // 5)
        chosen = range(len(rows) - held, len(rows)) if split == "test" else range(len(rows) - held)
        return [self._record(split, self.spec, i, rows[i]) for i in chosen]

    @staticmethod
    def _record(split: str, spec: dict[str, Any], i: int, data: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": str(data.get("id") or f"{split}-{i}"),
            "idx": i,
            "split": split,
            "prompt": data.get("prompt"),
            "system_prompt": data.get("system_prompt"),
        }

    async def reset(self, task: dict[str, Any]) -> Reset:
        self.task = task
        messages = [{"role": "system", "content": task["system_prompt"]}] if task.get("system_prompt") else []
        prompt = task.get("prompt")
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif isinstance(prompt, list):
            messages.extend(m for m in prompt if isinstance(m, dict))
        # the tools verifiers' agent will offer (its task's tool servers'): what `envs show` shows and
        # what an episode counts as offered
        spec_json = json.dumps(self._spec_of(task), sort_keys=True)
        listed = await asyncio.to_thread(list_tasks, self.python, spec_json)
        tools = listed.tools[int(task["idx"])]
        return Reset(messages=messages, tools=list(tools))

    async def play(self, task: dict[str, Any], model: Model) -> Played:
        if self.roles:  # a multi-agent env: MultiAgentEnv.play hands play_roles one agent per role
            return await super().play(task, model)
        from agentrl.env.adapters.relay import serve_model

        async with serve_model(model) as (base_url, api_key):
            out = await self._rollout(task, base_url=base_url, api_key=api_key, model=model.name)
        return self._played(out)

    async def play_roles(self, task: dict[str, Any], agents: Mapping[str, Agent]) -> Played:
        from agentrl.env.adapters.relay import serve_model

        for role in self.untrainable:
            if agents[role].trained and (self.taskset_id, role) not in _warned:
                _warned.add((self.taskset_id, role))
                log.warning("verifiers:%s marks agent %r not trainable (its env's setup), but env.roles "
                            "binds role %r to a trained policy, so its calls train it; bind it with "
                            "`frozen: true` or an endpoint to leave it untrained",
                            self.taskset_id, role, role)
        async with contextlib.AsyncExitStack() as stack:
            routes: dict[str, dict[str, str]] = {}
            for role in self.roles:  # one relay per role: each agent's calls reach its role's agent
                base_url, api_key = await stack.enter_async_context(serve_model(agents[role]))
                routes[role] = {"base_url": base_url, "api_key": api_key, "model": agents[role].name}
            first = routes[self.roles[0]]
            out = await self._rollout(task, base_url=first["base_url"], api_key=first["api_key"],
                                      model=first["model"], roles=routes)
        played = self._played(out)
        standing = {role: a for role, a in (out.get("agents") or {}).items() if role in self.roles}
        played.role_rewards = {role: float(a["reward"]) for role, a in standing.items()
                               if a.get("reward") is not None}
        played.info["agents"] = standing
        played.info["untrainable"] = sorted(r for r, a in standing.items() if not a.get("trainable", True))
        return played

    async def _rollout(self, task: dict[str, Any], **fields: Any) -> dict[str, Any]:
        """verifiers' own rollout of ``task`` in the worker, its agents calling the given endpoints."""
        worker = _worker(self.python)
        return await worker.call("rollout", env=self._spec_of(task), idx=int(task["idx"]), **fields)

    @staticmethod
    def _played(out: dict[str, Any]) -> Played:
        if out.get("error"):
            raise RuntimeError(f"verifiers raised {out['error']}")
        if not out.get("ok"):
            raise RuntimeError("verifiers' episode failed: "
                               f"{'; '.join(out.get('errors') or ['no reason given'])}"[:3000])
        rewards = {k: {"score": s, "weight": w} for k, (s, w) in (out.get("rewards") or {}).items()}
        return Played(
            reward=float(out["reward"]), info={"rewards": rewards, "metrics": out.get("metrics") or {}}
        )


# Run by verifiers' interpreter with the worker's path; imports nothing (verifiers' import takes
# seconds): verifiers' built-in tasksets, and whether the module verifiers would import is there.
_PROBE = ("import importlib.util as u, json, os, pkgutil, sys\n"
          "v = u.find_spec('verifiers')\n"
          "d = os.path.join(os.path.dirname(v.origin), 'v1', 'tasksets') if v and v.origin else ''\n"
          "builtin = sorted(m.name for m in pkgutil.iter_modules([d])) if d else []\n"
          "m = sys.argv[1]\n"
          "found = bool(m) and (m in builtin or u.find_spec(m.split('.')[0]) is not None)\n"
          "print(json.dumps({'builtin': builtin, 'found': found}))")


def _module_of(taskset_id: str) -> str:
    """The module verifiers imports for a taskset id (``verifiers.v1.utils.loaders._import_plugin``)."""
    return taskset_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def _find(taskset_id: str) -> Path | None:
    """The taskset module's file when it is in one of agentrl's folders (None: verifiers' own or an
    installed one); :class:`AdapterError`, saying where it looked, when it is nowhere."""
    module = _module_of(taskset_id)
    top = module.split(".")[0]
    for _, folders in _search_path():
        for path in (p for f in folders for p in (f / top / "__init__.py", f / f"{top}.py")):
            if path.is_file():
                return path
    python = interpreter()
    if python is None:
        raise AdapterError("no Python with verifiers: see docs/environments.md (a .venv-verifiers)")
    probe = _probe(python, module)
    if probe is None:
        raise AdapterError(f"could not ask {python} whether verifiers has a taskset {taskset_id!r}")
    if probe["found"]:
        return None
    where = "; ".join(f"{what} ({os.pathsep.join(map(str, folders)) or 'unset'})"
                      for what, folders in _search_path())
    raise AdapterError(f"verifiers has no taskset {taskset_id!r}: no module {module!r} in verifiers' "
                       f"built-in tasksets ({', '.join(probe['builtin']) or 'none'}), {where}, or {python}'s "
                       "installed packages; put its folder on $AGENTRL_VERIFIERS_PATH (`agentrl envs list` "
                       "shows what is found)")


def _probe(python: str, module: str) -> dict[str, Any] | None:
    """Run :data:`_PROBE` (None: it answered nothing readable)."""
    r = subprocess.run([python, "-P", "-c", _PROBE, module], capture_output=True, text=True, timeout=120,
                       env=_worker_env())
    with contextlib.suppress(ValueError, IndexError):
        return json.loads(r.stdout.strip().splitlines()[-1])
    log.warning("%s could not list verifiers' tasksets: %s", python, r.stderr.strip()[-300:])
    return None


def environment_class(rest: str) -> type[VerifiersEnv]:
    if not rest or not all(part.isidentifier() for part in rest.replace("-", "_").split(".")):
        raise AdapterError(f"verifiers:{rest}: name a taskset module, e.g. verifiers:vf_arith")
    path = _find(rest)
    about = (_summary(path) if path is not None else "") or f"verifiers environment {rest}"
    return type(f"Verifiers_{rest.replace('-', '_').replace('.', '_')}", (VerifiersEnv,),
                {"taskset_id": rest, "__module__": __name__, "__doc__": about})


def _parsed(path: Path) -> ast.Module | None:
    with contextlib.suppress(OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return ast.parse(path.read_text(encoding="utf-8"))
    return None


def _summary(path: Path) -> str:
    """The first line of a module's docstring, read without importing it."""
    tree = _parsed(path)
    doc = ast.get_docstring(tree) if tree is not None else None
    return doc.strip().splitlines()[0] if doc and doc.strip() else ""


def _imports_verifiers(path: Path) -> bool:
    for node in ast.walk(_parsed(path) or ast.Module(body=[], type_ignores=[])):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(n == "verifiers" or n.startswith("verifiers.") for n in names):
            return True
    return False


def _tasksets_in(folder: Path) -> list[tuple[str, Path]]:
    """The modules in ``folder`` that import verifiers (a package: any of its first 50 files), by name,
    with the file whose docstring describes them."""
    found = []
    for path in sorted([*folder.glob("*/__init__.py"), *folder.glob("*.py")]):
        package = path.name == "__init__.py"
        name = path.parent.name if package else path.stem
        files = list(itertools.islice(path.parent.rglob("*.py"), 50)) if package else [path]
        if name.isidentifier() and any(map(_imports_verifiers, files)):
            found.append((name, path))
    return found


def offered() -> list[tuple[str, str]]:
    """Shipped tasksets, those on ``$AGENTRL_VERIFIERS_PATH`` (modules there that import verifiers),
    then verifiers' built-in ones."""
    shipped = f"shipped in tasks/{REPO_TASKSETS.name}/"
    out = [(f"verifiers:{name}", f"{_summary(path) or 'verifiers taskset'} ({shipped})")
           for name, path in _tasksets_in(REPO_TASKSETS)]
    for folder in dict.fromkeys(dict(_search_path())["$AGENTRL_VERIFIERS_PATH"]):
        out += [(f"verifiers:{name}", f"{_summary(path) or 'verifiers taskset'} (in {folder})")
                for name, path in _tasksets_in(folder)]
    python = interpreter()
    if python:
        probe = _probe(python, "")
        out += [(f"verifiers:{n}", "taskset built into verifiers") for n in (probe or {}).get("builtin", [])]
    return out
