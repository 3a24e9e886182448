"""Isolated execution of tool calls: warm pools of locked-down sandboxes with a fast exec path.

    pool = SandboxPool(SandboxConfig(), instance_id="serve-...")
    await pool.start()
    async with pool.acquire() as sb:
        r = await sb.exec(["python3", "-c", code], timeout=10)

Backends: Docker (default; see docker_backend.py) and bubblewrap (weaker isolation, for machines
without Docker). Tool failures are ExecResults; infrastructure failures are SandboxError. Nothing
leaks: cleanup survives cancellation, an at-exit hook backs it up, and `start()` removes what dead
instances left. See docs/sandbox.md.
"""

from typing import TYPE_CHECKING

from agentrl._lazy import lazy

if TYPE_CHECKING:
    from agentrl.sandbox.handle import BackgroundProcess, Sandbox
    from agentrl.sandbox.images import build_images
    from agentrl.sandbox.pool import SandboxPool
    from agentrl.sandbox.types import ExecResult, SandboxConfig, SandboxError

__getattr__, __dir__ = lazy(__name__, {
    "BackgroundProcess": "agentrl.sandbox.handle",
    "Sandbox": "agentrl.sandbox.handle",
    "build_images": "agentrl.sandbox.images",
    "SandboxPool": "agentrl.sandbox.pool",
    "ExecResult": "agentrl.sandbox.types",
    "SandboxConfig": "agentrl.sandbox.types",
    "SandboxError": "agentrl.sandbox.types",
})

__all__ = ["BackgroundProcess", "ExecResult", "Sandbox", "SandboxConfig", "SandboxError", "SandboxPool", "build_images"]
