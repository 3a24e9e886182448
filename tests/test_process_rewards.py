"""Process rewards: a per-turn scorer's rewards land on each generated turn's last token, and the
learner turns them into per-token advantages (DeepSeekMath's process supervision: step rewards
normalized in their group, each token's advantage the return-to-go of the normalized steps)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import agentrl
from agentrl.buffer.sample import Sample
from agentrl.learner.advantages import process_advantages
from agentrl.scoring import ScoringConfig, ScoringStage
from agentrl.scoring.stage import generated_turns, place_turn_rewards
from tests.scoring_helpers import TASK, finished_episode

NAN = np.nan


def _two_turns(reward: float = 1.0) -> Sample:  # prompt, turn 1 (3 tokens), tool output, turn 2 (2 tokens)
    return Sample(list(range(1, 11)), [0, 0, 1, 1, 1, 0, 0, 1, 1, 0], [-0.5] * 10, [0] * 10, episode_id="e",
                  group_id="g", env="t", reward=reward)


def test_turn_rewards_go_on_each_turns_last_token_across_an_episodes_samples():
    a, b = _two_turns(), replace(_two_turns(), loss_mask=np.array([0] * 8 + [1, 0], dtype=np.int32))
    assert place_turn_rewards([a, b], [0.5, -1.0, 2.0], weight=2.0) == pytest.approx(0.5)
    assert np.flatnonzero(np.isfinite(a.token_rewards)).tolist() == [4, 8]
    assert a.token_rewards[[4, 8]].tolist() == [1.0, -2.0] and b.token_rewards[8] == 4.0
    place_turn_rewards([a, b], [1.0, 1.0, 1.0], weight=1.0)  # a second process scorer adds up
    assert a.token_rewards[[4, 8]].tolist() == [2.0, -1.0]
    with pytest.raises(ValueError, match="returned 2 rewards for the episode's 3 generated turns"):
        place_turn_rewards([a, b], [1.0, 2.0], weight=1.0)
    with pytest.raises(ValueError, match="list of finite numbers"):
        place_turn_rewards([a], [1.0, float("nan")], weight=1.0)


def test_process_advantages_are_the_return_to_go_of_the_groups_normalized_step_rewards():
    r1 = np.array([NAN, NAN, 1.0, NAN, 0.0], dtype=np.float32)  # two steps: rewards 1, 0
    r2 = np.array([NAN, 2.0, NAN, NAN, 1.0], dtype=np.float32)  # two steps: rewards 2, 1
    out = process_advantages([r1, r2, None], ["g", "g", "g"])
    steps = np.array([1.0, 0.0, 2.0, 1.0])
    z = (steps - steps.mean()) / (steps.std(ddof=1) + 1e-6)
    assert np.allclose(out[0], [z[0] + z[1]] * 3 + [z[1]] * 2, atol=1e-6)  # at or after each token
    assert np.allclose(out[1], [z[2] + z[3]] * 2 + [z[3]] * 3, atol=1e-6)
    assert out[2] is None
    flat = process_advantages([np.array([NAN, 1.0, 1.0], dtype=np.float32)], ["h"])
    assert (flat[0] == 0).all()  # all steps equal: no signal, as GRPO


def test_the_generated_turns_are_the_runs_of_the_loss_masks_in_order():
    a, b = _two_turns(), replace(_two_turns(), loss_mask=np.array([0] * 8 + [1, 0], dtype=np.int32))
    a.token_ids[-1] = 99
    b = replace(b, loss_mask=np.array([1] + [0] * 8 + [1], dtype=np.int32))  # runs at both ends
    assert generated_turns(SimpleNamespace(samples=[a, b])) == [[3, 4, 5], [8, 9], [1], [10]]


@agentrl.scorer("unit-steps", per_turn=True)
async def _steps(task: dict[str, Any], episode: Any) -> list[float]:
    return [0.25] * len(generated_turns(episode))


def test_a_per_turn_scorer_scores_tokens_and_leaves_the_outcome_reward_alone():
    ep = finished_episode(reward=1.0)
    stage = ScoringStage(ScoringConfig(scorers={"unit-steps": 4.0}))
    asyncio.run(stage(TASK, ep))
    (s,) = ep.samples  # mask [0, 1, 1]: one turn ending at position 2
    assert ep.error is None and s.token_rewards[2] == 1.0 and np.isnan(s.token_rewards[:2]).all()
    assert ep.reward == 1.0 and s.reward == 1.0  # the outcome is the environment's
    assert s.info["rewards"] == {"env": 1.0, "unit-steps": 0.25}


def test_a_step_trains_on_process_rewards_where_the_outcome_rewards_are_flat(tiny_model: str) -> None:
    torch = pytest.importorskip("torch")
    from agentrl.config import LearnConfig
    from agentrl.learner.config import PGLoss
    from agentrl.learner.dist import Dist, load_model
    from agentrl.learner.step import build_state, train_step
    from tests.test_learner_packing import make_samples

    base = [replace(s, reward=1.0) for s in make_samples(6, seed=8)]  # equal rewards: outcome advantages 0
    rng = np.random.default_rng(0)
    steps = []
    for s in base:
        r = np.full(len(s.token_ids), np.nan, dtype=np.float32)
        r[np.flatnonzero(s.loss_mask)[-1]] = rng.uniform(-1, 1)
        steps.append(replace(s, token_rewards=r))
    moved = {}
    for name, samples in (("outcome only", base), ("process", steps)):
        cfg = LearnConfig(lr=1e-3, micro_batch_tokens=10_000, loss=PGLoss(correction="none"))
        torch.manual_seed(0)
        state = build_state(cfg, load_model(tiny_model, Dist()), Dist())
        before = torch.cat([p.detach().flatten().clone() for p in state.model.parameters()])
        out = train_step(state, samples, cfg, 1)
        after = torch.cat([p.detach().flatten() for p in state.model.parameters()])
        moved[name] = (float((after - before).abs().max()), out)
    assert moved["outcome only"][0] == 0.0 and moved["outcome only"][1]["grad_norm"] == 0.0
    assert moved["process"][0] > 0.0 and moved["process"][1]["process_advantage_abs_mean"] > 0.0
