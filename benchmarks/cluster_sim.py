"""A cluster-shaped run on one machine: where does it saturate, and do routers scale out (issue #37).

Each configuration is a whole ``agentrl serve --ray`` (a local Ray instance it starts itself) with
``--workers`` rollout worker actors playing the ``straggler`` environment (multi-turn, heavy-tailed
tool latencies) against ``--engines`` stand-in engines (:mod:`agentrl.engines.standin`: the vLLM
routes with a throughput model and no model, so the engines are not what is measured), and a
stand-in learner here that pulls batches from serve's buffer, "trains" for ``--step-s`` and
publishes every version to serve as a real learner does (full weights of the tiny model, over HTTP;
the stand-in engines take them as no-ops that still version).

Three configurations in the same run, the same everything else:

- ``one_router``: the workers call serve's router over HTTP (``ray.local_router = false``, as before
  2026-12-07): every model call of the cluster crosses serve's one router process;
- ``local_one_worker``: all the episodes in one worker that routes its own calls;
- ``local``: ``--workers`` workers, each routing its own calls (``ray.local_router = true``, the
  default). Its CPU per completion against ``local_one_worker``'s is the linearity check: the same
  work per call whether one router process or several do it (``cpu_per_completion_vs_one_worker``).

Each plays ``--warmup`` seconds, then measures ``--duration`` seconds: model calls completed (the
routers' ``calls`` counters: serve's and each worker's), CPU seconds per process type from
``/proc`` (serve, the rollout workers, the stand-in engines, Ray's own processes), the buffer's
puts, the learner's idle share and the staleness of what it trained on. The window starts once
every worker has finished an episode. ``bottleneck`` names the first component at its limit: a
process at 90% of a core or more, else the machine's cores, else the learner (idle under 10%),
else the engines (a request waiting for room on average).

Capture is checked on every sample the learner gets: token ids, logprobs, versions and the loss
mask of equal length, every generated token's logprob finite and at most 0 and its version one the
learner published, one sample per episode (``exact_capture_violations``; ``tests/test_ray_cluster.py``
and ``tests/test_router_processes.py`` check exactness against a real vLLM engine). ``lost_samples``:
samples the workers counted as put that serve's buffer does not have.

On 2 cores the machine itself bounds both configurations; the ratio says how much of the one-router
ceiling was serve's process. Final JSON line: ``engines``, ``episodes``, ``router_processes``,
``completions_per_s``, ``completions_per_s_one_router``, ``ratio``, ``cpu_ms_per_completion``,
``cpu_ms_per_completion_one_router`` (each per process type and in all), ``completions_per_s_one_worker``,
``cpu_ms_per_completion_one_worker``, ``cpu_per_completion_vs_one_worker``, ``buffer_puts_per_s``,
``learner_idle``, ``staleness``, ``lost_samples``, ``exact_capture_violations``, ``bottleneck``,
``bottleneck_one_router``, ``configs`` (every figure of both), ``wall_s``.

    .venv/bin/python benchmarks/cluster_sim.py [--engines 2] [--workers 2] [--episodes 256]
        [--duration 40] [--warmup 20] [--step-s 0.25]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import cpu_s, descendants, free_port, start_standins, tied_to_this_process  # noqa: E402

from agentrl.client import ServeClient, get_json  # noqa: E402


def serve_config(path: Path, run_dir: Path, port: int, urls: list[str], local: bool, workers: int,
                 args: argparse.Namespace) -> None:
    per_worker = max(args.group, args.episodes // workers)
    path.write_text(f"""model = "tiny-tools"
