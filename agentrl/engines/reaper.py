"""Run a command in its own process group and take the whole group down with us.

``python -m agentrl.engines.reaper -- CMD...`` starts CMD in a new process group and waits.
The reaper asks the kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG), so an engine
never outlives the serve process that launched it, even after ``kill -9`` of serve. On SIGTERM or
SIGINT it forwards SIGTERM to the group, waits a grace period, then SIGKILLs the group; on SIGUSR1
it SIGKILLs the group at once (an engine being replaced has nothing left to finish). Its exit
code is the child's, or 128 + N when a signal N killed the child (as a shell reports it), so whoever
launched it can tell a ``kill -9`` (137) from an error exit.
``--tmpdir DIR`` (before ``--``) names a folder the command keeps private files in (an engine's
unix sockets): the reaper removes it once the group is gone, however the command ended.
:func:`stop_process` is the launching side's stop (SIGTERM, a wait, SIGKILL). A reaper killed
with ``kill -9`` cannot pass anything on: the kernel sends its command SIGTERM (PR_SET_PDEATHSIG
is set for the command too), and the launching side, when it is still alive, notes the group with
:func:`child_group` while the reaper runs and ends what is left with :func:`kill_group`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from agentrl.procs import die_with_parent, tied_to_this_process

GRACE_S = float(os.environ.get("AGENTRL_REAPER_GRACE_S", "15"))


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
    return pgid is not None and signal_group(pgid, signal.SIGKILL)


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False if no process of it is left (or ours to signal)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def main(argv: list[str]) -> int:
    tmpdir = None
    if len(argv) >= 2 and argv[0] == "--tmpdir":
        tmpdir, argv = argv[1], argv[2:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    try:
        return _reap(argv)
    finally:
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)


def _reap(argv: list[str]) -> int:
    parent = os.getppid()
    die_with_parent()
    if os.getppid() != parent:  # the parent died before prctl took effect
        return 1
    # the command gets SIGTERM if the reaper itself is killed with kill -9 (e.g. with its own parent,
    # by a process-group kill of `agentrl run`): nothing else would be left to stop it
    child: subprocess.Popen | None = None
    deadline: float | None = None  # once stopping: when the group gets SIGKILL if still there

    def stop(signum: int, _frame: object) -> None:
        nonlocal deadline
        if deadline is None:
            deadline = time.monotonic() + GRACE_S
            if child is not None:
                signal_group(child.pid, signal.SIGTERM)

    def kill_now(signum: int, _frame: object) -> None:
        nonlocal deadline
        deadline = time.monotonic()

    # the handlers before the command: a SIGTERM while it starts would otherwise end the reaper alone
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGUSR1, kill_now)
    child = subprocess.Popen(argv, start_new_session=True, preexec_fn=tied_to_this_process())
    if deadline is not None:  # a stop that came while it started
        signal_group(child.pid, signal.SIGTERM)
    # The escalation lives in this loop, not in the handlers: a handler runs inside the wait it
    # interrupted, where the child cannot be polled (it would always seem alive: the whole grace).
    while True:
        try:
            code = child.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            if deadline is not None and time.monotonic() >= deadline:
                signal_group(child.pid, signal.SIGKILL)
    signal_group(child.pid, signal.SIGKILL)  # whatever the child left in its group
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
