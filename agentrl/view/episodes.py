"""One episode as the view shows it: its calls, and its samples token by token.

The samples come from the same stitching the trainer's samples come from: the episode's call
records (``sessions/<episode id>.jsonl``, one :class:`~agentrl.router.sessions.CallRecord` a line,
written by the router as each call completes) are rebuilt into a
:class:`~agentrl.router.sessions.Session` and :meth:`Session.samples` gives the token ids, loss
mask, behaviour logprobs and per-token versions. Nothing here re-derives a mask or a version.

Bounds: a session file larger than ``MAX_SESSION_BYTES`` is refused (:class:`TooLarge`); message
text is cut at ``MAX_TEXT`` characters; a page of tokens holds at most ``MAX_TOKENS_PER_PAGE``.
A session id is checked with the router's own rule (letters, digits, ``-``, ``_`` and inner
dots, never ``..``), so it cannot reach outside ``sessions/``; a multi-agent episode's role sessions,
``<episode id>.<role>``, open the same way as an episode's own.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.buffer.sample import Sample
from agentrl.errors import AgentrlError
from agentrl.router.sessions import CallRecord, Session, valid_session_id

log = logging.getLogger(__name__)

MAX_SESSION_BYTES = 64 << 20
MAX_TEXT = 20_000
MAX_TOKENS_PER_PAGE = 20_000


class TooLarge(AgentrlError, ValueError):
    """A session file too large to show in one piece."""


def _cut(text: Any) -> str:
    text = text if isinstance(text, str) else json.dumps(text) if text is not None else ""
    if len(text) > MAX_TEXT:
        return text[:MAX_TEXT] + f"\n… ({len(text) - MAX_TEXT} more characters)"
    return text


def read_session(path: Path) -> Session:
    """The session rebuilt from its JSONL records (a torn last line, still being written, is skipped)."""
    size = path.stat().st_size
    if size > MAX_SESSION_BYTES:
        raise TooLarge(f"{path.name} is {size / 2**20:.0f} MiB; the view shows sessions up to "
                       f"{MAX_SESSION_BYTES >> 20} MiB")
    records = []
    with open(path, "rb") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                records.append(CallRecord.from_dict(row))
    sid = records[0].session_id if records else path.stem
    return Session(sid, records=records)


def _tool_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for c in message.get("tool_calls") or []:
        if isinstance(c, dict):  # as the router returned it: {"function": {"name", "arguments"}}
            fn = c.get("function") or {}
            out.append({"name": str(fn.get("name") or ""), "arguments": _cut(fn.get("arguments"))})
        elif isinstance(c, list | tuple) and len(c) == 2:  # normalised request messages: [name, arguments]
            out.append({"name": str(c[0] or ""), "arguments": _cut(c[1])})
    return out


def _message(m: dict[str, Any]) -> dict[str, Any]:
    out = {"role": str(m.get("role") or ""), "content": _cut(m.get("content") or "")}
    calls = _tool_calls(m)
    if calls:
        out["tool_calls"] = calls
    if m.get("tool_call_id"):
        out["tool_call_id"] = str(m["tool_call_id"])
    return out


def call_views(session: Session) -> list[dict[str, Any]]:
    """Per call: what was new in its request (tool outputs among them), and what each choice replied."""
    by_index = {r.index: r for r in session.records}
    out = []
    for r in session.records:
        parent = by_index.get(r.parent) if r.parent is not None else None
        # the request repeats the parent's messages and the reply it got; what follows is new
        seen = len(parent.messages) + 1 if parent is not None else 0
        choices = []
        for c in r.completions:
            msg = c.message or {}
            choices.append({"finish_reason": c.finish_reason, "tokens": len(c.token_ids),
                            "versions": sorted(set(c.versions)),
                            "content": _cut(msg.get("content") or ""), "tool_calls": _tool_calls(msg)})
        out.append({"index": r.index, "parent": r.parent, "choice": r.choice, "engine": r.engine,
                    "created": r.created, "latency_s": r.latency_s, "prompt_tokens": len(r.prompt_ids),
                    "new_messages": [_message(m) for m in r.messages[seen:]], "choices": choices})
    return out


def sample_summary(k: int, s: Sample) -> dict[str, Any]:
    trained = [v for v, m in zip(s.versions, s.loss_mask, strict=True) if m]
    return {"index": k, "tokens": len(s.token_ids), "trained": int(s.loss_mask.sum()),
            "versions": sorted({int(v) for v in trained}), "calls": list(s.info["calls"]),
            "finish_reason": s.info.get("finish_reason")}


def call_spans(session: Session, s: Sample) -> list[dict[str, int]]:
    """Where each call of the sample's chain put its sampled tokens: [start, end) in the sample."""
    by_index = {r.index: r for r in session.records}
    spans = []
    calls = s.info["calls"]
    for pos, idx in enumerate(calls):
        rec = by_index[idx]
        # the choice this chain followed: the next call's ``choice``, or the sample's own leaf choice
        choice = by_index[calls[pos + 1]].choice if pos + 1 < len(calls) else _leaf_choice(rec, s)
        start = len(rec.prompt_ids)
        spans.append({"call": idx, "start": start, "end": start + len(rec.completions[choice].logprobs)})
    return spans


