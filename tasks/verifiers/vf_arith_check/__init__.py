"""vf_arith's tasks over two turns: the env asks the agent to check its answer, then scores the final one."""

import verifiers.v1 as vf
from vf_arith import ArithConfig, ArithData, ArithTask, ArithTaskset


class CheckEnvConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()


class CheckEnv(vf.Env[CheckEnvConfig]):
    async def run(self, task, agents):
        async with agents.solver.interaction(task) as interaction:
            segment = await interaction.turn()
            if not segment.terminated:
                await interaction.turn("Check your answer. Reply with the final number only.")


class CheckTaskset(ArithTaskset):
    pass


__all__ = ["ArithConfig", "ArithData", "ArithTask", "CheckEnv", "CheckEnvConfig", "CheckTaskset"]
