"""Rendering: a chat request to prompt ids, and generated ids back to a chat completion.

One interface, :class:`Renderer`, two implementations, picked once per call by the router:

- :class:`LocalRenderer` renders and derenders in the router process with the same tokenizer
  and chat template files the engine loaded, so a call costs one engine round trip (generate).
  It mirrors what vLLM 0.32 does for a chat request: messages normalised as vLLM's
  ``parse_chat_messages`` does (text parts joined with a newline, assistant tool-call arguments
  parsed to objects, ``{}`` when they are not valid JSON), tools as vLLM dumps them, then
  ``tokenizer.apply_chat_template(..., tokenize=True)``; sampling parameters as the render route
  builds them (with the engine's defaults, learned by calibration); derender decodes the ids with
  special tokens kept, then runs the hermes parser (``<tool_call>{json}</tool_call>``; any
  malformed call leaves the whole text as content, as vLLM does).
- :class:`EngineRenderer` asks the engine (``/v1/chat/completions/render`` and ``/derender``):
  three round trips per completion, exact for anything the engine accepts.

Exactness is the invariant. The local renderer takes only requests it fully understands
(:meth:`LocalRenderer.can_render`; derender: :meth:`LocalRenderer.can_derender`, else it hands
the choice to the engine's derender); anything else (content that is not text, named or
required tool choice, structured outputs, logit bias, logprobs shown to the client, stop
strings, a tail that is not valid UTF-8 ...) goes to the engine's routes. Before it is trusted,
:meth:`LocalRenderer.calibrate` renders and derenders probe requests both ways on a live engine;
any difference switches the router to the engine's routes for good, with a warning.

A continued session call (the machinery in :class:`Renderer`) costs one render of its new
messages only: the tokens the template adds after an assistant reply are
``R(D + new, gen)[len(R(D)):]`` for the short fixed base ``D`` (same tools), with ``R(D)``'s end
of turn; ``R(D)`` is cached per tool set. Each renderer checks once, on probe conversations
(:func:`~agentrl.router.calibration.check_continuations`), that this equals rendering the whole
conversation twice; where it does not (or for requests outside the probed shapes) it renders the
whole conversation twice, as exact as before, and says why in the log.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import logging
import re
import secrets
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import orjson
from jinja2.runtime import new_context

from agentrl._lazy import imported_ahead
from agentrl.router.calibration import (
    BASE_CONVERSATION,
    CALIBRATION_OUTPUTS,
    calibration_bodies,
    check_continuations,
    probe_renders,
    same_message,
    same_sampling,
    served_model,
)
from agentrl.router.encode import PieceEncoder
from agentrl.router.errors import EngineError, InvalidRequest
from agentrl.router.sampling import DEFAULTED, render_sampling_params
from agentrl.router.sessions import CallRecord, continued_prompt
from agentrl.router.validate import text_size

if TYPE_CHECKING:
    import jinja2
    from transformers import PreTrainedTokenizerBase

    from agentrl.engines.pool import Engine, EnginePool

log = logging.getLogger(__name__)

# Body keys the local path handles; any other key sends the request to the engine's routes (and
# keeps a continued call on the two-render path: the key might change how the template renders).
LOCAL_CHAT_KEYS = frozenset(
    {
        "messages",
        "model",
        "tools",
        "tool_choice",
        "n",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "seed",
        "stop",
        "logprobs",
        "top_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "stream",
        "stream_options",
        "user",
        "ignore_eos",  # vLLM's extensions: sampling parameters, the template never sees them
        "min_tokens",
    }
)
_MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id", "name"})
_ROLES = frozenset({"system", "user", "assistant", "tool"})
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
_BILLING_HEADER = "x-anthropic-billing-header"  # vLLM strips system parts that start with it
_TOOL_CALL = "<tool_call>"
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_MAX_BASES = 64  # cached base renders (one per distinct tool set); cleared when full


@dataclass
class Rendered:
    """A call's prompt ids, and how they came about."""

    ids: list[int]
    by: str  # "local" | "engine": which renderer produced them (the router's counters)
    gen_req: dict[str, Any] | None = None  # the engine's generate request, for an engine render
    continues: bool = False  # the ids extend the parent call's tokens (else the whole conversation)


