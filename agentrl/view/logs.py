"""The run directory's JSONL logs, read incrementally and held in bounded, compact form.

- :class:`LogTail` follows one log (``learner.jsonl``, ``serve_metrics.jsonl``) from where its last
  read stopped and keeps only the numbers the charts draw, as columns of floats. Past
  ``max_rows`` kept rows it drops every other one and keeps every second row from then on, so a
  week-long run costs the same memory as a long afternoon, and the kept rows stay evenly spread.
- :class:`EpisodeIndex` follows ``episodes.jsonl`` and keeps, per episode, its byte offset, a hash of its
  id and the fields the browser filters on (about 60 bytes an episode, in ``array`` columns); a page
  of rows, or one episode's line, is read back from the file by offset. A multi-agent episode adds
  the roles that called and what sampled them (a bit each, in one 64-bit mask apiece), and each
  role's reward (a column per role, NaN where an episode has no such role).

Invariants: only complete lines are read (a line the run is still writing waits for the next
refresh); one refresh reads at most ``budget`` bytes, so a request on a huge run returns in bounded
time and later refreshes go on from there; a log that shrank (replaced) is read again from its
start. Nothing here writes to the run directory. The classes are not thread-safe by themselves:
:class:`agentrl.view.routes.ViewState` serialises access with a lock.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.view.graph import role_rewards, roles_and_samplers

log = logging.getLogger(__name__)

CHUNK = 1 << 20  # bytes read at a time
BUDGET = 32 << 20  # bytes one refresh reads at most
MAX_LINE = 8 << 20  # a longer "line" is skipped, not buffered without end
NAN = float("nan")

# learner.jsonl: the numbers the charts use (plus every is/* and mismatch/* statistic)
LEARNER_KEYS = ("step", "version", "time", "reward_mean", "staleness_mean", "staleness_max", "tokens_per_s",
                "idle_fraction", "wait_s", "train_s", "sync_s", "loss")
LEARNER_PREFIXES = ("is/", "mismatch/")
# serve_metrics.jsonl: dotted paths into serve's status()
SERVE_KEYS = (
    "time", "version", "router.completion_tokens", "router.calls", "rollout.episodes", "rollout.failed",
    "rollout.in_flight", "buffer.depth", "buffer.dropped", "sandbox.exec_p50_ms", "sandbox.exec_p99_ms",
    "sandbox.acquire_p50_ms", "sandbox.acquire_p99_ms", "sandbox.in_use", "rollout.concurrency.limit",
)


def number(node: Any, key: str) -> float | None:
    """``node[key]`` as a float; dotted keys reach into nested dicts; booleans and non-numbers are None."""
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if isinstance(node, bool) or not isinstance(node, int | float) or not math.isfinite(node):
        return None
    return float(node)


def env_label(row: dict[str, Any]) -> str:
    """An episode line's environment as the browser shows and filters it: a mix's episodes are
    ``mix/<environment>`` (their ``info.mix_env``), so each environment of a mix can be picked."""
    env = str(row.get("env") or "")
    info = row.get("info")
    sub = info.get("mix_env") if isinstance(info, dict) else None
    return f"{env}/{sub}" if isinstance(sub, str) and sub else env


def learner_numbers(row: dict[str, Any]) -> dict[str, float]:
    out = {k: v for k in LEARNER_KEYS if (v := number(row, k)) is not None}
    for k in row:
        if k.startswith(LEARNER_PREFIXES) and (v := number(row, k)) is not None:
            out[k] = v
    return out


def serve_numbers(row: dict[str, Any]) -> dict[str, float]:
    return {k: v for k in SERVE_KEYS if (v := number(row, k)) is not None}


def complete_lines(path: Path, offset: int, budget: int = BUDGET) -> Iterator[tuple[int, bytes, int]]:
    """(offset, line, offset after it) for each complete line of ``path`` from ``offset``, within
    ``budget`` bytes. The caller resumes from the last "offset after"; a torn last line is not yielded.
    """
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        f.seek(offset)
        pending = b""
        start = offset
        read = 0
        while read < budget:
            chunk = f.read(CHUNK)
            if not chunk:
                return
            read += len(chunk)
            pending += chunk
            lines = pending.split(b"\n")
            pending = lines.pop()  # the part after the last newline: incomplete
            for line in lines:
                yield start, line, start + len(line) + 1
                start += len(line) + 1
            if len(pending) > MAX_LINE:  # no newline in sight: skip it rather than hold it
                log.warning("%s: a line of more than %d bytes at %d; skipped", path, MAX_LINE, start)
                yield start, b"", start + len(pending)
                start += len(pending)
                pending = b""


def parse(line: bytes) -> dict[str, Any] | None:
    line = line.strip()
    if not line:
        return None
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _listed(col: array, step: int) -> list[float | None]:
    """A column as JSON-ready values (NaN, which JSON cannot carry, as None), every ``step``-th row."""
    n = len(col)
    idx = list(range(0, n, step))
    if n and idx[-1] != n - 1:
        idx.append(n - 1)  # the newest row always shows
    return [None if math.isnan(col[i]) else col[i] for i in idx]


class LogTail:
    """Numeric columns of one JSONL log, extended by :meth:`refresh` from where the last read stopped."""

    def __init__(self, path: Path, extract: Callable[[dict[str, Any]], dict[str, float]],
                 max_rows: int = 20_000) -> None:
        self.path = path
        self.extract = extract
        self.max_rows = max_rows
        self._reset()

    def _reset(self) -> None:
        self.offset = 0
        self.seen = 0  # rows read so far (the revision clients compare)
        self.stride = 1  # one row kept every ``stride`` rows
        self.kept = 0
        self.cols: dict[str, array] = {}
        self.newest: dict[str, float] | None = None  # the last row read, when it was not kept

    def refresh(self, budget: int = BUDGET) -> None:
        if _size(self.path) < self.offset:  # replaced or truncated: start again
            log.info("%s shrank; reading it again", self.path)
            self._reset()
        for _, line, after in complete_lines(self.path, self.offset, budget):
            self.offset = after
            row = parse(line)
            if row is None:
                continue
            self.seen += 1
            if (self.seen - 1) % self.stride:
                self.newest = self.extract(row)
                continue
            self.newest = None
            self._keep(self.extract(row))

    def _keep(self, values: dict[str, float]) -> None:
        for k in values.keys() - self.cols.keys():  # a key seen for the first time: earlier rows lack it
            self.cols[k] = array("d", [NAN] * self.kept)
        for k, col in self.cols.items():
            col.append(values.get(k, NAN))
        self.kept += 1
        if self.kept >= self.max_rows:  # thin out: every other kept row, and half as many from now on
            for k, col in self.cols.items():
                self.cols[k] = col[::2]
            self.kept = len(next(iter(self.cols.values()))) if self.cols else 0
            self.stride *= 2

    def snapshot(self, max_points: int) -> dict[str, Any]:
        """The kept rows as JSON-ready columns, at most about ``max_points`` of them (evenly strided),
        and always the newest row read."""
        step = max(1, math.ceil(self.kept / max(1, max_points)))
        cols = {k: _listed(col, step) for k, col in sorted(self.cols.items())}
        if self.newest is not None:
            for k in self.newest.keys() - cols.keys():
                cols[k] = [None] * len(next(iter(cols.values()), []))
            for k, values in cols.items():
                values.append(self.newest.get(k))
        return {
            "rev": self.seen, "rows": self.seen, "points": len(next(iter(cols.values()), [])), "cols": cols,
        }


@dataclass
class EpisodeFilter:
    """What the episode browser asks for; empty fields match everything."""

    env: str = ""
    reward_min: float | None = None
    reward_max: float | None = None
    version_min: int | None = None  # episodes with a token from a version >= this ...
    version_max: int | None = None  # ... and <= this
    error_kind: str = ""  # "", "none" (no error), "any" (some error) or a kind
    truncation: str = ""  # "", "no", "yes" (any reason) or a reason
    role: str = ""  # a multi-agent episode in which this role called
    policy: str = ""  # ... and one whose calls this sampled ("policy:<name>", "frozen", "endpoint:<url>")


def _id_hash(episode_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(episode_id.encode(), digest_size=8).digest(), "little")


class _Codes:
    """Small strings (env names, error kinds, truncation reasons) as small integers; 0 is "none"."""

    def __init__(self) -> None:
        self.names: list[str] = [""]
        self._index: dict[str, int] = {"": 0}

    def code(self, name: str | None) -> int:
        name = name or ""
        if name not in self._index:
            if len(self.names) >= 255:  # the column is one byte: fold the rest together
                name = "other"
                if name in self._index:
                    return self._index[name]
            self._index[name] = len(self.names)
            self.names.append(name)
        return self._index[name]

    def lookup(self, name: str) -> int | None:
        return self._index.get(name)


class _Tags:
    """Names (roles, samplers) as bits of a 64-bit mask; past 63 names the rest share the last bit."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._bit: dict[str, int] = {}

    def mask(self, names: list[str]) -> int:
        m = 0
        for name in names:
            if name not in self._bit:
                if len(self.names) >= 63:
                    name = "other"
                    if name not in self._bit:
                        self._bit[name] = 63
                        self.names.append(name)
                else:
                    self._bit[name] = len(self.names)
                    self.names.append(name)
            m |= 1 << self._bit[name]
        return m

    def bit(self, name: str) -> int | None:
        b = self._bit.get(name)
        return None if b is None else 1 << b


