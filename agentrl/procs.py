"""Child processes that end with the process that started them.

:func:`tied_to_this_process` makes the ``preexec_fn`` passed wherever agentrl (or a benchmark)
starts a process that must not outlive it: the engine's reaper and its command, a router process,
an OpenEnv server, a verifiers worker, a benchmark's runs and services. Standard library only, so
any layer may import it.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel for signal ``sig`` when this process's parent dies (PR_SET_PDEATHSIG; a no-op
    where prctl is missing). Passed as ``preexec_fn`` it runs in a child before exec, so the child
    goes when its launcher goes, however the launcher died (the launching *thread*, strictly: launch
    from a thread that lives as long as the child should)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except OSError:
        pass


def tied_to_this_process(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for a child that must not outlive this process: in the child, before exec,
    it asks for ``sig`` when the parent dies (:func:`die_with_parent`), then checks that its parent
    is still this process, and exits at once if not. A launcher killed between the fork and that ask
    would never send the signal: the child, adopted by another process, would live on (an engine
    launched by a serve killed that moment held its port for good)."""
    launcher = os.getpid()

    def preexec() -> None:
        die_with_parent(sig)
        if os.getppid() != launcher:
            os._exit(1)

    return preexec