def plain_chat(body: dict[str, Any]) -> bool:
    """Keys and messages of the shapes the local renderer and the continuation probes cover."""
    return body.keys() <= LOCAL_CHAT_KEYS and _plain_extensions(body) and \
        all(_plain_message(m) for m in body["messages"])


def _plain_extensions(body: dict[str, Any]) -> bool:
    """vLLM's ``ignore_eos`` and ``min_tokens`` of values the engine takes (any other: the engine's
    own answer, a 400)."""
    min_tokens = body.get("min_tokens", 0)
    most = body.get("max_completion_tokens", body.get("max_tokens"))
    if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or min_tokens < 0:
        return False
    fits = not isinstance(most, int) or min_tokens <= most
    return isinstance(body.get("ignore_eos", False), bool) and fits


def _plain_message(m: dict[str, Any]) -> bool:
    if not m.keys() <= _MESSAGE_KEYS or m["role"] not in _ROLES:
        return False
    text = _text(m.get("content"))
    if text is None or (m["role"] == "system" and text.startswith(_BILLING_HEADER)):
        return False
    calls = m.get("tool_calls")
    return calls is None or (
        m["role"] == "assistant"
        and isinstance(calls, list)
        and all(
            isinstance(c, dict)
            and c.get("type", "function") == "function"
            and isinstance(c.get("function"), dict)
            for c in calls
        )
    )


def cap_to_room(sampling: dict[str, Any], prompt_len: int, max_model_len: int) -> None:
    """``max_tokens`` no more than fits after the prompt (all of that room when it is unset)."""
    max_tokens = sampling.get("max_tokens")
    if max_tokens is None or prompt_len + max_tokens > max_model_len:
        sampling["max_tokens"] = max_model_len - prompt_len


# a request with more text than this is rendered in a worker thread (below it, the hop costs more
# than the render)
OFFLOAD_CHARS = 32_000


def _tools_key(body: dict[str, Any]) -> bytes | str:
    """The base render's cache key: the request's tools and tool choice, keys sorted. orjson's
    (every continued call computes it: the standard library took ten times as long); the standard
    library's for what orjson does not take (keys that are not strings)."""
    value = [body.get("tools"), body.get("tool_choice")]
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))


