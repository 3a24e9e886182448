"""Serve's collector pacer (agentrl.serve.collector): young cycles go each tick, older ones when
the heap has doubled, and stopping hands the collector back."""

from __future__ import annotations

import asyncio
import gc
import sys
import weakref

from agentrl.serve.collector import GcPacer


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref[Node]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_a_young_cycle_is_collected_on_the_next_tick() -> None:
    async def go() -> None:
        pacer = GcPacer(interval_s=0.01, young=True)
        pacer.start()
        try:
            assert not gc.isenabled()
            ref = cycle()
            await asyncio.sleep(0.05)
            assert ref() is None
            assert pacer.young_passes >= 1
        finally:
            pacer.stop()

    was = gc.isenabled()
    asyncio.run(go())
    assert gc.isenabled() == was
    assert gc.get_freeze_count() == 0


def test_a_frozen_cycle_waits_for_the_heap_to_double() -> None:
    async def go() -> None:
        pacer = GcPacer(interval_s=0.01, young=False, growth=1.0, min_heap=0, heap_every=1)
        pacer.start()
        try:
            base = sys.getallocatedblocks()
            ref = cycle()
            await asyncio.sleep(0.05)
            assert ref() is not None  # frozen: no pass walks it while the heap has not doubled
            assert pacer.full_passes == 0
            live = [[i] for i in range(base + 1000)]  # the heap doubles
            await asyncio.sleep(0.05)
            assert pacer.full_passes == 1 and ref() is None
            del live
        finally:
            pacer.stop()

    asyncio.run(go())
    assert gc.get_freeze_count() == 0
