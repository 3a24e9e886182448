"""The learner's math against values computed by hand on tiny tensors.

Every expected value is written out as arithmetic (exp(0.5) for a ratio whose log is 0.5), so a
reader can check it without running anything. Tensors are float64 so the comparisons can be tight.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.learner.advantages import group_advantages
from agentrl.learner.losses import (
    aggregate,
    approx_proximal_logp,
    compute_loss,
    decoupled_ppo_loss,
    masked_is,
    masked_mean,
    mismatch_kl,
    mismatch_spread,
    mismatch_token_mask,
    policy_gradient_loss,
    ppo_clip_loss,
    truncated_is,
)
from tests.hand_computed import close, e, t

# --- group advantages ------------------------------------------------------------------------


def test_group_advantages_subtract_the_group_mean_and_divide_by_the_sample_std() -> None:
    rewards = t([1.0, 0.0, 0.0, 1.0, 2.0])
    adv = group_advantages(rewards, ["a", "a", "b", "b", "b"], eps=0.0)
    # group a: mean 0.5, sample std sqrt((0.25 + 0.25) / 1); group b: mean 1, std sqrt((1 + 0 + 1) / 2)
    std_a = math.sqrt(0.5)
    close(adv, [0.5 / std_a, -0.5 / std_a, -1.0, 0.0, 1.0])


def test_group_advantages_without_std_are_reward_minus_group_mean() -> None:
    adv = group_advantages(t([3.0, 1.0, 5.0, 10.0]), ["x", "x", "x", "y"], normalize_std=False)
    close(adv, [0.0, -2.0, 2.0, 0.0])


def test_all_equal_rewards_in_a_group_give_zero_advantage_not_nan() -> None:
    # 0.1 * 3 / 3 is not exactly 0.1 in floating point; the result must still be exactly 0
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0], dtype=torch.float32)
    adv = group_advantages(rewards, [7, 7, 7, 8, 8])
    assert adv.dtype == torch.float32
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert not torch.isnan(adv).any()
    close(adv[3:], [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)], tol=1e-6)


def test_a_singleton_group_gets_zero_advantage() -> None:
    adv = group_advantages(t([5.0, 1.0, 2.0]), ["alone", "pair", "pair"])
    assert adv[0].item() == 0.0
    assert not torch.isnan(adv).any()


def test_group_ids_may_be_an_interleaved_tensor() -> None:
    adv = group_advantages(t([1.0, 10.0, 3.0, 30.0]), torch.tensor([0, 1, 0, 1]), normalize_std=False)
    close(adv, [-1.0, -10.0, 1.0, 10.0])


def test_group_ids_of_the_wrong_length_are_refused() -> None:
    with pytest.raises(ValueError, match="group_ids has 2 entries but rewards has 3"):
        group_advantages(t([1.0, 2.0, 3.0]), ["a", "b"])


def test_group_advantages_carry_no_gradient() -> None:
    rewards = t([1.0, 0.0], grad=True)
    assert not group_advantages(rewards, ["g", "g"]).requires_grad


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(-5, 5)), min_size=1, max_size=20))
def test_group_advantages_are_finite_and_sum_to_zero_within_each_group(
    pairs: list[tuple[int, float]],
) -> None:
    groups = [g for g, _ in pairs]
    adv = group_advantages(t([r for _, r in pairs]), groups)
    assert torch.isfinite(adv).all()
    for g in set(groups):
        assert abs(sum(a for a, h in zip(adv.tolist(), groups, strict=True) if h == g)) < 1e-6


# --- aggregation -----------------------------------------------------------------------------

VALUES = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
MASK = [[1, 1, 0], [1, 0, 0]]


def test_token_mean_weighs_every_counted_token_equally() -> None:
    close(aggregate(t(VALUES), t(MASK), "token-mean"), (1 + 2 + 4) / 3)


def test_seq_mean_token_sum_averages_per_sequence_sums() -> None:
    close(aggregate(t(VALUES), t(MASK), "seq-mean-token-sum"), ((1 + 2) + 4) / 2)


def test_seq_mean_token_mean_averages_per_sequence_means() -> None:
    close(aggregate(t(VALUES), t(MASK), "seq-mean-token-mean"), ((1 + 2) / 2 + 4) / 2)


def test_a_given_denominator_replaces_the_local_count() -> None:
    close(aggregate(t(VALUES), t(MASK), "token-mean", denominator=6), (1 + 2 + 4) / 6)
    close(aggregate(t(VALUES), t(MASK), "seq-mean-token-sum", denominator=4), (1 + 2 + 4) / 4)


def test_unknown_aggregation_is_refused_with_the_known_names() -> None:
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(t(VALUES), t(MASK), "sum")  # type: ignore[arg-type]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_a_zero_length_completion_contributes_zero_and_no_nan(agg: str) -> None:
    # row 1 generated nothing; its (garbage) values must not leak into the loss or the gradient
    values = t([[1.0, 2.0], [float("nan"), float("inf")]], grad=True)
    mask = t([[1, 1], [0, 0]])
    out = aggregate(values, mask, agg)  # type: ignore[arg-type]
    expected = {"token-mean": 1.5, "seq-mean-token-sum": 3.0, "seq-mean-token-mean": 1.5}[agg]
    close(out, expected)
    out.backward()
    assert torch.isfinite(values.grad).all()
    assert values.grad[1].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_a_batch_with_no_counted_token_gives_zero_loss_and_zero_gradient(agg: str) -> None:
    logp = t([[-1.0, -2.0]], grad=True)
    loss, _ = ppo_clip_loss(logp, t([[-1.0, -2.0]]), t([1.0]), t([[0, 0]]), agg=agg)  # type: ignore[arg-type]
    loss.backward()
    assert loss.item() == 0.0
    assert logp.grad.tolist() == [[0.0, 0.0]]


def test_masked_mean_of_nothing_is_zero() -> None:
    assert masked_mean(t([1.0, 2.0]), t([0, 0])).item() == 0.0


# --- truncated importance sampling ------------------------------------------------------------


def test_token_level_tis_caps_each_token_ratio() -> None:
    logp_old = t([[0.0, 0.0, -1.0]])
    logp_beh = t([[-0.5, 0.5, -3.0]])
    w, stats = truncated_is(logp_old, logp_beh, t([[1, 1, 1]]), cap=2.0, level="token")
    # ratios exp(0.5), exp(-0.5), exp(2) = 7.39 -> capped at 2
    close(w, [[e(0.5), e(-0.5), 2.0]])
    close(stats["mean"], (e(0.5) + e(-0.5) + 2.0) / 3)
    close(stats["max"], e(2.0))
    close(stats["frac_clipped"], 1 / 3)


LOGP_OLD = [[0.0, -0.2, 50.0], [0.5, 0.5, 0.0]]
LOGP_BEH = [[-0.5, 0.0, -50.0], [0.0, 0.0, 0.0]]
SEQ_MASK = [[1, 1, 0], [1, 1, 0]]  # the third token is padding with a garbage log-ratio of 100


def test_sequence_level_tis_uses_the_product_of_token_ratios_per_sequence() -> None:
    w, stats = truncated_is(t(LOGP_OLD), t(LOGP_BEH), t(SEQ_MASK), cap=2.0, level="sequence")
    # row 0: exp(0.5 - 0.2) = exp(0.3) = 1.35 < 2; row 1: exp(0.5 + 0.5) = e = 2.72 -> 2
    close(w, [[e(0.3), e(0.3), 0.0], [2.0, 2.0, 0.0]])
    close(stats["mean"], (e(0.3) + 2.0) / 2)
    close(stats["max"], e(1.0))
    close(stats["frac_clipped"], 1 / 2)


def test_token_level_tis_on_the_same_batch_clips_nothing() -> None:
    w, stats = truncated_is(t(LOGP_OLD), t(LOGP_BEH), t(SEQ_MASK), cap=2.0, level="token")
    close(w, [[e(0.5), e(-0.2), 0.0], [e(0.5), e(0.5), 0.0]])
    close(stats["frac_clipped"], 0.0)


def test_geometric_level_tis_uses_the_mean_token_log_ratio() -> None:
    w, _ = truncated_is(t(LOGP_OLD), t(LOGP_BEH), t(SEQ_MASK), cap=2.0, level="geometric")
    close(w, [[e(0.15), e(0.15), 0.0], [e(0.5), e(0.5), 0.0]])


def test_sequence_level_tis_does_not_overflow_on_long_sequences() -> None:
    w, stats = truncated_is(t([[400.0, 400.0]]), t([[0.0, 0.0]]), t([[1, 1]]), cap=3.0, level="sequence")
    close(w, [[3.0, 3.0]])
    assert stats["frac_clipped"].item() == 1.0


def test_tis_with_an_empty_row_gives_zero_weights_there() -> None:
    w, stats = truncated_is(t([[0.5], [0.0]]), t([[0.0], [0.0]]), t([[1], [0]]), cap=2.0, level="sequence")
    close(w, [[e(0.5)], [0.0]])
    close(stats["mean"], e(0.5))


def test_a_non_positive_cap_or_an_unknown_level_is_refused() -> None:
    with pytest.raises(ValueError, match="cap must be positive"):
        truncated_is(t([[0.0]]), t([[0.0]]), t([[1]]), cap=0.0)
    with pytest.raises(ValueError, match="token, sequence or geometric"):
        truncated_is(t([[0.0]]), t([[0.0]]), t([[1]]), cap=2.0, level="seq")  # type: ignore[arg-type]


# --- masked importance sampling and mismatch masking ------------------------------------------


def test_token_level_mis_drops_tokens_outside_the_band() -> None:
    # ratios exp(0.5) = 1.65, exp(-1) = 0.37, exp(0) = 1 against the band [0.5, 2]
    keep, stats = masked_is(t([[0.5, -1.0, 0.0]]), t([[0.0, 0.0, 0.0]]), t([[1, 1, 1]]), 0.5, 2.0)
    close(keep, [[1.0, 0.0, 1.0]])
    close(stats["frac_masked"], 1 / 3)
    close(stats["mean"], (e(0.5) + e(-1.0) + 1.0) / 3)


def test_sequence_level_mis_drops_whole_sequences() -> None:
    # row 0: exp(0.5 + 0.5) = 2.72 > 2 -> dropped; row 1: exp(0.5 - 0.5) = 1 -> kept
    logp_old = t([[0.5, 0.5], [0.5, -0.5]])
    keep, stats = masked_is(logp_old, t([[0.0, 0.0], [0.0, 0.0]]), t([[1, 1], [1, 1]]), 0.5, 2.0, "sequence")
    close(keep, [[0.0, 0.0], [1.0, 1.0]])
    close(stats["frac_masked"], 1 / 2)


def test_mis_keeps_ratios_exactly_on_the_band_edges() -> None:
    keep, _ = masked_is(t([[0.0]]), t([[0.0]]), t([[1]]), low=1.0, high=1.0)
    close(keep, [[1.0]])


def test_mis_returns_a_mask_of_the_input_mask_dtype_and_never_revives_masked_tokens() -> None:
    keep, _ = masked_is(t([[0.0, 0.0]]), t([[0.0, 0.0]]), torch.tensor([[True, False]]), 0.5, 2.0)
    assert keep.tolist() == [[True, False]]


def test_mismatch_masking_drops_only_single_tokens_outside_the_band() -> None:
    logp_train = t([[0.0, 0.3, -0.3, 2.0]])
    logp_beh = t([[0.0, 0.0, 0.0, 0.0]])
    keep, stats = mismatch_token_mask(logp_train, logp_beh, t([[1, 1, 1, 1]]), e(-0.5), e(0.5))
    close(keep, [[1.0, 1.0, 1.0, 0.0]])
    close(stats["frac_masked"], 1 / 4)
    close(stats["max"], e(2.0))


def test_an_inverted_band_is_refused() -> None:
    with pytest.raises(ValueError, match="low <= high"):
        mismatch_token_mask(t([[0.0]]), t([[0.0]]), t([[1]]), 2.0, 0.5)


def test_mismatch_kl_estimators_on_sampled_tokens() -> None:
    # log(pi / mu) = +0.5 and -0.5; the masked third token would add a huge term
    kl = mismatch_kl(t([[0.5, -0.5, 9.0]]), t([[0.0, 0.0, 0.0]]), t([[1, 1, 0]]))
    close(kl["k1"], (-0.5 + 0.5) / 2)
    close(kl["k3"], ((e(0.5) - 1 - 0.5) + (e(-0.5) - 1 + 0.5)) / 2)


def test_mismatch_spread_is_the_mean_abs_log_ratio_and_the_weights_std_on_sampled_tokens() -> None:
    # log(pi / mu) = +0.5 and -0.5; the masked third token would add a huge term
    got = mismatch_spread(t([[0.5, -0.5, 9.0]]), t([[0.0, 0.0, 0.0]]), t([[1, 1, 0]]))
    close(got["abs_log_ratio"], 0.5)
    close(got["ratio_std"], (e(0.5) - e(-0.5)) / 2)
    same = mismatch_spread(t([[-1.0, -2.0]]), t([[-1.0, -2.0]]), t([[1, 1]]))
    assert same["abs_log_ratio"].item() == 0.0 and same["ratio_std"].item() == 0.0


def test_mismatch_kl_is_zero_when_learner_and_engine_agree() -> None:
    kl = mismatch_kl(t([[-1.0, -2.0]]), t([[-1.0, -2.0]]), t([[1, 1]]))
    assert kl["k1"].item() == 0.0 and kl["k3"].item() == 0.0


# --- PPO clipped objective ---------------------------------------------------------------------


def test_an_unclipped_token_gives_minus_ratio_times_advantage() -> None:
    loss, stats = ppo_clip_loss(t([[0.1]]), t([[0.0]]), t([1.0]), t([[1]]))
    close(loss, -e(0.1))
    close(stats["clip_frac"], 0.0)


def test_ppo_clips_only_where_the_clipped_term_is_pessimistic_and_gives_it_no_gradient() -> None:
    logp = t([[0.5, -0.5, -0.5, 0.5]], grad=True)
    adv = t([[1.0, -1.0, 1.0, -1.0]])
    loss, stats = ppo_clip_loss(logp, t([[0.0] * 4]), adv, t([[1, 1, 1, 1]]))
    # token 0: A>0, r=exp(0.5)=1.65 -> clipped to 1.2       -> -1.2, no gradient
    # token 1: A<0, r=exp(-0.5)=0.61 -> clipped to 0.8      -> +0.8, no gradient
    # token 2: A>0, r=0.61 -> min(0.61, 0.8) is unclipped   -> -exp(-0.5)
    # token 3: A<0, r=1.65 -> min(-1.65, -1.2) is unclipped -> +exp(0.5)
    close(loss, (-1.2 + 0.8 - e(-0.5) + e(0.5)) / 4)
    loss.backward()
    close(logp.grad, [[0.0, 0.0, -e(-0.5) / 4, e(0.5) / 4]])
    close(stats["clip_frac"], 2 / 4)
    close(stats["clip_frac_high"], 1 / 4)
    close(stats["clip_frac_low"], 1 / 4)


def test_a_ratio_exactly_on_the_upper_clip_edge_is_not_clipped_and_keeps_its_gradient() -> None:
    edge = torch.exp(t(0.1)).item()  # the ratio below, to the last bit
    logp = t([[0.1]], grad=True)
    loss, stats = ppo_clip_loss(logp, t([[0.0]]), t([2.0]), t([[1]]), clip_high=edge - 1)
    close(loss, -2.0 * e(0.1))
    assert stats["clip_frac"].item() == 0.0
    loss.backward()
    close(logp.grad, [[-2.0 * e(0.1)]])


def test_a_ratio_exactly_on_the_lower_clip_edge_is_not_clipped_and_keeps_its_gradient() -> None:
    edge = torch.exp(t(-0.1)).item()
    logp = t([[-0.1]], grad=True)
    loss, stats = ppo_clip_loss(logp, t([[0.0]]), t([-1.0]), t([[1]]), clip_low=1 - edge)
    close(loss, e(-0.1))
    assert stats["clip_frac"].item() == 0.0
    loss.backward()
    close(logp.grad, [[e(-0.1)]])


def test_just_beyond_the_clip_edges_the_gradient_is_zero() -> None:
    high = torch.exp(t(0.1)).item()
    low = torch.exp(t(-0.1)).item()
    logp = t([[0.1 + 1e-6, -0.1 - 1e-6]], grad=True)
    loss, stats = ppo_clip_loss(logp, t([[0.0, 0.0]]), t([[2.0, -1.0]]), t([[1, 1]]), 1 - low, high - 1)
    close(loss, (-2.0 * high + 1.0 * low) / 2)
    loss.backward()
    assert logp.grad.tolist() == [[0.0, 0.0]]
    assert stats["clip_frac"].item() == 1.0


def test_clip_higher_widens_only_the_upper_edge() -> None:
    # r = exp(0.2) = 1.221 is clipped by the symmetric 0.2 but not by clip_high = 0.28;
    # r = exp(0.25) = 1.284 is clipped at 1.28
    logp, prox, adv, mask = t([[0.2, 0.25]]), t([[0.0, 0.0]]), t([1.0]), t([[1, 1]])
    symmetric, _ = ppo_clip_loss(logp, prox, adv, mask, 0.2, 0.2)
    higher, stats = ppo_clip_loss(logp, prox, adv, mask, 0.2, 0.28)
    close(symmetric, (-1.2 - 1.2) / 2)
    close(higher, (-e(0.2) - 1.28) / 2)
    close(stats["clip_frac_high"], 1 / 2)


def test_masked_tokens_are_ignored_by_ppo_even_with_garbage_logprobs() -> None:
    logp = t([[0.1, float("-inf")]], grad=True)
    loss, stats = ppo_clip_loss(logp, t([[0.0, float("nan")]]), t([1.0]), t([[1, 0]]))
    close(loss, -e(0.1))
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    close(stats["ratio_max"], e(0.1))


def test_ppo_gradient_of_an_unclipped_token_is_minus_advantage_times_weight_times_ratio() -> None:
    # token-mean over 2 counted tokens: d loss / d logp_i = -A_i * w_i * r_i / 2
    logp = t([[0.1, -0.05, 3.0]], grad=True)
    adv = t([[1.5, -2.0, 1.0]])
    w = t([[0.5, 2.0, 1.0]], grad=True)
    loss, _ = ppo_clip_loss(logp, t([[0.0, 0.0, 0.0]]), adv, t([[1, 1, 0]]), is_weights=w)
    close(loss, (-1.5 * 0.5 * e(0.1) + 2.0 * 2.0 * e(-0.05)) / 2)
    loss.backward()
    close(logp.grad, [[-1.5 * 0.5 * e(0.1) / 2, 2.0 * 2.0 * e(-0.05) / 2, 0.0]])
    assert w.grad is None  # importance weights are constants


def test_ppo_sequence_aggregations() -> None:
    # per-token losses: row 0 -exp(0.1), -1; row 1 -2 * exp(-0.1)
    logp, prox = t([[0.1, 0.0], [-0.1, 0.0]]), t([[0.0, 0.0], [0.0, 0.0]])
    adv, mask = t([1.0, 2.0]), t([[1, 1], [1, 0]])
    token_sum, _ = ppo_clip_loss(logp, prox, adv, mask, agg="seq-mean-token-sum")
    token_mean, _ = ppo_clip_loss(logp, prox, adv, mask, agg="seq-mean-token-mean")
    close(token_sum, ((-e(0.1) - 1.0) + (-2.0 * e(-0.1))) / 2)
    close(token_mean, ((-e(0.1) - 1.0) / 2 + (-2.0 * e(-0.1))) / 2)


# --- plain policy gradient -------------------------------------------------------------------


def test_policy_gradient_loss_is_minus_weight_times_advantage_times_logprob() -> None:
    logp = t([[-1.0, -2.0], [-0.5, -7.0]], grad=True)
    adv = t([1.0, -1.0])
    w = t([[1.0, 0.5], [2.0, 9.0]])
    loss, stats = policy_gradient_loss(logp, adv, t([[1, 1], [1, 0]]), is_weights=w)
    # -(1 * 1 * -1) = 1, -(0.5 * 1 * -2) = 1, -(2 * -1 * -0.5) = -1; the fourth is masked
    close(loss, (1 + 1 - 1) / 3)
    loss.backward()
    close(logp.grad, [[-1.0 / 3, -0.5 / 3], [2.0 / 3, 0.0]])
    close(stats["tokens"], 3.0)


def test_policy_gradient_loss_with_a_zero_length_completion() -> None:
    logp = t([[-1.0, -2.0], [0.0, 0.0]], grad=True)
    loss, _ = policy_gradient_loss(logp, t([1.0, 5.0]), t([[1, 1], [0, 0]]), agg="seq-mean-token-sum")
    close(loss, (1.0 + 2.0) / 1)
    loss.backward()
    close(logp.grad, [[-1.0, -1.0], [0.0, 0.0]])


# --- decoupled PPO and the proximal approximation --------------------------------------------

# token 0: log(pi_theta / pi_prox) = 0.1, log(pi_prox / mu) = 0.5; token 1: 0 and 0.2; A = 1
DEC = {"logp": [[0.1, 0.0]], "prox": [[0.0, 0.0]], "beh": [[-0.5, -0.2]]}


def test_decoupled_ppo_weights_the_clipped_objective_by_prox_over_behaviour() -> None:
    logp = t(DEC["logp"], grad=True)
    loss, stats = decoupled_ppo_loss(logp, t(DEC["prox"]), t(DEC["beh"]), t([1.0]), t([[1, 1]]))
    close(loss, (-e(0.5) * e(0.1) - e(0.2) * 1.0) / 2)
    loss.backward()
    close(logp.grad, [[-e(0.5) * e(0.1) / 2, -e(0.2) * 1.0 / 2]])
    close(stats["is_mean"], (e(0.5) + e(0.2)) / 2)
    close(stats["is_frac_capped"], 0.0)


def test_decoupled_ppo_truncates_the_behaviour_weight_at_the_cap() -> None:
    loss, stats = decoupled_ppo_loss(
        t(DEC["logp"]), t(DEC["prox"]), t(DEC["beh"]), t([1.0]), t([[1, 1]]), is_cap=1.5
    )
    close(loss, (-1.5 * e(0.1) - e(0.2)) / 2)
    close(stats["is_frac_capped"], 1 / 2)
    close(stats["is_max"], e(0.5))


def test_decoupled_ppo_in_mask_mode_zeroes_tokens_above_the_cap_but_still_counts_them() -> None:
    loss, _ = decoupled_ppo_loss(
        t(DEC["logp"]), t(DEC["prox"]), t(DEC["beh"]), t([1.0]), t([[1, 1]]), is_cap=1.5, is_cap_mode="mask"
    )
    close(loss, (0.0 - e(0.2)) / 2)


def test_decoupled_ppo_is_ppo_when_the_proximal_policy_is_the_behaviour_policy() -> None:
    logp, prox, adv, mask = t([[0.3, -0.4]]), t([[-0.1, 0.1]]), t([[1.0, -2.0]]), t([[1, 1]])
    decoupled, _ = decoupled_ppo_loss(logp, prox, prox, adv, mask)
    ppo, _ = ppo_clip_loss(logp, prox, adv, mask)
    close(decoupled, ppo.item())


def test_proximal_approximation_uses_the_current_logprob_for_tokens_of_the_current_version() -> None:
    out = approx_proximal_logp(
        t([[-2.0]]), t([[-1.0]]), torch.tensor([[6]]), current_version=6, proximal_version=5
    )
    close(out, [[-1.0]])


def test_proximal_approximation_uses_the_behaviour_logprob_when_proximal_is_the_token_version() -> None:
    out = approx_proximal_logp(
        t([[-2.0]]), t([[-1.0]]), torch.tensor([[5]]), current_version=6, proximal_version=5
    )
    close(out, [[-2.0]])


def test_proximal_approximation_interpolates_linearly_in_version() -> None:
    # versions 2, 4, 5 with current 6 and proximal 5: alpha = 3/4, 1/2, 0
    lb, lc = t([[-2.0, -2.0, -2.0]]), t([[-1.0, -1.0, -1.0]])
    out = approx_proximal_logp(lb, lc, torch.tensor([[2, 4, 5]]), current_version=6, proximal_version=5)
    close(out, [[-2.0 + 0.75 * 1.0, -2.0 + 0.5 * 1.0, -2.0]])


def test_proximal_approximation_clamps_tokens_newer_than_the_proximal_version_to_behaviour() -> None:
    # token sampled at 5, proximal 4, current 6: alpha = (4 - 5) / (6 - 5) = -1 -> 0
    out = approx_proximal_logp(
        t([[-2.0]]), t([[-1.0]]), torch.tensor([[5]]), current_version=6, proximal_version=4
    )
    close(out, [[-2.0]])


def test_proximal_approximation_refuses_a_proximal_version_newer_than_the_current_one() -> None:
    with pytest.raises(ValueError, match="newer than current_version"):
        approx_proximal_logp(
            t([[0.0]]), t([[0.0]]), torch.tensor([[1]]), current_version=2, proximal_version=3
        )


def test_proximal_approximation_is_detached() -> None:
    lc = t([[-1.0]], grad=True)
    out = approx_proximal_logp(t([[-2.0]]), lc, torch.tensor([[3]]), current_version=4, proximal_version=4)
    assert not out.requires_grad


# --- the config-facing dispatcher ------------------------------------------------------------


def test_compute_loss_pg_with_tis_matches_the_parts() -> None:
    logp, old, beh = t([[-1.0, -2.0]]), t([[-1.0, -2.0]]), t([[-1.5, -1.0]])
    adv, mask = t([1.0]), t([[1, 1]])
    loss, stats = compute_loss(
        "pg", "tis", logp=logp, logp_old=old, logp_behaviour=beh, advantages=adv, mask=mask
    )
    # weights min(exp(0.5), 2) = 1.65 and min(exp(-1), 2) = 0.37
    close(loss, (-(e(0.5) * -1.0) - (e(-1.0) * -2.0)) / 2)
    close(stats["is/mean"], (e(0.5) + e(-1.0)) / 2)
    close(stats["mismatch/kl_k1"], -(0.5 - 1.0) / 2)  # k1 = mean(log mu - log pi)
    assert "loss/loss" in stats


def test_compute_loss_pg_without_old_logprobs_uses_the_current_ones() -> None:
    logp = t([[-1.0, -2.0]], grad=True)
    loss, _ = compute_loss(
        "pg", "tis", logp=logp, logp_behaviour=t([[-1.0, -2.0]]), advantages=t([1.0]), mask=t([[1, 1]])
    )
    close(loss, (1.0 + 2.0) / 2)
    loss.backward()
    close(logp.grad, [[-0.5, -0.5]])


def test_compute_loss_ppo_with_mis_drops_out_of_band_tokens_from_the_mean() -> None:
    logp, old, beh = t([[0.1, 0.0]]), t([[0.0, 0.0]]), t([[0.0, -3.0]])
    loss, stats = compute_loss(
        "ppo", "mis", logp=logp, logp_old=old, logp_behaviour=beh, advantages=t([1.0]), mask=t([[1, 1]])
    )
    # token 1 has pi_old / mu = exp(3) > 2 and is dropped: only token 0 counts
    close(loss, -e(0.1))
    close(stats["is/frac_masked"], 1 / 2)


def test_compute_loss_decoupled_with_mis_keeps_the_raw_weight_on_kept_tokens() -> None:
    logp, old, beh = t([[0.1, 0.0]]), t([[0.0, 0.0]]), t([[-0.5, -3.0]])
    loss, _ = compute_loss(
        "decoupled_ppo",
        "mis",
        logp=logp,
        logp_old=old,
        logp_behaviour=beh,
        advantages=t([1.0]),
        mask=t([[1, 1]]),
    )
    close(loss, -e(0.5) * e(0.1))


def test_compute_loss_decoupled_with_tis_truncates_the_weight() -> None:
    logp, old, beh = t([[0.1]]), t([[0.0]]), t([[-1.0]])
    loss, _ = compute_loss(
        "decoupled_ppo",
        "tis",
        logp=logp,
        logp_old=old,
        logp_behaviour=beh,
        advantages=t([1.0]),
        mask=t([[1]]),
    )
    close(loss, -2.0 * e(0.1))


def test_compute_loss_mismatch_band_masks_single_tokens() -> None:
    logp, beh = t([[-1.0, -1.0]]), t([[-1.0, -3.0]])
    loss, stats = compute_loss(
        "pg",
        "none",
        logp=logp,
        logp_behaviour=beh,
        advantages=t([1.0]),
        mask=t([[1, 1]]),
        mismatch_band=(0.5, 2.0),
    )
    close(loss, 1.0)
    close(stats["mismatch/frac_masked"], 1 / 2)


def test_compute_loss_refuses_unknown_names() -> None:
    kw = {"logp": t([[0.0]]), "logp_behaviour": t([[0.0]]), "advantages": t([1.0]), "mask": t([[1]])}
    with pytest.raises(ValueError, match="pg, ppo or decoupled_ppo"):
        compute_loss("grpo", "none", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="none, tis or mis"):
        compute_loss("pg", "clip", **kw)  # type: ignore[arg-type]


def test_float32_logprobs_with_a_bool_mask_and_an_empty_row_train_without_nan() -> None:
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]], requires_grad=True)
    beh = torch.tensor([[-1.2, -1.9], [-0.5, -0.5]])
    mask = torch.tensor([[True, True], [False, False]])
    for kind in ("pg", "ppo", "decoupled_ppo"):
        for correction in ("none", "tis", "mis"):
            loss, stats = compute_loss(
                kind,  # type: ignore[arg-type]
                correction,  # type: ignore[arg-type]
                logp=logp,
                logp_behaviour=beh,
                advantages=torch.tensor([1.0, -1.0]),
                mask=mask,
                level="sequence",
                agg="seq-mean-token-mean",
            )
            (grad,) = torch.autograd.grad(loss, logp)
            assert torch.isfinite(loss) and torch.isfinite(grad).all()
            assert grad[1].tolist() == [0.0, 0.0]
            assert all(torch.isfinite(v) for v in stats.values()), (kind, correction, stats)