class Renderer(ABC):
    """Turns a chat request into prompt ids and a generate request, and a generation back into a
    chat completion. Override :meth:`render`, :meth:`generate_request` and :meth:`derender`; the
    machinery below them (:meth:`prompt`, :meth:`continuation`) builds a call's prompt the same
    way for every implementation, and counts ``<by>_renders`` once per call."""

    name: ClassVar[str]

    def __init__(self, counters: dict[str, float] | None = None) -> None:
        self.counters: dict[str, float] = counters if counters is not None else defaultdict(float)
        # how continued calls render: "unchecked" -> "linear" (new messages only) | "two-render"
        self.continuations = "unchecked"
        self._bases: dict[bytes | str, list[int]] = {}  # R(BASE_CONVERSATION) per tool set
        self._checking = asyncio.Lock()

    # -- override these ---------------------------------------------------------------------------
    @abstractmethod
    async def render(self, engine: Engine, body: dict[str, Any], messages: list[dict[str, Any]] | None = None,
                     add_generation_prompt: bool = True) -> Rendered:
        """``body`` (with ``messages`` in place of its own, when given) rendered to prompt ids."""

    @abstractmethod
    def generate_request(self, body: dict[str, Any], prompt: Rendered) -> dict[str, Any]:
        """The token-in generate request for ``prompt``: its ids, the body's sampling parameters,
        ``max_tokens`` no more than fits after the prompt."""

    @abstractmethod
    async def derender(self, engine: Engine, body: dict[str, Any], gen: dict[str, Any],
                       prompt_ids: list[int]) -> dict[str, Any]:
        """The chat completion for the generate response ``gen`` (sampled eos tokens stripped)."""

    # -- hooks ------------------------------------------------------------------------------------
    async def probe_ids(self, engine: Engine, body: dict[str, Any], messages: list[dict[str, Any]],
                        add_generation_prompt: bool) -> list[int]:
        """A render for the continuation check (the local renderer's own, never the engine's)."""
        return (await self.render(engine, body, messages, add_generation_prompt)).ids

    def continues_linearly(self, body: dict[str, Any]) -> bool:
        """Whether ``body`` is of the shapes the continuation check probed."""
        return plain_chat(body)

    # -- machinery --------------------------------------------------------------------------------
    async def prompt(self, engine: Engine, body: dict[str, Any], parent: CallRecord | None, choice: int,
                     eos_ids: set[int]) -> Rendered:
        """The call's prompt: the whole conversation rendered, or for a call that continues choice
        ``choice`` of ``parent``, that call's tokens followed by the new messages' (:meth:`continuation`)."""
        out = await (self.render(engine, body) if parent is None
                     else self.continuation(engine, body, parent, choice, eos_ids))
        self.counters[f"{out.by}_renders"] += 1
        return out

    async def continuation(self, engine: Engine, body: dict[str, Any], parent: CallRecord, choice: int,
                           eos_ids: set[int]) -> Rendered:
        """Parent prompt + its completion as sampled + end of turn + the new messages' tokens.

        Linear (checked): one render of the new messages after the base conversation (whose
        render is cached). Otherwise the whole conversation rendered twice, with and without the
        new messages. Where the template does not extend the conversation by the new messages'
        tokens, the whole conversation's render, not continuing (a new sample).
        """
        k = len(parent.messages) + 1
        new = body["messages"][k:]
        if await self._linear(engine, body, eos_ids):
            base = await self._base(engine, body)
            rendered = await self.render(engine, body, BASE_CONVERSATION + new)
            whole = False
        else:
            rendered = await self.render(engine, body)
            base = (await self.render(engine, body, body["messages"][:k], add_generation_prompt=False)).ids
            whole = True
        ids = continued_prompt(parent, choice, base, rendered.ids, eos_ids)
        if ids is not None:
            return replace(rendered, ids=ids, continues=True)
        if not whole:  # the probes did not show this: render the whole conversation
            log.info("a continued call's new messages did not extend the base conversation; new sample")
            rendered = await self.render(engine, body)
        return rendered

    async def _linear(self, engine: Engine, body: dict[str, Any], eos_ids: set[int]) -> bool:
        if self.continuations == "unchecked":
            await self.check_continuations(engine, body["model"], eos_ids)
        return self.continuations == "linear" and self.continues_linearly(body)

    async def _base(self, engine: Engine, body: dict[str, Any]) -> list[int]:
        key = _tools_key(body)
        ids = self._bases.get(key)
        if ids is None:
            ids = (await self.render(engine, body, BASE_CONVERSATION, add_generation_prompt=False)).ids
            if len(self._bases) >= _MAX_BASES:
                self._bases.clear()
            self._bases[key] = ids
        return ids

    async def check_continuations(self, engine: Engine, model: str, eos_ids: set[int]) -> None:
        """Decide, once, whether continued calls may render only their new messages (see
        :mod:`agentrl.router.calibration`). An engine failure leaves it undecided (two renders
        this time, checked again on a later call)."""
        async with self._checking:
            if self.continuations != "unchecked":
                return

            async def render(body: dict[str, Any], messages: list[dict[str, Any]], gen: bool) -> list[int]:
                return await self.probe_ids(engine, body, messages, gen)

            try:
                why = await check_continuations(render, eos_ids, model)
            except EngineError as e:
                log.warning(
                    "could not check continued-call rendering (%s renderer): %s", self.name, e.message
                )
                return
            except Exception as e:  # a probe the template or the engine refuses: not shown to be exact
                why = f"a probe failed to render: {type(e).__name__}: {e}"
            if why is None:
                self.continuations = "linear"
                log.info("continued calls render only their new messages (%s renderer)", self.name)
            else:
                self.continuations = "two-render"
                log.warning(
                    "continued calls render the whole conversation twice (%s renderer): %s", self.name, why
                )


