"""`Sandbox`: what one episode holds between acquire and release, and its background processes.

Invariants:
- A `Sandbox` object serves exactly one episode: after release every call raises SandboxError,
  even if the container behind it is reset and handed to another episode (under a new object).
- Tool-level outcomes (exit codes, timeouts, OOM kills) are ExecResults; a dead or hung agent is
  SandboxError (hung: after the command's timeout plus a grace period).
- Anything that may leave the container in an unknown state (a timeout, a call cancelled
  mid-flight, an infrastructure error) marks the slot `taint`ed: the pool replaces it instead of
  resetting it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentrl.sandbox.backend import Slot
from agentrl.sandbox.channel import ExecdTimeout
from agentrl.sandbox.stats import PoolStats
from agentrl.sandbox.types import ExecResult, SandboxConfig, SandboxError

AGENT_GRACE_S = 5.0  # beyond a command's own timeout, how long the agent may take to answer

Command = str | Sequence[str]


def _cmd(cmd: Command) -> str | list[str]:
    return cmd if isinstance(cmd, str) else [str(a) for a in cmd]


def _raise_agent_error(sandbox_id: str, msg: dict[str, Any]) -> None:
    err = msg.get("error")
    if not err:
        return
    if msg.get("errno") is not None:  # OSError and subclasses, rebuilt so callers can catch them
        raise OSError(int(msg["errno"]), msg.get("message", err))
    if err == "ProcessLookupError":
        raise ProcessLookupError(msg.get("message", ""))
    raise SandboxError(f"sandbox {sandbox_id[:12]}: agent error {err}: {msg.get('message')}")


class Sandbox:
    """One isolated machine for one episode. Working directory /work (writable); the rest read-only."""

    def __init__(self, slot: Slot, backend: str, cfg: SandboxConfig, stats: PoolStats) -> None:
        self._slot = slot
        self._cfg = cfg
        self._stats = stats
        self.backend = backend
        self.released = False
        self.inflight = 0
        self.taint: str | None = None

    @property
    def id(self) -> str:
        """Container id (Docker) or `bwrap-<pid>`; record it on the episode."""
        return self._slot.id

    async def _call(self, op: str, wait: float | None, **fields: Any) -> dict[str, Any]:
        if self.released:
            raise SandboxError(f"sandbox {self.id[:12]} was released; acquire a new one")
        self.inflight += 1
        try:
            msg = await self._slot.channel.call(op, wait, **fields)
        except ExecdTimeout:
            self.taint = f"agent did not answer {op!r}"
            if op != "exec":  # exec reports it as a timed-out ExecResult instead
                self._stats.infra_errors += 1
            raise
        except SandboxError:
            self.taint = "agent connection lost"
            self._stats.infra_errors += 1
            raise
        except BaseException:  # cancelled mid-call: the command may still be running in there
            self.taint = f"{op!r} call cancelled"
            raise
        finally:
            self.inflight -= 1
        _raise_agent_error(self.id, msg)
        return msg

    async def exec(self, cmd: Command, timeout: float | None = None, *, cwd: str = "/work",
                   env: dict[str, str] | None = None, stdin: str | bytes | None = None) -> ExecResult:
        """Run `cmd` (argv list, or a string for /bin/sh -c) and wait for it, at most `timeout` s
        (default `exec_timeout_s`); at the timeout its whole process tree is killed, descendants
        that started sessions of their own included."""
        limit = self._cfg.exec_timeout_s if timeout is None else float(timeout)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        t0 = time.perf_counter()
        try:
            msg = await self._call("exec", limit + AGENT_GRACE_S, cmd=_cmd(cmd), timeout=limit, cwd=cwd,
                                   env=env or {}, stdin=data, max_output=self._cfg.max_output_bytes)
        except ExecdTimeout:
            # The agent itself is stuck (or starved): report a timeout; the pool replaces the box.
            self._stats.timeouts += 1
            return ExecResult(124, "", "sandbox agent did not answer; command abandoned\n",
                              timed_out=True, duration_s=time.perf_counter() - t0)
        result = ExecResult(int(msg["exit_code"]), msg["stdout"], msg["stderr"], bool(msg["timed_out"]),
                            bool(msg["oom_killed"]), float(msg["duration_s"]))
        self._stats.record_exec(time.perf_counter() - t0)
        if result.timed_out:
            self._stats.timeouts += 1
            self.taint = "a command timed out"
        if result.oom_killed:
            self._stats.oom_kills += 1
        return result

    async def write_file(self, path: str, data: str | bytes, mode: int | None = None) -> None:
        """Write a file (parents created). Outside the writable dirs this raises OSError (EROFS/EACCES)."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        await self._call("write", self._cfg.exec_timeout_s, path=path, data=raw, mode=mode)

    async def read_file(self, path: str, max_bytes: int = 64 << 20) -> bytes:
        """Read a file's bytes (FileNotFoundError etc. if it cannot be read)."""
        msg = await self._call("read", self._cfg.exec_timeout_s, path=path, max_bytes=max_bytes)
        return msg["data"]

    async def start_background(self, cmd: Command, *, cwd: str = "/work",
                               env: dict[str, str] | None = None) -> BackgroundProcess:
        """Start a long-lived process (a server, a watcher); it dies with the episode at release."""
        msg = await self._call("bg_start", self._cfg.exec_timeout_s, cmd=_cmd(cmd), cwd=cwd, env=env or {})
        return BackgroundProcess(self, int(msg["pid"]), msg["log"])


@dataclass
class BackgroundProcess:
    """A process started by `Sandbox.start_background`; its stdout+stderr go to `log_path`."""

    sandbox: Sandbox
    pid: int
    log_path: str

    async def poll(self) -> int | None:
        """Exit code, or None while it runs."""
        msg = await self.sandbox._call("bg_poll", self.sandbox._cfg.exec_timeout_s, pid=self.pid)
        return None if msg["running"] else int(msg["exit_code"])

    async def output(self) -> str:
        """Everything it printed so far (stdout and stderr interleaved)."""
        return (await self.sandbox.read_file(self.log_path)).decode("utf-8", "replace")

    async def kill(self) -> None:
        """Kill it and every process it started."""
        await self.sandbox._call("bg_kill", self.sandbox._cfg.exec_timeout_s, pid=self.pid)
