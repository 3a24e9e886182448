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

from agentrl._lazy import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "agentrl.sandbox.handle": ["BackgroundProcess", "Sandbox"],
    "agentrl.sandbox.images": ["build_images"],
    "agentrl.sandbox.pool": ["SandboxPool"],
    "agentrl.sandbox.types": ["ExecResult", "SandboxConfig", "SandboxError"],
})
