"""The Anthropic Messages dialect (``POST /v1/messages``, ``stream: true``: Anthropic's events;
``POST /v1/messages/count_tokens``; at the top level and under every session's base URL) on the
router's one capture path.

A Messages request is validated as the Anthropic API validates it and translated into a chat
request (:func:`parse_request`) that the router's chat path runs: render -> token-in generate ->
derender -> record, with the same exact capture and stitching as chat calls. The reply is
translated back (:func:`message_object`; streamed: :class:`MessageEvents`), and every error is
Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}`` (:func:`error_body`): every
answer on these routes that is not a message, from bad JSON to an engine outage (the
:func:`anthropic_errors` middleware). Clients authenticate with ``x-api-key`` (the Anthropic SDK's
header) or ``Authorization: Bearer``; a session is named as on the chat routes.

Translation, as vLLM 0.32's own Messages server does it (facts, not its code): ``system`` (a
string or text blocks, joined) is a leading system message; a user message's ``tool_result``
blocks become tool messages (in order, before the message's text), its text blocks the user
message; an assistant message's text blocks are its content and its ``tool_use`` blocks its tool
calls (``input`` as JSON arguments); ``tools`` with ``input_schema`` become function tools;
``tool_choice`` auto / any / tool / none become auto / required / named / none;
``stop_sequences`` are stop strings. Replies: text then ``tool_use`` blocks, ``stop_reason``
``end_turn`` / ``max_tokens`` / ``stop_sequence`` / ``tool_use``.

Refused with a 400, as the Anthropic API refuses them or because they have no exact chat
rendering here: a missing ``max_tokens``, unknown fields, block types other than text, tool_use
and tool_result (images, documents, thinking, server tools), a ``tool_result`` whose
``tool_use_id`` the previous assistant message did not issue, a ``tool_use`` left without its
result, a final assistant message (prefill), extended thinking, non-custom tool types.
"""

from __future__ import annotations

import itertools
import json
import logging
import secrets
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from aiohttp import web

from agentrl.router.errors import InvalidRequest, RouterError
from agentrl.router.http import ROUTER_KEY, check_client, json_body, json_response, session_of, typed_sse
from agentrl.router.streaming import open_stream
from agentrl.router.validate import typed_tools

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler

    from agentrl.router.streaming import Stream

log = logging.getLogger(__name__)

# The SDK's request fields that change nothing the router renders or samples are accepted
# (cache_control, metadata, ...); temperature / top_p / top_k are not in the 2.x SDK's signature
# any more but the API (and this router) still take them, e.g. through ``extra_body``.
_ACCEPTED = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "tools",
        "tool_choice",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "metadata",
        "thinking",
        "service_tier",
        "cache_control",
        "inference_geo",
        "diagnostics",
        "user_profile_id",
        "workspace_id",
        "speed",
        "output_config",
    }
)
_BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request header: vLLM drops it
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(e: RouterError) -> dict[str, Any]:
    """A router error in Anthropic's error shape."""
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def _number(body: dict[str, Any], key: str, lo: float, hi: float) -> None:
    v = body.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi):
        raise InvalidRequest(f"{key}: must be a number between {lo:g} and {hi:g}", param=key)


def _texts(blocks: list[Any], where: str, *, allowed: tuple[str, ...]) -> None:
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind not in allowed:
            raise InvalidRequest(f"{where}.{j}: blocks of type {kind!r} are not supported by this router "
                                 f"(here: {', '.join(allowed)})", param=f"{where}.{j}.type")
        if kind == "text" and not isinstance(b.get("text"), str):
            raise InvalidRequest(f"{where}.{j}.text: Field required (a string)", param=f"{where}.{j}.text")


def _tool_result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        _texts(content, f"{where}.content", allowed=("text",))
        return "\n".join(b["text"] for b in content)
    raise InvalidRequest(
        f"{where}.content: must be a string or a list of text blocks", param=f"{where}.content"
    )


