"""Sandboxes spread over two Docker engines (``sandbox.docker_hosts``): placement by load, and an
engine that dies mid-run taken out, its episodes failed as infrastructure errors while the run goes
on with the other, until it answers again.

The second engine is a real dockerd started here (its own data root, exec root, pid file and socket
under a temporary folder; no iptables, no bridge, as scripts/docker-up.sh starts the first) and
killed with SIGKILL, as a crashed host would be. The episodes are the ``shell`` environment's, played
by the built-in agent loop against a scripted stand-in for the router (no engine needed). Needs root,
dockerd and runc beside the first engine; skipped without them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import agentrl
from agentrl.errors import INFRASTRUCTURE
from agentrl.rollout import run_episode
from agentrl.sandbox import SandboxConfig, SandboxPool
from agentrl.sandbox import hosts as hosts_module
from agentrl.sandbox.hosts import DockerHosts
from agentrl.sandbox.types import SandboxHostDown
from tests.scripted_shell import TASK, GatedRouter, _bash

FIRST = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
def containers(address: str, instance: str) -> set[str]:
    out = subprocess.run(["docker", "-H", address, "ps", "-aq", "--no-trunc", "--filter",
                          f"label=agentrl.instance={instance}"], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


# --- the second engine ----------------------------------------------------------------------------

def _start_dockerd(root: Path) -> subprocess.Popen[bytes]:
    """dockerd with everything of its own under ``root``; returns once it answers."""
    address = f"unix://{root}/docker.sock"
    with open(root / "dockerd.log", "ab") as log:
        proc = subprocess.Popen(
            ["dockerd", "--iptables=false", "--ip-masq=false", "--bridge=none", "--storage-driver=overlay2",
             "--data-root", str(root / "data"), "--exec-root", str(root / "exec"),
             "--pidfile", str(root / "docker.pid"), "-H", address],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    for _ in range(300):  # a readiness wait (up to a minute on a loaded machine), not a measurement
        if subprocess.run(["docker", "-H", address, "version"], capture_output=True).returncode == 0:
            return proc
        if proc.poll() is not None:
            break
        subprocess.run(["sleep", "0.2"])
    proc.kill()
    proc.wait()
    tail = (root / "dockerd.log").read_text(errors="replace")[-2000:]
    pytest.fail(f"the second dockerd did not start:\n{tail}")


def _clean_engine_leftovers(root: Path) -> None:
    """What a killed dockerd leaves: containers still running under their shims (runc removes them),
    the shims and any containerd of its own (found by their command lines naming ``root``), mounts."""
    runc = ["runc", "--root", str(root / "exec" / "runtime-runc" / "moby")]
    listed = subprocess.run([*runc, "list", "-q"], capture_output=True, text=True)
    for cid in listed.stdout.split():
        subprocess.run([*runc, "delete", "--force", cid], capture_output=True)
    mine = str(root).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if mine in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue
    # A killed containerd may linger as a zombie until init reaps it; a dockerd started on the same
    # roots would take its pid file's zombie for a live containerd and wait for it in vain.
    (root / "exec" / "containerd" / "containerd.pid").unlink(missing_ok=True)
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
              if line.split()[1].startswith(str(root))]
    for mount in sorted(mounts, reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True)


@pytest.fixture
def second_engine() -> Iterator[SimpleNamespace]:
    """A second Docker engine on this machine, empty (the pool copies the image to it), removed with
    everything it ran however the test ends."""
    if os.geteuid() != 0 or not (shutil.which("dockerd") and shutil.which("runc")):
        pytest.skip("a second Docker engine needs root, dockerd and runc")
    if subprocess.run(["docker", "-H", FIRST, "version"], capture_output=True).returncode != 0:
        pytest.skip(f"no Docker engine answers at {FIRST} (bash scripts/docker-up.sh)")
    root = Path(tempfile.mkdtemp(prefix="agentrl-dh-", dir="/tmp"))  # short: socket paths are bounded
    engine = SimpleNamespace(root=root, address=f"unix://{root}/docker.sock", proc=None)
    try:
        engine.proc = _start_dockerd(root)
        yield engine
    finally:
        if engine.proc is not None and engine.proc.poll() is None:
            engine.proc.kill()
            engine.proc.wait()
        _clean_engine_leftovers(root)
        shutil.rmtree(root, ignore_errors=True)


# --- tests ----------------------------------------------------------------------------------------

@pytest.mark.docker
def test_a_pool_over_two_engines_rides_out_losing_one(second_engine: SimpleNamespace, caplog: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hosts_module, "PROBE_BACKOFF_S", (0.2, 1.0))  # a quick return in act 4
    second = second_engine.address
    cfg = SandboxConfig(backend="docker", docker_hosts=[FIRST, second], warm=0, max_concurrency=4,
                        max_reuses=0, memory_mb=256, pids=64)

    async def play(pool: SandboxPool, router: GatedRouter, n: int) -> list[Any]:
        return await asyncio.gather(*(run_episode(router, "shell", TASK, group_id=f"g{i}", sandbox_pool=pool)
                                      for i in range(n)))

    async def until_up(pool: SandboxPool, up: bool) -> None:
        for _ in range(600):  # a wait for the pool to notice (bounded), not a measurement
            if pool.stats()["hosts"][second]["up"] == up:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"the pool never saw {second} {'up' if up else 'down'}: {pool.stats()['hosts']}")

    async def body() -> None:
        async with SandboxPool(cfg, f"t-dh-{uuid.uuid4().hex[:8]}") as pool:
            assert isinstance(pool.backend, DockerHosts)
            # 1. four episodes at once are spread two and two, each engine running its own containers
            router = GatedRouter(hold=4)
            episodes = asyncio.ensure_future(play(pool, router, 4))
            await router.all_held.wait()
            on_first, on_second = containers(FIRST, pool.instance_id), containers(second, pool.instance_id)
            assert len(on_first) == len(on_second) == 2, (on_first, on_second)

            # 2. the second engine dies mid-episode: the pool takes it out by itself (its sandboxes'
            # streams end, and it answers no ping), the next calls into its sandboxes fail with
            # SandboxHostDown, and their episodes are sandbox (infrastructure) failures, not scored;
            # the two on the first engine finish and are rewarded
            os.kill(second_engine.proc.pid, signal.SIGKILL)
            await asyncio.to_thread(second_engine.proc.wait)
            await until_up(pool, False)
            router.release()
            first_round = await episodes
            lost = [ep for ep in first_round if ep.sandbox_id in on_second]
            kept = [ep for ep in first_round if ep.sandbox_id in on_first]
            assert len(lost) == len(kept) == 2
            for ep in lost:
                assert ep.error_kind == "sandbox" and ep.error_kind in INFRASTRUCTURE, ep.error
                assert ep.error.startswith("SandboxHostDown: ") and second in ep.error, ep.error
                assert ep.reward == 0.0 and all(s.error is not None for s in ep.samples)
            assert all(ep.error is None and ep.reward == 1.0 for ep in kept), [ep.error for ep in kept]
            assert any(f"Docker host {second} stopped answering" in r.getMessage() for r in caplog.records)

            # 3. the run goes on with the first engine alone: every episode plays and is rewarded
            second_round = await play(pool, GatedRouter(), 4)
            assert all(ep.error is None and ep.reward == 1.0 for ep in second_round), \
                [ep.error for ep in second_round]
            await pool.wait_idle()  # their sandboxes removed (max_reuses=0): both engines hold none
            assert pool.stats()["hosts"] == {FIRST: {"up": True, "sandboxes": 0},
                                             second: {"up": False, "sandboxes": 0}}

            # 4. the engine comes back: the probe finds it, and it takes sandboxes again
            _clean_engine_leftovers(second_engine.root)
            second_engine.proc = await asyncio.to_thread(_start_dockerd, second_engine.root)
            await until_up(pool, True)
            router = GatedRouter(hold=2)
            episodes = asyncio.ensure_future(play(pool, router, 2))
            await router.all_held.wait()
            assert len(containers(FIRST, pool.instance_id)) == len(containers(second, pool.instance_id)) == 1
            router.release()
            assert all(ep.error is None and ep.reward == 1.0 for ep in await episodes)
        assert not containers(FIRST, pool.instance_id) and not containers(second, pool.instance_id)

    with caplog.at_level(logging.WARNING, logger="agentrl.sandbox.hosts"):
        asyncio.run(body())


@agentrl.environment("test-lost-sandbox")
class LostSandboxEnv(agentrl.ToolEnv):
    """A tool whose sandbox's host is gone, and one that fails by itself."""

    def tasks(self, split: str = "train") -> Iterator[dict[str, Any]]:
        yield {"id": "t0", "question": "q"}

    @agentrl.tool
    async def bash(self, command: str) -> str:
        """Run a command.

        Args:
            command: the command line.
        """
        if command == "broken":
            raise ValueError("a bug of the tool")
        raise SandboxHostDown("sandbox 0123: its Docker host unix:///gone.sock stopped answering")

    async def reward(self, task: dict[str, Any], answer: str) -> float:
        return 1.0


