"""kill -9 of serve and of the learner at random points loses and duplicates nothing.

The test runs real processes on loopback: a serve process (a durable Buffer behind the HTTP
routes, fed by a producer loop that respects admission control) and a learner process (pulls
batches, "trains", acks). Both are killed with SIGKILL at random moments and restarted, many times.
The learner keeps a journal: an intent line (batch id, sample ids) before it acks and a commit or
abort line after. On restart it settles a dangling intent by acking again (acks are idempotent;
a refused ack means the samples will be served again). At the end, the journal's committed
sample ids must be exactly the buffer's consumed samples, each once, every sample the producer
saw stored must be known to the buffer, and produced = consumed + dropped + pending.

This file is also the program those processes run: ``python test_buffer_crash.py serve|learn|settle``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from agentrl.web import free_port  # this file also runs as a script (spawn), where tests/ is no package

TOKEN = "crash-test-token"
BATCH = 4
STALENESS = 2


def buffer_config(workdir: Path) -> Any:
    from agentrl.buffer import BufferConfig

    return BufferConfig(path=str(workdir / "buf"), batch_size=BATCH, max_staleness=STALENESS, group_size=2,
                        group_deadline_s=0.3, partial_groups="serve", lease_s=2.0, sync="fsync")


def read_lines(path: Path) -> list[Any]:
    """JSON lines of a journal, tolerating a torn last line (the writer may have been killed)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def append_line(f: Any, obj: Any) -> None:
    f.write(json.dumps(obj) + "\n")
    f.flush()
    os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------- serve


async def serve_main(workdir: Path, port: int) -> None:
    from aiohttp import web

    from agentrl.buffer import Buffer, Sample, add_buffer_routes

    buf = Buffer(buffer_config(workdir))
    app = web.Application()
    add_buffer_routes(app, buf, TOKEN)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    produced = (workdir / "produced.jsonl").open("a")

    def episode(gid: str, version: int, sid: str | None = None) -> list[Sample]:
        eid = uuid.uuid4().hex
        out = []
        for _ in range(random.choice([1, 1, 2])):
            n = random.randint(4, 40)
            out.append(
                Sample(
                    token_ids=[random.randrange(1000) for _ in range(n)],
                    loss_mask=[0, 0] + [1] * (n - 2),
                    logprobs=[0.0, 0.0] + [-1.0] * (n - 2),
                    versions=[-1, -1] + [version] * (n - 2),
                    episode_id=eid,
                    group_id=gid,
                    env="crash",
                    reward=random.random(),
                    **({"sample_id": sid} if sid else {}),
                )
            )
        return out

    # A producer that retries puts it never saw finish: repeats must be ignored.
    for rec in read_lines(workdir / "produced.jsonl")[-3:]:
        await buf.put(episode(uuid.uuid4().hex, 0, sid=rec["id"])[:1])
    while True:
        if not await buf.wait_for_room(in_flight=0, timeout_s=0.5):
            continue
        version = max(buf.learner_version, 0) - random.randint(0, 3)
        gid = uuid.uuid4().hex
        members = 2 if random.random() < 0.85 else 1  # some groups straggle past the deadline
        for _ in range(members):
            samples = episode(gid, version)
            await buf.put(samples)
            for s in samples:
                append_line(produced, {"id": s.sample_id})
        await asyncio.sleep(0.005)


# ---------------------------------------------------------------------------------------- learn


async def until_answered(make_call: Any) -> Any:
    from agentrl.buffer import BufferTransportError

    while True:
        try:
            return await make_call()
        except BufferTransportError:
            await asyncio.sleep(0.1)