def _system(system: Any) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    if isinstance(system, list):
        _texts(system, "system", allowed=("text",))
        return (
            "".join(b["text"] for b in system if b["text"] and not b["text"].startswith(_BILLING_HEADER))
            or None
        )
    raise InvalidRequest("system: must be a string or a list of text blocks", param="system")


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Anthropic ``messages`` as chat messages, with the API's tool-use pairing rules checked."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages: Field required (a non-empty list)", param="messages")
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # tool_use ids of the previous assistant message, awaiting their results
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise InvalidRequest(
                f"{where}.role: Input should be 'user' or 'assistant'", param=f"{where}.role"
            )
        role, content = m["role"], m.get("content")
        if isinstance(content, str):
            blocks: list[Any] = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            blocks = content
        else:
            raise InvalidRequest(f"{where}.content: must be a string or a list of content blocks",
                                 param=f"{where}.content")
        if role == "user":
            _texts(blocks, f"{where}.content", allowed=("text", "tool_result"))
            answered = []
            for j, b in enumerate(blocks):
                if b["type"] != "tool_result":
                    continue
                tid = b.get("tool_use_id")
                if tid not in pending:
                    raise InvalidRequest(f"{where}.content.{j}: unexpected "
                                         "`tool_use_id` found in `tool_result` "
                                         f"blocks: {tid}. Each `tool_result` "
                                         "block must have a corresponding "
                                         "`tool_use` block in the previous "
                                         "message.", param=f"{where}.content.{j}")
                answered.append(tid)
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": tid,
                        "content": _tool_result_text(b, f"{where}.content.{j}"),
                    }
                )
            missing = [t for t in pending if t not in answered]
            if missing:
                raise InvalidRequest(f"{where}: `tool_use` ids were found without "
                                     "`tool_result` blocks immediately after: "
                                     f"{', '.join(missing)}. Each `tool_use` "
                                     "block must have a corresponding `tool_result` "
                                     "block in the next message.", param=where)
            pending = []
            texts = [b["text"] for b in blocks if b["type"] == "text" and b["text"]]
            if texts:
                out.append({"role": "user", "content": texts[0] if len(texts) == 1 else
                            [{"type": "text", "text": t} for t in texts]})
        else:
            if pending:
                raise InvalidRequest(f"{where}: `tool_use` ids were found without `tool_result` "
                                     f"blocks immediately after: {', '.join(pending)}.", param=where)
            _texts(blocks, f"{where}.content", allowed=("text", "tool_use"))
            texts = [b["text"] for b in blocks if b["type"] == "text" and b["text"]]
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
            calls = []
            for j, b in enumerate(blocks):
                if b["type"] != "tool_use":
                    continue
                if not (isinstance(b.get("id"), str) and b["id"] and isinstance(b.get("name"), str)
                        and isinstance(b.get("input", {}), dict)):
                    raise InvalidRequest(f"{where}.content.{j}: a tool_use "
                                         "block needs a string 'id' and "
                                         "'name' and an object 'input'", param=f"{where}.content.{j}")
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}})
                pending.append(b["id"])
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    if messages[-1]["role"] == "assistant":
        raise InvalidRequest("the last message is from the assistant: continuing a pre-filled reply is not "
                             "supported by this router", param=f"messages.{len(messages) - 1}")
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    out = []
    for at, t in typed_tools(tools, "custom", untyped="custom", path="tools.{i}", not_a_list="tools: must "
                                                                                             "be a list",
                             supported="custom tools with an input_schema"):
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise InvalidRequest(f"{at}.name: Field required (a string)", param=f"{at}.name")
        if t.get("description") is not None and not isinstance(t["description"], str):
            raise InvalidRequest(f"{at}.description: must be a string", param=f"{at}.description")
        if not isinstance(t.get("input_schema"), dict):
            raise InvalidRequest(f"{at}.input_schema: Field required (a JSON Schema object)",
                                 param=f"{at}.input_schema")
        fn: dict[str, Any] = {"name": t["name"], "parameters": t["input_schema"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        if isinstance(t.get("strict"), bool):
            fn["strict"] = t["strict"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool" and not isinstance(choice.get("name"), str):
        raise InvalidRequest("tool_choice.name: Field required", param="tool_choice.name")
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind or "")
    if kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif mapped is not None:
        chat["tool_choice"] = mapped
    else:
        raise InvalidRequest(
            "tool_choice.type: must be one of 'auto', 'any', 'tool', 'none'", param="tool_choice"
        )
    if choice.get("disable_parallel_tool_use") and kind != "none":
        chat["parallel_tool_calls"] = False


def parse_request(
    body: Any, model_name: str, max_model_len: int, *, count_only: bool = False
) -> dict[str, Any]:
    """Validate a Messages request and translate it into the chat request it runs as."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    accepted = (
        _ACCEPTED
        - {
            "max_tokens",
            "stream",
            "stop_sequences",
            "temperature",
            "top_p",
            "top_k",
            "metadata",
            "service_tier",
            "speed",
            "inference_geo",
        }
        if count_only
        else _ACCEPTED
    )
    extra = body.keys() - accepted
    if extra:
        first = min(extra)
        raise InvalidRequest(f"{first}: Extra inputs are not permitted", param=first)
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise InvalidRequest("model: Field required", param="model")
    if body["model"] not in (model_name, "default"):
        raise InvalidRequest(f"model: {body['model']}", param="model", status=404)
    if body.get("output_config") not in (None, {}):
        raise InvalidRequest("output_config: structured output and effort are not supported by this router",
                             param="output_config")
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict) or thinking.get("type") != "disabled"):
        raise InvalidRequest("thinking: extended thinking is not supported by this model", param="thinking")
    messages = chat_messages(body.get("messages"))
    system = _system(body.get("system"))
    chat: dict[str, Any] = {
        "model": model_name,
        "messages": ([{"role": "system", "content": system}] if system else []) + messages,
    }
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
        _tool_choice(body.get("tool_choice"), chat)
    elif body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], {})
    if count_only:
        return chat
    mt = body.get("max_tokens")
    if mt is None:
        raise InvalidRequest("max_tokens: Field required", param="max_tokens")
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        raise InvalidRequest("max_tokens: must be a positive integer", param="max_tokens")
    if mt > max_model_len:
        raise InvalidRequest(f"max_tokens: {mt} > {max_model_len}, which is the "
                             "maximum allowed number of output tokens for this model", param="max_tokens")
    chat["max_tokens"] = mt
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise InvalidRequest(
                "stop_sequences: must be a list of non-empty strings", param="stop_sequences"
            )
        if stops:
            chat["stop"] = stops
    _number(body, "temperature", 0, 1)
    _number(body, "top_p", 0, 1)
    tk = body.get("top_k")
    if tk is not None and (isinstance(tk, bool) or not isinstance(tk, int) or tk < 0):
        raise InvalidRequest("top_k: must be a non-negative integer", param="top_k")
    for key in ("temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if "stream" in body and not isinstance(body["stream"], bool):
        raise InvalidRequest("stream: must be a boolean", param="stream")
    return chat


def stop_reason(finish: str | None, matched: int | str | None, calls: bool) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for a chat finish (vLLM's mapping: the token
    limit wins; a matched stop string unless the calls are complete; calls; else end of turn)."""
    if finish == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "output_tokens": completion, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0}


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": args if isinstance(args, dict) else {}}


_RUN = secrets.token_hex(8)  # ids are unique per router process without a system call each
_COUNTER = itertools.count()


def new_id() -> str:
    return f"msg_{_RUN}{next(_COUNTER):08x}"


def message_object(out: dict[str, Any], model: str) -> dict[str, Any]:
    """The Message for a finished (non-streamed) chat completion ``out``."""
    ch = out["choices"][0]
    msg = ch["message"]
    content: list[dict[str, Any]] = []
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    content += [_tool_use(c) for c in msg.get("tool_calls") or []]
    reason, seq = stop_reason(ch.get("finish_reason"), ch.get("stop_reason"), bool(msg.get("tool_calls")))
    u = out.get("usage") or {}
    res = {"id": new_id(), "type": "message", "role": "assistant", "model": model,
           "content": content or [{"type": "text", "text": ""}], "stop_reason": reason, "stop_sequence": seq,
           "usage": _usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0))}
    if out.get("agentrl"):
        res["agentrl"] = out["agentrl"]
    return res


