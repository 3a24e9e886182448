"""How the learner's process gives freed memory back: glibc's allocator told to map every block over
1 MB on its own.

A learner step's tensors of a few MB (a [8192, 576] fp32 activation is 19 MB) sit under glibc's
dynamic mmap threshold (up to 32 MB), so they come from the heap, and freed heap memory between live
blocks is not given back: SmolLM2 at 8,192 tokens per micro-batch peaked at 6.63 GB with the
defaults and 2.72 GB with this setting, the same as at 2,048 tokens (benchmarks/learner_memory.py).
Setting it is the same as starting the process with ``MALLOC_MMAP_THRESHOLD_=1048576``; an explicit
``MALLOC_MMAP_THRESHOLD_`` in the environment wins. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
THRESHOLD_BYTES = 1 << 20


def map_large_blocks() -> bool:
    """Map every allocation over 1 MB on its own, so it is returned when freed. Returns whether the
    setting took (glibc only; not when the environment sets the threshold itself)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES))
    log.debug("mallopt(M_MMAP_THRESHOLD, %d): %s", THRESHOLD_BYTES, ok)
    return ok