async def learn_main(workdir: Path, port: int, settle_only: bool) -> None:
    from agentrl.buffer import BufferClient

    journal_path = workdir / "learner.jsonl"
    entries = read_lines(journal_path)
    version = sum(1 for e in entries if e.get("kind") == "commit")
    journal = journal_path.open("a")
    client = BufferClient(f"http://127.0.0.1:{port}", TOKEN, timeout_s=2.0, retries=0)
    if entries and entries[-1].get("kind") == "intent":  # killed between intent and outcome
        bid = entries[-1]["batch_id"]
        ok = await until_answered(lambda: client.ack(bid))
        append_line(journal, {"kind": "commit" if ok else "abort", "batch_id": bid})
        version += ok
    if settle_only:
        await client.close()
        return
    await until_answered(client.release_leases)
    while True:
        batch = await until_answered(lambda v=version: client.get_batch(v, STALENESS, BATCH, timeout_s=0.5))
        if batch is None:
            continue
        bad = [s.sample_id for s in batch.samples if s.staleness(version) > STALENESS]
        if bad:
            append_line(journal, {"kind": "violation", "ids": bad, "version": version})
        append_line(journal, {"kind": "intent", "batch_id": batch.batch_id,
                              "ids": [s.sample_id for s in batch.samples]})
        await asyncio.sleep(random.uniform(0, 0.02))  # the optimizer step
        ok = await until_answered(lambda b=batch.batch_id: client.ack(b))
        append_line(journal, {"kind": "commit" if ok else "abort", "batch_id": batch.batch_id})
        version += ok


# ---------------------------------------------------------------------------------------- test


def spawn(role: str, workdir: Path, port: int) -> subprocess.Popen[bytes]:
    err = (workdir / f"{role}.stderr").open("ab")
    return subprocess.Popen([sys.executable, __file__, role, str(workdir), str(port)], stdout=err, stderr=err,
                            cwd=Path(__file__).resolve().parents[1])


def wait_until_serving(port: int, p: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/buffer/stats", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    while time.monotonic() < deadline:
        assert p.poll() is None, "serve exited on its own"
        try:
            with urllib.request.urlopen(req, timeout=1.0):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"serve did not answer within {timeout_s}s")


def kill9(p: subprocess.Popen[bytes]) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill_9_of_serve_and_learner_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    from agentrl.buffer import Buffer

    rng = random.Random(int(os.environ.get("BUFFER_CRASH_SEED", "0")) or None)
    port = free_port()
    serve = spawn("serve", tmp_path, port)
    learner = spawn("learn", tmp_path, port)
    kills = {"serve": 0, "learn": 0}
    try:
        for _ in range(24):
            wait_until_serving(port, serve)
            time.sleep(rng.uniform(0.1, 1.0))
            victim = rng.choice(["serve", "learn", "both"])
            if victim in ("serve", "both"):
                kill9(serve)
                kills["serve"] += 1
            if victim in ("learn", "both"):
                kill9(learner)
                kills["learn"] += 1
            assert serve.poll() is None or victim in ("serve", "both"), (
                tmp_path / "serve.stderr"
            ).read_text()
            if serve.poll() is not None:
                serve = spawn("serve", tmp_path, port)
            if learner.poll() is not None:
                learner = spawn("learn", tmp_path, port)
        time.sleep(1.0)
        kill9(learner)
        settle = spawn("settle", tmp_path, port)
        assert settle.wait(timeout=60) == 0, (tmp_path / "settle.stderr").read_text()
    finally:
        for p in (serve, learner):
            if p.poll() is None:
                kill9(p)

    buf = Buffer(buffer_config(tmp_path))
    stats = buf.stats()
    journal = read_lines(tmp_path / "learner.jsonl")
    assert not [e for e in journal if e["kind"] == "violation"], ("a served sample exceeded "
                                                                  "the staleness bound")
    intents = {e["batch_id"]: e["ids"] for e in journal if e["kind"] == "intent"}
    committed = [i for e in journal if e["kind"] == "commit" for i in intents[e["batch_id"]]]
    produced = {e["id"] for e in read_lines(tmp_path / "produced.jsonl")}

    assert stats["identity_holds"], stats
    assert (
        stats["produced"] == stats["consumed"] + sum(stats["dropped_by_reason"].values()) + stats["pending"]
    )
    assert len(committed) == len(set(committed)), "a sample was consumed twice"
    assert stats["consumed"] == len(committed), "buffer and learner disagree on what was consumed"
    assert all(buf.sample_state(i) == "consumed" for i in committed)
    assert all(buf.sample_state(i) is not None for i in produced), "a stored sample was lost"
    assert stats["produced"] >= len(produced)
    assert len(committed) >= 20 * BATCH, f"too little progress to mean anything: {stats}"
    logging.getLogger(__name__).info("kills %s, stats %s", kills, stats)
    buf.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    role, workdir_arg, port_arg = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    if role == "serve":
        asyncio.run(serve_main(workdir_arg, port_arg))
    else:
        asyncio.run(learn_main(workdir_arg, port_arg, settle_only=role == "settle"))
