"""Small additions for verifiers: one question, a weighted rubric (correct 1.0, concise 0.2)."""

import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf

SYSTEM_PROMPT = "Answer with the number only."


class ArithConfig(vf.TasksetConfig):
    num_tasks: int = 200
    seed: int = 0
    max_operand: int = 20


class ArithData(vf.TaskData):
    answer: int


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
        return 1.0 if numbers and int(numbers[-1]) == task.answer else 0.0

    @vf.reward(weight=0.2)
    async def concise(self, trace: vf.Trace) -> float:
        return 1.0 if len((trace.last_reply or "").split()) <= 3 else 0.0


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self) -> Iterator[ArithTask]:
        rng = random.Random(self.config.seed)
        for i in range(self.config.num_tasks):
            a, b = rng.randint(0, self.config.max_operand), rng.randint(0, self.config.max_operand)
            yield ArithTask(
                ArithData(
                    id=f"arith-{i}", prompt=f"What is {a} + {b}?", system_prompt=SYSTEM_PROMPT, answer=a + b
                ),
                self.config.task,
            )


__all__ = ["ArithConfig", "ArithData", "ArithTask", "ArithTaskset"]
