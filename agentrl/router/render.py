"""Local render and derender: the engine's chat template and tool parser, run in the router process.

Routing a completion through vLLM's render, token-in generate and derender routes costs three
HTTP round trips. :class:`LocalCodec` does render and derender here, with the same tokenizer and
chat template files the engine loaded, so a call costs one round trip (generate). It mirrors what
vLLM 0.32 does for a chat request:

- render: messages normalised as vLLM's ``parse_chat_messages`` does (text parts joined with a
  newline, assistant tool-call arguments parsed to objects, ``{}`` when they are not valid JSON),
  tools as vLLM dumps them, then ``tokenizer.apply_chat_template(..., tokenize=True)``; sampling
  parameters as the render route builds them (with the engine's defaults, learned by calibration);
- derender: the output ids decoded with special tokens kept (a tool parser is configured), then
  the hermes parser (``<tool_call>{json}</tool_call>``; any malformed call leaves the whole text as
  content, as vLLM does).

Exactness is the invariant. The codec takes only requests it fully understands (:meth:`can_render`,
:meth:`can_derender`); anything else (content that is not text, named or required tool choice,
structured outputs, logit bias, logprobs shown to the client, stop strings, a tail that is not
valid UTF-8 ...) goes to the engine's own routes. And before it is trusted, :meth:`calibrate`
renders and derenders probe requests both ways on a live engine; any difference switches the
router to the engine's routes for good, with a warning.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import re
import secrets
import time
from pathlib import Path
from typing import Any

from jinja2.runtime import new_context

log = logging.getLogger(__name__)

# Body keys the local path handles; any other key sends the request to the engine's routes.
LOCAL_CHAT_KEYS = frozenset({
    "messages", "model", "tools", "tool_choice", "n", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "seed", "stop", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "stream",
    "stream_options", "user",
})
_MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id", "name"})
_ROLES = frozenset({"system", "user", "assistant", "tool"})
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
# vLLM's render route: these always appear, with the request's value or the server default.
_DEFAULTED = (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
              ("temperature", 1.0), ("top_p", 1.0), ("min_p", 0.0))
_BILLING_HEADER = "x-anthropic-billing-header"  # vLLM strips system parts that start with it
_TOOL_CALL = "<tool_call>"
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_OUTPUT_KIND_FINAL = 2  # vLLM RequestOutputKind.FINAL_ONLY: what render sets for a non-streamed body


class LocalCodec:
    """Renders chat requests to prompt ids and parses generated ids back, exactly as the engine."""

    def __init__(self, tokenizer: Any, *, max_model_len: int, model_dir: str = "") -> None:
        self.tok = tokenizer
        self.template: str = tokenizer.chat_template
        self.max_model_len = max_model_len
        self.model_dir = model_dir
        self.defaults: dict[str, Any] = {}  # the engine's default sampling parameters (calibrate)
        self._decode = tokenizer.backend_tokenizer.decoder.decode
        self._id_to_token = tokenizer.convert_ids_to_tokens
        self._encode = tokenizer.backend_tokenizer.encode
        # What apply_chat_template does, without its per-call argument handling (about 1 ms a call
        # here): transformers' own compiled template (same environment and filters), rendered with
        # the special tokens as variables, then encoded without added special tokens.
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            self._compiled: Any = _compile_jinja_template(self.template)
        except ImportError:  # an older transformers: go through apply_chat_template itself
            self._compiled = None
        self._template_vars = dict(tokenizer.special_tokens_map)
        # Template.render merges the template's globals (a ChainMap over the environment's) into
        # every call's context; a flat copy made once does the same for a fraction of the cost.
        self._globals = dict(self._compiled.globals) if self._compiled is not None else {}
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(4)

    @classmethod
    def load(cls, model_dir: str | Path | None, *, max_model_len: int) -> LocalCodec | None:
        """The codec for a model folder, or None (with the reason logged) when it cannot be exact."""
        if not model_dir or not Path(model_dir).is_dir():
            log.info("no local model folder (%s): the router uses the engine's render/derender routes", model_dir)
            return None
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(model_dir))
        except Exception as e:
            log.warning("could not load the tokenizer from %s (%s): using the engine's render/derender", model_dir, e)
            return None
        decoder = getattr(getattr(tok, "backend_tokenizer", None), "decoder", None)
        byte_level = "ByteLevel" in type(decoder).__name__ or "ByteLevel" in repr(decoder)
        if not getattr(tok, "is_fast", False) or not tok.chat_template or not byte_level:
            # Metaspace (sentencepiece-style) decoders need the prompt tail to place a leading
            # space; only byte-level decoding is concatenative, so only that is done here.
            log.warning("the tokenizer in %s is not a byte-level fast tokenizer with a chat template: using the "
                        "engine's render/derender", model_dir)
            return None
        return cls(tok, max_model_len=max_model_len, model_dir=str(model_dir))

    # -- render -----------------------------------------------------------------------------------
    def can_render(self, body: dict[str, Any]) -> bool:
        """Whether the local render reproduces the engine's for this (validated) chat body."""
        if not body.keys() <= LOCAL_CHAT_KEYS:
            return False
        if body.get("tool_choice") not in (None, "auto", "none"):
            return False
        tools = body.get("tools")
        if tools is not None:
            for t in tools:
                if not t.keys() <= _TOOL_KEYS or t.get("type", "function") != "function" \
                        or not t["function"].keys() <= _FUNCTION_KEYS or t["function"].get("strict"):
                    return False  # strict tools make vLLM add a structured-output grammar
        for m in body["messages"]:
            if not m.keys() <= _MESSAGE_KEYS or m["role"] not in _ROLES or _text(m.get("content")) is None:
                return False
            if m["role"] == "system" and _text(m.get("content")).startswith(_BILLING_HEADER):
                return False
            calls = m.get("tool_calls")
            if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and c.get("type", "function") == "function"
                    and isinstance(c.get("function"), dict) for c in calls)):
                return False
        return True

    def conversation(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages as vLLM hands them to the chat template."""
        conv = []
        for m in messages:
            out: dict[str, Any] = {"role": m["role"], "content": _text(m.get("content"))}
            if m["role"] == "assistant" and m.get("tool_calls") is not None:
                calls = copy.deepcopy(m["tool_calls"])
                for c in calls:
                    c["function"]["arguments"] = _arguments(c["function"].get("arguments"))
                if calls:
                    out["tool_calls"] = calls
            elif m["role"] == "tool" and "tool_call_id" in m:
                out["tool_call_id"] = m["tool_call_id"]
            if isinstance(m.get("name"), str):
                out["name"] = m["name"]
            conv.append(out)
        return conv

    def tool_dicts(self, body: dict[str, Any]) -> list[dict[str, Any]] | None:
        tools = body.get("tools")
        if tools is None:
            return None
        out = []
        for t in tools:
            f = t["function"]
            fn = {"name": f["name"], "description": f.get("description"), "parameters": f.get("parameters")}
            if f.get("strict") is not None:
                fn["strict"] = f["strict"]
            out.append({"type": "function", "function": fn})
        return out

    def render_ids(self, body: dict[str, Any], messages: list[dict[str, Any]] | None = None,
                   add_generation_prompt: bool = True) -> list[int]:
        """``tokenizer.apply_chat_template(conversation, tools=..., tokenize=True)``, as vLLM calls it."""
        if self._compiled is None:
            return self.render_ids_reference(body, messages, add_generation_prompt)
        tmpl = self._compiled
        ctx = new_context(tmpl.environment, tmpl.name, tmpl.blocks, dict(
            self._template_vars, messages=self.conversation(body["messages"] if messages is None else messages),
            tools=self.tool_dicts(body), documents=None, add_generation_prompt=add_generation_prompt),
            False, self._globals)
        try:
            text = tmpl.environment.concat(tmpl.root_render_func(ctx))
        except Exception:
            tmpl.environment.handle_exception()  # re-raises with the template's line (as render does)
        return self._encode(text, add_special_tokens=False).ids

    def render_ids_reference(self, body: dict[str, Any], messages: list[dict[str, Any]] | None = None,
                             add_generation_prompt: bool = True) -> list[int]:
        """The same through ``apply_chat_template`` itself (calibration checks the two agree)."""
        return list(self.tok.apply_chat_template(
            self.conversation(body["messages"] if messages is None else messages), tools=self.tool_dicts(body),
            chat_template=self.template, tokenize=True, return_dict=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=False))

    def sampling_params(self, body: dict[str, Any], prompt_len: int) -> dict[str, Any]:
        """The render route's ``sampling_params`` for a body whose ``logprobs`` the router forced on."""
        sp: dict[str, Any] = {}
        n = body.get("n", 1)
        if n != 1:
            sp["n"] = n
        for name, default in _DEFAULTED:
            v = body.get(name)
            sp[name] = float(v) if v is not None else self.defaults.get(name, default)
        if "top_k" in self.defaults:
            sp["top_k"] = self.defaults["top_k"]
        if body.get("seed") is not None:
            sp["seed"] = body["seed"]
        stop = body.get("stop")
        sp["stop"] = [stop] if isinstance(stop, str) else list(stop or [])
        if sp["stop"]:  # SamplingParams holds back this much text while it looks for a stop string
            sp["output_text_buffer_length"] = max(len(x) for x in sp["stop"]) - 1
        sp["stop_token_ids"] = []
        wanted = body.get("max_completion_tokens")
        if wanted is None:
            wanted = body.get("max_tokens")
        limit = self.max_model_len - prompt_len
        sp["max_tokens"] = min(limit, wanted) if wanted is not None else limit
        sp["logprobs"] = body.get("top_logprobs") or 0
        if body.get("tools") and body.get("tool_choice") != "none":
            sp["skip_special_tokens"] = False  # the hermes parser's adjust_request
        sp.update(output_kind=_OUTPUT_KIND_FINAL, skip_clone=True, bad_words=[], skip_reading_prefix_cache=False)
        return sp

    def generate_request(self, body: dict[str, Any], prompt_ids: list[int]) -> dict[str, Any]:
        # unique per router process (a random prefix) without a system call per request
        return {"request_id": f"chatcmpl-{self._id_prefix}{next(self._ids):x}", "token_ids": prompt_ids,
                "sampling_params": self.sampling_params(body, len(prompt_ids)), "model": body.get("model"),
                "stream": False}

    # -- derender ---------------------------------------------------------------------------------
    def can_derender(self, body: dict[str, Any], gen: dict[str, Any]) -> bool:
        """Local derender is exact for these; stop strings and client logprobs go to the engine."""
        if body.get("logprobs"):
            return False
        return all(ch.get("stop_reason") is None and ch.get("token_ids") for ch in gen.get("choices") or [])

    def decode(self, ids: list[int]) -> str:
        return self._decode(self._id_to_token(ids))

    def derender_chat(self, gen: dict[str, Any], body: dict[str, Any]) -> dict[str, Any] | None:
        """The engine's non-streaming chat derender of ``gen``; None when it would not be exact."""
        parse = bool(body.get("tools")) and body.get("tool_choice") in (None, "auto")
        choices = []
        for ch in gen["choices"]:
            text = self.decode(ch["token_ids"])
            if text.endswith("\ufffd"):
                return None  # vLLM's incremental detokeniser holds back an unfinished character
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                                       "audio": None, "function_call": None}
            if parse:
                calls, content = parse_hermes(text)
                message["content"] = content
                if calls:
                    message["tool_calls"] = [{"id": secrets.token_hex(8), "type": "function", "function": c}
                                             for c in calls]
            message["reasoning"] = None
            choices.append({"index": ch.get("index", 0), "message": message, "logprobs": None,
                            "finish_reason": ch.get("finish_reason"), "stop_reason": ch.get("stop_reason"),
                            "token_ids": None, "routed_experts": None})
        return {"id": gen.get("request_id"), "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model"), "choices": choices}

    # -- calibration ------------------------------------------------------------------------------
    async def calibrate(self, pool: Any, engine: Any) -> str | None:
        """Compare local and engine render/derender on probe requests; the first difference, or None."""
        probe = {"model": None, "messages": [{"role": "user", "content": "."}], "logprobs": True}
        probe["model"] = await _served_model(pool, engine)
        got = await pool.call(engine, "/v1/chat/completions/render", probe, count=False)
        sp = got.get("sampling_params") or {}
        self.defaults = {k: sp[k] for k, _ in _DEFAULTED if k in sp}
        if "top_k" in sp:
            self.defaults["top_k"] = sp["top_k"]
        for body in calibration_bodies(probe["model"]):
            ref = await pool.call(engine, "/v1/chat/completions/render", body, count=False)
            ids = self.render_ids(body)
            if ids != ref["token_ids"] or ids != self.render_ids_reference(body):
                return f"prompt ids differ for {_brief(body)}"
            mine = self.sampling_params(body, len(ids))
            if not same_sampling(mine, ref.get("sampling_params") or {}):
                return f"sampling params differ for {_brief(body)}: local {mine}, engine {ref.get('sampling_params')}"
            for text in CALIBRATION_OUTPUTS:
                out = self.tok.encode(text, add_special_tokens=False)
                gen = {"request_id": "calibrate", "choices": [{"index": 0, "finish_reason": "stop",
                                                               "stop_reason": None, "token_ids": out}]}
                theirs = await pool.call(engine, "/v1/chat/completions/derender", {
                    "generate_response": gen, "prompt_token_ids": ids, "prompt_tokens": len(ids),
                    "chat_request": body}, count=False)
                local = self.derender_chat(gen, body)
                if local is None or not same_message(local["choices"][0]["message"],
                                                     theirs["choices"][0]["message"]):
                    return (f"derender differs for {text!r} ({_brief(body)}): local "
                            f"{local and local['choices'][0]['message']}, engine {theirs['choices'][0]['message']}")
        return None


