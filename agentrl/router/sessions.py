"""Session capture: every call recorded with exact tokens, and calls stitched into samples.

A call's prompt is the engine's own rendering of the request, except when the request continues
an earlier call of the session (its messages are that call's messages plus the reply we returned
plus new messages). Then the prompt is built token-in/token-out: the earlier prompt ids, the
earlier completion ids exactly as sampled, the template's end-of-turn tokens, and the tokens the
template adds for the new messages (the rendered suffix beyond the earlier conversation). Text is
never re-tokenised, so a multi-turn episode becomes one sample whose loss mask covers exactly the
sampled tokens. A request that does not continue (history edited, template not prefix-stable)
starts a new sample, counted.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


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
class CallRecord:
    """One model call, exactly as the engine saw and produced it."""

    session_id: str
    index: int
    parent: int | None  # index of the call this one extends token-for-token, or None
    choice: int  # which choice of the parent this call continues
    prompt_ids: list[int]
    completions: list[dict[str, Any]]  # per choice: token_ids, logprobs, versions, finish_reason, message
    engine: str
    created: float = field(default_factory=time.time)
    latency_s: float = 0.0
    messages: list[dict[str, Any]] = field(default_factory=list)  # normalised request messages

    def to_json(self) -> str:
        return json.dumps(asdict(self))


@dataclass
class SampleTokens:
    """Token-level content of one sample built from a chain of calls."""

    token_ids: list[int]  # or numpy arrays from ``Session.samples(as_arrays=True)``
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    calls: list[int]
    finish_reason: str | None


@dataclass
class SessionSummary:
    """A closed session as the episode that owned it needs it: the same in-process and over HTTP."""

    session_id: str
    samples: list[SampleTokens]
    splits: int = 0  # calls that could not continue an earlier call and started a new sample
    calls: int = 0  # model calls recorded
    completion_tokens: int = 0
    versions: list[int] = field(default_factory=list)  # policy versions that produced its tokens, sorted
    last_reply: str = ""  # content of the last reply that had any (a scaffold's answer when it returns none)
    refused: str | None = None  # "max_turns" | "max_tokens" when the session refused a call at its limit
    model_failures: int = 0  # calls that failed for want of a working engine (5xx, none healthy)


@dataclass
class Session:
    session_id: str
    records: list[CallRecord] = field(default_factory=list)
    splits: int = 0  # calls that could not continue the previous call and started a new sample
    log_path: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    model_failures: int = 0  # calls that failed for want of a working engine

    def summary(self, refused: str | None = None) -> SessionSummary:
        comps = [c for r in self.records for c in r.completions]
        last = next((str(c["message"]["content"]) for c in reversed(comps)
                     if (c.get("message") or {}).get("content")), "")
        return SessionSummary(self.session_id, self.samples(as_arrays=True), self.splits, len(self.records),
                              sum(len(c["token_ids"]) for c in comps),
                              sorted({v for c in comps for v in c["versions"]}), last, refused,
                              self.model_failures)

    def record(self, rec: CallRecord) -> None:
        self.records.append(rec)
        if self.log_path is not None:
            with open(self.log_path, "a") as f:  # written as calls complete: a crashed scaffold leaves data
                f.write(rec.to_json() + "\n")

    def find_parent(self, messages: list[dict[str, Any]]) -> tuple[CallRecord, int] | None:
        """The latest call whose messages + returned reply are a prefix of ``messages``."""
        norm = [normalize_message(m) for m in messages]
        for rec in reversed(self.records):
            k = len(rec.messages)
            if len(norm) <= k + 1 or norm[:k] != rec.messages:
                continue
            for ci, comp in enumerate(rec.completions):
                if normalize_message(comp["message"]) == norm[k]:
                    return rec, ci
        return None

    def samples(self, as_arrays: bool = False) -> list[SampleTokens]:
        """One sample per leaf call: the call and the chain of calls it extends.

        ``as_arrays``: the per-token fields as numpy arrays (int32 ids, mask and versions, float32
        logprobs), what the rollout hands the buffer, which stores their bytes without converting
        lists; by default lists (JSON-ready).
        """
        extended = {(r.parent, r.choice) for r in self.records if r.parent is not None}
        by_index = {r.index: r for r in self.records}
        out: list[SampleTokens] = []
        for leaf in self.records:
            for ci, comp in enumerate(leaf.completions):
                if (leaf.index, ci) in extended:
                    continue
                tokens: Any = leaf.prompt_ids + comp["token_ids"]
                n = len(tokens)
                mask: Any
                logprobs: Any
                versions: Any
                if as_arrays:
                    import numpy as np

                    tokens = np.array(tokens, dtype=np.int32)
                    mask = np.zeros(n, dtype=np.int32)
                    logprobs = np.zeros(n, dtype=np.float32)
                    versions = np.full(n, -1, dtype=np.int32)
                else:
                    mask, logprobs, versions = [0] * n, [0.0] * n, [-1] * n
                chain: list[int] = []
                rec, c = leaf, ci
                while True:
                    chain.append(rec.index)
                    cc = rec.completions[c]
                    start, k = len(rec.prompt_ids), len(cc["logprobs"])
                    if len(cc["versions"]) != k or start + k > n:
                        raise ValueError(f"session {self.session_id} call {rec.index}: {k} logprobs, "
                                         f"{len(cc['versions'])} versions, at {start} of {n} tokens")
                    mask[start : start + k] = [1] * k
                    logprobs[start : start + k] = cc["logprobs"]
                    versions[start : start + k] = cc["versions"]
                    if rec.parent is None:
                        break
                    rec, c = by_index[rec.parent], rec.choice
                out.append(SampleTokens(tokens, mask, logprobs, versions, chain[::-1], comp["finish_reason"]))
        return out


def continued_prompt(parent: CallRecord, choice: int, base_ids: list[int], full_ids: list[int],
                     eos_ids: set[int]) -> list[int] | None:
    """Token-in/token-out prompt for a call that extends ``parent``'s chosen completion.

    ``base_ids``: the engine's rendering of the conversation up to and including the parent's reply
    (no generation prompt); ``full_ids``: its rendering of the new request. Returns None when the
    template is not prefix-stable here (the caller then uses ``full_ids`` and starts a new sample).
    """
    if len(full_ids) < len(base_ids) or full_ids[: len(base_ids)] != base_ids:
        return None
    last_eos = max((i for i, t in enumerate(base_ids) if t in eos_ids), default=None)
    if last_eos is None:
        return None
    completion = parent.completions[choice]["token_ids"]
    end_of_turn = base_ids[last_eos:]  # eos plus the template's separator after it
    if completion and completion[-1] in eos_ids:
        end_of_turn = end_of_turn[1:]  # the model sampled the eos itself
    return parent.prompt_ids + completion + end_of_turn + full_ids[len(base_ids):]
