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


def _one_step(model_path: str, export_dir: str = "", routed: bool = False, lora: bool = False) -> dict:
    import torch

    from agentrl.config import LearnConfig
    from agentrl.learner.checkpoint import export_hf
    from agentrl.learner.dist import full_state_dict, init_dist, load_model
    from agentrl.learner.lora import LoraConfig
    from agentrl.learner.step import build_state, train_step
    from tests.test_learner_packing import make_samples

    ctx = init_dist()
    torch.manual_seed(0)
    cfg = LearnConfig(micro_batch_tokens=64, lr=1e-3, grad_clip=0.0, lora=LoraConfig(rank=4 if lora else 0))
    state = build_state(cfg, load_model(model_path, ctx, lora=cfg.lora), ctx)
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
    adapter = full_state_dict(state.model, ctx, trainable_only=True) if lora else {}
    if export_dir:
        export_hf(state.model, ctx, model_path, export_dir, cfg.lora)
    ctx.close()
    return {
        "adapter_keys": sorted(adapter),
        "adapter_sum": float(sum(v.double().abs().sum() for v in adapter.values())),
        "optimized": sum(p.numel() for g in state.optimizer.param_groups for p in g["params"]),
        "loss": stats["loss"],
        "grad_norm": stats["grad_norm"],
        "rows": stats["packed_rows"],
        "loss2": second["loss"],
        "is_mean": stats["is/mean"],
        "world": ctx.world,
        "gathered_alike": gathered_alike,
        "routing_replayed_tokens": stats.get("routing_replayed_tokens"),
        "routing_disagreement": stats.get("routing_disagreement"),
    }


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
    moved = max(
        (a - b).abs().max().item() for a, b in zip(model.parameters(), base.parameters(), strict=True)
    )
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


@pytest.mark.slow
def test_lora_under_two_fsdp_processes_trains_and_gathers_the_adapter_like_one_process(tiny_model, tmp_path):
    """LoRA adapters on a frozen base: two FSDP2 processes take the one process's step, only the
    adapters are optimized and gathered, and the export's merged model is the adapted one."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from agentrl.learner.trainer import token_logprobs

    single = _one_step(tiny_model, lora=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__)), tiny_model, str(tmp_path / "hf"), "lora"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    sharded = json.loads([x for x in out.stdout.splitlines() if x.startswith("{")][-1])
    assert sharded["world"] == 2 and single["rows"] > 2
    for key in ("loss", "grad_norm", "loss2"):
        assert abs(sharded[key] - single[key]) <= 1e-4 * abs(single[key]), (key, sharded, single)
    keys = single["adapter_keys"]
    assert keys == sharded["adapter_keys"] and keys and all(".lora_A." in k or ".lora_B." in k for k in keys)
    assert sharded["adapter_sum"] == pytest.approx(single["adapter_sum"], rel=1e-5)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert 0 < single["optimized"] < sum(p.numel() for p in base.parameters()) / 5  # the adapters alone

    # the export: a merged Hugging Face model, and beside it a peft adapter; both are the trained policy
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "hf" / "adapter")).eval()
    ids = torch.tensor([[1, 5, 9, 14, 3, 7, 22, 8, 2, 11, 40, 6]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = token_logprobs(adapted, ids, mask)
        got = token_logprobs(merged.eval(), ids, mask)
        untrained = token_logprobs(
            AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), ids, mask
        )
    assert (got - want).abs().max() < 1e-4
    assert (want - untrained).abs().max() > 1e-4  # the adapters moved the policy


if __name__ == "__main__":
    result = _one_step(
        sys.argv[1],
        sys.argv[2] if len(sys.argv) > 2 else "",
        routed=sys.argv[3:] == ["routed"],
        lora=sys.argv[3:] == ["lora"],
    )
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result), flush=True)
