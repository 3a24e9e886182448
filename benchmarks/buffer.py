"""Buffer throughput: durable put, in-process get+ack, and 256-sample fetches over loopback HTTP.

Samples are 2,048 tokens (512 prompt, 1,536 generated across two policy versions) built as plain
Python lists, as the router produces them, with the info and timings the rollout code attaches. The log is on with ``sync="fsync"``. Prints one JSON
line at the end: put_samples_per_s, put_samples_per_s_one_per_call, get_samples_per_s,
batch_fetch_ms_p50 (and p90), bytes_per_sample, the same rates per CPU-second of this process
(meaningful on a shared, loaded machine), the load average, and the parameters.

    python benchmarks/buffer.py [--samples 8192] [--put-chunk 64] [--fetches 20] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from aiohttp import web

from agentrl.buffer import Buffer, BufferClient, BufferConfig, Sample, add_buffer_routes

TOKENS = 2048
ROUND = 1024
PROMPT = 512


def make_pool(n: int, rng: random.Random) -> list[Sample]:
    pool = []
    for i in range(n):
        gen = TOKENS - PROMPT
        switch = rng.randrange(gen)
        pool.append(Sample(
            token_ids=[rng.randrange(151_000) for _ in range(TOKENS)],
            loss_mask=[0] * PROMPT + [1] * gen,
            logprobs=[0.0] * PROMPT + [-rng.random() * 3 for _ in range(gen)],
            versions=[-1] * PROMPT + [10] * switch + [11] * (gen - switch),
            episode_id=f"e{i}", group_id=f"g{i}", env="bench", reward=rng.random(),
            # What the rollout code attaches to every sample (episode.py), so headers cost what they will.
            info={"task_id": f"task-{i}", "turns": 3, "sandbox_id": f"sb-{i:08x}", "calls": 2,
                  "truncation": None, "splits": 0},
            timings={"episode_s": 12.5 + rng.random(), "started": 1.7e9 + i},
        ))
    return pool


def fresh(pool: list[Sample], n: int, tag: str) -> list[Sample]:
    """n samples with distinct ids, sharing the pool's token lists (building lists is not timed)."""
    return [replace(pool[i % len(pool)], sample_id=f"{tag}-{i}") for i in range(n)]


async def bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    rng = random.Random(0)
    pool = make_pool(256, rng)
    cfg = BufferConfig(path=str(workdir / "buf"), batch_size=256, max_staleness=4, sync="fsync",
                       compact_bytes=1 << 40)
    buf = Buffer(cfg)

    # Each phase runs in rounds of 1,024 samples; the figures are the median round, and the best
    # round is reported beside it because shared build machines are often heavily loaded.
    put_rates, put_cpu_rates = [], []
    for r in range(args.samples // ROUND):
        samples = fresh(pool, ROUND, tag=f"r{r}")
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(0, ROUND, args.put_chunk):
            await buf.put(samples[i : i + args.put_chunk])
        put_rates.append(ROUND / (time.perf_counter() - t0))
        put_cpu_rates.append(ROUND / (time.process_time() - c0))
    bytes_per_sample = buf.stats()["log_bytes"] / buf.stats()["produced"]

    singles = fresh(pool, 256, tag="single")
    t0 = time.perf_counter()
    for s in singles:
        await buf.put([s])
    put_single_rate = len(singles) / (time.perf_counter() - t0)

    get_rates, get_cpu_rates = [], []
    while buf.stats()["depth"] >= ROUND:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(ROUND // 256):
            batch = await buf.get_batch(12, batch_size=256)
            assert batch is not None
            buf.ack(batch.batch_id)
        get_rates.append(ROUND / (time.perf_counter() - t0))
        get_cpu_rates.append(ROUND / (time.process_time() - c0))

    array_rates = []
    for r in range(2):
        await buf.put(fresh(pool, ROUND, tag=f"a{r}"))
        t0 = time.perf_counter()
        for _ in range(ROUND // 256):
            batch = await buf.get_batch(12, batch_size=256, as_arrays=True)
            assert batch is not None
            buf.ack(batch.batch_id)
        array_rates.append(ROUND / (time.perf_counter() - t0))

    app = web.Application(client_max_size=1 << 30)
    add_buffer_routes(app, buf, "bench-token")
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = BufferClient(f"http://127.0.0.1:{port}", "bench-token", timeout_s=30)
    fetch_ms, fetch_cpu_ms = [], []
    for _ in range(args.fetches):
        await buf.put(fresh(pool, 256, tag=f"f{len(fetch_ms)}"))
        t0, c0 = time.perf_counter(), time.process_time()
        batch = await client.get_batch(12, batch_size=256, timeout_s=5)
        fetch_ms.append(1000 * (time.perf_counter() - t0))
        fetch_cpu_ms.append(1000 * (time.process_time() - c0))
        assert batch is not None and len(batch.samples) == 256
        assert await client.ack(batch.batch_id)
    fetch_array_ms = []
    for _ in range(args.fetches // 2):
        await buf.put(fresh(pool, 256, tag=f"fa{len(fetch_array_ms)}"))
        t0 = time.perf_counter()
        batch = await client.get_batch(12, batch_size=256, timeout_s=5, as_arrays=True)
        fetch_array_ms.append(1000 * (time.perf_counter() - t0))
        assert batch is not None and await client.ack(batch.batch_id)
    await client.close()
    await runner.cleanup()
    stats = buf.stats()
    assert stats["identity_holds"]
    buf.close()
    return {
        "put_samples_per_s": round(statistics.median(put_rates), 1),
        "get_samples_per_s": round(statistics.median(get_rates), 1),
        "batch_fetch_ms_p50": round(statistics.median(fetch_ms), 2),
        "bytes_per_sample": round(bytes_per_sample, 1),
        "put_samples_per_s_best_round": round(max(put_rates), 1),
        "get_samples_per_s_best_round": round(max(get_rates), 1),
        "batch_fetch_ms_min": round(min(fetch_ms), 2),
        "batch_fetch_ms_p90": round(sorted(fetch_ms)[int(0.9 * (len(fetch_ms) - 1))], 2),
        "get_samples_per_s_as_arrays": round(statistics.median(array_rates), 1),
        "batch_fetch_ms_p50_as_arrays": round(statistics.median(fetch_array_ms), 2),
        "put_samples_per_s_one_per_call": round(put_single_rate, 1),
        # Per CPU-second of this process (inflated too when the machine is oversubscribed).
        "put_samples_per_cpu_s": round(statistics.median(put_cpu_rates), 1),
        "get_samples_per_cpu_s": round(statistics.median(get_cpu_rates), 1),
        "batch_fetch_cpu_ms_p50": round(statistics.median(fetch_cpu_ms), 2),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "tokens_per_sample": TOKENS,
        "samples": args.samples,
        "put_chunk": args.put_chunk,
        "sync": cfg.sync,
        "fetch_batch_size": 256,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--put-chunk", type=int, default=64, help="samples per put call")
    parser.add_argument("--fetches", type=int, default=20)
    parser.add_argument("--dir", type=Path, default=None, help="where the log goes (default: a temp dir)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.dir is not None:
        result = asyncio.run(bench(args, args.dir))
    else:
        with tempfile.TemporaryDirectory(prefix="agentrl-buffer-bench-") as d:
            result = asyncio.run(bench(args, Path(d)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
