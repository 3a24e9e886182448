"""GSPO, CISPO, Dr. GRPO's normalisation, the loss's counts and per-episode advantages, against
values computed by hand on tiny tensors (float64, every expected value written as arithmetic)."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.learner.losses import (
    aggregate,
    cispo_loss,
    compute_loss,
    episode_advantages,
    group_advantages,
    gspo_loss,
    loss_units,
    ppo_clip_loss,
)
from tests.hand_computed import close, e, t

# --- GSPO ------------------------------------------------------------------------------------

# sequence 0: two tokens whose log-ratios are +0.2 and -0.1 (mean 0.05); sequence 1: one token, ratio 1
LOGP = [[-1.0, -2.0], [-0.5, 9.0]]  # 9.0: a masked-out garbage value
OLD = [[-1.2, -1.9], [-0.5, -1.0]]
MASK2 = [[1, 1], [1, 0]]


def test_gspo_clips_the_geometric_mean_ratio_of_a_whole_sequence() -> None:
    logp = t(LOGP, grad=True)
    loss, stats = gspo_loss(logp, t(OLD), t([1.0, -1.0]), t(MASK2))  # GSPO's range: 1 - 3e-4 .. 1 + 4e-4
    s0 = e(0.05)  # exp(mean(0.2, -0.1)), above 1 + 4e-4 with A > 0: clipped, for both of its tokens
    # seq-mean-token-mean: sequence 0 is worth -(1 + 4e-4), sequence 1 -(1 * -1) = 1
    close(loss, (-(1 + 4e-4) + 1.0) / 2)
    loss.backward()
    close(logp.grad, [[0.0, 0.0], [0.5, 0.0]])  # the clipped sequence gets no gradient at all
    close(stats["clip_frac"], 2 / 3)  # 2 of the 3 counted tokens
    close(stats["ratio_mean"], (s0 + 1.0) / 2)  # per sequence
    close(stats["ratio_max"], s0)


def test_gspo_gradient_is_the_sequence_ratio_times_the_mean_token_gradient() -> None:
    logp = t(LOGP, grad=True)
    loss, _ = gspo_loss(logp, t(OLD), t([1.0, -1.0]), t(MASK2), clip_low=0.2, clip_high=0.2)
    s0 = e(0.05)
    close(loss, (-s0 + 1.0) / 2)
    loss.backward()
    # d/dlogp_t of (1/G) * -(s_i A_i) with s_i = exp(mean_t log-ratio): -(1/2) * s0 * A * (1/2) per token
    close(logp.grad, [[-s0 / 4, -s0 / 4], [0.5, 0.0]])


def test_gspo_with_a_length_one_sequence_is_ppo_on_that_token() -> None:
    logp, old, adv, mask = t([[-0.9]]), t([[-1.0]]), t([1.0]), t([[1]])
    g, _ = gspo_loss(logp, old, adv, mask, clip_low=0.05, clip_high=0.05)
    p, _ = ppo_clip_loss(logp, old, adv, mask, clip_low=0.05, clip_high=0.05)
    close(g, p)
    close(g, -1.05)  # exp(0.1) > 1.05: clipped


# --- CISPO -----------------------------------------------------------------------------------


def test_cispo_weights_reinforce_by_the_clipped_ratio_and_keeps_every_gradient() -> None:
    logp = t([[-1.0, -2.0]], grad=True)
    old = t([[-1.5, -1.9]])  # ratios exp(0.5) = 1.65 and exp(-0.1) = 0.90
    loss, stats = cispo_loss(logp, old, t([2.0]), t([[1, 1]]), clip_low=1.0, clip_high=0.2)
    w = [1.2, e(-0.1)]  # the first ratio is capped at 1 + 0.2; no floor (clip_low = 1)
    close(loss, (-(w[0] * 2.0 * -1.0) - (w[1] * 2.0 * -2.0)) / 2)
    loss.backward()
    # the clipped token still trains (PPO would drop it)
    close(logp.grad, [[-w[0] * 2.0 / 2, -w[1] * 2.0 / 2]])
    close(stats["clip_frac"], 1 / 2)
    close(stats["clip_frac_high"], 1 / 2)
    close(stats["ratio_max"], e(0.5))


def test_cispo_floor_applies_when_set() -> None:
    logp, old = t([[-2.0]], grad=True), t([[-1.0]])  # ratio exp(-1) = 0.37
    loss, stats = cispo_loss(logp, old, t([1.0]), t([[1]]), clip_low=0.2, clip_high=0.2)
    close(loss, -(0.8 * 1.0 * -2.0))
    close(stats["clip_frac_low"], 1.0)


def test_cispo_and_gspo_ignore_masked_garbage() -> None:
    logp = t([[-1.0, float("inf")]], grad=True)
    old = t([[-1.0, float("nan")]])
    for fn in (cispo_loss, gspo_loss):
        loss, _ = fn(logp, old, t([1.0]), t([[1, 0]]))
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert grad[0, 1].item() == 0.0


@pytest.mark.parametrize("kind", ["gspo", "cispo"])
def test_compute_loss_dispatches_the_new_kinds(kind: str) -> None:
    logp, beh = t([[-1.0, -2.0]]), t([[-1.0, -2.0]])
    loss, stats = compute_loss(
        kind,
        "tis",
        logp=logp,
        logp_behaviour=beh,
        advantages=t([1.0]),  # type: ignore[arg-type]
        mask=t([[1, 1]]),
        agg="token-mean",
    )
    # one pass: every ratio is 1; GSPO's value is -s A (PPO-like), CISPO's -w A logp (REINFORCE-like)
    close(loss, -1.0 if kind == "gspo" else (1.0 + 2.0) / 2)
    assert "loss/clip_frac" in stats and stats["loss/tokens"].item() == 2


# --- Dr. GRPO's normalisation and the counts the step divides by -----------------------------

VALUES = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
MASK = [[1, 1, 0], [1, 0, 0]]


def test_seq_mean_token_sum_norm_divides_by_sequences_times_a_constant_length() -> None:
    close(aggregate(t(VALUES), t(MASK), "seq-mean-token-sum-norm", norm_tokens=4), (1 + 2 + 4) / (2 * 4))
    close(aggregate(t(VALUES), t(MASK), "seq-mean-token-sum-norm"), (1 + 2 + 4) / (2 * 3))  # 0: the width


def test_loss_units_count_what_each_aggregation_divides_by() -> None:
    assert loss_units(t(MASK), "token-mean").item() == 3
    assert loss_units(t(MASK), "seq-mean-token-sum").item() == 2
    assert loss_units(t(MASK), "seq-mean-token-mean").item() == 2
    assert loss_units(t(MASK), "seq-mean-token-sum-norm", norm_tokens=10).item() == 20
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        loss_units(t(MASK), "sum")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_the_sum_form_divided_by_the_units_is_the_aggregate(agg: str) -> None:
    summed = aggregate(t(VALUES), t(MASK), agg, denominator=1.0, norm_tokens=5)  # type: ignore[arg-type]
    close(summed / loss_units(t(MASK), agg, 5), aggregate(t(VALUES), t(MASK), agg, norm_tokens=5))  # type: ignore[arg-type]


def test_mis_masked_tokens_leave_the_counts_of_compute_loss() -> None:
    logp, beh = t([[0.0, 0.0, 0.0]]), t([[0.0, -3.0, 0.1]])  # token 1: pi_old / mu = exp(3), out of [0.5, 2]
    _, stats = compute_loss(
        "pg", "mis", logp=logp, logp_behaviour=beh, advantages=t([1.0]), mask=t([[1, 1, 1]])
    )
    assert stats["loss/tokens"].item() == 2 and stats["loss/sequences"].item() == 1
    _, stats = compute_loss(
        "pg", "mis", logp=logp, logp_behaviour=beh, advantages=t([1.0]), mask=t([[1, 1, 1]]), level="sequence"
    )
    assert stats["loss/tokens"].item() == 0 and stats["loss/sequences"].item() == 0  # the whole sequence left


# --- advantages per episode ------------------------------------------------------------------


def test_an_episode_split_into_two_samples_counts_once_in_its_group() -> None:
    # group g: episode A (reward 1) became two samples (a template that is not prefix-stable); B, C got 0
    rewards = t([1.0, 1.0, 0.0, 0.0])
    adv = episode_advantages(rewards, ["A", "A", "B", "C"], ["g"] * 4, eps=0.0)
    # per episode: rewards 1, 0, 0; mean 1/3; sample std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    a, b = (2 / 3) / math.sqrt(1 / 3), -(1 / 3) / math.sqrt(1 / 3)
    close(adv, [a, a, b, b])
    # per sample it would have been rewards 1, 1, 0, 0: mean 1/2, advantages +-0.866
    close(group_advantages(rewards, ["g"] * 4, eps=0.0), [math.sqrt(3) / 2] * 2 + [-math.sqrt(3) / 2] * 2)


def test_samples_of_an_episode_with_several_choices_share_its_advantage() -> None:
    # group h: episode D (reward 1); episode E (reward 0) asked for n = 3 choices: three samples
    adv = episode_advantages(t([1.0, 0.0, 0.0, 0.0]), ["D", "E", "E", "E"], ["h"] * 4, eps=0.0)
    # +-0.5 / sqrt(0.5)
    close(adv, [1 / math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)])
    # without the std (Dr. GRPO): reward minus the mean over episodes, 1/2
    close(episode_advantages(t([1.0, 0.0, 0.0, 0.0]), ["D", "E", "E", "E"], ["h"] * 4, normalize_std=False),
          [0.5, -0.5, -0.5, -0.5])


def test_groups_stay_apart_and_a_group_of_one_episode_gets_zero() -> None:
    adv = episode_advantages(t([1.0, 0.0, 5.0, 5.0]), ["A", "B", "C", "C"], ["g", "g", "k", "k"], eps=0.0)
    close(adv, [1 / math.sqrt(2), -1 / math.sqrt(2), 0.0, 0.0])
    with pytest.raises(ValueError, match="one entry per reward"):
        episode_advantages(t([1.0]), ["A", "B"], ["g", "g"])
