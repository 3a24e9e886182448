"""Tool schemas from typed functions, and model output that is not a valid tool call.

Bad JSON, unknown tools, wrong or missing arguments and tools that raise all become a tool error
message to the model and a counted event (``info["tool_errors"]``), never an exception.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import agentrl
from agentrl.env.tools import ToolCallError, parse_arguments, parse_tool_calls, tool_schema


def search(query: str, limit: int = 5, exact: bool = False, tags: list[str] | None = None,
           mode: Literal["fast", "deep"] = "fast", weight: float = 1.0, extra: dict | None = None) -> str:
    """Search the notes.

    Longer explanation that is not part of the description.

    Args:
        query: what to look for.
        limit (int): how many results at most.
        tags: only notes with all of these tags.
    """
    return query


def test_a_schema_comes_from_the_signature_and_the_docstring() -> None:
    schema = tool_schema(search)
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "search" and fn["description"] == "Search the notes."
    props = fn["parameters"]["properties"]
    assert fn["parameters"]["required"] == ["query"]
    assert props["query"] == {"type": "string", "description": "what to look for."}
    assert props["limit"] == {"type": "integer", "description": "how many results at most.", "default": 5}
    assert props["exact"] == {"type": "boolean", "default": False}
    assert props["tags"] == {"type": "array", "items": {"type": "string"},
                             "description": "only notes with all of these tags.", "default": None}
    assert props["mode"] == {"type": "string", "enum": ["fast", "deep"], "default": "fast"}
    assert props["weight"] == {"type": "number", "default": 1.0}
    assert props["extra"] == {"type": "object", "default": None}
    json.dumps(schema)  # it must cross the wire as is


def test_a_method_schema_leaves_out_self() -> None:
    class Env:
        async def read(self, path: str) -> str:
            """Read a file."""
            return path

    fn = tool_schema(Env.read)["function"]
    assert fn["parameters"] == {
        "type": "object",
        "properties": {"path": {"type": "string"}},
        "required": ["path"],
    }


def test_arguments_are_decoded_and_type_checked() -> None:
    assert parse_arguments(search, '{"query": "x", "limit": 2}') == {"query": "x", "limit": 2}
    assert parse_arguments(search, {"query": "x"}) == {"query": "x"}
    for raw, kind in [
        ("{not json", "bad_json"),
        ("[1, 2]", "bad_json"),
        ('{"limit": 2}', "bad_arguments"),
        ('{"query": 3}', "bad_arguments"),
        ('{"query": "x", "limit": "2"}', "bad_arguments"),
        ('{"query": "x", "limit": true}', "bad_arguments"),
        ('{"query": "x", "nope": 1}', "bad_arguments"),
    ]:
        err = parse_arguments(search, raw)
        assert isinstance(err, ToolCallError) and err.kind == kind, raw


def test_the_project_parser_reads_hermes_blocks_and_reports_malformed_ones() -> None:
    text = ('Let me look.\n<tool_call>\n{"name": "search", "arguments": {"query": "a"}}\n</tool_call>\n'
            '<tool_call>{"name": "search", "arguments": {"query": </tool_call><tool_call>[1]</tool_call>')
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me look."
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["search"]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"query": "a"}
    assert [e.kind for e in parsed.errors] == ["bad_json", "bad_json"]
    assert parse_tool_calls("no calls here").tool_calls == []


class Notes(agentrl.ToolEnv):
    max_turns = 10

    def tasks(self, split: str = "train"):
        return [{"id": "0", "question": "find a"}]

    @agentrl.tool
    async def lookup(self, key: str, times: int = 1) -> str:
        """Look a key up.

        Args:
            key: the key.
            times: repeat count.
        """
        if key == "boom":
            raise RuntimeError("kaboom")
        return key * times

    async def reward(self, task: dict[str, Any], answer: str) -> float:
        return 1.0 if answer == "a" else 0.0


def call(name: str, arguments: str, cid: str = "c1") -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_invalid_tool_calls_become_error_messages_and_counted_events_not_exceptions() -> None:
    async def body() -> None:
        env = Notes()
        opening = await env.reset({"id": "0", "question": "find a"})
        assert [t["function"]["name"] for t in opening.tools] == ["lookup"]
        script = [
            ({"role": "assistant", "content": "", "tool_calls": [call("nope", "{}")]}, "unknown tool 'nope'"),
            ({"role": "assistant", "content": "", "tool_calls": [call("lookup", "{bad")]}, "not valid JSON"),
            (
                {"role": "assistant", "content": "", "tool_calls": [call("lookup", '{"key": 1}')]},
                "wrong type",
            ),
            (
                {"role": "assistant", "content": "", "tool_calls": [call("lookup", '{"times": 2}')]},
                "missing required",
            ),
            (
                {"role": "assistant", "content": "", "tool_calls": [call("lookup", '{"key": "boom"}')]},
                "kaboom",
            ),
            # What a reply looks like when the engine's parser rejected it: text with a broken block.
            (
                {
                    "role": "assistant",
                    "content": '<tool_call>\n{"name": "lookup", "arguments": {"key": \n</tool_call>',
                },
                "could not be read",
            ),
        ]
        for message, expected in script:
            result = await env.step(message)
            assert not result.terminated and not result.truncated and result.reward == 0.0
            assert len(result.messages) == 1 and expected in result.messages[0]["content"]
            assert result.messages[0]["content"].startswith("Error:")
        assert result.info["tool_errors"] == {
            "unknown_tool": 1,
            "bad_json": 2,
            "bad_arguments": 2,
            "tool_raised": 1,
        }
        ok = await env.step({"role": "assistant", "content": "",
                             "tool_calls": [call("lookup", '{"key": "a", "times": 2}', "c9")]})
        assert ok.messages == [{"role": "tool", "tool_call_id": "c9", "content": "aa"}]
        assert ok.info["tool_calls"] == 6  # five structured calls ran through the checks, plus this one
        done = await env.step({"role": "assistant", "content": "a"})
        assert done.terminated and done.reward == 1.0
    asyncio.run(body())


def test_tool_calls_written_as_text_run_when_no_engine_parser_read_them() -> None:
    async def body() -> None:
        env = Notes()
        await env.reset({"id": "0", "question": "q"})
        text = '<tool_call>\n{"name": "lookup", "arguments": {"key": "z", "times": 3}}\n</tool_call>'
        result = await env.step({"role": "assistant", "content": text})
        assert [m["content"] for m in result.messages] == ["zzz"] and result.messages[0]["role"] == "tool"
        assert result.info["tool_errors"] == {}
    asyncio.run(body())


def test_an_episode_that_never_answers_is_truncated_at_max_turns() -> None:
    async def body() -> None:
        env = Notes()
        env.max_turns = 2
        await env.reset({"id": "0", "question": "q"})
        first = await env.step({"role": "assistant", "content": "", "tool_calls": [call("lookup", '{"key": '
                                                                                                  '"a"}')]})
        second = await env.step({"role": "assistant", "content": "", "tool_calls": [call("lookup", '{"key": '
                                                                                                   '"a"}')]})
        assert not first.truncated and second.truncated and not second.terminated
    asyncio.run(body())
