"""FSDP2 under torchrun (gloo, 2 processes) computes the same step as one plain process.

Run as a script under torchrun this file is the driver: it trains one step on a fixed batch and
rank 0 prints the loss and gradient norm as JSON (and exports the policy when asked).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _one_step(model_path: str, export_dir: str = "", routed: bool = False) -> dict:
    import torch

    from agentrl.config import LearnConfig
    from agentrl.learner.checkpoint import export_hf
    from agentrl.learner.dist import full_state_dict, init_dist, load_model
    from agentrl.learner.step import build_state, train_step
    from tests.test_learner_packing import make_samples

    ctx = init_dist()
    torch.manual_seed(0)
    cfg = LearnConfig(micro_batch_tokens=64, lr=1e-3, grad_clip=0.0)
    state = build_state(cfg, load_model(model_path, ctx), ctx)
    if routed:  # an MoE model's samples, each with its recorded experts (tests.test_moe_routing)
        from tests.test_moe_routing import _routed_samples

        first_batch, second_batch = _routed_samples(10, seed=3), _routed_samples(10, seed=4)
    else:
        first_batch, second_batch = make_samples(10, seed=3), make_samples(10, seed=4)
    stats = train_step(state, first_batch, cfg, version=1)
    second = train_step(state, second_batch, cfg, version=2)
    # The two gathers the weight transports use (host memory for HTTP; the learner's device, one
    # parameter at a time, for NCCL) give rank 0 the same full weights.
    host = full_state_dict(state.model, ctx)
    on_device = full_state_dict(state.model, ctx, on_device=True)
    gathered_alike = bool(host) and sorted(host) == sorted(on_device) and all(
        torch.equal(host[k], on_device[k].cpu()) for k in host) if ctx.is_main else None
    if export_dir:
        export_hf(state.model, ctx, model_path, export_dir)
    ctx.close()
    return {"loss": stats["loss"], "grad_norm": stats["grad_norm"], "rows": stats["packed_rows"],
            "loss2": second["loss"], "is_mean": stats["is/mean"], "world": ctx.world,
            "gathered_alike": gathered_alike, "routing_replayed_tokens": stats.get("routing_replayed_tokens"),
            "routing_disagreement": stats.get("routing_disagreement")}


@pytest.mark.slow
def test_two_fsdp_processes_match_one_process_on_the_same_batch(tiny_model, tmp_path):
    single = _one_step(tiny_model)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__)), tiny_model, str(tmp_path / "hf")]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    sharded = json.loads([x for x in out.stdout.splitlines() if x.startswith("{")][-1])
    assert sharded["world"] == 2 and single["world"] == 1 and single["rows"] > 2
    assert sharded["gathered_alike"] and single["gathered_alike"]
    for key in ("loss", "grad_norm", "loss2", "is_mean"):
        assert abs(sharded[key] - single[key]) <= 1e-4 * abs(single[key]), (key, sharded, single)

    # the gathered policy is a normal Hugging Face folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(tmp_path / "hf") is not None
    assert "quantization_config" not in model.config.to_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), base.parameters(), strict=True))
    assert moved > 0  # the trained weights, not the starting ones


@pytest.mark.slow
def test_two_fsdp_processes_replay_an_moe_models_recorded_routing_like_one_process(tmp_path):
    from agentrl.models import resolve_model

    moe = resolve_model("tiny-moe")
    single = _one_step(moe, routed=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__)), moe, "", "routed"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    sharded = json.loads([x for x in out.stdout.splitlines() if x.startswith("{")][-1])
    assert sharded["world"] == 2 and single["rows"] > 2
    # each rank replays the rows it trains; the counts add up to the one process's
    assert sharded["routing_replayed_tokens"] == single["routing_replayed_tokens"] > 0
    assert sharded["routing_disagreement"] == pytest.approx(single["routing_disagreement"])
    for key in ("loss", "grad_norm", "loss2"):
        assert abs(sharded[key] - single[key]) <= 1e-4 * abs(single[key]), (key, sharded, single)


if __name__ == "__main__":
    result = _one_step(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "", routed=sys.argv[3:] == ["routed"])
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result), flush=True)
