"""Run an ecosystem's synchronous code (a verifier, a game step) without blocking the event loop.

Invariant: the call runs in a daemon thread, so the episode's wall clock (``asyncio.timeout``
around the episode) bounds the wait even when the code never returns; an abandoned thread cannot
keep the process from exiting. The result or exception comes back through a future.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a fresh daemon thread; cancellable (the thread is abandoned)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():  # cancelled while it ran
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def run() -> None:
        try:
            outcome = (True, fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = (False, e)
        with contextlib.suppress(RuntimeError):  # the loop closed while an abandoned call ran
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(
        target=run, name=f"agentrl-bounded-{getattr(fn, '__name__', 'call')}", daemon=True
    ).start()
    return await future
