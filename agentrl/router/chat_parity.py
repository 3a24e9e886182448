"""Chat completions as vLLM's own chat server answers them, built from the router's token-in path.

The router renders, generates token-in and derenders (``/v1/chat/completions/derender`` or the
local mirror of it). The derender route is not the chat route: measured on vLLM 0.32 with the
hermes parser configured, it keeps special tokens in the text even without tools (``ignore_eos``
gave ``<|im_end|><|im_end|>...`` where the chat route gives ``""``), and it reports
``finish_reason: "stop"`` for parsed tool calls where the chat route says ``"tool_calls"``. The
router also hides a sampled end-of-sequence token from the text (as the chat route does) and used
to drop its logprob with it. This module holds what makes the router's answer the chat route's:

- :func:`shown_choice`: the ids whose text the client sees: without a final sampled eos, and,
  where the chat route skips special tokens (``sampling_params.skip_special_tokens``, which the
  render sets to False when the hermes parser needs ``<tool_call>``), without special tokens.
  The logprobs stay whole: the eos was sampled and the chat route shows its logprob.
- :class:`TokenText`: logprob entries as the chat route writes them (``tokenizer.decode([id])``
  per token, the U+FFFD correction from preceding sampled tokens that vLLM applies to
  byte-fallback pieces, ``max(logprob, -9999)``, UTF-8 ``bytes``, the generate route's top list
  in its order, cut to ``top_logprobs``).
- :func:`cut_at_stop` and :class:`StopHold`: the text ends before the stop string the engine
  stopped on. The engine stops on the token that completes a stop string, and the text derendered
  from the ids holds the string and the rest of that token; the chat route (and Anthropic's
  ``stop_sequences``) shows the text before it. A stream holds back text that could begin a stop
  string until it is resolved, so nothing past the stop is ever sent. Where the visible text ended
  is recorded with the call (``Completion.text_end``); the ids stay the whole tokens sampled.
- :func:`tool_finish_reason`: ``"tool_calls"`` when the hermes parser found calls for an
  ``auto`` (or unset) tool choice, as vLLM's chat route reports it.
- :func:`check_tools` and :func:`check_max_tokens`: the request checks where vLLM answers 400
  and the router used to accept (tool schemas that are not objects, a non-string function name,
  ``max_tokens`` beyond the model's context).

Invariant: nothing here changes what is recorded. The captured ids, behaviour logprobs and
versions are the engine's; only the client's view of them is shaped here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from agentrl.router.errors import InvalidRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"
_CONTEXT = 4  # preceding sampled tokens that can complete a UTF-8 character (vLLM uses 4)


def special_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The ids a decode with ``skip_special_tokens=True`` leaves out: added tokens flagged special
    (the tokenizers library's rule, which vLLM's detokenizer follows; ``all_special_ids`` can
    miss some, e.g. ``<|im_start|>`` when the special-tokens map does not name it)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids = {i for i, t in decoder.items() if getattr(t, "special", False)}
    return frozenset(ids | set(getattr(tokenizer, "all_special_ids", ()) or ()))


def shown_choice(choice: dict[str, Any], eos_ids: set[int], hidden: frozenset[int] = frozenset()
                 ) -> tuple[dict[str, Any], bool]:
    """The generate choice as derender should see it, and whether its text must be blanked.

    Leaves out a final sampled eos (stop without a stop string) and, when ``hidden`` is given,
    every id in it. Derender refuses a choice with no tokens: then the choice goes as it is and
    the second value says that none of its text is visible. ``logprobs`` are left whole.
    """
    ids = choice.get("token_ids") or []
    keep = ids
    if (
        ids
        and choice.get("finish_reason") == "stop"
        and choice.get("stop_reason") is None
        and ids[-1] in eos_ids
    ):
        keep = ids[:-1]
    if hidden:
        keep = [t for t in keep if t not in hidden]
    if len(keep) == len(ids):
        return choice, False
    if not keep:
        return choice, True
    return dict(choice, token_ids=keep), False


def skips_special(gen_req: dict[str, Any]) -> bool:
    """Whether the chat route would skip special tokens in this call's text (its sampling params)."""
    return (gen_req.get("sampling_params") or {}).get("skip_special_tokens", True) is not False


def blank_text(out: dict[str, Any]) -> None:
    """Empty the visible text of a derendered choice (chat message, chat delta or completion text);
    its logprobs stay (the tokens were sampled and the chat route shows them)."""
    for key in ("message", "delta"):
        if isinstance(out.get(key), dict) and out[key].get("content") is not None:
            out[key]["content"] = ""
    if out.get("text") is not None:
        out["text"] = ""


def stop_strings(gen_req: dict[str, Any]) -> list[str]:
    """The stop strings of a generate request (its sampling params)."""
    return [s for s in (gen_req.get("sampling_params") or {}).get("stop") or [] if s]


def cut_at_stop(out: dict[str, Any], stop: int | str | None) -> int | None:
    """Cut a derendered choice's visible text (chat message or completion text) before ``stop``, the
    stop string the engine reports it stopped on; the visible text's length when it was cut, else None."""
    if not isinstance(stop, str) or not stop:
        return None
    holder, key = (out["message"], "content") if isinstance(out.get("message"), dict) else (out, "text")
    text = holder.get(key)
    at = text.find(stop) if isinstance(text, str) else -1
    if at < 0:
        return None
    holder[key] = text[:at]
    return at


