"""A two-agent team built with OpenAI's Agents SDK (package ``agents``), unmodified: a planner and a
solver, each an ``Agent`` with its own OpenAI client config, run one after the other by
``Runner.run``; the solver checks its answer in a second turn of its own conversation.

Each agent's client comes from its role's variables, ``AGENTRL_ROLE_PLANNER_*`` and
``AGENTRL_ROLE_SOLVER_*`` (base URL, key, model), which agentrl sets when ``env.roles`` names the
roles ``planner`` and ``solver``; bind each to a policy and each trains its own. Without them both
agents use ``OPENAI_BASE_URL`` (one policy, one session), so the program also runs as a plain
scaffold. The only agentrl-specific line turns tracing off (it would upload to OpenAI).

Run: ``--scaffold.command="{python} -m scaffolds.openai_agents_team"`` with
``--env.roles.planner.policy=planner --env.roles.solver.policy=solver``. The answer is the solver's
last output, on stdout.
"""

from __future__ import annotations

import asyncio
import os

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)


def _client(role: str) -> tuple[AsyncOpenAI, str]:
    """The role's OpenAI client and model: its own variables, else the program's default endpoint."""
    def var(name: str) -> str:
        return os.environ.get(f"AGENTRL_ROLE_{role.upper()}_{name}") or os.environ.get(f"OPENAI_{name}", "")
    return AsyncOpenAI(base_url=var("BASE_URL"), api_key=var("API_KEY") or "none"), var("MODEL")


async def main() -> str:
    settings = ModelSettings(max_tokens=int(os.environ.get("AGENTRL_MAX_TOKENS", "64")),
                             temperature=float(os.environ.get("AGENTRL_TEMPERATURE", "1.0")))
    (planner_client, planner_model), (solver_client, solver_model) = _client("planner"), _client("solver")
    planner = Agent(name="planner", instructions="Plan how to solve the task in one or two short steps.",
                    model=OpenAIChatCompletionsModel(model=planner_model, openai_client=planner_client),
                    model_settings=settings)
    solver = Agent(name="solver", instructions="Follow the plan and give the answer.",
                   model=OpenAIChatCompletionsModel(model=solver_model, openai_client=solver_client),
                   model_settings=settings)
    task = os.environ.get("AGENTRL_PROMPT", "What is 2 + 2?")
    try:
        plan = await Runner.run(planner, task, max_turns=1)
        first = await Runner.run(solver, f"Task: {task}\nPlan: {plan.final_output}", max_turns=1)
        again = first.to_input_list() + [{"role": "user", "content": "Check it and give the final answer."}]
        final = await Runner.run(solver, again, max_turns=1)
        return str(final.final_output or "")
    finally:
        await planner_client.close()
        await solver_client.close()


if __name__ == "__main__":
    print(asyncio.run(main()))
