"""Sandbox benchmark: cold start, warm acquire, fast exec vs `docker exec`, and leaks; with
--density, how many warm sandboxes one host holds.

Usage: python benchmarks/sandbox.py [--backend docker|bubblewrap] [--n 200]
Prints progress, then one final JSON line with cold_start_p50_ms, cold_start_p99_ms,
warm_acquire_p50_ms, warm_acquire_p99_ms, exec_p50_ms, exec_p99_ms, reset_p50_ms, reset_p99_ms
(from an episode's end until its box is back in the pool: the agent's reset, which kills, removes
IPC objects and wipes the writable mounts), docker_exec_p50_ms (the plain `docker exec` CLI
baseline, same run, same container), exec_speedup and leaked_containers.

Density: python benchmarks/sandbox.py --density [--backend docker|bubblewrap] [--density-max 1000]
[--exec-rate 50] [--mem-floor-mb 2048]
Holds more and more warm sandboxes at once (created through the backend, agent answering, idle
between calls, as the pool keeps them warm), at each of --density-levels up to --density-max. At
each level, with all of them held, it sends `true` round-robin over every held box at --exec-rate
calls/s, open loop, for max(--exec-seconds, count / rate) seconds (at most 30: every box answers
at least once where that fits); an exec's latency runs from its scheduled time, so a stalled event
loop counts. Per level: exec p50/p99, memory per sandbox, creation time per sandbox, failures.

Memory per sandbox (`mb_per_sandbox`, the one reported) is the fall of the host's MemAvailable
since before the first sandbox, divided by the count, read after a 1 s settle: it includes what
the host pays outside the box (containerd-shim and dockerd for Docker, the outer bwrap process,
namespaces, this process's channel state) and any other process's drift. `cgroup_mb_per_sandbox`
is the mean of each box's memory cgroup (usage minus page cache: shared files are charged to
whichever box read them first), what the box itself holds.

It stops at the first bound, named in `bounded_by`: "target_reached" (--density-max held with
exec p99 < 100 ms), "exec_latency" (p99 >= 100 ms), "exec_failures", "create_failures" (or
"fd_limit", "pids_limit", "memory", "create_timeout" when the errors say so), "memory"
(MemAvailable would fall under --mem-floor-mb), "pids_limit" (the host's threads would pass 90%
of kernel.pid_max or threads-max), "fd_limit" (this process's fds would pass 90% of its
RLIMIT_NOFILE). The last three are projected from each level's per-sandbox slope before the next
level is created, which is then cut to what fits, measured, and the ramp ends there. `ceilings`
projects each of them from the last level. Every sandbox is removed at the end, on Ctrl-C or
SIGTERM too; `leaked` counts what is left (containers by label; bwrap children of this process).

Final JSON line: backend, density_target, max_warm_held (the largest level held with exec p99 <
100 ms and no failure), exec_rate_per_s, levels (count, exec_p50_ms, exec_p99_ms, exec_calls,
exec_failures, mb_per_sandbox, cgroup_mb_per_sandbox, create_s_per_sandbox, create_p50_ms,
failures, mem_available_mb, host_threads, fds, load_avg_1m; exec_p99_ms_first_try where a p99
over the limit was measured again: a level over it runs once more before it counts as the bound),
mb_per_sandbox and cgroup_mb_per_sandbox at max_warm_held, bounded_by, bound_detail, ceilings,
mem_floor_mb, destroy_s_per_sandbox, leaked, wall_s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from agentrl.sandbox import SandboxConfig, SandboxError, SandboxPool
from agentrl.sandbox.backend import SandboxBackend, Slot
from agentrl.sandbox.handle import Sandbox
from agentrl.sandbox.stats import PoolStats


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))] * 1e3, 2)


async def main(backend: str, n: int) -> dict:
    instance = f"bench-{uuid.uuid4().hex[:8]}"
    cfg = SandboxConfig(backend=backend, warm=4, max_concurrency=8)  # type: ignore[arg-type]
    pool = SandboxPool(cfg, instance)
    await pool.start()
    try:
        # Cold start: creation until the agent answers, one at a time.
        cold = []
        for _ in range(max(10, n // 10)):
            t0 = time.perf_counter()
            slot = await pool.backend.create()  # type: ignore[union-attr]
            cold.append(time.perf_counter() - t0)
            await pool.backend.destroy(slot)  # type: ignore[union-attr]
        print(f"cold start p50 {pct(cold, .5)} ms", flush=True)

        # Warm acquire: a box is waiting (reset boxes come back between episodes).
        warm, execs, resets = [], [], []
        sid = ""
        for i in range(n):
            t0 = time.perf_counter()
            await pool.wait_idle()
            if i:
                resets.append(time.perf_counter() - t0)  # the previous episode's reset
            t0 = time.perf_counter()
            async with pool.acquire() as sb:
                warm.append(time.perf_counter() - t0)
                sid = sb.id
                t1 = time.perf_counter()
                r = await sb.exec(["true"])
                execs.append(time.perf_counter() - t1)
                assert r.ok
        print(f"warm acquire p50 {pct(warm, .5)} ms, exec p50 {pct(execs, .5)} ms, "
              f"reset p50 {pct(resets, .5)} ms", flush=True)

        docker_exec = []
        if backend == "docker":
            async with pool.acquire() as sb:
                sid = sb.id
                for _ in range(min(n, 50)):
                    t0 = time.perf_counter()
                    subprocess.run(["docker", "exec", sid, "true"], check=True)
                    docker_exec.append(time.perf_counter() - t0)
            print(f"docker exec p50 {pct(docker_exec, .5)} ms", flush=True)
    finally:
        await pool.close()
    leaked = len(await pool.live_ids())
    if backend == "docker":
        out = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=agentrl.instance={instance}"],
                             capture_output=True, text=True)
        leaked = max(leaked, len(out.stdout.split()))
    result = {
        "backend": backend,
        "cold_start_p50_ms": pct(cold, .5), "cold_start_p99_ms": pct(cold, .99),
        "warm_acquire_p50_ms": pct(warm, .5), "warm_acquire_p99_ms": pct(warm, .99),
        "exec_p50_ms": pct(execs, .5), "exec_p99_ms": pct(execs, .99),
        "reset_p50_ms": pct(resets, .5), "reset_p99_ms": pct(resets, .99),
        "docker_exec_p50_ms": pct(docker_exec, .5) if docker_exec else None,
        "leaked_containers": leaked,
    }
    if docker_exec:
        result["exec_speedup"] = round(result["docker_exec_p50_ms"] / result["exec_p50_ms"], 1)
    return result


# --- density ----------------------------------------------------------------------------------

P99_LIMIT_MS = 100.0
CHUNK = 25  # sandboxes created between two memory checks
LIMIT_SHARE = 0.9  # of pid_max / threads-max / RLIMIT_NOFILE a projection may reach


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def mem_available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def host_threads() -> int:
    """Threads on the host now (each takes a pid): the denominator of /proc/loadavg's 4th field."""
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[1])


