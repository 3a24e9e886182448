"""Learner throughput against a bare PyTorch loop on the same model and tokens.

Both loops train on the same packed rows (same input ids and position ids): the bare loop is
forward, mean token logprob, backward, AdamW step; the learner is ``agentrl.learner.step.train_step``
(advantages, packing, the off-policy-corrected loss, statistics, gradient clipping, schedule).
Steps alternate between the two so machine noise hits both alike. The final line is JSON with
``tokens_per_s``, ``plain_torch_tokens_per_s`` and ``overhead_ratio`` (plain / learner - 1).

    python benchmarks/learner.py --model tiny            # seconds
    python benchmarks/learner.py --model smollm2 --samples 8 --tokens 256   # ~15 s per step on 2 cores
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def make_samples(n: int, tokens: int, vocab: int, seed: int) -> list:
    from agentrl.buffer.sample import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = tokens // 4
        ids = [rng.randrange(3, vocab) for _ in range(tokens)]
        mask = [0] * prompt + [1] * (tokens - prompt)
        lps = [0.0] * prompt + [-rng.uniform(0.5, 5.0) for _ in range(tokens - prompt)]
        out.append(Sample(ids, mask, lps, [-1] * prompt + [0] * (tokens - prompt), episode_id=f"e{i}",
                          group_id=f"g{i // 4}", env="bench", reward=float(i % 2)))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny", help="tiny, smollm2 or a model folder")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256, help="tokens per sample")
    p.add_argument("--micro-batch-tokens", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5, help="measured steps of each loop")
    p.add_argument("--warmup", type=int, default=1)
    a = p.parse_args()

    import torch

    from agentrl.learner.config import LearnConfig
    from agentrl.learner.dist import Dist, load_model
    from agentrl.learner.packing import pack, packed_inputs
    from agentrl.learner.step import build_state, train_step
    from agentrl.models import home, resolve_model

    if a.model == "smollm2":
        from agentrl.models.smollm2 import build_smollm2

        path = str(build_smollm2(home() / "models" / "smollm2-135m"))
    else:
        path = resolve_model(a.model)
    torch.manual_seed(0)
    ctx = Dist()
    cfg = LearnConfig(micro_batch_tokens=a.micro_batch_tokens, lr=1e-5)
    state = build_state(cfg, load_model(path, ctx), ctx)
    bare = load_model(path, ctx)
    bare_opt = torch.optim.AdamW(bare.parameters(), lr=1e-5)
    samples = make_samples(a.samples, a.tokens, bare.config.vocab_size, seed=0)
    rows = [packed_inputs([samples[i] for i in r]) for r in pack([len(s.token_ids) for s in samples],
                                                                   a.micro_batch_tokens)]
    tokens = int(sum(sum(s.loss_mask[1:]) for s in samples))

    def plain_step() -> None:
        bare_opt.zero_grad(set_to_none=True)
        for ids, pos in rows:
            logits = bare(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False).logits
            logp = torch.log_softmax(logits[0, :-1].float(), dim=-1).gather(-1, ids[0, 1:, None])
            (-logp.sum() / tokens).backward()
        bare_opt.step()

    def learner_step() -> None:
        train_step(state, samples, cfg, version=0)

    times: dict[str, list[float]] = {"learner": [], "plain": []}
    cpu: dict[str, list[float]] = {"learner": [], "plain": []}
    for i in range(a.warmup + a.steps):
        for name, fn in (("learner", learner_step), ("plain", plain_step)):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            if i >= a.warmup:
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    learner_s, plain_s = statistics.median(times["learner"]), statistics.median(times["plain"])
    # CPU seconds are steadier than wall time on a shared machine
    learner_cpu, plain_cpu = statistics.median(cpu["learner"]), statistics.median(cpu["plain"])
    result = {
        "benchmark": "learner",
        "model": a.model,
        "params": sum(p.numel() for p in bare.parameters()),
        "samples": a.samples,
        "tokens_per_sample": a.tokens,
        "trained_tokens_per_step": tokens,
        "rows": len(rows),
        "steps": a.steps,
        "learner_step_s": learner_s,
        "plain_step_s": plain_s,
        "tokens_per_s": tokens / learner_s,
        "plain_torch_tokens_per_s": tokens / plain_s,
        "overhead_ratio": learner_s / plain_s - 1.0,
        "learner_cpu_s": learner_cpu,
        "plain_cpu_s": plain_cpu,
        "cpu_overhead_ratio": learner_cpu / plain_cpu - 1.0,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
