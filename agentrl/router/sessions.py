"""Session capture: every call recorded with exact tokens, and calls stitched into samples.

A call's prompt is the engine's own rendering of the request, except when the request continues
an earlier call of the session (its messages are that call's messages plus the reply we returned
plus new messages). Then the prompt is built token-in/token-out: the earlier prompt ids, the
earlier completion ids exactly as sampled, the template's end-of-turn tokens, and the tokens the
template adds for the new messages (the rendered suffix beyond the earlier conversation). Text is
never re-tokenised, so a multi-turn episode becomes one sample whose loss mask covers exactly the
sampled tokens. A request that does not continue (history edited, template not prefix-stable)
starts a new sample, counted.

How the new messages' tokens are found (one render of the new messages against a short fixed
base, or today's two renders of the whole conversation) is the renderer's business
(:mod:`agentrl.router.render`); the token arithmetic is :func:`continued_prompt`, here.

Shapes: a :class:`CallRecord` holds what the engine said, as it said it (lists, logged as JSON
lines), and the sampling settings the engine applied to the call; :meth:`Session.samples` turns
the records into :class:`~agentrl.buffer.sample.Sample` objects with numpy per-token fields and
their :class:`~agentrl.buffer.behaviour.Behaviour` (each call's settings over its tokens, and
the kept set of every token of a truncated call), the one shape a sample has from here to the
learner.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from agentrl.buffer.behaviour import Behaviour
from agentrl.buffer.sample import POLICY_KEY, Sample
from agentrl.buffer.sections.routing import routing_array
from agentrl.router.session_log import SessionLog

log = logging.getLogger(__name__)

# A session id names a file (sessions/<id>.jsonl) and travels in URLs, headers and keys: letters,
# digits, "_", "-" and inner dots only, at most 128 characters; never a path.
_SESSION_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def valid_session_id(sid: str) -> bool:
    return isinstance(sid, str) and _SESSION_ID.fullmatch(sid) is not None and ".." not in sid


def _norm_args(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def normalize_message(m: dict[str, Any]) -> dict[str, Any]:
    """The parts of a chat message that decide its rendering, in a comparable form."""
    out: dict[str, Any] = {"role": m.get("role"), "content": m.get("content") or ""}
    if isinstance(out["content"], list):  # content parts: keep the text
        out["content"] = "".join(p.get("text", "") for p in out["content"] if isinstance(p, dict))
    calls = m.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            ((c.get("function") or {}).get("name"), _norm_args((c.get("function") or {}).get("arguments")))
            for c in calls
        ]
    if m.get("role") == "tool":
        out["tool_call_id"] = m.get("tool_call_id")
    return out


@dataclass
class Completion:
    """One choice of a call, exactly as the engine produced it."""

    token_ids: list[int]  # the sampled ids, a sampled end-of-sequence token included
    logprobs: list[float]  # behaviour logprob of each sampled id
    versions: list[int]  # policy version that sampled each id
    finish_reason: str | None
    message: dict[str, Any]  # the assistant message returned to the client
    kept: list[list[int]] | None = None  # per token, the ids it was drawn from (truncated calls only)
    routing: dict[str, Any] | None = None
    """MoE engines: the experts the engine routed this choice's computed positions through (prompt
    and generated tokens), as the engine hands them over (:func:`agentrl.engines.routing.decode_experts`
    reads it); None when not captured."""
    text_end: int | None = None
    """Where the text shown to the client ended when a stop string cut it: the shown text's length in
    characters. The ids run on through the stop string and the rest of the token that completed it
    (they are the tokens sampled); None when no stop string cut the text."""


@dataclass
class CallRecord:
    """One model call, exactly as the engine saw and produced it."""

    session_id: str
    index: int
    parent: int | None  # index of the call this one extends token-for-token, or None
    choice: int  # which choice of the parent this call continues
    prompt_ids: list[int]
    completions: list[Completion]
    engine: str
    created: float = field(default_factory=time.time)
    latency_s: float = 0.0
    messages: list[dict[str, Any]] = field(default_factory=list)  # normalised request messages
    sampling: dict[str, float] = field(default_factory=dict)  # settings the engine applied (behaviour.PARAMS)
    policy: str = ""  # the named LoRA policy that sampled it ("": serve runs one unnamed policy)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> CallRecord:
        """The record :meth:`to_dict` wrote; fields a newer router may add are left out."""
        kept = {k: v for k, v in row.items() if k in _RECORD_FIELDS}
        kept["completions"] = [Completion(**{k: v for k, v in c.items() if k in _COMPLETION_FIELDS})
                               for c in kept.get("completions") or []]
        return cls(**kept)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


_RECORD_FIELDS = frozenset(f.name for f in fields(CallRecord))
_COMPLETION_FIELDS = frozenset(f.name for f in fields(Completion))


@dataclass
class CallSummary:
    """One recorded call as an episode graph needs it (:func:`agentrl.rollout.roles.session_graph`)."""

    index: int
    parent: int | None  # the call it continued token for token, or None
    created: float  # when it completed
    policy: str
    completion_tokens: int
    versions: list[int]  # the policy versions that sampled it, sorted


@dataclass
class SessionSummary:
    """A closed session as the episode that owned it needs it: the same in-process and over HTTP."""

    session_id: str
    samples: list[Sample]  # its token-level samples; the episode fills in its own fields
    splits: int = 0  # calls that could not continue an earlier call and started a new sample
    calls: int = 0  # model calls recorded
    completion_tokens: int = 0
    versions: list[int] = field(default_factory=list)  # policy versions that produced its tokens, sorted
    last_reply: str = ""  # content of the last reply that had any (a scaffold's answer when it returns none)
    refused: str | None = None  # "max_turns" | "max_tokens" when the session refused a call at its limit
    model_failures: int = 0  # calls that failed for want of a working engine (5xx, none healthy)
    call_log: list[CallSummary] = field(default_factory=list)  # in-process only (empty over HTTP)


@dataclass
class Session:
    session_id: str
    records: list[CallRecord] = field(default_factory=list)
    splits: int = 0  # calls that could not continue the previous call and started a new sample
    log_path: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    model_failures: int = 0  # calls that failed for want of a working engine
    writer: SessionLog | None = field(default=None, repr=False, compare=False)  # the router's log writer

    def summary(self, refused: str | None = None) -> SessionSummary:
        comps = [c for r in self.records for c in r.completions]
        last = next(
            (str(c.message["content"]) for c in reversed(comps) if (c.message or {}).get("content")), ""
        )
        return SessionSummary(
            self.session_id,
            self.samples(),
            self.splits,
            len(self.records),
            sum(len(c.token_ids) for c in comps),
            sorted({int(v) for c in comps for v in c.versions}),
            last,
            refused,
            self.model_failures,
            [CallSummary(r.index, r.parent, r.created, r.policy, sum(len(c.token_ids) for c in r.completions),
                         sorted({int(v) for c in r.completions for v in c.versions})) for r in self.records],
        )

    def record(self, rec: CallRecord) -> None:
        """Add ``rec`` and append it to the session's log, as the call completes (a crashed scaffold
        leaves data): through the router's writer thread when the session has one (off the event
        loop, in order), else here."""
        self.records.append(rec)
        if self.log_path is not None:
            line = rec.to_json()  # now: the record is the call's, as it completed
            if self.writer is not None:
                self.writer.append(self.log_path, line)
            else:
                with open(self.log_path, "a") as f:
                    f.write(line + "\n")

    def find_parent(
        self, messages: list[dict[str, Any]], policy: str | None = None
    ) -> tuple[CallRecord, int] | None:
        """The latest call whose messages + returned reply are a prefix of ``messages`` (already
        normalised with :func:`normalize_message`, as the caller also records them). With named
        policies, only a call of the same ``policy``: a sample holds one policy's tokens."""
        for rec in reversed(self.records):
            if policy is not None and rec.policy and rec.policy != policy:
                continue
            k = len(rec.messages)
            if len(messages) <= k + 1 or messages[:k] != rec.messages:
                continue
            for ci, comp in enumerate(rec.completions):
                if normalize_message(comp.message) == messages[k]:
                    return rec, ci
        return None

    def samples(self) -> list[Sample]:
        """One sample per leaf call: the call and the chain of calls it extends.

        The per-token fields are numpy arrays (int32 ids, mask and versions, float32 logprobs),
        what the buffer stores as they are. The episode's fields are the episode's to fill (the
        agent loop replaces them): here ``episode_id`` is the session id, ``group_id`` and ``env``
        come from the session's meta, the reward is 0, and ``info`` holds ``calls`` (the chain of
        call indexes), the leaf's ``finish_reason`` and, where a stop string cut the text shown of
        the leaf's reply, ``text_end`` (:attr:`Completion.text_end`). ``behaviour`` holds each call's sampling
        settings over its tokens and the kept sets of truncated calls (None when no call of the
        chain recorded its settings).
        """
        extended = {(r.parent, r.choice) for r in self.records if r.parent is not None}
        by_index = {r.index: r for r in self.records}
        out: list[Sample] = []
        for leaf in self.records:
            for ci, comp in enumerate(leaf.completions):
                if (leaf.index, ci) in extended:
                    continue
                tokens = np.array(leaf.prompt_ids + comp.token_ids, dtype=np.int32)
                n = len(tokens)
                mask = np.zeros(n, dtype=np.int32)
                logprobs = np.zeros(n, dtype=np.float32)
                versions = np.full(n, -1, dtype=np.int32)
                chain: list[int] = []
                calls: list[tuple[int, int, dict[str, float], list[list[int]] | None]] = []
                routings: list[dict[str, Any] | None] = []
                last_versions: list[int | None] = []
                rec, c = leaf, ci
                while True:
                    chain.append(rec.index)
                    cc = rec.completions[c]
                    start, k = len(rec.prompt_ids), len(cc.logprobs)
                    if len(cc.versions) != k or start + k > n:
                        raise ValueError(f"session {self.session_id} call {rec.index}: {k} logprobs, "
                                         f"{len(cc.versions)} versions, at {start} of {n} tokens")
                    mask[start : start + k] = 1
                    logprobs[start : start + k] = cc.logprobs
                    versions[start : start + k] = cc.versions
                    calls.append((start, k, rec.sampling, cc.kept))
                    routings.append(cc.routing)
                    last_versions.append(max(cc.versions) if cc.versions else None)
                    if rec.parent is None:
                        break
                    rec, c = by_index[rec.parent], rec.choice
                behaviour = Behaviour.from_calls(n, calls, tokens) if any(x[2] for x in calls) else None
                out.append(
                    Sample(
                        tokens,
                        mask,
                        logprobs,
                        versions,
                        episode_id=self.session_id,
                        group_id=str(self.meta.get("group_id", "")),
                        env=str(self.meta.get("env", "")),
                        reward=0.0,
                        info={
                            "calls": chain[::-1],
                            "finish_reason": comp.finish_reason,
                            **({POLICY_KEY: leaf.policy} if leaf.policy else {}),
                            **({"text_end": comp.text_end} if comp.text_end is not None else {}),
                        },
                        behaviour=behaviour,
                        routing=chain_routing(n, routings[::-1], last_versions[::-1]),
                    )
                )
        return out


