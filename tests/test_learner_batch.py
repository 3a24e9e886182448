"""What a step trains: per-episode advantages, a shared parent call trained once, truncated episodes.

The sessions are the router's own (``Session.samples``: one sample per leaf call, the chain of
calls it extends), built from hand-written call records, so the token layout is the product's.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from agentrl.buffer.sample import Sample
from agentrl.learner.batch import prepare, shared_completion_masks
from agentrl.learner.config import PGLoss
from agentrl.router.sessions import CallRecord, Completion, Session


def _completion(tokens: list[int], version: int = 3) -> Completion:
    return Completion(tokens, [-0.5] * len(tokens), [version] * len(tokens), "stop",
                      {"role": "assistant", "content": str(tokens)})


def _samples(session: Session, episode: str = "ep", reward: float = 1.0) -> list[Sample]:
    return [
        replace(
            st, episode_id=episode, group_id="g", env="t", reward=reward, info={"calls": st.info["calls"]}
        )
        for st in session.samples()
    ]


def _branching_session() -> Session:
    """Call 0 answers; calls 1 and 2 both continue call 0's reply (with different tool results)."""
    s = Session("s")
    s.record(CallRecord("s", 0, None, 0, [10, 11, 12], [_completion([20, 21])], "e0"))
    s.record(CallRecord("s", 1, 0, 0, [10, 11, 12, 20, 21, 5, 30, 31], [_completion([40, 41])], "e0"))
    s.record(CallRecord("s", 2, 0, 0, [10, 11, 12, 20, 21, 5, 32, 33], [_completion([42])], "e0"))
    return s


def test_a_parent_call_that_two_calls_extend_is_trained_once() -> None:
    samples = _samples(_branching_session())
    assert [list(s.info["calls"]) for s in samples] == [[0, 1], [0, 2]]
    masks, masked = shared_completion_masks(samples)
    # both samples hold call 0's completion (tokens 3, 4); the first keeps it, the second trains only its own
    assert masks[0].tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert masks[1].tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 1]
    assert masked == 2
    assert list(samples[1].loss_mask) == [0, 0, 0, 1, 1, 0, 0, 0, 1]  # the sample itself is untouched


def test_several_choices_of_one_call_are_each_trained() -> None:
    s = Session("s")  # one call with n = 2: two leaves, same prompt, different completions
    s.record(CallRecord("s", 0, None, 0, [10, 11], [_completion([20, 21]), _completion([22, 23, 24])], "e0"))
    samples = _samples(s)
    assert [list(x.info["calls"]) for x in samples] == [[0], [0]]
    masks, masked = shared_completion_masks(samples)
    assert masked == 0 and [m.tolist() for m in masks] == [[0, 0, 1, 1], [0, 0, 1, 1, 1]]


def test_the_same_chain_in_another_episode_is_not_shared() -> None:
    a = _samples(_branching_session(), episode="A")
    b = _samples(_branching_session(), episode="B")
    _, masked = shared_completion_masks(a + b)
    assert masked == 4  # call 0 once per episode: masked in A's second sample and in B's second


def test_samples_without_a_call_chain_keep_their_mask() -> None:
    plain = Sample([1, 2, 3, 4], [0, 1, 1, 1], [0.0, -1.0, -1.0, -1.0], [-1, 0, 0, 0], "e", "g", "t", 1.0)
    masks, masked = shared_completion_masks([plain, replace(plain, sample_id="other")])
    assert masked == 0 and all(m.tolist() == [0, 1, 1, 1] for m in masks)


def _sample(episode: str, group: str, reward: float, n: int = 6, truncated: bool = False) -> Sample:
    return Sample(list(range(1, n + 1)), [0, 0] + [1] * (n - 2), [0.0, 0.0] + [-1.0] * (n - 2),
                  [-1, -1] + [0] * (n - 2), episode, group, "t", reward, truncated=truncated)


def test_prepare_gives_the_samples_of_a_split_episode_its_one_advantage() -> None:
    batch = [_sample("A", "g", 1.0), _sample("A", "g", 1.0), _sample("B", "g", 0.0), _sample("C", "g", 0.0)]
    prep = prepare(batch, PGLoss())
    a, b = (2 / 3) / (math.sqrt(1 / 3) + 1e-6), -(1 / 3) / (math.sqrt(1 / 3) + 1e-6)
    assert np.allclose(prep.advantages.numpy(), [a, a, b, b], atol=1e-6)
    assert prep.stats["episodes"] == 3
    dr = prepare(batch, PGLoss(advantage_std=False))
    assert np.allclose(dr.advantages.numpy(), [2 / 3, 2 / 3, -1 / 3, -1 / 3], atol=1e-6)


def test_failed_and_empty_samples_are_neither_trained_nor_in_a_baseline() -> None:
    failed = replace(_sample("F", "g", 0.0), error="EnvironmentFailure: boom")
    empty = Sample([1, 2], [0, 0], [0.0, 0.0], [-1, -1], "E", "g", "t", 0.0)
    prep = prepare([_sample("A", "g", 1.0), _sample("B", "g", 0.0), failed, empty], PGLoss())
    assert [s.episode_id for s in prep.samples] == ["A", "B"]
    assert np.allclose(
        prep.advantages.numpy(), [1 / (math.sqrt(0.5) + 1e-6) * 0.5, -0.5 / (math.sqrt(0.5) + 1e-6)]
    )


def test_truncated_episodes_are_kept_masked_or_penalised() -> None:
    batch = [_sample("A", "g", 1.0), _sample("B", "g", 1.0, truncated=True), _sample("C", "g", 0.0)]
    keep = prepare(batch, PGLoss(overlong="keep"))
    assert [s.episode_id for s in keep.samples] == ["A", "B", "C"]
    masked = prepare(batch, PGLoss(overlong="mask"))
    # not trained, but still in the group's baseline: A's advantage is the same as under keep
    assert [s.episode_id for s in masked.samples] == ["A", "C"]
    assert np.allclose(masked.advantages.numpy(), keep.advantages.numpy()[[0, 2]])
    penalised = prepare(batch, PGLoss(overlong="penalize", overlong_penalty=1.0))
    # rewards 1, 1 - 1, 0: mean 1/3, sample std sqrt(1/3)
    a, b = (2 / 3) / (math.sqrt(1 / 3) + 1e-6), -(1 / 3) / (math.sqrt(1 / 3) + 1e-6)
    assert np.allclose(penalised.advantages.numpy(), [a, b, b], atol=1e-6)
