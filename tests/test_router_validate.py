"""The router's cheap size bound on a chat request counts characters, as its limit does."""

from __future__ import annotations

import json

import pytest

from agentrl.router.errors import InvalidRequest
from agentrl.router.validate import check_size, text_size

TOOL = {"type": "function", "function": {
    "name": "translate", "description": "日本語の文章を英語に翻訳する。長い文章も短い文章も受け付ける。",
    "parameters": {"type": "object", "properties": {"文章": {"type": "string"}}}}}


def test_a_tool_in_another_script_counts_its_characters_not_its_utf8_bytes() -> None:
    compact = json.dumps(TOOL, ensure_ascii=False, separators=(",", ":"))
    assert len(compact.encode()) > 1.3 * len(compact)  # the case: far more bytes than characters
    assert text_size({"tools": [TOOL]}) == len(compact)


def test_the_bound_refuses_only_text_over_the_limit() -> None:
    body = {"messages": [{"role": "user", "content": "こんにちは" * 4}], "tools": [TOOL]}
    n = text_size(body)
    assert n == 20 + len(json.dumps(TOOL, ensure_ascii=False, separators=(",", ":")))
    check_size(body, n)  # at the limit: taken
    with pytest.raises(InvalidRequest, match=f"the prompt has {n} characters"):
        check_size(body, n - 1)