def _leaf_choice(rec: CallRecord, s: Sample) -> int:
    tail = s.token_ids[len(rec.prompt_ids):]
    for ci, c in enumerate(rec.completions):
        if list(c.token_ids) == tail.tolist():
            return ci
    return 0


def token_page(session: Session, s: Sample, pieces: Any, offset: int, limit: int) -> dict[str, Any]:
    """Columns of ``s``'s tokens ``offset`` .. ``offset + limit``: id, text, raw token, special, mask,
    logprob (prompt tokens have none: null) and version (-1 for prompt tokens)."""
    n = len(s.token_ids)
    lo, hi = max(0, offset), min(n, max(0, offset) + max(1, min(limit, MAX_TOKENS_PER_PAGE)))
    ids = [int(t) for t in s.token_ids[lo:hi]]
    mask = [int(m) for m in s.loss_mask[lo:hi]]
    got = pieces(ids) if pieces is not None else None
    return {
        "offset": lo, "total": n, "ids": ids, "mask": mask,
        "logprob": [float(lp) if m else None for lp, m in zip(s.logprobs[lo:hi], mask, strict=True)],
        "version": [int(v) for v in s.versions[lo:hi]],
        "text": [p[0] for p in got] if got is not None else None,
        "raw": [p[1] for p in got] if got is not None else None,
        "special": [i for i, p in enumerate(got) if p[2]] if got is not None else [],
        "spans": call_spans(session, s),
    }


@dataclass
class _Entry:
    stamp: tuple[int, int]  # (size, mtime_ns): a session still being written is read again
    session: Session
    samples: list[Sample]


class SessionCache:
    """The last few sessions read, so paging through a sample does not parse its file again."""

    def __init__(self, sessions_dir: Path, size: int = 8) -> None:
        self.dir = sessions_dir
        self.size = size
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def path(self, episode_id: str) -> Path | None:
        if not valid_session_id(episode_id):
            return None
        p = self.dir / f"{episode_id}.jsonl"
        return p if p.is_file() else None

    def get(self, episode_id: str) -> tuple[Session, list[Sample]] | None:
        p = self.path(episode_id)
        if p is None:
            return None
        st = p.stat()
        stamp = (st.st_size, st.st_mtime_ns)
        e = self._entries.get(episode_id)
        if e is None or e.stamp != stamp:
            session = read_session(p)
            e = _Entry(stamp, session, session.samples())
            self._entries[episode_id] = e
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        self._entries.move_to_end(episode_id)
        return e.session, e.samples
