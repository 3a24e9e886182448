"""``agentrl plot`` on a recorded run directory writes readable, non-empty PNGs."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from agentrl.plot import RunLogs, chart_reward, moving_average, plot_run, read_jsonl  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_recorded_run(run_dir: Path, steps: int = 30, with_sandbox: bool = True) -> None:
    """Logs shaped like what serve and learn write: 30 steps, 16 samples per batch, one serve row per 5 s."""
    rng = random.Random(0)
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = 1_760_000_000.0
    with open(run_dir / "learner.jsonl", "w") as f:
        for step in range(1, steps + 1):
            stale = [rng.choice([0, 0, 1, 1, 2]) for _ in range(16)]
            reward = 0.2 + 0.6 * (1 - math.exp(-step / 10)) + rng.gauss(0, 0.05)
            wait, train, sync = rng.uniform(0.5, 4.0), rng.uniform(10, 14), rng.uniform(0.3, 0.8)
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "version": step,
                        "time": t0 + 20 * step,
                        "loss": rng.gauss(0, 0.05),
                        "grad_norm": rng.uniform(0.2, 1.0),
                        "samples": 16,
                        "trained_samples": 16,
                        "failed_samples": 0,
                        "reward_mean": reward,
                        "advantage_abs_mean": 0.7,
                        "staleness_mean": sum(stale) / 16,
                        "staleness_max": max(stale),
                        "staleness_hist": {str(k): stale.count(k) for k in sorted(set(stale))},
                        "tokens": 2048,
                        "tokens_per_s": rng.uniform(130, 150),
                        "mismatch/kl_k1": rng.uniform(-1e-4, 1e-3),
                        "mismatch/kl_k3": rng.uniform(0, 1e-3),
                        "is/mean": rng.uniform(0.97, 1.02),
                        "is/max": rng.uniform(1.2, 2.0),
                        "is/frac_clipped": rng.uniform(0, 0.02),
                        "loss/loss": 0.01,
                        "wait_s": wait,
                        "train_s": train,
                        "sync_s": sync,
                        "idle_fraction": wait / (wait + train + sync),
                        "engine_sync": {"engines": {"engine-0": {"total_s": 0.4}}},
                    }
                )
                + "\n"
            )
    with open(run_dir / "episodes.jsonl", "w") as f:
        for i in range(steps * 16):
            p = min(0.9, 0.2 + i / (steps * 20))
            f.write(json.dumps({
                "time": t0 + 1.2 * i, "episode_id": f"e{i}", "group_id": f"g{i // 4}", "env": "arithmetic",
                "task_id": f"t{i // 4}", "reward": float(rng.random() < p), "turns": 2, "terminated": True,
                "truncated": False, "truncation": None, "error": "ToolError: boom" if i % 97 == 5 else None,
                "sandbox_id": "sb-1", "completion_tokens": 40, "versions": [i // 16], "splits": 0,
                "info": {"tool_calls": 1}, "started": t0 + 1.2 * i - 3, "seconds": 3.0, "num_samples": 1,
            }) + "\n")
    with open(run_dir / "serve_metrics.jsonl", "w") as f:
        for k in range(1, steps * 4):
            sandbox = {
                "backend": "docker",
                "warm": 2,
                "in_use": rng.randint(4, 16),
                "creating": 0,
                "created": 20 + k,
                "destroyed": k,
                "resets": 3 * k,
                "reaped": 0,
                "acquires": 4 * k,
                "warm_hits": 4 * k - 1,
                "exec_count": 5 * k,
                "timeouts": k // 40,
                "oom_kills": 0,
                "infra_errors": 0,
                "exec_p50_ms": rng.uniform(60, 80),
                "exec_p99_ms": rng.uniform(150, 250),
                "acquire_p50_ms": 1.0,
                "acquire_p99_ms": rng.uniform(5, 300),
                "create_p50_ms": 300.0,
                "create_p99_ms": 450.0,
            }
            f.write(
                json.dumps(
                    {
                        "time": t0 + 5 * k,
                        "uptime_s": 5 * k,
                        "version": k // 4,
                        "engines": [
                            {
                                "url": "http://127.0.0.1:8100",
                                "name": "engine-0",
                                "healthy": True,
                                "outstanding": 12,
                                "version": k // 4,
                                "served": 30 * k,
                                "failures": 0,
                                "last_error": None,
                            }
                        ],
                        "router": {
                            "calls": 30 * k,
                            "errors_4xx": 0,
                            "errors_5xx": 0,
                            "prompt_tokens": 9000 * k,
                            "completion_tokens": 1600 * k + rng.randint(0, 200),
                            "continued": 0,
                            "splits": 0,
                            "retries": 0,
                        },
                        "rollout": {
                            "in_flight": rng.randint(24, 32),
                            "episodes": 4 * k,
                            "failed": k // 25,
                            "truncated": 0,
                            "samples": 4 * k,
                            "reward_sum": 2.0 * k,
                            "tool_calls": 4 * k,
                        },
                        "buffer": {
                            "depth": rng.randint(0, 32),
                            "produced": 4 * k,
                            "consumed": 3 * k,
                            "dropped": k // 10,
                            "pending": 8,
                            "leased": 16,
                            "learner_version": k // 4,
                        },
                        "sandbox": sandbox if with_sandbox else None,
                    }
                )
                + "\n"
            )


def test_plot_writes_a_non_empty_png_per_chart_for_a_recorded_run(tmp_path: Path) -> None:
    write_recorded_run(tmp_path / "run")
    paths = plot_run(tmp_path / "run")
    names = {p.name for p in paths}
    assert names == {"reward.png", "staleness.png", "importance_weights.png", "throughput.png",
                     "learner_time.png", "sandbox.png", "serve.png", "overview.png"}
    for p in paths:
        assert p.parent == tmp_path / "run" / "plots"
        data = p.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, p


def test_a_run_with_a_scoring_stage_gets_its_chart(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_recorded_run(run)
    for name, key in (("episodes.jsonl", None), ("serve_metrics.jsonl", "rollout")):
        rows = [json.loads(x) for x in (run / name).read_text().splitlines()]
        for i, r in enumerate(rows, start=1):
            if key is None:
                r["info"]["rewards"] = {"env": r["reward"], "judge": (i % 11) / 10}
            else:
                r[key]["scoring"] = {
                    "scored": 4 * i,
                    "failed": i // 9,
                    "timeouts": 0,
                    "waiting": 1,
                    "scoring": 2,
                    "outage": 0,
                    "scorers": {
                        "judge": {
                            "calls": 4 * i,
                            "failures": i // 9,
                            "seconds": 8.1 * i,
                            "reward_sum": 2.0 * i,
                        }
                    },
                }
        (run / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths = {p.name: p for p in plot_run(run)}
    assert "scoring.png" in paths
    data = paths["scoring.png"].read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_a_run_with_a_teacher_gets_its_distillation_chart(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_recorded_run(run)
    assert "distill.png" not in {p.name for p in plot_run(run, tmp_path / "before")}  # no teacher: no chart
    rows = [json.loads(x) for x in (run / "learner.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows):
        r["teacher_kl"], r["teacher_tokens"] = 3.0 / (1 + i), 400 + i
        r["teacher_version_min"] = r["teacher_version_max"] = max(0, i - 1)  # self-distillation, one back
    (run / "learner.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths = {p.name: p for p in plot_run(run)}
    data = paths["distill.png"].read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_a_mixs_reward_chart_has_a_line_per_environment(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    run = tmp_path / "run"
    write_recorded_run(run)
    rows = [json.loads(x) for x in (run / "learner.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows):  # guess_number in every other batch only
        r["reward_by_env"] = {"arithmetic": i / len(rows), **({"guess_number": 0.5} if i % 2 else {})}
    (run / "learner.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig, axes = plt.subplots(1, 2)
    try:
        assert chart_reward(RunLogs.read(run), list(axes))
        lines = {line.get_label(): line for line in axes[0].get_lines()}
        assert {"arithmetic", "guess_number"} <= set(lines)
        assert len(lines["arithmetic"].get_xdata()) == len(rows)
        assert len(lines["guess_number"].get_xdata()) == len(rows) // 2  # only the batches that held it
    finally:
        plt.close(fig)


def test_plot_skips_charts_whose_logs_are_missing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_recorded_run(run, with_sandbox=False)
    (run / "serve_metrics.jsonl").unlink()
    (run / "episodes.jsonl").unlink()
    names = {p.name for p in plot_run(run, tmp_path / "out")}
    assert "sandbox.png" not in names and "serve.png" not in names
    assert {"reward.png", "staleness.png", "learner_time.png", "overview.png"} <= names


def test_plot_reads_a_log_whose_last_line_is_still_being_written(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_recorded_run(run, steps=5)
    with open(run / "learner.jsonl", "a") as f:
        f.write('{"step": 6, "version": 6, "rew')
    assert [r["step"] for r in read_jsonl(run / "learner.jsonl")] == [1, 2, 3, 4, 5]
    assert plot_run(run)


def test_plot_of_a_directory_without_logs_says_so(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="learner.jsonl"):
        plot_run(tmp_path)


def test_run_logs_share_one_time_origin(tmp_path: Path) -> None:
    write_recorded_run(tmp_path, steps=3)
    logs = RunLogs.read(tmp_path)
    assert min(logs.minutes(logs.episodes)) == 0.0
    assert min(logs.minutes(logs.learner)) > 0.0


def test_moving_average_is_a_trailing_mean() -> None:
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_agentrl_plot_command_prints_the_pngs_it_wrote(tmp_path: Path) -> None:
    write_recorded_run(tmp_path / "run", steps=4)
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "plot", str(tmp_path / "run"), "--out",
                          str(tmp_path / "pngs")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    printed = [Path(line) for line in out.stdout.split()]
    assert printed and all(p.exists() and p.suffix == ".png" for p in printed)


def test_agentrl_plot_of_an_empty_directory_fails_with_a_message(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "plot", str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0
    assert "learner.jsonl" in out.stderr
