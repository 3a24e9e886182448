"""Sandbox configuration, results and errors: the plain types every backend shares.

Invariants: a tool failure (timeout, OOM, non-zero exit) is an `ExecResult`; only infrastructure
failures (engine unreachable, container vanished, agent dead) are `SandboxError`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from agentrl.errors import AgentrlError

Backend = Literal["docker", "bubblewrap", "auto"]

SHM_MB = 64  # /dev/shm, as Docker's default ShmSize
# Memory the writable mounts never take: the exec agent (python3, about 15 MB) and what its commands
# need to run. tmpfs pages count against the memory limit and no OOM kill frees them, so mounts that
# could fill the whole limit would leave the agent itself to the OOM killer once they are full.
AGENT_RESERVE_MB = 64


@dataclass
class SandboxConfig:
    """How sandboxes are made and bounded. Every field has a default that works on one machine."""

    backend: Backend = "auto"
    """"docker" (strong isolation), "bubblewrap" (weaker: shares the host kernel's user namespaces and
    the host's /usr read-only; for machines without Docker), or "auto" (Docker when an engine answers)."""
    image: str = field(
        default="agentrl/base:bookworm", metadata={"derived": "the environment's sandbox_image"}
    )
    """Docker image the sandboxes run (must contain python3 3.9+). Ignored by bubblewrap, which uses
    the host's /usr."""
    warm: int = 2
    """Sandboxes kept started and idle ahead of demand."""
    max_concurrency: int = 32
    """Most sandboxes handed out at once; `acquire` waits beyond that."""
    memory_mb: int = 512
    """Memory limit per sandbox (swap limit equal, so no swap). The /work tmpfs counts against it."""
    cpus: float = 1.0
    """CPU limit per sandbox, in cores."""
    pids: int = 256
    """Most processes/threads alive in one sandbox (fork bombs stop here)."""
    exec_timeout_s: float = 30.0
    """Default timeout of `Sandbox.exec`; the command's whole process tree is killed at it."""
    work_size_mb: int = 256
    """Size of the writable /work (and of /tmp) tmpfs; with /dev/shm they are scaled down together
    where they would not leave 64 MB of ``memory_mb`` to the exec agent (:meth:`mount_sizes_mb`)."""
    max_output_bytes: int = 1 << 20
    """Stdout and stderr of one command are each truncated to this many bytes."""
    max_reuses: int = 50
    """A clean sandbox is reset (processes killed, SysV IPC removed, writable mounts emptied) and
    reused up to this many times before it is replaced; 0 replaces after every episode. Sandboxes
    whose episode was cancelled mid-call or hit a timeout are always replaced."""
    user: str = "65534:65534"
    """uid:gid commands run as; the default is `nobody`. A bubblewrap sandbox started by root also runs
    as this uid:gid on the host (it may not be 0: bwrap would map the sandbox to host root)."""
    docker_host: str = ""
    """Docker engine address; empty: $DOCKER_HOST or unix:///var/run/docker.sock."""
    docker_hosts: list[str] = field(default_factory=list)
    """Several Docker engine addresses (``unix://...`` or ``tcp://host:port``) to spread sandboxes
    over: each new one goes to the answering engine with the fewest live sandboxes; an engine that
    stops answering is taken out (its sandboxes fail with SandboxHostDown) and probed until it
    answers again. An engine that lacks ``image`` gets it copied from one that has it (build it on
    any one). Empty: the one engine of ``docker_host``."""
    create_concurrency: int = 4
    """Most sandboxes being created at once (bounds the engine's load on small machines)."""
    start_timeout_s: float = 60.0
    """Longest wait for a new sandbox to answer; beyond it creation fails with SandboxError."""
    api_timeout_s: float = 60.0
    """Timeout of one Docker API call."""
    bwrap_path: str = "bwrap"
    """The bubblewrap executable."""
    labels: dict[str, str] = field(default_factory=dict)
    """Extra Docker labels put on every container."""

    def __post_init__(self) -> None:
        if self.backend not in ("docker", "bubblewrap", "auto"):
            raise ValueError(
                f"sandbox.backend must be 'docker', 'bubblewrap' or 'auto', not {self.backend!r}"
            )
        for name in ("memory_mb", "pids", "max_concurrency", "create_concurrency", "work_size_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"sandbox.{name} must be at least 1, got {getattr(self, name)}")
        if self.warm < 0 or self.max_reuses < 0:
            raise ValueError("sandbox.warm and sandbox.max_reuses must be >= 0")
        if self.cpus <= 0 or self.exec_timeout_s <= 0:
            raise ValueError("sandbox.cpus and sandbox.exec_timeout_s must be positive")
        if self.docker_hosts and (self.docker_host or self.backend == "bubblewrap"):
            raise ValueError("sandbox.docker_hosts spreads Docker sandboxes over several engines: leave "
                             "sandbox.docker_host empty and sandbox.backend 'docker' or 'auto' with it")
        if len(set(self.docker_hosts)) != len(self.docker_hosts):
            raise ValueError(f"sandbox.docker_hosts names an engine twice: {self.docker_hosts}")
        if self.memory_mb < AGENT_RESERVE_MB + 32:
            raise ValueError(f"sandbox.memory_mb={self.memory_mb} is too small: the exec agent keeps "
                             f"{AGENT_RESERVE_MB} MB out of the writable mounts; use at least "
                             f"{AGENT_RESERVE_MB + 32}")

    def mount_sizes_mb(self) -> dict[str, int]:
        """The sizes of the writable tmpfs mounts (/work, /tmp, /dev/shm), in MB: ``work_size_mb``
        for /work and /tmp and 64 for /dev/shm, scaled down together where they would leave less
        than the agent's reserve of ``memory_mb`` (so a command filling all three gets ENOSPC and
        the agent lives; with the defaults, 512 MB: 199 + 199 + 49)."""
        want = {"/work": self.work_size_mb, "/tmp": self.work_size_mb, "/dev/shm": SHM_MB}
        budget, total = self.memory_mb - AGENT_RESERVE_MB, sum(want.values())
        if total <= budget:
            return want
        return {path: max(1, mb * budget // total) for path, mb in want.items()}

    def resolved_docker_host(self) -> str:
        return self.docker_host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


@dataclass(frozen=True)
class ExecResult:
    """What a command did. `exit_code` is 124 on timeout and 128+N when killed by signal N."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    oom_killed: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.oom_killed


class SandboxError(AgentrlError, RuntimeError):
    """Infrastructure failure: the engine is unreachable, a container vanished, the agent died.

    Never raised for what a command does (that is an ExecResult). Counted in `SandboxPool.stats()`.
    """


class SandboxHostDown(SandboxError):
    """A Docker engine did not answer at all (connection refused or reset, socket gone, timeout):
    with ``sandbox.docker_hosts`` its host is taken out of placement, and every sandbox that lived on
    it fails its calls with this error (an infrastructure failure: the episode is not scored)."""
