"""``agentrl run``: serve in a child process and the learner in this one, on one machine.

With ``eval.tasks`` > 0 (the default) the agent is evaluated on held-out tasks through serve's
router before the learner's first step (the engines still serve version 0) and again after its
last (they serve the final version), so the run ends by printing success before and after, with
95% intervals, and writing ``eval_before.json``, ``eval_after.json`` and the charts (``plots/``).

The child is started with the serve section written to ``run_dir/serve.toml``; it is stopped
(SIGTERM, then SIGKILL) when the learner finishes or fails, and dies with us if we are killed.
The admin token never appears on the child's command line: it is settled first and written to
``run_dir/admin_token`` (mode 0600), which ``serve.toml`` (also 0600) names as ``admin_token_file``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from agentrl.config import RunConfig, ServeConfig, to_toml
from agentrl.engines.reaper import stop_process

log = logging.getLogger(__name__)
_progress = logging.getLogger("agentrl.progress")


def serve_command(serve_cfg: ServeConfig, run_dir: Path) -> list[str]:
    """Write ``run_dir/serve.toml`` (0600, no token in it) and return the serve child's argv."""
    cfg = dataclasses.replace(serve_cfg, admin_token="", admin_token_file=str((run_dir / "admin_token").resolve()))
    path = run_dir / "serve.toml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # router.api_keys may be in it
    with os.fdopen(fd, "w") as f:
        f.write(to_toml(cfg))
    path.chmod(0o600)
    return [sys.executable, "-m", "agentrl.engines.reaper", "--",
            sys.executable, "-m", "agentrl.cli", "serve", "--config", str(path)]


def wait_for_serve(url: str, serve: subprocess.Popen, timeout_s: float) -> None:
    """Wait until serve's router answers ``/health`` (its engines are up); fail if serve exits."""
    from agentrl.client import ServeClient
    from agentrl.errors import TransportError

    async def wait() -> None:
        deadline = time.monotonic() + timeout_s
        said = ""
        async with ServeClient(url, timeout_s=5.0, retries=0) as client:
            while time.monotonic() < deadline:
                if serve.poll() is not None:
                    raise SystemExit(f"serve exited with code {serve.returncode} before it was ready; "
                                     "see serve.log in the run directory")
                try:
                    got = await client.request("GET", "/health", accept={503})
                    if got.status == 200:
                        return
                    state = got.json() or {}
                    engines = ", ".join(f"{e.get('port')} {e.get('phase')}" for e in state.get("engines") or [])
                    now = f"{state.get('phase', 'starting')}" + (f" [{engines}]" if engines else "")
                    if now != said:  # serve's own start-up phases, as they change
                        _progress.info("serve: %s (%.0f s)", now, float(state.get("elapsed_s") or 0))
                        said = now
                except (TransportError, ValueError):
                    pass
                await asyncio.sleep(1.0)
        raise SystemExit(f"serve at {url} was not healthy within {timeout_s:.0f} s")

    asyncio.run(wait())


def held_out_eval(cfg: RunConfig, url: str, label: str, run_dir: Path) -> Any:
    """Evaluate the policy the engines serve now on ``eval.tasks`` held-out tasks."""
    from agentrl.credentials import find_api_keys
    from agentrl.rollout.evaluate import evaluate, write_result
    from agentrl.serve.build import import_user_code

    import_user_code(cfg.serve)  # the evaluation plays the user's environment here too
    e, ev = cfg.serve.env, cfg.eval
    keys = find_api_keys(cfg.serve.router.api_keys, cfg.serve.router.api_keys_file)
    print(f"eval {label}: {ev.tasks} held-out {e.name} tasks at temperature {ev.temperature:g} ...", flush=True)
    result = asyncio.run(evaluate(
        e.name, f"{url}/v1", ev.tasks, split="test", env_config=e.config, api_key=keys[0] if keys else "",
        limits=e.limits(temperature=ev.temperature), concurrency=ev.concurrency, success_reward=ev.success_reward,
        sandbox_config=dataclasses.replace(cfg.serve.sandbox, warm=0, max_concurrency=ev.concurrency)))
    write_result(result, run_dir / f"eval_{label}.json")
    lo, hi = result.success_ci95
    print(f"eval {label}: success {result.success_rate:.3f} (95% CI {lo:.3f}-{hi:.3f}) over {result.n} tasks, "
          f"reward mean {result.reward_mean:.3f}, {result.failed} failed, {result.seconds:.0f} s", flush=True)
    return result


def run(cfg: RunConfig) -> int:
    from agentrl.credentials import settle_admin_token
    from agentrl.learner.trainer import learn

    run_dir = Path(cfg.serve.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Settle the admin token before either side starts: serve reads its file, the learner gets it.
    token = settle_admin_token(cfg.serve.admin_token, cfg.serve.admin_token_file, run_dir)
    # a fresh run (no learn.resume) starts from the model's weights, whatever the directory holds
    cmd = serve_command(dataclasses.replace(cfg.serve, restore=cfg.learn.resume), run_dir)
    # the learner on this machine: serve's address and run directory filled in (it asks serve for
    # the batch size and staleness bound, which the buffer section says once)
    learn_cfg = dataclasses.replace(cfg.learn, serve=f"http://{cfg.serve.router.host}:{cfg.serve.router.port}",
                                    run_dir=cfg.serve.run_dir, admin_token=cfg.learn.admin_token or token)
    log.info("starting serve (log: %s)", run_dir / "serve.log")
    with open(run_dir / "serve.log", "ab") as logf:
        serve = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    t0 = time.monotonic()
    before = after = None
    try:
        wait_for_serve(learn_cfg.serve, serve, cfg.serve.engine.start_timeout_s + 120)
        _progress.info("watch the run: %s/view/ (open it once with ?token= and the token in %s)", learn_cfg.serve,
                       run_dir / "view_token")
        if cfg.eval.tasks:
            before = held_out_eval(cfg, learn_cfg.serve, "before", run_dir)
        history = learn(learn_cfg)
        if cfg.eval.tasks:
            after = held_out_eval(cfg, learn_cfg.serve, "after", run_dir)
    finally:
        stop_process(serve, 60)
    summary = {"steps": len(history), "final_version": history[-1]["version"] if history else 0,
               "reward_by_step": [round(h["reward_mean"], 4) for h in history],
               "wall_minutes": round((time.monotonic() - t0) / 60, 2), "run_dir": str(run_dir)}
    if before is not None and after is not None:
        summary.update(eval_tasks=before.n, success_before=round(before.success_rate, 4),
                       success_after=round(after.success_rate, 4),
                       success_before_ci95=[round(x, 4) for x in before.success_ci95],
                       success_after_ci95=[round(x, 4) for x in after.success_ci95],
                       reward_before=round(before.reward_mean, 4), reward_after=round(after.reward_mean, 4))
        print(f"success on held-out tasks: {before.success_rate:.3f} before -> {after.success_rate:.3f} after "
              f"({len(history)} learner steps, {summary['wall_minutes']} min)", flush=True)
    try:
        from agentrl.plot import plot_run

        charts = plot_run(run_dir)
        summary["charts"] = str(charts[0].parent) if charts else ""
    except (ImportError, FileNotFoundError) as e:  # matplotlib is in the dev extra
        log.warning("no charts: %s", e)
    print(json.dumps(summary), flush=True)
    return 0
