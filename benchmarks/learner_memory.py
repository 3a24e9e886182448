"""Peak memory of one learner step (forward, backward, AdamW) against the tokens of its micro-batch.

Each setting runs in a fresh process (one micro-batch of that many tokens, 256 per sample, one
``train_step``) and reports its peak resident memory (``ru_maxrss``); the parent polls each child's
resident memory and stops it above ``--limit-gb`` (reported as ``null``), so no setting can take
the machine down. Settings: SmolLM2-135M full fine-tuning (vocabulary 49,152, hidden 576) at
2k, 8k and 16k tokens; a synthetic model with a 152,064-token vocabulary at the same hidden size
(SmolLM2's configuration, randomly initialised, 4 layers so that the head dominates) at 2k and 8k;
with ``--unchunked``, also SmolLM2 at 2k tokens with the whole row's logits at once
(``learn.head_chunk_tokens = 0``, the learner before the chunked head).

A JSON line follows every setting (the summary so far), so the last line is the summary even of a
run stopped early: ``peak_gb`` per setting, ``peak_gb_smollm2_8k`` (target: at most 6),
``growth_8k_to_16k`` (SmolLM2's peak at 16k over its peak at 8k; null until both ran), and the
same ratio from 2k to 8k for SmolLM2 and for the 152k vocabulary.

Activation checkpointing is on by default (``--no-activation-checkpointing`` for the other).
On the shared 2-core build machine the default run takes about 15 minutes (SmolLM2's step: 107 s
at 2k tokens, 274 s at 8k, 446 s at 16k; each sample attends only to itself, so attention does
not grow with the row's length squared).

``--settings tiny:256`` (the project's 0.76M-parameter model, one 256-token sample) is the shortest
run, seconds: what tests/test_benchmark_smoke.py runs to check that the final JSON line is reached.

    python benchmarks/learner_memory.py
    python benchmarks/learner_memory.py --unchunked --settings smollm2:2048
    python benchmarks/learner_memory.py --settings tiny:256
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import tied_to_this_process  # benchmarks/common.py

SETTINGS = ["smollm2:2048", "smollm2:8192", "smollm2:16384", "vocab152k:2048", "vocab152k:8192"]
TOKENS_PER_SAMPLE = 256


def _model_path(name: str) -> str:
    from agentrl.models import home, resolve_model

    if name in ("smollm2", "tiny"):
        return resolve_model(name)
    folder = home() / "models" / "bench-vocab152k"
    if not (folder / "config.json").exists():  # SmolLM2's shape with a Qwen-sized vocabulary, random weights
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(resolve_model("smollm2"))
        config.vocab_size, config.num_hidden_layers = 152_064, 4
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return str(folder)


def child(name: str, tokens: int, chunk: int, checkpointing: bool) -> None:
    """One learner step on one micro-batch of ``tokens`` tokens; prints its peak resident memory."""
    import random
    import resource

    import torch

    from agentrl.buffer.sample import Sample
    from agentrl.learner.config import LearnConfig
    from agentrl.learner.dist import Dist, load_model
    from agentrl.learner.heap import map_large_blocks
    from agentrl.learner.step import build_state, train_step

    map_large_blocks()  # as the learner's process does (agentrl/learner/heap.py)

    path = _model_path(name)
    torch.manual_seed(0)
    ctx = Dist()
    cfg = LearnConfig(micro_batch_tokens=tokens, head_chunk_tokens=chunk, lr=1e-5,
                      activation_checkpointing=checkpointing)
    model = load_model(path, ctx, activation_checkpointing=checkpointing)
    state = build_state(cfg, model, ctx)
    rng = random.Random(0)
    vocab, samples = model.config.vocab_size, []
    for i in range(tokens // TOKENS_PER_SAMPLE):
        prompt = TOKENS_PER_SAMPLE // 4
        ids = [rng.randrange(3, vocab) for _ in range(TOKENS_PER_SAMPLE)]
        completion = TOKENS_PER_SAMPLE - prompt
        samples.append(Sample(ids, [0] * prompt + [1] * completion,
                              [0.0] * prompt + [-rng.uniform(0.5, 5.0) for _ in range(completion)],
                              [-1] * prompt + [0] * completion, episode_id=f"e{i}", group_id=f"g{i // 4}",
                              env="bench", reward=float(i % 2)))
    before_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # model loaded, no step yet
    t0 = time.perf_counter()
    out = train_step(state, samples, cfg, version=0)
    seconds = time.perf_counter() - t0
    assert out["updated"] and out["packed_rows"] == 1, out
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(
        json.dumps(
            {"peak_gb": round(peak_gb, 3), "loaded_gb": round(before_gb, 3), "step_s": round(seconds, 1)}
        ),
        flush=True,
    )


def _rss_gb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def measure(name: str, tokens: int, chunk: int, checkpointing: bool, limit_gb: float) -> dict | None:
    """Run one setting in a fresh process; its result, or None if it went over ``limit_gb``."""
    cmd = [sys.executable, __file__, "--child", f"{name}:{tokens}", "--chunk", str(chunk)]
    cmd += ["--activation-checkpointing" if checkpointing else "--no-activation-checkpointing"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=tied_to_this_process())
    while proc.poll() is None:
        if _rss_gb(proc.pid) > limit_gb:
            proc.kill()
            proc.wait()
            print(f"{name}:{tokens} chunk {chunk}: stopped above {limit_gb} GB", file=sys.stderr, flush=True)
            return None
        time.sleep(0.05)
    assert proc.stdout is not None
    lines = [x for x in proc.stdout.read().splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{name}:{tokens} failed (exit {proc.returncode})")
    result = json.loads(lines[-1])
    print(f"{name}:{tokens} chunk {chunk}: {result}", file=sys.stderr, flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--settings", default=",".join(SETTINGS), help="model:tokens,... (model: "
                                                                  "smollm2, vocab152k or tiny)")
    p.add_argument(
        "--chunk", type=int, default=-1, help="learn.head_chunk_tokens (-1: the learner's default)"
    )
    p.add_argument("--unchunked", action="store_true", help="also SmolLM2 at 2k tokens "
                                                            "with the whole row's logits")
    p.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="learn.activation_checkpointing for every setting (on by default: "
                        "8k tokens of SmolLM2 keep about 13 GB of activations without it)")
    p.add_argument("--limit-gb", type=float, default=14.0, help="stop a setting whose "
                                                                "resident memory passes this")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    from agentrl.learner.config import LearnConfig

    chunk = LearnConfig().head_chunk_tokens if a.chunk < 0 else a.chunk
    if a.child:
        name, tokens = a.child.split(":")
        child(name, int(tokens), chunk, a.activation_checkpointing)
        return
    details: dict[str, dict | None] = {}
    runs = [(s, chunk) for s in a.settings.split(",")] + ([("smollm2:2048", 0)] if a.unchunked else [])
    for setting, c in runs:
        name, tokens = setting.split(":")
        details[setting if c else f"{setting}:unchunked"] = measure(
            name, int(tokens), c, a.activation_checkpointing, a.limit_gb
        )
        # the summary so far after every setting: a long run stopped early still ends in a JSON line
        print(json.dumps(summary(details, chunk, a.activation_checkpointing)), flush=True)


def summary(details: dict[str, dict | None], chunk: int, checkpointing: bool) -> dict:
    peaks = {k: None if v is None else v["peak_gb"] for k, v in details.items()}

    def growth(small: str, large: str) -> float | None:
        lo, hi = peaks.get(small), peaks.get(large)
        return round(hi / lo, 3) if lo and hi else None

    return {
        "benchmark": "learner_memory",
        "head_chunk_tokens": chunk,
        "activation_checkpointing": checkpointing,
        "peak_gb": peaks,
        "step_s": {k: v["step_s"] for k, v in details.items() if v},
        "loaded_gb": {k: v["loaded_gb"] for k, v in details.items() if v},
        "peak_gb_smollm2_8k": peaks.get("smollm2:8192"),
        "growth_8k_to_16k": growth("smollm2:8192", "smollm2:16384"),
        "growth_2k_to_8k": growth("smollm2:2048", "smollm2:8192"),
        "growth_vocab152k_2k_to_8k": growth("vocab152k:2048", "vocab152k:8192"),
    }


if __name__ == "__main__":
    main()
