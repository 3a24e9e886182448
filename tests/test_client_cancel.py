"""A cancelled call is not retried: when the HTTP stack turns the caller's cancellation into an
error (aiohttp's timeout context can raise TimeoutError for it), ``ServeClient.request`` raises
``CancelledError`` instead of retrying, so a Ctrl-C or a shutdown stops a learner in the middle of
a call (before: it retried, and the learner trained on for minutes after Ctrl-C)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from agentrl.client import ServeClient


class _Swallowing:
    """A stand-in session whose request turns a cancellation into TimeoutError, and counts calls."""

    def __init__(self) -> None:
        self.calls = 0

    @contextlib.asynccontextmanager
    async def request(self, *args, **kwargs):
        self.calls += 1
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise TimeoutError from None
        yield None  # never reached


def test_a_cancellation_turned_into_a_timeout_is_raised_not_retried() -> None:
    async def main() -> int:
        async with ServeClient("http://127.0.0.1:9", "", retries=5, backoff_s=0.01) as client:
            fake = _Swallowing()
            client.session = lambda: fake  # type: ignore[method-assign]
            call = asyncio.create_task(client.request("GET", "/buffer/batch"))
            await asyncio.sleep(0.05)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            return fake.calls

    assert asyncio.run(main()) == 1


def test_a_timeout_of_its_own_is_still_retried() -> None:
    class _TimesOut(_Swallowing):
        @contextlib.asynccontextmanager
        async def request(self, *args, **kwargs):
            self.calls += 1
            raise TimeoutError
            yield None  # never reached

    async def main() -> int:
        async with ServeClient("http://127.0.0.1:9", "", retries=2, backoff_s=0.01) as client:
            fake = _TimesOut()
            client.session = lambda: fake  # type: ignore[method-assign]
            with pytest.raises(Exception, match="timed out"):
                await client.request("GET", "/buffer/batch")
            return fake.calls

    assert asyncio.run(main()) == 3