run_dir = "{run_dir}"
restore = false
[engine]
urls = {json.dumps(urls)}
max_model_len = 2048
[router]
port = {port}
[env]
name = "straggler"
config = {{ latency_median_s = {args.tool_median_s}, latency_sigma = {args.tool_sigma}, max_keys = 4 }}
max_turns = 5
max_tokens = {args.max_tokens}
group_size = {args.group}
max_concurrency = {args.episodes}
[buffer]
batch_size = {args.batch}
max_staleness = {args.max_staleness}
[ray]
address = "local"
workers = {workers}
worker_cpus = 0.25
worker_concurrency = {per_worker}
local_router = {str(local).lower()}
""")


class Learner:
    """Pulls batches as a learner would, 'trains' for ``step_s``, publishes each version."""

    def __init__(self, base: str, token: str, weights: bytes, step_s: float, batch: int,
                 max_staleness: int) -> None:
        from agentrl.buffer.http import BufferClient

        self.base, self.token, self.weights, self.step_s = base, token, weights, step_s
        self.client = BufferClient(base, token, timeout_s=30.0)
        self.batch, self.max_staleness = batch, max_staleness
        self.version = 0
        self.measuring = False
        self.waited = self.busy = 0.0
        self.staleness: Counter[int] = Counter()
        self.violations = 0
        self.samples = 0
        self.episodes: Counter[str] = Counter()

    def check(self, s: Any) -> None:
        import numpy as np

        n = len(s.token_ids)
        if not (len(s.loss_mask) == len(s.logprobs) == len(s.versions) == n) or not s.loss_mask.any():
            self.violations += 1
            return
        gen = s.loss_mask != 0
        lp, vs = s.logprobs[gen], s.versions[gen]
        if not np.all(np.isfinite(lp)) or np.any(lp > 0) or vs.min() < 0 or vs.max() > self.version:
            self.violations += 1
        self.episodes[s.episode_id] += 1
        if self.measuring:
            self.staleness[int(self.version - vs.min())] += 1

    async def run(self) -> None:
        from agentrl.weights.transfer import publish

        while True:
            t0 = time.monotonic()
            batch = await self.client.get_batch(self.version, self.max_staleness, self.batch, timeout_s=10.0)
            t1 = time.monotonic()
            if self.measuring:
                self.waited += t1 - t0
            if batch is None:
                continue
            for s in batch.samples:
                self.check(s)
            self.samples += len(batch.samples)
            await asyncio.sleep(self.step_s)
            await self.client.ack(batch.batch_id)
            self.version += 1
            await publish(self.weights, self.version, self.base, self.token)
            if self.measuring:
                self.busy += time.monotonic() - t1

    async def close(self) -> None:
        await self.client.close()


def snapshot(serve_pid: int, engine_pids: list[int], status: dict[str, Any]) -> dict[str, Any]:
    workers = [w for w in (status.get("rollout") or {}).get("workers", []) if isinstance(w, dict)]
    worker_pids = {int(w["pid"]) for w in workers if w.get("pid")}
    ray_pids = [p for p in descendants(serve_pid) if p not in worker_pids]
    calls = float(status["router"]["calls"]) + sum(float((w.get("router") or {}).get("calls", 0))
                                                   for w in workers)
    return {
        "t": time.monotonic(), "calls": calls,
        "cpu": {"serve": cpu_s(serve_pid), "workers": sum(cpu_s(p) for p in worker_pids),
                "engines": sum(cpu_s(p) for p in engine_pids), "ray": sum(cpu_s(p) for p in ray_pids)},
        "worker_cpu": {p: cpu_s(p) for p in worker_pids},
        "produced": float(status["buffer"].get("produced", 0)),
        "rollout_samples": float((status.get("rollout") or {}).get("samples", 0)),
    }


def engine_waiting(urls: list[str]) -> float:
    """Requests the stand-in engines hold waiting for room, summed (their /metrics)."""
    import urllib.request

    from agentrl.engines.pool import metric_sums

    total = 0.0
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
                total += metric_sums(r.read().decode(), ["vllm:num_requests_waiting"]).get(
                    "vllm:num_requests_waiting", 0.0)
        except OSError:
            pass
    return total


async def one_config(name: str, local: bool, workers: int, urls: list[str], engine_pids: list[int],
                     weights: bytes, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    run_dir, port = root / name, free_port()
    config = root / f"{name}.toml"
    serve_config(config, run_dir, port, urls, local, workers, args)
    base = f"http://127.0.0.1:{port}"
    out = open(root / f"{name}.serve.log", "wb")  # noqa: SIM115 - closed below
    env = {k: v for k, v in os.environ.items() if k != "AGENTRL_ADMIN_TOKEN"}
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "serve", "--config", str(config)],
                            stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=tied_to_this_process(),
                            start_new_session=True)
    t0 = time.monotonic()
    try:
        while get_json(f"{base}/health")[0] != 200:
            if proc.poll() is not None or time.monotonic() - t0 > 300:
                raise SystemExit(f"[{name}] serve did not come up; see {root / f'{name}.serve.log'}")
            await asyncio.sleep(0.5)
        token = (run_dir / "admin_token").read_text().strip()
        print(f"[{name}] serving after {time.monotonic() - t0:.0f} s; warming up {args.warmup:.0f} s",
              file=sys.stderr, flush=True)
        learner = Learner(base, token, weights, args.step_s, args.batch, args.max_staleness)
        learning = asyncio.create_task(learner.run())
        async with ServeClient(base, token, timeout_s=30.0) as http:
            while True:  # every worker has finished an episode (a slow start is not measured)
                playing = (await http.json("GET", "/admin/status")).get("rollout", {}).get("workers", [])
                if playing and all((w.get("episodes") or 0) >= 1 for w in playing):
                    break
                if time.monotonic() - t0 > 600:
                    raise SystemExit(f"[{name}] the rollout workers did not all play an episode in 600 s")
                await asyncio.sleep(1.0)
            await asyncio.sleep(args.warmup)
            first = snapshot(proc.pid, engine_pids, await http.json("GET", "/admin/status"))
            learner.measuring = True
            waiting = []
            for _ in range(max(1, int(args.duration // 5))):
                await asyncio.sleep(args.duration / max(1, int(args.duration // 5)))
                waiting.append(await asyncio.to_thread(engine_waiting, urls))
            last_status = await http.json("GET", "/admin/status")
            last = snapshot(proc.pid, engine_pids, last_status)
            learner.measuring = False
        learning.cancel()
        await asyncio.gather(learning, return_exceptions=True)
        await learner.close()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # serve shuts its Ray instance down
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(ProcessLookupError):  # whatever of its session outlived it
            os.killpg(proc.pid, signal.SIGKILL)
        out.close()
    dt = last["t"] - first["t"]
    calls = last["calls"] - first["calls"]
    cpu = {k: last["cpu"][k] - first["cpu"][k] for k in last["cpu"]}
    per_call = {k: round(1000 * v / calls, 3) if calls else None for k, v in cpu.items()}
    per_call["total"] = round(1000 * sum(cpu.values()) / calls, 3) if calls else None
    util = {"serve": cpu["serve"] / dt,
            "worker_max": max((last["worker_cpu"].get(p, 0) - first["worker_cpu"].get(p, 0)
                               for p in last["worker_cpu"]), default=0.0) / dt,
            "machine": sum(cpu.values()) / dt / (os.cpu_count() or 1)}
    learner_idle = learner.waited / max(1e-9, learner.waited + learner.busy)
    if util["serve"] >= 0.9:
        bottleneck = "serve's process (router and buffer)"
    elif util["worker_max"] >= 0.9:
        bottleneck = "a rollout worker's process (agent loops and its router)"
    elif util["machine"] >= 0.9:
        bottleneck = f"the machine's {os.cpu_count()} cores"
    elif learner_idle < 0.1:
        bottleneck = "the learner"
    elif waiting and sum(waiting) / len(waiting) >= 1:
        bottleneck = "the engines (requests waiting for room)"
    else:
        bottleneck = "none at its limit (the tools' latency and the episode count bound the rate)"
    worker_status = (last_status.get("rollout") or {}).get("workers", [])
    lost = max(0.0, last["rollout_samples"] - last["produced"])
    fig = {
        "router_processes": workers if local else 1, "workers": workers,
        "completions": int(calls), "seconds": round(dt, 1),
        "completions_per_s": round(calls / dt, 1),
        "cpu_ms_per_completion": per_call,
        "utilisation": {k: round(v, 3) for k, v in util.items()},
        "buffer_puts_per_s": round((last["produced"] - first["produced"]) / dt, 1),
        "learner_idle": round(learner_idle, 3),
        "learner_versions": learner.version,
        "staleness": {str(k): v for k, v in sorted(learner.staleness.items())},
        "samples_checked": learner.samples,
        "exact_capture_violations": learner.violations + sum(1 for n in learner.episodes.values() if n > 1),
        "lost_samples": int(lost),
        "engine_requests_waiting_mean": round(sum(waiting) / len(waiting), 2) if waiting else None,
        "serve_router_calls": int(last_status["router"]["calls"]),
        "worker_router_calls": [int((w.get("router") or {}).get("calls", 0)) for w in worker_status],
        "bottleneck": bottleneck,
    }
    print(f"[{name}] {json.dumps(fig)}", file=sys.stderr, flush=True)
    return fig


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    from agentrl.models import resolve_model
    from agentrl.weights.transfer import serialize_state_dict

    t0 = time.monotonic()
    model = resolve_model("tiny-tools")
    from safetensors.torch import load_file

    weights = serialize_state_dict(load_file(str(Path(model) / "model.safetensors")))
    root = Path(args.run_root) if args.run_root else Path(tempfile.mkdtemp(prefix="agentrl-cluster-sim-"))
    root.mkdir(parents=True, exist_ok=True)
    urls, engines = start_standins(args.engines, model, "--tokens-per-s", str(args.tokens_per_s),
                                   "--kv-tokens", "10000000", "--step-s", "0.01")
    try:
        configs = {}
        plan = [("one_router", False, args.workers), ("local", True, args.workers)]
        if args.workers > 1:  # the same episodes through one worker and its router: is it linear?
            plan.insert(1, ("local_one_worker", True, 1))
        for name, local, workers in plan:
            configs[name] = await one_config(name, local, workers, urls, [p.pid for p in engines], weights,
                                             root, args)
    finally:
        for p in engines:
            p.terminate()
        for p in engines:
            p.wait()
    one, loc = configs["one_router"], configs["local"]
    ratio = loc["completions_per_s"] / one["completions_per_s"] if one["completions_per_s"] else math.nan
    single = configs.get("local_one_worker")
    linear = (round(loc["cpu_ms_per_completion"]["total"] / single["cpu_ms_per_completion"]["total"], 3)
              if single and single["cpu_ms_per_completion"]["total"] else None)
    if not args.run_root:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "benchmark": "cluster_sim", "engines": args.engines, "episodes": args.episodes,
        "workers": args.workers, "router_processes": loc["router_processes"],
        "completions_per_s": loc["completions_per_s"],
        "completions_per_s_one_router": one["completions_per_s"],
        "ratio": round(ratio, 3),
        "cpu_ms_per_completion": loc["cpu_ms_per_completion"],
        "cpu_ms_per_completion_one_router": one["cpu_ms_per_completion"],
        "completions_per_s_one_worker": single["completions_per_s"] if single else None,
        "cpu_ms_per_completion_one_worker": single["cpu_ms_per_completion"] if single else None,
        "cpu_per_completion_vs_one_worker": linear,
        "buffer_puts_per_s": loc["buffer_puts_per_s"], "learner_idle": loc["learner_idle"],
        "staleness": loc["staleness"],
        "lost_samples": sum(c["lost_samples"] for c in configs.values()),
        "exact_capture_violations": sum(c["exact_capture_violations"] for c in configs.values()),
        "bottleneck": loc["bottleneck"], "bottleneck_one_router": one["bottleneck"],
        "configs": configs, "cpus": os.cpu_count(), "wall_s": round(time.monotonic() - t0, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=2, help="stand-in engine processes")
    p.add_argument("--workers", type=int, default=2, help="rollout worker actors")
    p.add_argument("--episodes", type=int, default=256, help="episodes in flight over all workers")
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--max-staleness", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per model call")
    p.add_argument("--tool-median-s", type=float, default=0.05, help="the tools' median latency")
    p.add_argument("--tool-sigma", type=float, default=1.0, help="log-normal shape of tool latency")
    p.add_argument("--tokens-per-s", type=float, default=50000.0, help="each stand-in engine's decode rate")
    p.add_argument("--step-s", type=float, default=0.25, help="the stand-in learner's time per step")
    p.add_argument("--warmup", type=float, default=20.0)
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--run-root", default="", help="keep every run's folder and log here")
    args = p.parse_args()
    print(json.dumps(asyncio.run(amain(args))), flush=True)


if __name__ == "__main__":
    main()
