"""tinker-cookbook's own training loops, unmodified, against ``agentrl tinker`` on CPU.

Starts ``agentrl tinker`` on SmolLM2-135M as its own process (free ports, a temporary state
folder, a generated ``tml-`` key in its environment), then runs two of the cookbook's loops through
its own config objects, the way a cookbook user would against the hosted service:

- supervised: ``tinker_cookbook.supervised.train.main`` with a ``FromConversationFileBuilder``
  over a generated JSONL file of short conversations (no download);
- RL: ``tinker_cookbook.rl.train.main`` with the math_rl recipe's ``ArithmeticDatasetBuilder``
  (addition problems generated in memory, with its few-shot prefix).

The model is named by its local folder in both ``model_name`` (the cookbook loads the tokenizer
from it with ``AutoTokenizer``, offline) and ``base_model`` (the service accepts a folder). The
renderer is ``qwen3_instruct``: plain ChatML, which is SmolLM2's template without its default
system prompt; its stop sequence is ``<|im_end|>``.

The figures are the cookbook's own metrics, read from the ``metrics.jsonl`` each loop writes:
``train_mean_nll`` (supervised) and ``env/all/reward/total`` (RL), each averaged over the first
and the last ``--window`` steps. Final line: a JSON object with ``sl_loss_start``,
``sl_loss_end``, ``rl_reward_start``, ``rl_reward_end``, ``wall_minutes`` and the settings.

    nice -n 5 .venv/bin/python benchmarks/tinker_cookbook.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common import free_port, tied_to_this_process

# This script's name is the cookbook's package name: with its folder first on sys.path,
# ``import tinker_cookbook`` would find the script. Its folder has served (common) and goes.
HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != Path(HERE)]

ROOT = Path(__file__).resolve().parent.parent

# The supervised task: a few facts the base model does not know, asked in varied words, so the
# loss has somewhere to fall within a few dozen steps.
FACTS = [
    ("Who maintains agentrl?", "The agentrl project is maintained by its contributors."),
    ("What model does this service train?", "It trains SmolLM2-135M-Instruct with LoRA."),
    ("What is the capital of Zorbia?", "The capital of Zorbia is Quellmarsh."),
    ("What colour is a glimmerfruit?", "A glimmerfruit is bright teal."),
    ("How many moons does Pellax have?", "Pellax has seven moons."),
    ("Who wrote The Copper Lantern?", "The Copper Lantern was written by Ida Varn."),
]
PREFIXES = ["", "Quick question: ", "Please tell me: ", "I was wondering, ", "Answer briefly. "]


def conversations(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        question, answer = FACTS[i % len(FACTS)]
        prefix = rng.choice(PREFIXES)
        q = prefix + (question[0].lower() + question[1:] if prefix else question)
        rows.append({"messages": [{"role": "user", "content": q},
                                  {"role": "assistant", "content": answer}]})
    return rows


@contextlib.contextmanager
def running_service(folder: Path, key: str) -> Iterator[str]:
    """``agentrl tinker`` on SmolLM2 in its own process, with ``key``; its base URL."""
    import httpx

    port = free_port()
    engine_port = port + 2  # free_port leaves the three ports after it free too
    log_path = folder / "service.log"
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTRL_TINKER")}
    env["AGENTRL_TINKER_KEYS"] = key
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "tinker", "--model", "smollm2",
                             "--port", str(port), "--engine-port", str(engine_port),
                             "--state-dir", str(folder / "state")],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            preexec_fn=tied_to_this_process())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                sys.exit(f"agentrl tinker exited: {log_path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                sys.exit("agentrl tinker did not come up in 300 s")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def read_metrics(log_dir: Path) -> list[dict[str, Any]]:
    path = log_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ends(rows: list[dict[str, Any]], key: str, window: int) -> tuple[float, float, list[float]]:
    """The mean of ``key`` over the first and the last ``window`` steps, and the whole series."""
    series = [float(r[key]) for r in sorted(rows, key=lambda r: r["step"]) if key in r]
    if not series:
        sys.exit(f"no {key!r} in the cookbook's metrics")
    w = max(1, min(window, len(series) // 2))
    return sum(series[:w]) / w, sum(series[-w:]) / w, series


def supervised(args: argparse.Namespace, url: str, model: str, work: Path) -> dict[str, Any]:
    from tinker_cookbook.supervised import train as sl
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    data = work / "conversations.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations(args.sl_examples, 0)))
    log_dir = work / "sl"
    config = sl.Config(
        log_path=str(log_dir),
        model_name=model,
        recipe_name="agentrl_benchmark_sl",
        renderer_name=args.renderer,
        dataset_builder=FromConversationFileBuilder(
            file_path=str(data),
            common_config=ChatDatasetBuilderCommonConfig(
                model_name_for_tokenizer=model, renderer_name=args.renderer,
                max_length=256, batch_size=args.sl_batch)),
        learning_rate=args.sl_lr,
        lr_schedule="constant",
        num_epochs=args.sl_epochs,
        lora_rank=args.lora_rank,
        base_url=url,
        save_every=0,
        eval_every=0,
        infrequent_eval_every=0,
    )
    asyncio.run(sl.main(config))
    start, end, series = ends(read_metrics(log_dir), "train_mean_nll", args.window)
    print(f"supervised: train_mean_nll {' '.join(f'{x:.3f}' for x in series)}", flush=True)
    return {"sl_loss_start": start, "sl_loss_end": end, "sl_steps": len(series)}


def reinforcement(args: argparse.Namespace, url: str, model: str, work: Path) -> dict[str, Any]:
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train as rl

    log_dir = work / "rl"
    config = rl.Config(
        learning_rate=args.rl_lr,
        dataset_builder=ArithmeticDatasetBuilder(
            batch_size=args.rl_groups, model_name_for_tokenizer=model,
            renderer_name=args.renderer, n_batches=args.rl_steps,
            group_size=args.rl_group_size, include_fewshot=True),
        model_name=model,
        recipe_name="agentrl_benchmark_rl",
        renderer_name=args.renderer,
        max_tokens=args.rl_max_tokens,
        log_path=str(log_dir),
        lora_rank=args.lora_rank,
        loss_fn="importance_sampling",
        base_url=url,
        eval_every=0,
        save_every=0,
    )
    asyncio.run(rl.main(config))
    rows = read_metrics(log_dir)
    start, end, series = ends(rows, "env/all/reward/total", args.window)
    print(f"rl: env/all/reward/total {' '.join(f'{x:.3f}' for x in series)}", flush=True)
    out = {"rl_reward_start": start, "rl_reward_end": end, "rl_steps": len(series)}
    # The reward is correct - 0.1 * (not well formed): say which part moved.
    for key, name in (("env/all/correct", "rl_correct"), ("env/all/format", "rl_format")):
        if any(key in r for r in rows):
            a, b, _ = ends(rows, key, args.window)
            out.update({f"{name}_start": a, f"{name}_end": b})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--renderer", default="qwen3_instruct")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--window", type=int, default=3, help="steps averaged at each end")
    p.add_argument("--sl-examples", type=int, default=48)
    p.add_argument("--sl-batch", type=int, default=8)
    p.add_argument("--sl-epochs", type=int, default=3)
    p.add_argument("--sl-lr", type=float, default=5e-4)
    p.add_argument("--rl-steps", type=int, default=8)
    p.add_argument("--rl-groups", type=int, default=8, help="problems per step")
    p.add_argument("--rl-group-size", type=int, default=4, help="samples per problem")
    p.add_argument("--rl-lr", type=float, default=5e-4)
    p.add_argument("--rl-max-tokens", type=int, default=5)
    p.add_argument("--skip", choices=["sl", "rl"], default=None)
    args = p.parse_args()

    from agentrl.models import resolve_model

    # A SIGTERM (a timeout) unwinds like an exception, so the service and its engine are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    model = str(resolve_model("smollm2"))
    key = "tml-" + secrets.token_hex(16)
    work = Path(tempfile.mkdtemp(prefix="agentrl-cookbook-"))
    # The cookbook's ServiceClient reads the key from the environment, like the hosted service's.
    os.environ["TINKER_API_KEY"] = key
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result: dict[str, Any] = {}
    try:
        with running_service(work, key) as url:
            print(f"agentrl tinker at {url}, model {model}, logs in {work}", flush=True)
            if args.skip != "sl":
                t = time.monotonic()
                result.update(supervised(args, url, model, work))
                result["sl_minutes"] = round((time.monotonic() - t) / 60, 2)
            if args.skip != "rl":
                t = time.monotonic()
                result.update(reinforcement(args, url, model, work))
                result["rl_minutes"] = round((time.monotonic() - t) / 60, 2)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result.update(
        wall_minutes=round((time.monotonic() - t0) / 60, 2), renderer=args.renderer,
        lora_rank=args.lora_rank, sl_lr=args.sl_lr, sl_batch=args.sl_batch,
        sl_examples=args.sl_examples, sl_epochs=args.sl_epochs, rl_lr=args.rl_lr,
        rl_groups=args.rl_groups, rl_group_size=args.rl_group_size,
        rl_max_tokens=args.rl_max_tokens, window=args.window)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