def own_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def limits() -> dict[str, int]:
    def read(path: str) -> int:
        return int(Path(path).read_text())

    return {"pids": min(read("/proc/sys/kernel/pid_max"), read("/proc/sys/kernel/threads-max")),
            "fds": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}


def cgroup_dir(backend: SandboxBackend, slot: Slot) -> Path | None:
    """The memory cgroup of one box (cgroup v1 or v2), None where it cannot be found."""
    if backend.name == "bubblewrap":
        cg = getattr(backend, "_cg", None)
        return cg.dirs(slot.id)[0] if cg is not None and getattr(backend, "_use_cg", False) else None
    for d in (f"/sys/fs/cgroup/memory/docker/{slot.id}", f"/sys/fs/cgroup/docker/{slot.id}",
              f"/sys/fs/cgroup/system.slice/docker-{slot.id}.scope"):
        if os.path.isdir(d):
            return Path(d)
    return None


def cgroup_mb(d: Path) -> float | None:
    """A cgroup's memory less its page cache (v1: usage - total_cache; v2: current - file)."""
    try:
        stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
        if (d / "memory.usage_in_bytes").exists():
            return (int((d / "memory.usage_in_bytes").read_text()) - int(stat["total_cache"])) / 2**20
        return (int((d / "memory.current").read_text()) - int(stat["file"])) / 2**20
    except (OSError, KeyError, ValueError):
        return None


