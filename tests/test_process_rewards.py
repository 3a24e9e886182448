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
from agentrl.scoring.registry import split_at_token, split_text
from agentrl.scoring.stage import generated_segments, generated_turns, place_turn_rewards
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


def test_a_splitter_cuts_the_turns_into_segments_and_their_rewards_go_on_each_segments_last_token():
    a = _two_turns()  # turns: tokens 3, 4, 5 (positions 2-4) and 8, 9 (positions 7-8)
    split = split_at_token(4)  # a segment ends after each token 4; the turn's end ends one too
    assert generated_segments(SimpleNamespace(samples=[a]), split) == [[3, 4], [5], [8, 9]]
    assert place_turn_rewards([a], [1.0, 0.5, -1.0], weight=2.0, split=split) == pytest.approx(0.5 / 3)
    assert np.flatnonzero(np.isfinite(a.token_rewards)).tolist() == [3, 4, 8]
    assert a.token_rewards[[3, 4, 8]].tolist() == [2.0, 1.0, -2.0]
    with pytest.raises(ValueError, match="returned 2 rewards for the episode's 3 segments"):
        place_turn_rewards([a], [1.0, 2.0], weight=1.0, split=split)
    for bad in ([2, 1], [0], [4], [1, 1], "1", [1.5]):  # not increasing offsets within the turn
        with pytest.raises(ValueError, match="splitter"):
            place_turn_rewards([_two_turns()], [1.0, 1.0, 1.0], weight=1.0, split=lambda turn, b=bad: b)


def test_split_text_ends_a_segment_at_each_delimiter_of_the_decoded_turn(tiny_tools_model: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tools_model)
    parts = ["First, 37 * 12 is 444.\n\n", "Then 444 + 5 = 449.\n\n\n\n", "The answer is 449."]
    ids = tok.encode("".join(parts), add_special_tokens=False)
    n = len(ids) + 1
    turn = Sample([0, *ids], [0] + [1] * len(ids), [0.0] * n, [0] * n, episode_id="e", group_id="g", env="t",
                  reward=0.0)
    segments = generated_segments(SimpleNamespace(samples=[turn]), split_text(tok, "\n\n"))
    # this tokenizer has one token per newline: four in a row are two delimiters, two segment ends
    assert [tok.decode(s) for s in segments] == [parts[0], "Then 444 + 5 = 449.\n\n", "\n\n", parts[2]]
    one_token = SimpleNamespace(decode=lambda ids: {1: "a", 2: "\n\n\n\n", 3: "b"}[ids[0]])
    assert split_text(one_token)([1, 2, 3, 2]) == [2, 4]  # a token that completes two ends one segment


@agentrl.scorer("unit-sentences", split=split_at_token(2))
async def _sentences(task: dict[str, Any], episode: Any) -> list[float]:
    return [float(len(s)) for s in generated_segments(episode, split_at_token(2))]


def test_a_splitting_scorer_through_the_stage_scores_each_segment_and_leaves_the_outcome_alone():
    ep = finished_episode(reward=0.0)
    stage = ScoringStage(ScoringConfig(scorers={"unit-sentences": 0.5}))
    asyncio.run(stage(TASK, ep))
    (s,) = ep.samples  # tokens [1, 2, 3], mask [0, 1, 1]: segments [2] and [3]
    assert ep.error is None and s.token_rewards[1:].tolist() == [0.5, 0.5] and np.isnan(s.token_rewards[0])
    assert ep.reward == 0.0 and s.info["rewards"] == {"env": 0.0, "unit-sentences": 1.0}


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
