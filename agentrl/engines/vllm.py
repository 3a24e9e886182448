"""vLLM engines as child processes: launch, wait until healthy, stop, never orphan.

An engine is started through :mod:`agentrl.engines.reaper`, which puts vLLM in its own process
group and dies with us: Ctrl-C, SIGTERM, a crash or ``kill -9`` of serve all take the engine down.
Engines run with the routes the router needs: ``--enable-scale-out`` (render / token-in generate /
derender, with per-token weight versions) and the hermes tool parser; ``VLLM_SERVER_DEV_MODE=1``
for the weight-reload RPC; ``--logprobs-mode processed_logprobs`` so every logprob is the one the
sampler drew with (the behaviour logprob), and ``--generation-config`` as configured (the model's
sampling defaults off unless asked for).
"""

from __future__ import annotations

import asyncio
import atexit
import getpass
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from agentrl.engines.config import LORA_RANKS, EngineOptions, EngineSpec  # noqa: F401 (their home before)
from agentrl.engines.reaper import child_group, kill_group, stop_process
from agentrl.errors import AgentrlError
from agentrl.models import home as agentrl_home
from agentrl.procs import tied_to_this_process

log = logging.getLogger(__name__)

_LIVE: set[subprocess.Popen] = set()


# vLLM's start-up, as its log shows it: (a line's marker, the phase that line starts). Matched in
# order; a marker the log never shows is skipped (e.g. compilation under --enforce-eager).
PHASES: tuple[tuple[str, str], ...] = (
    ("non-default args", "reading the model's config"),
    ("Initializing a V1 LLM engine", "starting the engine process"),
    ("Starting to load model", "loading weights"),
    ("Loading weights took", "weights loaded, initialising"),
    ("torch.compile", "compiling"),
    ("Compiling a graph", "compiling"),
    ("KV cache size", "allocating the KV cache"),
    ("init engine (profile, create kv cache, warmup model)", "warming up"),
    ("Starting vLLM server", "starting the HTTP server"),
)
_progress = logging.getLogger("agentrl.progress")


class _LogWatch:
    """Reads an engine's log as it grows and says the newest start-up phase it has reached."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path, self.offset, self.at = path, offset, -1

    def phase(self) -> str | None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return None
        if not chunk:
            return None
        cut = chunk.rfind(b"\n") + 1  # whole lines only: a marker may be half written
        self.offset += cut
        text = chunk[:cut].decode(errors="replace")
        found = None
        for i, (marker, phase) in enumerate(PHASES):
            if i > self.at and marker in text:
                self.at, found = i, phase
        return found


class EngineStartError(AgentrlError, RuntimeError):
    """The engine process exited or did not become healthy in time."""


def port_taken(host: str, port: int) -> bool:
    """Whether something listens on ``host:port`` already (a socket only in TIME_WAIT does not count)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def port_holders(port: int) -> str:
    """Who holds local ``port``, as words: each socket's process and state (a listener, or a
    connection that took the port as its local end), for the error that says the port is taken."""
    import psutil

    try:
        conns = [c for c in psutil.net_connections(kind="tcp") if c.laddr and c.laddr.port == port]
    except (psutil.Error, OSError):
        return "(the sockets could not be listed)"
    said = []
    for c in conns:
        who = f"pid {c.pid}" if c.pid else "a process"
        try:
            who += f" ({' '.join(psutil.Process(c.pid).cmdline()[:4])[:80]})" if c.pid else ""
        except psutil.Error:
            pass
        peer = f" to {c.raddr.ip}:{c.raddr.port}" if c.raddr else ""
        said.append(f"{who}, {c.status}{peer}")
    return "; ".join(said) or "(no socket seen: perhaps another network namespace)"


def foreign_listener(port: int, group: int | None) -> str | None:
    """Who listens on local ``port`` when it is not process group ``group`` (the engine launched
    here), as words; None when the listener is ours, or when the listeners cannot be seen (then
    nothing is claimed)."""
    import psutil

    try:
        pids = {c.pid for c in psutil.net_connections(kind="tcp")
                if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid}
    except (psutil.Error, OSError):
        return None
    ours = set()
    for pid in pids:
        try:
            ours.add(os.getpgid(pid) == group)
        except OSError:
            continue
    return port_holders(port) if ours == {False} else None


