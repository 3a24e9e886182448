"""Is there anything to learn? The learner's check that a run is not silently training on nothing.

A policy-gradient step learns only from differences between the episodes of a group. Three ways a
run can have none, each common with a new environment or a model that does not fit it:

- ``flat_rewards``: every group's rewards are identical (advantage spread 0) step after step: the
  task is too hard (all fail) or too easy (all succeed) for this model, or the reward is constant;
- ``no_tool_calls``: the environment offers tools and no episode calls one: the model does not
  know the tool-call format its chat template expects;
- ``all_truncated``: every episode hits a limit (turns, tokens, time) before it ends, so none is
  scored.

:class:`SignalWatch` looks at each step's samples and, once a condition has held for ``steps``
consecutive steps, warns once (per condition) with the figures and what usually causes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from agentrl.buffer.sample import Sample

CAUSES = {
    "flat_rewards": "every group's episodes got the same reward, so advantages are 0 and the loss has no "
                    "gradient. Usually the tasks are out of the model's reach (all fail) or trivial (all "
                    "succeed), or the reward is constant; try an easier/harder split, a model that can "
                    "already solve some tasks, or a denser reward",
    "no_tool_calls": "the environment offers tools but no episode called one. Usually the model does not "
                     "produce the tool-call format its chat template expects; use a model warm-started on "
                     "tool calls (docs/environments.md: a model for your own environment)",
    "all_truncated": "every episode was truncated (turn, token or time limit) before the environment ended "
                     "it, so none was scored; raise env.max_turns / env.max_tokens / env.episode_timeout_s "
                     "or make the task shorter",
}


@dataclass
class SignalWatch:
    steps: int = 3  # consecutive steps a condition must hold before it is reported
    runs: dict[str, int] = field(default_factory=dict)
    warned: set[str] = field(default_factory=set)

    def observe(
        self, samples: Sequence[Sample], advantage_std: float, per_token_signal: bool = False
    ) -> list[str]:
        """Look at one step's samples; the warnings this step raises (each condition at most once a run).
        ``per_token_signal``: the step's tokens had advantages of their own (a teacher's term, process
        rewards), which are a signal where the episodes' rewards are flat."""
        usable = [s for s in samples if s.error is None]
        conditions = {
            "flat_rewards": bool(usable) and advantage_std == 0.0 and not per_token_signal,
            "no_tool_calls": bool(usable) and all((s.info or {}).get("tools", 0) > 0 for s in usable)
                             and not any((s.info or {}).get("tool_calls", 0) for s in usable),
            "all_truncated": bool(usable) and all(s.truncated for s in usable),
        }
        out = []
        for name, holds in conditions.items():
            self.runs[name] = self.runs.get(name, 0) + 1 if holds else 0
            if self.runs[name] >= self.steps and name not in self.warned:
                self.warned.add(name)
                rewards = sorted({round(float(s.reward), 4) for s in usable})
                figures = (f"{self.runs[name]} steps in a row; last step: {len(usable)} samples, rewards "
                           f"{rewards[:8]}{'...' if len(rewards) > 8 else ''}, "
                           f"tool calls {sum((s.info or {}).get('tool_calls', 0) for s in usable)}, "
                           f"truncated {sum(bool(s.truncated) for s in usable)}")
                out.append(f"no learning signal ({name}): {figures}. {CAUSES[name]}")
        return out