def chain_routing(n: int, routings: list[dict[str, Any] | None],
                  versions: list[int | None] | None = None) -> np.ndarray | None:
    """A sample's routing over its ``n`` tokens from its chain of calls' captures, first call first:
    a position computed by several calls keeps the latest one's experts (the ones the latest
    sampled tokens were conditioned on; an earlier call's tokens may have seen another routing of a
    position its engine computed again, after a weight update). None when no call captured any.

    ``versions``: per call, the policy version of its last token (None: unknown). The last call
    took the positions it did not compute from the prefix cache, which a weight update empties: an
    earlier call's experts stand for them only when it ran its last tokens under the same version
    as the last call. Another call filled the cache since, under other weights, otherwise, and
    such a position stays unrecorded (the learner routes it itself). Without ``versions`` every
    earlier capture counts."""
    from agentrl.engines.routing import decode_experts

    if not any(r is not None for r in routings):
        return None
    last = versions[-1] if versions else None
    captured = [decode_experts(r) for i, r in enumerate(routings)
                if r is not None and (versions is None or i == len(routings) - 1
                                      or (last is not None and versions[i] == last))]
    if not captured:
        return None
    _, first = captured[0]
    out = routing_array(n, first.shape[1], first.shape[2], wide=any(e.dtype != np.uint8 for _, e in captured))
    for positions, experts in captured:
        # the last sampled token is never computed; positions beyond the sample are not its own
        keep = positions < n
        out[positions[keep]] = experts[keep]
    return out


