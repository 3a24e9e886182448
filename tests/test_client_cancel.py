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


def test_a_retry_after_a_slow_try_is_logged_as_a_warning_and_a_quick_one_is_not(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A partition makes each try wait out its limit: the retry after one says so (a learner was
    silent for 43 s while its chunk uploads timed out and were sent again); quick retries stay quiet."""
    import logging

    import agentrl.client

    class _Slow(_Swallowing):
        delay = 0.0

        @contextlib.asynccontextmanager
        async def request(self, *args, **kwargs):
            self.calls += 1
            await asyncio.sleep(self.delay)
            raise TimeoutError
            yield None  # never reached

    async def main(delay: float) -> None:
        async with ServeClient("http://127.0.0.1:9", "", retries=1, backoff_s=0.01) as client:
            fake = _Slow()
            fake.delay = delay
            client.session = lambda: fake  # type: ignore[method-assign]
            with pytest.raises(Exception, match="timed out"):
                await client.request("PUT", "/admin/weights/4/chunks/0")

    monkeypatch.setattr(agentrl.client, "SLOW_TRY_S", 0.2)
    with caplog.at_level(logging.DEBUG, logger="agentrl.client"):
        asyncio.run(main(0.0))
        assert [r.levelno for r in caplog.records if "retrying in" in r.message] == [logging.DEBUG]
        caplog.clear()
        asyncio.run(main(0.3))
        warned = [r for r in caplog.records if "retrying in" in r.message]
        assert [r.levelno for r in warned] == [logging.WARNING] and "chunks/0: timed out" in warned[0].message
