"""The straggler environment's workload, and the orchestrator's synchronous baseline mode."""

from __future__ import annotations

import asyncio
import random
import statistics
from types import SimpleNamespace

import agentrl
from agentrl.rollout.episode import EpisodeLimits, EpisodeResult  # noqa: F401 - EpisodeLimits used below
from agentrl.rollout.orchestrator import Orchestrator

CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "k1"}}\n</tool_call>'


def test_straggler_latencies_are_heavy_tailed():
    env = agentrl.make("straggler", latency_median_s=0.2, latency_sigma=1.3)
    env.rng = random.Random(7)
    xs = sorted(env.latency_s() for _ in range(50_000))
    median, p99 = xs[len(xs) // 2], xs[int(len(xs) * 0.99)]
    assert abs(median - 0.2) < 0.01
    assert p99 / median >= 19.0


def test_straggler_episodes_vary_in_length_and_are_deterministic():
    env = agentrl.make("straggler", max_keys=8)
    tasks = list(env.tasks("train"))[:2000]
    counts = [len(t["keys"]) for t in tasks]
    assert min(counts) == 1 and max(counts) == 8
    assert statistics.median(counts) == 1  # most are short, a few are many times longer
    assert tasks == list(agentrl.make("straggler", max_keys=8).tasks("train"))[:2000]
    assert not {t["id"] for t in tasks} & {t["id"] for t in env.tasks("test")}


def test_straggler_episode_lasts_one_turn_per_key_plus_the_answer():
    env = agentrl.make("straggler", latency_median_s=0.0)
    task = next(t for t in env.tasks() if len(t["keys"]) == 3)

    async def play(replies):
        await env.reset(task)
        results = [await env.step({"role": "assistant", "content": r}) for r in replies]
        return results

    total = sum(task["values"])
    results = asyncio.run(play([CALL, "no call", CALL, f"The sum is {total}"]))
    assert [r.terminated for r in results] == [False, False, False, True]
    assert results[0].messages[0]["role"] == "tool"
    assert results[1].messages[0]["role"] == "user"  # no call: the value is told, the turn still costs
    assert results[-1].reward == 2 / 3 + 1.0

    results = asyncio.run(play(["?", "?", "?", "no idea"]))
    assert results[-1].terminated and results[-1].reward == 0.0


class _Buffer:
    def __init__(self):
        self.samples = 0

    async def wait_for_room(self, in_flight, timeout_s):
        return 1

    async def put(self, samples):
        self.samples += len(samples)


def test_sync_mode_starts_a_batch_only_after_the_engines_serve_new_weights():
    """The synchronous baseline: a batch runs to its slowest episode, then waits for version + 1."""
    pool = SimpleNamespace(version=0)
    starts: list[tuple[int, float]] = []  # (pool version when the episode started, time)
    ends: list[float] = []

    async def episode(task, group_id):
        loop = asyncio.get_running_loop()
        starts.append((pool.version, loop.time()))
        await asyncio.sleep(random.random() * 0.05)
        ends.append(loop.time())
        return EpisodeResult(
            episode_id="e", group_id=group_id, env="straggler", task_id=task["id"], terminated=True
        )

    async def learner():
        for _ in range(3):
            while len(ends) < 8 * (pool.version + 1):  # a whole batch of 8 has finished
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)  # train + publish
            pool.version += 1

    async def main():
        orch = Orchestrator(episode, _Buffer(), env_name="straggler", env_config={"latency_median_s": 0.0},
                            group_size=4, max_concurrency=64, max_episodes=24, sync=True, batch_size=8,
                            policy_version=lambda: pool.version)
        await asyncio.gather(orch.run(), learner())
        return orch

    orch = asyncio.run(main())
    assert orch.counters["episodes"] == 24
    by_version: dict[int, list[float]] = {}
    for v, t in starts:
        by_version.setdefault(v, []).append(t)
    assert sorted(by_version) == [0, 1, 2] and all(len(ts) == 8 for ts in by_version.values())
    # No episode of batch k+1 started before every episode of batch k had ended.
    for v in (1, 2):
        assert min(by_version[v]) >= sorted(ends)[8 * v - 1]
