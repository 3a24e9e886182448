"""Run a command in its own process group and take the whole group down with us.

``python -m agentrl.engines.reaper -- CMD...`` starts CMD in a new process group and waits.
The reaper asks the kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG), so an engine
never outlives the serve process that launched it, even after ``kill -9`` of serve. On SIGTERM or
SIGINT it forwards SIGTERM to the group, waits a grace period, then SIGKILLs the group; on SIGUSR1
it SIGKILLs the group at once (an engine being replaced has nothing left to finish). Its exit
code is the child's, or 128 + N when a signal N killed the child (as a shell reports it), so whoever
launched it can tell a ``kill -9`` (137) from an error exit.
:func:`stop_process` is the launching side's stop (SIGTERM, a wait, SIGKILL). A reaper killed
with ``kill -9`` cannot pass anything on, so the launching side notes the group with
:func:`child_group` while the reaper runs and ends what is left with :func:`kill_group`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
GRACE_S = float(os.environ.get("AGENTRL_REAPER_GRACE_S", "15"))


def _die_with_parent(sig: int = signal.SIGTERM) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except OSError:
        pass


def stop_process(proc: subprocess.Popen, timeout_s: float, kill_wait_s: float = 5.0) -> None:
    """Stop a child we started: SIGTERM, up to ``timeout_s`` for it to exit, then SIGKILL (and up to
    ``kill_wait_s`` to reap it). A reaper child passes the SIGTERM on to its whole group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(kill_wait_s)


def child_group(reaper_pid: int) -> int | None:
    """The process group a running reaper leads its command in (the command's pid: it starts a
    new session), read from /proc; None when it has none (yet)."""
    try:
        children = Path(f"/proc/{reaper_pid}/task/{reaper_pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def kill_group(pgid: int | None) -> bool:
    """SIGKILL what is left of a command's process group, e.g. after its reaper itself was killed
    with ``kill -9`` (the group then outlives it: it is another session). True if any was left."""
    if pgid is None:
        return False
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--":
        argv = argv[1:]
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before prctl took effect
        return 1
    child = subprocess.Popen(argv, start_new_session=True)
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        try:
            os.killpg(child.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.1)
        try:
            os.killpg(child.pid, signal.SIGKILL)  # also any grandchildren still alive
        except ProcessLookupError:
            pass

    def kill_now(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGUSR1, kill_now)
    code = child.wait()
    if not stopping:
        try:
            os.killpg(child.pid, signal.SIGKILL)  # the engine died: leave none of its children
        except ProcessLookupError:
            pass
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
