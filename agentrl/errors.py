"""One error root for agentrl, with families named after the boundary each error crossed.

Every exception agentrl raises on purpose derives from :class:`AgentrlError`, so a caller that
wants "anything agentrl refused or failed at" catches one class. The families below it say where
the failure happened; the ones that define their own details (the router's OpenAI-shaped errors,
the sandbox's, the weight sync's) live beside their code and derive from a family here.

A failed *episode* is data, not an exception: it carries an :data:`ErrorKind` (which boundary
failed) and a human-readable message. :data:`INFRASTRUCTURE` names the kinds that say nothing
about the policy (a model outage, a transport failure, a sandbox outage): the orchestrator backs
off on them, and they never count as the agent's failure.

This module imports nothing beyond the standard library: everything may import it.
"""

from __future__ import annotations

from typing import Literal, get_args

ErrorKind = Literal["model", "environment", "sandbox", "tool", "scaffold", "transport", "scoring"]
ERROR_KINDS: tuple[str, ...] = get_args(ErrorKind)
INFRASTRUCTURE: frozenset[str] = frozenset({"model", "transport", "sandbox"})


class AgentrlError(Exception):
    """The root of every error agentrl raises on purpose."""


class ConfigError(AgentrlError, ValueError):
    """A setting is unknown, has the wrong type, or contradicts another; the message says which."""


class TransportError(AgentrlError):
    """A call between agentrl's own processes (learner, rollout workers, CLI -> serve) failed.

    ``status`` is the HTTP status when there was an answer (None for a connection failure or a
    timeout). A retry can fix it when :attr:`retryable` (no answer, 5xx, 429); a 4xx it cannot.
    """

    def __init__(self, message: str, *, status: int | None = None, body: object = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.body = body

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status >= 500 or self.status == 429


class EnvironmentFailure(AgentrlError):
    """An environment raised (in reset, step, reward or while being built): its bug, recorded on the
    episode."""


class ScaffoldError(AgentrlError):
    """A scaffold failed (raised, or exited non-zero): its bug, recorded on the episode."""
