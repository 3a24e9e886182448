"""Does the learner's step raise a reward? GRPO in one process, without serve, in minutes.

A diagnostic for the RL recipe, much faster than ``benchmarks/learning.py``: the model samples
with transformers' ``generate`` (temperature 1, behaviour logprobs from its scores), the learner's
own ``train_step`` (advantages, packing, loss, correction, clipping, optimizer) trains on the
samples, on policy. The objective is the first turn of the ``arithmetic`` environment: reward 1
when the model's first reply calls the python tool with exactly ``print(<the question's
expression>)`` (the part of the task the tiny models get wrong: copying the numbers), else 0.
Held-out prompts (the environment's ``test`` split) are scored before and after, ``--eval-samples``
samples each. Prints one JSON line at the end.

    python benchmarks/grpo_offline.py [--model tiny-arith] [--lr 1e-4] [--steps 30] [--optimizer adamw|sgd]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-arith")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (GRPO group)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--eval-prompts", type=int, default=24)
    p.add_argument("--eval-samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.buffer.sample import Sample
    from agentrl.env.tools import tool_schema
    from agentrl.learner.config import LearnConfig
    from agentrl.learner.dist import Dist
    from agentrl.learner.step import build_state, train_step
    from agentrl.models import resolve_model
    from environments.arithmetic import SYSTEM, ArithmeticEnv

    model_dir = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    env = ArithmeticEnv(num_train=2000, num_test=args.eval_prompts)
    tools = [tool_schema(ArithmeticEnv.python)]
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def prompt(task: dict[str, Any]) -> tuple[list[int], str]:
        ids = tok.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}],
            tools=tools,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        return list(ids), task["question"][len("What is "):-1]

    train = [prompt(t) for t in env.tasks("train")]
    test = [prompt(t) for t in env.tasks("test")]
    cfg = LearnConfig(lr=args.lr, steps=args.steps)
    state = build_state(cfg, model, Dist())
    if args.optimizer == "sgd":
        state.optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda s: 1.0)

    def rollout(ids: list[int], expr: str, n: int, version: int) -> list[Sample]:
        model.eval()
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.max_new_tokens,
                num_return_sequences=n,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=tok.pad_token_id or 0,
            )
        lps = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        samples = []
        for i in range(n):
            comp, lp = out.sequences[i, len(ids):].tolist(), lps[i].tolist()
            if eos in comp:
                k = comp.index(eos) + 1
                comp, lp = comp[:k], lp[:k]
            reward = 1.0 if f'"code": "print({expr})"' in tok.decode(comp) else 0.0
            samples.append(  # the buffer's own type: whatever fields the learner's step reads, it has
                Sample(
                    ids + comp,
                    [0] * len(ids) + [1] * len(comp),
                    [0.0] * len(ids) + lp,
                    [-1] * len(ids) + [version] * len(comp),
                    episode_id=f"{expr}-{version}-{i}",
                    group_id=expr,
                    env="arithmetic",
                    reward=reward,
                    sample_id=f"{expr}-{version}-{i}",
                )
            )
        return samples

    def evaluate() -> float:
        rewards = [s.reward for ids, expr in test for s in rollout(ids, expr, args.eval_samples, 0)]
        return float(np.mean(rewards))

    t0 = time.monotonic()
    before = evaluate()
    print(
        f"before: {before:.3f} on {len(test)} held-out prompts x {args.eval_samples}",
        file=sys.stderr,
        flush=True,
    )
    for step in range(args.steps):
        batch = [
            s for ids, expr in rng.sample(train, args.prompts) for s in rollout(ids, expr, args.group, step)
        ]
        stats = train_step(state, batch, cfg, step)
        print(f"step {step + 1} | reward "
              f"{np.mean([s.reward for s in batch]):.3f} "
              f"| loss {stats.get('loss', 0.0):+.4f} "
              f"| {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
    after = evaluate()
    print(
        json.dumps(
            {
                "benchmark": "grpo_offline",
                "model": args.model,
                "optimizer": args.optimizer,
                "lr": args.lr,
                "steps": args.steps,
                "samples_per_step": args.prompts * args.group,
                "reward_before": round(before, 4),
                "reward_after": round(after, 4),
                "eval_samples": len(test) * args.eval_samples,
                "minutes": round((time.monotonic() - t0) / 60, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
