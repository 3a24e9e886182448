"""Async versus sync: the same training workload through both pipelines, in one run.

Both runs are ``agentrl run`` (real vLLM engine, router, buffer, learner, weight sync) on the
``straggler`` environment, whose tool latencies are log-normal (p99 about 20x the median) and whose
episodes take 2 to ``max_keys + 1`` turns (heavy-tailed). They differ in one setting:

- ``env.mode=sync``: the synchronous loop built from the same parts: start one batch of groups,
  wait for the slowest episode, let the learner train and publish, wait until the engines serve the
  new weights, repeat;
- ``env.mode=async`` (the default pipeline): agent loops run continuously under admission control,
  the learner trains whenever a batch is ready, weights move between forward passes.

Figures come from each run's ``learner.jsonl``: throughput is the samples trained per second from
the end of the first ``--warmup`` steps to the end of the last step (engine start-up and model
loading excluded alike); learner idle is the time the learner spent waiting for a batch in that
window; staleness is over the samples trained in async mode (the bound is ``--max-staleness``). A
timeline chart of both runs (episodes and learner phases) is written to ``--out``. Prints one JSON
line at the end.

    python benchmarks/async_vs_sync.py [--steps 10] [--batch 32] [--group 4] [--out runs/async_vs_sync]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import free_port, tied_to_this_process  # benchmarks/common.py


def run_mode(mode: str, args: argparse.Namespace, out: Path, *, name: str = "",
             extra: tuple[str, ...] = (), env: str = "straggler", max_turns: int = 0) -> Path:
    """One ``agentrl run`` of ``mode`` in ``out/<name or mode>``, with ``extra`` options appended
    (benchmarks/scoring_pace.py runs the async mode with and without a judge), on ``env`` (one that
    takes straggler's config; benchmarks/multi_agent_stragglers.py plays ``straggler_roles``) with
    ``max_turns`` calls per episode at most (default: straggler's ``max_keys + 1``)."""
    name = name or mode
    run_dir = out / name
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    env_cfg = {"latency_median_s": args.latency_median, "latency_sigma": args.latency_sigma,
               "max_keys": args.max_keys}
    cmd = [sys.executable, "-m", "agentrl.cli", "run",
           f"--serve.model={args.model}", f"--serve.run_dir={run_dir}",
           f"--serve.router.port={free_port()}", f"--serve.engine.base_port={free_port()}",
           f"--serve.env.name={env}", f"--serve.env.mode={mode}",
           *(f"--serve.env.config.{k}={v}" for k, v in env_cfg.items()),
           f"--serve.env.group_size={args.group}", f"--serve.env.max_turns={max_turns or args.max_keys + 1}",
           f"--serve.env.max_tokens={args.max_tokens}", f"--serve.env.max_concurrency={args.concurrency}",
           f"--serve.buffer.batch_size={args.batch}", f"--serve.buffer.max_staleness={args.max_staleness}",
           f"--learn.steps={args.steps}", f"--learn.lr={args.lr}", "--eval.tasks=0", *extra]
    print(f"[{name}] {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=tied_to_this_process())
    assert proc.stdout is not None
    for line in proc.stdout:  # progress: the learner prints a line per step
        if line.startswith("step ") or "ERROR" in line or "Traceback" in line:
            print(f"[{name} {time.monotonic() - t0:6.0f}s] {line.rstrip()}", file=sys.stderr, flush=True)
    if proc.wait() != 0:
        raise SystemExit(f"{name} run failed (exit {proc.returncode}); see {run_dir}/serve.log")
    return run_dir


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def figures(run_dir: Path, warmup: int) -> dict[str, Any]:
    rows = read_jsonl(run_dir / "learner.jsonl")
    if len(rows) <= warmup:
        raise SystemExit(f"{run_dir}: only {len(rows)} learner steps; need more than --warmup {warmup}")
    start = rows[warmup - 1]["time"] if warmup else rows[0]["time"] - sum(
        rows[0][k] for k in ("wait_s", "train_s", "sync_s", "checkpoint_s"))
    window = rows[warmup:]
    elapsed = window[-1]["time"] - start
    samples = sum(r["samples"] for r in window)
    stale: list[int] = []
    for r in window:
        for k, n in r.get("staleness_hist", {}).items():
            stale += [int(k)] * int(n)
    stale.sort()
    return {"samples_per_s": samples / elapsed, "learner_idle": sum(r["wait_s"] for r in window) / elapsed,
            "window_s": elapsed, "samples": samples, "steps": len(window),
            "step_s_mean": elapsed / len(window),
            "staleness_p50": stale[len(stale) // 2] if stale else 0, "staleness_max": max(stale, default=0),
            "reward_mean": statistics.fmean(r["reward_mean"] for r in window)}


def episode_latencies(run_dir: Path) -> dict[str, float]:
    eps = read_jsonl(run_dir / "episodes.jsonl")
    secs = sorted(e["seconds"] for e in eps)
    if not secs:
        return {}
    return {"episodes": len(secs), "episode_s_p50": secs[len(secs) // 2],
            "episode_s_p99": secs[min(len(secs) - 1, int(len(secs) * 0.99))], "episode_s_max": secs[-1]}


def learner_phases(rows: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """(phase, start, end) per learner step, from each row's end time and phase durations."""
    out = []
    for r in rows:
        end = r["time"]
        for phase in ("checkpoint_s", "sync_s", "train_s", "wait_s"):
            start = end - r.get(phase, 0.0)
            out.append((phase[:-2], start, end))
            end = start
    return out


def chart(out: Path, runs: dict[str, Path]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"wait": "#d62728", "train": "#2ca02c", "sync": "#1f77b4", "checkpoint": "#9467bd"}
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 3.2 * len(runs)), squeeze=False)
    for ax, (mode, run_dir) in zip(axes[:, 0], runs.items(), strict=True):
        rows = read_jsonl(run_dir / "learner.jsonl")
        eps = sorted(read_jsonl(run_dir / "episodes.jsonl"), key=lambda e: e["started"])
        t0 = min([e["started"] for e in eps] or [rows[0]["time"]])
        lanes: list[float] = []  # end time of the episode last placed in each lane
        for e in eps:
            s, f = e["started"] - t0, e["started"] + e["seconds"] - t0
            lane = next((i for i, end in enumerate(lanes) if end <= s), len(lanes))
            if lane == len(lanes):
                lanes.append(f)
            lanes[lane] = f
            ax.plot([s, f], [lane + 2, lane + 2], color="0.55", lw=0.8)
        for phase, s, f in learner_phases(rows):
            ax.barh(0, f - s, left=s - t0, height=1.2, color=colors[phase], edgecolor="none")
        for phase, c in colors.items():
            ax.barh(0, 0, color=c, label=f"learner {phase}")
        ax.set_title(f"{mode}: episodes (grey, one line each) and learner phases (bottom band)")
        ax.set_xlabel("seconds since the first episode started")
        ax.set_yticks([])
        ax.legend(loc="upper right", fontsize=8, ncol=4)
    fig.tight_layout()
    path = out / "async_vs_sync_timeline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def workload_options(p: argparse.ArgumentParser) -> None:
    """The workload's options (shared with benchmarks/scoring_pace.py)."""
    p.add_argument("--steps", type=int, default=10, help="learner steps per run")
    p.add_argument("--warmup", type=int, default=1, help="learner steps left out of the figures")
    p.add_argument("--batch", type=int, default=32, help="samples per learner batch")
    p.add_argument("--group", type=int, default=4, help="episodes per task")
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=256, help="episodes in flight at most (async)")
    p.add_argument("--max-tokens", type=int, default=48, help="completion tokens per model call")
    p.add_argument("--latency-median", type=float, default=1.5, help="median tool latency, seconds")
    p.add_argument("--latency-sigma", type=float, default=1.3, help="log-normal sigma (1.3: p99 ~20x median)")
    p.add_argument("--max-keys", type=int, default=8, help="most tool turns in an episode")
    p.add_argument("--model", default="tiny-tools")
    p.add_argument("--lr", type=float, default=1e-4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    workload_options(p)
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--out", default="runs/async_vs_sync")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {mode: run_mode(mode, args, out) for mode in args.modes.split(",")}
    fig = {mode: figures(d, args.warmup) for mode, d in runs.items()}
    lat = {mode: episode_latencies(d) for mode, d in runs.items()}
    path = chart(out, runs)
    result: dict[str, Any] = {"benchmark": "async_vs_sync", "model": args.model, "batch": args.batch,
                              "group": args.group, "steps": args.steps, "max_staleness": args.max_staleness}
    for mode in runs:
        result[f"samples_per_s_{mode}"] = round(fig[mode]["samples_per_s"], 3)
        result[f"learner_idle_{mode}"] = round(fig[mode]["learner_idle"], 4)
        result[f"step_s_{mode}"] = round(fig[mode]["step_s_mean"], 2)
        result[f"reward_{mode}"] = round(fig[mode]["reward_mean"], 4)
        result[f"episodes_{mode}"] = {k: round(v, 3) for k, v in lat[mode].items()}
    if "async" in runs:
        result["staleness_p50"] = fig["async"]["staleness_p50"]
        result["staleness_max"] = fig["async"]["staleness_max"]
        result["staleness_within_bound"] = fig["async"]["staleness_max"] <= args.max_staleness
    if "async" in runs and "sync" in runs:
        result["speedup"] = round(fig["async"]["samples_per_s"] / fig["sync"]["samples_per_s"], 3)
    result["load_avg"] = round(os.getloadavg()[0], 2)
    result["chart"] = str(path)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
