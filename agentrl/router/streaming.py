"""Streaming completions (``stream: true``): token-in generate streamed, derendered chunk by chunk.

The router streams vLLM's token-in generate and turns each generated chunk into the client's
delta (:mod:`agentrl.router.stream_derender`: in the router when the local renderer took the call,
else through the engine's streaming derender route), so the client sees ordinary
``chat.completion.chunk`` / ``text_completion`` events while the router keeps the exact ids,
behaviour logprobs and version spans. When the stream ends (finished, failed, or the client went
away) the router records the same :class:`CallRecord` a non-streaming call would, holding exactly
the tokens produced; an unfinished choice gets ``finish_reason="abort"``.

The chat stream has the shape of vLLM's own chat route: a role-only first chunk per choice
(``{"role": "assistant", "content": ""}``); then a chunk only when it carries something (text,
tool calls, logprobs the client asked for, or the finish), so a tool call being held for parsing
sends nothing token by token; logprobs per chunk in the chat route's shape (the sampled eos
included); ``finish_reason: "tool_calls"`` when calls were parsed. The agentrl extension
``token_ids`` rides on the chunks that are sent: together they are the completion's ids.

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

from agentrl.engines.pool import Engine
from agentrl.router.call import Prepared
from agentrl.router.chat_parity import StopHold, skips_special, stop_strings, tool_finish_reason
from agentrl.router.core import Router
from agentrl.router.errors import RouterError
from agentrl.router.stream_derender import EngineChoiceStream, LocalChoiceStream

log = logging.getLogger(__name__)


@dataclass
class _Choice:
    derender: LocalChoiceStream | EngineChoiceStream
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    content: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    unsent: list[int] = field(default_factory=list)  # ids of skipped chunks, sent with the next one
    lp_context: list[int] = field(default_factory=list)  # preceding sampled ids, for logprob token text
    kept: list[list[int]] = field(default_factory=list)  # kept sets (a recorded truncated call)
    stops: StopHold | None = None  # the call's stop strings applied to the text sent

    def add_delta(self, delta: dict[str, Any]) -> None:
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
        self.id = str(prep.gen_req.get("request_id") or f"agentrl-{id(self)}")
        self.created = int(time.time())
        sp = prep.gen_req.get("sampling_params") or {}
        self.n = int(sp.get("n") or 1)
        text = router.token_text
        self._hidden = (
            text.special
            if text is not None and prep.kind == "chat" and skips_special(prep.gen_req)
            else frozenset()
        )
        # the local derender mirrors the chat route for what the local renderer takes, stop strings aside
        self._local = (prep.kind == "chat" and router.local is not None and prep.renderer is router.local
                       and not sp.get("stop") and not sp.get("stop_token_ids"))
        self._top = int(prep.body.get("top_logprobs") or 0)
        self._stops = stop_strings(prep.gen_req)

    def _choice(self, index: int) -> _Choice:
        c = self.choices.get(index)
        if c is None:
            router, prep = self.router, self.prep
            if self._local:
                assert router.local is not None
                d: LocalChoiceStream | EngineChoiceStream = LocalChoiceStream(
                    router.local.decode, prep.body, router.eos_token_ids, self._hidden)
            else:
                d = EngineChoiceStream(router, prep, router.eos_token_ids, self._hidden)
            c = self.choices[index] = _Choice(d, stops=StopHold(self._stops) if self._stops else None)
        return c

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """OpenAI stream chunks; the call is recorded when this ends, however it ends."""
        prep = self.prep
        include_usage = bool((prep.body.get("stream_options") or {}).get("include_usage"))
        try:
            if prep.kind == "chat":
                for i in range(self.n):
                    yield self._wrap(
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    )
            event = self._first
            while event is not None:
                for ch in event.get("choices") or []:
                    chunk = await self._chunk(event, ch)
                    if chunk is not None:
                        yield chunk
                event = await anext(self._gen, None)
            self.finished = True
            if include_usage:
                completion = self.completion_tokens()
                yield self._wrap(
                    None,
                    usage={
                        "prompt_tokens": len(prep.prompt_ids),
                        "completion_tokens": completion,
                        "total_tokens": len(prep.prompt_ids) + completion,
                    },
                )
        finally:
            await self.close()

    async def choice_chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The choices of :meth:`events`' chunks one by one, for the routes that translate the chat
        stream into their own protocol's events (Responses, Messages). A failure after the stream
        started is logged here and raised, for the caller to send as its protocol's error event."""
        try:
            async for chunk in self.events():
                for ch in chunk.get("choices") or []:
                    yield ch
        except RouterError as e:
            log.warning("a stream translated for its client failed after it started: %s", e.message)
            raise

    def completion_tokens(self) -> int:
        """The tokens generated so far, over every choice."""
        return sum(len(c.ids) for c in self.choices.values())

    def _wrap(self, choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.prep.kind == "chat" else "text_completion"
        out: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.router.model_name,
            "choices": [choice] if choice is not None else [],
        }
        if usage is not None:
            out["usage"] = usage
        return out

    async def close(self) -> None:
        """Record the call and release the engine stream (idempotent; also for a never-iterated stream)."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._record()
        finally:
            if not self.finished:
                self.router.counters["streams_aborted"] += 1
            await self._gen.aclose()  # closing the engine stream aborts the request in vLLM

    async def _chunk(self, event: dict[str, Any], ch: dict[str, Any]) -> dict[str, Any] | None:
        prep, router = self.prep, self.router
        index = ch.get("index", 0)
        c = self._choice(index)
        if not c.ids and not self.choices.keys() - {index}:
            router.metrics.first_token_seconds.labels(prep.kind).observe(time.perf_counter() - prep.t0)
        ids = ch.get("token_ids") or []
        kept = router.read_kept(prep, ch)  # trims the top logprobs to the client's
        if kept is not None:
            c.kept += kept
        entries = (ch.get("logprobs") or {}).get("content") or []
        c.ids += ids
        c.logprobs += [x["logprob"] for x in entries]
        if ch.get("weight_versions"):
            c.weight_versions = ch["weight_versions"]  # cumulative spans over the whole output
        finish = ch.get("finish_reason")
        if finish:
            c.finish_reason, c.stop_reason = finish, ch.get("stop_reason")
        c.unsent += ids
        if isinstance(c.derender, LocalChoiceStream):
            delta = await c.derender.feed(ch)
        else:
            delta = await c.derender.feed(ch, event)
        if c.stops is not None:
            key = "content" if prep.kind == "chat" else "text"
            shown = c.stops.feed(delta.pop(key, None) or "", final=finish is not None)
            if shown:
                delta[key] = shown
        if prep.kind != "chat":
            return self._completion_chunk(c, index, delta, finish)
        logprobs = None
        if prep.want_logprobs:
            if router.token_text is not None:
                logprobs = {"content": router.token_text.entries(entries, self._top, c.lp_context)}
        if not delta and finish is None and logprobs is None:
            return None  # nothing the client sees: vLLM's chat route sends no chunk either
        c.add_delta(delta)
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        if finish is not None:
            choice["finish_reason"] = tool_finish_reason(prep.body, c.message(), finish, streamed=True)
            choice["stop_reason"] = ch.get("stop_reason")
        choice["token_ids"], c.unsent = c.unsent, []
        return self._wrap(choice)

    def _completion_chunk(self, c: _Choice, index: int, out: dict[str, Any], finish: str | None
                          ) -> dict[str, Any] | None:
        if not out and finish is None:
            return None
        text = out.get("text") or ""
        if text:
            c.content.append(text)
        choice = {
            "index": index,
            "text": text,
            "logprobs": out.get("logprobs") if self.prep.want_logprobs else None,
            "finish_reason": finish,
            "stop_reason": c.stop_reason if finish else None,
        }
        choice["token_ids"], c.unsent = c.unsent, []
        return self._wrap(choice)

    async def _record(self) -> None:
        prep, router = self.prep, self.router
        comps = []
        routings = await router.routings(prep, max(self.choices, default=-1) + 1)
        for i in sorted(self.choices):
            c = self.choices[i]
            lps = c.logprobs[:len(c.ids)] if len(c.logprobs) >= len(c.ids) else c.logprobs
            ids = c.ids[:len(lps)]  # a torn chunk never leaves ids without logprobs
            kept = c.kept[:len(ids)] if prep.capture is not None else None
            message = (
                c.message() if prep.kind == "chat" else {"role": "assistant", "content": "".join(c.content)}
            )
            comps.append(router.completion_entry(prep.engine, ids, lps, c.weight_versions,
                                                 c.finish_reason or "abort", c.stop_reason, message, kept,
                                                 routings[i], adapter_version=prep.adapter_version,
                                                 text_end=c.stops.text_end if c.stops else None))
        rec = router.record(prep, comps)
        self.record_index = rec.index if rec else None


async def open_stream(router: Router, kind: str, body: Any, session_id: str | None, *,
                      route: str | None = None) -> Stream:
    """Validate, render and start generating; returns once the first chunk is in (retrying before).
    ``route`` labels the latency metric (default: ``<kind>_stream``)."""
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
    return await router._counted(route or f"{kind}_stream", lambda: router.with_retries(session_id, once))
