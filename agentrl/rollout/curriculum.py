"""The online curriculum: which task the rollout plays next, from what each task has taught so far.

Without it the rollout plays the task stream in order, each task once. With it
(``serve.env.curriculum.enabled``), each new group is either the stream's next task (exploration of
unseen tasks) or a replay of a task already played, drawn from one of three pools by its pass rate
so far:

- ``learnable``: pass rate strictly between ``hard`` and ``easy`` (default 0.2 and 0.8); within the
  pool a task is drawn with weight p x (1 - p), so tasks near one half come first;
- ``hard``: at or below ``hard`` (nothing or almost nothing solved);
- ``easy``: at or above ``easy``.

The pool (or ``new``) is drawn with the configured ``weights`` among the non-empty ones. A task is
played in ``max_plays`` groups at most, then retires. Groups whose rewards have no spread teach GRPO
nothing: serve turns on the buffer's ``drop_uniform_groups`` with the curriculum, so such a group
does not count toward a batch and admission lets the rollout play another (the buffer counts them,
reason ``uniform_group``); the curriculum counts them per task and moves the task to the pool its
pass rate says.

State: an append-only ``curriculum.jsonl`` in the run directory, one line per draw (its pool and
the task's stream index) and one per finished episode (its group, task index, success and reward),
with the task itself the first time it is seen. A restarted serve reads it back and carries on with
the same statistics and the same draw sequence (each draw's randomness comes from the seed and the
draw's number); the task frontier (``rollout_frontier.jsonl``) keeps resuming the groups that were
open, so the curriculum adds replays by choice and never a replay or a skip by accident. An
episode line is written after the episode's samples are stored, so a ``kill -9`` can leave episodes
in the buffer but not in the statistics: those whose puts had landed (several can land together)
and whose lines were not yet written. Never a sample trained twice. On restart the rollout tells
the curriculum what the buffer holds of each open group (:meth:`Curriculum.stored`); the shortfall
is written as an ``uncounted`` line, so the group still closes at its size, and
``status()["uncounted_episodes"]`` reports it.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.buffer.disk import append_record
from agentrl.rollout.config import POOLS, CurriculumConfig

log = logging.getLogger(__name__)

@dataclass
class TaskStats:
    """What one task has shown so far."""

    task: dict[str, Any]
    plays: int = 0  # groups started on it
    episodes: int = 0
    successes: int = 0
    reward_sum: float = 0.0
    reward_sq: float = 0.0
    uniform_groups: int = 0  # finished groups whose rewards had no spread
    open_rewards: dict[str, list[float]] = field(default_factory=dict)  # group id -> rewards so far

    @property
    def pass_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0

    @property
    def reward_var(self) -> float:
        if self.episodes < 2:
            return 0.0
        mean = self.reward_sum / self.episodes
        return max(0.0, self.reward_sq / self.episodes - mean * mean)


class Curriculum:
    """Draws the next task and keeps per-task statistics, durable in ``path``."""

    def __init__(self, cfg: CurriculumConfig, path: Path | None, group_size: int, fresh: bool = True) -> None:
        cfg.check()
        self.cfg, self.path, self.group_size = cfg, path, group_size
        self.tasks: dict[int, TaskStats] = {}  # stream index -> statistics
        self.draws = 0
        self.drawn_by_pool = dict.fromkeys(POOLS, 0)
        self._groups: dict[str, int] = {}  # open group id -> stream index
        self._uncounted: dict[str, int] = {}  # open group id -> its stored episodes no line counts
        self.uncounted_episodes = 0
        # stream tasks its draws took as new, by every run: a restart's stream goes on from there even
        # when a kill fell between a draw's line and the task frontier's line for its group
        self.new_drawn = 0
        self._fd: int | None = None
        if path is not None:
            if path.exists() and not fresh:
                self._read(path)
            elif path.exists():
                path.unlink()
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    # ------------------------------------------------------------------ drawing

    def pool_of(self, stats: TaskStats) -> str | None:
        """The pool a played task is in (None: retired, or every one of its groups still running)."""
        if stats.plays >= self.cfg.max_plays or stats.episodes == 0:
            return None
        p = stats.pass_rate
        return "hard" if p <= self.cfg.hard else "easy" if p >= self.cfg.easy else "learnable"

    def draw(self, next_new: Callable[[], tuple[int, dict[str, Any]]]) -> tuple[int, dict[str, Any]]:
        """The next group's (stream index, task): the stream's next one (``next_new``) or a replay."""
        rng = random.Random(f"{self.cfg.seed}-{self.draws}")
        pools: dict[str, list[int]] = {"learnable": [], "hard": [], "easy": []}
        for index, stats in self.tasks.items():
            if (pool := self.pool_of(stats)) is not None:
                pools[pool].append(index)
        names = ["new"] + [p for p in ("learnable", "hard", "easy") if pools[p]]
        weights = [self.cfg.weights.get(p, 0.0) for p in names]
        pool = rng.choices(names, weights)[0]
        if pool == "new":
            index, task = next_new()
            self.new_drawn = max(self.new_drawn, index + 1)
        else:
            members = sorted(pools[pool])
            # within the learnable pool a task near one half first; elsewhere any alike
            w = [max(1e-6, self.tasks[i].pass_rate * (1 - self.tasks[i].pass_rate)) if pool == "learnable"
                 else 1.0 for i in members]
            index = rng.choices(members, w)[0]
            task = self.tasks[index].task
        self.drawn_by_pool[pool] += 1
        self._write({"draw": self.draws, "pool": pool, "i": index})
        self.draws += 1
        return index, task

    def started(self, group_id: str, index: int, task: dict[str, Any]) -> None:
        """A group starts (a drawn one, or one the frontier resumes) on the stream's task ``index``."""
        stats = self.tasks.get(index)
        if stats is None:
            stats = self.tasks[index] = TaskStats(task)
            self._write({"seen": index, "task": task})
        if group_id not in stats.open_rewards:
            stats.plays += 1
            stats.open_rewards[group_id] = []
        self._groups[group_id] = index
        self._write({"start": group_id, "i": index})

    def finished_episode(self, group_id: str, success: bool, reward: float) -> None:
        """An episode of the group is stored (its samples in the buffer)."""
        index = self._groups.get(group_id)
        if index is None:
            return
        self._count(index, group_id, success, reward)
        self._write({"ep": group_id, "i": index, "ok": success, "r": reward})

    def stored(self, group_id: str, n: int) -> None:
        """A restarted rollout found ``n`` of an open group's episodes in the buffer. Those the file
        does not count (a kill between their put and their line) are noted, so the group closes at
        its size."""
        index = self._groups.get(group_id)
        if index is None:
            return
        rewards = self.tasks[index].open_rewards.get(group_id, [])
        short = n - len(rewards) - self._uncounted.get(group_id, 0)
        if short > 0:
            self._write({"uncounted": group_id, "i": index, "n": short})
            self._note_uncounted(index, group_id, short)

    def _note_uncounted(self, index: int, group_id: str, n: int) -> None:
        self.uncounted_episodes += n
        self._uncounted[group_id] = self._uncounted.get(group_id, 0) + n
        self._close_if_whole(self.tasks[index], group_id)

    def _count(self, index: int, group_id: str, success: bool, reward: float) -> None:
        stats = self.tasks[index]
        stats.episodes += 1
        stats.successes += bool(success)
        stats.reward_sum += reward
        stats.reward_sq += reward * reward
        stats.open_rewards.setdefault(group_id, []).append(reward)
        self._close_if_whole(stats, group_id)

    def _close_if_whole(self, stats: TaskStats, group_id: str) -> None:
        rewards = stats.open_rewards.get(group_id)
        if rewards is None or len(rewards) + self._uncounted.get(group_id, 0) < self.group_size:
            return
        del stats.open_rewards[group_id]
        self._groups.pop(group_id, None)
        self._uncounted.pop(group_id, None)
        if rewards:  # the spread of the rewards it counted
            stats.uniform_groups += max(rewards) - min(rewards) <= 1e-9

    # ------------------------------------------------------------------ state

    def _write(self, rec: dict[str, Any]) -> None:
        if self._fd is not None:
            append_record(self._fd, rec, f"curriculum {self.path}")

    def _read(self, path: Path) -> None:
        torn = 0
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                torn += not self._replay(json.loads(line))
            except (ValueError, KeyError, TypeError, AttributeError):
                torn += 1
        if torn:
            log.warning("curriculum %s: skipped %d torn or orphaned line(s)", path, torn)
        if self.tasks:
            log.info("curriculum: %d task(s) seen, %d draw(s) made before", len(self.tasks), self.draws)

    def _replay(self, rec: dict[str, Any]) -> bool:
        """Apply one line of the file; False for a line about a task whose "seen" line was not
        written (a full disk): nothing to count it on."""
        if "seen" in rec:
            self.tasks.setdefault(int(rec["seen"]), TaskStats(rec["task"]))
        elif "draw" in rec:
            self.draws = max(self.draws, int(rec["draw"]) + 1)
            self.drawn_by_pool[rec["pool"]] = self.drawn_by_pool.get(rec["pool"], 0) + 1
            if rec["pool"] == "new":
                self.new_drawn = max(self.new_drawn, int(rec["i"]) + 1)
        elif int(rec["i"]) not in self.tasks:
            return False
        elif "start" in rec:
            stats = self.tasks[int(rec["i"])]
            if rec["start"] not in stats.open_rewards:
                stats.plays += 1
                stats.open_rewards[rec["start"]] = []
            self._groups[rec["start"]] = int(rec["i"])
        elif "ep" in rec:
            self._count(int(rec["i"]), rec["ep"], bool(rec["ok"]), float(rec["r"]))
        elif "uncounted" in rec:
            self._note_uncounted(int(rec["i"]), rec["uncounted"], int(rec["n"]))
        return True

    def status(self) -> dict[str, Any]:
        pools = dict.fromkeys(("learnable", "hard", "easy", "retired"), 0)
        for stats in self.tasks.values():
            pool = self.pool_of(stats)
            if pool is not None:
                pools[pool] += 1
            elif stats.plays >= self.cfg.max_plays:
                pools["retired"] += 1
        finished = sum(s.plays - len(s.open_rewards) for s in self.tasks.values())
        uniform = sum(s.uniform_groups for s in self.tasks.values())
        return {"tasks_seen": len(self.tasks), "draws": self.draws, "drawn_by_pool": dict(self.drawn_by_pool),
                "tasks_by_pool": pools, "groups_finished": finished, "uniform_groups": uniform,
                "uncounted_episodes": self.uncounted_episodes,
                "zero_spread_share": round(uniform / finished, 4) if finished else 0.0}

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
