"""The benchmarks that start engines: each reaches its final JSON line, with the docs' keys.

``tests/test_benchmark_smoke.py`` runs the engine-free benchmarks in CI, and ``tests/test_chaos.py``
runs ``chaos`` at its defaults. The ones below start vLLM engines, sandboxes or a whole ``agentrl
run`` and cost a minute or more each, too much for CI's time budget: before a release, run them
through pytest (``tests/test_benchmark_engines.py`` and ``tests/test_benchmark_runs.py``, marked
``benchmark_smoke``: ``AGENTRL_TEST_MARKERS="not gpu" bash scripts/test.sh`` gives each file a lane)
or with this script: one after another, each as a subprocess of this
interpreter from the repository root, in its shortest mode (fewest steps, tasks, requests, rounds,
episodes; a tiny model where one can be chosen). For each it checks that it exits 0 and that the LAST
line of its stdout is a JSON object holding the keys README.md and docs/*.md quote for it. It checks
nothing about speed or quality: the figures of so short a run mean nothing.

It prints one progress line per benchmark (name, ok/failed, seconds, then the missing keys or the
tail of stderr) and ends with one JSON line::

    {"benchmark": "smoke", "ran": N, "passed": N, "failed": [names], "seconds": {name: s}}

and exits 1 if any failed. Output folders go under ``--run-root`` (default: a fresh temporary
folder), never under the repository; ``TMPDIR`` points there too.

All 20 run by default: none takes over 3 minutes in its shortest mode on the 2-core development
machine (about 20 minutes in all). ``sandbox.py --density`` runs once per backend
(``sandbox_density_docker``, ``sandbox_density_bubblewrap``: 10 sandboxes, a few seconds each).
``chaos`` runs one round (``--rounds 1``: four faults, one of each kind, 160 s); ``first_hour``
clones HEAD, builds a new venv without pip's cache and runs the quickstart to ``step 1`` (150 s,
3.6 GB left under the run root). The run root is kept for its
logs (each benchmark's ``stdout.txt`` and ``stderr.txt``); remove it after.

    .venv/bin/python benchmarks/smoke.py [--only weight_sync,sandbox] [--run-root DIR] [--timeout-s 1800]
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentrl.procs import tied_to_this_process

ROOT = Path(__file__).resolve().parents[1]

# (name, shortest arguments, keys the final JSON line must hold). "{run}" is this benchmark's own
# folder under --run-root. Those with one engine of their own first, then the whole `agentrl run`s.
BENCHMARKS: list[tuple[str, list[str], list[str]]] = [
    (
        "sandbox",
        ["--n", "10"],
        # README.md (sandboxes) and docs/sandbox.md: warm acquire, exec vs plain docker exec, leaks
        ["warm_acquire_p50_ms", "exec_p50_ms", "docker_exec_p50_ms", "exec_speedup", "leaked_containers"],
    ),
    *(
        (
            f"sandbox_density_{backend}",
            ["--density", "--backend", backend, "--density-max", "10", "--exec-seconds", "1"],
            # docs/sandbox.md (*Density*): warm sandboxes held, MB each, what bounds it, leaks
            ["backend", "density_target", "max_warm_held", "exec_rate_per_s", "levels", "mb_per_sandbox",
             "bounded_by", "leaked", "wall_s"],
        )
        for backend in ("docker", "bubblewrap")
    ),
    (
        "moe_replay",
        ["--requests", "2", "--tokens", "8", "--step-repeats", "1", "--step-samples", "1"],
        # docs/learner.md (routing replay): on smollm2-moe against the dense floor
        ["routing_disagreement", "mean_abs_diff_replay", "mean_abs_diff_no_replay",
         "disagreeing_tokens_diff_replay", "disagreeing_tokens_diff_no_replay", "dense_floor",
         "replay_vs_floor", "replay_bytes_per_sample", "replay_step_s_ratio", "tokens"],
    ),
    (
        "sampling_parity",
        ["--calls", "2", "--max-tokens", "8", "--skip-qwen"],
        # docs/losses.md (processed logprobs): the explicit run's differences, then every run's
        ["mean_abs_diff", "max_abs_diff", "raw_mean_abs_diff", "plain_vs_behaviour_mean_abs_diff", "runs"],
    ),
    (
        "weight_sync",
        ["--model", "tiny", "--concurrency", "1", "--max-tokens", "200", "--lead-s", "0.5"],
        # README.md (weight sync) and docs/weights.md (*Measured*)
        ["aborted_requests", "engine_reload_s", "pause_over_reload", "client_stall_s", "reprefill_s",
         "sync_total_s", "streams_in_flight_at_update"],
    ),
    (
        "lora_sync",
        ["--model", "tiny", "--rank", "2", "--concurrency", "1", "--max-tokens", "50",
         "--parity-tokens", "20", "--parity-max-tokens", "20"],
        # README.md (LoRA sync) and docs/weights.md
        ["adapter_bytes", "full_bytes", "adapter_sync_s", "full_sync_s", "adapter_pause_s", "full_pause_s",
         "aborted_requests", "lora_parity_mean_abs_diff"],
    ),
    (
        "delta_sync",
        ["--steps", "1", "--group", "1", "--max-tokens", "16", "--run-root", "{run}"],
        # docs/weights.md (*Measured (benchmarks/delta_sync.py ...)*)
        ["delta_bytes_per_step", "full_bytes", "delta_sync_s", "full_sync_s", "weights_equal"],
    ),
    (
        "scaffolds",
        ["--episodes", "2", "--group", "2"],
        # README.md (scaffolds) and docs/scaffolds.md: one object per scaffold
        ["episodes", "openai_sdk_in_serve", "openai_sdk_as_a_program", "openai_agents_framework"],
    ),
    (
        "cluster_sim",
        ["--episodes", "16", "--warmup", "2", "--duration", "5", "--run-root", "{run}"],
        # docs/scale.md (*A cluster-shaped run*): both configurations, the ratio, the bottleneck
        ["engines", "episodes", "router_processes", "completions_per_s", "completions_per_s_one_router",
         "ratio", "cpu_ms_per_completion", "buffer_puts_per_s", "learner_idle", "lost_samples",
         "exact_capture_violations", "bottleneck"],
    ),
    (
        "router_processes",
        ["--sessions", "4", "--warmup", "2", "--duration", "3"],
        # docs/scale.md (*N router processes*): both configurations, the ratio, the passed-on share
        ["router_processes", "completions_per_s", "completions_per_s_one_process", "ratio",
         "cpu_ms_per_completion", "forwarded_share", "errors"],
    ),
    (
        "async_vs_sync",
        ["--steps", "2", "--warmup", "1", "--batch", "4", "--group", "2", "--max-keys", "1",
         "--latency-median", "0.1", "--max-tokens", "16", "--out", "{run}"],
        # README.md (async vs sync): samples/s and learner idle of both modes, staleness, speed-up
        ["samples_per_s_sync", "samples_per_s_async", "learner_idle_sync", "learner_idle_async",
         "staleness_max", "staleness_within_bound", "speedup"],
    ),
    (
        "multi_agent",
        ["--steps", "2", "--tasks", "4", "--run-dir", "{run}"],
        # docs/multi_agent.md (*Learning*) and README.md: each role's held-out success before and after
        ["roles", "policies", "steps_by_policy", "team_before", "team_after", "wall_minutes"],
    ),
    (
        "multi_agent_stragglers",
        ["--steps", "2", "--warmup", "1", "--batch", "6", "--group", "2", "--max-keys", "1",
         "--latency-median", "0.1", "--max-tokens", "16", "--out", "{run}"],
        # docs/multi_agent.md (*Stragglers*): learner idle of both modes, speed-up, the latency tail
        ["learner_idle_async", "learner_idle_sync", "speedup", "latency_p99_over_p50", "roles",
         "wall_minutes"],
    ),
    (
        "scoring_pace",
        ["--steps", "2", "--warmup", "1", "--batch", "4", "--group", "2", "--max-keys", "1",
         "--latency-median", "0.1", "--max-tokens", "16", "--judge-s", "0.1", "--out", "{run}"],
        # docs/scoring.md (*pace*): samples/s and learner idle with and without the judge
        ["samples_per_s_plain", "samples_per_s_judged", "learner_idle_plain", "learner_idle_judged",
         "pace_ratio", "judge_calls"],
    ),
    (
        "learning",
        ["--tasks", "4", "--run-dir", "{run}", "--", "--learn.steps=1"],
        # README.md (learning) and docs/learner.md: success before -> after, the whole run's minutes
        ["success_before", "success_after", "wall_minutes"],
    ),
    (
        "curriculum",
        ["--tasks", "4", "--out", "{run}", "--", "--learn.steps=1"],
        # docs/curriculum.md (*Benchmark*): both runs' held-out success and zero-spread share
        ["success_curriculum", "success_uniform", "success_curriculum_ci95", "success_uniform_ci95",
         "zero_spread_curriculum", "zero_spread_uniform", "steps_curriculum", "steps_uniform",
         "train_minutes_curriculum", "train_minutes_uniform", "minutes_each", "wall_minutes"],
    ),
    (
        "distill",
        ["--teacher-steps", "1", "--tasks", "4", "--steps", "1", "--run-dir", "{run}"],
        # README.md (distillation) and docs/scoring.md
        ["teacher_kl_start", "teacher_kl_end", "kl_end_over_start", "meets_target", "student_success_before",
         "student_success_after", "teacher_success", "teacher_build_minutes", "wall_minutes"],
    ),
    (
        "chaos",
        ["--rounds", "1", "--run-dir", "{run}"],
        # README.md (chaos) and docs/operating.md: recoveries, their times, the audit
        ["trials", "recoveries", "failed_trials", "max_recovery_s", "lost_samples", "double_trained",
         "skipped_tasks", "orphans", "identity", "buffer", "wall_minutes"],
    ),
    (
        "moe_run",
        ["--steps", "1"],
        # docs/learner.md (routing replay in training): replay on, off, and the dense floor
        ["kl_replay", "kl_no_replay", "kl_dense", "ratio_std_replay", "ratio_std_no_replay",
         "replay_bytes_per_sample", "train_s_per_step_replay", "train_s_per_step_no_replay"],
    ),
    (
        "first_hour",
        ["--workdir", "{run}", "--steps", "1"],
        # README.md (first hour): the phases to the first learner step
        ["setup_s", "model_s", "engine_start_s", "first_step_s", "total_to_first_step_s"],
    ),
]
NOT_BY_DEFAULT: set[str] = set()  # a benchmark too long to run unless --only names it
# A second mode of one script runs under a name of its own; its script is named here.
SCRIPTS = {"sandbox_density_docker": "sandbox", "sandbox_density_bubblewrap": "sandbox"}


def run_one(name: str, args: list[str], keys: list[str], run_root: Path,
            timeout_s: float) -> tuple[bool, str]:
    """Run one benchmark; (passed, what went wrong)."""
    folder = run_root / name
    folder.mkdir(parents=True, exist_ok=True)
    script = SCRIPTS.get(name, name)
    cmd = [sys.executable, f"benchmarks/{script}.py", *(a.replace("{run}", str(folder)) for a in args)]
    # TMPDIR under the run root keeps what a benchmark leaves there; torch's compiled-kernel cache
    # stays the machine's (under a new TMPDIR each engine of each benchmark would compile afresh)
    inductor = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    env = dict(os.environ, TMPDIR=str(run_root))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, env=env,
                              preexec_fn=tied_to_this_process())
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return False, f"timed out after {timeout_s:.0f} s; stderr ends:\n{err[-2000:]}"
    (folder / "stdout.txt").write_text(proc.stdout)
    (folder / "stderr.txt").write_text(proc.stderr)
    result, why = final_line(proc, keys)
    return result is not None, why


def final_line(proc: subprocess.CompletedProcess[str], keys: list[str]) -> tuple[dict[str, Any] | None, str]:
    """A finished benchmark's final JSON object if it exited 0 and that line holds ``keys``; else
    None and what went wrong (with the tail of its stderr). tests/test_benchmark_smoke.py uses it too."""
    tail = proc.stderr[-2000:]
    if proc.returncode != 0:
        return None, f"exited {proc.returncode}; stderr ends:\n{tail}"
    lines = proc.stdout.strip().splitlines()
    if not lines:
        return None, f"printed nothing; stderr ends:\n{tail}"
    try:
        result: Any = json.loads(lines[-1])
    except json.JSONDecodeError as e:
        return None, f"last line is not JSON ({e}): {lines[-1][:300]!r}; stderr ends:\n{tail}"
    if not isinstance(result, dict):
        return None, f"last line is not a JSON object: {lines[-1][:300]!r}"
    missing = [k for k in keys if k not in result]
    if missing:
        return None, f"final line lacks {missing}: {result}"
    return result, ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [b[0] for b in BENCHMARKS]
    p.add_argument("--only", default="", help="comma-separated subset of: " + ",".join(names))
    p.add_argument("--run-root", default="",
                   help="folder for the benchmarks' output (default: a fresh temp dir)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="limit per benchmark")
    args = p.parse_args()
    chosen = ([n.strip() for n in args.only.split(",") if n.strip()]
              or [n for n in names if n not in NOT_BY_DEFAULT])
    unknown = [n for n in chosen if n not in names]
    if unknown:
        p.error(f"unknown benchmarks {unknown}; choose from {names}")
    run_root = Path(args.run_root or tempfile.mkdtemp(prefix="agentrl-smoke-")).resolve()
    run_root.mkdir(parents=True, exist_ok=True)
    print(f"smoke: {len(chosen)} benchmarks, output under {run_root}", flush=True)  # noqa: T201
    table = {b[0]: b for b in BENCHMARKS}
    failed: list[str] = []
    seconds: dict[str, float] = {}
    for name in chosen:
        _, bench_args, keys = table[name]
        t0 = time.monotonic()
        ok, why = run_one(name, bench_args, keys, run_root, args.timeout_s)
        seconds[name] = round(time.monotonic() - t0, 1)
        if not ok:
            failed.append(name)
        line = f"{name}: {'ok' if ok else 'failed'} in {seconds[name]:.0f} s"
        print(line + (f"; {why}" if why else ""), flush=True)  # noqa: T201 - progress
    print(json.dumps({"benchmark": "smoke", "ran": len(chosen), "passed": len(chosen) - len(failed),  # noqa: T201
                      "failed": failed, "seconds": seconds}), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
