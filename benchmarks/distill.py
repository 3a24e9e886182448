"""On-policy distillation on CPU: a student trained on a stronger teacher's logprobs of its own tokens.

With no ``--teacher`` it first builds one: ``agentrl run`` of the student's own model for
``--teacher-steps`` RL steps on the environment (the quickstart's recipe, no evaluation), written
out by ``--learn.export_dir``; a policy the RL made better than the student, with its tokenizer.
Then it starts a vLLM engine for the teacher (serve's engine flags), measures the teacher's own success on
the held-out tasks (the held-out evaluation ``agentrl run`` makes of the student: the same tasks,
limits and sandboxes, through a router as serve's), then runs ``agentrl run`` on the
student with the teacher as a scorer (``--serve.scoring.teacher.*``: each episode's samples get the
teacher's logprobs of their generated tokens) and the learner's distillation term
(``--learn.loss.distill_coef``; by default the teacher's signal alone, ``distill_reward = false``).
``agentrl run`` evaluates the student before the first step and after the last. The teacher KL is
each learner step's ``teacher_kl`` (the mean of ``log mu - log pi_teacher`` over the tokens it
trained). Prints one JSON line at the end with ``teacher_kl_start`` (the first step's),
``teacher_kl_end`` (the mean of the last three), ``student_success_before``,
``student_success_after``, ``teacher_success`` (each with its 95% Wilson interval),
``kl_end_over_start`` and ``meets_target`` (the end at most half the start), ``teacher_build_minutes``
(0 with ``--teacher``) and ``wall_minutes`` (the whole benchmark).

    python benchmarks/distill.py [--student tiny-agent] [--teacher NAME_OR_FOLDER] [--teacher-steps 60]
                                 [--env arithmetic] [--tasks 100] [--steps 20] [--with-reward]
                                 [-- extra agentrl run overrides]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

from common import agentrl_run, free_port  # benchmarks/common.py

# groups of 8: the recipe its figures were measured with (the quickstart's was 8 until 2026-12-07)
GROUPS = ["--serve.env.group_size=8"]


def teacher_success(model: str, overrides: list[str], log_dir: Path) -> tuple[str, object, object]:
    """The teacher's engine (left running: the caller stops it), its URL and its evaluation: the
    held-out evaluation ``agentrl run`` makes of the student (the same tasks, limits, temperature,
    sandboxes), through a router of serve's own making over the teacher's engine, as serve's
    evaluation goes through serve's router."""
    from agentrl.config import RunConfig, load
    from agentrl.engines.vllm import VLLMEngine
    from agentrl.models import resolve_model
    from agentrl.rollout.evaluate import evaluate
    from agentrl.serve import build

    cfg = load(RunConfig, None, overrides)
    serve = dataclasses.replace(cfg.serve, model="teacher")
    path = resolve_model(model)
    # serve's engine flags
    spec = dataclasses.replace(serve.engine.spec(0, path, "teacher"), port=free_port())
    engine = VLLMEngine(spec, log_dir)
    engine.launch()

    async def measure() -> object:
        await engine.start(timeout_s=900)
        print(f"teacher {model} serving at {engine.url}; evaluating it on {cfg.eval.tasks} held-out tasks",
              file=sys.stderr, flush=True)
        pool = build.build_pool(serve, [engine.url])
        await pool.start()
        try:
            e, ev = serve.env, cfg.eval
            return await evaluate(e.name, build.build_router(serve, pool, path, None), ev.tasks, split="test",
                                  env_config=e.config, limits=e.limits(temperature=ev.temperature),
                                  concurrency=ev.concurrency, success_reward=ev.success_reward,
                                  sandbox_config=dataclasses.replace(serve.sandbox, warm=0,
                                                                     max_concurrency=ev.concurrency))
        finally:
            await pool.close()

    try:
        result = asyncio.run(measure())
    except BaseException:
        engine.stop()
        raise
    print(result.line(), file=sys.stderr, flush=True)
    return engine.url, engine, result


