"""A scripted policy for ``shell`` episodes over real sandboxes (a test helper, no registrations):
:class:`GatedRouter` answers the episode's calls from a script, as the router would, and records
them in a session so the episode's samples come out as they do in serve."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from agentrl.router.sessions import CallRecord, Completion, Session
from environments.shell import TASKS

TASK = next(t for t in TASKS if t["id"] == "count-errors")


def _bash(command: str) -> dict[str, Any]:
    call = {"id": "c", "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": command})}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


# the count-errors task solved in two tool calls, then "done": reward 1.0 when the sandbox lives
SCRIPT = [_bash("grep -c ERROR logs/app.log > errors.txt"), _bash("cat errors.txt"),
          {"role": "assistant", "content": "done"}]


class GatedRouter:
    """Answers like the router from ``script`` (:data:`SCRIPT`). With ``hold`` set, each episode's second call
    waits until :meth:`release`, and ``all_held`` is set once ``hold`` episodes wait there: every
    episode has its sandbox and has used it when the test acts."""

    def __init__(self, hold: int = 0, script: list[dict[str, Any]] = SCRIPT) -> None:
        self.sessions: dict[str, Session] = {}
        self.script = script
        self.hold, self.held = hold, 0
        self.all_held, self._gate = asyncio.Event(), asyncio.Event()
        if not hold:
            self._gate.set()

    def release(self) -> None:
        self._gate.set()

    async def begin(self, sid: str, **meta: Any) -> None:
        self.sessions[sid] = Session(sid, meta={k: v for k, v in meta.items() if k != "limits"})

    async def end(self, sid: str) -> Any:
        session = self.sessions.pop(sid, None)
        return None if session is None else session.summary()

    async def chat(self, body: dict[str, Any], session_id: str) -> dict[str, Any]:
        s = self.sessions[session_id]
        turn = len(s.records)
        if turn == 1 and not self._gate.is_set():
            self.held += 1
            if self.held == self.hold:
                self.all_held.set()
            await self._gate.wait()
        message, ids = self.script[turn], [7, 8, 9]
        last = s.records[-1] if s.records else None
        prompt = [1, 2, 3] if last is None else last.prompt_ids + last.completions[0].token_ids + [4]
        s.record(CallRecord(session_id, turn, turn - 1 if turn else None, 0, prompt,
                            [Completion(ids, [-1.0] * 3, [0] * 3, "stop", message)], engine="scripted"))
        return {"choices": [{"message": message, "finish_reason": "stop", "token_ids": ids}],
                "agentrl": {"versions": [[0, 0, 0]]}}
