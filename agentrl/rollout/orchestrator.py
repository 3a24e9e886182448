"""The orchestrator: keeps groups of episodes running, bounded by admission control.

It starts a group of G episodes on one task only while the buffer's admission rule allows it
(the samples of the episodes in flight plus those buffered at most (max_staleness + 1) x batch size,
so little is generated only to be thrown away as stale; an episode in flight counts as the mean a
finished one made, three for a multi-agent episode of three trained roles) and while fewer than
``max_concurrency`` episodes run. Episodes are played by an
:class:`~agentrl.rollout.protocols.EpisodeProducer` (the built-in agent loop or an external
scaffold: the orchestrator does not know which); finished episodes go to a
:class:`~agentrl.rollout.protocols.BufferSink` (durable) and to ``episodes.jsonl`` in the run
directory.

Tasks are drawn lazily from the environment's train split and the split is read again when it
runs out, so a task source may be huge or endless and memory stays bounded. With a
:class:`~agentrl.rollout.frontier.TaskFrontier` (serve's run directory) a restart carries on
where the last run stopped: no task skipped, none played twice, and each group that was in flight
finished with only the episodes the buffer does not have. Episodes that failed
at an infrastructure boundary (model, transport, sandbox: :data:`agentrl.errors.INFRASTRUCTURE`)
make it back off before starting more, whoever played them.

``sync=True`` turns it into the synchronous baseline that the asynchronous design is measured
against (``benchmarks/async_vs_sync.py``): start one batch of groups (``batch_size`` samples; a
multi-agent episode makes one per role), wait for the slowest
episode, then wait until the learner has trained on the batch and the engines serve the new
weights (``policy_version``), and only then start the next batch.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.aio import to_the_end
from agentrl.buffer.disk import append_line
from agentrl.env import make
from agentrl.env.registry import lookup
from agentrl.env.roles import MultiAgentEnv
from agentrl.errors import INFRASTRUCTURE
from agentrl.rollout.episode import EpisodeResult, is_success
from agentrl.rollout.frontier import TaskFrontier
from agentrl.rollout.protocols import BufferSink, EpisodeProducer

if TYPE_CHECKING:
    from agentrl.rollout.concurrency import ConcurrencyController
    from agentrl.rollout.curriculum import Curriculum
    from agentrl.scoring.stage import ScoringStage

log = logging.getLogger(__name__)


def expected_samples(env_name: str, env_config: dict[str, Any],
                     trained: Callable[[str], bool] | None = None) -> int:
    """How many samples an episode of the environment makes: one per trained role of a multi-agent
    environment (``trained(role)``; every role without it), one otherwise. Known before an instance
    is built (``MultiAgentEnv.declared_roles``)."""
    cls = lookup(env_name)
    if not (isinstance(cls, type) and issubclass(cls, MultiAgentEnv)):
        return 1
    roles = cls.declared_roles(env_config)
    return max(1, sum(1 for role in roles if trained is None or trained(role)))


def task_stream(env_name: str, env_config: dict[str, Any], split: str = "train") -> Iterator[dict[str, Any]]:
    """The split's tasks, read lazily and read again from the start whenever they run out."""
    env = make(env_name, **env_config)
    while True:
        n = 0
        for task in env.tasks(split):
            n += 1
            yield task
        if n == 0:
            raise ValueError(f"environment {env_name!r} has no tasks in split {split!r}")


