"""A partition longer than torch.distributed's timeout: two learner ranks (torchrun, gloo) ride it out.

While rank 0 waits on serve (its info, a batch, an ack), the other ranks sit in a broadcast; before
the heartbeat they timed out there once the wait passed torch.distributed's timeout (then derived
from ``batch_timeout_s``). Run as a script under torchrun this file is the driver: the process
group's timeout is 6 s, and rank 0's stand-in serve does not answer for 12 s at each of the three
waits; every rank must come out of each wait with rank 0's answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIST_TIMEOUT_S = 6.0
SILENT_S = 12.0  # each wait: twice the process group's timeout


class _CutOffServe:
    """Rank 0's batch source: answers nothing (no info, no batch, a retryable TransportError for an
    ack) for ``SILENT_S`` after each wait begins, then answers."""

    publishes = False

    def __init__(self) -> None:
        self.since = time.monotonic()
        self.batches = 0

    def _silent(self) -> bool:
        return time.monotonic() - self.since < SILENT_S

    def _cut(self) -> None:
        from agentrl.errors import TransportError

        if self._silent():
            raise TransportError("GET http://serve/...: timed out")

    async def info(self) -> dict:  # as ServeSource.info: asks again until serve answers
        while self._silent():
            await asyncio.sleep(0.2)
        return {"version": 0}

    async def get_batch(self, version: int, **kw: object) -> tuple[str, list] | None:
        if self._silent():
            await asyncio.sleep(0.2)
            return None
        self.batches += 1
        return f"batch-{self.batches}", []

    async def ack(self, batch_id: str) -> bool:
        self._cut()
        return True


def _drive() -> dict:
    from agentrl.config import LearnConfig
    from agentrl.learner.dist import init_dist
    from agentrl.learner.feed import BatchFeed

    ctx = init_dist(timeout_s=DIST_TIMEOUT_S)
    source = _CutOffServe() if ctx.is_main else None
    feed = BatchFeed(LearnConfig(batch_timeout_s=0), ctx, source, Counter(), retry_s=0.5, heartbeat_s=1.0)
    feed.policies = SimpleNamespace(publishes=False, names=[],
                                    of=lambda name: SimpleNamespace(version=0, kwargs={}))
    waits = []

    async def main() -> list[str]:
        got = []
        t0 = time.monotonic()
        info = await feed.share(None if source is None else source.info)
        waits.append(round(time.monotonic() - t0, 1))
        got.append(f"info v{info['version']}")
        if source is not None:
            source.since = time.monotonic()
        t0 = time.monotonic()
        batch = await feed.next(time.monotonic())
        waits.append(round(time.monotonic() - t0, 1))
        got.append(batch.batch_id)
        if source is not None:  # the ack of that batch: cut off too (the others wait in next())
            source.since = time.monotonic()
        t0 = time.monotonic()
        got.append(f"acked {await feed.ack(batch, True)}")
        if source is not None:
            source.since = 0.0  # the next batch is there at once
        got.append((await feed.next(time.monotonic())).batch_id)
        waits.append(round(time.monotonic() - t0, 1))
        return got

    got = asyncio.run(main())
    ctx.close()
    return {"rank": ctx.rank, "world": ctx.world, "got": got, "waits_s": waits}


@pytest.mark.slow
def test_two_ranks_ride_out_waits_on_serve_longer_than_the_process_groups_timeout() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    ranks = sorted(lines, key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["world"] == 2, out.stdout
    for r in ranks:  # rank 0's answers on every rank, after waits longer than the timeout
        assert r["got"] == ["info v0", "batch-1", "acked True", "batch-2"], r
        assert all(w >= SILENT_S - 1 for w in r["waits_s"]), r
        assert min(r["waits_s"]) > DIST_TIMEOUT_S, r


if __name__ == "__main__":
    # one write of a whole line: the two ranks share stdout, and print's separate writes of the text
    # and its newline interleaved (one line came out holding both ranks' objects)
    sys.stdout.write(json.dumps(_drive()) + "\n")
    sys.stdout.flush()
