"""straggler_roles without an engine: three roles play each episode through a stand-in chat client
(a scripted worker), each role's reward follows its rule, every role waits on log-normal tool
latency, and the latency is heavy-tailed (p99/median about 20 at the default sigma)."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any

import agentrl
from agentrl.rollout.config import EpisodeLimits
from agentrl.rollout.episode import EpisodeResult, run_episode
from agentrl.rollout.orchestrator import Orchestrator
from agentrl.router.sessions import SessionSummary
from environments.straggler_roles import StragglerRolesEnv

TASK = {"id": "t", "keys": ["k11", "k22"], "values": [3, 4], "latency_seed": 7}


class Scripted:
    """A chat client standing in for the router: the planner names the keys, the worker calls the
    tool once per key then answers ``answer``, the reviewer says ``verdict``."""

    model_name = "m"

    def __init__(self, answer: str = "The sum is 7", verdict: str = "It is 7") -> None:
        self.answer, self.verdict = answer, verdict
        self.calls: dict[str, int] = {}

    async def begin(self, session_id: str, **meta: Any) -> None:
        pass

    async def chat(self, body: dict[str, Any], session_id: str | None = None) -> dict[str, Any]:
        role = (session_id or "").rsplit(".", 1)[-1]
        i = self.calls[role] = self.calls.get(role, -1) + 1
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        if role == "planner":
            message["content"] = "look up 11, then 22"
        elif role == "worker" and i < len(TASK["keys"]):  # one lookup per key, then the answer
            message["tool_calls"] = [{"id": f"c{i}", "type": "function",
                                      "function": {"name": "lookup", "arguments": "{}"}}]
        elif role == "worker":
            message["content"] = self.answer
        else:
            message["content"] = self.verdict
        return {"choices": [{"message": message, "token_ids": [1], "finish_reason": "stop"}],
                "agentrl": {"session_id": session_id, "call_index": i, "versions": [[0]]}}

    async def end(self, session_id: str) -> SessionSummary | None:
        return SessionSummary(session_id, [])


def play(client: Scripted) -> Any:
    config = {"latency_median_s": 0.001, "latency_sigma": 1.3, "max_keys": 8}
    return asyncio.run(run_episode(client, "straggler_roles", TASK, group_id="g", env_config=config,
                                   limits=EpisodeLimits(max_turns=8 + 3)))


def test_three_roles_play_each_episode_and_each_role_is_rewarded_by_its_own_rule() -> None:
    client = Scripted()
    ep = play(client)
    assert ep.error is None and ep.terminated and ep.turns == len(TASK["keys"]) + 3
    assert client.calls == {"planner": 0, "worker": 2, "reviewer": 0}  # last call index per role
    assert ep.info["role_rewards"] == {"planner": 1.0, "worker": 2.0, "reviewer": 1.0}
    # one tool wait for the planner and the reviewer, one per key for the worker
    assert len(ep.info["tool_s"]) == len(TASK["keys"]) + 2 and set(ep.info["role_tool_s"]) == set(
        StragglerRolesEnv.roles)
    nodes = ep.info["graph"]["nodes"]
    assert [n["role"] for n in nodes] == ["planner", "worker", "worker", "worker", "reviewer"]


def test_a_sum_off_by_some_earns_less_the_further_off_and_nothing_without_a_number() -> None:
    ep = play(Scripted(answer="The sum is 8", verdict="No: 3 + 4 = 7"))
    assert ep.info["role_rewards"] == {"planner": 1.0, "worker": 1.5, "reviewer": 1.0}
    assert not ep.info["solved"]
    ep = play(Scripted(answer="The sum is 10", verdict="I cannot tell"))
    assert ep.info["role_rewards"] == {"planner": 1.0, "worker": 1.25, "reviewer": 0.0}


def test_tool_latency_is_log_normal_with_p99_about_20x_the_median() -> None:
    env = agentrl.make("straggler_roles", num_test=5000)
    waits = sorted(w for task in env.tasks("test") for w in env.drawn_waits(task))  # ~17,000
    ratio = waits[int(len(waits) * 0.99)] / waits[len(waits) // 2]
    assert len(waits) > 15_000 and 17 < ratio < 24  # exp(1.3 x 2.326) = 20.6
    assert abs(waits[len(waits) // 2] - env.latency_median_s) < 0.02
    # an episode waits exactly what its task's seed draws (what benchmarks count for cut-off episodes)
    ep = play(Scripted())
    drawn = agentrl.make("straggler_roles", latency_median_s=0.001, latency_sigma=1.3).drawn_waits(TASK)
    assert ep.info["tool_s"] == [round(w, 4) for w in drawn]
    assert list(env.tasks("test")) == list(env.tasks("test"))
    assert max(len(t["keys"]) for t in env.tasks("test")) <= env.max_keys


def test_the_roles_are_three_and_bound_to_the_default_policy_unless_the_run_binds_them() -> None:
    assert StragglerRolesEnv.roles == ("planner", "worker", "reviewer")
    ep = play(Scripted())
    assert {n["sampler"] for n in ep.info["graph"]["nodes"]} == {"policy:"}


class _Buffer:
    async def wait_for_room(self, in_flight: int, timeout_s: float) -> int:
        return 1

    async def put(self, samples: list[Any]) -> None:
        pass


def test_the_sync_baseline_starts_one_batch_of_samples_per_barrier_three_per_episode() -> None:
    started: list[str] = []

    async def episode(task: dict[str, Any], group_id: str) -> EpisodeResult:
        started.append(group_id)
        return EpisodeResult(episode_id="e", group_id=group_id, env="straggler_roles", task_id=task["id"],
                             terminated=True)

    async def main() -> None:
        # the learner never publishes (policy_version stays 0): one barrier only
        orch = Orchestrator(episode, _Buffer(), env_name="straggler_roles", group_size=4, max_concurrency=64,
                            sync=True, batch_size=24, policy_version=lambda: 0)
        run = asyncio.create_task(orch.run())
        await asyncio.sleep(0.3)
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run

    asyncio.run(main())
    # 24 samples: two groups of four episodes, three samples (roles) each; not six groups
    assert len(started) == 8 and len(set(started)) == 2


def test_admission_counts_the_samples_an_episode_in_flight_will_make() -> None:
    """Three trained roles: a group of four episodes asks for room for 12 samples, not 4; once
    episodes have finished, at the mean they made (here two samples each: one role left untrained)."""
    asked: list[int] = []

    class Sink(_Buffer):
        async def wait_for_room(self, in_flight: int, timeout_s: float) -> int:
            asked.append(in_flight)
            return 1 if len(asked) == 1 else 0  # room for the first group only

    async def episode(task: dict[str, Any], group_id: str) -> EpisodeResult:
        made = [SimpleNamespace(sample_id=f"{group_id}-{i}") for i in (0, 1)]
        return EpisodeResult(episode_id="e", group_id=group_id, env="straggler_roles", task_id=task["id"],
                             terminated=True, samples=made)  # type: ignore[arg-type]

    async def main() -> Orchestrator:
        orch = Orchestrator(episode, Sink(), env_name="straggler_roles", group_size=4, max_concurrency=64)
        run = asyncio.create_task(orch.run())
        while orch.counters["episodes"] < 4:
            await asyncio.sleep(0.01)
        seen = len(asked)
        while len(asked) < seen + 2:  # asks made after the group finished
            await asyncio.sleep(0.01)
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run
        return orch

    orch = asyncio.run(main())
    assert orch.samples_per_episode == 3  # straggler_roles declares three roles, none bound
    # before any episode finished: the group about to start, 4 episodes x 3 samples (minus one: the
    # rule is room > 0 for the group's last sample)
    assert asked[0] == 4 * 3 - 1
    # the first group's four finished at 2 samples each: the next group of four at that mean
    assert asked[-1] == 4 * 2 - 1
    assert orch.counters["samples"] == 8 and orch.started == 4


def test_serve_expects_one_sample_per_trained_role() -> None:
    from agentrl.rollout.config import RoleBinding
    from agentrl.rollout.orchestrator import expected_samples

    assert expected_samples("straggler_roles", {}) == 3
    frozen = {"reviewer": RoleBinding(frozen=True)}
    assert expected_samples("straggler_roles", {}, lambda r: r not in frozen or frozen[r].trained) == 2
    assert expected_samples("straggler", {}) == 1