async def wait_ports_free(specs: list[EngineSpec], timeout_s: float) -> None:
    """Until no process listens on any of ``specs``' ports. After ``kill -9`` of serve its engines
    are still shutting down (their reapers give them a grace period): an engine launched on a port
    one of them still holds fails to bind, and its health check would be answered by the old one."""
    deadline, told = time.monotonic() + timeout_s, False
    while taken := [s.port for s in specs if port_taken(s.host, s.port)]:
        if time.monotonic() > deadline:
            holders = "; ".join(f"{port}: {port_holders(port)}" for port in taken)
            raise EngineStartError(f"engine port(s) {taken} still held after {timeout_s:.0f} s, by "
                                   f"{holders}; stop it, or set engine.base_port to free ports")
        if not told:
            _progress.info("engine port(s) %s still held by another process (an earlier engine shutting "
                           "down?); waiting up to %.0f s", taken, timeout_s)
            told = True
        await asyncio.sleep(0.5)


class VLLMEngine:
    """One engine process. ``await start()``, then use ``url``; ``stop()`` is idempotent."""

    def __init__(self, spec: EngineSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_path = Path(log_dir) / f"engine-{spec.port}.log"
        self.proc: subprocess.Popen | None = None
        self.group: int | None = None  # the engine's process group under its reaper, once it answers
        self.phase, self.phase_since = "not started", time.monotonic()
        self.tmp_dir: Path | None = None  # the engine's private temporary folder (see private_tmp)

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def launch(self) -> None:
        """Spawn the process (from the calling thread: keep it the main thread, see reaper). Called
        again after the process exited, it relaunches the engine with the same spec (same port)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                raise RuntimeError(f"engine on port {self.spec.port} is still running (pid {self.proc.pid})")
            _LIVE.discard(self.proc)
            self._end_group()  # a reaper killed with -9 leaves its engine running (and on its port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        self._log_start = logf.tell()  # an earlier run's lines are not this start-up's
        self._remove_tmp()
        self.tmp_dir = Path(tempfile.mkdtemp(prefix="agentrl-engine-", dir=engine_tmp_parent()))
        cmd = [sys.executable, "-m", "agentrl.engines.reaper", "--tmpdir", str(self.tmp_dir), "--",
               *self.spec.command()]
        log.info("starting engine on port %d: %s", self.spec.port, " ".join(self.spec.command()[2:]))
        # One vLLM cache for every run of this machine (beside the models): its model-class
        # inspection, cached there, is a 10-20 s subprocess on each start-up otherwise.
        env = self.spec.environment(agentrl_home() / "vllm-cache")
        env.update(private_tmp(self.tmp_dir))
        # tied before exec: the reaper's own ask comes after its imports, and a serve killed in that
        # window left a reaper (and its engine, on this port) that nothing would ever stop
        self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, preexec_fn=tied_to_this_process())
        logf.close()
        _LIVE.add(self.proc)

    async def start(self, timeout_s: float = 600.0, progress: bool = True) -> None:
        """Wait until the engine answers ``/health``; on the way, follow its log through the start-up
        phases (:data:`PHASES`) and report each one with the time it took to reach it."""
        if self.proc is None:
            self.launch()
        t0 = time.monotonic()
        self.phase, self.phase_since = "starting", t0
        watch = _LogWatch(self.log_path, getattr(self, "_log_start", 0))
        next_report = t0 + 15
        async with aiohttp.ClientSession() as http:
            while True:
                if self.proc.poll() is not None:
                    raise EngineStartError(
                        f"engine on port {self.spec.port} exited with code {self.proc.returncode}; "
                        f"last lines of {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    async with http.get(f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            self.group = child_group(self.proc.pid)
                            self._check_ours()
                            self.phase, self.phase_since = "ready", time.monotonic()
                            if progress:
                                _progress.info(
                                    "engine %d: ready (%.0f s)", self.spec.port, time.monotonic() - t0
                                )
                            return
                except (TimeoutError, aiohttp.ClientError):
                    pass
                now = time.monotonic()
                phase = watch.phase()
                if phase and phase != self.phase:
                    self.phase, self.phase_since = phase, now
                    if progress:
                        _progress.info("engine %d: %s (%.0f s)", self.spec.port, phase, now - t0)
                    next_report = now + 15
                if now - t0 > timeout_s:
                    self.stop()
                    raise EngineStartError(
                        f"engine on port {self.spec.port} not healthy after {timeout_s:.0f} s; "
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                if progress and now >= next_report:
                    _progress.info("engine %d: still %s (%.0f s)", self.spec.port, self.phase, now - t0)
                    next_report = now + 15
                await asyncio.sleep(0.5)

    def _check_ours(self) -> None:
        """An engine another serve left on this port (it took the port first) answers the health
        check too: it is not ours to use, and ours cannot bind."""
        other = foreign_listener(self.spec.port, self.group)
        if other is not None:
            self.stop()
            raise EngineStartError(f"port {self.spec.port} is answered by another process ({other}), not the "
                                   "engine launched here; stop it, or set engine.base_port to free ports")

    def startup(self) -> dict[str, Any]:
        """The start-up phase and how long it has lasted (for serve's status while it starts)."""
        return {
            "port": self.spec.port,
            "phase": self.phase,
            "phase_s": round(time.monotonic() - self.phase_since, 1),
        }

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> None:
        proc = self.proc
        if proc is None:
            return
        stop_process(proc, timeout_s)  # the reaper takes the engine's whole group down
        _LIVE.discard(proc)
        self._end_group()
        self._remove_tmp()

    def kill(self, timeout_s: float = 10.0) -> None:
        """Kill the engine's whole process group at once, no grace (an engine that is being replaced:
        e.g. its engine core died, and vLLM's own shutdown could take the reaper's whole grace)."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)  # the reaper SIGKILLs the group, then exits
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                stop_process(proc, 30.0)
        _LIVE.discard(proc)
        self._end_group()
        self._remove_tmp()

    def _remove_tmp(self) -> None:
        """The reaper removes the private folder as it exits; a reaper killed with ``kill -9`` cannot."""
        if self.tmp_dir is not None and (self.proc is None or self.proc.poll() is not None):
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.tmp_dir = None

    def _end_group(self) -> None:
        """Kill what is left of the engine's group once its reaper is gone (only a reaper killed
        with ``kill -9`` leaves anything)."""
        if self.group is not None and self.proc is not None and self.proc.poll() is not None:
            # a reaper's own exits are codes >= 0; killed by a signal, it could not end the group
            if self.proc.returncode < 0 and kill_group(self.group):
                log.warning("engine on port %d: its reaper was killed; ended its process group %d",
                            self.spec.port, self.group)
            self.group = None


# vLLM binds its ZeroMQ sockets at <the engine's temporary folder>/<a uuid4>, and a unix socket's path
# holds at most 107 bytes: with "agentrl-engine-" and 8 random characters, a parent of 46 bytes at most
MAX_TMP_PARENT = 107 - len("/agentrl-engine-12345678/") - 36


def engine_tmp_parent() -> str:
    """Where an engine's private temporary folder goes: the temporary folder (``TMPDIR``) when its
    path leaves room for vLLM's socket paths, else ``/tmp`` (said once); an error that says why when
    neither does."""
    parent = tempfile.gettempdir()
    if len(parent.encode()) <= MAX_TMP_PARENT:
        return parent
    if os.path.isdir("/tmp") and os.access("/tmp", os.W_OK | os.X_OK):
        if parent not in _WARNED_TMP:
            _WARNED_TMP.add(parent)
            log.warning("the temporary folder %s is too long a path for the engine's sockets (unix socket "
                        "paths hold 107 bytes): engines keep their sockets under /tmp instead", parent)
        return "/tmp"
    raise EngineStartError(f"the temporary folder {parent} is too long a path for the engine's sockets "
                           f"(at most {MAX_TMP_PARENT} bytes leave room in a unix socket's 107) and /tmp is "
                           "not writable: set TMPDIR to a shorter folder")


_WARNED_TMP: set[str] = set()


def private_tmp(folder: Path) -> dict[str, str]:
    """The environment that keeps an engine's local endpoints in ``folder`` (mode 0700, serve's
    user's): vLLM binds the ZeroMQ sockets between its API server, engine core and worker as unix
    sockets under ``VLLM_RPC_BASE_PATH`` and rendezvous its torch.distributed group through a file
    under the temporary folder; both default to the machine's shared /tmp, where they outlived
    every engine. Torch's compiled-kernel cache stays where it was (it is not private and is
    reused across start-ups)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    env = {"TMPDIR": str(folder), "VLLM_RPC_BASE_PATH": str(folder)}
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), "torchinductor_" + user)
    return env


@atexit.register
def _stop_all() -> None:
    for proc in list(_LIVE):
        stop_process(proc, 20.0)
