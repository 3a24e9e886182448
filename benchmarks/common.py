"""What the benchmarks share: a free loopback port, one percentile convention, running ``agentrl run``,
serve's weight receiver over one engine, stand-in engines, a process's CPU seconds and its
descendants, and ``tied_to_this_process()`` for every process a benchmark starts (``preexec_fn``): a
benchmark killed, with SIGTERM or SIGKILL, takes its runs, services and engines with it instead of
leaving them on the machine.

Benchmarks run as scripts (``python benchmarks/x.py``), so this module is imported as ``common``
(the script's own folder is on ``sys.path``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from agentrl.procs import tied_to_this_process

TICK = os.sysconf("SC_CLK_TCK")


def in_flight_options(p: argparse.ArgumentParser, *, model: str, max_tokens: int) -> None:
    """The options of the benchmarks that publish weights while generations stream."""
    p.add_argument("--model", default=model, help="tiny, tiny-tools, smollm2 or a model folder")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--lead-s", type=float, default=2.0,
                   help="seconds of generation before each measured update")


def free_port() -> int:
    """A port nobody listens on now, on 127.0.0.1, with the three after it free too, below the
    ephemeral range (:func:`agentrl.web.free_port`)."""
    from agentrl.web import free_port as outside_ephemeral

    return outside_ephemeral(span=4)


def percentile(xs: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (``q`` in [0, 1]) of ``xs``: the value at index
    ``min(n - 1, floor(q * n))`` of the sorted values; NaN for no values."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def agentrl_run(cmd: list[str], run_dir: Path, t0: float) -> dict[str, Any]:
    """Run ``cmd`` (an ``agentrl run`` command line), passing its progress lines (steps, evaluations,
    errors) through to stderr with the seconds since ``t0``; its final JSON summary line. Exits
    with the run's log named if the run fails."""
    import json
    import os
    import subprocess
    import sys
    import time

    print(" ".join(cmd[2:]), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=tied_to_this_process())
    assert proc.stdout is not None
    last = ""
    for line in proc.stdout:
        line = line.rstrip()
        if line.startswith(("step ", "eval ", "success ")) or "ERROR" in line:
            print(f"[{time.monotonic() - t0:5.0f}s] {line}", file=sys.stderr, flush=True)
        if line.startswith("{"):
            last = line
    if proc.wait() != 0 or not last:
        raise SystemExit(f"agentrl run failed (exit {proc.returncode}); see {run_dir}/serve.log")
    return json.loads(last)


@contextlib.asynccontextmanager
async def weight_receiver(engine_url: str, root: Path, port: int = 0) -> AsyncIterator[tuple[Any, Any, str]]:
    """serve's weight path over one engine, in this process: the pool, its ``EngineUpdater`` and the
    receiver's routes on loopback (``port``, 0: a free one); yields (pool, updater, serve's URL)."""
    from aiohttp import web

    from agentrl.engines.pool import EnginePool
    from agentrl.weights import EngineUpdater, WeightReceiver

    pool = EnginePool([engine_url], health_interval_s=3600)
    await pool.start()
    updater = EngineUpdater(pool)
    await updater.start()
    app = web.Application(client_max_size=2**31)
    WeightReceiver(root, updater).add_routes(app, lambda request: None)
    runner = web.AppRunner(app)
    await runner.setup()
    port = port or free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield pool, updater, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await pool.close()


def start_standins(n: int, model: str, *flags: str) -> tuple[list[str], list[subprocess.Popen]]:
    """``n`` stand-in engine processes (:mod:`agentrl.engines.standin`, served name "tiny-tools",
    ``flags`` passed on: ``--tokens-per-s``, ``--kv-tokens``, ...), each ready; their URLs and
    processes (the caller stops them; they die with it)."""
    urls, procs = [], []
    for _ in range(n):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "agentrl.engines.standin", "--port", str(port),
                                 "--model", model, "--served-model-name", "tiny-tools", *flags],
                                stdout=subprocess.PIPE, text=True, preexec_fn=tied_to_this_process())
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("standin engine ready"):
            for p in procs:
                p.kill()
            raise SystemExit(f"a stand-in engine did not start: {line!r}")
        urls.append(f"http://127.0.0.1:{port}")
    return urls, procs


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Ray's raylet, GCS and workers are serve's descendants)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parts = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(parts[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out
