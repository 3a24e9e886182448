"""Every loss option is a setting: each kind's settings parse under their full names, reach
``compute_loss`` (or the step) as they are, and bad values are refused with what to change."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agentrl import config as C
from agentrl.learner.config import CISPOLoss, DecoupledPPOLoss, GSPOLoss, PGLoss, PPOLoss
from agentrl.learner.losses import compute_loss

VARIANTS = (PGLoss, PPOLoss, DecoupledPPOLoss, GSPOLoss, CISPOLoss)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.__name__)
def test_every_kind_hands_compute_loss_exactly_its_parameters(variant: type) -> None:
    loss = variant()
    args = loss.arguments()
    step_only = {f.name for f in dataclasses.fields(loss) if f.metadata.get("step")}
    assert {"advantage_std", "overlong", "overlong_penalty"} <= step_only and not step_only & set(args)
    x = torch.tensor([[-1.0, -2.0]])
    value, stats = compute_loss(**args, logp=x, logp_behaviour=x, advantages=torch.tensor([1.0]),
                                mask=torch.tensor([[1, 1]]))
    assert torch.isfinite(value) and stats["loss/tokens"].item() == 2


def test_the_new_settings_resolve_under_their_full_names() -> None:
    for name in ("loss.minibatches", "loss.epochs", "loss.proximal", "loss.advantage_std", "loss.norm_tokens",
                 "loss.overlong", "loss.overlong_penalty"):
        assert C.resolve(C.LearnConfig, name), name
    assert C.resolve(C.RunConfig, "learn.loss.epochs") and C.resolve(
        C.ServeConfig, "buffer.drop_uniform_groups"
    )
    cfg = C.load(C.LearnConfig, None, ["--loss.kind=gspo", "--loss.epochs=2", "--loss.minibatches=4"])
    assert isinstance(cfg.loss, GSPOLoss) and (cfg.loss.epochs, cfg.loss.minibatches) == (2, 4)
    assert (
        cfg.loss.clip_low == 3e-4 and cfg.loss.agg == "seq-mean-token-mean" and cfg.loss.level == "geometric"
    )
    cfg = C.load(C.LearnConfig, None, ["--loss.kind=decoupled_ppo", "--loss.proximal=approx",
                                       "--loss.agg=seq-mean-token-sum-norm", "--loss.norm_tokens=512",
                                       "--loss.advantage_std=false", "--loss.overlong=mask"])
    assert (cfg.loss.proximal, cfg.loss.norm_tokens, cfg.loss.advantage_std, cfg.loss.overlong) == (
        "approx", 512, False, "mask")
    serve = C.load(C.ServeConfig, None, ["--buffer.drop_uniform_groups=true"])
    assert serve.buffer.drop_uniform_groups is True


def test_bad_loss_settings_are_refused_with_their_names() -> None:
    with pytest.raises(C.ConfigError, match=r"loss\.epochs"):
        C.load(C.LearnConfig, None, ["--loss.kind=pg", "--loss.epochs=2"])  # pg takes one pass
    with pytest.raises(C.ConfigError, match=r"loss\.minibatches and loss\.epochs"):
        C.load(C.LearnConfig, None, ["--loss.kind=ppo", "--loss.epochs=0"])
    with pytest.raises(C.ConfigError, match=r"loss\.clip_low"):
        C.load(C.LearnConfig, None, ["--loss.kind=cispo", "--loss.clip_low=1.5"])
    with pytest.raises(C.ConfigError, match=r"loss\.overlong"):
        C.load(C.LearnConfig, None, ["--loss.overlong=drop"])
