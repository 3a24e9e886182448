"""``serve.max_episodes`` under ``--ray``: split over the rollout workers, and what a dead worker
started is spent. The supervision loop runs against stand-in actor handles (Ray itself, with real
actors, is in tests/test_ray_cluster.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from agentrl import config as C
from agentrl.serve.ray import RayCluster, split_episodes


def test_max_episodes_is_split_into_whole_groups_and_no_limit_stays_no_limit():
    assert split_episodes(0, 4, 3) == [None, None, None]
    assert split_episodes(40, 4, 2) == [20, 20]
    assert split_episodes(20, 4, 3) == [8, 8, 4]  # 5 groups: the first two workers take one more
    assert split_episodes(18, 4, 2) == [12, 8]  # 4.5 groups round up to 5, as one process starts them
    assert split_episodes(4, 4, 3) == [4, 0, 0]  # one group: the other workers get nothing to play
    assert sum(split_episodes(1000, 8, 7)) == 1000


class _Call:
    def __init__(self, fut: concurrent.futures.Future) -> None:
        self._fut = fut

    def future(self) -> concurrent.futures.Future:
        return self._fut


class _Method:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class StandInWorker:
    """A rollout worker actor handle: the first life dies after starting ``dies_after`` episodes."""

    def __init__(self, cluster: RayCluster, i: int, dies_after: int | None) -> None:
        self.runs: list[int] = []
        self.dies_after = dies_after

        def run(max_episodes: int = 0) -> _Call:
            self.runs.append(max_episodes)
            fut: concurrent.futures.Future = concurrent.futures.Future()
            if self.dies_after is not None and len(self.runs) == 1:
                cluster.worker_info[i] = {"worker": f"worker-{i}", "started": self.dies_after}
                fut.set_exception(cluster.ray.exceptions.RayActorError())
            else:
                fut.set_result(None)
            return _Call(fut)

        def ping() -> _Call:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            fut.set_result(1)  # Ray restarted it: the same handle answers again
            return _Call(fut)

        self.run, self.ping = _Method(run), _Method(ping)


def test_a_worker_that_dies_plays_only_what_is_left_of_its_share(tmp_path):
    cfg = C.load(C.ServeConfig, None, ["max_episodes=20", "env.group_size=4", "ray.workers=3"])
    cluster = RayCluster(cfg, "model", tmp_path)
    cluster.budgets = split_episodes(cfg.max_episodes, cfg.env.group_size, 3)  # [8, 8, 4]
    cluster.worker_info = [{"worker": f"worker-{i}"} for i in range(3)]
    cluster.workers = [StandInWorker(cluster, 0, dies_after=4), StandInWorker(cluster, 1, dies_after=8),
                       StandInWorker(cluster, 2, dies_after=None)]

    async def go() -> None:
        await asyncio.gather(*(cluster._keep_running(i, "http://serve", "token") for i in range(3)))

    asyncio.run(go())
    assert cluster.workers[0].runs == [8, 4]  # died after 4 of its 8: its next life may start 4
    assert cluster.workers[1].runs == [8]  # died having started all 8: not run again
    assert cluster.workers[2].runs == [4]
    assert cluster.restarts["workers"] == 2 and cluster.restarts["respawned"] == 0


def test_without_max_episodes_a_dead_worker_runs_again_without_a_limit(tmp_path):
    cfg = C.load(C.ServeConfig, None, ["ray.workers=1"])
    cluster = RayCluster(cfg, "model", tmp_path)
    cluster.budgets = split_episodes(cfg.max_episodes, cfg.env.group_size, 1)
    cluster.worker_info = [{"worker": "worker-0"}]
    cluster.workers = [StandInWorker(cluster, 0, dies_after=100)]
    asyncio.run(cluster._keep_running(0, "http://serve", "token"))
    assert cluster.workers[0].runs == [0, 0]
