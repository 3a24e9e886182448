"""Streaming completions (``stream: true``): token-in generate streamed, derendered chunk by chunk.

The router streams vLLM's token-in generate and passes each generated chunk through vLLM's
streaming derender (which carries the detokeniser and tool-parser state between calls), so the
client sees ordinary ``chat.completion.chunk`` / ``text_completion`` events while the router keeps
the exact ids, behaviour logprobs and version spans. When the stream ends (finished, failed, or the
client went away) the router records the same :class:`CallRecord` a non-streaming call would,
holding exactly the tokens produced; an unfinished choice gets ``finish_reason="abort"``.

A stream is opened (rendered, and its first generated chunk received) before the HTTP response
starts, so an engine that fails before anything was sent is retried elsewhere and a bad request
still gets a plain 4xx.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from agentrl.router.core import Prepared, Router, blank_text, strip_eos
from agentrl.router.pool import Engine

log = logging.getLogger(__name__)


@dataclass
class _Choice:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None
    content: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    state: dict[str, Any] | None = None  # the derender stream state, carried between chunks
    kept: list[list[int]] = field(default_factory=list)  # kept sets (a recorded truncated call)

    def add_delta(self, kind: str, out: dict[str, Any]) -> None:
        if kind == "completion":
            self.content.append(out.get("text") or "")
            return
        delta = out.get("delta") or {}
        if delta.get("content"):
            self.content.append(delta["content"])
        for tc in delta.get("tool_calls") or []:
            cur = self.tool_calls.setdefault(tc.get("index", 0), {"id": None, "type": "function",
                                                                  "function": {"name": "", "arguments": ""}})
            cur["id"] = tc.get("id") or cur["id"]
            fn = tc.get("function") or {}
            cur["function"]["name"] += fn.get("name") or ""
            cur["function"]["arguments"] += fn.get("arguments") or ""

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.tool_calls:
            msg["tool_calls"] = [self.tool_calls[k] for k in sorted(self.tool_calls)]
        return msg


class Stream:
    """An opened streaming call. Iterate :meth:`events` exactly once."""

    def __init__(self, router: Router, prep: Prepared, gen: AsyncIterator[dict[str, Any]],
                 first: dict[str, Any] | None) -> None:
        self.router = router
        self.prep = prep
        self._gen = gen
        self._first = first
        self.choices: dict[int, _Choice] = {}
        self.finished = False
        self.record_index: int | None = None
        self._closed = False

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """OpenAI stream chunks; the call is recorded when this ends, however it ends."""
        prep, router = self.prep, self.router
        include_usage = bool((prep.body.get("stream_options") or {}).get("include_usage"))
        try:
            event = self._first
            while event is not None:
                for ch in event.get("choices") or []:
                    yield await self._chunk(event, ch)
                event = await anext(self._gen, None)
            self.finished = True
            if include_usage:
                completion = sum(len(c.ids) for c in self.choices.values())
                yield {"id": f"agentrl-{id(self)}", "object": self._object(), "created": int(time.time()),
                       "model": router.model_name, "choices": [],
                       "usage": {"prompt_tokens": len(prep.prompt_ids), "completion_tokens": completion,
                                 "total_tokens": len(prep.prompt_ids) + completion}}
        finally:
            await self.close()

    async def close(self) -> None:
        """Record the call and release the engine stream (idempotent; also for a never-iterated stream)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._record()
        finally:
            if not self.finished:
                self.router.counters["streams_aborted"] += 1
            await self._gen.aclose()  # closing the engine stream aborts the request in vLLM

    def _object(self) -> str:
        return "chat.completion.chunk" if self.prep.kind == "chat" else "text_completion"

    async def _chunk(self, event: dict[str, Any], ch: dict[str, Any]) -> dict[str, Any]:
        prep, router = self.prep, self.router
        c = self.choices.setdefault(ch.get("index", 0), _Choice())
        if not c.ids and not self.choices.keys() - {ch.get("index", 0)}:
            router.metrics.first_token_seconds.observe(time.perf_counter() - prep.t0, route=prep.kind)
        ids = ch.get("token_ids") or []
        kept = router.read_kept(prep, ch)  # trims the top logprobs to the client's
        if kept is not None:
            c.kept += kept
        c.ids += ids
        c.logprobs += [x["logprob"] for x in ((ch.get("logprobs") or {}).get("content") or [])]
        if ch.get("weight_versions"):
            c.weight_versions = ch["weight_versions"]  # cumulative spans over the whole output
        if ch.get("finish_reason"):
            c.finish_reason, c.stop_reason = ch["finish_reason"], ch.get("stop_reason")
        shown, blank = strip_eos(ch, router.eos_token_ids)
        one = dict(event, choices=[shown])
        if prep.kind == "chat":
            path = "/v1/chat/completions/derender"
            req = {"stream": True, "generate_chunk": one, "stream_state": c.state, "chat_request": prep.body,
                   "prompt_token_ids": prep.prompt_ids, "prompt_tokens": len(prep.prompt_ids)}
        else:
            path = "/v1/completions/derender"
            req = {"stream": True, "generate_chunk": one, "stream_state": c.state,
                   "completion_request": prep.body, "prompt_token_ids": prep.prompt_ids,
                   "prompt_tokens": len(prep.prompt_ids)}
        res = await router.pool.call(prep.engine, path, req, count=False)
        c.state = res.get("stream_state")
        chunk = res["chunk"]
        chunk["model"] = router.model_name
        for out in chunk.get("choices") or []:
            if blank:
                blank_text(out)
            c.add_delta(prep.kind, out)
            if not prep.want_logprobs:
                out["logprobs"] = None
            out["token_ids"] = ids
        return chunk

    def _record(self) -> None:
        prep, router = self.prep, self.router
        comps = []
        for i in sorted(self.choices):
            c = self.choices[i]
            lps = c.logprobs[:len(c.ids)] if len(c.logprobs) >= len(c.ids) else c.logprobs
            ids = c.ids[:len(lps)]  # a torn chunk never leaves ids without logprobs
            kept = c.kept[:len(ids)] if prep.capture is not None else None
            comps.append(router.completion_entry(prep.engine, ids, lps, c.weight_versions,
                                                 c.finish_reason or "abort", c.stop_reason, c.message(), kept))
        rec = router.record(prep, comps)
        self.record_index = rec.index if rec else None


async def open_stream(router: Router, kind: str, body: Any, session_id: str | None) -> Stream:
    """Validate, render and start generating; returns once the first chunk is in (retrying before)."""
    async def once(engine: Engine, t0: float) -> Stream:
        if kind == "chat":
            prep = await router.prepare_chat(engine, body, session_id, t0)
        else:
            prep = await router.prepare_completion(engine, body, session_id, t0)
        gen_req = dict(prep.gen_req, stream=True)
        gen = router.pool.stream(engine, "/inference/v1/generate", gen_req)
        try:
            first = await anext(gen, None)
        except BaseException:
            await gen.aclose()
            raise
        return Stream(router, prep, gen, first)

    router.counters["streams"] += 1
    return await router._counted(f"{kind}_stream", lambda: router.with_retries(session_id, once))
