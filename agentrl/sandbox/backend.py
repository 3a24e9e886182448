"""The backend interface (what Docker and bubblewrap each implement) and process-ownership helpers.

A backend makes and destroys raw sandboxes: an id plus an `ExecChannel` to the exec daemon (execd) running
inside. Pooling, reuse and accounting live above it, in pool.py.

Invariants: every sandbox a backend creates is findable from the owning instance id (Docker labels,
or the bubblewrap cgroup/process registry), so `close()` and `close_sync()` can remove all of them
without remembering anything; `reap_stale()` only removes sandboxes whose owner is provably dead
(same host, owning pid gone or reused) or whose instance id is ours.
"""

from __future__ import annotations

import os
import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from agentrl.sandbox.channel import ExecChannel
from agentrl.sandbox.types import SandboxConfig


@dataclass
class Slot:
    """One live sandbox as the pool holds it, across the episodes that reuse it."""

    id: str
    channel: ExecChannel
    uses: int = 0
    extra: dict = field(default_factory=dict)


class SandboxBackend(ABC):
    name: str = "abstract"

    def __init__(self, cfg: SandboxConfig, instance_id: str) -> None:
        self.cfg = cfg
        self.instance_id = instance_id

    async def start(self) -> int:
        """Check that the backend works; remove what dead owners left. Returns how many removed."""
        return 0

    @abstractmethod
    async def create(self) -> Slot:
        """Start one sandbox and wait until its agent answers. Raises SandboxError."""

    @abstractmethod
    async def destroy(self, slot: Slot) -> None:
        """Remove the sandbox and everything running in it. Idempotent."""

    @abstractmethod
    async def close(self) -> int:
        """Remove every sandbox of this instance, remembered or not. Returns how many."""

    @abstractmethod
    def close_sync(self) -> int:
        """`close` without an event loop: the at-exit backstop."""

    async def live_ids(self) -> list[str]:
        """Ids of this instance's sandboxes that still exist (tests and leak checks)."""
        return []

    def stats(self) -> dict[str, Any]:
        """What the backend adds to ``SandboxPool.stats()`` (several Docker hosts: each one's state)."""
        return {}


# --- who owns a sandbox -------------------------------------------------------------------------

def process_start_ticks(pid: int) -> str:
    """The kernel's start time of `pid` (clock ticks since boot): tells a live pid from a reused one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def owner_labels(instance_id: str) -> dict[str, str]:
    pid = os.getpid()
    return {
        "agentrl.sandbox": "1",
        "agentrl.instance": instance_id,
        "agentrl.pid": str(pid),
        "agentrl.pid_start": process_start_ticks(pid),
        "agentrl.host": socket.gethostname(),
        "agentrl.boot": boot_id(),
    }


def owner_is_dead(labels: dict[str, str]) -> bool:
    """True only when we can tell: the owner ran on this host and its pid is gone or reused."""
    if labels.get("agentrl.host") != socket.gethostname():
        return False
    if labels.get("agentrl.boot") != boot_id():
        return True  # this host rebooted since: every process of that boot is gone
    try:
        pid = int(labels.get("agentrl.pid", ""))
    except ValueError:
        return False
    if not os.path.exists(f"/proc/{pid}"):
        return True
    return process_start_ticks(pid) != labels.get("agentrl.pid_start")