class EngineRenderer(Renderer):
    """The engine's own render and derender routes (exact for anything the engine accepts)."""

    name = "engine"

    def __init__(self, pool: EnginePool, *, max_model_len: int,
                 counters: dict[str, float] | None = None) -> None:
        super().__init__(counters)
        self.pool = pool
        self.max_model_len = max_model_len

    async def render(self, engine: Engine, body: dict[str, Any], messages: list[dict[str, Any]] | None = None,
                     add_generation_prompt: bool = True) -> Rendered:
        req = body
        if messages is not None:
            req = dict(body, messages=messages)
        if not add_generation_prompt:
            req = dict(req, add_generation_prompt=False)
        try:
            got = await self.pool.call(engine, "/v1/chat/completions/render", req)
        except InvalidRequest as e:
            if e.code == "context_length_exceeded":
                e.param = "messages"
            raise
        return Rendered(got["token_ids"], "engine", gen_req=got)

    def generate_request(self, body: dict[str, Any], prompt: Rendered) -> dict[str, Any]:
        """The engine's generate request with the call's prompt ids. Its ``max_tokens`` was computed
        for the ids the engine rendered (for a continued call, not the prompt): capped to the room
        after the prompt."""
        assert prompt.gen_req is not None, "an engine render carries the engine's generate request"
        sampling = dict(prompt.gen_req.get("sampling_params") or {})
        cap_to_room(sampling, len(prompt.ids), self.max_model_len)
        return dict(prompt.gen_req, token_ids=prompt.ids, sampling_params=sampling)

    async def derender(self, engine: Engine, body: dict[str, Any], gen: dict[str, Any],
                       prompt_ids: list[int]) -> dict[str, Any]:
        self.counters["engine_derenders"] += 1
        return await self.pool.call(engine, "/v1/chat/completions/derender", {
            "generate_response": gen, "prompt_token_ids": prompt_ids, "prompt_tokens": len(prompt_ids),
            "chat_request": body})


