"""Routing replay in training: ``agentrl run`` on the routing MoE (``smollm2-moe``) for ``--steps``
learner steps with replay on, the same with replay off (``--learn.routing_replay=false``), and the
dense SmolLM2 the MoE was made from, as the floor. Each run is the quickstart's ``agentrl run`` on
the ``guess_number`` game (multi-turn, no sandbox), on-policy (``max_staleness = 0``), so what the
learner's logprobs differ from the engine's by is numerics and routing, not staleness. The engine
samples in bf16 (``--engine-dtype``), as engines do on GPUs, and the learner computes in fp32 (its
CPU default): the engine's rounding then moves its routing away from the learner's on a share of
the tokens, which is where replay acts. (With both in fp32 the two route alike: no token of five
steps disagreed in the run measured, and replay on or off is the same run.)

Per run and step, from ``learner.jsonl``: the mismatch KL(mu || pi_old) (``mismatch/kl_k3``), the
mean |log pi_old - log mu| (``mismatch/abs_log_ratio``), the importance weights' spread
(``mismatch/ratio_std``), the routing disagreement and the step's seconds (``train_s``); and what
the routing adds to a buffer record (each sample of the run's buffer encoded with and without it).
Final JSON line: ``kl_replay``, ``kl_no_replay``, ``kl_dense`` (the mean over the steps), their
``abs_log_ratio_*`` and ``ratio_std_*``, ``kl_replay_vs_dense`` and ``kl_no_replay_vs_replay``,
``replay_bytes_per_sample``, ``train_s_per_step_replay`` / ``_no_replay``, and the per-step lists.

    .venv/bin/python benchmarks/moe_run.py [--steps 5] [--model smollm2-moe] [--dense smollm2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import free_port  # noqa: E402 - the benchmarks' folder is on sys.path


def run(run_dir: Path, model: str, steps: int, engine_dtype: str, *extra: str) -> list[dict[str, Any]]:
    """One ``agentrl run``; its learner.jsonl rows."""
    cmd = [sys.executable, "-m", "agentrl.cli", "run", f"--serve.run_dir={run_dir}", f"--serve.model={model}",
           f"--serve.router.port={free_port()}", f"--serve.engine.base_port={free_port()}",
           "--serve.env.name=guess_number", "--serve.env.group_size=4", "--serve.buffer.batch_size=8",
           "--serve.buffer.max_staleness=0", "--serve.env.max_tokens=48", f"--learn.steps={steps}",
           f"--serve.engine.dtype={engine_dtype}", "--eval.tasks=0", *extra]
    env = {k: v for k, v in os.environ.items() if k != "AGENTRL_ADMIN_TOKEN"}
    t0 = time.monotonic()
    print(f"agentrl run {model} {' '.join(extra)} -> {run_dir}", file=sys.stderr, flush=True)
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"agentrl run failed ({out.returncode}): {out.stdout[-2000:]}")
    rows = [json.loads(x) for x in (run_dir / "learner.jsonl").read_text().splitlines() if x.strip()]
    print(f"  {len(rows)} steps in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows


def routing_bytes(run_dir: Path) -> float | None:
    """Mean bytes the routing section adds to a buffer record, over the run's samples."""
    from moe_replay import routing_bytes

    from agentrl.buffer.codec import decode_sample
    from agentrl.buffer.log import Kind, ScanReport, scan
    from agentrl.buffer.units import ARRIVAL

    extra = []
    for path in sorted((run_dir / "buffer").rglob("*")):
        if not path.is_file():
            continue
        try:
            frames = list(scan(path, ScanReport()))
        except Exception:  # not a log file (an index, a lock)
            continue
        for kind, payload in frames:
            if kind != Kind.PUT:
                continue
            s = decode_sample(memoryview(payload)[ARRIVAL.size:])
            if s.routing is not None:
                extra.append(routing_bytes(s))
    return sum(extra) / len(extra) if extra else None


def column(rows: list[dict[str, Any]], key: str) -> list[float | None]:
    return [r.get(key) for r in rows]


def mean(xs: list[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return sum(got) / len(got) if got else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--model", default="smollm2-moe")
    p.add_argument("--dense", default="smollm2")
    p.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args()

    root = Path(tempfile.mkdtemp(prefix="moe-run-"))
    runs = {
        "replay": run(root / "replay", args.model, args.steps, args.engine_dtype),
        "no_replay": run(root / "no_replay", args.model, args.steps, args.engine_dtype,
                         "--learn.routing_replay=false"),
        "dense": run(root / "dense", args.dense, args.steps, args.engine_dtype),
    }
    result: dict[str, Any] = {"benchmark": "moe_run", "model": args.model, "dense": args.dense,
                              "steps": args.steps, "engine_dtype": args.engine_dtype}
    for name, rows in runs.items():
        for key, label in (("mismatch/kl_k3", "kl"), ("mismatch/abs_log_ratio", "abs_log_ratio"),
                           ("mismatch/ratio_std", "ratio_std"), ("train_s", "train_s")):
            result[f"{label}_{name}_per_step"] = column(rows, key)
            result[f"{label}_{name}"] = mean(column(rows, key))
        if name != "dense":
            result[f"routing_disagreement_{name}_per_step"] = column(rows, "routing_disagreement")
    ratio = lambda a, b: round(a / b, 3) if a is not None and b else None  # noqa: E731
    result["kl_replay_vs_dense"] = ratio(result["kl_replay"], result["kl_dense"])
    result["kl_no_replay_vs_replay"] = ratio(result["kl_no_replay"], result["kl_replay"])
    result["abs_log_ratio_replay_vs_dense"] = ratio(result["abs_log_ratio_replay"],
                                                    result["abs_log_ratio_dense"])
    result["replay_bytes_per_sample"] = routing_bytes(root / "replay")
    result["train_s_per_step_replay"] = result.pop("train_s_replay")
    result["train_s_per_step_no_replay"] = result.pop("train_s_no_replay")
    result["run_dirs"] = str(root)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
