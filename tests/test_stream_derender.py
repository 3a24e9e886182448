"""The router's own streaming derender: however the ids are chunked, the streamed reply is the
unstreamed one (same text, same parsed calls), and the eos that ended a reply never shows."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from agentrl.router.stream_derender import LocalChoiceStream

TOOLS = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}]
OUTPUTS = [
    "plain answer",
    "  ",
    'ok <tool_call>\n{"name": "python", "arguments": {"code": "print(\'é\')"}}\n</tool_call>',
    '<tool_call>\n{"name": "python", "arguments": {"code": "1"}\n</tool_call>',  # invalid JSON
    '\n\n<tool_call>\n{"name": "python", "arguments": {"code": "2"}}\n</tool_call>',  # whitespace lead
    'two <tool_call>{"name": "python", "arguments": {}}</tool_call>\n<tool_call>{"name": "python", '
    '"arguments": {"code": "x"}}</tool_call>',
    'cut off <tool_call>\n{"name": "python", "argu',
    "no call but < tool_call and <tool_ and ✓ émoji 🎉",
]


@pytest.fixture(scope="module")
def local(tiny_tools_model):
    from agentrl.router.render import LocalRenderer

    return LocalRenderer.load(tiny_tools_model, max_model_len=2048)


def _run(local, body, chunks, finish="stop", eos=(2,)):
    s = LocalChoiceStream(local.decode, body, set(eos), frozenset())
    deltas = []
    for i, ids in enumerate(chunks):
        last = i == len(chunks) - 1
        deltas.append(asyncio.run(s.feed({"token_ids": ids, "finish_reason": finish if last else None,
                                          "stop_reason": None})))
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for d in deltas for c in d.get("tool_calls") or []]
    return content, calls, deltas


@pytest.mark.parametrize("text", OUTPUTS)
@pytest.mark.parametrize("tools", [True, False])
def test_any_chunking_streams_exactly_the_unstreamed_reply(local, text, tools):
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        **({"tools": TOOLS} if tools else {}),
    }
    ids = local.tok.encode(text, add_special_tokens=False) + [2]
    want = local.derender_chat({"choices": [{"token_ids": ids[:-1], "finish_reason": "stop"}]}, body)
    msg = want["choices"][0]["message"]
    want_calls = [c["function"] for c in msg.get("tool_calls") or []]
    rng = random.Random(text)
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, len(ids)), k=min(len(ids) - 1, rng.randint(0, 5))))
        chunks = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
        content, calls, _ = _run(local, body, chunks)
        assert content == (msg["content"] or "")
        assert calls == want_calls
        for c in calls:
            json.loads(c["arguments"])


def test_an_eos_whose_finish_comes_in_a_later_chunk_is_not_text(local):
    body = {"model": "m", "messages": [], "tools": TOOLS}
    ids = local.tok.encode(
        '<tool_call>\n{"name": "python", "arguments": {"code": "1"}}', add_special_tokens=False
    )
    # the call is not closed; the eos comes in the last token chunk and the finish after it
    content, calls, _ = _run(local, body, [ids[:3], ids[3:] + [2], []])
    assert content == "" and calls == [{"name": "python", "arguments": '{"code": "1"}'}]  # as unstreamed


def test_an_eos_in_the_middle_is_text_when_special_tokens_are_kept(local):
    body = {"model": "m", "messages": [], "tools": TOOLS}  # tools: the chat route keeps special tokens
    a, b = (
        local.tok.encode("one", add_special_tokens=False),
        local.tok.encode("two", add_special_tokens=False),
    )
    content, _, _ = _run(local, body, [a + [2], b + [2]], finish="length")
    assert content == "one<|im_end|>two<|im_end|>"


def test_a_tool_call_sends_nothing_until_it_is_parsed(local):
    body = {"model": "m", "messages": [], "tools": TOOLS}
    ids = local.tok.encode('Let me run it.\n<tool_call>\n{"name": "python", "arguments": {"code": "1"}}\n'
                           '</tool_call>',
                           add_special_tokens=False)
    content, calls, deltas = _run(local, body, [[t] for t in ids] + [[2]])
    assert content == "Let me run it.\n" and calls == [{"name": "python", "arguments": '{"code": "1"}'}]
    start = next(i for i, t in enumerate(ids) if local.decode(ids[:i + 1]).endswith("<tool_call>"))
    assert all(d == {} for d in deltas[start:-1])  # the call's tokens: held, then one delta at the end
