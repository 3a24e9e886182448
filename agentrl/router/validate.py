"""Request validation for the OpenAI routes: bad input becomes a 4xx with an OpenAI error body.

The checks here are the ones a client can get wrong cheaply and the engine would otherwise answer
with a less helpful message (or not at all, e.g. ``n`` far beyond what the pool should sample).
Everything else is passed through to vLLM's render route, whose 4xx answers are returned as-is.
"""

from __future__ import annotations

from typing import Any

import orjson

from agentrl.router.chat_parity import check_tools
from agentrl.router.errors import InvalidRequest

ALLOWED_ROLES = {"system", "user", "assistant", "tool", "developer"}
MAX_N = 64
MAX_TOP_LOGPROBS = 20


def typed_tools(tools: Any, wanted: str, *, untyped: str | None, path: str, not_a_list: str, supported: str,
                code: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """A foreign protocol's ``tools``, each checked to be an object of type ``wanted`` (one without a
    type counts as ``untyped``): ``(its parameter path, the tool)`` per tool, the path ``path`` with
    ``{i}`` filled in. A non-list is :class:`InvalidRequest` ``not_a_list``; a tool of another type one
    that names it and what this router ``supported``."""
    if not isinstance(tools, list):
        raise InvalidRequest(not_a_list, param="tools")
    out = []
    for i, t in enumerate(tools):
        at = path.format(i=i)
        if not isinstance(t, dict) or t.get("type", untyped) != wanted:
            kind = t.get("type") if isinstance(t, dict) else None
            raise InvalidRequest(f"{at}: tools of type {kind!r} are not "
                                 f"supported by this router ({supported} are)",
                                 param=f"{at}.type", code=code)
        out.append((at, t))
    return out


def _number(body: dict[str, Any], key: str, lo: float, hi: float) -> None:
    v = body.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi):
        raise InvalidRequest(f"'{key}' must be a number between {lo:g} and {hi:g}", param=key)


def _positive_int(body: dict[str, Any], key: str) -> None:
    v = body.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise InvalidRequest(f"'{key}' must be a positive integer", param=key)


def check_model(body: dict[str, Any], model_name: str) -> None:
    model = body.get("model")
    if model is not None and model not in (model_name, "default"):
        raise InvalidRequest(f"the model {model!r} does not exist; this endpoint serves {model_name!r}",
                             param="model", code="model_not_found", status=404)


def check_sampling(body: dict[str, Any]) -> None:
    """Parameters shared by chat and text completions."""
    n = body.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise InvalidRequest(f"'n' must be an integer between 1 and {MAX_N}", param="n")
    _positive_int(body, "max_tokens")
    _positive_int(body, "max_completion_tokens")
    _number(body, "temperature", 0, 2)
    _number(body, "top_p", 0, 1)
    if body.get("top_p") == 0:
        raise InvalidRequest("'top_p' must be greater than 0", param="top_p")
    _number(body, "presence_penalty", -2, 2)
    _number(body, "frequency_penalty", -2, 2)
    _number(body, "min_p", 0, 1)
    _number(body, "repetition_penalty", 0, 100)
    if body.get("repetition_penalty") == 0:
        raise InvalidRequest("'repetition_penalty' must be greater than 0", param="repetition_penalty")
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1):
        raise InvalidRequest("'top_k' must be an integer: 0 or -1 (off), or at least 1", param="top_k")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidRequest("'seed' must be an integer", param="seed")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise InvalidRequest("'stop' must be a string or a list of strings", param="stop")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise InvalidRequest("'stream_options' must be an object", param="stream_options")


def text_size(body: dict[str, Any]) -> int:
    """Characters of text a chat request carries (message contents, tool-call arguments, tools): a
    cheap bound of its prompt, taken before anything is tokenised."""
    n = 0
    for m in body.get("messages") or []:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            n += sum(
                len(p.get("text") or "")
                for p in content
                if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
        for c in m.get("tool_calls") or []:
            args = (c.get("function") or {}).get("arguments") if isinstance(c, dict) else None
            n += len(args) if isinstance(args, str) else 0
    tools = body.get("tools")
    if isinstance(tools, list):
        n += sum(_size(t) for t in tools)
    return n


def _size(value: Any) -> int:
    """Characters of ``value`` as compact JSON (orjson's, decoded: a tool in another script counts
    its characters, not its UTF-8 bytes; a microsecond or two a tool), the repr's for what orjson
    does not take."""
    try:
        return len(orjson.dumps(value).decode())
    except TypeError:
        return len(repr(value))


def check_size(body: dict[str, Any], max_chars: int) -> None:
    """Refuse a request whose text cannot fit the context however it tokenises (``max_chars`` =
    context length x the longest token's characters): a huge prompt costs no tokenising at all."""
    if max_chars and (n := text_size(body)) > max_chars:
        raise InvalidRequest(
            f"the prompt has {n} characters: more than this model's context can hold "
            f"({max_chars} characters at most)",
            param="messages",
            code="context_length_exceeded",
        )


def validate_chat(body: Any, model_name: str, max_chars: int = 0) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    check_model(body, model_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list of chat messages", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ALLOWED_ROLES:
            raise InvalidRequest(f"messages[{i}] must be an object with a role in {sorted(ALLOWED_ROLES)}",
                                 param=f"messages[{i}]")
    check_size(body, max_chars)
    check_sampling(body)
    lp = body.get("logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise InvalidRequest("'logprobs' must be a boolean for chat completions", param="logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"'top_logprobs' must be an integer between 0 and {MAX_TOP_LOGPROBS}",
                                 param="top_logprobs")
        if not lp:
            raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    check_tools(body)
    body = dict(body)
    body["model"] = model_name
    return body


def validate_completion(body: Any, model_name: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    check_model(body, model_name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt wrapped in a list
    token_prompt = isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not token_prompt:
        raise InvalidRequest("'prompt' must be one non-empty string or one list of token ids "
                             "(send one prompt per request)", param="prompt")
    check_sampling(body)
    lp = body.get("logprobs")
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 5):
        raise InvalidRequest(
            "'logprobs' must be an integer between 0 and 5 for completions", param="logprobs"
        )
    if body.get("echo"):
        raise InvalidRequest("'echo' is not supported by this router", param="echo")
    body = dict(body, prompt=prompt, model=model_name)
    return body
