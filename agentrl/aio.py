"""asyncio helpers the parts share."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def to_the_end(aw: Awaitable[T]) -> T:
    """Await ``aw`` to its end whatever cancellations arrive meanwhile, then let one through.

    For work that must not be left half done: a buffer put whose log write is under way in a
    thread, an episode whose samples are in the buffer but not yet in the episode log. Cancelled,
    the caller still waits for the work (which is never cancelled itself), and the CancelledError
    reaches the caller only once it is done. If the work fails, or is cancelled from elsewhere, that
    is raised instead.
    """
    work = asyncio.ensure_future(aw)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(work)
            break
        except asyncio.CancelledError:
            if work.done():  # the work itself was cancelled
                raise
            cancelled = True  # ours: wait on
    if cancelled:
        raise asyncio.CancelledError
    return result


async def wait_at_most(event: asyncio.Event, timeout_s: float) -> None:
    """Wait for ``event`` at most ``timeout_s``. Not ``asyncio.wait_for``: on Python 3.11 it swallows a
    cancellation that arrives as the event is set, so the orchestrator (waiting for the buffer's
    room) could not be stopped."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        pass
