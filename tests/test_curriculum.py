"""The online curriculum (agentrl/rollout/curriculum.py) without an engine: its pools, its draws,
its state across a restart, its config checks, and the orchestrator playing through it."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agentrl.errors import ConfigError
from agentrl.rollout.config import CurriculumConfig
from agentrl.rollout.curriculum import Curriculum
from agentrl.rollout.episode import EpisodeResult
from agentrl.rollout.orchestrator import Orchestrator
from agentrl.serve.config import ServeConfig

G = 4


def stream() -> Any:
    """Tasks whose pass rate is in the task: index i solved with probability ``p``."""
    for i in itertools.count():
        yield i, {"id": f"t{i}", "p": (0.0, 0.5, 1.0, 0.25)[i % 4]}


def play(cur: Curriculum, new: Any, groups: int, rng: random.Random) -> list[int]:
    """Draw ``groups`` groups and finish each at once, its episodes succeeding as the task says;
    the stream indices drawn."""
    drawn = []
    for g in range(groups):
        index, task = cur.draw(lambda: next(new))
        gid = f"g{cur.draws}-{g}"
        cur.started(gid, index, task)
        for _ in range(G):
            ok = rng.random() < task["p"]
            cur.finished_episode(gid, ok, float(ok))
        drawn.append(index)
    return drawn


def test_pools_follow_pass_rates_and_a_task_retires_after_max_plays() -> None:
    cur = Curriculum(CurriculumConfig(enabled=True, max_plays=3), None, G)
    play(cur, stream(), 200, random.Random(0))
    st = cur.status()
    assert st["draws"] == 200 and sum(st["drawn_by_pool"].values()) == 200
    for index, stats in cur.tasks.items():
        assert stats.plays <= 3
        p = (0.0, 0.5, 1.0, 0.25)[index % 4]
        if stats.episodes >= 8 and p in (0.0, 1.0):
            assert cur.pool_of(stats) in ("hard", "easy", None)
    # a task never solved and one always solved are never "learnable"; tasks near one half are
    # replayed most: their plays outnumber the always-solved tasks' plays
    plays = {p: [s.plays for i, s in cur.tasks.items() if (0.0, 0.5, 1.0, 0.25)[i % 4] == p]
             for p in (0.0, 0.5, 1.0)}
    assert sum(plays[0.5]) / len(plays[0.5]) > sum(plays[1.0]) / len(plays[1.0])
    # every finished group of an all-or-nothing task had no reward spread
    assert st["uniform_groups"] >= sum(s.plays for i, s in cur.tasks.items() if (0.0, 0.5, 1.0, 0.25)[i % 4]
                                       in (0.0, 1.0))
    assert 0 < st["zero_spread_share"] < 1


def test_unseen_tasks_come_first_and_replays_only_after_a_group_finished() -> None:
    cur = Curriculum(CurriculumConfig(enabled=True), None, G)
    new = stream()
    index, task = cur.draw(lambda: next(new))
    assert index == 0 and cur.drawn_by_pool["new"] == 1
    cur.started("a", index, task)  # running, nothing known: not replayable
    assert cur.pool_of(cur.tasks[0]) is None
    for _ in range(10):
        i, t = cur.draw(lambda: next(new))
        cur.started(f"b{i}", i, t)
    assert cur.drawn_by_pool["new"] == 11  # nothing finished: nothing to replay


def test_a_restart_carries_on_with_the_same_statistics_and_the_same_draws(tmp_path: Path) -> None:
    cfg = CurriculumConfig(enabled=True, seed=3)
    whole = Curriculum(cfg, tmp_path / "a.jsonl", G)
    drawn_whole = play(whole, stream(), 60, random.Random(1))

    # the same run, stopped after 25 groups and read back from its file
    first = Curriculum(cfg, tmp_path / "b.jsonl", G)
    new, rng = stream(), random.Random(1)
    drawn = play(first, new, 25, rng)
    first.close()
    again = Curriculum(cfg, tmp_path / "b.jsonl", G, fresh=False)
    assert again.draws == 25 and again.status() == first.status()
    assert {i: (s.plays, s.episodes, s.successes) for i, s in again.tasks.items()} == {
        i: (s.plays, s.episodes, s.successes) for i, s in first.tasks.items()}
    drawn += play(again, new, 35, rng)
    assert drawn == drawn_whole
    assert again.status() == whole.status()
    # fresh: an earlier run's file is forgotten
    assert Curriculum(cfg, tmp_path / "b.jsonl", G, fresh=True).draws == 0


def test_a_group_open_at_a_crash_keeps_its_episodes_and_counts_once(tmp_path: Path) -> None:
    cfg = CurriculumConfig(enabled=True)
    cur = Curriculum(cfg, tmp_path / "c.jsonl", G)
    new = stream()
    index, task = cur.draw(lambda: next(new))
    cur.started("g", index, task)
    cur.finished_episode("g", True, 1.0)
    cur.finished_episode("g", False, 0.0)
    cur.close()
    back = Curriculum(cfg, tmp_path / "c.jsonl", G, fresh=False)
    back.started("g", index, task)  # the frontier resumes the group: its two missing episodes
    back.finished_episode("g", True, 1.0)
    back.finished_episode("g", True, 1.0)
    stats = back.tasks[index]
    assert (stats.plays, stats.episodes, stats.successes, stats.open_rewards) == (1, 4, 3, {})


def test_episodes_stored_before_a_kill_but_not_counted_are_noted_and_the_group_still_closes(
        tmp_path: Path) -> None:
    cfg = CurriculumConfig(enabled=True)
    cur = Curriculum(cfg, tmp_path / "c.jsonl", G)
    new = stream()
    drawn = [cur.draw(lambda: next(new)) for _ in range(2)]
    for gid, (index, task) in zip(("a", "b"), drawn, strict=True):
        cur.started(gid, index, task)
        cur.finished_episode(gid, True, 1.0)
    cur.close()  # the kill: "a" had 3 episodes stored, "b" all 4, each with one line written
    back = Curriculum(cfg, tmp_path / "c.jsonl", G, fresh=False)
    back.stored("a", 3)
    back.stored("b", 4)  # whole in the buffer: the rollout does not start it again
    back.stored("a", 3)  # asked twice (a second restart): noted once
    assert back.uncounted_episodes == 5
    assert "b" not in back._groups and "b" not in back.tasks[drawn[1][0]].open_rewards
    back.started("a", *drawn[0])  # its one missing episode
    back.finished_episode("a", False, 0.0)
    assert back.tasks[drawn[0][0]].open_rewards == {} and back._groups == {}
    back.close()
    again = Curriculum(cfg, tmp_path / "c.jsonl", G, fresh=False)  # the file says the same
    assert again.status()["uncounted_episodes"] == 5 and again._groups == {}
    assert again.status()["groups_finished"] == 2


def test_config_errors_are_clear() -> None:
    for bad, says in [({"hard": 0.9, "easy": 0.1}, "hard < easy"),
                      ({"weights": {"medium": 1.0}}, "unknown pool"),
                      ({"weights": {"new": 0.0}}, "new > 0"), ({"max_plays": 0}, "max_plays")]:
        cfg = ServeConfig()
        cfg.env.curriculum = CurriculumConfig(enabled=True, **bad)
        with pytest.raises(ConfigError, match=says):
            cfg.check()


def test_the_orchestrator_plays_through_the_curriculum_and_serve_turns_the_gate_on(tmp_path: Path) -> None:
    from agentrl.serve.build import buffer_config

    cfg = ServeConfig()
    cfg.env.curriculum.enabled = True
    assert buffer_config(cfg, tmp_path).drop_uniform_groups

    played: list[str] = []

    class Sink:
        async def wait_for_room(self, in_flight: int, timeout_s: float) -> int:
            return 1

        async def put(self, samples: list[Any]) -> int:
            return len(samples)

    rng = random.Random(0)

    async def episode(task: dict[str, Any], group_id: str) -> EpisodeResult:
        played.append(task["id"])
        won = rng.random() < (0.5 if int(task["id"].split("-")[1]) % 2 else 1.0)
        return EpisodeResult(episode_id=f"e{len(played)}", group_id=group_id, env="arithmetic",
                             task_id=task["id"], terminated=True, reward=float(won), info={"success": won},
                             samples=[SimpleNamespace(sample_id=f"s{len(played)}")])  # type: ignore[list-item]

    cur = Curriculum(CurriculumConfig(enabled=True), tmp_path / "curriculum.jsonl", G)

    async def main() -> Orchestrator:
        orch = Orchestrator(episode, Sink(), env_name="arithmetic", group_size=G, max_concurrency=8,
                            max_episodes=80, curriculum=cur)
        await asyncio.wait_for(orch.run(), timeout=60)
        return orch

    orch = asyncio.run(main())
    st = orch.status()["curriculum"]
    assert st["groups_finished"] == 20 and st["draws"] == 20
    assert st["drawn_by_pool"]["new"] < 20  # some groups replayed a task already played
    replayed = [i for i, s in cur.tasks.items() if s.plays > 1]
    assert replayed and all(s.episodes == s.plays * G for s in cur.tasks.values())
    assert len(played) == 80 and len(set(played)) < 20


def test_a_stopped_curriculum_rollout_resumes_with_frontier_buffer_and_statistics_agreeing(
        tmp_path: Path) -> None:
    """As tests/test_rollout_frontier.py, with the curriculum drawing: the rollout is stopped (files
    left as a kill -9 leaves them) with groups in flight, then started again on the same directory.
    Every group ends with exactly its G episodes in the buffer, the stream's new tasks are drawn
    once each and in order, replays are of tasks played before, and the curriculum's statistics read
    back from its file count exactly the episodes the buffer holds."""
    import uuid
    from collections import Counter

    import agentrl
    from agentrl.buffer import Buffer, BufferConfig, Sample
    from agentrl.env.registry import unregister
    from agentrl.rollout.frontier import TaskFrontier

    @agentrl.environment("curriculum-count")
    class Counting(agentrl.ToolEnv):
        def tasks(self, split: str = "train") -> Any:
            for i in range(1000):
                yield {"id": f"t{i}", "question": str(i)}

        async def reward(self, task: dict[str, Any], answer: str) -> float:
            return 0.0

    hang = asyncio.Event()

    class Producer:
        def __init__(self, hang_after: int) -> None:
            self.left, self.hanging = hang_after, 0

        async def __call__(self, task: dict[str, Any], group_id: str) -> EpisodeResult:
            if self.left <= 0:
                self.hanging += 1
                await hang.wait()
            self.left -= 1
            episode = uuid.uuid4().hex
            won = int(task["id"][1:]) % 3 == 0 or random.random() < 0.5  # some tasks easy, others not
            sample = Sample(token_ids=list(range(8)), loss_mask=[0] * 4 + [1] * 4,
                            logprobs=[0.0] * 4 + [-0.5] * 4, versions=[-1] * 4 + [0] * 4, episode_id=episode,
                            group_id=group_id, env="curriculum-count", reward=float(won))
            return EpisodeResult(episode_id=episode, group_id=group_id, env="curriculum-count",
                                 task_id=task["id"], reward=float(won), terminated=True, samples=[sample],
                                 info={"success": won})

    bcfg = BufferConfig(path=str(tmp_path / "buffer"), batch_size=8, max_staleness=1000, group_size=G)
    ccfg = CurriculumConfig(enabled=True, max_plays=3, seed=5)

    def orchestrator(producer: Producer, buf: Buffer, fresh: bool, max_episodes: int = 0) -> Orchestrator:
        return Orchestrator(producer, buf, env_name="curriculum-count", group_size=G, max_concurrency=8,
                            run_dir=tmp_path, max_episodes=max_episodes,
                            frontier=TaskFrontier(tmp_path / "rollout_frontier.jsonl", fresh=fresh),
                            curriculum=Curriculum(ccfg, tmp_path / "curriculum.jsonl", G, fresh=fresh))

    async def first_run() -> int:
        buf = Buffer(bcfg)
        producer = Producer(hang_after=70)
        orch = orchestrator(producer, buf, fresh=True)
        run = asyncio.create_task(orch.run())
        while producer.hanging < 6:
            await asyncio.sleep(0.01)
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        buf.close()
        assert orch.frontier is not None and orch.frontier.open  # groups were in flight
        return orch.curriculum.draws if orch.curriculum else 0

    async def second_run() -> tuple[Orchestrator, Buffer]:
        buf = Buffer(bcfg)
        orch = orchestrator(Producer(hang_after=10**6), buf, fresh=False, max_episodes=40)
        await asyncio.wait_for(orch.run(), timeout=60)
        return orch, buf

    try:
        random.seed(11)
        draws_before = asyncio.run(first_run())
        orch, buf = asyncio.run(second_run())
    finally:
        unregister("curriculum-count")
    cur = orch.curriculum
    assert cur is not None and cur.draws > draws_before
    lines = [json.loads(x) for x in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    per_group = Counter(line["group_id"] for line in lines)
    assert set(per_group.values()) == {G}, "a group lacks an episode or has one twice"
    # the stream's tasks: each drawn as new once, in order; replays only of tasks seen before
    draws = [json.loads(x) for x in (tmp_path / "curriculum.jsonl").read_text().splitlines() if '"draw"' in x]
    new = [d["i"] for d in draws if d["pool"] == "new"]
    assert new == list(range(len(new)))
    assert all(d["i"] < max(new) for d in draws if d["pool"] != "new")
    assert len([d for d in draws if d["pool"] != "new"]) > 0
    # the statistics, read back and carried on, count exactly the episodes the buffer and the log hold
    per_task = Counter(line["task_id"] for line in lines)
    assert {f"t{i}": s.episodes for i, s in cur.tasks.items() if s.episodes} == dict(per_task)
    assert sum(s.plays for s in cur.tasks.values()) == len(per_group)
    stats = buf.stats()
    assert stats["identity_holds"] and stats["produced"] == len(lines)
    buf.close()


def test_a_kill_between_a_draw_and_its_frontier_line_does_not_draw_that_task_again(tmp_path: Path) -> None:
    """The curriculum wrote its draw of the stream's task 0, the frontier never heard of the group:
    the restarted rollout goes on with task 1 (the stream's tasks are each drawn as new once)."""
    import uuid

    from agentrl.buffer import Buffer, BufferConfig, Sample
    from agentrl.rollout.frontier import TaskFrontier

    (tmp_path / "curriculum.jsonl").write_text(json.dumps({"draw": 0, "pool": "new", "i": 0}) + "\n")

    async def producer(task: dict[str, Any], group_id: str) -> EpisodeResult:
        episode = uuid.uuid4().hex
        sample = Sample(token_ids=list(range(8)), loss_mask=[0] * 4 + [1] * 4,
                        logprobs=[0.0] * 4 + [-0.5] * 4, versions=[-1] * 4 + [0] * 4, episode_id=episode,
                        group_id=group_id, env="arithmetic")
        return EpisodeResult(episode_id=episode, group_id=group_id, env="arithmetic",
                             task_id=str(task.get("id")), reward=0.0, terminated=True, samples=[sample])

    async def run() -> Orchestrator:
        buf = Buffer(BufferConfig(path=str(tmp_path / "buffer"), batch_size=8, max_staleness=1000,
                                  group_size=G))
        cur = Curriculum(CurriculumConfig(enabled=True), tmp_path / "curriculum.jsonl", G, fresh=False)
        orch = Orchestrator(producer, buf, env_name="arithmetic", group_size=G, max_concurrency=G,
                            run_dir=tmp_path, max_episodes=G, curriculum=cur,
                            frontier=TaskFrontier(tmp_path / "rollout_frontier.jsonl", fresh=False))
        try:
            await asyncio.wait_for(orch.run(), timeout=30)
        finally:
            buf.close()
        return orch

    orch = asyncio.run(run())
    draws = [json.loads(x) for x in (tmp_path / "curriculum.jsonl").read_text().splitlines() if '"draw"' in x]
    assert [(d["draw"], d["pool"], d["i"]) for d in draws] == [(0, "new", 0), (1, "new", 1)]
    assert orch.curriculum is not None and orch.curriculum.new_drawn == 2


def test_arithmetic_mixes_difficulty_by_operand_size_and_keeps_its_default_tasks() -> None:
    import itertools

    import agentrl

    default = list(itertools.islice(agentrl.make("arithmetic").tasks(), 20))
    assert all("digits" not in t for t in default)
    mixed = list(agentrl.make("arithmetic", digits=[1, 2, 4, 8]).tasks("test"))
    assert {t["digits"] for t in mixed} == {1, 2, 4, 8}
    for t in mixed:
        operands = [int(x) for x in t["question"][len("What is "):-1].split() if x.isdigit()]
        assert all(len(str(x)) == t["digits"] for x in operands), t
        assert eval(t["question"][len("What is "):-1]) == t["answer"]  # noqa: S307 - digits and + - *
    assert mixed == list(agentrl.make("arithmetic", digits=[1, 2, 4, 8]).tasks("test"))  # same seed, same
    for bad in ([], [0], [31]):
        with pytest.raises(ValueError, match="digits"):
            agentrl.make("arithmetic", digits=bad)


def test_torn_and_orphaned_lines_are_skipped_on_reading(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "curriculum.jsonl"
    cur = Curriculum(CurriculumConfig(enabled=True), path, G)
    play(cur, stream(), 3, random.Random(0))
    cur.close()
    with path.open("a") as f:  # a line about a task never seen, one that is not an object, one torn
        f.write('{"start": "x", "i": 999}\n12\n{"ep": "g1-0", "i"')
    back = Curriculum(CurriculumConfig(enabled=True), path, G, fresh=False)
    assert back.draws == 3 and back.status() == cur.status()
    assert "skipped 3 torn or orphaned line(s)" in caplog.text
