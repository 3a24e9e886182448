"""``agentrl status --serve URL``: a compact, human-readable view of a running serve.

It GETs ``/admin/status`` with serve's admin token and prints engines and their policy versions,
episodes in flight, buffer depth, the sandbox pool and throughput. The token comes from a file
(``--admin-token-file``), ``$AGENTRL_ADMIN_TOKEN``, or ``RUN_DIR/admin_token``, never from a value on
the command line, where every user of the machine could read it in the process list.

Throughput is averaged since serve started; with ``--watch`` it is measured between refreshes.
While serve's engines start it shows the start-up phase of each. It talks to serve through the
one client of serve's HTTP surface (:class:`agentrl.client.ServeClient`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError


class StatusError(AgentrlError, RuntimeError):
    """serve could not be reached, refused the token, or answered something that is not a status."""


def resolve_token(token_file: str | None = None, run_dir: str | Path | None = "runs/latest") -> str:
    """The admin token: ``token_file``, ``$AGENTRL_ADMIN_TOKEN``, ``$AGENTRL_ADMIN_TOKEN_FILE``,
    ``run_dir/admin_token``."""
    from agentrl.credentials import SecretError, find_admin_token

    try:
        token = find_admin_token("", token_file or "", run_dir)
    except SecretError as e:
        raise StatusError(str(e)) from None
    if not token:
        raise StatusError("no admin token: pass --admin-token-file FILE, set "
                          "$AGENTRL_ADMIN_TOKEN, or point --run-dir at serve's run "
                          f"directory (looked for {Path(run_dir or '.') / 'admin_token'})")
    return token


def fetch_status(url: str, token: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """GET ``URL/admin/status``; raise StatusError with what went wrong and what to do."""
    import asyncio

    from agentrl.client import ServeClient
    from agentrl.errors import TransportError

    async def get() -> Any:
        async with ServeClient(url, token, timeout_s=timeout_s, retries=1) as client:
            return await client.json("GET", "/admin/status", headers={"Accept": "application/json"})

    try:
        data = asyncio.run(get())
    except TransportError as e:
        if e.status in (401, 403):
            raise StatusError(f"serve at {url} refused the admin token ({e.status}); "
                              "use the token from serve's run_dir/admin_token") from None
        if e.status is not None:
            raise StatusError(f"serve at {url} answered {e.status}: {e.message}") from None
        raise StatusError(f"cannot reach serve at {url}: {e.message}") from None
    except ValueError:
        raise StatusError(f"serve at {url} answered something that is not JSON") from None
    if not isinstance(data, dict):
        raise StatusError(f"serve at {url} answered an unexpected status: {data!r:.200}")
    return data


# -- formatting --------------------------------------------------------------------------------------

def _n(v: Any, digits: int = 0) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float) and digits == 0 and v.is_integer():
        return f"{int(v):,}"
    if isinstance(v, int | float):
        return f"{v:,.{digits}f}"
    return str(v)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned columns separated by two spaces."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in [header, *rows]]


def rates(now: dict[str, Any], before: dict[str, Any] | None = None) -> dict[str, float | None]:
    """Generated tokens/s, episodes/min and samples consumed/min: since ``before`` if given, else since
    start."""

    def get(d: dict[str, Any], section: str, key: str) -> float | None:
        v = (d.get(section) or {}).get(key)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    if before is not None:
        dt = float(now.get("uptime_s") or 0) - float(before.get("uptime_s") or 0)
    else:
        dt = float(now.get("uptime_s") or 0)
    out: dict[str, float | None] = {}
    for name, section, key, per in (("tokens_per_s", "router", "completion_tokens", 1.0),
                                    ("episodes_per_min", "rollout", "episodes", 60.0),
                                    ("consumed_per_min", "buffer", "consumed", 60.0)):
        a = get(now, section, key)
        b = get(before, section, key) if before is not None else 0.0
        out[name] = (a - b) / dt * per if a is not None and b is not None and dt > 0 and a >= b else None
    return out


def format_status(url: str, status: dict[str, Any], before: dict[str, Any] | None = None) -> str:
    """The status as a few lines and one table of engines."""
    if status.get("starting"):  # serve answers while its engines start
        lines = [f"serve {url}   starting for {_duration(status.get('elapsed_s'))}: {status.get('phase')}"]
        for e in status.get("engines") or []:
            lines.append(f"  engine {e.get('port')}: {e.get('phase')} ({_duration(e.get('phase_s'))})")
        return "\n".join(lines)
    lines = [f"serve {url}   up {_duration(status.get('uptime_s'))} "
             f"  policy version {_n(status.get('version'))}"]
    engines = status.get("engines") or []
    healthy = sum(bool(e.get("healthy")) for e in engines)
    lines.append("")
    lines.append(f"engines: {healthy}/{len(engines)} healthy")
    if engines:
        supervised = any("state" in e for e in engines)  # engines serve launched: relaunched when they die
        rows = [
            [
                e.get("name", "?"),
                e.get("url", "?"),
                _n(e.get("healthy")),
                *([str(e.get("state", "-")), _n(e.get("restarts"))] if supervised else []),
                _n(e.get("version")),
                _n(e.get("outstanding")),
                _n(e.get("served")),
                _n(e.get("failures")),
                (e.get("last_error") or "")[:60],
            ]
            for e in engines
        ]
        lines += [
            "  " + r
            for r in table(
                [
                    "name",
                    "url",
                    "healthy",
                    *(["state", "restarts"] if supervised else []),
                    "version",
                    "in flight",
                    "served",
                    "failures",
                    "last error",
                ],
                rows,
            )
        ]
    lines.append("")

    ro = status.get("rollout") or {}
    episodes = ro.get("episodes") or 0
    reward_mean = (
        ro["reward_sum"] / episodes if episodes and isinstance(ro.get("reward_sum"), int | float) else None
    )
    lines.append(f"rollout   in flight {_n(ro.get('in_flight'))} | episodes {_n(ro.get('episodes'))} "
                 f"(failed {_n(ro.get('failed'))}, truncated {_n(ro.get('truncated'))}) | "
                 f"mean reward {_n(reward_mean, 3)} | tool calls {_n(ro.get('tool_calls'))}")
    workers = ro.get("workers")
    if isinstance(workers, list):  # serve --ray: rollout worker actors
        rs = ro.get("restarts") or {}
        lines.append(f"ray       {len(workers)} rollout workers | restarts: workers {_n(rs.get('workers'))} "
                     f"engines {_n(rs.get('engines'))} replaced {_n(rs.get('respawned'))}")
        rows = [[str(w.get("worker", "?")), str(w.get("node_id", "-"))[:12], _n(w.get("pid")),
                 "restarting" if w.get("restarting") else _n(w.get("in_flight")), _n(w.get("episodes")),
                 _n(w.get("failed"))] for w in workers]
        lines += ["  " + r for r in table(["worker", "node", "pid", "in flight", "episodes", "failed"], rows)]
    bu = status.get("buffer") or {}
    lines.append(f"buffer    depth {_n(bu.get('depth'))} | leased {_n(bu.get('leased'))} | "
                 f"produced {_n(bu.get('produced'))} consumed {_n(bu.get('consumed'))} "
                 f"dropped {_n(bu.get('dropped'))} | learner version {_n(bu.get('learner_version'))} | "
                 f"learners polling {_n(bu.get('pollers'))}")
    sb = status.get("sandbox")
    if isinstance(sb, dict):
        lines.append(f"sandbox   {sb.get('backend') or '-'} | in use {_n(sb.get('in_use'))} "
                     f"warm {_n(sb.get('warm'))} creating {_n(sb.get('creating'))} | "
                     f"exec p50 {_n(sb.get('exec_p50_ms'), 1)} ms p99 {_n(sb.get('exec_p99_ms'), 1)} "
                     f"ms | timeouts {_n(sb.get('timeouts'))} oom {_n(sb.get('oom_kills'))} "
                     f"errors {_n(sb.get('infra_errors'))}")
    else:
        lines.append("sandbox   none (this environment runs no tools in sandboxes)")
    rt = status.get("router") or {}
    lines.append(f"router    calls {_n(rt.get('calls'))} | 4xx {_n(rt.get('errors_4xx'))} "
                 f"5xx {_n(rt.get('errors_5xx'))} retries {_n(rt.get('retries'))}")
    r = rates(status, before)
    window = "last interval" if before is not None else "since start"
    lines.append(f"rate      {_n(r['tokens_per_s'])} generated tokens/s | {_n(r['episodes_per_min'], 1)} "
                 f"episodes/min | {_n(r['consumed_per_min'], 1)} samples trained/min  ({window})")
    return "\n".join(lines)


def main(url: str, token_file: str | None, run_dir: str | None, *, as_json: bool = False,
         watch_s: float = 0.0, timeout_s: float = 10.0) -> int:
    """The CLI command: print once (or every ``watch_s`` seconds until interrupted)."""
    token = resolve_token(token_file, run_dir)
    before: dict[str, Any] | None = None
    while True:
        status = fetch_status(url, token, timeout_s)
        if as_json:
            print(json.dumps(status, indent=None if watch_s else 2, default=str), flush=True)
        else:
            print(format_status(url, status, before), flush=True)
        if not watch_s:
            return 0
        before = status
        try:
            time.sleep(watch_s)
        except KeyboardInterrupt:
            return 0
        if not as_json:
            print()