class LocalRenderer(Renderer):
    """Renders chat requests to prompt ids and parses generated ids back, exactly as the engine.

    ``fallback`` (the router's :class:`EngineRenderer`) takes what the local path cannot do
    exactly: a template that raises (the engine answers with its own error) and outputs
    :meth:`can_derender` refuses. ``state``: "unchecked" until :meth:`calibrate` ran, then "on" or
    "off" (set by the router)."""

    name = "local"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, max_model_len: int, model_dir: str = "",
                 fallback: EngineRenderer | None = None, counters: dict[str, float] | None = None) -> None:
        super().__init__(counters)
        self.fallback = fallback
        self.state = "unchecked"
        self.tok = tokenizer
        # the most characters one token can stand for (byte-level: a token string's length bounds its text)
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=64) or 64
        self.template: str = tokenizer.chat_template
        self.max_model_len = max_model_len
        self.model_dir = model_dir
        self.defaults: dict[str, Any] = {}  # the engine's default sampling parameters (calibrate)
        self._decode = tokenizer.backend_tokenizer.decoder.decode
        self._id_to_token = tokenizer.convert_ids_to_tokens
        # the same decode in one call into the tokenizer, for ids it knows (the above raises on others)
        self._decode_ids = tokenizer.backend_tokenizer.decode
        self._known_ids = tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True)
        self._encode = PieceEncoder(tokenizer).encode  # the tokenizer's ids, from cached pieces
        # What apply_chat_template does, without its per-call argument handling (about 1 ms a call
        # here): transformers' own compiled template (same environment and filters), rendered with
        # the special tokens as variables, then encoded without added special tokens.
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            self._compiled: jinja2.Template | None = _compile_jinja_template(self.template)
        except ImportError:  # an older transformers: go through apply_chat_template itself
            self._compiled = None
        self._template_vars = dict(tokenizer.special_tokens_map)
        # Template.render merges the template's globals (a ChainMap over the environment's) into
        # every call's context; a flat copy made once does the same for a fraction of the cost.
        self._globals = dict(self._compiled.globals) if self._compiled is not None else {}
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(4)

    @classmethod
    def load(cls, model_dir: str | Path | None, *, max_model_len: int, fallback: EngineRenderer | None = None,
             counters: dict[str, float] | None = None) -> LocalRenderer | None:
        """The renderer for a model folder, or None (with the reason logged) when it cannot be exact."""
        if not model_dir or not Path(model_dir).is_dir():
            log.info(
                "no local model folder (%s): the router uses the engine's render/derender routes", model_dir
            )
            return None
        try:
            imported_ahead("transformers")  # serve may be importing it in another thread
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(model_dir))
        except Exception as e:
            log.warning(
                "could not load the tokenizer from %s (%s): using the engine's render/derender", model_dir, e
            )
            return None
        decoder = getattr(getattr(tok, "backend_tokenizer", None), "decoder", None)
        byte_level = "ByteLevel" in type(decoder).__name__ or "ByteLevel" in repr(decoder)
        if not getattr(tok, "is_fast", False) or not tok.chat_template or not byte_level:
            # Metaspace (sentencepiece-style) decoders need the prompt tail to place a leading
            # space; only byte-level decoding is concatenative, so only that is done here.
            log.warning("the tokenizer in %s is not a byte-level fast tokenizer "
                        "with a chat template: using the engine's render/derender", model_dir)
            return None
        return cls(
            tok, max_model_len=max_model_len, model_dir=str(model_dir), fallback=fallback, counters=counters
        )

    # -- render -----------------------------------------------------------------------------------
    def can_render(self, body: dict[str, Any]) -> bool:
        """Whether the local render reproduces the engine's for this (validated) chat body."""
        if body.get("tool_choice") not in (None, "auto", "none"):
            return False
        for t in body.get("tools") or ():
            if not t.keys() <= _TOOL_KEYS or t.get("type", "function") != "function" \
                    or not t["function"].keys() <= _FUNCTION_KEYS or t["function"].get("strict"):
                return False  # strict tools make vLLM add a structured-output grammar
        return plain_chat(body)

    def continues_linearly(self, body: dict[str, Any]) -> bool:
        return True  # can_render, which chose this renderer for the call, checked plain_chat

    async def render(self, engine: Engine, body: dict[str, Any], messages: list[dict[str, Any]] | None = None,
                     add_generation_prompt: bool = True) -> Rendered:
        try:
            if text_size(body if messages is None else dict(body, messages=messages)) > OFFLOAD_CHARS:
                # tokenising a long prompt takes milliseconds to seconds: not on the loop every call shares
                ids = await asyncio.to_thread(self.render_ids, body, messages, add_generation_prompt)
            else:
                ids = self.render_ids(body, messages, add_generation_prompt)
            return Rendered(ids, "local")
        except Exception as e:  # a template that raises: the engine answers with its own 4xx
            if self.fallback is None:
                raise
            log.debug("local render failed (%s); asking the engine", e)
            return await self.fallback.render(engine, body, messages, add_generation_prompt)

    async def probe_ids(self, engine: Engine, body: dict[str, Any], messages: list[dict[str, Any]],
                        add_generation_prompt: bool) -> list[int]:
        return self.render_ids(body, messages, add_generation_prompt)

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
        ctx = new_context(
            tmpl.environment,
            tmpl.name,
            tmpl.blocks,
            dict(
                self._template_vars,
                messages=self.conversation(body["messages"] if messages is None else messages),
                tools=self.tool_dicts(body),
                documents=None,
                add_generation_prompt=add_generation_prompt,
            ),
            False,
            self._globals,
        )
        try:
            text = tmpl.environment.concat(tmpl.root_render_func(ctx))
        except Exception:
            tmpl.environment.handle_exception()  # re-raises with the template's line (as render does)
        return self._encode(text)

    def render_ids_reference(self, body: dict[str, Any], messages: list[dict[str, Any]] | None = None,
                             add_generation_prompt: bool = True) -> list[int]:
        """The same through ``apply_chat_template`` itself (calibration checks the two agree)."""
        return list(
            self.tok.apply_chat_template(
                self.conversation(body["messages"] if messages is None else messages),
                tools=self.tool_dicts(body),
                chat_template=self.template,
                tokenize=True,
                return_dict=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=False,
            )
        )

    def sampling_params(self, body: dict[str, Any], prompt_len: int) -> dict[str, Any]:
        """The render route's ``sampling_params`` for a body whose ``logprobs`` the router forced on."""
        return render_sampling_params(body, self.defaults, prompt_len, self.max_model_len)

    def generate_request(self, body: dict[str, Any], prompt: Rendered) -> dict[str, Any]:
        if prompt.gen_req is not None:  # the template raised and the engine rendered this call
            assert self.fallback is not None
            return self.fallback.generate_request(body, prompt)
        # unique per router process (a random prefix) without a system call per request
        return {"request_id": f"chatcmpl-{self._id_prefix}{next(self._ids):x}", "token_ids": prompt.ids,
                "sampling_params": self.sampling_params(body, len(prompt.ids)), "model": body.get("model"),
                "stream": False}

    # -- derender ---------------------------------------------------------------------------------
    async def derender(self, engine: Engine, body: dict[str, Any], gen: dict[str, Any],
                       prompt_ids: list[int]) -> dict[str, Any]:
        out = self.derender_chat(gen, body) if self.can_derender(body, gen) else None
        if out is not None:
            self.counters["local_derenders"] += 1
            return out
        if self.fallback is None:
            raise EngineError("this choice cannot be derendered locally and no engine renderer is set")
        return await self.fallback.derender(engine, body, gen, prompt_ids)

    def can_derender(self, body: dict[str, Any], gen: dict[str, Any]) -> bool:
        """Local derender is exact for these; stop strings and client logprobs go to the engine."""
        if body.get("logprobs"):
            return False
        return all(ch.get("stop_reason") is None and ch.get("token_ids") for ch in gen.get("choices") or [])

    def decode(self, ids: list[int]) -> str:
        if ids and min(ids) >= 0 and max(ids) < self._known_ids:
            return self._decode_ids(ids, skip_special_tokens=False)
        return self._decode(self._id_to_token(ids))

    def derender_chat(self, gen: dict[str, Any], body: dict[str, Any]) -> dict[str, Any] | None:
        """The engine's non-streaming chat derender of ``gen``; None when it would not be exact."""
        parse = bool(body.get("tools")) and body.get("tool_choice") in (None, "auto")
        choices = []
        for ch in gen["choices"]:
            text = self.decode(ch["token_ids"])
            if text.endswith("\ufffd"):
                return None  # vLLM's incremental detokeniser holds back an unfinished character
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
            }
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
    async def calibrate(self, pool: EnginePool, engine: Engine) -> str | None:
        """Compare local and engine render/derender on probe requests; the first difference, or None.

        Besides the calibration bodies, every conversation the continuation check renders is
        compared (with and without a generation prompt), so that check's local renders are the
        engine's too."""
        model = await served_model(pool, engine)
        probe = {"model": model, "messages": [{"role": "user", "content": "."}], "logprobs": True}
        got = await pool.call(engine, "/v1/chat/completions/render", probe, count=False)
        sp = got.get("sampling_params") or {}
        self.defaults = {k: sp[k] for k, _ in DEFAULTED if k in sp}
        if "top_k" in sp:
            self.defaults["top_k"] = sp["top_k"]
        for body in calibration_bodies(model):
            ref = await pool.call(engine, "/v1/chat/completions/render", body, count=False)
            ids = self.render_ids(body)
            if ids != ref["token_ids"] or ids != self.render_ids_reference(body):
                return f"prompt ids differ for {_brief(body)}"
            mine = self.sampling_params(body, len(ids))
            if not same_sampling(mine, ref.get("sampling_params") or {}):
                return (f"sampling params differ for {_brief(body)}: local "
                        f"{mine}, engine {ref.get('sampling_params')}")
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
                    return (f"derender differs for {text!r} ({_brief(body)}): "
                            f"local {local and local['choices'][0]['message']}, "
                            f"engine {theirs['choices'][0]['message']}")
        for body, messages, gen_prompt in probe_renders(model):
            req = dict(body, messages=messages) if gen_prompt else dict(body, messages=messages,
                                                                        add_generation_prompt=False)
            ref = await pool.call(engine, "/v1/chat/completions/render", req, count=False)
            ids = self.render_ids(body, messages, gen_prompt)
            if ids != ref["token_ids"] or ids != self.render_ids_reference(body, messages, gen_prompt):
                return f"prompt ids differ for {_brief(req)}"
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
