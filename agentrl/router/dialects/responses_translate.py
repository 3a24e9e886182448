"""The OpenAI Responses API's translation (the dialect's routes are :mod:`.responses`): requests to
chat calls, chat answers to responses, and the store behind ``previous_response_id``.

A Responses request is translated into a chat request (:func:`parse_request`) and run by the
router's chat path: render -> token-in generate -> derender -> record, so every call is captured
with exact prompt and completion ids, behaviour logprobs and per-token versions, and calls that
extend each other are stitched into one sample exactly as chat calls are. The reply is translated
back (:func:`response_object`; streamed: :mod:`agentrl.router.dialects.responses_stream`).

Translation, as vLLM 0.32's own Responses server does it (facts, not its code): ``instructions``
is a leading system message; ``input`` a string is one user message; input items become chat
messages: ``message`` items by role (``developer`` is ``system``; text parts joined with a
newline, an assistant's parts concatenated), a ``function_call`` joins the assistant message
before it as a tool call (or starts one), a ``function_call_output`` is a tool message.
Function tools become chat tools, ``tool_choice`` and ``max_output_tokens`` map to their chat
names. Anything that has no exact chat rendering (images, files, audio, reasoning items, hosted
tools, item references, background mode, conversations, prompt templates, reasoning settings) is
refused with a 400 that names it: nothing is approximated.

``previous_response_id``: the router keeps each stored response's conversation
(:class:`ResponseStore`: this turn's input messages and the reply, linked to the turn before, so
a chain costs its length once); a request naming one is the stored conversation (without its
instructions, which do not carry over) plus the new input. Stored responses are scoped to the
session that made them: a session cannot read another's, and a session-less client cannot read a
session's. The store is bounded (least recently used out); an evicted or unknown id is a 400
``previous_response_not_found``.
"""

from __future__ import annotations

import copy
import itertools
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from agentrl.router.chat_parity import check_tools
from agentrl.router.errors import InvalidRequest, NotFound
from agentrl.router.validate import check_model, typed_tools

log = logging.getLogger(__name__)

MAX_STORED = 8192  # responses kept for previous_response_id and retrieval
# Request keys that change nothing the router renders or samples: accepted, echoed where the API does.
_ACCEPTED = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "previous_response_id",
        "store",
        "metadata",
        "include",
        "parallel_tool_calls",
        "truncation",
        "user",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "stream_options",
        "top_logprobs",
        "text",
        "reasoning",
        "background",
        "max_tool_calls",
    }
)
_LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TEXT_PARTS = {"user": ("input_text",), "system": ("input_text",), "developer": ("input_text",),
               "assistant": ("output_text", "refusal")}
_UNSUPPORTED_PARTS = ("input_image", "input_file", "input_audio")


_RUN = secrets.token_hex(8)  # ids are unique per router process without a system call each
_COUNTER = itertools.count()


def new_id(prefix: str) -> str:
    return f"{prefix}_{_RUN}{next(_COUNTER):08x}"


@dataclass
class _Stored:
    session_id: str | None
    parent: str | None  # previous_response_id of the turn that made this one
    messages: list[dict[str, Any]]  # this turn's input messages (no instructions) and then its reply
    response: dict[str, Any]