class StopHold:
    """A streamed choice's text with stop strings applied: :meth:`feed` returns the part that may be sent.

    Text that could be the start of a stop string is held until the next text resolves it; text from
    the first stop string on is never returned. ``text_end`` is the visible text's length once a stop
    string cut it (None until then)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.held = ""
        self.sent = 0  # characters returned so far
        self.text_end: int | None = None

    def feed(self, text: str, final: bool) -> str:
        if self.text_end is not None:
            return ""
        buf = self.held + text
        cuts = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if cuts:
            out, self.held = buf[: min(cuts)], ""
            self.text_end = self.sent + len(out)
        elif final:
            out, self.held = buf, ""
        else:
            keep = max((n for s in self.stops for n in range(1, len(s)) if buf.endswith(s[:n])), default=0)
            out, self.held = buf[: len(buf) - keep], buf[len(buf) - keep:]
        self.sent += len(out)
        return out


def parses_tools(body: dict[str, Any]) -> bool:
    """The hermes parser runs on this body's output (tools, and a tool choice of auto or unset)."""
    return bool(body.get("tools")) and body.get("tool_choice") in (None, "auto")


def tool_finish_reason(body: dict[str, Any], message: dict[str, Any] | None, finish: str | None,
                       *, streamed: bool = False) -> str | None:
    """vLLM's chat route: ``"tool_calls"`` when calls were parsed for tool choice auto (or unset),
    or for ``required`` when generation stopped; a named tool choice keeps ``"stop"``. Its
    streaming generator says ``"tool_calls"`` only when generation stopped (not on ``length``)."""
    if not (message or {}).get("tool_calls"):
        return finish
    choice = body.get("tool_choice")
    if choice in (None, "auto") and (not streamed or finish == "stop"):
        return "tool_calls"
    if choice == "required" and finish == "stop":
        return "tool_calls"
    return finish


class TokenText:
    """Logprob entries in the chat route's shape, from the generate route's id-only entries."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tok = tokenizer
        self.special = special_ids(tokenizer)
        self._pieces: dict[int, str] = {}

    def piece(self, token_id: int) -> str:
        """``tokenizer.decode([id])``, what vLLM's logprobs show for one token (cached: the vocabulary is
        small)."""
        s = self._pieces.get(token_id)
        if s is None:
            s = self._pieces[token_id] = self.tok.decode([token_id]) or ""
        return s

    def token(self, token_id: int, context: list[int]) -> str:
        """The token's text; a byte-fallback piece (ending in U+FFFD) is completed from the
        preceding sampled tokens, the way vLLM's logprobs processor does, or "" when the
        character is not finished yet."""
        s = self.piece(token_id)
        if not s.endswith(REPLACEMENT):
            return s
        for n in range(1, min(len(context), _CONTEXT) + 1):
            ctx = context[-n:]
            full = self.tok.decode(ctx + [token_id])
            if full.endswith(REPLACEMENT):
                continue
            clean = len(ctx)  # context tokens that were themselves unfinished belong to this character
            while clean > 0 and self.piece(ctx[clean - 1]).endswith(REPLACEMENT):
                clean -= 1
            prefix = self.tok.decode(ctx[:clean]) if clean else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = 0
            for a, b in zip(prefix, full, strict=False):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""

    def entries(self, content: list[dict[str, Any]], top_k: int, context: list[int]) -> list[dict[str, Any]]:
        """Chat logprobs ``content`` for generate entries; ``context`` (the sampled ids before
        them, oldest first) is extended in place so a stream can carry it from chunk to chunk."""
        out = []
        for e in content:
            tid = int(e["token_id"])
            text = self.token(tid, context)
            tops = []
            for t in (e.get("top_logprobs") or [])[:top_k]:
                ttext = self.token(int(t["token_id"]), context)
                tops.append({"token": ttext, "logprob": max(float(t["logprob"]), -9999.0),
                             "bytes": list(ttext.encode("utf-8", errors="replace"))})
            out.append({"token": text, "logprob": max(float(e["logprob"]), -9999.0),
                        "bytes": list(text.encode("utf-8", errors="replace")), "top_logprobs": tops})
            context.append(tid)
            if len(context) > _CONTEXT:
                del context[0]
        return out


def check_tools(body: dict[str, Any]) -> None:
    """Tool schemas as vLLM's chat route validates them: a list of function tools, each with a
    string ``name``, an optional string ``description``, an optional object ``parameters`` and an
    optional boolean ``strict``."""
    tools = body.get("tools")
    if tools is None:
        return
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be a list of function tools", param="tools")
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if (
            not isinstance(t, dict)
            or t.get("type", "function") != "function"
            or not isinstance(t.get("function"), dict)
        ):
            raise InvalidRequest(f"{where} must be {{\"type\": \"function\", "
                                 "\"function\": {\"name\": ...}}",
                                 param=where)
        f = t["function"]
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise InvalidRequest(
                f"{where}.function.name must be a non-empty string", param=f"{where}.function.name"
            )
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise InvalidRequest(f"{where}.function.description must be a string",
                                 param=f"{where}.function.description")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise InvalidRequest(f"{where}.function.parameters must be a JSON Schema object",
                                 param=f"{where}.function.parameters")
        if f.get("strict") is not None and not isinstance(f["strict"], bool):
            raise InvalidRequest(
                f"{where}.function.strict must be a boolean", param=f"{where}.function.strict"
            )


def check_max_tokens(
    body: dict[str, Any], max_model_len: int, keys: tuple[str, ...] = ("max_tokens", "max_completion_tokens")
) -> None:
    """vLLM answers 400 for a completion budget larger than the whole context (a budget that only
    overflows with the prompt is capped to the room after it, there as here)."""
    for key in keys:
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > max_model_len:
            raise InvalidRequest(f"{key}={v} cannot be greater than max_model_len={max_model_len}. "
                                 "Please request fewer output tokens.", param=key)