def continuation_tail(base_ids: list[int], full_ids: list[int], eos_ids: set[int]) -> list[int] | None:
    """The tokens a continued call adds after the parent's completion: the template's end of turn
    (``base_ids`` from its last eos on) and what ``full_ids`` renders beyond ``base_ids``.

    ``base_ids`` renders a conversation that ends with an assistant reply (no generation prompt),
    ``full_ids`` the same conversation plus new messages (with it). None when ``full_ids`` does not
    extend ``base_ids`` (the template is not prefix-stable there) or ``base_ids`` has no eos.
    """
    if len(full_ids) < len(base_ids) or full_ids[: len(base_ids)] != base_ids:
        return None
    last_eos = next((i for i in range(len(base_ids) - 1, -1, -1) if base_ids[i] in eos_ids), None)
    if last_eos is None:
        return None
    return base_ids[last_eos:] + full_ids[len(base_ids):]


def continued_prompt(parent: CallRecord, choice: int, base_ids: list[int], full_ids: list[int],
                     eos_ids: set[int]) -> list[int] | None:
    """Token-in/token-out prompt for a call that extends ``parent``'s chosen completion: the
    parent's prompt, its completion exactly as sampled, then :func:`continuation_tail`.

    ``base_ids``/``full_ids``: a rendering of a conversation ending with an assistant reply (no
    generation prompt), and of it plus the call's new messages. Either the call's own conversation
    up to the parent's reply, or a short fixed one the template treats alike (the renderer checks
    which is exact). Returns None when the template is not prefix-stable here (the caller then
    renders the whole conversation and starts a new sample).
    """
    tail = continuation_tail(base_ids, full_ids, eos_ids)
    if tail is None:
        return None
    completion = parent.completions[choice].token_ids
    if completion and completion[-1] in eos_ids:
        tail = tail[1:]  # the model sampled the eos itself
    return parent.prompt_ids + completion + tail
