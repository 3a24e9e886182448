"""The buffer's rules in one process: staleness bound, groups and deadlines, leases, acks, accounting."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.buffer import Batch, Buffer, BufferConfig, Sample, decode_batch, encode_batch

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def make_sample(version: int, group: str = "g", episode: str | None = None, n_prompt: int = 3,
                n_gen: int = 4, reward: float = 1.0, error: str | None = None, sid: str | None = None) -> Sample:
    n = n_prompt + n_gen
    kw = {"sample_id": sid} if sid else {}
    return Sample(
        token_ids=list(range(100, 100 + n)),
        loss_mask=[0] * n_prompt + [1] * n_gen,
        logprobs=[0.0] * n_prompt + [-0.5] * n_gen,
        versions=[-1] * n_prompt + [version] * n_gen,
        episode_id=episode or f"ep-{version}-{id(object())}",
        group_id=group,
        env="test",
        reward=reward,
        error=error,
        **kw,
    )


def check_identity(buf: Buffer) -> dict[str, Any]:
    s = buf.stats()
    assert s["produced"] == s["consumed"] + sum(s["dropped_by_reason"].values()) + s["pending"], s
    assert s["identity_holds"]
    return s


def test_a_sample_round_trips_through_the_binary_encoding() -> None:
    s = Sample(token_ids=[5, 6, 7, 8, 9], loss_mask=[0, 1, 1, 0, 1], logprobs=[0.0, -0.25, -1.5, 0.0, -2.0],
               versions=[-1, 3, 4, -1, 4], episode_id="e", group_id="g", env="math", reward=0.5,
               truncated=True, error="ToolError", info={"turns": 2}, timings={"gen_s": 1.5})
    batch = decode_batch(encode_batch(Batch("b1", [s, s], learner_version=7)))
    assert batch.batch_id == "b1" and batch.learner_version == 7 and len(batch.samples) == 2
    assert batch.samples[0] == s
    assert batch.samples[0].min_version == 3


def test_stale_samples_are_dropped_and_never_served() -> None:
    async def go() -> None:
        buf = Buffer(BufferConfig(batch_size=2, max_staleness=1))
        await buf.put([make_sample(0), make_sample(5), make_sample(6)])
        batch = await buf.get_batch(learner_version=6, max_staleness=1, batch_size=2)
        assert batch is not None
        assert sorted(s.min_version for s in batch.samples) == [5, 6]
        s = check_identity(buf)
        assert s["dropped_by_reason"] == {"stale": 1}
        assert s["leased"] == 2

    run(go())


def test_keep_weighted_serves_up_to_the_loose_bound() -> None:
    async def go() -> None:
        buf = Buffer(BufferConfig(batch_size=2, max_staleness=1, stale_policy="keep_weighted", loose_staleness=3))
        await buf.put([make_sample(0), make_sample(3), make_sample(4)])
        batch = await buf.get_batch(learner_version=4, max_staleness=1, batch_size=2)
        assert batch is not None and sorted(s.min_version for s in batch.samples) == [3, 4]
        assert batch.info["staleness_bound"] == 3
        assert check_identity(buf)["dropped_by_reason"] == {"stale": 1}

    run(go())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(st.tuples(st.sampled_from(["put", "get", "get", "ack", "bump", "release"]),
                           st.integers(0, 7), st.integers(0, 4), st.integers(1, 5)), min_size=1, max_size=50),
    grouped=st.booleans(),
    policy=st.sampled_from(["drop", "keep_weighted"]),
)
def test_no_served_sample_exceeds_the_staleness_bound(ops: list[tuple[str, int, int, int]], grouped: bool,
                                                      policy: str) -> None:
    """Random sample versions (lagging the learner by 0-7), arrival orders, learner versions,
    bounds, batch sizes, acks and releases."""

    async def go() -> None:
        cfg = BufferConfig(batch_size=2, max_staleness=2, group_size=2 if grouped else 1, stale_policy=policy,
                           loose_staleness=3, group_deadline_s=0.0 if grouped else None)
        buf = Buffer(cfg)
        learner_version, n = 8, 0
        leased: list[Batch] = []
        consumed: list[str] = []
        for op, a, b, c in ops:
            if op == "put":
                samples = [make_sample(max(learner_version - (a + j) % 8, -1) if (a + j) % 9 else -1,
                                       group=f"g{(n + j) // 2}", episode=f"e{n + j}") for j in range(c)]
                n += c
                await buf.put(samples)
            elif op == "get":
                batch = await buf.get_batch(learner_version, b, c * 2 if grouped else c)
                if batch is not None:
                    bound = b if policy == "drop" else max(b, 3)
                    for s in batch.samples:
                        assert s.staleness(learner_version) <= bound, (s.min_version, learner_version, bound)
                    leased.append(batch)
            elif op == "ack" and leased:
                batch = leased.pop(0)
                assert buf.ack(batch.batch_id)
                consumed += [s.sample_id for s in batch.samples]
            elif op == "bump":
                learner_version += a
            elif op == "release":
                buf.release_leases()
                leased.clear()
            check_identity(buf)
        assert len(consumed) == len(set(consumed))
        assert buf.stats()["consumed"] == len(consumed)

    run(go())


def test_groups_are_served_only_when_complete() -> None:
    async def go() -> None:
        buf = Buffer(BufferConfig(batch_size=2, max_staleness=4, group_size=2, group_deadline_s=None))
        await buf.put([make_sample(1, group="a", episode="a1")])
        await buf.put([make_sample(1, group="b", episode="b1")])
        assert await buf.get_batch(1, batch_size=2) is None
        await buf.put([make_sample(1, group="a", episode="a2")])
        batch = await buf.get_batch(1, batch_size=2)
        assert batch is not None and {s.group_id for s in batch.samples} == {"a"}
        assert buf.stats()["waiting_groups"] == 1

    run(go())


def test_a_split_episode_counts_once_towards_its_group() -> None:
    async def go() -> None:
        buf = Buffer(BufferConfig(batch_size=2, max_staleness=4, group_size=2, group_deadline_s=None))
        await buf.put([make_sample(1, group="a", episode="a1"), make_sample(1, group="a", episode="a1")])
        assert await buf.get_batch(1, batch_size=2) is None
        await buf.put([make_sample(1, group="a", episode="a2")])
        batch = await buf.get_batch(1, batch_size=2)
        assert batch is not None and len(batch.samples) == 3
        assert {s.episode_id for s in batch.samples} == {"a1", "a2"}

    run(go())


@pytest.mark.parametrize("policy", ["serve", "drop"])
def test_a_group_past_its_deadline_is_served_partial_or_dropped(policy: str) -> None:
    async def go() -> None:
        buf = Buffer(BufferConfig(batch_size=2, group_size=2, group_deadline_s=0.2, partial_groups=policy))
        await buf.put([make_sample(1, group="a", episode="a1")])
        await buf.put([make_sample(1, group="b", episode="b1"), make_sample(1, group="b", episode="b2")])
        t0 = time.monotonic()
        batch = await buf.get_batch(1, batch_size=2, timeout_s=2.0)
        assert batch is not None and {s.group_id for s in batch.samples} == {"b"}
        later = await buf.get_batch(1, batch_size=1, timeout_s=2.0)
        s = check_identity(buf)
        if policy == "serve":
            assert later is not None and [x.episode_id for x in later.samples] == ["a1"]
            assert later.info["partial_groups"] == 1 and s["partial_groups_served"] == 1
            assert time.monotonic() - t0 >= 0.15
        else:
            assert later is None and s["dropped_by_reason"] == {"partial_group": 1}
        assert s["groups_past_deadline"] == 1
        # A straggler of the closed group is dropped, counted.
        await buf.put([make_sample(1, group="a", episode="a2")])
        assert check_identity(buf)["dropped_by_reason"]["group_closed"] == 1

    run(go())


def test_a_group_with_a_stale_member_loses_that_member_and_is_served_partial() -> None:
    async def go() -> None:
        buf = Buffer(BufferConfig(batch_size=2, max_staleness=1, group_size=2, group_deadline_s=None))
        await buf.put([make_sample(0, group="a", episode="a1"), make_sample(5, group="a", episode="a2")])
        batch = await buf.get_batch(5, batch_size=1)
        assert batch is not None and [s.episode_id for s in batch.samples] == ["a2"]
        assert check_identity(buf)["dropped_by_reason"] == {"stale": 1}

    run(go())


def test_failed_episodes_are_kept_as_data_with_reward_zero() -> None:
    async def go() -> None:
        buf = Buffer(BufferConfig(batch_size=1))
        await buf.put([make_sample(1, reward=3.0, error="SandboxError")])
        batch = await buf.get_batch(1)
        assert batch is not None and batch.samples[0].reward == 0.0 and batch.samples[0].error == "SandboxError"
        dropping = Buffer(BufferConfig(batch_size=1, drop_errors=True))
        await dropping.put([make_sample(1, error="SandboxError")])
        assert check_identity(dropping)["dropped_by_reason"] == {"error": 1}

    run(go())


def test_an_unacknowledged_batch_is_served_again_after_its_lease_expires() -> None:
    async def go() -> None:
        buf = Buffer(BufferConfig(batch_size=2, lease_s=0.1))
        await buf.put([make_sample(1), make_sample(1)])
        first = await buf.get_batch(1)
        assert first is not None
        assert await buf.get_batch(1) is None
        second = await buf.get_batch(1, timeout_s=2.0)
        assert second is not None and {s.sample_id for s in second.samples} == {s.sample_id for s in first.samples}
        assert not buf.ack(first.batch_id)
        assert buf.ack(second.batch_id) and buf.ack(second.batch_id)  # idempotent
        s = check_identity(buf)
        assert s["consumed"] == 2 and s["pending"] == 0 and s["leases_expired"] == 1

    run(go())


def test_repeated_puts_of_the_same_sample_are_ignored() -> None:
    async def go() -> None:
        buf = Buffer(BufferConfig(batch_size=1))
        s = make_sample(1)
        assert await buf.put([s, s]) == 1
        batch = await buf.get_batch(1)
        assert batch is not None and buf.ack(batch.batch_id)
        assert await buf.put([s]) == 0
        st_ = check_identity(buf)
        assert st_["produced"] == 1 and st_["duplicates_ignored"] == 2

    run(go())


def test_admission_keeps_in_flight_plus_buffered_within_the_staleness_window() -> None:
    async def go() -> None:
        buf = Buffer(BufferConfig(batch_size=4, max_staleness=1))
        assert buf.in_flight_allowance(0) == 8
        await buf.put([make_sample(1) for _ in range(3)])
        assert buf.in_flight_allowance(2) == 3
        assert buf.in_flight_allowance(5) == 0
        assert await buf.wait_for_room(5, timeout_s=0.05) == 0
        batch = await buf.get_batch(1, batch_size=3)
        assert batch is not None
        waiter = asyncio.create_task(buf.wait_for_room(5, timeout_s=5.0))
        await asyncio.sleep(0.01)
        buf.ack(batch.batch_id)
        assert await waiter == 3
        assert buf.stats()["admission_waits"] == 2

    run(go())


def test_a_long_poll_returns_as_soon_as_a_batch_is_ready() -> None:
    async def go() -> None:
        buf = Buffer(BufferConfig(batch_size=2))
        poll = asyncio.create_task(buf.get_batch(1, timeout_s=5.0))
        await asyncio.sleep(0.05)
        await buf.put([make_sample(1), make_sample(1)])
        batch = await asyncio.wait_for(poll, 1.0)
        assert batch is not None and len(batch) == 2

    run(go())


def test_a_restarted_buffer_recovers_pending_samples_and_forgets_leases(tmp_path: Path) -> None:
    cfg = BufferConfig(path=str(tmp_path / "buf"), batch_size=2, group_size=2, group_deadline_s=None)

    async def first() -> set[str]:
        buf = Buffer(cfg)
        samples = [make_sample(1, group=f"g{i // 2}", episode=f"e{i}") for i in range(6)]
        await buf.put(samples)
        b1 = await buf.get_batch(1)
        b2 = await buf.get_batch(1)
        assert b1 is not None and b2 is not None and buf.ack(b1.batch_id)
        buf.close()
        return {s.sample_id for s in samples} - {s.sample_id for s in b1.samples}

    async def second(expected: set[str]) -> None:
        buf = Buffer(cfg)
        s = check_identity(buf)
        assert s["produced"] == 6 and s["consumed"] == 2 and s["pending"] == 4 and s["leased"] == 0
        got: set[str] = set()
        while (b := await buf.get_batch(1)) is not None:
            got |= {x.sample_id for x in b.samples}
            assert len({x.group_id for x in b.samples}) == 1
        assert got == expected

    run(second(run(first())))


def test_compaction_keeps_pending_samples_and_the_counters(tmp_path: Path) -> None:
    cfg = BufferConfig(path=str(tmp_path / "buf"), batch_size=4, compact_bytes=4096, sync="flush")

    async def go() -> None:
        buf = Buffer(cfg)
        for _ in range(10):
            await buf.put([make_sample(2, n_gen=50) for _ in range(4)])
            b = await buf.get_batch(2)
            assert b is not None and buf.ack(b.batch_id)
        await buf.put([make_sample(0, n_gen=50), make_sample(2, n_gen=50)])
        s = check_identity(buf)
        assert s["compactions"] >= 1
        buf.close()
        again = Buffer(cfg)
        s2 = check_identity(again)
        assert (s2["produced"], s2["consumed"], s2["pending"]) == (42, 40, 2)
        assert s2["staleness_consumed"] == {"0": 40}
        b = await again.get_batch(3, max_staleness=1, batch_size=1)
        assert b is not None and b.samples[0].min_version == 2
        assert check_identity(again)["dropped_by_reason"] == {"stale": 1}

    run(go())


def test_samples_can_be_decoded_as_numpy_arrays_for_the_learner() -> None:
    import numpy as np

    s = make_sample(4)
    batch = decode_batch(encode_batch(Batch("b", [s], 5)), as_arrays=True)
    got = batch.samples[0]
    assert isinstance(got.token_ids, np.ndarray) and got.token_ids.dtype == np.int32 and got.token_ids.flags.writeable
    assert got.token_ids.tolist() == s.token_ids and got.loss_mask.tolist() == s.loss_mask
    assert got.versions.tolist() == s.versions and got.logprobs.tolist() == s.logprobs


def test_versions_round_trip_whether_or_not_a_turn_crossed_a_weight_update() -> None:
    import numpy as np

    base = {"token_ids": list(range(10)), "logprobs": [0.0] * 10, "episode_id": "e", "group_id": "g", "env": "t",
            "reward": 0.0}
    cases = [
        ([0, 0, 1, 1, 1, 0, 0, 1, 1, 1], [-1, -1, 4, 4, 4, -1, -1, 5, 5, 5]),  # one version per turn
        ([0, 0, 1, 1, 1, 1, 1, 1, 1, 0], [-1, -1, 4, 4, 5, 5, 5, 6, 6, -1]),  # a turn across two updates
        ([1] * 10, [7] * 10),
        ([0] * 10, [-1] * 10),
    ]
    for mask, versions in cases:
        for as_np in (False, True):
            s = Sample(loss_mask=np.array(mask) if as_np else mask, versions=np.array(versions) if as_np else versions,
                       **base)
            got = decode_batch(encode_batch(Batch("b", [s], 9))).samples[0]
            assert got.loss_mask == mask and got.versions == versions
            assert got.min_version == Sample(loss_mask=mask, versions=versions, **base).min_version