def bwrap_children() -> int:
    """Live bwrap processes whose parent is this process (what a bubblewrap leak would be)."""
    me, n = os.getpid(), 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        n += comm == "bwrap" and rest[0] != "Z" and int(rest[1]) == me
    return n


def classify(errors: list[str]) -> str:
    """A bound's name from what failed creations said."""
    text = " ".join(errors)
    for name, marks in (("fd_limit", ("Too many open files", "EMFILE", "ENFILE")),
                        ("pids_limit", ("Resource temporarily unavailable", "EAGAIN", "fork", "pids")),
                        ("memory", ("Cannot allocate memory", "ENOMEM", "out of memory")),
                        ("create_timeout", ("did not start within",))):
        if any(m in text for m in marks):
            return name
    return "create_failures"


async def drive_execs(handles: list[Sandbox], rate: float, seconds: float,
                      cursor: int) -> tuple[list[float], list[str]]:
    """`true` round-robin over `handles` from `cursor` at `rate` calls/s, open loop, for `seconds`;
    each latency from its scheduled time. Returns (latencies in s, errors)."""
    lat: list[float] = []
    errors: list[str] = []

    async def one(sb: Sandbox, scheduled: float) -> None:
        try:
            r = await sb.exec(["true"], timeout=10)
            if not r.ok:
                errors.append(f"exit {r.exit_code}{' (timed out)' if r.timed_out else ''}: {r.stderr[:200]}")
        except (SandboxError, OSError) as e:
            errors.append(repr(e)[:300])
        lat.append(time.perf_counter() - scheduled)

    tasks = []
    start = time.perf_counter()
    for i in range(max(1, int(rate * seconds))):
        scheduled = start + i / rate
        if (delay := scheduled - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(handles[(cursor + i) % len(handles)], scheduled)))
    await asyncio.gather(*tasks)
    return lat, errors


def density_levels(spec: str, cap: int) -> list[int]:
    levels = sorted({int(x) for x in spec.split(",") if x.strip() and int(x) < cap} | {cap})
    return [n for n in levels if n > 0]


