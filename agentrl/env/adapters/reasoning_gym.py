"""reasoning-gym datasets as agentrl environments: ``reasoning_gym:<dataset>`` and ``reasoning_gym:mix``.

Any of reasoning-gym's procedural datasets is a task source: the train split is the dataset
generated with ``seed``, the test split the one generated with ``seed + TEST_SEED_OFFSET``, and any
train question that also appears among the test questions is skipped, so the splits never overlap.
An episode is one turn: reasoning-gym's system prompt and the question; the reply is read with
reasoning-gym's own parser (``extract_answer``: the last ``<answer>...</answer>``) and scored by the
dataset's own ``score_answer``: the reward is that score (partial credit, e.g. 0.05 for a
well-formed wrong answer in some datasets), and ``info["success"]`` is the exact answer (score 1),
what ``agentrl eval`` counts as solved. ``reasoning_gym:mix`` is reasoning-gym's
``CompositeDataset``: several datasets sampled with weights (``datasets={"basic_arithmetic": 2,
"chain_sum": {"weight": 1, "config": {...}}}``).

Invariants: a task names its entry by split and index; scoring regenerates that entry from the
(seeded, cached) dataset, so what is scored is the ecosystem's own record, not a JSON copy of it.
The verifier runs in a daemon thread (:func:`~agentrl.env.adapters._bounded.in_thread`): one that
hangs is cut by the episode's wall clock, never the event loop.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import reasoning_gym
from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

if TYPE_CHECKING:
    from reasoning_gym.dataset import ProceduralDataset

from agentrl.env.adapters import AdapterError
from agentrl.env.adapters._bounded import in_thread
from agentrl.env.base import SUCCESS_KEY, Environment, Message, Reset, StepResult

log = logging.getLogger(__name__)

TEST_SEED_OFFSET = 1_000_003  # the test split's seed is the train seed plus this
MIX = "mix"


@functools.lru_cache(maxsize=64)
def _dataset(name: str, seed: int, size: int, config_json: str) -> ProceduralDataset:
    """One seeded dataset, built once per process (environments are built once per episode)."""
    config = json.loads(config_json)
    if name == MIX:
        specs = []
        for ds, spec in config["datasets"].items():
            spec = spec if isinstance(spec, dict) else {"weight": float(spec)}
            specs.append(
                DatasetSpec(
                    name=ds, weight=float(spec.get("weight", 1.0)), config=dict(spec.get("config", {}))
                )
            )
        composite = CompositeConfig(size=size, seed=seed, datasets=specs)
        composite.validate()
        return CompositeDataset(composite)
    return reasoning_gym.create_dataset(name, seed=seed, size=size, **config)


class ReasoningGymEnv(Environment):
    """A reasoning-gym dataset: one question, one answer, scored by the dataset's own verifier.

    Args:
        seed: the train split's seed (the test split uses ``seed + TEST_SEED_OFFSET``).
        size: train tasks; test_size: held-out tasks.
        dataset_config: the dataset's own configuration fields (e.g. ``{"max_terms": 3}``).
        datasets: for ``reasoning_gym:mix``: dataset name -> weight, or -> {"weight", "config"}.
        system_prompt: the system message (default: reasoning-gym's ``SYSTEM_PROMPTS["default"]``).
        parse: "answer_tags" (reasoning-gym's ``extract_answer``) or "raw" (the whole reply is the answer).
    """

    dataset_name: str = ""  # set on the class registered for each name

    def __init__(self, seed: int = 0, size: int = 100_000, test_size: int = 200,
                 dataset_config: dict[str, Any] | None = None, datasets: dict[str, Any] | None = None,
                 system_prompt: str | None = None, parse: str = "answer_tags") -> None:
        if self.dataset_name == MIX and not datasets:
            raise ValueError("reasoning_gym:mix needs datasets={name: weight, ...}")
        if parse not in ("answer_tags", "raw"):
            raise ValueError(f"parse must be 'answer_tags' or 'raw', not {parse!r}")
        self.seed, self.size, self.test_size = seed, size, test_size
        config = {"datasets": datasets} if self.dataset_name == MIX else dict(dataset_config or {})
        self._config_json = json.dumps(config, sort_keys=True)
        self.system_prompt = SYSTEM_PROMPTS["default"] if system_prompt is None else system_prompt
        self.parse = parse
        self.task: dict[str, Any] = {}

    def _data(self, split: str) -> ProceduralDataset:
        if split == "train":
            return _dataset(self.dataset_name, self.seed, self.size, self._config_json)
        return _dataset(self.dataset_name, self.seed + TEST_SEED_OFFSET, self.test_size, self._config_json)

    def tasks(self, split: str = "train") -> Iterator[dict[str, Any]]:
        data = self._data(split)
        held_out = (
            {self._data("test")[i]["question"] for i in range(self.test_size)} if split == "train" else set()
        )
        for i in range(len(data)):
            entry = data[i]
            if entry["question"] in held_out:
                continue
            yield {
                "id": f"{split}-{i}",
                "split": split,
                "index": i,
                "question": entry["question"],
                "answer": str(entry.get("answer")),
                "dataset": entry["metadata"].get("source_dataset", self.dataset_name),
            }

    async def reset(self, task: dict[str, Any]) -> Reset:
        self.task = task
        messages: list[Message] = (
            [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        )
        messages.append({"role": "user", "content": str(task["question"])})
        return Reset(messages=messages)

    async def step(self, message: Message) -> StepResult:
        text = str(message.get("content") or "")
        answer = text.strip() if self.parse == "raw" else extract_answer(text)
        score = await self.score(self.task, answer)
        return StepResult(messages=[], reward=score, terminated=True,
                          info={"answer": answer, "score": score, "dataset": self.task.get("dataset"),
                                SUCCESS_KEY: score == 1.0})

    async def reward(self, task: dict[str, Any], answer: str) -> float:
        parsed = answer.strip() if self.parse == "raw" else extract_answer(answer)
        return await self.score(task, parsed)

    async def score(self, task: dict[str, Any], answer: str | None) -> float:
        """The dataset's own verdict on ``answer`` to the task's entry."""
        data = self._data(task.get("split", "train"))
        entry = data[int(task["index"])]
        return float(await in_thread(data.score_answer, answer, entry))


def environment_class(rest: str) -> type[ReasoningGymEnv]:
    if rest != MIX and rest not in DATASETS:
        close = [n for n in sorted(DATASETS) if rest.lower() in n or n in rest.lower()][:8]
        raise AdapterError(
            f"reasoning-gym has no dataset {rest!r}"
            + (f" (close: {', '.join(close)})" if close else "")
            + f"; `agentrl envs list` shows its {len(DATASETS)} datasets, "
            "and reasoning_gym:mix combines several with weights"
        )
    doc = f"reasoning-gym dataset {rest}" if rest != MIX else "reasoning-gym datasets mixed with weights"
    return type(f"ReasoningGym_{rest}", (ReasoningGymEnv,), {"dataset_name": rest, "__doc__": doc,
                                                              "__module__": __name__})


def offered() -> list[tuple[str, str]]:
    names = [(f"reasoning_gym:{n}", f"reasoning-gym dataset ({DATASETS[n][0].__module__.split('.')[1]})")
             for n in sorted(DATASETS)]
    return [
        ("reasoning_gym:mix", "several reasoning-gym datasets with weights (datasets={name: weight})"),
        *names,
    ]
