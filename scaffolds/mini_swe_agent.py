"""mini-swe-agent (PyPI ``mini-swe-agent`` 2.x), unmodified, working in the episode's Docker sandbox.

The package's own pieces are used as its users assemble them: ``DefaultAgent`` (its loop: query,
parse the bash tool call, execute, observe, until the submit marker or a limit) and
``LitellmModel`` (its model client: litellm's OpenAI provider, pointed at the session's base
URL, with its ``bash`` tool). What agentrl supplies is what the package asks its users to supply:

- the configuration (``mini_swe_agent.yaml`` beside this file: the package's protocol with short
  templates, which fit the small test model's context; pass ``config=`` for another);
- an environment: mini-swe-agent's ``Environment`` protocol over the episode's sandbox
  (:class:`SandboxEnvironment`: each command runs through the sandbox's exec API, since the
  container has no network and the agent runs on the host; its submit check is the package's
  own, inherited from ``LocalEnvironment``).

mini-swe-agent is synchronous: it runs in a worker thread, and its commands hop back onto the
serve loop for the sandbox. A cancelled episode (wall-clock limit) makes the next command raise,
which ends the agent's loop. Offline settings, set before the package is imported: litellm reads
its bundled model-cost map (``LITELLM_LOCAL_MODEL_COST_MAP``), cost tracking ignores the local
model's missing price, and a refused call is not retried (``MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT=1``:
the router refuses a call beyond the episode's limits with a 400, which ends the run).

Run: ``--scaffold.agent=scaffolds.mini_swe_agent:agent`` with ``--env.name=swe``.
"""

from __future__ import annotations

import asyncio
import os
import platform
import threading
from pathlib import Path
from typing import Any

import yaml

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")

import litellm  # noqa: E402 - after the settings above
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments.local import LocalEnvironment  # noqa: E402
from minisweagent.models.litellm_model import LitellmModel  # noqa: E402
from minisweagent.utils.serialize import recursive_merge  # noqa: E402

CONFIG = Path(__file__).with_name("mini_swe_agent.yaml")
litellm.suppress_debug_info = True  # its "Provider List" banner on every priceless call


class EpisodeCancelled(RuntimeError):
    """The episode ended (its time limit) while mini-swe-agent was still working."""


class SandboxEnvironment(LocalEnvironment):
    """mini-swe-agent's environment protocol, its commands run in the episode's sandbox."""

    def __init__(
        self, sandbox: Any, loop: asyncio.AbstractEventLoop, stop: threading.Event, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.sandbox, self.loop, self.stop = sandbox, loop, stop

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        if self.stop.is_set():
            raise EpisodeCancelled("the episode ended")
        limit = timeout or self.config.timeout
        run = self.sandbox.exec(
            action.get("command", ""), timeout=limit, cwd=cwd or self.config.cwd or "/work"
        )
        try:
            r = asyncio.run_coroutine_threadsafe(run, self.loop).result(limit + 30)
            output = {"output": r.stdout + r.stderr, "returncode": -1 if r.timed_out else r.exit_code,
                      "exception_info": f"the command timed out after {limit} s" if r.timed_out else ""}
        except Exception as e:  # the sandbox failed the command: the agent sees it, as with its own envs
            output = {"output": "", "returncode": -1, "exception_info": "An error occurred while "
                                                                        "executing the command: "
                                                                        f"{type(e).__name__}: {e}"}
        self._check_finished(output)  # raises Submitted on the marker (mini-swe-agent's own check)
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        # LocalEnvironment adds the host's environment variables; the sandbox is not the host
        return recursive_merge(self.config.model_dump(), platform.uname()._asdict(), kwargs)


def build(ctx: Any, loop: asyncio.AbstractEventLoop, stop: threading.Event, config: Path | str = CONFIG,
          model_kwargs: dict[str, Any] | None = None) -> DefaultAgent:
    """mini-swe-agent's agent for one episode: its model at the session's base URL, its environment the
    sandbox."""
    cfg = yaml.safe_load(Path(config).read_text())
    model_cfg = dict(cfg.get("model") or {})
    kwargs = {
        "api_base": ctx.base_url,
        "api_key": ctx.api_key,
        "max_tokens": ctx.max_tokens,
        "temperature": ctx.temperature,
        **(model_cfg.pop("model_kwargs", None) or {}),
        **(model_kwargs or {}),
    }
    model = LitellmModel(model_name=f"openai/{ctx.model}", model_kwargs=kwargs, cost_tracking="ignore_errors",
                         **model_cfg)
    env = SandboxEnvironment(ctx.sandbox, loop, stop, **(cfg.get("environment") or {}))
    return DefaultAgent(model, env, **(cfg.get("agent") or {}))


async def agent(ctx: Any, *, config: Path | str = CONFIG, model_kwargs: dict[str, Any] | None = None) -> str:
    """agentrl scaffold entry point: mini-swe-agent's submission ("" when it stopped at a limit)."""
    if ctx.sandbox is None:
        raise RuntimeError("mini-swe-agent needs an environment with a sandbox (e.g. swe)")
    stop = threading.Event()
    runner = build(ctx, asyncio.get_running_loop(), stop, config, model_kwargs)
    try:
        result = await asyncio.to_thread(runner.run, ctx.prompt)
    finally:
        stop.set()
    return str(result.get("submission") or "")
