"""``agentrl serve --ray``: on a simulated two-node Ray cluster, a real vLLM engine actor on one node
and two rollout worker actors on the other, each calling the engine through a router of its own
(whose pool its concurrency controller reads), run episodes into serve's buffer; a rollout worker killed
with SIGKILL is restarted and episodes keep arriving; closing serve leaves no engine process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agentrl import config as C
from tests.conftest import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LOOPBACK = "127.0.0.1"


async def until(what: str, check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.5)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie still answers kill(0); its state says it is dead
        return Path(f"/proc/{pid}/stat").read_text().split()[2] in ("Z", "X")
    except OSError:
        return True


def test_serve_on_a_two_node_ray_cluster_runs_episodes_and_survives_a_killed_rollout_worker(
        tmp_path: Path, tiny_tools_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Keep every Ray address on loopback (tests talk to nothing else): Ray otherwise swaps
    # 127.0.0.1 for the machine's outward IP, where the simulated nodes do not listen.
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    from agentrl.serve import Serve

    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"head_node": 1},
            "node_ip_address": LOOPBACK,
            "include_dashboard": False,
        },
    )
    cluster.add_node(num_cpus=2, resources={"worker_node": 1}, node_ip_address=LOOPBACK)
    cluster.wait_for_nodes()
    cfg = C.load(
        C.ServeConfig,
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            f"router.port={free_port()}",
            f"engine.base_port={free_port()}",
            "env.name=guess_number",
            "env.group_size=2",
            "env.max_turns=2",
            "env.max_tokens=16",
            "buffer.batch_size=4",
            "buffer.max_staleness=10",
            "buffer.durable=false",
            "engine.max_model_len=2048",
            f"ray.address={cluster.address}",
            f"ray.engine_host={LOOPBACK}",
            "ray.engine_cpus=1",
            "ray.engine_resources={head_node = 1}",
            "ray.workers=2",
            "ray.worker_cpus=1",
            "ray.worker_resources={worker_node = 0.5}",
            "ray.worker_concurrency=4",
            "env.concurrency.controller=true",
        ],
    )
    facts: dict[str, object] = {}

    async def scenario() -> None:
        serve = Serve(cfg)
        try:
            await serve.start()
            cl = serve.cluster
            nodes = {n["NodeID"]: n for n in ray.nodes()}
            engine_node = nodes[cl.engine_info[0]["node_id"]]
            assert engine_node["Resources"].get("head_node") == 1  # placed on the "head machine"
            facts["engine_pid"] = cl.engine_info[0]["engine_pid"]
            # an episode batch, end to end: worker actors -> router (sessions) -> engine -> buffer
            await until("samples from both workers", lambda: serve.buffer.stats()["produced"] >= 8 and all(
                (w.get("episodes") or 0) >= 1 for w in cl.worker_info), 300)
            for w in cl.worker_info:
                assert nodes[w["node_id"]]["Resources"].get("worker_node") == 1  # the other "machine"
            # the workers' episode lines reach serve's episodes.jsonl (sent every 2 s)
            log_path = tmp_path / "run" / "episodes.jsonl"

            def logged_workers() -> set[str]:
                if not log_path.exists():
                    return set()
                return {json.loads(x).get("worker") for x in log_path.read_text().splitlines() if x.strip()}

            await until(
                "episode lines from both workers", lambda: {"worker-0", "worker-1"} <= logged_workers(), 60
            )
            assert all("reward" in json.loads(x) for x in log_path.read_text().splitlines() if x.strip())
            batch = await serve.buffer.get_batch(0, timeout_s=30)
            assert batch is not None and len(batch.samples) == 4
            # the engine's exact tokens
            assert any(sum(s.loss_mask) > 0 and len(s.logprobs) for s in batch.samples)
            assert serve.buffer.ack(batch.batch_id)
            # each worker's own router made its calls: none crossed serve's
            await until("the workers' router counts", lambda: all("router" in w for w in cl.worker_info), 30)
            assert sum(w["router"]["calls"] for w in cl.worker_info) >= 8
            assert all(w["router"]["calls"] >= 1 for w in cl.worker_info)
            assert serve.router.counters["calls"] == 0
            # and each worker's concurrency controller reads the engine through that router's pool
            await until("the workers' controllers to read the engine", lambda: all(
                not w["concurrency"]["fallback"] and w["concurrency"]["engines"] for w in cl.worker_info), 30)
            assert all(w["concurrency"]["max"] == 4 for w in cl.worker_info)  # its share, not 64
            # finished episodes closed theirs; only in-flight ones stay
            assert len(serve.router.sessions) <= 8

            victim = cl.worker_info[0]["pid"]
            os.kill(victim, signal.SIGKILL)
            await until("the restart to be noticed", lambda: cl.restarts["workers"] >= 1, 120)
            before = serve.buffer.stats()["produced"]

            async def learner() -> None:
                # Consume as a learner would: with nothing consumed, the surviving worker can fill the
                # admission bound before the restarted one starts, and then no worker gets room.
                version = 0
                while True:
                    got = await serve.buffer.get_batch(version, timeout_s=5)
                    if got is not None:
                        serve.buffer.ack(got.batch_id)

            consumer = asyncio.create_task(learner())
            try:
                await until(
                    "the restarted worker to play episodes",
                    lambda: (
                        cl.worker_info[0].get("pid") not in (None, victim)
                        and (cl.worker_info[0].get("episodes") or 0) >= 1
                    ),
                    300,
                )
                await until(
                    "more samples after the kill", lambda: serve.buffer.stats()["produced"] > before, 120
                )
            finally:
                consumer.cancel()
            status = serve.status()
            assert status["rollout"]["restarts"]["workers"] >= 1 and len(status["rollout"]["workers"]) == 2
            assert status["rollout"]["episodes"] >= 8
        finally:
            await serve.close()

    try:
        asyncio.run(scenario())
    finally:
        cluster.shutdown()
    engine_pid = facts["engine_pid"]
    assert isinstance(engine_pid, int)
    deadline = time.monotonic() + 30
    while not gone(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert gone(engine_pid), "the engine outlived serve"
