"""Streaming derender, one choice at a time: generated ids in, the client's delta out.

Two implementations of one small interface (:meth:`feed`), picked per call by
:func:`choice_streams`:

- :class:`LocalChoiceStream` decodes in the router with the engine's tokenizer (the same
  byte-level decode the local non-streaming derender uses) and runs the same hermes parser on the
  whole text, so a streamed reply is, by construction, the non-streamed one: content streams as it
  is generated up to the first ``<tool_call>``; from there everything is held until generation
  ends and then parsed once (:func:`~agentrl.router.render.parse_hermes`): valid calls come as
  tool-call deltas (name and whole arguments), and a malformed or cut-off call comes as the text
  it is, never as broken arguments. A whitespace-only lead before a call is held too (the
  non-streamed parser drops it). Text that ends in an unfinished UTF-8 character, or in what may
  be the start of ``<tool_call>``, is held until the next tokens decide it. One call per chunk,
  no engine round trip.
- :class:`EngineChoiceStream` asks the engine's streaming derender route (which carries the
  detokeniser and tool-parser state between calls in ``stream_state``), for what the local path
  does not mirror: stop strings (vLLM trims them), ``required`` or named tool choice (a JSON
  grammar and another parser), bodies the local renderer does not take, text completions.

Both see only the ids the client's text is made of (:func:`~agentrl.router.chat_parity.shown_choice`:
no final sampled eos, no special tokens where the chat route skips them); a trailing eos id is held
back one chunk, because only the finish that follows it says whether it ended the reply.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agentrl.router.chat_parity import parses_tools
from agentrl.router.render import parse_hermes

if TYPE_CHECKING:
    from agentrl.router.call import Prepared
    from agentrl.router.core import Router

log = logging.getLogger(__name__)

TOOL_CALL = "<tool_call>"


def _held_suffix(text: str) -> int:
    """Length of the longest end of ``text`` that could still grow into ``<tool_call>``."""
    for k in range(min(len(TOOL_CALL) - 1, len(text)), 0, -1):
        if TOOL_CALL.startswith(text[-k:]):
            return k
    return 0


class LocalChoiceStream:
    """One choice, derendered in the router (see the module docstring)."""

    def __init__(self, decode: Callable[[list[int]], str], body: dict[str, Any], eos_ids: set[int],
                 hidden: frozenset[int]) -> None:
        self._decode = decode
        self.parse = parses_tools(body)
        self.eos_ids = eos_ids
        self.hidden = hidden
        self.text = ""  # decoded text of the ids taken so far
        self._pending: list[int] = []  # ids whose text is not finished (UTF-8) yet
        self._eos: list[int] = []  # a trailing eos, until the finish says whether it ended the reply
        self._sent = 0  # characters of ``text`` sent as content
        self.calls: list[dict[str, Any]] = []

    async def feed(self, ch: dict[str, Any]) -> dict[str, Any]:
        """The delta for one generate chunk of this choice: ``content`` and/or ``tool_calls``."""
        finish = ch.get("finish_reason")
        ids = [t for t in (ch.get("token_ids") or []) if t not in self.hidden]
        if ids:
            ids, self._eos = self._eos + ids, []
            if ids[-1] in self.eos_ids:
                ids, self._eos = ids[:-1], ids[-1:]
        if finish is not None and self._eos and not (finish == "stop" and ch.get("stop_reason") is None):
            ids, self._eos = ids + self._eos, []  # not the token that ended the reply: it is text
        self._pending += ids
        if self._pending:
            s = self._decode(self._pending)
            if finish is not None or not s.endswith("\ufffd"):
                self.text += s
                self._pending = []
        return self._finish() if finish is not None else self._content(self._visible())

    def _visible(self) -> int:
        """How much of the text may be sent as content now."""
        if not self.parse:
            return len(self.text)
        at = self.text.find(TOOL_CALL)
        limit = at if at >= 0 else len(self.text) - _held_suffix(self.text)
        if self.text[:limit].strip() == "":
            return self._sent  # a whitespace-only lead is dropped if a call follows it
        return limit

    def _content(self, upto: int) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if upto > self._sent:
            delta["content"] = self.text[self._sent:upto]
            self._sent = upto
        return delta

    def _finish(self) -> dict[str, Any]:
        if not (self.parse and TOOL_CALL in self.text):
            return self._content(len(self.text))
        calls, content = parse_hermes(self.text)
        if not calls:  # malformed: the whole text is the content, as unstreamed
            return self._content(len(self.text))
        delta = self._content(len(content or ""))
        self.calls = [
            {
                "index": i,
                "id": f"chatcmpl-tool-{secrets.token_hex(8)}",
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for i, c in enumerate(calls)
        ]
        delta["tool_calls"] = self.calls
        return delta


class EngineChoiceStream:
    """One choice, derendered by the engine's streaming derender route."""

    def __init__(self, router: Router, prep: Prepared, eos_ids: set[int], hidden: frozenset[int]) -> None:
        self.router = router
        self.prep = prep
        self.eos_ids = eos_ids
        self.hidden = hidden
        self.state: dict[str, Any] | None = None  # the route's stream state, carried between chunks
        self._eos: list[int] = []

    async def feed(self, ch: dict[str, Any], event: dict[str, Any] | None = None) -> dict[str, Any]:
        prep = self.prep
        finish = ch.get("finish_reason")
        ids = [t for t in (ch.get("token_ids") or []) if t not in self.hidden]
        if ids:
            ids, self._eos = self._eos + ids, []
            if ids[-1] in self.eos_ids and prep.kind == "chat":
                ids, self._eos = ids[:-1], ids[-1:]
        if finish is not None and self._eos and not (finish == "stop" and ch.get("stop_reason") is None):
            ids, self._eos = ids + self._eos, []
        if not ids and finish is None:
            return {}
        shown = dict(ch, token_ids=ids)
        one = dict(event or {}, choices=[shown])
        if prep.kind == "chat":
            path = "/v1/chat/completions/derender"
            req = {
                "stream": True,
                "generate_chunk": one,
                "stream_state": self.state,
                "chat_request": prep.body,
                "prompt_token_ids": prep.prompt_ids,
                "prompt_tokens": len(prep.prompt_ids),
            }
        else:
            path = "/v1/completions/derender"
            req = {"stream": True, "generate_chunk": one, "stream_state": self.state,
                   "completion_request": prep.body, "prompt_token_ids": prep.prompt_ids,
                   "prompt_tokens": len(prep.prompt_ids)}
        res = await self.router.pool.call(prep.engine, path, req, count=False)
        self.state = res.get("stream_state")
        out = (res["chunk"].get("choices") or [{}])[0]
        if prep.kind != "chat":
            return {"text": out.get("text") or "", "logprobs": out.get("logprobs")}
        delta = {k: v for k, v in (out.get("delta") or {}).items() if k in ("content", "tool_calls") and v}
        return delta