def test_a_sandbox_failure_in_a_tool_fails_the_episode_as_infrastructure_not_the_model() -> None:
    router = GatedRouter()
    ep = asyncio.run(run_episode(router, "test-lost-sandbox", {"id": "t0", "question": "q"}, group_id="g"))
    assert ep.error_kind == "sandbox" and ep.error_kind in INFRASTRUCTURE
    assert ep.error.startswith("SandboxHostDown: ") and ep.reward == 0.0 and ep.turns == 1
    assert all(s.error is not None and s.error_kind == "sandbox" for s in ep.samples)
    # a tool's own failure stays the model's problem: an error message, and the episode goes on
    router = GatedRouter(script=[_bash("broken"), {"role": "assistant", "content": "done"}])
    ep = asyncio.run(run_episode(router, "test-lost-sandbox", {"id": "t0", "question": "q"}, group_id="g"))
    assert ep.error is None and ep.reward == 1.0 and ep.turns == 2


def test_a_pool_whose_engines_all_refuse_fails_to_start_with_host_down() -> None:
    cfg = SandboxConfig(backend="docker", warm=0, docker_hosts=["unix:///nonexistent/a.sock",
                                                                "unix:///nonexistent/b.sock"])

    async def body() -> None:
        pool = SandboxPool(cfg)
        with pytest.raises(SandboxHostDown, match="no engine of sandbox.docker_hosts takes sandboxes"):
            await pool.start()
        await pool.close()

    asyncio.run(body())


def test_docker_hosts_is_checked_against_the_other_settings() -> None:
    with pytest.raises(ValueError, match="docker_host empty"):
        SandboxConfig(docker_hosts=["unix:///a.sock"], docker_host="unix:///b.sock")
    with pytest.raises(ValueError, match="names an engine twice"):
        SandboxConfig(docker_hosts=["unix:///a.sock", "unix:///a.sock"])
