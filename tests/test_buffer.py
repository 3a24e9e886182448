"""The buffer's rules in one process: staleness bound, groups and deadlines, leases, acks, accounting."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.buffer import Batch, Buffer, BufferConfig, Sample, decode_batch, encode_batch

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def make_sample(
    version: int,
    group: str = "g",
    episode: str | None = None,
    n_prompt: int = 3,
    n_gen: int = 4,
    reward: float = 1.0,
    error: str | None = None,
    sid: str | None = None,
) -> Sample:
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
        buf = Buffer(
            BufferConfig(batch_size=2, max_staleness=1, stale_policy="keep_weighted", loose_staleness=3)
        )
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
        assert (
            batch is not None and batch.samples[0].reward == 0.0 and batch.samples[0].error == "SandboxError"
        )
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
        assert second is not None and {s.sample_id for s in second.samples} == {
            s.sample_id for s in first.samples
        }
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
    batch = decode_batch(encode_batch(Batch("b", [s], 5)))
    got = batch.samples[0]
    assert (
        isinstance(got.token_ids, np.ndarray)
        and got.token_ids.dtype == np.int32
        and got.token_ids.flags.writeable
    )
    assert got.token_ids.tolist() == s.token_ids.tolist() and got.loss_mask.tolist() == s.loss_mask.tolist()
    assert got.versions.tolist() == s.versions.tolist() and got.logprobs.tolist() == s.logprobs.tolist()


def test_versions_round_trip_whether_or_not_a_turn_crossed_a_weight_update() -> None:
    import numpy as np

    base = {
        "token_ids": list(range(10)),
        "logprobs": [0.0] * 10,
        "episode_id": "e",
        "group_id": "g",
        "env": "t",
        "reward": 0.0,
    }
    cases = [
        ([0, 0, 1, 1, 1, 0, 0, 1, 1, 1], [-1, -1, 4, 4, 4, -1, -1, 5, 5, 5]),  # one version per turn
        ([0, 0, 1, 1, 1, 1, 1, 1, 1, 0], [-1, -1, 4, 4, 5, 5, 5, 6, 6, -1]),  # a turn across two updates
        ([1] * 10, [7] * 10),
        ([0] * 10, [-1] * 10),
    ]
    for mask, versions in cases:
        for as_np in (False, True):
            s = Sample(
                loss_mask=np.array(mask) if as_np else mask,
                versions=np.array(versions) if as_np else versions,
                **base,
            )
            got = decode_batch(encode_batch(Batch("b", [s], 9))).samples[0]
            assert got.loss_mask.tolist() == mask and got.versions.tolist() == versions
            assert got.min_version == Sample(loss_mask=mask, versions=versions, **base).min_version


def _v1_record(s: Sample) -> bytes:
    """A sample record in format 1 (JSON header), as logs written before format 2 hold them."""
    import json

    import numpy as np

    def runs(xs: list[int]) -> tuple[list[int], list[int]]:
        vals: list[int] = []
        lens: list[int] = []
        for x in xs:
            if vals and vals[-1] == x:
                lens[-1] += 1
            else:
                vals.append(x)
                lens.append(1)
        return vals, lens

    mv, ml = runs(s.loss_mask)
    vv, vl = runs(s.versions)
    head = {
        "v": 1,
        "n": len(s.token_ids),
        "km": len(mv),
        "kv": len(vv),
        "min_version": s.min_version,
        "sample_id": s.sample_id,
        "episode_id": s.episode_id,
        "group_id": s.group_id,
        "env": s.env,
        "reward": s.reward,
        "truncated": s.truncated,
        "error": s.error,
        "info": s.info,
        "timings": s.timings,
    }
    hb = json.dumps(head).encode()
    hb += b" " * (-len(hb) % 4)
    arrays = [np.array(s.token_ids, "<i4"), np.array(s.logprobs, "<f4")] + [
        np.array(x, "<i4") for x in (mv, ml, vv, vl)
    ]
    return len(hb).to_bytes(4, "little") + hb + b"".join(a.tobytes() for a in arrays)


int32s = st.integers(min_value=-(2**31), max_value=2**31 - 1)


@st.composite
def samples(draw: st.DrawFn) -> Sample:
    """Samples with turns, weight updates inside turns, negative and extreme versions, and logprobs
    that float32 must round (or overflow to -inf)."""
    mask: list[int] = []
    versions: list[int] = []
    for _ in range(draw(st.integers(0, 6))):
        n = draw(st.integers(1, 120))
        generated = draw(st.booleans())
        mask += [1 if generated else 0] * n
        if generated:
            first = draw(int32s)
            split = draw(st.integers(0, n))
            versions += [first] * split + [draw(int32s)] * (n - split)
        else:
            versions += [draw(st.sampled_from([-1, -5, 0]))] * n
    n = len(mask)
    logprob = st.one_of(st.floats(allow_nan=False, width=64), st.floats(-1e-44, 0), st.just(-0.1))
    return Sample(
        token_ids=draw(st.lists(int32s, min_size=n, max_size=n)),
        loss_mask=mask,
        logprobs=draw(st.lists(logprob, min_size=n, max_size=n)),
        versions=versions,
        episode_id=draw(st.text(max_size=8)),
        group_id=draw(st.text(max_size=8)),
        env=draw(st.text(max_size=8)),
        reward=draw(st.floats(allow_nan=False)),
        truncated=draw(st.booleans()),
        error=draw(st.one_of(st.none(), st.text(max_size=8))),
        info=draw(st.one_of(st.just({}), st.dictionaries(st.text(max_size=4), st.integers(), max_size=3))),
        timings=draw(
            st.one_of(st.just({}), st.dictionaries(st.text(max_size=4), st.floats(0, 1e6), max_size=3))
        ),
    )


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(s=samples())
def test_every_sample_round_trips_exactly_with_logprobs_rounded_to_float32(s: Sample) -> None:
    import array

    import numpy as np

    from agentrl.buffer import decode_sample, encode_sample
    from agentrl.buffer.codec import read_header

    record, head = encode_sample(s)
    got = decode_sample(record)
    want_logprobs = array.array("f", s.logprobs).tolist()  # C (float) cast: nearest, -inf past float32
    assert got.logprobs.tolist() == want_logprobs
    assert got == replace(s, logprobs=want_logprobs)
    assert head["min_version"] == read_header(record)["min_version"] == s.min_version
    # Other dtypes (numpy int64/int8/float64 input, converted by Sample) write the same bytes.
    arrays = replace(s, token_ids=np.array(s.token_ids, np.int64), loss_mask=np.array(s.loss_mask, np.int8),
                     logprobs=np.array(s.logprobs), versions=np.array(s.versions, np.int64))
    with np.errstate(over="ignore"):  # float32 overflow to -inf is the documented rounding
        assert encode_sample(arrays)[0] == record
        v1 = _v1_record(s)
    as_np = decode_sample(record)
    assert as_np.token_ids.tolist() == s.token_ids.tolist() and as_np.versions.tolist() == s.versions.tolist()
    assert as_np.loss_mask.tolist() == s.loss_mask.tolist() and as_np.logprobs.tolist() == want_logprobs
    # Format 1 records (older logs) decode to the same sample.
    assert decode_sample(v1) == got


def test_unusual_masks_and_values_keep_their_former_meaning() -> None:
    from agentrl.buffer import decode_sample, encode_sample

    base = {
        "token_ids": [1, 2, 3, 4],
        "logprobs": [0.0, -1.0, -1e39, 1e-50],
        "episode_id": "e",
        "group_id": "g",
        "env": "t",
        "reward": 0.0,
    }
    bools = decode_sample(encode_sample(Sample(loss_mask=[False, True, True, 1.0], versions=[-1, 2, 3, 3],
                                               **base))[0])
    assert bools.loss_mask.tolist() == [0, 1, 1, 1] and bools.versions.tolist() == [-1, 2, 3, 3]
    assert bools.logprobs.tolist() == [0.0, -1.0, float("-inf"), 0.0]
    twos = decode_sample(encode_sample(Sample(loss_mask=[0, 2, 2, 1], versions=[-1, 2, 2, 2], **base))[0])
    assert twos.loss_mask.tolist() == [0, 2, 2, 1]
    with pytest.raises(OverflowError):
        encode_sample(Sample(loss_mask=[0, 1, 1, 1], versions=[-1, 2**31, 2, 2], **base))
    with pytest.raises(OverflowError):
        encode_sample(
            Sample(loss_mask=[0, 1, 1, 1], versions=[-1, 2, 2, 2], **{**base, "token_ids": [1, 2, 3, 2**40]})
        )


def test_a_log_written_in_format_1_is_recovered_and_served(tmp_path: Path) -> None:
    from agentrl.buffer.log import Kind, Log, frame
    from agentrl.buffer.units import ARRIVAL

    old = [make_sample(3, sid=f"old{i}") for i in range(2)]
    log = Log(tmp_path)
    list(log.recover())
    log.append([frame(Kind.PUT, ARRIVAL.pack(time.time()) + _v1_record(s)) for s in old])
    log.close()

    async def go() -> None:
        buf = Buffer(BufferConfig(path=str(tmp_path), batch_size=3, max_staleness=4))
        await buf.put([make_sample(4, sid="new")])
        batch = await buf.get_batch(5)
        assert batch is not None and batch.samples == [
            *old,
            make_sample(4, sid="new", episode=batch.samples[2].episode_id),
        ]
        buf.close()

    run(go())


def test_decoding_a_batch_pauses_the_collector_only_while_it_runs() -> None:
    import gc

    from agentrl.buffer.codec import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError
    assert gc.isenabled()
