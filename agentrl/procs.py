"""Child processes that end with the process that started them.

:func:`die_with_parent` is passed as ``preexec_fn`` wherever agentrl (or a benchmark) starts a
process that must not outlive it: the engine reaper's command, an OpenEnv server, a verifiers
worker, a benchmark's runs and services. Standard library only, so any layer may import it.
"""

from __future__ import annotations

import ctypes
import signal

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