def build_teacher(model: str, steps: int, env: str, run_dir: Path, t0: float) -> str:
    """``agentrl run`` of ``model`` for ``steps`` RL steps on ``env`` (no evaluation: the teacher's is
    measured after), its policy written out; the folder it was written to."""
    export = run_dir / "export"
    print(f"building the teacher: {model} after {steps} RL steps on {env}", file=sys.stderr, flush=True)
    agentrl_run([
        sys.executable, "-m", "agentrl.cli", "run", f"--serve.run_dir={run_dir}",
        f"--serve.router.port={free_port()}", f"--serve.engine.base_port={free_port()}",
        f"--serve.model={model}", f"--serve.env.name={env}", f"--learn.steps={steps}", "--eval.tasks=0",
        f"--learn.export_dir={export}", *GROUPS,
    ], run_dir, t0)
    if not (export / "config.json").exists():
        raise SystemExit(f"the teacher's run wrote no model to {export}: see {run_dir}/serve.log")
    return str(export.resolve())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--student", default="tiny-agent", help="the student (--serve.model)")
    p.add_argument("--teacher", default="", help="the teacher: a model with the student's tokenizer "
                                                 "(default: build one, see --teacher-steps)")
    p.add_argument("--teacher-steps", type=int, default=60,
                   help="without --teacher: RL steps of the student's model that make the teacher")
    p.add_argument("--env", default="arithmetic")
    p.add_argument("--tasks", type=int, default=100, help="held-out tasks evaluated "
                                                          "(teacher, student before/after)")
    p.add_argument("--steps", type=int, default=20, help="learner steps")
    p.add_argument("--coef", type=float, default=1.0, help="learn.loss.distill_coef")
    p.add_argument("--with-reward", action="store_true", help="keep the reward advantages "
                                                              "beside the teacher's term")
    p.add_argument("--run-dir", default="runs/distill")
    p.add_argument("extra", nargs="*", help="more agentrl run overrides (after --)")
    args = p.parse_args()
    run_dir = Path(args.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    (run_dir / "teacher").mkdir(parents=True)
    t0 = time.monotonic()
    shared = [f"--eval.tasks={args.tasks}", f"--serve.env.name={args.env}", *GROUPS, *args.extra]
    teacher_model = args.teacher or build_teacher(args.student, args.teacher_steps, args.env,
                                                  run_dir / "teacher-rl", t0)
    built_min = 0.0 if args.teacher else (time.monotonic() - t0) / 60
    url, engine, teacher = teacher_success(teacher_model, shared, run_dir / "teacher")
    try:
        cmd = [
            sys.executable, "-m", "agentrl.cli", "run", f"--serve.run_dir={run_dir / 'run'}",
            f"--serve.router.port={free_port()}", f"--serve.engine.base_port={free_port()}", *shared,
            f"--serve.model={args.student}", f"--learn.steps={args.steps}",
            f"--serve.scoring.teacher.url={url}/v1", "--serve.scoring.teacher.model=teacher",
            f"--serve.scoring.teacher.name={teacher_model}", f"--learn.loss.distill_coef={args.coef}",
            f"--learn.loss.distill_reward={'true' if args.with_reward else 'false'}",
        ]
        summary = agentrl_run(cmd, run_dir / "run", t0)
    finally:
        engine.stop()
    steps = [json.loads(x) for x in (run_dir / "run" / "learner.jsonl").read_text().splitlines() if x.strip()]
    kls = [s["teacher_kl"] for s in steps if "teacher_kl" in s]
    if not kls:
        raise SystemExit("no learner step trained on teacher logprobs: see the run's serve.log (scoring)")
    kl_end = sum(kls[-3:]) / len(kls[-3:])
    result = {
        "benchmark": "distill", "student": args.student,
        "teacher": args.teacher or f"{args.student} after {args.teacher_steps} RL steps (built here)",
        "env": args.env, "eval_tasks": args.tasks, "learner_steps": len(steps), "distill_coef": args.coef,
        "with_reward": args.with_reward, "teacher_kl_start": round(kls[0], 4),
        "teacher_kl_end": round(kl_end, 4),
        "kl_end_over_start": round(kl_end / kls[0], 4) if kls[0] else None,
        "meets_target": kl_end <= kls[0] / 2,
        "teacher_kl_per_step": [round(k, 4) for k in kls],
        "student_success_before": summary["success_before"],
        "student_success_after": summary["success_after"],
        "student_success_before_ci95": summary["success_before_ci95"],
        "student_success_after_ci95": summary["success_after_ci95"],
        "teacher_success": round(teacher.success_rate, 4),
        "teacher_success_ci95": [round(x, 4) for x in teacher.success_ci95],
        "teacher_build_minutes": round(built_min, 2),
        "wall_minutes": round((time.monotonic() - t0) / 60, 2), "load_avg": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