class Ramp:
    """The sandboxes held at once, and what each level costs. Boxes are made with the backend
    directly (as the cold starts above), so no pool cap applies; the pool is only started for its
    set-up (reaping, cgroups) and closed for its remove-by-label backstop."""

    def __init__(self, pool: SandboxPool, floor_mb: float) -> None:
        assert pool.backend is not None
        self.pool, self.backend, self.floor_mb = pool, pool.backend, floor_mb
        self.held: list[tuple[Slot, Sandbox]] = []
        self.stats = PoolStats()
        self.limits = limits()
        self.base = self.now()

    def now(self) -> dict[str, float]:
        return {"mem": mem_available_mb(), "threads": host_threads(), "fds": own_fds()}

    def per_sandbox(self, now: dict[str, float], n: int = 0) -> dict[str, float]:
        """What each of `n` boxes (default: those held) has cost since before the first one: MB,
        host threads, our fds."""
        n = n or len(self.held)
        return {k: (self.base[k] - now[k] if k == "mem" else now[k] - self.base[k]) / n for k in now}

    def room(self, now: dict[str, float], n: int = 0) -> dict[str, tuple[float | None, str]]:
        """For each projected bound: how many more boxes fit before it (None: no growth seen), why."""
        per = self.per_sandbox(now, n)

        def extra(free: float, slope: float) -> float | None:
            return free / slope if slope > 0 else None

        pids, fds = LIMIT_SHARE * self.limits["pids"], LIMIT_SHARE * self.limits["fds"]
        return {
            "memory": (extra(now["mem"] - self.floor_mb, per["mem"]),
                       f"MemAvailable {now['mem']:.0f} MB, {per['mem']:.1f} MB per sandbox, "
                       f"floor {self.floor_mb:.0f} MB"),
            "pids_limit": (extra(pids - now["threads"], per["threads"]),
                           f"host threads {now['threads']:.0f}, {per['threads']:.1f} per sandbox, "
                           f"limit {self.limits['pids']}"),
            "fd_limit": (extra(fds - now["fds"], per["fds"]),
                         f"fds {now['fds']:.0f}, {per['fds']:.1f} per sandbox, "
                         f"RLIMIT_NOFILE {self.limits['fds']}"),
        }

    def fit(self, target: int) -> tuple[int, str, str]:
        """The largest count <= target that every projection allows; the bound that cut it, why."""
        n, best, name, why = len(self.held), target, "", ""
        for bound, (extra, text) in self.room(self.now()).items():
            if extra is not None and n + int(extra) < best:
                best, name, why = max(n, n + int(extra)), bound, text
        return best, name, why

    async def grow(self, target: int) -> tuple[list[float], list[str], str]:
        """Create boxes up to `target`, CHUNK at a time, checking memory between chunks. Returns
        (creation latencies, errors, why it stopped short on memory or '')."""
        lat: list[float] = []
        errors: list[str] = []

        async def one() -> None:
            t0 = time.perf_counter()
            slot = await self.backend.create()
            self.held.append((slot, Sandbox(slot, self.backend.name, self.pool.cfg, self.stats)))
            lat.append(time.perf_counter() - t0)

        while len(self.held) < target and not errors:
            if mem_available_mb() < self.floor_mb:
                return lat, errors, f"MemAvailable fell under the {self.floor_mb:.0f} MB floor while creating"
            k = min(CHUNK, target - len(self.held))
            for r in await asyncio.gather(*(one() for _ in range(k)), return_exceptions=True):
                if isinstance(r, Exception):
                    errors.append(repr(r)[:300])
                elif isinstance(r, BaseException):
                    raise r
        return lat, errors, ""

    def cgroup_mb_mean(self) -> float | None:
        dirs = [d for d in (cgroup_dir(self.backend, s) for s, _ in self.held) if d is not None]
        mbs = [m for m in map(cgroup_mb, dirs) if m is not None]
        return round(sum(mbs) / len(mbs), 2) if mbs else None

    async def remove_all(self) -> float:
        """Destroy every held box; seconds taken. Shielded by the caller."""
        t0 = time.perf_counter()
        await asyncio.gather(*(self.backend.destroy(s) for s, _ in self.held), return_exceptions=True)
        return time.perf_counter() - t0


async def leaks(pool: SandboxPool, instance: str) -> int:
    """Sandboxes of this run still alive after close: what the backend lists, then containers by
    label (Docker) or live bwrap children of this process (bubblewrap)."""
    n = len(await pool.live_ids())
    if pool.cfg.backend == "docker":
        out = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=agentrl.instance={instance}"],
                             capture_output=True, text=True)
        return max(n, len(out.stdout.split()))
    return max(n, bwrap_children())


