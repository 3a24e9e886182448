"""The rollout's seams, as small typed interfaces (each with more than one implementation).

- :class:`ChatClient`: where an episode's model calls go. Serve's router in-process
  (:class:`agentrl.router.Router`), serve's router from another machine
  (:class:`agentrl.rollout.remote.RemoteRouter`), or any OpenAI endpoint without sessions
  (:class:`agentrl.rollout.remote.OpenAIChat`, for ``agentrl eval``).
- :class:`BufferSink`: where finished episodes' samples go, with admission control. Serve's
  buffer in-process (:class:`agentrl.buffer.Buffer`) or over HTTP
  (:class:`agentrl.rollout.remote.RemoteBuffer`).
- :class:`GroupLedger`: a sink that remembers, across restarts, how many of each group's episodes
  it took: serve's own buffer (:class:`agentrl.buffer.Buffer`, :class:`agentrl.buffer.PolicyBuffers`),
  not one over HTTP. Only with one can the rollout keep a task frontier and resume open groups.
- :class:`EpisodeProducer`: who plays one episode of a task: the built-in agent loop
  (:class:`agentrl.rollout.episode.BuiltinLoop`) or an external scaffold
  (:class:`agentrl.rollout.scaffold.ScaffoldLoop`). One call: ``await producer(task, group_id)``.

The orchestrator and the builder see only these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from agentrl.buffer.sample import Sample
    from agentrl.rollout.episode import EpisodeResult
    from agentrl.router.session_store import SessionLimits
    from agentrl.router.sessions import SessionSummary


class ChatClient(Protocol):
    model_name: str  # the served model's name

    async def begin(self, session_id: str, *, limits: SessionLimits | None = None, **meta: Any) -> None:
        """Open an episode's session (a client without sessions does nothing)."""

    async def chat(self, body: dict[str, Any], session_id: str | None = None) -> dict[str, Any]:
        """One chat completion (recorded in ``session_id`` when given); raises the router's errors."""

    async def end(self, session_id: str) -> SessionSummary | None:
        """Close the session: its samples and what it spent (None: no session, or no call made)."""


class BufferSink(Protocol):
    async def wait_for_room(self, in_flight: int, timeout_s: float) -> int:
        """The room left, in samples, beside ``in_flight`` (the samples the producer's episodes in
        flight are expected to make), waiting up to ``timeout_s`` for some."""

    async def put(self, samples: list[Sample]) -> int:
        """Store an episode's samples (idempotent by sample id); how many were new."""


@runtime_checkable
class GroupLedger(Protocol):
    async def group_progress(self, group_id: str) -> int:
        """How many of the group's episodes the sink took, or the group size once it is closed."""


class EpisodeProducer(Protocol):
    async def __call__(self, task: dict[str, Any], group_id: str) -> EpisodeResult:
        """Play one episode of ``task``; never raises for a failure of the episode itself."""
