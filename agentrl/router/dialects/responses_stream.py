"""Streamed Responses (``stream: true`` on ``/v1/responses``): chat chunks in, typed events out.

The router's chat stream (:class:`~agentrl.router.streaming.Stream`, recorded like any chat call)
is translated event by event into the Responses API's stream, in the order the official SDK
assembles: ``response.created``, ``response.in_progress``; per output item
``response.output_item.added``, then for text ``response.content_part.added``,
``response.output_text.delta`` ..., ``response.output_text.done``, ``response.content_part.done``,
and for a function call ``response.function_call_arguments.delta`` ...,
``response.function_call_arguments.done``; ``response.output_item.done``; finally
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut the reply) with the
whole Response, the same object a non-streamed call returns. Every event carries a
``sequence_number``. An engine failure after the stream started is an ``error`` event followed
by ``response.failed``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from agentrl.router.dialects.responses_translate import (
    ResponsesTurn,
    call_item,
    logprob_items,
    message_item,
    new_id,
    response_object,
    usage,
)
from agentrl.router.errors import RouterError

if TYPE_CHECKING:
    from agentrl.router.streaming import Stream


class ResponsesEvents:
    """Translate one opened chat stream into Responses events (iterate :meth:`events` once)."""

    def __init__(self, turn: ResponsesTurn, stream: Stream, model: str) -> None:
        self.turn = turn
        self.stream = stream
        self.model = model
        self.rid = new_id("resp")
        self.created = time.time()
        self.seq = 0
        self.output: list[tuple[int, dict[str, Any]]] = []  # finished items and their output indexes
        self.text: dict[str, Any] | None = None  # the open message item: {"id", "index", "parts", "logprobs"}
        self.calls: dict[int, dict[str, Any]] = {}  # open function-call items by chat tool-call index
        self.finish: str | None = None
        # logprobs of chunks with no text yet: they go with the next text
        self._lps: list[dict[str, Any]] = []
        self.response: dict[str, Any] | None = None  # the final Response, once the stream ended

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def _snapshot(self, status: str, use: dict[str, Any] | None = None) -> dict[str, Any]:
        output = [item for _, item in sorted(self.output, key=lambda x: x[0])]
        return response_object(self.turn, self.rid, self.model, status=status, output=output, use=use,
                               created=self.created)

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        yield self._event("response.created", response=self._snapshot("in_progress"))
        yield self._event("response.in_progress", response=self._snapshot("in_progress"))
        try:
            async for ch in self.stream.choice_chunks():
                for ev in self._choice(ch):
                    yield ev
        except RouterError as e:
            yield self._event("error", code=e.code or e.type, message=e.message, param=e.param)
            failed = self._snapshot("failed")
            failed["error"] = {"code": "server_error", "message": e.message}
            yield self._event("response.failed", response=failed)
            return
        for ev in self._close_all():
            yield ev
        status = "incomplete" if self.finish == "length" else "completed"
        prompt = len(self.stream.prep.prompt_ids)
        self.response = self._snapshot(status, usage(prompt, self.stream.completion_tokens()))
        yield self._event(f"response.{status}", response=self.response)

    def _choice(self, ch: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        delta = ch.get("delta") or {}
        if self.turn.want_logprobs:
            self._lps += (ch.get("logprobs") or {}).get("content") or []
        if delta.get("content"):
            entries, self._lps = self._lps, []
            out += self._text_delta(delta["content"], entries)
        for tc in delta.get("tool_calls") or []:
            out += self._call_delta(tc)
        if ch.get("finish_reason"):
            self.finish = ch["finish_reason"]
        return out

    def _text_delta(self, text: str, entries: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        out = []
        if self.text is None:
            item_id = new_id("msg")
            self.text = {
                "id": item_id, "index": len(self.output) + len(self.calls), "parts": [], "logprobs": [],
            }
            out.append(self._event("response.output_item.added", output_index=self.text["index"],
                                   item=message_item(item_id, "", "in_progress")))
            out.append(
                self._event(
                    "response.content_part.added", item_id=item_id, output_index=self.text["index"],
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                )
            )
        self.text["parts"].append(text)
        lps = logprob_items(entries, with_bytes=False) if self.turn.want_logprobs else []
        if self.turn.want_logprobs:
            self.text["logprobs"] += logprob_items(entries)
        out.append(
            self._event(
                "response.output_text.delta", item_id=self.text["id"], output_index=self.text["index"],
                content_index=0, delta=text, logprobs=lps,
            )
        )
        return out

    def _close_text(self, status: str) -> list[dict[str, Any]]:
        if self.text is None:
            return []
        t, self.text = self.text, None
        full = "".join(t["parts"])
        if self._lps and not self.calls:  # a held tail (the eos, a call kept as text): the item's still
            t["logprobs"] += logprob_items(self._lps)
            self._lps = []
        lps = t["logprobs"] if self.turn.want_logprobs else None
        item = message_item(t["id"], full, status, lps)
        part = item["content"][0]
        self.output.append((t["index"], item))
        return [
            self._event(
                "response.output_text.done", item_id=t["id"], output_index=t["index"], content_index=0,
                text=full, logprobs=lps or [],
            ),
            self._event(
                "response.content_part.done", item_id=t["id"], output_index=t["index"], content_index=0,
                part=part,
            ),
            self._event("response.output_item.done", output_index=t["index"], item=item),
        ]

    def _call_delta(self, tc: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        index = tc.get("index", 0)
        fn = tc.get("function") or {}
        cur = self.calls.get(index)
        if cur is None:
            out += self._close_text("completed")  # text comes before calls; a call closes it
            cur = self.calls[index] = {"id": new_id("fc"), "index": len(self.output) + len(self.calls),
                                       "call": {"id": tc.get("id") or new_id("call"), "type": "function",
                                                "function": {"name": fn.get("name") or "", "arguments": ""}}}
            out.append(self._event("response.output_item.added", output_index=cur["index"],
                                   item=call_item(cur["id"], cur["call"], "in_progress")))
        elif fn.get("name"):
            cur["call"]["function"]["name"] += fn["name"]
        if fn.get("arguments"):
            cur["call"]["function"]["arguments"] += fn["arguments"]
            out.append(self._event("response.function_call_arguments.delta", item_id=cur["id"],
                                   output_index=cur["index"], delta=fn["arguments"]))
        return out

    def _close_all(self) -> list[dict[str, Any]]:
        status = "incomplete" if self.finish == "length" else "completed"
        out = self._close_text(status)
        for index in sorted(self.calls):
            cur = self.calls[index]
            item = call_item(cur["id"], cur["call"])
            self.output.append((cur["index"], item))
            out.append(self._event("response.function_call_arguments.done", item_id=cur["id"],
                                   output_index=cur["index"], name=item["name"], arguments=item["arguments"]))
            out.append(self._event("response.output_item.done", output_index=cur["index"], item=item))
        self.calls = {}
        return out

    def reply(self) -> dict[str, Any]:
        """The reply as a chat message (what the store keeps for ``previous_response_id``)."""
        return (
            self.stream.choices[0].message()
            if self.stream.choices
            else {"role": "assistant", "content": None}
        )