class Orchestrator:
    def __init__(self, producer: EpisodeProducer, sink: BufferSink, *, env_name: str,
                 env_config: dict[str, Any] | None = None, group_size: int, max_concurrency: int,
                 run_dir: Path | None = None, max_episodes: int = 0, sync: bool = False, batch_size: int = 0,
                 policy_version: Callable[[], int] | None = None,
                 episode_log: Callable[[dict[str, Any]], Any] | None = None,
                 frontier: TaskFrontier | None = None, scoring: ScoringStage | None = None,
                 samples_per_episode: int | None = None, curriculum: Curriculum | None = None,
                 concurrency: ConcurrencyController | None = None) -> None:
        """``episode_log``: also given each finished episode's summary line (a rollout worker on
        another machine sends them to serve's ``episodes.jsonl``). ``policy_version``: the version
        the engines serve (the sync baseline waits for it to move). ``scoring``: a
        :class:`~agentrl.scoring.stage.ScoringStage` each finished episode goes through before the
        buffer, outside ``max_concurrency`` (an episode being scored holds no agent-loop slot, but
        counts against the buffer's room until its samples are in). ``samples_per_episode``: what an
        episode is expected to make (serve passes one per trained role; default: one per declared
        role); admission counts episodes in flight at the mean that finished ones made, this until
        one has, and the sync baseline's barrier is one batch of samples. ``curriculum``: draws each
        group's task (:mod:`agentrl.rollout.curriculum`) instead of the stream's next one.
        ``concurrency``: its ``limit`` bounds the episodes in flight instead of ``max_concurrency``
        (:mod:`agentrl.rollout.concurrency`)."""
        self.producer, self.sink = producer, sink
        self.env_name, self.env_config = env_name, dict(env_config or {})
        self.group_size = group_size
        self.max_concurrency = max_concurrency
        self.max_episodes = max_episodes
        self.sync, self.batch_size = sync, batch_size
        self.policy_version = policy_version
        self.in_flight = 0  # episodes whose agent loop is running (max_concurrency bounds them)
        self.scoring = scoring
        # Episodes done playing whose samples are not in the buffer yet (being scored, or their put
        # under way): admission counts them, or a slow put lets the rollout start group after group.
        self.landing = 0
        self.counters: dict[str, float] = {"episodes": 0, "failed": 0, "truncated": 0, "samples": 0,
                                           "reward_sum": 0.0, "tool_calls": 0}
        self.failed_by_kind: dict[str, int] = {}
        self._log_path = run_dir / "episodes.jsonl" if run_dir else None
        self._episode_log = episode_log
        self._tasks: set[asyncio.Task] = set()
        self._started = 0
        self._infra_failures = 0  # consecutive episodes that failed at an infrastructure boundary
        self.samples_per_episode = samples_per_episode  # None: expected_samples, at the start of run
        self._made = [0, 0]  # episodes that made samples, and their samples (admission's mean)
        self.frontier = frontier  # needs a sink that is a GroupLedger (serve's own buffer)
        self.curriculum = curriculum
        self.concurrency = concurrency
        self._cursor = 0  # index in the task stream of the next task drawn
        self.resumed = {"groups": 0, "episodes": 0}

    @property
    def started(self) -> int:
        """Episodes started so far (whole groups; what ``max_episodes`` bounds)."""
        return self._started

    @property
    def backing_off(self) -> bool:
        return self._failures_in_a_row > 0

    @property
    def _failures_in_a_row(self) -> int:
        """Episodes in a row lost to an outage: an engine, the transport, a sandbox, or a scorer's
        endpoint."""
        return self._infra_failures + (self.scoring.outage if self.scoring is not None else 0)

    async def run(self) -> None:
        if self.samples_per_episode is None:
            self.samples_per_episode = expected_samples(self.env_name, self.env_config)
        tasks = task_stream(self.env_name, self.env_config)
        if self.frontier is not None:
            self._cursor = max(self.frontier.cursor,
                               self.curriculum.new_drawn if self.curriculum is not None else 0)
            tasks = itertools.islice(tasks, self._cursor, None)  # what earlier runs drew is not drawn again
            await self._resume_open_groups()
        try:
            if self.sync:
                await self._run_sync(tasks)
                return
            while not self.max_episodes or self._started < self.max_episodes:
                # admission counts samples: the episodes in flight, landing and about to start, each
                # at the mean a finished episode made (three for three trained roles)
                made, samples = self._made
                per_episode = samples / made if made else self.samples_per_episode
                expected = math.ceil((self.in_flight + self.landing + self.group_size) * per_episode)
                room = await self.sink.wait_for_room(expected - 1, timeout_s=5.0)
                cap = self.max_concurrency if self.concurrency is None else self.concurrency.limit
                if room <= 0 or self.in_flight + self.group_size > max(cap, self.group_size):
                    await asyncio.sleep(0.05)
                    continue
                if failures := self._failures_in_a_row:
                    # No engine, no judge (every call failing): back off instead of churning out failed
                    # episodes.
                    await asyncio.sleep(min(10.0, 0.1 * 2 ** min(failures, 7)))
                self._start_group(self._draw(tasks))
                await asyncio.sleep(0)  # let the new episodes (and HTTP handlers) run
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self.scoring is not None:
                # its judge's connections, wherever this runs (serve, a Ray worker)
                await self.scoring.close()

    async def _run_sync(self, tasks: Iterator[dict[str, Any]]) -> None:
        if self.policy_version is None:
            raise ValueError("the sync baseline needs policy_version (the version the engines serve)")
        # one batch of samples: a multi-agent episode makes one per trained role, and a barrier of
        # several batches would let the learner train on the rest without waiting (no longer the
        # baseline)
        groups = max(1, self.batch_size // (self.group_size * self.samples_per_episode))
        while not self.max_episodes or self._started < self.max_episodes:
            version = self.policy_version()
            # the barrier: the slowest episode decides
            await asyncio.gather(*(self._start_group(self._draw(tasks)) for _ in range(groups)))
            t0 = time.monotonic()
            while self.policy_version() <= version:  # the learner trains, then the engines reload
                await asyncio.sleep(0.02)
                if time.monotonic() - t0 > 60:
                    log.info("sync rollout: waiting for the learner to publish version %d", version + 1)
                    t0 = time.monotonic()

    def _draw(self, tasks: Iterator[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
        if self.curriculum is not None:
            return self.curriculum.draw(lambda: self._next(tasks))
        return self._next(tasks)

    def _next(self, tasks: Iterator[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
        index, self._cursor = self._cursor, self._cursor + 1
        return index, next(tasks)

    async def _resume_open_groups(self) -> None:
        """Start again the groups an earlier run left open, each with the episodes the buffer lacks."""
        for group_id, (index, task) in list(self.frontier.open.items()):
            stored = await self.sink.group_progress(group_id)
            if self.curriculum is not None:
                self.curriculum.stored(group_id, stored)
            missing = self.group_size - stored
            if missing <= 0:
                self.frontier.finish(group_id)
                continue
            self.resumed["groups"] += 1
            self.resumed["episodes"] += missing
            log.info("resuming group %s (task %d): %d of %d episode(s) to play", group_id, index, missing,
                     self.group_size)
            self._start_group((index, task), group_id, missing)

    def _start_group(self, drawn: tuple[int, dict[str, Any]], group_id: str | None = None,
                     members: int | None = None) -> asyncio.Task:
        index, task = drawn
        members = self.group_size if members is None else members
        if group_id is None:
            group_id = f"{task.get('id', 'task')}-{uuid.uuid4().hex[:8]}"
            if self.frontier is not None:
                self.frontier.start(group_id, index, task)
        if self.curriculum is not None:
            self.curriculum.started(group_id, index, task)
        # Count the group as in flight before it runs: admission must see it at once.
        self.in_flight += members
        self._started += members
        t = asyncio.create_task(self._group(task, group_id, members), name=f"group-{group_id}")
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _group(self, task: dict[str, Any], group_id: str, members: int) -> None:
        playing = [members]  # the group's episodes still counted in flight (each takes itself off)
        try:
            # return_exceptions: a cancelled group waits for every episode (each finishes delivering
            # what it has), instead of ending at the first one that is done
            for outcome in await asyncio.gather(*(self._episode(task, group_id, playing, members)
                                                  for _ in range(members)),
                                                return_exceptions=True):
                if isinstance(outcome, BaseException):
                    raise outcome
            if self.frontier is not None:  # only once all its episodes are in the buffer
                self.frontier.finish(group_id)
        finally:
            self.in_flight -= playing[0]  # episodes cancelled before they began

    async def _episode(self, task: dict[str, Any], group_id: str, playing: list[int], members: int) -> None:
        try:
            ep = await self.producer(task, group_id)
        finally:  # its agent loop is done: the slot is free, whatever scoring takes
            self.in_flight -= 1
            playing[0] -= 1
        self.landing += 1
        try:
            if self.scoring is not None:
                await self.scoring(task, ep, members)  # a group judge waits for the group's members
            # Once its samples go to the sink, the episode is logged with them: a stop that cancels
            # the put lets both finish first, so the episode log and the buffer agree.
            await to_the_end(self._deliver(ep))
        finally:
            self.landing -= 1

    async def _deliver(self, ep: EpisodeResult) -> None:
        await self.sink.put(ep.samples)
        if self.curriculum is not None:
            self.curriculum.finished_episode(ep.group_id, is_success(ep), ep.reward)
        self._account(ep)

    def _account(self, ep: EpisodeResult) -> None:
        c = self.counters
        c["episodes"] += 1
        c["failed"] += ep.error is not None
        if ep.error_kind is not None:
            self.failed_by_kind[ep.error_kind] = self.failed_by_kind.get(ep.error_kind, 0) + 1
        if ep.error_kind in INFRASTRUCTURE:
            self._infra_failures += 1
        elif ep.error is None:
            self._infra_failures = 0
        c["truncated"] += ep.truncated
        c["samples"] += len(ep.samples)
        if ep.samples:
            self._made[0] += 1
            self._made[1] += len(ep.samples)
        c["reward_sum"] += ep.reward
        c["tool_calls"] += ep.info.get("tool_calls", 0)
        line = {"time": time.time(), **ep.summary()}
        if self._log_path is not None:  # a full disk skips the line whole (its samples are in the buffer)
            append_line(self._log_path, json.dumps(line))
        if self._episode_log is not None:
            self._episode_log(line)

    def status(self) -> dict[str, Any]:
        out = {"in_flight": self.in_flight, **self.counters, "failed_by_kind": dict(self.failed_by_kind),
               "backing_off": self.backing_off}
        if self.scoring is not None:
            out["scoring"] = self.scoring.status()
        if self.curriculum is not None:
            out["curriculum"] = self.curriculum.status()
        if self.concurrency is not None:
            out["concurrency"] = self.concurrency.status()
        if self.frontier is not None:
            out["frontier"] = {
                "cursor": self._cursor,
                "open_groups": len(self.frontier.open),
                "resumed": dict(self.resumed),
            }
        return out
