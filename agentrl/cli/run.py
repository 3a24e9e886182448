"""``agentrl run``: serve in a child process and the learner in this one, on one machine.

With ``eval.tasks`` > 0 (the default) the agent is evaluated on held-out tasks through serve's
router before the learner's first step (the engines still serve version 0) and again after its
last (they serve the final version), so the run ends by printing success before and after, with
95% intervals, and writing ``eval_before.json``, ``eval_after.json`` and the charts (``plots/``).

The child is started with the serve section written to ``run_dir/serve.toml``; it is stopped
(SIGTERM, then SIGKILL) when the learner finishes or fails, and dies with us if we are killed.
A serve that dies while the learner runs (a crash, ``kill -9``, the OOM killer) is started again
on the run directory by :class:`ServeChild`, restoring the buffer, the last published weights and
the groups in flight (``serve.restore``); the learner rides out the outage. ``restarts`` bounds
that (default 3 in a row, each after a doubling wait); past it the run stops with an error.
The admin token never appears on the child's command line: it is settled first and written to
``run_dir/admin_token`` (mode 0600), which ``serve.toml`` (also 0600) names as ``admin_token_file``.
"""

from __future__ import annotations

import _thread
import asyncio
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl._lazy import import_ahead
from agentrl.config import RunConfig, ServeConfig, to_toml
from agentrl.engines.reaper import child_group, kill_group, stop_process

if TYPE_CHECKING:
    from types import FrameType

    from agentrl.rollout.evaluate import EvalResult

log = logging.getLogger(__name__)
_progress = logging.getLogger("agentrl.progress")


def serve_command(serve_cfg: ServeConfig, run_dir: Path) -> list[str]:
    """Write ``run_dir/serve.toml`` (0600, no token in it) and return the serve child's argv."""
    cfg = dataclasses.replace(
        serve_cfg, admin_token="", admin_token_file=str((run_dir / "admin_token").resolve())
    )
    path = run_dir / "serve.toml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # router.api_keys may be in it
    with os.fdopen(fd, "w") as f:
        f.write(to_toml(cfg))
    path.chmod(0o600)
    return [sys.executable, "-m", "agentrl.engines.reaper", "--",
            sys.executable, "-m", "agentrl.cli", "serve", "--config", str(path)]


