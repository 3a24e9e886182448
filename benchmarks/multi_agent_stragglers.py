"""Multi-agent stragglers: async versus sync on a three-role workload with heavy-tailed latency.

The same ``agentrl run`` pair as ``benchmarks/async_vs_sync.py`` (real vLLM engine, router, buffer,
full-weights learner, weight sync; its functions, not a copy), on ``straggler_roles``: a planner, a
worker and a reviewer play each episode one after another, every one waiting on a log-normal tool
latency between its calls (median ``--latency-median``, 0.5 s, sigma 1.5: p99 about 33x the median), the
worker once per key (1 to ``--max-keys``, heavy-tailed). All three roles are bound to the default
policy, so each episode gives the learner three samples (one per role, each with its role's reward).
The sync baseline starts one batch of samples per barrier (``batch / (3 x group)`` groups) and waits
for its slowest episode; async runs the agent loops continuously under the staleness bound.

Figures (each run's ``learner.jsonl`` after ``--warmup`` steps, as in async_vs_sync): learner idle
in both modes, the speed-up in samples trained per second, what became of the samples made (trained,
or dropped as stale: serve's metrics), and the tool latencies' p99/median over the waits drawn for
every episode both runs started (``latency_p99_over_p50``; ``_finished``: over the finished ones'
``info.tool_s`` alone, which a run's end biases short). Prints one JSON line.

    python benchmarks/multi_agent_stragglers.py [--steps 40] [--batch 24] [--max-staleness 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from async_vs_sync import episode_latencies, figures, read_jsonl, run_mode, workload_options

ENV = "straggler_roles"
ROLES = ("planner", "worker", "reviewer")


def tool_latencies(runs: dict[str, Path], args: argparse.Namespace) -> dict[str, float]:
    """The tool waits of every episode the runs started, finished or not (each task's seed draws
    them: ``drawn_waits``; a group's episodes share theirs, counted once), and beside them those of
    the finished episodes alone (``info.tool_s``), which a run's end biases short: the episodes it
    cut off are the ones that drew the longest waits."""
    import agentrl

    env = agentrl.make(ENV, latency_median_s=args.latency_median, latency_sigma=args.latency_sigma,
                       max_keys=args.max_keys)
    started = [row["task"] for d in runs.values() for row in read_jsonl(d / "rollout_frontier.jsonl")
               if "start" in row]
    drawn = sorted(w for task in started for w in env.drawn_waits(task))
    finished = sorted(s for d in runs.values() for e in read_jsonl(d / "episodes.jsonl")
                      for s in (e.get("info") or {}).get("tool_s", []))
    out: dict[str, float] = {}
    for name, waits in (("", drawn), ("_finished", finished)):
        if waits:
            p50, p99 = waits[len(waits) // 2], waits[min(len(waits) - 1, int(len(waits) * 0.99))]
            out |= {f"tool_waits{name}": len(waits), f"tool_s_p50{name}": p50, f"tool_s_p99{name}": p99,
                    f"latency_p99_over_p50{name}": p99 / p50}
    return out


def sample_fate(run_dir: Path) -> dict[str, Any]:
    """What became of the run's samples, from serve's last metrics line: made, trained, and dropped
    as stale (generated for a learner that had moved past the staleness bound: work thrown away)."""
    rows = read_jsonl(run_dir / "serve_metrics.jsonl")
    b = (rows[-1].get("buffer") or {}) if rows else {}
    produced, stale = int(b.get("produced", 0)), int((b.get("dropped_by_reason") or {}).get("stale", 0))
    return {"produced": produced, "trained": int(b.get("consumed", 0)), "dropped_stale": stale,
            "stale_fraction": round(stale / produced, 4) if produced else 0.0}


def role_rewards(run_dir: Path) -> dict[str, float]:
    """Each role's mean reward over the run's finished episodes."""
    per: dict[str, list[float]] = {}
    for e in read_jsonl(run_dir / "episodes.jsonl"):
        for role, r in ((e.get("info") or {}).get("role_rewards") or {}).items():
            per.setdefault(role, []).append(float(r))
    return {role: round(sum(v) / len(v), 4) for role, v in sorted(per.items())}


def main() -> None:
    t0 = time.monotonic()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    workload_options(p)
    # A batch of whole groups: one group of 4 episodes is 12 samples (three roles). The staleness
    # bound has to span an episode in learner steps: admission keeps the samples in flight and
    # pending within (max_staleness + 1) x batch, so the rollout makes at most that many per episode
    # length, while the learner trains 24 samples in about 1 s and an episode takes 5-8 s (median
    # 0.5 s waits). At max_staleness 2 (72 samples) the async learner idled 11-27% (three runs);
    # 8 (216) keeps it fed. Sigma 1.5: the drawn waits' p99/median is exp(1.5 x 2.326) = 33, which
    # a run's few hundred distinct draws measure at 20 or more (1.3's 20.6 measured 14-22).
    p.set_defaults(batch=24, latency_median=0.5, latency_sigma=1.5, max_staleness=8, steps=40)
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--out", default="runs/multi_agent_stragglers")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # every call of every role counts against max_turns: planner 1, worker keys + 1, reviewer 1
    runs = {mode: run_mode(mode, args, out, env=ENV, max_turns=args.max_keys + 3)
            for mode in args.modes.split(",")}
    fig = {mode: figures(d, args.warmup) for mode, d in runs.items()}
    result: dict[str, Any] = {"benchmark": "multi_agent_stragglers", "env": ENV, "roles": list(ROLES),
                              "model": args.model, "batch": args.batch, "group": args.group,
                              "steps": args.steps,
                              "max_staleness": args.max_staleness, "latency_median_s": args.latency_median,
                              "latency_sigma": args.latency_sigma, "max_keys": args.max_keys}
    for mode, d in runs.items():
        result[f"samples_per_s_{mode}"] = round(fig[mode]["samples_per_s"], 3)
        result[f"learner_idle_{mode}"] = round(fig[mode]["learner_idle"], 4)
        result[f"step_s_{mode}"] = round(fig[mode]["step_s_mean"], 2)
        result[f"role_rewards_{mode}"] = role_rewards(d)
        result[f"episodes_{mode}"] = {k: round(v, 3) for k, v in episode_latencies(d).items()}
        result[f"samples_{mode}"] = sample_fate(d)
    if "async" in runs:
        result["staleness_max"] = fig["async"]["staleness_max"]
        result["learner_idle_async_under_10pct"] = fig["async"]["learner_idle"] < 0.10
    if "async" in runs and "sync" in runs:
        result["speedup"] = round(fig["async"]["samples_per_s"] / fig["sync"]["samples_per_s"], 3)
    lat = tool_latencies(runs, args)
    result.update({k: round(v, 3) for k, v in lat.items()})
    # the distribution's own: the measured one is over finished episodes, and a run's end cuts off the
    # episodes that drew the longest waits
    result["latency_p99_over_p50_configured"] = round(math.exp(2.3263 * args.latency_sigma), 2)
    result["load_avg"] = round(os.getloadavg()[0], 2)
    result["wall_minutes"] = round((time.monotonic() - t0) / 60, 2)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
