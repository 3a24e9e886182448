"""One call on its way through the capture path (:class:`Prepared`) and what it leaves behind: each
choice as captured (:func:`completion_entry`) and the call's record in its session (:func:`record_call`).

Invariants: a choice has one behaviour logprob and one policy version per sampled id (and one kept
set per id when its vocabulary was truncated), else the engine's answer is refused as an
:class:`EngineError`; a call on a LoRA adapter is that adapter's version throughout (an adapter
never changes under a request: a new version is a new adapter); a record is written as the call
completes, so a session's records are in call order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from agentrl.engines.pool import DEFAULT_POLICY, Engine, parse_version
from agentrl.router.errors import EngineError
from agentrl.router.render import Renderer
from agentrl.router.sampling import Capture
from agentrl.router.sessions import CallRecord, Completion, Session


@dataclass
class Prepared:
    """A request rendered to tokens on one engine, ready for token-in generate."""

    kind: str  # "chat" or "completion"
    engine: Engine
    body: dict[str, Any]  # the validated client body (what derender parses against)
    gen_req: dict[str, Any]  # the generate request, prompt ids and sampling params final
    prompt_ids: list[int]
    session: Session | None
    parent: CallRecord | None
    choice: int
    want_logprobs: bool
    t0: float
    renderer: Renderer | None = None  # a chat call's (its derender too); None for text completions
    messages: list[dict[str, Any]] | None = None  # normalised request messages (a session's chat call)
    sampling: dict[str, float] = field(default_factory=dict)  # the settings the engine applies (recorded)
    capture: Capture | None = None  # how a recorded truncated call's kept sets are read
    adapter_version: int | None = None
    """the LoRA policy version the call samples from (None: the engine's weights)"""
    policy: str = DEFAULT_POLICY  # the LoRA policy the call samples from (the request's model names it)


def token_versions(weight_versions: list[dict[str, Any]] | None, n: int) -> list[int]:
    """Per-token policy versions from vLLM's spans over output indexes."""
    versions = [0] * n
    for span in weight_versions or []:
        start, end = max(0, span.get("start", 0)), min(n, span.get("end", n))
        if end > start:
            versions[start:end] = [parse_version(span.get("version"))] * (end - start)
    return versions


def completion_entry(
    engine: Engine,
    ids: list[int],
    lps: list[float],
    weight_versions: list[dict[str, Any]] | None,
    finish_reason: str | None,
    stop_reason: int | str | None,
    message: dict[str, Any],
    kept: list[list[int]] | None,
    routing: dict[str, Any] | None,
    *,
    adapter_version: int | None,
    eos_token_ids: set[int],
    text_end: int | None = None,
) -> Completion:
    """One choice as captured: exact ids, behaviour logprobs, per-token versions, kept sets, routed
    experts. A stop on a token the engine names no stop string for is an end-of-sequence token:
    it joins ``eos_token_ids`` (the renderers close a continued turn with it). ``text_end``: where a
    stop string cut the text shown (:attr:`Completion.text_end`)."""
    if len(lps) != len(ids) or (kept is not None and len(kept) != len(ids)):
        raise EngineError(f"engine {engine.name} returned {len(lps)} logprobs "
                          f"({'-' if kept is None else len(kept)} kept sets) for {len(ids)} tokens")
    if finish_reason == "stop" and stop_reason is None and ids:
        eos_token_ids.add(ids[-1])
    versions = [adapter_version] * len(ids) if adapter_version is not None \
        else token_versions(weight_versions, len(ids))
    return Completion(ids, lps, versions, finish_reason, message, kept, routing, text_end)


def record_call(prep: Prepared, comps: list[Completion], policy: str) -> CallRecord | None:
    """Write the call's record in its session (None for a call outside a session); ``policy`` is
    the name the record carries."""
    if prep.session is None:
        return None
    session = prep.session
    rec = CallRecord(
        session_id=session.session_id, index=len(session.records),
        parent=prep.parent.index if prep.parent else None, choice=prep.choice,
        prompt_ids=prep.prompt_ids, completions=comps, engine=prep.engine.name,
        latency_s=time.perf_counter() - prep.t0, messages=prep.messages or [], sampling=prep.sampling,
        policy=policy,
    )
    session.record(rec)
    return rec
