"""Dynamic sampling (DAPO): the buffer drops groups whose rewards are all equal, and the rollout,
given the room back by admission control, generates replacements so batches stay full."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace
from pathlib import Path

from agentrl.buffer import Buffer, BufferConfig, Sample
from agentrl.rollout.episode import EpisodeResult
from agentrl.rollout.orchestrator import Orchestrator


def _sample(group: str, episode: str, reward: float, error: str | None = None) -> Sample:
    return Sample(token_ids=list(range(12)), loss_mask=[0] * 4 + [1] * 8, logprobs=[0.0] * 4 + [-0.5] * 8,
                  versions=[-1] * 4 + [0] * 8, episode_id=episode, group_id=group, env="t", reward=reward,
                  error=error)


def _cfg(**kw: object) -> BufferConfig:
    return BufferConfig(batch_size=4, group_size=2, drop_uniform_groups=True, **kw)  # type: ignore[arg-type]


def test_a_complete_group_whose_rewards_are_all_equal_is_dropped_and_counted() -> None:
    async def go() -> None:
        buf = Buffer(_cfg())
        await buf.put([_sample("u", "u1", 1.0), _sample("u", "u2", 1.0)])  # all solved: nothing to learn
        await buf.put([_sample("m", "m1", 1.0), _sample("m", "m2", 0.0)])
        await buf.put([_sample("k", "k1", 0.5), _sample("k", "k2", 0.0)])
        stats = buf.stats()
        assert stats["dropped_by_reason"] == {"uniform_group": 2} and stats["uniform_groups_dropped"] == 1
        assert stats["identity_holds"] and stats["depth"] == 4
        batch = await buf.get_batch(0)
        assert batch is not None and sorted(s.group_id for s in batch.samples) == ["k", "k", "m", "m"]
        assert buf.sample_state(next(iter(s.sample_id for s in batch.samples))) == "leased"

    asyncio.run(go())


def test_failed_episodes_are_left_out_of_the_comparison() -> None:
    async def go() -> None:
        buf = Buffer(_cfg())
        # one success and one failure (stored with reward 0): the learner trains only the success,
        # whose advantage in a group of one is 0
        await buf.put([_sample("f", "f1", 1.0), _sample("f", "f2", 0.0, error="EnvironmentFailure: boom")])
        await buf.put([_sample("g", "g1", 0.0, error="x"), _sample("g", "g2", 0.0, error="y")])
        assert buf.stats()["uniform_groups_dropped"] == 2 and buf.stats()["depth"] == 0

    asyncio.run(go())


def test_without_the_setting_uniform_groups_are_served() -> None:
    async def go() -> None:
        buf = Buffer(BufferConfig(batch_size=2, group_size=2))
        await buf.put([_sample("u", "u1", 1.0), _sample("u", "u2", 1.0)])
        assert await buf.get_batch(0) is not None

    asyncio.run(go())


def test_a_uniform_drop_survives_a_restart(tmp_path: Path) -> None:
    async def go() -> None:
        buf = Buffer(_cfg(path=str(tmp_path)))
        await buf.put([_sample("u", "u1", 0.0), _sample("u", "u2", 0.0)])
        await buf.put([_sample("m", "m1", 1.0), _sample("m", "m2", 0.0)])
        buf.close()
        again = Buffer(_cfg(path=str(tmp_path)))
        stats = again.stats()
        assert (
            stats["dropped_by_reason"] == {"uniform_group": 2}
            and stats["pending"] == 2
            and stats["identity_holds"]
        )
        batch = await again.get_batch(0, batch_size=2)
        assert batch is not None and {s.group_id for s in batch.samples} == {"m"}
        await again.put([_sample("u", "u3", 1.0)])  # a late member of the dropped group
        assert again.sample_state(batch.samples[0].sample_id) == "leased"
        assert again.stats()["dropped_by_reason"]["group_closed"] == 1
        again.close()

    asyncio.run(go())


def test_the_rollout_replaces_dropped_groups_so_the_batch_is_full_of_signal() -> None:
    """Every other group the producer plays is uniform. Admission allows (max_staleness + 1) x
    batch_size = 4 episodes in flight or buffered, so without the drops the first batch would be
    one uniform and one mixed group; with them, the room comes back and the orchestrator plays on.
    (The orchestrator sees the room when its admission wait next wakes, within its 5 s timeout.)"""
    order: dict[str, int] = {}  # group id -> the order in which its group started
    played: dict[str, int] = {}  # group id -> episodes played so far
    counter = itertools.count()

    async def producer(task: dict, group_id: str) -> EpisodeResult:
        g = order.setdefault(group_id, len(order))
        n = played[group_id] = played.get(group_id, 0) + 1
        await asyncio.sleep(0)
        reward = 1.0 if g % 2 == 0 else float(n == 1)  # even groups: all solved; odd: one of two
        ep = EpisodeResult(episode_id=f"e{next(counter)}", group_id=group_id, env="straggler",
                           task_id=str(task.get("id")), reward=reward, terminated=True)
        ep.samples = [_sample(group_id, ep.episode_id, reward)]
        return ep

    async def go() -> tuple[list[Sample], dict]:
        buf = Buffer(BufferConfig(batch_size=4, group_size=2, max_staleness=0, drop_uniform_groups=True))
        orch = Orchestrator(producer, buf, env_name="straggler", env_config={"latency_median_s": 0.0},
                            group_size=2, max_concurrency=4)
        run = asyncio.create_task(orch.run())
        batch = None
        try:
            for _ in range(6):  # long-polls of up to 30 s each until a full batch is ready
                batch = batch or await buf.get_batch(0, timeout_s=30.0)
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        assert batch is not None
        return batch.samples, buf.stats()

    samples, stats = asyncio.run(go())
    assert len(samples) == 4
    by_group: dict[str, set[float]] = {}
    for s in samples:
        by_group.setdefault(s.group_id, set()).add(s.reward)
    assert len(by_group) == 2 and all(rewards == {0.0, 1.0} for rewards in by_group.values())
    assert stats["uniform_groups_dropped"] >= 2  # the room they freed was filled with new groups
    assert stats["dropped_by_reason"]["uniform_group"] == 2 * stats["uniform_groups_dropped"]
    assert stats["identity_holds"]


def test_a_group_that_lost_a_member_to_the_infrastructure_is_dropped_and_counted() -> None:
    def failed(group: str, episode: str, kind: str) -> Sample:
        return replace(_sample(group, episode, 0.0, error=f"{kind} failed"), error_kind=kind)

    async def go() -> None:
        buf = Buffer(BufferConfig(batch_size=4, group_size=2))
        await buf.put([_sample("i", "i1", 1.0)])
        await buf.put([failed("i", "i2", "model")])  # the engine died under it: says nothing of the policy
        await buf.put([_sample("e", "e1", 1.0)])
        await buf.put([failed("e", "e2", "environment")])  # the environment's failure is data
        await buf.put([_sample("k", "k1", 0.5), _sample("k", "k2", 0.0)])
        stats = buf.stats()
        assert stats["dropped_by_reason"] == {"infrastructure": 2}
        assert stats["infrastructure_groups_dropped"] == 1 and stats["identity_holds"] and stats["depth"] == 4
        batch = await buf.get_batch(0)
        assert batch is not None and sorted(s.group_id for s in batch.samples) == ["e", "e", "k", "k"]
        await buf.put([_sample("i", "i3", 0.0)])  # a late member of the dropped group
        assert buf.stats()["dropped_by_reason"] == {"infrastructure": 2, "group_closed": 1}

    asyncio.run(go())


def test_infrastructure_groups_can_be_kept() -> None:
    async def go() -> None:
        buf = Buffer(BufferConfig(batch_size=2, group_size=2, drop_infrastructure_groups=False))
        await buf.put([_sample("i", "i1", 1.0)])
        await buf.put([replace(_sample("i", "i2", 0.0, error="engine gone"), error_kind="model")])
        assert buf.stats()["depth"] == 2 and not buf.stats()["dropped_by_reason"]

    asyncio.run(go())
