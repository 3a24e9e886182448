"""One learner step on the tiny model: several clipped passes, MIS out of the denominator, a
non-finite step not applied, fp32 logits under bf16 FSDP, no dropout in the policy's logprobs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from agentrl.config import LearnConfig  # noqa: E402
from agentrl.learner.config import DecoupledPPOLoss, PGLoss, PPOLoss  # noqa: E402
from agentrl.learner.dist import Dist, load_model  # noqa: E402
from agentrl.learner.step import build_state, eval_mode, train_step  # noqa: E402
from tests.test_learner_packing import make_samples  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _state(model_path: str, cfg: LearnConfig):
    torch.manual_seed(0)
    return build_state(cfg, load_model(model_path, Dist()), Dist())


def _params(state) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in state.model.parameters()])


def _mixed(n: int, seed: int):
    """Samples whose groups each have a winner, so every advantage is non-zero."""
    # groups: i % 2
    return [replace(s, reward=float(i % 4 < 2)) for i, s in enumerate(make_samples(n, seed=seed))]


def test_ppo_clips_over_several_passes_with_pi_old_fixed_at_the_start(tiny_model: str) -> None:
    samples = _mixed(8, seed=5)
    one = train_step(_state(tiny_model, cfg := LearnConfig(lr=1e-2, micro_batch_tokens=256,
                                                           loss=PPOLoss(correction="none"))), samples, cfg, 1)
    # one pass: pi_theta = pi_old, nothing to clip
    assert one["updates"] == 1 and one["loss/clip_frac"] == 0.0
    cfg = LearnConfig(
        lr=1e-2, micro_batch_tokens=256, loss=PPOLoss(correction="none", minibatches=2, epochs=4)
    )
    state = _state(tiny_model, cfg)
    many = train_step(state, samples, cfg, 1)
    assert many["updated"] and many["updates"] == 8 and state.step == 1
    # a large learning rate moves the ratio past 1 +- 0.2 within the step's eight updates: the clip acts
    assert many["loss/clip_frac"] > 0.0, many
    assert many["loss/ratio_max"] > 1.2


def test_decoupled_ppo_with_the_approximate_proximal_policy_takes_no_extra_pass(tiny_model: str) -> None:
    samples = _mixed(8, seed=6)
    calls = {}
    for proximal in ("recompute", "approx"):
        cfg = LearnConfig(lr=1e-2, micro_batch_tokens=10_000,
                          loss=DecoupledPPOLoss(correction="none", epochs=3, proximal=proximal))
        state = _state(tiny_model, cfg)
        n = [0]
        state.model.register_forward_hook(lambda *_, n=n: n.__setitem__(0, n[0] + 1))
        stats = train_step(state, samples, cfg, 1)
        assert stats["updated"] and stats["updates"] == 3
        calls[proximal] = n[0]
    assert calls == {"recompute": 4, "approx": 3}  # one packed row: pi_old's pass, then one per update


def test_mis_masked_tokens_leave_the_denominator_of_the_step(tiny_model: str) -> None:
    from agentrl.learner.advantages import episode_advantages
    from agentrl.learner.packing import packed_logprobs, pad_batch

    cfg = LearnConfig(lr=1e-3, micro_batch_tokens=10_000, loss=PGLoss(correction="mis"))
    state = _state(tiny_model, cfg)
    samples = _mixed(4, seed=7)
    with torch.no_grad(), eval_mode(state.model):
        logp = packed_logprobs(state.model, samples)
    mask = pad_batch(samples, 0)["mask"] > 0
    # behaviour = the learner's own logprob (ratio 1, kept) on even positions, 5 nats above it
    # (ratio exp(-5) < mis_low, dropped) on odd ones
    drop = torch.zeros_like(mask)
    drop[:, 1::2] = True
    drop &= mask
    out = []
    for i, s in enumerate(samples):
        beh = torch.zeros(len(s.token_ids))
        n = len(s.token_ids) - 1
        beh[1:] = torch.where(drop[i, :n], logp[i, :n] + 5.0, logp[i, :n])
        out.append(replace(s, logprobs=(beh * torch.as_tensor(s.loss_mask)).tolist()))
    adv = episode_advantages(torch.tensor([s.reward for s in out]), [s.episode_id for s in out],
                             [s.group_id for s in out])
    kept = mask & ~drop
    per_token = -adv.unsqueeze(1) * logp
    expected = float(per_token[kept].sum() / kept.sum())
    stats = train_step(state, out, cfg, 0)
    assert stats["loss/tokens"] == int(kept.sum()) < int(mask.sum())
    assert stats["is/frac_masked"] > 0
    assert abs(stats["loss"] - expected) <= 1e-5 * max(1.0, abs(expected))
    assert abs(stats["loss"] - float(per_token[kept].sum() / mask.sum())) > 1e-4  # not over every token


def test_a_non_finite_loss_skips_the_update_and_names_the_sample(tiny_model: str) -> None:
    cfg = LearnConfig(lr=1e-2, micro_batch_tokens=64)
    state = _state(tiny_model, cfg)
    samples = _mixed(6, seed=8)
    bad = samples[3]
    lps = list(bad.logprobs)
    lps[-1] = float("nan")  # an engine logprob that is not a number
    samples[3] = replace(bad, logprobs=lps)
    before, lr_before = _params(state), state.scheduler.get_last_lr()[0]
    stats = train_step(state, samples, cfg, 2)
    assert not stats["updated"] and stats["skipped"] == "non_finite_loss"
    assert stats["offending_sample_ids"] == [bad.sample_id]
    assert torch.equal(_params(state), before)  # not one weight moved (AdamW never stepped)
    assert state.step == 0 and state.scheduler.get_last_lr()[0] == lr_before
    assert all(p.grad is None for p in state.model.parameters())
    again = train_step(state, [s for s in samples if s.sample_id != bad.sample_id], cfg, 2)
    assert again["updated"] and state.step == 1 and not torch.equal(_params(state), before)


def test_dropout_is_off_so_training_passes_give_the_sampling_policys_logprobs(
    tiny_model: str, tmp_path
) -> None:
    from agentrl.learner.packing import packed_logprobs

    model_dir = tmp_path / "dropout"
    shutil.copytree(tiny_model, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    model = load_model(str(model_dir), Dist())
    assert model.training  # activation checkpointing needs training mode
    samples = make_samples(3, seed=9)
    with torch.no_grad():
        a, b = packed_logprobs(model, samples), packed_logprobs(model, samples)
        with eval_mode(model):
            c = packed_logprobs(model, samples)
    assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.slow
def test_bf16_fsdp_computes_the_lm_head_and_logits_in_fp32(tiny_model: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__)), tiny_model]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    seen = json.loads([x for x in out.stdout.splitlines() if x.startswith("{")][-1])
    assert seen["layer_out"] == "torch.bfloat16"  # bf16 is on: the decoder layers compute in it
    assert seen["head_in"] == seen["head_out"] == seen["logits"] == "torch.float32"
    assert seen["max_logprob_error"] < 0.05  # bf16 layers, against the fp32 model
    assert seen["updated"]


def _bf16_driver(model_path: str) -> dict:
    from agentrl.learner.dist import init_dist
    from agentrl.learner.packing import packed_logprobs

    ctx = init_dist()
    cfg = LearnConfig(micro_batch_tokens=64, precision="bf16")
    model = load_model(model_path, ctx, precision="bf16")
    seen: dict = {}

    def layer_hook(module, inputs, output) -> None:  # a hook that returns nothing leaves the output alone
        seen.setdefault("layer_out", str((output[0] if isinstance(output, tuple) else output).dtype))

    def head_hook(module, inputs, output) -> None:
        seen.update(head_in=str(inputs[0].dtype), head_out=str(output.dtype))

    model.model.layers[0].register_forward_hook(layer_hook)
    model.lm_head.register_forward_hook(head_hook)
    samples = make_samples(4, seed=10)
    with torch.no_grad(), eval_mode(model):
        lp = packed_logprobs(model, samples, ctx.device)
        seen["logits"] = str(model(input_ids=torch.tensor([[3, 4, 5]])).logits.dtype)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = packed_logprobs(reference, samples)
    seen["max_logprob_error"] = float((lp - ref).abs().max())
    seen["updated"] = train_step(build_state(cfg, model, ctx), samples, cfg, 0)["updated"]
    ctx.close()
    return seen


if __name__ == "__main__":
    result = _bf16_driver(sys.argv[1])
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result), flush=True)