class EpisodeIndex:
    """``episodes.jsonl`` as columns: byte offset, time, reward, version range, env, error kind,
    truncation."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._reset()

    def _reset(self) -> None:
        self.offset = 0
        self.offsets = array("q")
        self.ids = array("Q")  # 64-bit hashes of the episode ids: find() without scanning the file
        self.times = array("d")
        self.rewards = array("d")
        self.vmin = array("q")
        self.vmax = array("q")
        self.envs, self.kinds, self.truncs = _Codes(), _Codes(), _Codes()
        self.env = array("B")
        self.kind = array("B")
        self.trunc = array("B")
        self.roles, self.samplers = _Tags(), _Tags()
        self.role_mask = array("Q")
        self.sampler_mask = array("Q")
        self.role_reward: dict[str, array] = {}  # role -> its reward per episode (NaN: not in it)

    def __len__(self) -> int:
        return len(self.offsets)

    def refresh(self, budget: int = BUDGET) -> None:
        if _size(self.path) < self.offset:
            log.info("%s shrank; indexing it again", self.path)
            self._reset()
        for off, line, after in complete_lines(self.path, self.offset, budget):
            self.offset = after
            row = parse(line)
            if row is None or not isinstance(row.get("episode_id"), str):
                continue
            versions = [int(v) for v in row.get("versions") or [] if isinstance(v, int | float)]
            self.offsets.append(off)
            self.ids.append(_id_hash(row["episode_id"]))
            self.times.append(number(row, "time") or NAN)
            self.rewards.append(number(row, "reward") or 0.0)
            self.vmin.append(min(versions, default=-1))
            self.vmax.append(max(versions, default=-1))
            self.env.append(self.envs.code(env_label(row)))
            kind = row.get("error_kind") or ("unknown" if row.get("error") else "")
            self.kind.append(self.kinds.code(str(kind)))
            trunc = row.get("truncation") or ("unknown" if row.get("truncated") else "")
            self.trunc.append(self.truncs.code(str(trunc)))
            roles, samplers = roles_and_samplers(row)
            self.role_mask.append(self.roles.mask(roles))
            self.sampler_mask.append(self.samplers.mask(samplers))
            rewards = role_rewards(row) if roles else {}
            for role in rewards.keys() - self.role_reward.keys():
                if len(self.role_reward) < 63:  # as many columns as the role mask has bits
                    self.role_reward[role] = array("d", [NAN] * (len(self.offsets) - 1))
            for role, col in self.role_reward.items():
                col.append(rewards.get(role, NAN))

    def facets(self) -> dict[str, list[str]]:
        """The values each filter can take in this run."""
        return {
            "envs": self.envs.names[1:], "error_kinds": self.kinds.names[1:],
            "truncations": self.truncs.names[1:], "roles": sorted(self.roles.names),
            "policies": sorted(self.samplers.names),
        }

    def match(self, f: EpisodeFilter, offset: int, limit: int) -> tuple[int, list[int]]:
        """(how many episodes match, the byte offsets of matches ``offset`` .. ``offset + limit``), newest
        first."""
        env = self.envs.lookup(f.env) if f.env else None
        if f.env and env is None:
            return 0, []
        kind: int | None = None
        if f.error_kind not in ("", "none", "any"):
            kind = self.kinds.lookup(f.error_kind)
            if kind is None:
                return 0, []
        trunc: int | None = None
        if f.truncation not in ("", "no", "yes"):
            trunc = self.truncs.lookup(f.truncation)
            if trunc is None:
                return 0, []
        role = self.roles.bit(f.role) if f.role else 0
        policy = self.samplers.bit(f.policy) if f.policy else 0
        if role is None or policy is None:
            return 0, []
        total, page = 0, []
        for i in range(len(self.offsets) - 1, -1, -1):
            if env is not None and self.env[i] != env:
                continue
            if f.reward_min is not None and self.rewards[i] < f.reward_min:
                continue
            if f.reward_max is not None and self.rewards[i] > f.reward_max:
                continue
            if f.version_min is not None and self.vmax[i] < f.version_min:
                continue
            if f.version_max is not None and (self.vmin[i] < 0 or self.vmin[i] > f.version_max):
                continue
            k = self.kind[i]
            if (f.error_kind == "none" and k) or (f.error_kind == "any" and not k) or (kind not in (None, k)):
                continue
            t = self.trunc[i]
            if (f.truncation == "no" and t) or (f.truncation == "yes" and not t) or (trunc not in (None, t)):
                continue
            if (role and not self.role_mask[i] & role) or (policy and not self.sampler_mask[i] & policy):
                continue
            if offset <= total < offset + limit:
                page.append(self.offsets[i])
            total += 1
        return total, page

    def read_rows(self, offsets: list[int], max_line: int = 1 << 20) -> list[dict[str, Any]]:
        rows = []
        with open(self.path, "rb") as f:
            for off in offsets:
                f.seek(off)
                row = parse(f.readline(max_line))
                if row is not None:
                    rows.append(row)
        return rows

    def find(self, episode_id: str) -> dict[str, Any] | None:
        """The episode's line (the newest, should one be written twice), found by its id's hash in the
        index and read back by offset; None when the indexed part of the log has none."""
        h = _id_hash(episode_id)
        for i in range(len(self.ids) - 1, -1, -1):
            if self.ids[i] == h:
                rows = self.read_rows([self.offsets[i]])
                if rows and rows[0].get("episode_id") == episode_id:
                    return rows[0]
        return None

    def series(self, max_points: int) -> dict[str, Any]:
        """Episode rewards in finish order, averaged over bins of equal size (at most ``max_points`` bins);
        for a multi-agent run also each role's (``role_reward.<role>``: the mean over the bin's episodes
        the role played in, None for a bin without one)."""
        n = len(self.rewards)
        size = max(1, math.ceil(n / max(1, max_points)))
        xs, ts, rs, fails = [], [], [], []
        per_role: dict[str, list[float | None]] = {role: [] for role in self.role_reward}
        for start in range(0, n, size):
            end = min(n, start + size)
            xs.append((start + end + 1) / 2)  # episodes are numbered from 1
            t = self.times[end - 1]
            ts.append(None if math.isnan(t) else t)
            rs.append(sum(self.rewards[start:end]) / (end - start))
            fails.append(sum(1 for k in self.kind[start:end] if k))
            for role, col in self.role_reward.items():
                got = [r for r in col[start:end] if not math.isnan(r)]
                per_role[role].append(sum(got) / len(got) if got else None)
        cols: dict[str, list[Any]] = {"episode": xs, "time": ts, "reward": rs, "failed": fails}
        cols.update({f"role_reward.{role}": ys for role, ys in sorted(per_role.items())})
        return {"rev": n, "rows": n, "bin": size, "points": len(xs), "cols": cols}
