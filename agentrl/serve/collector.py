"""Serve's pacing of Python's cyclic garbage collector: short, frequent passes over young objects
only; a whole-heap pass only when the heap has doubled.

Why: the agent loops' objects (a call's coroutines, requests and records, an episode's messages)
live for seconds to minutes, the length of a model call or an episode, not the microseconds
CPython's generations are tuned for. Nearly all of them survive a young collection, so with
CPython's count-based thresholds each collection walks most of the live heap again: with 20,000
episodes in flight (3 million tracked objects) single passes stopped the event loop for 0.2-2.2 s
(benchmarks/agent_loops.py). Nearly all of that garbage is freed by reference counting; the
collector is only for reference cycles.

How: automatic collection is off. Every ``interval_s`` a timer on the event loop collects the
young generation (what was allocated since the last tick and is still alive: a short list),
then freezes the survivors (``gc.freeze``: moved out of every generation, never walked again; a
frozen object is still freed when its last reference goes). A cycle that becomes garbage after
it survived a tick is not found then: it stays until the heap has grown ``growth`` times (1.0:
doubled) since the last whole-heap pass, which then runs once (unfreeze, ``gc.collect()``,
freeze). The heap is measured as ``sys.getallocatedblocks()`` (Python's small-object blocks, read
in about a tenth of a millisecond; ``gc.get_freeze_count()`` walks every frozen object, 60 ms at
300k). So memory stays within about twice what is live, as with Go's
``GOGC=100``; a whole-heap pass happens while the heap grows (start-up, a rising load), not in a
steady state. The agent loop's own path makes no cycles (``ToolEnv`` binds its tools when used),
so there is little for that pass to find.

Invariant: while a pacer runs, nothing else turns the collector back on; :meth:`GcPacer.stop`
hands it back as CPython runs it (automatic collection as it was before, nothing frozen).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time

log = logging.getLogger(__name__)


class GcPacer:
    def __init__(self, interval_s: float = 0.05, young: bool = False, growth: float = 1.0,
                 min_heap: int = 2_000_000, heap_every: int = 10) -> None:
        """``interval_s``: between ticks (a young collection's pause grows with it: it walks what the
        loop allocated in that time and kept). ``young``: collect the young generation each tick
        (off: only freeze it; its cycles wait for the whole-heap pass). ``growth``: how much the
        frozen heap may grow since the last whole-heap pass before the next one. ``min_heap``: no
        whole-heap pass below this many allocated blocks (such a pass is short there anyway, and
        start-up would run several). ``heap_every``: ticks between two looks at the heap's size."""
        self.interval_s = interval_s
        self.young = young
        self.growth = growth
        self.min_heap = min_heap
        self.heap_every = heap_every
        self._ticks = 0
        self.young_passes = 0
        self.full_passes = 0
        self.young_pause_max_s = 0.0
        self.full_pause_max_s = 0.0
        self._base = 0  # allocated blocks after the last whole-heap pass
        self._handle: asyncio.TimerHandle | None = None
        self._was_enabled = True

    @property
    def running(self) -> bool:
        return self._handle is not None

    def start(self) -> None:
        """Collect everything once, freeze it, and pace the collector from the running loop."""
        if self._handle is not None:
            return
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()
        gc.freeze()
        self._base = sys.getallocatedblocks()
        self._handle = asyncio.get_running_loop().call_later(self.interval_s, self._tick)

    def stop(self) -> None:
        """Cancel the timer and hand the collector back as CPython runs it (frozen objects thawed)."""
        if self._handle is None:
            return
        self._handle.cancel()
        self._handle = None
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()

    def _tick(self) -> None:
        t0 = time.perf_counter()
        if self.young:
            gc.collect(0)
        gc.freeze()
        self.young_passes += 1
        self.young_pause_max_s = max(self.young_pause_max_s, time.perf_counter() - t0)
        self._ticks += 1
        heap = sys.getallocatedblocks() if self._ticks % self.heap_every == 0 else 0
        if heap > self.min_heap and heap > self._base * (1 + self.growth):
            t1 = time.perf_counter()
            gc.unfreeze()
            found = gc.collect()
            gc.freeze()
            self._base = sys.getallocatedblocks()
            took = time.perf_counter() - t1
            self.full_passes += 1
            self.full_pause_max_s = max(self.full_pause_max_s, took)
            log.info("whole-heap collection: %d unreachable objects, %d -> %d blocks in %.0f ms",
                     found, heap, self._base, took * 1000)
        self._handle = asyncio.get_running_loop().call_later(self.interval_s, self._tick)

    def stats(self) -> dict[str, float]:
        return {
            "gc_young_passes": self.young_passes,
            "gc_young_pause_max_ms": round(self.young_pause_max_s * 1000, 2),
            "gc_full_passes": self.full_passes,
            "gc_full_pause_max_ms": round(self.full_pause_max_s * 1000, 1),
            "heap_blocks": sys.getallocatedblocks(),
            "heap_blocks_at_last_full_pass": self._base,
        }
