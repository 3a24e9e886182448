"""Training throughput through ``agentrl tinker`` against agentrl's own learner step, on one batch.

The same samples (``benchmarks/learner.py``'s: random tokens, a quarter prompt, behaviour logprobs,
two rewards) are trained on two ways, LoRA rank 8 on the same layers:

- agentrl's learner: ``agentrl.learner.step.train_step`` in this process;
- the Tinker service, as its own process, driven by the official SDK: ``forward_backward`` with the
  importance-sampling loss on the same tokens, logprobs and advantages, then ``optim_step``; each
  step waits for both results, so it is the whole round trip (encode, HTTP, queue, compute, poll).

Steps alternate so that machine noise hits both alike; each figure is the median step. The final
line is JSON with ``service_tokens_per_s``, ``learner_tokens_per_s`` and ``ratio`` (service over
learner: #39 asks for at least 0.9).

    .venv/bin/python benchmarks/tinker_service.py                       # smollm2, 8 x 256 tokens, 5 steps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import free_port, tied_to_this_process  # noqa: E402 (benchmarks/common.py)
from learner import make_samples  # noqa: E402 (benchmarks/learner.py)


def start_service(model: str, folder: Path, key: str) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    env = {**os.environ, "AGENTRL_TINKER_KEYS": key}
    log = open(folder / "service.log", "wb")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "tinker", "--model", model, "--port",
                             str(port), "--state-dir", str(folder / "state"), "--no-sampling"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=tied_to_this_process())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the service did not start; see {folder / 'service.log'}")
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2", help="a built-in model name or folder")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256, help="tokens per sample")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank of both")
    p.add_argument("--steps", type=int, default=5, help="measured steps of each")
    p.add_argument("--warmup", type=int, default=1)
    a = p.parse_args()

    import numpy as np
    import tinker
    import torch
    from tinker import types

    from agentrl.learner.config import LearnConfig
    from agentrl.learner.dist import Dist, load_model
    from agentrl.learner.lora import LoraConfig
    from agentrl.learner.step import build_state, train_step
    from agentrl.models import resolve_model

    path = resolve_model(a.model)
    torch.manual_seed(0)
    ctx = Dist()
    cfg = LearnConfig(micro_batch_tokens=2048, lr=1e-4, lora=LoraConfig(rank=a.rank, alpha=32.0))
    state = build_state(cfg, load_model(path, ctx, lora=cfg.lora), ctx)
    vocab = state.model.config.vocab_size
    samples = make_samples(a.samples, a.tokens, vocab, seed=0)
    tokens = int(sum(sum(s.loss_mask[1:]) for s in samples))
    mean_reward = sum(s.reward for s in samples) / len(samples)
    data = []
    for s in samples:
        mask = np.array(s.loss_mask[1:], dtype=np.float32)
        ids = np.asarray(s.token_ids).tolist()
        data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
            "target_tokens": np.array(ids[1:], dtype=np.int64),
            "logprobs": np.asarray(s.logprobs[1:], dtype=np.float32),
            "advantages": mask * (s.reward - mean_reward)}))

    key = "tml-bench-" + os.urandom(8).hex()
    with tempfile.TemporaryDirectory(prefix="agentrl-tinker-bench-") as tmp:
        proc, url = start_service(a.model, Path(tmp), key)
        try:
            client = tinker.ServiceClient(base_url=url, api_key=key).create_lora_training_client(
                base_model=a.model, rank=a.rank, seed=0, train_unembed=False).result()

            def service_step() -> None:
                fwd = client.forward_backward(data, "importance_sampling")
                opt = client.optim_step(types.AdamParams(learning_rate=1e-4))
                fwd.result(), opt.result()

            def learner_step() -> None:
                train_step(state, samples, cfg, version=0)

            times: dict[str, list[float]] = {"service": [], "learner": []}
            for i in range(a.warmup + a.steps):
                for name, fn in (("service", service_step), ("learner", learner_step)):
                    t0 = time.perf_counter()
                    fn()
                    if i >= a.warmup:
                        times[name].append(time.perf_counter() - t0)
                    print(f"[tinker-bench] step {i} {name}: {time.perf_counter() - t0:.2f} s", flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    service_s, learner_s = statistics.median(times["service"]), statistics.median(times["learner"])
    print(json.dumps({
        "benchmark": "tinker", "model": a.model, "samples": a.samples, "tokens_per_sample": a.tokens,
        "lora_rank": a.rank, "trained_tokens_per_step": tokens, "steps": a.steps,
        "service_step_s": service_s, "learner_step_s": learner_s,
        "service_tokens_per_s": tokens / service_s, "learner_tokens_per_s": tokens / learner_s,
        "ratio": learner_s / service_s, "threads": torch.get_num_threads(),
    }), flush=True)


if __name__ == "__main__":
    main()
