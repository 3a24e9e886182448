"""Test helper: checks that what a client received is exactly what the engine sampled.

Used by the Responses, Messages and scaffold tests: a call's recorded completion ids, decoded the
way the chat route shows text (no final eos, special tokens skipped unless a tool parser needs
them) and parsed by the hermes parser, are the text and tool calls the client got; its recorded
prompt and completion ids and logprobs are a token-in generate the engine really served.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import pytest


@cache
def _tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def reply_of(model_dir: str, ids: list[int], *, tools: bool) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) the completion ``ids`` decode and parse to, as the router's chat path shows them."""
    from agentrl.router.chat_parity import special_ids
    from agentrl.router.render import parse_hermes

    tok = _tokenizer(model_dir)
    if ids and ids[-1] == tok.convert_tokens_to_ids("<|im_end|>"):
        ids = ids[:-1]
    if not tools:
        ids = [t for t in ids if t not in special_ids(tok)]
    text = tok.backend_tokenizer.decoder.decode(tok.convert_ids_to_tokens(ids))
    if not tools:
        return text, []
    calls, content = parse_hermes(text)
    return content, [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls]


def assert_exact(
    records: list[dict[str, Any]], generated: list[tuple[list[int], list[int], list[float]]]
) -> None:
    """Every recorded call is one generate the engine served: same prompt ids, completion ids and logprobs."""
    served = {(tuple(p), tuple(c)): lp for p, c, lp in generated}
    for r in records:
        comp = r["completions"][0]
        key = (tuple(r["prompt_ids"]), tuple(comp["token_ids"]))
        assert key in served, f"call {r['index']} is not a generate the engine served"
        assert comp["logprobs"] == pytest.approx(served[key], abs=1e-6)
        assert len(comp["versions"]) == len(comp["token_ids"]) == len(comp["logprobs"])


def assert_stitched(records: list[dict[str, Any]]) -> None:
    """Each call extends the previous one token for token: one sample."""
    assert [r["parent"] for r in records] == [None] + list(range(len(records) - 1))
    for a, b in zip(records, records[1:], strict=False):
        whole = a["prompt_ids"] + a["completions"][0]["token_ids"]
        assert b["prompt_ids"][:len(whole)] == whole