class MessageEvents:
    """One opened chat stream as Anthropic's server-sent events: ``message_start``, per block
    ``content_block_start`` / ``content_block_delta`` (``text_delta``, ``input_json_delta``) /
    ``content_block_stop``, ``message_delta`` (stop reason, output tokens), ``message_stop``.
    An engine failure after the stream started is an ``error`` event."""

    def __init__(self, stream: Stream, model: str) -> None:
        self.stream = stream
        self.model = model
        self.index = -1  # the open block's index
        self.open: str | None = None  # "text" | "tool_use"
        self.calls: dict[int, int] = {}  # chat tool-call index -> block index
        self.finish: str | None = None
        self.matched: int | str | None = None  # the engine's stop_reason: a stop token id or string

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._stop()
        self.index += 1
        self.open = block["type"]
        return out + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _stop(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        prompt = len(self.stream.prep.prompt_ids)
        yield {"type": "message_start", "message": {
            "id": new_id(), "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": _usage(prompt, 0)}}
        try:
            async for ch in self.stream.choice_chunks():
                for ev in self._choice(ch):
                    yield ev
        except RouterError as e:
            yield error_body(e)
            return
        if self.index < 0:  # an empty reply is one empty text block, as unstreamed
            for ev in self._start({"type": "text", "text": ""}):
                yield ev
        for ev in self._stop():
            yield ev
        reason, seq = stop_reason(self.finish, self.matched, bool(self.calls))
        yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
               "usage": {"output_tokens": self.stream.completion_tokens()}}
        yield {"type": "message_stop"}

    def _choice(self, ch: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        delta = ch.get("delta") or {}
        if delta.get("content"):
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "text_delta", "text": delta["content"]}})
        for tc in delta.get("tool_calls") or []:
            fn = tc.get("function") or {}
            if tc.get("index", 0) not in self.calls:
                out += self._start(
                    {
                        "type": "tool_use",
                        "id": tc.get("id") or f"toolu_{secrets.token_hex(12)}",
                        "name": fn.get("name") or "",
                        "input": {},
                    }
                )
                self.calls[tc.get("index", 0)] = self.index
            if fn.get("arguments"):
                out.append({"type": "content_block_delta", "index": self.calls[tc.get("index", 0)],
                            "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}})
        if ch.get("finish_reason"):
            self.finish, self.matched = ch["finish_reason"], ch.get("stop_reason")
        return out


# -- routes ---------------------------------------------------------------------------------------
@web.middleware
async def anthropic_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error on the Messages routes in Anthropic's shape (the app's own middlewares give the
    OpenAI shape to the other routes)."""
    if not request.path.rstrip("/").endswith(("/v1/messages", "/v1/messages/count_tokens")):
        return await handler(request)
    try:
        return await handler(request)
    except RouterError as e:
        return json_response(error_body(e), status=e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        return json_response({"type": "error", "error": {"type": kind, "message": e.reason or "error"}},
                             status=e.status)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_response({"type": "error", "error": {"type": "api_error", "message": "internal "
                                                                                         "server error"}},
                             status=500)


async def create_message(request: web.Request) -> web.StreamResponse:
    check_client(request)
    router = request.app[ROUTER_KEY]
    sid = session_of(request)
    body, policy = router.named_policy(await json_body(request))
    chat = parse_request(body, router.model_name, router.max_model_len)
    if policy:  # a named LoRA policy: the chat call names it (Router.policy_of)
        chat["model"] = policy
    if body.get("stream") is True:
        stream = await open_stream(router, "chat", dict(chat, stream=True), sid, route="messages")
        return await typed_sse(request, MessageEvents(stream, router.model_name).events(), stream)
    out = await router.chat(chat, session_id=sid, route="messages")
    return json_response(message_object(out, router.model_name))


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's length as the model sees it (rendered as a message call would be, nothing generated)."""
    check_client(request)
    router = request.app[ROUTER_KEY]
    chat = parse_request(await json_body(request), router.model_name, router.max_model_len, count_only=True)
    body = router.validate(chat)
    engine = router.pool.pick(session_of(request))
    renderer = await router.renderer_for(engine, body)
    ids = (await renderer.render(engine, body)).ids
    return json_response({"input_tokens": len(ids)})


def add_routes(app: web.Application) -> None:
    app.middlewares.append(anthropic_errors)
    for prefix in ("", "/sessions/{session_id}"):
        app.router.add_post(f"{prefix}/v1/messages", create_message)
        app.router.add_post(f"{prefix}/v1/messages/count_tokens", count_tokens)