class ResponseStore:
    """Stored responses: their conversations for ``previous_response_id``, and the objects for retrieval."""

    def __init__(self, max_entries: int = MAX_STORED) -> None:
        self.max_entries = max_entries
        self._items: OrderedDict[str, _Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, session_id: str | None, parent: str | None, messages: list[dict[str, Any]],
            response: dict[str, Any]) -> None:
        self._items[rid] = _Stored(session_id, parent, messages, response)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def get(self, rid: str, session_id: str | None) -> dict[str, Any] | None:
        item = self._items.get(rid)
        return item.response if item is not None and item.session_id == session_id else None

    def delete(self, rid: str, session_id: str | None) -> bool:
        item = self._items.get(rid)
        if item is None or item.session_id != session_id:
            return False
        del self._items[rid]
        return True

    def history(self, rid: str, session_id: str | None) -> list[dict[str, Any]]:
        """The conversation up to and including response ``rid``'s reply (chat messages, copies)."""
        chain: list[_Stored] = []
        at: str | None = rid
        while at is not None:
            item = self._items.get(at)
            if item is None or item.session_id != session_id:
                raise InvalidRequest(
                    f"Previous response with id '{at}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            self._items.move_to_end(at)  # a chain in use stays
            chain.append(item)
            at = item.parent
        return [copy.deepcopy(m) for item in reversed(chain) for m in item.messages]


@dataclass
class ResponsesTurn:
    """One Responses request, translated: the chat body it runs as, and what the reply echoes."""

    chat: dict[str, Any]
    new_messages: list[dict[str, Any]]  # this turn's input as chat messages (what the store keeps)
    request: dict[str, Any]  # the validated Responses request
    tools: list[dict[str, Any]] = field(default_factory=list)  # the request's function tools, as sent
    want_logprobs: bool = False

    @property
    def store(self) -> bool:
        return self.request.get("store") is not False


def _text_of(parts: Any, role: str, where: str) -> str | list[dict[str, str]]:
    """A message item's content as chat content: a string, or text parts (joined with a newline by the
    template path)."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list) or not parts:
        raise InvalidRequest(f"{where}.content must be a string or a non-empty list of content parts",
                             param=f"{where}.content")
    texts = []
    for j, p in enumerate(parts):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in _UNSUPPORTED_PARTS:
            raise InvalidRequest(
                f"{where}.content[{j}]: '{kind}' is not supported by this router (text only)",
                param=f"{where}.content[{j}].type",
                code="unsupported_content",
            )
        key = "refusal" if kind == "refusal" else "text"
        if kind not in _TEXT_PARTS[role] or not isinstance(p.get(key), str):
            raise InvalidRequest(f"{where}.content[{j}] must be one of {list(_TEXT_PARTS[role])} "
                                 f"with a string '{key}' for role '{role}'", param=f"{where}.content[{j}]")
        texts.append(p[key])
    if role == "assistant":
        return "".join(texts)
    return texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]


def _output_text(out: Any) -> str:
    if isinstance(out, str):
        return out
    if isinstance(out, list) and all(isinstance(p, dict) and p.get("type") == "input_text"
                                     and isinstance(p.get("text"), str) for p in out):
        return "\n".join(p["text"] for p in out)
    raise InvalidRequest("a function_call_output's 'output' must be a string or a list of input_text parts",
                         param="input")


def input_messages(items: Any, known_calls: set[str]) -> list[dict[str, Any]]:
    """Responses ``input`` as chat messages; ``known_calls`` (call ids of the conversation so far)
    grows with this input's calls, and every ``function_call_output`` must answer one of them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidRequest("'input' must be a string or a non-empty list of input items", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _TEXT_PARTS:
                raise InvalidRequest(
                    f"{where}.role must be one of {sorted(_TEXT_PARTS)}", param=f"{where}.role"
                )
            content = _text_of(item.get("content"), role, where)
            msg_role = "system" if role == "developer" else role
            prev = out[-1] if out else None
            if (
                role == "assistant"
                and prev is not None
                and prev["role"] == "assistant"
                and prev.get("content") is None
            ):
                prev["content"] = content  # its calls came first: one assistant message, as vLLM merges them
            else:
                out.append({"role": msg_role, "content": content})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
            if not (
                isinstance(call_id, str)
                and call_id
                and isinstance(name, str)
                and name
                and isinstance(args, str)
            ):
                raise InvalidRequest(f"{where}: a function_call needs string "
                                     "'call_id', 'name' and 'arguments'",
                                     param=where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            known_calls.add(call_id)
            prev = out[-1] if out else None
            if prev is not None and prev["role"] == "assistant":
                prev.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in known_calls:
                raise InvalidRequest(f"No tool call found for function call output with call_id {call_id!r}.",
                                     param=f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _output_text(item.get("output"))})
        else:
            raise InvalidRequest(
                f"{where}: input items of type {kind!r} are not supported by this router "
                "(message, function_call and function_call_output are)",
                param=f"{where}.type",
                code="unsupported_input_item",
            )
    return out


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    out = []
    for _, t in typed_tools(tools, "function", untyped=None, path="tools[{i}]",
                            not_a_list="'tools' must be a list of function tools", supported="function tools",
                            code="unsupported_tool"):
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    chat = {"tools": out}
    try:
        check_tools(chat)
    except InvalidRequest as e:
        e.param = (e.param or "tools").replace(".function", "")
        e.message = e.message.replace(".function", "")
        raise
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest("'tool_choice' must be 'auto', 'none', 'required' "
                         "or {\"type\": \"function\", \"name\": ...}",
                         param="tool_choice")


def _response_format(text: Any) -> dict[str, Any] | None:
    fmt = (text or {}).get("format") if isinstance(text, dict) else None
    if fmt is None or fmt == {"type": "text"}:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {
            "type": "json_schema",
            "json_schema": {
                "name": fmt.get("name") or "response",
                "schema": fmt["schema"],
                "strict": fmt.get("strict"),
            },
        }
    raise InvalidRequest(
        "'text.format' must be text, json_object or json_schema with a 'schema'", param="text.format"
    )


def parse_request(body: Any, model_name: str, store: ResponseStore, session_id: str | None,
                  max_model_len: int) -> ResponsesTurn:
    """Validate a Responses request and translate it into the chat request it runs as."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    unknown = body.keys() - _ACCEPTED
    if unknown:
        first = min(unknown)
        raise InvalidRequest(f"Unknown parameter: '{first}'.", param=first, code="unknown_parameter")
    check_model(body, model_name)
    if body.get("background"):
        raise InvalidRequest("background responses are not supported by this router", param="background")
    if body.get("reasoning") not in (None, {}) and any(v is not None for v in body["reasoning"].values()):
        raise InvalidRequest("this model takes no reasoning settings", param="reasoning")
    if body.get("truncation") not in (None, "disabled", "auto"):
        raise InvalidRequest("'truncation' must be 'auto' or 'disabled'", param="truncation")
    mot = body.get("max_output_tokens")
    if mot is not None and (isinstance(mot, bool) or not isinstance(mot, int) or mot < 1):
        raise InvalidRequest("'max_output_tokens' must be a positive integer", param="max_output_tokens")
    if isinstance(mot, int) and mot > max_model_len:
        raise InvalidRequest(f"max_output_tokens={mot} cannot be greater than max_model_len={max_model_len}.",
                             param="max_output_tokens")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("'instructions' must be a string", param="instructions")
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise InvalidRequest("'include' must be a list of strings", param="include")
    history: list[dict[str, Any]] = []
    prev = body.get("previous_response_id")
    if prev is not None:
        if not isinstance(prev, str):
            raise InvalidRequest("'previous_response_id' must be a string", param="previous_response_id")
        history = store.history(prev, session_id)
    known = {c["id"] for m in history for c in m.get("tool_calls") or []}
    new = input_messages(body.get("input"), known)
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history + new
    chat: dict[str, Any] = {"model": model_name, "messages": messages}
    tools = body.get("tools") or []
    if tools:
        chat["tools"] = _chat_tools(tools)
    tool_choice = _chat_tool_choice(body.get("tool_choice"))
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    if forced and not tools:  # the model is made to call a tool that does not exist
        raise InvalidRequest("'tool_choice' asks for a tool call, but 'tools' is empty", param="tool_choice")
    named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    if named is not None and named not in {t["function"]["name"] for t in chat["tools"]}:
        raise InvalidRequest(f"'tool_choice' names {named!r}, which is not in 'tools'", param="tool_choice")
    if tool_choice is not None and tools:
        chat["tool_choice"] = tool_choice
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("user", "user")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    if body.get("parallel_tool_calls") is False and tools:
        chat["parallel_tool_calls"] = False
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    want_logprobs = _LOGPROBS_INCLUDE in include or bool(body.get("top_logprobs"))
    if want_logprobs:
        chat["logprobs"] = True
        if body.get("top_logprobs"):
            chat["top_logprobs"] = body["top_logprobs"]
    return ResponsesTurn(chat, new, body, tools=list(tools), want_logprobs=want_logprobs)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def logprob_items(entries: list[dict[str, Any]] | None, *, with_bytes: bool = True) -> list[dict[str, Any]]:
    """Chat logprob entries as the Responses API writes them (its delta events carry no bytes)."""
    def one(e: dict[str, Any]) -> dict[str, Any]:
        return {"token": e["token"], "logprob": e["logprob"], **({"bytes": e["bytes"]} if with_bytes else {})}
    return [{**one(e), "top_logprobs": [one(t) for t in e.get("top_logprobs") or []]} for e in entries or []]


def message_item(
    item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def call_item(item_id: str, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"]}


def response_object(turn: ResponsesTurn, rid: str, model: str, *, status: str, output: list[dict[str, Any]],
                    use: dict[str, Any] | None, created: float) -> dict[str, Any]:
    """The Response object as the official SDK parses it."""
    req = turn.request
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.get("instructions"),
        "max_output_tokens": req.get("max_output_tokens"),
        "max_tool_calls": req.get("max_tool_calls"),
        "metadata": req.get("metadata") or {},
        "model": model,
        "output": output,
        "parallel_tool_calls": req.get("parallel_tool_calls", True),
        "previous_response_id": req.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None},
        "service_tier": req.get("service_tier") or "default",
        "store": turn.store,
        "temperature": req.get("temperature", 1.0),
        "text": req.get("text") or {"format": {"type": "text"}},
        "tool_choice": req.get("tool_choice") or "auto",
        "tools": turn.tools,
        "top_logprobs": req.get("top_logprobs", 0),
        "top_p": req.get("top_p", 1.0),
        "truncation": req.get("truncation") or "disabled",
        "usage": use,
        "user": req.get("user"),
    }


def reply_output(message: dict[str, Any], finish: str | None, logprobs: list[dict[str, Any]] | None
                 ) -> tuple[list[dict[str, Any]], str]:
    """A chat reply's message as Response output items, and the response status."""
    status = "incomplete" if finish == "length" else "completed"
    output = []
    if message.get("content"):
        output.append(message_item(new_id("msg"), message["content"], status,
                                   logprob_items(logprobs) if logprobs is not None else None))
    for call in message.get("tool_calls") or []:
        output.append(call_item(new_id("fc"), call))
    return output, status


def from_chat(turn: ResponsesTurn, out: dict[str, Any], model: str) -> dict[str, Any]:
    """The Response for a finished (non-streamed) chat completion ``out``."""
    ch = out["choices"][0]
    lps = ((ch.get("logprobs") or {}).get("content") or []) if turn.want_logprobs else None
    output, status = reply_output(ch["message"], ch.get("finish_reason"), lps)
    u = out.get("usage") or {}
    resp = response_object(
        turn,
        new_id("resp"),
        model,
        status=status,
        output=output,
        use=usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0)),
        created=time.time(),
    )
    if out.get("agentrl"):
        resp["agentrl"] = out["agentrl"]
    return resp


def remember(store: ResponseStore, turn: ResponsesTurn, resp: dict[str, Any], reply: dict[str, Any],
             session_id: str | None) -> None:
    """Keep a response's conversation for ``previous_response_id`` (unless ``store`` is false)."""
    if not turn.store:
        return
    msg: dict[str, Any] = {"role": "assistant", "content": reply.get("content")}
    if reply.get("tool_calls"):
        msg["tool_calls"] = [{"id": c["id"], "type": "function", "function": dict(c["function"])}
                             for c in reply["tool_calls"]]
    store.put(
        resp["id"], session_id, turn.request.get("previous_response_id"), turn.new_messages + [msg], resp
    )


def retrieve(store: ResponseStore, rid: str, session_id: str | None) -> dict[str, Any]:
    resp = store.get(rid, session_id)
    if resp is None:
        raise NotFound(f"No response found with id '{rid}'.", param="response_id")
    return resp
