"""The router's open sessions and what each may spend.

A session is opened by an episode's agent loop (``Router.begin``), by the admin for an external
scaffold (``POST /admin/sessions``), or by the first call that names it; its calls are recorded in
it, and in ``<sessions_dir>/<id>.jsonl`` when the router has one. Invariants: a session id is
checked before it names a file; a session's limits (:class:`SessionLimits`) are kept until it is
closed (sessions opened with one limits object spend one budget together), so a call beyond its
model-call or token budget is refused with a 400 whose code names the
limit (``max_turns_exceeded``, ``max_tokens_exceeded``) and the limit is reported in its summary.
The log files are written off the event loop (:class:`~agentrl.router.session_log.SessionLog`);
:meth:`SessionStore.flush` waits until what was recorded is on disk.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.router.errors import InvalidRequest, NotFound
from agentrl.router.session_log import SessionLog
from agentrl.router.sessions import Session, SessionSummary, valid_session_id


@dataclass
class SessionLimits:
    """What one session may spend; 0 means no limit. ``refused`` says why a call was turned away."""

    max_calls: int = 0  # model calls (an episode's turns)
    max_tokens: int = 0  # completion tokens per call: caps the request's max_tokens
    max_session_tokens: int = 0  # completion tokens over the whole session
    refused: str | None = None  # "max_turns" | "max_tokens" once a call was refused
    bound: list[str] = field(default_factory=list, repr=False, compare=False)
    """the open sessions it bounds (several: the role sessions of one episode, one budget)"""


class SessionStore:
    def __init__(self, sessions_dir: Path | None = None) -> None:
        self.sessions_dir = sessions_dir
        self.sessions: dict[str, Session] = {}
        self.limits: dict[str, SessionLimits] = {}
        self.log: SessionLog | None = None
        # with several router processes (router.processes): whether a session id is this process's
        # to hold; an id made up here is one it holds (agentrl.serve.routers)
        self.claims: Callable[[str], bool] | None = None
        if sessions_dir is not None:
            sessions_dir.mkdir(parents=True, exist_ok=True)
            self.log = SessionLog()

    def open(
        self, session_id: str | None = None, limits: SessionLimits | None = None, **meta: Any
    ) -> Session:
        """The session ``session_id`` (a new id when None), opened now unless it is open already."""
        sid = session_id or self.new_id()
        if not valid_session_id(sid):
            raise InvalidRequest("a session id has 1-128 letters, digits, '_', '-' or inner '.' (no path), "
                                 f"not {sid[:60]!r}", param="session_id", code="invalid_session_id")
        if limits is not None:
            if self.limits.get(sid) is not limits:
                self.release(sid)
                limits.bound.append(sid)
            self.limits[sid] = limits
        if sid in self.sessions:
            return self.sessions[sid]
        path = self.sessions_dir / f"{sid}.jsonl" if self.sessions_dir else None
        s = Session(sid, log_path=path, meta=meta, writer=self.log)
        self.sessions[sid] = s
        return s

    def new_id(self) -> str:
        """A fresh session id (one this process holds, see ``claims``: 1 draw in N on average)."""
        while True:
            sid = uuid.uuid4().hex
            if self.claims is None or self.claims(sid):
                return sid

    def get(self, session_id: str) -> Session:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise NotFound(f"unknown session {session_id!r}", param="session_id") from None

    def close(self, session_id: str) -> Session | None:
        self.release(session_id)
        return self.sessions.pop(session_id, None)

    def release(self, session_id: str) -> None:
        """Take ``session_id`` off its limits (its budget no longer counts its calls)."""
        lim = self.limits.pop(session_id, None)
        if lim is not None and session_id in lim.bound:
            lim.bound.remove(session_id)

    async def flush(self) -> None:
        """Wait until every record written so far is in its session's log file."""
        if self.log is not None:
            await self.log.flush()

    def close_log(self) -> None:
        """Write what is queued and stop the log's writer thread."""
        if self.log is not None:
            self.log.close()

    def summary(self, session: Session) -> SessionSummary:
        """A session's samples and what it spent, with the limit that refused a call (if one did)."""
        lim = self.limits.get(session.session_id)
        return session.summary(lim.refused if lim else None)

    def admit(self, session: Session | None) -> int:
        """Refuse a call beyond its session's limits; else the cap on its max_tokens (0: none)."""
        lim = self.limits.get(session.session_id) if session is not None else None
        if lim is None or session is None:
            return 0
        records = [r for s in self.sharing(lim) for r in s.records]
        if lim.max_calls and len(records) >= lim.max_calls:
            lim.refused = "max_turns"
            raise InvalidRequest(f"this episode allows at most {lim.max_calls} model calls",
                                 param="messages", code="max_turns_exceeded")
        caps = [lim.max_tokens] if lim.max_tokens else []
        if lim.max_session_tokens:
            left = lim.max_session_tokens - sum(len(c.token_ids) for r in records for c in r.completions)
            if left <= 0:
                lim.refused = "max_tokens"
                raise InvalidRequest(
                    f"this episode allows at most {lim.max_session_tokens} completion tokens",
                    param="max_tokens",
                    code="max_tokens_exceeded",
                )
            caps.append(left)
        return min(caps, default=0)

    def sharing(self, lim: SessionLimits) -> list[Session]:
        """The open sessions ``lim`` bounds together (opened with that one object: the role sessions of
        an external multi-agent program share their episode's budget)."""
        return [self.sessions[sid] for sid in lim.bound if sid in self.sessions]

    def model_failure(self, session_id: str | None) -> None:
        """Count a call that failed for want of a working engine on its session (a scaffold's episode
        is then recorded as a model failure, not as the scaffold's)."""
        if session_id is not None and session_id in self.sessions:
            self.sessions[session_id].model_failures += 1