def parse_hermes(text: str) -> tuple[list[dict[str, str]], str | None]:
    """vLLM's hermes tool parser (non-streaming): (calls, content)."""
    if _TOOL_CALL not in text:
        return [], text
    try:
        calls = []
        for a, b in _TOOL_CALL_RE.findall(text):
            call = json.loads(a if a else b)
            name = call["name"]
            if not isinstance(name, str):
                raise TypeError("the tool name is not a string")
            calls.append({"name": name, "arguments": json.dumps(call["arguments"], ensure_ascii=False)})
    except Exception:
        return [], text
    content = text[:text.find(_TOOL_CALL)] or None
    if content is not None and content.strip() == "":
        content = None
    return calls, content


# vLLM's SamplingParams defaults: its render route leaves out some fields that hold them.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "n": 1, "max_tokens": 16, "top_k": 0, "skip_special_tokens": True, "seed": None, "stop": [],
    "stop_token_ids": [], "logprobs": None, "output_kind": 0, "skip_clone": False, "bad_words": [],
    "skip_reading_prefix_cache": False, "temperature": 1.0, "top_p": 1.0, "min_p": 0.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "output_text_buffer_length": 0,
}


def same_sampling(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same sampling parameters once fields left out are read as vLLM's defaults."""
    return all(a.get(k, SAMPLING_DEFAULTS.get(k)) == b.get(k, SAMPLING_DEFAULTS.get(k)) for k in a.keys() | b.keys())


def same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal as the client sees them, tool-call ids aside (those are random on both sides)."""
    def strip(m: dict[str, Any]) -> dict[str, Any]:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in m["tool_calls"]]
        return m
    return strip(a) == strip(b)


TOOLS = [{"type": "function", "function": {"name": "python", "description": "Run Python code.", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]


def calibration_bodies(model: str) -> list[dict[str, Any]]:
    """Probe requests: plain, system prompt, tools, a tool round trip with invalid arguments, sampling."""
    call = {"id": "c1", "type": "function", "function": {"name": "python", "arguments": '{"code": "print(1)"}'}}
    bad = {"id": "c2", "type": "function", "function": {"name": "python", "arguments": "{not json"}}
    return [
        {"model": model, "messages": [{"role": "user", "content": "hi"}], "logprobs": True},
        {"model": model, "messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "héllo ✓"}], "logprobs": True,
         "n": 2, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["x"], "max_tokens": 7},
        {"model": model, "tools": TOOLS, "logprobs": True, "max_tokens": 16, "messages": [
            {"role": "system", "content": "Use tools."}, {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": None, "tool_calls": [call, bad]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"}, {"role": "tool", "tool_call_id": "c2",
                                                                      "content": "error"}]},
    ]


CALIBRATION_OUTPUTS = (
    "plain answer",
    'ok <tool_call>\n{"name": "python", "arguments": {"code": "print(\'é\')"}}\n</tool_call>',
    '<tool_call>\n{"name": "python", "arguments": {"code": "1"}\n</tool_call>',  # invalid JSON
)


async def _served_model(pool: Any, engine: Any) -> str:
    import aiohttp

    async with pool._http.get(engine.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as r:
        data = await r.json()
    return data["data"][0]["id"]


def _text(content: Any) -> str | None:
    """Message content as the string vLLM renders (None: a shape only the engine handles)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    return None


def _arguments(args: Any) -> Any:
    """vLLM's ``_postprocess_messages``: tool-call arguments become an object ({} when not one)."""
    if not args:
        return {}
    if isinstance(args, dict):
        return args
    parsed = args
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
    return parsed if isinstance(parsed, dict) else {}


def _brief(body: dict[str, Any]) -> str:
    return json.dumps(body)[:200]