class ServeChild:
    """serve as ``agentrl run``'s child process, started again when it dies before :meth:`stop`.

    A watcher thread polls the child; after an exit it waits ``backoff_s`` (doubling for each next
    relaunch in a row, at most 5 minutes; a serve that stays up 10 minutes starts a new row) and
    starts serve again with ``restore = true``, so the new serve comes back at the learner's
    version. After ``restarts`` relaunches in a row (-1: no limit) it gives up: ``failed`` says why
    and the main thread is interrupted, so the learner stops instead of waiting for a serve that
    will not come back."""

    STABLE_S = 600.0

    def __init__(self, cfg: ServeConfig, run_dir: Path, restarts: int, backoff_s: float = 2.0) -> None:
        self.cfg, self.run_dir, self.restarts, self.backoff_s = cfg, run_dir, restarts, backoff_s
        self.proc: subprocess.Popen | None = None
        self.relaunched = 0  # in all, for the summary
        self.failed = ""
        self._group: int | None = None  # serve's process group under its reaper, once seen
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._log_start = 0

    def start(self) -> subprocess.Popen:
        cmd = serve_command(self.cfg, self.run_dir)
        with open(self.run_dir / "serve.log", "ab") as logf:
            self._log_start = logf.tell()  # this launch's lines begin here
            self._group = None  # an earlier launch's group is gone (its id may be another's by now)
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self.proc

    def supervise(self) -> None:
        """Start watching the child (call from the main thread, once serve has come up the first
        time). Giving up interrupts the main thread as a SIGINT would, so Python must handle SIGINT:
        a process started with it ignored (a background job of a script) gets Python's own handler
        here, or the interrupt would do nothing and the learner would wait on a dead serve."""
        if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
            signal.signal(signal.SIGINT, signal.default_int_handler)
        self._watcher = threading.Thread(target=self._watch, name="serve-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        in_row, started = 0, time.monotonic()
        while not self._stopping.wait(0.5):
            assert self.proc is not None
            code = self.proc.poll()
            if code is None:
                self._group = self._group or child_group(self.proc.pid)
                continue
            self._end_group()
            if time.monotonic() - started > self.STABLE_S:
                in_row = 0
            if self.restarts != -1 and in_row >= self.restarts:
                self.failed = (f"serve exited with code {code} and was relaunched {in_row} "
                               f"times in a row (restarts = {self.restarts}); see "
                               f"{self.run_dir / 'serve.log'}, which ends:\n{self.log_tail()}")
                log.error("agentrl run: %s; stopping", self.failed)
                _thread.interrupt_main()
                return
            log.warning(
                "serve exited with code %s; its last lines in %s:\n%s",
                code,
                self.run_dir / "serve.log",
                self.log_tail(),
            )
            wait = min(300.0, self.backoff_s * 2 ** in_row)
            _progress.info(
                "serve exited with code %s; starting it again on %s in %.0f s (relaunch %d%s)",
                code,
                self.run_dir,
                wait,
                in_row + 1,
                "" if self.restarts == -1 else f" of {self.restarts}",
            )
            if self._stopping.wait(wait):
                return
            self.cfg = dataclasses.replace(self.cfg, restore=True)  # back at the learner's version
            in_row, started = in_row + 1, time.monotonic()
            self.relaunched += 1
            self.start()

    def stop_relaunching(self) -> None:
        """Relaunch serve no more (Ctrl-C: the terminal's SIGINT reached serve too, which is stopping)."""
        self._stopping.set()

    def log_tail(self, n: int = 25) -> str:
        """The last ``n`` lines serve's latest launch wrote to serve.log."""
        try:
            with open(self.run_dir / "serve.log", "rb") as f:
                f.seek(self._log_start)
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def poll(self) -> int | None:
        """None while serve runs or is being started again; its exit code once it is down for good."""
        code = self.proc.poll() if self.proc is not None else None
        supervised = self._watcher is not None and self._watcher.is_alive()
        return None if code is None or supervised else code

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    def stop(self, timeout_s: float = 60) -> None:
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join()
        if self.proc is not None:
            stop_process(self.proc, timeout_s)
            self._end_group()

    def _end_group(self) -> None:
        """What is left of serve's process group once its reaper is gone. Only a reaper killed by a
        signal (``kill -9``: its own exits are codes >= 0) leaves anything: serve itself, on its port."""
        if self.proc is not None and (self.proc.returncode or 0) < 0 and kill_group(self._group):
            log.warning("serve's reaper was killed; ended serve's process group %s", self._group)
        self._group = None


PREPARING = "preparing the model"  # serve's phase while it builds or converts its model (minutes, once)
STILL_SAY_S = 60.0  # while serve prepares its model, say so this often


def wait_for_serve(url: str, serve: subprocess.Popen | ServeChild, timeout_s: float) -> None:
    """Wait until serve's router answers ``/health`` (its engines are up); fail if serve exits.

    ``timeout_s`` bounds the start after the model is prepared: building a model the first time
    (``tiny-agent``: 10-20 minutes on 2 cores, longer on a busy machine) has its own progress in
    serve's log and fails serve itself if it fails, so it is not counted."""
    from agentrl.client import ServeClient
    from agentrl.errors import TransportError

    async def wait() -> None:
        deadline = time.monotonic() + timeout_s
        said, said_at = "", time.monotonic()
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
                    phase = str(state.get("phase", "starting"))
                    engines = ", ".join(
                        f"{e.get('port')} {e.get('phase')}" for e in state.get("engines") or []
                    )
                    now = phase + (f" [{engines}]" if engines else "")
                    elapsed = float(state.get("elapsed_s") or 0)
                    if now != said:  # serve's own start-up phases, as they change
                        _progress.info("serve: %s (%.0f s)", now, elapsed)
                        said, said_at = now, time.monotonic()
                    if phase.startswith(PREPARING):
                        deadline = time.monotonic() + timeout_s
                        if time.monotonic() - said_at > STILL_SAY_S:
                            _progress.info(
                                "serve: still %s (%.0f s; its progress is in serve.log)", phase, elapsed
                            )
                            said_at = time.monotonic()
                except (TransportError, ValueError):
                    pass
                await asyncio.sleep(1.0)
        raise SystemExit(f"serve at {url} was not healthy within {timeout_s:.0f} s")

    asyncio.run(wait())


def held_out_eval(cfg: RunConfig, url: str, label: str, run_dir: Path) -> EvalResult:
    """Evaluate the policy the engines serve now on ``eval.tasks`` held-out tasks."""
    from agentrl.credentials import find_api_keys
    from agentrl.rollout.evaluate import evaluate, write_result
    from agentrl.serve.build import import_user_code

    import_user_code(cfg.serve)  # the evaluation plays the user's environment here too
    e, ev = cfg.serve.env, cfg.eval
    keys = find_api_keys(cfg.serve.router.api_keys, cfg.serve.router.api_keys_file)
    print(
        f"eval {label}: {ev.tasks} held-out {e.name} tasks at temperature {ev.temperature:g} ...", flush=True
    )
    result = asyncio.run(
        evaluate(
            e.name,
            f"{url}/v1",
            ev.tasks,
            split="test",
            env_config=e.config,
            api_key=keys[0] if keys else "",
            limits=e.limits(temperature=ev.temperature),
            concurrency=ev.concurrency,
            success_reward=ev.success_reward,
            sandbox_config=dataclasses.replace(cfg.serve.sandbox, warm=0, max_concurrency=ev.concurrency),
            roles=e.roles,
        )
    )
    write_result(result, run_dir / f"eval_{label}.json")
    lo, hi = result.success_ci95
    print(f"eval {label}: success {result.success_rate:.3f} (95% CI "
          f"{lo:.3f}-{hi:.3f}) over {result.n} tasks, reward mean "
          f"{result.reward_mean:.3f}, {result.failed} failed, {result.seconds:.0f} s", flush=True)
    # a mix: each environment's own; a multi-agent environment: each role's own
    for name, e in [*result.by_env.items(), *((f"role {r}", e) for r, e in result.by_role.items())]:
        lo, hi = e["success_ci95"]
        print(f"eval {label}:   {name}: success {e['success_rate']:.3f} "
              f"(95% CI {lo:.3f}-{hi:.3f}) over {e['n']} tasks",
              flush=True)
    return result


def run(cfg: RunConfig) -> int:
    from agentrl.credentials import settle_admin_token
    from agentrl.learner.trainer import learn

    run_dir = Path(cfg.serve.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Settle the admin token before either side starts: serve reads its file, the learner gets it.
    token = settle_admin_token(cfg.serve.admin_token, cfg.serve.admin_token_file, run_dir)
    # a fresh run (no learn.resume) starts from the model's weights, whatever the directory holds
    serve_child = ServeChild(dataclasses.replace(cfg.serve, restore=cfg.learn.resume), run_dir, cfg.restarts)
    # the learner on this machine: serve's address and run directory filled in (it asks serve for
    # the batch size and staleness bound, which the buffer section says once)
    learn_cfg = dataclasses.replace(
        cfg.learn,
        serve=f"http://{cfg.serve.router.host}:{cfg.serve.router.port}",
        run_dir=cfg.serve.run_dir,
        admin_token=cfg.learn.admin_token or token,
    )
    log.info("starting serve (log: %s)", run_dir / "serve.log")
    serve_child.start()
    import_ahead("transformers", "AutoModelForCausalLM")  # the learner's model stack, while serve starts
    t0 = time.monotonic()
    before = after = None

    def interrupted(signum: int, frame: FrameType | None) -> None:
        # Ctrl-C: serve must not be relaunched (it got the SIGINT too), and the learner stops where it
        # is, not where its event loop next checks for a cancellation (an HTTP call can swallow one)
        serve_child.stop_relaunching()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        wait_for_serve(learn_cfg.serve, serve_child, cfg.serve.engine.start_timeout_s + 120)
        serve_child.supervise()
        _progress.info(
            "watch the run: %s/view/ (open it once with ?token= and the token in %s)",
            learn_cfg.serve,
            run_dir / "view_token",
        )
        if cfg.eval.tasks:
            before = held_out_eval(cfg, learn_cfg.serve, "before", run_dir)
        history = learn(learn_cfg)
        if cfg.eval.tasks:
            wait_for_serve(learn_cfg.serve, serve_child, cfg.serve.engine.start_timeout_s + 120)
            after = held_out_eval(cfg, learn_cfg.serve, "after", run_dir)
    except KeyboardInterrupt:
        if serve_child.failed:
            raise SystemExit(f"agentrl run: {serve_child.failed}") from None
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
        serve_child.stop()
    summary = {"steps": len(history), "final_version": history[-1]["version"] if history else 0,
               "serve_restarts": serve_child.relaunched,
               "reward_by_step": [round(h["reward_mean"], 4) for h in history],
               "wall_minutes": round((time.monotonic() - t0) / 60, 2), "run_dir": str(run_dir)}
    if any("policy" in h for h in history):  # named LoRA policies: each one's last version and step count
        summary["final_versions"] = {h["policy"]: h["version"] for h in history if "policy" in h}
        summary["steps_by_policy"] = dict(Counter(h["policy"] for h in history if "policy" in h))
    if before is not None and after is not None:
        summary.update(eval_tasks=before.n, success_before=round(before.success_rate, 4),
                       success_after=round(after.success_rate, 4),
                       success_before_ci95=[round(x, 4) for x in before.success_ci95],
                       success_after_ci95=[round(x, 4) for x in after.success_ci95],
                       reward_before=round(before.reward_mean, 4), reward_after=round(after.reward_mean, 4))
        if before.by_env:  # a mix: each environment's success before and after, on the same tasks
            summary["success_by_env"] = {name: [round(e["success_rate"], 4),
                                                round(after.by_env.get(name, {}).get("success_rate", 0.0), 4)]
                                         for name, e in before.by_env.items()}
        if before.by_role:  # a multi-agent environment: each role's success before and after
            late = after.by_role
            summary["success_by_role"] = {
                role: [round(e["success_rate"], 4), round(late.get(role, {}).get("success_rate", 0), 4)]
                for role, e in before.by_role.items()}
        print(f"success on held-out tasks: {before.success_rate:.3f} before -> {after.success_rate:.3f} "
              f"after ({len(history)} learner steps, {summary['wall_minutes']} min)", flush=True)
    try:
        from agentrl.plot import plot_run

        charts = plot_run(run_dir)
        summary["charts"] = str(charts[0].parent) if charts else ""
    except (ImportError, FileNotFoundError) as e:  # matplotlib is in the dev extra
        log.warning("no charts: %s", e)
    print(json.dumps(summary), flush=True)
    return 0
