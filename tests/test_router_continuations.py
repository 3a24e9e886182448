"""A continued session call renders only its new messages, and only where that is exact.

The tiny-tools model's own tokenizer and ChatML template, rendered locally (no engine): the linear
continuation (one render of the new messages after a short base conversation) must give exactly
the prompt the two-render path gives, and a template for which it would not (one that numbers its
messages) must be detected by the check and keep the two-render path. The same against real vLLM,
with render counts: tests/test_router_render.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentrl.router.calibration import continuation_probes
from agentrl.router.render import LocalRenderer
from agentrl.router.sessions import CallRecord, Completion, continued_prompt, normalize_message


@pytest.fixture(scope="module")
def renderer(tiny_tools_model: str) -> LocalRenderer:
    r = LocalRenderer.load(tiny_tools_model, max_model_len=2048)
    assert r is not None
    return r


@pytest.fixture(scope="module")
def eos(tiny_tools_model: str) -> set[int]:
    from agentrl.models import eos_token_ids

    return eos_token_ids(tiny_tools_model)


def _numbered(template: str) -> str:
    """The same template with each message's position rendered into it: not prefix-local."""
    numbered = template.replace("<|im_start|>{{ m.role }}", "<|im_start|>{{ m.role }}{{ loop.index }}")
    assert numbered != template
    return numbered


def _parent(
    renderer: LocalRenderer, body: dict[str, Any], k: int, reply: dict[str, Any], eos: set[int]
) -> CallRecord:
    """A recorded call for ``body``'s first ``k - 1`` messages whose reply is message ``k - 1``."""
    conv = body["messages"][: k - 1]
    prompt = renderer.render_ids(body, conv)
    # The reply's tokens as a model would sample them: its rendering after the prompt, eos included.
    replied = renderer.render_ids(body, [*conv, reply], add_generation_prompt=False)
    eos_at = max(i for i, t in enumerate(replied) if t in eos)
    completion = replied[len(prompt) : eos_at + 1]
    return CallRecord("s", 0, None, 0, prompt, [Completion(completion, [-1.0] * len(completion),
                                                           [0] * len(completion), "stop", reply)],
                      engine="e", messages=[normalize_message(m) for m in conv])


def _two_render(
    renderer: LocalRenderer, body: dict[str, Any], parent: CallRecord, eos: set[int]
) -> list[int] | None:
    k = len(parent.messages) + 1
    return continued_prompt(
        parent,
        0,
        renderer.render_ids(body, body["messages"][:k], add_generation_prompt=False),
        renderer.render_ids(body),
        eos,
    )


def test_the_chatml_template_passes_the_check_and_a_continuation_renders_only_the_new_messages(renderer, eos):
    r = LocalRenderer(renderer.tok, max_model_len=2048)
    asyncio.run(r.check_continuations(None, "m", eos))
    assert r.continuations == "linear"
    renders: list[int] = []
    plain = r.render_ids

    def counted(
        body: dict[str, Any], messages: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True
    ):
        renders.append(len(body["messages"] if messages is None else messages))
        return plain(body, messages, add_generation_prompt)

    r.render_ids = counted  # type: ignore[method-assign]
    for name, tools, conv, new in continuation_probes():
        body: dict[str, Any] = {"model": "m", "messages": conv + new, **({"tools": tools} if tools else {})}
        parent = _parent(renderer, body, len(conv), conv[-1], eos)
        renders.clear()
        got = asyncio.run(r.prompt(None, body, parent, 0, eos))
        assert got.continues and got.ids == _two_render(renderer, body, parent, eos), name
        # the base conversation (2 messages) once per tool set, then base + new messages: never the whole
        # conversation
        assert renders in ([2 + len(new)], [2, 2 + len(new)]), (name, renders)
    assert r.counters["local_renders"] == len(continuation_probes())
    assert len(r._bases) == 2  # no tools, and TOOLS


def test_a_template_that_numbers_its_messages_keeps_the_two_render_path(eos, tiny_tools_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tools_model)
    tok.chat_template = _numbered(tok.chat_template)
    r = LocalRenderer(tok, max_model_len=2048)
    asyncio.run(r.check_continuations(None, "m", eos))
    assert r.continuations == "two-render"
    name, tools, conv, new = continuation_probes()[1]  # a conversation longer than the base one
    body = {"model": "m", "messages": conv + new}
    parent = _parent(r, body, len(conv), conv[-1], eos)
    got = asyncio.run(r.prompt(None, body, parent, 0, eos))
    assert got.continues and got.ids == _two_render(r, body, parent, eos)  # exact, as before
    # what the linear path would have given instead: different tokens, which the check caught
    r.continuations = "linear"
    assert asyncio.run(r.prompt(None, body, parent, 0, eos)).ids != got.ids


def test_requests_outside_the_probed_shapes_take_the_two_render_path(renderer, eos):
    from agentrl.router.render import EngineRenderer

    e = EngineRenderer(None, max_model_len=2048)
    e.continuations = "linear"
    hi = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert e.continues_linearly({"model": "m", "messages": hi})
    assert not e.continues_linearly({"model": "m", "messages": hi, "chat_template_kwargs": {"x": 1}})
    assert not e.continues_linearly({"model": "m", "messages": [*hi, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]})
    assert not e.continues_linearly({"model": "m", "messages": [*hi, {"role": "developer", "content": "x"}]})
