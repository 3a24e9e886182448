"""A model call of an episode: the policy as an environment that plays its own episode reaches it
(:class:`SessionModel`: the episode's session, sampling and budgets), and a closed session's records
turned into the episode's samples (:func:`episode_samples`). Shared by the built-in agent loop
(:mod:`agentrl.rollout.episode`) and multi-agent episodes (:mod:`agentrl.rollout.roles`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from agentrl.buffer.sample import POLICY_KEY, Sample
from agentrl.env.base import MIX_TAG
from agentrl.errors import AgentrlError, TransportError
from agentrl.router.errors import EngineError, InvalidRequest

if TYPE_CHECKING:
    from agentrl.rollout.config import EpisodeLimits
    from agentrl.rollout.episode import EpisodeResult
    from agentrl.rollout.protocols import ChatClient
    from agentrl.router.sessions import SessionSummary

__all__ = ["LimitReached", "SessionModel", "episode_samples"]


class LimitReached(AgentrlError):
    """A playing environment asked for a call beyond the episode's turn or token budget."""

    def __init__(self, truncation: str) -> None:
        super().__init__(f"the episode's {truncation} limit is reached")
        self.truncation = truncation


class SessionModel:
    """The policy as a :class:`~agentrl.env.base.PlayingEnv` sees it: chat calls recorded in the
    episode's session, under the episode's limits (the built-in loop's sampling, the per-call and
    per-episode token budgets, the turn limit). Counts what it spends on ``ep``."""

    def __init__(
        self, client: ChatClient, ep: EpisodeResult, limits: EpisodeLimits, policy: str = "", *,
        session_id: str | None = "",
    ) -> None:
        self.client, self.ep, self.limits = client, ep, limits
        # the router session its calls are recorded in ("": the episode's own; None: none, a plain endpoint)
        self.session_id = ep.episode_id if session_id == "" else session_id
        self.policy = policy  # the named LoRA policy the episode's calls sample from ("": the default)
        # the named policies a call may pick by its own "model" (a seat of a self-play game); any
        # other model name an environment sends is its own business and is dropped, as before
        self.policies = set(getattr(client, "policies", None) or ())
        self.name = client.model_name
        self.max_tokens, self.temperature = limits.max_tokens, limits.temperature
        self.refused: str | None = None  # the limit that stopped the episode, if one did
        self.model_failure: BaseException | None = None  # an engine failure behind a call

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        ep, limits = self.ep, self.limits
        budget = min(limits.max_tokens, limits.max_episode_tokens - ep.completion_tokens)
        if ep.turns >= limits.max_turns or budget <= 0:
            self.refused = "max_turns" if ep.turns >= limits.max_turns else "max_tokens"
            raise LimitReached(self.refused)
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or budget
        # The learner corrects with the temperature and top_p the loop samples at: they are not the
        # environment's to change. One choice, not streamed: one sample per call.
        named = body.get("model") if body.get("model") in self.policies else None
        body = {k: v for k, v in body.items() if k not in ("model", "stream", "stream_options", "n",
                                                            "max_completion_tokens")}
        body.update(max_tokens=min(int(asked), budget), temperature=limits.temperature, top_p=limits.top_p)
        if named or self.policy:
            body["model"] = named or self.policy
        try:
            out = await self.client.chat(body, session_id=self.session_id)
        except InvalidRequest as e:
            if e.code == "context_length_exceeded":
                self.refused = "context"
            raise
        except (EngineError, TransportError) as e:
            self.model_failure = e
            raise
        ep.turns += 1
        ep.versions.extend(sorted(set(out.get("agentrl", {}).get("versions", [[]])[0])))
        ep.completion_tokens += len(out["choices"][0].get("token_ids") or []) or int(
            (out.get("usage") or {}).get("completion_tokens") or 0)
        return out


def episode_samples(summary: SessionSummary, ep: EpisodeResult) -> list[Sample]:
    """The session's samples (numpy per-token fields, built once) with the episode's fields; a sample
    whose last call the environment rewarded on its own (a self-play seat) takes that reward."""
    extra = {k: ep.info[k] for k in ("tools", "tool_calls", MIX_TAG) if k in ep.info}
    out = []
    for s in summary.samples:
        calls = s.info["calls"]
        reward = ep.sample_rewards.get(calls[-1], ep.reward) if calls else ep.reward
        out.append(replace(s, episode_id=ep.episode_id, group_id=ep.group_id, env=ep.env, reward=reward,
                           truncated=ep.truncated, error=ep.error, error_kind=ep.error_kind,
                           info={"task_id": ep.task_id, "turns": ep.turns, "sandbox_id": ep.sandbox_id,
                                 "calls": calls, "truncation": ep.truncation, "splits": ep.splits, **extra,
                                 **({POLICY_KEY: s.info[POLICY_KEY]} if POLICY_KEY in s.info else {})},
                           timings={"episode_s": ep.seconds, "started": ep.started}))
    return out
