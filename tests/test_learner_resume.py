"""Resume: a learner killed with kill -9 after step k continues exactly where it was.

Run as a script this file is the driver: ``Learner`` on a fixed sequence of batches served by a
small in-process stand-in for the buffer (leases, idempotent acks, acks kept on disk so they
survive the kill), checkpointing every step.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
KILL_AFTER = 2


class FixedBatches:
    """Batch i is always the same samples; acknowledged ids are appended to ``acked.txt``."""

    publishes = False

    def __init__(self, model: str, run_dir: Path, hang_at: int | None = None) -> None:
        self.model, self.run_dir, self.hang_at = model, run_dir, hang_at
        self.acked_path = run_dir / "acked.txt"
        self.leased: set[str] = set()

    def _acked(self) -> set[str]:
        return set(self.acked_path.read_text().split()) if self.acked_path.exists() else set()

    async def info(self) -> dict[str, Any]:
        return {"model_path": self.model, "version": 0}

    async def get_batch(self, version: int) -> tuple[str, list[Any]] | None:
        from tests.test_learner_packing import make_samples

        done = self._acked() | self.leased
        i = next(i for i in range(1000) if f"b{i}" not in done)
        if i == self.hang_at:
            await asyncio.sleep(3600)  # the test kills us here
        self.leased.add(f"b{i}")
        return f"b{i}", make_samples(6, seed=100 + i)

    async def publish(self, state: dict[str, Any], version: int) -> dict[str, Any]:
        return {}

    async def ack(self, batch_id: str) -> bool:
        if batch_id in self._acked():
            return True
        if batch_id not in self.leased:
            return False
        with open(self.acked_path, "a") as f:
            f.write(batch_id + "\n")
            f.flush()
            os.fsync(f.fileno())
        return True

    async def release(self) -> int:
        n, self.leased = len(self.leased), set()
        return n

    async def close(self) -> None:
        pass


def _run(model: str, run_dir: Path, resume: bool, hang_at: int | None, lora: bool = False) -> None:
    from agentrl.config import LearnConfig
    from agentrl.learner.lora import LoraConfig
    from agentrl.learner.trainer import learn

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = LearnConfig(
        model=model,
        run_dir=str(run_dir),
        steps=STEPS,
        lr=1e-3,
        warmup_steps=2,
        decay_steps=4,
        micro_batch_tokens=64,
        checkpoint_every=1,
        resume=resume,
        lora=LoraConfig(rank=4 if lora else 0),
    )
    learn(cfg, FixedBatches(model, run_dir, hang_at))


def _driver(model: str, run_dir: Path, *flags: str) -> list[str]:
    return [sys.executable, str(Path(__file__)), model, str(run_dir), *flags]


def _rows(run_dir: Path) -> list[dict]:
    p = run_dir / "learner.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_learner_killed_after_step_k_resumes_with_the_uninterrupted_loss(tiny_model, tmp_path, lora):
    """Full fine-tuning, and LoRA (whose checkpoints hold only the adapters and their optimizer
    state: the frozen base comes from the model again)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    mode = ("--lora",) if lora else ()
    whole = tmp_path / "whole"
    out = subprocess.run(
        _driver(tiny_model, whole, *mode), capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    reference = _rows(whole)
    assert [r["step"] for r in reference] == list(range(1, STEPS + 1))

    cut = tmp_path / "cut"
    proc = subprocess.Popen(_driver(tiny_model, cut, "--hang-at", str(KILL_AFTER), *mode), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while len(_rows(cut)) < KILL_AFTER and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_rows(cut)) == KILL_AFTER, "the first run did not reach the kill point"
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL

    out = subprocess.run(_driver(tiny_model, cut, "--resume", *mode), capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _rows(cut)
    resumed = rows[KILL_AFTER:]
    assert [r["step"] for r in resumed] == list(range(KILL_AFTER + 1, STEPS + 1))
    for got, want in zip(resumed, reference[KILL_AFTER:], strict=True):
        assert got["batch_id"] == want["batch_id"]
        assert got["version"] == want["version"]
        assert abs(got["lr"] - want["lr"]) < 1e-12
        assert abs(got["loss"] - want["loss"]) <= 1e-5, (got["step"], got["loss"], want["loss"])
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-5 * max(1.0, want["grad_norm"])
    assert (cut / "acked.txt").read_text().split() == [f"b{i}" for i in range(STEPS)]
    if lora:  # the checkpoint is the adapters' (a few KB for the tiny model), not the whole model's
        ckpt = cut / "checkpoints" / (cut / "checkpoints" / "latest").read_text().strip()
        assert (
            sum(f.stat().st_size for f in ckpt.glob("*.distcp"))
            < (Path(tiny_model) / "model.safetensors").stat().st_size / 4
        )
        _exports_the_trained_adapter(ckpt, tiny_model, tmp_path / "hf")


def _exports_the_trained_adapter(ckpt: Path, model: str, out: Path) -> None:
    """The offline export of a LoRA checkpoint: the merged model and the peft adapter, the same policy."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from agentrl.learner.checkpoint import export_checkpoint
    from agentrl.learner.trainer import token_logprobs

    export_checkpoint(ckpt, model, out)
    ids = torch.tensor([[1, 5, 9, 14, 3, 7, 22, 8, 2, 11]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        merged = token_logprobs(
            AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), ids, mask
        )
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        untrained = token_logprobs(base, ids, mask)
        adapted = token_logprobs(PeftModel.from_pretrained(base, str(out / "adapter")).eval(), ids, mask)
    assert (merged - adapted).abs().max() < 1e-4 and (adapted - untrained).abs().max() > 1e-4


if __name__ == "__main__":
    args = sys.argv[1:]
    hang = int(args[args.index("--hang-at") + 1]) if "--hang-at" in args else None
    _run(args[0], Path(args[1]), resume="--resume" in args, hang_at=hang, lora="--lora" in args)