async def density(backend: str, cap: int, levels: list[int], rate: float, exec_seconds: float,
                  floor_mb: float) -> dict[str, Any]:
    """The ramp; prints its final JSON line itself (an interrupted asyncio.run returns nothing)."""
    t_start = time.perf_counter()

    # Setup: a pool for its start-up and backstop, the host's state before the first box.
    instance = f"bench-density-{uuid.uuid4().hex[:8]}"
    pool = SandboxPool(SandboxConfig(backend=backend, warm=0), instance)  # type: ignore[arg-type]
    await pool.start()
    ramp = Ramp(pool, floor_mb)
    base, lim = ramp.base, ramp.limits
    log(f"density {backend}: levels {levels}, exec {rate:g}/s, memory floor {floor_mb:.0f} MB; "
        f"MemAvailable {base['mem']:.0f} MB, host threads {base['threads']:.0f} (limit {lim['pids']}), "
        f"fds {base['fds']:.0f} (limit {lim['fds']})")
    rows: list[dict[str, Any]] = []
    bounded_by, detail, cursor, n_held, destroy_s = "target_reached", "", 0, 0, None
    try:
        for target in levels:
            # Project: cut the level to what memory, pids and fds allow.
            cut_by = why = ""
            if ramp.held:
                target, cut_by, why = ramp.fit(target)
                if target <= len(ramp.held):
                    bounded_by, detail = cut_by, f"the next level does not fit: {why}"
                    break

            # Create up to the level.
            t0, before = time.perf_counter(), len(ramp.held)
            create_lat, errors, short = await ramp.grow(target)
            create_wall = time.perf_counter() - t0
            if short:
                cut_by, why = "memory", short
            await asyncio.sleep(1.0)  # the agents finish starting before memory is read

            # Measure: memory, then exec latency under load over every held box.
            n, state = len(ramp.held), ramp.now()
            per = ramp.per_sandbox(state)
            seconds = min(30.0, max(exec_seconds, n / rate))
            lat, exec_errors = await drive_execs([h for _, h in ramp.held], rate, seconds, cursor)
            cursor += len(lat)
            first_p99 = None
            if pct(lat, .99) >= P99_LIMIT_MS and not exec_errors:
                # Once more: on a shared host another process's burst can spoil one phase; a bound
                # that density sets is still there the second time.
                first_p99 = pct(lat, .99)
                log(f"level {target}: exec p99 {first_p99} ms over the limit; measuring again")
                lat, exec_errors = await drive_execs([h for _, h in ramp.held], rate, seconds, cursor)
                cursor += len(lat)
            row = {
                "count": n, "exec_p50_ms": pct(lat, .5), "exec_p99_ms": pct(lat, .99),
                "exec_calls": len(lat), "exec_failures": len(exec_errors),
                "mb_per_sandbox": round(per["mem"], 2), "cgroup_mb_per_sandbox": ramp.cgroup_mb_mean(),
                "create_s_per_sandbox": round(create_wall / len(create_lat), 4) if create_lat else None,
                "create_p50_ms": pct(create_lat, .5) if create_lat else None,
                "failures": len(errors), "mem_available_mb": round(state["mem"]),
                "host_threads": int(state["threads"]), "fds": int(state["fds"]),
                "load_avg_1m": os.getloadavg()[0],
            }
            if first_p99 is not None:
                row["exec_p99_ms_first_try"] = first_p99
            rows.append(row)
            log(f"level {target}: held {n} (created {n - before} in {create_wall:.1f} s, {len(errors)} "
                f"failed), {row['mb_per_sandbox']} MB/sandbox (cgroup {row['cgroup_mb_per_sandbox']}), "
                f"exec p50 {row['exec_p50_ms']} ms p99 {row['exec_p99_ms']} ms over {len(lat)} calls "
                f"at {rate:g}/s ({len(exec_errors)} failed), MemAvailable {row['mem_available_mb']} MB, "
                f"host threads {row['host_threads']}, fds {row['fds']}, load {row['load_avg_1m']:.1f}")

            # Stop at the first bound this level hit.
            if errors:
                bounded_by, detail = classify(errors), f"{len(errors)} creations failed, first: {errors[0]}"
            elif exec_errors:
                bounded_by, detail = "exec_failures", f"{len(exec_errors)} failed, first: {exec_errors[0]}"
            elif row["exec_p99_ms"] >= P99_LIMIT_MS:
                bounded_by, detail = "exec_latency", f"exec p99 {row['exec_p99_ms']} ms at {n} held"
            elif cut_by:
                bounded_by, detail = cut_by, f"level cut to {n}: {why}"
            else:
                continue
            break
    except (asyncio.CancelledError, KeyboardInterrupt):
        bounded_by, detail = "interrupted", "Ctrl-C or SIGTERM; every sandbox removed"
    finally:
        # Cleanup, whatever happened: every box destroyed, then the pool's sweep by label/cgroup.
        n_held = len(ramp.held)
        with contextlib.suppress(Exception):
            destroy_s = await asyncio.shield(ramp.remove_all())
        await pool.close()
        leaked = await leaks(pool, instance)
        log(f"removed {n_held} sandboxes in {destroy_s or 0:.1f} s; leaked {leaked}")

    # Report: the largest clean level, and where each projected bound would fall.
    good = [r for r in rows if r["exec_p99_ms"] < P99_LIMIT_MS and not (r["failures"] or r["exec_failures"])]
    top = good[-1] if good else None
    ceilings: dict[str, int | None] = {}
    if rows:
        last = rows[-1]
        state = {"mem": last["mem_available_mb"], "threads": last["host_threads"], "fds": last["fds"]}
        room = ramp.room(state, last["count"]) if last["count"] else {}
        ceilings = {k: (max(0, last["count"] + int(extra)) if extra is not None else None)
                    for k, (extra, _) in room.items()}
    result = {
        "backend": backend, "density_target": cap, "max_warm_held": top["count"] if top else 0,
        "exec_rate_per_s": rate, "p99_limit_ms": P99_LIMIT_MS,
        "mb_per_sandbox": top["mb_per_sandbox"] if top else None,
        "cgroup_mb_per_sandbox": top["cgroup_mb_per_sandbox"] if top else None,
        "bounded_by": bounded_by, "bound_detail": detail, "ceilings": ceilings,
        "mem_floor_mb": floor_mb, "limits": lim, "create_concurrency": pool.cfg.create_concurrency,
        "destroy_s_per_sandbox": round(destroy_s / n_held, 4) if destroy_s and n_held else None,
        "leaked": leaked, "levels": rows, "wall_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(result), flush=True)
    return result


async def density_main(args: argparse.Namespace) -> dict[str, Any]:
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    levels = density_levels(args.density_levels, args.density_max)
    return await density(args.backend, args.density_max, levels, args.exec_rate, args.exec_seconds,
                         args.mem_floor_mb)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="docker", choices=["docker", "bubblewrap"])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--density", action="store_true", help="measure how many warm sandboxes the host holds")
    ap.add_argument("--density-max", type=int, default=1000, help="the target: most sandboxes held at once")
    ap.add_argument("--density-levels", default="25,50,100,200,400,700,1000",
                    help="counts to hold, in order (capped by --density-max, which is always the last)")
    ap.add_argument("--exec-rate", type=float, default=50.0, help="exec calls/s during each level")
    ap.add_argument("--exec-seconds", type=float, default=5.0,
                    help="shortest exec phase per level (longer where count / rate is)")
    ap.add_argument("--mem-floor-mb", type=float, default=2048.0,
                    help="stop before MemAvailable would fall under this")
    args = ap.parse_args()
    if not args.density:
        print(json.dumps(asyncio.run(main(args.backend, args.n))))
    else:
        try:
            done = asyncio.run(density_main(args))
        except KeyboardInterrupt:  # the JSON line is printed; the cleanup ran in density()
            sys.exit(130)
        sys.exit(130 if done["bounded_by"] == "interrupted" else 0)
