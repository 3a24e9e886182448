"""Lossless resume of in-flight work: a rollout stopped at any moment and started again on the same
run directory neither skips a task nor plays any task's group twice.

The first rollout is stopped (cancelled, which leaves its files as a ``kill -9`` would: the buffer
fsyncs each put, the frontier flushes each line) while groups are in flight: one with no episode in
the buffer yet, one with one of its two, and after the learner consumed a batch. The second run
recovers the buffer from its log and the frontier from its file, finishes exactly the missing
episodes under the same group ids, then carries on with the next tasks. The audit: every task
drawn has exactly ``group_size`` episodes in the buffer, the tasks drawn are contiguous, and the
buffer's accounting identity holds.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import agentrl
from agentrl.buffer import Buffer, BufferConfig, Sample
from agentrl.env.registry import unregister
from agentrl.rollout.episode import EpisodeResult
from agentrl.rollout.frontier import TaskFrontier
from agentrl.rollout.orchestrator import Orchestrator

G = 2


@agentrl.environment("frontier-count")
class Counting(agentrl.ToolEnv):
    def tasks(self, split="train"):
        for i in range(1000):
            yield {"id": f"t{i}", "question": str(i)}

    async def reward(self, task, answer):
        return 0.0


class Producer:
    """Episodes that finish at once, except those of ``hold``: task id -> how many of its group's
    episodes finish before the rest hang (in flight when the rollout stops)."""

    def __init__(self, hold: dict[str, int] | None = None) -> None:
        self.hold = dict(hold or {})
        self.played: Counter[str] = Counter()
        self.hanging = 0

    async def __call__(self, task: dict[str, Any], group_id: str) -> EpisodeResult:
        self.played[task["id"]] += 1
        if task["id"] in self.hold:
            if self.hold[task["id"]] <= 0:
                self.hanging += 1
                await asyncio.Event().wait()
            self.hold[task["id"]] -= 1
        episode = uuid.uuid4().hex
        reward = float(self.played[task["id"]] % 2)
        sample = Sample(
            token_ids=list(range(8)),
            loss_mask=[0] * 4 + [1] * 4,
            logprobs=[0.0] * 4 + [-0.5] * 4,
            versions=[-1] * 4 + [0] * 4,
            episode_id=episode,
            group_id=group_id,
            env="frontier-count",
            reward=reward,
        )
        return EpisodeResult(episode_id=episode, group_id=group_id, env="frontier-count", task_id=task["id"],
                             reward=reward, terminated=True, samples=[sample])


def _orchestrator(producer: Producer, buf: Buffer, run_dir: Path, max_episodes: int = 0) -> Orchestrator:
    return Orchestrator(
        producer,
        buf,
        env_name="frontier-count",
        group_size=G,
        max_concurrency=8,
        run_dir=run_dir,
        max_episodes=max_episodes,
        frontier=TaskFrontier(run_dir / "rollout_frontier.jsonl"),
    )


async def _until(cond: Any, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_a_stopped_rollout_resumes_its_groups_and_its_task_stream_exactly_once(tmp_path: Path) -> None:
    cfg = BufferConfig(path=str(tmp_path / "buffer"), batch_size=4, max_staleness=1000, group_size=G)

    async def first_run() -> dict[str, str]:
        buf = Buffer(cfg)
        producer = Producer(hold={"t3": 1, "t5": 0})  # t3: one of two in the buffer; t5: none
        orch = _orchestrator(producer, buf, tmp_path)
        task = asyncio.create_task(orch.run())
        await _until(lambda: producer.hanging == 3 and orch.counters["episodes"] >= 12)
        batch = await buf.get_batch(0)  # the learner takes a batch and acks it
        assert batch is not None and buf.ack(batch.batch_id)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        open_groups = {orch.frontier.open[g][1]["id"]: g for g in orch.frontier.open}
        buf.close()
        return open_groups

    async def second_run() -> tuple[Producer, Orchestrator, Buffer]:
        buf = Buffer(cfg)  # recovered from its log
        producer = Producer()
        orch = _orchestrator(producer, buf, tmp_path, max_episodes=12)
        await orch.run()
        return producer, orch, buf

    try:
        open_before = asyncio.run(first_run())
        assert {"t3", "t5"} <= set(open_before)
        producer, orch, buf = asyncio.run(second_run())
    finally:
        unregister("frontier-count")

    # only what the buffer lacked was played again, under the groups' own ids
    assert producer.played["t3"] == 1 and producer.played["t5"] == 2
    assert orch.resumed["groups"] >= 2
    lines = [json.loads(x) for x in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    per_task = Counter(line["task_id"] for line in lines)
    drawn = sorted(int(t[1:]) for t in per_task)
    assert drawn == list(range(len(drawn))), "a task was skipped"
    assert set(per_task.values()) == {G}, {t: n for t, n in per_task.items() if n != G}
    groups = {line["group_id"] for line in lines if line["task_id"] in ("t3", "t5")}
    assert groups == {open_before["t3"], open_before["t5"]}
    assert orch.frontier.cursor == len(drawn) and not orch.frontier.open
    stats = buf.stats()
    assert stats["identity_holds"] and stats["produced"] == len(lines)
    assert stats["dropped_by_reason"] == {}
    buf.close()


def test_the_frontier_file_survives_a_torn_line_and_a_fresh_run_forgets_it(tmp_path: Path) -> None:
    path = tmp_path / "rollout_frontier.jsonl"
    f = TaskFrontier(path)
    f.start("g0", 0, {"id": "t0"})
    f.start("g1", 1, {"id": "t1"})
    f.finish("g0")
    f.close()
    with open(path, "a") as out:
        out.write('{"end": "g1"')  # a power loss in the middle of a line
    again = TaskFrontier(path)
    assert again.cursor == 2 and list(again.open) == ["g1"] and again.open["g1"] == (1, {"id": "t1"})
    again.close()
    other = TaskFrontier(path, stream="another environment")  # not this stream's: not resumed
    assert other.cursor == 0 and not other.open
    other.close()
    fresh = TaskFrontier(path, fresh=True)
    assert fresh.cursor == 0 and not fresh.open
    fresh.close()


def test_a_frontier_line_the_full_disk_refuses_is_said_and_left_out_whole(tmp_path: Path, caplog) -> None:
    """A line that does not fit (``/dev/full``: every write is ENOSPC) is not written, the rollout
    goes on, the log says which file lost it; the file keeps only whole lines."""
    import os

    path = tmp_path / "rollout_frontier.jsonl"
    f = TaskFrontier(path)
    f.start("g0", 0, {"id": "t0"})
    kept = f._fd
    f._fd = os.open("/dev/full", os.O_WRONLY | os.O_APPEND)
    with caplog.at_level("WARNING"):
        f.start("g1", 1, {"id": "t1"})  # no exception: the rollout goes on
    assert f.cursor == 2 and list(f.open) == ["g0", "g1"]
    assert f"task frontier {path}: a line not written" in caplog.text
    os.close(f._fd)
    f._fd = kept
    f.finish("g0")
    f.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]  # whole lines only
    assert [r.get("start") or r.get("end") for r in lines[1:]] == ["g0", "g0"]
    again = TaskFrontier(path)  # the lost start: a restart draws task 1 again, nothing else lost
    assert again.cursor == 1 and not again.open
    again.close()
